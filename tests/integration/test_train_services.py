"""The trainer against the real local S3 (SeaweedFS) and MLflow servers: checkpoints mirrored to
S3 with a manifest, resume from S3 after the local folder is lost, metrics/images/plan in MLflow."""

import json
import re
import shutil

import pytest

from chunkgrpo.store.client import ArtifactStore
from chunkgrpo.train.config import TrainConfig
from chunkgrpo.train.trainer import run_training

pytestmark = pytest.mark.integration


def test_s3_checkpoints_resume_and_mlflow_logging(services_env, tiny_model_dir, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat on a chair\na red car\nthree apples\n")
    prefix = f"s3://{services_env.store_config.bucket}/runs/test-train/ckpt"

    def cfg(out, steps):
        return TrainConfig.load("tiny_cpu", [
            f"model={tiny_model_dir}", f"prompts={prompts}", f"output_dir={out}", "progress=false",
            f"max_steps={steps}", "checkpoint.every=2", f"checkpoint.s3_prefix={prefix}",
            "tracking.experiment=test-train", "tracking.image_every=1"])

    first = run_training(cfg(tmp_path / "a", 2))
    st = ArtifactStore()
    assert st.latest_complete(prefix).endswith("/step-000002")
    manifest = st.read_manifest(prefix + "/step-000002")
    assert {"trainable.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json"} <= set(
        manifest.files
    )

    # a new pod with an empty disk: resume from S3 and continue to step 4
    shutil.rmtree(tmp_path / "a")
    second = run_training(cfg(tmp_path / "a", 4))
    assert second["optimizer_steps"] == 4
    assert [h["optimizer_step"] for h in second["history"]] == [1, 2, 3, 4]
    assert second["history"][:2] == first["history"]  # the first two steps came from the checkpoint
    assert st.latest_complete(prefix).endswith("/step-000004")

    from mlflow import MlflowClient

    c = MlflowClient()
    exp = c.get_experiment_by_name("test-train")
    runs = c.search_runs([exp.experiment_id], order_by=["attributes.start_time DESC"])
    run = runs[0]
    assert run.info.status == "FINISHED"
    assert run.data.params["method"] == "chunk"
    hist = c.get_metric_history(run.info.run_id, "reward/mean")
    assert [m.step for m in hist] == [3, 4]
    for key in (
        "policy/loss",
        "policy/clip_fraction",
        "policy/grad_norm",
        "policy/kl_k3",
        "count/transformer_forward",
        "policy/ratio_mean",
        "time/rollout",
    ):
        assert key in run.data.metrics, key
    assert all(k.startswith(("reward/", "policy/", "time/", "count/")) for k in run.data.metrics)
    arts = {a.path for a in c.list_artifacts(run.info.run_id)}
    assert {"chunk_plan.json", "samples", "train_summary.json", "images"} <= arts
    # sample grids under key "samples" at the optimizer step of the resumed run's iterations (3, 4)
    images = [a.path for a in c.list_artifacts(run.info.run_id, "images") if a.path.endswith(".png")]
    steps = [re.match(r"images/samples[+%]step[+%](\d+)[+%]", p) for p in images]  # MLflow's file names
    assert all(steps) and sorted(int(m.group(1)) for m in steps) == [3, 4], images

    (tmp_path / "dl").mkdir()
    with open(c.download_artifacts(run.info.run_id, "samples/captions.json", str(tmp_path / "dl"))) as f:
        table = json.load(f)
    rows = [dict(zip(table["columns"], r, strict=True)) for r in table["data"]]
    assert {r["step"] for r in rows} == {3, 4}
    assert {r["prompt"] for r in rows} <= {"a cat on a chair", "a red car", "three apples"} and rows


def test_base_model_loads_from_s3_through_the_cache(services_env, tiny_model_dir, tmp_path, monkeypatch):
    from chunkgrpo.flux import load_flux

    monkeypatch.setenv("CHUNKGRPO_CACHE", str(tmp_path / "cache"))
    uri = f"s3://{services_env.store_config.bucket}/models/tiny-flux"
    ArtifactStore().put_folder(tiny_model_dir, uri)
    model = load_flux(uri)
    assert type(model.transformer).__name__ == "FluxTransformer2DModel"
    cached = list((tmp_path / "cache" / "models").iterdir())
    assert len(cached) == 1 and (cached[0] / "model_index.json").exists()
    load_flux(uri)  # second load reuses the verified cache entry
    assert len(list((tmp_path / "cache" / "models").iterdir())) == 1


def test_prompts_from_s3(services_env, tmp_path, monkeypatch):
    from chunkgrpo.errors import UserError
    from chunkgrpo.prompts import load_prompts

    monkeypatch.setenv("CHUNKGRPO_CACHE", str(tmp_path / "cache"))
    st = ArtifactStore()
    uri = f"s3://{services_env.store_config.bucket}/data/prompts.jsonl"
    st.put_bytes(b'{"prompt": "a cat"}\n{"prompt": "a dog"}\n', uri)
    assert load_prompts(uri) == ["a cat", "a dog"]
    st.put_bytes(b'{"prompt": "a bird"}\n', uri)  # changed object: fetched again, not served stale
    assert load_prompts(uri) == ["a bird"]
    with pytest.raises(UserError, match="does not exist"):
        load_prompts(f"s3://{services_env.store_config.bucket}/data/missing.txt")


def test_the_final_model_reaches_s3_before_the_last_checkpoint(services_env, tiny_model_dir, tmp_path,
                                                               monkeypatch):
    """With checkpoint.final_uri the last checkpoint's upload waits until the final model is in S3."""
    from chunkgrpo.train import checkpoint_format as ckpt

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a cat on a chair\na red car\n")
    base = f"s3://{services_env.store_config.bucket}/runs/final-first"
    order = []
    real_upload, real_put = ckpt.upload, ArtifactStore.put_folder

    def upload(path, prefix, store=None):
        order.append(path.name)
        return real_upload(path, prefix, store)

    def put_folder(self, local_dir, prefix, **kw):
        if str(prefix).endswith("/final"):
            order.append("final")
        return real_put(self, local_dir, prefix, **kw)

    monkeypatch.setattr(ckpt, "upload", upload)
    monkeypatch.setattr(ArtifactStore, "put_folder", put_folder)
    run_training(TrainConfig.load("tiny_cpu", [
        f"model={tiny_model_dir}", f"prompts={prompts}", f"output_dir={tmp_path / 'a'}", "progress=false",
        "max_steps=2", "checkpoint.every=1", "checkpoint.keep=5", f"checkpoint.s3_prefix={base}/ckpt",
        f"checkpoint.final_uri={base}/final", "tracking.image_every=0"]))
    assert order.index("final") < order.index("step-000002")
    st = ArtifactStore()
    assert st.is_complete(f"{base}/final") and st.latest_complete(f"{base}/ckpt").endswith("/step-000002")
