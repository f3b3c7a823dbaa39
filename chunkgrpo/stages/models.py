"""The S3 model cache (base FLUX model, reward and scorer weights) that pipeline runs read, and the
training prompt file the pipelines default to."""

from __future__ import annotations

import hashlib
from pathlib import Path

# The pipelines' default `prompts`: PartiPrompts (Apache-2.0, shipped in chunkgrpo/data), put there by
# `chunkgrpo models sync --defaults`. The paper trains on HPDv2's training prompts, which are not
# redistributed: upload a copy with `--prompts FILE` and pass its URI.
DEFAULT_TRAIN_PROMPTS = "s3://chunkgrpo-data/prompts/PartiPrompts.tsv"
PROMPTS_ROOT = "s3://chunkgrpo-data/prompts"


def default_sources() -> list[str]:
    """The base model and every default reward/scorer weight."""
    from chunkgrpo import model_cache

    return [model_cache.BASE_MODEL, *model_cache.REWARD_MODELS.values()]


def sync_models(sources: list[str], *, to: str | None = None, root: str | None = None,
                download: bool = False, revision: str | None = None) -> list[str]:
    """Put each hub id (from the local hub cache, or downloaded with `download`) or folder into the cache
    and return the s3:// URIs in order. Destination: `to` (one source), else `<root>/<hub id>` when a
    root is given ('' = $CHUNKGRPO_MODEL_ROOT or s3://chunkgrpo-data/models), else model_cache's."""
    from chunkgrpo import model_cache

    out = []
    for source in sources:
        dest = to or (model_cache.model_uri(source, root or None) if root is not None else None)
        uri, uploaded = model_cache.sync(source, dest, download=download, revision=revision or None)
        print(f"{source} -> {uri}" + ("" if uploaded else " (already there)"), flush=True)
        out.append(uri)
    return out


def sync_prompts(source: str | Path | None = None, *, to: str | None = None, store=None) -> str:
    """Upload a training prompt file and return its s3:// URI.

    `source=None` is the shipped PartiPrompts set, uploaded to `DEFAULT_TRAIN_PROMPTS` unless an
    identical object is there already. A user file goes to `to`, else `<PROMPTS_ROOT>/<file name>`.
    The file is parsed first (`prompts.load_prompts`): an unreadable or empty file is refused in one
    line and nothing is written."""
    from chunkgrpo.errors import UserError
    from chunkgrpo.eval import data_file
    from chunkgrpo.prompts import load_prompts
    from chunkgrpo.store.client import ArtifactStore

    path = Path(source).expanduser() if source else data_file("partiprompts/PartiPrompts.tsv")
    if not path.is_file():
        raise UserError(f"prompt file {str(source)!r} does not exist")
    dest = to or (DEFAULT_TRAIN_PROMPTS if source is None else f"{PROMPTS_ROOT}/{path.name}")
    if not dest.startswith("s3://") or dest.endswith("/"):
        raise UserError(f"prompt destination {dest!r} must be an s3:// URI of a file")
    if Path(dest).suffix != path.suffix:
        raise UserError(f"prompt destination {dest!r} must keep the file's type ({path.suffix}): "
                        "the suffix says how prompts are read")
    n = len(load_prompts(path))
    if n == 0:
        raise UserError(f"prompt file {str(path)!r} holds no prompts")
    store = store or ArtifactStore()
    store.require_bucket(dest)
    data = path.read_bytes()
    st = store.stat(dest)  # an identical object (the sha256 put_bytes records, else its bytes) is kept
    same = st is not None and st["size"] == len(data) and (
        st["sha256"] == hashlib.sha256(data).hexdigest() if st["sha256"] else store.get_bytes(dest) == data)
    if same:
        print(f"{path.name} ({n} prompts) -> {dest} (already there)", flush=True)
        return dest
    store.put_bytes(data, dest, content_type="text/plain; charset=utf-8")
    print(f"{path.name} ({n} prompts) -> {dest}", flush=True)
    return dest
