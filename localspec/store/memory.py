"""Will a target and a draft model fit in memory? An estimate read from the GGUF headers, checked before loading.

What is estimated, per model (target and draft each get their own llama.cpp context):
  weights  the GGUF file size (llama.cpp maps the file; a draft that is the target's own file counts once).
  KV       2 (K and V) x n_layer x n_ctx x n_embd_{k,v}_gqa x bytes per element of the KV type, with n_ctx
           rounded up to llama.cpp's 256-cell padding.
  compute  llama.cpp's graph buffer for one ubatch of 512 tokens: the larger of the output logits
           (n_vocab x n_ubatch x 4 bytes) and the attention scores without flash attention
           (n_ctx x n_ubatch x (n_head + 1 for the mask) x 4 bytes), plus a few activation rows.
           Against llama.cpp 0.3.36 (SmolLM2-135M, Qwen2.5-Coder 0.5B/1.5B, n_ctx 2048-32768), KV is exact
           and compute within 1%. Flash attention, when the engine turns it on, makes compute smaller.

What is not estimated:
  - CPU weight repacking (llama.cpp's CPU_REPACK buffers, e.g. q4_K_8x8 on AVX-512) copies part of the
    weights into anonymous memory; the mapped pages it came from become reclaimable, so the file size stays
    the right order, but peak use while loading can be higher.
  - GPU offload. Everything is counted against system RAM, as if every layer ran on the CPU. With
    n_gpu_layers > 0 the offloaded weights, their KV cells and the compute buffer live in VRAM instead,
    which this module does not query: the estimate then overstates RAM needs and says nothing about
    whether VRAM suffices (pass --no-memory-check if it refuses a load that offloading would make fit).
    On Apple Silicon, RAM and VRAM are one pool, so the total is the right figure there.
  - The Python process, the tokenizer, llama.cpp's small output buffers and the OS itself.
So the estimate is a floor, and the check refuses only a load that clearly cannot fit.
"""
from __future__ import annotations

import mmap
import os
import platform
import struct
import subprocess
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from ..core.errors import LocalspecError

# Bytes per element of each KV cache type llama.cpp accepts (block size / elements per block for quants).
KV_BYTES = {
    "f32": 4.0, "f16": 2.0, "bf16": 2.0,
    "q8_0": 34 / 32, "q5_1": 24 / 32, "q5_0": 22 / 32, "q4_1": 20 / 32, "q4_0": 18 / 32, "iq4_nl": 18 / 32,
}
N_UBATCH = 512  # llama.cpp's default physical batch: the compute buffer is sized for it
CTX_PAD = 256   # llama.cpp pads the KV cache to a multiple of this many cells

GiB = 1024 ** 3


class MemoryCheckError(LocalspecError):
    """The models, their KV caches and compute buffers clearly do not fit in available memory."""


class GGUFError(LocalspecError):
    """A file is not a GGUF file localspec can read, or lacks a key the estimate needs."""


# ---- a small GGUF metadata reader (header only; tensor data is never touched) ----

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
_KEEP_ARRAY = 4096  # numeric arrays up to this length are returned (per-layer head counts); longer ones by length


@dataclass(frozen=True)
class ArrayInfo:
    """An array value the reader skipped over (token lists, merges): only its element type and length."""
    type: int
    length: int


def read_gguf_metadata(path: str | os.PathLike) -> dict[str, object]:
    """The key/value metadata of a GGUF (v2 or v3) file. String arrays and long arrays come back as ArrayInfo."""
    path = Path(path)
    st = path.stat()
    return dict(_read_metadata(str(path), st.st_size, st.st_mtime_ns))


