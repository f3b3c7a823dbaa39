"""Shared pytest fixtures. Integration fixtures (servers) live in tests/fixtures_*.py plugins."""

import os

from chunkgrpo import threads

threads.set_env_policy()  # the OpenMP wait policy (chunkgrpo.threads) before anything loads torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

pytest_plugins: list[str] = ["tests.fixtures_services", "tests.tiers", "tests.kfp_frames",
                              "tests.session_tmpdir"]

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


# The longest files (seconds of one xdist worker, `-n 2` on 2 cores, `benchmarks/test_suite_time.py`),
# longest first. README's command runs files on 2 workers in collection order (`--dist loadfile
# --no-loadscope-reorder`): starting these first keeps one worker from running a 5-minute file alone at the
# end. (xdist's default order, most tests first, put them last: they have few tests each.)
LONG_FILES_FIRST = (  # setup + call + teardown of the file's tests, 2 workers, 2026-11-29
    "tests/pipeline/test_local_run.py",  # 186 s: the clone's main job, the nightly
    "tests/unit/scoring/test_scorers_packages.py",  # 127 s
    "tests/pipeline/test_local_branching.py",  # 87 s
    "tests/integration/test_train_torchrun.py",  # 80 s
    "tests/pipeline/test_image_faithful.py",  # 78 s
    "tests/integration/test_availability.py",  # 70 s
    "tests/integration/test_reward_server_training.py",  # 60 s
    "tests/pipeline/test_local_interrupt.py",  # 59 s
    "tests/integration/test_session_interrupt.py",  # 59 s
    "tests/integration/registry/test_promoter_probe.py",  # 57 s
    "tests/integration/registry/test_promotion_integrity.py",  # 57 s
    "tests/unit/test_capacity.py",  # 56 s
    "tests/integration/test_sharded_load_torchrun.py",  # 56 s
    "tests/integration/test_torchrun_loopback.py",  # 49 s
    "tests/integration/test_checkpoint_policy_nodes.py",  # 48 s
    "tests/integration/test_evaluate_tracking_outage.py",  # 47 s
    "tests/integration/test_resume_s3_faults.py",  # 43 s
    "tests/integration/test_local_services.py",  # 41 s
)


def pytest_collection_modifyitems(config, items):
    """The files of LONG_FILES_FIRST first, in that order; every other file after them, as collected."""
    rank = {path: i for i, path in enumerate(LONG_FILES_FIRST)}
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], len(rank)))  # stable
