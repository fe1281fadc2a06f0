#!/usr/bin/env bash
# Make scripts/gpu/dist/ (git-ignored): what run.sh needs on a device machine that reaches no registry.
#   dist/llama-cpp-python-0.3.36-slim.tar.xz  llama-cpp-python's sdist cut down to a CUDA/CPU build (slim.py)
#   dist/wheels/                              pure-Python wheels the device's image lacks
# Fetched with pip (the 77 MB sdist into cache/, which stays here) and checked against SHA256SUMS. A second
# run does nothing.
#
#   bash scripts/gpu/prepare.sh        (with PyPI reachable; then carry scripts/gpu/dist to the device)
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
py=${PYTHON:-python3}
slim=dist/llama-cpp-python-0.3.36-slim.tar.xz
cd "$here"
mkdir -p cache dist/wheels
if ! sha256sum --quiet -c SHA256SUMS >/dev/null 2>&1; then
    "$py" -m pip download -q --no-deps --no-binary :all: -d cache llama-cpp-python==0.3.36
    "$py" -m pip download -q --no-deps --only-binary :all: --python-version 3.12 --implementation cp \
        --platform manylinux_2_28_x86_64 -d dist/wheels diskcache==5.6.3 gguf==0.19.0 scikit-build-core==1.1.2 \
        pathspec==1.1.1
    sha256sum --quiet -c SHA256SUMS
fi
if [ ! -f "$slim" ] || [ "$slim" -ot cache/llama_cpp_python-0.3.36.tar.gz ] || [ "$slim" -ot slim.py ]; then
    "$py" slim.py cache/llama_cpp_python-0.3.36.tar.gz "$slim.part"
    mv "$slim.part" "$slim"
fi
# What a device call sends: the tracked files, the untracked ones git does not ignore, and the carried dist/.
cd "$(git rev-parse --show-toplevel)"
size() { xargs -0 -r stat -c %s | awk '{n += $1} END {print n + 0}'; }
tracked=$(git ls-files -z | size)
untracked=$(git ls-files -z -o --exclude-standard | size)
carried=$(find scripts/gpu/dist -type f -print0 | size)
awk -v t="$tracked" -v u="$untracked" -v c="$carried" 'BEGIN {
    m = 2^20; printf "travels: %.2f MiB tracked + %.2f MiB untracked + %.2f MiB scripts/gpu/dist = %.2f MiB (limit 64)\n",
    t / m, u / m, c / m, (t + u + c) / m; exit (t + u + c >= 64 * m) }'
