"""`worker.load_state_strict` (issue 24 item 5): the scorer checkpoints load strictly, and a checkpoint
that does not fit fails in one line naming the keys (the real ImageReward package test, with its own
model class, is in test_scorers_packages.py)."""

from __future__ import annotations

import pytest
import torch

from chunkgrpo.scoring.backends import SpecError, load_state_strict


class _Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))


def test_a_full_checkpoint_loads_every_weight():
    src, dst = _Head(), _Head()
    load_state_strict(dst, src.state_dict(), "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values()))


def test_missing_weights_name_the_keys_in_one_line():
    state = {k: v for k, v in _Head().state_dict().items() if not k.startswith("mlp.")}
    with pytest.raises(SpecError) as e:
        load_state_strict(_Head(), state, "imagereward: checkpoint 'x.pt'")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == (
        "imagereward: checkpoint 'x.pt' does not fit the model: it lacks 4 of the model's 6 weights "
        "(mlp.0.bias, mlp.0.weight, mlp.2.bias, mlp.2.weight)"
    )


def test_extra_weights_and_shapes_are_refused():
    state = {**_Head().state_dict(), "text_decoder.w": torch.zeros(1)}
    with pytest.raises(SpecError, match=r"has 1 weights the model does not \(text_decoder.w\)"):
        load_state_strict(_Head(), state, "ckpt")
    bad = {**_Head().state_dict(), "body.weight": torch.zeros(5, 4)}
    with pytest.raises(
        SpecError, match=r"ckpt does not fit the model: .*body.weight.*size mismatch|size mismatch"
    ):
        load_state_strict(_Head(), bad, "ckpt")
    with pytest.raises(SpecError, match="not a state dict"):
        load_state_strict(_Head(), [1, 2], "ckpt")
