"""What `localspec cache` shows and clears: the prompt cache's disk tier as a whole ($LOCALSPEC_HOME/kv), per model.

Each model folder's meta.json (written by store.prefix.KvFiles) says which model file and settings its states
are for; the states' headers say how many tokens each holds.
"""
from __future__ import annotations

import contextlib
import json
import os
import struct
import time
from pathlib import Path

from .prefix import HEADER, MAGIC, STALE_TEMP_S, SUFFIX, default_root, files_in_root, files_under, is_temp, list_dir


def _meta(folder: Path) -> dict:
    try:
        data = json.loads((folder / "meta.json").read_text(encoding="utf-8"))
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def describe(settings: dict) -> str:
    """A model folder's settings in one short line."""
    s = settings or {}
    if not s:
        return "?"
    bits = [f"n_ctx {s.get('n_ctx')}", f"KV {s.get('type_k')}/{s.get('type_v')}",
            f"flash attention {s.get('flash_attn')}"]
    if s.get("exact"):
        bits.append("exact")
    if s.get("n_gpu_layers"):
        bits.append(f"{s['n_gpu_layers']} GPU layers")
    if s.get("extra_bufts") is False:
        bits.append("no repacking")
    bits += [f"{k}={v}" for k, v in (s.get("kwargs") or {}).items()]
    return ", ".join(bits)


def summary(root: Path | None = None) -> list[dict]:
    """What each model folder under root keeps: model (its file name), path, settings (one short line), scopes,
    files, tokens, bytes (every file's real size), last_used (epoch seconds, or None), most recent first."""
    root = Path(root) if root is not None else default_root()
    out = []
    for model in list_dir(root):
        if not model.is_dir(follow_symlinks=False):
            continue
        meta = _meta(Path(model.path))
        scopes, files, tokens, size, last = set(), 0, 0, 0, None
        for path, st in files_under(Path(model.path)):
            size += st.st_size
            if path.suffix != SUFFIX:
                continue
            scopes.add(path.parent.name)
            files += 1
            last = max(last or 0, st.st_mtime)
            with contextlib.suppress(OSError, struct.error):
                with open(path, "rb") as f:
                    raw = f.read(HEADER.size)
                if len(raw) == HEADER.size and raw[:4] == MAGIC:
                    tokens += HEADER.unpack(raw)[3]
        out.append({"folder": model.name, "model": meta.get("model", "?"), "path": meta.get("path"),
                    "settings": describe(meta.get("settings", {})), "scopes": len(scopes), "files": files,
                    "tokens": tokens, "bytes": size, "last_used": last})
    out.sort(key=lambda r: -(r["last_used"] or 0))
    return out


def names_model(folder: Path, model: str) -> bool:
    """Whether `model` (a models.toml name, a file name, a path, or the folder's own name) names the model whose
    states `folder` (ROOT/FINGERPRINT) keeps."""
    from .registry import RegistryError, load_registry

    names = {model, Path(model).name}
    with contextlib.suppress(RegistryError):
        reg = load_registry()
        if model in reg.models:
            names.add(Path(reg.models[model].file).name)
    with contextlib.suppress(OSError):
        if Path(model).expanduser().exists():
            names.add(str(Path(model).expanduser().resolve()))
    meta = _meta(folder)
    return folder.name in names or meta.get("model") in names or meta.get("path") in names


def clear(root: Path | None = None, model: str | None = None) -> int:
    """Remove what root keeps (only model's folders, when named: a models.toml name, its file's name or path);
    bytes freed. A temp file another process is writing now is left to it."""
    root = Path(root) if root is not None else default_root()
    freed, now = 0, time.time()
    for entry in list_dir(root):
        folder = Path(entry.path)
        if not entry.is_dir(follow_symlinks=False) or (model and not names_model(folder, model)):
            continue
        for path, st in list(files_under(folder)):
            if is_temp(path) and now - st.st_mtime <= STALE_TEMP_S:
                continue
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
                freed += st.st_size
        for sub in list_dir(folder):
            if sub.is_dir(follow_symlinks=False):
                with contextlib.suppress(OSError):
                    os.rmdir(sub.path)
        with contextlib.suppress(OSError):
            os.rmdir(folder)
    return freed


def total_bytes(root: Path | None = None) -> int:
    """Every file's real size under root."""
    return sum(st.st_size for _, st in files_in_root(Path(root) if root is not None else default_root()))


