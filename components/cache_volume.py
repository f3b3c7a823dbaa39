"""The `/cache` volume of the pipeline's GPU steps: a generic ephemeral volume by default, so the scheduler
accounts for it (KFP cannot set an ephemeral-storage request, so an emptyDir of 800Gi would be invisible to
the scheduler and evict the pod late, once checkpoints fill the node's disk); an emptyDir as an option.

Compile-time settings (read when the pipeline is built, like the other `CHUNKGRPO_*` compile settings):

* `CHUNKGRPO_CACHE_VOLUME`: `ephemeral` (default: a PVC created with the pod and deleted with it) or
  `emptyDir` (node-local; the node's kubelet disk must hold it);
* `CHUNKGRPO_CACHE_STORAGE_CLASS`: the StorageClass of the ephemeral PVC ('' = the cluster's default);
  a local-NVMe class (docs/node-types.md) gives the best checkpoint and model-download throughput.
"""

from __future__ import annotations

import os

from kfp import kubernetes

VOLUME_ENV = "CHUNKGRPO_CACHE_VOLUME"
STORAGE_CLASS_ENV = "CHUNKGRPO_CACHE_STORAGE_CLASS"
KINDS = ("ephemeral", "emptyDir")


def cache_volume_kind() -> str:
    kind = os.environ.get(VOLUME_ENV, "").strip() or "ephemeral"
    if kind not in KINDS:
        from chunkgrpo.errors import UserError

        raise UserError(f"{VOLUME_ENV}={kind!r} is not one of {', '.join(KINDS)}")
    return kind


def mount_cache(task, size: str, mount_path: str = "/cache", name: str = "cache"):
    """Mount the step's `/cache` (`size`) as the configured kind of volume."""
    if cache_volume_kind() == "emptyDir":
        kubernetes.empty_dir_mount(task, volume_name=name, mount_path=mount_path, size_limit=size)
    else:
        kubernetes.add_ephemeral_volume(
            task, volume_name=name, mount_path=mount_path, access_modes=["ReadWriteOnce"], size=size,
            storage_class_name=os.environ.get(STORAGE_CLASS_ENV, "").strip() or None,
            labels={"app.kubernetes.io/part-of": "chunkgrpo", "app.kubernetes.io/component": "step-cache"})
    return task
