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
    from chunkgrpo.testing.tiny import build_tiny_flux

    return build_tiny_flux(tmp_path_factory.mktemp("models") / "tiny-flux", seed=0)


@pytest.fixture(scope="session")
def tiny_model(tiny_model_dir):
    from chunkgrpo.flux import load_flux

    return load_flux(tiny_model_dir)


@pytest.fixture(autouse=True)
def _mlflow_http_env_restored():
    """`registry.client.connect` sets process-wide defaults for MLflow's HTTP retries/timeouts (right for a
    CLI process, which registers or promotes once); tests share one process, so each test gets the variables
    back as they were — a test asserting the tracker restores them does not depend on test order."""
    def ours(k: str) -> bool:
        return k.startswith("MLFLOW_HTTP_REQUEST_") or k == "MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR"

    before = {k: os.environ[k] for k in os.environ if ours(k)}
    yield
    for k in [k for k in os.environ if ours(k)]:
        if k not in before:
            del os.environ[k]
    os.environ.update(before)
