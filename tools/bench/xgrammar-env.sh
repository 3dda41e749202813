#!/usr/bin/env bash
# Sets up .venv-xgrammar, the Python environment of tools/bench/bench_xgrammar.py and
# tools/fixtures/make_grammar_fixtures.py: xgrammar (the version the grammar fixtures were recorded
# with) and jsonschema. xgrammar needs torch: PyPI's, about 5.6 GB with the CUDA wheels it pulls
# (the benchmark runs on the CPU). Safe to re-run.
# Usage: tools/bench/xgrammar-env.sh && .venv-xgrammar/bin/python tools/bench/bench_xgrammar.py WALKS
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)"
VENV="$ROOT/.venv-xgrammar"
PINS=(
  xgrammar==0.2.9
  torch==2.15.0
  jsonschema==4.26.0
)

if [ ! -x "$VENV/bin/python" ]; then
  echo "xgrammar-env: creating $VENV"
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q "${PINS[@]}"
