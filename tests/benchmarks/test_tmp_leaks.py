"""benchmarks/tmp_leaks.py: names grouped without their random tails, and what it counts in a temp folder
(top level, the test session's own TMPDIR once, the local runs' volume folders without their caches)."""

import os

import pytest

from tests import benchmark_scripts


@pytest.fixture(scope="module")
def leaks():
    return benchmark_scripts.load("tmp_leaks")


@pytest.mark.parametrize("name,kind", [
    ("chunkgrpo-train-a1b2c3d4", "chunkgrpo-train"), ("chunkgrpo-train-abcdefgh", "chunkgrpo-train"),
    ("kfp-workspace-x8_kq2ab", "kfp-workspace"), ("torchelastic_ymn_4w7a", "torchelastic"),
    ("chunkgrpo-clip-worker-k2j3l4m5.log", "chunkgrpo-clip-worker"), ("tmpab12cd34", "tmp"),
    ("tmp.6fnpvoQzqD", "tmp.*"), ("weed.vm.root.log.INFO.20261129-021920.14706", "weed.vm.root.log.INFO"),
    ("seaweedfs-volume-grpc-12345.sock", "seaweedfs-volume-grpc"),
    ("torchinductor_root", "torchinductor_root"),
])
def test_kind(leaks, name, kind):
    assert leaks.kind(name) == kind


def test_leftovers(leaks, tmp_path):
    (tmp_path / "chunkgrpo-eval-a1b2c3d4").mkdir()
    base = tmp_path / "pytest-of-u" / "pytest-3"
    (base / "tmp" / "torchelastic_ab12cd34").mkdir(parents=True)
    os.symlink(base, tmp_path / "pytest-of-u" / "pytest-current")  # counted once
    cache = base / "user0" / "repo" / ".chunkgrpo" / "pod-volumes" / "cache"
    for name in ("chunkgrpo", "inductor", ".config", "chunkgrpo-eval-x1y2z3w4"):
        (cache / name).mkdir(parents=True)
    found = leaks.leftovers(tmp_path)
    assert found["top"] == ["chunkgrpo-eval-a1b2c3d4"] and found["session"] == ["torchelastic_ab12cd34"]
    assert found["volumes"] == ["pytest-of-u/pytest-3/user0/repo/.chunkgrpo/pod-volumes/cache/"
                                "chunkgrpo-eval-x1y2z3w4"]
