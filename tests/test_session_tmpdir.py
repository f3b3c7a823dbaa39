"""tests/session_tmpdir.py: the test session's TMPDIR is its own folder under pytest's basetemp (an xdist
worker's: the controller's), and at exit one warning line names what was left there."""

import getpass
import os
import tempfile
from pathlib import Path

from tests import session_tmpdir


def test_tmpdir_is_the_sessions_folder_under_basetemp(tmp_path_factory):
    base = tmp_path_factory.getbasetemp()
    here = Path(os.environ["TMPDIR"])
    assert here in {base / "tmp", base.parent / "tmp"} and tempfile.gettempdir() == str(here)
    assert tmp_path_factory.mktemp("x").parent == base  # pytest's own folders are not under it


def test_report_names_what_was_left_but_not_the_per_user_caches(tmp_path, capsys):
    session_tmpdir.report(tmp_path)  # nothing left: no line
    assert capsys.readouterr().err == ""
    (tmp_path / "chunkgrpo-train-a1b2c3d4").mkdir()
    (tmp_path / f"torchinductor_{getpass.getuser()}").mkdir()
    session_tmpdir.report(tmp_path)
    err = capsys.readouterr().err
    assert err.startswith("warning: ") and "1 entries" in err and "chunkgrpo-train-a1b2c3d4" in err
    assert "torchinductor" not in err
