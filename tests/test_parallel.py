"""Tier 2: concurrent requests sharing each llama_decode (load(parallel=N), real SmolLM2-135M): each request's
output is what it would be alone, its KV cache is its own, sampled output keeps the target's distribution, slots
are taken and given back, and exact mode is refused with the reason."""
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from scipy.stats import chisquare

import localspec
from localspec.core.batch import Batcher
from localspec.core.model import Model, ModelConfig, ModelError, Seq
from localspec.core.sampling import SamplingParams, dist

from gguf_edit import shadowed

TASKS = ["returns the n-th Fibonacci number", "reverses a string", "sums a list of numbers",
         "checks whether a number is prime"]
TOPICS = ["a lighthouse keeper", "a robot who learns to paint", "the history of bread", "a fox in winter"]


@pytest.fixture(scope="module")
def par(smol_path):
    with localspec.load(target=smol_path, draft=smol_path, n_ctx=512, parallel=4) as llm:
        yield llm


@pytest.fixture(scope="module")
def solo(smol_path):
    """The same settings, one request at a time."""
    with localspec.load(target=smol_path, draft=smol_path, n_ctx=512) as llm:
        yield llm


def together(jobs):
    """Run each callable in its own thread, all at once; their results in order (an error is raised)."""
    out, errors = [None] * len(jobs), []

    def run(i, job):
        try:
            out[i] = job()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return out


def test_greedy_requests_decoded_together_give_their_text_alone(par, solo):
    """Four requests at once, with every drafter: each gives the tokens it gives alone, or parts from them only
    where the two best tokens were nearly tied (outside exact mode a token's logits move with what shares its
    batch, by ~0.1-0.4 on this model; which tokens share a decode varies from run to run, so where one parts
    varies too)."""
    drafters = ["auto", "ngram", "none", "model"]
    prompts = [par.chat_tokens([{"role": "user", "content": f"Write a Python function that {t}."}]) for t in TASKS]
    alone = [solo.generate(p, max_tokens=24, temperature=0, drafter=d, logprobs=5)
             for p, d in zip(prompts, drafters)]
    sizes = []
    run_jobs = par.target._run_jobs
    par.target._run_jobs = lambda jobs: (sizes.append(len(jobs)), run_jobs(jobs))
    try:
        got = together([lambda p=p, d=d: par.generate(p, max_tokens=24, temperature=0, drafter=d)
                        for p, d in zip(prompts, drafters)])
    finally:
        del par.target._run_jobs
    assert max(sizes) == 4  # they did share decodes
    for a, b in zip(alone, got):
        assert_as_alone(a, b)


def assert_as_alone(a, b):
    """b gives a's tokens (a: alone, with logprobs), or parts from them where a's two best were nearly tied."""
    at = next((i for i, (x, y) in enumerate(zip(a.tokens, b.tokens)) if x != y), None)
    if at is None:
        assert a.tokens == b.tokens
        return
    lp, top = a.logprobs[at]
    tops = dict(top)
    assert b.tokens[at] in tops and lp - tops[b.tokens[at]] < 0.5, (at, a.tokens[at], b.tokens[at], top)


