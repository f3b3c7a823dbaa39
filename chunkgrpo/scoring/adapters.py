"""The two adapters between rewards and scorers, one per direction.

- `ScorerReward(scorer)`: a model scorer (`chunkgrpo.scoring.scorers.Scorer`) as a training reward:
  `reward(images, prompts) -> float32 tensor (n,)` on CPU; `close()` stops the scorer's worker process.
- `RewardScorer(name, options)`: a programmatic reward (`chunkgrpo.scoring.table.REWARDS`, or a
  user's: `chunkgrpo.scoring.custom`) as an evaluation scorer: `score(images, prompts)` and `info`
  (name, options, scale = the table's line).

Neither imports torch: the tensors come from the wrapped objects.
"""

from __future__ import annotations

from chunkgrpo.scoring.custom import build
from chunkgrpo.scoring.table import REWARDS, build_reward, reward_about


class ScorerReward:
    """An evaluation scorer as a training reward; `close()` stops its worker process (if it has one)."""

    def __init__(self, scorer) -> None:
        self.scorer = scorer

    def __call__(self, images, prompts):
        return self.scorer.score(list(images), list(prompts)).float().cpu()

    def close(self) -> None:
        self.scorer.close()


class RewardScorer:
    """A programmatic reward as an evaluation scorer (never a published metric)."""

    def __init__(self, name: str, options: dict, kind: str = "reward") -> None:
        self.name = name
        builtin = name in REWARDS
        self.fn = build_reward(name, options) if builtin else build(name, options, kind)
        source = None if builtin else self.fn.resolved.source
        self.info = {
            "name": name,
            "backend": f"user {kind} {source}" if source else "chunkgrpo.scoring.rewards (programmatic)",
            "options": dict(options),
            "preprocessing": "RGB pixels / 255",
            "scale": reward_about(name) if builtin else self.fn.resolved.about,
            "higher_is_better": True,
        }

    def score(self, images, prompts):
        return self.fn(list(images), list(prompts))

    def close(self) -> None:
        close = getattr(self.fn, "close", None)
        if callable(close):
            close()
