"""Session-scoped real local services (SeaweedFS S3 + MLflow) for integration tests.

    def test_x(services):            # started once per session on free ports in a tmp dir
        store = ArtifactStore(services.store_config)
        services.env                 # CHUNKGRPO_S3_ENDPOINT, AWS_*, MLFLOW_TRACKING_URI, ...

    def test_y(services_env):        # the same, with services.env applied to os.environ for the test

Servers are stopped at the end of the session, also when tests fail (context manager + atexit).
"""

from __future__ import annotations

import atexit
import dataclasses
from pathlib import Path

import pytest


@dataclasses.dataclass
class Services:
    home: Path
    env: dict[str, str]
    store_config: object  # chunkgrpo.store.StoreConfig
    local: object         # chunkgrpo.local_services.LocalServices

    @property
    def tracking_uri(self) -> str:
        return self.env["MLFLOW_TRACKING_URI"]


def _need_weed() -> None:
    from chunkgrpo.errors import UserError
    from chunkgrpo.local_services import weed_binary

    try:
        weed_binary()
    except UserError as e:
        pytest.skip(str(e))


@pytest.fixture(scope="session")
def services(tmp_path_factory):
    """Real weed mini + mlflow server on free 127.0.0.1 ports, for the whole session."""
    _need_weed()
    from chunkgrpo.local_services import local_services

    home = tmp_path_factory.mktemp("chunkgrpo-services")
    with local_services(home) as svc:
        atexit.register(svc.down)  # belt and braces if the session is interrupted hard
        yield Services(home=home, env=svc.env(), store_config=svc.store_config(), local=svc)
        atexit.unregister(svc.down)


@pytest.fixture
def services_env(services, monkeypatch):
    """`services`, with its env vars set in os.environ for the duration of one test."""
    for key, value in services.env.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MLFLOW_DISABLE_TELEMETRY", "true")
    return services
