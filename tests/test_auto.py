"""The auto drafter's policy and the calibration, with scripted costs and acceptance (no timing asserted)."""
import json
from dataclasses import replace

import numpy as np
import pytest

from localspec.core.costs import Costs, measure, plan
from localspec.store.calibration import load_or_measure
from localspec.core.auto import CAP, NEWLINE, PUNCT, WORD, AutoDrafter, KindOdds, token_kinds
from localspec.core.tuning import TUNING
from localspec.core.drafters import Draft, NgramDrafter

SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 17, 24, 33)


def costs(verify, draft, sample_row=0.0):
    """Costs measured at one depth."""
    return Costs(SIZES, (256,), (tuple(verify),), (draft,), sample_row)


# This machine's kind of CPU (../shared/MODELS.md): verifying 5 tokens costs ~3 single decodes.
CPU = costs(np.interp(SIZES, [1, 2, 4, 6, 8, 16, 32], [29, 38, 63, 90, 106, 119, 211]) / 1e3, 0.016)
# The other kind of CPU of the same machine kind (MODELS.md): decoding slower, verifying 5 tokens ~2 decodes.
INTEL = costs(np.interp(SIZES, [1, 2, 3, 5, 8, 17, 33], [68, 100, 130, 141, 208, 308, 493]) / 1e3, 0.0315)
# This host (a 2-vCPU AMD EPYC Zen 4, its calibration before FORMAT 8): each token of a verify costs most of a decode.
ZEN4 = costs(np.array([37.2, 65.8, 98.5, 124.4, 150.8, 175.8, 271.6, 326.5, 326.5, 375.6, 375.6, 484.7, 552.2]) / 1e3,
             0.0253)
# Verification that costs n decodes for n tokens: speculation can never pay.
LINEAR = costs([0.029 * n for n in SIZES], 0.016)
# A GPU: a 33-token verify costs about one decode, and the draft is cheap.
GPU = costs([0.010 + 0.0002 * n for n in SIZES], 0.002)


def auto(c, model=None, **kw):
    return AutoDrafter(c, NgramDrafter(n_min=1), model, **kw)

REPEATING = list(range(100, 140)) * 3  # a long stretch of context that repeats itself


def play(a, ctx, text, n=16):
    """One round as the engine plays it, where the target writes `text`: auto's draft, its agreed prefix and the
    target's next token appended."""
    truth = text[len(ctx):]
    d = a.propose(ctx, min(n, len(truth) - 1))
    m = next((i for i, (x, y) in enumerate(zip(d.tokens, truth)) if x != y), len(d.tokens))
    return ctx + truth[:m + 1]


def confident(a, guesses=100):
    """An auto whose n-gram statistics have seen `guesses` guesses of 16 tokens, all accepted."""
    for s in a.ngram_stats.values():
        for _ in range(guesses):
            s.update(16, 16)
    return a


class FakeModelDrafter:
    def __init__(self, tokens):
        self.tokens, self.calls = tokens, []

    def propose(self, context, n):
        self.calls.append(n)
        return Draft(self.tokens[:n])

    def fits(self, context):
        return True

    def lag(self, context):
        return 0


def test_plain_when_verify_is_expensive_and_acceptance_low():
    a = auto(LINEAR)
    for s in a.ngram_stats.values():
        for _ in range(50):
            s.update(1, 0)  # every n-gram guess failed
    assert a.propose(REPEATING, 16).tokens == []


def test_never_speculates_when_only_perfect_acceptance_could_break_even():
    assert auto(LINEAR, FakeModelDrafter([1] * 16)).propose(REPEATING, 16).tokens == []


def test_long_ngram_drafts_when_acceptance_is_high():
    d = confident(auto(CPU)).propose(REPEATING, 16)
    assert len(d.tokens) >= 12
    assert d.tokens == REPEATING[-80:-80 + len(d.tokens)]  # what followed the previous occurrence


def test_a_copy_is_never_priced_surer_than_copy_runs_go_on():
    """However well the guesses did, each next token is priced at most at CAP (copy runs end): where a verify
    token costs most of a decode, a perfect record no longer buys a 16-token bet; where it is cheap, it does."""
    a = confident(auto(ZEN4))
    assert all((s.rates(16) <= CAP[origin]).all() for (_, _, origin), s in a.ngram_stats.items())
    assert 1 <= len(a.propose(REPEATING, 16).tokens) <= 5
    assert len(confident(auto(INTEL)).propose(REPEATING, 16).tokens) >= 12


def test_learns_from_what_actually_follows_even_when_not_drafting():
    """Shadow scoring: n-gram guesses are checked against the real continuation, drafted or not."""
    a = auto(CPU)
    ctx = list(range(100, 140)) + list(range(100, 105))
    first = a.propose(ctx, 16)
    quote = list(range(100, 140)) * 2
    ctx = ctx[:-5] + quote[40:45 + len(first.tokens) + 1]  # the first round: what it drafted held, and one more
    while len(ctx) < len(quote):  # the text keeps quoting itself
        ctx = play(a, ctx, quote)
    assert max(s.rates(4).min() for s in a.ngram_stats.values()) > 0.9
    assert len(a.propose(ctx + list(range(100, 104)), 16).tokens) > len(first.tokens)


