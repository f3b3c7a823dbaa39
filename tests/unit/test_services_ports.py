"""chunkgrpo.services.local_services: the free ports it picks for S3 and MLflow are distinct."""

import pytest

from chunkgrpo import processes
from chunkgrpo import services as ls


@pytest.fixture
def no_servers(monkeypatch):
    """LocalServices that starts nothing: the test is about the ports it is configured with."""
    seen = []

    def up(self):
        seen.append((self.config.s3_port, self.config.mlflow_port))
        return {}

    monkeypatch.setattr(ls.LocalServices, "up", up)
    monkeypatch.setattr(ls.LocalServices, "down", lambda self: [])
    monkeypatch.setattr(ls.LocalServices, "status", lambda self: {})
    return seen


def test_two_picked_ports_differ_even_when_the_kernel_offers_the_same_one_twice(monkeypatch, no_servers,
                                                                              tmp_path):
    # what happened in a CI run: two separate free_port() calls returned the same port (nothing held the
    # first one while the second was picked), and the session's services fixture failed for 40 tests
    monkeypatch.setattr(processes, "free_port", lambda: 32941)
    with ls.local_services(tmp_path):
        pass
    ((s3, mlflow),) = no_servers
    assert s3 != mlflow and 1024 <= s3 <= 65535 and 1024 <= mlflow <= 65535


def test_a_given_port_is_kept_and_never_picked_for_the_other(monkeypatch, no_servers, tmp_path):
    monkeypatch.setattr(ls, "_distinct_free_ports", lambda n: [40001, 40002, 40003][:n])
    with ls.local_services(tmp_path, s3_port=40001):
        pass
    with ls.local_services(tmp_path, mlflow_port=40001):
        pass
    assert no_servers == [(40001, 40002), (40002, 40001)]
