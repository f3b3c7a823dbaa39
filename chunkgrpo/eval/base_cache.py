"""The base model's evaluation images, generated once and shared between evaluations through S3.

Every evaluation generates two labels with the same prompts and seeds: "trained" (hybrid inference)
and "base" (the base model alone). The base label does not depend on the trained model: a training
run's evaluation, the nightly benchmark and every re-evaluation against the same base model regenerate
the same images (for FLUX.1-dev on GenEval: 2,212 images at 1024² and 50 steps, half of an
evaluation's GPU time). With `base_cache=s3://bucket/prefix` (the pipelines set
`s3://<artifact_root's bucket>/eval-base-cache`; `base_cache=` turns it off) the evaluate stage

1. downloads the base images the cache already holds for this evaluation's prompts and seeds,
2. generates the rest (and the trained label),
3. uploads the base images it generated, for the next evaluation.

An image is `<prefix>/<key>/<benchmark>/<sha256(prompt, seed)[:16]>.png`. The key is the sha256 of what
a base image depends on (`cache_inputs`, also stored as `<prefix>/<key>/key.json`): the base model's
content (`model_digest`: an s3:// folder artifact's manifest, or a local folder's), the sampling
settings except `trained_steps`, the dtype, the device kind (CPU, or the GPU's name), the torch and
diffusers versions and the source of the modules that sample (`GENERATION_CODE`). Batch size and
offloading are left out: they change the arithmetic's order, not what is sampled. A hub id as base
model (no content digest) is not cached. The cache only ever saves work: a failed listing, download
or upload is one warning line and the evaluation goes on, generating what it did not get.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

log = logging.getLogger(__name__)

LABEL = "base"
# the modules whose code decides what a base image is (sampling loop, SDE/ODE step, schedule, FLUX calls)
GENERATION_CODE = ("chunkgrpo.eval.hybrid", "chunkgrpo.rollout", "chunkgrpo.flux", "chunkgrpo.sde",
                   "chunkgrpo.schedules")


def default_prefix(artifact_root: str) -> str:
    """`s3://<bucket>/eval-base-cache` for a pipeline's `artifact_root` (s3://bucket/...)."""
    from chunkgrpo.store import parse_s3_uri

    bucket, _ = parse_s3_uri(artifact_root)
    return f"s3://{bucket}/eval-base-cache"


def job_hash(prompt: str, seed: int) -> str:
    """An image's identity within a key: its prompt and seed."""
    return hashlib.sha256(f"{prompt}\n{seed}".encode()).hexdigest()[:16]


def model_digest(base_model: str) -> str | None:
    """The base model's content digest (`Manifest.content_sha256`): an s3:// folder artifact's manifest; for
    a local folder the MANIFEST.json a download from the model cache leaves in it, when every file it lists
    is there with its recorded size and no other file is (the same digest as the S3 copy's, without reading
    FLUX.1-dev's 30 GB), else the folder's files hashed; None for anything else (a hub id)."""
    from chunkgrpo.store.manifest import MANIFEST_NAME, Manifest, build_manifest, file_sizes

    if base_model.startswith("s3://"):
        from chunkgrpo.store.client import ArtifactStore

        manifest = ArtifactStore().read_manifest(base_model)
        return manifest.content_sha256 if manifest is not None else None
    path = Path(base_model).expanduser()
    if not path.is_dir():
        return None
    if (path / MANIFEST_NAME).is_file():
        try:
            recorded = Manifest.from_json((path / MANIFEST_NAME).read_bytes(), str(path / MANIFEST_NAME))
        except Exception:
            recorded = None
        listed = {rel: int(e["size"]) for rel, e in recorded.files.items()} if recorded is not None else None
        if listed is not None and file_sizes(path) == listed:
            return recorded.content_sha256
    return build_manifest(path).content_sha256


def _code_digest() -> str:
    h = hashlib.sha256()
    for name in GENERATION_CODE:
        origin = importlib.util.find_spec(name).origin
        h.update(name.encode() + b"\0" + Path(origin).read_bytes())
    return h.hexdigest()


def _device_kind(device: str) -> str:
    import torch

    if device.startswith("cuda") and torch.cuda.is_available():
        return torch.cuda.get_device_name(torch.device(device))
    return "cpu"


