"""`chunkgrpo reward-server` as a real process on 127.0.0.1, and the training client against it."""

from __future__ import annotations

import base64
import io
import json
import re
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch
from PIL import Image

from chunkgrpo.errors import UserError
from chunkgrpo.scoring.remote import RemoteReward, RewardServiceError
from chunkgrpo.scoring.rewards import get_reward
from chunkgrpo.train.config import TrainConfig
from tests.integration.reward_servers import TOKEN, Server

pytestmark = pytest.mark.integration


# User rewards the server can serve that answer wrongly or slowly on purpose (counts and NaNs are the client's
# check; a slow one outlasts the client's per-request timeout)
BAD_REWARDS = '''
import time

import torch

def short():
    return lambda images, prompts: torch.zeros(max(len(images) - 1, 0))

def nan():
    return lambda images, prompts: torch.full((len(images),), float("nan"))

def slow(seconds=5.0):
    def fn(images, prompts):
        time.sleep(float(seconds))
        return torch.zeros(len(images))
    return fn
'''


@pytest.fixture
def servers(tmp_path):
    (tmp_path / "badrewards.py").write_text(BAD_REWARDS)
    started: list[Server] = []

    def start(scorer: str, *extra: str, token: str | None = TOKEN, port: int = 0) -> Server:
        s = Server(tmp_path, scorer, *extra, token=token, port=port)
        started.append(s)
        return s

    yield start
    for s in started:
        s.stop()


@pytest.fixture
def token_env(monkeypatch):
    monkeypatch.setenv("CHUNKGRPO_REWARD_TOKEN", TOKEN)


def _images(n: int, seed: int = 0, size: int = 16) -> list[Image.Image]:
    g = torch.Generator().manual_seed(seed)
    px = (torch.rand(n, size, size, 3, generator=g) * 255).to(torch.uint8).numpy()
    return [Image.fromarray(a, "RGB") for a in px]


def _post(url: str, body: bytes, token: str | None = TOKEN) -> tuple[int, dict]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    try:
        with urllib.request.urlopen(urllib.request.Request(f"{url}/score", data=body, headers=headers),
                                    timeout=30) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def _body(images, prompts) -> bytes:
    def png(im):
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        return base64.b64encode(buf.getvalue()).decode()

    return json.dumps({"prompts": prompts, "images": [png(im) for im in images]}).encode()


@pytest.mark.parametrize("scorer,options", [("brightness", {}), ("contrast", {}),
                                            ("color", {"rgb": "10,200,30"})])
def test_served_reward_equals_in_process(servers, token_env, scorer, options):
    extra = [a for k, v in options.items() for a in ("--option", f"{k}={v}")]
    s = servers(scorer, *extra)
    images, prompts = _images(37), [f"p{i}" for i in range(37)]
    local = get_reward(scorer, options)(images, prompts)
    remote = RemoteReward(s.url, scorer, max_batch=8)(images, prompts)  # 5 requests, the last of 5 images
    assert remote.dtype == torch.float32 and remote.shape == (37,)
    assert torch.allclose(remote, local, rtol=1e-6, atol=0)
    metrics = urllib.request.urlopen(f"{s.url}/metrics", timeout=5).read().decode()
    assert f'chunkgrpo_reward_requests_total{{code="200",scorer="{scorer}"}} 5' in metrics
    assert f'chunkgrpo_reward_images_total{{scorer="{scorer}"}} 37' in metrics
    assert "chunkgrpo_reward_batch_size_count 5" in metrics
    assert "chunkgrpo_reward_latency_seconds_sum" in metrics


