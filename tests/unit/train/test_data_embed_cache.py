"""The prompt-embedding cache is verified, not trusted: a truncated or bit-flipped
cache file is detected and re-encoded (a resumed run ends bit-identical to an uninterrupted one), and
another base model / encoder / max_sequence_length never reuses the cached embeddings."""

from __future__ import annotations

import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file

from chunkgrpo.train.data import EmbeddingCache, encoder_identity
from chunkgrpo.train.trainer import run_training
from tests.unit.train.test_checkpoint_format_safety import (  # noqa: F401 - fixtures
    _cfg,
    _same,
    prompts_file,
    reference,
    stopped_run,
    two_checkpoints,
)


def _damage(f, how: str) -> None:
    raw = bytearray(f.read_bytes())
    if how == "truncated":
        f.write_bytes(bytes(raw[: len(raw) // 2]))
    else:  # one bit in each of 16 bytes in the middle (tensor data, exponents included): still loadable
        for k in range(16):
            raw[len(raw) // 2 + k] ^= 0x40
        f.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["truncated", "bit-flip"])
def test_damaged_cache_files_are_rebuilt(how, tiny_model, tmp_path, caplog):
    cache = EmbeddingCache(tiny_model, tmp_path, max_sequence_length=16)
    assert cache.precompute(["a cat", "a dog"]) == 2
    good = cache.get(["a cat", "a dog"])
    files = sorted(cache.dir.glob("*.pt"))
    assert len(files) == 2
    for f in files:
        _damage(f, how)
    caplog.set_level(logging.WARNING, logger="chunkgrpo.train.data")
    again = EmbeddingCache(tiny_model, tmp_path, max_sequence_length=16)
    assert again.precompute(["a cat", "a dog"]) == 2  # both re-encoded, none trusted
    assert sorted(again.rebuilt) == ["a cat", "a dog"]
    assert ("sha256 differs" if how == "bit-flip" else "re-encoding") in caplog.text
    emb = again.get(["a cat", "a dog"])
    assert torch.equal(emb.prompt_embeds, good.prompt_embeds) and torch.equal(emb.pooled, good.pooled)
    third = EmbeddingCache(tiny_model, tmp_path, max_sequence_length=16)
    assert third.precompute(["a cat", "a dog"]) == 0  # the rebuilt files verify


def test_a_file_planted_under_another_prompts_name_is_refused(tiny_model, tmp_path):
    cache = EmbeddingCache(tiny_model, tmp_path, max_sequence_length=16)
    cache.precompute(["a cat", "a dog"])
    shutil.copy(cache._path("a dog"), cache._path("a cat"))  # a valid file, for the wrong prompt
    again = EmbeddingCache(tiny_model, tmp_path, max_sequence_length=16)
    assert again.precompute(["a cat"]) == 1 and again.rebuilt == ["a cat"]


def test_another_base_model_or_length_is_another_key(tiny_model, tiny_model_dir, tmp_path):
    from chunkgrpo.flux import load_flux
    from chunkgrpo.testing.tiny import build_tiny_flux

    other_dir = build_tiny_flux(tmp_path / "other", seed=1)  # same architecture, other weights
    other = load_flux(other_dir)
    a = EmbeddingCache(tiny_model, tmp_path / "c", max_sequence_length=16)
    assert a.precompute(["a cat"]) == 1
    b = EmbeddingCache(other, tmp_path / "c", max_sequence_length=16)
    assert b.identity != a.identity and b.dir != a.dir
    assert b.precompute(["a cat"]) == 1  # not reused
    assert not torch.equal(b.get(["a cat"]).prompt_embeds, a.get(["a cat"]).prompt_embeds)
    assert encoder_identity(tiny_model_dir, 32, torch.float32) != encoder_identity(
        tiny_model_dir, 16, torch.float32
    )
    assert encoder_identity(tiny_model_dir, 16, torch.bfloat16) != encoder_identity(
        tiny_model_dir, 16, torch.float32
    )
    # a changed tokenizer file alone changes the key
    copy = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, copy)
    assert encoder_identity(copy, 16, torch.float32) == encoder_identity(tiny_model_dir, 16, torch.float32)
    tok = sorted((copy / "tokenizer").rglob("*.json"))[0]
    tok.write_text(tok.read_text() + " ")
    assert encoder_identity(copy, 16, torch.float32) != encoder_identity(tiny_model_dir, 16, torch.float32)


@pytest.mark.parametrize("how", ["truncated", "bit-flip", "swapped"])
def test_resume_with_a_damaged_cache_ends_exactly_as_an_uninterrupted_run(
        how, two_checkpoints, tiny_model_dir, prompts_file, reference):  # noqa: F811
    files = sorted((two_checkpoints / "embeds").rglob("*.pt"))
    assert len(files) >= 2
    if how == "swapped":  # valid files under each other's names (what the old cache loaded silently)
        a, b = files[0].read_bytes(), files[1].read_bytes()
        files[0].write_bytes(b)
        files[1].write_bytes(a)
    else:
        for f in files:
            _damage(f, how)
    summary = run_training(_cfg(tiny_model_dir, prompts_file, two_checkpoints, "max_steps=3"))
    assert summary["optimizer_steps"] == 3
    assert _same(load_file(str(two_checkpoints / "final" / "pytorch_lora_weights.safetensors")), reference)