def cache_inputs(sampling: dict, seed: int, dtype: str, device: str, digest: str) -> dict:
    """What a base image depends on (the key is their sha256)."""
    import diffusers
    import torch

    return {"base_model": digest, "sampling": {k: v for k, v in sampling.items() if k != "trained_steps"},
            "seed": seed, "dtype": dtype, "device": _device_kind(device), "torch": torch.__version__,
            "diffusers": diffusers.__version__, "code": _code_digest()}


def cache_key(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:24]


class BaseImageCache:
    """One evaluation's view of the cache: `fetch` before generation, `store` after it."""

    def __init__(self, prefix: str, inputs: dict, store=None):
        from chunkgrpo.store.client import ArtifactStore

        self.store = store or ArtifactStore()
        self.inputs = inputs
        self.key = cache_key(inputs)
        self.root = f"{prefix.rstrip('/')}/{self.key}"
        self.had: set[str] = set()   # object names the cache held when fetched

    def _pairs(self, out: Path, jobs: Iterable) -> list[tuple[str, Path]]:
        """(object URI in the cache, local base image under `out`) of each job."""
        return [(f"{self.root}/{j.benchmark}/{job_hash(j.prompt, j.seed)}.png",
                 out / j.benchmark / LABEL / j.rel) for j in jobs]

    def _workers(self) -> int:
        return max(1, int(getattr(self.store.config, "workers", 4)))

    def fetch(self, out: Path, jobs: Iterable) -> int:
        """Download the cached base images of `jobs` missing under `out/<benchmark>/base/`; returns how
        many. The cache stays empty for this evaluation when listing fails (one warning)."""
        from chunkgrpo.store import parse_s3_uri, s3_uri

        try:
            bucket, _ = parse_s3_uri(self.root)
            self.had = {s3_uri(bucket, e.key) for e in self.store.list(self.root + "/")}
        except Exception as e:  # a cache: never a reason to fail an evaluation
            log.warning("base image cache %s unreadable (%s): generating every base image", self.root, e)
            return 0
        todo = [(name, path) for name, path in self._pairs(out, jobs)
                if name in self.had and not path.exists()]

        def one(item) -> bool:
            name, path = item
            try:
                data = self.store.get_bytes(name)
            except Exception as e:
                log.warning("base image cache: %s not downloaded (%s): generating it", name, e)
                return False
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.part")
            tmp.write_bytes(data)
            tmp.replace(path)  # an image is whole or absent
            return True

        with ThreadPoolExecutor(self._workers()) as ex:
            n = sum(ex.map(one, todo))
        if n:
            log.info("base image cache: %d base images from %s", n, self.root)
        return n

    def store_new(self, out: Path, jobs: Iterable) -> int:
        """Upload the base images of `jobs` under `out` that the cache did not hold; returns how many.
        A failed upload is one warning (the next evaluation generates those images again)."""
        todo = [(name, path) for name, path in self._pairs(out, jobs)
                if name not in self.had and path.is_file()]
        if not todo:
            return 0
        try:
            self.store.put_bytes(json.dumps(self.inputs, indent=1, sort_keys=True).encode(),
                                 f"{self.root}/key.json", content_type="application/json")
            with ThreadPoolExecutor(self._workers()) as ex:
                list(ex.map(lambda it: self.store.put_file(it[1], it[0], content_type="image/png"), todo))
        except Exception as e:
            log.warning("base image cache %s: upload failed (%s); the next evaluation generates them",
                        self.root, e)
            return 0
        log.info("base image cache: %d new base images -> %s", len(todo), self.root)
        return len(todo)


def open_cache(prefix: str, base_model: str, sampling: dict, seed: int, dtype: str,
               device: str) -> BaseImageCache | None:
    """The cache for this evaluation, or None (no prefix, a base model without a content digest, or S3
    unreachable: one warning)."""
    if not prefix:
        return None
    try:
        digest = model_digest(base_model)
        if digest is None:
            log.info("base image cache: %s has no content digest (a hub id?): not cached", base_model)
            return None
        return BaseImageCache(prefix, cache_inputs(sampling, seed, dtype, device, digest))
    except Exception as e:
        log.warning("base image cache %s unusable (%s): generating every base image", prefix, e)
        return None
