"""Dynamics profiling: SDE (training) and ODE trajectories of the base model -> per-step L1rel profile
(JSON + PNG) that the planner reads."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Profile:
    """A written profile."""

    data: dict             # the profile (chunkgrpo.dynamics: sigmas, l1rel, trajectories, ...)
    path: Path             # its JSON file
    plot: Path | None      # the PNG of the curves (None when not drawn)


def training_config(*, model: str, prompts: str, preset: str, method: str, overrides: list,
                    num_prompts: int, seeds: int, device: str, trajectories: str, out: str | Path):
    """The ProfileConfig that profiles a training preset's sampling (its `sampling` section with the
    `sampling.*` overrides); device `auto` is resolved by `run_profile` (chunkgrpo.gpu.require: a
    GPU the pod was granted but CUDA cannot use is an error, never a silent CPU profile)."""
    from chunkgrpo.dynamics import ProfileConfig
    from chunkgrpo.recipes import preset_for
    from chunkgrpo.stages.task import local_file
    from chunkgrpo.train.config import TrainConfig

    preset = preset_for(method, preset)
    sampling = TrainConfig.load(preset, [o for o in overrides if o.startswith("sampling.")]).sampling
    return ProfileConfig.from_dict({"model": model, "prompts": local_file(prompts), "out": str(out),
                                    "num_prompts": num_prompts, "seeds": seeds, "device": device,
                                    "trajectories": trajectories, "sampling": sampling.to_dict()})


def profile(cfg, progress: bool = True) -> Profile:
    """Profile a ProfileConfig (load the model and prompts, sample, write JSON + PNG)."""
    from chunkgrpo.dynamics import run_profile

    data, path = run_profile(cfg, progress=progress)
    png = path.with_suffix(".png")
    return Profile(data, path, png if png.exists() else None)
