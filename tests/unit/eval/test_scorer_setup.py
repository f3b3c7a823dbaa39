"""A scorer is labelled as the published metric only when it can be: programmatic rewards never, a CLIP-family
scorer only with the published architecture and trained (not initial) weights."""

from __future__ import annotations


def test_random_clip_is_not_labelled_the_published_metric(tmp_path):
    import torch
    from transformers import CLIPConfig

    from chunkgrpo.eval.scorer_setup import _published, clip_published_check
    from chunkgrpo.scoring.scorers import get_scorer
    from chunkgrpo.testing.clip import make_tiny_clip

    tiny = get_scorer("clip", weights=make_tiny_clip(tmp_path / "clip"), device="cpu")
    ok, why = _published("clip", tiny)
    assert not ok and "is not VIT-H-14" in why
    # the published ViT-H/14 architecture with its logit scale still at the initial value = random weights
    vit_h = CLIPConfig(vision_config={"hidden_size": 1280, "num_hidden_layers": 32, "patch_size": 14,
                                      "num_attention_heads": 16},
                       text_config={"hidden_size": 1024, "num_attention_heads": 16})

    class Model:  # architecture only: a real ViT-H/14 would not fit the test budget
        config = vit_h
        logit_scale = torch.tensor(vit_h.logit_scale_init_value)

    assert "random" in clip_published_check(Model(), "vit-h-14")
    Model.logit_scale = torch.tensor(4.6052)  # trained CLIP-family checkpoints end at ln(100)
    assert clip_published_check(Model(), "vit-h-14") is None
    assert "not VIT-L-14" in clip_published_check(Model(), "vit-l-14")


def test_programmatic_rewards_are_never_published():
    from chunkgrpo.eval.scorer_setup import _published, _scorer_info
    from chunkgrpo.scoring.adapters import RewardScorer

    s = RewardScorer("brightness", {})
    assert _published("brightness", s) == (
        False,
        "brightness is a programmatic reward, not a published metric",
    )
    info = _scorer_info(s, "brightness")
    assert info["comparable_to_official"] is False and "programmatic" in info["not_published_because"]