def test_token_and_limits(servers, tmp_path, monkeypatch):
    s = servers("brightness", "--max-batch", "4", "--max-request-bytes", "20000")
    images = _images(3)
    code, body = _post(s.url, _body(images, ["a", "b", "c"]))
    assert code == 200 and body["scorer"] == "brightness" and len(body["scores"]) == 3
    assert body["version"].startswith("chunkgrpo ")
    assert _post(s.url, _body(images, ["a", "b", "c"]), token=None)[0] == 401
    assert _post(s.url, _body(images, ["a", "b", "c"]), token="wrong")[0] == 401
    code, body = _post(s.url, _body(_images(5), list("abcde")))
    assert code == 413 and "at most 4" in body["error"]
    big = _images(2, size=128)  # random pixels: ~2 x 49 KB of PNG
    code, body = _post(s.url, _body(big, ["a", "b"]))
    assert code == 413 and "at most 20000" in body["error"]
    assert _post(s.url, json.dumps({"prompts": ["a"], "images": ["not png"]}).encode())[0] == 400
    assert urllib.request.urlopen(f"{s.url}/healthz", timeout=5).status == 200
    assert TOKEN not in (tmp_path / "server-brightness.log").read_text()
    # the client names the URL and the cause, without retrying a refusal
    monkeypatch.delenv("CHUNKGRPO_REWARD_TOKEN", raising=False)
    with pytest.raises(RewardServiceError, match=rf"reward 'brightness' at {s.url}/score: HTTP 401 "
                                                 r"\(missing or wrong bearer token\)$"):
        RemoteReward(s.url, "brightness", deadline_s=30)(images, ["a", "b", "c"])


def test_killed_server_is_one_line_naming_the_url(servers, token_env):
    s = servers("brightness")
    reward = RemoteReward(s.url, "brightness", deadline_s=2, backoff_s=0.1)
    assert reward(_images(2), ["a", "b"]).shape == (2,)
    s.proc.kill()
    s.proc.wait()
    t0 = time.monotonic()
    with pytest.raises(RewardServiceError) as e:
        reward(_images(2), ["a", "b"])
    msg = str(e.value)
    assert msg.startswith(f"reward 'brightness' at {s.url}/score: ") and "\n" not in msg
    assert "Connection refused" in msg or "ConnectionRefusedError" in msg, msg
    assert "gave up after" in msg and time.monotonic() - t0 < 10


def test_killed_server_back_within_the_deadline_is_retried(servers, token_env):
    """A crash and a restart at the same address (a pod rescheduled behind its Service): the call that
    met the dead server retries, with backoff, until the new one answers; nothing is scored twice."""
    s = servers("brightness")
    reward = RemoteReward(s.url, "brightness", deadline_s=180, backoff_s=0.2)
    images, prompts = _images(5), list("abcde")
    before = reward(images, prompts)
    s.kill()
    back: list[Server] = []

    def restart_later():
        time.sleep(1.0)
        back.append(servers("brightness", port=s.port))

    restart = threading.Thread(target=restart_later)
    restart.start()
    try:
        t0 = time.monotonic()
        after = reward(images, prompts)  # refused until the new server listens
        waited = time.monotonic() - t0
    finally:
        restart.join()
    assert torch.equal(after, before) and waited >= 1.0
    assert 'chunkgrpo_reward_requests_total{code="200",scorer="brightness"} 1' in back[0].metrics()


def test_slow_server_past_the_deadline_is_one_line(servers, token_env):
    """Every request outlasts the client's timeout: retried until the deadline, then one line; the call
    ends within the deadline plus one request's timeout."""
    s = servers("badrewards:slow", "--option", "seconds=3")
    reward = RemoteReward(s.url, "badrewards:slow", deadline_s=2, timeout_s=0.5, backoff_s=0.1)
    t0 = time.monotonic()
    with pytest.raises(RewardServiceError) as e:
        reward(_images(2), ["a", "b"])
    took = time.monotonic() - t0
    msg = str(e.value)
    m = re.fullmatch(rf"reward 'badrewards:slow' at {s.url}/score: TimeoutError: timed out; "
                     r"gave up after (\d+) attempts in 2 s", msg)
    assert m, msg
    assert 2 <= int(m.group(1)) <= 4 and took < 2 + 0.5 + 1.5, (msg, took)


def test_refusals_are_one_request_each(servers, token_env, monkeypatch):
    """401 and 413 cannot pass on a retry: one request each, then one line naming the URL and the cause."""
    s = servers("brightness", "--max-batch", "2")
    images, prompts = _images(3), ["a", "b", "c"]
    with pytest.raises(RewardServiceError, match=rf"^reward 'brightness' at {s.url}/score: HTTP 413 "
                                                 r"\(3 images in one request; at most 2\)$"):
        RemoteReward(s.url, "brightness", max_batch=3, deadline_s=30)(images, prompts)
    monkeypatch.setenv("CHUNKGRPO_REWARD_TOKEN", "wrong")
    with pytest.raises(RewardServiceError, match=rf"^reward 'brightness' at {s.url}/score: HTTP 401 "):
        RemoteReward(s.url, "brightness", max_batch=2, deadline_s=30)(images, prompts)
    metrics = s.metrics()
    for code in (401, 413):
        assert f'chunkgrpo_reward_requests_total{{code="{code}",scorer="brightness"}} 1' in metrics, metrics
    assert 'code="200"' not in metrics


