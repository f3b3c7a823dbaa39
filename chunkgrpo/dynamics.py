"""Temporal-dynamics profiling (method.md §5, Eq. 15).

`L1rel(t) = ‖x_{t+1} − x_t‖₁ / ‖x_t‖₁` (mean |Δ| / mean |x|) per transition, on deterministic (ODE)
base-model trajectories, averaged over prompts × seeds. The profile is what the chunk planner reads.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from chunkgrpo.config import Config, option
from chunkgrpo.errors import UserError
from chunkgrpo.objectives import l1rel
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
    device: str = option("cpu", "torch device")
    sampling: SamplingConfig = option(factory=lambda: SamplingConfig(stochastic="none"),
                                      help="schedule/resolution (profiling always integrates the ODE)")

    def __post_init__(self) -> None:
        if self.seeds < 1:
            raise UserError(f"seeds must be >= 1, got {self.seeds}")
        if self.batch_size < 1:
            raise UserError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.num_prompts < 0:
            raise UserError(f"num_prompts must be >= 0, got {self.num_prompts}")


def profile_model(model, prompts: list[str], cfg: ProfileConfig, progress: bool = True) -> dict:
    """Run ODE trajectories for prompts × seeds and return the profile dict (JSON-ready)."""
    if not prompts:
        raise UserError("no prompts to profile")
    s = cfg.sampling
    cond_all = []
    for i in range(0, len(prompts), cfg.batch_size):
        cond_all.append(model.encode_prompts(prompts[i:i + cfg.batch_size], s.max_sequence_length))
    L, _ = model.latent_shape(s.height, s.width)
    sigmas = s.sigmas(image_seq_len=L)
    timesteps = s.timesteps(sigmas)
    ode = s.replace(stochastic="none")  # profiling always integrates the ODE
    per_run = []
    bar = tqdm(total=cfg.seeds * len(cond_all), desc="profile", disable=not progress)
    for seed in range(cfg.seeds):
        for bi, cond in enumerate(cond_all):
            traj = rollout_group(model, cond, 1, ode, torch.Generator().manual_seed(1000 * seed + bi))
            per_run.append(l1rel(traj.latents).cpu())
            bar.update(1)
    bar.close()
    allv = torch.cat(per_run)  # (prompts*seeds, N)
    if not torch.isfinite(allv).all():
        raise RuntimeError("non-finite L1rel in profile (model produced NaN/inf velocities)")
    mean = allv.mean(dim=0)
    std = allv.std(dim=0) if allv.shape[0] > 1 else torch.zeros_like(mean)
    return {
        "sigmas": [float(x) for x in sigmas],
        "timesteps": [float(x) for x in timesteps],
        "l1rel": [float(x) for x in mean],
        "l1rel_std": [float(x) for x in std],
        "num_steps": s.num_steps,
        "num_prompts": len(prompts),
        "seeds": cfg.seeds,
        "samples": int(allv.shape[0]),
        "model": str(cfg.model),
        "sampling": s.to_dict(),
        "definition": "L1rel(t) = mean|x_{t+1} - x_t| / mean|x_t| on ODE trajectories, averaged over prompts x seeds (Eq. 15)",
    }


def write_profile(profile: dict, out: str | Path, plot: bool = True) -> Path:
    """Write the profile JSON atomically, and a PNG plot next to it."""
    out = Path(out)
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
        raise UserError(f"profile {path}: {len(prof['sigmas'])} sigmas for {n} transitions (expected {n + 1})")
    if n < 2 or not all(isinstance(v, (int, float)) and math.isfinite(v) for v in prof["l1rel"]):
        raise UserError(f"profile {path}: l1rel must be >= 2 finite numbers")
    return prof


def plot_profile(profile: dict, out: str | Path, plan: dict | None = None) -> Path:
    """PNG of L1rel per step (± std), with chunk boundaries when a plan is given."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    y = profile["l1rel"]
    std = profile.get("l1rel_std") or [0.0] * len(y)
    x = list(range(len(y)))
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=110)
    ax.plot(x, y, marker="o", color="#1f77b4", label="L1rel (mean)")
    ax.fill_between(x, [a - b for a, b in zip(y, std)], [a + b for a, b in zip(y, std)], alpha=0.2, color="#1f77b4")
    ax.axvspan(len(y) - 1.5, len(y) - 0.5, color="grey", alpha=0.15, label="final step (never trained)")
    if plan:
        start = 0
        for k, size in enumerate(plan["sizes"]):
            ax.axvspan(start - 0.5, start + size - 0.5, alpha=0.08, color=f"C{(k % 8) + 1}")
            ax.text(start + size / 2 - 0.5, max(y), f"c{k}:{size}", ha="center", va="bottom", fontsize=8)
            start += size
    ax.set_xlabel("step t (σ_t → σ_t+1)")
    ax.set_ylabel("‖x_t+1 − x_t‖₁ / ‖x_t‖₁")
    ax.set_title(f"Temporal dynamics ({profile.get('samples', '?')} trajectories)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out)
    plt.close(fig)
    return out


def run_profile(cfg: ProfileConfig, progress: bool = True) -> tuple[dict, Path]:
    """The profiling stage: load the model and prompts, profile, write JSON + PNG."""
    from chunkgrpo.flux import load_flux
    from chunkgrpo.prompts import load_prompts

    if not cfg.model:
        raise UserError("profile needs a model (--model DIR)")
    if not cfg.prompts:
        raise UserError("profile needs a prompt file (--prompts FILE)")
    if Path(cfg.out).is_dir():
        raise UserError(f"profile output {cfg.out} is a directory; give a file name (e.g. {Path(cfg.out) / 'profile.json'})")
    prompts = load_prompts(cfg.prompts, limit=cfg.num_prompts)
    model = load_flux(cfg.model, device=cfg.device)
    prof = profile_model(model, prompts, cfg, progress=progress)
    return prof, write_profile(prof, cfg.out)
