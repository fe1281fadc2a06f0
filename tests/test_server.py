"""`localspec serve` as desktop apps meet it: a live server on loopback, the official `openai` client.

Real SmolLM2 as its own draft, exact mode, temperature 0: a correct answer is what a fresh engine answers.
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import openai
import pytest
from click.testing import CliRunner

from localspec.apps.cli import cli
from localspec.api.server import create_app

from conftest import until

KEY = "sk-local-test"
MODEL = "SmolLM2-135M-Instruct.Q4_1"
MESSAGES = [{"role": "user", "content": "What is the capital of France?"}]
COUNTING = "1, 2, 3, 4, 5, 6,"  # SmolLM2 keeps counting: a generation as long as max_tokens


class Server:
    """`python -m localspec serve` in a subprocess on a free loopback port, its output in a log file."""

    def __init__(self, model_path, log_path, *args, fast: bool = False):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "localspec", "serve", "--target", model_path, "--draft", model_path,
                 "--n-ctx", "1024", *(() if fast else ("--exact",)), "--port", str(self.port), *args],
                stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, NO_COLOR="1"))
        # the first start on a machine measures its speculation costs (a few minutes on a slow CPU: ~3 for the
        # Qwen pair on a first-generation EPYC), then they are cached
        deadline = time.monotonic() + 600
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.output()}")
            try:
                if httpx.get(f"{self.url}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"server did not come up:\n{self.output()}")
            time.sleep(0.2)

    def client(self, key: str = KEY) -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=120)

    def health(self) -> dict:
        return httpx.get(f"{self.url}/health", timeout=5).json()

    def wait_queued(self, timeout: float = 10) -> None:
        """Until a request waits in the queue."""
        deadline = time.monotonic() + timeout
        while self.health()["queued"] < 1:
            assert time.monotonic() < deadline, "no request was queued"
            time.sleep(0.05)

    def wait_idle(self, timeout: float) -> float:
        t0 = time.monotonic()
        while self.health()["busy"]:
            assert time.monotonic() - t0 < timeout, "the server is still generating"
            time.sleep(0.05)
        return time.monotonic() - t0

    def output(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode


@pytest.fixture(scope="module")
def server(smol_path, tmp_path_factory):
    s = Server(smol_path, tmp_path_factory.mktemp("server") / "server.log", "--api-key", KEY)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def small_server(smol_path, tmp_path_factory):
    """No API key; one waiting request at most; CORS for one origin; greedy ngram drafting by default."""
    s = Server(smol_path, tmp_path_factory.mktemp("small") / "server.log", "--queue-size", "1",
               "--cors", "https://app.example", "--allow-host", "app.internal", "--temperature", "0",
               "--drafter", "ngram", "-k", "3")
    yield s
    s.stop()


def chat_answer(llm, messages, n: int) -> str:
    return llm.generate(llm.chat_tokens(messages), temperature=0, max_tokens=n).text


def stats_of(obj) -> dict:
    return obj.model_extra["localspec"]


# ---- answers ----
def test_models_lists_the_target_stem(server):
    assert [m.id for m in server.client().models.list().data] == [MODEL]
    assert server.client().models.retrieve(MODEL).id == MODEL


def test_chat(server, smol_engine):
    r = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24,
                                                extra_body={"localspec": {"drafter": "model", "k": 3},
                                                            # newer OpenAI fields that change nothing here
                                                            "prompt_cache_key": "k", "safety_identifier": "u"})
    assert r.choices[0].message.content == chat_answer(smol_engine, MESSAGES, 24)
    assert r.choices[0].finish_reason in ("stop", "length")
    st = stats_of(r)
    assert (st["drafter"], st["k"], st["lossless"]) == ("model", 3, True)
    assert st["drafted"] > 0 and r.usage.completion_tokens == st["generated"]


def test_chat_stream(server, smol_engine):
    chunks = list(server.client().chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24, stream=True, user="someone",
        stream_options={"include_usage": True}, extra_body={"localspec": {"drafter": "ngram"}}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == chat_answer(smol_engine, MESSAGES, 24)
    done, last = chunks[-2:]  # include_usage: the last chunk has the usage and no choices, as OpenAI sends it
    assert done.choices[0].finish_reason in ("stop", "length")
    assert last.choices == [] and last.usage.completion_tokens > 0
    assert stats_of(done)["drafter"] == "ngram" and "gen_tps" in stats_of(done)


def test_completions(server, smol_engine):
    prompt = "The three primary colors are"
    expected = smol_engine.generate(prompt, temperature=0, max_tokens=12).text
    r = server.client().completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12)
    assert r.choices[0].text == expected and r.choices[0].finish_reason == "length"
    assert stats_of(r)["generated"] == 12
    chunks = list(server.client().completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=12,
                                                     stream=True))
    assert "".join(c.choices[0].text for c in chunks) == expected
    assert chunks[-1].choices[0].finish_reason == "length" and stats_of(chunks[-1])["generated"] == 12


def test_any_model_name_is_answered_by_the_served_model(server, smol_engine):
    # OpenAI snippets name some model; one model is served, so any name means it (as llama.cpp's server)
    r = server.client().chat.completions.create(model="gpt-4o", messages=MESSAGES, temperature=0, max_tokens=8)
    assert r.model == MODEL and r.choices[0].message.content == chat_answer(smol_engine, MESSAGES, 8)
    with pytest.raises(openai.NotFoundError):  # a lookup by name still says what exists
        server.client().models.retrieve("gpt-4o")


def test_serve_flags_are_the_defaults_of_requests(small_server, smol_engine):
    client = small_server.client(key="unused")
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12)  # --temperature 0
    assert r.choices[0].message.content == chat_answer(smol_engine, MESSAGES, 12)
    assert (stats_of(r)["drafter"], stats_of(r)["k"]) == ("ngram", 3)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                       extra_body={"localspec": {"drafter": "none", "k": 2}})
    assert (stats_of(r)["drafter"], stats_of(r)["k"]) == ("none", 2)  # the request's fields win
    # OpenAI's max_tokens defaults, not generate's 256, so serve has no --max-tokens
    result = CliRunner().invoke(cli, ["serve", "--max-tokens", "5"])
    assert result.exit_code == 2 and "each request sets its own max_tokens" in result.output


def test_serve_says_a_busy_port_or_a_wrong_host_before_loading_the_models(smol_path, monkeypatch):
    """A port in use was found after the models loaded and their costs were measured (minutes on a first run),
    as uvicorn's 'address already in use'; --port 70000 and --host 999.1.1.1 dumped 80-line tracebacks."""
    import localspec.apps.cli as lc

    monkeypatch.setattr(lc, "load_engine", lambda *a, **k: pytest.fail("loaded the models first"))
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        for args, message in (
                (["--port", str(port)], f"port {port} on 127.0.0.1 is in use (another localspec serve, or another "
                                        "server): stop it or pick another --port"),
                (["--host", "999.1.1.1"], "--host 999.1.1.1: not an address of this machine")):
            r = subprocess.run([sys.executable, "-c", "import sys, localspec.apps.cli as c; c.load_engine = None; "
                                "sys.argv[0] = 'localspec'; c.main()", "serve", "--target", str(smol_path), *args],
                               capture_output=True, text=True, timeout=120)
            assert r.returncode == 2 and message in r.stderr and "Traceback" not in r.stderr, r.stderr
    result = CliRunner().invoke(cli, ["serve", "--target", str(smol_path), "--port", "70000"])
    assert result.exit_code == 2 and "70000 is not in the range 1<=x<=65535" in result.output
    from localspec.api.server import ServeError, bind

    loading = bind("127.0.0.1", 0)  # a server still loading its models holds its port already
    try:
        with pytest.raises(ServeError, match="is in use"):  # SO_REUSEADDR let two bound sockets share it
            bind("127.0.0.1", loading[0].getsockname()[1])
    finally:
        for sock in loading:
            sock.close()


def test_four_concurrent_clients_each_get_a_complete_correct_answer(server, smol_engine):
    questions = ["Name a fruit.", "What is 2+2?", "Say hello in French.", "What color is the sky?"]

    def ask(i: int) -> str:
        messages = [{"role": "user", "content": questions[i]}]
        if i % 2:  # half of them stream
            chunks = server.client().chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                             max_tokens=20, stream=True)
            return "".join(c.choices[0].delta.content or "" for c in chunks)
        return server.client().chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                                       max_tokens=20).choices[0].message.content

    with ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(ask, range(4)))
    expected = [chat_answer(smol_engine, [{"role": "user", "content": q}], 20) for q in questions]
    assert answers == expected
    print("\nconcurrent answers:", json.dumps(answers))


def test_second_turn_prefills_only_the_new_tokens(server, smol_engine):
    client = server.client()
    turn1 = [{"role": "system", "content": "You are a terse geography tutor."},
             {"role": "user", "content": "What is the capital of Italy?"}]
    r1 = client.chat.completions.create(model=MODEL, messages=turn1, temperature=0, max_tokens=16)
    turn2 = turn1 + [{"role": "assistant", "content": r1.choices[0].message.content},
                     {"role": "user", "content": "And of Spain?"}]
    r2 = client.chat.completions.create(model=MODEL, messages=turn2, temperature=0, max_tokens=16)
    cached = r2.usage.prompt_tokens_details.cached_tokens
    assert cached == stats_of(r2)["prompt_reused"] > r1.usage.prompt_tokens // 2  # turn 1 is reused
    # at most the tokens added since turn 1's prompt (the reply, the new message): turn 1 is not redone
    assert stats_of(r2)["prompt_prefilled"] <= r2.usage.prompt_tokens - r1.usage.prompt_tokens + 1
    assert r2.choices[0].message.content == chat_answer(smol_engine, turn2, 16)


# ---- one engine, many clients ----
@pytest.mark.slow  # 27 s: in the slow tier, which CI runs, to keep the default run within 8 minutes
def test_identical_requests_get_identical_text_under_auto_in_fast_mode(smol_path, tmp_path):
    """Hardening case 14: auto's state from the first request changed the second's draft lengths, batch
    shapes changed the numerics and a near-tie flipped: the same request, streamed or not, gave other text."""
    s = Server(smol_path, tmp_path / "server.log", "--drafter", "auto", fast=True)
    try:
        client = s.client()
        messages = [{"role": "user", "content": "Repeat this list twice: apple, banana, cherry, dates, elderberry, "
                                                "fig, grape."}]
        texts = []
        for stream in (False, True, False):
            r = client.chat.completions.create(model=MODEL, messages=messages, temperature=0, max_tokens=64,
                                               stream=stream)
            texts.append("".join(c.choices[0].delta.content or "" for c in r if c.choices) if stream
                         else r.choices[0].message.content)
        assert texts[0] and texts == [texts[0]] * 3
    finally:
        s.stop()


