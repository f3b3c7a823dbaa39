"""Dynamics profiling: SDE (training) and ODE trajectories of the base model -> per-step L1rel profile
(JSON + PNG)."""

from kfp import dsl
from kfp.dsl import Artifact, Output

from components._shared import local_file, stage_env
from components.images import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False, additional_funcs=[local_file, stage_env])
def profile(
    model: str,
    prompts: str,
    preset: str,
    overrides: list,
    num_prompts: int,
    seeds: int,
    device: str,
    profile_json: Output[Artifact],
    plot: Output[Artifact],
    method: str = "chunk",
    trajectories: str = "sde",
):
    """Profile the base model's flow dynamics with the sampling settings of the training preset.

    Args:
        model: base model (diffusers folder, s3:// folder artifact or cached hub id).
        prompts: prompt file (local path or s3:// object).
        preset: training preset ('' = the method's own); its `sampling` section (steps, schedule, resolution,
            η and rule of the training SDE) is profiled.
        overrides: training overrides (key=value); `sampling.*` ones apply here too.
        num_prompts: prompts to profile (0 = all).
        seeds: initial-noise seeds per prompt.
        device: auto | cpu | cuda.
        method: training method (picks the preset when `preset` is '').
        trajectories: the curve the planner reads: sde (training trajectories) or ode; both are recorded.
    """
    import shutil
    import tempfile
    from pathlib import Path

    stage_env("")
    import torch

    from chunkgrpo.dynamics import ProfileConfig, run_profile
    from chunkgrpo.recipes import preset_for
    from chunkgrpo.train.config import TrainConfig

    preset = preset_for(method, preset)
    sampling = TrainConfig.load(
        preset, [o for o in overrides if o.startswith("sampling.")]
    ).sampling.to_dict()
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    out = Path(tempfile.mkdtemp(prefix="chunkgrpo-profile-")) / "profile.json"
    cfg = ProfileConfig.from_dict({"model": model, "prompts": local_file(prompts), "out": str(out),
                                   "num_prompts": num_prompts, "seeds": seeds, "device": device,
                                   "trajectories": trajectories, "sampling": sampling})
    _, path = run_profile(cfg, progress=False)
    shutil.copyfile(path, profile_json.path)
    profile_json.metadata.update(
        {"num_steps": sampling["num_steps"], "model": model, "trajectories": trajectories}
    )
    if path.with_suffix(".png").exists():
        shutil.copyfile(path.with_suffix(".png"), plot.path)
    print(
        f"profile: {sampling['num_steps']} steps, {num_prompts or 'all'} prompts x {seeds} seeds, SDE + ODE "
        f"(planning on {trajectories}) -> {profile_json.uri}"
    )
