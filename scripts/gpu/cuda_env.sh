# Sourced by run.sh: `cuda_env PYTHON` finds nvcc, cuBLAS and the CUDA driver library and sets
#   CUDA_CMAKE_ARGS  extra CMake arguments for llama.cpp's CUDA backend
#   CUDA_LIB_DIRS    folders to put on LD_LIBRARY_PATH when the built libraries load
# A toolkit assembled from NVIDIA's pip wheels (as this workplace's images are) has no cuBLAS of its own: it
# sits beside PyTorch (site-packages/nvidia/cu13/lib) under versioned names only (libcublas.so.13), which
# CMake's FindCUDAToolkit does not look for. Such files are passed to CMake by path, their headers by -I.
# With no driver library to link (a machine without a GPU), llama.cpp's VMM pool is left out instead.

cuda_env() {
    local py=${1:-python3} nvcc="" c
    CUDA_CMAKE_ARGS="" CUDA_LIB_DIRS=""
    for c in "${CUDACXX:-}" /usr/local/cuda/bin/nvcc "$(command -v nvcc 2>/dev/null)" /usr/local/cuda-*/bin/nvcc; do
        if [ -n "$c" ] && [ -x "$c" ]; then nvcc=$c; break; fi
    done
    if [ -z "$nvcc" ]; then echo "cuda_env: no nvcc found" >&2; return 1; fi
    CUDA_CMAKE_ARGS="-DCMAKE_CUDA_COMPILER=$nvcc"
    local root
    root=$(cd "$(dirname "$(readlink -f "$nvcc")")/.." && pwd)
    # a wrapper script (/usr/local/bin/nvcc -> exec /usr/local/cuda-13.0/bin/nvcc) hides the real root
    [ -d "$root/lib64" ] || [ -d "$root/targets" ] || root=$(ls -d /usr/local/cuda /usr/local/cuda-* 2>/dev/null | head -1)
    echo "cuda_env: nvcc $nvcc, toolkit $root" >&2

    local cublas="" lt="" inc=""
    if ! ls "$root"/lib64/libcublas.so "$root"/targets/*/lib/libcublas.so >/dev/null 2>&1; then
        cublas=$("$py" - <<'EOF'
import glob, os, sys
hits = [f for p in sys.path if p for f in glob.glob(os.path.join(p, "nvidia", "*", "lib", "libcublas.so*"))]
print(sorted(hits)[0] if hits else "")
EOF
        )
        [ -n "$cublas" ] || cublas=$(find /usr /opt -name 'libcublas.so*' -not -name '*.a' 2>/dev/null | sort | head -1)
        if [ -z "$cublas" ]; then echo "cuda_env: cuBLAS not found (libcublas.so*)" >&2; return 1; fi
        local dir; dir=$(dirname "$cublas")
        lt=$(ls "$dir"/libcublasLt.so* 2>/dev/null | sort | head -1)
        for c in "$dir/../include" "$root/include" "$root"/targets/*/include; do
            if [ -f "$c/cublas_v2.h" ]; then inc=$(cd "$c" && pwd); break; fi
        done
        if [ -z "$inc" ]; then echo "cuda_env: cublas_v2.h not found near $dir" >&2; return 1; fi
        CUDA_CMAKE_ARGS+=" -DCUDA_cublas_LIBRARY=$cublas -DCMAKE_CUDA_FLAGS=-I$inc"
        [ -n "$lt" ] && CUDA_CMAKE_ARGS+=" -DCUDA_cublasLt_LIBRARY=$lt"
        CUDA_LIB_DIRS=$dir
        echo "cuda_env: cuBLAS $cublas (headers $inc)" >&2
    fi

    local driver=""
    driver=$( { ls "$root"/lib64/stubs/libcuda.so "$root"/targets/*/lib/stubs/libcuda.so 2>/dev/null
                ldconfig -p 2>/dev/null | awk '/libcuda\.so(\.1)? /{print $NF}'
                ls /usr/local/nvidia/lib64/libcuda.so* /usr/lib/x86_64-linux-gnu/libcuda.so* 2>/dev/null; } | head -1)
    if [ -n "$driver" ]; then
        CUDA_CMAKE_ARGS+=" -DCUDA_cuda_driver_LIBRARY=$driver"
        echo "cuda_env: driver library $driver" >&2
    else
        CUDA_CMAKE_ARGS+=" -DGGML_CUDA_NO_VMM=ON"
        echo "cuda_env: no libcuda.so found: building without the VMM memory pool" >&2
    fi
    CUDA_LIB_DIRS=${CUDA_LIB_DIRS:+$CUDA_LIB_DIRS:}$root/lib64
}