def test_guesses_the_context_disagrees_on_are_judged_apart():
    """A match whose earlier occurrences went on differently (a JSON key whose value changes from record to
    record) is learned apart from clean copies: its failures leave the copies' statistics alone."""
    a = auto(CPU)
    record = [7, 8, 9]  # a record's key, then its value
    ctx = list(range(100, 140)) + record + [1, 2] + record + [3, 4] + record + [5, 6]  # the value differs each time
    quote = ctx + list(range(100, 130))
    while len(ctx) < len(quote):  # a long quote of the prompt, learned as it goes
        ctx = play(a, ctx, quote)
    assert a.propose(ctx, 16).tokens  # the copy is drafted
    for _ in range(20):  # then records whose values never repeat: the key's guess fails every time
        ctx += record
        assert a.propose(ctx, 16).tokens == []
        ctx += [200 + len(ctx), 300 + len(ctx)]
    a.propose(ctx, 16)
    tried = {key: s for key, s in a.ngram_stats.items() if s.tried[0] > 0.5}
    assert any(origin == "split" and s.tried[0] > 10 and s.rates(1)[0] < 0.2 for (_, _, origin), s in tried.items())
    # the copies' statistics saw one failure at most (where the quote ended), not the keys' twenty
    assert all(s.tried[0] - s.accepted[0] < 1.5 for (_, _, origin), s in tried.items() if origin != "split")


def test_draft_model_wins_where_verification_is_nearly_free():
    model = FakeModelDrafter(list(range(16)))
    a = auto(GPU, model)
    for _ in range(50):
        a.model_stats.update(16, 12)
    d = a.propose([1, 2, 3, 4, 5], 16)
    assert model.calls and len(d.tokens) >= 8


class LaggingModel(FakeModelDrafter):
    """A draft model whose cache holds the context it last drafted from: nothing at first (not prefilled)."""

    def __init__(self, tokens):
        super().__init__(tokens)
        self.synced, self.caught_up = 0, []

    def lag(self, context):
        return len(context) - min(self.synced, len(context))

    def propose(self, context, n):
        self.caught_up.append(self.lag(context))
        self.synced = len(context)
        return super().propose(context, n)


def test_a_long_prompt_is_caught_up_once_the_time_lost_without_the_draft_model_would_pay_for_it():
    """Ski rental: the draft model's cache is not filled with the prompt before the first token; while only its
    lag keeps the model out, the time it would have saved accrues, and the catch-up is made when that reaches
    its price. So the first token never waits for it, and an answer too short to repay it never pays it."""
    def first_model_round(fill):
        model = LaggingModel(list(range(16)))
        a = auto(Costs(GPU.sizes, GPU.depths, GPU.verify, GPU.draft, 0.0, (fill,)), model)
        ctx, rounds = list(range(1000, 1300)), 0  # a 300-token prompt that never repeats itself
        while not model.calls:
            assert rounds < 2000
            a.propose(ctx, 16)
            ctx.append(5000 + rounds)
            rounds += 1
        assert model.caught_up == [300 + rounds - 1]  # one catch-up: the prompt and every token since
        # an investment, not a round that lost: the account is untouched and the round is priced without it
        assert a.bank == 0.0 and a.missed == 0.0 and a.bet[1] < 0.03
        d = model.tokens[:model.calls[0]]
        for _ in range(3):  # its drafts hold: where catching up is cheap it drafts again, paying one round's lag
            ctx += d + [1]
            d = a.propose(ctx, 16).tokens
        assert fill > 0.001 or (len(model.calls) >= 3 and max(model.caught_up[1:]) <= 17)
        return rounds

    cheap, dear = first_model_round(0.0001), first_model_round(0.002)  # 30 ms and 600 ms to catch 300 tokens up
    assert 2 <= cheap <= 20 and dear > 10 * cheap


def test_draft_model_is_probed_now_and_then_and_less_often_when_it_loses():
    model = FakeModelDrafter([7] * 16)
    a = auto(GPU, model)
    for _ in range(50):
        a.model_stats.update(4, 0)  # the model keeps failing
    ctx = [1, 2, 3]
    for i in range(200):
        a.propose(ctx, 16)
        ctx.append(1000 + i)
    assert 1 <= len(model.calls) <= 4
    assert a.probe_every > 64


