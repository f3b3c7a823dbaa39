"""Preflight and the trainer's start ask a real `chunkgrpo reward-server` on 127.0.0.1 whether it can score
the run's reward, and refuse in one line naming the URL: unreachable, still loading, unauthorised, or
serving another reward than the config names."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import urllib.request

import pytest

from chunkgrpo.errors import UserError
from chunkgrpo.preflight import PreflightSpec, check
from chunkgrpo.scoring.remote import check_service
from tests.integration.reward_servers import ROOT, TOKEN, Server
from tests.integration.test_reward_server import servers, token_env  # noqa: F401

pytestmark = pytest.mark.integration

SLOW_REWARD = '''
import threading

def slow():
    threading.Event().wait()  # never loads: /readyz stays 503
'''


def _spec(tmp_path, name: str, url: str) -> PreflightSpec:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    (model / "model_index.json").write_text("{}")
    (tmp_path / "prompts.txt").write_text("a cat\n")
    return PreflightSpec(model=str(model), prompts=str(tmp_path / "prompts.txt"), mlflow=False,
                         reward_servers=[(name, url)], timeout_s=10)


def test_a_ready_server_with_the_token_passes(servers, token_env, tmp_path):  # noqa: F811
    s = servers("brightness", "--max-batch", "16")
    assert check_service(s.url + "/", "brightness") is None
    assert check(_spec(tmp_path, "brightness", s.url)) == []
    req = urllib.request.Request(f"{s.url}/info", headers={"Authorization": f"Bearer {TOKEN}"})
    with urllib.request.urlopen(req, timeout=5) as r:
        info = json.loads(r.read())
    assert info["scorer"] == "brightness" and info["max_batch"] == 16 and info["ready"] is True
    assert info["version"].startswith("chunkgrpo ")
    metrics = urllib.request.urlopen(f"{s.url}/metrics", timeout=5).read().decode()
    assert 'chunkgrpo_reward_images_total{scorer="brightness"} 0' in metrics  # the checks scored nothing


def test_a_wrong_or_missing_token_is_unauthorised(servers, tmp_path, monkeypatch):  # noqa: F811
    s = servers("brightness")
    for token in ("wrong", None):
        if token:
            monkeypatch.setenv("CHUNKGRPO_REWARD_TOKEN", token)
        else:
            monkeypatch.delenv("CHUNKGRPO_REWARD_TOKEN", raising=False)
        assert check(_spec(tmp_path, "brightness", s.url)) == [
            f"reward 'brightness' at {s.url}/info: unauthorised (HTTP 401: $CHUNKGRPO_REWARD_TOKEN is "
            "missing or wrong)"]


def test_another_scorer_is_refused(servers, token_env, tmp_path):  # noqa: F811
    s = servers("contrast")
    assert check(_spec(tmp_path, "brightness", s.url)) == [
        f"reward 'brightness' at {s.url}: the server scores with 'contrast', not 'brightness'"]


def test_an_unreachable_server_is_named(tmp_path, token_env):  # noqa: F811
    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    [problem] = check(_spec(tmp_path, "brightness", url))
    assert problem.startswith(f"reward 'brightness' at {url} is not reachable (") and "\n" not in problem
    assert "Connection refused" in problem or "ConnectionRefusedError" in problem, problem


def test_a_loading_server_is_not_ready(tmp_path, token_env):  # noqa: F811
    (tmp_path / "slowreward.py").write_text(SLOW_REWARD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), str(tmp_path)])}
    s = Server.__new__(Server)  # started without waiting for /readyz, stopped by Server.stop
    s.log = open(tmp_path / "server-slow.log", "w")
    cmd = [sys.executable, "-m", "chunkgrpo", "reward-server", "--scorer", "slowreward:slow", "--port", "0"]
    s.proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=s.log, text=True, cwd=tmp_path)
    try:
        url = s.proc.stdout.readline().split()[-1]
        assert check(_spec(tmp_path, "slowreward:slow", url)) == [
            f"reward 'slowreward:slow' at {url}/readyz: not ready (HTTP 503: the reward is still loading)"]
        # a pod deleted while its reward still loads goes at once, not after its grace period
        s.proc.terminate()
        assert s.proc.wait(timeout=30) == 128 + 15
        assert ("chunkgrpo reward-server: terminated by signal 15 while loading 'slowreward:slow'; stopped"
                in (tmp_path / "server-slow.log").read_text())
    finally:
        s.stop()


def test_a_ready_server_stops_on_sigterm_with_exit_0(tmp_path):
    """The legitimate side of the loading case above: once the reward is loaded, SIGTERM ends the serving
    wait and the server exits 0, without the loading line."""
    s = Server(tmp_path, "contrast")
    try:
        s.proc.terminate()
        assert s.proc.wait(timeout=30) == 0
        assert "while loading" not in s.log_path.read_text()
    finally:
        s.stop()


def test_the_trainer_refuses_before_loading_any_model(servers, token_env, tmp_path):  # noqa: F811
    from chunkgrpo.train.config import TrainConfig
    from chunkgrpo.train.trainer import Trainer

    s = servers("contrast")
    (tmp_path / "prompts.txt").write_text("a cat\n")
    model = tmp_path / "model"
    model.mkdir()
    (model / "model_index.json").write_text("{}")
    cfg = TrainConfig.load("tiny_cpu", [f"model={model}", f"prompts={tmp_path / 'prompts.txt'}",
                                        f"rewards=[{{name: brightness, url: '{s.url}'}}]"])
    with pytest.raises(UserError, match=rf"^reward 'brightness' at {s.url}: the server scores with "
                                        r"'contrast', not 'brightness'$"):
        Trainer(cfg, check_device=False)
    cfg.rewards[0].name = "contrast"
    Trainer(cfg, check_device=False)  # the right scorer: the trainer is built
