"""Every name a reward or a scorer is known by: what `rewards: [{name: ...}]` in a train config and
`scorers: [...]` in an eval config accept.

Two kinds of names:

- **programmatic rewards** (`REWARDS`): deterministic functions of the pixels (and the caption), no weights.
  Each entry names its factory by `"module:attr"` (imported when the reward is built, so this table
  imports nothing): `factory(**options) -> fn(images, prompts) -> float32 tensor (n,)`. Training uses
  them directly; evaluation wraps them as scorers (`chunkgrpo.scoring.adapters.RewardScorer`).
- **model scorers** (`SCORERS`): learned reward / preference models built by
  `chunkgrpo.scoring.scorers.get_scorer(name, weights=...)` from a local folder or an `s3://` prefix.
  Training wraps them as rewards (`chunkgrpo.scoring.adapters.ScorerReward`). The ones with a `pip`
  entry need a reward package whose pins conflict with the main stack: they run in their own venv
  (`$CHUNKGRPO_VENV_<NAME>`, see `chunkgrpo.scoring.client`). Scorer names are case-insensitive and
  have aliases (`canonical_name`).

A programmatic reward wins over a scorer of the same name (there is none today). Tests may register a
factory directly: `REWARDS["mine"] = factory`. Any other name is a user's reward or scorer: an import path
`module:attr` or an installed package's entry point (groups `chunkgrpo.rewards`, `chunkgrpo.scorers`),
resolved by `chunkgrpo.scoring.custom`.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib
from collections.abc import Callable

from chunkgrpo.errors import UserError


@dataclasses.dataclass(frozen=True)
class RewardEntry:
    """A programmatic reward: `target` = "module:attr" of its factory; `about` = what it measures, one
    line (evaluation records it as the scorer's scale)."""

    target: str
    about: str


@dataclasses.dataclass(frozen=True)
class ScorerEntry:
    """A model scorer: `about` = what `score` returns; `aliases` also accepted; `pip` = the reward package
    (and what it needs) to install in the scorer's own venv, None when it runs on the main stack."""

    about: str
    aliases: tuple[str, ...] = ()
    pip: str | None = None


REWARDS: dict[str, RewardEntry | Callable] = {
    "brightness": RewardEntry("chunkgrpo.scoring.rewards:brightness",
                         "Mean luminance in [0, 1]; with `target`, 1 − |luminance − target|."),
    "color": RewardEntry("chunkgrpo.scoring.rewards:color",
                    "1 − ‖mean colour − rgb‖ / √3 (colours in [0, 1])."),
    "contrast": RewardEntry("chunkgrpo.scoring.rewards:contrast",
                       "Pixel standard deviation (a crude 'detail' reward)."),
    "toy_geneval": RewardEntry("chunkgrpo.toy.reward:toy_geneval_reward",
                          "GenEval correctness of a toy-world image for its caption (exact detector); "
                          "dense=true: partial credit."),
}

SCORERS: dict[str, ScorerEntry] = {
    "hpsv3": ScorerEntry("mu of HPSv3's predicted (mu, sigma); FLUX.1-dev ~10-11",
                    pip="hpsv3 matplotlib tensorboard"),
    "imagereward": ScorerEntry("ImageReward's standardised reward (r - 0.1672) / 1.0333",
                          aliases=("image_reward", "image-reward"), pip="image-reward openai-clip fairscale"),
    "hpsv2.1": ScorerEntry("cosine of HPSv2.1's open_clip ViT-H-14 features (~0.2-0.37)",
                      aliases=("hpsv2_1", "hpsv21", "hps"), pip="hpsv2"),
    "hpsv2": ScorerEntry("cosine of HPSv2.0's open_clip ViT-H-14 features", pip="hpsv2"),
    "pickscore": ScorerEntry("logit_scale.exp() x cosine, the raw PickScore logit (FLUX ~22-23)",
                        aliases=("pick", "pick_score")),
    "clip": ScorerEntry("cosine of L2-normalised CLIP embeddings (x multiplier)",
                        aliases=("clipscore", "clip_score")),
}

SCORER_NAMES = tuple(SCORERS)
PACKAGE_SCORERS = tuple(name for name, s in SCORERS.items() if s.pip)
ALIASES = {alias: name for name, s in SCORERS.items() for alias in s.aliases}


def canonical_name(name: str) -> str:
    """The scorer a name means (case-insensitive, aliases resolved); UserError naming the known ones."""
    key = str(name).strip().lower()
    key = ALIASES.get(key, key)
    if key not in SCORERS:
        close = difflib.get_close_matches(key, SCORER_NAMES, n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise UserError(f"unknown scorer {name!r}{hint}; known: {', '.join(SCORER_NAMES)}")
    return key


def known_names() -> list[str]:
    """Every name `rewards:` accepts (programmatic rewards, then scorers)."""
    return sorted(REWARDS) + list(SCORER_NAMES)


def _load(target: str) -> Callable:
    module, _, attr = target.partition(":")
    return getattr(importlib.import_module(module), attr)


def reward_about(name: str) -> str:
    """One line on what programmatic reward `name` measures (its factory's first doc line when it was
    registered as a bare factory)."""
    entry = REWARDS[name]
    if isinstance(entry, RewardEntry):
        return entry.about
    doc = (entry.__doc__ or "").strip().splitlines()
    return doc[0] if doc else ""


def build_reward(name: str, options: dict | None = None) -> Callable:
    """The programmatic reward `name` built with `options`: fn(images, prompts) -> float32 tensor (n,)."""
    options = dict(options or {})
    entry = REWARDS[name]
    factory = _load(entry.target) if isinstance(entry, RewardEntry) else entry
    try:
        return factory(**options)
    except TypeError as e:
        raise UserError(f"reward {name!r}: bad options {options} ({e})") from None
