from dataclasses import dataclass

import pytest

from chunkgrpo.config import Config, describe, option
from chunkgrpo.errors import UserError
from chunkgrpo.rollout import SamplingConfig


@dataclass
class Outer(Config):
    name: str = option("x", "a name")
    lr: float = option(1e-5, "learning rate")
    sizes: list[int] = option([2, 3], "chunk sizes")
    sampling: SamplingConfig = option(factory=SamplingConfig, help="nested")


def test_yaml_and_overrides(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("name: base\nlr: 0.001\nsampling:\n  eta: 0.3\n  rule: dance\n")
    cfg = Outer.load(p, ["sampling.num_steps=17", "sizes=4,4", "lr=2e-6"])
    assert cfg.name == "base" and cfg.lr == 2e-6 and cfg.sizes == [4, 4]
    assert cfg.sampling.eta == 0.3 and cfg.sampling.rule == "dance" and cfg.sampling.num_steps == 17
    assert Outer.from_dict(cfg.to_dict()) == cfg


def test_unknown_key_suggests_and_types_are_checked():
    with pytest.raises(UserError, match="did you mean sampling.eta"):
        Outer.load({}, ["sampling.etaa=1"])
    with pytest.raises(UserError, match="lr='fast' is not a number"):
        Outer.load({}, ["lr=fast"])
    with pytest.raises(UserError, match="sampling.rule='ddim' is not one of"):
        Outer.load({}, ["sampling.rule=ddim"])
    with pytest.raises(UserError, match="neither a file nor a preset"):
        Outer.load("no_such_preset")


def test_every_field_documented():
    text = describe(Outer)
    assert "sampling.eta" in text and "learning rate" in text
    with pytest.raises(TypeError):
        option(1)
