"""Container images of the pipeline steps, pinned to the package version.

Lightweight components embed their function source in the pipeline IR and run it on one of these
images with `install_kfp_package=False` (the images already contain kfp and chunkgrpo), so the tag
must match the code that was compiled: it defaults to `chunkgrpo.__version__`.

Override at compile time (the values are read when `components` is first imported, i.e. set them
before importing, as `chunkgrpo pipeline compile --registry/--tag` does):

    CHUNKGRPO_IMAGE_REGISTRY   default ghcr.io/chunkgrpo
    CHUNKGRPO_IMAGE_TAG        default chunkgrpo.__version__ (CI may use "<version>@sha256:<digest>")
"""

from __future__ import annotations

import os

from chunkgrpo import __version__

REGISTRY_ENV = "CHUNKGRPO_IMAGE_REGISTRY"
TAG_ENV = "CHUNKGRPO_IMAGE_TAG"
DEFAULT_REGISTRY = "ghcr.io/chunkgrpo"


def image(name: str) -> str:
    """`<registry>/chunkgrpo-<name>:<tag>` for name in runtime | eval | launcher."""
    registry = (os.environ.get(REGISTRY_ENV) or DEFAULT_REGISTRY).rstrip("/")
    tag = os.environ.get(TAG_ENV) or __version__
    sep = "" if tag.startswith("@") else ":"  # allow a bare digest: CHUNKGRPO_IMAGE_TAG=@sha256:...
    return f"{registry}/chunkgrpo-{name}{sep}{tag}"


RUNTIME_IMAGE = image("runtime")    # CUDA torch + chunkgrpo[all]: profile, plan, train, register, promote
EVAL_IMAGE = image("eval")          # + reward-model venvs (HPSv3, ImageReward, GenEval, ...): evaluate
LAUNCHER_IMAGE = image("launcher")  # slim, no torch: creates/watches TrainJobs
