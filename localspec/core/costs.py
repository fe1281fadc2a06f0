"""What this machine does: speculation costs for `auto`, and whether `exact` can be honoured.

Costs: the target's verify time by batch size at two context depths, the draft's time per token, and the
time to turn a logit row into a sampling distribution. Measured once per machine, build, model files and
settings (half a minute on a recent 2-core CPU, a few minutes on a slow one), then cached as JSON under
$LOCALSPEC_HOME/calibration; `localspec calibrate` shows them and `--force` measures again.

Exactness: whether single-token and batched logits are bit-identical depends on the CPU's kernels and the
llama.cpp build (an AMD EPYC host needed flash attention on, an Intel Xeon host needed it off and a build
without llamafile's sgemm). So `exact=True` probes it, per machine, build, model and settings, also cached.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass, replace
from importlib.metadata import version
from pathlib import Path
from typing import Sequence

import llama_cpp as L
import numpy as np

from .model import Cancelled, Model, ModelConfig, ModelError
from .sampling import SamplingParams, dist

SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 17, 24, 33)  # verify batch sizes; costs in between are interpolated
DEPTHS = (256, 1024)  # tokens cached while measuring; other depths are interpolated (and extrapolated) linearly
FORMAT = 7  # bump when the cached files change shape or how they are measured
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

    @classmethod
    def from_dict(cls, d: dict) -> "Costs":
        """From the JSON the calibration writes (the cache file, a replay recording, the GPU script's output);
        KeyError, TypeError or ValueError when it is not one."""
        return cls(tuple(d["sizes"]), tuple(d["depths"]), tuple(map(tuple, d["verify"])),
                   tuple(d["draft"]) if d["draft"] is not None else None, float(d["sample_row"]),
                   tuple(d["draft_fill"]) if d.get("draft_fill") is not None else None)

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

    def draft_cost(self, depth: int = 0) -> float:
        return float(self._at_depth(self.draft, depth)) if self.draft is not None else float("inf")

    def fill_cost(self, depth: int = 0) -> float:
        """Seconds per token of catching the draft's cache up (a quarter of a draft step when not measured)."""
        fill = self.draft_fill if self.draft_fill is not None else [0.25 * d for d in self.draft or (0.0,)]
        return float(self._at_depth(fill, depth))

    def table(self) -> str:
        head = "batch " + "".join(f"{n:>8d}" for n in self.sizes)
        lines = [head] + [f"@{d:<5d}" + "".join(f"{v * 1e3:8.1f}" for v in row)
                          for d, row in zip(self.depths, self.verify)]
        lines.append("verify: ms per target decode of that many tokens (logits for all) at @depth cached tokens")
        if self.draft is not None:
            lines.append("draft:  " + ", ".join(f"{v * 1e3:.1f} ms per token @{d}" for d, v in zip(self.depths, self.draft)))
            lines.append("fill:   " + ", ".join(f"{self.fill_cost(d) * 1e3:.2f} ms per token of draft catch-up @{d}"
                                                for d in self.depths))
        lines.append(f"sample: {self.sample_row * 1e3:.2f} ms per row at temperature > 0")
        return "\n".join(lines)


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def system_info() -> str:
    """llama.cpp's own account of the backends and CPU features it was built with and uses."""
    return L.llama_print_system_info().decode(errors="replace").strip()


def _ident(path: Path, cfg: ModelConfig) -> list:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns, repr(cfg)]


def machine_key(*parts) -> str:
    """Same CPU, build, library version and settings -> same answer. Threads are the resolved count."""
    key = [platform.machine(), _cpu_name(), system_info(), version("llama-cpp-python"), *parts]
    return hashlib.sha256(json.dumps(key, default=str).encode()).hexdigest()[:24]


def cache_key(target: Model, draft: Model | None) -> str:
    def ident(m: Model | None):
        return None if m is None else [*_ident(m.path, m.cfg), m.flash_attn, m.n_threads]
    return machine_key("costs", FORMAT, ident(target), ident(draft))


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

    Sizes are interleaved across `reps` passes. Each batch is timed as a verify runs, right after single-token
    steps (_time_singles), and kept as its ratio to them: the median ratio over the passes times the median
    step, so a burst of other work moves one sample, not the curve, and a drift of the machine's speed moves
    the steps and the batches alike; each curve is then made non-decreasing. (Batches once kept their fastest
    pass while a single token kept a median: that lowered the price of a verify against plain decoding, to
    2.9 single steps for a 4-token verify where runs on the same 2-core EPYC took 3.2-3.4, and auto drafted
    where it lost.)
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
        singles, ratios = [], np.ones((reps, len(sizes)))
        for rep in range(reps):
            for i, n in enumerate(sizes):
                check()
                if n == 1:
                    continue
                steps = _time_singles(target, 3)  # as auto runs: a verify comes between single-token steps
                singles += steps
                ratios[rep, i] = _time_decode(target, n) / float(np.median(steps))
        # each batch against the steps just before it: a machine whose speed drifts while it is measured (other
        # work starting or stopping) moves both alike, so the curve's shape stays what a run will see
        best = float(np.median(singles)) * np.median(ratios, axis=0)
        verify.append(tuple(np.maximum.accumulate(best).tolist()))
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