def test_each_requests_own_options_hold_beside_others(par, solo):
    """Four requests at once, each with options of its own (a JSON schema; a prediction; a stop string; logprobs),
    give what each gives alone; the two drafting with the draft model share its decodes too."""
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}}, "required": ["name"],
              "additionalProperties": False}
    ask = [par.chat_tokens([{"role": "user", "content": c}]) for c in
           ("Name a cat. Answer in JSON.", f"Write a Python function that {TASKS[1]}.",
            f"Write a Python function that {TASKS[2]}.", f"Write a Python function that {TASKS[3]}.")]
    plain = solo.generate(ask[1], max_tokens=40, temperature=0, drafter="none")
    options = [dict(json_schema=schema, drafter="auto"), dict(prediction=plain.text, drafter="auto"),
               dict(stop=["```\n"], drafter="model"), dict(logprobs=2, drafter="model")]
    alone = [solo.generate(p, max_tokens=40, temperature=0, **(o | {"logprobs": 5})) for p, o in zip(ask, options)]
    target_sizes, draft_sizes = [], []
    spies = [(par.target, target_sizes), (par.draft, draft_sizes)]
    for model, sizes in spies:
        model._run_jobs = lambda jobs, run=model._run_jobs, sizes=sizes: (sizes.append(len(jobs)), run(jobs))[1]
    try:
        got = together([lambda p=p, o=o: par.generate(p, max_tokens=40, temperature=0, **o)
                        for p, o in zip(ask, options)])
    finally:
        for model, _ in spies:
            del model._run_jobs
    assert max(target_sizes) >= 2 and max(draft_sizes) >= 2  # both models' decodes were shared (the short ones end
    # soon: test_greedy_requests_decoded_together_give_their_text_alone shows four in one)
    for a, b in zip(alone, got):
        assert_as_alone(a, b)
    assert json.loads(got[0].text)["name"] and got[0].finish_reason == "stop"
    assert got[1].stats.drafted > 0  # the prediction was drafted from
    assert got[2].finish_reason == "stop" and got[2].text.count("```") == 1  # ends before the closing fence
    assert len(got[3].logprobs) == len(got[3].tokens) and all(len(top) == 2 for _, top in got[3].logprobs)


def test_requests_of_one_scope_decoded_together_draft_from_its_history(par, monkeypatch):
    """Two requests of one scope at once, each asked before: both draft their answer from the scope's history
    and teach its statistics from their own threads (history.Learned, under the scope's lock), and each gives
    its text as before."""
    from localspec.core.history import History

    monkeypatch.setattr(par, "history", History(1))
    prompts = [par.chat_tokens([{"role": "user", "content": f"Write a Python function that {t}."}])
               for t in TASKS[:2]]
    first = [par.generate(p, max_tokens=32, temperature=0, drafter="none", logprobs=5) for p in prompts]
    again = together([lambda p=p: par.generate(p, max_tokens=32, temperature=0, drafter="auto") for p in prompts])
    for a, b in zip(first, again):
        assert_as_alone(a, b)
        assert b.stats.drafted_history > 0
    assert par.history.cache("").learned.stats


def test_a_requests_cache_is_its_own(smol_path):
    """Two prompts that differ in their first token, decoded in one batch: each one's logit rows are its own
    prompt's (as decoded alone), never a mix with the other's cells."""
    alone = Model(smol_path, ModelConfig(n_ctx=256))
    m = Model(smol_path, ModelConfig(n_ctx=256, n_seq=2))
    m.batcher = Batcher()
    try:
        text = " keeper climbed the stairs of the lighthouse every night to light the lamp for the ships"
        a, b = alone.tokenize("The" + text), alone.tokenize("A" + text)
        assert len(a) == len(b) and sum(x != y for x, y in zip(a, b)) == 1

        def rows(seq, tokens):
            seq.sync(tokens[:8])
            return np.concatenate([np.array(seq.decode(tokens[i:i + 4], logits="all"))
                                   for i in range(8, len(tokens) - 3, 4)])

        def member(seq, tokens):
            with m.batcher.holding(seq.id), m.batcher:
                return rows(seq, tokens)

        ra, rb = rows(alone, a), rows(alone, b)
        alone.truncate(0)
        ca, cb = together([lambda: member(m.seqs[1], a), lambda: member(m.seqs[2], b)])
        apart = np.abs(ra - rb).max()
        assert apart > 1.0  # the one token matters to every later row
        # outside exact mode what shares a decode moves logits a little (up to ~0.7 here): far less than a leak
        assert np.abs(ca - ra).max() < 0.25 * apart and np.abs(cb - rb).max() < 0.25 * apart
        assert m.seqs[1].pos_max() == len(m.seqs[1].tokens) - 1 and m.seqs[1].tokens[:len(ca)] == a[:len(ca)]
    finally:
        alone.close()
        m.close()


