"""Tier 2: what clients send at once, as they send it (real SmolLM2-135M as its own draft, parallel slots).

One real system prompt, longer than a prefill chunk, shared by requests in flight; a decode that fails inside a
joined batch; a seeded stress of many clients with random heads, lengths, cancels and disconnects through the
server. Every wait has a deadline, and every completed reply is its text alone (near-ties allowed: outside exact
mode a token's logits move a little with what shares its decode)."""
from __future__ import annotations

import random
import threading
import time

import httpx
import numpy as np
import pytest

import localspec
from localspec.core import llama
from localspec.core.llama import DecodeError
from localspec.core.loop import logprobs

from test_parallel import assert_as_alone
from test_server import Server

USERS = ["What is the capital of France?", "Name a prime number.", "Say hello in Spanish.", "What colour is the sky?",
         "Count to three.", "Name a fruit.", "What is 2 + 2?", "Name a planet."]
TOOLS = ["search the web", "read a file", "write a file", "list a folder", "run a shell command", "send an email",
         "look up the weather", "convert units", "translate text", "summarise a page", "make a calendar entry",
         "query a database"]


def system_prompt(llm, tokens: int, variant: int = 0) -> str:
    """An agent's system prompt of about `tokens` tokens: rules and tool descriptions, as apps send them."""
    parts = [f"You are assistant #{variant}, a careful helper in a desktop app. Answer briefly and truthfully."]
    i = 0
    while len(llm.tokenize("\n".join(parts))) < tokens:
        tool = TOOLS[i % len(TOOLS)]
        parts.append(f"Tool {i + 1}: {tool}. Call it when the user asks you to {tool}; give its arguments as JSON "
                     f"with the keys 'query' and 'limit' (a number from 1 to {i + 5}), and never call it twice in a row.")
        i += 1
    return "\n".join(parts)


def chat(llm, system: str, user: str) -> list[int]:
    return llm.chat_tokens([{"role": "system", "content": system}, {"role": "user", "content": user}])


def together(jobs, timeout: float = 300):
    """Run each callable in its own thread, all at once; their results in order. Raises the first error, and
    fails when any is still running at the deadline (a hang)."""
    out, errors = [None] * len(jobs), []

    def run(i, job):
        try:
            out[i] = job()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i, j), daemon=True) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + timeout
    for t in threads:
        t.join(max(deadline - time.monotonic(), 0))
    assert not any(t.is_alive() for t in threads), f"still running after {timeout} s"
    if errors:
        raise errors[0]
    return out


@pytest.fixture(scope="module")
def solo(smol_path):
    with localspec.load(target=smol_path, draft=smol_path, n_ctx=3072) as llm:
        yield llm


@pytest.fixture(scope="module", params=[4, pytest.param(2, marks=pytest.mark.slow)])
def par(request, smol_path):
    """Parallel slots without a prompt cache: a head is prefilled together and borrowed, never restored."""
    with localspec.load(target=smol_path, draft=smol_path, n_ctx=3072, parallel=request.param, prompt_cache_mb=0,
                        prompt_cache_disk_mb=0) as llm:
        yield llm


@pytest.mark.slow  # the slow tier (CI runs it): the default run stays within minutes
@pytest.mark.parametrize("head, rounds", [(600, 3), pytest.param(600, 20, marks=pytest.mark.slow),
                                          pytest.param(2500, 8, marks=pytest.mark.slow)])
def test_clients_sharing_one_long_system_prompt_each_get_their_text_alone(par, solo, head, rounds):
    """The most common thing an app does: every client sends the same system prompt (longer than a prefill chunk)
    with its own question, at the same moment. A chunk wholly borrowed from another sequence (prefilled once,
    copied with seq_cp) divided by zero, all four requests failed, and the slots were corrupted for the next
    round. Every other round starts from empty slots, so the head is prefilled together and borrowed again."""
    n = par.parallel
    system = system_prompt(par, head)
    prompts = [chat(par, system, u) for u in USERS]
    assert all(len(p) > head > llama.PREFILL_CHUNK for p in prompts)
    alone = [solo.generate(p, max_tokens=12, temperature=0, drafter="none", logprobs=5) for p in prompts]
    drafters = ["auto", "model", "ngram", "none"]
    borrowed = 0
    for r in range(rounds):
        if r % 2 == 0:
            for seq in par.target.seqs[1:] + par.draft.seqs[1:]:
                seq.clear()
        before = sum(s.borrowed for s in par.target.seqs)
        users = [(r + i) % len(USERS) for i in range(n)]
        got = together([lambda u=u, d=drafters[i % 4]: par.generate(prompts[u], max_tokens=12, temperature=0,
                                                                    drafter=d) for i, u in enumerate(users)])
        for u, g in zip(users, got):
            assert_as_alone(alone[u], g)
        borrowed += sum(s.borrowed for s in par.target.seqs) - before
    assert borrowed >= head  # the head was prefilled once and shared, not once per request
    # the slots hold what their token lists say: nothing foreign was left in any
    for seq in par.target.seqs[1:]:
        assert seq.pos_max() == len(seq.tokens) - 1


