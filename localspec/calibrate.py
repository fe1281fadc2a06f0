"""What speculation costs on this machine: the target's verify time by batch size, the draft's time per token.

Measured once per machine, model files and settings (a few seconds), then cached as JSON under
$LOCALSPEC_HOME/calibration. The auto drafter weighs these costs against acceptance to decide, each round,
whether and how far to speculate.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from dataclasses import asdict, dataclass
from importlib.metadata import version

import numpy as np

from .model import Model

# Batch sizes measured; costs in between are interpolated linearly.
SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 14, 17, 24, 33)
FILL = 256  # tokens already cached while measuring: a typical chat-turn context


@dataclass(frozen=True)
class Costs:
    """Seconds: verify[i] is one target decode of SIZES[i] tokens with logits for all; draft per draft token."""

    sizes: tuple[int, ...]
    verify: tuple[float, ...]
    draft: float | None

    def verify_cost(self, n: int) -> float:
        return float(np.interp(n, self.sizes, self.verify))


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def cache_key(target: Model, draft: Model | None) -> str:
    """Same machine, same model files, same settings -> same costs."""
    def ident(m: Model | None):
        if m is None:
            return None
        st = m.path.stat()
        return [str(m.path.resolve()), st.st_size, st.st_mtime_ns, repr(m.cfg), m.flash_attn]

    key = [platform.node(), platform.machine(), _cpu_name(), os.cpu_count(), version("llama-cpp-python"),
           ident(target), ident(draft)]
    return hashlib.sha256(json.dumps(key).encode()).hexdigest()[:24]


def _time_decode(model: Model, n: int) -> float:
    base = len(model.tokens)
    toks = model.tokens[-n:]
    t = time.perf_counter()
    model.decode(toks, logits="all")
    elapsed = time.perf_counter() - t
    model.truncate(base)
    return elapsed


def measure(target: Model, draft: Model | None, *, reps: int = 3, log=None) -> Costs:
    """Time verify batches on the target and single-token decodes on the draft (both caches end empty).

    Sizes are interleaved across `reps` passes and each keeps its fastest time, so a burst of other work on
    the machine inflates one sample, not the curve; the curve is then made non-decreasing.
    """
    sizes = tuple(n for n in SIZES if n <= min(target.n_batch, target.n_ctx - FILL))
    fill = [(7 + 13 * i) % min(target.n_vocab, 30000) + 100 for i in range(FILL)]
    target.sync(fill)
    _time_decode(target, max(sizes))  # warm-up
    best = np.full(len(sizes), np.inf)
    for rep in range(reps):
        for i, n in enumerate(sizes):
            best[i] = min(best[i], _time_decode(target, n))
        if log:
            log(f"pass {rep + 1}/{reps}: verify 1/{sizes[len(sizes) // 2]}/{sizes[-1]} tokens: "
                f"{best[0] * 1e3:.1f}/{best[len(sizes) // 2] * 1e3:.1f}/{best[-1] * 1e3:.1f} ms")
    target.truncate(0)
    d = None
    if draft is not None:
        draft.sync(fill)
        _time_decode(draft, 1)
        d = min(_time_decode(draft, 1) for _ in range(2 * reps))
        draft.truncate(0)
        if log:
            log(f"draft 1 token: {d * 1e3:.1f} ms")
    return Costs(sizes, tuple(np.maximum.accumulate(best).tolist()), d)


def load_or_measure(target: Model, draft: Model | None, cache_dir) -> Costs:
    """The cached costs for this machine and these models, measuring them (with progress) the first time."""
    path = cache_dir / f"{cache_key(target, draft)}.json"
    try:
        data = json.loads(path.read_text())
        return Costs(tuple(data["sizes"]), tuple(data["verify"]), data["draft"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    print(f"localspec: measuring speculation costs on this machine for {target.path.name} "
          "(once; a few seconds)", file=sys.stderr, flush=True)
    costs = measure(target, draft, log=lambda msg: print(f"  {msg}", file=sys.stderr, flush=True))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(costs)))
    os.replace(tmp, path)
    return costs
