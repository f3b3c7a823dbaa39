"""The pretrained toy model shipped with the package (chunkgrpo.toy.pretrained): used only when it is the
model the current code would build and every file matches its checksums; copied out atomically; the
shipped copy (when present) is never stale."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from chunkgrpo.errors import UserError
from chunkgrpo.toy import pretrained
from chunkgrpo.toy.model import META_FILE, ToyModelConfig, model_key, read_meta


def _fake_model(folder: Path, key: str | None = None, **config) -> Path:
    """A folder shaped like a toy model (meta, weights, prompt files), without pretraining."""
    cfg = ToyModelConfig(**config)
    (folder / "transformer").mkdir(parents=True)
    (folder / "transformer" / "diffusion_pytorch_model.safetensors").write_bytes(b"\x00weights" * 100)
    (folder / "toy").mkdir()
    (folder / "toy" / "train_prompts.txt").write_text("a red circle\n")
    (folder / META_FILE).write_text(json.dumps({"key": key or model_key(cfg), "config": cfg.to_dict(),
                                                "files": {"train_prompts": "toy/train_prompts.txt"}}))
    return folder


def test_ship_then_install_copies_a_verified_folder(tmp_path):
    shipped = pretrained.ship(_fake_model(tmp_path / "built"), tmp_path / "pkg")
    assert pretrained.verify(shipped) is None and pretrained.packaged(shipped) == shipped
    out = tmp_path / "home" / "models" / "toy"
    assert pretrained.install(out, shipped)
    assert read_meta(out)["key"] == model_key(ToyModelConfig())
    assert (out / "transformer" / "diffusion_pytorch_model.safetensors").read_bytes() == b"\x00weights" * 100
    assert not (out / pretrained.SUMS).exists()
    assert [p.name for p in out.parent.iterdir()] == ["toy"]  # no staging folder left behind


def test_a_stale_or_damaged_copy_is_not_used(tmp_path):
    stale = pretrained.ship(_fake_model(tmp_path / "b1"), tmp_path / "stale")
    meta = json.loads((stale / META_FILE).read_text())
    (stale / META_FILE).write_text(json.dumps({**meta, "key": "0123456789abcdef"}))
    pretrained.write_sums(stale)  # intact, but built by other code
    assert pretrained.packaged(stale) is None
    assert not pretrained.install(tmp_path / "out1", stale) and not (tmp_path / "out1").exists()

    damaged = pretrained.ship(_fake_model(tmp_path / "b2"), tmp_path / "damaged")
    (damaged / "toy" / "train_prompts.txt").write_text("a blue square\n")
    assert "train_prompts.txt" in pretrained.verify(damaged)
    assert pretrained.packaged(damaged) is None
    (damaged / "extra.bin").write_bytes(b"x")
    assert "extra.bin" in pretrained.verify(damaged)


def test_current_means_the_default_config_up_to_the_thread_count(tmp_path):
    assert pretrained.is_current(read_meta(_fake_model(tmp_path / "a", threads=1)))
    assert not pretrained.is_current(read_meta(_fake_model(tmp_path / "b", steps=10)))  # another model
    other_code = _fake_model(tmp_path / "c", key="0123456789abcdef")
    assert not pretrained.is_current(read_meta(other_code))
    assert not pretrained.is_current(None) and not pretrained.is_current({"key": "x"})


def test_ship_refuses_a_model_of_another_config_and_install_an_unrelated_folder(tmp_path):
    with pytest.raises(UserError, match="current default"):
        pretrained.ship(_fake_model(tmp_path / "old", key="feedfacefeedface"), tmp_path / "pkg")
    shipped = pretrained.ship(_fake_model(tmp_path / "built"), tmp_path / "pkg")
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not empty"):
        pretrained.install(busy, shipped)
    assert (busy / "notes.txt").read_text() == "mine"


def test_the_shipped_copy_is_the_current_default_model():
    """Fails when world.py / model.py / ToyModelConfig changed without refreshing the shipped copy
    (`python -m chunkgrpo.toy.pretrained --from <a folder built by chunkgrpo toy-model>`)."""
    if read_meta(pretrained.PACKAGED) is None:
        pytest.skip("no toy model shipped in this checkout (chunkgrpo/toy/pretrained)")
    assert pretrained.is_current(read_meta(pretrained.PACKAGED))
    assert pretrained.verify(pretrained.PACKAGED) is None


def test_the_demo_uses_the_shipped_copy_instead_of_pretraining(tmp_path, monkeypatch, capsys):
    from chunkgrpo.toy import model as toy_model
    from pipeline.demos import prepare_inputs

    shipped = pretrained.ship(_fake_model(tmp_path / "built"), tmp_path / "pkg")
    monkeypatch.setattr(pretrained, "PACKAGED", shipped)
    monkeypatch.setattr(toy_model, "_build",
                        lambda *a, **k: pytest.fail("pretrained although a copy is shipped"))
    model, prompts = prepare_inputs(tmp_path / "home")
    assert model == tmp_path / "home" / "models" / "toy" and prompts.read_text() == "a red circle\n"
    assert "shipped with chunkgrpo" in capsys.readouterr().out


def test_a_stale_demo_model_is_replaced_by_the_shipped_copy_not_pretrained(tmp_path, monkeypatch, capsys):
    """After an upgrade the demo's model folder holds a model of older code: the shipped current copy takes
    its place (no 5-minute pretraining), and no staging folder is left beside it."""
    from chunkgrpo.toy import model as toy_model
    from pipeline.demos import prepare_inputs

    shipped = pretrained.ship(_fake_model(tmp_path / "built"), tmp_path / "pkg")
    monkeypatch.setattr(pretrained, "PACKAGED", shipped)
    monkeypatch.setattr(toy_model, "_build",
                        lambda *a, **k: pytest.fail("pretrained although a current copy is shipped"))
    home = tmp_path / "home"
    _fake_model(home / "models" / "toy", key="0123456789abcdef")
    assert not pretrained.is_current(read_meta(home / "models" / "toy"))
    model, _ = prepare_inputs(home)
    assert pretrained.is_current(read_meta(model))
    assert sorted(p.name for p in model.parent.iterdir()) == ["toy"]
    assert "built by other code (key 0123456789abcdef)" in capsys.readouterr().out


def test_a_stale_demo_model_is_left_alone_when_nothing_current_is_shipped(tmp_path, monkeypatch):
    from chunkgrpo.toy import model as toy_model
    from pipeline.demos import prepare_inputs

    stale = pretrained.ship(_fake_model(tmp_path / "built"), tmp_path / "pkg")
    meta = json.loads((stale / META_FILE).read_text())
    (stale / META_FILE).write_text(json.dumps({**meta, "key": "feedfacefeedface"}))
    pretrained.write_sums(stale)
    monkeypatch.setattr(pretrained, "PACKAGED", stale)
    built = []
    monkeypatch.setattr(toy_model, "build_toy_model", lambda out, *a, **k: built.append(out))
    home = tmp_path / "home"
    _fake_model(home / "models" / "toy", key="0123456789abcdef")
    prepare_inputs(home)
    assert built == [home / "models" / "toy"]
    assert read_meta(home / "models" / "toy")["key"] == "0123456789abcdef"


def test_the_stale_warning_names_the_key_it_compares_with(tmp_path, caplog):
    stale = pretrained.ship(_fake_model(tmp_path / "built", threads=1), tmp_path / "pkg")
    meta = json.loads((stale / META_FILE).read_text())
    (stale / META_FILE).write_text(json.dumps({**meta, "key": "0123456789abcdef"}))
    pretrained.write_sums(stale)
    with caplog.at_level("WARNING"):
        assert pretrained.packaged(stale) is None
    want = model_key(ToyModelConfig(threads=1))
    assert pretrained.current_key(read_meta(stale)) == want and f"current {want}" in caplog.text
