"""scripts/serving_requirements.py: a registered version's requirements.txt and python_env.yaml, as the
registry holds them, resolve with pip's resolver (no index) from the project's environment and its own
wheel, alone and together with the project; a pin nothing provides, an unpinned line, another Python or a
folder that is no MLflow model are refused."""

from __future__ import annotations

import json
import shutil
import sys
import uuid
import zipfile
from email.parser import BytesParser
from importlib import metadata

import pytest

from scripts import serving_requirements as sr


def test_metadata_wheel_carries_what_a_resolver_reads(tmp_path):
    wheel = sr.metadata_wheel(metadata.distribution("packaging"), tmp_path)
    assert wheel.name == f"packaging-{metadata.version('packaging')}-py3-none-any.whl"
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        md = BytesParser().parsebytes(z.read(next(n for n in names if n.endswith("METADATA"))))
    assert md["Name"] == "packaging" and md["Version"] == metadata.version("packaging")
    assert any(n.endswith("RECORD") for n in names) and any(n.endswith("WHEEL") for n in names)
    mlflow_md = sr.metadata_wheel(metadata.distribution("mlflow"), tmp_path)
    with zipfile.ZipFile(mlflow_md) as z:
        body = z.read(next(n for n in z.namelist() if n.endswith("METADATA")))
    requires = BytesParser().parsebytes(body).get_all("Requires-Dist")
    assert requires == metadata.distribution("mlflow").metadata.get_all("Requires-Dist")


def test_lock_pins_read_the_image_locks():
    pins = sr.lock_pins()
    assert "images/eval/requirements-torch.lock" in pins
    assert pins["images/eval/requirements-torch.lock"]["numpy"].count(".") == 2


def _model(tmp_path, requirements: str, python: str | None = None):
    folder = tmp_path / "m"
    folder.mkdir()
    (folder / "requirements.txt").write_text(requirements)
    py = python or f"{sys.version_info.major}.{sys.version_info.minor}.7"
    (folder / "python_env.yaml").write_text(f"python: {py}\nbuild_dependencies:\n- pip\n"
                                            "dependencies:\n- -r requirements.txt\n")
    return folder


def test_bad_models_are_refused_in_one_line(tmp_path, capsys):
    assert sr.main([str(tmp_path)]) == 2
    assert "not an MLflow model folder" in capsys.readouterr().err
    assert sr.main([str(_model(tmp_path, "numpy>=1\n"))]) == 2
    assert "not pinned to a public version: ['numpy>=1']" in capsys.readouterr().err
    shutil.rmtree(tmp_path / "m")
    assert sr.main([str(_model(tmp_path, "numpy==2.0\n", python="3.9.1"))]) == 2
    assert "asks for Python '3.9.1'" in capsys.readouterr().err


@pytest.fixture(scope="module")
def wheelhouse(tmp_path_factory):
    house = tmp_path_factory.mktemp("wheelhouse")
    held = sr.build_wheelhouse(house)
    assert held["chunkgrpo"] and held["mlflow"] == metadata.version("mlflow")
    assert len(list(house.glob("chunkgrpo-*.whl"))) == 1
    return house


@pytest.mark.integration
def test_registered_versions_requirements_resolve(services_env, wheelhouse, tmp_path):
    from chunkgrpo.registry.registration import Registration, register_model

    weights = tmp_path / "lora"
    weights.mkdir()
    (weights / "pytorch_lora_weights.safetensors").write_bytes(bytes([3]) * 1024)
    name = f"serve-{uuid.uuid4().hex[:6]}"
    v = register_model(Registration(name, "tiny-flux", weights, kind="lora"))
    out = sr.check(f"models:/{name}/{v.version}", wheelhouse=wheelhouse)
    json.dumps(out)
    assert out["pins_kept"] is True
    assert out["requirements"]["mlflow"] == metadata.version("mlflow")
    assert {"torch", "diffusers", "peft", "pandas"} <= set(out["requirements"])
    # the pins pull their own dependencies; the project adds its own on top
    assert out["resolved"]["requirements"] > len(out["requirements"])
    assert out["resolved"]["with_project"] > out["resolved"]["requirements"]


@pytest.mark.integration
def test_a_pin_nothing_provides_is_refused(wheelhouse, tmp_path):
    with pytest.raises(sr.Refused, match="numpy==0.0.1"):
        sr.resolve(["numpy==0.0.1", "pandas"], wheelhouse, tmp_path, "bad")