def test_health_answers_during_a_generation(server):
    stream = server.client().completions.create(model=MODEL, prompt=COUNTING, temperature=0, max_tokens=1000,
                                                stream=True)
    next(iter(stream))
    t0 = time.monotonic()
    h = server.health()
    assert time.monotonic() - t0 < 2.0
    assert h["status"] == "ok" and h["busy"] is True
    stream.close()
    server.wait_idle(5)


def test_client_that_disconnects_stops_its_generation(server, smol_engine):
    stream = server.client().completions.create(model=MODEL, prompt=COUNTING, temperature=0, max_tokens=1000,
                                                stream=True)
    pieces = [c.choices[0].text for c, _ in zip(stream, range(5))]
    assert len(pieces) == 5
    stream.close()
    server.wait_idle(30)
    # stopped within a round or two of the disconnect, far from its 1000 tokens
    cancelled = [line for line in server.output().splitlines() if "completion (cancelled)" in line]
    assert cancelled and int(cancelled[-1].split(": ")[-1].split()[0]) < 60
    r = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=16)
    assert r.choices[0].message.content == chat_answer(smol_engine, MESSAGES, 16)


def test_full_queue_answers_503_with_retry_after(small_server, smol_engine):
    client = small_server.client(key="unused")
    running = client.completions.create(model=MODEL, prompt=COUNTING, temperature=0, max_tokens=1000, stream=True)
    next(iter(running))
    waiting = {}
    t = threading.Thread(target=lambda: waiting.update(r=client.chat.completions.create(
        model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8)))
    t.start()
    small_server.wait_queued()
    with pytest.raises(openai.APIStatusError) as e:
        client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8)
    assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
    assert e.value.response.json()["error"]["code"] == "queue_full"
    running.close()
    t.join(timeout=60)
    assert waiting["r"].choices[0].message.content == chat_answer(smol_engine, MESSAGES, 8)


@pytest.fixture(scope="module")
def parallel_server(smol_path, tmp_path_factory):
    """Four requests generated together, one more may wait."""
    s = Server(smol_path, tmp_path_factory.mktemp("parallel") / "server.log", "--parallel", "4", "--queue-size", "1",
               "--temperature", "0", fast=True)
    yield s
    s.stop()


@pytest.mark.slow  # 5-15 s: in the slow tier, which CI runs, to keep the default run within 8 minutes
def test_four_streamed_requests_generate_together_and_a_leaving_one_frees_its_slot(parallel_server, smol_engine):
    """Four OpenAI clients streaming at once each get their own text; /health counts them; a fifth waits, a sixth
    is refused 503; the fifth starts once one of the four leaves, while the other three go on."""
    client = parallel_server.client(key="unused")
    starts = [f"{n}, {n + 1}, {n + 2}," for n in (1, 20, 300, 4000)]
    streams = [client.completions.create(model=MODEL, prompt=p, max_tokens=400, stream=True) for p in starts]
    firsts = [next(iter(s)).choices[0].text for s in streams]
    h = parallel_server.health()
    assert (h["active"], h["parallel"], h["queued"]) == (4, 4, 0)
    texts = [f + "".join(c.choices[0].text for c, _ in zip(s, range(12))) for f, s in zip(firsts, streams)]
    for p, t in zip(starts, texts):  # each counts on from its own prompt: no request read another's cache
        alone = smol_engine.generate(p, temperature=0, max_tokens=40).text
        assert len(t) > 10 and alone.startswith(t), (p, t, alone)
    waiting = {}
    fifth = threading.Thread(target=lambda: waiting.update(r=client.completions.create(
        model=MODEL, prompt="7, 8, 9,", max_tokens=8)))
    fifth.start()
    parallel_server.wait_queued()
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(model=MODEL, prompt="1,", max_tokens=8)
    assert e.value.status_code == 503
    streams[0].close()  # the first client leaves: its slot goes to the fifth within a round
    fifth.join(timeout=60)
    assert waiting["r"].choices[0].text == smol_engine.generate("7, 8, 9,", temperature=0, max_tokens=8).text
    for s in streams[1:]:  # the other three went on meanwhile
        assert "".join(c.choices[0].text for c, _ in zip(s, range(4)))
        s.close()
    parallel_server.wait_idle(30)


def test_a_client_that_leaves_while_queued_gives_up_its_place(small_server, smol_engine):
    client = small_server.client(key="unused")
    running = client.completions.create(model=MODEL, prompt=COUNTING, temperature=0, max_tokens=1000, stream=True)
    next(iter(running))
    with pytest.raises(httpx.ReadTimeout):  # waits behind the running one, then gives up
        httpx.post(small_server.url + CHAT, json=OK_CHAT, timeout=httpx.Timeout(30, read=1))
    deadline = time.monotonic() + 5
    while small_server.health()["queued"]:
        assert time.monotonic() < deadline, "the abandoned request still holds its place"
        time.sleep(0.05)
    with ThreadPoolExecutor(1) as pool:  # the one place is free again: the next request waits, no 503
        waiting = pool.submit(client.chat.completions.create, model=MODEL, messages=MESSAGES, max_tokens=8)
        until(lambda: small_server.health()["queued"] >= 1 or waiting.done(), 30, "the next request's wait")
        running.close()
        assert waiting.result(timeout=60).choices[0].message.content == chat_answer(smol_engine, MESSAGES, 8)


def test_sigterm_during_a_generation_shuts_down_cleanly(smol_path, tmp_path):
    s = Server(smol_path, tmp_path / "server.log")
    stream = s.client().completions.create(model=MODEL, prompt=COUNTING, temperature=0, max_tokens=1000,
                                           stream=True)
    chunks = iter(stream)
    next(chunks)
    t0 = time.monotonic()
    rc = s.stop()
    assert time.monotonic() - t0 < 20
    assert rc in (0, -signal.SIGTERM), s.output()
    assert "Traceback" not in s.output() and "completion (cancelled)" in s.output()
    with pytest.raises(openai.APIError, match="shutting down"):  # the stream ends with an error event
        list(chunks)


LONG_PROMPT = " ".join(f"item {i} is {i * 7 % 13}." for i in range(340))  # ~3,000 tokens: a prefill of a minute


def long_prefill_server(smol_path, tmp_path) -> Server:
    # one thread: llama.cpp's threads spin-wait for each other, so a busy machine slows two of them tenfold
    # not --exact: what is measured is how soon the prefill stops, not its logits (an exact-mode probe 4,000 tokens
    # deep with one thread would cost more than the test)
    return Server(smol_path, tmp_path / "server.log", "--n-ctx", "4096", "--threads", "1", fast=True)


@pytest.mark.slow  # 24 s: in the slow tier, which CI runs, to keep the default run within 8 minutes
def test_a_client_that_leaves_during_a_long_prefill_stops_it(smol_path, tmp_path, smol_engine):
    s = long_prefill_server(smol_path, tmp_path)
    try:
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(s.url + COMPLETIONS, json={"prompt": LONG_PROMPT, "max_tokens": 1},
                       timeout=httpx.Timeout(30, read=2))
        t0 = time.monotonic()
        r = s.client().chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8)
        assert time.monotonic() - t0 < 15, "the abandoned prefill ran on"
        assert r.choices[0].message.content == chat_answer(smol_engine, MESSAGES, 8)  # the caches were left sound
        assert "completion (cancelled)" in s.output()
    finally:
        s.stop()


def test_sigterm_during_a_long_prefill_exits_promptly(smol_path, tmp_path):
    s = long_prefill_server(smol_path, tmp_path)
    body = {"prompt": LONG_PROMPT, "max_tokens": 1}
    threading.Thread(target=lambda: httpx.post(s.url + COMPLETIONS, json=body, timeout=60), daemon=True).start()
    until(lambda: s.health()["busy"], 60, "the prefill")
    t0 = time.monotonic()
    rc = s.stop()
    assert time.monotonic() - t0 < 10 and rc in (0, -signal.SIGTERM), s.output()
    assert "Traceback" not in s.output()


