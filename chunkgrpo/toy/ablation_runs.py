"""One ablation run, in a worker process: train one (method, seed) from a spec, export the adapter at each
evaluation point and evaluate every point on the held-out prompts (`run_one`); the base model's point 0
(`base_one`). `engine_fingerprint` hashes the engine these runs execute, so a changed engine makes the
cached runs stale.

**Evaluation.** Each point is the trained model alone, ODE, on the world's held-out prompts, `eval_samples`
images per prompt, seeds 10 000 + 1 000·seed + k (`eval_seed`): every arm and every point of one seed sees
the same evaluation noise (the base model is point 0), so differences pair.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import tempfile
import time
from pathlib import Path

from chunkgrpo.toy.ablation_design import ARMS

# The engine: the training and evaluation code the runs execute (the library's top-level modules, train/,
# the rewards in scoring/, the toy world, model, detector and this harness) and the presets they start from.
# The ablation's report (aggregation, Markdown, plots) is not part of it: a changed report never makes
# runs stale.
ENGINE_DIRS = (".", "train", "scoring", "toy")
NOT_ENGINE = ("toy/ablation_report.py",)


def engine_files(root: Path | None = None) -> list[Path]:
    """The files of the engine: `chunkgrpo/*.py`, the `ENGINE_DIRS` packages and `presets/*.yaml`, without
    `NOT_ENGINE`, sorted."""
    root = root or Path(__file__).resolve().parents[1]
    return sorted(f for f in [*(p for d in ENGINE_DIRS for p in (root / d).glob("*.py")),
                              *(root / "presets").glob("*.yaml")]
                  if f.relative_to(root).as_posix() not in NOT_ENGINE)


@functools.lru_cache(maxsize=1)
def engine_fingerprint() -> str:
    """Hash of the engine's source, path and bytes of each of `engine_files()` (a changed engine makes cached
    runs stale); computed once per process, so a long run stays consistent while its source tree is edited
    (run it from a snapshot to resume it)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    for f in engine_files(root):
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def eval_seed(seed: int) -> int:
    return 10_000 + 1_000 * seed


def _train_overrides(spec: dict) -> list[str]:
    arm = spec["arm"]
    method = list(ARMS[spec["method"]]["overrides"])
    chunks = ARMS[spec["method"]].get("chunks")
    if chunks:
        method.append("chunks=" + (spec["plan_path"] if chunks == "{plan}" else spec["uniform"]))
    if arm["kind"] != "branch":
        method.append(f"timestep_fraction={arm['timestep_fraction']!r}")
    steps = spec["steps"] if arm["kind"] != "branch" else spec["steps"] * 10  # branching: stopped by samples
    return [*spec["overrides"], *method, f"model={spec['model']}", f"prompts={spec['prompts']}",
            f"seed={spec['seed']}", f"max_steps={steps}", "max_iterations=0", "progress=false",
            "checkpoint.every=0", "checkpoint.resume=false", "tracking.image_every=0"]


def rewards_per_iteration(cfg) -> int:
    """Rewarded images per iteration: P·G for step/chunk, P·G per trained branching step (× granularities)."""
    B = cfg.prompts_per_rank * cfg.group_size
    if cfg.method in ("tempflow", "granular"):
        from chunkgrpo.train.branching import branch_steps, granularities

        return B * len(branch_steps(cfg)) * len(granularities(cfg))
    return B


def _evaluate(spec: dict, lora: str | None, cfg=None) -> dict:
    from chunkgrpo.flux import load_flux
    from chunkgrpo.toy.sampling import accuracy, sampling_config

    model = load_flux(spec["model"])
    if lora:
        model.pipe.load_lora_weights(lora)
    sampling = sampling_config(steps=spec["num_steps"], size=spec["size"]).replace(
        max_sequence_length=spec["max_sequence_length"])
    acc = accuracy(model, spec["eval_metadata"], spec["eval_samples"], sampling, seed=eval_seed(spec["seed"]))
    return {"overall": acc["overall"], "tasks": {k: v["score"] for k, v in acc["tasks"].items()},
            "images": {k: v.get("total", v.get("n", 0)) for k, v in acc["tasks"].items()},
            "n_images": acc["n_images"], "partial": acc.get("partial")}


