#!/usr/bin/env bash
# Create .venv from the runtime image's lock: torch==2.13.0 first (the CPU build where pip finds one, or
# from $TORCH_INDEX_URL), then every package of images/runtime/requirements.lock (what the training image
# runs) and of requirements-dev.lock (the test tools) at its hash-locked version, then this checkout
# (editable). So the tests and the local pipeline run on the packages the image ships.
# Idempotent: a second run only checks what is installed (stamp + package metadata, ~0.3 s). Never deletes
# .venv; packages a user added to it stay.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
TORCH_VERSION=2.13.0   # the version images/runtime/requirements.lock was resolved with (scripts/image-env.sh)
LOCKS=(images/runtime/requirements.lock requirements-dev.lock)
if [ ! -x .venv/bin/python ]; then
  "$PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' 2>/dev/null || {
    echo "setup: the locks are for CPython 3.11; $PY is $("$PY" -V 2>&1). Set PYTHON=/path/to/python3.11" >&2
    exit 2
  }
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# the project's bytecode, as `pip install` writes it for an installed package: an editable install does not,
# and where PYTHONDONTWRITEBYTECODE is set nothing else would, so every process (each torchrun rank, kfp task
# and CLI call) would compile the modules it imports again (~0.1 CPU-s each). Up-to-date files are skipped.
compile_project() { python -m compileall -q chunkgrpo components pipeline >/dev/null; }
stamp=.venv/.chunkgrpo-setup
want="$(cat pyproject.toml "${LOCKS[@]}" | sha256sum | cut -c1-16)"
# complete = the stamp of these files + every locked package at its pinned version and every requirement of
# chunkgrpo[all,dev] accepted (package metadata only: scripts/env_check.py)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && python scripts/env_check.py 2>/dev/null; then
  compile_project
  echo "setup: .venv up to date"
  exit 0
fi
pip=(python -m pip --quiet --disable-pip-version-check)
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
if [ -n "${TORCH_INDEX_URL:-}" ]; then
  quiet "${pip[@]}" install --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
else
  quiet "${pip[@]}" install "torch==$TORCH_VERSION"
fi
quiet "${pip[@]}" install --no-deps --require-hashes "${LOCKS[@]/#/--requirement=}"
quiet "${pip[@]}" install --no-deps -e .
python -m pip check --disable-pip-version-check >/dev/null || {
  python -m pip check --disable-pip-version-check >&2; echo "setup: .venv is inconsistent" >&2; exit 1; }
python scripts/env_check.py || { echo "setup: .venv does not match the locks" >&2; exit 1; }
compile_project
echo "$want" > "$stamp"
echo "setup: .venv ready ($(python -c 'import torch; print("torch", torch.__version__)'))"
