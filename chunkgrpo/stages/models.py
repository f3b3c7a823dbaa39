"""The S3 model cache (base FLUX model, reward and scorer weights) that pipeline runs read."""

from __future__ import annotations


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
