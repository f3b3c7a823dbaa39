"""Pure logic of the store/tracking/local-services layer: no servers (the registry's: tests/unit/registry)."""

from __future__ import annotations

import json
import socket

import pytest

from chunkgrpo.errors import UserError
from chunkgrpo.processes import free_ports, port_in_use
from chunkgrpo.services import LocalServicesConfig
from chunkgrpo.store import ChecksumMismatchError, StoreError, parse_s3_uri, s3_uri
from chunkgrpo.store.client import ArtifactStore, StoreConfig, classify_error
from chunkgrpo.store.manifest import Manifest, build_manifest, make_pointer, read_pointer
from chunkgrpo.tracking import NullTracker, flatten, stage_run, start_pipeline_run

SECRET = "s3cr3t-value-never-shown"


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
    for k in ("CHUNKGRPO_S3_ENDPOINT", "CHUNKGRPO_S3_BUCKET", "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY",
              "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_CA_BUNDLE", "SSL_CERT_FILE", "MLFLOW_TRACKING_URI"):
        monkeypatch.delenv(k, raising=False)


# ------------------------------------------------------------------------------------------ URIs

def test_parse_s3_uri():
    assert parse_s3_uri("s3://bucket/a/b/c.bin") == ("bucket", "a/b/c.bin")
    assert parse_s3_uri("s3://bucket") == ("bucket", "")
    assert parse_s3_uri("s3://bucket/") == ("bucket", "")
    assert s3_uri("bucket", "/a/b") == "s3://bucket/a/b"


@pytest.mark.parametrize("bad", ["bucket/key", "http://x/y", "s3://", "s3:///key", "s3://ab/k", "s3://Bad_Bucket/k"])
def test_parse_s3_uri_rejects(bad):
    with pytest.raises(UserError):
        parse_s3_uri(bad)


# ---------------------------------------------------------------------------------------- config

def test_store_config_from_env_and_secret_hidden(monkeypatch):
    monkeypatch.setenv("CHUNKGRPO_S3_ENDPOINT", "http://127.0.0.1:8333")
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIDEXAMPLE")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    c = StoreConfig()
    assert (c.host, c.use_tls, c.url) == ("127.0.0.1:8333", False, "http://127.0.0.1:8333")
    assert (c.bucket, c.region, c.access_key, c.secret_key) == (
        "chunkgrpo",
        "us-east-1",
        "AKIDEXAMPLE",
        SECRET,
    )
    assert SECRET not in repr(c)
    assert "secret_key" not in c.to_dict() and SECRET not in c.to_yaml()
    assert SECRET not in repr(ArtifactStore(c))
    # round trip through the dict form re-reads the secret from the environment
    assert StoreConfig.from_dict(c.to_dict()).secret_key == SECRET


def test_retries_from_the_environment_unless_set(monkeypatch):
    monkeypatch.delenv("CHUNKGRPO_S3_RETRIES", raising=False)
    assert StoreConfig().retries == 6
    monkeypatch.setenv("CHUNKGRPO_S3_RETRIES", "3")
    assert StoreConfig().retries == 3 and StoreConfig(retries=9).retries == 9
    for bad in ("three", "0", "-2"):
        monkeypatch.setenv("CHUNKGRPO_S3_RETRIES", bad)
        with pytest.raises(UserError, match=f"^CHUNKGRPO_S3_RETRIES='{bad}' is not a whole number >= 1$"):
            StoreConfig()


def test_store_config_tls_inference():
    assert StoreConfig(endpoint="https://minio.minio.svc:9000").use_tls
    assert StoreConfig(endpoint="s3.amazonaws.com").use_tls
    assert not StoreConfig(endpoint="minio:9000", secure=False).use_tls


@pytest.mark.parametrize("kv, words", [
    ({"endpoint": "ftp://x:1"}, "scheme"),
    ({"endpoint": "http://x:1/path"}, "path"),
    ({"part_size_mb": 4}, "5 MiB"),
    ({"workers": 0}, "workers"),
    ({"bucket": "No"}, "bucket name"),
    ({"ca_bundle": "/nonexistent/ca.pem"}, "ca_bundle"),
])
def test_store_config_validation(kv, words):
    with pytest.raises(UserError, match=words):
        StoreConfig.from_dict(kv)


def test_store_without_endpoint_or_credentials_is_a_user_error():
    with pytest.raises(UserError, match="CHUNKGRPO_S3_ENDPOINT"):
        ArtifactStore(StoreConfig())
    with pytest.raises(UserError, match="AWS_ACCESS_KEY_ID"):
        ArtifactStore(StoreConfig(endpoint="http://127.0.0.1:1"))


# -------------------------------------------------------------------------------------- manifest

