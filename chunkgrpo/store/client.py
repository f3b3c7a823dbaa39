"""The S3 client: `ArtifactStore` (objects, multipart uploads with checksums, atomic folder artifacts,
retries with backoff). Its configuration is `chunkgrpo.store.config.StoreConfig`, which errors it retries
`chunkgrpo.store.retries.classify_error`; both are importable from here too. See `chunkgrpo.store` for the
environment variables and the folder-artifact contract."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import logging
import math
import os
import random
import re
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from chunkgrpo.errors import UserError
from chunkgrpo.store import (
    ChecksumMismatchError,
    IncompleteArtifactError,
    StoreError,
    _check_bucket_name,
    _check_key,
    parse_s3_uri,
    s3_uri,
)
from chunkgrpo.store.config import StoreConfig
from chunkgrpo.store.manifest import CHUNK, MANIFEST_NAME, Manifest, MiB, build_manifest, file_sha256
from chunkgrpo.store.retries import classify_error, request_retry

log = logging.getLogger(__name__)

_MIN_PART = 5 * MiB
_MAX_PARTS = 10_000

__all__ = ["ArtifactStore", "ObjectEntry", "StoreConfig", "classify_error", "folder_prefix"]

T = TypeVar("T")


def folder_prefix(prefix: str) -> str:
    prefix = prefix.strip("/")
    return f"{prefix}/" if prefix else ""


class _HashingReader:
    """File wrapper that hashes what minio reads, so a file changed mid-upload is detected."""

    def __init__(self, f):
        self._f = f
        self.sha = hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.sha.update(data)
        return data


@dataclasses.dataclass
class ObjectEntry:
    key: str
    size: int
    last_modified: _dt.datetime | None
    is_dir: bool = False


# --------------------------------------------------------------------------------------- store


class ArtifactStore:
    """S3 artifact store. Keys are relative to `config.bucket`; `s3://bucket/key` URIs are also accepted."""

    def __init__(self, config: StoreConfig | None = None, *, sleep: Callable[[float], None] = time.sleep):
        self.config = config or StoreConfig()
        if not self.config.endpoint:
            raise UserError(
                "no S3 endpoint configured: set CHUNKGRPO_S3_ENDPOINT (or store.endpoint); "
                "for a local one run "
                '`chunkgrpo local up` and `eval "$(chunkgrpo local env)"`'
            )
        if not self.config.access_key or not self.config.secret_key:
            raise UserError(
                f"no S3 credentials for {self.config.url}: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY "
                "(in the cluster: from a Kubernetes Secret)")
        self._sleep = sleep
        self._client = self._make_client()

    def __repr__(self) -> str:
        return (
            f"ArtifactStore({self.config.url}, bucket={self.config.bucket!r}, "
            f"access_key={self.config.access_key!r})"
        )

    @property
    def bucket(self) -> str:
        return self.config.bucket

    def _make_client(self):
        import certifi
        import urllib3
        from minio import Minio

        c = self.config
        http = urllib3.PoolManager(
            timeout=urllib3.Timeout(connect=c.connect_timeout_s, read=c.read_timeout_s),
            maxsize=max(10, c.workers * c.parallel_parts + 2),
            cert_reqs="CERT_REQUIRED" if c.verify_tls else "CERT_NONE",
            ca_certs=c.ca_bundle or certifi.where(),
            retries=request_retry(c.retries),  # beneath `_retry`'s operation-level backoff
        )
        return Minio(c.host, access_key=c.access_key, secret_key=c.secret_key, secure=c.use_tls,
                     region=c.region, http_client=http, cert_check=c.verify_tls)

    # -------------------------------------------------------------------------------- helpers

    def _loc(self, key_or_uri: str) -> tuple[str, str]:
        if key_or_uri.startswith("s3://"):
            return parse_s3_uri(key_or_uri)
        _check_key(key_or_uri.lstrip("/"), key_or_uri)
        return self.bucket, key_or_uri.lstrip("/")

    def uri(self, key: str) -> str:
        """`s3://bucket/key` for a key relative to the default bucket (URIs pass through)."""
        bucket, key = self._loc(key)
        return s3_uri(bucket, key)

    def _retry(self, what: str, fn: Callable[[], T]) -> T:
        """Run `fn`, retrying transient errors with exponential backoff + jitter."""
        c = self.config
        for attempt in range(1, c.retries + 1):
            try:
                return fn()
            except Exception as exc:
                kind = classify_error(exc)
                if kind == "auth":
                    raise UserError(
                        f"S3 authentication failed at {c.url} for access key id {c.access_key!r} "
                        f"while {what}: "
                        f"{getattr(exc, 'code', '') or type(exc).__name__} — check AWS_ACCESS_KEY_ID/"
                        "AWS_SECRET_ACCESS_KEY (the Kubernetes Secret) and the bucket policy"
                    ) from None
                if getattr(exc, "code", "") == "RequestTimeTooSkewed":
                    raise UserError(
                        f"S3 at {c.url} refused the request while {what}: this machine's clock differs "
                        "from the server's by more than S3 allows (RequestTimeTooSkewed, 15 min); fix the "
                        "clock (NTP)") from None
                if kind == "missing" and getattr(exc, "code", "") == "NoSuchBucket":
                    raise UserError(
                        f"bucket {getattr(exc, 'bucket_name', None) or self.bucket!r} "
                        f"does not exist at {c.url} "
                        "(create it: ArtifactStore.ensure_bucket(), or `chunkgrpo local up` locally)"
                    ) from None
                if kind != "transient":
                    raise
                if attempt == c.retries:
                    raise StoreError(
                        f"S3 at {c.url} still failing after {c.retries} attempts while {what}: "
                        f"{_short(exc)}") from exc
                delay = min(c.max_backoff_s, c.backoff_s * 2 ** (attempt - 1)) * (
                    0.75 + 0.5 * random.random()
                )
                log.warning("S3 %s failed (%s); retry %d/%d in %.1fs", what, _short(exc), attempt,
                            c.retries - 1, delay)
                self._sleep(delay)
        raise AssertionError("unreachable")

    # ------------------------------------------------------------------------------- buckets

    def require_bucket(self, uri: str) -> None:
        """UserError naming the bucket if the bucket of `uri` does not exist: an upload must not create one
        silently (SeaweedFS does on the first PUT) nor be reported as done (checked before any work)."""
        bucket, _ = self._loc(uri)
        if not self._retry(f"checking bucket {bucket!r}", lambda: self._client.bucket_exists(bucket)):
            raise UserError(f"bucket {bucket!r} of {uri} does not exist at {self.config.url}; create it "
                            "first (or fix the URI)")

    def ensure_bucket(self, bucket: str | None = None) -> None:
        """Create the bucket if it does not exist (idempotent, safe against a concurrent create)."""
        from minio.error import S3Error

        bucket = bucket or self.bucket
        _check_bucket_name(bucket)

        def go() -> None:
            if self._client.bucket_exists(bucket):
                return
            try:
                self._client.make_bucket(bucket, location=self.config.region)
                log.info("created bucket s3://%s at %s", bucket, self.config.url)
            except S3Error as e:
                if e.code not in ("BucketAlreadyOwnedByYou", "BucketAlreadyExists"):
                    raise

        self._retry(f"ensuring bucket {bucket!r}", go)

    # -------------------------------------------------------------------------------- objects

    def _part_size(self, size: int) -> int:
        part = self.config.part_size_mb * MiB
        need = math.ceil(size / _MAX_PARTS) if size > 0 else 0
        if need > part:
            part = math.ceil(need / MiB) * MiB
        return max(part, _MIN_PART)

    def put_file(
        self,
        local_path: str | Path,
        key: str,
        *,
        sha256: str | None = None,
        content_type: str = "application/octet-stream",
        metadata: dict[str, str] | None = None,
    ) -> dict:
        """Stream one file up (multipart above part_size). Stores its sha256 as object metadata.

        Returns {"uri", "key", "size", "sha256", "etag"}.
        """
        local_path = Path(local_path)
        if not local_path.is_file():
            raise UserError(f"cannot upload {local_path}: not a file")
        bucket, key = self._loc(key)
        if not key or key.endswith("/"):
            raise UserError(f"object key {key!r} must name a file, not a folder")
        size = local_path.stat().st_size
        digest = sha256 or file_sha256(local_path)
        meta = {"sha256": digest, **(metadata or {})}

        def go():
            with open(local_path, "rb") as f:
                reader = _HashingReader(f)
                res = self._client.put_object(
                    bucket, key, reader, size, content_type=content_type, metadata=meta,
                    part_size=self._part_size(size), num_parallel_uploads=self.config.parallel_parts)
            if reader.sha.hexdigest() != digest:
                raise ChecksumMismatchError(
                    f"{local_path} changed while it was being uploaded to {s3_uri(bucket, key)}"
                )
            return res

        res = self._retry(f"uploading {s3_uri(bucket, key)}", go)
        log.debug("put %s (%d bytes)", s3_uri(bucket, key), size)
        return {"uri": s3_uri(bucket, key), "key": key, "size": size, "sha256": digest, "etag": res.etag}

    def put_bytes(self, data: bytes, key: str, content_type: str = "application/octet-stream") -> dict:
        """Upload a small in-memory object (JSON, pointers)."""
        import io

        bucket, key = self._loc(key)
        digest = hashlib.sha256(data).hexdigest()
        self._retry(f"uploading {s3_uri(bucket, key)}", lambda: self._client.put_object(
            bucket, key, io.BytesIO(data), len(data), content_type=content_type, metadata={"sha256": digest}))
        return {"uri": s3_uri(bucket, key), "key": key, "size": len(data), "sha256": digest}

    def get_bytes(self, key: str) -> bytes:
        """Download a small object into memory. Missing -> FileNotFoundError."""
        bucket, key = self._loc(key)

        def go() -> bytes:
            resp = self._client.get_object(bucket, key)
            try:
                return resp.read()
            finally:
                resp.close()
                resp.release_conn()

        return self._missing_as_fnf(
            s3_uri(bucket, key), lambda: self._retry(f"reading {s3_uri(bucket, key)}", go)
        )

    def get_bytes_etag(self, key: str) -> tuple[bytes, str]:
        """A small object and its ETag, from one response (for a conditional rewrite). Missing ->
        FileNotFoundError."""
        bucket, key = self._loc(key)

        def go() -> tuple[bytes, str]:
            resp = self._client.get_object(bucket, key)
            try:
                return resp.read(), (resp.headers.get("ETag") or "").strip('"')
            finally:
                resp.close()
                resp.release_conn()

        return self._missing_as_fnf(
            s3_uri(bucket, key), lambda: self._retry(f"reading {s3_uri(bucket, key)}", go)
        )

    def put_bytes_if(self, data: bytes, key: str, etag: str | None) -> str:
        """Write a small object only if it does not exist (`etag` None: `If-None-Match: *`) or still has
        `etag` (`If-Match`): S3 conditional writes (AWS S3, MinIO, SeaweedFS). Returns the new ETag;
        PreconditionFailedError if another writer got there first. Sent through the minio client's
        single-request PUT, whose public `put_object` would turn these headers into user metadata."""
        from minio.error import S3Error

        from chunkgrpo.store import PreconditionFailedError

        bucket, key = self._loc(key)
        headers = {"If-None-Match": "*"} if etag is None else {"If-Match": f'"{etag}"'}
        headers["Content-Type"] = "application/json"
        try:
            res = self._retry(f"writing {s3_uri(bucket, key)}",
                              lambda: self._client._put_object(bucket, key, data, headers=headers))
        except S3Error as e:
            if e.code in ("PreconditionFailed", "ConditionalRequestConflict"):
                raise PreconditionFailedError(f"{s3_uri(bucket, key)}: changed by another writer "
                                              f"({e.code})") from None
            raise
        return (res.etag or "").strip('"')

    def _missing_as_fnf(self, uri: str, fn: Callable[[], T]) -> T:
        from minio.error import S3Error

        try:
            return fn()
        except S3Error as e:
            if e.code in ("NoSuchKey", "NoSuchBucket"):
                raise FileNotFoundError(2, f"no such object ({e.code})", uri) from None
            raise

    def stat(self, key: str) -> dict | None:
        """{"size", "etag", "last_modified", "sha256"} of an object, or None if it does not exist."""
        from minio.error import S3Error

        bucket, key = self._loc(key)

        def go():
            try:
                return self._client.stat_object(bucket, key)
            except S3Error as e:
                if e.code in ("NoSuchKey", "NoSuchBucket", "NoSuchObject"):
                    return None
                raise

        st = self._retry(f"stat {s3_uri(bucket, key)}", go)
        if st is None:
            return None
        meta = {k.lower(): v for k, v in (st.metadata or {}).items()}
        return {"size": st.size, "etag": st.etag, "last_modified": st.last_modified,
                "sha256": meta.get("x-amz-meta-sha256")}

    def exists(self, key: str) -> bool:
        return self.stat(key) is not None

    def get_file(self, key: str, local_path: str | Path, *, sha256: str | None = None,
                 size: int | None = None, verify: bool = True) -> Path:
        """Stream one object to `local_path` (written to a temp name, renamed when verified).

        A transient failure mid-download resumes at the byte offset reached. The sha256 is checked
        against `sha256` if given, else against the object's `sha256` metadata when present.
        """
        bucket, key = self._loc(key)
        uri = s3_uri(bucket, key)
        local_path = Path(local_path)
        local_path.parent.mkdir(parents=True, exist_ok=True)
        if verify and sha256 is None:
            st = self.stat(s3_uri(bucket, key))
            if st is None:
                raise FileNotFoundError(2, "no such object", uri)
            sha256 = st["sha256"]
        fd, tmp = tempfile.mkstemp(prefix=f".{local_path.name}.", suffix=".part", dir=local_path.parent)
        h = hashlib.sha256()
        written = 0
        try:
            with os.fdopen(fd, "wb") as out:
                def go() -> None:
                    nonlocal written
                    resp = self._client.get_object(bucket, key, offset=written)
                    try:
                        for block in resp.stream(CHUNK):
                            out.write(block)
                            h.update(block)
                            written += len(block)
                    finally:
                        resp.close()
                        resp.release_conn()

                self._missing_as_fnf(uri, lambda: self._retry(f"downloading {uri}", go))
            if size is not None and written != size:
                raise ChecksumMismatchError(f"{uri}: got {written} bytes, expected {size}")
            if verify and sha256 and h.hexdigest() != sha256:
                raise ChecksumMismatchError(f"{uri}: sha256 {h.hexdigest()} != recorded {sha256}")
            os.replace(tmp, local_path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return local_path

    def delete(self, key: str) -> None:
        bucket, key = self._loc(key)
        self._retry(f"deleting {s3_uri(bucket, key)}", lambda: self._client.remove_object(bucket, key))

    def delete_prefix(self, prefix: str) -> int:
        """Delete every object under a prefix (manifest first, so the folder stops being complete)."""
        from minio.deleteobjects import DeleteObject

        bucket, key = self._loc(prefix)
        entries = [e.key for e in self.list(s3_uri(bucket, key))]
        manifests = [k for k in entries if k.endswith("/" + MANIFEST_NAME) or k == MANIFEST_NAME]
        for k in manifests:
            self._retry(f"deleting {s3_uri(bucket, k)}", lambda k=k: self._client.remove_object(bucket, k))
        rest = [k for k in entries if k not in manifests]

        def go() -> None:
            errors = list(self._client.remove_objects(bucket, (DeleteObject(k) for k in rest)))
            if errors:
                raise StoreError(
                    f"could not delete {len(errors)} objects under {s3_uri(bucket, key)}: {errors[0]}"
                )

        if rest:
            self._retry(f"deleting under {s3_uri(bucket, key)}", go)
        return len(entries)

    # -------------------------------------------------------------------------------- listing

    def list(self, prefix: str = "", recursive: bool = True) -> list[ObjectEntry]:
        """Objects under `prefix` (keys relative to the bucket), sorted by key.

        With recursive=False, direct children only; sub-folders come back with is_dir=True.
        """
        bucket, key = self._loc(prefix)

        def go() -> list[ObjectEntry]:
            return [ObjectEntry(o.object_name, o.size or 0, o.last_modified, bool(o.is_dir))
                    for o in self._client.list_objects(bucket, prefix=key or None, recursive=recursive)]

        return sorted(self._retry(f"listing {s3_uri(bucket, key)}", go), key=lambda e: e.key)

    def list_complete(self, prefix: str) -> list[str]:
        """Folder prefixes directly under `prefix` that have a manifest, in natural name order."""
        bucket, base = self._loc(prefix)
        base = folder_prefix(base)
        found = []
        for e in self.list(s3_uri(bucket, base)):
            rest = e.key[len(base):]
            parts = rest.split("/")
            if len(parts) == 2 and parts[1] == MANIFEST_NAME:
                found.append(s3_uri(bucket, base + parts[0]))
        return sorted(found, key=_natural_key)

    def latest_complete(self, prefix: str) -> str | None:
        """`s3://` URI of the last complete folder under `prefix` (natural name order: step-9 < step-10).

        Folders without a manifest (interrupted uploads, uploads in progress) are ignored.
        """
        done = self.list_complete(prefix)
        return done[-1] if done else None

    def presigned_get(self, key: str, expires: _dt.timedelta = _dt.timedelta(days=7)) -> str:
        """A time-limited GET URL for a report/browser (max 7 days for SigV4)."""
        bucket, key = self._loc(key)
        return self._retry(f"presigning {s3_uri(bucket, key)}",
                           lambda: self._client.presigned_get_object(bucket, key, expires=expires))

    # --------------------------------------------------------------------------------- folders

    def read_manifest(self, prefix: str) -> Manifest | None:
        """The folder's manifest, or None if the folder is incomplete/missing."""
        bucket, key = self._loc(prefix)
        mkey = folder_prefix(key) + MANIFEST_NAME
        try:
            data = self.get_bytes(s3_uri(bucket, mkey))
        except FileNotFoundError:
            return None
        return Manifest.from_json(data, where=s3_uri(bucket, mkey))

    def is_complete(self, prefix: str) -> bool:
        """True only if the folder has a manifest (written last by put_folder)."""
        bucket, key = self._loc(prefix)
        return self.exists(s3_uri(bucket, folder_prefix(key) + MANIFEST_NAME))

    def put_folder(self, local_dir: str | Path, prefix: str, *, meta: dict | None = None,
                   overwrite: bool = True, progress: Callable[[str, int], None] | None = None) -> Manifest:
        """Upload a folder atomically: files first (in parallel), `MANIFEST.json` last.

        If the prefix already holds a complete folder, its manifest is removed first (so readers
        never mix old and new files) unless overwrite=False, which raises instead. Objects under the
        prefix that are not part of the new folder are deleted before the manifest is written.
        """
        local_dir = Path(local_dir)
        bucket, key = self._loc(prefix)
        base = folder_prefix(key)
        if not base:
            raise UserError("put_folder needs a non-empty prefix (not the bucket root)")
        uri = s3_uri(bucket, base.rstrip("/"))
        t0 = time.perf_counter()
        manifest = build_manifest(local_dir, meta)
        if self.is_complete(uri):
            if not overwrite:
                raise UserError(
                    f"{uri} already holds a complete folder artifact (pass overwrite=True to replace it)"
                )
            log.info("replacing complete folder %s", uri)
            self.delete(s3_uri(bucket, base + MANIFEST_NAME))

        def one(item: tuple[str, dict]) -> None:
            rel, entry = item
            self.put_file(local_dir / rel, s3_uri(bucket, base + rel), sha256=entry["sha256"])
            if progress:
                progress(rel, int(entry["size"]))

        with ThreadPoolExecutor(max_workers=self.config.workers) as pool:
            for _ in pool.map(one, sorted(manifest.files.items())):
                pass  # re-raises the first failure; the manifest is then never written
        stale = [e.key for e in self.list(s3_uri(bucket, base))
                 if e.key[len(base):] not in manifest.files and e.key != base + MANIFEST_NAME]
        for k in stale:
            self.delete(s3_uri(bucket, k))
        self.put_bytes(
            manifest.to_json(), s3_uri(bucket, base + MANIFEST_NAME), content_type="application/json"
        )
        dt = time.perf_counter() - t0
        log.info("uploaded %s: %d files, %.1f MB in %.1fs (%.0f MB/s)", uri, len(manifest.files),
                 manifest.total_bytes / 1e6, dt, manifest.total_bytes / 1e6 / max(dt, 1e-9))
        return manifest

    def get_folder(self, prefix: str, local_dir: str | Path) -> Manifest:
        """Download a complete folder and verify every file's size and sha256.

        Raises IncompleteArtifactError if the folder has no manifest (interrupted upload).
        Files not listed in the manifest are ignored. The manifest is written to local_dir too.
        """
        bucket, key = self._loc(prefix)
        base = folder_prefix(key)
        uri = s3_uri(bucket, base.rstrip("/"))
        manifest = self.read_manifest(uri)
        if manifest is None:
            n = len(self.list(s3_uri(bucket, base))) if base else 0
            detail = (
                f"it holds {n} objects but no {MANIFEST_NAME}: the upload was interrupted or is still running"
                if n
                else "nothing is stored there"
            )
            raise IncompleteArtifactError(f"{uri} is not a complete folder artifact ({detail})")
        local_dir = Path(local_dir)
        local_dir.mkdir(parents=True, exist_ok=True)
        t0 = time.perf_counter()

        def one(item: tuple[str, dict]) -> None:
            rel, entry = item
            self.get_file(s3_uri(bucket, base + rel), local_dir / rel, sha256=entry["sha256"],
                          size=int(entry["size"]))

        with ThreadPoolExecutor(max_workers=self.config.workers) as pool:
            for _ in pool.map(one, sorted(manifest.files.items())):
                pass
        (local_dir / MANIFEST_NAME).write_bytes(manifest.to_json())
        dt = time.perf_counter() - t0
        log.info("downloaded %s: %d files, %.1f MB in %.1fs", uri, len(manifest.files),
                 manifest.total_bytes / 1e6, dt)
        return manifest


def _natural_key(s: str) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _short(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}"
    return text if len(text) < 300 else text[:297] + "..."
