"""A local run's temp folder (pipeline/local_run.py `run_tmpdir`, `point_tmpdir`): the run's TMPDIR, for this
process and every task, removed with what the tasks left in it when the run ends, on failure too.
(The whole main job's leftovers: tests/pipeline/test_local_run.py.)"""

import os
import tempfile

import pytest

from pipeline.local_run import point_tmpdir, run_tmpdir


@pytest.mark.parametrize("fail", [False, True], ids=["success", "failure"])
def test_the_runs_temp_folder_is_its_tmpdir_then_removed(fail, tmp_path, monkeypatch):
    outer = tmp_path / "outer"
    outer.mkdir()
    monkeypatch.setenv("TMPDIR", str(outer))
    monkeypatch.setattr(tempfile, "tempdir", str(outer))
    home = tmp_path / "home"
    (home / "pod-volumes" / "cache").mkdir(parents=True)
    (home / "pod-volumes" / "cache" / "model.bin").write_text("kept between runs")
    try:
        with run_tmpdir(home) as tmp:
            assert tmp.parent == home / "pod-volumes" and os.environ["TMPDIR"] == str(tmp)
            assert tempfile.gettempdir() == str(tmp)
            (tmp / "tmp.abc123").mkdir()  # what a task leaves: kfp's folder of the task's program
            (tmp / "tmp.abc123" / "ephemeral_component.py").write_text("")
            if fail:
                raise KeyboardInterrupt("signal 15")
    except KeyboardInterrupt:
        assert fail
    assert not tmp.exists() and os.environ["TMPDIR"] == str(outer) and tempfile.gettempdir() == str(outer)
    assert sorted(p.name for p in (home / "pod-volumes").iterdir()) == ["cache"]
    assert (home / "pod-volumes" / "cache" / "model.bin").exists() and list(outer.iterdir()) == []


def test_every_tasks_tmpdir_points_at_the_runs_folder(tmp_path):
    """The compiled pipeline's TMPDIR (the pod's /cache volume) of every task that sets one."""
    from pipeline.compile import pipeline_func
    from pipeline.pod_faithful import layout_for, map_volumes

    func, _ = pipeline_func("train_and_evaluate", pool="cpu", trainer="torchrun")
    map_volumes(func, layout_for("train_and_evaluate", func, tmp_path, faithful=False, model_dir=None))
    executors = func.pipeline_spec.deployment_spec["executors"]
    envs = [{e["name"]: e["value"] for e in executors[k]["container"]["env"]}
            for k in executors.keys() if "env" in executors[k]["container"]]
    with_tmpdir = [env for env in envs if "TMPDIR" in env]
    shared = str(tmp_path / "pod-volumes" / "cache")
    assert with_tmpdir and all(env["TMPDIR"] == shared for env in with_tmpdir)
    assert point_tmpdir(func, tmp_path / "run-tmp") == len(with_tmpdir)
    envs = [{e["name"]: e["value"] for e in executors[k]["container"]["env"]}
            for k in executors.keys() if "env" in executors[k]["container"]]
    assert all(env["TMPDIR"] == str(tmp_path / "run-tmp") for env in envs if "TMPDIR" in env)
    # the cache on the same volume stays the shared folder: kept between runs
    assert {env["CHUNKGRPO_CACHE"] for env in envs if "CHUNKGRPO_CACHE" in env} == {
        str(tmp_path / "pod-volumes" / "cache" / "chunkgrpo")}
