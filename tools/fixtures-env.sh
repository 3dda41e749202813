#!/usr/bin/env bash
# Sets up .venv-fixtures, the Python environment of tools/make_parity_fixtures.py. Safe to re-run.
# Usage: tools/fixtures-env.sh && .venv-fixtures/bin/python tools/make_parity_fixtures.py
#
# torch comes from Debian 12 (python3-torch 1.13.1, CPU only) rather than PyPI, whose wheels pull
# gigabytes of CUDA libraries; the venv sees it through --system-site-packages, so it must be
# built on Debian's /usr/bin/python3, not a pyenv or other python3 earlier on PATH.
# transformers 4.49.0 is the newest release that imports with torch 1.13 (4.50 needs
# torch.distributed.tensor, torch >= 2.5) and it has Qwen2 and llama3 rope_scaling (>= 4.43).
# numpy stays Debian's 1.24.2, which torch 1.13 was built against; the pin stops pip from
# replacing it with numpy 2.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-fixtures"
PYTHON=/usr/bin/python3
PINS=(
  transformers==4.49.0
  tokenizers==0.21.4
  safetensors==0.8.0
  huggingface-hub==0.36.2
  numpy==1.24.2
)

SUDO=""
if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi

if ! "$PYTHON" -c "import torch, ensurepip" 2>/dev/null; then
  echo "fixtures-env: installing Debian python3-torch python3-venv"
  export DEBIAN_FRONTEND=noninteractive
  $SUDO apt-get update -q
  $SUDO apt-get install -y -q python3-torch python3-venv
fi

# For tools/train_demo_model.py only: the King James Bible text (bible-kjv-text, public domain) and
# `bible` (bible-kjv), the reader that decompresses it.
if ! command -v bible >/dev/null; then $SUDO apt-get update -q && DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q bible-kjv bible-kjv-text; fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "fixtures-env: creating $VENV"
  "$PYTHON" -m venv --system-site-packages "$VENV"
fi
"$VENV/bin/pip" install -q --disable-pip-version-check "${PINS[@]}"

"$VENV/bin/python" - <<'PY'
import numpy, torch, transformers
assert torch.__version__.startswith("1.13"), f"expected Debian's torch 1.13, got {torch.__version__}"
print(f"fixtures-env: ready (torch {torch.__version__}, transformers {transformers.__version__}, "
      f"numpy {numpy.__version__})")
PY