def test_a_request_whose_drafts_keep_failing_stops_drafting_though_its_rates_still_promise():
    """The account of a request's drafts: each failed round's lost time raises the margin the next draft must
    clear, so auto stops betting on a text that defeats its estimates long before the rates learn it."""
    drafted = {}
    for caution in (0.0, TUNING.caution):
        a = confident(auto(INTEL))
        a.tuning = replace(a.tuning, caution=caution)
        ctx = list(REPEATING)
        drafted[caution] = 0
        for i in range(60):
            d = a.propose(ctx, 16)
            drafted[caution] += bool(d.tokens)
            # the target never writes what was guessed, but a token the context has seen: more guesses follow
            ctx.append(100 + ((d.tokens[0] if d.tokens else ctx[-1]) - 100 + 7) % 40)
        assert (a.bank < 0) == bool(drafted[caution])
    assert drafted[0.0] == 60 and drafted[TUNING.caution] < 30


def test_the_account_prices_a_failed_draft_as_a_loss_at_temperature_above_zero():
    """The sampler's time per row is paid per token with or without a draft: counted on the plain side only, it
    made a failed draft on a GPU (a 17-token verify ~1.3 decodes) look like a gain, and the account never ran a
    deficit at T > 0."""
    gpu_sampling = costs(GPU.verify[0], 0.002, sample_row=0.005)
    a = confident(auto(gpu_sampling, sample_rows=True))
    d = a.propose(REPEATING, 16)
    assert len(d.tokens) == 16
    a.propose(REPEATING + [9999], 16)  # the draft's first token was wrong: the round gave one token
    assert a.bank < 0


def test_a_request_whose_drafts_pay_keeps_the_plain_margin():
    a = confident(auto(INTEL))
    ctx = list(REPEATING)
    for _ in range(10):
        d = a.propose(ctx, 16)
        assert d.tokens
        ctx = ctx + list(d.tokens) + [ctx[len(ctx) - 120 + len(d.tokens)]]  # every guess holds, then one more
    assert a.bank > 0


class FakeGrammar:
    """Forces tokens 1, 2 everywhere and spells the rest of its forced bytes as token 3."""

    span, copying = "", True  # no thinking span; structured output

    def forced(self):
        return [1, 2]

    def spelled(self, forced):
        return [3]

    def validate(self, tokens):
        return len(tokens)

    def first_end(self, tokens):
        return len(tokens)

    def consume(self, tokens):
        pass

    def rollback(self, n):
        pass


@pytest.mark.parametrize("written, kept", [(3, True), (9, False)])
def test_the_spelled_guess_is_drafted_while_the_model_writes_it(written, kept):
    a = auto(GPU, grammar=FakeGrammar())
    d = a.propose([50, 51, 52], 8)
    assert d.tokens[:3] == [1, 2, 3] and d.forced == 2  # the guess is drafted, but not counted as forced
    d = a.propose([50, 51, 52, 1, 2, written], 8)
    assert (d.tokens[2:3] == [3]) == kept


class FreeGrammar(FakeGrammar):
    """A grammar that forces nothing (inside a JSON string value)."""

    def forced(self):
        return []

    def spelled(self, forced):
        return []


def test_under_a_grammar_a_value_copied_from_the_prompt_is_drafted_from_its_first_tokens():
    """Extraction copies its values from the prompt: under a grammar a prompt copy starts from the rates measured
    on held-out extraction prompts; without one, from code's (where a 2-token match in the prompt says little)."""
    kinds = np.full(2000, WORD, dtype=np.int8)
    prompt = list(range(100, 130))
    drafted = {}
    for grammar in (None, FreeGrammar()):
        a = auto(CPU, grammar=grammar, kinds=kinds)
        a.propose(prompt + [500], 16)  # the output starts
        drafted[grammar is not None] = a.propose(prompt + [500, 110, 111], 16).tokens
    assert drafted[False] == [] and drafted[True][:2] == [112, 113]


def test_kind_odds_can_start_from_measured_rates():
    odds = KindOdds((0.92, 0.46, None))  # words copied from the prompt, its punctuation mostly not
    word, punct, newline = odds.adjust(np.array([0.7, 0.7, 0.7]), np.array([WORD, PUNCT, NEWLINE]))
    assert word > 0.8 and punct < 0.65 and newline == pytest.approx(0.7)  # no rate for line breaks: as given
    for _ in range(300):
        odds.update(np.array([PUNCT]), 1, final=True)  # here the punctuation is copied: the prior is forgotten
    assert odds.adjust(np.array([0.7]), np.array([PUNCT]))[0] > 0.7


def test_draft_model_is_never_probed_where_it_could_not_win():
    """On the second AMD host of MODELS.md a verify of 17 costs ~9 decodes: even a perfect draft model loses."""
    model = FakeModelDrafter([7] * 16)
    amd2 = costs(np.interp(SIZES, [1, 2, 5, 9, 17, 33], [34.7, 61.0, 118, 233, 325, 504]) / 1e3, 0.0208)
    a = auto(amd2, model)
    ctx = [1, 2, 3]
    for i in range(300):
        a.propose(ctx, 16)
        ctx.append(1000 + i)
    assert model.calls == []


