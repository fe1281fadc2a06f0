#!/usr/bin/env bash
# Build llama.cpp's own server (llama-server) from the llama.cpp source that the installed llama-cpp-python's
# sdist carries, with llama.cpp's default settings (as llama-cpp-python builds its library), so that
# `scripts/bench_concurrency.py` can measure it as the peer on the same machine, the same prompts and the same
# llama.cpp. Needs PyPI (for the sdist), cmake and a C++ compiler; about 5 minutes on 2 cores; run once.
#   bash scripts/build_llama_server.sh [PYTHON]     -> prints the path of the llama-server binary
# Set CMAKE_ARGS as for the llama-cpp-python install (e.g. -DGGML_LLAMAFILE=OFF) to build it the same way.
set -euo pipefail
PY=${1:-python}
VER=$("$PY" -c 'import llama_cpp; print(llama_cpp.__version__)')
HOME_DIR=${LOCALSPEC_HOME:-${XDG_CACHE_HOME:-$HOME/.cache}/localspec}
TAG=$(echo "$VER ${CMAKE_ARGS:-}" | sha256sum | cut -c1-12)
OUT="$HOME_DIR/peers/llama-server-$VER-$TAG"
if [ -x "$OUT/bin/llama-server" ]; then echo "$OUT/bin/llama-server"; exit 0; fi
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VER" -d "$WORK" >&2
tar xzf "$WORK"/llama_cpp_python-"$VER".tar.gz -C "$WORK"
SRC="$WORK/llama_cpp_python-$VER/vendor/llama.cpp"
# shellcheck disable=SC2086
cmake -S "$SRC" -B "$WORK/build" -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON -DBUILD_SHARED_LIBS=OFF ${CMAKE_ARGS:-} >&2
cmake --build "$WORK/build" --target llama-server -j "$(nproc)" >&2
mkdir -p "$OUT/bin"
cp "$WORK/build/bin/llama-server" "$OUT/bin/llama-server.part"
mv "$OUT/bin/llama-server.part" "$OUT/bin/llama-server"
echo "$OUT/bin/llama-server"
