"""A local run's temp folder (pipeline/local_run.py `run_tmpdir`): the run's TMPDIR, for this process and
the tasks it starts, removed with what they left in it when the run ends, on failure too. (The whole main
job's leftovers: tests/pipeline/test_local_run.py.)"""

import os
import tempfile

import pytest

from pipeline.local_run import run_tmpdir


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
