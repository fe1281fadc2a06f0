"""Concurrent clients against `localspec serve` and against llama.cpp's own server, on one machine, in one run.

    python scripts/bench_concurrency.py [--concurrency 1,2,4,8] [--max-tokens 64] [--pair NAME]
        [--workload shipped|stream|shared-head] [--llama-server PATH] [--out results.json]

Each system serves the pair's target (ours with its draft model), and `c` clients each send the workload's
prompts (rendered once with the model's chat template, sent as /v1/completions text, so both servers read the
same tokens) one after another until all are answered, streamed, at temperature 0. Workloads: `shipped`, the
8 shipped bench prompts; `stream`, those and the 15 held-out ones (scripts/holdout_prompts.jsonl), 23 in all:
a longer stream of requests, in which the end of the burst (fewer requests left than clients, longer the more
their speeds differ, as speculation makes them) weighs less; `shared-head`, 8 short questions under one
~800-token system prompt (an agent's instructions and tools, an app's document), as sub-agents or parallel tool
calls send them:
  queue      localspec serve --parallel 1 (one request at a time, the rest wait: what serve did before)
  plain-N    localspec serve --parallel c --drafter none (batched plain decoding)
  auto-N     localspec serve --parallel c --drafter auto (batched, auto drafting)
  llama-N    llama-server -np c --kv-unified (the peer; same threads, flash attention off, batch sizes, context
             per request; built by scripts/build_llama_server.sh from the llama.cpp that llama-cpp-python carries)
Reported per system and concurrency: aggregate tokens/s (all output tokens / wall time), tokens/s per request
(its tokens / its time), time to first token (mean and worst, and the worst against the same prompt sent
alone, with its floor: the least any server can give the first c prompts arriving together where prefill is
compute bound, see ttft_floor), and the ratio to the queue. Two ceilings from the calibrated batch surface
(localspec calibrate's costs), T_c(c) being a decode of c sequences' one token each:
  decode     c x T(1) / T_c(c): what batched plain decoding gains at most while every client is decoding;
  +prefill   against the queue's own run alone (its wall time W, of which P before first tokens, the prompts'
             prefill): W / (P + N x t / (decode ceiling)) for its N output tokens, t being a plain decoding
             step as batched plain decoding's run alone measured it (W - P of that run, per token; T(1) where
             plain was not run): the prefill taken as it was (compute bound, so batching does not shrink it)
             and every token decoded c at a time. About what batched plain decoding gains over the queue at
             most (an estimate: the surface is measured at one depth); speculation beside it may add to it.
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


SHARED_HEAD_QUESTIONS = ["Summarise this in one sentence.", "What does the target model do?",
                         "Name one option it mentions.", "Is it offline? Answer yes or no.",
                         "What is the draft model for?", "Give the project's name.", "List two of its features.",
                         "Who is it for?"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(port: int, proc: subprocess.Popen, timeout: float = 600) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("server did not come up")


def complete(port: int, prompt: str | list[int], max_tokens: int, timeout: float = 900) -> dict:
    """One streamed /v1/completions request (prompt: text or token ids): its time to first token, its seconds
    and tokens, and what its chunks carried last of `usage`, llama-server's `timings` and localspec's stats."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                       "stream_options": {"include_usage": True}}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    t0 = time.perf_counter()
    first, chunks, carried = None, 0, {}
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for line in r:
            line = line.strip()
            if not line.startswith(b"data: ") or line == b"data: [DONE]":
                continue
            d = json.loads(line[6:])
            carried |= {k: d[k] for k in ("usage", "timings", "localspec") if d.get(k)}
            if d.get("choices") and d["choices"][0].get("text"):
                chunks += 1
                if first is None:
                    first = time.perf_counter()
    end = time.perf_counter()
    tokens = carried["usage"]["completion_tokens"] if "usage" in carried else chunks
    return {"ttft": (first or end) - t0, "seconds": end - t0, "tokens": tokens, **carried}


