"""What shapes a prompt-cache state's bytes: the name of the folder (store.prefix.KvFiles) its states are kept in.

A state is only ever found by a process that would have computed the same bytes: the model file (its sha256 where
the registry verified it, else its size, mtime and a hash of its head and tail), the context and KV settings,
offload, the llama.cpp build and its state format, the CPU.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

from .prefix import FORMAT


def file_identity(path: Path) -> dict:
    """The model file's identity: its sha256 where the registry verified it (and it has not changed since),
    else its size, mtime and a sha256 of its first and last 4 MiB (reading 8 MiB, not the whole file)."""
    from .registry import known_sha256

    path = Path(path)
    sha = known_sha256(path)
    if sha is not None:
        return {"sha256": sha}
    st = path.stat()
    h, chunk = hashlib.sha256(), 4 << 20
    with open(path, "rb") as f:
        h.update(f.read(chunk))
        if st.st_size > chunk:
            f.seek(max(chunk, st.st_size - chunk))
            h.update(f.read(chunk))
    return {"size": st.st_size, "mtime_ns": st.st_mtime_ns, "head_tail_sha256": h.hexdigest()}


def fingerprint(model) -> tuple[str, dict]:
    """(folder name, meta) for a loaded core.model.Model: the name hashes everything that shapes its states'
    bytes (the file, context and KV settings, offload, the llama.cpp build, its state format, the CPU); meta says
    it for people. n_threads and n_seq are left out: they do not change the bytes."""
    import llama_cpp as L

    from ..core.llama import system_info, tiled_matmul_setting
    from .machine import cpu_name

    cfg = model.cfg
    settings = {"n_ctx": model.n_ctx, "type_k": cfg.type_k, "type_v": cfg.type_v, "flash_attn": model.flash_attn,
                "extra_bufts": bool(model.extra_bufts), "exact": bool(cfg.exact), "n_gpu_layers": cfg.n_gpu_layers,
                "kwargs": {k: cfg.kwargs[k] for k in sorted(cfg.kwargs)}}
    build = {"llama_cpp_python": L.__version__, "state_seq_version": L.LLAMA_STATE_SEQ_VERSION,
             "machine": platform.machine(), "cpu": cpu_name(), "system_info": system_info(),
             "tiled_matmul": tiled_matmul_setting(), "LLAMA_ATTN_ROT_DISABLE": os.environ.get("LLAMA_ATTN_ROT_DISABLE")}
    key = {"format": FORMAT, "file": file_identity(model.path), "settings": settings, "build": build}
    name = hashlib.sha256(json.dumps(key, sort_keys=True, default=repr).encode()).hexdigest()[:32]
    return name, {"model": Path(model.path).name, "path": str(Path(model.path).resolve()), **key}
