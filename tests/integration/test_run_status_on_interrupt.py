"""Against the real local MLflow: a run that stops is never left RUNNING. Interrupted (SIGTERM as
`Terminated`, Ctrl-C) it ends KILLED, on an exception FAILED, otherwise FINISHED; for the pipeline's
parent run in this process (`start_pipeline_run`) and a stage run (`stage_run`)."""

from __future__ import annotations

import contextlib
import uuid

import pytest

from chunkgrpo.errors import Terminated

pytestmark = pytest.mark.integration


def _status(run_id: str) -> str:
    from mlflow import MlflowClient

    return MlflowClient().get_run(run_id).info.status


@pytest.mark.parametrize("raised, status", [
    (Terminated(15), "KILLED"),
    (KeyboardInterrupt(), "KILLED"),
    (OSError(28, "No space left on device"), "FAILED"),
    (None, "FINISHED"),
], ids=["sigterm", "ctrl-c", "disk-full", "finished"])
@pytest.mark.parametrize("opener", ["pipeline", "stage"])
def test_a_stopped_run_ends_with_its_cause(services_env, opener, raised, status):
    from chunkgrpo.tracking import stage_run, start_pipeline_run

    experiment = f"interrupt-{uuid.uuid4().hex[:6]}"
    run = (start_pipeline_run(experiment, "p") if opener == "pipeline"
           else stage_run("train", experiment=experiment))
    seen = {}
    with pytest.raises(type(raised)) if raised is not None else contextlib.nullcontext():
        with run as tracker:
            seen["id"] = tracker.run_id
            assert _status(tracker.run_id) == "RUNNING"
            if raised is not None:
                raise raised
    assert _status(seen["id"]) == status

