"""`chunkgrpo models sync --to` against the real local S3: it replaces only what an earlier sync of the
same source put there. A prefix holding anything else is refused in one line (exit 2) with every object
kept; a folder with a broken symlink is refused naming the link, with nothing uploaded."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest

from chunkgrpo.cli import main

pytestmark = pytest.mark.integration


def _folder(root: Path, name: str, files: dict[str, bytes]) -> Path:
    d = root / name
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)
    return d


def _objects(store, prefix: str) -> dict[str, bytes]:
    return {e.key: store.get_bytes(store.uri(e.key)) for e in store.list(prefix + "/")}


@pytest.fixture
def store(services_env):
    from chunkgrpo.store.client import ArtifactStore

    return ArtifactStore(services_env.store_config)


def test_sync_refuses_a_prefix_holding_another_model_and_a_readme(store, tmp_path, capsys):
    dest = store.uri(f"sync-{uuid.uuid4().hex[:6]}/model")
    other = _folder(tmp_path, "other", {f"w{i}.bin": bytes([i]) * 10 for i in range(16)})
    assert main(["models", "sync", str(other), "--to", dest]) == 0
    store.put_bytes(b"# notes\n", dest + "/README.md")
    before = _objects(store, dest)
    assert len(before) == 18  # 16 files, the manifest, the README
    new = _folder(tmp_path, "new", {"model_index.json": b"{}", "w.bin": b"x" * 10})
    capsys.readouterr()

    assert main(["models", "sync", str(new), "--to", dest]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and dest in err[0] and f"a sync of {other}" in err[0], err
    assert _objects(store, dest) == before  # nothing deleted or replaced


def test_sync_refuses_a_prefix_with_objects_but_no_manifest(store, tmp_path, capsys):
    dest = store.uri(f"sync-{uuid.uuid4().hex[:6]}/model")
    store.put_bytes(b"# notes\n", dest + "/README.md")
    new = _folder(tmp_path, "new", {"model_index.json": b"{}"})
    assert main(["models", "sync", str(new), "--to", dest]) == 2
    err = capsys.readouterr().err
    assert "README.md" in err and dest in err and "Traceback" not in err
    assert _objects(store, dest) == {f"{dest[len('s3://chunkgrpo/'):]}/README.md": b"# notes\n"}


def test_a_new_version_of_the_same_source_replaces_its_earlier_sync(store, tmp_path, monkeypatch, capsys):
    dest = store.uri(f"sync-{uuid.uuid4().hex[:6]}/model")
    src = _folder(tmp_path, "m", {"model_index.json": b"{}", "old.bin": b"1"})
    assert main(["models", "sync", str(src), "--to", dest]) == 0
    (src / "old.bin").unlink()
    (src / "new.bin").write_bytes(b"2")
    monkeypatch.chdir(tmp_path)  # the same folder, named relative to another working directory
    assert main(["models", "sync", "m", "--to", dest]) == 0
    names = {k.rsplit("/", 1)[1] for k in _objects(store, dest)}
    assert names == {"model_index.json", "new.bin", "MANIFEST.json"}
    assert store.read_manifest(dest).meta["source"] == str(src.resolve())
    # an interrupted first upload (files, no manifest) of the same folder is resumed, not refused
    dest2 = store.uri(f"sync-{uuid.uuid4().hex[:6]}/model")
    store.put_bytes(b"partial", dest2 + "/new.bin")
    assert main(["models", "sync", str(src), "--to", dest2]) == 0
    assert store.get_bytes(dest2 + "/new.bin") == b"2"


def test_a_broken_symlink_is_refused_and_nothing_is_uploaded(store, tmp_path, capsys):
    dest = store.uri(f"sync-{uuid.uuid4().hex[:6]}/model")
    src = _folder(tmp_path, "m", {"model_index.json": b"{}", "w.bin": b"1"})
    (src / "sub").mkdir()
    (src / "sub" / "weights.safetensors").symlink_to(tmp_path / "gone.safetensors")
    assert main(["models", "sync", str(src), "--to", dest]) == 2
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "sub/weights.safetensors" in err[0] and "broken symlink" in err[0], err
    assert _objects(store, dest) == {}


@pytest.mark.parametrize("where", ["nothing there", "a bucket that does not exist"])
def test_train_from_an_s3_model_that_is_not_there_is_one_line(store, where, tmp_path, capsys):
    model = (store.uri(f"nothing-{uuid.uuid4().hex[:6]}/model") if where == "nothing there"
             else f"s3://no-such-bucket-{uuid.uuid4().hex[:6]}/model")
    (tmp_path / "p.txt").write_text("a cat\n")
    capsys.readouterr()
    rc = main(["train", "--config", "tiny_cpu", f"model={model}", f"prompts={tmp_path / 'p.txt'}",
               f"output_dir={tmp_path / 'run'}", "max_steps=1"])
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.strip() and "WARNING" not in ln]
    assert rc == 2 and "Traceback" not in err, err
    needle = model if where == "nothing there" else model.split("/")[2]  # the URI, or its missing bucket
    assert len(lines) == 1 and needle in lines[0], err
    assert not (tmp_path / "run").exists()