def _read(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _write(path: Path, data: dict) -> None:
    """Keep a measurement; where that fails (LOCALSPEC_HOME a file, a full disk) say so and go on: it is measured
    again next time, never lost this time."""
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp.write_text(json.dumps(data))
        os.replace(tmp, path)
    except OSError as e:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        print(f"localspec: could not keep the measurement in {path.parent} ({e.strerror or e}); it is measured "
              "again next time (set LOCALSPEC_HOME to a writable folder)", file=sys.stderr)


def load_or_measure(target: Model, draft: Model | None, cache_dir: Path, *, force: bool = False,
                    stop=None) -> Costs:
    """The cached costs for this machine and these models, measuring them (with progress) the first time.
    stop: as measure() takes it."""
    path = cache_dir / f"{cache_key(target, draft)}.json"
    data = None if force else _read(path)
    if data is not None:
        try:
            return Costs.from_dict(data)
        except (KeyError, TypeError, ValueError):
            pass
    print(f"localspec: measuring speculation costs on this machine for {target.path.name} "
          "(once; half a minute to a few minutes, by the CPU)", file=sys.stderr, flush=True)
    costs = measure(target, draft, log=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True), stop=stop)
    _write(path, asdict(costs))
    return costs


# ---- exact mode: which flash-attention setting (if any) makes batched logits equal single-token logits ----
# Real text (prose, commands and code), cycled where a context is longer: the probe reads it at every depth.
PROBE_TEXT = Path(__file__).with_name("probe_text.txt")
PROBE_WIDTHS = range(2, 33)  # exact mode's physical batches hold 32 tokens: every verify or prefill is made of these
PROBE_FORMAT = 2  # bump when what the probe covers changes: older verdicts are then not trusted


@dataclass(frozen=True)
class Cell:
    """One place the probe looked: `width` tokens decoded in one batch after `depth` cached tokens, and the
    max |single-token logits - batched logits| over their rows (0.0: bit-identical)."""

    depth: int
    width: int
    diff: float


def probe_depths(n_ctx: int, width: int = PROBE_WIDTHS[-1]) -> tuple[int, ...]:
    """Depths spread over the whole context, the deepest verify it can hold included. Kernels change their
    reduction order with the cache's length (flash attention splits a long cache across threads from 512
    cells on), so a shallow probe cannot vouch for a deep context."""
    deepest = n_ctx - width
    return tuple(sorted({d for d in (64, 256, 1024, 4096, 16384, 65536) if d < deepest} | {max(deepest, 0)}))


