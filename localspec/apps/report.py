"""The bench's report: the table of speeds and ratios (with acceptance, spread of repeats and the speed
priced within each run), geometric means, and the plot."""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path

WITHIN_WINDOW = 16  # plain rounds that price each drafting round in bench.within_run


@dataclass
class Run:
    tps: float
    tokens: int
    text: str
    acceptance: float | None = None
    mean_accepted: float | None = None
    outside_decode: float | None = None  # share of wall time not inside llama_decode (either model)
    ratio: float = 0.0
    same_as_plain: bool | None = True  # None: not comparable (sampled without a seed; a peer's own sampler)
    failed: str | None = None          # a peer that raised: its error, on one line
    valid: bool | None = None          # under a schema: whether the output is valid JSON for it
    prediction: tuple[int, int] | None = None  # auto-pred: prediction tokens (accepted, rejected)
    tries: list[float] | None = None   # with --repeat: each run's tokens/s, in the order they ran
    within: float | None = None        # our methods: speed against plain priced inside the run (within_run)
    # a reasoning model's spans, each apart ('thinking', 'answer'): tokens/s, tokens drafted and accepted
    spans: dict | None = None


@dataclass
class Row:
    id: str
    kind: str
    runs: dict[str, Run] = field(default_factory=dict)


def _gmean(values: list[float]) -> float | None:
    return math.exp(sum(math.log(max(x, 1e-9)) for x in values) / len(values)) if values else None


def geomean(rows: list[Row], method: str) -> float | None:
    """Geometric mean of the ratios to plain over the prompts where the method ran; None when it never did."""
    return _gmean([r.runs[method].ratio for r in rows if not r.runs[method].failed])


def spread(r: Run) -> float | None:
    """How much faster the fastest of a method's repeats ran than its slowest (0.05: 5%); None without repeats."""
    return max(r.tries) / min(r.tries) - 1 if r.tries and min(r.tries) > 0 else None


def _cell(m: str, r: Run) -> str:
    if r.failed:
        return f"failed: {r.failed[:60]}{'…' if len(r.failed) > 60 else ''}"
    cell = f"{r.tps:.1f}" if m == "none" else f"{r.tps:.1f} ({r.ratio:.2f}x)"
    if r.acceptance is not None:
        cell += f" {r.acceptance:.0%} {r.mean_accepted:.1f}/rd"
    cell += {True: " ✓", False: " INVALID", None: ""}[r.valid]
    if r.prediction is not None:
        cell += f" pred {r.prediction[0]}/{r.prediction[1]}"
    return cell + (" ≠" if r.same_as_plain is False else "")


MIN_SPAN_TOKENS = 16  # a span shorter than this in a run is left out of its speed ratio (a round or two)


def _span_cell(rows: list[Row], m: str, span: str) -> str:
    """One span's geomean ratio to plain, and its acceptance over the prompts, for method m."""
    ratios, drafted, accepted = [], 0, 0
    for r in rows:
        mine, plain = (r.runs[m].spans or {}).get(span), (r.runs["none"].spans or {}).get(span)
        if mine is None or plain is None or r.runs[m].failed:
            continue
        if min(mine["tokens"], plain["tokens"]) >= MIN_SPAN_TOKENS and plain["tps"] > 0:
            ratios.append(mine["tps"] / plain["tps"])  # (a span of a few tokens is one round: no speed)
        drafted, accepted = drafted + mine["drafted"], accepted + mine["accepted"]
    if not ratios:
        return "n/a"
    return f"{_gmean(ratios):.2f}x" + (f" {accepted / drafted:.0%}" if drafted else "")


