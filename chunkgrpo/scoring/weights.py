"""Where a scorer's weights are: a local file/folder, or an `s3://` URI downloaded through the store's cache.

    resolve_weights("/models/PickScore_v1", what="pickscore")            # the local path, checked
    resolve_weights("s3://models/MizzenAI/HPSv3", what="hpsv3")          # <cache root>/weights/<entry>

`s3://` weights land in the one download cache of `chunkgrpo.store` (`cache_root(cache_dir)`, i.e.
`$CHUNKGRPO_CACHE`, which the pods point at their `/cache` volume, else ~/.cache/chunkgrpo), kind
`weights`, and notice a changed remote the way the store does: a complete folder artifact (with
MANIFEST.json) by its manifest hash (`cached_folder`, checksums verified), any other prefix by its
listing (`cached_prefix`), a single object by its size/etag (`cached_file`). Hub ids are never resolved.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path
from typing import Any, Callable

from chunkgrpo.errors import UserError
from chunkgrpo.store import client, parse_s3_uri
from chunkgrpo.store.cache import cache_root, cached_file, cached_folder, cached_prefix

Fetch = Callable[[str, Path], Any]
"""A weights fetch hook: `fetch(uri, dest_dir)` downloads everything under `uri` into `dest_dir`."""

KIND = "weights"


def resolve_weights(
    source: str | os.PathLike | None,
    *,
    what: str,
    cache_dir: str | os.PathLike | None = None,
    fetch: Fetch | None = None,
) -> Path:
    """A local path for `source`: an existing local file/dir, or an `s3://` URI downloaded into the store's
    cache (`cache_dir` overrides its root). A folder comes back as the folder, a single object as the
    folder holding it. `fetch(uri, dest_dir)` replaces the store as the transport (tests, mirrors): it
    cannot say whether the remote changed, so its entry is filled once. Hub ids are rejected."""
    if source is None or str(source).strip() == "":
        raise UserError(f"{what}: no weights given; set `weights` to a local directory or an s3:// prefix")
    text = str(source)
    if text.startswith("s3://"):
        return _fetched(text, what, cache_dir, fetch) if fetch is not None else _from_store(text, cache_dir)
    if "://" in text:
        raise UserError(f"{what}: unsupported weights URI {text!r}; use a local path or s3://bucket/prefix")
    path = Path(text).expanduser()
    if not path.exists():
        hint = (
            " (this looks like a hub id; hub downloads are disabled: "
            "download it in advance and pass the folder)"
            if text.count("/") == 1 and not text.startswith((".", "/", "~"))
            else ""
        )
        raise UserError(f"{what}: weights path {text!r} does not exist{hint}")
    return path


def _from_store(uri: str, cache_dir: str | os.PathLike | None) -> Path:
    """A complete folder artifact, else every object under the prefix, else the single object `uri` names
    (e.g. `.../HPS_v2.1_compressed.pt`), each through the store's cache."""
    st = client.ArtifactStore()
    if st.is_complete(uri):
        return cached_folder(uri, KIND, cache_dir)
    folder = cached_prefix(uri, KIND, cache_dir)
    if folder is not None:
        return folder
    _, key = parse_s3_uri(uri)
    if key and st.exists(uri):
        return cached_file(uri, KIND, "weights", cache_dir).parent
    raise UserError(f"nothing is stored under {uri}")


def _fetched(uri: str, what: str, cache_dir: str | os.PathLike | None, fetch: Fetch) -> Path:
    """`uri` fetched by the hook into `<cache root>/weights/<name>-<hash>` once (a `.fetched` stamp)."""
    digest = hashlib.sha256(uri.encode()).hexdigest()[:16]
    dest = cache_root(cache_dir) / KIND / f"{uri.rstrip('/').rsplit('/', 1)[-1]}-{digest}"
    stamp = dest / ".fetched"
    if stamp.exists():
        return dest
    tmp = dest.with_name(dest.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    fetch(uri, tmp)
    if not any(tmp.iterdir()):
        shutil.rmtree(tmp, ignore_errors=True)
        raise UserError(f"{what}: {uri} is empty (nothing was downloaded)")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    stamp.write_text(uri + "\n")
    return dest