def run_clients(port: int, prompts: list[str], clients: int, max_tokens: int) -> dict:
    todo: queue.Queue = queue.Queue()
    for i, p in enumerate(prompts):
        todo.put((i, p))
    out: dict[int, dict] = {}

    def client() -> None:
        while True:
            try:
                i, p = todo.get_nowait()
            except queue.Empty:
                return
            out[i] = complete(port, p, max_tokens)

    t = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    wall = time.perf_counter() - t
    rows = [out[i] for i in range(len(prompts))]
    return {"wall": wall, "tokens": sum(r["tokens"] for r in rows), "aggregate": sum(r["tokens"] for r in rows) / wall,
            "per_request": statistics.mean(r["tokens"] / r["seconds"] for r in rows),
            "ttft_mean": statistics.mean(r["ttft"] for r in rows), "ttft_max": max(r["ttft"] for r in rows),
            "ttfts": [r["ttft"] for r in rows]}


def ttft_floor(alone: list[float]) -> float:
    """The lowest worst-client time to first token against alone that any server can give prompts that arrive
    together, where a prompt's prefill takes the machine its time alone whatever runs beside it (compute bound,
    a CPU's case): whichever prompt's first token comes last waited for all of them, and taking them shortest
    first puts the least of that on any one (a lower bound: the rounds of requests already answering are left
    out)."""
    waited, worst = 0.0, 1.0
    for a in sorted(alone):
        waited += a
        worst = max(worst, waited / a)
    return worst


def serve(cmd: list[str], port: int, log: Path):
    proc = subprocess.Popen(cmd, stdout=open(log, "ab"), stderr=subprocess.STDOUT)
    wait_ready(port, proc)
    return proc


def _num(v: float) -> float | None:
    """v for JSON: None where the run it needs was not asked for (NaN is not JSON)."""
    return None if v != v else v


