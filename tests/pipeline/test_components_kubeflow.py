"""Every component folder passes kubeflow/pipelines-components' own metadata validator (vendored unmodified
under scripts/vendor/pipelines_components/): an OWNERS file with an approver, and a metadata.yaml with
exactly its fields (name, stability, dependencies, lastVerified; optional tags, ci, links), semver
dependency versions and a `lastVerified` timestamp within a year of today."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
VALIDATOR = ROOT / "scripts" / "vendor" / "pipelines_components" / "validate_metadata.py"
FOLDERS = sorted(p.parent for p in (ROOT / "components").glob("*/metadata.yaml"))

pytest.importorskip("semver", reason="the upstream validator needs semver (pip install -e '.[dev]')")


def _validate(folder: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(VALIDATOR), "--dir", str(folder)], capture_output=True,
                          text=True, timeout=120)


def test_every_component_folder_is_validated():
    assert len(FOLDERS) >= 11 and all((f / "component.py").is_file() for f in FOLDERS)


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_component_passes_the_upstream_validator(folder):
    r = _validate(folder)
    assert r.returncode == 0, r.stderr
    assert f"Validation successful for {folder}" in r.stdout


def test_the_validator_rejects_what_it_should(tmp_path):
    """The vendored validator still has teeth: a missing OWNERS, a date-only `lastVerified`, an extra field
    and a non-semver version each fail."""
    good = (ROOT / "components" / "train" / "metadata.yaml").read_text()
    owners = (ROOT / "components" / "train" / "OWNERS").read_text()
    cases = {
        "no_owners": (good, None),
        "date_only": (re.sub(r"lastVerified: .*", "lastVerified: '2026-11-23'", good), owners),
        "extra_field": (good.replace("stability:", "image: chunkgrpo-runtime\nstability:"), owners),
        "not_semver": (good.replace('">=2.15.0"', '">=2.15"'), owners),
    }
    for name, (meta, own) in cases.items():
        d = tmp_path / name
        d.mkdir()
        (d / "metadata.yaml").write_text(meta)
        if own is not None:
            (d / "OWNERS").write_text(own)
        assert meta != good or own is None, name  # the replacement took effect
        assert _validate(d).returncode == 1, name
