"""Trainer features: full fine-tuning, gradient checkpointing, CLIP reward on a tiny random CLIP,
prompt formats, the text-embedding cache."""

import json

import pytest
import torch

from chunkgrpo.errors import UserError
from chunkgrpo.prompts import load_prompts
from chunkgrpo.train.config import TrainConfig
from chunkgrpo.train.data import EmbeddingCache, PromptStream
from chunkgrpo.train.trainer import Trainer, run_training


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "prompts.txt"
    p.write_text("a cat on a chair\na red car\nthree apples\n")
    return p


def _cfg(model, prompts, out, *over):
    return TrainConfig.load(
        "tiny_cpu", [f"model={model}", f"prompts={prompts}", f"output_dir={out}", "progress=false", *over]
    )


def test_full_finetune_with_gradient_checkpointing_exports_transformer(
    tiny_model_dir, prompts_file, tmp_path
):
    cfg = _cfg(tiny_model_dir, prompts_file, tmp_path, "lora.enabled=false", "gradient_checkpointing=true",
               "max_steps=1", "lr=1e-4", "checkpoint.every=0")
    summary = run_training(cfg)
    final = tmp_path / "final"
    assert json.loads((final / "chunkgrpo_model.json").read_text())["kind"] == "full"
    from diffusers import FluxTransformer2DModel

    trained = FluxTransformer2DModel.from_pretrained(final / "transformer")
    base = FluxTransformer2DModel.from_pretrained(tiny_model_dir, subfolder="transformer")
    changed = [
        n
        for (n, a), (_, b) in zip(trained.named_parameters(), base.named_parameters())
        if not torch.equal(a, b)
    ]
    assert len(changed) > 10  # the whole transformer trains, not an adapter
    assert summary["optimizer_steps"] == 1


def test_clip_similarity_reward_on_tiny_random_clip(tiny_model_dir, prompts_file, tmp_path):
    from chunkgrpo.testing.clip import make_tiny_clip

    clip_dir = make_tiny_clip(tmp_path / "clip")
    cfg = _cfg(
        tiny_model_dir,
        prompts_file,
        tmp_path / "run",
        "max_steps=1",
        f"rewards=[{{name: clip, weight: 0.7, options: {{weights: {clip_dir}}}}}, "
        "{name: brightness, weight: 1.4}]",
    )
    t = Trainer(cfg)
    t.setup()
    m = t.iteration()
    assert set(k for k in m if k.startswith("reward/")) == {"reward/clip", "reward/brightness"}
    assert all(torch.isfinite(torch.tensor(m[k])) for k in ("reward/clip", "loss"))
    t.close()


def test_prompt_formats(tmp_path):
    (tmp_path / "p.jsonl").write_text('{"prompt": "a cat"}\n\n{"text": "a dog"}\n')
    (tmp_path / "p.tsv").write_text("Prompt\tCategory\na red car\tVehicles\n")
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"prompt": ["an apple", "a pear"]}), tmp_path / "p.parquet")
    assert load_prompts(tmp_path / "p.jsonl") == ["a cat", "a dog"]
    assert load_prompts(tmp_path / "p.tsv") == ["a red car"]
    assert load_prompts(tmp_path / "p.parquet", limit=1) == ["an apple"]
    (tmp_path / "bad.jsonl").write_text('{"caption_x": "a"}\n')
    with pytest.raises(UserError, match="no prompt field"):
        load_prompts(tmp_path / "bad.jsonl")


def test_prompt_stream_is_a_function_of_iteration_and_rank():
    prompts = [f"p{i}" for i in range(5)]
    s = PromptStream(prompts, per_rank=2, world=2, seed=3)
    a = [s.batch(i, r) for i in range(4) for r in range(2)]
    b = [PromptStream(prompts, 2, 2, 3).batch(i, r) for i in range(4) for r in range(2)]
    assert a == b  # resumable without sampler state
    assert s.batch(0, 0) != s.batch(0, 1)  # ranks see different prompts
    first_epoch = sum((s.batch(i, r) for i in range(2) for r in range(2)), [])[:5]
    assert sorted(first_epoch) == sorted(prompts)  # each prompt once per epoch


@pytest.mark.exactness
def test_embedding_cache_encodes_once_and_reloads_from_disk(tiny_model, tmp_path):
    cache = EmbeddingCache(tiny_model, tmp_path, max_sequence_length=16)
    assert cache.precompute(["a cat", "a dog", "a cat"]) == 2
    assert cache.precompute(["a cat", "a dog"]) == 0
    again = EmbeddingCache(tiny_model, tmp_path, max_sequence_length=16)
    assert again.precompute(["a cat"]) == 0
    emb = again.get(["a dog", "a cat"])
    direct = tiny_model.encode_prompts(["a dog", "a cat"], 16)
    # cached rows were encoded in another batch order: fp32 tolerance, not bit equality
    from tests.cpu_kernels import tol

    torch.testing.assert_close(emb.prompt_embeds, direct.prompt_embeds, **tol(torch.float32))
    torch.testing.assert_close(emb.pooled, direct.pooled, **tol(torch.float32))


def test_bf16_mixed_precision_path_on_cpu(tiny_model_dir, prompts_file, tmp_path):
    """The GPU recipe's precision layout, exercised on CPU: frozen base weights in bf16, fp32 LoRA
    master weights, bf16 autocast in rollout and training."""
    from tests.cpu_kernels import bf16_attention_kernels

    cfg = _cfg(tiny_model_dir, prompts_file, tmp_path, "mixed_precision=bf16", "max_steps=1")
    t = Trainer(cfg)
    with bf16_attention_kernels():  # a torch bug under a forced lower ATEN_CPU_CAPABILITY on AMX CPUs
        t.setup()
        tr = t.model.transformer
        assert all(p.dtype == torch.float32 for p in t.trainable)
        assert any(p.dtype == torch.bfloat16 for n, p in tr.named_parameters() if not p.requires_grad)
        before = [p.detach().clone() for p in t.trainable]
        m = t.iteration()
    assert torch.isfinite(torch.tensor(m["loss"])) and m["ratio_mean"] == 1.0
    assert any(not torch.equal(a, p.detach()) for a, p in zip(before, t.trainable))
    t.close()
