"""open_run / close_run under kfp.local against the local MLflow: idempotent parent run, closed by the
exit handler with the KFP state."""

import uuid

import pytest
from kfp import dsl

from components.tracking.component import close_run, open_run

pytestmark = pytest.mark.integration


def test_parent_run_opened_once_and_closed_by_the_exit_handler(local_runner):
    from mlflow import MlflowClient

    exp, kfp_id = f"comp-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    first = open_run(experiment=exp, run_name="r", kfp_run_id=kfp_id, pipeline="p").output
    again = open_run(experiment=exp, run_name="r", kfp_run_id=kfp_id, pipeline="p").output  # a retry
    assert first and first == again

    @dsl.pipeline(name="close-local")
    def p(experiment: str, run_id: str):
        with dsl.ExitHandler(close_run(experiment=experiment, kfp_run_id=run_id)):
            open_run(experiment=experiment, run_name="r", kfp_run_id=run_id, pipeline="p")

    p(experiment=exp, run_id=kfp_id)
    run = MlflowClient().get_run(first)
    assert run.info.status == "FINISHED" and run.data.tags["kfp.state"].endswith("SUCCEEDED")
