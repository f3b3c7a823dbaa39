"""The HPDv2 scorers of the evaluate stage: built from the config, checked before generation, and judged
against the published metrics (a random or tiny CLIP is never labelled as the published metric).

- `build_scorers(cfg)`: name → object with `score(images, prompts)` and `info` (programmatic rewards
  through `chunkgrpo.scoring.adapters.RewardScorer`, the eval scorers through
  `chunkgrpo.scoring.scorers.get_scorer`).
- `check_scorers(cfg)`: weights set (local ones exist), scorer packages importable.
- `_published` / `_scorer_info` / `clip_published_check`: is a scorer (or GenEval's colour classifier)
  the published model of its name?
"""

from __future__ import annotations

from typing import Any

from chunkgrpo.errors import UserError
from chunkgrpo.eval.config import EvalConfig
from chunkgrpo.scoring.adapters import RewardScorer
from chunkgrpo.scoring.custom import is_builtin
from chunkgrpo.scoring.table import REWARDS, canonical_name

OFFICIAL_SCORERS = ("hpsv3", "imagereward", "hpsv2.1", "hpsv2", "pickscore", "clip")


def build_scorers(cfg: EvalConfig) -> dict[str, Any]:
    """name → object with `score(images, prompts)` and `info`."""
    out: dict[str, Any] = {}
    for name in cfg.scorers:
        opts = dict(cfg.scorer_options.get(name) or {})
        if name in REWARDS or not is_builtin(name):  # programmatic, or a user's scorer (custom)
            out[name] = RewardScorer(name, opts, "scorer")
            continue
        from chunkgrpo.scoring.scorers import get_scorer

        canon = canonical_name(name)
        weights = cfg.scorer_weights.get(name) or cfg.scorer_weights.get(canon) or opts.pop("weights", None)
        if not weights:
            raise UserError(
                f"scorer {canon!r} needs weights: set scorer_weights.{canon}=DIR (or an s3:// prefix)"
            )
        opts.setdefault("device", cfg.scorer_device)
        if cfg.cache_dir:
            opts.setdefault("cache_dir", cfg.cache_dir)
        out[canon] = get_scorer(canon, weights=weights, **opts)
    return out


def check_scorers(cfg: EvalConfig) -> None:
    """Fail before generation: every HPDv2 scorer has weights (local paths exist) and its package imports."""
    from chunkgrpo.scoring.scorers import require_package
    from chunkgrpo.scoring.weights import resolve_weights

    packages = {"hpsv3": ("hpsv3", "hpsv3"), "imagereward": ("ImageReward", "image-reward"),
                "hpsv2.1": ("hpsv2", "hpsv2"), "hpsv2": ("hpsv2", "hpsv2")}
    for name in cfg.scorers:
        if name in REWARDS or not is_builtin(name):
            continue
        canon = canonical_name(name)
        weights = (cfg.scorer_weights.get(name) or cfg.scorer_weights.get(canon)
                   or (cfg.scorer_options.get(name) or {}).get("weights"))
        if not weights:
            raise UserError(
                f"scorer {canon!r} needs weights: set scorer_weights.{canon}=DIR (or an s3:// prefix)"
            )
        if not str(weights).startswith("s3://"):
            resolve_weights(weights, what=canon)
        if canon in packages:
            require_package(packages[canon][0], canon, packages[canon][1])


# The published CLIP-family metrics use ViT-H/14 (PickScore_v1; the DFN5B / laion CLIP score of the
# DanceGRPO lineage); GenEval's colour classifier is CLIP ViT-L/14 "openai".
_CLIP_ARCH = {"vit-h-14": {"vision_hidden": 1280, "vision_layers": 32, "patch": 14, "text_hidden": 1024},
              "vit-l-14": {"vision_hidden": 1024, "vision_layers": 24, "patch": 14, "text_hidden": 768}}
_PUBLISHED_ARCH = {"clip": "vit-h-14", "pickscore": "vit-h-14"}


def clip_published_check(model, arch: str) -> str | None:
    """Why a transformers CLIPModel is NOT the published model of architecture `arch` (None if it may be):
    a different size, or a logit scale still at its initial value (untrained / random weights)."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "vision_config"):
        return "not a CLIP model"
    want = _CLIP_ARCH[arch]
    v, t = cfg.vision_config, cfg.text_config
    have = {"vision_hidden": v.hidden_size, "vision_layers": v.num_hidden_layers, "patch": v.patch_size,
            "text_hidden": t.hidden_size}
    if have != want:
        return (f"architecture (vision width {have['vision_hidden']}, {have['vision_layers']} layers, patch "
                f"{have['patch']}; text width {have['text_hidden']}) is not {arch.upper()}")
    scale = getattr(model, "logit_scale", None)
    init = getattr(cfg, "logit_scale_init_value", None)
    if scale is not None and init is not None and abs(float(scale) - float(init)) < 1e-6:
        return f"logit_scale is still its initial value {float(init):g}: untrained (random) weights"
    return None


def _published(name: str, scorer) -> tuple[bool, str]:
    """Is this scorer the published metric of that name? (flag, reason when not)."""
    if isinstance(scorer, RewardScorer):
        return False, f"{name} is a programmatic reward, not a published metric"
    info = getattr(scorer, "info", {}) or {}
    if info.get("name", name) not in OFFICIAL_SCORERS:
        return False, f"{name} is not one of the published metrics ({', '.join(OFFICIAL_SCORERS)})"
    if info.get("published") is False or info.get("random_weights"):
        return False, str(info.get("published_note") or f"{name} runs random / non-published weights")
    arch = _PUBLISHED_ARCH.get(info.get("name", name))
    if arch is not None:
        model = getattr(scorer, "model", None)
        why = clip_published_check(model, arch) if model is not None else "model not inspectable"
        if why:
            return False, f"{name}: {why}"
    return True, ""


def _scorer_info(scorer, name: str | None = None) -> dict:
    info = dict(scorer.info)
    ok, why = _published(name or info.get("name", ""), scorer)
    info["comparable_to_official"] = ok
    if not ok:
        info["not_published_because"] = why
    return info

