"""A tiny randomly initialised Mask2Former (transformers' real `Mask2FormerForUniversalSegmentation` with a
Swin backbone, 80 COCO labels) saved with its image processor, loadable by the GenEval transformers backend.

Random weights give near-uniform class probabilities (~1/81), which no GenEval threshold lets through.
`favour` sets the class head so that every query predicts one of the given classes with high probability
(which one depends on the query's random embedding): the masks, boxes and mask scores stay those of the
random network, so post-processing, thresholds, masks and the colour classifier all run on real outputs."""

from __future__ import annotations

from pathlib import Path
from typing import Sequence


def make_tiny_mask2former(folder: str | Path, class_names: Sequence[str], favour: Sequence[str] = (),
                          *, seed: int = 0, num_queries: int = 12) -> Path:
    import torch
    from transformers import Mask2FormerConfig, Mask2FormerForUniversalSegmentation, SwinConfig

    try:
        from transformers import Mask2FormerImageProcessorPil as Proc
    except ImportError:  # older transformers
        from transformers import Mask2FormerImageProcessor as Proc
    names = list(class_names)
    backbone = SwinConfig(
        image_size=64,
        patch_size=4,
        embed_dim=8,
        depths=[1, 1, 1, 1],
        num_heads=[1, 1, 1, 1],
        window_size=4,
        out_features=["stage1", "stage2", "stage3", "stage4"],
    )
    cfg = Mask2FormerConfig(
        backbone_config=backbone,
        feature_size=32,
        mask_feature_size=32,
        hidden_dim=32,
        encoder_feedforward_dim=32,
        dim_feedforward=32,
        encoder_layers=1,
        decoder_layers=2,
        num_attention_heads=2,
        num_queries=num_queries,
        num_labels=len(names),
        use_pretrained_backbone=False,
        backbone=None,
        id2label=dict(enumerate(names)),
        label2id={n: i for i, n in enumerate(names)},
    )
    torch.manual_seed(seed)
    model = Mask2FormerForUniversalSegmentation(cfg)
    if favour:
        head = model.class_predictor  # Linear(hidden_dim, num_labels + 1); the last logit is "no object"
        with torch.no_grad():
            head.weight.zero_()
            head.bias.zero_()
            direction = torch.randn(cfg.hidden_dim)
            direction = 40.0 * direction / direction.norm()
            for k, name in enumerate(favour):
                i = names.index(name)
                head.bias[i] = 8.0
                head.weight[i] = direction if k % 2 == 0 else -direction
    folder = Path(folder)
    model.save_pretrained(str(folder))
    Proc(size={"shortest_edge": 64, "longest_edge": 96}, size_divisor=32).save_pretrained(str(folder))
    return folder
