"""The `toy_geneval` training reward through the reward registry."""

import numpy as np
import pytest
import torch

from chunkgrpo.errors import UserError
from chunkgrpo.scoring.rewards import compute_rewards, get_reward
from chunkgrpo.scoring.table import REWARDS
from chunkgrpo.toy.world import World, metadata


def test_registered_and_exact_on_rendered_scenes():
    assert "toy_geneval" in REWARDS
    scenes = World(0).sample(24, seed=2)
    images = [s.image() for s in scenes]
    prompts = [s.prompt for s in scenes]
    for dense in ("true", "false", "graded"):
        r = get_reward("toy_geneval", {"dense": dense})(images, prompts)
        assert r.dtype == torch.float32 and r.shape == (24,)
        assert torch.equal(r, torch.ones(24))
    # shuffled captions: mostly wrong; sparse reward is 0/1, dense reward grades them
    shuffled = prompts[1:] + prompts[:1]
    sparse = get_reward("toy_geneval", {"dense": "false"})(images, shuffled)
    dense = get_reward("toy_geneval", {})(images, shuffled)
    assert set(sparse.tolist()) <= {0.0, 1.0} and sparse.mean() < 0.5
    assert (dense >= sparse).all() and (dense <= 1).all()
    assert ((dense > 0) & (dense < 1)).any()
    graded = get_reward("toy_geneval", {"dense": "graded"})(images, shuffled)
    assert torch.equal(graded == 1.0, sparse == 1.0)  # 1 exactly when correct by the rules
    assert (graded[sparse == 0] < 1).all() and (
        graded > dense
    ).float().mean() > 0.5  # finer than clause counts


def test_counting_reward_is_dense():
    w = World(0)
    rng = np.random.default_rng(0)
    images = [w.scene(metadata("counting", shape="circle", count=n), rng).image() for n in (1, 2, 3, 4)]
    r = get_reward("toy_geneval")(images, ["a photo of three circles"] * 4)
    assert r[2] == 1.0 and r[1] > r[0] and 0 < r[3] < 1


def test_bad_inputs_are_one_line_user_errors():
    fn = get_reward("toy_geneval")
    with pytest.raises(UserError, match="'a photo of a dog' is not a toy-world caption"):
        compute_rewards({"toy_geneval": fn}, [World(0).sample(1)[0].image()], ["a photo of a dog"])
    with pytest.raises(UserError, match="dense='maybe' must be false, true \\(clauses\\) or graded"):
        get_reward("toy_geneval", {"dense": "maybe"})
