"""Every step removes the scratch it made in $TMPDIR once its outputs are uploaded or copied out, on failure
too, and nothing else there: each step runs with TMPDIR pointed at a fresh folder that already holds a file
of someone else's, and afterwards that file is all the folder holds. (Torchrun, S3, MLflow and the
evaluation/ablation engines are stubbed; their own tests run them.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import types
from contextlib import contextmanager
from pathlib import Path

import pytest

from chunkgrpo.errors import UserError
from chunkgrpo.stages.task import local_file
from chunkgrpo.tempdirs import scratch
from components.conftest import FakeArtifact, tiny_profile

THEIRS = "someone-elses.txt"


@pytest.fixture
def tmpdir_(tmp_path, monkeypatch) -> Path:
    """A fresh TMPDIR (env and `tempfile.tempdir`) holding one file no step made."""
    folder = tmp_path / "TMPDIR"
    folder.mkdir()
    (folder / THEIRS).write_text("not ours to delete\n")
    monkeypatch.setenv("TMPDIR", str(folder))
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


def left(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_scratch_is_removed_on_success_and_on_failure(tmpdir_):
    with scratch("chunkgrpo-x-") as a:
        (a / "sub").mkdir()
        (a / "sub" / "f").write_text("x")
        assert a.parent == tmpdir_ and a.name.startswith("chunkgrpo-x-")
    with pytest.raises(KeyError), scratch("chunkgrpo-x-") as b:
        (b / "f").write_text("x")
        raise KeyError("boom")
    assert not a.exists() and not b.exists() and left(tmpdir_) == [THEIRS]


class FakeStore:
    """ArtifactStore stand-in: uploads recorded (with the files' bytes), downloads written."""

    uploads: list = []

    def __init__(self, *a, **k):
        pass

    def get_file(self, uri, dst):
        Path(dst).write_text("a cat\na dog\n")

    def read_manifest(self, uri):
        return None

    def put_folder(self, local, uri, meta=None):
        FakeStore.uploads.append((uri, sorted(p.name for p in Path(local).iterdir())))
        return types.SimpleNamespace(sha256="d" * 64, total_bytes=10)

    def put_file(self, local, uri):
        FakeStore.uploads.append((uri, Path(local).read_text()[:1]))


@pytest.fixture
def store(monkeypatch):
    import chunkgrpo.store.client as client

    FakeStore.uploads = []
    monkeypatch.setattr(client, "ArtifactStore", FakeStore)
    return FakeStore


def _train_request():
    from chunkgrpo.stages.train import TrainRequest

    return TrainRequest(model="s3://bkt/models/flux", prompts="s3://bkt/data/prompts.txt", preset="tiny_cpu",
                        method="chunk", chunks="sizes:2,2", max_iterations=1, artifact_root="s3://bkt/runs",
                        run_id="r1")


def _fake_torchrun(seen: dict, fail: bool = False):
    def run(cmd, *a, **k):
        out = Path(next(x for x in cmd if x.startswith("output_dir=")).split("=", 1)[1])
        seen["prompts"] = Path(next(x for x in cmd if x.startswith("prompts=")).split("=", 1)[1])
        seen["out"] = out
        (out / "final").mkdir(parents=True)
        (out / "checkpoints" / "step-1").mkdir(parents=True)
        (out / "checkpoints" / "step-1" / "state.pt").write_bytes(b"\0" * 1024)
        if fail:
            raise RuntimeError("torchrun exited with status 3")
        (out / "final" / "chunkgrpo_model.json").write_text(json.dumps({"kind": "lora"}))
        (out / "train_summary.json").write_text(json.dumps({
            "chunk_sizes": [2, 2], "optimizer_steps": 1, "config_hash": "c",
            "history": [{"reward_mean": 0.1, "loss": 1.0}]}))
    return run


def test_train_removes_its_output_folder_once_uploaded(tmpdir_, store, monkeypatch):
    import chunkgrpo.torchrun as torchrun
    from chunkgrpo.stages.train import train

    seen = {}
    monkeypatch.setattr(torchrun, "run_torchrun", _fake_torchrun(seen))
    model = train(_train_request(), 2)
    assert model.pointer["uri"] == "s3://bkt/runs/r1/train/final"
    assert store.uploads[0] == ("s3://bkt/runs/r1/train/final", ["chunkgrpo_model.json"])  # uploaded first
    # the S3 prompt file was downloaded into the step's scratch folder, the outputs written there
    assert seen["prompts"].parent == seen["out"].parent and seen["out"].parent.parent == tmpdir_
    assert left(tmpdir_) == [THEIRS]


def test_a_failed_training_removes_its_output_folder_too(tmpdir_, store, monkeypatch):
    import chunkgrpo.torchrun as torchrun
    from chunkgrpo.stages.train import train

    seen = {}
    monkeypatch.setattr(torchrun, "run_torchrun", _fake_torchrun(seen, fail=True))
    with pytest.raises(RuntimeError, match="status 3"):
        train(_train_request(), 2)
    assert seen["out"].parent.parent == tmpdir_ and left(tmpdir_) == [THEIRS]


def _fake_evaluation(monkeypatch, fail: bool = False):
    import chunkgrpo.eval.runner as runner

    def run(cfg):
        Path(cfg.output_dir).mkdir(parents=True)
        (Path(cfg.output_dir) / "report.html").write_text("<!DOCTYPE html>")
        (Path(cfg.output_dir) / "images").mkdir()
        if fail:
            raise UserError("the scorer is missing")
        return {"metrics": {"geneval.overall.trained": 0.3}, "base_model": cfg.base_model,
                "mlflow_run_id": ""}

    monkeypatch.setattr(runner, "run_evaluation", run)
    monkeypatch.setattr(runner, "summary_lines", lambda r: [])


def test_evaluate_result_owns_its_scratch_folder(tmpdir_, monkeypatch, tmp_path):
    from chunkgrpo.stages.evaluate import EvalRequest, evaluate

    _fake_evaluation(monkeypatch)
    pointer = tmp_path / "pointer.json"  # the trained model's pointer: an input, not the step's to remove
    pointer.write_text("{}")
    req = EvalRequest(preset="eval_tiny", base_model="s3://bkt/models/flux", model_pointer=str(pointer),
                      artifact_root="s3://bkt/runs", run_id="r1")
    with evaluate(req) as ev:
        assert ev.report.read_text() == "<!DOCTYPE html>" and ev.scratch.parent == tmpdir_
    assert not ev.scratch.exists() and left(tmpdir_) == [THEIRS] and pointer.exists()
    assert ev.metrics == {"geneval.overall.trained": 0.3}  # the results outlive the files


def test_a_failed_evaluation_removes_its_scratch_folder(tmpdir_, monkeypatch):
    from chunkgrpo.stages.evaluate import EvalRequest, evaluate

    _fake_evaluation(monkeypatch, fail=True)
    req = EvalRequest(preset="eval_tiny", base_model="s3://bkt/models/flux", artifact_root="s3://bkt/runs",
                      run_id="r1")
    with pytest.raises(UserError, match="scorer is missing"):
        evaluate(req)
    assert left(tmpdir_) == [THEIRS]


def _fake_ablation(monkeypatch, fail: bool = False):
    import chunkgrpo.toy.ablation as ablation
    from chunkgrpo import tracking

    def run_series(cfg, root, seeds):
        out = Path(cfg.out)
        (out / "runs").mkdir()
        (out / "ablation.md").write_text("| comparison |\n")
        if fail:
            raise RuntimeError("a run diverged")
        (out / "ablation.json").write_text("{}")
        return {"methods": {}, "paired": [], "primary": {},
                "series": {"uri": f"{root}/k", "seeds": [0], "seeds_added": [0]}}

    @contextmanager
    def stage_run(name, parent_run_id=None, params=None, **kw):
        yield types.SimpleNamespace(log_metrics=lambda m: None, log_artifact=lambda p: None)

    monkeypatch.setattr(ablation, "run_series", run_series)
    monkeypatch.setattr(tracking, "stage_run", stage_run)


@pytest.mark.parametrize("fail", [False, True], ids=["success", "failure"])
def test_ablation_results_folder_is_removed(fail, tmpdir_, store, monkeypatch, tmp_path):
    from chunkgrpo.stages.ablation import AblationRequest, ablation

    _fake_ablation(monkeypatch, fail)
    model = tmp_path / "toy"
    model.mkdir()
    (model / "model_index.json").write_text("{}")
    req = AblationRequest(model=str(model), artifact_root="s3://bkt/nightly", run_id="r7")
    if fail:
        with pytest.raises(RuntimeError, match="diverged"):
            ablation(req)
    else:
        with ablation(req) as ab:
            assert (ab.out / "ablation.md").exists() and store.uploads[0][0] == "s3://bkt/nightly/r7/ablation"
    assert left(tmpdir_) == [THEIRS] and model.exists()


def test_local_file_downloads_into_the_callers_folder(tmpdir_, store, tmp_path):
    assert local_file("/data/p.txt", tmp_path) == "/data/p.txt"  # a local path is used where it is
    assert local_file("s3://bkt/p.txt", tmp_path) == str(tmp_path / "p.txt") and left(tmpdir_) == [THEIRS]


def test_plan_and_profile_steps_leave_only_their_outputs(tmpdir_, tmp_path, tiny_model_dir):
    from components.plan.component import plan
    from components.profile.component import profile

    def artifact(name, text=None):
        return FakeArtifact(tmp_path / name, text)

    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\na dog\n")
    prof, plot = artifact("profile.json"), artifact("plot.html")
    profile.python_func(model=str(tiny_model_dir), prompts=str(prompts), preset="tiny_cpu",
                        overrides=["sampling.num_steps=4"], num_prompts=1, seeds=1, device="cpu",
                        profile_json=prof, plot=plot)
    assert json.loads(Path(prof.path).read_text())["l1rel"] and "<img" in Path(plot.path).read_text()
    spec = plan.python_func(profile_json=artifact("p16.json", json.dumps(tiny_profile(16))),
                            chunks="uniform:5", plan_json=artifact("plan.json"), report=artifact("r.md"),
                            plot=artifact("p.html"))
    assert spec == "sizes:5,5,5" and "<img" in Path(tmp_path / "p.html").read_text()
    assert left(tmpdir_) == [THEIRS]


def test_scorer_worker_modules_are_staged_privately_and_removed_at_exit(tmpdir_):
    """The staged folder (the reward venv worker's PYTHONPATH) is this process's and goes when it exits."""
    code = ("from chunkgrpo.scoring.client import stage_modules\n"
            "a = stage_modules(); b = stage_modules()\n"
            "assert a == b and (a / 'chunkgrpo' / 'scoring' / 'worker.py').is_file(), a\n"
            "assert oct(a.stat().st_mode & 0o777) == '0o700'\n"
            "print(a)\n")
    r = subprocess.run([sys.executable, "-c", code], env={**os.environ, "TMPDIR": str(tmpdir_)},
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert Path(r.stdout.strip()).parent == tmpdir_ and left(tmpdir_) == [THEIRS]
