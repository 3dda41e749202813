#!/usr/bin/env bash
# Installs the Debian packages shardserve builds and tests with. Safe to re-run.
# Usage: tools/ci/install-deps.sh            (needs root, or sudo)
set -euo pipefail

PACKAGES=(
  build-essential cmake ninja-build pkg-config ccache
  libgrpc++-dev protobuf-compiler-grpc libprotobuf-dev protobuf-compiler
  libabsl-dev
  prometheus-cpp-dev
  libgloo-dev
  libdnnl-dev               # oneDNN: the CPU backend's matrix products
  libsleef-dev              # Sleef: the vectorized tanhf of GELU and soft-capping, as PyTorch's CPU kernels compute it
  libpcre2-dev libutf8proc-dev
  nlohmann-json3-dev
  libssl-dev                # OpenSSL: certificate checks, launch's CA, API key hashes (security/), the prefix cache's block keys (SHA-256)
  libcpp-httplib-dev        # the coordinator's OpenAI-compatible HTTP API (coordinator/api/openai)
  libgtest-dev libgmock-dev
  python3 python3-venv
  curl                      # tools/demo.sh, README.md's tour (tests/readme_doc_test.py): the HTTP API
  iproute2                  # ip: tests/readme_doc_test.py brings up the loopback of its own network namespace
  procps                    # pgrep: tests/bench_test.py checks that no process is left behind
  xz-utils                  # xz: the GPU bundle (tools/gpu/gpu-tests.sh pack) and tests/gpu_bench_test.py's pieces
  prometheus                # promtool: tests/deploy_test.sh checks deploy/prometheus
  clang libclang-rt-14-dev  # tools/ci/fuzz.sh: clang and libFuzzer (libclang_rt.fuzzer-x86_64.a)
  libomp-dev                # OpenMP for clang, which the fuzz build's configure looks for
)

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -eq 0 ]; then
  echo "install-deps: all ${#PACKAGES[@]} Debian packages present"
  exit 0
fi
echo "install-deps: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
$SUDO apt-get update -q
$SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
