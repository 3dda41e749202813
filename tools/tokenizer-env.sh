#!/usr/bin/env bash
# Sets up .venv-tokenizers, the Python environment of tools/make_tokenizer_fixtures.py and
# tools/bench_tokenizer_hf.py: Hugging Face `tokenizers` from PyPI, pinned, so that the recorded
# fixtures and the benchmark baseline come from a known version. Safe to re-run.
# Usage: tools/tokenizer-env.sh && .venv-tokenizers/bin/python tools/make_tokenizer_fixtures.py
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="$ROOT/.venv-tokenizers"
PINS=(tokenizers==0.22.2)

# The training and benchmark text: the King James Bible (public domain) from Debian's bible-kjv,
# whose `bible` program reads the compressed bible-kjv-text data.
if ! command -v bible >/dev/null; then
  SUDO=""; if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q bible-kjv
fi

if [ ! -x "$VENV/bin/python" ]; then
  echo "tokenizer-env: creating $VENV"
  python3 -m venv "$VENV"
fi
"$VENV/bin/pip" install -q --disable-pip-version-check "${PINS[@]}"
"$VENV/bin/python" -c 'import tokenizers; print(f"tokenizer-env: ready (tokenizers {tokenizers.__version__})")'