def test_a_common_head_is_prefilled_once_and_stays_each_requests_own_after(smol_path):
    """Requests whose prompts start alike (one system prompt) share the cells of that head: one that comes later
    borrows them (llama_memory_seq_cp), one asked for together borrows them when its chunk runs; its logits are
    its own prompt's, what follows the head is its own, and it keeps the head when the other request leaves."""
    alone = Model(smol_path, ModelConfig(n_ctx=256))
    m = Model(smol_path, ModelConfig(n_ctx=256, n_seq=3))
    m.batcher = Batcher()
    try:
        head = alone.tokenize("You are a careful assistant. Answer in one short sentence, then stop.\n")
        a = head + alone.tokenize("Q: why is the sky blue?\nA:", add_special=False)
        b = head + alone.tokenize("Q: why do cats purr?\nA:", add_special=False)
        want = np.array(alone.sync(b, logits=True)[1])
        s1, s2, s3 = m.seqs[1:]
        decoded = []
        run_jobs = m._run_jobs
        m._run_jobs = lambda jobs: (run_jobs(jobs), decoded.append(sum(len(j.tokens) for j in jobs)))

        def prefill(seq, tokens):
            with m.batcher.holding(seq.id), m.batcher:
                return seq.sync(tokens, logits=True, cancel=lambda: False)

        prefill(s1, a)
        reused, row = prefill(s2, b)  # later: borrowed at once
        common = next(i for i, (x, y) in enumerate(zip(a, b)) if x != y)
        assert reused == common == s2.borrowed and sum(decoded[-1:]) == len(b) - common
        assert np.abs(np.array(row) - want).max() < 0.5  # its own prompt's logits (a batch moves them a little)
        s1.truncate(0)  # the lender leaves: the borrower's head stays
        assert s2.pos_max() == len(b) - 1
        assert np.abs(np.array(s2.decode([b[-1]], logits="last")) - np.array(alone.decode([b[-1]]))).max() < 0.5
        s2.truncate(0)
        # asked for together: whichever runs second borrows what the first prefilled meanwhile
        decoded.clear()
        together([lambda: prefill(s1, a), lambda: prefill(s3, b)])
        assert s1.borrowed + s3.borrowed >= common and sum(decoded) == len(a) + len(b) - common
        assert s1.tokens == a and s3.tokens == b
        # another scope (another API key) borrows nothing: one key's prompts never make another's faster
        s3.truncate(0)
        s3.scope, before = "key-b", s3.borrowed
        assert prefill(s3, b)[0] == 0 and s3.borrowed == before
    finally:
        alone.close()
        m.close()


@pytest.mark.slow  # 15 s: in the slow tier, which CI runs, to keep the default run within 8 minutes
def test_sampled_output_beside_three_other_requests_has_the_targets_distribution(smol_path):
    """Rejection sampling for a request decoded beside three others: its first token, drafted by a draft whose q
    differs from the target's p (the shadowed target), is distributed as p (chi-square)."""
    params = dict(temperature=1.0, top_k=3, top_p=1.0, min_p=0.0)
    with localspec.load(target=shadowed(smol_path), draft=smol_path, n_ctx=256, parallel=4) as llm:
        prompt = llm.tokenize("The old lighthouse keeper walked down to")
        p = dist(np.array(llm.target.sync(prompt, logits=True)[1][0]), SamplingParams(**params))
        llm.target.truncate(0)
        done = threading.Event()
        counts: dict[int, int] = {}
        rejected = [0]

        def sample():
            try:
                for seed in range(120):
                    r = llm.generate(prompt, max_tokens=2, seed=seed, drafter="model", accept="rejection", k=1,
                                     p_min=0.0, **params)
                    counts[r.tokens[0]] = counts.get(r.tokens[0], 0) + 1
                    rejected[0] += r.stats.drafted - r.stats.accepted
            finally:
                done.set()

        def beside(topic):
            def run():
                n = 0
                while not done.is_set():
                    llm.generate(f"A story about {topic}:", max_tokens=4, drafter="model", temperature=0.8, seed=n)
                    n += 1
                return n
            return run

        sizes = []
        run_jobs = llm.target._run_jobs
        llm.target._run_jobs = lambda jobs: (sizes.append(len(jobs)), run_jobs(jobs))[1]
        try:
            others = together([sample, *(beside(t) for t in TOPICS[1:])])[1:]
        finally:
            del llm.target._run_jobs
    assert min(others) > 0 and rejected[0] > 0 and max(sizes) >= 2  # decoded beside others
    assert set(counts) <= set(p.ids.tolist())
    obs = np.array([counts.get(int(t), 0) for t in p.ids])
    expected = p.p * obs.sum()
    big = expected >= 5  # chi-square wants 5 or more expected per cell: the rest pooled
    obs_c = np.append(obs[big], obs[~big].sum())
    exp_c = np.append(expected[big], expected[~big].sum())
    if exp_c[-1] == 0:
        obs_c, exp_c = obs_c[:-1], exp_c[:-1]
    assert chisquare(obs_c, exp_c).pvalue > 1e-3, (obs_c, exp_c.round(1))


