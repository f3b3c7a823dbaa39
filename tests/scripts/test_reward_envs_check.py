"""The up-to-date check of scripts/reward-envs.sh (`pinned VENV LOCK`, run before it skips a venv whose stamp
matches): the packages of a lock file at their pinned versions pass; another version or a missing package
fails, one line each. Run on this test's own environment with the script's function as bash defines it."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "reward-envs.sh"


def _pinned(lock: Path) -> subprocess.CompletedProcess:
    # the function's definition, cut from the script (running the script would check the real venvs)
    cut = f"source <(sed -n '/^pinned() {{/,/^}}/p' {SCRIPT}); pinned {sys.prefix} {lock}"
    return subprocess.run(["bash", "-c", cut], capture_output=True, text=True, timeout=60)


def test_pinned_versions_pass_and_any_other_fails(tmp_path):
    numpy, yaml = metadata.version("numpy"), metadata.version("pyyaml")
    lock = tmp_path / "ok.lock"
    lock.write_text(f"# generated\nnumpy=={numpy} \\\n    --hash=sha256:00\n    # via x\nPyYAML=={yaml} \\\n"
                    "    --hash=sha256:11\n")
    r = _pinned(lock)
    assert r.returncode == 0 and r.stderr == "", r.stderr

    lock.write_text(f"numpy==0.0.1 \\\n    --hash=sha256:00\nno-such-package==1.0\nPyYAML=={yaml}\n")
    r = _pinned(lock)
    assert r.returncode == 1
    assert r.stderr.splitlines() == [f"reward-envs: numpy==0.0.1: {numpy}",
                                     "reward-envs: no-such-package==1.0: not installed"], r.stderr