def test_costs_interpolate_in_size_and_depth():
    c = Costs((1, 2, 4), (256, 1024), ((0.01, 0.02, 0.05), (0.02, 0.03, 0.07)), (0.004, 0.008), 0.0)
    assert c.verify_cost(3, 256) == 0.035 and c.verify_cost(1, 256) == 0.01
    assert c.verify_cost(1, 640) == pytest.approx(0.015)  # halfway between the depths
    assert c.verify_cost(1, 1792) == pytest.approx(0.03)  # beyond: attention keeps growing linearly
    assert c.verify_cost(1, 0) == 0.01  # below the first depth: as measured there
    assert c.draft_cost(640) == pytest.approx(0.006)
    np.testing.assert_allclose(c.verify_cost(np.array([1, 2]), 256), [0.01, 0.02])


def test_the_costs_of_every_length_are_verify_costs_figures():
    """auto reads a round's costs of 1..n tokens at once (verify_costs, the sizes interpolated once per n): the
    same figures as verify_cost, within, below and beyond the measured depths, alone and beside others."""
    from localspec.core.costs import Shared

    c = Costs((1, 2, 4, 8), (256, 1024), ((0.01, 0.02, 0.05, 0.09), (0.02, 0.03, 0.07, 0.12)), None, 0.0,
              batch=((2, 1.1), (4, 1.3)))
    one = Costs((1, 2, 4), (256,), ((0.01, 0.02, 0.05),), None, 0.0)
    for costs in (c, one, Shared(c, lambda: (3, 4))):
        for n in (1, 5, 9):
            for depth in (0, 256, 640, 1024, 3000):
                np.testing.assert_array_equal(costs.verify_costs(n, depth),
                                              costs.verify_cost(np.arange(1, n + 1), depth))
    assert not one.verify_costs(3, 256).flags.writeable  # the cached row itself: nobody may write to it


def test_a_noisy_deeper_measurement_never_extrapolates_towards_zero():
    """Measured on a busy machine, the deeper cost can come out lower: within the depths that is interpolated
    as measured, beyond the last depth it stays at the deeper figure instead of falling towards zero."""
    c = Costs((1, 2), (256, 1024), ((0.04, 0.06), (0.03, 0.05)), (0.02, 0.01), 0.0)
    assert c.verify_cost(1, 640) == pytest.approx(0.035)
    assert c.verify_cost(1, 4096) == pytest.approx(0.03) and c.verify_cost(1, 100_000) == pytest.approx(0.03)
    assert c.draft_cost(100_000) == pytest.approx(0.01)
    np.testing.assert_allclose(c.verify_cost(np.array([1, 2]), 100_000), [0.03, 0.05])


def test_auto_prices_long_contexts_at_their_depth():
    """Costs measured at 256 cached tokens but used at 1,500+ made long drafts look cheap."""
    deep = Costs(SIZES, (256, 1024), (tuple(np.interp(SIZES, [1, 33], [0.03, 0.5])),
                                      tuple(np.interp(SIZES, [1, 33], [0.04, 1.5]))), None, 0.0)
    a = auto(deep)
    for s in a.ngram_stats.values():
        for _ in range(100):
            s.update(16, 12)  # good but not perfect guesses
    shallow = len(a.propose(REPEATING, 16).tokens)
    long_ctx = list(range(5000, 6800)) + REPEATING
    assert len(a.propose(long_ctx, 16).tokens) < shallow


def test_sampling_cost_per_row_counts_at_temperature_above_zero():
    """Each row the rule reads costs a sampler pass at T > 0, the same per token with or without a draft:
    it dilutes what a draft saves, so a marginal draft stops paying."""
    slow_rows = costs(CPU.verify[0], 0.016, sample_row=3.0)  # absurdly slow, to show the effect
    drafted = []
    for sample_rows in (False, True):
        a = auto(slow_rows, sample_rows=sample_rows)
        for s in a.ngram_stats.values():
            for i in range(100):
                s.update(16, i % 12)
        drafted.append(len(a.propose(REPEATING, 16).tokens))
    assert drafted[0] > 0 and drafted[1] == 0


def test_calibration_plan_fits_small_contexts():
    """--n-ctx 256 crashed calibration: no batch size fit once 256 tokens were cached."""
    from localspec.core import costs as measured
    assert plan(4096, 512) == ((256, 1024), measured.SIZES)
    depths, sizes = plan(256, 256)
    assert depths == (128,) and sizes == measured.SIZES
    depths, sizes = plan(16, 16)
    assert depths == (8,) and sizes[0] == 1 and depths[0] + sizes[-1] <= 16
    assert plan(1000, 512)[0] == (256,)


