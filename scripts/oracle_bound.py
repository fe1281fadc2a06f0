#!/usr/bin/env python3
"""How fast could n-gram speculation possibly be here? An upper bound from an oracle that knows the future.

For each prompt, greedy plain decoding gives the output; at every position the n-gram lookup (the one
`auto` uses) proposes a continuation, and we know how many of its tokens the target would accept. With this
machine's measured verify costs (localspec's calibration), dynamic programming picks, position by position,
the best choice between a plain step and a draft of any length. No real policy can beat the result: it
is the speedup ceiling of n-gram drafting on this machine, to be read beside `localspec bench`.

Beside it, the same outputs replayed through the `auto` policy (a fresh one per prompt, as each request
gets), with the same costs: what the policy captures of the ceiling, free of timing noise. Costs are priced
at the context depth where each step happens, as `auto` prices them.

    python scripts/oracle_bound.py [--pair NAME | --target T --draft D] [--max-tokens 256] [--threads 2]
"""
from __future__ import annotations

import argparse
import json
import math

import localspec
from localspec.bench import load_prompts
from localspec.drafters import AutoDrafter, NgramDrafter


def agreed(guess, actual) -> int:
    """How many leading tokens of a guess the actual continuation confirms."""
    return next((i for i, (x, y) in enumerate(zip(guess, actual)) if x != y), min(len(guess), len(actual)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--pair")
    ap.add_argument("--target")
    ap.add_argument("--draft")
    ap.add_argument("--prompts")
    ap.add_argument("--max-tokens", type=int, default=256)
    ap.add_argument("--threads", type=int)
    ap.add_argument("-k", type=int, default=16, help="longest draft considered (auto's default k)")
    a = ap.parse_args()
    kw = {"target": a.target, "draft": a.draft} if a.target else {"pair": a.pair}
    llm = localspec.load(n_threads=a.threads, **kw)
    costs = llm.calibration()
    lookup = NgramDrafter(n_min=1, n_max=8).lookup
    ratios, replays = [], []
    for p in load_prompts(a.prompts):
        prompt = llm.chat_tokens(p["messages"])
        out = llm.generate(prompt, max_tokens=a.max_tokens, temperature=0, drafter="none").tokens
        seq = prompt + out
        n = len(out)

        def c(k: int, t: int) -> float:  # a verify of k tokens after the prompt and out[:t]
            return costs.verify_cost(k, len(prompt) + t)

        # best[t]: least time to produce out[t:], from the state where out[:t] is known
        best = [0.0] * (n + 1)
        for t in range(n - 1, -1, -1):
            ctx = seq[:len(prompt) + t]
            _, cont = lookup(ctx, a.k)
            m = agreed(cont, out[t:])
            options = [c(1, t) + best[t + 1]]
            for kk in range(1, len(cont) + 1):
                gained = min(min(m, kk) + 1, n - t)
                options.append(c(kk + 1, t) + best[t + gained])
            best[t] = min(options)
        plain = sum(c(1, t) for t in range(n))
        ratio = plain / best[0]
        ratios.append(ratio)
        auto, t, spent = AutoDrafter(costs, NgramDrafter(n_min=1, n_max=8), None), 0, 0.0
        while t < n:
            d = auto.propose(seq[:len(prompt) + t], min(a.k, n - t - 1)).tokens
            t, spent = t + agreed(d, out[t:]) + 1, spent + c(len(d) + 1, t)
        replays.append(plain / spent)
        print(f"{p['id']:18s} oracle n-gram speedup ceiling {ratio:.2f}x, auto replayed {replays[-1]:.2f}x, "
              f"over {n} tokens")
    gm = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
    print(f"geometric mean: ceiling {gm(ratios):.2f}x, auto replayed {gm(replays):.2f}x; "
          f"costs: " + ", ".join(f"verify({n}) {costs.verify_cost(n) * 1e3:.1f} ms" for n in (1, 2, 5, 17)))
    print(json.dumps({"verify_ms": {n: round(costs.verify_cost(n) * 1e3, 1) for n in (1, 2, 3, 5, 9, 17, 33)}}))


if __name__ == "__main__":
    main()
