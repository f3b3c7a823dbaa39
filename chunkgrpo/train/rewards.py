"""Training rewards: name → callable(images, prompts) → float32 tensor (n,).

Built in (deterministic, programmatic): `brightness` (mean luminance, or closeness to `target`),
`color` (closeness of the mean colour to `rgb=R,G,B`), `contrast` (pixel std). Any other name is
looked up among the evaluation scorers (`chunkgrpo.eval.scorers.get_scorer`: clip, pickscore,
hpsv2.1, hpsv3, imagereward), whose weights come from a local dir / S3 (`options.weights`). Those run
through the same scorer boundary as evaluation: with `$CHUNKGRPO_VENV_<NAME>` set (or `options.venv`),
the reward model lives in a worker process in its own venv (`chunkgrpo.eval.worker`); otherwise in-process.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from chunkgrpo.errors import UserError

RewardFn = Callable[[Sequence, Sequence[str]], torch.Tensor]


def _pixels(images) -> np.ndarray:
    return np.stack([np.asarray(im.convert("RGB"), dtype=np.float32) / 255.0 for im in images])


def brightness(target: str | float | None = None) -> RewardFn:
    """Mean luminance in [0, 1]; with `target`, 1 − |luminance − target|."""
    t = None if target in (None, "") else float(target)

    def fn(images, prompts):
        px = _pixels(images)
        lum = (px @ np.array([0.299, 0.587, 0.114], dtype=np.float32)).reshape(len(images), -1).mean(1)
        return torch.from_numpy(lum if t is None else 1.0 - np.abs(lum - t)).float()

    return fn


def color(rgb: str = "255,0,0") -> RewardFn:
    """1 − ‖mean colour − rgb‖ / √3 (colours in [0, 1])."""
    try:
        target = np.array([float(c) for c in str(rgb).split(",")], dtype=np.float32) / 255.0
        assert target.shape == (3,)
    except (ValueError, AssertionError):
        raise UserError(f"color reward: rgb={rgb!r} must be three numbers 0-255 like 255,0,0") from None

    def fn(images, prompts):
        mean = _pixels(images).reshape(len(images), -1, 3).mean(1)
        return torch.from_numpy(1.0 - np.linalg.norm(mean - target, axis=1) / np.sqrt(3)).float()

    return fn


def contrast() -> RewardFn:
    """Pixel standard deviation (a crude 'detail' reward)."""
    def fn(images, prompts):
        return torch.from_numpy(_pixels(images).reshape(len(images), -1).std(1)).float()

    return fn


REWARDS: dict[str, Callable[..., RewardFn]] = {"brightness": brightness, "color": color, "contrast": contrast}


def get_reward(name: str, options: dict | None = None, device: str = "cpu") -> RewardFn:
    """A reward callable by name (built-ins first, then the evaluation scorers)."""
    options = dict(options or {})
    if name in REWARDS:
        try:
            return REWARDS[name](**options)
        except TypeError as e:
            raise UserError(f"reward {name!r}: bad options {options} ({e})") from None
    from chunkgrpo.eval.scorers import SCORER_NAMES, get_scorer

    if name not in SCORER_NAMES:
        known = sorted(REWARDS) + list(SCORER_NAMES)
        raise UserError(f"unknown reward {name!r} (known: {', '.join(known)})")
    options.setdefault("device", device)
    return ScorerReward(get_scorer(name, **options))


class ScorerReward:
    """An evaluation scorer as a training reward; `close()` stops its worker process (if it has one)."""

    def __init__(self, scorer) -> None:
        self.scorer = scorer

    def __call__(self, images, prompts) -> torch.Tensor:
        return self.scorer.score(list(images), list(prompts)).float().cpu()

    def close(self) -> None:
        self.scorer.close()


def compute_rewards(fns: dict[str, RewardFn], images, prompts) -> dict[str, torch.Tensor]:
    """Every reward for a batch; non-finite values are an error naming the reward and samples."""
    out = {}
    for name, fn in fns.items():
        r = torch.as_tensor(fn(images, prompts), dtype=torch.float32).flatten()
        if r.numel() != len(images):
            raise RuntimeError(f"reward {name!r} returned {r.numel()} values for {len(images)} images")
        bad = (~torch.isfinite(r)).nonzero().flatten().tolist()
        if bad:
            raise ValueError(f"reward {name!r} is non-finite for samples {bad[:8]} (prompts {[prompts[i] for i in bad[:3]]})")
        out[name] = r
    return out