@pytest.mark.parametrize("engine", ["par", "solo"])
def test_a_cache_another_scope_used_is_emptied_first(engine, request):
    """The server's scopes (one per API key) keep to their own cached prompts, as their histories do: a request
    reuses the prompt its own scope left in a slot (or in the one sequence of parallel 1), never another
    scope's."""
    llm = request.getfixturevalue(engine)
    prompt = llm.chat_tokens([{"role": "user", "content": "Name three colours."}])
    llm.generate(prompt, max_tokens=2, temperature=0, drafter="none", scope="key-a")
    again = llm.generate(prompt, max_tokens=2, temperature=0, drafter="none", scope="key-a")
    other = llm.generate(prompt, max_tokens=2, temperature=0, drafter="none", scope="key-b")
    assert again.stats.prompt_reused > 0 and other.stats.prompt_reused == 0


def test_slots_are_taken_and_given_back(par):
    """A stream holds a slot from its first token to its end; a thread holding every slot is told so instead of
    waiting forever; another thread's stream waits, counted (auto prices drafts by it: costs.Shared), and a slot
    freed is its."""
    streams = [par.stream(f"{i}, {i + 1}, {i + 2},", max_tokens=8, temperature=0, drafter="none") for i in range(4)]
    reading = [iter(s) for s in streams]
    for it in reading:
        next(it)
    assert par._free == []
    fifth = par.stream("5, 6, 7,", max_tokens=8, temperature=0, drafter="none")
    with pytest.raises(localspec.RequestError, match="all 4 parallel slots are held by streams this thread"):
        list(fifth)
    with ThreadPoolExecutor(1) as pool:
        other = pool.submit(par.generate, "5, 6, 7,", max_tokens=8, temperature=0, drafter="none")
        deadline = time.monotonic() + 30
        while par._waiting < 1:
            assert time.monotonic() < deadline and not other.done(), "the other thread's stream did not wait"
            time.sleep(0.01)
        streams[0].close()
        assert len(other.result(timeout=60).tokens) == 8 and par._waiting == 0
    for it in reading[1:]:
        list(it)
    assert sorted(par._free) == [1, 2, 3, 4]


def test_exact_mode_is_refused_with_parallel_requests(smol_path):
    with pytest.raises(ModelError, match="exact mode cannot be kept with parallel requests"):
        localspec.load(target=smol_path, n_ctx=256, parallel=2, exact=True)
    with pytest.raises(ModelError, match="parallel must be 1 to 64"):
        localspec.load(target=smol_path, n_ctx=256, parallel=0)


@pytest.mark.parametrize("chosen", [1, 2])
def test_parallel_auto_loads_as_many_slots_as_the_calibration_says(smol_path, monkeypatch, chosen):
    """parallel='auto' measures one request's costs first and keeps that engine where more would not pay; in
    exact mode it is 1 whatever the costs."""
    from localspec.core import costs as costs_module
    from localspec.core.engine import Engine

    monkeypatch.setattr(Engine, "calibration", lambda self: _costs((10, 12, 16, 30, 60)))
    monkeypatch.setattr(costs_module, "parallel_for", lambda c: chosen)
    with localspec.load(target=smol_path, n_ctx=256, parallel="auto") as llm:
        assert llm.parallel == chosen and (llm._batcher is None) == (chosen == 1)
        assert llm.generate("1, 2, 3,", max_tokens=4, temperature=0).tokens
    with localspec.load(target=smol_path, n_ctx=256, parallel="auto", exact=True) as llm:
        assert llm.parallel == 1


