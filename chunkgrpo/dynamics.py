"""Temporal-dynamics profiling (method.md §5, Eq. 15).

`L1rel(t) = ‖x_{t+1} − x_t‖₁ / ‖x_t‖₁` (mean |Δ| / mean |x|) per transition, on base-model trajectories,
averaged over prompts × seeds. Both kinds of trajectory are profiled from the same initial noise:

* ``sde`` — the training trajectories (the sampling section's η, rule and stochastic steps), which the
  paper's weighted sampling and the authors' chunk weights measure; high while the injected noise
  dominates (early, high σ) and falling afterwards — the shape of the paper's figure;
* ``ode`` — deterministic trajectories; on the same model they can rise with the step instead.

`trajectories` picks the one the planner reads (`l1rel`, default ``sde``); both are stored
(`l1rel_ode`, `l1rel_sde`) and plotted, and plan.json records which one was planned on.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch

from chunkgrpo.config import Config, option
from chunkgrpo.errors import UserError
from chunkgrpo.objectives import l1rel
from chunkgrpo.progress import progress_bar
from chunkgrpo.rollout import SamplingConfig, rollout_group


@dataclass
class ProfileConfig(Config):
    """Dynamics profiling stage."""

    model: str = option("", "base model: local diffusers folder, s3:// URI or cached hub id")
    prompts: str = option("", "prompt file (.txt one per line, .jsonl with 'prompt', or .parquet)")
    out: str = option("profile.json", "output JSON path (a PNG plot is written next to it)")
    num_prompts: int = option(16, "how many prompts from the file to profile (0 = all)")
    seeds: int = option(2, "initial-noise seeds per prompt")
    batch_size: int = option(8, "prompts per batched ODE rollout")
    device: str = option("cpu", "auto | cpu | cuda | cuda:N (auto: the GPU when CUDA sees one; a GPU asked "
                         "for that CUDA cannot use is an error, never a CPU run)")
    trajectories: Literal["sde", "ode"] = option(
        "sde", "profile the planner reads: sde = the training trajectories (η, rule, stochastic steps of "
        "`sampling`), ode = deterministic; both are computed, stored and plotted")
    sampling: SamplingConfig = option(
        factory=SamplingConfig, help="schedule/resolution and the training SDE (η, rule, stochastic steps)"
    )

    def __post_init__(self) -> None:
        if self.seeds < 1:
            raise UserError(f"seeds must be >= 1, got {self.seeds}")
        if self.batch_size < 1:
            raise UserError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.num_prompts < 0:
            raise UserError(f"num_prompts must be >= 0, got {self.num_prompts}")


def profile_model(model, prompts: list[str], cfg: ProfileConfig, progress: bool = True) -> dict:
    """ODE and SDE trajectories for prompts × seeds (same initial noise); the profile dict (JSON-ready)."""
    if not prompts:
        raise UserError("no prompts to profile")
    s = cfg.sampling
    cond_all = []
    for i in range(0, len(prompts), cfg.batch_size):
        cond_all.append(model.encode_prompts(prompts[i:i + cfg.batch_size], s.max_sequence_length))
    L, _ = model.latent_shape(s.height, s.width)
    sigmas = s.sigmas(image_seq_len=L)
    timesteps = s.timesteps(sigmas)
    kinds = {"ode": s.replace(stochastic="none"), "sde": s}
    runs: dict[str, list] = {k: [] for k in kinds}
    bar = progress_bar(total=cfg.seeds * len(cond_all) * len(kinds), desc="profile", disable=not progress)
    for seed in range(cfg.seeds):
        for bi, cond in enumerate(cond_all):
            for kind, sampling in kinds.items():  # the same generator seed: same initial noise for both
                traj = rollout_group(
                    model, cond, 1, sampling, torch.Generator().manual_seed(1000 * seed + bi)
                )
                runs[kind].append(l1rel(traj.latents).cpu())
                bar.update(1)
    bar.close()
    out = {
        "sigmas": [float(x) for x in sigmas],
        "timesteps": [float(x) for x in timesteps],
        "num_steps": s.num_steps,
        "num_prompts": len(prompts),
        "seeds": cfg.seeds,
        "model": str(cfg.model),
        "sampling": s.to_dict(),
        "trajectories": cfg.trajectories,
        "definition": "L1rel(t) = mean|x_{t+1} - x_t| / mean|x_t|, averaged over prompts x seeds (Eq. 15); "
        "l1rel = the '" + cfg.trajectories + "' profile (sde: training eta/rule; ode: deterministic)",
    }
    for kind, per_run in runs.items():
        allv = torch.cat(per_run)  # (prompts*seeds, N)
        if not torch.isfinite(allv).all():
            raise RuntimeError(f"non-finite L1rel in the {kind} profile (model produced NaN/inf velocities)")
        mean = allv.mean(dim=0)
        std = allv.std(dim=0) if allv.shape[0] > 1 else torch.zeros_like(mean)
        out[f"l1rel_{kind}"] = [float(x) for x in mean]
        out[f"l1rel_{kind}_std"] = [float(x) for x in std]
        out["samples"] = int(allv.shape[0])
    out["l1rel"] = out[f"l1rel_{cfg.trajectories}"]
    out["l1rel_std"] = out[f"l1rel_{cfg.trajectories}_std"]
    return out


def select_trajectories(profile: dict, trajectories: str | None = None) -> tuple[list[float], str]:
    """The profile curve to plan on and its kind: `trajectories` (sde | ode) or the profile's own choice.
    Profiles written before both were recorded hold ODE trajectories."""
    kind = trajectories or profile.get("trajectories", "ode")
    if kind not in ("sde", "ode"):
        raise UserError(f"trajectories={kind!r} must be 'sde' or 'ode'")
    key = f"l1rel_{kind}"
    if key in profile:
        return list(profile[key]), kind
    if kind == profile.get("trajectories", "ode"):
        return list(profile["l1rel"]), kind
    raise UserError(
        f"the profile has no {kind.upper()} curve ({key}); re-run `chunkgrpo profile` to record both"
    )


def write_profile(profile: dict, out: str | Path, plot: bool = True) -> Path:
    """Write the profile JSON atomically, and a PNG plot next to it."""
    from chunkgrpo.inputs import check_output_file

    out = check_output_file(out, "profile output")
    if plot:
        check_output_file(out.with_suffix(".png"), "profile plot")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    try:
        tmp.write_text(json.dumps(profile, indent=2))
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    if plot:
        plot_profile(profile, out.with_suffix(".png"))
    return out


MAX_PROFILE_STEPS = 4096


def load_profile(path: str | Path) -> dict:
    path = Path(path)
    if not path.exists():
        raise UserError(f"profile {path} does not exist (run `chunkgrpo profile` first)")
    from chunkgrpo.inputs import read_json

    prof = read_json(path, "profile")
    if not isinstance(prof, dict):
        raise UserError(f"profile {path}: expected a JSON object with 'sigmas' and 'l1rel'")
    for key in ("sigmas", "l1rel"):
        if not isinstance(prof.get(key), list):
            raise UserError(f"profile {path} has no {key!r} list")
    n = len(prof["l1rel"])
    if len(prof["sigmas"]) != n + 1:
        raise UserError(
            f"profile {path}: {len(prof['sigmas'])} sigmas for {n} transitions (expected {n + 1})"
        )
    if n > MAX_PROFILE_STEPS:
        raise UserError(f"profile {path} has {n} transitions; at most {MAX_PROFILE_STEPS} sampling steps are "
                        "supported (FLUX samples 16–50)")
    if n < 2 or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in prof["l1rel"]):
        raise UserError(f"profile {path}: l1rel must be >= 2 finite numbers")
    neg = [(i, v) for i, v in enumerate(prof["l1rel"]) if v < 0]
    if neg:
        raise UserError(f"profile {path}: l1rel[{neg[0][0]}]={neg[0][1]} is negative "
                        "(a relative L1 change is >= 0)")
    return prof


def plot_profile(profile: dict, out: str | Path, plan: dict | None = None) -> Path:
    """PNG of L1rel per step (± std) for the SDE and ODE trajectories, the planned-on one bold, with the
    chunk boundaries when a plan is given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    planned = (plan or {}).get("trajectories") or profile.get("trajectories", "ode")
    curves = [
        (k, profile[f"l1rel_{k}"], profile.get(f"l1rel_{k}_std"))
        for k in ("sde", "ode")
        if f"l1rel_{k}" in profile
    ]
    if not curves:
        curves = [(planned, profile["l1rel"], profile.get("l1rel_std"))]
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=110)
    top = 0.0
    for kind, y, std in curves:
        std = std or [0.0] * len(y)
        x = list(range(len(y)))
        main = kind == planned
        label = f"{kind.upper()} trajectories" + (" (planned on)" if main and plan else "")
        color = "#1f77b4" if kind == "sde" else "#ff7f0e"
        ax.plot(
            x,
            y,
            marker="o" if main else ".",
            linestyle="-" if main else "--",
            linewidth=2 if main else 1,
            color=color,
            label=label,
        )
        ax.fill_between(
            x, [a - b for a, b in zip(y, std)], [a + b for a, b in zip(y, std)], alpha=0.15, color=color
        )
        top = max(top, max(y))
    n = len(curves[0][1])
    ax.axvspan(n - 1.5, n - 0.5, color="grey", alpha=0.15, label="final step (never trained)")
    if plan:
        start = 0
        for k, size in enumerate(plan["sizes"]):
            ax.axvspan(start - 0.5, start + size - 0.5, alpha=0.08, color=f"C{(k % 8) + 1}")
            ax.text(start + size / 2 - 0.5, top, f"c{k}:{size}", ha="center", va="bottom", fontsize=8)
            start += size
    ax.set_xlabel("step t (σ_t → σ_t+1)")
    ax.set_ylabel("‖x_t+1 − x_t‖₁ / ‖x_t‖₁")
    ax.set_title(f"Temporal dynamics ({profile.get('samples', '?')} trajectories each)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out)
    plt.close(fig)
    return out


def run_profile(cfg: ProfileConfig, progress: bool = True) -> tuple[dict, Path]:
    """The profiling stage: load the model and prompts, profile, write JSON + PNG."""
    from chunkgrpo.flux import load_flux
    from chunkgrpo.gpu import require
    from chunkgrpo.prompts import load_prompts

    device = require(cfg.device)  # first: a GPU asked for that CUDA cannot use is one line, not a CPU profile
    if not cfg.model:
        raise UserError("profile needs a model (--model DIR)")
    if not cfg.prompts:
        raise UserError("profile needs a prompt file (--prompts FILE)")
    if Path(cfg.out).is_dir():
        raise UserError(
            f"profile output {cfg.out} is a directory; "
            f"give a file name (e.g. {Path(cfg.out) / 'profile.json'})"
        )
    from chunkgrpo.inputs import check_output_file

    check_output_file(cfg.out, "profile output")  # before minutes of sampling
    check_output_file(Path(cfg.out).with_suffix(".png"), "profile plot")
    prompts = load_prompts(cfg.prompts, limit=cfg.num_prompts)
    model = load_flux(cfg.model, device=device)
    prof = profile_model(model, prompts, cfg, progress=progress)
    return prof, write_profile(prof, cfg.out)
