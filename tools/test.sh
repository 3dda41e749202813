#!/usr/bin/env bash
# Every test, from a fresh clone: installs the Debian dependencies, configures, builds and runs
# the whole suite with CTest.
#
#   tools/test.sh                 # build/ with CUDA kernels compiled (needs nvcc) and all tests
#   BUILD_DIR=build-cpu CMAKE_ARGS=-DSHARDSERVE_WITH_CUDA=OFF tools/test.sh
#
# Tests that need a GPU report themselves as skipped where none is present; any skip but those and
# the ones of CPU features the machine lacks fails the run (tools/ci/check_skips.py).
#
# After CTest, the fuzz targets (fuzz/) are built with clang in build-fuzz/ and each runs a fixed
# number of executions from a fixed seed over its seed corpus (tools/ci/fuzz.sh ci, two at a time);
# FUZZ=0 skips them. Then CI's set of test programs is built under ASan + UBSan in the same tree,
# whose libraries the fuzz step has built, and run (tools/ci/sanitize.sh ci); SANITIZE=0 skips it.
set -euo pipefail
cd "$(dirname "$0")/.."

BUILD_DIR=${BUILD_DIR:-build}
JOBS=${JOBS:-$(nproc)}

tools/ci/install-deps.sh

# nvcc lives outside PATH on some installs.
if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
  export PATH=/usr/local/cuda/bin:$PATH
fi

start=$(date +%s)
# shellcheck disable=SC2086
cmake -S . -B "$BUILD_DIR" -G Ninja ${CMAKE_ARGS:-}
cmake --build "$BUILD_DIR" -j "$JOBS"
echo "test.sh: build took $(( $(date +%s) - start )) s"

(cd "$BUILD_DIR" && ctest --output-on-failure -j "$JOBS" --timeout 900 --output-junit "$PWD/ctest-results.xml")
# Only the skips a machine without a GPU, or with fewer CPU features, must make pass: any other skip
# (a tool missing, a set-up that gave up) fails the run.
python3 tools/ci/check_skips.py "$BUILD_DIR/ctest-results.xml"

if [ "${FUZZ:-1}" != 0 ]; then
  start=$(date +%s)
  JOBS=$JOBS tools/ci/fuzz.sh ci
  echo "test.sh: fuzz build and runs took $(( $(date +%s) - start )) s"
fi

if [ "${SANITIZE:-1}" != 0 ]; then
  start=$(date +%s)
  JOBS=$JOBS tools/ci/sanitize.sh ci
  echo "test.sh: sanitizer build and runs took $(( $(date +%s) - start )) s"
fi
