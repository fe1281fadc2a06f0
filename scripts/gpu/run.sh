#!/usr/bin/env bash
# localspec on a CUDA GPU in one call: build llama-cpp-python 0.3.36 for sm_90 from the slim sdist that
# prepare.sh made, write the synthetic Qwen2.5-Coder 1.5B/0.5B pair, and measure localspec's speculation costs
# with every layer of both models offloaded. Logs, the cost curves (JSON) and a timing of each step go to $OUT.
#
#   bash scripts/gpu/run.sh            (on the device; scripts/gpu/README.md has the exact call)
#
# Nothing is fetched: the wheels and the source come from scripts/gpu/dist/. A build cut short by the deadline
# resumes where it stopped when the same command is run again at once (scripts/gpu/build/ stays while the
# machine is warm). Environment: OUT (default scripts/gpu/out), PYTHON (python3), GPU_DEADLINE (seconds this
# script may take, default 570), CUDA_ARCH (90), GPU_CMAKE_ARGS (more CMake arguments), GPU_DRY_RUN=1 (the
# same steps on a machine without a GPU: a CPU build, nothing offloaded, the calibration's sizes only).
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)
OUT=${OUT:-$here/out}
py=${PYTHON:-python3}
deadline=${GPU_DEADLINE:-570}
dry=${GPU_DRY_RUN:-0}
work=$here/build
dist=$here/dist
sdist=$dist/llama-cpp-python-0.3.36-slim.tar.xz
models=$work/models
start=$(date +%s)
mkdir -p "$OUT" "$work"
exec > >(tee -a "$OUT/run.log") 2>&1

now() { date +%s.%N; }
elapsed() { echo $(( $(date +%s) - start )); }
step() {  # step NAME COMMAND...: run it, and record its exit status and seconds in $OUT/timings.tsv
    local name=$1 t0 rc
    shift
    t0=$(now)
    echo "== $name ($(elapsed) s in)"
    "$@"
    rc=$?
    printf '%s\t%s\t%s\n' "$name" "$rc" "$(awk -v a="$t0" -v b="$(now)" 'BEGIN{printf "%.1f", b - a}')" >> "$OUT/timings.tsv"
    return $rc
}

report_env() {
    date -u
    nvidia-smi --query-gpu=name,memory.total,driver_version,clocks.sm,clocks.max.sm --format=csv 2>&1
    grep -m1 'model name' /proc/cpuinfo
    echo "nproc $(nproc); $(free -g | awk '/Mem:/{print $2 " GiB memory"}')"
    "$py" -V
    "$py" -m pip --version
    cmake --version | head -1
    echo "ninja $(ninja --version)"
    "$py" -c "import numpy, packaging, pathspec; print('numpy', numpy.__version__)"
    return 0
}

install_wheels() {  # diskcache (llama-cpp-python needs it), gguf (synth.py), scikit-build-core (the build)
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$work/site" \
        "$dist"/wheels/*.whl
}

make_models() {
    "$py" "$here/synth.py" "$here/qwen2.5-coder.json.xz" "$models"
}

build() {
    mkdir -p "$work/src"
    [ -d "$work/src/llama_cpp_python-0.3.36" ] || tar xJf "$sdist" -C "$work/src" || return 1
    if [ "$dry" = 1 ]; then
        export CMAKE_ARGS="-DGGML_CUDA=off -DLLAVA_BUILD=OFF ${GPU_CMAKE_ARGS:-}"
        : > "$work/cuda_lib_dirs"
    else
        # shellcheck source=cuda_env.sh
        . "$here/cuda_env.sh"
        cuda_env "$py" || return 1
        echo "$CUDA_LIB_DIRS" > "$work/cuda_lib_dirs"
        export CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-90} -DLLAVA_BUILD=OFF $CUDA_CMAKE_ARGS ${GPU_CMAKE_ARGS:-}"
    fi
    export CMAKE_BUILD_PARALLEL_LEVEL=$(nproc)
    echo "CMAKE_ARGS=$CMAKE_ARGS"
    local budget=$(( deadline - $(elapsed) - 100 ))  # leave time for the models and the measurements
    echo "building (log: build.log), at most $budget s"
    timeout -k 10 "$budget" "$py" -m pip install --no-index --no-deps --no-build-isolation --no-cache-dir \
        --upgrade --target "$work/site" -C build-dir="$work/cmake" -v \
        "$work/src/llama_cpp_python-0.3.36" > "$OUT/build.log" 2>&1
    local rc=$?
    if [ $rc -eq 124 ] || [ $rc -eq 137 ]; then
        echo "BUILD CUT SHORT at the deadline, at step $(grep -oE "\[[0-9]+/[0-9]+\]" "$OUT/build.log" | tail -1) of the build:"
        echo "run the same command again at once to resume it"
        return 3
    fi
    [ $rc -eq 0 ] || { tail -40 "$OUT/build.log"; return $rc; }
    touch "$work/built"
}

check_build() {
    "$py" - "$dry" <<'EOF'
import sys

import llama_cpp as L

info = L.llama_print_system_info().decode()
print("llama-cpp-python", L.__version__, "from", L.__file__)
print("llama.cpp:", info)
if sys.argv[1] != "1":
    assert L.llama_supports_gpu_offload(), "this llama.cpp cannot offload layers to a GPU"
    assert "CUDA" in info, "no CUDA backend in this build"
EOF
}

measure() {  # measure NAME [costs.py options]
    local name=$1
    shift
    "$py" "$here/costs.py" measure --target "$models/synthetic-qwen2.5-coder-1.5b-instruct-q4_k_m.gguf" \
        --draft "$models/synthetic-qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" --out "$OUT/$name.json" "$@"
}

export PYTHONPATH=$work/site:$repo${PYTHONPATH:+:$PYTHONPATH}
export PYTHONUNBUFFERED=1
step environment report_env
if [ ! -f "$work/site/.wheels" ]; then
    step wheels install_wheels || exit 1
    touch "$work/site/.wheels"
fi
models_pid=""
if [ ! -f "$models/synthetic-qwen2.5-coder-0.5b-instruct-q4_k_m.gguf" ]; then
    step models make_models &  # one core writes 1.6 GB of random weights while the others compile
    models_pid=$!
fi
if [ ! -f "$work/built" ]; then
    step build build || exit $?
fi
LD_LIBRARY_PATH=$(cat "$work/cuda_lib_dirs")${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
export LD_LIBRARY_PATH
step check-build check_build || exit 1
if [ -n "$models_pid" ]; then
    wait "$models_pid" || { echo "writing the synthetic models failed"; exit 1; }
fi
if [ "$dry" = 1 ]; then
    step costs-cpu measure costs-cpu --n-gpu-layers 0 || exit 1
else
    step costs-gpu measure costs-gpu --n-gpu-layers -1 --all-sizes || exit 1
    # A second curve with flash attention off, where time is left: llama.cpp's 'auto' turns it on on a GPU.
    if [ $(( deadline - $(elapsed) )) -gt 60 ]; then
        step costs-gpu-fa-off measure costs-gpu-fa-off --n-gpu-layers -1 --flash-attn off
    fi
fi

echo "== summary ($(elapsed) s)"
column -t "$OUT/timings.tsv" 2>/dev/null || cat "$OUT/timings.tsv"
"$py" "$here/costs.py" compare "$OUT"/costs-*.json
