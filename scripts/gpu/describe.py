"""Describe GGUF models for synth.py: every metadata key (with its GGUF type) and every tensor's name, shape
and type, in file order, without the weights. Arrays that all the models share (the vocabulary, the merges)
are stored once. The result is small JSON, xz-compressed.

    python scripts/gpu/describe.py scripts/gpu/qwen2.5-coder.json.xz \
        target=.../qwen2.5-coder-1.5b-instruct-q4_k_m.gguf draft=.../qwen2.5-coder-0.5b-instruct-q4_k_m.gguf

(`localspec pull NAME` prints where a model's file is.)
"""
from __future__ import annotations

import hashlib
import json
import lzma
import sys
from pathlib import Path

from gguf import GGUFReader, GGUFValueType

FORMAT = 1


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            h.update(chunk)
    return h.hexdigest()


def describe_file(path: Path) -> dict:
    r = GGUFReader(path)
    metadata = []
    for key, f in r.fields.items():
        if key.startswith("GGUF."):  # the header's own fields (version, counts): not metadata
            continue
        vtype = f.types[0]
        sub = f.types[1] if vtype == GGUFValueType.ARRAY else None
        if vtype == GGUFValueType.ARRAY and sub == GGUFValueType.ARRAY:
            raise SystemExit(f"{path.name}: nested array {key!r} is not supported")
        metadata.append([key, vtype.name, sub.name if sub is not None else None, f.contents()])
    tensors = [[t.name, [int(n) for n in t.shape], t.tensor_type.name] for t in r.tensors]
    return {"file": path.name, "size": path.stat().st_size, "sha256": _sha256(path), "alignment": r.alignment,
            "data_offset": r.data_offset, "metadata": metadata, "tensors": tensors}


def describe(models: dict[str, Path]) -> dict:
    described = {role: describe_file(path) for role, path in models.items()}
    # An array identical in every model is stored once, under "shared", and referenced by its key.
    shared = {}
    first, *rest = described.values()
    for entry in first["metadata"]:
        key, vtype, _, value = entry
        if vtype == "ARRAY" and all(any(e[0] == key and e[3] == value for e in m["metadata"]) for m in rest):
            shared[key] = value
    for m in described.values():
        for entry in m["metadata"]:
            if entry[0] in shared:
                entry[3] = {"shared": entry[0]}
    return {"format": FORMAT, "models": described, "shared": shared}


def main() -> None:
    if len(sys.argv) < 3 or not all("=" in a for a in sys.argv[2:]):
        raise SystemExit(__doc__)
    models = {role: Path(p).expanduser() for role, p in (a.split("=", 1) for a in sys.argv[2:])}
    data = json.dumps(describe(models), ensure_ascii=False, separators=(",", ":")).encode()
    out = Path(sys.argv[1])
    out.write_bytes(lzma.compress(data, preset=9 | lzma.PRESET_EXTREME))
    print(f"describe.py: {out} ({out.stat().st_size / 2**20:.2f} MiB; {len(data) / 2**20:.1f} MiB of JSON)")


if __name__ == "__main__":
    main()
