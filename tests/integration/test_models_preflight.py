"""The S3 model cache (`chunkgrpo models sync`) and the pipeline's preflight against the real local
SeaweedFS + MLflow: a run whose base model, weights or judge key are missing fails in seconds with
one line naming all of them; once `models sync` has filled the cache the same preflight passes."""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

import pytest

from chunkgrpo.cli import main
from chunkgrpo.errors import UserError

pytestmark = pytest.mark.integration


def _hub_cache(tmp_path: Path, model_dir: Path, repo: str) -> Path:
    """A local hub cache holding `model_dir` as `repo` (what a machine that downloaded it once has)."""
    org, name = repo.split("/")
    root = tmp_path / "hf" / "hub" / f"models--{org}--{name}"
    snap = root / "snapshots" / ("0" * 40)
    shutil.copytree(model_dir, snap)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text("0" * 40)
    return tmp_path / "hf"


def test_models_sync_from_the_hub_cache_then_preflight_passes(
    services_env, tmp_path, tiny_model_dir, monkeypatch, capsys
):
    from chunkgrpo import model_cache
    from chunkgrpo.flux import resolve_model_source
    from chunkgrpo.preflight import PreflightSpec, check, require
    from chunkgrpo.store.client import ArtifactStore

    store = ArtifactStore(services_env.store_config)
    root = store.uri(f"models-{uuid.uuid4().hex[:6]}")
    monkeypatch.setenv(model_cache.MODEL_ROOT_ENV, root)
    import huggingface_hub.constants

    hf_home = _hub_cache(tmp_path, tiny_model_dir, "acme/tiny-flux")
    monkeypatch.setattr(
        huggingface_hub.constants, "HF_HUB_CACHE", str(hf_home / "hub")
    )  # read at import time
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    prompts = store.uri("preflight/prompts.txt")
    store.put_bytes(b"a red apple\n", prompts)
    weights = {"reward hpsv3": f"{root}/MizzenAI/HPSv3"}
    spec = PreflightSpec(model=f"{root}/acme/tiny-flux", prompts=prompts, weights=weights,
                         benchmarks=["hpdv2", "wise"], artifact_root=store.uri("runs"))
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)

    t0 = time.perf_counter()
    problems = check(spec)
    assert time.perf_counter() - t0 < 30  # seconds, not the hours a GPU job would run first
    text = " | ".join(problems)
    assert "base model" in text and "acme/tiny-flux" in text and "chunkgrpo models sync" in text
    assert "weights reward hpsv3" in text and "OPENAI_API_KEY" in text and len(problems) == 3
    with pytest.raises(UserError) as exc:
        require(spec)
    assert "\n" not in str(exc.value) and str(exc.value).startswith("preflight: 3 problem(s): ")

    # the one-time step: hub cache -> S3 (idempotent), then the model loads from S3 like any other
    assert main(["models", "sync", "acme/tiny-flux"]) == 0
    assert f"acme/tiny-flux -> {root}/acme/tiny-flux" in capsys.readouterr().out
    assert main(["models", "sync", "acme/tiny-flux"]) == 0
    assert "(already there)" in capsys.readouterr().out
    assert (
        Path(resolve_model_source(f"{root}/acme/tiny-flux", tmp_path / "cache")) / "model_index.json"
    ).exists()
    hps = tmp_path / "HPSv3"
    hps.mkdir()
    (hps / "HPSv3.safetensors").write_bytes(b"\0" * 64)
    assert main(["models", "sync", str(hps), "--to", f"{root}/MizzenAI/HPSv3"]) == 0
    monkeypatch.setenv("OPENAI_API_KEY", "sk-test")
    assert check(spec) == []
    # a hub id that was never cached: one line, no download attempt
    assert main(["models", "sync", "acme/never-downloaded"]) == 2
    assert "not in the local hub cache" in capsys.readouterr().err


def test_preflight_names_bad_credentials_and_missing_bucket(services_env, monkeypatch, tmp_path):
    from chunkgrpo.preflight import PreflightSpec, check

    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "wrong-secret")
    problems = check(PreflightSpec(model=str(tmp_path / "nope"), prompts="s3://chunkgrpo/p.txt",
                                   artifact_root="s3://no-such-bucket-x/runs"))
    text = " | ".join(problems)
    assert "base model" in text and "does not exist" in text
    assert "S3 error" in text  # the signature is refused: named, not a traceback
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://127.0.0.1:9")  # nothing listens there
    assert any(
        "MLflow http://127.0.0.1:9 is not reachable" in p for p in check(PreflightSpec(model="", prompts=""))
    )


