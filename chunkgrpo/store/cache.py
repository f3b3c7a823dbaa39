"""The local download cache of S3 objects and folder artifacts: `<cache root>/<kind>/<entry>`, the cache
root being `cache_dir`, else $CHUNKGRPO_CACHE, else ~/.cache/chunkgrpo. An entry is downloaded once
(checksums verified) and reused until the remote object or folder changes; processes sharing a cache
fill an entry under a blocking `FileLock`."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from chunkgrpo.errors import UserError
from chunkgrpo.locks import FileLock
from chunkgrpo.store import IncompleteArtifactError, client, parse_s3_uri, s3_uri
from chunkgrpo.store.client import folder_prefix
from chunkgrpo.store.manifest import MANIFEST_NAME


def cache_root(cache_dir: str | os.PathLike | None = None) -> Path:
    """The local download cache: `cache_dir`, else $CHUNKGRPO_CACHE, else ~/.cache/chunkgrpo."""
    return Path(
        cache_dir or os.environ.get("CHUNKGRPO_CACHE") or Path.home() / ".cache" / "chunkgrpo"
    ).expanduser()


def _entry_lock(entry: Path) -> FileLock:
    """The blocking lock on one cache entry (`<cache root>/.locks/<kind>-<entry>.lock`, beside the
    entries so a listing of a kind shows only entries): processes sharing the cache (the ranks of a node,
    or the nodes of a shared volume) fill an entry once; the others wait and reuse it."""
    return FileLock(entry.parent.parent / ".locks" / f"{entry.parent.name}-{entry.name}.lock")


def cached_file(uri: str, kind: str, what: str = "file", cache_dir: str | Path | None = None) -> Path:
    """Download one `s3://` object into `<cache root>/<kind>/` and return the local path; a changed object
    (size/etag) is downloaded again, an unchanged one reused. A missing object is a UserError naming `what`.
    Concurrent callers on one cache download it once (entry lock). Cache root: `cache_root(cache_dir)`."""
    store = client.ArtifactStore()  # looked up on the module: tests substitute a fake store
    meta = store.stat(uri)
    if meta is None:
        raise UserError(f"{what} {uri} does not exist")
    key = hashlib.sha256(f"{uri}\0{meta.get('etag')}\0{meta.get('size')}".encode()).hexdigest()[:16]
    local = cache_root(cache_dir) / kind / key / uri.rstrip("/").rsplit("/", 1)[-1]
    with _entry_lock(local.parent):
        if not local.exists():
            store.get_file(uri, local)
    return local


def cached_folder_entry(uri: str, kind: str = "artifacts", cache_dir: str | Path | None = None) -> Path:
    """Where `cached_folder` keeps `uri` (nothing is read or downloaded)."""
    return cache_root(cache_dir) / kind / hashlib.sha256(uri.encode()).hexdigest()[:16]


def cached_folder(uri: str, kind: str = "artifacts", cache_dir: str | Path | None = None) -> Path:
    """Download a complete S3 folder artifact into a local cache once (checksums verified) and return
    the local path. The cache entry is reused while its recorded manifest hash matches the remote one.
    Cache root: `cache_root(cache_dir)`. Concurrent callers on one cache (ranks of a node, nodes sharing
    a volume) download it once: the entry is filled under an exclusive lock, the others then reuse it."""
    target = cached_folder_entry(uri, kind, cache_dir)
    store = client.ArtifactStore()  # looked up on the module: tests substitute a fake store
    manifest = store.read_manifest(uri)
    if manifest is None:
        raise IncompleteArtifactError(
            f"{uri} is not a complete folder in S3 (no {MANIFEST_NAME}); was the upload finished?"
        )
    stamp = target / ".manifest-sha256"
    with _entry_lock(target):
        if not (stamp.exists() and stamp.read_text() == manifest.sha256):
            store.get_folder(uri, target)  # verifies every file's sha256
            stamp.write_text(manifest.sha256)
    return target


def cached_prefix(uri: str, kind: str = "artifacts", cache_dir: str | Path | None = None) -> Path | None:
    """Every object under an `s3://` prefix that is not a complete folder (no MANIFEST.json: e.g. weights
    copied there with `aws s3 sync`) into a local cache entry, and its path; None when nothing is stored
    under the prefix. The entry is keyed by the listing (keys, sizes, modification times): a changed
    prefix is downloaded again into a new entry, an unchanged one reused. Cache root and locking as
    `cached_folder`."""
    store = client.ArtifactStore()  # looked up on the module: tests substitute a fake store
    bucket, key = parse_s3_uri(uri)
    base = folder_prefix(key)
    entries = [e for e in store.list(s3_uri(bucket, base)) if not e.is_dir]
    if not entries:
        return None
    listing = "".join(f"{e.key}\0{e.size}\0{e.last_modified}\n" for e in entries)
    target = cache_root(cache_dir) / kind / hashlib.sha256(f"{uri}\0{listing}".encode()).hexdigest()[:16]
    stamp = target / ".listing-sha256"
    digest = hashlib.sha256(listing.encode()).hexdigest()
    with _entry_lock(target):
        if not (stamp.exists() and stamp.read_text() == digest):
            for e in entries:
                store.get_file(s3_uri(bucket, e.key), target / e.key[len(base):])
            stamp.write_text(digest)
    return target