def test_the_batch_surface_is_measured_for_the_sequences_the_target_holds(par):
    """measure_batch: for 2 and 4 sequences (what a 4-slot target holds), a decode of theirs against one
    sequence's of as many tokens; every sequence left empty."""
    from localspec.core.costs import Costs, measure_batch

    base = Costs((1, 2, 4), (32,), ((0.01, 0.012, 0.015),), None, 0.0)
    got = measure_batch(par.target, base, reps=1)
    assert [b for b, _ in got.batch] == [2, 4] and all(0.3 < r < 4 for _, r in got.batch), got.batch
    assert got.verify == base.verify and all(not s.tokens for s in par.target.seqs)


def test_the_batch_surface_prices_a_decode_by_its_sequences():
    """Costs.batch_cost: a decode of b sequences costs the measured factor over one sequence's of as many
    tokens (interpolated between measured b, the widest one's past it); Shared prices a request's round with it."""
    from dataclasses import replace

    from localspec.core.costs import Shared

    c = replace(_costs((40, 60, 100, 180, 340)), batch=((2, 1.1), (4, 1.2)))
    assert c.batch_cost(4, 256, 1) == pytest.approx(c.verify_cost(4))
    assert c.batch_cost(4, 256, 2) == pytest.approx(1.1 * c.verify_cost(4))
    assert c.batch_cost(6, 256, 3) == pytest.approx(1.15 * c.verify_cost(6))
    assert c.batch_cost(8, 256, 8) == pytest.approx(1.2 * c.verify_cost(8))
    queued = Shared(c, lambda: (3, 4), lambda: 1)
    assert queued.verify_cost(1) == pytest.approx(1.2 * c.verify_cost(4) / 4)
    assert queued.verify_cost(5) - queued.verify_cost(1) == pytest.approx(1.2 * (c.verify_cost(8) - c.verify_cost(4)))
    burst = Shared(c, lambda: (3, 4))
    assert burst.verify_cost(1) == pytest.approx(1.2 * c.verify_cost(4) - 1.15 * c.verify_cost(3))


def _costs(verify_ms):
    from localspec.core.costs import Costs

    sizes = (1, 2, 4, 8, 16)
    return Costs(sizes, (256,), (tuple(v / 1e3 for v in verify_ms),), None, 0.0)


def test_parallel_auto_is_one_where_a_wider_decode_costs_in_proportion():
    from localspec.core.costs import parallel_for

    assert parallel_for(_costs((37, 72, 140, 280, 560))) == 1  # a small CPU: 2 tokens cost 1.95 x 1
    assert parallel_for(_costs((10, 10.5, 11, 12, 14))) == 8  # a GPU: width is nearly free
    assert parallel_for(_costs((10, 12, 16, 30, 60))) == 4  # 8 gains less than 10% over 4


