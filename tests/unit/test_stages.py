"""chunkgrpo.stages: the training overrides exist once (both trainers send the same list), and the stage
modules load without kfp or torch (the launcher image has neither torch nor, at import, the SDK)."""

import subprocess
import sys

from chunkgrpo.stages.launch import JobOptions, job_spec
from chunkgrpo.stages.train import TrainRequest

REQ = TrainRequest(model="s3://bkt/models/flux", prompts="s3://bkt/p.txt", preset="", method="chunk",
                   chunks="sizes:2,3,4,7", max_iterations=5, overrides=["lr=1e-5"],
                   artifact_root="s3://bkt/runs", run_id="run-123456789", experiment="e", parent_run_id="p1",
                   reward_weights={"hpsv3": "s3://bkt/models/MizzenAI/HPSv3"})


def test_both_trainers_send_the_same_overrides():
    in_task = REQ.train_args("/tmp/p.txt", output_dir="/cache/out")
    spec = job_spec(REQ, JobOptions(image="img:1", num_nodes=2), "kubeflow")
    assert spec.train_args[:2] == ["--config", "chunk_grpo_flux"]  # '' = the method's own preset
    pods = spec.train_args[2:]
    differ = {(a, b) for a, b in zip(in_task, pods, strict=True) if a != b}
    assert differ == {("prompts=/tmp/p.txt", "prompts=/tmp/inputs/prompts.txt"),
                      ("output_dir=/cache/out", "progress=false")}
    assert in_task[0] == "lr=1e-5" and "rewards.0.options.weights=s3://bkt/models/MizzenAI/HPSv3" in in_task
    assert "max_iterations=5" in in_task and in_task[-1] == "tracking.run_name=train-run-1234"
    assert "checkpoint.s3_prefix=s3://bkt/runs/run-123456789/train/checkpoints" in in_task  # a retry resumes
    # ... as the same writer of that prefix (its lease), in the task and in every job pod
    writer = "checkpoint.writer_id=kfp-run-run-123456789"
    assert writer in in_task and writer in pods
    assert spec.fetch == {"/tmp/inputs/prompts.txt": "s3://bkt/p.txt"}
    assert "max_iterations=0" not in TrainRequest(**{**vars(REQ), "max_iterations": 0}).train_args("p")


def test_stage_modules_import_without_kfp_or_torch():
    code = ("import sys; import chunkgrpo.stages.launch, chunkgrpo.stages.train, chunkgrpo.stages.evaluate, "
            "chunkgrpo.stages.register, chunkgrpo.stages.promote, chunkgrpo.stages.tracking, "
            "chunkgrpo.stages.models, chunkgrpo.stages.ablation, chunkgrpo.stages.profile, "
            "chunkgrpo.stages.plan, chunkgrpo.stages.preflight, chunkgrpo.stages.regression; "
            "print(sorted(m for m in ('kfp', 'torch', 'mlflow') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
