#!/usr/bin/env bash
# Builds llama.cpp, the CPU peer of the side-by-side figures in docs/benchmarks.md, outside the
# repository. Nothing it fetches or builds is committed. Safe to re-run (each step is skipped when
# its output exists).
#
#   tools/build-llamacpp.sh [DIR]        (DIR default: /work/llamacpp-build; JOBS=2 by default)
#
# What it makes, under DIR:
#   src/                 llama-cpp-python 0.3.36's source package from PyPI (pip download --no-binary),
#                        whose vendor/llama.cpp is the llama.cpp that was measured
#   build/bin/           llama-bench, llama-batched-bench, llama-server, llama-quantize, llama-simple:
#                        llama.cpp's own CMake, Release, CPU only, its defaults for this CPU
#                        (-march=native, OpenMP, llamafile's sgemm), no curl / OpenSSL; its model graph
#                        builders (src/models/*.cpp) in unity batches, for build time only
#                        (tools/llamacpp/unity-models.cmake says which files and why)
#   venv/                numpy + the gguf package vendored with it (gguf-py) + safetensors, which is what
#                        tools/bench_model_to_gguf.py needs. llama.cpp's own convert_hf_to_gguf.py also
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

if [ ! -f build/CMakeCache.txt ]; then
  cmake -S "$LCPP" -B build -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=OFF -DLLAMA_CURL=OFF \
      -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF \
      -DCMAKE_PROJECT_INCLUDE="$TOOLS/llamacpp/unity-models.cmake"
fi
nice -n "${NICE:-10}" cmake --build build -j "$JOBS" --target llama-bench llama-batched-bench llama-server \
    llama-quantize llama-simple
echo "llama.cpp (llama-cpp-python $VERSION's vendor/llama.cpp) in $DIR/build/bin"