@pytest.mark.slow  # the slow tier (CI runs it): the default run stays within minutes
def test_calibration_measures_once_then_reads_the_cache(smol_path, tmp_path, monkeypatch, capsys):
    from localspec.core.model import Model, ModelConfig

    m = Model(smol_path, ModelConfig(n_ctx=512))
    calls = []
    import localspec.store.calibration as cal

    def counting(target, draft, **kw):
        calls.append(1)
        return measure(target, draft, reps=1, **kw)

    monkeypatch.setattr(cal, "measure", counting)
    a = load_or_measure(m, m, tmp_path)
    b = load_or_measure(m, m, tmp_path)
    assert calls == [1] and a == b
    assert list(a.sizes) == sorted(a.sizes) and all(v > 0 for row in a.verify for v in row) and a.draft[0] > 0
    assert a.sample_row > 0 and a.depths == (256,)
    assert len(m.tokens) == 0  # calibration leaves the cache empty
    (cached,) = tmp_path.glob("*.json")
    assert json.loads(cached.read_text())["sizes"][0] == 1
    load_or_measure(m, m, tmp_path, force=True)
    assert calls == [1, 1]
    (tmp_path / "a file").write_text("")  # a cache folder that cannot be made: measured, used, said
    c = load_or_measure(m, m, tmp_path / "a file" / "calibration")
    assert calls == [1, 1, 1] and c.sizes == a.sizes
    assert "could not keep the measurement" in capsys.readouterr().err
    m.close()


class _Clocked:
    """A model whose decodes advance a fake clock: n tokens cost cost(n), a decode of another shape than the
    last pays `rebuild` more, and while `busy` (other work on the machine) a single step costs 20% more and a
    batch 5% more."""

    def __init__(self, cost, rebuild):
        self.cost, self.rebuild, self.clock, self.last, self.busy, self.passes = cost, rebuild, 0.0, 0, False, 0
        self.tokens, self.n_ctx, self.n_batch, self.n_vocab = [], 2048, 512, 64

    def perf_counter(self):
        return self.clock

    def sync(self, tokens, cancel=None):
        self.tokens = list(tokens)

    def truncate(self, n):
        del self.tokens[n:]

    def decode(self, toks, logits="last"):
        n = len(toks)
        self.clock += self.cost(n) * ((1.2 if n == 1 else 1.05) if self.busy else 1.0)
        self.clock += self.rebuild if n != self.last else 0.0
        self.last = n
        self.tokens += toks
        return np.zeros((n, 64), dtype=np.float32)


def test_calibration_prices_the_rebuild_after_a_verify_and_the_quiet_machine(monkeypatch):
    """A verify costs its own decode and the graph rebuild of the single step after it (plain decoding never
    pays one); passes slowed by other work (singles more than batches) do not price verifies low."""
    import localspec.core.costs as C

    m = _Clocked(lambda n: 1.0 if n == 1 else 0.8 * n, rebuild=0.05)
    singles, coin = C._time_singles, np.random.default_rng(0)

    def sometimes_busy(model, n):
        model.busy = coin.random() < 0.5  # half the passes run beside other work
        return singles(model, n)

    monkeypatch.setattr(C, "time", m)
    monkeypatch.setattr(C, "_time_singles", sometimes_busy)
    c = measure(m, None, reps=8)
    for row in c.verify:
        ratios = np.array(row) / row[0]
        # the quiet passes: 0.8 n + the verify's own rebuild and the next step's
        want = np.maximum.accumulate([1.0] + [0.8 * n + 0.1 for n in c.sizes[1:]])
        assert ratios == pytest.approx(want)
        assert 1.0 <= row[0] <= 1.2  # the step: the median over quiet and busy passes


def test_a_wider_verify_that_costs_less_is_kept_and_drafted_into(monkeypatch):
    """llama.cpp's CPU kernels take a batch's rows in blocks, so a verify of 16 can cost less than one of 13 (a
    2-vCPU Xeon: 277 against 290 ms). The calibration keeps the dip (it once made the curve non-decreasing,
    pricing 16 as 14) and auto, sure of a long copy, drafts 15 into it rather than 12."""
    import localspec.core.costs as C

    m = _Clocked(lambda n: 1.0 if n == 1 else 4.0 if n == 16 else 0.3 + 0.3 * n, rebuild=0.0)
    monkeypatch.setattr(C, "time", m)
    c = measure(m, None, reps=2)
    row = dict(zip(c.sizes, c.verify[0]))
    assert row[16] < row[13] < row[17] and row[16] == pytest.approx(4.0)
    assert len(confident(auto(c)).propose(REPEATING, 16).tokens) == 15
    smooth = Costs(c.sizes, c.depths, (tuple(np.maximum.accumulate(c.verify[0])),), None, 0.0)
    assert len(confident(auto(smooth)).propose(REPEATING, 16).tokens) != 15


def test_calibration_runs_in_a_small_context(smol_path, tmp_path):
    from localspec.core.model import Model, ModelConfig

    m = Model(smol_path, ModelConfig(n_ctx=256))
    c = measure(m, m, reps=1)
    assert c.depths == (128,) and c.sizes[-1] == 33 and c.draft[0] > 0
    m.close()