def test_weight_uris_become_stage_overrides():
    from chunkgrpo.model_cache import (
        reward_weight_overrides,
        scorer_weight_overrides,
        used_reward_weights,
        used_scorer_weights,
    )

    w = {"hpsv3": "s3://m/MizzenAI/HPSv3", "hpsv3.processor": "s3://m/Qwen/Qwen2-VL-7B-Instruct",
         "imagereward": "s3://m/THUDM/ImageReward"}
    assert reward_weight_overrides("chunk_grpo_flux", [], w) == [
        "rewards.0.options.weights=s3://m/MizzenAI/HPSv3", "rewards.0.options.processor=s3://m/Qwen/Qwen2-VL-7B-Instruct"]
    assert reward_weight_overrides("tiny_cpu", [], w) == []  # its reward needs no weights
    assert reward_weight_overrides(
        "tiny_cpu", ['rewards=[{"name": "brightness"}, {"name": "imagereward"}]'], w
    ) == ["rewards.1.options.weights=s3://m/THUDM/ImageReward"]
    assert scorer_weight_overrides(w) == ["scorer_weights.hpsv3=s3://m/MizzenAI/HPSv3",
                                          "scorer_options.hpsv3.processor=s3://m/Qwen/Qwen2-VL-7B-Instruct",
                                          "scorer_weights.imagereward=s3://m/THUDM/ImageReward"]
    assert used_reward_weights("chunk_grpo_flux", [], w) == {
        k: v for k, v in w.items() if k.startswith("hpsv3")
    }
    assert used_scorer_weights("eval_hpdv2", [], w) == w
    assert used_scorer_weights("eval_tiny", [], w) == {}
    from chunkgrpo.eval.config import EvalConfig

    cfg = EvalConfig.load(
        "eval_hpdv2", [*scorer_weight_overrides(w), "base_model=/models/flux"]
    )  # valid keys
    assert cfg.scorer_weights["imagereward"] == w["imagereward"]
    assert cfg.scorer_options["hpsv3"]["processor"] == w["hpsv3.processor"]


def test_benchmark_preflight_checks_the_registry_version_and_its_base_model(
    services_env, tmp_path, tiny_model_dir, monkeypatch
):
    """The nightly benchmark's preflight: the alias must exist, and the base model the version was registered
    with (tag base_model) must be loadable, checked against the real MLflow registry in seconds."""
    from chunkgrpo.preflight import PreflightSpec, check
    from chunkgrpo.registry.promotion import promote
    from chunkgrpo.registry.registration import Registration, register_model
    from tests.registry_helpers import eval_run

    name = f"bench-{uuid.uuid4().hex[:6]}"
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    spec = PreflightSpec(registered=f"{name}@champion", benchmarks=["hpdv2"])
    t0 = time.perf_counter()
    problems = check(spec)
    assert time.perf_counter() - t0 < 30
    assert problems == [
        f"registered model {name!r} has no version with alias 'champion' (register and promote one)"
    ]

    lora = tmp_path / "lora"
    lora.mkdir()
    (lora / "pytorch_lora_weights.safetensors").write_bytes(b"\1" * 256)
    gone = tmp_path / "gone-base"
    run = eval_run({"hpdv2.hpsv3.trained": 0.3}, weights=lora)  # promotion trusts only an eval run
    v = register_model(
        Registration(
            name,
            str(gone),
            lora,
            kind="lora",
            metrics={"eval": {"hpdv2.hpsv3": 0.3}},
            git="abc",
            cfg_hash="c",
            eval_protocol={"preset": "eval_tiny"},
            eval_run_id=run,
        )
    )
    promote(name, v.version, who="t")
    text = " | ".join(check(PreflightSpec(registered=f"{name}@champion", benchmarks=["hpdv2", "wise"])))
    assert f"base model {gone} does not exist" in text and "OPENAI_API_KEY" in text
    # an explicit base model replaces the registered one; prompts are not asked for
    assert (
        check(PreflightSpec(model=str(tiny_model_dir), registered=f"{name}@champion", benchmarks=["hpdv2"]))
        == []
    )
    monkeypatch.delenv("MLFLOW_TRACKING_URI")
    assert "needs an MLflow server" in " ".join(check(PreflightSpec(registered=f"{name}@champion")))