@pytest.mark.parametrize("scorer,match", [
    ("badrewards:short", r"HTTP 500 \(UserError: reward 'badrewards:short' \(badrewards:short\): "
                         r"returned shape \(2,\) for 3 images \(expected \(3,\)\)\)"),
    ("badrewards:nan", r"HTTP 500 \(UserError: .*non-finite values for samples \[0, 1, 2\] of 3\)")])
def test_bad_served_reward_is_one_line(servers, token_env, scorer, match):
    s = servers(scorer)
    with pytest.raises(RewardServiceError, match=rf"^reward '{scorer}' at {s.url}/score: {match}$"):
        RemoteReward(s.url, scorer, deadline_s=30)(_images(3), ["a", "b", "c"])
    assert f'chunkgrpo_reward_requests_total{{code="500",scorer="{scorer}"}} 1' in s.metrics()  # not retried


@pytest.mark.parametrize("scores,match", [([0.5, 0.5], r"2 scores for 3 images"),
                                          ([0.5, float("nan"), 1.0], r"non-finite scores for samples \[1\]"),
                                          (None, r"no scores for 3 images")])
def test_client_checks_count_and_nan(scores, match):
    """A server that answers wrongly (here: a stand-in on 127.0.0.1) never yields a reward."""
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    class Wrong(BaseHTTPRequestHandler):
        def log_message(self, *a):
            pass

        def do_POST(self):
            self.rfile.read(int(self.headers["Content-Length"]))
            data = json.dumps({"scores": scores, "scorer": "brightness", "version": "x"}).encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Wrong)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        with pytest.raises(RewardServiceError, match=rf"^reward 'brightness' at {url}/score: {match}$"):
            RemoteReward(url, "brightness")(_images(3), ["a", "b", "c"])
    finally:
        server.shutdown()
        server.server_close()


def test_another_scorer_is_refused(servers, token_env):
    s = servers("contrast")
    with pytest.raises(RewardServiceError, match="the server scores with 'contrast', not 'brightness'"):
        RemoteReward(s.url, "brightness")(_images(2), ["a", "b"])


def test_url_in_the_train_config(tiny_model_dir, tmp_path, servers, token_env):
    s = servers("brightness")
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat\na dog\n")
    cfg = TrainConfig.load("tiny_cpu", [f"model={tiny_model_dir}", f"prompts={prompts}",
                                        f"output_dir={tmp_path / 'run'}", "progress=false", "max_steps=1",
                                        "checkpoint.every=0",
                                        f'rewards=[{{name: brightness, url: "{s.url}/"}}]'])
    assert cfg.rewards[0].url == s.url
    from chunkgrpo.train.trainer import run_training

    summary = run_training(cfg)
    assert summary["optimizer_steps"] == 1
    metrics = urllib.request.urlopen(f"{s.url}/metrics", timeout=5).read().decode()
    assert 'chunkgrpo_reward_images_total{scorer="brightness"} 8' in metrics  # the one rollout's 8 samples
    with pytest.raises(UserError, match="reward url 'ftp://x' must look like http://host:port"):
        TrainConfig.load("tiny_cpu", ["rewards=[{name: brightness, url: 'ftp://x'}]"])


def test_throughput_eight_clients(servers, token_env, capsys):
    """benchmarks/reward_server.py's measurement, against this test's server: every image scored once."""
    from tests.benchmark_scripts import load

    s = servers("brightness", "--max-batch", "16")
    result = load("reward_server").measure(s.url, "brightness", clients=8, rounds=6, batch=16, size=64)
    assert result["images"] == 8 * 6 * 16 and result["images_per_s"] > 0
    assert f'chunkgrpo_reward_images_total{{scorer="brightness"}} {8 * 6 * 16}' in s.metrics()
    with capsys.disabled():
        print(f"\nreward-server throughput: {result['images_per_s']:.0f} images/s "
              f"(8 clients, 64x64 PNG, batches of 16, brightness, CPU)")