def test_manifest_build_and_roundtrip(tmp_path):
    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(b"hello")
    (tmp_path / "sub" / "b.txt").write_text("world")
    (tmp_path / "empty").write_bytes(b"")
    (tmp_path / "MANIFEST.json").write_text("{}")  # an old manifest is never part of the content
    m = build_manifest(tmp_path, meta={"step": 3})
    assert sorted(m.files) == ["a.bin", "empty", "sub/b.txt"]
    assert m.files["a.bin"] == {"sha256": "2cf24dba5fb0a30e26e83b2ac5b9e29e1b161e5c1fa7425e73043362938b9824",
                                "size": 5}
    assert m.total_bytes == 10
    back = Manifest.from_json(m.to_json())
    assert back.files == m.files and back.meta == {"step": 3} and back.sha256 == m.sha256
    later = build_manifest(tmp_path)
    assert later.content_sha256 == m.content_sha256


@pytest.mark.parametrize("body", [
    "not json", json.dumps({"format": "other", "files": {}}),
    json.dumps({"format": "chunkgrpo.manifest/v1", "files": {"../evil": {"sha256": "x", "size": 1}}}),
    json.dumps({"format": "chunkgrpo.manifest/v1", "files": {"a": {"size": 1}}}),
])
def test_manifest_rejects_bad(body):
    with pytest.raises(StoreError):
        Manifest.from_json(body)


def test_model_pointer():
    p = make_pointer("s3://ckpts/run1/step-10", "a" * 64, "lora", "black-forest-labs/FLUX.1-dev", step=10)
    assert read_pointer(json.dumps(p)) == p
    with pytest.raises(UserError):
        make_pointer("s3://ckpts/x", "a" * 64, "adapter", "base")
    with pytest.raises(UserError):
        read_pointer({"format": "chunkgrpo.model-pointer/v1", "uri": "s3://ckpts/x"})


# -------------------------------------------------------------------------------------- retrying

class _Resp:
    def __init__(self, status):
        self.status = status


def _s3_error(code, status):
    from minio.error import S3Error

    return S3Error(_Resp(status), code, "msg", "/r", "req", "host")


def test_classify_error():
    from minio.error import ServerError
    from urllib3.exceptions import MaxRetryError, ProtocolError

    assert classify_error(_s3_error("SignatureDoesNotMatch", 403)) == "auth"
    assert classify_error(_s3_error("InvalidAccessKeyId", 403)) == "auth"
    assert classify_error(_s3_error("SlowDown", 503)) == "transient"
    assert classify_error(_s3_error("InternalError", 500)) == "transient"
    assert classify_error(_s3_error("NoSuchKey", 404)) == "missing"
    assert classify_error(_s3_error("InvalidArgument", 400)) == "other"
    assert classify_error(ServerError("bad gateway", 502)) == "transient"
    assert classify_error(MaxRetryError(None, "/x", reason=ConnectionRefusedError())) == "transient"
    assert classify_error(ProtocolError("reset")) == "transient"
    assert classify_error(ConnectionResetError()) == "transient"
    assert classify_error(ValueError("x")) == "other"
    assert classify_error(ChecksumMismatchError("x")) == "other"


def _store(**kw):
    return ArtifactStore(
        StoreConfig(endpoint="http://127.0.0.1:1", access_key="AKID", secret_key=SECRET, **kw),
        sleep=lambda s: sleeps.append(s),
    )


sleeps: list[float] = []


def test_retry_backoff_then_success():
    from minio.error import ServerError

    sleeps.clear()
    store = _store(retries=5, backoff_s=1.0, max_backoff_s=3.0)
    calls = iter([ConnectionRefusedError(), _s3_error("SlowDown", 503), ServerError("x", 500), "ok"])

    def fn():
        v = next(calls)
        if isinstance(v, BaseException):
            raise v
        return v

    assert store._retry("testing", fn) == "ok"
    assert len(sleeps) == 3
    for got, base in zip(sleeps, [1.0, 2.0, 3.0]):  # doubling, capped, +-25% jitter
        assert 0.75 * base <= got <= 1.25 * base


def test_retry_gives_up_and_auth_is_not_retried():
    sleeps.clear()
    store = _store(retries=3, backoff_s=0.0)

    def refused():
        raise ConnectionRefusedError("refused")

    with pytest.raises(StoreError, match="after 3 attempts"):
        store._retry("testing", refused)
    sleeps.clear()

    def denied():
        raise _s3_error("SignatureDoesNotMatch", 403)

    with pytest.raises(UserError) as e:
        store._retry("testing", denied)
    assert sleeps == []
    assert "127.0.0.1:1" in str(e.value) and "AKID" in str(e.value) and SECRET not in str(e.value)