def test_calibration_key_follows_threads_and_build(smol_path, monkeypatch):
    """os.cpu_count() missed CPU affinity and cgroup limits, and a CUDA rebuild kept the CPU's costs."""
    import localspec.store.calibration as cal
    from localspec.core import llama
    from localspec.core.model import Model, ModelConfig

    one, two = Model(smol_path, ModelConfig(n_ctx=256, n_threads=1)), Model(smol_path, ModelConfig(n_ctx=256, n_threads=2))
    assert cal.cache_key(one, None) != cal.cache_key(two, None)
    key = cal.cache_key(two, None)
    monkeypatch.setattr(llama, "system_info", lambda: "CUDA : ARCHS = 900 | AVX512 = 1")
    assert cal.cache_key(two, None) != key
    one.close()
    two.close()


def test_each_request_starts_from_the_same_priors():
    """Decisions depend on the request alone (case 14): a request that copied everything before it must
    not change how the next one drafts."""
    first = confident(auto(CPU), guesses=200)
    first.run = 50
    assert len(first.propose(REPEATING, 16).tokens) >= 12
    fresh, again = auto(CPU), auto(CPU)
    assert fresh.run == 0
    ctx = list(REPEATING[:50])
    assert [len(fresh.propose(ctx[:i], 16).tokens) for i in range(5, 50)] == \
        [len(again.propose(ctx[:i], 16).tokens) for i in range(5, 50)]


def test_kind_odds_start_neutral_and_learn_which_kinds_of_token_guesses_miss():
    odds = KindOdds()
    rates = np.array([0.3, 0.6, 0.9])
    assert np.allclose(odds.adjust(rates, np.array([WORD, PUNCT, NEWLINE])), rates)  # nothing learned: as given
    for _ in range(30):
        odds.update(np.array([WORD, WORD, PUNCT]), 2, final=True)  # the words copied, the punctuation not
    word, punct = odds.adjust(np.array([0.6, 0.6]), np.array([WORD, PUNCT]))
    assert word > 0.6 > punct and punct < 0.3


def test_guesses_are_also_judged_by_the_kind_of_token_they_hold():
    """Values copied from the prompt into JSON: the words are copied, the prompt's punctuation after them
    is not (the output writes its own). Learned per origin over every guess, so a guess runs up to the
    prompt's punctuation and stops there; judged by position alone it stops short (records differ in length)."""
    kinds = np.full(2000, WORD, dtype=np.int8)
    kinds[50:90] = PUNCT
    words = [[100 + 10 * i + j for j in range(2 + i % 4)] for i in range(40)]  # records of 2 to 5 words
    prompt = [t for i in range(40) for t in (*words[i], 50 + i)]  # "w w w ,"
    drafts = {}
    for with_kinds in (True, False):
        a = auto(CPU, kinds=kinds if with_kinds else None)
        ctx = list(prompt)
        text = ctx + [t for i in range(30) for t in (*words[i], 1500 + i)]  # the output copies each record's
        while len(ctx) < len(text):  # words, then writes its own punctuation
            ctx = play(a, ctx, text)
        drafts[with_kinds] = a.propose(ctx + words[35][:1], 16).tokens
        if with_kinds:
            tried, accepted = a.kind_odds["prompt"].tried, a.kind_odds["prompt"].accepted
            assert accepted[WORD] / tried[WORD] > 0.9 and accepted[PUNCT] / tried[PUNCT] < 0.1
    assert drafts[True] == words[35][1:]  # every word of the record, not the prompt's ',' after them
    assert len(drafts[False]) < len(drafts[True])  # by position alone the record's end is unknown: cut early


