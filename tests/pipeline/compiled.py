"""Compiled pipeline packages shared by the tests of one process (one xdist worker): each variant -- pipeline,
pool, trainer, target KFP and the CHUNKGRPO_* environment the compile reads (pull secrets, model PVC, cache
volume, image registry) -- is compiled once, and every caller gets its own copy of the parsed documents."""

from __future__ import annotations

import copy
import functools
import os
import tempfile
from pathlib import Path

import yaml

from pipeline.compile import KFP_TARGETS, compile_pipeline

# The compile-time options that add platform fields too (imagePullSecret, pvcMount): the packages
# tests/pipeline/test_kfp_versions.py parses with every backend's protos.
COMPILE_OPTIONS = {"CHUNKGRPO_IMAGE_PULL_SECRETS": "regcred", "CHUNKGRPO_MODEL_PVC": "flux-models"}
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # libyaml: the same documents, parsed ~10x faster


def compiled(name: str, *, pool: str = "cpu", trainer: str = "torchrun",
             target_kfp: str = KFP_TARGETS[-1]) -> tuple[dict, dict]:
    """(pipeline spec, platform spec) of `compile_pipeline(name, ...)` under the current environment."""
    env = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("CHUNKGRPO_")))
    return copy.deepcopy(_compile(name, pool, trainer, target_kfp, env))


@functools.cache
def _compile(name: str, pool: str, trainer: str, target_kfp: str, env: tuple) -> tuple[dict, dict]:
    with tempfile.TemporaryDirectory() as tmp:
        path = compile_pipeline(name, Path(tmp) / f"{name}.yaml", pool=pool, trainer=trainer,
                                target_kfp=target_kfp)
        spec, platform = yaml.load_all(path.read_text(), Loader=_LOADER)
    return spec, platform