@lru_cache(maxsize=16)
def _read_metadata(path: str, size: int, mtime_ns: int) -> tuple[tuple[str, object], ...]:
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"GGUF":
            raise GGUFError(f"{path}: not a GGUF file (magic {bytes(m[:4])!r})")
        if len(m) < 24:
            raise GGUFError(f"{path}: GGUF header is truncated ({len(m)} bytes); delete the file and download it again")
        (version,) = struct.unpack_from("<I", m, 4)
        if version not in (2, 3):
            raise GGUFError(f"{path}: GGUF version {version} is not supported (2 and 3 are)")
        _n_tensors, n_kv = struct.unpack_from("<QQ", m, 8)
        pos = 24

        def string(pos: int) -> tuple[str, int]:
            (n,) = struct.unpack_from("<Q", m, pos)
            return m[pos + 8:pos + 8 + n].decode("utf-8", "replace"), pos + 8 + n

        def value(vtype: int, pos: int) -> tuple[object, int]:
            if vtype in _SCALARS:
                fmt = _SCALARS[vtype]
                return struct.unpack_from(fmt, m, pos)[0], pos + struct.calcsize(fmt)
            if vtype == _STRING:
                return string(pos)
            if vtype != _ARRAY:
                raise GGUFError(f"{path}: unknown GGUF value type {vtype} at byte {pos}")
            etype, n = struct.unpack_from("<IQ", m, pos)
            pos += 12
            if etype in _SCALARS:
                width = struct.calcsize(_SCALARS[etype])
                if n <= _KEEP_ARRAY:
                    return list(struct.unpack_from(f"<{n}{_SCALARS[etype][1]}", m, pos)), pos + n * width
                return ArrayInfo(etype, n), pos + n * width
            for _ in range(n):  # strings (or nested arrays): walk them without building them
                if etype == _STRING:
                    pos += 8 + struct.unpack_from("<Q", m, pos)[0]
                else:
                    _, pos = value(etype, pos)
            return ArrayInfo(etype, n), pos

        items = []
        try:
            for _ in range(n_kv):
                key, pos = string(pos)
                (vtype,) = struct.unpack_from("<I", m, pos)
                val, pos = value(vtype, pos + 4)
                items.append((key, val))
        except struct.error:
            raise GGUFError(f"{path}: GGUF header is truncated or corrupt") from None
        return tuple(items)


# ---- the estimate ----

@dataclass(frozen=True)
class ModelEstimate:
    """Memory one model and its context need, in bytes (see the module docstring for what is counted)."""
    path: str
    arch: str
    n_ctx: int
    cells: int           # n_ctx padded the way llama.cpp pads it
    kv_elements: int     # K plus V elements per cell, over all layers
    weights: int
    kv: int
    logits: int          # compute buffer terms: the output logits of one ubatch,
    scores_per_cell: int  # the attention scores (and mask) per KV cell,
    activations: int     # and a few activation rows

    @property
    def compute(self) -> int:
        return self.compute_at(self.cells)

    def compute_at(self, cells: int) -> int:
        # The graph allocator reuses memory between stages, so the peak is the larger of the two big tensors.
        return max(self.logits, cells * self.scores_per_cell) + self.activations

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute


@dataclass(frozen=True)
class Estimate:
    """The target's and the draft's memory needs together; str() gives the one-line summary --verbose prints."""
    target: ModelEstimate
    draft: ModelEstimate | None
    type_k: str
    type_v: str
    type_k_draft: str | None = None  # None: as the target's
    type_v_draft: str | None = None

    @property
    def models(self) -> tuple[ModelEstimate, ...]:
        return (self.target,) if self.draft is None else (self.target, self.draft)

    @property
    def weights(self) -> int:
        return sum(m.weights for m in self.models)

    @property
    def kv(self) -> int:
        return sum(m.kv for m in self.models)

    @property
    def compute(self) -> int:
        return sum(m.compute for m in self.models)

    @property
    def total(self) -> int:
        return self.weights + self.kv + self.compute

    def __str__(self) -> str:
        ctx = "/".join(str(m.n_ctx) for m in self.models)
        types = f"{self.type_k}/{self.type_v}"
        draft = f"{self.type_k_draft or self.type_k}/{self.type_v_draft or self.type_v}"
        if self.draft is not None and draft != types:
            types += f", draft {draft}"
        return (f"{gib(self.total)} = weights {gib(self.weights)} + KV {gib(self.kv)} "
                f"(n_ctx {ctx}, {types}) + compute {gib(self.compute)}")


