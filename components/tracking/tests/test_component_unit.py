"""open_run / close_run: python_func without MLflow (tracking off) and the orphan cleanup path."""

import types

from components.tracking.component import close_run, open_run


def test_open_run_is_a_noop_without_tracking(monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    assert open_run.python_func(experiment="e", run_name="r", kfp_run_id="k", pipeline="p") == ""


def test_close_run_deletes_the_runs_active_jobs(monkeypatch):
    """The exit handler after the launcher step was killed: the still-running TrainJob goes."""
    from chunkgrpo.k8s import launcher
    from tests.pipeline.trainjob_fakes import FakeApi, job

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    api = FakeApi()
    orphan = job()  # labelled with tests.pipeline.test_trainjob.RUN_ID
    launcher.submit_or_attach(api, orphan)
    monkeypatch.setattr(launcher, "load_api", lambda: api)
    status = types.SimpleNamespace(state="FAILED", error_message="pod evicted")
    from tests.pipeline.trainjob_fakes import RUN_ID

    close_run.python_func(
        experiment="e", kfp_run_id=RUN_ID, status=status, cleanup_jobs=True, job_namespace="kubeflow"
    )
    assert api.objects == {}
    launcher.submit_or_attach(api, orphan)
    close_run.python_func(experiment="e", kfp_run_id=RUN_ID, status=status)  # cleanup_jobs=False: untouched
    assert len(api.objects) == 1
