"""Fixtures for the per-component tests (components/<name>/tests/): the real local services and the
tiny model of tests/, plus a kfp.local SubprocessRunner (as kubeflow/pipelines-components does)."""

import os

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")

pytest_plugins = ["tests.fixtures_services", "tests.tiers", "tests.kfp_frames", "tests.session_tmpdir"]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from chunkgrpo.testing.tiny import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("models") / "tiny-flux", seed=0)


@pytest.fixture
def local_runner(tmp_path, services_env, monkeypatch):
    """kfp.local with tasks run in this venv (no pip), outputs under tmp_path, the services' env set; the
    tasks' TMPDIR is under tmp_path too (kfp leaves a `tmp.*` folder of each task's program there)."""
    import warnings

    from kfp import local

    (tmp_path / "tmpdir").mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmpdir"))

    local.init(
        runner=local.SubprocessRunner(use_venv=False),
        pipeline_root=str(tmp_path / "kfp"),
        workspace_root=str(tmp_path / "kfp-workspace"),  # else kfp.local makes one in $TMPDIR and keeps it
        raise_on_error=True,
    )
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*have no effect in the current local runner.*")
        warnings.filterwarnings("ignore", message=".*custom or non-Python base image.*")
        yield services_env


@pytest.fixture
def text_artifact():
    """A tiny lightweight component that turns text into an output artifact (to feed Input[...] locally)."""
    from kfp import dsl
    from kfp.dsl import Artifact, Output

    @dsl.component(base_image="python:3.11", install_kfp_package=False)
    def make_artifact(text: str, out: Output[Artifact]):
        with open(out.path, "w") as f:
            f.write(text)

    return make_artifact


class FakeArtifact:
    """Stands in for a KFP Input/Output artifact in unit tests (`component.python_func(...)`)."""

    def __init__(self, path, text=None):
        from pathlib import Path

        self.path = str(path)
        self.uri = str(path)
        self.metadata = {}
        self.metrics = {}
        if text is not None:
            Path(path).write_text(text)

    def log_metric(self, name, value):
        self.metrics[name] = value


@pytest.fixture
def artifact(tmp_path):
    """artifact(name, text=None) -> a FakeArtifact at tmp_path/name."""
    return lambda name, text=None: FakeArtifact(tmp_path / name, text)


def tiny_profile(num_steps: int = 16) -> dict:
    """A syntactically complete dynamics profile (what the profile step writes) for plan tests."""
    import math

    sigmas = [1 - i / num_steps for i in range(num_steps + 1)]
    l1rel = [0.05 + 0.04 * math.sin(i / 2.0) ** 2 for i in range(num_steps)]
    return {"sigmas": sigmas, "timesteps": [s * 1000 for s in sigmas[:-1]], "l1rel": l1rel,
            "l1rel_std": [0.01] * num_steps, "samples": 2}
