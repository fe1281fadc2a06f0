"""What speculation costs on this machine, as `auto` prices it: the target's verify time by batch size at two
context depths, the draft's time per token and per token of catching its cache up, and the time to turn a
logit row into a sampling distribution (about three minutes to measure on a 2-core CPU).
store.calibration keeps them, once per machine, build, model files and settings.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

import numpy as np

from .model import Cancelled, Model
from .sampling import SamplingParams, dist

# verify batch sizes; costs in between are interpolated. Every size up to 17, and the widest ones about 32: the
# curve is not smooth. llama.cpp's CPU kernels take the batch's rows in blocks (a 2-vCPU Xeon, Qwen2.5-Coder
# 1.5B, 256 deep, ms: 3 tokens 124, 4 tokens 120, 13 290, 16 277, 17 338, 31 544, 32 483), so a verify of 16
# costs less than one of 13, and an interpolation over a few sizes priced the dips as their neighbours.
SIZES = (*range(1, 18), 24, 31, 32, 33)
DEPTHS = (256, 1024)  # tokens cached while measuring; other depths are interpolated (and extrapolated) linearly
SMALL, SMALL_REPS = 6, 3  # verifies of up to SMALL tokens are measured SMALL_REPS times as often (measure)
FILL_BATCH = 32  # catching the draft's cache up is a batched decode: its cost per token is measured at this size


@dataclass(frozen=True)
class Costs:
    """Seconds. verify[j][i]: one target decode of sizes[i] tokens (logits for all) after depths[j] cached
    tokens; draft[j]: one draft-model token at that depth; draft_fill[j]: one token of catching the draft's
    cache up (a batched decode) at that depth; sample_row: one row through the sampler at T > 0."""

    sizes: tuple[int, ...]
    depths: tuple[int, ...]
    verify: tuple[tuple[float, ...], ...]
    draft: tuple[float, ...] | None
    sample_row: float
    draft_fill: tuple[float, ...] | None = None
    # concurrent requests: (sequences, a verify of theirs against one sequence's of as many tokens) (measure_batch)
    batch: tuple[tuple[int, float], ...] | None = None

    @classmethod
    def from_dict(cls, d: dict) -> "Costs":
        """From the JSON the calibration writes (the cache file, a replay recording, the GPU script's output);
        KeyError, TypeError or ValueError when it is not one."""
        return cls(tuple(d["sizes"]), tuple(d["depths"]), tuple(map(tuple, d["verify"])),
                   tuple(d["draft"]) if d["draft"] is not None else None, float(d["sample_row"]),
                   tuple(d["draft_fill"]) if d.get("draft_fill") is not None else None,
                   tuple(map(tuple, d["batch"])) if d.get("batch") is not None else None)

    def _at_depth(self, values, depth):
        if len(self.depths) == 1:
            return values[0]
        d0, d1 = self.depths[0], self.depths[-1]
        w = (max(depth, d0) - d0) / (d1 - d0)  # attention grows linearly with the cache: extrapolate beyond d1
        if w <= 1:
            return values[0] + w * (values[-1] - values[0])
        # beyond d1 only growth is extrapolated: a noisy measurement with the deeper cost lower would otherwise
        # extrapolate towards zero (or below) at long contexts
        return values[-1] + (w - 1) * np.maximum(np.subtract(values[-1], values[0]), 0.0)

    def verify_cost(self, n, depth: int = 0):
        """Seconds of a verify of n tokens (a number or an array) with `depth` tokens cached."""
        rows = [np.interp(n, self.sizes, v) for v in self.verify]
        return self._at_depth(rows, depth)

    def verify_costs(self, n: int, depth: int = 0) -> np.ndarray:
        """verify_cost of 1..n tokens as an array. auto prices every length each round: the curve is interpolated
        over sizes once per n and only over depth each time (the same figures as verify_cost)."""
        rows = self.__dict__.setdefault("_by_size", {}).get(n)  # a cache, not a field (frozen, asdict)
        if rows is None:
            rows = [np.interp(np.arange(1, n + 1), self.sizes, v) for v in self.verify]
            for r in rows:
                r.flags.writeable = False  # with one depth measured, _at_depth hands a row out as it is
            self.__dict__["_by_size"][n] = rows
        return self._at_depth(rows, depth)

    def batch_cost(self, n, depth: int = 0, seqs: int = 1):
        """Seconds of one decode of n tokens (in all) from `seqs` sequences, each `depth` deep."""
        if seqs <= 1 or not self.batch:
            return self.verify_cost(n, depth)
        b, r = zip(*((1, 1.0), *self.batch))
        return self.verify_cost(n, depth) * float(np.interp(seqs, b, r))

    def draft_cost(self, depth: int = 0) -> float:
        return float(self._at_depth(self.draft, depth)) if self.draft is not None else float("inf")

    def fill_cost(self, depth: int = 0) -> float:
        """Seconds per token of catching the draft's cache up (a quarter of a draft step when not measured)."""
        fill = self.draft_fill if self.draft_fill is not None else [0.25 * d for d in self.draft or (0.0,)]
        return float(self._at_depth(fill, depth))

    def table(self) -> str:
        lines = []
        for at in range(0, len(self.sizes), 11):  # 11 sizes a block: lines under 100 columns
            lines.append("batch " + "".join(f"{n:>8d}" for n in self.sizes[at:at + 11]))
            lines += [f"@{d:<5d}" + "".join(f"{v * 1e3:8.1f}" for v in row[at:at + 11])
                      for d, row in zip(self.depths, self.verify)]
        lines.append("verify: ms per target decode of that many tokens (logits for all) at @depth cached tokens")
        if self.draft is not None:
            lines.append("draft:  " + ", ".join(f"{v * 1e3:.1f} ms per token @{d}" for d, v in zip(self.depths, self.draft)))
            lines.append("fill:   " + ", ".join(f"{self.fill_cost(d) * 1e3:.2f} ms per token of draft catch-up @{d}"
                                                for d in self.depths))
        lines.append(f"sample: {self.sample_row * 1e3:.2f} ms per row at temperature > 0")
        if self.batch:
            lines.append("batch:  " + ", ".join(f"{b} sequences x{r:.2f}" for b, r in self.batch)
                         + " (a decode of theirs against one sequence's of as many tokens)")
        return "\n".join(lines)


class Shared:
    """Costs as one request of a batch sees them (engine, parallel > 1): its verify shares one llama_decode with
    the others' tokens. A round then costs T(w + n) for all b sequences, w the others' tokens; adding drafts
    pays for the whole batch's round only if they yield more than the batch's rate per second, which is the
    single-request rule priced with T(w + n) - T(w + 1) + T(w + 1) / b (T(n) when alone). others() gives
    (w, b) as the latest decode had them.

    That rate is what a token is worth where requests wait for a slot: ending sooner lets one in (waiting()
    counts them). Where none waits, ending sooner saves only what the request's sequence adds to the rounds,
    T(w + 1) - T(w) on b - 1 sequences, and its tokens are priced at that: each draft widens every round the others
    sit through (an 8-prompt burst at 4 clients, 2-vCPU Xeon: drafting as if its tokens were worth the batch's
    rate, auto took 0.93-0.95x plain batching's aggregate, its requests ending apart and the last ones decoding
    in rounds of two; pricing the one with most left to generate at the batch's rate, 0.98-0.99x). The request
    that ends last is priced as alone once it is.

    Priced on the curve's upper envelope (made non-decreasing): a dip (SIZES) is one width of the batch in all,
    and every request deciding at once, each seeing the others' width as it was, would chase the same dip and
    land far past it (4 requests, 16 tokens the dip: measured 1.19x the queue where plain batching gave 1.39x)."""

    FREE = 1e-4  # seconds: the least a token is priced at, where a sequence adds nothing to the rounds (a flat
    # curve): drafts that cost nothing still pay

    def __init__(self, costs: Costs, others, waiting=lambda: 0):
        self.costs, self.others, self.waiting = costs, others, waiting
        self.envelope = replace(costs, verify=tuple(tuple(np.maximum.accumulate(row)) for row in costs.verify))

    def __getattr__(self, name: str):
        return getattr(self.costs, name)

    def verify_cost(self, n, depth: int = 0):
        w, b = self.others()
        if b <= 1:
            return self.costs.verify_cost(n, depth)
        base = self.envelope.batch_cost(w + 1, depth, b)
        own = base / b if self.waiting() else max(base - self.envelope.batch_cost(w, depth, b - 1), self.FREE)
        return self.envelope.batch_cost(w + np.asarray(n), depth, b) - base + own

    def verify_costs(self, n: int, depth: int = 0) -> np.ndarray:
        return np.asarray(self.verify_cost(np.arange(1, n + 1), depth), dtype=float)


def _time_decode(model: Model, n: int) -> float:
    base = len(model.tokens)
    toks = model.tokens[-n:]
    t = time.perf_counter()
    model.decode(toks, logits="all")
    elapsed = time.perf_counter() - t
    model.truncate(base)
    return elapsed


def _time_singles(model: Model, n: int) -> list[float]:
    """One token decoded n times in a row, as plain decoding runs (llama.cpp reuses the compute graph of
    a batch the same shape as the last): each step's time. The first step after a batch of another size
    pays a graph rebuild that plain decoding does not (measured 1-2 ms of ~33 on a 2-core EPYC): it is
    left out, or plain decoding would look dearer and speculation better than it is."""
    base = len(model.tokens)
    times = []
    for tok in model.tokens[-(n + 1):]:
        t = time.perf_counter()
        model.decode([tok], logits="all")
        times.append(time.perf_counter() - t)
    model.truncate(base)
    return times[1:]


def _time_fill(model: Model, n: int) -> float:
    """A catch-up decode of n tokens (logits for the last only), as sync does it."""
    base = len(model.tokens)
    toks = model.tokens[-n:]
    model.truncate(base - n)
    t = time.perf_counter()
    model.decode(toks, logits="last")
    return time.perf_counter() - t


def _fill(model: Model, n: int) -> list[int]:
    return [(7 + 13 * i) % min(model.n_vocab, 30000) + 100 for i in range(n)]


def plan(n_ctx: int, n_batch: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(depths, sizes) that fit a context of n_ctx tokens: a small context is measured where it can be."""
    depths = tuple(d for d in DEPTHS if d + SIZES[-1] <= n_ctx) or (n_ctx // 2,)
    sizes = tuple(n for n in SIZES if n <= min(n_batch, n_ctx - depths[-1]))
    return depths, sizes


def measure(target: Model, draft: Model | None, *, reps: int = 5, log=None, stop=None) -> Costs:
    """Time verify batches on the target and single-token decodes on the draft (both caches end empty).

    Sizes are interleaved across `reps` passes, and the short verifies (up to SMALL tokens, the ones auto weighs
    most rounds) across SMALL_REPS times as many. Each batch is timed as a verify runs, right after single-token
    steps (_time_singles), with the step after it, which pays llama.cpp's graph rebuild for the shape change
    back, and kept as its ratio to the steps: the median ratio over the passes times the median step, so a
    burst of other work moves one sample, not the curve, and a drift of the machine's speed moves the steps
    and the batches alike. The curve is kept as measured, dips and all (it was once made non-decreasing: that
    priced a 4-token verify as a 3-token one and 16 as 14, where they cost less). (Batches once kept their
    fastest pass while a single token kept a median: that lowered the price of a verify against plain
    decoding, to 2.9 single steps for a 4-token verify where runs on the same 2-core EPYC took 3.2-3.4, and
    auto drafted where it lost. Five passes in a busy minute, with no rebuild, then priced a 2-token verify at
    1.77 steps where 30 passes on the same EPYC measured 1.96 and the step after it 1.03: auto bet on drafts
    that lost.)
    stop: checked between measurements; when it returns True, Cancelled is raised (the engine is closing).
    """
    try:
        return _measure(target, draft, reps, log, stop or (lambda: False))
    finally:
        for m in (target, draft):
            if m is not None:
                m.truncate(0)


def _measure(target: Model, draft: Model | None, reps: int, log, stop) -> Costs:
    def check():
        if stop():
            raise Cancelled("calibration stopped")

    depths, sizes = plan(target.n_ctx, target.n_batch)
    verify, drafts, fills = [], [], []
    for depth in depths:
        target.sync(_fill(target, depth), cancel=stop)
        _time_decode(target, sizes[-1])  # warm-up
        singles, ratios = [], [[] for _ in sizes]
        for rep in range(reps * SMALL_REPS):
            for i, n in enumerate(sizes):
                check()
                if n == 1 or (rep >= reps and n > SMALL):
                    continue
                steps = _time_singles(target, 3)  # as auto runs: a verify comes between single-token steps
                singles += steps
                step = float(np.median(steps))
                # the verify, and what the single step after it adds: that step runs a graph of another shape
                # than the last (llama.cpp rebuilds it), which plain decoding never pays and a round after a draft does
                # (at least half a step: a spike in the steps around it would otherwise price it at 0 or below,
                # seen under load on a 2-core host, and auto would then draft at any price)
                x = (_time_decode(target, n) + _time_decode(target, 1) - step) / step
                ratios[i].append((step, max(x, 0.5)))
        # each batch against the steps just before it: a machine whose speed drifts while it is measured (other
        # work starting or stopping) moves both alike, so the curve's shape stays what a run will see. Not
        # quite alike: other work slows the memory-bound single step more than a batch (on a 2-core EPYC, passes
        # whose steps took 36-38 ms priced a 2-token verify at 1.7 steps, those at 32-34 ms at 2.0), and a verify
        # priced low makes auto draft where it loses on a quiet machine. So each size keeps the passes whose
        # steps were the quicker half: the machine as it is when nothing else runs.
        quick = float(np.median([st for r in ratios for st, _ in r])) if any(ratios) else 0.0
        best = float(np.median(singles)) * np.array(
            [np.median([x for st, x in r if st <= quick] or [x for _, x in r]) if r else 1.0 for r in ratios])
        verify.append(tuple(best.tolist()))  # as measured: a wider verify may cost less (SIZES)
        if log:
            mid = len(sizes) // 2
            log(f"verify at {depth} cached tokens, {sizes[0]}/{sizes[mid]}/{sizes[-1]} tokens: "
                f"{best[0] * 1e3:.1f}/{best[mid] * 1e3:.1f}/{best[-1] * 1e3:.1f} ms")
        if draft is not None:
            check()
            draft.sync(_fill(draft, min(depth, draft.n_ctx - 2)), cancel=stop)
            _time_decode(draft, 1)
            drafts.append(float(np.median([_time_decode(draft, 1) for _ in range(2 * reps)])))
            base = len(draft.tokens)
            if base >= FILL_BATCH:
                fills.append(float(np.median([_time_fill(draft, FILL_BATCH) for _ in range(reps)])) / FILL_BATCH)
            else:
                fills.append(0.25 * drafts[-1])
            if log:
                log(f"draft 1 token at {depth} cached tokens: {drafts[-1] * 1e3:.1f} ms, catch-up "
                    f"{fills[-1] * 1e3:.2f} ms per token")
    # a real row through the default sampler chain (top-k 40 ...), as every row at temperature > 0 is
    row = np.array(target.decode(target.tokens[-1:], logits="all")[0])
    params = SamplingParams()
    times = []
    for _ in range(21):
        t = time.perf_counter()
        dist(row, params)
        times.append(time.perf_counter() - t)
    return Costs(sizes, depths, tuple(verify), tuple(drafts) if draft is not None else None,
                 float(np.median(times)), tuple(fills) if draft is not None else None)


BATCH_SEQS = (2, 4, 8)
BATCH_WIDTHS = (1, 4)  # plain decoding, and a short verify each


def measure_batch(target: Model, costs: Costs, *, reps: int = 3, log=None) -> Costs:
    """costs with `batch`: for 2, 4, 8 sequences (as many as the target holds), a decode of theirs (1 and 4
    tokens each) against one sequence's decode of as many tokens, at the shallower measured depth: what
    sharing a llama_decode between requests costs beyond its width (their attention reads their own caches)."""
    from .batch import Job

    seqs = [b for b in BATCH_SEQS if b < len(target.seqs)]
    if not seqs:
        return costs
    depth = costs.depths[0]
    fill = _fill(target, depth)
    try:
        for s in target.seqs[:seqs[-1] + 1]:
            s.sync(fill)
        out = []
        for b in seqs:
            ratios = []
            for w in BATCH_WIDTHS:
                times = []
                for _ in range(reps):
                    jobs = [Job(s, fill[-w:], "all") for s in target.seqs[1:b + 1]]
                    t = time.perf_counter()
                    target._run_jobs(jobs)
                    many = time.perf_counter() - t
                    for s in target.seqs[1:b + 1]:
                        s.truncate(depth)
                    times.append(many / _time_decode(target, b * w))
                ratios.append(float(np.median(times)))
            out.append((b, float(np.mean(ratios))))
            if log:
                log(f"{b} sequences: x{out[-1][1]:.2f} against one sequence of as many tokens")
    finally:
        for s in target.seqs:
            s.truncate(0)
    return replace(costs, batch=tuple(out))


def parallel_for(costs: Costs, most: int = 8) -> int:
    """How many requests are worth decoding together here: the batch doubles while that raises plain decoding's
    tokens per second in all by 10% or more (the target's verify curve at the shallower depth: one decode of
    n tokens, as a batch of n requests' tokens costs about as much). 1 where a wider decode costs nearly in
    proportion to its width (many CPUs)."""
    n = 1
    while 2 * n <= min(most, costs.sizes[-1]) and \
            costs.verify_cost(2 * n) / (2 * n) * 1.1 <= costs.verify_cost(n) / n:
        n *= 2
    return n