def test_a_decode_that_fails_in_a_joined_batch_fails_its_request_alone(smol_path, solo, monkeypatch):
    """A decode failure inside a batch joined by four requests: the others finish with their text alone, the one
    whose decode fails ends with a typed DecodeError, its sequence is emptied, nothing stays queued, and the next
    requests (every slot) give their text alone."""
    with localspec.load(target=smol_path, draft=smol_path, n_ctx=3072, parallel=4) as par:
        prompts = [chat(par, "You are a helpful assistant.", u) for u in USERS[:4]]
        alone = [solo.generate(p, max_tokens=24, temperature=0, drafter="none", logprobs=5) for p in prompts]
        victim, failed = {}, []
        real = llama.L.llama_decode

        def flaky(ctx, batch):
            """Fails every decode holding the victim's sequence once it has generated a few tokens."""
            slot = next((s for s, t in par._held.items() if t == victim.get("thread")), None)
            seqs = {batch.seq_id[i][0] for i in range(batch.n_tokens)}
            if slot in seqs and len(par.target.seqs[slot].tokens) > len(prompts[0]) + 4:
                failed.append(len(seqs))
                return -1
            return real(ctx, batch)

        monkeypatch.setattr(llama.L, "llama_decode", flaky)

        def run(i):
            if i == 0:
                victim["thread"] = threading.get_ident()
                with pytest.raises(DecodeError, match="llama_decode failed with code -1"):
                    par.generate(prompts[0], max_tokens=24, temperature=0, drafter="none")
                return None
            return par.generate(prompts[i], max_tokens=24, temperature=0, drafter="none")

        got = together([lambda i=i: run(i) for i in range(4)])
        assert failed and max(failed) > 1  # it failed inside a joined batch (then alone, to find whose it was)
        for a, b in zip(alone[1:], got[1:]):
            assert_as_alone(a, b)
        assert par._batcher._jobs == [] and sorted(par._free) == [1, 2, 3, 4]
        emptied = [s for s in par.target.seqs[1:] if not s.tokens]
        assert emptied and all(s.pos_max() == -1 for s in emptied)
        monkeypatch.setattr(llama.L, "llama_decode", real)
        again = together([lambda p=p: par.generate(p, max_tokens=24, temperature=0, drafter="none") for p in prompts])
        for a, b in zip(alone, again):
            assert_as_alone(a, b)


# ---- the server under a seeded stress ----
class Alone:
    """A request's greedy text decoded alone, with what judging another text against it needs: each token's top
    alternatives and, where it ended on its own, the odds of its end-of-generation token there (read before the
    clients start: the test's own decodes would otherwise fight the server's for the cores)."""

    def __init__(self, solo, prompt: list[int], max_tokens: int):
        self.result = r = solo.generate(prompt, max_tokens=max_tokens, temperature=0, drafter="none", logprobs=5)
        self.pieces = [solo.target.piece(t).decode(errors="replace") for t in r.tokens]
        self.end = None
        if r.finish_reason == "stop":
            row = np.array(solo.target.sync(prompt + r.tokens, logits=True)[1][0])
            top = logprobs(row, 0, 5)[1]
            ends = [(p, tok) for tok, p in top if solo.target.is_eog(tok)]
            self.end = (max(ends)[0], max(ends)[1], top) if ends else (float("inf"), None, top)

    def check(self, text: str) -> None:
        """`text` is this text (or as far as a shorter max_tokens went), or parts from it only where its two best
        tokens were nearly tied, its end (the end-of-generation token) included."""
        r = self.result
        if r.text.startswith(text):
            return
        at = next((i for i, (x, y) in enumerate(zip(r.text, text)) if x != y), len(r.text))
        done, t = 0, 0
        while t < len(r.tokens) and done + len(self.pieces[t]) <= at:
            done += len(self.pieces[t])
            t += 1
        if t < len(r.tokens):
            (lp, top), chosen = r.logprobs[t], r.tokens[t]
        else:  # it ended here
            assert self.end is not None, (r.text, text)
            lp, chosen, top = self.end
        assert any(tok != chosen and lp - p < 0.5 for tok, p in top), (t, r.text, text, top)


