"""Dynamics profiling: SDE (training) and ODE trajectories of the base model -> per-step L1rel profile
(JSON, and an HTML page with the plot that the KFP UI's visualisation panel renders). The step is
`chunkgrpo.stages.profile`."""

from kfp import dsl
from kfp.dsl import HTML, Artifact, Output

from components.images import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def profile(model: str, prompts: str, preset: str, overrides: list, num_prompts: int, seeds: int, device: str,
            profile_json: Output[Artifact], plot: Output[HTML], method: str = "chunk",
            trajectories: str = "sde"):
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
    from pathlib import Path

    from chunkgrpo.stages.task import stage_env
    from chunkgrpo.tempdirs import scratch

    stage_env("")
    from chunkgrpo.stages.profile import profile as profile_stage
    from chunkgrpo.stages.profile import training_config

    with scratch("chunkgrpo-profile-") as tmp:  # removed once the outputs are copied out
        cfg = training_config(model=model, prompts=prompts, preset=preset, method=method,
                              overrides=list(overrides), num_prompts=num_prompts, seeds=seeds, device=device,
                              trajectories=trajectories, out=tmp / "profile.json", scratch=tmp)
        p = profile_stage(cfg, progress=False)
        shutil.copyfile(p.path, profile_json.path)
        Path(plot.path).write_text(p.html(model))  # the plot embedded, with the per-step values
    steps = cfg.sampling.num_steps
    profile_json.metadata.update({"num_steps": steps, "model": model, "trajectories": trajectories})
    print(f"profile: {steps} steps, {num_prompts or 'all'} prompts x {seeds} seeds, SDE + ODE "
          f"(planning on {trajectories}) -> {profile_json.uri}")
