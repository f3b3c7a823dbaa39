"""Every component folder follows kubeflow/pipelines-components' convention (tests/component_metadata.py):
an OWNERS file with an approver, and a metadata.yaml with exactly its fields (name, stability,
dependencies, lastVerified; optional tags, ci, links), semantic dependency versions and a `lastVerified`
timestamp within a year of today."""

import datetime as dt
import re
from pathlib import Path

import pytest

from tests.component_metadata import problems

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = sorted(p.parent for p in (ROOT / "components").glob("*/metadata.yaml"))


def test_every_component_folder_is_checked():
    assert len(FOLDERS) >= 11 and all((f / "component.py").is_file() for f in FOLDERS)


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_component_follows_the_convention(folder):
    assert problems(folder) == []


def test_the_check_rejects_what_it_should(tmp_path):
    """The checker has teeth: each broken variant of a good folder is refused, naming what is wrong."""
    good = (ROOT / "components" / "train" / "metadata.yaml").read_text()
    owners = (ROOT / "components" / "train" / "OWNERS").read_text()
    cases = {
        "no OWNERS": (good, None),
        "not a timestamp": (re.sub(r"lastVerified: .*", "lastVerified: '2026-11-23'", good), owners),
        "fields": (good.replace("stability:", "image: chunkgrpo-runtime\nstability:"), owners),
        "not semantic": (good.replace('">=2.15.0"', '">=2.15"'), owners),
        "no approver": (good, "reviewers:\n- someone\n"),
        "stability": (re.sub(r"stability: .*", "stability: final", good), owners),
    }
    for want, (meta, own) in cases.items():
        d = tmp_path / want.replace(" ", "-")
        d.mkdir()
        (d / "metadata.yaml").write_text(meta)
        if own is not None:
            (d / "OWNERS").write_text(own)
        assert meta != good or own != owners, want  # the change took effect
        found = problems(d)
        assert found and any(want in p for p in found), (want, found)


def test_last_verified_expires_after_a_year():
    folder = ROOT / "components" / "train"
    later = dt.datetime.now(dt.timezone.utc) + dt.timedelta(days=400)
    assert any("a year or more" in p for p in problems(folder, today=later))
