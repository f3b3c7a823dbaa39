"""The promoter service (`python -m chunkgrpo.promoter`, a real process) against the real local MLflow and
S3 of the `services` fixture, probed the way a pipeline user could misuse it: every alias move goes
through the gate, an evaluation counts only for the weights it scored, a version comes only from the
caller's own run, requests are idempotent and bounded, the audit log keeps what it records, a promotion
lock whose holder died is reclaimed at once, and the champion loads verified in a fresh process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from base64 import b64encode
from pathlib import Path
from types import SimpleNamespace

import pytest

from chunkgrpo.errors import UserError
from tests.registry_helpers import eval_run

pytestmark = pytest.mark.integration
PROTOCOL = {"preset": "eval_tiny", "seed": 42}
PIPE = ("pipeline-user", "pw")


@pytest.fixture(scope="module")
def promoter(services, tmp_path_factory):
    """The promoter service as its own process, on a free port, acting for the registry."""
    from chunkgrpo.processes import free_port

    port = free_port()
    env = {**os.environ, **services.env, "MLFLOW_DISABLE_TELEMETRY": "true"}
    for k in ("MLFLOW_TRACKING_USERNAME", "MLFLOW_TRACKING_PASSWORD", "CHUNKGRPO_PROMOTER_URL"):
        env.pop(k, None)
    log = open(tmp_path_factory.mktemp("promoter") / "promoter.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "chunkgrpo.promoter", "--port", str(port)], env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    break
            except (urllib.error.URLError, OSError):
                assert proc.poll() is None and time.monotonic() < deadline, "promoter did not start"
                time.sleep(0.3)
        yield SimpleNamespace(url=url, proc=proc)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


@pytest.fixture
def pipe_env(services_env, promoter, monkeypatch):
    """This process as a pipeline user that registers through the promoter."""
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", PIPE[0])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", PIPE[1])
    monkeypatch.setenv("CHUNKGRPO_PROMOTER_URL", promoter.url)
    return promoter


def post(url: str, path: str, body, raw: bytes | None = None) -> tuple[int, dict]:
    data = raw if raw is not None else json.dumps(body).encode()
    req = urllib.request.Request(f"{url}{path}", data=data, method="POST", headers={
        "Content-Type": "application/json",
        "Authorization": "Basic " + b64encode(f"{PIPE[0]}:{PIPE[1]}".encode()).decode()})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def weights(root: Path, seed: int) -> Path:
    root.mkdir(parents=True)
    (root / "pytorch_lora_weights.safetensors").write_bytes(bytes([seed % 256]) * 1024)
    return root


def register(name: str, w: Path, run: str | None, **kw):
    from chunkgrpo.registry.registration import Registration, register_model

    return register_model(Registration(name, "tiny-flux", w, kind="lora", eval_protocol=PROTOCOL,
                                       eval_run_id=run, **kw), experiment="probe-register")


def evaluated(name: str, tmp_path: Path, seed: int, score: float):
    w = weights(tmp_path / f"w{seed}", seed)
    return register(name, w, eval_run({"hpdv2.hpsv3.trained": score}, "probe-eval", weights=w))


def aliases(name: str) -> dict:
    from mlflow import MlflowClient

    return dict(MlflowClient().get_registered_model(name).aliases)


def versions(name: str) -> list[str]:
    from mlflow import MlflowClient

    return sorted(mv.version for mv in MlflowClient().search_model_versions(f"name='{name}'"))


def one_line(body: dict) -> bool:
    return bool(body.get("error")) and "\n" not in body["error"] and "Traceback" not in body["error"]


def test_no_request_field_can_name_the_champion(pipe_env, tmp_path):
    """A worse version registered with challenger_alias=champion (or previous) is refused, nothing is
    created and the champion stays."""
    name = f"probe-{uuid.uuid4().hex[:6]}"
    v1 = evaluated(name, tmp_path, 1, 0.5)
    assert post(pipe_env.url, "/promote", {"name": name, "version": v1.version, "why": "first"})[1][
        "action"] == "promoted"
    w = weights(tmp_path / "worse", 2)
    run = eval_run({"hpdv2.hpsv3.trained": 0.10}, "probe-eval", weights=w)
    for alias in ("champion", "previous"):
        with pytest.raises(UserError, match="moved only by the promotion gate"):
            register(name, w, run, challenger_alias=alias)
    assert aliases(name)["champion"] == v1.version and versions(name) == [v1.version]


def test_an_evaluation_of_other_weights_is_refused(pipe_env, tmp_path):
    """New weights registered with the evaluation run of better weights: refused at the promoter (and
    in-process), so no version carries the borrowed numbers."""
    name = f"probe-{uuid.uuid4().hex[:6]}"
    v1 = evaluated(name, tmp_path, 1, 0.5)
    post(pipe_env.url, "/promote", {"name": name, "version": v1.version, "why": "first"})
    better = eval_run({"hpdv2.hpsv3.trained": 0.9}, "probe-eval", weights=weights(tmp_path / "better", 3))
    worse = weights(tmp_path / "worse", 4)
    with pytest.raises(UserError, match="scored other weights"):
        register(name, worse, better)
    plain = register(name, worse, None)  # registered without an evaluation: its run and source
    code, body = post(pipe_env.url, "/versions", {"name": name + "-b", "source": plain.source,
                                                  "run_id": plain.run_id, "eval_run_id": better})
    assert code == 400 and one_line(body) and "scored other weights" in body["error"], body
    code, body = post(pipe_env.url, "/promote", {"name": name, "version": plain.version, "why": "x"})
    assert code == 400 and "links no evaluation run" in body["error"]
    assert aliases(name)["champion"] == v1.version


def test_a_fabricated_evaluation_is_refused(pipe_env, tmp_path, monkeypatch):
    """A run the pipeline user tags chunkgrpo.stage=evaluate with 0.99 names no weights: refused. In the
    stronger mode (the model trusts only the evaluator's experiment) even one naming the right weights is
    refused, while the evaluator's own run is accepted."""
    from mlflow import MlflowClient

    from chunkgrpo.registry.promotion import set_eval_experiment
    from chunkgrpo.tracking import stage_run

    name = f"probe-{uuid.uuid4().hex[:6]}"
    v1 = evaluated(name, tmp_path, 1, 0.5)
    post(pipe_env.url, "/promote", {"name": name, "version": v1.version, "why": "first"})
    w = weights(tmp_path / "w2", 2)
    with stage_run("evaluate", experiment="probe-fabricated") as t:
        t.log_metrics({"hpdv2.hpsv3.trained": 0.99})
    with pytest.raises(UserError, match="records no weights digest"):
        register(name, w, t.run_id)
    # the stronger mode, from a model's start: only the evaluator's experiment counts (the champion's too)
    strict = f"probe-strict-{uuid.uuid4().hex[:6]}"
    register(strict, weights(tmp_path / "s0", 9), None)  # creates the model (no evaluation, no champion)
    evaluator = MlflowClient().create_experiment(f"probe-evaluator-{uuid.uuid4().hex[:6]}")
    set_eval_experiment(strict, evaluator, why="evaluations run by the evaluator identity")
    forged = eval_run({"hpdv2.hpsv3.trained": 0.99}, "probe-fabricated", weights=w)
    with pytest.raises(UserError, match="not in the evaluator's experiment"):
        register(strict, w, forged)
    trusted = eval_run({"hpdv2.hpsv3.trained": 0.6}, MlflowClient().get_experiment(evaluator).name,
                       weights=w)
    v2 = register(strict, w, trusted)
    code, body = post(pipe_env.url, "/promote", {"name": strict, "version": v2.version, "why": "first"})
    assert code == 200 and body["action"] == "promoted", body
    assert aliases(name)["champion"] == v1.version


def test_a_source_outside_the_callers_run_is_refused(pipe_env, tmp_path):
    """`..`, another run's artifacts, an absolute path: HTTP 400 with one line, before MLflow sees it."""
    name = f"probe-{uuid.uuid4().hex[:6]}"
    mine = register(name, weights(tmp_path / "a", 1), None)
    other = register(name, weights(tmp_path / "b", 2), None)
    root = mine.source.rsplit("/", 1)[0]
    other_run_path = other.source.split("/", 1)[1]  # <experiment>/<run>/artifacts/model
    before = versions(name)
    for source in (f"{root}/../../../{other_run_path}", f"{root}/./model", f"{root}//model",
                   other.source, "/etc/passwd", f"{root}/%2e%2e/x"):
        code, body = post(pipe_env.url, "/versions", {"name": name, "source": source, "run_id": mine.run_id})
        assert code == 400 and one_line(body), (source, code, body)
    assert versions(name) == before


def test_replaying_a_version_request_creates_nothing_more(pipe_env, tmp_path):
    """The same /versions body three times answers the same version; an idempotency key names one request
    (reused for another source: refused)."""
    name = f"probe-{uuid.uuid4().hex[:6]}"
    v = register(name, weights(tmp_path / "a", 1), None)
    body = {"name": name, "source": v.source, "run_id": v.run_id, "tags": {"note": "replayed"}}
    answers = [post(pipe_env.url, "/versions", body) for _ in range(3)]
    assert [a[0] for a in answers] == [200] * 3 and {a[1]["version"] for a in answers} == {v.version}
    assert versions(name) == [v.version]
    other = register(name + "-o", weights(tmp_path / "b", 2), None)
    keyed = {"name": name + "-k", "source": v.source, "run_id": v.run_id, "idempotency_key": "req-1"}
    first = post(pipe_env.url, "/versions", keyed)
    assert first[0] == 200 and post(pipe_env.url, "/versions", keyed)[1]["version"] == first[1]["version"]
    code, err = post(pipe_env.url, "/versions", {**keyed, "source": other.source, "run_id": other.run_id})
    assert code == 400 and "idempotency key" in err["error"]
    assert versions(name + "-k") == [first[1]["version"]]


def test_rejections_cannot_push_records_out_of_the_audit_log(pipe_env, tmp_path, monkeypatch):
    """A forced promotion stays in the log after 21 rejected requests (counted apart); a 60 KB reason is
    refused with one line, a body over the limit with 413."""
    from chunkgrpo.registry.promotion import promote, promotion_history

    name = f"probe-{uuid.uuid4().hex[:6]}"
    v1, v2 = evaluated(name, tmp_path, 1, 0.5), evaluated(name, tmp_path, 2, 0.3)
    assert promote(name, v1.version).action == "promoted"
    assert promote(name, v2.version, force=True, why="hotfix").action == "forced"
    v3 = evaluated(name, tmp_path, 3, 0.1)
    for _ in range(21):
        assert post(pipe_env.url, "/promote", {"name": name, "version": v3.version, "why": "again"})[1][
            "action"] == "rejected"
    history = promotion_history(name)
    assert [e["action"] for e in history if e["action"] in ("promoted", "forced")] == ["promoted", "forced"]
    from mlflow import MlflowClient

    assert MlflowClient().get_registered_model(name).tags["promotion.rejected_count"] == "21"
    code, body = post(pipe_env.url, "/promote", {"name": name, "version": v3.version, "why": "w" * 60_000})
    assert code == 400 and one_line(body) and "why" in body["error"], (code, body)
    code, body = post(pipe_env.url, "/promote", {"name": name, "version": v3.version, "why": "w" * 70_000})
    assert code == 413 and one_line(body)
    assert len(promotion_history(name)) == len(history)


def test_a_killed_lock_holder_does_not_block_the_next_promotion(pipe_env, tmp_path):
    """A process SIGKILLed while it holds the promotion lock: the next, better promotion succeeds within
    seconds (the lock's holder is gone), not after the lease or a fixed wait."""
    name = f"probe-{uuid.uuid4().hex[:6]}"
    v1 = evaluated(name, tmp_path, 1, 0.3)
    code = ("import sys, time\nfrom chunkgrpo.registry.client import connect\n"
            "from chunkgrpo.registry.promotion import promotion_lock\n"
            "with promotion_lock(connect(), sys.argv[1]):\n"
            "    print('held', flush=True)\n    time.sleep(600)\n")
    holder = subprocess.Popen([sys.executable, "-c", code, name], stdout=subprocess.PIPE, text=True,
                              env=os.environ.copy())
    try:
        assert holder.stdout.readline().strip() == "held"
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    t0 = time.monotonic()
    code, body = post(pipe_env.url, "/promote", {"name": name, "version": v1.version, "why": "after a crash"})
    assert code == 200 and body["action"] == "promoted", body
    assert time.monotonic() - t0 < 20
    assert aliases(name)["champion"] == v1.version


def test_malformed_bodies_get_400_never_500(pipe_env):
    deep = b'{"name": ' + b"[" * 5000 + b"]" * 5000 + b"}"
    for raw in (deep, b'{"tags": {"a": {"b": {"c": {"d": 1}}}}}', b"[1, 2]", b"{not json", b"\xff\xfe"):
        code, body = post(pipe_env.url, "/versions", None, raw=raw)
        assert code == 400 and one_line(body), (raw[:40], code, body)
    code, body = post(pipe_env.url, "/promote", {"name": "m", "version": "1", "margin": "nan"})
    assert code == 400 and one_line(body)
    code, body = post(pipe_env.url, "/versions", {"name": "m", "source": "s", "run_id": "r",
                                                  "challenger_alias": "champion"})
    assert code == 400 and "promotion gate" in body["error"]
    code, body = post(pipe_env.url, "/promote", {"name": "m", "version": "1", "force": True})
    assert code == 400 and "unknown field 'force'" in body["error"]


def test_the_champion_loads_verified_in_a_fresh_process(services_env, tmp_path, tiny_model_dir):
    """`load_pyfunc("models:/NAME@champion")` in a new process loads an untampered champion (its digest
    covers exactly the registered files) and refuses one whose code was replaced in the artifact store."""
    import mlflow
    import torch
    from diffusers import FluxPipeline
    from mlflow import MlflowClient
    from peft import LoraConfig
    from peft.utils import get_peft_model_state_dict

    from chunkgrpo.registry.promotion import promote
    from chunkgrpo.registry.registration import Registration, register_model

    pipe = FluxPipeline.from_pretrained(str(tiny_model_dir), dtype=torch.float32)
    pipe.transformer.add_adapter(LoraConfig(r=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"],
                                            init_lora_weights=False))
    w = tmp_path / "w"
    FluxPipeline.save_lora_weights(w, transformer_lora_layers=get_peft_model_state_dict(pipe.transformer))
    name = f"probe-load-{uuid.uuid4().hex[:6]}"
    run = eval_run({"hpdv2.hpsv3.trained": 0.4}, "probe-eval", weights=w)
    rv = register_model(Registration(name, str(tiny_model_dir), w, kind="lora", eval_protocol=PROTOCOL,
                                     eval_run_id=run))
    assert promote(name, rv.version).action == "promoted"
    script = ("import sys\nfrom chunkgrpo.errors import UserError\n"
              "from chunkgrpo.registry.load import load_pyfunc\n"
              "try:\n    m = load_pyfunc(sys.argv[1], sys.argv[2])\nexcept UserError as e:\n"
              "    print('refused:', e)\n    sys.exit(3)\nprint('loaded', type(m).__name__)\n")
    uri = f"models:/{name}@champion"

    def load(dst: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-c", script, uri, str(tmp_path / dst)], capture_output=True,
                              text=True, timeout=300, env={**os.environ, "CHUNKGRPO_DEVICE": "cpu"})

    r = load("ok")
    assert r.returncode == 0 and "loaded PyFuncModel" in r.stdout, r.stdout + r.stderr[-2000:]
    mv = MlflowClient().get_model_version(name, rv.version)
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(tmp_path / "dl")))
    sentinel = tmp_path / "planted-code-ran"
    (local / "served_model_entry.py").write_text(f"open({str(sentinel)!r}, 'w').write('x')\n")
    MlflowClient().log_artifact(mv.run_id, str(local / "served_model_entry.py"), mv.source.rsplit("/", 1)[-1])
    r = load("tampered")
    assert r.returncode == 3 and "changed since registration" in r.stdout, r.stdout + r.stderr[-2000:]
    assert not sentinel.exists()


