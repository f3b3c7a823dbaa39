#!/usr/bin/env bash
# Create .venv and install chunkgrpo with every extra, torch==2.13.0 (CPU) first so pip never
# resolves a multi-GB CUDA build. Idempotent: a second run only checks what is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
stamp=.venv/.chunkgrpo-setup
want="$(sha256sum pyproject.toml | cut -c1-16)"
# complete = the stamp of this pyproject.toml + every requirement of chunkgrpo[all,dev] installed at an accepted
# version (package metadata only, ~0.2 s; importing torch, diffusers, kfp and mlflow to check took 8-9 s)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && python scripts/env_check.py 2>/dev/null; then
  echo "setup: .venv up to date"
  exit 0
fi
pip install --quiet --disable-pip-version-check "torch==2.13.0"
pip install --quiet --disable-pip-version-check "torch==2.13.0" -e ".[all,dev]"
echo "$want" > "$stamp"
echo "setup: .venv ready ($(python -c 'import torch; print("torch", torch.__version__)'))"
