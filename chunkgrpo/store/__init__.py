"""S3 artifact store on the `minio` SDK: files, atomic folder artifacts, checksums, retries, a local cache.

Works with MinIO, SeaweedFS (`chunkgrpo local up`) and any S3. Endpoint, TLS, region, bucket and
credentials come from `StoreConfig`, whose defaults are read from the environment (Kubernetes
Secrets mounted as env vars in the cluster):

    CHUNKGRPO_S3_ENDPOINT   http://127.0.0.1:8333 | https://minio.minio.svc:9000 | s3.amazonaws.com
    CHUNKGRPO_S3_BUCKET     default bucket (default "chunkgrpo")
    AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY / AWS_DEFAULT_REGION (or AWS_REGION)
    AWS_CA_BUNDLE / SSL_CERT_FILE   CA bundle for a private TLS endpoint
    CHUNKGRPO_S3_RETRIES    attempts per operation on transient errors (default 6: ~15 s of backoff;
                            more rides out a longer S3 restart, fewer fails sooner)

Folder artifacts are atomic for readers: every file is uploaded first and `MANIFEST.json` (relative
path -> sha256 + size) is written LAST. Readers (`get_folder`, `is_complete`, `latest_complete`) only
trust a folder that has a manifest, and `get_folder` verifies every checksum. An interrupted upload
therefore leaves a folder that is never read as complete.

Transient errors (connection refused/reset, timeouts, HTTP 5xx, SlowDown) are retried with
exponential backoff; authentication errors are not retried and become a `UserError` that names
the endpoint and access key id (never the secret).

The package, bottom up (each module imports only those above it):
    chunkgrpo.store           the errors and `s3://` URIs (this module)
    chunkgrpo.store.manifest  the two JSON formats: a folder's MANIFEST.json and the model pointer
    chunkgrpo.store.config    `StoreConfig` (endpoint, credentials, transfer tuning)
    chunkgrpo.store.retries   `classify_error`: which S3 failures are retried
    chunkgrpo.store.client    `ArtifactStore` (the S3 client: retries, multipart, folders)
    chunkgrpo.store.cache     the local download cache (`cached_file`, `cached_folder`) under $CHUNKGRPO_CACHE
"""

from __future__ import annotations

import re

from chunkgrpo.errors import UserError


class StoreError(RuntimeError):
    """An S3 operation failed for a reason that is not the user's input (after retries)."""


class IncompleteArtifactError(UserError):
    """A folder artifact has no manifest (upload interrupted or still running)."""


class PreconditionFailedError(StoreError):
    """A conditional write was refused: the object exists (create-only) or changed since it was read."""


class ChecksumMismatchError(StoreError):
    """Downloaded bytes do not match the recorded sha256/size."""


# ------------------------------------------------------------------------------------------ URIs


def parse_s3_uri(uri: str) -> tuple[str, str]:
    """`s3://bucket/some/key` -> ("bucket", "some/key"). The key may be empty (`s3://bucket`)."""
    if not isinstance(uri, str) or not uri.startswith("s3://"):
        raise UserError(f"{uri!r} is not an S3 URI (expected s3://bucket/key)")
    rest = uri[len("s3://"):]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise UserError(f"{uri!r} has no bucket (expected s3://bucket/key)")
    _check_bucket_name(bucket)
    _check_key(key, uri)
    return bucket, key


def _check_key(key: str, where: str) -> None:
    """S3 keys with '.'/'..' segments are rejected by S3 clients (minio raises ValueError): a UserError
    here."""
    if any(part in (".", "..") for part in key.split("/")):
        raise UserError(f"{where!r}: '.' and '..' are not allowed as parts of an S3 key")


def s3_uri(bucket: str, key: str = "") -> str:
    """("bucket", "a/b") -> "s3://bucket/a/b"."""
    return f"s3://{bucket}/{key.lstrip('/')}"


def _check_bucket_name(bucket: str) -> None:
    if not re.fullmatch(r"[a-z0-9][a-z0-9.\-]{1,61}[a-z0-9]", bucket or ""):
        raise UserError(
            f"invalid bucket name {bucket!r}: use 3-63 lowercase letters, digits, '-' or '.', "
            "starting and ending with a letter or digit")