def table(rows: list[Row], *, temperature: float = 0.0, seed: int | None = None) -> str:
    """A Markdown table: tokens/s (ratio to plain) per prompt and method, acceptance, equality with plain."""
    methods = list(rows[0].runs)
    out = [f"| prompt | {' | '.join('plain' if m == 'none' else m for m in methods)} |",
           "|---" * (len(methods) + 1) + "|"]
    for row in rows:
        out.append(f"| {row.id} | {' | '.join(_cell(m, row.runs[m]) for m in methods)} |")
    means = [geomean(rows, m) for m in methods]
    out.append(f"| geomean ratio | {' | '.join('n/a' if g is None else f'{g:.2f}x' for g in means)} |")
    shares = {m: [r.runs[m].outside_decode for r in rows if r.runs[m].outside_decode is not None] for m in methods}
    out.append(f"| outside llama_decode | {' | '.join(f'{sum(v) / len(v):.1%}' if v else 'n/a' for v in shares.values())} |")
    inside = {m: [x for r in rows if (x := r.runs[m].within) is not None] for m in methods}
    priced = any(inside.values())
    if priced:
        cells = [f"{_gmean(v):.2f}x (≥ {min(v):.2f}x)" if v else "n/a" for v in inside.values()]
        out.append(f"| within the run | {' | '.join(cells)} |")
    spreads = {m: [x for r in rows if (x := spread(r.runs[m])) is not None] for m in methods}
    repeated = any(spreads.values())
    if repeated:
        cells = [f"{statistics.median(v):.0%} (≤ {max(v):.0%})" if v else "n/a" for v in spreads.values()]
        out.append(f"| spread of repeats | {' | '.join(cells)} |")
    for span in sorted({s for r in rows for run in r.runs.values() for s in (run.spans or {})}, reverse=True):
        out.append(f"| {span} | {' | '.join(_span_cell(rows, m, span) for m in methods)} |")
    checked = {m: [r.runs[m].valid for r in rows if r.runs[m].valid is not None] for m in methods}
    if any(checked.values()):
        out.append(f"| valid JSON | {' | '.join(f'{sum(v)}/{len(v)}' if v else 'n/a' for v in checked.values())} |")
    out.append("\ntokens/s from first to last token; (ratio) to plain in this run; NN% = acceptance rate, "
               "N.N/rd = mean accepted draft tokens per drafting round; geomean over the prompts a method ran; "
               "pred A/R = prediction tokens accepted/rejected.")
    if any(run.spans for r in rows for run in r.runs.values()):
        out.append("thinking / answer: a reasoning model's spans apart: tokens/s in the span over plain's in the same "
                   "span (geomean over the prompts where both wrote 16 tokens or more in it), and the span's "
                   "acceptance (a round counts in the span it started in).")
    if priced:
        out.append("Within the run: the speed against plain decoding priced inside each run, its drafting rounds "
                   "against its own single-token decodes nearest them (geomean over prompts, and the lowest), free "
                   "of the machine's drift between runs; n/a where a run had under "
                   f"{WITHIN_WINDOW} single-token rounds.")
    if repeated:
        out.append("Spread of repeats: the fastest of a method's runs on a prompt over its slowest, minus 1 (the "
                   "median over prompts, and the largest): how far the same run moves on this machine from one "
                   "repeat to the next, the noise under every ratio above.")
    if temperature == 0:
        out.append("Greedy: ≠ = output differs from plain's.")
    elif seed is None:
        out.append(f"Sampled at temperature {temperature} without --seed: each run draws its own sample, so no "
                   "output is compared with plain's (no ≠ is shown).")
    else:
        out.append(f"Sampled at temperature {temperature}, seed {seed}: ≠ = output differs from plain's with the "
                   "same seed. n-gram drafts are point masses: in exact mode (--exact) they give plain's very sample; in "
                   "the default mode batched logits differ slightly from single-token ones, so samples can part at "
                   "a near-boundary draw. The draft model samples its own proposals, so its text differs (the "
                   "distribution does not). Peers sample with llama.cpp's own sampler and are not compared.")
    return "\n".join(out)


def plot(rows: list[Row], path: str | Path) -> None:
    """Ratios to plain by prompt kind and method (needs matplotlib: the 'plot' extra)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    methods = [m for m in rows[0].runs if m != "none"]
    kinds = sorted({r.kind or r.id for r in rows})
    fig, ax = plt.subplots(figsize=(1.5 + 1.3 * len(kinds), 4))
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        vals = [geomean([r for r in rows if (r.kind or r.id) == k], m) or math.nan for k in kinds]
        ax.bar([j + i * width for j in range(len(kinds))], vals, width, label=m)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks([j + 0.4 - width / 2 for j in range(len(kinds))], kinds)
    ax.set_ylabel("speed / plain decoding")
    ax.legend(fontsize=8, ncols=2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