def test_a_draft_in_a_batch_is_priced_as_its_share_of_the_round():
    """Alone, a verify of n costs T(n). Beside others' w tokens in b sequences, each draft token adds what it adds
    to the whole round, and the request's own token is worth what ending sooner gains: with requests waiting for
    a slot, the batch's rate (T(w + 1) / b); with none, what its sequence adds to the rounds (T(w + 1) - T(w))."""
    from localspec.core.costs import Costs, Shared

    c = _costs((40, 60, 100, 180, 340))
    assert Shared(c, lambda: (0, 1)).verify_cost(4) == pytest.approx(c.verify_cost(4))
    queued = Shared(c, lambda: (3, 4), lambda: 2)  # three others, one token each; two requests wait
    assert queued.verify_cost(1) == pytest.approx(c.verify_cost(4) / 4)
    assert queued.verify_cost(5) - queued.verify_cost(1) == pytest.approx(c.verify_cost(8) - c.verify_cost(4))
    assert np.allclose(queued.verify_cost(np.array([1, 5])), [queued.verify_cost(1), queued.verify_cost(5)])
    burst = Shared(c, lambda: (3, 4))  # nobody waits
    assert burst.verify_cost(1) == pytest.approx(c.verify_cost(4) - c.verify_cost(3))
    assert burst.verify_cost(5) - burst.verify_cost(1) == pytest.approx(c.verify_cost(8) - c.verify_cost(4))
    # a dip (a wider decode cheaper, as CPU kernels take rows in blocks) is priced at its envelope beside others:
    # every request deciding at once would chase it; alone it is taken
    dip = Costs((1, 2, 4, 8, 12, 16), (256,), ((0.04, 0.06, 0.1, 0.18, 0.3, 0.25),), None, 0.0)
    assert Shared(dip, lambda: (3, 4), lambda: 1).verify_cost(13) == pytest.approx(0.3 - 0.1 + 0.1 / 4)
    assert Shared(dip, lambda: (0, 1)).verify_cost(16) == pytest.approx(0.25)
    # where a sequence adds nothing to the round (the envelope flat), its token is nearly free: only drafts that
    # cost nothing pay
    flat = Costs((1, 2, 3, 4, 5), (256,), ((0.06, 0.1, 0.125, 0.122, 0.157),), None, 0.0)
    assert Shared(flat, lambda: (3, 4)).verify_cost(1) == pytest.approx(Shared.FREE)


def test_auto_in_a_burst_drafts_only_what_pays_the_batch():
    """4 requests, none waiting, on a 2-vCPU Xeon's curve (a 4-token decode no dearer than a 3-token one): a
    request's draft of up to 4 tokens that nearly always hold widens every round, and the request ending sooner
    saves the others nothing; with requests waiting for its slot it pays (ending sooner lets one in)."""
    from localspec.core.auto import _best
    from localspec.core.costs import Costs, Shared

    xeon = Costs((1, 2, 3, 4, 5, 6, 7, 8), (256,), ((0.060, 0.101, 0.125, 0.122, 0.157, 0.181, 0.202, 0.218),),
                 None, 0.0)
    for waiting, pays in ((0, False), (2, True)):
        shared = Shared(xeon, lambda: (3, 4), lambda w=waiting: w)
        speed = _best(np.full(4, 0.95), shared.verify_cost)[1]  # the best of 1..4 drafted, 19 in 20 holding
        assert bool(speed > 1 / shared.verify_cost(1)) is pays


class _Recorder:
    """A stand-in model for the Batcher: records which sequences each decode joined."""

    n_batch = 64

    def __init__(self):
        self.decodes = []

    def _run_jobs(self, jobs):
        time.sleep(0.02)  # as long as a small model's decode
        self.decodes.append(sorted(j.seq.id for j in jobs))
        for j in jobs:
            j.rows = np.full((len(j.tokens), 2), j.seq.id, dtype=np.float32)


def test_a_sequence_offers_what_it_says_and_nothing_more():
    """A Seq forwarded every attribute to its model, so a typo (seq.n_vocb) reached the model silently; it offers
    what the loop and the drafters read of it, and anything else of the model is asked of seq.model."""
    from conftest import FakeModel

    model = FakeModel({}, 10, eog=3)
    seq = Seq(model, 1, 64)
    assert seq.n_vocab == 10 and seq.is_eog(3) and not seq.is_eog(4) and seq.check_open() is None
    for name in ("n_vocb", "piece", "tokenize", "n_batch", "cfg"):
        with pytest.raises(AttributeError):
            getattr(seq, name)


class _Seq:
    def __init__(self, i, model):
        self.id, self.model = i, model


