"""Write GGUF models with random weights from a description made by describe.py.

The file has the real model's metadata (vocabulary, merges, chat template, hyperparameters) and its tensors
in the same order, with the same shapes and the same quantization types, tensor by tensor: only the weights
are random. A decode reads and multiplies the same bytes in the same kernels, so it costs what the real
model's does; its text is noise. Quantized blocks are written directly (random codes, scales chosen so the
weights have a standard deviation near 0.02 and mean near 0), so no quantizer is needed and the mix of types
is exactly the real file's: the "Q4_K_M" 0.5B, for one, is mostly Q5_0 and Q8_0.

    python scripts/gpu/synth.py scripts/gpu/qwen2.5-coder.json.xz OUTDIR [--role target] [--layers N]
"""
from __future__ import annotations

import argparse
import json
import lzma
import sys
import time
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType, GGUFWriter
from gguf.quants import dequantize

DESCRIPTION = Path(__file__).with_name("qwen2.5-coder.json.xz")
STD = 0.02  # weights' standard deviation: activations stay finite through every layer

# Where each block type keeps its fp16 scale (d) and, for the types with one, its fp16 min (m), by byte
# offset; int8 sub-block scales (Q6_K) are drawn small so that d stays a normal fp16 number.
BLOCKS = {
    "Q4_0": {"d": 0}, "Q4_1": {"d": 0, "m": 2}, "Q5_0": {"d": 0}, "Q5_1": {"d": 0, "m": 2}, "Q8_0": {"d": 0},
    "Q4_K": {"d": 0, "m": 2}, "Q5_K": {"d": 0, "m": 2}, "Q6_K": {"d": 208, "int8": (192, 208)},
}


def load_description(path: str | Path = DESCRIPTION) -> dict:
    return json.loads(lzma.decompress(Path(path).read_bytes()))


def metadata(desc: dict, role: str) -> list[tuple[str, GGUFValueType, GGUFValueType | None, object]]:
    """(key, type, array item type, value) of each metadata key of a described model, shared arrays resolved."""
    out = []
    for key, vtype, sub, value in desc["models"][role]["metadata"]:
        if isinstance(value, dict):
            value = desc["shared"][value["shared"]]
        out.append((key, GGUFValueType[vtype], GGUFValueType[sub] if sub else None, value))
    return out


def _random_blocks(rng: np.random.Generator, qtype: str, n_blocks: int, d: float, m: float) -> np.ndarray:
    spec = BLOCKS[qtype]
    size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][1]
    blocks = np.frombuffer(bytearray(rng.bytes(n_blocks * size)), dtype=np.uint8).reshape(n_blocks, size)
    if "int8" in spec:
        a, b = spec["int8"]
        blocks[:, a:b] = ((blocks[:, a:b] & 31).astype(np.int8) - 16).view(np.uint8)
    blocks[:, spec["d"]:spec["d"] + 2] = np.frombuffer(np.float16(d).tobytes(), np.uint8)
    if "m" in spec:
        blocks[:, spec["m"]:spec["m"] + 2] = np.frombuffer(np.float16(m).tobytes(), np.uint8)
    return blocks


_SCALES: dict[str, tuple[float, float]] = {}


def block_scales(qtype: str) -> tuple[float, float]:
    """(d, m) for a block type such that its dequantized weights have mean ~0 and standard deviation ~STD."""
    if qtype not in _SCALES:
        qt = GGMLQuantizationType[qtype]

        def weights(d, m):
            return dequantize(_random_blocks(np.random.default_rng(1), qtype, 2048, d, m), qt).astype(np.float64)

        ratio = 0.0
        if "m" in BLOCKS[qtype]:  # zero the mean: d * E[with d=1, m=0] + m * E[with d=0, m=1] = 0
            ratio = -weights(1.0, 0.0).mean() / weights(0.0, 1.0).mean()
        scale = STD / weights(1.0, ratio).std()
        _SCALES[qtype] = (scale, ratio * scale)
    return _SCALES[qtype]


def tensor_data(rng: np.random.Generator, name: str, shape: list[int], qtype: str) -> np.ndarray:
    n = int(np.prod(shape))
    if qtype == "F32":
        if name.endswith("norm.weight"):
            return np.ones(n, dtype=np.float32)
        return rng.standard_normal(n, dtype=np.float32) * np.float32(STD)
    if qtype == "F16":
        return (rng.standard_normal(n, dtype=np.float32) * np.float32(STD)).astype(np.float16)
    if qtype not in BLOCKS:
        raise ValueError(f"tensor {name}: type {qtype} is not supported by synth.py (supported: F32, F16, "
                         f"{', '.join(BLOCKS)})")
    block = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]][0]
    if shape[0] % block:
        raise ValueError(f"tensor {name}: a row of {shape[0]} is not a whole number of {qtype} blocks ({block})")
    return _random_blocks(rng, qtype, n // block, *block_scales(qtype)).reshape(-1)


def nbytes(shape: list[int], qtype: str) -> int:
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[qtype]]
    return int(np.prod(shape)) // block * size


def write(desc: dict, role: str, path: str | Path, *, layers: int | None = None, seed: int = 0) -> Path:
    """Write the described model `role` to path with random weights. layers: keep only the first N blocks
    (block_count becomes N), for small test models; None keeps them all."""
    model = desc["models"][role]
    meta = metadata(desc, role)
    arch = next(v for k, _, _, v in meta if k == "general.architecture")
    tensors = model["tensors"]
    if layers is not None:
        tensors = [t for t in tensors if not (t[0].startswith("blk.") and int(t[0].split(".")[1]) >= layers)]
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    part = path.with_name(path.name + ".part")
    w = GGUFWriter(part, arch)
    w.data_alignment = model["alignment"]
    for key, vtype, sub, value in meta:
        if key == "general.architecture":  # GGUFWriter writes it first, as llama.cpp's writers do
            continue
        if key == f"{arch}.block_count" and layers is not None:
            value = layers
        w.add_key_value(key, value, vtype, sub)
    for name, shape, qtype in tensors:
        # the element shape in numpy order (rows first) with the block type: nothing is converted
        w.add_tensor_info(name, list(reversed(shape)), np.dtype(np.float32), nbytes(shape, qtype),
                          raw_dtype=GGMLQuantizationType[qtype])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    rng = np.random.default_rng(seed)
    for name, shape, qtype in tensors:
        w.write_tensor_data(tensor_data(rng, name, shape, qtype))
    w.close()
    part.replace(path)
    return path


def synthetic_name(desc: dict, role: str) -> str:
    return "synthetic-" + desc["models"][role]["file"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("description", type=Path)
    ap.add_argument("outdir", type=Path)
    ap.add_argument("--role", action="append", help="which described model (default: all)")
    ap.add_argument("--layers", type=int, help="keep only the first N transformer blocks")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    desc = load_description(a.description)
    for role in a.role or list(desc["models"]):
        t = time.perf_counter()
        p = write(desc, role, a.outdir / synthetic_name(desc, role), layers=a.layers, seed=a.seed)
        print(f"synth.py: {role}: {p} ({p.stat().st_size / 2**20:.0f} MiB, {time.perf_counter() - t:.1f} s)",
              file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
