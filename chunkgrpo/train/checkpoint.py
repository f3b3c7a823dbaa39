"""Training checkpoints: atomic local folders (staged, MANIFEST.json last, then renamed) mirrored
to S3 through the artifact store (manifest last there too). A folder without a manifest is never
resumed from. Layout of `output_dir/checkpoints/step-000010/`:

    trainable.safetensors   exact fp32 trainable parameters (LoRA or full), by parameter name
    optimizer.pt            optimizer state (full, gathered under FSDP)
    scheduler.pt            LR scheduler state
    trainer_state.json      iteration, optimizer step, metrics history, config hash
    rng/rank{r}.pt          per-rank RNG states (torch, cuda, python, numpy)
    MANIFEST.json           sha256 of every file — written last
"""

from __future__ import annotations

import json
import logging
import random
import re
import shutil
from pathlib import Path

import numpy as np
import torch

from chunkgrpo.errors import UserError

log = logging.getLogger(__name__)
MANIFEST = "MANIFEST.json"
_STEP_RE = re.compile(r"^step-(\d+)$")


def rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def is_complete(path: Path) -> bool:
    return (path / MANIFEST).exists()


def complete_checkpoints(root: Path) -> list[Path]:
    if not root.exists():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_RE.match(p.name) and is_complete(p)]
    return sorted(found, key=lambda p: int(_STEP_RE.match(p.name).group(1)))


def write_manifest(path: Path, meta: dict) -> None:
    from chunkgrpo.store import build_manifest

    manifest = build_manifest(path, meta=meta)
    tmp = path / (MANIFEST + ".tmp")
    tmp.write_bytes(manifest.to_json())
    tmp.replace(path / MANIFEST)


def staging_path(root: Path, step: int) -> Path:
    return root / f".staging-step-{step:06d}"


def stage_dir(root: Path, step: int) -> Path:
    """A fresh staging folder for step `step` (a crashed earlier attempt is discarded)."""
    staging = staging_path(root, step)
    if staging.exists():
        shutil.rmtree(staging)
    (staging / "rng").mkdir(parents=True)
    return staging


def finalize(staging: Path, root: Path, step: int, meta: dict, keep: int) -> Path:
    """Manifest last, then an atomic rename; prune older complete checkpoints."""
    write_manifest(staging, meta)
    final = step_dir(root, step)
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    if keep > 0:
        for old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    return final


def upload(path: Path, s3_prefix: str) -> str:
    """Mirror a complete checkpoint folder to S3 (`put_folder` writes the manifest last)."""
    from chunkgrpo.store import ArtifactStore

    uri = s3_prefix.rstrip("/") + "/" + path.name
    ArtifactStore().put_folder(path, uri, meta={"kind": "checkpoint"})
    return uri


def fetch_latest_from_s3(s3_prefix: str, root: Path) -> Path | None:
    """Download the newest complete S3 checkpoint into `root` (if newer than the local ones)."""
    from chunkgrpo.store import ArtifactStore

    st = ArtifactStore()
    latest = st.latest_complete(s3_prefix)
    if latest is None:
        return None
    name = latest.rstrip("/").rsplit("/", 1)[-1]
    if not _STEP_RE.match(name):
        return None
    local = complete_checkpoints(root)
    if local and int(_STEP_RE.match(local[-1].name).group(1)) >= int(_STEP_RE.match(name).group(1)):
        return local[-1]
    staging = root / f".download-{name}"
    if staging.exists():
        shutil.rmtree(staging)
    st.get_folder(latest, staging)  # verifies checksums; writes the manifest locally
    final = root / name
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
    return final


def load_trainer_state(path: Path) -> dict:
    if not is_complete(path):
        raise UserError(f"checkpoint {path} is incomplete (no {MANIFEST}); refusing to resume from it")
    return json.loads((path / "trainer_state.json").read_text())
