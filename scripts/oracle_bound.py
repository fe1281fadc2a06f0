#!/usr/bin/env python3
"""How fast could speculation possibly be here, and how much of that does `auto` capture? Free of timing noise.

`record` runs plain greedy decoding once per prompt (constrained to the prompt's schema when it has one) and
saves the outputs, this host's measured costs (localspec's calibration) and, with --draft-proposals, the draft
model's own greedy proposals at every position (with its top probabilities, for p_min).

`replay` then prices, with a cost curve — this host's, or one measured on another host (MODELS.md) —
  - the ceiling: dynamic programming with perfect foresight over what could be drafted at each position
    (the tokens a grammar forces, an n-gram continuation, the draft model's proposal), choosing per position
    a plain step or a draft of any length, a draft-model round paying what it pays `auto` (below); and the
    ceiling without the draft model;
  - `auto`, fed the same outputs, making its own decisions as in a live run;
  - the fixed drafters: none, ngram k 4, ngram k 16, model k 4;
  - with --history, the ceiling and auto where each prompt may also draft from the outputs of the prompts before
    it in the file (what an engine with history_mb would hold): oracle-hist and auto-hist;
and, once, the draft model's profile as model k 4: how often it drafts, how much, how much of that holds.
A draft-model round also pays for catching the draft's cache up over the tokens since it last ran, the prompt
included: nothing is prefilled for free (the cost per token measured by the calibration; a quarter of a draft
step on curves that lack it).

    python scripts/oracle_bound.py record --prompts shipped --out runs.json [--draft-proposals] [--threads 2]
    python scripts/oracle_bound.py replay runs.json [--costs host|amd1|amd2|intel|zen1|all] [--history]
"""
from __future__ import annotations

import argparse
import json
import math
import re
import sys
from dataclasses import asdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from localspec.apps.bench import EDITS, HISTORY, PROMPTS, STRUCTURED, load_prompts  # noqa: E402
from localspec.core.costs import Costs  # noqa: E402
from localspec.core.defaults import K_AUTO, K_PREDICTION  # noqa: E402
from localspec.core.auto import AutoDrafter, vocab_kinds  # noqa: E402
from localspec.core.drafters import Draft, NgramDrafter, Prediction  # noqa: E402
from localspec.core.history import PROMPT_TAIL, Learned, SuffixCache  # noqa: E402

HOLDOUT = Path(__file__).with_name("holdout_prompts.jsonl")
SETS = {"shipped": PROMPTS, "holdout": HOLDOUT, "structured": STRUCTURED,
        "holdout-structured": Path(__file__).with_name("holdout_structured.jsonl"), "edit": EDITS,
        "history": HISTORY}
K = K_AUTO  # longest draft considered (auto's default bound; with a prediction, K_PREDICTION)
SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 17, 24, 33)


def curve(points: dict[int, float], draft_ms: float, per_row_ms: float = 0.0, fill_ms: float | None = None) -> Costs:
    """A cost curve measured at one depth: ms per target decode of n tokens -> Costs."""
    ns, ms = zip(*sorted(points.items()))
    verify = np.interp(SIZES, ns, ms) + per_row_ms * (np.array(SIZES) - 1)
    return Costs(SIZES, (256,), (tuple(verify / 1e3),), (draft_ms / 1e3,), 0.0,
                 (fill_ms / 1e3,) if fill_ms is not None else None)


# ../shared/MODELS.md. amd1 is llama-bench's pp-n (logits for the last row only) plus 3.6 ms per other row,
# as measured per row in a 16-row batch on an AMD host; amd2 and intel are localspec's calibration. zen1 is
# localspec's calibration on a third host of the same machine kind (2026-12-01): an AMD EPYC of the first
# generation (family 23 model 1, AVX2, no AVX-512), where a decode takes 97 ms and a 2-token verify 1.7 of it.
CURVES = {
    "amd1": curve({1: 29, 2: 38, 4: 63, 6: 90, 8: 106, 16: 119, 32: 211}, 16.0, per_row_ms=3.6),
    "amd2": curve({1: 34.7, 2: 61.0, 5: 118, 9: 233, 17: 325, 33: 504}, 20.8),
    "intel": curve({1: 68, 2: 100, 3: 130, 5: 141, 6: 169, 8: 208, 10: 248, 12: 260, 14: 300, 17: 308, 24: 398,
                    33: 493}, 31.5),
    "zen1": curve({1: 97.4, 2: 169.5, 3: 243.3, 4: 321.8, 5: 392.3, 6: 464.5, 8: 749.4, 10: 851.0, 12: 968.3,
                   14: 1069.4, 17: 1259.2, 24: 1646.1, 33: 2154.4}, 48.6, fill_ms=22.09),
}


