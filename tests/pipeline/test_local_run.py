"""End to end with kfp.local (SubprocessRunner, no venv) on the tiny model, against the real local
SeaweedFS + MLflow of the `services` fixture: the full `train_and_evaluate` pipeline (training with
2 torchrun processes), then the `nightly_benchmark` pipeline on the model it promoted."""

import json
import uuid

import pytest

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def model_name():
    return f"pipeline-test-{uuid.uuid4().hex[:8]}"


@pytest.fixture(scope="module")
def trained(services, tmp_path_factory, model_name):
    from pipeline.local import run_local

    home = tmp_path_factory.mktemp("pipeline-home")
    return run_local("train_and_evaluate", {"model_name": model_name}, home=home, services_env=services.env)


def test_train_and_evaluate_end_to_end(trained, services, model_name):
    from mlflow import MlflowClient

    from chunkgrpo.store import ArtifactStore, read_pointer

    t = trained.tasks
    assert {"open-run", "profile", "plan", "train", "evaluate", "register", "check-gate", "promote",
            "close-run"} <= set(t)
    # plan -> train: the planned chunk sizes were trained with
    sizes = t["plan"]["parameters"]["Output"]
    pointer = read_pointer(open(t["train"]["artifacts"]["trained_model"]["uri"]).read())
    assert sizes == "sizes:" + ",".join(map(str, pointer["chunk_sizes"]))
    from pipeline.local import TINY_TRAIN

    assert pointer["optimizer_steps"] == TINY_TRAIN["max_iterations"]  # tiny_cpu: one optimizer step per rollout
    # the model is in S3 as a complete folder artifact with the pointer's digest
    store = ArtifactStore(services.store_config)
    assert store.read_manifest(pointer["uri"]).sha256 == pointer["manifest_sha256"]
    # evaluation: metrics artifact, HTML report, images uploaded
    ev = t["evaluate"]["artifacts"]
    m = ev["metrics"]["metadata"]
    # the demo trains long enough for the trained model to beat the base on its reward
    assert m["hpdv2.brightness.trained"] > m["hpdv2.brightness.base"] + 0.004, m
    assert open(ev["report"]["uri"]).read().lstrip().lower().startswith("<!doctype html")
    assert store.read_manifest(ev["results"]["metadata"]["output_uri"]) is not None
    # registry: the version exists, carries the eval metric, and the gate/promote decision is applied
    client = MlflowClient(services.tracking_uri)
    version = t["register"]["parameters"]["Output"]
    mv = client.get_model_version(model_name, version)
    assert float(mv.tags["metric.eval.hpdv2.brightness"]) == pytest.approx(ev["metrics"]["metadata"]["hpdv2.brightness.trained"])
    assert mv.tags["checkpoint_uri"] == pointer["uri"] and mv.tags["kfp.run_id"]
    assert t["check-gate"]["parameters"]["Output"] is True  # first version: no champion yet
    assert t["promote"]["parameters"]["Output"] == "promoted"
    assert client.get_registered_model(model_name).aliases["champion"] == version
    # MLflow: one parent run, closed by the exit handler, with the stage runs nested under it
    parent = client.get_run(trained.mlflow_run_id)
    assert parent.info.status == "FINISHED" and parent.data.tags["kfp.state"] == "SUCCEEDED"
    children = client.search_runs([parent.info.experiment_id],
                                  filter_string=f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    assert {"train", "evaluate", "register"} <= {r.data.tags.get("chunkgrpo.stage") or r.info.run_name for r in children}
    # the summary names every artifact location
    from pipeline.local import summary_lines

    text = "\n".join(summary_lines(trained))
    for needle in (pointer["uri"], f"models:/{model_name}/{version}", trained.mlflow_run_id, "promoted"):
        assert needle in text


def test_nightly_benchmark_on_the_champion(trained, services, model_name, tmp_path):
    from mlflow import MlflowClient

    from pipeline.local import run_local

    r = run_local("nightly_benchmark", {"model_name": model_name}, home=tmp_path, services_env=services.env)
    t = r.tasks
    assert {"open-run", "evaluate", "check-regression", "close-run"} <= set(t)
    metrics = t["evaluate"]["artifacts"]["metrics"]["metadata"]
    assert {"hpdv2.brightness.trained", "hpdv2.brightness.base"} <= set(metrics)
    # same settings and seeds as at registration -> same score -> no regression
    assert t["check-regression"]["parameters"]["Output"] is False
    client = MlflowClient(services.tracking_uri)
    assert client.get_run(r.mlflow_run_id).data.tags["chunkgrpo.regression"] == "false"
    summary = open(t["check-regression"]["artifacts"]["summary"]["uri"]).read()
    assert "no regression" in summary and f"{model_name}@champion" in summary
    results = json.loads(open(t["evaluate"]["artifacts"]["results"]["uri"]).read())
    assert results["labels"] == ["trained", "base"]
