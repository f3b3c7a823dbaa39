"""Promotion integrity against the real local MLflow of the `services` fixture: the gate
trusts only the evaluation run's metrics, gates are not retroactive, non-finite metrics are refused,
concurrent promoters end with the best champion, a replaced model file is refused at load, and bad
register/promote inputs end in one line."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest

from chunkgrpo.errors import UserError
from chunkgrpo.registry.promotion import promote
from chunkgrpo.registry.registration import Registration, register_model

pytestmark = pytest.mark.integration
METRIC = "eval.hpdv2.hpsv3"
PROTOCOL = {"preset": "eval_hpdv2", "seed": 42}


def eval_run(score: float, weights: Path) -> str:
    """An evaluation stage run as `chunkgrpo evaluate` logs one (tag chunkgrpo.stage=evaluate, the digest
    of the weights it scored)."""
    from tests.registry_helpers import eval_run as logged

    return logged({"hpdv2.hpsv3.trained": score, "hpdv2.hpsv3.base": 0.1}, "integrity-eval", weights)


def lora(root: Path, seed: int) -> Path:
    root.mkdir(parents=True)
    (root / "pytorch_lora_weights.safetensors").write_bytes(bytes([seed % 256]) * 2048)
    return root


def reg(name, tmp_path, seed, score=None, **kw):
    weights = lora(tmp_path / f"l{seed}", seed)
    run = eval_run(score, weights) if score is not None else None
    return register_model(Registration(name, "tiny-flux", weights, kind="lora",
                                       eval_protocol=PROTOCOL, eval_run_id=run, **kw))


def champion(name):
    from mlflow import MlflowClient

    return MlflowClient().get_registered_model(name).aliases.get("champion")


def cli(*args, env=None, timeout=120):
    return subprocess.run([sys.executable, "-m", "chunkgrpo.cli", *args], capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})})


def test_metrics_come_from_the_eval_run_not_from_files_or_tags(services_env, tmp_path):
    """A hand-made metrics file (0.99) or an edited metric tag does not crown a worse
    model."""
    from mlflow import MlflowClient

    name = f"integ-{uuid.uuid4().hex[:6]}"
    v1 = reg(name, tmp_path, 1, 0.5)
    assert promote(name, v1.version).action == "promoted"
    # 2: metrics from a file the registering user wrote, no evaluation run
    v2 = reg(name, tmp_path, 2, None, metrics={METRIC: 0.99})
    with pytest.raises(UserError, match="links no evaluation run"):
        promote(name, v2.version)
    # 4: an evaluated but worse version whose metric tag is edited through the API
    v3 = reg(name, tmp_path, 3, 0.3)
    MlflowClient().set_model_version_tag(name, v3.version, f"metric.{METRIC}", "0.99")
    assert promote(name, v3.version).action == "rejected"
    # and a re-logged value in the evaluation run itself is refused
    MlflowClient().log_metric(v3.tags["eval.run_id"], "hpdv2.hpsv3.trained", 0.99)
    with pytest.raises(UserError, match="logged hpdv2.hpsv3.trained 2 times"):
        promote(name, v3.version)
    # a metrics file that disagrees with its evaluation run is refused at registration
    with pytest.raises(UserError, match="differs from evaluation run"):
        reg(name, tmp_path, 4, 0.3, metrics={METRIC: 0.99})
    assert champion(name) == v1.version


def test_non_finite_and_malformed_metrics_are_refused_at_registration(services_env, tmp_path):
    """NaN, Infinity, non-numeric, a JSON list -> exit 2, one line, nothing
    registered."""
    from mlflow import MlflowClient

    name = f"integ-{uuid.uuid4().hex[:6]}"
    model = lora(tmp_path / "m", 9)
    for i, text in enumerate(['{"eval.hpdv2.hpsv3": NaN}', '{"eval": {"hpdv2.hpsv3": Infinity}}',
                              '{"eval.hpdv2.hpsv3": "high"}', '[0.5, 0.6]']):
        f = tmp_path / f"m{i}.json"
        f.write_text(text)
        r = cli(
            "register", "--model-dir", str(model), "--name", name, "--base-model", "tiny", "--metrics", str(f)
        )
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1 and "Traceback" not in r.stderr, (text, r.stderr)
        assert ("finite" in lines[0] or "JSON object" in lines[0]) and str(f) in lines[0], lines
    assert not MlflowClient().search_registered_models(f"name='{name}'")
    # an evaluation run that logged inf is refused too
    from chunkgrpo.tracking import stage_run

    with stage_run("evaluate", experiment="integrity-eval") as t:  # the tracker itself skips inf: log it raw
        MlflowClient().log_metric(t.run_id, "hpdv2.hpsv3.trained", float("inf"))
    with pytest.raises(UserError, match="non-finite"):
        register_model(Registration(name, "tiny", model, kind="lora", eval_run_id=t.run_id))


def test_gate_change_is_promoter_only_audited_and_not_retroactive(services_env, tmp_path, monkeypatch):
    """Changing the gate needs the promoter identity and a reason; a pending version keeps its gate."""
    from mlflow import MlflowClient

    from chunkgrpo.registry.promotion import promotion_history, set_gate

    name = f"integ-{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "promoter-bot")  # the identity that creates the model
    v1 = reg(name, tmp_path, 1, 0.5)
    assert MlflowClient().get_registered_model(name).tags["promoter"] == "promoter-bot"
    assert promote(name, v1.version).action == "promoted"
    v2 = reg(name, tmp_path, 2, 0.3)   # worse on the gate in force when it was registered
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "pipeline-user")
    with pytest.raises(UserError, match="reserved to its promoter identity 'promoter-bot'"):
        set_gate(name, "eval.hpdv2.other", "max", why="try")
    r = cli("promote", "--model", name, "--set-gate", "eval.hpdv2.other:max", "--why", "x")
    assert r.returncode == 2 and "promoter identity" in r.stderr
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "promoter-bot")
    with pytest.raises(UserError, match="give a reason"):
        set_gate(name, "eval.hpdv2.other", "max")
    set_gate(name, "eval.hpdv2.other", "max", why="new benchmark")
    assert promote(name, v2.version).action == "rejected"  # judged on the gate it was registered under
    last = promotion_history(name)[-1]  # the rejection is counted on the model, not logged
    assert (
        last["action"] == "set_gate" and last["why"] == "new benchmark" and last["identity"] == "promoter-bot"
    )


def test_force_and_rollback_are_promoter_only_and_audited(services_env, tmp_path, monkeypatch):
    """--force/--rollback need the promoter identity and --why; the audit log shows
    who/why/previous."""
    name = f"integ-{uuid.uuid4().hex[:6]}"
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "promoter-bot")
    v1 = reg(name, tmp_path, 1, 0.5)
    promote(name, v1.version)
    v2 = reg(name, tmp_path, 2, 0.3)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "pipeline-user")
    for args in (["--version", v2.version, "--force", "--why", "hotfix"], ["--rollback", "--why", "bad"]):
        r = cli("promote", "--model", name, *args)
        assert r.returncode == 2 and "reserved to its promoter identity" in r.stderr, r.stderr
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "promoter-bot")
    assert cli("promote", "--model", name, "--version", v2.version, "--force").returncode == 2  # no --why
    r = cli(
        "promote", "--model", name, "--version", v2.version, "--force", "--why", "hotfix #12", "--who", "ana"
    )
    assert r.returncode == 0 and "forced by ana (promoter-bot): hotfix #12" in r.stdout, r.stdout + r.stderr
    assert champion(name) == v2.version
    r = cli("promote", "--model", name, "--history")
    forced = [ln for ln in r.stdout.splitlines() if " forced " in ln]
    assert (
        forced
        and "hotfix #12" in forced[0]
        and '"previous": "1"' in forced[0]
        and "(promoter-bot)" in forced[0]
    )


def test_concurrent_promoters_end_with_the_best_champion(services_env, tmp_path):
    """Two promoters at once (0.40 and 0.35 against 0.30): the better one is champion, every trial."""
    for trial in range(3):
        name = f"integ-{uuid.uuid4().hex[:6]}"
        v1 = reg(name, tmp_path / str(trial), 1, 0.30)
        promote(name, v1.version)
        better, worse = reg(name, tmp_path / str(trial), 2, 0.40), reg(name, tmp_path / str(trial), 3, 0.35)
        results, barrier = {}, threading.Barrier(2)

        def go(v):
            barrier.wait()
            results[v] = promote(name, v).action

        threads = [threading.Thread(target=go, args=(v.version,)) for v in (worse, better)]
        [t.start() for t in threads]
        [t.join(120) for t in threads]
        assert champion(name) == better.version, (trial, results)
        assert results[better.version] == "promoted"


def test_replaced_model_code_is_refused_at_load(services_env, tmp_path, monkeypatch):
    """served_model_entry.py replaced in the artifact store -> load_pyfunc refuses, the code never runs
    (and the temp folder it downloaded into, without a `dst`, is removed)."""
    import tempfile

    import mlflow
    from mlflow import MlflowClient

    from chunkgrpo.registry.load import load_pyfunc

    name = f"integ-{uuid.uuid4().hex[:6]}"
    v1 = reg(name, tmp_path, 1, 0.5)
    promote(name, v1.version)
    mv = MlflowClient().get_model_version(name, v1.version)
    assert len(mv.tags["model.tree_sha256"]) == 64
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(tmp_path / "dl")))
    sentinel = tmp_path / "planted-code-ran"
    (local / "served_model_entry.py").write_text(f"open({str(sentinel)!r}, 'w').write('x')\n")
    run_id, path = mv.source.split("/artifacts/", 1)
    MlflowClient().log_artifact(mv.run_id, str(local / "served_model_entry.py"), path.split("/", 1)[-1]
                                if "/" in path else path)
    with pytest.raises(UserError, match="changed since registration"):
        load_pyfunc(f"models:/{name}@champion", tmp_path / "load")
    assert not sentinel.exists()
    fresh = tmp_path / "tmpdir"
    fresh.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(fresh))
    with pytest.raises(UserError, match="changed since registration"):
        load_pyfunc(f"models:/{name}@champion")
    assert not sentinel.exists() and not list(fresh.glob("chunkgrpo-pyfunc-*"))


def test_mlflow_down_or_closed_port_answers_in_one_line_within_seconds(services_env, tmp_path):
    """Promote and register against a closed port: one line naming it, no 250 s of retries."""
    from chunkgrpo.processes import free_port

    url = f"http://127.0.0.1:{free_port()}"
    model = lora(tmp_path / "m", 3)
    for args in (["promote", "--model", "x", "--version", "1"],
                 ["register", "--model-dir", str(model), "--name", "x", "--base-model", "tiny"]):
        t0 = time.monotonic()
        r = cli(*args, env={"MLFLOW_TRACKING_URI": url}, timeout=60)
        took = time.monotonic() - t0
        assert r.returncode == 2 and "unreachable" in r.stderr and "no version" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and took < 30, (took, r.stderr)


def test_a_300_character_model_name_is_refused(services_env, tmp_path):
    r = cli(
        "register", "--model-dir", str(lora(tmp_path / "m", 4)), "--name", "n" * 300, "--base-model", "tiny"
    )
    assert r.returncode == 2 and "300 characters" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_credentials_in_the_tracking_uri_are_never_printed(services_env, tmp_path):
    """An MLFLOW_TRACKING_URI with user:password: nothing chunkgrpo or MLflow prints contains the password."""
    url = services_env.tracking_uri.replace("http://", "http://someone:Pa55-secret@")
    r = cli(
        "register",
        "--model-dir",
        str(lora(tmp_path / "m", 5)),
        "--name",
        f"integ-{uuid.uuid4().hex[:6]}",
        "--base-model",
        "tiny",
        env={"MLFLOW_TRACKING_URI": url},
    )
    assert r.returncode == 0, r.stderr
    assert "View run" in r.stdout + r.stderr  # MLflow's line is printed, without the credentials
    assert "Pa55-secret" not in r.stdout + r.stderr
    r = cli("promote", "--model", "no-such-model-xyz", "--version", "1", env={"MLFLOW_TRACKING_URI": url})
    assert r.returncode == 2 and "Pa55-secret" not in r.stdout + r.stderr


def test_preflight_never_prints_credentials_from_the_uri(monkeypatch):
    """The preflight names the MLflow URI in its problems: without the credentials embedded in it."""
    from chunkgrpo.preflight import _check_mlflow
    from chunkgrpo.processes import free_port

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"http://someone:Pa55-secret@127.0.0.1:{free_port()}")
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    problem = _check_mlflow(3.0)
    assert problem and "Pa55-secret" not in problem and "127.0.0.1" in problem
    assert os.environ["MLFLOW_TRACKING_PASSWORD"] == "Pa55-secret"  # moved where MLflow's client reads it