def test_a_starting_promoter_reclaims_locks_of_gone_holders_only(services_env):
    """What `serve` does on start: a lock whose lease expired or whose process is gone is deleted, a live
    holder's is kept."""
    from mlflow import MlflowClient

    from chunkgrpo.registry.client import connect
    from chunkgrpo.registry.gate import LOCK_SUFFIX
    from chunkgrpo.registry.promotion import lock_holder, reclaim_locks

    c, tag = MlflowClient(), uuid.uuid4().hex[:6]
    now = time.time()
    held = {f"gone-{tag}": ("elsewhere:1:1:x", now - 5), f"live-{tag}": (lock_holder(), now + 30)}
    for name, (holder, expires) in held.items():
        tags = {"lock.holder": holder, "lock.expires": repr(expires), "lock.at": repr(now - 60)}
        c.create_registered_model(name + LOCK_SUFFIX, tags=tags)
    reclaimed = reclaim_locks(connect())
    assert f"gone-{tag}{LOCK_SUFFIX}" in reclaimed and f"live-{tag}{LOCK_SUFFIX}" not in reclaimed
    assert c.search_registered_models(f"name = 'live-{tag}{LOCK_SUFFIX}'")
    c.delete_registered_model(f"live-{tag}{LOCK_SUFFIX}")
