"""HPDv2 test benchmark: the 400 prompts, fixed per-prompt seeds, scorer aggregation."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from PIL import Image

from chunkgrpo.errors import UserError
from chunkgrpo.eval import hpdv2 as H


def test_official_prompts():
    prompts = H.load_prompts()
    assert len(prompts) == 400 and H.is_official()
    assert prompts[0].startswith("Dwayne the Rock Johnson")
    items = H.plan(prompts)
    assert [it.seed for it in items[:3]] == [42, 43, 44] and items[399].filename == "399.png"
    assert len({it.seed for it in items}) == 400


def test_custom_prompt_file(tmp_path, monkeypatch):
    f = tmp_path / "p.txt"
    f.write_text("a cat\n\n a dog \nthe sea\n")
    assert H.load_prompts(f) == ["a cat", "a dog", "the sea"]
    assert not H.is_official(f)
    with pytest.raises(UserError, match="expected 400"):
        H.load_prompts(f, strict=True)
    with pytest.raises(UserError, match="does not exist"):
        H.load_prompts(tmp_path / "nope.txt")
    monkeypatch.setenv("CHUNKGRPO_DATA_DIR", str(tmp_path))
    (tmp_path / "hpdv2").mkdir()
    (tmp_path / "hpdv2" / "hpdv2_test_prompts_400.txt").write_text("\n".join(f"p{i}" for i in range(400)))
    assert H.load_prompts()[-1] == "p399"  # $CHUNKGRPO_DATA_DIR wins over the package data


def test_seeds():
    assert H.seed_for(0) == 42 and H.seed_for(5, base_seed=1000) == 1005
    with pytest.raises(UserError):
        H.seed_for(-1)
    assert [it.seed for it in H.plan(["a", "b"], base_seed=7)] == [7, 8]


def test_aggregate():
    infos = {"pickscore": {"name": "pickscore", "scale": "logit"}}
    res = H.aggregate({"pickscore": [1.0, 2.0, 3.0], "clip": torch.tensor([0.5, float("nan"), 0.7])},
                      infos, n_expected=3)
    p = res["scorers"]["pickscore"]
    assert (
        p["mean"] == 2.0 and p["std"] == pytest.approx(1.0) and p["stderr"] == pytest.approx(1 / math.sqrt(3))
    )
    assert p["info"]["scale"] == "logit" and p["n"] == 3
    c = res["scorers"]["clip"]
    assert c["n"] == 2 and c["n_nonfinite"] == 1 and c["mean"] == pytest.approx(0.6)
    assert res["complete"] and res["n_images"] == 3
    assert not H.aggregate({"x": [1.0]})["complete"]  # 1 of 400


def test_score_images_with_tiny_clip(tmp_path):
    from chunkgrpo.scoring.scorers import get_scorer
    from chunkgrpo.testing.clip import make_tiny_clip

    make_tiny_clip(tmp_path / "clip")
    scorers = {n: get_scorer(n, weights=str(tmp_path / "clip"), device="cpu") for n in ("clip", "pickscore")}
    rng = np.random.default_rng(0)
    prompts = ["a cat", "a dog", "the sea"]
    images = [Image.fromarray(rng.integers(0, 255, (32, 32, 3), dtype=np.uint8)) for _ in prompts]
    scores = H.score_images(images, prompts, scorers, batch_size=2)
    assert set(scores) == {"clip", "pickscore"} and all(len(v) == 3 for v in scores.values())
    res = H.aggregate(scores, {n: s.info for n, s in scorers.items()}, n_expected=3)
    assert res["complete"] and "preprocessing" in res["scorers"]["clip"]["info"]
    with pytest.raises(UserError, match="3 images for 2 prompts"):
        H.score_images(images, prompts[:2], scorers)
