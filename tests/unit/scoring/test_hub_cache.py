"""install_snapshot lays a folder out as huggingface_hub stores downloads, so loading by hub name
finds it offline; the same folder twice is one snapshot, a changed folder becomes the new `main`."""

from __future__ import annotations

import pytest

from chunkgrpo.scoring.hub_cache import hub_cache_dir, install_snapshot


def test_installed_folder_resolves_by_hub_name_offline(tmp_path, monkeypatch):
    from huggingface_hub import try_to_load_from_cache

    src = tmp_path / "bert"
    src.mkdir()
    (src / "vocab.txt").write_text("[PAD]\n[UNK]\na\n")
    (src / "tokenizer_config.json").write_text("{}")
    cache = tmp_path / "hub"
    snap = install_snapshot("bert-base-uncased", src, cache)
    assert (snap / "vocab.txt").read_text() == "[PAD]\n[UNK]\na\n"
    found = try_to_load_from_cache("bert-base-uncased", "vocab.txt", cache_dir=str(cache))
    assert isinstance(found, str) and open(found).read() == "[PAD]\n[UNK]\na\n"
    assert install_snapshot("bert-base-uncased", src, cache) == snap  # idempotent
    (src / "vocab.txt").write_text("[PAD]\n[UNK]\nb\n")
    snap2 = install_snapshot("bert-base-uncased", src, cache)
    assert snap2 != snap and (snap2.parent.parent / "refs" / "main").read_text() == snap2.name
    found = try_to_load_from_cache("bert-base-uncased", "vocab.txt", cache_dir=str(cache))
    assert open(found).read().endswith("b\n")


def test_hub_cache_follows_huggingface_hub_order(tmp_path, monkeypatch):
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(tmp_path / "home"))
    assert hub_cache_dir() == tmp_path / "home" / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "c"))
    assert hub_cache_dir() == tmp_path / "c"


def test_an_empty_or_missing_folder_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not a folder with files"):
        install_snapshot("bert-base-uncased", tmp_path / "missing", tmp_path / "hub")
    assert not (tmp_path / "hub").exists()
