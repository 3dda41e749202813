#!/usr/bin/env bash
# Sets up .venv-fixtures5, the Python environment of tools/make_parity_fixtures_tf5.py: transformers
# 5 with PyPI's torch (its CUDA build: about 5 GB with the nvidia-* wheels it pulls; the fixtures
# are computed on the CPU). transformers 5 writes config.json as current checkpoints have it
# ("rope_parameters", "dtype"), and has the families transformers 4.49 lacks; it needs a newer
# torch than Debian's 1.13, which tools/fixtures-env.sh keeps for the 4.x fixtures. Safe to re-run.
# Usage: tools/fixtures5-env.sh && .venv-fixtures5/bin/python tools/make_parity_fixtures_tf5.py
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-fixtures5"
PINS=(
  transformers==5.24.0
  torch==2.15.0
  tokenizers==0.23.3
  safetensors==0.8.0
)

if [ ! -x "$VENV/bin/python" ]; then
  echo "fixtures5-env: creating $VENV"
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q "${PINS[@]}"
