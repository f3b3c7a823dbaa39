"""MLflow with the basic-auth app, as manifests/base/mlflow runs it: a real `mlflow server --app-name
basic-auth` on 127.0.0.1 (sqlite tracking + auth DB, admin credentials from the environment as the
Deployment takes them from Secret `mlflow-auth`). An unauthenticated request to move an alias is
refused, so is a read-only user's. The server-side gate: pipeline users hold READ on the registered model
(MLflow lets EDIT move any alias), only the promoter identity moves `champion`, through the promoter
service (`chunkgrpo.promoter`), which runs the gate."""

from __future__ import annotations

import contextlib
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

import pytest

from chunkgrpo.registry.client import version_details
from tests.registry_helpers import eval_run

pytestmark = pytest.mark.integration
ADMIN, ADMIN_PW = "chunkgrpo-admin", "s3cret-" + uuid.uuid4().hex[:12]


# The one difference from the Deployment: the server hashes passwords with PBKDF2-SHA256 at 1,000 rounds
# instead of werkzeug's default scrypt. MLflow checks the password of every request against its stored
# hash (`check_password_hash`, the method read from the hash), and scrypt cost 0.54 s of CPU per request
# on a 2-core machine: most of this module's time. Wrong and missing passwords are refused the same way.
CHEAP_HASH = """import werkzeug.security as _security

_generate = _security.generate_password_hash


def generate_password_hash(password, method="pbkdf2:sha256:1000", salt_length=16):
    return _generate(password, method=method, salt_length=salt_length)


_security.generate_password_hash = generate_password_hash
"""


@pytest.fixture(scope="module")
def auth_server(tmp_path_factory):
    from chunkgrpo.processes import free_port

    home = tmp_path_factory.mktemp("mlflow-auth")
    (home / "site").mkdir()
    (home / "site" / "sitecustomize.py").write_text(CHEAP_HASH)  # before mlflow imports werkzeug's function
    ini = home / "basic_auth.ini"
    ini.write_text(
        "[mlflow]\ndefault_permission = READ\n"  # what the render-auth-config init container writes
        f"database_uri = sqlite:///{home / 'auth.db'}\n"
        "authorization_function = mlflow.server.auth:authenticate_request_basic_auth\n"
        "grant_default_workspace_access = false\n"
    )
    port = free_port()
    env = {**os.environ, "MLFLOW_AUTH_CONFIG_PATH": str(ini), "MLFLOW_AUTH_ADMIN_USERNAME": ADMIN,
           "MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN_PW, "MLFLOW_FLASK_SERVER_SECRET_KEY": uuid.uuid4().hex,
           "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false", "MLFLOW_DISABLE_TELEMETRY": "true",
           "PYTHONPATH": os.pathsep.join(filter(None, [str(home / "site"), os.environ.get("PYTHONPATH")]))}
    env.pop("MLFLOW_TRACKING_USERNAME", None)
    env.pop("MLFLOW_TRACKING_PASSWORD", None)
    log = open(home / "mlflow.log", "w")
    proc = subprocess.Popen(
        [
            str(Path(sys.executable).parent / "mlflow"),
            "server",
            "--app-name",
            "basic-auth",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--workers",
            "1",
            "--backend-store-uri",
            f"sqlite:///{home / 'mlflow.db'}",
            "--artifacts-destination",
            str(home / "artifacts"),
            "--serve-artifacts",
        ],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, OSError):
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(
                    f"mlflow basic-auth server did not start:\n{(home / 'mlflow.log').read_text()[-3000:]}"
                )
            time.sleep(0.5)
        import sqlite3

        with contextlib.closing(sqlite3.connect(home / "auth.db")) as db:
            (stored,) = db.execute("SELECT password_hash FROM users WHERE username = ?", (ADMIN,)).fetchone()
        assert stored.startswith("pbkdf2:sha256:1000$"), stored[:20]  # the server took the cheap hash
        yield url
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        log.close()


