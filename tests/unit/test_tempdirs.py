"""chunkgrpo.tempdirs: `scratch` is removed when its block ends, on failure too; `owned_on_failure` is
removed only when its block fails (the caller owns it on success), and a folder passed in is never removed."""

from __future__ import annotations

import pytest

from chunkgrpo.tempdirs import owned_on_failure, scratch


@pytest.fixture(autouse=True)
def _tmpdir(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))


def test_scratch_is_removed_on_success_and_on_failure(tmp_path):
    with scratch("s-") as a:
        (a / "f").write_text("x")
    with pytest.raises(RuntimeError), scratch("s-") as b:
        raise RuntimeError("boom")
    assert a.parent == b.parent == tmp_path and not a.exists() and not b.exists()


def test_owned_on_failure_is_kept_on_success_removed_on_failure(tmp_path):
    with owned_on_failure("o-") as kept:
        (kept / "f").write_text("x")
    assert (kept / "f").read_text() == "x"
    with pytest.raises(KeyboardInterrupt), owned_on_failure("o-") as gone:
        raise KeyboardInterrupt
    assert kept.parent == gone.parent == tmp_path and not gone.exists()


def test_a_folder_passed_in_is_never_removed(tmp_path):
    mine = tmp_path / "mine"
    mine.mkdir()
    with pytest.raises(ValueError), owned_on_failure("o-", mine) as got:
        raise ValueError
    assert got == mine and mine.is_dir()