def run_one(spec: dict) -> dict:
    """Train one (method, seed), exporting the adapter at each evaluation point, and evaluate every point on
    the held-out prompts (runs in a worker process)."""
    import torch

    from chunkgrpo.train.config import TrainConfig
    from chunkgrpo.train.trainer import Trainer

    torch.set_num_threads(spec["threads"])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("chunkgrpo").setLevel(logging.WARNING)
    t0, c0 = time.perf_counter(), time.process_time()
    arm, points = spec["arm"], spec["eval_points"]
    branch = arm["kind"] == "branch"
    budget = spec["sample_budget"]
    records: list[dict] = []
    exports: list[dict] = []
    state = {"samples": 0, "rewards": 0, "transitions": 0.0, "samples_seen": 0}

    with tempfile.TemporaryDirectory(prefix="chunkgrpo-ablation-") as tmp:
        class RecordingTrainer(Trainer):
            def iteration(self) -> dict:
                m = super().iteration()
                B = self.cfg.prompts_per_rank * self.cfg.group_size
                state["samples"] += int(m["transformer_samples"])
                state["rewards"] += rewards_per_iteration(self.cfg)
                if (
                    "unshared_transformer_samples" in m
                ):  # step/chunk: trained (sample, step) pairs of the rollout
                    state["transitions"] += (
                        m["unshared_transformer_samples"] - self.cfg.sampling.num_steps * B
                    )
                    state["samples_seen"] += B
                records.append({"optimizer_step": self.opt_step, "iteration": self.iteration_idx + 1,
                                "reward_mean": m["reward_mean"], "transformer_samples": state["samples"],
                                "rewards": state["rewards"]})
                progress = state["samples"] / budget if branch else self.opt_step / spec["steps"]
                while len(exports) < points and progress >= (len(exports) + 1) / points - 1e-12:
                    j = len(exports) + 1
                    path = (
                        exports[-1]["path"]
                        if exports and exports[-1]["iteration"] == records[-1]["iteration"]
                        else str(self.export(Path(tmp) / f"eval-{j}"))
                    )
                    exports.append({"point": j, "path": path, **records[-1]})
                return m

            def done(self) -> bool:
                return len(exports) >= points or super().done()

        cfg = TrainConfig.load(spec["preset"], [*_train_overrides(spec), f"output_dir={tmp}/run"])
        trainer = RecordingTrainer(cfg)
        trainer.setup()
        try:
            summary = trainer.train()
        finally:
            trainer.close()
        if len(exports) < points:
            raise RuntimeError(
                f"{spec['method']}/seed {spec['seed']}: stopped after {len(exports)} of {points} "
                f"evaluation points ({state['samples']} of {budget} samples)"
            )
        train_s, train_cpu = time.perf_counter() - t0, time.process_time() - c0
        curve = []
        for e in exports:
            ev = _evaluate(spec, e["path"])
            curve.append({k: v for k, v in e.items() if k != "path"} | ev)
    final = curve[-1]
    return {
        "method": spec["method"],
        "seed": spec["seed"],
        "key": spec["key"],
        "overall": final["overall"],
        "tasks": final["tasks"],
        "n_images": final["n_images"],
        "curve": curve,
        "optimizer_steps": final["optimizer_step"],
        "iterations": final["iteration"],
        "chunk_sizes": summary["chunk_sizes"],
        "timestep_fraction": cfg.timestep_fraction,
        "reward_curve": [(r["optimizer_step"], r["reward_mean"], r["transformer_samples"]) for r in records],
        "transformer_samples": final["transformer_samples"],
        "rewards": final["rewards"],
        "transitions_per_sample": (state["transitions"] / state["samples_seen"])
        if state["samples_seen"]
        else None,
        "train_wall_s": round(train_s, 2),
        "train_cpu_s": round(train_cpu, 2),
        "wall_s": round(time.perf_counter() - t0, 2),
        "cpu_s": round(time.process_time() - c0, 2),
        "config": cfg.to_dict(),
    }


def base_one(spec: dict) -> dict:
    """The base model's held-out accuracy with a seed's evaluation noise (point 0 of every arm's curve)."""
    import torch

    torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    ev = _evaluate(spec, None)
    return {
        "method": "base",
        "seed": spec["seed"],
        "key": spec["key"],
        **ev,
        "wall_s": round(time.perf_counter() - t0, 2),
    }