# ---- security ----
def test_api_key_is_required(server):
    with pytest.raises(openai.AuthenticationError):
        server.client(key="wrong").models.list()
    r = httpx.post(f"{server.url}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES})
    assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{server.url}/health").status_code == 200


def test_cors_only_for_the_named_origin(server, small_server):
    preflight = {"Origin": "https://app.example", "Access-Control-Request-Method": "POST",
                 "Access-Control-Request-Headers": "authorization,content-type"}
    r = httpx.options(f"{small_server.url}/v1/chat/completions", headers=preflight)
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://app.example"
    r = httpx.get(f"{small_server.url}/v1/models", headers={"Origin": "https://evil.example"})
    assert "access-control-allow-origin" not in r.headers
    r = httpx.get(f"{server.url}/v1/models", headers={"Origin": "https://app.example",
                                                      "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200 and "access-control-allow-origin" not in r.headers


def test_refused_cors_preflight_gets_an_error_object(small_server):
    r = httpx.options(f"{small_server.url}/v1/chat/completions",
                      headers={"Origin": "https://evil.example", "Access-Control-Request-Method": "POST"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "cors_refused"
    assert "access-control-allow-origin" not in r.headers


def test_without_a_key_only_requests_naming_this_server_are_answered(server, small_server):
    # DNS rebinding: a page at evil.example:PORT whose name now points at 127.0.0.1 sends Host: evil.example
    port = small_server.port
    for host in (f"127.0.0.1:{port}", "127.0.0.1", f"localhost:{port}", "LOCALHOST", f"[::1]:{port}", "[::1]",
                 f"app.internal:{port}", f"192.168.1.20:{port}"):  # --allow-host app.internal; IPs cannot rebind
        assert httpx.get(f"{small_server.url}/v1/models", headers={"Host": host}).status_code == 200, host
    for host in (f"evil.example:{port}", "localhost.evil.example", "127.0.0.1.nip.io"):
        for r in (httpx.get(f"{small_server.url}/v1/models", headers={"Host": host}),
                  httpx.post(small_server.url + CHAT, json=OK_CHAT, headers={"Host": host})):
            assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed", host
    # with a key, a rebound page cannot authenticate anyway: any name is answered
    r = httpx.get(f"{server.url}/v1/models", headers={"Host": "my-box.lan", "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200


def test_health_answers_only_this_servers_names_even_with_a_key(server):
    """/health needs no key, and with --api-key it answered any Host: a DNS-rebinding page could watch when the
    server was busy and how many requests waited."""
    port = server.port
    r = httpx.get(f"{server.url}/health", headers={"Host": f"evil.example:{port}"})
    assert r.status_code == 403 and r.json()["error"]["code"] == "host_not_allowed"
    message = r.json()["error"]["message"]
    assert "--allow-host evil.example" in message and "--api-key" not in message
    for host in (f"127.0.0.1:{port}", f"localhost:{port}", f"192.168.1.20:{port}"):
        assert httpx.get(f"{server.url}/health", headers={"Host": host}).json()["status"] == "ok", host
    r = httpx.get(f"{server.url}/v1/models", headers={"Host": "evil.example", "Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200  # the routes that need the key still answer any name


def test_post_bodies_must_be_declared_json(small_server):
    # a cross-site page may POST text/plain or a form without a CORS preflight: such bodies are refused
    content = json.dumps(OK_CHAT).encode()
    for ctype in ("text/plain", "application/x-www-form-urlencoded", None):
        r = httpx.post(small_server.url + CHAT, content=content, headers={"Content-Type": ctype} if ctype else {})
        assert r.status_code == 415 and r.json()["error"]["code"] == "unsupported_media_type", ctype
    r = httpx.post(small_server.url + CHAT, content=content, timeout=60,
                   headers={"Content-Type": "application/json; charset=utf-8"})
    assert r.status_code == 200


# ---- bad input: a 4xx with an OpenAI error object, and the server keeps serving ----
CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
OK_CHAT = {"model": MODEL, "messages": MESSAGES, "max_tokens": 4, "temperature": 0}
OK_COMPLETION = {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0}
LONG = "word " * 1500  # > n_ctx 1024 tokens
BAD = {
    "invalid JSON": (CHAT, b'{"messages": [', 400, None),
    "NaN is not JSON": (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": NaN}', 400, None),
    "body not an object": (CHAT, [1, 2], 400, None),
    "missing messages": (CHAT, {"model": MODEL}, 400, "messages"),
    "messages not an array": (CHAT, OK_CHAT | {"messages": "hi"}, 400, "messages"),
    "message without role": (CHAT, OK_CHAT | {"messages": [{"content": "hi"}]}, 400, "messages[0].role"),
    "content a number": (CHAT, OK_CHAT | {"messages": [{"role": "user", "content": 5}]}, 400,
                         "messages[0].content"),
    "image content": (CHAT, OK_CHAT | {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "data:,"}}]}]}, 400, "messages[0].content"),
    "legacy function message": (CHAT, OK_CHAT | {"messages": [{"role": "function", "content": "42", "name": "f"}]},
                                400, "messages[0]"),
    "tool_calls not an array": (CHAT, OK_CHAT | {"messages": [{"role": "assistant", "tool_calls": {}}]}, 400,
                                "messages[0].tool_calls"),
    "max_tokens a string": (CHAT, OK_CHAT | {"max_tokens": "ten"}, 400, "max_tokens"),
    "max_tokens 0": (CHAT, OK_CHAT | {"max_tokens": 0}, 400, "max_tokens"),
    "temperature negative": (CHAT, OK_CHAT | {"temperature": -1}, 400, "temperature"),
    "temperature a bool": (CHAT, OK_CHAT | {"temperature": True}, 400, "temperature"),
    "top_p above 1": (CHAT, OK_CHAT | {"top_p": 1.5}, 400, "top_p"),
    "frequency_penalty above 2": (CHAT, OK_CHAT | {"frequency_penalty": 3}, 400, "frequency_penalty"),
    "seed negative": (CHAT, OK_CHAT | {"seed": -1}, 400, "seed"),
    "stop a number": (CHAT, OK_CHAT | {"stop": 5}, 400, "stop"),
    "stream a string": (CHAT, OK_CHAT | {"stream": "yes"}, 400, "stream"),
    "model a number": (CHAT, OK_CHAT | {"model": 5}, 400, "model"),
    "n above 1": (CHAT, OK_CHAT | {"n": 2}, 400, "n"),
    "logprobs a number": (CHAT, OK_CHAT | {"logprobs": 3}, 400, "logprobs"),
    "top_logprobs above 20": (CHAT, OK_CHAT | {"logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    "top_logprobs without logprobs": (CHAT, OK_CHAT | {"top_logprobs": 2}, 400, "top_logprobs"),
    "top_logprobs negative": (CHAT, OK_CHAT | {"logprobs": True, "top_logprobs": -1}, 400, "top_logprobs"),
    "completion logprobs above 20": (COMPLETIONS, OK_COMPLETION | {"logprobs": 50}, 400, "logprobs"),
    "completion logprobs a bool": (COMPLETIONS, OK_COMPLETION | {"logprobs": True}, 400, "logprobs"),
    "prediction a string": (CHAT, OK_CHAT | {"prediction": "text"}, 400, "prediction"),
    "prediction of another type": (CHAT, OK_CHAT | {"prediction": {"type": "file", "content": "x"}}, 400,
                                   "prediction"),
    "prediction content a number": (CHAT, OK_CHAT | {"prediction": {"type": "content", "content": 5}}, 400,
                                    "prediction"),
    "completion prediction an object": (COMPLETIONS, OK_COMPLETION | {"prediction": {"content": "x"}}, 400,
                                        "prediction"),
    "stream_options not an object": (CHAT, OK_CHAT | {"stream_options": True}, 400, "stream_options"),
    # SmolLM2's chat template writes no tool-call format
    "tools on a template without calls": (CHAT, OK_CHAT | {"tools": [{"type": "function", "function": {"name": "f"}}]},
                                          400, "tools"),
    "tools not an array": (CHAT, OK_CHAT | {"tools": {"name": "f"}}, 400, "tools"),
    "tool name with spaces": (CHAT, OK_CHAT | {"tools": [{"type": "function", "function": {"name": "a b"}}]}, 400,
                              "tools"),
    "tool_choice naming no tool": (CHAT, OK_CHAT | {"tools": [{"type": "function", "function": {"name": "f"}}],
                                                    "tool_choice": {"type": "function", "function": {"name": "g"}}},
                                   400, "tool_choice"),
    "tool_choice without tools": (CHAT, OK_CHAT | {"tool_choice": "required"}, 400, "tool_choice"),
    "response_format xml": (CHAT, OK_CHAT | {"response_format": {"type": "xml"}}, 400, "response_format"),
    "json_schema without a schema": (CHAT, OK_CHAT | {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x"}}}, 400, "response_format.json_schema"),
    "invalid json_schema": (CHAT, OK_CHAT | {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "strin"}}}}, 400, "response_format"),
    "unknown field": (CHAT, OK_CHAT | {"frobnicate": 1}, 400, "frobnicate"),
    "localspec k 0": (CHAT, OK_CHAT | {"localspec": {"k": 0}}, 400, "localspec.k"),
    "localspec unknown drafter": (CHAT, OK_CHAT | {"localspec": {"drafter": "magic"}}, 400, "localspec.drafter"),
    "localspec unknown option": (CHAT, OK_CHAT | {"localspec": {"speed": "max"}}, 400, "localspec.speed"),
    "chat prompt too long": (CHAT, OK_CHAT | {"messages": [{"role": "user", "content": LONG}]}, 400, "messages"),
    "missing prompt": (COMPLETIONS, {"model": MODEL}, 400, "prompt"),
    "empty prompt": (COMPLETIONS, OK_COMPLETION | {"prompt": ""}, 400, "prompt"),
    "batch of prompts": (COMPLETIONS, OK_COMPLETION | {"prompt": ["a", "b"]}, 400, "prompt"),
    "token id outside the vocabulary": (COMPLETIONS, OK_COMPLETION | {"prompt": [1, 10**7]}, 400, "prompt"),
    "prompt too long": (COMPLETIONS, OK_COMPLETION | {"prompt": LONG}, 400, "prompt"),
    "echo": (COMPLETIONS, OK_COMPLETION | {"echo": True}, 400, "echo"),
    "messages to /v1/completions": (COMPLETIONS, OK_COMPLETION | {"messages": MESSAGES}, 400, "messages"),
    # numbers past what a type check, numpy or a C int holds
    "temperature a 400-digit integer": (CHAT, OK_CHAT | {"temperature": 10**400}, 400, "temperature"),
    "top_p a 400-digit integer": (CHAT, OK_CHAT | {"top_p": 10**400}, 400, "top_p"),
    "frequency_penalty a 400-digit integer": (CHAT, OK_CHAT | {"frequency_penalty": -10**400}, 400,
                                              "frequency_penalty"),
    "max_tokens a 400-digit integer": (CHAT, OK_CHAT | {"max_tokens": 10**400}, 400, "max_tokens"),
    "seed a 400-digit integer": (CHAT, OK_CHAT | {"seed": 10**400}, 400, "seed"),
    "top_k a 400-digit integer": (CHAT, OK_CHAT | {"top_k": 10**400}, 400, "top_k"),
    "localspec k a 400-digit integer": (CHAT, OK_CHAT | {"localspec": {"k": 10**400}}, 400, "localspec.k"),
    "token id a 400-digit integer": (COMPLETIONS, OK_COMPLETION | {"prompt": [1, 10**400]}, 400, "prompt"),
    "temperature 1e400": (CHAT, b'{"messages": [{"role": "user", "content": "hi"}], "temperature": 1e400}', 400,
                          "temperature"),
    # lone UTF-16 surrogates: valid JSON escapes that UTF-8 cannot encode
    "lone surrogate in content": (CHAT, OK_CHAT | {"messages": [{"role": "user", "content": "a\ud800"}]}, 400,
                                  "messages[0].content"),
    "lone surrogate in a content part": (CHAT, OK_CHAT | {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "\udfff"}]}]}, 400, "messages[0].content[0].text"),
    "lone surrogate in stop": (CHAT, OK_CHAT | {"stop": ["x", "\ud800"]}, 400, "stop[1]"),
    "lone surrogate in prompt": (COMPLETIONS, OK_COMPLETION | {"prompt": "\ud800"}, 400, "prompt"),
    "lone surrogate in a field name": (CHAT, OK_CHAT | {"\ud800": 1}, 400, None),
    # wrong shapes
    "localspec an array": (CHAT, OK_CHAT | {"localspec": []}, 400, "localspec"),
    "stop nested arrays": (CHAT, OK_CHAT | {"stop": [["a"]]}, 400, "stop"),
    "content nested arrays": (CHAT, OK_CHAT | {"messages": [{"role": "user", "content": [[["x"]]]}]}, 400,
                              "messages[0].content"),
    "prompt an array of objects": (COMPLETIONS, OK_COMPLETION | {"prompt": [{"a": 1}]}, 400, "prompt"),
    "max_tokens a float": (CHAT, OK_CHAT | {"max_tokens": 1.5}, 400, "max_tokens"),
    # sizes: OpenAI's stop limits; more messages than the context has tokens
    "five stop strings": (CHAT, OK_CHAT | {"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
    "a 257-character stop string": (CHAT, OK_CHAT | {"stop": "x" * 257}, 400, "stop"),
    "an empty stop string": (CHAT, OK_CHAT | {"stop": ""}, 400, "stop"),
    "more messages than context": (CHAT, OK_CHAT | {"messages": MESSAGES * 1025}, 400, "messages"),
    # what parsing would build, in a field that is otherwise ignored (8 MiB of {} held 620 MB for a while)
    "metadata of 120,000 objects": (CHAT, OK_CHAT | {"metadata": [{}] * 120_000}, 400, None),
    "metadata of 1.1 million numbers": (CHAT, OK_CHAT | {"metadata": [0] * 1_100_000}, 400, None),
    # nesting that later steps (error messages, templates, schemas) would walk recursively
    "max_tokens nested 900 deep": (CHAT, ("{" + '"messages": [{"role": "user", "content": "hi"}], "max_tokens": '
                                          + "[" * 900 + "]" * 900 + "}").encode(), 400, "max_tokens"),
    "a schema nested 100 deep": (CHAT, OK_CHAT | {"response_format": {"type": "json_schema", "json_schema": {
        "name": "x", "schema": json.loads('{"items": ' * 100 + "{}" + "}" * 100)}}}, 400, "response_format"),
    # a penalty that divides a logit to infinity
    "repeat_penalty 1e-300": (CHAT, OK_CHAT | {"repeat_penalty": 1e-300, "temperature": 0.8}, 400, "repeat_penalty"),
    # text that would reach the template outside message content
    "tool call named with a control token": (CHAT, OK_CHAT | {"messages": [
        {"role": "assistant", "content": "", "tool_calls": [{"id": "1", "type": "function", "function": {
            "name": "f<|im_end|>", "arguments": "{}"}}]}, *MESSAGES]}, 400, "messages[0].tool_calls[0].function.name"),
    "tool call id a number": (CHAT, OK_CHAT | {"messages": [
        {"role": "assistant", "content": "", "tool_calls": [{"id": 1, "type": "function", "function": {
            "name": "f", "arguments": "{}"}}]}, *MESSAGES]}, 400, "messages[0].tool_calls[0].id"),
}


@pytest.mark.parametrize("case", BAD)
def test_bad_request_gets_4xx_error_object(server, case):
    path, body, status, param = BAD[case]
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    r = httpx.post(server.url + path, content=content, timeout=30,
                   headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert err["param"] == param, err
    if "too long" in case:
        assert err["code"] == "context_length_exceeded"


@pytest.mark.parametrize("arguments", ["[" * 100_000, '{"code": "print(\'<|im_start|>system\')"}'])
def test_odd_tool_call_arguments_are_text_not_a_500(server, arguments):
    """A past call's arguments are parsed for the template; nested past what Python parses they stay text, and
    so does a control token's spelling in them (code that prints one, say): the conversation goes on."""
    body = OK_CHAT | {"messages": [{"role": "assistant", "content": "", "tool_calls": [
        {"id": None, "type": "function", "function": {"name": "f", "arguments": arguments}}]}, *MESSAGES]}
    r = httpx.post(server.url + CHAT, json=body, timeout=60, headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 200, r.text


def test_unknown_route_and_method_get_error_objects(server):
    r = httpx.get(f"{server.url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == "not_found"
    r = httpx.get(f"{server.url}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 405 and "error" in r.json()


def raw_request(server: Server, head: str, body: bytes = b"", *, close: bool = False) -> bytes:
    """One hand-written HTTP/1.1 request on a fresh connection; the response, or b"" when `close`."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(f"{head}\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                     "Content-Type: application/json\r\n\r\n".encode() + body)
        if close:
            return b""
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
        return data


def test_bodies_over_8_mib_get_413(server):
    r = raw_request(server, f"POST {CHAT} HTTP/1.1\r\nContent-Length: {20 << 20}")  # refused before it is sent
    assert r.startswith(b"HTTP/1.1 413") and b'"request_too_large"' in r
    # chunked: no length to check first, so it is counted while read; the last chunk crosses 8 MiB
    chunks = [b"x" * (1 << 20)] * 8 + [b"x"]
    r = raw_request(server, f"POST {CHAT} HTTP/1.1\r\nTransfer-Encoding: chunked",
                    b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks))
    assert r.startswith(b"HTTP/1.1 413"), r[:200]


def test_a_client_that_sends_a_whole_body_over_8_mib_before_reading_gets_the_413(server):
    """The server answered and closed while the body was still arriving; closed with bytes unread, the kernel
    reset the connection and the client lost the 413 (the OpenAI SDK retried, then said "Connection error")."""
    body = json.dumps({"messages": [{"role": "user", "content": "x" * (12 << 20)}]}).encode()
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in (body[i:i + (1 << 20)] for i in
                                                               range(0, len(body), 1 << 20))) + b"0\r\n\r\n"
    for head, sent in ((f"Content-Length: {len(body)}", body), ("Transfer-Encoding: chunked", chunked)):
        r = raw_request(server, f"POST {CHAT} HTTP/1.1\r\n{head}", sent)  # all of it, then the answer is read
        assert r.startswith(b"HTTP/1.1 413"), (head, r[:200])
        assert json.loads(r.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_too_large"
    with pytest.raises(openai.APIStatusError) as e:
        server.client().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * (9 << 20)}],
                                                max_tokens=1)
    assert e.value.status_code == 413 and e.value.code == "request_too_large"
    assert server.health()["status"] == "ok"


def test_an_incomplete_upload_logs_one_line(server):
    raw_request(server, f"POST {CHAT} HTTP/1.1\r\nContent-Length: 1000", b'{"messages": ', close=True)
    deadline = time.monotonic() + 10
    while "left before sending its whole body" not in server.output():
        assert time.monotonic() < deadline, server.output()[-2000:]
        time.sleep(0.05)
    assert "Traceback" not in server.output()


class Live:
    """An ASGI app served by uvicorn with serve()'s protocol, in a thread of this process, on a free loopback port."""

    def __init__(self, app, *, timeout_keep_alive: float = 5, lifespan: str = "off", **protocol):
        import uvicorn

        from localspec.api.http import json_400_protocol

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        config = uvicorn.Config(app, http=json_400_protocol(**protocol), log_level="warning", lifespan=lifespan,
                                timeout_keep_alive=timeout_keep_alive)
        self.server = uvicorn.Server(config)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        until(lambda: self.server.started, 30, "uvicorn's start")
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(10)
        self.sock.close()

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)


def read_response(sock: socket.socket) -> bytes:
    """One response whose body has a Content-Length, read off a kept-alive connection."""
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                  if line.lower().startswith(b"content-length"))
    while len(body) < length:
        body += sock.recv(65536)
    return head + b"\r\n\r\n" + body


def test_connections_whose_headers_do_not_arrive_are_closed():
    """Connections that sent part of their headers, or nothing, were held for as long as their clients liked
    (300 over 75 s); uvicorn has no header timeout. An idle kept-alive connection is still uvicorn's to close."""
    async def app(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]})
        await send({"type": "http.response.body", "body": b"ok"})

    request = b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
    with Live(app, header_timeout_s=0.5, timeout_keep_alive=2) as live:
        silent, partial, kept, kept_partial = (live.connect() for _ in range(4))
        t0 = time.monotonic()
        partial.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
        for sock in (kept, kept_partial):
            sock.sendall(request)
            assert read_response(sock).endswith(b"\r\n\r\nok")
        kept_partial.sendall(b"GET / HT")  # the next request, begun on the kept-alive connection
        for sock in (silent, partial, kept_partial):
            data = b""
            while chunk := sock.recv(65536):
                data += chunk
            assert data.startswith(b"HTTP/1.1 408"), data
            assert json.loads(data.partition(b"\r\n\r\n")[2])["error"]["code"] == "request_timeout"
        assert time.monotonic() - t0 < 3
        kept.settimeout(0.5)
        with pytest.raises(TimeoutError):  # idle past the header timeout: still open, kept alive
            kept.recv(1)
        kept.sendall(request)
        assert read_response(kept).endswith(b"ok")
        kept.settimeout(10)
        t1 = time.monotonic()
        assert kept.recv(1) == b""  # closed by uvicorn's keep-alive timeout, without a word
        assert 1.5 < time.monotonic() - t1 < 5
        for sock in (silent, partial, kept, kept_partial):
            sock.close()


def test_a_refused_upload_is_drained_for_a_bounded_time_and_size(monkeypatch):
    """After a refusal the rest of a body is read and dropped so that the client gets the answer, but a client
    that never stops sending is cut off: after LINGER_S, or after LINGER_BYTES."""
    from localspec.api import http

    async def app(scope, receive, send):
        await receive()  # the first bytes of the body, then a refusal that closes the connection
        await send({"type": "http.response.start", "status": 413,
                    "headers": [(b"content-length", b"2"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": b"no"})

    def flood(sock, sent):
        try:
            while True:
                sent[0] += sock.send(b"x" * 65536)
        except OSError:
            pass

    for seconds, size in ((0.5, 1 << 40), (60, 4 << 20)):
        monkeypatch.setattr(http, "LINGER_S", seconds)
        monkeypatch.setattr(http, "LINGER_BYTES", size)
        with Live(app) as live, live.connect() as sock:
            sock.sendall(b"POST / HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 1000000000000\r\n\r\n")
            sent = [0]
            sender = threading.Thread(target=flood, args=(sock, sent), daemon=True)
            t0 = time.monotonic()
            sender.start()
            assert read_response(sock).startswith(b"HTTP/1.1 413")
            sender.join(20)
            assert not sender.is_alive(), "the server is still reading"
            if seconds < 1:
                assert time.monotonic() - t0 < 5
            else:
                assert sent[0] < size + (16 << 20)  # what the socket buffers hold besides


def test_schema_compiles_are_bounded_remembered_and_spared_by_a_full_queue(smol_engine, monkeypatch):
    """A schema's compile can take seconds of CPU (300 pattern properties that refer to it: 7.5 s to refuse), and
    it ran on arrival, before any queue limit, as many at once as clients sent, and again for each resend of a
    refused one. Now two compile at once (a third meanwhile: 503 queue_full), outcomes are remembered, and a
    request that a full queue would refuse is not compiled."""
    from localspec.core import grammar as grammar_module

    real_compile, real_matcher = grammar_module._cached, grammar_module.Grammar.__init__
    compiled, matchers, release = [], [], threading.Event()

    def compile_(field, text):
        compiled.append(text)
        if "slow" in text:  # a compile that takes a while
            release.wait(30)
        return real_compile(field, text)

    def matcher(self, *args, **kwargs):
        matchers.append(1)
        real_matcher(self, *args, **kwargs)

    monkeypatch.setattr(grammar_module, "_cached", compile_)
    monkeypatch.setattr(grammar_module.Grammar, "__init__", matcher)

    def ask(schema, timeout=60):
        rf = {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}
        return httpx.post(url + CHAT, json=OK_CHAT | {"max_tokens": 1, "response_format": rf}, timeout=timeout)

    app = create_app(smol_engine)
    with Live(app, lifespan="on") as live:
        url = f"http://127.0.0.1:{live.port}"
        invalid = {"type": "strin"}
        for _ in range(3):  # refused by the compiler, which is asked once
            r = ask(invalid)
            assert r.status_code == 400 and r.json()["error"]["param"] == "response_format"
        assert sum(json.dumps(invalid) in t for t in compiled) == 1
        selfref = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
        n = len(matchers)
        for _ in range(2):  # refused by its matcher's first mask, which is built once
            assert ask(selfref).status_code == 400
        assert len(matchers) == n + 1

        with ThreadPoolExecutor(2) as pool:
            slow = [pool.submit(ask, {"type": "strin", "description": f"slow {i}"}) for i in range(2)]
            deadline = time.monotonic() + 30
            while sum("slow" in t for t in compiled) < 2:
                assert time.monotonic() < deadline
                time.sleep(0.01)
            try:
                r = ask({"type": "object", "description": "another"}, timeout=10)
            finally:
                release.set()
            assert r.status_code == 503 and r.headers["retry-after"] == "1"
            assert r.json()["error"]["code"] == "queue_full" and "compiling" in r.json()["error"]["message"]
            assert [f.result().status_code for f in slow] == [400, 400]  # their compiles went on to the end

        app.state.worker.queue_size = 0  # full: refused before its schema is compiled
        n = len(compiled)
        r = ask({"type": "object", "description": "never compiled"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "queue_full"
        assert len(compiled) == n


def test_the_engine_sees_the_servers_queue():
    """auto prices a batched request's drafts by whether requests wait for a slot (costs.Shared): the server's
    queue is part of that, and a job that leaves it is no longer counted."""
    from localspec.api.server import Worker

    engine = SimpleNamespace(name="stub", defaults={}, parallel=1)
    worker = Worker(engine, queue_size=2)
    jobs = [SimpleNamespace(cancelled=threading.Event()) for _ in range(2)]
    for job in jobs:
        worker.submit(job)
    assert engine.queued() == 2
    worker.cancel(jobs[0])
    assert engine.queued() == 1


def test_a_slow_body_gets_408():
    """In process, with a short timeout (serve's is 30 s): a body that stops arriving holds nothing."""
    app = create_app(SimpleNamespace(name="stub", defaults={}, parallel=1), body_timeout_s=0.2)
    parts, sent = [b'{"messages": '], []

    async def receive():
        if parts:
            return {"type": "http.request", "body": parts.pop(), "more_body": True}
        await asyncio.sleep(60)  # the rest never comes

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": CHAT, "raw_path": CHAT.encode(), "query_string": b"", "root_path": "",
             "headers": [(b"host", b"127.0.0.1"), (b"content-type", b"application/json")],
             "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
    asyncio.run(asyncio.wait_for(app(scope, receive, send), 10))
    assert sent[0]["status"] == 408 and json.loads(sent[1]["body"])["error"]["code"] == "request_timeout"


def test_server_keeps_serving_after_bad_input(server, smol_engine):
    assert server.proc.poll() is None and server.health()["status"] == "ok"
    r = server.client().chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=8)
    assert r.choices[0].message.content == chat_answer(smol_engine, MESSAGES, 8)
    assert "Traceback" not in server.output()


# ---- structured output and tool calls, through the official client ----
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}
ASK_PERSON = [{"role": "user", "content": "Describe a fictional person as JSON with name and age."}]


def test_response_format_json_schema(server, smol_engine):
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    client = server.client()
    r = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, temperature=0, max_tokens=64,
                                       response_format=rf)
    obj = json.loads(r.choices[0].message.content)
    assert set(obj) == {"name", "age"} and r.choices[0].finish_reason == "stop"
    expected = smol_engine.generate(smol_engine.chat_tokens(ASK_PERSON), temperature=0, max_tokens=64,
                                    json_schema=PERSON).text
    assert r.choices[0].message.content == expected
    chunks = list(client.chat.completions.create(model=MODEL, messages=ASK_PERSON, temperature=0, max_tokens=64,
                                                 response_format=rf, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == expected
    r = client.chat.completions.create(model=MODEL, messages=ASK_PERSON, temperature=0, max_tokens=64,
                                       response_format={"type": "json_object"})
    assert isinstance(json.loads(r.choices[0].message.content), dict)


def test_a_schema_that_outgrows_llguidance_limits_midway_is_a_400_not_a_cut_answer(smol_engine, monkeypatch):
    """Past max_lexer_states llguidance's mask allowed only the end: '{"name":' came back, finish_reason stop."""
    from llguidance import LLParserLimits
    from starlette.testclient import TestClient

    from localspec.core import grammar as grammar_module

    monkeypatch.setattr(grammar_module, "_limits", lambda: LLParserLimits(max_lexer_states=40))
    rf = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    body = {"messages": ASK_PERSON, "temperature": 0, "max_tokens": 64, "response_format": rf}
    with TestClient(create_app(smol_engine), base_url="http://127.0.0.1") as client:
        r = client.post(CHAT, json=body)
        assert r.status_code == 400 and "too many states" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "response_format"
        with client.stream("POST", CHAT, json=body | {"stream": True}) as r:
            events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert r.status_code == 200 and "too many states" in events[-1]["error"]["message"]
        monkeypatch.undo()  # the server goes on with llguidance's limits
        assert client.post(CHAT, json=body).status_code == 200


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current local time in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


# the Qwen pair's tool calls (a 1.5B model behind a server, 30 s here): in the slow tier, which CI runs; the default
# run checks their paths with SmolLM2 under a Hermes-style template (test_tool_choice_named_required_and_a_tool_
# result_with_smollm2, test_tool_*, test_stop_strings_end_a_replys_content_not_its_calls), though not whether a
# model that knows tools calls one when asked and answers in prose when not
QWEN_TOOLS = pytest.mark.slow

# a Hermes-style template (as Qwen2.5's writes calls and results) for SmolLM2, which has none of its own
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\nYou may call these functions. Reply with <tool_call>{\"name\": NAME, "
    "\"arguments\": ARGS}</tool_call>.\n{%- for t in tools %}{{ t | tojson }}\n{%- endfor %}<|im_end|>\n{%- endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{%- for c in m.tool_calls %}<tool_call>\n"
    "{{ {'name': c.function.name, 'arguments': c.function.arguments} | tojson }}\n</tool_call>{%- endfor %}"
    "<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")


def test_tool_choice_named_required_and_a_tool_result_with_smollm2(smol_engine, monkeypatch):
    """The paths of the Qwen checks below, by default: a named tool_choice end to end (whole and streamed), the
    required grammar's end after `</tool_call>\n` with parallel calls allowed, and a tool result rendered back
    through the template."""
    from starlette.testclient import TestClient

    from localspec.api.tools import HERMES, check_tools, for_template
    from localspec.core.grammar import Grammar, compile_spec

    monkeypatch.setattr(smol_engine.target, "chat_template", lambda: HERMES_TEMPLATE)
    ask = [{"role": "user", "content": "I am flying to Tokyo tomorrow."}]
    named = {"type": "function", "function": {"name": "get_time"}}
    body = {"messages": ask, "tools": [WEATHER, TIME], "tool_choice": named, "max_tokens": 64, "temperature": 0}
    with TestClient(create_app(smol_engine), base_url="http://127.0.0.1") as client:
        r = client.post(CHAT, json=body).json()
        choice = r["choices"][0]
        (call,) = choice["message"]["tool_calls"]
        assert choice["finish_reason"] == "tool_calls" and call["function"]["name"] == "get_time"
        assert set(json.loads(call["function"]["arguments"])) == {"city"}
        with client.stream("POST", CHAT, json=body | {"stream": True}) as s:
            events = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        deltas = [tc for e in events if e["choices"] for tc in e["choices"][0]["delta"].get("tool_calls") or []]
        assert deltas[0]["function"]["name"] == "get_time"
        assert "".join(d["function"].get("arguments") or "" for d in deltas) == call["function"]["arguments"]
        assert events[-1]["choices"][0]["finish_reason"] == "tool_calls"
        # the call and its result go back through the template
        messages = ask + [choice["message"], {"role": "tool", "tool_call_id": call["id"], "content": "18°C, sunny"}]
        r = client.post(CHAT, json={"messages": messages, "tools": [WEATHER, TIME], "max_tokens": 8, "temperature": 0})
        assert r.status_code == 200, r.text
    rendered = smol_engine.render_chat(for_template(messages), tools=[WEATHER, TIME])
    assert "<tool_response>\n18°C, sunny\n</tool_response>" in rendered
    assert json.dumps({"name": "get_time", "arguments": json.loads(call["function"]["arguments"])}) in rendered
    assert r.json()["usage"]["prompt_tokens"] == len(smol_engine.tokenize(rendered, add_special=False))
    # required, parallel calls allowed: the reply may end after a call and the template's line break
    g = Grammar(smol_engine.target, compile_spec(grammar=HERMES.grammar(check_tools([WEATHER]), "required", True,
                                                                         lambda t: None)))
    text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    tokens = smol_engine.target.tokenize(text, add_special=False, parse_special=False)
    assert g.validate(tokens) == len(tokens)
    g.consume(tokens)
    assert g.allowed()[sorted(g.eog)].any()


@pytest.fixture(scope="module")
def qwen_server(qwen_paths, tmp_path_factory):
    """The Qwen pair: its chat template writes Hermes-style <tool_call> calls."""
    s = Server(qwen_paths[0], tmp_path_factory.mktemp("qwen") / "server.log", "--draft", qwen_paths[1],
               "--n-ctx", "2048", "--temperature", "0", fast=True)
    yield s
    s.stop()


@QWEN_TOOLS
def test_tools_auto_calls_when_asked_and_answers_in_prose_when_not(qwen_server):
    client = qwen_server.client()
    r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "What's the weather in "
                                                                                           "Paris right now?"}],
                                       tools=[WEATHER, TIME], max_tokens=96)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Write a haiku about "
                                                                                           "the sea."}],
                                       tools=[WEATHER, TIME], max_tokens=64)
    assert r.choices[0].finish_reason == "stop" and not r.choices[0].message.tool_calls
    assert r.choices[0].message.content and "<tool_call>" not in r.choices[0].message.content


@QWEN_TOOLS
def test_a_stop_string_ends_the_content_not_a_call(qwen_server):
    """stop ["\\n"] with tools: Qwen writes '<tool_call>\\n{...}', and the stop string ended the reply inside
    the call's markup: it came back with neither content nor a call."""
    client = qwen_server.client()
    ask = [{"role": "user", "content": "What's the weather in Paris right now?"}]
    r = client.chat.completions.create(model="any", messages=ask, tools=[WEATHER, TIME], max_tokens=96, stop=["\n"])
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    chunks = list(client.chat.completions.create(model="any", messages=ask, tools=[WEATHER, TIME], max_tokens=96,
                                                 stop="\n", stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert [d.function.name for d in deltas] == ["get_weather"] and chunks[-1].choices[0].finish_reason == "tool_calls"
    # in the content, the stop string ends the reply, and the generation at its token: the usage counts the
    # tokens read up to it (one logprobs entry each), not the rest of their round (counted at first). (The
    # 1.5B model's first line here is '<tools>', echoing its template: any line of content will do.)
    poem = [{"role": "user", "content": "Write a four-line poem about the sea."}]
    for stream in (False, True):
        more = {"stream": True, "stream_options": {"include_usage": True}} if stream else {}
        r = client.chat.completions.create(model="any", messages=poem, tools=[WEATHER, TIME], max_tokens=96,
                                           stop=["\n"], logprobs=True, **more)
        if stream:
            r = list(r)
            content = "".join(c.choices[0].delta.content or "" for c in r if c.choices)
            finish, used = [c.choices[0].finish_reason for c in r if c.choices][-1], r[-1].usage.completion_tokens
            read = sum(len(c.choices[0].logprobs.content) for c in r if c.choices and c.choices[0].logprobs)
        else:
            content, finish, used = r.choices[0].message.content, r.choices[0].finish_reason, r.usage.completion_tokens
            read = len(r.choices[0].logprobs.content)
        assert content and "\n" not in content and finish == "stop" and used == read < 60, (content, used, read)


@QWEN_TOOLS
def test_tools_required_named_and_streamed(qwen_server):
    client = qwen_server.client()
    ask = [{"role": "user", "content": "I am flying to Tokyo tomorrow."}]
    r = client.chat.completions.create(model="any", messages=ask, tools=[WEATHER, TIME], tool_choice="required",
                                       max_tokens=128, parallel_tool_calls=False)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name in ("get_weather", "get_time") and "city" in json.loads(call.function.arguments)
    # parallel calls allowed (the default): the reply still ends after the calls the model means to make (it
    # wrote `</tool_call>\n`, and the grammar then masked the end: calls for other cities until max_tokens)
    r = client.chat.completions.create(model="any", messages=[{"role": "user", "content": "Weather in Paris?"}],
                                       tools=[WEATHER], tool_choice="required", max_tokens=200)
    assert r.choices[0].finish_reason == "tool_calls" and r.usage.completion_tokens < 100
    assert [json.loads(c.function.arguments)["city"] for c in r.choices[0].message.tool_calls] == ["Paris"]
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(model="any", messages=ask, tools=[WEATHER, TIME], tool_choice=named,
                                       max_tokens=128)
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and r.choices[0].finish_reason == "tool_calls"
    stats = stats_of(r)
    assert stats["drafted_forced"] > 0 and stats["accepted_forced"] > 0  # the call's markup was drafted
    chunks = list(client.chat.completions.create(model="any", messages=ask, tools=[WEATHER, TIME],
                                                 tool_choice=named, max_tokens=128, stream=True))
    deltas = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert deltas and deltas[0].index == 0 and deltas[0].function.name == "get_time"
    assert json.loads("".join(d.function.arguments or "" for d in deltas if d.index == 0)) == \
        json.loads(call.function.arguments)
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


@QWEN_TOOLS
def test_a_tool_result_goes_back_through_the_template(qwen_server):
    client = qwen_server.client()
    messages = [{"role": "system", "content": "Use the tool results to answer the user in one sentence."},
                {"role": "user", "content": "What's the weather in Paris?"}]
    r = client.chat.completions.create(model="any", messages=messages, tools=[WEATHER], max_tokens=96,
                                       tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = r.choices[0].message.tool_calls[0]
    messages += [r.choices[0].message.model_dump(exclude_none=True),
                 {"role": "tool", "tool_call_id": call.id, "content": "18°C and sunny"}]
    r = client.chat.completions.create(model="any", messages=messages, tools=[WEATHER], max_tokens=64)
    assert r.choices[0].finish_reason == "stop"
    assert "18" in r.choices[0].message.content and not r.choices[0].message.tool_calls


# ---- predicted outputs, logprobs, include_usage ----
def test_prediction_counts_add_up_and_change_nothing(server, smol_engine):
    client = server.client()
    expected = chat_answer(smol_engine, MESSAGES, 24)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=24,
                                       prediction={"type": "content", "content": expected},
                                       extra_body={"localspec": {"drafter": "ngram"}})
    assert r.choices[0].message.content == expected
    details = r.usage.completion_tokens_details
    stats = stats_of(r)
    assert details.accepted_prediction_tokens == stats["accepted_prediction"] > 0
    assert details.accepted_prediction_tokens + details.rejected_prediction_tokens == stats["drafted_prediction"]
    assert details.accepted_prediction_tokens <= r.usage.completion_tokens
    r = server.client().completions.create(model=MODEL, prompt="The three primary colors are", max_tokens=12,
                                           temperature=0, extra_body={"prediction": " red, green and blue."})
    assert r.usage.completion_tokens_details.accepted_prediction_tokens is not None


def test_logprobs_stream_and_not(server, smol_engine):
    client = server.client()
    want = smol_engine.generate(smol_engine.chat_tokens(MESSAGES), max_tokens=12, temperature=0, logprobs=3)
    r = client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12,
                                       logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == 12 and "".join(c.token for c in content) == r.choices[0].message.content
    assert [c.logprob for c in content] == pytest.approx([lp for lp, _ in want.logprobs], abs=1e-4)
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob for c in content)
    assert bytes(content[0].bytes).decode() == content[0].token
    chunks = list(client.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=0, max_tokens=12,
                                                 logprobs=True, top_logprobs=3, stream=True,
                                                 stream_options={"include_usage": True}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.logprob for e in streamed] == pytest.approx([c.logprob for c in content], abs=1e-4)
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 12
    r = client.completions.create(model=MODEL, prompt="The three primary colors are", max_tokens=6, temperature=0,
                                  logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 6
    assert "".join(lp.tokens) == r.choices[0].text and all(len(t) == 2 for t in lp.top_logprobs)


# ---- the request edge without a server (tier 1) ----
def test_check_text_bounds_nesting_and_names_the_field():
    from localspec.api.request import MAX_DEPTH, ApiError, check_text

    nested = lambda d: json.loads("[" * d + "]" * d)  # noqa: E731
    check_text({"a": [1, {"b": nested(MAX_DEPTH - 2)}]})
    with pytest.raises(ApiError, match="a nests deeper than") as e:
        check_text({"a": [1, {"b": nested(MAX_DEPTH)}]})
    assert e.value.param == "a" and e.value.status == 400
    check_text({"prompt": list(range(1_000_000))})  # numbers are skipped, not walked one by one
    with pytest.raises(ApiError) as e:
        check_text({"messages": [{"content": [{"text": "ok"}, {"text": "\ud800"}]}]})
    assert e.value.param == "messages[0].content[1].text"


def test_a_body_is_refused_by_what_its_parse_would_build_before_it_is_parsed(monkeypatch):
    """8 MiB of '[{},{},...]' in the ignored `metadata` was parsed into 2.8 million objects (620 MB, for a while);
    the body's objects, arrays and values are counted outside its strings first."""
    from localspec.api import request as rq

    loads = []
    monkeypatch.setattr(rq.json, "loads", lambda *a, **k: loads.append(1))  # not reached when refused
    for body, what in [({"metadata": [{}] * (rq.MAX_JSON_CONTAINERS + 1)}, "100,003 JSON objects and arrays"),
                       ({"metadata": [[1, 2]] * (rq.MAX_JSON_CONTAINERS // 2)}, None),
                       ({"prompt": list(range(rq.MAX_JSON_VALUES - 1))}, None),
                       ({"prompt": list(range(rq.MAX_JSON_VALUES))}, "1,048,577 JSON values"),
                       # inside strings, escaped quotes and backslashes included, nothing is counted
                       ({"content": ['a "quoted" {[,]} \\", [{' * 40] * 30_000}, None)]:
        raw = json.dumps(body).encode()
        if what is None:
            rq.check_json_size(raw)
            continue
        with pytest.raises(rq.ApiError) as e:
            rq.check_json_size(raw)
        assert e.value.status == 400 and e.value.code == "request_too_complex" and what in str(e.value)
        assert "at most" in str(e.value)
    assert not loads


def test_tool_parameters_with_defs_and_refs_constrain_the_call(smol_engine):
    """Pydantic's nested models come as $defs + $ref: nested under the call's "arguments" key, '#/$defs/A'
    pointed nowhere and every such tool was refused with a 400."""
    from localspec.core.grammar import Grammar, compile_spec
    from localspec.api.tools import HERMES, ToolError, check_tools

    save = {"type": "function", "function": {"name": "save", "parameters": {
        "type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"],
        "$defs": {"A": {"type": "object", "properties": {"x": {"type": "string"}}, "required": ["x"]}}}}}
    tools = check_tools([save, {"type": "function", "function": {"name": "ping"}}])
    fence = "```json\n{}\n```"
    for choice, text, ok in [("required", '{"name": "save", "arguments": {"a": {"x": "y"}}}', True),
                             ("required", '{"name": "ping", "arguments": {}}', True),
                             ("required", '{"name": "save", "arguments": {"a": {"z": 1}}}', False),
                             ("save", '{"name": "ping", "arguments": {}}', False),
                             # undeclared arguments: a tool without parameters got made-up ones
                             ("required", '{"name": "ping", "arguments": {"dir": "."}}', False),
                             ("required", '{"name": "save", "arguments": {"a": {"x": "y"}, "b": 2}}', False),
                             # auto: a fenced JSON naming no tool is free text (a package.json was forced into a
                             # call), one naming a tool is a call, constrained
                             ("auto", "Here:\n" + fence.format('{"name": "demo", "version": "1.0.0"}'), True),
                             ("auto", fence.format('{"name": "save", "arguments": {"a": {"x": "y"}}}'), True),
                             ("auto", fence.format('{"name": "save", "arguments": {"a": {"z": 1}}}'), False)]:
        g = Grammar(smol_engine.target, compile_spec(grammar=HERMES.grammar(tools, choice, True, lambda t: None)))
        text = text if choice == "auto" else f"<tool_call>\n{text}\n</tool_call>"
        tokens = smol_engine.target.tokenize(text, add_special=False, parse_special=False)
        assert (g.validate(tokens) == len(tokens)) == ok, (choice, text)
    with pytest.raises(ToolError, match="parameters must be a JSON Schema of an object"):
        check_tools([{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}])


def test_tool_call_parser_leaves_odd_json_as_text():
    """Blocks that are JSON but not a call: a name that is an object, nesting past Python's parser."""
    from localspec.api.tools import FORMATS, CallParser

    fmt = FORMATS[0]
    for body in ('{"name": {"first": "Ada"}, "arguments": {}}', "[" * 100_000, '{"name": "g", "arguments": {}}'):
        p = CallParser(fmt, {"f"})
        text = f"{fmt.open}{body}{fmt.close}"
        out = p.feed(text) + [p.finish()]
        assert "".join(o for o in out if isinstance(o, str)) == text and not p.calls
    p = CallParser(fmt, {"f"})
    assert [o.name for o in p.feed(f'{fmt.open}{{"name": "f", "arguments": {{"x": 1}}}}{fmt.close}')] == ["f"]


def test_tool_call_parser_takes_one_call_without_parallel_calls_and_no_trailing_whitespace():
    """parallel_tool_calls false left a second fenced block (free text there, unconstrained) parsed as a call;
    a stream sent the line break after a call as a content delta."""
    from dataclasses import replace

    from localspec.api.tools import HERMES

    call = '```json\n{"name": "f", "arguments": {"x": 1}}\n```'
    p = replace(HERMES, parallel=False).parser([{"function": {"name": "f"}}])
    out = p.feed(call + "\n" + call) + [p.finish()]
    assert len(p.calls) == 1 and "".join(o for o in out if isinstance(o, str)) == call
    p = HERMES.parser([{"function": {"name": "f"}}])
    tagged = f'{HERMES.open}\n{{"name": "f", "arguments": {{}}}}\n{HERMES.close}'
    assert [type(o).__name__ for o in p.feed(tagged)] == ["ToolCall"]
    assert p.feed("\n") == [] and p.feed(" ") == [] and p.finish() == ""   # held, then dropped
    p = HERMES.parser([{"function": {"name": "f"}}])
    assert p.feed(tagged)[1:] == [] and p.feed("\nDone.") == ["Done."]   # held until text follows
    p = HERMES.parser([{"function": {"name": "f"}}])                          # two calls, streamed token by token
    parts = [o for piece in [tagged, "\n", HERMES.open, tagged[len(HERMES.open):], "\n"] for o in p.feed(piece)]
    assert [type(o).__name__ for o in parts + [p.finish()]] == ["ToolCall", "ToolCall", "str"] and p.finish() == ""


def test_tool_call_parser_reads_a_streamed_reply_as_the_whole_one():
    """Whitespace between text and a later call was dropped when they came in different tokens, and the line
    break after a call was content when it came alone: a streamed reply's content differed from the same reply
    read whole."""
    from localspec.api.tools import HERMES

    tagged = f'{HERMES.open}\n{{"name": "f", "arguments": {{}}}}\n{HERMES.close}'
    fence = '```json\n{"name": "f", "arguments": {"x": 1}}\n```'
    bare = '{"name": "f", "arguments": {}}'
    for text, content in [(f"{tagged}\nSome text {tagged}", "Some text "), (f"a {tagged} b {tagged} c", "a  b  c"),
                          (f"Intro:\n\n{tagged}\nThen  \n{fence} end", "Intro:\n\nThen  \n end"),
                          (f"{tagged}\n\n  \n{tagged}\n", ""), (f"{fence}\nand \t{tagged}", "and \t"),
                          (f"{bare}\n\nDone. {tagged}", "Done. ")]:
        for pieces in ([text], list(text)):  # whole, and streamed a character at a time
            p = HERMES.parser([{"function": {"name": "f"}}])
            out = [o for piece in pieces for o in p.feed(piece)] + [p.finish()]
            assert ("".join(o for o in out if isinstance(o, str)), len(p.calls)) == (content, 2), (text, pieces)


def test_tool_call_parser_takes_a_bare_call_at_the_start_of_a_reply():
    """A reply that is only {"name": TOOL, "arguments": {...}} (what Qwen2.5-Coder-0.5B writes under
    tool_choice auto) came back as content; llama.cpp's Hermes parser takes it as a call."""
    from localspec.api.tools import HERMES

    names = [{"function": {"name": "get_weather"}}, {"function": {"name": "get_time"}}]
    bare = '{"name": "get_weather", "arguments": {"city": "Paris \\"}\\" {x}"}}'
    for text, calls, content in [
            (f"  {bare}\n", ["get_weather"], ""),
            (f'{bare}\n{{"name": "get_time", "arguments": {{}}}}', ["get_weather", "get_time"], ""),
            (f"{bare}\nThe weather is on its way.", ["get_weather"], "The weather is on its way."),
            (f"Call it so: {bare}", [], f"Call it so: {bare}"),                   # after text: content
            ('{"name": "Ada", "age": 36}', [], '{"name": "Ada", "age": 36}'),      # not a tool's name
            ('{"title": "get_weather"}', [], '{"title": "get_weather"}'),
            ('{"name": "get_weather", "arguments": {"city": "Pa', [], '{"name": "get_weather", "arguments": {"city": "Pa'),
            ('{"name": "get_weather", "arguments": 5} tail', [], '{"name": "get_weather", "arguments": 5} tail'),
            ('{"name": "get_weather", "arguments": "Paris"}', [], '{"name": "get_weather", "arguments": "Paris"}'),
            ('{"name": "get_weather", "arguments": "{\\"city\\": 1}"}', ["get_weather"], "")]:
        for pieces in ([text], list(text)):  # whole, and streamed a character at a time
            p = HERMES.parser(names)
            out = [o for piece in pieces for o in p.feed(piece)] + [p.finish()]
            assert [c.name for c in p.calls] == calls, (text, pieces is text)
            assert "".join(o for o in out if isinstance(o, str)).strip() == content
    p = HERMES.parser(names)
    assert p.feed('{"na') == [] and p.feed('me": "get_w') == [] and p.feed('x"') == ['{"name": "get_wx"']
    p = HERMES.parser(names)  # the text after a bare call, as after a tagged one: its line break is not content
    assert [type(o).__name__ for o in p.feed(bare + "\nDone.")] == ["ToolCall", "str"] and p.finish() == ""
    assert p.feed("") == [] and "".join(o for o in HERMES.parser(names).feed(bare + "\nDone.") if isinstance(o, str)) == "Done."


def test_a_bad_tool_schema_names_its_tool():
    """The 400 named only "tools" and dumped the whole call grammar, other tools' schemas included."""
    from localspec.api.request import ApiError, structured

    good = {"type": "function", "function": {"name": "g"}}
    bad = {"type": "function", "function": {"name": "f", "parameters": {
        "type": "object", "properties": {"a": {"type": "strnig"}}}}}
    for choice in ("auto", "none"):
        with pytest.raises(ApiError) as e:
            structured(tools=[good, bad], tool_choice=choice, template="<tool_call>")
        assert e.value.param == "tools[1].function.parameters" and "(f)" in str(e.value)
        assert "tagged" not in str(e.value) and len(str(e.value)) < 400


def whole(shape, events, stats) -> dict:
    """The whole (not streamed) response of `shape` to these events."""
    for ev in events:
        shape.add(ev)
    return shape.response(stats)


def test_a_reply_cut_short_inside_a_call_says_length_and_shows_no_markup():
    """max_tokens ending a reply inside its second call: finish_reason said "tool_calls" and the half-written
    '<tool_call>{"name": ...' came back as content, to be shown to the user."""
    from localspec.core.stream import Event
    from localspec.api.shapes import Chat
    from localspec.api.tools import FORMATS

    fmt, tools = FORMATS[0], [{"type": "function", "function": {"name": n}} for n in ("f", "g")]
    text = 'Sure.\n<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>\n<tool_call>\n{"name": "g", "argu'
    stats = SimpleNamespace(finish_reason="length", to_dict=lambda: {}, prompt_tokens=5, generated=20,
                            prompt_reused=0, accepted_prediction=0, drafted_prediction=0)
    events = [Event(0, ch, False) for ch in text]
    r = whole(Chat("m", fmt, tools), events, stats)["choices"][0]
    assert r["finish_reason"] == "length" and r["message"]["content"] == "Sure."
    assert [c["function"]["name"] for c in r["message"]["tool_calls"]] == ["f"]
    shape = Chat("m", fmt, tools)
    chunks = [c for ev in events for c in shape.chunks(ev)] + shape.final_chunks(stats)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks).strip() == "Sure."
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and "usage" not in chunks[-1]  # not asked for
    stats.finish_reason = "stop"
    assert whole(Chat("m", fmt, tools), events[:text.index("\n<tool_call>\n{\"name\": \"g")], stats)[
        "choices"][0]["finish_reason"] == "tool_calls"


def test_stop_strings_end_a_replys_content_not_its_calls():
    """A stop string such as "\\n" ended a reply inside its call's markup ('<tool_call>\\n{...'): the call was
    dropped and the reply said "stop" with nothing in it. With calls parsed, stop strings end the content."""
    from localspec.core.stream import Event
    from localspec.api.shapes import Chat, chat_completion
    from localspec.api.tools import FORMATS

    fmt, tools = FORMATS[0], [{"type": "function", "function": {"name": n}} for n in ("f", "g")]
    call = '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>'

    def stats(reason):
        return SimpleNamespace(finish_reason=reason, to_dict=lambda: {"finish_reason": reason}, prompt_tokens=5,
                               generated=20, prompt_reused=0, accepted_prediction=0, drafted_prediction=0)

    # the engine's finish_reason: a stop string in the content cancels the engine's stream
    for text, stop, content, calls, finish, ended in [
            (call, ["\n"], None, ["f"], "tool_calls", "stop"),
            (f"Sure. {call}\nDone. Bye", ["."], "Sure", [], "stop", "cancelled"),   # the content ends first
            (f"xa{call}\nab", ["ab"], "xa", ["f"], "tool_calls", "cancelled"),     # 'a' held: a call follows
            (f"x\n{call}", ["\n"], "x", [], "stop", "cancelled")]:
        events = [Event(0, ch, False) for ch in text]
        engine = stats(ended)
        r = whole(Chat("m", fmt, tools, stop=stop), events, engine)
        assert r["choices"][0]["message"]["content"] == content, text
        assert [c["function"]["name"] for c in r["choices"][0]["message"].get("tool_calls", [])] == calls
        assert r["choices"][0]["finish_reason"] == finish and r["localspec"]["finish_reason"] in ("stop", "cancelled")
        shape = Chat("m", fmt, tools, stop=stop)
        chunks = [c for ev in events for c in shape.chunks(ev)] + shape.final_chunks(engine)
        deltas = [c["choices"][0]["delta"] for c in chunks]
        assert "".join(d.get("content") or "" for d in deltas).strip() == (content or "")
        assert [d["tool_calls"][0]["function"]["name"] for d in deltas if "tool_calls" in d] == calls
        assert chunks[-1]["choices"][0]["finish_reason"] == finish

    class Stream:  # the engine's stream: read until the stop string, then closed
        def __init__(self, text):
            self.text, self.read, self.closed, self.stats = text, 0, False, stats("cancelled")

        def __iter__(self):
            for ch in self.text:
                self.read += 1
                yield Event(0, ch, False)

        def close(self):
            self.closed = True

    s = Stream(f"Sure. Bye {call}")
    r = chat_completion("m", s, fmt, tools, stop=[". "])
    assert s.closed and s.read == len("Sure. ") and r["choices"][0]["message"]["content"] == "Sure"
    assert r["choices"][0]["finish_reason"] == r["localspec"]["finish_reason"] == "stop"


def test_a_template_that_fails_on_odd_input_is_a_chat_error():
    from localspec.core.chat_template import ChatError, render

    with pytest.raises(ChatError, match="TypeError"):
        render("{{ messages[0].content + 1 }}", [{"role": "user", "content": "x"}])
    deep = []
    for _ in range(5000):
        deep = [deep]
    with pytest.raises(ChatError, match="RecursionError"):
        render("{{ tools | tojson }}", [{"role": "user", "content": "x"}], tools=[deep])


def test_token_pieces_read_from_two_threads_at_once_are_each_right(smol_engine):
    target = smol_engine.target
    ids = list(range(0, target.n_vocab, 3))
    want = [target.piece(t) for t in ids]
    with ThreadPoolExecutor(4) as pool:
        got = list(pool.map(lambda _: [target.piece(t) for t in ids], range(4)))
    assert all(g == want for g in got)


def test_tool_arguments_hold_declared_keys_unless_the_schema_says_otherwise():
    from localspec.api.tools import _params

    def f(parameters=None):
        return _params({"function": {"name": "f"} | ({"parameters": parameters} if parameters is not None else {})})

    assert f() == {"type": "object", "additionalProperties": False}
    assert f({"type": "object", "properties": {"a": {}}})["additionalProperties"] is False
    for says in ({"additionalProperties": True}, {"$ref": "#/$defs/A"}, {"anyOf": []}, {"patternProperties": {}},
                 {"required": ["b"], "properties": {"a": {}}}):  # a required key it does not declare: left alone
        assert "additionalProperties" not in f({"type": "object"} | says) or says.get("additionalProperties")


# ---- a hostile local program: idle senders, requests that must fail, requests HTTP cannot parse ----
def test_idle_senders_never_lock_out_a_client(server):
    """64 connections that sent headers with a Content-Length and then nothing made every API request a 503
    queue_full for 30 s (each counted from its first byte). A request now counts by the bytes of its body that
    have arrived: 80 such connections hold nothing, and a client is served meanwhile."""
    idle = []
    try:
        for _ in range(80):
            sock = socket.create_connection(("127.0.0.1", server.port), timeout=30)
            sock.sendall(f"POST {COMPLETIONS} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {KEY}\r\n"
                         "Content-Type: application/json\r\nContent-Length: 100\r\n\r\n".encode())
            idle.append(sock)
        r = httpx.post(server.url + COMPLETIONS, headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                       json={"prompt": "Hello", "max_tokens": 2})
        assert r.status_code == 200, r.text
        assert server.health()["status"] == "ok"
    finally:
        for sock in idle:
            sock.close()


def test_what_will_fail_is_refused_on_arrival_not_at_the_head_of_the_queue(server):
    """A schema that refers to itself and out-of-vocabulary token ids were accepted, waited their turn (behind a
    long generation), then failed: they are 400s before the generation running meanwhile has ended."""
    long = {"prompt": COUNTING, "max_tokens": 300, "temperature": 0}
    auth = {"Authorization": f"Bearer {KEY}"}
    ended = []
    t = threading.Thread(target=lambda: ended.append(
        (httpx.post(server.url + COMPLETIONS, json=long, headers=auth, timeout=120), time.monotonic())), daemon=True)
    t.start()
    deadline = time.monotonic() + 30
    while not server.health()["busy"]:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    selfref = {"$defs": {"a": {"$ref": "#/$defs/a"}}, "$ref": "#/$defs/a"}
    refused = [
        (CHAT, {"messages": MESSAGES, "response_format": {"type": "json_schema",
                                                         "json_schema": {"name": "a", "schema": selfref}}}, None),
        (COMPLETIONS, {"prompt": [999999999]}, "prompt"),
        (COMPLETIONS, {"prompt": [-1]}, "prompt"),
        (COMPLETIONS, {"prompt": [1, 2, 49152]}, "prompt"),
    ]
    answered = []
    for path, body, param in refused:
        r = httpx.post(server.url + path, json=body, headers=auth, timeout=60)
        answered.append(time.monotonic())
        assert r.status_code == 400, (body, r.text)
        if param:
            assert r.json()["error"]["param"] == param and "outside the vocabulary" in r.json()["error"]["message"]
    t.join(120)
    (response, end), = ended
    assert response.status_code == 200 and response.json()["usage"]["completion_tokens"] > 100
    assert max(answered) < end, "a refusal waited for the running generation"


@pytest.mark.parametrize("head", ["Content-Length: -5", "Content-Length: abc", "(no Host header)"])
def test_requests_http_cannot_parse_get_an_openai_error_object(server, head):
    """uvicorn answered these with plain text; every other refusal is an OpenAI error object."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        lines = "" if head.startswith("(") else f"Host: 127.0.0.1\r\n{head}\r\n"
        sock.sendall(f"POST {CHAT} HTTP/1.1\r\n{lines}Content-Type: application/json\r\n\r\n".encode())
        data = b""
        while chunk := sock.recv(65536):
            data += chunk
    status, _, rest = data.partition(b"\r\n")
    assert status.startswith(b"HTTP/1.1 400"), data
    body = json.loads(rest.partition(b"\r\n\r\n")[2])
    assert body["error"]["code"] == "invalid_http_request" and body["error"]["type"] == "invalid_request_error"


def test_each_api_key_has_its_own_history_and_a_request_may_opt_out(smol_engine, monkeypatch):
    """With several keys (one per app) and a history, a key's outputs are kept in its own scope, so they never
    draft another key's requests; localspec.history=false keeps a request out of it."""
    import hashlib

    from starlette.testclient import TestClient

    from localspec.core.history import History

    monkeypatch.setattr(smol_engine, "history", History(4))
    body = {"messages": MESSAGES, "temperature": 0, "max_tokens": 8}
    with TestClient(create_app(smol_engine, api_key=("app-one", "app-two")), base_url="http://127.0.0.1") as client:
        one, two = ({"Authorization": f"Bearer {k}"} for k in ("app-one", "app-two"))
        assert client.post(CHAT, json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
        assert client.post(CHAT, json=body | {"localspec": {"history": False}}, headers=two).status_code == 200
        assert not [c for c in smol_engine.history._caches.values() if c.size]  # opted out: nothing kept
        assert client.post(CHAT, json=body, headers=one).status_code == 200
        kept = {scope: c.size for scope, c in smol_engine.history._caches.items() if c.size}
        assert list(kept) == ["key-" + hashlib.sha256(b"app-one").hexdigest()[:16]]
        r = client.post(CHAT, json=body | {"localspec": {"history": "no"}}, headers=one)
        assert r.status_code == 400 and r.json()["error"]["param"] == "localspec.history"