@pytest.mark.parametrize("retries,timeout,lo,hi", [(1, 1.0, 0.9, 1.7), (2, 0.5, 1.8, 3.5)])
def test_a_hung_server_costs_one_read_timeout_per_request_with_one_attempt(retries, timeout, lo, hi):
    """A server that accepts connections and never answers (the kernel's backlog): with retries=1 (the
    callers with their own loop and time budget: the mirror, the resume listing, the lease) the call
    gives up after one read timeout; with more attempts the client's quick low-level retry doubles each
    attempt (2 attempts × 2 reads × 0.5 s)."""
    import time

    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        store = ArtifactStore(
            StoreConfig(endpoint=f"http://127.0.0.1:{srv.getsockname()[1]}", access_key="AKID",
                        secret_key=SECRET, retries=retries, backoff_s=0.0, read_timeout_s=timeout,
                        connect_timeout_s=timeout))
        t0 = time.monotonic()
        with pytest.raises(StoreError, match=f"after {retries} attempts"):
            store.list("s3://chunkgrpo/x/")
        took = time.monotonic() - t0
    assert lo <= took < hi, took


def test_a_reset_still_gets_the_quick_retry_with_one_attempt():
    """The legitimate side of the one-timeout bound above: a connection the server resets (a single
    part's upload cut) is sent again once by the client's quick retry also with retries=1, so a multi-GB
    upload of the checkpoint mirror does not start over for it."""
    import struct
    import threading

    seen: list[int] = []
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen(8)
        srv.settimeout(5)

        def reset_each():
            for _ in range(3):
                try:
                    conn, _ = srv.accept()
                except OSError:
                    return
                seen.append(1)
                conn.recv(65536)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                conn.close()  # RST

        t = threading.Thread(target=reset_each, daemon=True)
        t.start()
        store = ArtifactStore(
            StoreConfig(endpoint=f"http://127.0.0.1:{srv.getsockname()[1]}", access_key="AKID",
                        secret_key=SECRET, retries=1, backoff_s=0.0, read_timeout_s=5, connect_timeout_s=5))
        with pytest.raises(StoreError, match="after 1 attempts"):
            store.list("s3://chunkgrpo/x/")
        srv.close()
        t.join(timeout=10)
    assert len(seen) == 2, seen


def test_part_size_grows_for_huge_files():
    store = _store(part_size_mb=8)
    assert store._part_size(100) == 8 * 2**20
    assert store._part_size(200 * 2**30) >= 200 * 2**30 / 10_000  # 200 GiB still fits in 10k parts


# -------------------------------------------------------------------------------------- tracking

def test_flatten_and_null_tracker():
    assert flatten({"a": {"b": 1, "c": {"d": "x"}}, "e": [1, 2]}) == {"a.b": 1, "a.c.d": "x", "e": [1, 2]}
    with start_pipeline_run("exp", "run") as run:  # MLFLOW_TRACKING_URI unset -> no-op
        assert isinstance(run, NullTracker) and not run.enabled
        run.log_params({"a": 1})
        with run.stage("train") as st:
            st.log_metrics({"loss": 1.0}, step=1)
    with stage_run("evaluate") as st:
        assert st.run_id is None


# -------------------------------------------------------------------------------- local services

def test_local_services_config(monkeypatch, tmp_path):
    monkeypatch.setenv("CHUNKGRPO_HOME", str(tmp_path))
    assert LocalServicesConfig().home == str(tmp_path)
    with pytest.raises(UserError, match="both"):
        LocalServicesConfig(s3_port=9000, mlflow_port=9000)
    with pytest.raises(UserError, match="between"):
        LocalServicesConfig(s3_port=80)


def test_port_helpers():
    ports = free_ports(5)
    assert len(set(ports)) == 5
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        assert port_in_use(s.getsockname()[1])


def test_file_sizes_lists_what_build_manifest_hashes(tmp_path):
    """The size-only listing (a downloaded folder checked against its manifest) skips the top-level
    MANIFEST.json exactly as build_manifest does, and keeps one nested deeper."""
    from chunkgrpo.store.manifest import MANIFEST_NAME, build_manifest, file_sizes

    (tmp_path / "sub").mkdir()
    (tmp_path / "a.bin").write_bytes(b"x" * 3)
    (tmp_path / "sub" / MANIFEST_NAME).write_text("{}")
    (tmp_path / MANIFEST_NAME).write_text("{}")
    sizes = file_sizes(tmp_path)
    assert sizes == {rel: e["size"] for rel, e in build_manifest(tmp_path).files.items()}
    assert sizes == {"a.bin": 3, f"sub/{MANIFEST_NAME}": 2}
