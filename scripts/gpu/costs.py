"""Measure localspec's speculation costs for a model pair and write them as JSON; compare two such files.

    python scripts/gpu/costs.py measure --target T.gguf --draft D.gguf [--n-gpu-layers -1] [--threads N]
                                        [--all-sizes] --out costs.json
    python scripts/gpu/costs.py compare A.json B.json [...]

`measure` runs localspec's own calibration (llm.calibration(force=True): verify batches of 1..33 tokens at 256
and 1,024 cached tokens, the draft's time per token and per token of catch-up, the sampler's time per row) and
writes the Costs under the calibration cache's field names (sizes, depths, verify, draft, sample_row,
draft_fill), with the llama.cpp build, the settings and how long each step took. --all-sizes measures every
batch size from 1 to 33 as well (under "all_sizes"), to see steps that the calibration's 13 sizes would
interpolate over. `compare` prints the figures that decide speculation side by side: verify(1) (a plain
decode), verify(5), verify(17) and the draft step, at each depth.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def measure(a) -> None:
    os.environ.setdefault("LOCALSPEC_HOME", tempfile.mkdtemp(prefix="localspec-gpu-"))  # no stale cache
    t0 = time.perf_counter()
    import localspec
    from localspec.core import costs as calibrate
    from localspec.core.llama import system_info
    from localspec.store.machine import cpu_name

    llm = localspec.load(target=a.target, draft=a.draft, n_gpu_layers=a.n_gpu_layers, n_threads=a.threads,
                         n_ctx=a.n_ctx, flash_attn=a.flash_attn, memory_check=False)
    t_load = time.perf_counter() - t0
    t = time.perf_counter()
    costs = llm.calibration(force=True)
    t_cal = time.perf_counter() - t
    print(costs.table(), flush=True)
    out = {**asdict(costs),
           "target_file": str(a.target), "draft_file": str(a.draft), "n_gpu_layers": a.n_gpu_layers,
           "threads": llm.target.n_threads, "flash_attn": [llm.target.flash_attn, llm.draft.flash_attn],
           "n_ctx": llm.target.n_ctx, "system_info": system_info(), "cpu": cpu_name(),
           "machine": platform.node(), "seconds": {"load": round(t_load, 2), "calibration": round(t_cal, 2)}}
    if a.all_sizes:
        calibrate.SIZES = tuple(range(1, 34))  # plan() reads the module's sizes
        t = time.perf_counter()
        full = calibrate.measure(llm.target, llm.draft, log=lambda m: print(f"  {m}", file=sys.stderr, flush=True))
        out["all_sizes"] = asdict(full)
        out["seconds"]["all_sizes"] = round(time.perf_counter() - t, 2)
        print("every batch size, ms:\n" + full.table(), flush=True)
    llm.close()
    Path(a.out).write_text(json.dumps(out, indent=1))
    print(f"costs.py: wrote {a.out}", file=sys.stderr)


def _row(costs, depth_index: int) -> dict[str, float]:
    from localspec.core.costs import Costs

    c = Costs.from_dict(costs)
    d = c.depths[depth_index]
    return {"verify(1)": c.verify_cost(1, d) * 1e3, "verify(5)": c.verify_cost(5, d) * 1e3,
            "verify(17)": c.verify_cost(17, d) * 1e3, "draft": c.draft_cost(d) * 1e3}


def compare(a) -> None:
    runs = [(Path(f).stem, json.loads(Path(f).read_text())) for f in a.files]
    depths = runs[0][1]["depths"]
    print("| ms | depth | " + " | ".join(name for name, _ in runs) + (" | last / first |" if len(runs) > 1 else " |"))
    print("|---|---|" + "---|" * (len(runs) + (len(runs) > 1)))
    for j, depth in enumerate(depths):
        rows = [_row(r, j) for _, r in runs]
        for key in rows[0]:
            ratio = f" | {rows[-1][key] / rows[0][key]:.3f}" if len(rows) > 1 else ""
            print(f"| {key} | {depth} | " + " | ".join(f"{r[key]:.1f}" for r in rows) + ratio + " |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--target", required=True)
    m.add_argument("--draft", required=True)
    m.add_argument("--n-gpu-layers", type=int, default=-1)
    m.add_argument("--threads", type=int)
    m.add_argument("--n-ctx", type=int, default=4096)
    m.add_argument("--flash-attn", default="auto", choices=["auto", "on", "off"])
    m.add_argument("--all-sizes", action="store_true")
    m.add_argument("--out", required=True)
    c = sub.add_parser("compare")
    c.add_argument("files", nargs="+")
    a = ap.parse_args()
    measure(a) if a.cmd == "measure" else compare(a)


if __name__ == "__main__":
    main()
