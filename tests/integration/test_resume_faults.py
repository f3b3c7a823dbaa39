"""Resume against a real SeaweedFS behind a TCP proxy of the test's own that cuts a checkpoint download
mid-transfer and then refuses every connection for a while: a checkpoint that could not be read is never
taken for one that fails verification. S3 back within `checkpoint.s3_wait_s`: the run resumes from it;
away longer: one line naming the endpoint, the checkpoint and the cause, nothing set aside or deleted, no
training from scratch."""

from __future__ import annotations

import contextlib
import socket
import threading
import time

import pytest

from chunkgrpo.store import StoreError
from chunkgrpo.store.client import ArtifactStore
from chunkgrpo.train.config import TrainConfig
from chunkgrpo.train.trainer import Trainer, run_training

pytestmark = pytest.mark.integration  # real SeaweedFS (the services fixture)


class CuttingProxy:
    """127.0.0.1 → S3. The first response to a request naming `cut_on` is forwarded for `after` bytes, then
    both sides are closed; for `away_s` seconds every connection, new or kept alive, is closed on its next
    request."""

    def __init__(self, upstream: tuple[str, int], cut_on: str, away_s: float, after: int = 700):
        self.upstream, self.cut_on, self.away_s, self.after = upstream, cut_on.encode(), away_s, after
        self.server = socket.create_server(("127.0.0.1", 0))
        self.port = self.server.getsockname()[1]
        self.armed, self.cuts, self.refused, self.away_until = True, 0, 0, 0.0
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, _ = self.server.accept()
            except OSError:
                return
            if time.monotonic() < self.away_until:
                self.refused += 1
                conn.close()
                continue
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            up = socket.create_connection(self.upstream, timeout=30)
        except OSError:
            conn.close()
            return
        state = {"cut": False}

        def close_both() -> None:
            for s in (conn, up):
                with contextlib.suppress(OSError):
                    s.shutdown(socket.SHUT_RDWR)
                s.close()

        def client_to_s3() -> None:
            with contextlib.suppress(OSError):
                while data := conn.recv(65536):
                    if time.monotonic() < self.away_until:  # away: open connections fail too
                        self.refused += 1
                        break
                    if self.armed and self.cut_on in data:
                        self.armed, state["cut"] = False, True
                    up.sendall(data)
            close_both()

        def s3_to_client() -> None:
            sent = 0
            with contextlib.suppress(OSError):
                while data := up.recv(65536):
                    if state["cut"]:
                        conn.sendall(data[: max(0, self.after - sent)])
                        sent += len(data)
                        if sent >= self.after:
                            self.cuts += 1
                            self.away_until = time.monotonic() + self.away_s
                            break
                    else:
                        conn.sendall(data)
            close_both()

        threading.Thread(target=client_to_s3, daemon=True).start()
        s3_to_client()

    def close(self) -> None:
        self._closed = True
        self.server.close()


def _cfg(model, prompts, out, prefix, *over):
    return TrainConfig.load("tiny_cpu", [f"model={model}", f"prompts={prompts}", f"output_dir={out}",
                                         "progress=false", "tracking.image_every=0", "max_steps=2",
                                         "checkpoint.every=1", "checkpoint.mirror_wait_s=5",
                                         f"checkpoint.s3_prefix={prefix}", *over])


@pytest.fixture
def in_s3(services_env, tiny_model_dir, tmp_path, request):
    """step-000001 of a run mirrored to the shared SeaweedFS under a prefix of this test's own."""
    prefix = f"s3://chunkgrpo/runs/resume-faults/{request.node.name}-{time.time_ns()}"
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat on a chair\na red car\n")
    run_training(_cfg(tiny_model_dir, prompts, tmp_path / "first", prefix, "max_steps=1"))
    assert len(ArtifactStore().list_complete(prefix)) == 1
    return prefix, prompts


@pytest.fixture
def proxy_for(services_env, monkeypatch):
    made = []

    def make(**kw) -> CuttingProxy:
        host_port = services_env.env["CHUNKGRPO_S3_ENDPOINT"].split("://", 1)[1]
        host, port = host_port.rsplit(":", 1)
        p = CuttingProxy((host, int(port)), **kw)
        made.append(p)
        monkeypatch.setenv("CHUNKGRPO_S3_ENDPOINT", p.endpoint)
        # the store gives up after 3 attempts (~1.5 s of backoff): an outage of a few seconds outlasts it
        monkeypatch.setenv("CHUNKGRPO_S3_RETRIES", "3")
        return p

    yield make
    for p in made:
        p.close()


def test_s3_away_longer_than_the_wait_mid_download_fails_in_one_line_and_sets_nothing_aside(
    in_s3, proxy_for, services_env, tiny_model_dir, tmp_path
):
    prefix, prompts = in_s3
    proxy = proxy_for(cut_on="trainable.safetensors", away_s=600)
    out = tmp_path / "second"  # a fresh pod: every checkpoint comes from S3
    with pytest.raises(StoreError) as e:
        run_training(_cfg(tiny_model_dir, prompts, out, prefix, "checkpoint.s3_wait_s=3"))
    msg = str(e.value)
    assert proxy.cuts == 1 and proxy.refused > 0
    assert len(msg.splitlines()) == 1, msg
    assert prefix in msg and proxy.endpoint in msg and "nothing was set aside" in msg, msg
    ckpts = out / "checkpoints"
    assert not list(ckpts.glob("step-*")) and not (out / "final").exists()  # nothing trained, nothing aside
    direct = ArtifactStore(services_env.store_config)  # the S3 copy is untouched
    assert [u.rsplit("/", 1)[-1] for u in direct.list_complete(prefix)] == ["step-000001"]


def test_s3_back_within_the_wait_resumes_from_its_checkpoint(in_s3, proxy_for, tiny_model_dir, tmp_path):
    prefix, prompts = in_s3
    # away longer than the store's own retries (~1.5 s here): only the resume's wait bridges it
    proxy = proxy_for(cut_on="trainable.safetensors", away_s=8)
    t = Trainer(_cfg(tiny_model_dir, prompts, tmp_path / "second", prefix, "checkpoint.s3_wait_s=120"))
    t0 = time.monotonic()
    try:
        t.setup()
    finally:
        t.close()
    assert proxy.cuts == 1 and proxy.refused > 0
    assert t.opt_step == 1 and time.monotonic() - t0 >= 6  # resumed from S3's step-1 after the outage
    assert not list((tmp_path / "second" / "checkpoints").glob("*.bad-*"))
