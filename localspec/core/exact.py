"""Exact mode's probe: whether this machine's single-token and batched logits are bit-identical, at every
verify width and over the whole context. llama.cpp's kernels decide it per CPU and build (an AMD EPYC host
needed a build without llamafile's sgemm and ggml's tiled matmul off; its flash-attention kernel splits a
cache of 512 cells and more across threads for a single token). store.calibration keeps the verdicts.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from .model import Model, ModelConfig

PROBE_WIDTHS = range(2, 33)  # exact mode's physical batches hold 32 tokens: every verify or prefill is made of these


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


def _probe_tokens(m: Model, text: str, n: int) -> list[int]:
    toks = m.tokenize(text)
    return (toks * (n // len(toks) + 1))[:n]


def probe_exact(path: Path, cfg: ModelConfig, flash_attn: str, text: str, log=None) -> list[Cell]:
    """Every width 2..32 at every depth of probe_depths(cfg.n_ctx), on real text (`text`: prose, commands and
    code, cycled where the context is longer): the cells whose batched logits differ from single-token ones
    (empty: exact everywhere exact mode can be asked to be). Stops at the first depth with a difference (that
    setting is out whatever the deeper ones say)."""
    m = Model(path, replace(cfg, flash_attn=flash_attn, exact=True))
    try:
        widths = [w for w in PROBE_WIDTHS if w < m.n_ctx]
        tokens = _probe_tokens(m, text, m.n_ctx)
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
