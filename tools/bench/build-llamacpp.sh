#!/usr/bin/env bash
# Builds llama.cpp, the CPU peer of the side-by-side figures in docs/performance.md, outside the
# repository. Nothing it fetches or builds is committed. Safe to re-run (each step is skipped when
# its output exists).
#
#   tools/bench/build-llamacpp.sh [DIR]        (DIR default: /work/llamacpp-build; JOBS=2 by default)
#   AVX2_ONLY=1 tools/bench/build-llamacpp.sh /work/llamacpp-avx2
#                                        the same without -march=native: ggml's portable x86 set (SSE4.2,
#                                        AVX, AVX2, BMI2, FMA, F16C; no AVX-512, no AVX-VNNI), what an
#                                        AVX2-only CPU (the Zen 3 EPYC VMs) builds; to run beside
#                                        shardserve under SHARDSERVE_CPU_ISA=avx2 on an AVX-512 VM
#
# What it makes, under DIR:
#   src/                 llama-cpp-python 0.3.36's source package from PyPI (pip download --no-binary),
#                        whose vendor/llama.cpp is the llama.cpp that was measured
#   build/bin/           llama-bench, llama-batched-bench, llama-server, llama-quantize, llama-simple:
#                        llama.cpp's own CMake, Release, CPU only, its defaults for this CPU
#                        (-march=native, less AMX where the CPU has it: below; OpenMP, llamafile's
#                        sgemm), no curl / OpenSSL; its model graph
#                        builders (src/models/*.cpp) in unity batches, for build time only
#                        (tools/bench/llamacpp/unity-models.cmake says which files and why)
#   venv/                numpy + the gguf package vendored with it (gguf-py) + safetensors, which is what
#                        tools/bench/bench_model_to_gguf.py needs. llama.cpp's own convert_hf_to_gguf.py also
#                        needs torch and transformers (its requirements pin torch 2.11 from PyTorch's
#                        index); they are installed only with CONVERTER=1, as they are large.
# The build runs under `nice -n $NICE` (default 10), with JOBS parallel jobs, so that it leaves a shared
# machine usable (where every other build runs at nice 0, NICE=10 gets it a few per cent of the CPU).
set -euo pipefail

TOOLS="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
DIR="${1:-/work/llamacpp-build}"
JOBS="${JOBS:-2}"
VERSION=0.3.36
mkdir -p "$DIR"
cd "$DIR"

if [ ! -x venv/bin/python ]; then
  python3 -m venv venv
fi
if [ ! -d src ]; then
  venv/bin/pip download "llama-cpp-python==$VERSION" --no-binary :all: --no-deps -d sdist
  mkdir -p src
  tar xzf "sdist/llama_cpp_python-$VERSION.tar.gz" -C src --strip-components=1
fi
LCPP="$DIR/src/vendor/llama.cpp"

if ! venv/bin/python -c "import gguf, numpy, safetensors" 2>/dev/null; then
  venv/bin/pip install "numpy~=2.2.6" "safetensors==0.8.0" "$LCPP/gguf-py"
fi
if [ "${CONVERTER:-0}" = 1 ] && ! venv/bin/python -c "import torch, transformers" 2>/dev/null; then
  venv/bin/pip install -r "$LCPP/requirements/requirements-convert_hf_to_gguf.txt"
fi

# On a CPU with AMX (Intel Xeon from Sapphire Rapids on), -march=native compiles ggml's AMX products
# for Q4_0 / Q8_0, and on this project's Intel VM they crash at their first tile instruction
# (llama-bench and llama-server: SIGSEGV at ldtilecfg in ggml_backend_amx_mul_mat for Q8_0, SIGILL
# for Q4_0; llama.cpp issue 20824, fix proposed in pull request 26954: tile-data permission asked
# for on the main thread only, and a tile config the compiler may drop). So there, everything
# -march=native gives except AMX (AVX-512, VNNI, BF16 and the weight repacking stay on).
NO_AMX=()
if grep -qw amx_tile /proc/cpuinfo; then
  NO_AMX=(-DCMAKE_C_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"
          -DCMAKE_CXX_FLAGS="-mno-amx-tile -mno-amx-int8 -mno-amx-bf16")
fi
ISA=()
if [ "${AVX2_ONLY:-0}" = 1 ]; then
  NO_AMX=()
  ISA=(-DGGML_NATIVE=OFF)
fi
if [ ! -f build/CMakeCache.txt ]; then
  cmake -S "$LCPP" -B build -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF -DLLAMA_CURL=OFF \
      -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF "${NO_AMX[@]}" "${ISA[@]}" \
      -DCMAKE_PROJECT_INCLUDE="$TOOLS/llamacpp/unity-models.cmake"
fi
nice -n "${NICE:-10}" cmake --build build -j "$JOBS" --target llama-bench llama-batched-bench llama-server \
    llama-quantize llama-simple
echo "llama.cpp (llama-cpp-python $VERSION's vendor/llama.cpp) in $DIR/build/bin"