def agreed(guess, actual) -> int:
    """How many leading tokens of a guess the actual continuation confirms."""
    return next((i for i, (x, y) in enumerate(zip(guess, actual)) if x != y), min(len(guess), len(actual)))


# ---- record ----
def draft_proposals(draft, context: list[int], out: list[int]) -> list[tuple[list[int], list[float]]]:
    """The draft model's greedy proposal (K tokens, with its top probability for each) at every position.

    Where the output followed the last proposal, the next one is that proposal shifted plus one decode."""
    props, prev = [], None
    for t in range(len(out)):
        ctx = context + out[:t]
        if prev is not None and t > 0 and prev[0] and prev[0][0] == out[t - 1] and len(prev[0]) == K:
            toks, probs = prev[0][1:], prev[1][1:]
            row = draft.decode([toks[-1]], logits="last")[0]
        else:
            toks, probs = [], []
            row = draft.sync(ctx, logits=True)[1][0]
        while len(toks) < K:
            z = row - row.max()
            tok = int(np.argmax(z))
            toks.append(tok)
            probs.append(float(1.0 / np.exp(z).sum()))
            if len(toks) < K:
                row = draft.decode([tok], logits="last")[0]
        prev = (toks, probs)
        props.append((list(toks), list(probs)))
    return props


def record(a) -> None:
    import localspec

    llm = localspec.load(**({"target": a.target, "draft": a.draft} if a.target else {"pair": a.pair}),
                         n_threads=a.threads)
    costs = llm.calibration()
    runs = []
    for p in load_prompts(SETS.get(a.prompts, a.prompts)):
        prompt = llm.chat_tokens(p["messages"])
        out = llm.generate(prompt, max_tokens=a.max_tokens, temperature=0, drafter="none",
                           json_schema=p.get("schema")).tokens
        run = {"id": p["id"], "kind": p.get("kind", ""), "prompt": prompt, "out": out, "schema": p.get("schema")}
        if p.get("prediction") is not None:
            run["prediction"] = llm.tokenize(p["prediction"], add_special=False, parse_special=False)
        if a.draft_proposals and llm.draft is not None and p.get("schema") is None:
            run["draft"] = draft_proposals(llm.draft, prompt, out)
        runs.append(run)
        print(f"recorded {p['id']}: {len(out)} tokens", file=sys.stderr)
    data = {"target": str(llm.target.path), "costs": asdict(costs), "runs": runs}
    Path(a.out).write_text(json.dumps(data))


# ---- replay ----
class Recorded:
    """The draft model, replayed: its recorded greedy proposal at each position, cut by p_min and n. It
    keeps the account of its cache: each proposal first catches it up over what it has not seen, and one cut
    short by p_min has also decoded the token whose successor was too unsure (a draft step beyond the
    tokens the caller pays for; an empty proposal still costs that step)."""

    def __init__(self, props, start: int, p_min: float, fill_cost: float, step: float = 0.0):
        self.props, self.start, self.p_min, self.fill_cost, self.step = props, start, p_min, fill_cost, step
        self.synced, self.spent = 0, 0.0  # how much of the context its cache holds; catch-up seconds paid

    def fits(self, context) -> bool:
        return True

    def lag(self, context) -> int:
        return max(len(context) - self.synced, 0)

    def propose(self, context, n: int) -> Draft:
        toks, probs = self.props[len(context) - self.start]
        k = next((i for i, q in enumerate(probs[:n]) if q < self.p_min), min(n, len(toks)))
        self.spent += self.lag(context) * self.fill_cost + (max(self.step - self.fill_cost, 0.0) if k < n else 0.0)
        self.synced = len(context) + max(k - 1, 0)
        return Draft(list(toks[:k]))


