"""Cut llama-cpp-python's sdist down to what a CUDA (or CPU) build of its shared libraries needs.

The sdist is 77 MB (217 MB unpacked): llama.cpp's test models and vocab files, docs, examples, tools, a
.git folder and a dozen other backends. A build with `-DLLAVA_BUILD=OFF` (no multimodal library) compiles
only llama, ggml-base, ggml-cpu, ggml-cuda and the common library, so only their sources are kept.

    python scripts/gpu/slim.py SDIST.tar.gz OUT.tar.xz
"""
from __future__ import annotations

import io
import sys
import tarfile

ROOT = "llama_cpp_python-0.3.36/"
LC = "vendor/llama.cpp/"
# Paths kept, relative to the sdist's root: a name ending in '/' keeps the whole folder.
KEEP = [
    "pyproject.toml", "CMakeLists.txt", "README.md", "LICENSE.md", "llama_cpp/",
    LC + "CMakeLists.txt", LC + "LICENSE", LC + "cmake/", LC + "include/", LC + "src/", LC + "common/",
    LC + "vendor/", LC + "licenses/",
    LC + "ggml/CMakeLists.txt", LC + "ggml/cmake/", LC + "ggml/include/",
    LC + "ggml/src/ggml-cpu/", LC + "ggml/src/ggml-cuda/",
]
# ggml/src's own files (not its backend folders) are kept too.
GGML_SRC = LC + "ggml/src/"


def kept(rel: str) -> bool:
    if rel.startswith(GGML_SRC) and "/" not in rel[len(GGML_SRC):]:
        return True
    return any(rel == k or (k.endswith("/") and rel.startswith(k)) for k in KEEP)


def slim(src: str, dst: str) -> tuple[int, int]:
    """Write the kept members of src to dst (xz); return (files kept, bytes kept before compression)."""
    n = size = 0
    with tarfile.open(src) as tin, tarfile.open(dst, "w:xz", preset=6) as tout:
        for m in tin:
            if not m.name.startswith(ROOT):
                raise SystemExit(f"unexpected member {m.name!r}: not llama-cpp-python 0.3.36's sdist")
            rel = m.name[len(ROOT):]
            if not (m.isfile() or m.isdir()) or not kept(rel):
                continue
            data = tin.extractfile(m).read() if m.isfile() else None
            tout.addfile(m, io.BytesIO(data) if data is not None else None)
            if m.isfile():
                n, size = n + 1, size + m.size
    return n, size


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    files, size = slim(sys.argv[1], sys.argv[2])
    print(f"slim.py: kept {files} files, {size / 2**20:.1f} MiB before compression -> {sys.argv[2]}")