def _probe_tokens(m: Model, n: int) -> list[int]:
    toks = m.tokenize(PROBE_TEXT.read_text(encoding="utf-8"))
    return (toks * (n // len(toks) + 1))[:n]


def probe_exact(path: Path, cfg: ModelConfig, flash_attn: str, log=None) -> list[Cell]:
    """Every width 2..32 at every depth of probe_depths(cfg.n_ctx), on real text: the cells whose batched
    logits differ from single-token ones (empty: exact everywhere exact mode can be asked to be). Stops at the
    first depth with a difference (that setting is out whatever the deeper ones say)."""
    m = Model(path, replace(cfg, flash_attn=flash_attn, exact=True))
    try:
        widths = [w for w in PROBE_WIDTHS if w < m.n_ctx]
        tokens = _probe_tokens(m, m.n_ctx)
        for depth in probe_depths(m.n_ctx, widths[-1]):
            t = time.perf_counter()
            m.sync(tokens[:depth])
            ahead = tokens[depth:depth + widths[-1]]
            single = np.stack([np.array(m.decode([tok], logits="last")[0]) for tok in ahead])
            m.truncate(depth)
            cells = []
            for w in widths:
                batched = m.decode(ahead[:w], logits="all")
                cells.append(Cell(depth, w, float(np.max(np.abs(single[:w] - batched)))))
                m.truncate(depth)
            if log:
                log(f"  flash attention {flash_attn}, {depth} tokens deep: widths {widths[0]}-{widths[-1]} "
                    f"{'equal' if not any(c.diff for c in cells) else 'differ'} ({time.perf_counter() - t:.0f} s)")
            if any(c.diff for c in cells):
                return [c for c in cells if c.diff]
        return []
    finally:
        m.close()


def describe(cells: Sequence[Cell]) -> str:
    """'at depth 256: widths 2-32 (max |diff| 0.88)': the cells that differ, by depth."""
    out = []
    for depth in sorted({c.depth for c in cells}):
        ws = sorted(c.width for c in cells if c.depth == depth)
        runs, start = [], ws[0]
        for a, b in zip(ws, ws[1:] + [None]):
            if b != a + 1:
                runs.append(f"{start}" if start == a else f"{start}-{a}")
                start = b
        worst = max(c.diff for c in cells if c.depth == depth)
        out.append(f"{depth} tokens deep, widths {', '.join(runs)} (max |diff| {worst:.2g})")
    return "; ".join(out)


def _tiled_state() -> str:
    from .model import tiled_matmul_setting

    return tiled_matmul_setting()


def exact_flash_attn(path: Path, cfg: ModelConfig, cache_dir: Path, *, force: bool = False, log=None) -> str:
    """The flash-attention setting under which this machine's logits are bit-identical, single-token against
    batched, at every verify width and over the whole context (probe_exact).

    Tries the setting asked for, or with 'auto' first off (faster on a CPU) then on. Cached per machine,
    build, model and settings: a verdict for a context at least as deep is reused. Raises ModelError naming
    the cells that differ and the fix when no setting is exact.
    """
    from .model import default_threads

    threads = cfg.n_threads or default_threads()
    key = machine_key("exact", PROBE_FORMAT, _tiled_state(),
                      _ident(path, replace(cfg, n_ctx=16, n_threads=threads)))  # any n_ctx: the verdict says how deep
    file = cache_dir / f"exact-{key}.json"
    seen = None if force else _read(file)
    if not isinstance(seen, dict):
        seen = {}
    order = ("off", "on") if cfg.flash_attn == "auto" else (cfg.flash_attn,)
    found: dict[str, list[Cell]] = {}
    for fa in order:
        verdict = seen.get(fa)
        try:
            cells = [Cell(*c) for c in verdict["cells"]]
            covers = cells and min(c.depth for c in cells) < cfg.n_ctx or verdict["n_ctx"] >= cfg.n_ctx
        except (KeyError, TypeError, ValueError):
            covers = False
        if not covers:
            if log:
                log(f"checking that batched logits equal single-token logits for {path.name} (flash attention {fa}, "
                    f"every verify width at {len(probe_depths(cfg.n_ctx))} depths up to {cfg.n_ctx} tokens; once "
                    "for these settings, a minute or a few)")
            t = time.perf_counter()
            cells = probe_exact(path, cfg, fa, log)
            if log:
                log(f"  {'exact' if not cells else 'not exact'} with flash attention {fa} "
                    f"({time.perf_counter() - t:.0f} s)")
            seen[fa] = {"n_ctx": cfg.n_ctx, "cells": [list(asdict(c).values()) for c in cells]}
            _write(file, seen)
        found[fa] = [c for c in cells if c.depth < cfg.n_ctx]
        if not found[fa]:
            return fa
    diffs = "; ".join(f"flash attention {fa}: {describe(found[fa])}" for fa in order)
    info = system_info()
    if "LLAMAFILE = 1" in info:
        fix = ("rebuild llama-cpp-python without llamafile's sgemm: CMAKE_ARGS=\"-DGGML_LLAMAFILE=OFF\" pip install "
               "--force-reinstall --no-cache-dir \"llama-cpp-python>=0.3.36,<0.4\"")
    elif _tiled_state() != "0":
        fix = ("ggml's tiled matmul was on when this process loaded its first model: set GGML_CPU_TILED_MM=0 before "
               "starting, or load the exact models first (exact mode turns it off then)")
    else:
        fix = "no build setting known to localspec makes this CPU exact"
    raise ModelError(
        f"exact mode cannot be honoured on this machine: single-token and batched logits of {path.name} differ "
        f"({diffs}), so speculative output could differ from plain output. llama.cpp's kernels decide this per "
        f"CPU and build ({info}). Fix: {fix}"
        + (" (and try flash_attn 'auto')" if cfg.flash_attn != "auto" else "") + "; or run without exact")