def gib(n: float) -> str:
    """Bytes for people: GiB with two decimals, or MiB below one GiB."""
    return f"{n / GiB:.2f} GiB" if n >= GiB else f"{n / 2**20:.0f} MiB"


def _kv_type(name: str) -> float:
    if name not in KV_BYTES:
        raise LocalspecError(f"unknown KV cache type {name!r}; choose one of {', '.join(KV_BYTES)}")
    return KV_BYTES[name]


def _per_layer_max(value: object, key: str, path: Path) -> int:
    if isinstance(value, list):  # per-layer counts (some architectures vary them by layer)
        value = max(value)
    if not isinstance(value, int) or isinstance(value, bool):
        raise GGUFError(f"{path}: GGUF key {key!r} is {value!r}, expected an integer")
    return value


def trained_ctx(path: str | os.PathLike) -> int:
    """The context length a GGUF model was trained for (its `{arch}.context_length`), as llama.cpp's n_ctx=0 means."""
    meta = read_gguf_metadata(path)
    n = meta.get(f"{meta.get('general.architecture')}.context_length")
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise GGUFError(f"{path}: GGUF gives no training context length, so n_ctx=0 cannot mean it; pass a size")
    return n


def model_estimate(path: str | os.PathLike, n_ctx: int, *, type_k: str = "f16", type_v: str = "f16",
                   n_ubatch: int = N_UBATCH, weights: bool = True) -> ModelEstimate:
    """What one GGUF model needs with a context of n_ctx cells (weights=False: its file is counted elsewhere)."""
    path = Path(path)
    meta = read_gguf_metadata(path)
    arch = meta.get("general.architecture")
    if not isinstance(arch, str):
        raise GGUFError(f"{path}: GGUF has no general.architecture")

    def need(key: str) -> int:
        full = f"{arch}.{key}"
        if full not in meta:
            raise GGUFError(f"{path}: GGUF lacks {full!r}, needed for the memory estimate")
        return _per_layer_max(meta[full], full, path)

    n_layer, n_embd, n_head = need("block_count"), need("embedding_length"), need("attention.head_count")
    n_head_kv = need("attention.head_count_kv") if f"{arch}.attention.head_count_kv" in meta else n_head
    head_k = need("attention.key_length") if f"{arch}.attention.key_length" in meta else n_embd // n_head
    head_v = need("attention.value_length") if f"{arch}.attention.value_length" in meta else n_embd // n_head
    tokens = meta.get("tokenizer.ggml.tokens")
    n_vocab = tokens.length if isinstance(tokens, ArrayInfo) else len(tokens) if isinstance(tokens, list) else 0

    cells = -(-n_ctx // CTX_PAD) * CTX_PAD
    kv_per_cell = n_layer * n_head_kv * (head_k * _kv_type(type_k) + head_v * _kv_type(type_v))
    return ModelEstimate(
        str(path), arch, n_ctx, cells, n_layer * n_head_kv * (head_k + head_v),
        weights=path.stat().st_size if weights else 0, kv=int(cells * kv_per_cell),
        logits=n_vocab * n_ubatch * 4, scores_per_cell=n_ubatch * (n_head + 1) * 4,  # n_head score rows + f32 mask
        activations=3 * n_ubatch * n_embd * 4)


def estimate(target_path: str | os.PathLike, draft_path: str | os.PathLike | None, n_ctx: int,
             type_k: str = "f16", type_v: str = "f16", n_ctx_draft: int | None = None, *,
             type_k_draft: str | None = None, type_v_draft: str | None = None,
             n_ubatch: int = N_UBATCH) -> Estimate:
    """Memory for a target (and optional draft) with KV caches of n_ctx cells (the draft's: n_ctx_draft or n_ctx).

    The draft's KV types are type_k_draft/type_v_draft, or the target's when None. Reads only the GGUF
    headers. See the module docstring for what is and is not counted (GPU offload is not).
    """
    target = model_estimate(target_path, n_ctx, type_k=type_k, type_v=type_v, n_ubatch=n_ubatch)
    draft = None
    if draft_path is not None:
        same_file = Path(draft_path).resolve() == Path(target_path).resolve()  # one mapping, shared pages
        draft = model_estimate(draft_path, n_ctx_draft or n_ctx, type_k=type_k_draft or type_k,
                               type_v=type_v_draft or type_v, n_ubatch=n_ubatch, weights=not same_file)
    return Estimate(target, draft, type_k, type_v, type_k_draft, type_v_draft)


# ---- available memory and the check ----

def available_memory() -> int | None:
    """Bytes the OS could give this process now without swapping; None when it cannot be told.

    Linux: MemAvailable from /proc/meminfo, lowered to a cgroup v2 limit when one is set (containers).
    macOS: free + inactive + speculative + purgeable pages from vm_stat (hw.memsize when vm_stat fails).
    """
    system = platform.system()
    if system == "Linux":
        return _linux_available()
    if system == "Darwin":
        return _macos_available()
    return None


def _linux_available() -> int | None:
    avail = None
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except OSError:
        return None
    try:  # a container's own limit can be far below what the host has free
        limit = Path("/sys/fs/cgroup/memory.max").read_text().strip()
        used = int(Path("/sys/fs/cgroup/memory.current").read_text())
        if limit != "max" and avail is not None:
            avail = min(avail, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return avail


def _macos_available() -> int | None:
    try:
        out = subprocess.run(["vm_stat"], capture_output=True, text=True, timeout=5, check=True).stdout
        page = int(out.split("page size of")[1].split()[0])
        pages = {k.strip(): int(v.strip().rstrip(".")) for k, v in
                 (line.split(":", 1) for line in out.splitlines()[1:] if ":" in line)}
        return page * sum(pages.get(f"Pages {k}", 0) for k in ("free", "inactive", "speculative", "purgeable"))
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        pass
    try:
        out = subprocess.run(["sysctl", "-n", "hw.memsize"], capture_output=True, text=True, timeout=5, check=True)
        return int(out.stdout.strip())
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


def _largest_fitting_ctx(est: Estimate, available: int) -> int | None:
    """The largest n_ctx (a multiple of CTX_PAD, below the current one) at which est would fit, or None."""
    for cells in range(max(m.cells for m in est.models) - CTX_PAD, 0, -CTX_PAD):
        need = sum(m.weights + m.kv * min(cells, m.cells) // m.cells + m.compute_at(min(cells, m.cells))
                   for m in est.models)
        if need <= available:
            return cells
    return None


def check_fits(estimate: Estimate, available: int | None, parallel: int = 1) -> None:
    """Raise MemoryCheckError, saying what to lower, when the estimate exceeds available memory.

    available=None (unknown platform) checks nothing. The estimate is a floor (see the module docstring), so
    exceeding what the OS reports available means the load clearly cannot fit. parallel: the requests the
    estimate's cells are shared by (each gets n_ctx of them): the n_ctx hint is per request.
    """
    if available is None or estimate.total <= available:
        return
    hints = []
    fit = (_largest_fitting_ctx(estimate, available) or 0) // parallel // CTX_PAD * CTX_PAD
    if fit:
        each = f" with --parallel {parallel}" if parallel > 1 else ""
        hints.append(f"lower n_ctx (--n-ctx {fit} would fit{each})")
    if parallel > 1:
        hints.append(f"decode fewer requests together (--parallel below {parallel}: each has its own n_ctx cells)")
    saved = estimate.kv - sum(m.cells * m.kv_elements * KV_BYTES["q8_0"] for m in estimate.models)
    if saved > 0:
        hints.append(f"use a q8_0 KV cache (--type-k q8_0 --type-v q8_0 saves about {gib(saved)})")
    hints.append("choose a smaller pair (see `localspec models`)")
    hints.append("or skip this check with --no-memory-check")
    raise MemoryCheckError(f"not enough memory: the models need about {estimate}, "
                           f"but only {gib(available)} is available. To fit: {'; '.join(hints)}")