def _x(v: float, width: int, digits: int) -> str:
    """A ratio as the table prints it; "n/a" where the run it needs was not asked for (no queue system)."""
    return f"{v:>{width - 1}.{digits}f}x" if v == v else f"{'n/a':>{width}}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--concurrency", default="1,2,4,8")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--pair", default=None)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--n-ctx", type=int, default=2048, help="context per request (both servers)")
    ap.add_argument("--llama-server", default=None, help="the peer's binary (default: scripts/build_llama_server.sh's)")
    ap.add_argument("--systems", default="queue,plain,auto,llama")
    ap.add_argument("--workload", choices=("shipped", "stream", "shared-head"), default="shipped")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()

    import localspec
    from localspec.core.llama import default_threads
    from localspec.store.download import resolve_pair

    levels = [int(c) for c in args.concurrency.split(",")]
    threads = args.threads or default_threads()
    spec, target, draft = resolve_pair(args.pair)
    if args.workload in ("shipped", "stream"):
        files = [ROOT / "localspec" / "apps" / "prompts.jsonl"]
        files += [ROOT / "scripts" / "holdout_prompts.jsonl"] if args.workload == "stream" else []
        records = [json.loads(line) for f in files for line in f.read_text().splitlines() if line.strip()]
    else:
        head = (ROOT / "localspec" / "store" / "probe_text.txt").read_text()[:3000]
        records = [{"messages": [{"role": "system", "content": head}, {"role": "user", "content": q}]}
                   for q in SHARED_HEAD_QUESTIONS]
    with localspec.load(pair=args.pair, n_ctx=args.n_ctx, n_threads=threads, parallel=max(levels)) as llm:
        prompts = [llm.render_chat(r["messages"]) for r in records]
        costs = llm.calibration()
        # llama.cpp's extra weight layouts as our target loaded (off where this build's AMX kernels crash)
        repack = [] if llm.target.extra_bufts else ["--no-repack"]
    systems = args.systems.split(",")
    peer = args.llama_server
    if "llama" in systems and peer is None:
        peer = subprocess.run(["bash", str(ROOT / "scripts" / "build_llama_server.sh"), sys.executable],
                              check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
    log = Path(os.environ.get("TMPDIR", "/tmp")) / "bench_concurrency.log"
    print(f"{len(prompts)} prompts ({args.workload}), {args.max_tokens} tokens each, {threads} threads, "
          f"n_ctx {args.n_ctx} per request; server logs in {log}", file=sys.stderr)
    ours = [sys.executable, "-m", "localspec", "serve", "--target", str(target), "--draft", str(draft),
            "--n-ctx", str(args.n_ctx), "--threads", str(threads), "--flash-attn", "off", "--queue-size", "64",
            # batching measured, not the prompt cache: with it, every server after the first would restore the
            # prompts the first one kept on disk (the peer keeps nothing across processes)
            "--no-prompt-cache"]
    results: dict[str, dict[int, dict]] = {}

    def measure(name: str, cmd: list[str], port: int, c: int) -> None:
        proc = serve(cmd, port, log)
        try:
            complete(port, "Hello", 8)  # warm-up (not a measured prompt: none starts with its cache filled)
            r = run_clients(port, prompts, c, args.max_tokens)
        finally:
            proc.terminate()
            proc.wait()
        results.setdefault(name, {})[c] = r
        print(f"  {name:>6} c={c}: {r['aggregate']:.2f} tok/s in all, {r['per_request']:.2f} per request, "
              f"TTFT mean {r['ttft_mean']:.2f} s max {r['ttft_max']:.2f} s", file=sys.stderr, flush=True)

    for c in levels:
        for system in systems:
            port = free_port()
            if system == "queue":
                cmd = ours + ["--parallel", "1", "--drafter", "auto", "--port", str(port)]
            elif system in ("plain", "auto"):
                cmd = ours + ["--parallel", str(c), "--drafter", "none" if system == "plain" else "auto",
                              "--port", str(port)]
            else:
                cmd = [peer, "-m", str(target), "-t", str(threads), "-tb", str(threads), "-c", str(args.n_ctx * c),
                       "-np", str(c), "--kv-unified", "-fa", "off", "-b", "512", "-ub", "512", "--port", str(port),
                       "--no-webui", *repack]
            measure(system, cmd, port, c)

    alone = results.get("queue", {}).get(1)
    plain = results.get("plain", {}).get(1)
    step = ((plain["wall"] - sum(plain["ttfts"])) / plain["tokens"]) if plain else costs.verify_cost(1, 256)
    print(f"\n{'system':>8} {'c':>3} {'tok/s all':>10} {'x queue':>8} "
          f"{'tok/s each':>11} {'TTFT mean':>10} {'TTFT max':>9} {'max/alone':>10} {'floor':>6} {'ceiling':>8} "
          f"{'+prefill':>9}")
    bounds = {}
    for c in levels:
        q = results.get("queue", {}).get(c)
        ceiling = c * costs.verify_cost(1, 256) / costs.batch_cost(c, 256, c)
        with_prefill = (alone["wall"] / (sum(alone["ttfts"]) + alone["tokens"] * step / ceiling)) if alone \
            else float("nan")
        floor = ttft_floor(alone["ttfts"][:c]) if alone else float("nan")
        bounds[c] = {"ceiling": ceiling, "ceiling_with_prefill": _num(with_prefill), "ttft_floor": _num(floor)}
        for system in systems:
            r = results[system][c]
            worst = max(t / a for t, a in zip(r["ttfts"], alone["ttfts"])) if alone else float("nan")
            ratio = r["aggregate"] / q["aggregate"] if q else float("nan")
            r |= {"x_queue": _num(ratio), "ttft_worst_over_alone": _num(worst)}  # (in --out's JSON)
            print(f"{system:>8} {c:>3} {r['aggregate']:>10.2f} {_x(ratio, 8, 2)} {r['per_request']:>11.2f} "
                  f"{r['ttft_mean']:>9.2f}s {r['ttft_max']:>8.2f}s {_x(worst, 10, 1)} {_x(floor, 6, 1)} "
                  f"{_x(ceiling, 8, 2)} {_x(with_prefill, 9, 2)}")
    if args.out:
        Path(args.out).write_text(json.dumps({"levels": levels, "workload": args.workload,
                                              "max_tokens": args.max_tokens, "threads": threads, "results": results,
                                              "bounds": bounds, "batch": costs.batch}, indent=1))


if __name__ == "__main__":
    main()
