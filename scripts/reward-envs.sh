#!/usr/bin/env bash
# Build the reward-model venvs the runtime and evaluation images build (their Dockerfiles run this same script):
#   venv-torch        torch 2.13.0 + torchvision 0.28.0, by version: the runtime image's torch, same version and
#                     CUDA build (from $TORCH_INDEX_URL when set: the images' CUDA wheel index, default cu126),
#                     + the rest of their dependencies from requirements-torch.lock. Without TORCH_INDEX_URL
#                     (a plain machine): PyPI's build of both (CUDA 13; runs on the CPU too), never a CPU torch
#                     from local find-links: PyPI's torchvision is compiled against PyPI's torch and does not
#                     import on the CPU build ("operator torchvision::nms does not exist").
#   venv-hpsv2        hpsv2        (+ open_clip's BPE vocabulary, which the hpsv2 wheel lacks)
#   venv-imagereward  image-reward (+ the pins that make it importable)
#   venv-hpsv3        hpsv3        (+ its undeclared matplotlib / tensorboard)
# Each reward venv is installed from its lock file (every package pinned with hashes, no resolution) and sees
# the one shared torch through a `zz-shared-torch.pth` file, appended after its own site-packages so its own
# pins still win. chunkgrpo is NOT installed in them: scorers run there as
# `python -m chunkgrpo.scoring.worker`.
#
#   bash scripts/reward-envs.sh [hpsv2 imagereward hpsv3]       # default: all three
#   eval "$(bash scripts/reward-envs.sh --print-env)"           # export CHUNKGRPO_VENV_* for this shell
#
# Location: $CHUNKGRPO_REWARD_ENVS, default <repo>/.reward-envs (git-ignored). Idempotent: a venv whose stamp
# matches its lock file, the torch build (version + index) and the build recipe, and whose packages are at their
# pinned versions, is left alone; a half-built one is rebuilt. Needs CPython 3.11 (PYTHON=...), ~7 GB of disk,
# network access to PyPI (or TORCH_INDEX_URL's index for torch).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
ROOT=${CHUNKGRPO_REWARD_ENVS:-$REPO/.reward-envs}
PY=${PYTHON:-python3}
LOCKS=$REPO/images/eval
ALL=(hpsv2 imagereward hpsv3)
SITE=lib/python3.11/site-packages

envvar() { case $1 in hpsv2) echo CHUNKGRPO_VENV_HPSV2 ;; imagereward) echo CHUNKGRPO_VENV_IMAGEREWARD ;; hpsv3) echo CHUNKGRPO_VENV_HPSV3 ;; esac; }

if [ "${1:-}" = "--print-env" ]; then
  for n in "${ALL[@]}"; do echo "export $(envvar "$n")=$ROOT/venv-$n"; done
  exit 0
fi
names=("$@")
[ ${#names[@]} -gt 0 ] || names=("${ALL[@]}")
for n in "${names[@]}"; do
  [ -n "$(envvar "$n")" ] || { echo "reward-envs: unknown venv '$n' (choose from: ${ALL[*]})" >&2; exit 2; }
done
"$PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' 2>/dev/null || {
  echo "reward-envs: the lock files are for CPython 3.11; $PY is $("$PY" -V 2>&1). Set PYTHON=/path/to/python3.11" >&2
  exit 2
}
mkdir -p "$ROOT"
ROOT=$(cd "$ROOT" && pwd)
RECIPE=2  # bump when the build steps below change (the lock files' hashes cover their content)
# The runtime image's torch (TORCH_VERSION in scripts/image-env.sh) and its torchvision; the locks were resolved
# against them (images/eval/constraints-torch.txt, scripts/lock-reward-envs.sh).
TORCH_VERSION=2.13.0
TORCHVISION_VERSION=0.28.0
stamp_of() {  # stamp_of LOCK: what a venv built from LOCK on this torch build (version + index) is stamped with
  local build
  build=$(echo "torch==$TORCH_VERSION torchvision==$TORCHVISION_VERSION ${TORCH_INDEX_URL:-pypi}" | sha256sum)
  echo "$(sha256sum "$1" | cut -c1-16)-recipe$RECIPE-torch$(echo "$build" | cut -c1-8)"
}

quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }  # pip's local-folder notes
pip_install() {  # pip_install VENV LOCK
  quiet "$1/bin/python" -m pip install --quiet --disable-pip-version-check --no-deps --require-hashes -r "$2"
}

install_torch() {  # install_torch VENV: torch + torchvision by version, of one build
  local pip=("$1/bin/python" -m pip install --quiet --disable-pip-version-check)
  if [ -n "${TORCH_INDEX_URL:-}" ]; then  # that index's build only (2.13.0+cu126 with 0.28.0+cu126)
    quiet "${pip[@]}" --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"
  else  # === : the public build itself, not a local-label build (2.13.0+cpu) of the same version
    quiet "${pip[@]}" "torch===$TORCH_VERSION" "torchvision===$TORCHVISION_VERSION"
  fi
}

