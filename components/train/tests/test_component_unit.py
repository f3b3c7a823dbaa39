"""train: python_func with torchrun and S3 stubbed: the command it runs and what it reports."""

import json
import sys
import types
from pathlib import Path

import pytest

from components.train.component import train


def _args(**kw):
    return dict(model="s3://bkt/models/flux", prompts="/data/p.txt", preset="chunk_grpo_flux", method="chunk",
                chunks="sizes:2,3,4,7", max_iterations=3, nproc_per_node=8, overrides=["lr=1e-5"],
                artifact_root="s3://bkt/runs", run_id="run-1", experiment="e", parent_run_id="",
                reward_weights={"hpsv3": "s3://bkt/models/MizzenAI/HPSv3",
                                "hpsv3.processor": "s3://bkt/models/Qwen/Qwen2-VL-7B-Instruct"}, **kw)


def test_torchrun_command_and_pointer(monkeypatch, artifact):
    import chunkgrpo.store.client as store
    import chunkgrpo.torchrun as torchrun

    ran = {}

    def fake_run(cmd, *a, **k):  # instead of chunkgrpo.torchrun.run_torchrun: no 8-process job here
        ran["cmd"] = cmd
        out = Path(next(x for x in cmd if x.startswith("output_dir=")).split("=", 1)[1])
        (out / "final").mkdir(parents=True)
        (out / "final" / "chunkgrpo_model.json").write_text(json.dumps({"kind": "lora"}))
        (out / "train_summary.json").write_text(json.dumps({"chunk_sizes": [2, 3, 4, 7], "optimizer_steps": 3,
                                                            "config_hash": "c", "history": [
                                                                {"reward_mean": 0.1, "loss": 1.0},
                                                                {"reward_mean": 0.2, "loss": 0.5}]}))

    class FakeStore:
        def put_folder(self, local, uri, meta=None):
            return types.SimpleNamespace(sha256="d" * 64, total_bytes=10)

        def put_file(self, *a, **k):
            pass

        def read_manifest(self, uri):  # the trainer's own upload of the final model did not happen here
            return None

    monkeypatch.setattr(torchrun, "run_torchrun", fake_run)
    monkeypatch.setattr(store, "ArtifactStore", FakeStore)
    model, metrics = artifact("model.json"), artifact("metrics")
    train.python_func(trained_model=model, metrics=metrics, **_args())
    cmd = ran["cmd"]
    assert cmd[1:3] == ["-m", "chunkgrpo.torchrun_local"] and "--standalone" not in cmd
    assert "--master-addr=127.0.0.1" in cmd and "--rdzv-backend=static" in cmd and "--nproc-per-node=8" in cmd
    assert "rewards.0.options.weights=s3://bkt/models/MizzenAI/HPSv3" in cmd
    assert "rewards.0.options.processor=s3://bkt/models/Qwen/Qwen2-VL-7B-Instruct" in cmd
    assert "checkpoint.s3_prefix=s3://bkt/runs/run-1/train/checkpoints" in cmd  # a retry resumes from here
    assert "checkpoint.final_uri=s3://bkt/runs/run-1/train/final" in cmd  # before the last checkpoint
    pointer = json.loads(open(model.path).read())
    assert pointer["uri"] == "s3://bkt/runs/run-1/train/final" and pointer["chunk_sizes"] == [2, 3, 4, 7]
    assert metrics.metrics["reward_mean.last"] == 0.2


def _instead_of_torchrun(monkeypatch, script: str):
    """Run the real run_torchrun on a one-line stand-in for the workers (same output protocol)."""
    import chunkgrpo.torchrun as torchrun

    real = torchrun.run_torchrun
    monkeypatch.setattr(torchrun, "run_torchrun", lambda cmd, *a, **k: real([sys.executable, "-c", script]))


def test_failed_torchrun_fails_the_step(monkeypatch, artifact):
    _instead_of_torchrun(monkeypatch, "raise SystemExit(3)")
    with pytest.raises(RuntimeError, match="status 3"):
        train.python_func(trained_model=artifact("m.json"), metrics=artifact("x"), **_args())


def test_a_ranks_user_error_is_the_steps_one_line_error(monkeypatch, artifact):
    from chunkgrpo.errors import UserError

    _instead_of_torchrun(monkeypatch, "print('chunkgrpo train: error: lr=nan must be a finite number'); "
                                      "raise SystemExit(1)")
    with pytest.raises(UserError, match=r"^lr=nan must be a finite number$"):
        train.python_func(trained_model=artifact("m.json"), metrics=artifact("x"), **_args())
