"""This machine's measurements, kept: speculation costs (core.costs) and exact mode's verdicts (core.exact),
as JSON under $LOCALSPEC_HOME/calibration, once per machine, llama.cpp build, model files and settings.
`localspec calibrate` shows the costs and `--force` measures again.
"""
from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import asdict, replace
from pathlib import Path

from ..core.costs import BATCH_SEQS, Costs, measure, measure_batch, plan
from ..core.llama import system_info
from ..core.exact import Cell, describe, probe_depths, probe_exact
from ..core.model import Model, ModelConfig, ModelError, default_threads, tiled_matmul_setting
from .machine import keep, machine_key, read_kept

# Real text (prose, commands and code), cycled where a context is longer: the exact probe reads it at every depth.
PROBE_TEXT = Path(__file__).with_name("probe_text.txt")

FORMAT = 9  # bump when the cached cost files change shape or how they are measured
PROBE_FORMAT = 2  # bump when what the exact probe covers changes: older verdicts are then not trusted


def _ident(path: Path, cfg: ModelConfig) -> list:
    st = path.stat()
    return [str(path.resolve()), st.st_size, st.st_mtime_ns, repr(cfg)]


def cache_key(target: Model, draft: Model | None) -> str:
    """The costs' key: machine, build, files and settings. The context size counts only as far as it changes
    what is measured (the depths and batch sizes that fit): --n-ctx 2048 and 4096 share one measurement."""
    def ident(m: Model | None):
        if m is None:
            return None
        measured = plan(m.n_ctx, m.n_batch)
        return [*_ident(m.path, replace(m.cfg, n_ctx=16)), measured, m.flash_attn, m.n_threads]
    return machine_key("costs", FORMAT, ident(target), ident(draft))


def load_or_measure(target: Model, draft: Model | None, cache_dir: Path, *, force: bool = False,
                    stop=None) -> Costs:
    """The cached costs for this machine and these models, measuring them (with progress) the first time.
    stop: as measure() takes it."""
    path = cache_dir / f"{cache_key(target, draft)}.json"
    data = None if force else read_kept(path)
    costs = None
    if data is not None:
        with contextlib.suppress(KeyError, TypeError, ValueError):
            costs = Costs.from_dict(data)
    log = lambda msg: print(f"  {msg}", file=sys.stderr, flush=True)  # noqa: E731
    if costs is None:
        print(f"localspec: measuring speculation costs on this machine for {target.path.name} "
              "(once; a minute to a few, by the CPU)", file=sys.stderr, flush=True)
        costs = measure(target, draft, log=log, stop=stop)
        keep(path, asdict(costs))
    wanted = [b for b in BATCH_SEQS if b < len(target.seqs)]
    if wanted and max((b for b, _ in costs.batch or ()), default=0) < wanted[-1]:
        print(f"localspec: measuring what {wanted[-1]} parallel requests cost in one decode (once)",
              file=sys.stderr, flush=True)
        costs = measure_batch(target, costs, log=log)
        keep(path, asdict(costs))
    return costs


def costs_keeper(cache_dir: Path):
    """What an Engine calls for its costs: load_or_measure, kept in cache_dir."""
    def costs(target: Model, draft: Model | None, *, force: bool = False, stop=None) -> Costs:
        return load_or_measure(target, draft, cache_dir, force=force, stop=stop)
    return costs


def exact_flash_attn(path: Path, cfg: ModelConfig, cache_dir: Path, *, force: bool = False, log=None) -> str:
    """The flash-attention setting under which this machine's logits are bit-identical, single-token against
    batched, at every verify width and over the whole context (probe_exact).

    Tries the setting asked for, or with 'auto' first off (faster on a CPU) then on. Cached per machine,
    build, model and settings: a verdict for a context at least as deep is reused. Raises ModelError naming
    the cells that differ and the fix when no setting is exact.
    """
    threads = cfg.n_threads or default_threads()
    key = machine_key("exact", PROBE_FORMAT, tiled_matmul_setting(),
                      _ident(path, replace(cfg, n_ctx=16, n_threads=threads)))  # any n_ctx: the verdict says how deep
    file = cache_dir / f"exact-{key}.json"
    seen = None if force else read_kept(file)
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
            cells = probe_exact(path, cfg, fa, PROBE_TEXT.read_text(encoding="utf-8"), log)
            if log:
                log(f"  {'exact' if not cells else 'not exact'} with flash attention {fa} "
                    f"({time.perf_counter() - t:.0f} s)")
            seen[fa] = {"n_ctx": cfg.n_ctx, "cells": [list(asdict(c).values()) for c in cells]}
            keep(file, seen)
        found[fa] = [c for c in cells if c.depth < cfg.n_ctx]
        if not found[fa]:
            return fa
    diffs = "; ".join(f"flash attention {fa}: {describe(found[fa])}" for fa in order)
    info = system_info()
    if "LLAMAFILE = 1" in info:
        fix = ("rebuild llama-cpp-python without llamafile's sgemm: CMAKE_ARGS=\"-DGGML_LLAMAFILE=OFF\" pip install "
               "--force-reinstall --no-cache-dir \"llama-cpp-python>=0.3.36,<0.4\"")
    elif tiled_matmul_setting() != "0":
        fix = ("ggml's tiled matmul was on when this process loaded its first model: set GGML_CPU_TILED_MM=0 before "
               "starting, or load the exact models first (exact mode turns it off then)")
    else:
        fix = "no build setting known to localspec makes this CPU exact"
    raise ModelError(
        f"exact mode cannot be honoured on this machine: single-token and batched logits of {path.name} differ "
        f"({diffs}), so speculative output could differ from plain output. llama.cpp's kernels decide this per "
        f"CPU and build ({info}). Fix: {fix}"
        + (" (and try flash_attn 'auto')" if cfg.flash_attn != "auto" else "") + "; or run without exact")
