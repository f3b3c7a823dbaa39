"""Learning sanity: does a short GRPO run raise a programmatic reward over the base model?

Builds the tiny FLUX, measures the mean reward of deterministic (ODE) samples on fixed prompts and
seeds, trains with the `tiny_cpu` preset (overridable), and measures again with the trained LoRA.

  python benchmarks/learning_sanity.py [--method chunk|dance] [key=value overrides]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch

from chunkgrpo.flux import load_flux
from chunkgrpo.rollout import rollout_group
from chunkgrpo.scoring.rewards import get_reward
from chunkgrpo.testing.tiny import build_tiny_flux
from chunkgrpo.train.config import TrainConfig
from chunkgrpo.train.trainer import run_training

PROMPTS = [
    "a cat on a chair",
    "a red car",
    "three apples",
    "a bowl of fruit",
    "a dog in the park",
    "a city at night",
]


def ode_reward(model, cfg: TrainConfig, prompts: list[str], seeds: int = 4) -> float:
    """Mean reward of ODE samples (fixed seeds), the way evaluation would see the policy."""
    s = cfg.sampling
    fn = get_reward(cfg.rewards[0].name, cfg.rewards[0].options)
    cond = model.encode_prompts(prompts, s.max_sequence_length)
    ode = s.replace(stochastic="none")
    vals = []
    for seed in range(seeds):
        tr = rollout_group(model, cond, 1, ode, torch.Generator().manual_seed(10_000 + seed))
        vals.append(fn(model.decode(tr.x0, s.height, s.width), prompts))
    return float(torch.cat(vals).mean())


def run(overrides: list[str], workdir: Path) -> dict:
    model_dir = build_tiny_flux(workdir / "tiny-flux", seed=0)
    prompts = workdir / "prompts.txt"
    prompts.write_text("\n".join(PROMPTS) + "\n")
    cfg = TrainConfig.load(
        "tiny_cpu",
        [
            f"model={model_dir}",
            f"prompts={prompts}",
            f"output_dir={workdir / 'run'}",
            "progress=false",
            "checkpoint.every=0",
            *overrides,
        ],
    )
    base = ode_reward(load_flux(model_dir), cfg, PROMPTS)
    t0 = time.perf_counter()
    summary = run_training(cfg)
    train_s = time.perf_counter() - t0
    trained = load_flux(model_dir)
    trained.pipe.load_lora_weights(summary["final_model"])
    after = ode_reward(trained, cfg, PROMPTS)
    return {
        "method": cfg.method,
        "reward": cfg.rewards[0].name,
        "optimizer_steps": summary["optimizer_steps"],
        "base_reward": base,
        "trained_reward": after,
        "gain": after - base,
        "train_seconds": train_s,
        "rollout_reward_first": summary["history"][0]["reward_mean"],
        "rollout_reward_last": summary["history"][-1]["reward_mean"],
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        res = run(args.overrides, Path(tmp))
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    from chunkgrpo import startup

    startup.fewer_full_collections()  # as the entry points: fewer full collections while it loads
    sys.exit(main())