def draft_profile(run, p_min: float = 0.75, k: int = 4) -> dict[str, float]:
    """What the draft model's recorded proposals do as a fixed k-token drafter cut by p_min, per round: how
    often it drafts at all (its first token sure enough), the tokens it drafts, the share of those accepted;
    the share of rounds after one whose k tokens were all drafted and accepted ('hot'), and how often it
    drafts in those and in the others ('cold'). Its drafts hold about as often everywhere; how often it is
    sure varies, and in streaks."""
    props, out = run["draft"], run["out"]
    drafted = accepted = 0
    rounds = {False: [0, 0], True: [0, 0]}  # cold, hot: rounds, rounds that drafted
    t, hot = 0, False
    while t < len(out) - 1:
        toks, probs = props[t]
        d = next((i for i, q in enumerate(probs[:k]) if q < p_min), min(k, len(toks)))
        a = agreed(toks[:d], out[t:])
        drafted, accepted = drafted + d, accepted + a
        rounds[hot][0] += 1
        rounds[hot][1] += d > 0
        hot = d == k and a == k
        t += a + 1
    n = max(rounds[False][0] + rounds[True][0], 1)
    return {"drafts": (rounds[False][1] + rounds[True][1]) / n, "tokens": drafted / n,
            "accepted": accepted / max(drafted, 1), "hot": rounds[True][0] / n,
            "hot_drafts": rounds[True][1] / max(rounds[True][0], 1),
            "cold_drafts": rounds[False][1] / max(rounds[False][0], 1)}


def earlier(runs, i: int, learned: Learned | None = None) -> SuffixCache:
    """The history an engine would hold before run i: the outputs of the runs before it (after their prompts'
    last PROMPT_TAIL tokens), as Engine.history records them; `learned`: what auto learned of it in the runs
    before (SuffixCache.learned), carried over as the engine does."""
    h = SuffixCache(64 << 20)
    if learned is not None:
        h.learned = learned
    for r in runs[:i]:
        h.add([*r["prompt"][-PROMPT_TAIL:], *r["out"]])
    return h


def replay_one(run, costs: Costs, policy: str, target=None, learned: list | None = None,
               history: SuffixCache | None = None) -> float:
    """Seconds to produce the run's output under a policy ('oracle', 'oracle-no-model', 'oracle-hist', 'auto',
    'auto-warm', 'auto-hist', 'none', 'ngram4', 'ngram16', 'model4'); the -hist ones draft from `history` too.

    auto-warm is auto whose acceptance statistics have already learned this very output (replayed once
    untimed, then timed): what better estimates alone could give within auto's decision rule."""
    from localspec.core.grammar import Grammar, compile_spec

    if policy == "auto-warm":
        learned = []
        replay_one(run, costs, "auto", target, learned)
        return replay_one(run, costs, "auto", target, learned)

    prompt, out, n = run["prompt"], run["out"], len(run["out"])
    seq = prompt + out

    def c(k: int, t: int) -> float:
        return float(costs.verify_cost(k, len(prompt) + t))

    def grammar():
        return Grammar(target, compile_spec(json_schema=run["schema"])) if run.get("schema") else None

    draft_step = costs.draft_cost(len(prompt))
    props = run.get("draft")
    if policy == "oracle":
        return _ceiling(run, costs, grammar(), c)
    if policy == "oracle-no-model":  # the ceiling over what costs nothing to draft: no draft model
        return _ceiling({k: v for k, v in run.items() if k != "draft"}, costs, grammar(), c)
    if policy == "oracle-hist":
        return _ceiling(run, costs, grammar(), c, history)
    g = grammar()
    model = (Recorded(props, len(prompt), 0.75, costs.fill_cost(len(prompt)), draft_step)
             if props is not None else None)
    pred = Prediction(run["prediction"], len(prompt)) if run.get("prediction") else None
    kinds = vocab_kinds(target) if target is not None else None  # as the engine gives them
    drafter = {"auto": lambda: AutoDrafter(costs, NgramDrafter(n_min=1, n_max=8), model, grammar=g, kinds=kinds),
               "auto-pred": lambda: AutoDrafter(costs, NgramDrafter(n_min=1, n_max=8), model, grammar=g,
                                                prediction=pred, kinds=kinds),
               "auto-hist": lambda: AutoDrafter(costs, NgramDrafter(n_min=1, n_max=8), model, grammar=g, kinds=kinds,
                                                history=history),
               "none": lambda: None, "ngram4": lambda: NgramDrafter(), "ngram16": lambda: NgramDrafter(),
               "model4": lambda: model}[policy]()
    if learned is not None:  # auto-warm: the same statistics, a fresh start on the output
        if learned:
            drafter, drafter.model, drafter.grammar, drafter.pending, drafter.run = learned[0], model, g, [], 0
            drafter.bank, drafter.bet, drafter.missed = 0.0, None, 0.0
        else:
            learned.append(drafter)
    if model is not None and policy == "model4":  # drafter 'model' prefills the draft with the prompt: paid too
        model.synced, model.spent = len(prompt) - 1, (len(prompt) - 1) * model.fill_cost
    # (auto catches the draft's cache up, prompt and all, only where it decides to draft from it: priced there)
    if g is not None and drafter is not None and not policy.startswith("auto"):
        from localspec.core.drafters import GrammarDrafter

        drafter = GrammarDrafter(g, drafter)  # as the engine wraps a fixed drafter under a grammar
    k = K_PREDICTION if policy == "auto-pred" else K if policy in ("auto", "auto-hist", "ngram16") else 4
    t, spent = 0, 0.0
    while t < n:
        ctx = seq[:len(prompt) + t]
        d = drafter.propose(ctx, min(k, n - t - 1)) if drafter is not None and t < n - 1 else Draft([])
        if model is not None and d.tokens and (policy == "model4" or (policy.startswith("auto") and _from_model(drafter))):
            spent += draft_step * len(d.tokens)
        gained = agreed(d.tokens, out[t:]) + 1
        if g is not None:
            g.consume(out[t:t + gained])
        t, spent = t + gained, spent + c(len(d.tokens) + 1, t)
    return spent + (model.spent if model is not None else 0.0)