def test_the_batcher_waits_for_every_member_in_a_round_and_no_one_else():
    model, b = _Recorder(), Batcher()
    seqs = [_Seq(i, model) for i in range(3)]
    gate = threading.Barrier(3, timeout=30)

    def request(seq, rounds):
        out = []
        with b.holding(seq.id):
            gate.wait()
            for i in range(rounds):
                time.sleep(0.003 * seq.id * (i == 0))  # arriving apart: the first decode waits for the others
                with b:
                    out.append(float(b.decode(seq, [1, 2], "all")[0, 0]))
        return out

    got = together([lambda s=s: request(s, 3) for s in seqs])
    assert got == [[0.0] * 3, [1.0] * 3, [2.0] * 3]  # each its own rows
    assert model.decodes == [[0, 1, 2]] * 3  # one decode per round, all three in it
    assert b.others(seqs[0]) == (4, 3)
    # a request that holds its slot but is away (its reader is slow) delays the others only a little
    with b.holding(0), b.holding(1):
        t = time.perf_counter()
        assert b.decode(seqs[1], [5], "last")[0, 0] == 1.0
        assert time.perf_counter() - t < 0.5
    assert model.decodes[-1] == [1]


def test_close_lets_the_decode_thread_go(smol_path):
    llm = localspec.load(target=smol_path, n_ctx=256, parallel=2)
    assert llm.generate("1, 2, 3,", max_tokens=4, temperature=0, drafter="none").tokens
    scheduler = llm._batcher._scheduler
    assert scheduler.is_alive()
    llm.close()
    assert not scheduler.is_alive()
    with pytest.raises(ModelError, match="closed"):
        llm.generate("1, 2, 3,", max_tokens=4)


def test_prompts_are_prefilled_one_at_a_time_the_shortest_first():
    """Requests that arrive together get their first tokens in turn (a short prompt soon), not all at the end:
    each decode holds one prefill chunk per model, the shortest prefill's, beside the other requests' rounds;
    a prefill passed over counts as AGING tokens shorter each time, so a long one is not put off for ever."""
    from localspec.core.batch import Job

    model, b = _Recorder(), Batcher()
    long, short, running, other = (_Seq(i, model) for i in range(4))
    b._jobs = [Job(long, [0] * 32, "none", prefill=600), Job(short, [0] * 32, "none", prefill=100),
               Job(running, [1, 2, 3], "all")]
    assert [j.seq for j in b._take()[model]] == [short, running]
    assert [j.seq for j in b._jobs] == [long]
    # new short prefills keep coming: the long one waits, then runs once it has waited its length in chunks
    turns = []
    for _ in range(8):
        b._jobs.append(Job(other, [0] * 32, "none", prefill=64))
        turns.append([j.seq for j in b._take()[model]])
        b._jobs = [j for j in b._jobs if j.seq is long]
    assert turns.index([long]) == 4  # 600 - 5 x 128 < 64: after five short ones
    assert all(t == [other] for i, t in enumerate(turns) if i != 4)
    # the other models' jobs are taken beside (one prefill per model)
    draft = _Recorder()
    b._jobs = [Job(_Seq(0, draft), [0] * 32, "none", prefill=64), Job(short, [0] * 32, "none", prefill=36)]
    assert {m: len(js) for m, js in b._take().items()} == {draft: 1, model: 1}


def test_prompts_sent_together_are_prefilled_shortest_first_whichever_arrives_first():
    """An idle batcher waits a moment (GATHER) when a prompt arrives: a shorter one arriving a few milliseconds
    later (HTTP, tokenizing) goes first. Measured on the Xeon, four prompts sent together reached it within
    3 ms; the one that came first had been prefilled first (the worst client's first token 3.6x alone where
    the shortest-first order gives 2.4x)."""
    model, b = _Recorder(), Batcher()
    long, short = _Seq(0, model), _Seq(1, model)

    def request(seq, n, delay):
        time.sleep(delay)
        b.decode(seq, [0] * 8, "none", prefill=n)

    together([lambda: request(long, 300, 0.0), lambda: request(short, 40, 0.003)])
    assert model.decodes == [[1], [0]]
    # a prompt alone waits at most GATHER[1], and a fiftieth of its chunk's time as the latest prefill took
    assert b._per_token == pytest.approx(0.02 / 8, rel=0.5)
    t = time.perf_counter()
    b.decode(long, [0] * 8, "none", prefill=8)
    assert time.perf_counter() - t < 0.02 + Batcher.GATHER[1] + 0.05