# pinned VENV LOCK [NAME==VERSION...]: every package of LOCK is installed in VENV at its pinned version, and each
# NAME at VERSION with any local label (2.13.0+cpu, +cu126: the build is in the stamp). Package metadata only:
# ~0.1 s, where importing torch and the reward package took ~8 s per venv; the import CHECK below ran once,
# when the stamp was written.
pinned() {
  "$1/bin/python" -I - "$2" "${@:3}" <<'PY'
import re, sys
from importlib import metadata
pins = [(m.group(1), m.group(2), False) for m in
        (re.match(r"([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", line) for line in open(sys.argv[1])) if m]
pins += [(*arg.split("=="), True) for arg in sys.argv[2:]]
bad = []
for name, version, any_local in pins:
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        have = "not installed"
    if (have.split("+")[0] if any_local else have) != version:
        bad.append(f"{name}=={version}: {have}")
for b in bad:
    print(f"reward-envs: {b}", file=sys.stderr)
sys.exit(1 if bad else 0)
PY
}

# build NAME LOCK CHECK [POST]: (re)create $ROOT/venv-NAME from LOCK unless its stamp is current and CHECK passes
build() {
  local name=$1 lock=$2 check=$3 post=${4:-}
  local venv=$ROOT/venv-$name
  local want extra=()
  # every venv runs on (and was resolved against) the shared torch: a change of its build rebuilds them all
  want=$(stamp_of "$lock")
  if [ "$name" = torch ]; then extra=("torch==$TORCH_VERSION" "torchvision==$TORCHVISION_VERSION"); fi
  if [ -f "$venv/.chunkgrpo-stamp" ] && [ "$(cat "$venv/.chunkgrpo-stamp")" = "$want" ] \
     && pinned "$venv" "$lock" "${extra[@]}" && { [ "$name" != hpsv2 ] || hpsv2_vocab_present "$venv"; }; then
    echo "reward-envs: venv-$name up to date"
    return 0
  fi
  local t0=$SECONDS
  rm -rf "$venv"
  "$PY" -m venv "$venv"
  if [ "$name" = torch ]; then
    install_torch "$venv"  # first: the lock's pins then replace whatever versions its dependencies got
  else
    echo "$ROOT/venv-torch/$SITE" > "$venv/$SITE/zz-shared-torch.pth"
  fi
  pip_install "$venv" "$lock"
  if [ -n "$post" ]; then "$post" "$venv"; fi
  "$venv/bin/python" -m pip check --disable-pip-version-check >/dev/null || {
    "$venv/bin/python" -m pip check --disable-pip-version-check >&2; echo "reward-envs: venv-$name is inconsistent" >&2; exit 1; }
  "$venv/bin/python" -W ignore -c "$check" >/dev/null
  echo "$want" > "$venv/.chunkgrpo-stamp"
  echo "reward-envs: venv-$name built in $((SECONDS - t0)) s ($(du -sh "$venv" | cut -f1))"
}

# hpsv2 1.2.0's wheel lacks open_clip's BPE vocabulary: its vendored tokenizer opens it at import
# (FileNotFoundError). The identical file ships with open-clip-torch (pinned in the hpsv2 lock).
hpsv2_vocab() {
  local py=$1/bin/python src dst
  src=$("$py" -c 'import importlib.util as u; print(u.find_spec("open_clip").submodule_search_locations[0])')
  dst=$("$py" -c 'import importlib.util as u; print(u.find_spec("hpsv2").submodule_search_locations[0])')/src/open_clip
  cp "$src/bpe_simple_vocab_16e6.txt.gz" "$dst/"
}

hpsv2_vocab_present() {  # the file hpsv2_vocab copies, found without importing hpsv2
  local dir
  dir=$("$1/bin/python" -I -c 'import importlib.util as u; print(u.find_spec("hpsv2").submodule_search_locations[0])') \
    && [ -s "$dir/src/open_clip/bpe_simple_vocab_16e6.txt.gz" ]
}

build torch "$LOCKS/requirements-torch.lock" "import torch, torchvision"
for n in "${names[@]}"; do
  case $n in
    hpsv2) build hpsv2 "$LOCKS/requirements-hpsv2.lock" "import hpsv2.src.open_clip" hpsv2_vocab ;;
    imagereward) build imagereward "$LOCKS/requirements-imagereward.lock" "import ImageReward" ;;
    hpsv3) build hpsv3 "$LOCKS/requirements-hpsv3.lock" "import hpsv3" ;;
  esac
done
echo "reward-envs: ready in $ROOT ($(du -sh "$ROOT" | cut -f1)); to use them:"
for n in "${names[@]}"; do echo "  export $(envvar "$n")=$ROOT/venv-$n"; done