def _ceiling(run, costs: Costs, g, c, history: SuffixCache | None = None) -> float:
    """The ceiling: the least time to produce the output, choosing at each position with perfect foresight a
    plain step or a draft of any length from any candidate (the tokens a grammar forces, with and without the
    token spelling the rest of their bytes, then an n-gram continuation; the draft model's proposal; the
    request's prediction; with a history, what it proposes).

    A draft-model round pays, as in `auto`'s replay, one draft step per token and the catch-up of the draft's
    cache over the tokens since it last ran, so the dynamic programme's state is the position and how far the
    draft's cache reaches (where a round left it: the context and all but the last drafted token). Not paid:
    the step that finds the draft too unsure to go on (the ceiling drafts exactly the tokens it wants)."""
    prompt, out, n = run["prompt"], run["out"], len(run["out"])
    seq, props = prompt + out, run.get("draft")
    lookup, cands, model = NgramDrafter(n_min=1, n_max=8).lookup, [], []
    pred = Prediction(run["prediction"], len(prompt)) if run.get("prediction") else None
    for t in range(n):
        forced = g.forced()[:K] if g is not None else []
        guess = g.spelled(forced) if g is not None and len(forced) < K else []
        cands.append([])
        for lead in [forced] + ([forced + guess] if guess else []):
            cont = lookup(seq[:len(prompt) + t] + lead, K - len(lead)).tokens if len(lead) < K else []
            cand = lead + cont
            cands[-1].append(cand[:g.validate(cand)] if g is not None else cand)
        if pred is not None:
            cands[-1].append(pred.lookup(seq[:len(prompt) + t], K_PREDICTION)[1])
        if history is not None:
            cands[-1].append(history.lookup(seq[:len(prompt) + t], K).tokens)
        model.append(props[t][0] if props is not None else [])
        if g is not None:
            g.consume(out[t:t + 1])
    step = costs.draft_cost(len(prompt)) if props is not None else 0.0
    fill = costs.fill_cost(len(prompt)) if props is not None else 0.0
    # best[t][s + 2]: least seconds from position t with the draft's cache reaching output position s (-1: the
    # prompt less its last token); best[t][0]: with the draft's cache empty, as a request starts (its prompt's
    # catch-up is paid like any other)
    width = n + K + 2
    best = np.zeros((n + 1, width + 1))
    reach = np.concatenate([[-len(prompt)], np.arange(-1, width - 1)])
    for t in range(n - 1, -1, -1):
        row = c(1, t) + best[t + 1]
        for cand in cands[t]:
            m = agreed(cand, out[t:])
            for kk in range(1, len(cand) + 1):
                row = np.minimum(row, c(kk + 1, t) + best[t + min(min(m, kk) + 1, n - t)])
        if model[t]:
            m, catch_up = agreed(model[t], out[t:]), fill * np.maximum(t - reach, 0)
            for kk in range(1, len(model[t]) + 1):
                after = best[t + min(min(m, kk) + 1, n - t), min(t + kk - 1, width - 2) + 2]
                row = np.minimum(row, c(kk + 1, t) + step * kk + catch_up + after)
        best[t] = row
    return float(best[0, 0])