def test_a_prefill_chunk_does_not_make_a_round_look_dear():
    """auto prices a round as its share of the decode it shares (Shared): a prompt's 128-token chunk beside one
    request's round had made plain decoding look 65 tokens dear to it, and a 16-token draft nearly free."""
    from localspec.core.batch import Job

    model, b = _Recorder(), Batcher()
    arriving, answering, other = (_Seq(i, model) for i in range(3))
    b._run({model: [Job(arriving, [0] * 32, "none", prefill=200), Job(answering, [1], "all")]})
    assert b.others(answering) == (0, 1)  # priced as alone
    b._run({model: [Job(arriving, [0] * 32, "none", prefill=168), Job(answering, [1, 2], "all"),
                    Job(other, [3], "all")]})
    assert b.others(answering) == (1, 2) and b.others(other) == (2, 2)


@pytest.fixture
def prefill_chunks(monkeypatch):
    """The sizes of the chunks the batcher is given as a prompt's prefill, in order."""
    sizes = []
    real = Batcher.decode

    def spy(self, seq, tokens, logits, prefill=0, cancel=None):
        if prefill:
            sizes.append(len(tokens))
        return real(self, seq, tokens, logits, prefill, cancel)

    monkeypatch.setattr(Batcher, "decode", spy)
    return sizes


def test_a_gpu_prefill_beside_other_requests_leaves_room_for_their_rounds(smol_path, prefill_chunks):
    """Offloaded to a GPU a prompt is prefilled in whole batches (n_batch tokens, one decode each); beside other
    requests in half batches, so their rounds fit the same decode instead of waiting out the whole prefill
    (shortest-prefill-first puts a prefill chunk first in each decode). On this CPU-only build n_gpu_layers
    reaches llama.cpp and offloads nothing; the chunking is what is checked."""
    sizes = prefill_chunks
    prompt = "one two three four five six seven eight nine ten " * 40
    with localspec.load(target=smol_path, n_ctx=512, parallel=2, n_gpu_layers=99) as llm:
        sizes.clear()  # (what measuring the costs at load prefilled, the first time)
        n = len(llm.tokenize(prompt))
        assert 300 < n < 500
        llm.generate(prompt, max_tokens=2, temperature=0, drafter="none", cancel=lambda: False)
        assert llm.target.n_batch == 512 and sizes == [256, n - 1 - 256]


def test_a_requests_first_round_waits_for_no_prefill_chunk():
    """Right after its prefill a request's first round goes into a decode of rounds only: its first token does
    not wait out the next prompt's chunk (~1.2 s for 128 tokens of the 1.5B model on 2 cores)."""
    from localspec.core.batch import Job

    model, b = _Recorder(), Batcher()
    new, waiting, running = (_Seq(i, model) for i in range(3))
    for seq, tokens, prefill in ((new, [0] * 16, 16), (waiting, [0] * 32, 300)):
        b._jobs = [Job(seq, tokens, "none", prefill)]
        b._run(b._take())
        b._prefilled.add(seq)  # as decode() marks it
    b._jobs = [Job(waiting, [0] * 32, "none", prefill=268), Job(running, [1], "all"),
               Job(new, [1], "all", first=True)]
    assert [j.seq for j in b._take()[model]] == [running, new]
    assert [j.seq for j in b._take()[model]] == [waiting]  # then the prefill goes on, not counted as passed
    assert b._passed == {}


def test_only_a_prompts_prefill_is_scheduled_as_one(smol_path, prefill_chunks):
    """The draft model catching its cache up by a token or two each round is part of that round: scheduled as
    a prefill (one per decode, shortest first) it would have spread the requests' catch-ups over several
    decodes."""
    prompt = "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n\nprint(fib(10))\n" * 4
    with localspec.load(target=smol_path, draft=smol_path, n_ctx=512, parallel=2) as llm:
        prefill_chunks.clear()  # (what measuring the costs at load prefilled, the first time)
        n = len(llm.tokenize(prompt))
        r = llm.generate(prompt, max_tokens=12, temperature=0, drafter="model", k=3, cancel=lambda: False)
        assert r.stats.drafting_rounds > 1
    assert sum(prefill_chunks) == 2 * (n - 1)  # the prompt, in the target and in the draft model