def test_token_kinds_are_built_once_by_requests_that_arrive_together():
    """Four requests arriving at a server at once each built the vocabulary's kinds beside the others (3-4 s
    with no decode running on a 2-core CPU): the others now wait for the one building them."""
    import threading
    import time

    from localspec.core.auto import vocab_kinds

    class Vocab:
        reads = 0

        def pieces(self):
            Vocab.reads += 1
            time.sleep(0.05)
            return [b"a", b" ", b"\n"]

    model, gate = Vocab(), threading.Barrier(4)
    got = []

    def request():
        gate.wait()
        got.append(vocab_kinds(model))

    threads = [threading.Thread(target=request) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert Vocab.reads == 1 and all(k is got[0] for k in got) and got[0].tolist() == [WORD, PUNCT, NEWLINE]


def test_token_kinds_from_bytes():
    pieces = [b"hello", b" 42", b", ", b'"}', b"\n", b"  ", b"\xe4\xb8", "é".encode(), b""]
    assert token_kinds(pieces).tolist() == [WORD, WORD, PUNCT, PUNCT, NEWLINE, PUNCT, PUNCT, WORD, PUNCT]
    more = [b"a\n", "é\n".encode(), "—".encode(), " —x".encode(), "日本".encode(), b"\xff\xfe", "٣".encode(), b"_"]
    assert token_kinds(more).tolist() == [NEWLINE, NEWLINE, PUNCT, WORD, WORD, PUNCT, WORD, PUNCT]
    assert token_kinds([]).tolist() == []


def test_each_draft_carries_what_auto_chose_and_expected():
    """The plan is a trace beside the outcome: the chosen candidate, expected tokens and seconds at this depth."""
    d = confident(auto(CPU)).propose(REPEATING, 16)
    k = len(d.tokens)
    assert d.plan.source == "ngram" and 1 < d.plan.tokens <= k + 1
    assert d.plan.seconds == pytest.approx(CPU.verify_cost(k + 1, len(REPEATING)))
    plain = auto(LINEAR).propose(REPEATING, 16)       # nothing can beat plain decoding: none, and its cost
    assert plain.tokens == [] and plain.plan.source == "none" and plain.plan.tokens == 1.0
    assert plain.plan.seconds == pytest.approx(LINEAR.verify_cost(1, len(REPEATING)))


def test_history_guesses_are_judged_by_the_kind_of_token_they_hold():
    """An app's earlier output holds the same records as this one's, in words, but it put another separator
    after each: drafted from history, the words hold and the separator does not. Learned over the scope's
    guesses (a KindOdds kept with its history), a guess runs to the record's last word and stops there; judged
    by position alone it stops elsewhere (records differ in length)."""
    from localspec.core.history import SuffixCache

    kinds = np.full(2000, WORD, dtype=np.int8)
    kinds[50:90] = PUNCT
    words = [[100 + 10 * i + j for j in range(3 + i % 4)] for i in range(40)]  # records of 3 to 6 words
    drafts = {}
    for with_kinds in (True, False):
        store = SuffixCache(1 << 20)
        store.add([t for w in words for t in (*w, 60)])  # the earlier output: "w w w ;" ...
        a = auto(INTEL, history=store, kinds=kinds if with_kinds else None)
        prompt = list(range(1000, 1020))
        ctx = list(prompt)
        text = ctx + [t for w in words[:30] for t in (*w, 80)]  # this one: "w w w ," ...
        while len(ctx) < len(text):
            ctx = play(a, ctx, text)
        drafts[with_kinds] = [a.propose(ctx + words[i][:3], 16).tokens for i in range(32, 36)]
        if with_kinds:
            odds = store.learned.kinds
            assert odds.accepted[WORD] / odds.tried[WORD] > 0.9 and odds.accepted[PUNCT] / odds.tried[PUNCT] < 0.1
    # each record's last words, not the earlier output's ';' after them
    assert drafts[True] == [words[i][3:] for i in range(32, 36)]
    assert drafts[False] != drafts[True]


def test_a_scopes_history_statistics_are_read_and_taught_under_its_lock():
    """Requests decoded together share their scope's history statistics (history.Learned), each from its own
    thread: every read and update of them happens while the scope's lock is held."""
    import threading

    from localspec.core import auto as auto_module
    from localspec.core.history import SuffixCache

    store = SuffixCache(1 << 20)
    for _ in range(4):
        store.add([1, 2, 3, 4, 5, 6, 100, 101, 102, 103, 104, 105, 7])
    held = []

    class Watched:
        """The scope's lock, telling whether it is held."""
        def __init__(self):
            self.lock, self.owner = threading.Lock(), None

        def __enter__(self):
            self.lock.acquire()
            self.owner = threading.get_ident()

        def __exit__(self, *exc):
            self.owner = None
            self.lock.release()

    store.lock = Watched()
    stats_update, odds_update = auto_module.AcceptanceStats.update, KindOdds.update

    def watched(original):
        def call(self, *args, **kw):
            if any(self is s for s in store.learned.stats.values()) or self is store.learned.kinds:
                held.append(store.lock.owner == threading.get_ident())
            return original(self, *args, **kw)
        return call

    auto_module.AcceptanceStats.update, KindOdds.update = watched(stats_update), watched(odds_update)
    try:
        text = [50, 1, 2, 3, 4, 5, 6, 100, 101, 102, 200, 201, 202, 203, 204, 205, 206, 207]
        a = auto(INTEL, history=store, kinds=np.full(300, WORD, dtype=np.int8))
        ctx = text[:7]
        while len(ctx) < len(text) - 1:
            ctx = play(a, ctx, text)
    finally:
        auto_module.AcceptanceStats.update, KindOdds.update = stats_update, odds_update
    assert store.learned.stats and store.learned.kinds is not None  # history was drafted from, and judged
    assert held and all(held)


def test_a_history_draft_is_priced_by_how_many_earlier_places_agree_on_each_token():
    """Five earlier outputs went on alike after the same opening; in one store all five go on alike to the end,
    in the other two of them part at the second token. Both drafts open alike (the majority goes on), but where
    places part auto expects less of the round (each token's rate times the share agreeing on it) and drafts
    less far."""
    from localspec.core.history import SuffixCache

    head, body = [1, 2, 3, 4, 5, 6], list(range(100, 116))
    expected, drafted = [], []
    for parting in (0, 2):
        store = SuffixCache(1 << 20)
        for i in range(5):
            tail = body[:1] + [900 + i] * 15 if i < parting else body
            store.add([*head, *tail])
        d = auto(INTEL, history=store).propose([50, *head], 16)
        assert d.plan.source == "history" and d.tokens[0] == body[0]
        expected.append(d.plan.tokens)
        drafted.append(len(d.tokens))
    assert expected[1] < expected[0] and drafted[1] < drafted[0]


def test_a_copy_whose_first_token_holds_is_expected_to_go_on():
    """Only first tokens taught (each held, nothing further seen): a copy from the prompt is still drafted
    long, its later tokens priced at the continuation prior, not at the first token's."""
    prompt = list(range(100, 140))
    a = auto(INTEL)
    a.propose(prompt, 16)  # the output starts here
    for s in a.ngram_stats.values():
        for _ in range(20):
            s.update(1, 1)
    d = a.propose(prompt + [110, 111], 16)  # "110 111" occurs in the prompt, followed by 112...
    assert d.plan.source == "ngram" and d.tokens[:4] == [112, 113, 114, 115]


def test_history_statistics_are_the_scopes_learned_across_its_requests():
    """An agent whose steps open with different tool calls: every earlier output opened alike after the same
    turn header, so the first request bets on that opening. Each request that opens otherwise teaches the scope
    (SuffixCache.learned), and a few requests on the opening is no longer drafted; another scope's store still
    starts from the priors, and later rounds (not the opening) keep their own statistics."""
    from localspec.core.history import SuffixCache

    header = [1, 2, 3, 4, 5, 6]  # the end of every prompt: the chat template's turn header, say
    store, other = SuffixCache(1 << 20), SuffixCache(1 << 20)
    for s in (store, other):
        for _ in range(10):
            s.add([*header, 100, 101, 102, 103, 104, 105])
    prompt = [50, 51, *header]
    opened = []
    for step in range(6):
        a = auto(INTEL, history=store)
        opened.append(a.propose(prompt, 16).tokens[:1] == [100])
        a.propose([*prompt, 200 + step], 16)  # it opened otherwise: the bet is scored
    assert opened[0] and not opened[-1]
    assert {key[2] for key in store.learned.stats} == {True}  # learned at openings only
    assert auto(INTEL, history=other).propose(prompt, 16).tokens[:1] == [100]


def test_choose_takes_the_fastest_candidate_and_on_a_tie_the_one_named_first():
    from localspec.core.auto import Candidate, choose

    plain = Candidate("none", 0, 30.0, 1.0, 1 / 30)
    ngram = Candidate("ngram", 4, 45.0, 3.0, 3 / 45, cont=[1, 2, 3, 4])
    model = Candidate("model", 4, 45.0, 3.0, 3 / 45)
    assert choose(plain, None, ngram, None) is ngram
    assert choose(plain, ngram, model) is ngram  # a tie keeps the earlier source
    assert choose(plain, Candidate("history", 2, 29.9, 1.5, 0.05)) is plain
    assert choose(plain) is plain


@pytest.mark.parametrize("curve, wins", [(GPU, "ngram"), (CPU, "ngram"), (LINEAR, "none")])
def test_which_source_wins_a_sure_copy_depends_on_what_a_verify_costs(curve, wins):
    """The same n-gram guess, its rates learned sure: drafted where a verify of several tokens costs little more
    than one (a GPU) or a few decodes (this kind of CPU), never where a verify costs a decode per token."""
    a = confident(auto(curve))
    d = a.propose(REPEATING, 16)
    assert d.plan.source == wins and (len(d.tokens) > 1) == (wins != "none")


def test_the_draft_model_wins_only_where_it_is_expected_faster_than_the_best_lookup():
    """A draft model always right, no repeat in the context (no lookup has a candidate): it drafts on a GPU,
    and on a curve where a verify costs a decode per token it is never tried (model_may_win)."""
    fresh = list(range(1000, 1040))
    for curve, used in ((GPU, True), (LINEAR, False)):
        model = FakeModelDrafter(list(range(2000, 2016)))
        a = auto(curve, model)
        a.model_stats.update(16, 16)
        d = a.propose(fresh, 16)
        assert (d.plan.source == "model") == used and bool(model.calls) == used


def test_every_tuned_number_says_what_it_trades_and_what_chose_it():
    from localspec.core.tuning import table

    rows = table()
    assert len({name for name, *_ in rows}) == len(rows) >= 25
    for name, value, trades, chosen_by in rows:
        assert value is not None and trades.strip() and chosen_by.strip(), name
    with pytest.raises(Exception):
        TUNING.cap["prompt"] = 1.0  # read-only: a request cannot change another's
