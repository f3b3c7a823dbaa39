"""train under kfp.local: one optimizer step of the tiny model with a real torchrun process, model to S3."""

import json

import pytest

from components.train.component import train

pytestmark = pytest.mark.integration


def test_train_one_step_locally(local_runner, tiny_model_dir, tmp_path):
    from chunkgrpo.store.client import ArtifactStore
    from chunkgrpo.store.manifest import read_pointer

    prompts = tmp_path / "p.txt"
    prompts.write_text("a red apple\na blue car\n")
    bucket = local_runner.env["CHUNKGRPO_S3_BUCKET"]
    task = train(
        model=str(tiny_model_dir),
        prompts=str(prompts),
        preset="tiny_cpu",
        method="chunk",
        chunks="uniform:3",
        max_iterations=1,
        nproc_per_node=1,
        overrides=[],
        artifact_root=f"s3://{bucket}/comp-train",
        run_id="comp-train-run",
        experiment="comp",
        parent_run_id="",
    )
    pointer = read_pointer(open(task.outputs["trained_model"].path).read())
    assert pointer["optimizer_steps"] == 1
    assert ArtifactStore().read_manifest(pointer["uri"]).sha256 == pointer["manifest_sha256"]
    assert json.loads(ArtifactStore().get_bytes(pointer["uri"] + "/chunkgrpo_model.json"))["kind"] in (
        "lora",
        "full",
    )
