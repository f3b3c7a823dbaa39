"""Training rewards: name → callable(images, prompts) → float32 tensor (n,).

The names are those of `chunkgrpo.scoring.table`: a programmatic reward (`brightness`, `color`,
`contrast` defined here; `toy_geneval`, the toy world's exact GenEval reward, named there by
"module:attr") is built from its factory; any other name is a model scorer
(`chunkgrpo.scoring.scorers.get_scorer`: clip, pickscore, hpsv2.1, hpsv3, imagereward), whose weights come
from a local dir / S3 (`options.weights`), wrapped as a reward (`chunkgrpo.scoring.adapters.ScorerReward`).
Those run through the same scorer boundary as evaluation: with `$CHUNKGRPO_VENV_<NAME>` set (or
`options.venv`), the reward model lives in a worker process in its own venv (`chunkgrpo.scoring.worker`);
otherwise in-process. Any other name is a user's reward (`chunkgrpo.scoring.custom`: `module:attr` or an
entry point of group `chunkgrpo.rewards`). A reward with a `url` is scored by a reward server
(`chunkgrpo.scoring.remote`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

from chunkgrpo.errors import UserError
from chunkgrpo.scoring.adapters import ScorerReward
from chunkgrpo.scoring.custom import build, is_builtin
from chunkgrpo.scoring.scorers import get_scorer
from chunkgrpo.scoring.table import REWARDS, build_reward

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


def get_reward(name: str, options: dict | None = None, device: str = "cpu", url: str = "") -> RewardFn:
    """A reward callable by name (programmatic rewards first, then the model scorers, then a user's); with
    `url`, the reward server there scores it (`options` are then the client's: max_batch, deadline_s, ...)."""
    options = dict(options or {})
    if url:
        from chunkgrpo.scoring.remote import RemoteReward

        try:
            return RemoteReward(url, name, **options)
        except TypeError as e:
            raise UserError(f"reward {name!r} at {url}: bad client options {options} ({e})") from None
    if name in REWARDS:
        return build_reward(name, options)
    if not is_builtin(name):
        return build(name, options, "reward")  # a user's reward: import path or entry point
    options.setdefault("device", device)
    return ScorerReward(get_scorer(name, **options))


def compute_rewards(fns: dict[str, RewardFn], images, prompts) -> dict[str, torch.Tensor]:
    """Every reward for a batch; non-finite values are an error naming the reward and samples."""
    out = {}
    for name, fn in fns.items():
        r = torch.as_tensor(fn(images, prompts), dtype=torch.float32).flatten()
        if r.numel() != len(images):
            raise RuntimeError(f"reward {name!r} returned {r.numel()} values for {len(images)} images")
        bad = (~torch.isfinite(r)).nonzero().flatten().tolist()
        if bad:
            raise ValueError(
                f"reward {name!r} is non-finite for samples {bad[:8]} "
                f"(prompts {[prompts[i] for i in bad[:3]]})"
            )
        out[name] = r
    return out
