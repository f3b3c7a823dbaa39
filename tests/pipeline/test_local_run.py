"""README's main job, run as a user runs it: in a copy of the repository (`git archive`) in a temporary
folder with nothing beside it, with the command line written in README.md (on free ports). It must end
SUCCEEDED with a promoted model; then the nightly benchmark runs on that champion.

The real `train_and_evaluate` pipeline under kfp.local (SubprocessRunner), 2 torchrun processes,
local SeaweedFS + MLflow started by the command itself; the clone's `.venv` reuses this environment's
third-party packages but has the clone's own chunkgrpo installed (`tests/repo_copy.py`)."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from tests.repo_copy import ROOT, export_repo, overlay_venv

pytestmark = pytest.mark.integration


def readme_command(heading: str) -> str:
    readme = (ROOT / "README.md").read_text()
    block = readme[readme.index(heading):]
    return re.search(r"```bash\n(.+?)\n```", block, re.S).group(1).strip()


def _clean_env() -> dict:
    """The environment of a user's shell: none of this test session's service or data settings."""
    drop = ("CHUNKGRPO_", "MLFLOW_", "AWS_", "PYTHONPATH", "VIRTUAL_ENV", "KFP_")
    env = {k: v for k, v in os.environ.items() if not k.startswith(drop)}
    return {**env, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}


@pytest.fixture(scope="module")
def clone_run(tmp_path_factory):
    from chunkgrpo.local_services import LocalServices, LocalServicesConfig, free_ports

    clone = export_repo(tmp_path_factory.mktemp("user"))
    assert not (clone.parent / "shared").exists() and not (clone / "data").exists()
    overlay_venv(clone)
    main_job = readme_command("**Set up and run the main job**")
    assert "pipeline run --local" in main_job, f"README's main job changed shape: {main_job!r}"
    s3, mlflow = free_ports(2)
    ports = f"--s3-port {s3} --mlflow-port {mlflow}"
    r = subprocess.run(["bash", "-c", f"{main_job} {ports} --keep-services"], cwd=clone, env=_clean_env(),
                       capture_output=True, text=True, timeout=1800)
    svc = LocalServices(LocalServicesConfig(home=str(clone / ".chunkgrpo" / "local"), s3_port=s3, mlflow_port=mlflow))
    try:
        yield {"clone": clone, "result": r, "ports": ports, "services": svc}
    finally:
        svc.down()


def _run_dir(clone: Path, stdout: str) -> Path:
    m = re.search(r"kfp run dir\s+(\S+)", stdout)
    assert m, stdout[-3000:]
    return clone / m.group(1)


def test_main_job_from_a_clone_succeeds_and_promotes(clone_run):
    from mlflow import MlflowClient

    from chunkgrpo.store import ArtifactStore, read_pointer
    from pipeline.local import TINY_TRAIN, read_task_outputs

    clone, r = clone_run["clone"], clone_run["result"]
    assert r.returncode == 0, (r.stdout[-4000:], r.stderr[-4000:])
    assert "setup: .venv up to date" in r.stdout  # README's set-up step ran and found the clone's venv
    assert re.search(r"train_and_evaluate: SUCCEEDED", r.stdout), r.stdout[-3000:]
    t = read_task_outputs(_run_dir(clone, r.stdout))
    assert {"open-run", "profile", "plan", "train", "evaluate", "register", "check-gate", "promote",
            "close-run"} <= set(t)
    env = clone_run["services"].env()
    client = MlflowClient(env["MLFLOW_TRACKING_URI"])
    # a promoted model: the registered version carries the champion alias
    registered = t["register"]["artifacts"]["registered"]["metadata"]["uri"]
    name, version = re.fullmatch(r"models:/(.+)/(\d+)", registered).groups()
    assert t["promote"]["parameters"]["Output"] == "promoted"
    assert client.get_registered_model(name).aliases["champion"] == version
    # plan -> train: the planned chunk sizes were trained with, for the configured number of steps
    sizes = t["plan"]["parameters"]["Output"]
    pointer = read_pointer(Path(t["train"]["artifacts"]["trained_model"]["uri"]).read_text())
    assert sizes == "sizes:" + ",".join(map(str, pointer["chunk_sizes"]))
    assert pointer["optimizer_steps"] == TINY_TRAIN["max_iterations"]  # tiny_cpu: one optimizer step per rollout
    # the model is in S3 as a complete folder artifact with the pointer's digest
    store = ArtifactStore(clone_run["services"].store_config())
    assert store.read_manifest(pointer["uri"]).sha256 == pointer["manifest_sha256"]
    # evaluation ran on the HPDv2 prompts shipped inside the package (there is no other copy here)
    ev = t["evaluate"]["artifacts"]
    results = json.loads(Path(ev["results"]["uri"]).read_text())
    assert results["benchmarks"]["hpdv2"]["official_prompts"] is True
    assert Path(ev["report"]["uri"]).read_text().lstrip().lower().startswith("<!doctype html")
    assert store.read_manifest(ev["results"]["metadata"]["output_uri"]) is not None
    # the demo trains long enough for the trained model to beat the base on the gate metric
    metric = TINY_TRAIN["gate_metric"].removeprefix("eval.")
    m = ev["metrics"]["metadata"]
    sign = 1 if TINY_TRAIN["gate_direction"] == "max" else -1
    assert sign * (m[f"{metric}.trained"] - m[f"{metric}.base"]) > 0.004, m
    mv = client.get_model_version(name, version)
    assert float(mv.tags[f"metric.{TINY_TRAIN['gate_metric']}"]) == pytest.approx(m[f"{metric}.trained"])
    assert mv.tags["checkpoint_uri"] == pointer["uri"] and mv.tags["kfp.run_id"]
    # MLflow: one parent run, closed by the exit handler, with the stage runs nested under it
    parent_id = t["open-run"]["parameters"]["Output"]
    parent = client.get_run(parent_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["kfp.state"] == "SUCCEEDED"
    children = client.search_runs([parent.info.experiment_id], filter_string=f"tags.mlflow.parentRunId = '{parent_id}'")
    assert {"train", "evaluate", "register"} <= {c.data.tags.get("chunkgrpo.stage") or c.info.run_name for c in children}
    # the summary names every artifact location and the full log
    for needle in (pointer["uri"], f"models:/{name}/{version}", parent_id, "promoted", "full log"):
        assert needle in r.stdout
    log = re.search(r"full log\s+(\S+)", r.stdout).group(1)
    assert (clone / log).is_file() and "Executing task" in (clone / log).read_text()


def test_nightly_benchmark_on_the_champion(clone_run):
    from mlflow import MlflowClient

    from pipeline.local import TINY_NIGHTLY, read_task_outputs

    clone = clone_run["clone"]
    if clone_run["result"].returncode != 0:
        pytest.skip("the main job failed (reported by test_main_job_from_a_clone_succeeds_and_promotes)")
    r = subprocess.run(["bash", "-c", f".venv/bin/chunkgrpo pipeline run --local --pipeline nightly_benchmark "
                                      f"{clone_run['ports']}"],
                       cwd=clone, env=_clean_env(), capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, (r.stdout[-4000:], r.stderr[-4000:])
    t = read_task_outputs(_run_dir(clone, r.stdout))
    assert {"open-run", "evaluate", "check-regression", "close-run"} <= set(t)
    metric = TINY_NIGHTLY["regression_metric"]
    metrics = t["evaluate"]["artifacts"]["metrics"]["metadata"]
    assert {f"{metric}.trained", f"{metric}.base"} <= set(metrics)
    # same settings and seeds as at registration -> same score -> no regression
    assert t["check-regression"]["parameters"]["Output"] is False
    client = MlflowClient(clone_run["services"].env()["MLFLOW_TRACKING_URI"])
    assert client.get_run(t["open-run"]["parameters"]["Output"]).data.tags["chunkgrpo.regression"] == "false"
    summary = Path(t["check-regression"]["artifacts"]["summary"]["uri"]).read_text()
    assert "no regression" in summary and f"{TINY_NIGHTLY['model_name']}@champion" in summary
    results = json.loads(Path(t["evaluate"]["artifacts"]["results"]["uri"]).read_text())
    assert results["labels"] == ["trained", "base"]
