"""A sharded checkpoint's `dcp/.metadata` is a pickle and its non-tensor items are `torch.load`ed: both
are read as data only, so a planted payload is refused and never runs."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
import torch.distributed.checkpoint as dcp

from chunkgrpo.train import checkpoint_sharded as sharded


def _write(folder):
    state = {"model": {"w": torch.arange(6.0).reshape(2, 3)},
             "optim": {"param_groups": [{"lr": 0.01, "betas": (0.9, 0.999), "params": ["w"]}],
                       "state": {"w": {"step": torch.tensor(3.0), "exp_avg": torch.ones(2, 3)}}}}
    dcp.save(state, checkpoint_id=str(folder / sharded.DCP_DIR), no_dist=True)
    return state


def test_a_written_checkpoint_reads_back_through_the_restricted_reader(tmp_path):
    state = _write(tmp_path)
    into = {"model": {"w": torch.zeros(2, 3)},
            "optim": {"param_groups": [{"lr": 0.0, "betas": (0.0, 0.0), "params": ["w"]}],
                      "state": {"w": {"step": torch.tensor(0.0), "exp_avg": torch.zeros(2, 3)}}}}
    dcp.load(into, storage_reader=sharded._reader(tmp_path / sharded.DCP_DIR), planner=sharded._planner(),
             no_dist=True)
    assert torch.equal(into["model"]["w"], state["model"]["w"])
    assert into["optim"]["param_groups"][0]["lr"] == 0.01 and into["optim"]["state"]["w"]["step"] == 3


class Payload:
    def __reduce__(self):
        return (os.system, ("echo planted > planted.txt",))


def test_a_planted_metadata_pickle_is_refused_never_run(tmp_path, monkeypatch):
    _write(tmp_path)
    monkeypatch.chdir(tmp_path)
    (tmp_path / sharded.METADATA).write_bytes(pickle.dumps(Payload()))
    with pytest.raises(pickle.UnpicklingError, match="posix.system is not allowed|os.system is not allowed"):
        sharded._reader(tmp_path / sharded.DCP_DIR).read_metadata()
    assert not (tmp_path / "planted.txt").exists()