def stress(server: Server, solo, requests: int, seed: int, heads=(40, 300, 700)) -> dict:
    """8 threads send `requests` chat requests (random system prompts from a few, random users, random lengths);
    some stream and leave after a few chunks, some leave before an answer (a client timeout), the rest read
    their reply. Returns counts by outcome; fails on a 5xx, a hang, or a reply that is not its text alone."""
    rnd = random.Random(seed)
    systems = [system_prompt(solo, n, v) for v, n in enumerate(heads)]
    plan = [(rnd.randrange(len(systems)), rnd.randrange(len(USERS)), rnd.randint(1, 16), rnd.random())
            for _ in range(requests)]
    alone = {}
    for s, u, _, _ in sorted(plan):
        if (s, u) not in alone:
            alone[s, u] = Alone(solo, chat(solo, systems[s], USERS[u]), 16)
    counts = {"read": 0, "left streaming": 0, "left waiting": 0}
    lock = threading.Lock()
    todo = list(enumerate(plan))

    def client():
        with httpx.Client(base_url=server.url, timeout=300) as http:
            while True:
                with lock:
                    if not todo:
                        return
                    i, (s, u, n, how) = todo.pop()
                body = {"messages": [{"role": "system", "content": systems[s]}, {"role": "user", "content": USERS[u]}],
                        "max_tokens": n, "temperature": 0}
                if how < 0.2:  # streams, and leaves after a chunk or two
                    with http.stream("POST", "/v1/chat/completions", json=body | {"stream": True}) as r:
                        assert r.status_code == 200, r.read()
                        for j, _ in enumerate(r.iter_lines()):
                            if j >= 2:
                                break
                    outcome = "left streaming"
                elif how < 0.4:  # gives up before the answer (a client timeout: the connection closes)
                    try:
                        r = http.post("/v1/chat/completions", json=body, timeout=httpx.Timeout(10, read=0.05))
                        assert r.status_code < 500, r.text
                    except httpx.ReadTimeout:
                        pass
                    outcome = "left waiting"
                else:
                    r = http.post("/v1/chat/completions", json=body)
                    assert r.status_code == 200, r.text
                    text = r.json()["choices"][0]["message"]["content"]
                    alone[s, u].check(text)
                    outcome = "read"
                with lock:
                    counts[outcome] += 1

    together([client] * 8, timeout=600)
    deadline = time.monotonic() + 30  # nothing a client left behind holds a slot or the queue
    while (h := server.health())["active"] or h["queued"]:
        assert time.monotonic() < deadline, h
        time.sleep(0.05)
    assert sum(counts.values()) == requests
    return counts


@pytest.fixture(scope="module", params=[4, pytest.param(2, marks=pytest.mark.slow)])
def busy_server(request, smol_path, tmp_path_factory):
    s = Server(smol_path, tmp_path_factory.mktemp("busy") / "server.log", "--parallel", str(request.param),
               "--queue-size", "64", fast=True)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def solo_1024(smol_path):
    """The server's settings (Server: n_ctx 1024, fast), one request at a time."""
    with localspec.load(target=smol_path, draft=smol_path, n_ctx=1024) as llm:
        yield llm


@pytest.mark.slow  # the slow tier (CI runs it): the default run stays within minutes
def test_many_clients_that_cancel_and_disconnect_leave_the_server_whole(busy_server, solo_1024):
    """A seeded stress: 32 requests from 8 threads, with random shared heads, lengths, streams left midway and
    clients that give up while waiting. No 5xx, no hang, every completed reply its text alone, and nothing held
    once they are gone (the slow tier: 100 requests a run, longer heads, at parallel 2 and 4)."""
    counts = stress(busy_server, solo_1024, 32, seed=busy_server.port, heads=(30, 80, 160))
    assert counts["read"] and counts["left streaming"] + counts["left waiting"]
    assert "Traceback" not in busy_server.output()


@pytest.mark.slow
def test_the_stress_at_a_hundred_requests(busy_server, solo_1024):
    """The same, 100 requests a run, heads of 40-700 tokens (scripts can run it longer: stress(..., 200, seed))."""
    counts = stress(busy_server, solo_1024, 100, seed=busy_server.port)
    assert counts["read"] > 25 and counts["left streaming"] and counts["left waiting"]
    assert "Traceback" not in busy_server.output()


@pytest.mark.parametrize("rounds", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_four_clients_with_one_system_prompt_get_200_and_their_text_alone(busy_server, solo_1024, rounds):
    """The reported run: four clients send one ~600-token system prompt with their own question at the same moment,
    three rounds: every reply 200 (it was 4 x 500, then llama_decode failures once the slots were corrupted). By
    default two rounds (the first prefills the head, the second finds it kept); the reported three in the slow
    tier."""
    system = system_prompt(solo_1024, 600)
    alone = [Alone(solo_1024, chat(solo_1024, system, u), 16) for u in USERS[:4]]

    def ask(u: str):
        r = httpx.post(busy_server.url + "/v1/chat/completions", timeout=300, json={
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": u}],
            "max_tokens": 16, "temperature": 0})
        return r.status_code, r.json()

    for _ in range(rounds):
        got = together([lambda u=u: ask(u) for u in USERS[:4]])
        assert [status for status, _ in got] == [200] * 4, got
        for a, (_, body) in zip(alone, got):
            a.check(body["choices"][0]["message"]["content"])
