"""`chunkgrpo models sync --prompts FILE` and the default training prompts, against the real local S3:
the file is parsed before anything is written, a bad file or destination is one line (exit 2) with
nothing uploaded, a re-run of an identical file is a no-op, and the shipped PartiPrompts set (the
pipelines' default `prompts`) reads back through the same loader training uses."""

from __future__ import annotations

import uuid

import pytest

from chunkgrpo.cli import main

pytestmark = pytest.mark.integration


@pytest.fixture
def store(services_env):
    from chunkgrpo.store.client import ArtifactStore

    return ArtifactStore(services_env.store_config)


def _one_error_line(capsys) -> str:
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and "Traceback" not in err[0], err
    return err[0]


def test_user_prompts_upload_then_noop_and_read_back(store, tmp_path, capsys):
    from chunkgrpo.prompts import load_prompts

    f = tmp_path / "hpdv2_train.txt"
    f.write_text("a red cube\n# comment\n\na cat on a mat\n")
    dest = store.uri(f"prompts-{uuid.uuid4().hex[:6]}/hpdv2_train.txt")
    assert main(["models", "sync", "--prompts", str(f), "--to", dest]) == 0
    assert f"(2 prompts) -> {dest}" in capsys.readouterr().out
    assert store.get_bytes(dest) == f.read_bytes()
    assert load_prompts(dest) == ["a red cube", "a cat on a mat"]
    assert main(["models", "sync", "--prompts", str(f), "--to", dest]) == 0
    assert "(already there)" in capsys.readouterr().out


def test_bad_prompt_files_and_destinations_write_nothing(store, tmp_path, capsys):
    prefix = f"prompts-{uuid.uuid4().hex[:6]}"
    empty = tmp_path / "empty.txt"
    empty.write_text("# only a comment\n")
    assert main(["models", "sync", "--prompts", str(empty), "--to", store.uri(f"{prefix}/empty.txt")]) == 2
    assert "no prompts" in _one_error_line(capsys)
    good = tmp_path / "p.txt"
    good.write_text("a dog\n")
    assert main(["models", "sync", "--prompts", str(good), "--to", store.uri(f"{prefix}/p.tsv")]) == 2
    assert "p.tsv" in _one_error_line(capsys)  # the suffix decides how prompts are read
    assert main(["models", "sync", "--prompts", str(tmp_path / "missing.txt"), "--to",
                 store.uri(f"{prefix}/m.txt")]) == 2
    assert "missing.txt" in _one_error_line(capsys)
    assert main(["models", "sync", "--prompts", str(good), "--to", "s3://no-such-bucket-x/p.txt"]) == 2
    assert "no-such-bucket-x" in _one_error_line(capsys)
    assert store.list(prefix + "/") == []


def test_shipped_default_prompts_upload_and_load(store, capsys):
    from chunkgrpo.prompts import load_prompts
    from chunkgrpo.stages.models import DEFAULT_TRAIN_PROMPTS, sync_prompts

    assert DEFAULT_TRAIN_PROMPTS.endswith("/PartiPrompts.tsv")
    dest = store.uri(f"prompts-{uuid.uuid4().hex[:6]}/PartiPrompts.tsv")
    assert sync_prompts(None, to=dest, store=store) == dest
    prompts = load_prompts(dest)
    assert len(prompts) == 1632 and prompts[0] == "bond"