def _from_model(auto) -> bool:
    return bool(auto.pending) and auto.pending[-1][2] is auto.model_stats and auto.since_model == 0


def replay(a) -> None:
    data = json.loads(Path(a.file).read_text())
    curves = {"host": Costs.from_dict(data["costs"])} | CURVES
    for f in a.costs_file or ():
        curves[Path(f).stem] = Costs.from_dict(json.loads(Path(f).read_text()))
    from localspec.core.model import Model, ModelConfig

    # the target's vocabulary: auto judges n-gram guesses by their tokens' kinds, grammars need it
    target = Model(data["target"], ModelConfig(n_ctx=512), vocab_only=True)
    fixed = ["none", "ngram4", "ngram16"] + (["model4"] if any("draft" in r for r in data["runs"]) else [])
    policies = (["oracle", "auto", "auto-warm"] + (["auto-pred"] if any("prediction" in r for r in data["runs"]) else [])
                + (["oracle-hist", "auto-hist"] if a.history else []) + fixed)
    gm = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
    if "model4" in fixed:
        print("## the draft model as model k 4 (p_min 0.75), per round: drafts at all / tokens drafted / "
              "share accepted; rounds after one that held all 4 (hot): their share, and how often they draft "
              "vs the other rounds (cold)")
        print("| prompt | drafts | tokens | accepted | hot rounds | drafts when hot | drafts when cold |")
        print("|---" * 7 + "|")
        for run in data["runs"]:
            if "draft" in run:
                d = draft_profile(run)
                print(f"| {run['id']} | {d['drafts']:.0%} | {d['tokens']:.2f} | {d['accepted']:.0%} | {d['hot']:.0%} "
                      f"| {d['hot_drafts']:.0%} | {d['cold_drafts']:.0%} |")
    for name in (list(curves) if a.costs == "all" else [a.costs, *(Path(f).stem for f in a.costs_file or ())]):
        costs = curves[name]
        print(f"\n## costs: {name} (verify 1/2/5/17: " +
              "/".join(f"{costs.verify_cost(n, 256) * 1e3:.0f}" for n in (1, 2, 5, 17)) + " ms)")
        print("| prompt | " + " | ".join(policies) + " | auto's share of the ceiling's gain |")
        print("|---" * (len(policies) + 2) + "|")
        ratios = {p: [] for p in policies}
        bare = []  # the ceiling without the draft model, per prompt (printed only where it drafted)
        learned = Learned()  # auto's history statistics, carried from run to run as a scope's are
        for i, run in enumerate(data["runs"]):
            plain = replay_one(run, costs, "none", target)
            history = earlier(data["runs"], i, learned) if a.history else None
            row = {p: plain / replay_one(run, costs, p, target, history=history) for p in policies}
            for p in policies:
                ratios[p].append(row[p])
            if "model4" in fixed:
                bare.append(plain / replay_one(run, costs, "oracle-no-model", target))
            share = (row["auto"] - 1) / (row["oracle"] - 1) if row["oracle"] > 1.001 else 1.0
            print(f"| {run['id']} | " + " | ".join(f"{row[p]:.2f}x" for p in policies) + f" | {share:.0%} |")
        g = {p: gm(ratios[p]) for p in policies}
        share = {p: (g[p] - 1) / max(g["oracle"] - 1, 1e-9) for p in ("auto", "auto-warm")}
        print("| **geomean** | " + " | ".join(f"**{g[p]:.2f}x**" for p in policies) + f" | {share['auto']:.0%} |")
        print(f"auto-warm (statistics learned from the output in advance) captures {share['auto-warm']:.0%} "
              "of the ceiling's gain")
        if a.history:
            print(f"with the history of the runs before each: the ceiling {g['oracle-hist']:.2f}x, auto-hist "
                  f"{g['auto-hist']:.2f}x ({(g['auto-hist'] - 1) / max(g['oracle-hist'] - 1, 1e-9):.0%} of its gain; "
                  f"{g['auto-hist'] / g['auto']:.2f}x auto without it)")
            # per workload (a prompt id less its number): what history adds at most over auto without it is the
            # ceiling with history over auto; where that is short of a goal, no policy reaches the goal
            groups: dict[str, list[int]] = {}
            for i, run in enumerate(data["runs"]):
                groups.setdefault(re.sub(r"[-_]?\d+$", "", run["id"]), []).append(i)
            print("| workload | prompts | auto | auto-hist | auto-hist / auto | ceiling | ceiling-hist "
                  "| ceiling-hist / auto |")
            print("|---" * 8 + "|")
            for w, idx in groups.items():
                r = {p: gm([ratios[p][i] for i in idx]) for p in ("auto", "auto-hist", "oracle", "oracle-hist")}
                print(f"| {w} | {len(idx)} | {r['auto']:.2f}x | {r['auto-hist']:.2f}x | "
                      f"{r['auto-hist'] / r['auto']:.2f}x | {r['oracle']:.2f}x | {r['oracle-hist']:.2f}x | "
                      f"{r['oracle-hist'] / r['auto']:.2f}x |")
        if bare:  # how much of the ceiling is the draft model's, and auto's share of the rest
            print(f"the ceiling without the draft model: {gm(bare):.2f}x (auto captures "
                  f"{(g['auto'] - 1) / max(gm(bare) - 1, 1e-9):.0%} of its gain)")
        # a selector that knew, for each prompt, which fixed drafter (or plain decoding) would be fastest on it
        best_fixed = [max(ratios[p][i] for p in fixed) for i in range(len(data["runs"]))]
        pick = gm(best_fixed)
        print(f"the best fixed drafter of each prompt, picked in hindsight: {pick:.2f}x "
              f"({(pick - 1) / max(g['oracle'] - 1, 1e-9):.0%} of the ceiling's gain; auto {g['auto'] - pick:+.2f})")
        worst = min(min(a - b for a, b in zip(ratios["auto"], best_fixed)), 9)
        print(f"auto minus the best fixed drafter, worst prompt: {worst:+.2f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("record", help="plain outputs (and draft proposals) of a prompt set, with this host's costs")
    r.add_argument("--pair")
    r.add_argument("--target")
    r.add_argument("--draft")
    r.add_argument("--prompts", default="shipped",
                   help="shipped, holdout, structured, holdout-structured, edit, or a JSONL file")
    r.add_argument("--out", required=True)
    r.add_argument("--max-tokens", type=int, default=256)
    r.add_argument("--threads", type=int)
    r.add_argument("--draft-proposals", action="store_true", help="record the draft model's proposals too")
    p = sub.add_parser("replay", help="the ceiling, auto and the fixed drafters over recorded outputs")
    p.add_argument("file")
    p.add_argument("--costs", default="host", choices=["host", *CURVES, "all"],
                   help="host: the costs recorded with the outputs; amd1/amd2/intel: built-in curves measured on "
                        "three other 2-core hosts; zen1: a first-generation EPYC (AVX2 only)")
    p.add_argument("--history", action="store_true",
                   help="also price drafting from the outputs of the runs before each (oracle-hist, auto-hist)")
    p.add_argument("--costs-file", action="append", metavar="JSON",
                   help="also replay with costs from this file (a calibration cache file, or the GPU script's "
                        "costs.json); repeatable")
    a = ap.parse_args()
    record(a) if a.cmd == "record" else replay(a)


if __name__ == "__main__":
    main()
