"""The fast tier stays honest (tests/tiers.py): a test without the integration marker cannot start a
server, torchrun or kfp.local, and cannot use the fixtures that do."""

import subprocess
import sys

import pytest

from tests import tiers


class _Item:
    nodeid = "tests/unit/test_x.py::test_y"

    def __init__(self, marked: bool):
        self.marked = marked
        self.fixturenames = ["tmp_path", "services_env"]

    def get_closest_marker(self, name):
        return object() if self.marked and name == "integration" else None


@pytest.mark.parametrize("argv, kind", [
    (["/home/u/.local/bin/weed", "mini", "-dir", "x"], "SeaweedFS"),
    ([sys.executable, "-m", "mlflow", "server", "--port", "5000"], "MLflow server"),
    ([sys.executable, "-m", "chunkgrpo.promoter", "--port", "1"], "the promoter"),
    (["torchrun", "--nproc_per_node=2", "-m", "chunkgrpo.train"], "torchrun"),
    ([sys.executable, "-m", "chunkgrpo.torchrun_local", "--standalone"], "torchrun"),
    (["sh", "-c", "python3 -m kfp.dsl.executor_main --executor_input {}"], "kfp.local task"),
    ("weed server -dir x", "SeaweedFS"),
    ([sys.executable, "-c", "print(1)"], None),
    (["git", "status"], None),
])
def test_launch_kind(argv, kind):
    assert tiers.launch_kind(argv) == kind


def test_an_unmarked_test_cannot_launch_and_a_marked_one_can():
    with pytest.raises(tiers.FastTierLaunchError, match="starts torchrun but is not marked `integration`"):
        tiers.check_launch(["torchrun", "-m", "chunkgrpo.train"], item=_Item(marked=False))
    tiers.check_launch(["torchrun", "-m", "chunkgrpo.train"], item=_Item(marked=True))
    tiers.check_launch([sys.executable, "-c", "pass"], item=_Item(marked=False))


def test_the_guard_is_installed_in_popen_for_this_unmarked_test(tmp_path):
    """This test has no marker: Popen refuses to start SeaweedFS before anything runs."""
    with pytest.raises(tiers.FastTierLaunchError, match="starts SeaweedFS"):
        subprocess.Popen([str(tmp_path / "weed"), "version"])
    assert subprocess.run([sys.executable, "-c", "print(2)"], capture_output=True, text=True).stdout == "2\n"


def test_the_service_fixtures_need_the_marker():
    with pytest.raises(tiers.FastTierLaunchError, match="uses services_env"):
        tiers.pytest_runtest_setup(_Item(marked=False))
    tiers.pytest_runtest_setup(_Item(marked=True))
