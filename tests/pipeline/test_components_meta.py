"""Every component folder is laid out like kubeflow/pipelines-components: component.py, README.md,
metadata.yaml (stability, KFP/Trainer version constraints, tags), OWNERS and its own unit + local tests."""

from pathlib import Path

import pytest
import yaml

COMPONENTS = Path(__file__).resolve().parents[2] / "components"
FOLDERS = sorted(p.parent for p in COMPONENTS.glob("*/component.py"))


def test_there_are_components():
    assert {p.name for p in FOLDERS} >= {
        "evaluate",
        "launch_trainjob",
        "models",
        "plan",
        "preflight",
        "profile",
        "promote",
        "register",
        "tracking",
        "train",
    }


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_component_folder_layout_and_metadata(folder):
    meta = yaml.safe_load((folder / "metadata.yaml").read_text())
    assert meta["name"] == folder.name and meta["stability"] in ("alpha", "beta", "stable")
    assert meta["tags"] and meta["lastVerified"]
    deps = {d["name"]: d["version"] for d in meta["dependencies"]["kubeflow"]}
    from pipeline.compile import OLDEST_KFP

    assert deps["Pipelines"] == f">={OLDEST_KFP}.0"  # semver, as the upstream validator requires
    if folder.name == "launch_trainjob":
        assert deps["Trainer"] == ">=2.2.0" and deps["Training Operator"] == ">=1.9.0"
    assert "@dsl.component" in (folder / "component.py").read_text()
    assert (folder / "README.md").read_text().startswith("# ")
    assert "approvers:" in (folder / "OWNERS").read_text()
    for kind in ("unit", "local"):
        test = folder / "tests" / f"test_component_{kind}.py"
        assert test.exists(), test
        text = test.read_text()
        assert "def test_" in text
        if kind == "local":
            assert "pytest.mark.integration" in text
