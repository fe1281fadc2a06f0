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

import llama_cpp as L
import numpy as np

from .model import Cancelled, Model, ModelConfig, ModelError
from .sampling import SamplingParams, dist

SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 17, 24, 33)  # verify batch sizes; costs in between are interpolated
DEPTHS = (256, 1024)  # tokens cached while measuring; other depths are interpolated (and extrapolated) linearly
FORMAT = 4  # bump when the cached files change shape or how they are measured
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
    key = [FORMAT, platform.machine(), _cpu_name(), system_info(), version("llama-cpp-python"), *parts]
    return hashlib.sha256(json.dumps(key, default=str).encode()).hexdigest()[:24]


def cache_key(target: Model, draft: Model | None) -> str:
    def ident(m: Model | None):
        return None if m is None else [*_ident(m.path, m.cfg), m.flash_attn, m.n_threads]
    return machine_key("costs", ident(target), ident(draft))


def _time_decode(model: Model, n: int) -> float:
    base = len(model.tokens)
    toks = model.tokens[-n:]
    t = time.perf_counter()
    model.decode(toks, logits="all")
    elapsed = time.perf_counter() - t
    model.truncate(base)
    return elapsed


def _time_plain(model: Model, n: int = 8) -> float:
    """One token decoded n times in a row, as plain decoding runs (llama.cpp reuses the compute graph of
    a batch the same shape as the last): the median step. A single token timed between batches of other
    sizes pays a graph rebuild that plain decoding does not (measured 1-2 ms of ~33 on a 2-core EPYC),
    which made plain decoding look dearer and speculation look better than it is."""
    base = len(model.tokens)
    times = []
    for tok in model.tokens[-n:]:
        t = time.perf_counter()
        model.decode([tok], logits="all")
        times.append(time.perf_counter() - t)
    model.truncate(base)
    return float(np.median(times))


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


def measure(target: Model, draft: Model | None, *, reps: int = 3, log=None, stop=None) -> Costs:
    """Time verify batches on the target and single-token decodes on the draft (both caches end empty).

    Sizes are interleaved across `reps` passes and each keeps its fastest time, so a burst of other work on
    the machine inflates one sample, not the curve; each curve is then made non-decreasing. A batch of 1 is
    timed as plain decoding runs, in a row (_time_plain); the batches a verify sends, after other sizes.
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
        best = np.full(len(sizes), np.inf)
        for rep in range(reps):
            for i, n in enumerate(sizes):
                check()
                best[i] = min(best[i], _time_plain(target) if n == 1 else _time_decode(target, n))
        verify.append(tuple(np.maximum.accumulate(best).tolist()))
        if log:
            mid = len(sizes) // 2
            log(f"verify at {depth} cached tokens, {sizes[0]}/{sizes[mid]}/{sizes[-1]} tokens: "
                f"{best[0] * 1e3:.1f}/{best[mid] * 1e3:.1f}/{best[-1] * 1e3:.1f} ms")
        if draft is not None:
            check()
            draft.sync(_fill(draft, min(depth, draft.n_ctx - 2)), cancel=stop)
            _time_decode(draft, 1)
            drafts.append(min(_time_decode(draft, 1) for _ in range(2 * reps)))
            base = len(draft.tokens)
            if base >= FILL_BATCH:
                fills.append(min(_time_fill(draft, FILL_BATCH) for _ in range(reps)) / FILL_BATCH)
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
PROBE_TEXT = ("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n    a, b = 0, 1\n"
              "    for _ in range(n):\n        a, b = b, a + b\n    return a\n\nThe quick brown fox jumps over "
              "the lazy dog, and the function above runs in linear time.")


def probe_exact(path: Path, cfg: ModelConfig, flash_attn: str) -> float:
    """Max |single-token logits - batched logits| over a 5-token verify after a real-text prefix (0.0: exact)."""
    m = Model(path, replace(cfg, flash_attn=flash_attn, n_ctx=512, exact=True))
    try:
        tokens = m.tokenize(PROBE_TEXT)
        prefix, tail = tokens[:-5], tokens[-5:]
        m.sync(prefix)
        single = []
        for t in tail:
            single.append(np.array(m.decode([t], logits="last")[0]))
        m.truncate(len(prefix))
        batched = np.array(m.decode(tail, logits="all"))
        return float(np.max(np.abs(np.stack(single) - batched)))
    finally:
        m.close()


def exact_flash_attn(path: Path, cfg: ModelConfig, cache_dir: Path, *, force: bool = False, log=None) -> str:
    """The flash-attention setting under which this machine's logits are bit-identical single vs batched.

    Tries the setting asked for, or with 'auto' first off (faster on a CPU) then on. Cached per machine,
    build, model and settings. Raises ModelError naming the measured differences and the fix when none is.
    """
    from .model import default_threads

    threads = cfg.n_threads or default_threads()
    key = machine_key("exact", _ident(path, replace(cfg, n_ctx=512, n_threads=threads)))
    file = cache_dir / f"exact-{key}.json"
    seen = None if force else _read(file)
    if not isinstance(seen, dict):
        seen = {}
    order = ("off", "on") if cfg.flash_attn == "auto" else (cfg.flash_attn,)
    for fa in order:
        if fa not in seen:
            if log:
                log(f"checking that batched logits equal single-token logits (flash attention {fa}) ...")
            seen[fa] = probe_exact(path, cfg, fa)
            _write(file, seen)
        if seen[fa] == 0.0:
            return fa
    diffs = ", ".join(f"{seen[fa]:.3g} with flash attention {fa}" for fa in order)
    raise ModelError(
        f"exact mode cannot be honoured on this machine: single-token and batched logits of {path.name} differ "
        f"(max |diff| {diffs}), so speculative output could differ from plain output. llama.cpp's kernels "
        f"decide this per CPU and build ({system_info()}). Rebuild llama-cpp-python without llamafile's sgemm: "
        f"CMAKE_ARGS=\"-DGGML_LLAMAFILE=OFF\" pip install --force-reinstall --no-cache-dir \"llama-cpp-python>=0.3.36,<0.4\""
        + (" (and try flash_attn 'auto')" if cfg.flash_attn != "auto" else "") + "; or run without exact")
