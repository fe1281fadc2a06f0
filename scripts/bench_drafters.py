#!/usr/bin/env python3
"""Side-by-side speed of each drafter against plain decoding, and llama-cpp-python's own prompt lookup.

Greedy, same threads, same max_tokens, every method on every prompt in turn (interleaved), caches cleared
between runs so no method reuses another's prompt. Tokens/s counts from the first emitted token to the
last (prompt processing excluded, for every method alike). Ratios are to plain in the same run.

    python scripts/bench_drafters.py --target T.gguf --draft D.gguf [--prompts FILE] [--max-tokens 256]
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import localspec

ROOT = Path(__file__).resolve().parents[1]


def timed(events):
    """(tokens, text, seconds from the first token to the last)."""
    toks, text, t_first = [], [], None
    for tok, piece in events:
        if t_first is None:
            t_first = time.perf_counter()
        toks.append(tok)
        text.append(piece)
    return toks, "".join(text), time.perf_counter() - t_first if t_first else 0.0


def run_ours(llm, prompt, method, max_tokens, k):
    for m in (llm.target, llm.draft):
        m.truncate(0)
    s = llm.stream(prompt, max_tokens=max_tokens, temperature=0, drafter=method, k=k)
    toks, text, secs = timed((e.token, e.text) for e in s)
    return toks, text, secs, s.stats


def run_peer(peer, prompt, max_tokens):
    peer.reset()
    chunks = peer.create_completion(prompt, max_tokens=max_tokens, temperature=0.0, repeat_penalty=1.0,
                                    stream=True)
    toks, text, secs = timed((None, c["choices"][0]["text"]) for c in chunks)
    return toks, text, secs, None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", required=True)
    ap.add_argument("--draft", required=True)
    ap.add_argument("--prompts", default=str(ROOT / "localspec" / "prompts.jsonl"))
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("-k", type=int, default=4)
    ap.add_argument("--peer", type=int, nargs="*", default=[2, 10], help="num_pred_tokens of the peer runs")
    ap.add_argument("--json", help="write the raw results here")
    a = ap.parse_args()

    from llama_cpp import Llama
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    llm = localspec.load(target=a.target, draft=a.draft, n_ctx=4096, n_threads=a.threads)
    peers = {f"llama-cpp-python N={n}": Llama(a.target, n_ctx=4096, n_threads=a.threads, n_threads_batch=a.threads,
                                              draft_model=LlamaPromptLookupDecoding(num_pred_tokens=n),
                                              verbose=False) for n in a.peer}
    methods = ["none", "model", "ngram", "hybrid", *peers]
    prompts = [json.loads(line) for line in Path(a.prompts).read_text().splitlines() if line.strip()]
    results = []
    for p in prompts:
        tokens = llm.chat_tokens(p["messages"])
        run_ours(llm, tokens, "none", 8, a.k)  # warm-up
        row = {"id": p["id"], "kind": p.get("kind", "")}
        for m in methods:
            if m in peers:
                toks, text, secs, stats = run_peer(peers[m], tokens, a.max_tokens)
            else:
                toks, text, secs, stats = run_ours(llm, tokens, m, a.max_tokens, a.k)
            tps = (len(toks) - 1) / secs if secs > 0 else 0.0
            row[m] = {"tps": tps, "tokens": len(toks), "text": text,
                      "acceptance": stats.acceptance_rate if stats and stats.drafted else None,
                      "mean_accepted": stats.mean_accepted if stats and stats.drafted else None}
            print(f"{p['id']:16s} {m:24s} {tps:6.1f} tok/s  {len(toks)} tokens", file=sys.stderr, flush=True)
        for m in methods:
            row[m]["ratio"] = row[m]["tps"] / row["none"]["tps"]
            row[m]["same_as_plain"] = row[m]["text"] == row["none"]["text"]
        results.append(row)

    print(f"\n| prompt | {' | '.join(methods)} |")
    print("|---" * (len(methods) + 1) + "|")
    for row in results:
        cells = []
        for m in methods:
            r = row[m]
            cell = f"{r['tps']:.1f}" if m == "none" else f"{r['tps']:.1f} ({r['ratio']:.2f}x)"
            if r["acceptance"] is not None:
                cell += f" acc {r['acceptance']:.0%}, {r['mean_accepted']:.2f}/round"
            if m != "none" and not r["same_as_plain"]:
                cell += " ≠plain"
            cells.append(cell)
        print(f"| {row['id']} | {' | '.join(cells)} |")
    geo = {m: math.exp(sum(math.log(r[m]["ratio"]) for r in results) / len(results)) for m in methods}
    print(f"| geometric mean of ratios | {' | '.join(f'{geo[m]:.2f}x' for m in methods)} |")
    if a.json:
        Path(a.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
