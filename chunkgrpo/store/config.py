"""`StoreConfig`: where artifacts live (endpoint, TLS, bucket, credentials) and the transfer tuning. Empty
values are filled from the environment (see `chunkgrpo.store`)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from urllib.parse import urlsplit

from chunkgrpo.config import Config, option
from chunkgrpo.errors import UserError
from chunkgrpo.store import (
    _check_bucket_name,
)

DEFAULT_RETRIES = 6  # backoff 0.5, 1, 2, 4, 8 s: an S3 restart of ~15 s costs an operation nothing


@dataclasses.dataclass
class StoreConfig(Config):
    """Where artifacts live. Empty values are filled from the environment (see module doc)."""

    endpoint: str = option(
        "", "S3 endpoint: http(s)://host:port or host[:port]; default $CHUNKGRPO_S3_ENDPOINT"
    )
    bucket: str = option("", "default bucket for relative keys; default $CHUNKGRPO_S3_BUCKET or 'chunkgrpo'")
    region: str = option("", "S3 region; default $AWS_DEFAULT_REGION / $AWS_REGION or 'us-east-1'")
    secure: bool | None = option(None, "use TLS; null = from the endpoint scheme (no scheme -> TLS on)")
    verify_tls: bool = option(
        True, "verify the server certificate (turn off only for self-signed test setups)"
    )
    ca_bundle: str = option(
        "", "CA bundle file for a private TLS endpoint; default $AWS_CA_BUNDLE / $SSL_CERT_FILE"
    )
    access_key: str = option("", "access key id; default $AWS_ACCESS_KEY_ID (not secret, shown in errors)")
    # The secret never appears in repr() or to_dict(); in the cluster it comes from a Secret as env.
    secret_key: str = dataclasses.field(
        default="", repr=False,
        metadata={"help": "secret key; default $AWS_SECRET_ACCESS_KEY. Never logged or serialised"})
    part_size_mb: int = option(
        64, "multipart part size in MiB (>= 5); raised automatically for files > 10000 parts"
    )
    parallel_parts: int = option(2, "parts uploaded in parallel per file")
    workers: int = option(4, "files transferred in parallel by put_folder/get_folder")
    retries: int = option(
        0, "attempts per operation on transient errors (connection refused/reset, 5xx, SlowDown); "
        f"0 = $CHUNKGRPO_S3_RETRIES or {DEFAULT_RETRIES} (~15 s of backoff); 1 = one attempt: a "
        "timed-out read is not repeated by the client's quick low-level retry either (a hung server costs "
        "one read timeout), a reset still is"
    )
    backoff_s: float = option(0.5, "first retry delay in seconds; doubles per attempt (with jitter)")
    max_backoff_s: float = option(8.0, "cap on a single retry delay in seconds")
    connect_timeout_s: float = option(10.0, "TCP connect timeout in seconds")
    read_timeout_s: float = option(300.0, "socket read timeout in seconds")

    def __post_init__(self) -> None:
        env = os.environ
        self.endpoint = (self.endpoint or env.get("CHUNKGRPO_S3_ENDPOINT", "")).strip()
        self.bucket = self.bucket or env.get("CHUNKGRPO_S3_BUCKET", "") or "chunkgrpo"
        self.region = self.region or env.get("AWS_DEFAULT_REGION") or env.get("AWS_REGION") or "us-east-1"
        self.ca_bundle = self.ca_bundle or env.get("AWS_CA_BUNDLE", "") or env.get("SSL_CERT_FILE", "")
        self.access_key = self.access_key or env.get("AWS_ACCESS_KEY_ID", "")
        self.secret_key = self.secret_key or env.get("AWS_SECRET_ACCESS_KEY", "")
        if not self.retries:
            self.retries = _env_int("CHUNKGRPO_S3_RETRIES", DEFAULT_RETRIES)
        _check_bucket_name(self.bucket)
        if self.endpoint:
            _ = self.host  # validates the endpoint form
        if self.part_size_mb < 5:
            raise UserError(f"store.part_size_mb={self.part_size_mb} is below the S3 minimum of 5 MiB")
        if self.part_size_mb > 5 * 1024:
            raise UserError(f"store.part_size_mb={self.part_size_mb} is above the S3 maximum of 5120 MiB")
        for name in ("parallel_parts", "workers", "retries"):
            if getattr(self, name) < 1:
                raise UserError(f"store.{name}={getattr(self, name)} must be >= 1")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise UserError("store.backoff_s and store.max_backoff_s must be >= 0")
        if self.ca_bundle and not Path(self.ca_bundle).is_file():
            raise UserError(f"store.ca_bundle={self.ca_bundle!r} does not exist")

    @property
    def host(self) -> str:
        """`host:port` without scheme, as the minio client wants it."""
        ep = self.endpoint
        if "://" in ep:
            parts = urlsplit(ep)
            if parts.scheme not in ("http", "https"):
                raise UserError(f"store.endpoint={ep!r}: scheme must be http or https")
            if parts.path not in ("", "/"):
                raise UserError(f"store.endpoint={ep!r}: must not contain a path (use host[:port])")
            ep = parts.netloc
        if not ep or "/" in ep:
            raise UserError(f"store.endpoint={self.endpoint!r} is not host[:port] or http(s)://host[:port]")
        return ep

    @property
    def use_tls(self) -> bool:
        if self.secure is not None:
            return self.secure
        return not self.endpoint.startswith("http://")

    @property
    def url(self) -> str:
        """The endpoint as a URL (`http://127.0.0.1:8333`)."""
        return f"{'https' if self.use_tls else 'http'}://{self.host}"

    def to_dict(self) -> dict:
        """Serialisable form without the secret (it is re-read from the environment on load)."""
        d = super().to_dict()
        d.pop("secret_key", None)
        return d


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name, "").strip()
    if not value:
        return default
    try:
        n = int(value)
    except ValueError:
        n = 0
    if n < 1:
        raise UserError(f"{name}={value!r} is not a whole number >= 1")
    return n
