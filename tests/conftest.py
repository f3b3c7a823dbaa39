"""Shared pytest fixtures. Integration fixtures (servers) live in tests/fixtures_*.py plugins."""

import os

import chunkgrpo  # noqa: F401 - the thread policy (chunkgrpo.threads) before anything loads torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins: list[str] = ["tests.fixtures_services"]

import pytest  # noqa: E402


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A tiny random-weight FLUX pipeline folder, built once per test session."""
    from chunkgrpo.tiny import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("models") / "tiny-flux", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from chunkgrpo.flux import load_flux

    return load_flux(tiny_model_dir)
