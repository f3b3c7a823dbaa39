"""ArtifactStore against a real SeaweedFS S3 server (the session `services` fixture, or its own)."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
import urllib.request
import uuid

import pytest

from chunkgrpo.errors import UserError
from chunkgrpo.store import ChecksumMismatchError, IncompleteArtifactError
from chunkgrpo.store.client import ArtifactStore, _HashingReader
from chunkgrpo.store.manifest import MANIFEST_NAME

pytestmark = pytest.mark.integration
MiB = 2**20


@pytest.fixture
def store(services):
    cfg = dataclasses.replace(services.store_config, part_size_mb=5, backoff_s=0.2)
    return ArtifactStore(cfg)


def _prefix(name: str) -> str:
    return f"tests/{name}-{uuid.uuid4().hex[:8]}"


def _make_folder(root, big_mb: int = 12):
    (root / "sub" / "deeper").mkdir(parents=True)
    (root / "adapter_config.json").write_text('{"r": 4}')
    (root / "empty.txt").write_bytes(b"")
    (root / "sub" / "deeper" / "weights.bin").write_bytes(os.urandom(3 * MiB + 17))
    (root / "big.safetensors").write_bytes(os.urandom(big_mb * MiB + 1))  # > part size: multipart
    return root


def _same_tree(a, b):
    fa = {p.relative_to(a).as_posix(): p.read_bytes() for p in a.rglob("*") if p.is_file()}
    fb = {p.relative_to(b).as_posix(): p.read_bytes() for p in b.rglob("*") if p.is_file()}
    return fa == fb


def test_folder_roundtrip_with_checksums(store, tmp_path):
    src = _make_folder(tmp_path / "src")
    prefix = _prefix("roundtrip")
    t0 = time.perf_counter()
    manifest = store.put_folder(src, prefix, meta={"step": 10})
    up_s = time.perf_counter() - t0
    assert store.is_complete(prefix)
    keys = [e.key for e in store.list(prefix)]
    assert keys[-1] == f"{prefix}/sub/deeper/weights.bin" and f"{prefix}/{MANIFEST_NAME}" in keys
    assert store.stat(f"{prefix}/big.safetensors")["sha256"] == manifest.files["big.safetensors"]["sha256"]

    t0 = time.perf_counter()
    got = store.get_folder(store.uri(prefix), tmp_path / "dst")
    down_s = time.perf_counter() - t0
    assert got.files == manifest.files and got.meta == {"step": 10}
    (tmp_path / "dst" / MANIFEST_NAME).unlink()
    assert _same_tree(src, tmp_path / "dst")
    mb = manifest.total_bytes / 1e6
    print(
        f"\nfolder {mb:.1f} MB: upload {mb / up_s:.0f} MB/s ({up_s:.2f}s), "
        f"download {mb / down_s:.0f} MB/s ({down_s:.2f}s)"
    )

    # a corrupted object is caught by the checksum, and no partial file is left behind
    (tmp_path / "evil").write_bytes(b"x" * 100)
    store.put_file(tmp_path / "evil", f"{prefix}/adapter_config.json")
    with pytest.raises(ChecksumMismatchError, match="adapter_config.json"):
        store.get_folder(prefix, tmp_path / "dst2")
    assert not [p for p in (tmp_path / "dst2").rglob("*.part")]

    # single files + presigned URL (what the report links to)
    store.put_file(src / "adapter_config.json", f"{prefix}/single.json")
    assert store.get_file(f"{prefix}/single.json", tmp_path / "single.json").read_text() == '{"r": 4}'
    url = store.presigned_get(f"{prefix}/single.json")
    with urllib.request.urlopen(url, timeout=10) as r:
        assert r.read() == b'{"r": 4}'
    assert store.delete_prefix(prefix) >= 6 and store.list(prefix) == []


def test_interrupted_upload_is_never_complete(store, tmp_path, monkeypatch):
    src = _make_folder(tmp_path / "src", big_mb=11)
    root = _prefix("ckpts")
    store.put_folder(src, f"{root}/step-9")

    # 1) an exception midway through the multipart upload of a big file (the file reader fails)
    real_read = _HashingReader.read
    seen = {"n": 0}

    def failing_read(self, n=-1):
        data = real_read(self, n)
        seen["n"] += len(data)
        if seen["n"] > 6 * MiB:
            raise OSError("disk vanished (injected)")
        return data

    monkeypatch.setattr(_HashingReader, "read", failing_read)
    with pytest.raises(OSError, match="injected"):
        store.put_folder(src, f"{root}/step-10")
    monkeypatch.undo()
    assert not store.is_complete(f"{root}/step-10")
    assert store.list(f"{root}/step-10"), "the other files were uploaded, only the manifest is missing"
    with pytest.raises(IncompleteArtifactError, match="no MANIFEST.json"):
        store.get_folder(f"{root}/step-10", tmp_path / "x")

    # 2) the process "dies" after some files (injected exception between files)
    calls = {"n": 0}
    real_put = ArtifactStore.put_file

    def dying_put(self, *a, **kw):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt("killed (injected)")
        return real_put(self, *a, **kw)

    monkeypatch.setattr(ArtifactStore, "put_file", dying_put)
    with pytest.raises(KeyboardInterrupt):
        store.put_folder(src, f"{root}/step-11")
    monkeypatch.undo()
    assert not store.is_complete(f"{root}/step-11")

    # readers only trust folders with a manifest: step-9 is the latest complete checkpoint
    assert store.list_complete(root) == [store.uri(f"{root}/step-9")]
    assert store.latest_complete(root) == store.uri(f"{root}/step-9")
    # a retried upload completes the folder; natural order puts step-10 after step-9
    store.put_folder(src, f"{root}/step-10")
    assert store.latest_complete(root) == store.uri(f"{root}/step-10")
    store.delete_prefix(root)


def test_wrong_credentials_give_a_clear_error(services):
    secret = "definitely-wrong-secret-value"
    cfg = dataclasses.replace(services.store_config, secret_key=secret, retries=5)
    store = ArtifactStore(cfg)
    t0 = time.perf_counter()
    with pytest.raises(UserError) as e:
        store.list("anything")
    msg = str(e.value)
    assert "authentication failed" in msg and cfg.url in msg and cfg.access_key in msg
    assert secret not in msg and services.store_config.secret_key not in msg
    assert time.perf_counter() - t0 < 3, "auth errors must not be retried"


def test_server_restarted_midway_is_retried(tmp_path, caplog):
    """Stop the S3 server, start it again a moment later: the operations in between retry and succeed."""
    from chunkgrpo.services import local_services

    with local_services(tmp_path / "home", mlflow=False) as svc:
        cfg = dataclasses.replace(svc.store_config(), part_size_mb=5, backoff_s=0.5, max_backoff_s=2.0,
                                  retries=12)
        store = ArtifactStore(cfg)
        src = _make_folder(tmp_path / "src", big_mb=6)
        store.put_folder(src, "restart/a")
        rec = svc._load_state()["services"]["s3"]
        svc._stop_record("s3", rec)  # server gone (data stays on disk)
        assert not svc.status()["s3"].state == "running"

        def restart():
            time.sleep(2.0)
            svc.up()  # sees the dead process as crashed, starts it again on the same port

        t = threading.Thread(target=restart)
        t.start()
        caplog.set_level(logging.WARNING, logger="chunkgrpo")
        t0 = time.perf_counter()
        try:
            got = store.get_folder("restart/a", tmp_path / "dst")   # starts while the server is down
            store.put_folder(src, "restart/b")
        finally:
            t.join()
        assert time.perf_counter() - t0 >= 1.5
        assert got.total_bytes > 9 * MiB and store.is_complete("restart/b")
        assert any("retry" in r.getMessage() for r in caplog.records)
        assert any("crashed" in r.getMessage() for r in caplog.records)


def test_missing_bucket_is_a_clear_error(services):
    store = ArtifactStore(dataclasses.replace(services.store_config, bucket="no-such-bucket-here"))
    with pytest.raises(UserError, match="no-such-bucket-here.*does not exist"):
        store.list("x")
    assert not store.is_complete("x")
    store.ensure_bucket()
    store.ensure_bucket()  # idempotent
    assert store.list("x") == []