def _post(url: str, path: str, body: dict, auth: tuple[str, str] | None = None) -> int:
    req = urllib.request.Request(f"{url}{path}", data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    if auth:
        req.add_header("Authorization", "Basic " + b64encode(f"{auth[0]}:{auth[1]}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def _as(monkeypatch, url: str, user: str, password: str) -> None:
    monkeypatch.setenv("MLFLOW_TRACKING_URI", url)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", user)
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", password)


def test_alias_moves_need_credentials_and_permission(auth_server, monkeypatch, tmp_path):
    from mlflow import MlflowClient
    from mlflow.server.auth.client import AuthServiceClient

    from chunkgrpo.registry.promotion import promote
    from chunkgrpo.registry.registration import Registration, register_model

    url = auth_server
    name = f"flux-auth-{uuid.uuid4().hex[:6]}"
    _as(monkeypatch, url, ADMIN, ADMIN_PW)
    lora = tmp_path / "lora"
    lora.mkdir()
    (lora / "pytorch_lora_weights.safetensors").write_bytes(b"\x01" * 2048)
    protocol = {"preset": "eval_tiny", "seed": 42}
    run = eval_run({"hpdv2.hpsv3.trained": 0.3}, weights=lora)
    rv = register_model(Registration(name, "tiny-flux", lora, kind="lora", metrics={"eval.hpdv2.hpsv3": 0.3},
                                     eval_protocol=protocol, eval_run_id=run), experiment="auth-test")
    assert promote(name, rv.version, who="admin").action == "promoted"

    body = {"name": name, "alias": "champion", "version": rv.version}
    # 1. no credentials at all: refused before anything happens
    assert _post(url, "/api/2.0/mlflow/registered-models/alias", body) == 401
    # 2. wrong password
    assert _post(url, "/api/2.0/mlflow/registered-models/alias", body, (ADMIN, "wrong")) == 401
    # 3. a valid user with the default READ permission may look but not move aliases
    reader_pw = "r-" + uuid.uuid4().hex[:12]
    AuthServiceClient(url).create_user("reader", reader_pw)
    assert _post(url, "/api/2.0/mlflow/registered-models/alias", body, ("reader", reader_pw)) == 403
    _as(monkeypatch, url, "reader", reader_pw)
    with pytest.raises(Exception, match="(?i)permission|403"):
        MlflowClient().set_registered_model_alias(name, "champion", rv.version)
    assert MlflowClient().get_registered_model(name).aliases == {
        "champion": rv.version,
        "challenger": rv.version,
    }
    # 4. the admin (or a user granted MANAGE) can
    assert _post(url, "/api/2.0/mlflow/registered-models/alias", body, (ADMIN, ADMIN_PW)) == 200
    # health stays unauthenticated (the Deployment's probes)
    with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
        assert r.status == 200


def test_pipeline_users_cannot_move_champion_but_the_promoter_service_gates_for_them(auth_server, monkeypatch,
                                                                                     tmp_path):
    """A pipeline user's direct `set_registered_model_alias` is refused by the server (403), while
    `chunkgrpo promote` through the promoter service promotes a better version and rejects a worse one;
    --force and --set-gate stay the promoter identity's."""
    from mlflow import MlflowClient
    from mlflow.server.auth.client import AuthServiceClient

    from chunkgrpo.processes import free_port
    from chunkgrpo.registry.registration import Registration, register_model

    url = auth_server
    _as(monkeypatch, url, ADMIN, ADMIN_PW)
    users = AuthServiceClient(url)
    promoter_pw, pipe_pw = "p-" + uuid.uuid4().hex[:12], "q-" + uuid.uuid4().hex[:12]
    promoter, pipe = f"promoter-{uuid.uuid4().hex[:4]}", f"pipeline-{uuid.uuid4().hex[:4]}"
    users.create_user(promoter, promoter_pw)
    users.create_user(pipe, pipe_pw)
    other_pw = "o-" + uuid.uuid4().hex[:12]
    users.create_user(f"other-{pipe}", other_pw)  # a second pipeline user
    # the pipeline evaluates (its own experiment, its own runs) ...
    _as(monkeypatch, url, pipe, pipe_pw)
    dirs = []
    for i in range(2):
        d = tmp_path / f"lora{i}"
        d.mkdir()
        (d / "pytorch_lora_weights.safetensors").write_bytes(bytes([i + 1]) * 1024)
        dirs.append(d)
    good = eval_run({"hpdv2.hpsv3.trained": 0.5}, experiment=f"pipe-eval-{pipe}", weights=dirs[0])
    worse = eval_run({"hpdv2.hpsv3.trained": 0.3}, experiment=f"pipe-eval-{pipe}", weights=dirs[1])
    name = f"flux-gate-{uuid.uuid4().hex[:6]}"
    port = free_port()
    env = {**os.environ, "MLFLOW_TRACKING_URI": url, "MLFLOW_TRACKING_USERNAME": promoter,
           "MLFLOW_TRACKING_PASSWORD": promoter_pw, "MLFLOW_DISABLE_TELEMETRY": "true"}
    service = subprocess.Popen(
        [sys.executable, "-m", "chunkgrpo.promoter", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        promoter_url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                with urllib.request.urlopen(f"{promoter_url}/health", timeout=2):
                    break
            except (urllib.error.URLError, OSError):
                assert service.poll() is None and time.monotonic() < deadline, "promoter did not start"
                time.sleep(0.3)
        # the pipeline registers through the promoter: it logs the MLflow model in its own run, the
        # promoter identity creates the registered model (MANAGE as its creator) and the versions
        monkeypatch.setenv("CHUNKGRPO_PROMOTER_URL", promoter_url)
        versions = []
        for d, run in zip(dirs, (good, worse)):
            rv = register_model(
                Registration(
                    name,
                    "tiny-flux",
                    d,
                    kind="lora",
                    eval_run_id=run,
                    eval_protocol={"preset": "eval_tiny"},
                    tags={"metric.eval.hpdv2.hpsv3": "0.99", "eval.run_id": good},
                ),  # ignored
                experiment=f"reg-{pipe}",
            )
            versions.append(rv.version)
        monkeypatch.delenv("CHUNKGRPO_PROMOTER_URL")
        v_good, v_worse = versions
        tags = MlflowClient().get_model_version(name, v_worse).tags
        assert tags["eval.run_id"] == worse and float(tags["metric.eval.hpdv2.hpsv3"]) == 0.3
        # the promoter adds the caller it authenticated to the short set
        assert tags["registered_by"] == pipe and len(tags["model.tree_sha256"]) == 64
        assert len(tags) <= 10, sorted(tags)
        details = version_details(MlflowClient(), MlflowClient().get_model_version(name, v_worse))
        assert details["tags"]["eval.run_id"] == good  # a caller's tags stay descriptive, in the details
        assert MlflowClient().get_registered_model(name).tags["promoter"] == promoter
        with pytest.raises(Exception, match="(?i)permission|403"):  # no version creation around the promoter
            MlflowClient().create_model_version(
                name,
                source=MlflowClient().get_model_version(name, v_good).source,
                run_id=MlflowClient().get_model_version(name, v_good).run_id,
            )
        # the pipeline user: may read, may not move champion itself (the server says no)
        _as(monkeypatch, url, pipe, pipe_pw)
        with pytest.raises(Exception, match="(?i)permission|403"):
            MlflowClient().set_registered_model_alias(name, "champion", v_worse)
        with pytest.raises(Exception, match="(?i)permission|403"):
            MlflowClient().set_model_version_tag(name, v_worse, "eval.run_id", good)
        assert "champion" not in MlflowClient().get_registered_model(name).aliases
        # another pipeline user may read pipe's run but not make a version of it (it may not write to it)
        mv_good = MlflowClient().get_model_version(name, v_good)
        body = {"name": name + "-copy", "source": mv_good.source, "run_id": mv_good.run_id}
        assert _post(promoter_url, "/versions", body, (f"other-{pipe}", other_pw)) == 403
        # unauthenticated or wrong credentials at the promoter: refused
        assert _post(promoter_url, "/promote", {"name": name, "version": v_worse}) == 403
        assert _post(promoter_url, "/promote", {"name": name, "version": v_worse}, (pipe, "wrong")) == 403

        def promote_cli(*args):
            return subprocess.run([sys.executable, "-m", "chunkgrpo.cli", "promote", "--model", name, *args],
                                  capture_output=True, text=True, timeout=120,
                                  env={**os.environ, "CHUNKGRPO_PROMOTER_URL": promoter_url})

        r = promote_cli("--version", v_good, "--why", "nightly")
        assert r.returncode == 0 and "promoted" in r.stdout, r.stdout + r.stderr
        r = promote_cli("--version", v_worse, "--why", "try")
        assert r.returncode == 0 and "rejected" in r.stdout, r.stdout + r.stderr
        for args in (["--version", v_worse, "--force", "--why", "x"], ["--rollback", "--why", "x"],
                     ["--set-gate", "eval.other:max", "--why", "x"]):
            r = promote_cli(*args)
            assert r.returncode == 2 and "promoter identity" in r.stderr, (args, r.stderr)
        mv = MlflowClient().get_model_version(name, v_good)
        assert MlflowClient().get_registered_model(name).aliases["champion"] == v_good
        record = json.loads(mv.tags["promotion.record"])
        assert record["by"] == pipe and record["identity"] == promoter
        assert len(mv.tags) <= 13, sorted(mv.tags)  # the short set, the caller's identity, the decision
    finally:
        os.killpg(service.pid, signal.SIGTERM)
        service.wait(timeout=30)
