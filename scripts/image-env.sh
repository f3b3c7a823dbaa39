#!/usr/bin/env bash
# Install an image's main Python environment from its lock, the same way in its Dockerfile and on a plain
# machine (CI, `chunkgrpo pipeline run --local --image-faithful`):
#   runtime   torch 2.13.0 + images/runtime/requirements.lock (chunkgrpo[all]) + the reward venvs
#   eval      images/eval/requirements.lock (chunkgrpo[train,store] + kfp) on the reward venvs' shared torch
#             (zz-shared-torch.pth -> venv-torch: the same torch version, from the same TORCH_INDEX_URL, that
#             scripts/reward-envs.sh installs) + the reward venvs
#   launcher  images/launcher/requirements.lock (no torch)
# The reward venvs (runtime and eval) are built by scripts/reward-envs.sh in $CHUNKGRPO_REWARD_ENVS.
#
#   bash scripts/image-env.sh IMAGE [PREFIX]   # PREFIX: the venv; default <repo>/.image-envs/IMAGE
#   bash scripts/image-env.sh all              # the three, at their default prefixes (CI)
#
# torch is not in the locks: it is installed by version, from $TORCH_INDEX_URL when set (the Dockerfile: the
# CUDA wheel index), otherwise from pip's configured indexes, where a CPU build of the same version on local
# disk (find-links) wins. chunkgrpo itself: editable from this checkout (CHUNKGRPO_PROJECT=editable, the
# default), or not at all (CHUNKGRPO_PROJECT=none: the Dockerfile installs its code in a later layer).
# CHUNKGRPO_IMAGE_LOCKS: the folder holding <image>/requirements.lock (default <repo>/images).
# Idempotent: a venv whose stamp matches its lock, torch (eval: the shared venv-torch's own stamp) and recipe,
# and whose packages (and torch) are at their pinned versions, is left alone (~0.2 s); anything else is rebuilt
# from scratch. Needs CPython 3.11 (PYTHON=...).
set -euo pipefail
cd "$(dirname "$0")/.."
REPO=$PWD
PY=${PYTHON:-python3}
IMAGE=${1:-}
if [ "$IMAGE" = all ] && [ $# -eq 1 ]; then
  for image in runtime eval launcher; do bash "$REPO/scripts/image-env.sh" "$image"; done
  exit 0
fi
case $IMAGE in
  runtime|eval|launcher) ;;
  *) echo "image-env: unknown image '${IMAGE}' (choose from: runtime eval launcher all)" >&2; exit 2 ;;
esac
PREFIX=${2:-$REPO/.image-envs/$IMAGE}
LOCK=${CHUNKGRPO_IMAGE_LOCKS:-$REPO/images}/$IMAGE/requirements.lock
[ -f "$LOCK" ] || { echo "image-env: no lock file $LOCK" >&2; exit 2; }
LOCK=$(cd "$(dirname "$LOCK")" && pwd)/requirements.lock
PROJECT=${CHUNKGRPO_PROJECT:-editable}
case $PROJECT in editable|none) ;; *) echo "image-env: CHUNKGRPO_PROJECT=$PROJECT (editable or none)" >&2; exit 2 ;; esac
TORCH_VERSION=2.13.0   # runtime and reward venvs (scripts/reward-envs.sh); the locks were resolved against it
REWARDS=${CHUNKGRPO_REWARD_ENVS:-$REPO/.reward-envs}
SITE=lib/python3.11/site-packages
RECIPE=1  # bump when the build steps below change (the lock's hash covers its content)
"$PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else 1)' 2>/dev/null || {
  echo "image-env: the locks are for CPython 3.11; $PY is $("$PY" -V 2>&1). Set PYTHON=/path/to/python3.11" >&2
  exit 2
}

case $IMAGE in
  runtime|eval) CHUNKGRPO_REWARD_ENVS=$REWARDS PYTHON=$PY bash "$REPO/scripts/reward-envs.sh"
                REWARDS=$(cd "$REWARDS" && pwd) ;;
esac
case $IMAGE in
  runtime) torch="torch==$TORCH_VERSION ${TORCH_INDEX_URL:-}" ;;
  eval) torch="shared $REWARDS/venv-torch $(cat "$REWARDS/venv-torch/.chunkgrpo-stamp")" ;;  # rebuilt with it
  launcher) torch="none" ;;
esac
want="$(sha256sum "$LOCK" | cut -c1-16)-recipe$RECIPE-$PROJECT-$(echo "$torch" | sha256sum | cut -c1-8)"
stamp=$PREFIX/.chunkgrpo-image-env

# every package of the lock at its pinned version, and torch where the image has it (metadata only)
pinned() {
  "$PREFIX/bin/python" -I - "$LOCK" "$IMAGE" "$TORCH_VERSION" <<'PY'
import re, sys
from importlib import metadata
lock, image, torch = sys.argv[1:]
want = dict(re.findall(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", open(lock).read(), re.M))
if image in ("runtime", "eval"):  # eval: the shared venv-torch's, through zz-shared-torch.pth
    want["torch"] = torch
bad = []
for name, version in want.items():
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        have = "not installed"
    if have.split("+")[0] != version:
        bad.append(f"{name}=={version}: {have}")
for b in bad:
    print(f"image-env: {b}", file=sys.stderr)
sys.exit(1 if bad else 0)
PY
}

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && pinned 2>/dev/null; then
  echo "image-env: $IMAGE env up to date ($PREFIX)"
  exit 0
fi
t0=$SECONDS
rm -rf "$PREFIX"
"$PY" -m venv "$PREFIX"
pip=("$PREFIX/bin/python" -m pip --disable-pip-version-check)
quiet() { "$@" 2> >(grep -v "is ignored: it is neither a file nor a directory" >&2); }
case $IMAGE in
  runtime)
    if [ -n "${TORCH_INDEX_URL:-}" ]; then
      quiet "${pip[@]}" install --quiet --index-url "$TORCH_INDEX_URL" "torch==$TORCH_VERSION"
    else
      quiet "${pip[@]}" install --quiet "torch==$TORCH_VERSION"
    fi ;;
  eval) echo "$REWARDS/venv-torch/$SITE" > "$PREFIX/$SITE/zz-shared-torch.pth" ;;
esac
quiet "${pip[@]}" install --quiet --no-deps --require-hashes -r "$LOCK"
if [ "$PROJECT" = editable ]; then
  quiet "${pip[@]}" install --quiet --no-deps -e "$REPO"
fi
"${pip[@]}" check >/dev/null || { "${pip[@]}" check >&2; echo "image-env: the $IMAGE env is inconsistent" >&2; exit 1; }
case $IMAGE in
  runtime) check="import torch, pyarrow, diffusers, transformers, kfp, mlflow, minio" ;;
  eval) check="import torch, pyarrow, diffusers, transformers, kfp, mlflow, minio" ;;
  launcher) check="import kfp, kubernetes, minio, kubeflow.trainer" ;;
esac
[ "$PROJECT" = none ] || check="$check, chunkgrpo"
"$PREFIX/bin/python" -W ignore -c "$check"
echo "$want" > "$stamp"
echo "image-env: $IMAGE env built in $((SECONDS - t0)) s ($(du -sh "$PREFIX" | cut -f1), $PREFIX)"
