"""The paper's ablation on the toy world: does optimizing by chunk beat optimizing by step? A budget-matched,
pre-registered, powered comparison from one base model, with learning curves.

    from chunkgrpo.toy.ablation import AblationConfig, run_ablation
    result = run_ablation(AblationConfig(model="models/toy", out="benchmarks/results/ablation"))

Methods (every run: the `toy_cpu` preset, the same base model, prompts, reward, LoRA and learning rate):

    step_flow        step-level GRPO, Flow-GRPO SDE (rule flow, η 0.7): the matched baseline of chunks
    step_dance       step-level GRPO, DanceGRPO SDE (rule dance, η 0.3)
    chunk_uniform    Chunk-GRPO, uniform chunks (`uniform`, default 3 steps)
    chunk_dynamics   Chunk-GRPO, chunks planned on this model's SDE dynamics profile (engine profile + plan)
    chunk_ws         chunk_dynamics + weighted chunk sampling (Eq. 16)
    tempflow         TempFlow-GRPO (ODE anchor, branching, noise-aware weights)
    granular         Granular-GRPO (branching, multi-granularity advantages λ ∈ {1, 2})

**Plan.** `chunk_dynamics` is planned on the SDE profile (the training η, rule and stochastic steps of
the preset: method.md §5.3); `profile.json` holds both curves and `plan.json` records `"trajectories": "sde"`.

**Equal budgets by construction** (`design()` computes them from the configs and refuses a design where
they differ):

* step and chunk arms make the same optimizer steps on the same rollouts (P·G images per step) and train
  the same expected number of transitions per sample: a chunk arm with K chunks training k = int(K·f)
  of them (uniformly) trains k/K·S of the S trainable steps on average; the step arms are given the
  `timestep_fraction` that trains exactly that many steps (N = 10: `[2, 3, 4]`, 2 of 3 chunks = 6 of 9
  steps; N = 17: `[2, 3, 4, 7]`, 2 of 4 chunks = 8 of 16 steps). Weighted sampling (`chunk_ws`) draws
  chunks by their dynamics, so its count is data-dependent: measured and reported, not matched;
* branching arms (TempFlow, Granular) score far more images per optimizer step; they are stopped at the
  same cumulative transformer samples as a step arm's run (`steps`·P·G·(N + T), T the matched transitions
  per sample), and every curve is also plotted against cumulative transformer samples.

The report states each arm's trained transitions per sample, rewarded images and transformer samples.

**Pre-registered primary endpoint** (fixed before the run, written into the config and results file):
held-out GenEval accuracy at the final evaluation point, `chunk_dynamics − step_flow`, paired by seed,
two-sided paired t at α = 0.05. Seeds = `seeds_needed(Δ = primary_delta, σ = assumed_sd)` at 80 % power
unless given; `sequential` adds seeds until the 95 % CI excludes 0 or its half-width is below
`stop_half_width`. Secondary comparisons are Holm-corrected.

**Evaluation.** `eval_points` checkpoints per run (evenly spaced in optimizer steps, or in samples for the
branching arms), each the trained model alone, ODE, on the world's held-out prompts (attribute combinations
never seen in training), `eval_samples` images per prompt, seeds 10 000 + 1 000·seed + k: every arm and
every point of one seed sees the same evaluation noise (the base model is point 0), so differences pair.

Results are cached per (method, seed) under `<out>/runs/<method>/seed-<s>.json`, keyed by the run's
settings, the toy model and the engine's source; a re-run only computes what is missing or stale, so the
ablation can be run incrementally, resumed, and extended by seeds (the outputs are rewritten after every
finished run, so an interrupted run leaves a valid interim report). Outputs: `ablation.json`,
`ablation.md`, `curves.png` (learning curves + training reward), `reward_curves.png`, `profile.json/png`
and `plan.json`.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import math
import os
import shutil
import tempfile
import time
from pathlib import Path

from chunkgrpo.config import Config, option
from chunkgrpo.errors import UserError
from chunkgrpo.toy.power import eval_sd, holm, mean_ci, min_detectable_effect, paired_power, seeds_needed
from chunkgrpo.toy.power import sequential_decision, t_quantile

log = logging.getLogger(__name__)

FORMAT = "chunkgrpo.toy-ablation/v2"
# per method: training overrides; `kind` step | chunk | branch; `chunks` the chunk strategy of a chunk arm
# ("{plan}" = the SDE dynamics plan, "{uniform}" = the config's uniform strategy); `weighted` = Eq. 16 sampling
METHODS: dict[str, dict] = {
    "step_flow": {"overrides": ["method=dance", "sampling.rule=flow", "sampling.eta=0.7"], "kind": "step"},
    "step_dance": {"overrides": ["method=dance", "sampling.rule=dance", "sampling.eta=0.3"], "kind": "step"},
    "chunk_uniform": {"overrides": ["method=chunk"], "kind": "chunk", "chunks": "{uniform}"},
    "chunk_dynamics": {"overrides": ["method=chunk"], "kind": "chunk", "chunks": "{plan}"},
    "chunk_ws": {"overrides": ["method=chunk+ws"], "kind": "chunk", "chunks": "{plan}", "weighted": True},
    "tempflow": {"overrides": ["method=tempflow"], "kind": "branch"},
    "granular": {"overrides": ["method=granular"], "kind": "branch"},
}
LABELS = {"step_flow": "step-level GRPO (flow)", "step_dance": "step-level GRPO (dance)",
          "chunk_uniform": "Chunk-GRPO, uniform", "chunk_dynamics": "Chunk-GRPO, SDE dynamics plan",
          "chunk_ws": "Chunk-GRPO + weighted sampling", "tempflow": "TempFlow-GRPO (equal samples)",
          "granular": "Granular-GRPO (equal samples)"}
PRIMARY = ("chunk_dynamics", "step_flow")
SECONDARY = [("chunk_uniform", "step_flow"), ("chunk_ws", "step_flow"), ("chunk_dynamics", "step_dance"),
             ("tempflow", "step_flow"), ("granular", "step_flow")]
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
PRIOR_SD = 0.053  # paired sd of chunk − step_flow over 5 seeds in the v1 ablation (benchmarks/results/ablation-toy)


def t95(df: int) -> float:
    """Two-sided 95 % Student-t quantile (scipy)."""
    return t_quantile(df)


@dataclasses.dataclass
class AblationConfig(Config):
    """The toy-world ablation (see the module docstring)."""

    model: str = option("", "toy model folder (`chunkgrpo toy-model --out DIR`); '' = build/reuse the default one "
                            "in .chunkgrpo/models/toy")
    out: str = option("benchmarks/results/ablation", "results folder (per-run cache, JSON, Markdown, PNG)")
    methods: list[str] = option(list(METHODS), f"methods to run, of {list(METHODS)}; must hold the primary pair")
    seeds: int = option(0, "training seeds of the primary pair (0 = the power calculation's number for "
                           "primary_delta at assumed_sd)")
    secondary_seeds: int = option(0, "training seeds of the other methods (0 = as many as the primary pair)")
    first_seed: int = option(0, "first training seed")
    steps: int = option(72, "optimizer steps per step/chunk run; branching runs stop at the same transformer samples")
    eval_points: int = option(4, "evaluations per run, evenly spaced over its budget (the last one is the endpoint)")
    timestep_fraction: float = option(0.6667, "chunk arms train int(K·fraction) of their K chunks per sample; step "
                                      "arms get the fraction that trains the same expected transitions")
    uniform: str = option("uniform:3", "chunk strategy of chunk_uniform (its K must match the equal-transition budget)")
    preset: str = option("toy_cpu", "training preset every run starts from")
    overrides: list[str] = option([], "training overrides applied to every run (key=value)")
    eval_per_category: int = option(16, "held-out prompts per GenEval category (at most what the world holds)")
    eval_samples: int = option(16, "images per held-out prompt")
    profile_prompts: int = option(12, "training prompts profiled for the dynamics plan")
    profile_seeds: int = option(2, "noise seeds per profiled prompt")
    plan: str = option("dynamics", "chunk strategy of chunk_dynamics / chunk_ws (planned on the SDE profile)")
    primary_delta: float = option(0.03, "pre-registered effect the primary comparison is powered for")
    assumed_sd: float = option(PRIOR_SD, "pre-registered sd of the paired primary difference (from the v1 ablation)")
    power: float = option(0.8, "target power of the primary comparison")
    alpha: float = option(0.05, "two-sided significance level (secondaries: Holm-corrected at this level)")
    sequential: bool = option(False, "add primary seeds one at a time until the 95 % CI excludes 0 or its half-width "
                                     "< stop_half_width (or max_seeds)")
    min_seeds: int = option(5, "sequential: seeds before the stop rule is looked at")
    max_seeds: int = option(80, "sequential: most primary seeds")
    stop_half_width: float = option(0.015, "sequential: stop once the primary 95 % CI half-width is below this")
    compute: bool = option(True, "false = only rebuild the report from the cached runs (nothing is trained)")
    engine_pin: str = option("", "report-only: read the cached runs of this engine fingerprint (ablation.json "
                                 "settings.engine) although the source has changed since; '' = this source's")
    jobs: int = option(1, "runs in parallel (processes); each uses `threads` torch threads")
    threads: int = option(1, "torch threads per run")
    progress: bool = option(True, "progress output")

    def __post_init__(self) -> None:
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise UserError(f"methods {bad or self.methods} must be a non-empty subset of {list(METHODS)}")
        self.methods = list(dict.fromkeys(self.methods))
        missing = [m for m in PRIMARY if m not in self.methods]
        if missing:
            raise UserError(f"methods {self.methods} lack {missing}: the pre-registered primary comparison is "
                            f"{PRIMARY[0]} − {PRIMARY[1]}")
        for name in ("steps", "eval_per_category", "eval_samples", "jobs", "threads", "profile_prompts",
                     "profile_seeds", "eval_points", "max_seeds"):
            if getattr(self, name) < 1:
                raise UserError(f"{name}={getattr(self, name)} must be >= 1")
        for name in ("seeds", "secondary_seeds", "first_seed", "min_seeds"):
            if getattr(self, name) < 0:
                raise UserError(f"{name}={getattr(self, name)} must be >= 0")
        if not 0 < self.timestep_fraction <= 1:
            raise UserError(f"timestep_fraction={self.timestep_fraction} must be in (0, 1]")
        for name in ("primary_delta", "assumed_sd", "stop_half_width"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise UserError(f"{name}={v} must be a positive number")
        if not 0 < self.power < 1 or not 0 < self.alpha < 1:
            raise UserError(f"power={self.power} and alpha={self.alpha} must be in (0, 1)")
        if self.engine_pin and self.compute and self.engine_pin != engine_fingerprint():
            raise UserError(f"engine_pin={self.engine_pin!r} is not this source's engine ({engine_fingerprint()}): "
                            f"only a report-only run (compute=false) may read another engine's runs")
        if self.steps % self.eval_points:
            raise UserError(f"steps={self.steps} must be a multiple of eval_points={self.eval_points}")

    def primary_seeds(self) -> int:
        """Planned primary seeds: as given, else the power calculation's number."""
        return self.seeds or seeds_needed(self.primary_delta, self.assumed_sd, self.power, self.alpha)

    def other_seeds(self) -> int:
        return self.secondary_seeds or self.primary_seeds()


# --------------------------------------------------------------------------------------------------
# design: budgets and the power calculation


def expected_transitions(sizes: list[int], fraction: float) -> float:
    """Expected trained transitions per sample when int(K·fraction) of K chunks are drawn uniformly (the
    engine's `select_units`): each chunk is drawn with probability k/K, so k/K·Σ sizes."""
    K = len(sizes)
    k = max(1, int(K * fraction))
    return k / K * sum(sizes)


def step_fraction(transitions: int, trainable_steps: int) -> float:
    """The `timestep_fraction` at which a step arm trains exactly `transitions` of `trainable_steps`
    (int(S·f) = T; the midpoint of the interval keeps float rounding away from the boundary)."""
    return (transitions + 0.5) / trainable_steps


def design(cfg: AblationConfig, train_cfg, plan_sizes: list[int] | None) -> dict:
    """Each arm's chunk sizes, timestep_fraction, expected transitions per sample, rewarded images and
    transformer samples per optimizer step — equal by construction across the step and (unweighted) chunk
    arms; UserError when the configuration cannot make them equal."""
    from chunkgrpo.chunks import plan_chunks

    S = train_cfg.trainable_steps
    N = train_cfg.sampling.num_steps
    B = train_cfg.prompts_per_rank * train_cfg.group_size
    chunk_sizes: dict[str, list[int]] = {}
    for m in cfg.methods:
        spec = METHODS[m]
        if spec["kind"] != "chunk":
            continue
        if spec["chunks"] == "{plan}":
            if plan_sizes is None:
                raise UserError(f"{m} needs the dynamics plan")
            chunk_sizes[m] = list(plan_sizes)
        else:
            chunk_sizes[m] = plan_chunks(cfg.uniform, S).sizes
    matched = {m: expected_transitions(s, cfg.timestep_fraction) for m, s in chunk_sizes.items()
               if not METHODS[m].get("weighted")}
    T = matched[PRIMARY[0]]
    unequal = {m: t for m, t in matched.items() if abs(t - T) > 1e-9}
    if unequal:
        raise UserError(f"unequal budgets: {PRIMARY[0]} trains {T:g} transitions per sample but "
                        + ", ".join(f"{m} (sizes {chunk_sizes[m]}) {t:g}" for m, t in unequal.items())
                        + f" at timestep_fraction={cfg.timestep_fraction}; choose `uniform`/`timestep_fraction` "
                          "so that int(K·f)/K·S is the same for every chunk arm")
    if abs(T - round(T)) > 1e-9:
        raise UserError(f"{PRIMARY[0]} (sizes {chunk_sizes[PRIMARY[0]]}) trains {T:g} transitions per sample at "
                        f"timestep_fraction={cfg.timestep_fraction}: a step arm trains a whole number of steps, "
                        f"so no step arm can match it; change timestep_fraction or the plan")
    T = int(round(T))
    budget = cfg.steps * B * (N + T)
    arms = {}
    for m in cfg.methods:
        spec = METHODS[m]
        if spec["kind"] == "step":
            f = step_fraction(T, S)
            arms[m] = {"kind": "step", "chunk_sizes": [1] * S, "timestep_fraction": f,
                       "transitions_per_sample": float(int(S * f)), "rewards_per_step": B,
                       "samples_per_step": B * (N + T), "optimizer_steps": cfg.steps}
        elif spec["kind"] == "chunk":
            sizes = chunk_sizes[m]
            k = max(1, int(len(sizes) * cfg.timestep_fraction))
            arms[m] = {"kind": "chunk", "chunk_sizes": sizes, "timestep_fraction": cfg.timestep_fraction,
                       "trained_chunks": k,
                       "transitions_per_sample": (None if spec.get("weighted")
                                                  else expected_transitions(sizes, cfg.timestep_fraction)),
                       "rewards_per_step": B, "samples_per_step": B * (N + T), "optimizer_steps": cfg.steps}
        else:
            arms[m] = {"kind": "branch", "chunk_sizes": [1] * S, "transitions_per_sample": None,
                       "sample_budget": budget, "optimizer_steps": None}
    return {"trainable_steps": S, "num_steps": N, "samples_per_step": B, "transitions_per_sample": T,
            "sample_budget": budget, "arms": arms,
            "rule": f"step/chunk arms: {cfg.steps} optimizer steps × {B} images, {T} of {S} transitions per sample "
                    f"in expectation; branching arms stop at {budget} cumulative transformer samples "
                    f"(= {cfg.steps} × {B} × ({N} + {T}))"}


def power_plan(cfg: AblationConfig, observed: dict | None = None) -> dict:
    """The pre-registered power calculation (and, with `observed` paired differences, the same at the
    measured sd): seeds for Δ ∈ {0.02, 0.03, 0.05}, power at the planned seeds, the minimum detectable
    effect at the planned and at the current number of seeds."""
    sd = cfg.assumed_sd
    n = cfg.primary_seeds()
    out = {"test": f"two-sided paired t, alpha {cfg.alpha}, power {cfg.power} (scipy noncentral t)",
           "assumed_sd": sd, "primary_delta": cfg.primary_delta, "planned_seeds": n,
           "power_at_planned": paired_power(n, cfg.primary_delta, sd, cfg.alpha) if n >= 2 else float("nan"),
           "seeds_for": {f"{d:g}": seeds_needed(d, sd, cfg.power, cfg.alpha) for d in (0.02, 0.03, 0.05)},
           "mde_at_planned": min_detectable_effect(n, sd, cfg.power, cfg.alpha)}
    if observed and observed.get("n", 0) >= 2 and observed.get("sd", 0) > 0:
        osd, on = observed["sd"], observed["n"]
        out["observed"] = {"sd": osd, "seeds": on, "mde": min_detectable_effect(on, osd, cfg.power, cfg.alpha),
                           "seeds_for_primary_delta": seeds_needed(cfg.primary_delta, osd, cfg.power, cfg.alpha),
                           "power_at_primary_delta": paired_power(on, cfg.primary_delta, osd, cfg.alpha)}
    return out


def primary_endpoint(cfg: AblationConfig) -> dict:
    """The pre-registered primary comparison (written before any run, into config and results)."""
    return {"a": PRIMARY[0], "b": PRIMARY[1],
            "metric": "held-out GenEval overall accuracy (exact toy detector) at the final evaluation point",
            "estimand": f"mean over seeds of ({PRIMARY[0]} − {PRIMARY[1]}), paired by training seed",
            "test": f"two-sided paired t-test, alpha {cfg.alpha}; 95 % t confidence interval",
            "powered_for": {"delta": cfg.primary_delta, "sd": cfg.assumed_sd, "power": cfg.power,
                            "seeds": cfg.primary_seeds()},
            "sequential": ({"min_seeds": cfg.min_seeds, "max_seeds": cfg.max_seeds,
                            "stop": f"95 % CI excludes 0 or half-width < {cfg.stop_half_width}"}
                           if cfg.sequential else None),
            "secondary": [f"{a} − {b}" for a, b in SECONDARY if a in cfg.methods and b in cfg.methods],
            "secondary_correction": "Holm (step-down) over the secondary comparisons present"}


# --------------------------------------------------------------------------------------------------
# one run


@functools.lru_cache(maxsize=1)
def engine_fingerprint() -> str:
    """Hash of the engine's source (a changed engine makes cached runs stale); computed once per process, so
    a long run stays consistent while its source tree is edited (run it from a snapshot to resume it)."""
    root = Path(__file__).resolve().parents[1]
    h = hashlib.sha256()
    files = sorted([*root.glob("*.py"), *(root / "train").glob("*.py"), *(root / "toy").glob("*.py"),
                    *(root / "presets").glob("*.yaml")])
    for f in files:
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def eval_seed(seed: int) -> int:
    return 10_000 + 1_000 * seed


def _train_overrides(spec: dict) -> list[str]:
    arm = spec["arm"]
    method = list(METHODS[spec["method"]]["overrides"])
    chunks = METHODS[spec["method"]].get("chunks")
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
    from chunkgrpo.toy.model import accuracy, sampling_config

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
                if "unshared_transformer_samples" in m:  # step/chunk: trained (sample, step) pairs of the rollout
                    state["transitions"] += m["unshared_transformer_samples"] - self.cfg.sampling.num_steps * B
                    state["samples_seen"] += B
                records.append({"optimizer_step": self.opt_step, "iteration": self.iteration_idx + 1,
                                "reward_mean": m["reward_mean"], "transformer_samples": state["samples"],
                                "rewards": state["rewards"]})
                progress = state["samples"] / budget if branch else self.opt_step / spec["steps"]
                while len(exports) < points and progress >= (len(exports) + 1) / points - 1e-12:
                    j = len(exports) + 1
                    path = exports[-1]["path"] if exports and exports[-1]["iteration"] == records[-1]["iteration"] \
                        else str(self.export(Path(tmp) / f"eval-{j}"))
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
            raise RuntimeError(f"{spec['method']}/seed {spec['seed']}: stopped after {len(exports)} of {points} "
                               f"evaluation points ({state['samples']} of {budget} samples)")
        train_s, train_cpu = time.perf_counter() - t0, time.process_time() - c0
        curve = []
        for e in exports:
            ev = _evaluate(spec, e["path"])
            curve.append({k: v for k, v in e.items() if k != "path"} | ev)
    final = curve[-1]
    return {"method": spec["method"], "seed": spec["seed"], "key": spec["key"],
            "overall": final["overall"], "tasks": final["tasks"], "n_images": final["n_images"],
            "curve": curve, "optimizer_steps": final["optimizer_step"], "iterations": final["iteration"],
            "chunk_sizes": summary["chunk_sizes"], "timestep_fraction": cfg.timestep_fraction,
            "reward_curve": [(r["optimizer_step"], r["reward_mean"], r["transformer_samples"]) for r in records],
            "transformer_samples": final["transformer_samples"], "rewards": final["rewards"],
            "transitions_per_sample": (state["transitions"] / state["samples_seen"]) if state["samples_seen"] else None,
            "train_wall_s": round(train_s, 2), "train_cpu_s": round(train_cpu, 2),
            "wall_s": round(time.perf_counter() - t0, 2), "cpu_s": round(time.process_time() - c0, 2),
            "config": cfg.to_dict()}


def base_one(spec: dict) -> dict:
    """The base model's held-out accuracy with a seed's evaluation noise (point 0 of every arm's curve)."""
    import torch

    torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    ev = _evaluate(spec, None)
    return {"method": "base", "seed": spec["seed"], "key": spec["key"], **ev, "wall_s": round(time.perf_counter() - t0, 2)}


# --------------------------------------------------------------------------------------------------
# the ablation


def _key(obj) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:16]


def _write_json(path: Path, obj) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    tmp.replace(path)


def dynamics_plan(cfg: AblationConfig, model_dir: str, prompts: list[str], out: Path, train_cfg) -> dict:
    """Profile the base model on its training SDE (and the ODE from the same noise; Eq. 15) and plan the
    chunks on the SDE curve (cached in `out`)."""
    from chunkgrpo.chunks import plan_chunks, write_plan
    from chunkgrpo.dynamics import ProfileConfig, profile_model, select_trajectories, write_profile
    from chunkgrpo.flux import load_flux

    s = train_cfg.sampling
    key = _key({"model": model_dir, "n": cfg.profile_prompts, "seeds": cfg.profile_seeds, "plan": cfg.plan,
                "sampling": s.to_dict(), "trajectories": "sde", "engine": cfg.engine_pin or engine_fingerprint()})
    plan_path = out / "plan.json"
    if plan_path.exists():
        old = json.loads(plan_path.read_text())
        if old.get("ablation_key") == key:
            return old
    if s.eta <= 0 or s.stochastic == "none":
        raise UserError(f"the dynamics plan is made on the training SDE, but sampling has eta={s.eta}, "
                        f"stochastic={s.stochastic!r}")
    pcfg = ProfileConfig(model=model_dir, prompts="(ablation)", out=str(out / "profile.json"),
                         num_prompts=cfg.profile_prompts, seeds=cfg.profile_seeds, sampling=s, trajectories="sde")
    profile = profile_model(load_flux(model_dir), prompts[: cfg.profile_prompts], pcfg, progress=False)
    write_profile(profile, out / "profile.json")
    curve, kind = select_trajectories(profile, "sde")
    plan = plan_chunks(cfg.plan, train_cfg.trainable_steps, curve)
    d = plan.to_dict(profile)
    d["trajectories"] = kind
    d["ablation_key"] = key
    write_plan(d, plan_path)
    return d


def _prepare(cfg: AblationConfig) -> dict:
    """Model, prompts, base training config, evaluation set, plan and design (no training)."""
    from chunkgrpo.prompts import load_prompts
    from chunkgrpo.toy.model import build_toy_model, read_meta
    from chunkgrpo.toy.world import World
    from chunkgrpo.train.config import TrainConfig

    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(cfg.model) if cfg.model else build_toy_model(Path(".chunkgrpo/models/toy"))
    meta = read_meta(model_dir)
    if meta is None:
        raise UserError(f"model={str(model_dir)!r} is not a toy model folder (build one with `chunkgrpo toy-model`)")
    model_dir = str(model_dir.resolve())
    prompts_file = str(Path(model_dir) / meta["files"]["train_prompts"])
    base_cfg = TrainConfig.load(cfg.preset, [*cfg.overrides, f"model={model_dir}", f"prompts={prompts_file}"])
    world = World(meta["config"]["seed"], meta["config"]["size"])
    eval_md = world.eval_prompts(cfg.eval_per_category, "heldout")
    plan = None
    if any(METHODS[m].get("chunks") == "{plan}" for m in cfg.methods):
        plan = dynamics_plan(cfg, model_dir, load_prompts(prompts_file), out, base_cfg)
        log.info("dynamics plan (SDE profile): %s", plan["sizes"])
    des = design(cfg, base_cfg, plan["sizes"] if plan else None)
    return {"out": out, "model_dir": model_dir, "meta": meta, "prompts_file": prompts_file, "base_cfg": base_cfg,
            "eval_md": eval_md, "plan": plan, "design": des}


def series_key(cfg: AblationConfig, prep: dict) -> str:
    """What a seed's runs depend on besides the seed: a changed engine, model or design starts a new series."""
    return _key({"model_key": prep["meta"]["key"], "preset": cfg.preset, "overrides": cfg.overrides,
                 "steps": cfg.steps, "eval": [cfg.eval_per_category, cfg.eval_samples, cfg.eval_points],
                 "engine": cfg.engine_pin or engine_fingerprint(),
                 "plan": prep["plan"]["sizes"] if prep["plan"] else None,
                 "design": prep["design"]["arms"], "uniform": cfg.uniform})


def _spec(cfg: AblationConfig, prep: dict, method: str, seed: int) -> dict:
    series = series_key(cfg, prep)
    arm = prep["design"]["arms"].get(method, {"kind": "base"})
    key = _key({"series": series, "method": method, "seed": seed, "method_overrides": METHODS.get(method)})
    bc = prep["base_cfg"]
    return {"method": method, "seed": seed, "key": key, "path": str(prep["out"] / "runs" / method / f"seed-{seed}.json"),
            "model": prep["model_dir"], "prompts": prep["prompts_file"], "preset": cfg.preset,
            "overrides": list(cfg.overrides), "steps": cfg.steps, "threads": cfg.threads, "arm": arm,
            "eval_metadata": prep["eval_md"], "eval_samples": cfg.eval_samples, "eval_points": cfg.eval_points,
            "plan_path": str(prep["out"] / "plan.json"), "uniform": cfg.uniform,
            "sample_budget": prep["design"]["sample_budget"], "num_steps": bc.sampling.num_steps,
            "size": bc.sampling.height, "max_sequence_length": bc.sampling.max_sequence_length}


def _cached(spec: dict) -> bool:
    p = Path(spec["path"])
    return p.exists() and json.loads(p.read_text()).get("key") == spec["key"]


def run_ablation(cfg: AblationConfig) -> dict:
    """Run (or resume) the ablation; returns the aggregated result (also written to `<out>/ablation.json`).
    Order: the primary pair (and the base) seed by seed, so a partial run is a valid sequential interim,
    then the secondary methods."""
    t_start = time.perf_counter()
    prep = _prepare(cfg)
    state = {"computed": 0, "t_start": t_start, "stop": None}

    def finish_one(spec: dict, res: dict) -> None:
        _write_json(Path(spec["path"]), res)
        state["computed"] += 1
        report(cfg, prep, state)

    primary = ["base", *PRIMARY]
    others = [m for m in cfg.methods if m not in primary]
    s0 = cfg.first_seed
    if cfg.compute:
        if cfg.sequential:
            seed = s0
            while True:
                diffs = _primary_diffs(cfg, prep)
                stop, why = sequential_decision(diffs, min_seeds=cfg.min_seeds, max_seeds=cfg.max_seeds,
                                                half_width=cfg.stop_half_width)
                state["stop"] = why
                if stop:
                    break
                _execute([s for s in (_spec(cfg, prep, m, seed) for m in primary) if not _cached(s)], cfg, finish_one)
                seed += 1
            n_primary = seed - s0
        else:
            n_primary = cfg.primary_seeds()
            specs = [_spec(cfg, prep, m, s) for s in range(s0, s0 + n_primary) for m in primary]
            _execute([s for s in specs if not _cached(s)], cfg, finish_one)
        specs = [_spec(cfg, prep, m, s) for s in range(s0, s0 + cfg.other_seeds()) for m in others]
        _execute([s for s in specs if not _cached(s)], cfg, finish_one)
    return report(cfg, prep, state)


def run_series(cfg: AblationConfig, series_root: str, new_seeds: int, store=None) -> dict:
    """A nightly series that accumulates: the runs of every earlier night are kept in S3 under
    `<series_root>/<series key>/runs/<method>/seed-<s>.json` (plus the plan), downloaded and reused; this
    night adds `new_seeds` seeds after the last complete one, uploads its new runs and reports all seeds
    so far. The series key hashes the model, engine source, preset, overrides and design, so a changed
    engine or configuration starts a new series instead of mixing incomparable runs."""
    from chunkgrpo.store import parse_s3_uri, s3_uri
    from chunkgrpo.store.client import ArtifactStore

    if new_seeds < 1:
        raise UserError(f"new_seeds={new_seeds} must be >= 1")
    if not series_root.startswith("s3://"):
        raise UserError(f"series_root={series_root!r} must be an s3:// prefix")
    store = store or ArtifactStore()
    out = Path(cfg.out)
    bucket, root = parse_s3_uri(series_root.rstrip("/"))
    # the plan first (so the series key is known without re-profiling when an earlier night planned already)
    pre = dataclasses.replace(cfg, compute=False)
    prep = _prepare(pre)
    key = series_key(pre, prep)
    prefix = f"{root}/{key}"
    for e in store.list(s3_uri(bucket, prefix + "/runs/")):
        rel = e.key[len(prefix) + 1:]
        store.get_file(s3_uri(bucket, e.key), out / rel)
    done_before = _complete_seeds(pre, prep)
    start = (max(done_before) + 1) if done_before else cfg.first_seed
    total = start - cfg.first_seed + new_seeds
    night = dataclasses.replace(cfg, seeds=total, secondary_seeds=total, sequential=False)
    t0 = time.perf_counter()
    prep = _prepare(night)
    state = {"computed": 0, "t_start": t0, "stop": None}
    others = [m for m in night.methods if m not in PRIMARY]
    specs = [_spec(night, prep, m, s_) for s_ in range(start, start + new_seeds) for m in ["base", *PRIMARY, *others]]
    todo = [x for x in specs if not _cached(x)]

    def finish_one(spec: dict, res: dict) -> None:
        _write_json(Path(spec["path"]), res)
        state["computed"] += 1

    _execute(todo, night, finish_one)
    for x in specs:
        rel = Path(x["path"]).relative_to(out).as_posix()
        store.put_file(x["path"], s3_uri(bucket, f"{prefix}/{rel}"))
    result = report(night, prep, state)
    seeds_now = _complete_seeds(night, prep)
    pr = result["primary"]
    result["series"] = {"key": key, "uri": s3_uri(bucket, prefix), "seeds_before": len(done_before),
                        "seeds_added": [s_ for s_ in seeds_now if s_ not in done_before], "seeds": seeds_now,
                        "runs_reused": sum(len(v) for v in _load_runs(night, prep).values()) - len(todo),
                        "runs_computed": len(todo)}
    result["primary"]["nightly_summary"] = (
        f"series {key}: {len(seeds_now)} seeds so far ({len(result['series']['seeds_added'])} added tonight); "
        f"{pr['a']} − {pr['b']} = " + (f"{pr['diff']['mean']:+.4f} ± {pr['diff']['ci95']:.4f}"
                                       if pr.get("diff") and pr["diff"]["n"] >= 2 else "n/a (< 2 seeds)")
        + f"; minimum detectable effect at {len(seeds_now)} seeds: {_f(pr.get('mde_at_seeds'), 4)} (observed sd), "
          f"{_f(pr.get('mde_at_seeds_assumed_sd'), 4)} (pre-registered sd)")
    _write_json(out / "ablation.json", result)
    (out / "ablation.md").write_text(markdown(result))
    return result


def _complete_seeds(cfg: AblationConfig, prep: dict) -> list[int]:
    """Seeds with a cached run of every method (and the base) of this series."""
    runs = _load_runs(cfg, prep)
    sets = [set(runs.get(m, {})) for m in ["base", *cfg.methods]]
    return sorted(set.intersection(*sets)) if sets else []


def _execute(specs: list[dict], cfg: AblationConfig, done) -> None:
    from chunkgrpo.progress import progress_bar

    if not specs:
        return
    fn = {True: base_one, False: run_one}
    bar = progress_bar(total=len(specs), desc="ablation runs", disable=not cfg.progress)
    if cfg.jobs == 1:
        for spec in specs:
            res = fn[spec["method"] == "base"](spec)
            done(spec, res)
            bar.update(1)
            bar.set_postfix(last=f"{spec['method']}/{spec['seed']}={res['overall']:.3f}")
    else:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor, as_completed

        with ProcessPoolExecutor(cfg.jobs, mp_context=mp.get_context("spawn")) as pool:
            futs = {pool.submit(fn[s["method"] == "base"], s): s for s in specs}
            for f in as_completed(futs):
                spec = futs[f]
                res = f.result()
                done(spec, res)
                bar.update(1)
                bar.set_postfix(last=f"{spec['method']}/{spec['seed']}={res['overall']:.3f}")
    bar.close()


def _load_runs(cfg: AblationConfig, prep: dict) -> dict[str, dict[int, dict]]:
    """Every cached run of this series (any seed ≥ first_seed), by method and seed."""
    runs: dict[str, dict[int, dict]] = {}
    for m in ["base", *cfg.methods]:
        folder = prep["out"] / "runs" / m
        for p in sorted(folder.glob("seed-*.json")) if folder.exists() else []:
            seed = int(p.stem.split("-", 1)[1])
            if seed < cfg.first_seed:
                continue
            r = json.loads(p.read_text())
            if r.get("key") == _spec(cfg, prep, m, seed)["key"]:
                runs.setdefault(m, {})[seed] = r
    return runs


def _primary_diffs(cfg: AblationConfig, prep: dict) -> list[float]:
    runs = _load_runs(cfg, prep)
    a, b = runs.get(PRIMARY[0], {}), runs.get(PRIMARY[1], {})
    return [a[s]["overall"] - b[s]["overall"] for s in sorted(set(a) & set(b))]


def report(cfg: AblationConfig, prep: dict, state: dict) -> dict:
    """Aggregate the cached runs and (re)write ablation.json, ablation.md and the PNGs."""
    out = prep["out"]
    result = aggregate(cfg, prep)
    result["plan"] = prep["plan"]
    meta = prep["meta"]
    result["model"] = {"path": prep["model_dir"], "key": meta["key"], "pretraining": meta.get("pretraining"),
                       "base_accuracy": meta.get("base_accuracy")}
    result["settings"] = {**cfg.to_dict(), "train_config": prep["base_cfg"].to_dict(),
                          "eval_prompts": [md["prompt"] for md in prep["eval_md"]],
                          "engine": cfg.engine_pin or engine_fingerprint(),
                          "series": series_key(cfg, prep)}
    result["elapsed_s"] = round(time.perf_counter() - state["t_start"], 1)
    result["computed_runs"] = state["computed"]
    if state.get("stop"):
        result["primary"]["sequential_state"] = state["stop"]
    _write_json(out / "ablation.json", result)
    (out / "ablation.md").write_text(markdown(result))
    plot_curves(result, out / "reward_curves.png")
    plot_learning_curves(result, out / "curves.png")
    return result


# --------------------------------------------------------------------------------------------------
# aggregation and outputs


def _curve_stats(rs: list[dict], base: dict[int, dict]) -> list[dict]:
    """Per evaluation point (0 = the base model): mean ± CI of accuracy, mean samples / steps / rewards."""
    pts = sorted({c["point"] for r in rs for c in r.get("curve", [])})
    out = []
    b0 = [base[r["seed"]]["overall"] for r in rs if r["seed"] in base]
    if b0:
        out.append({"point": 0, "overall": mean_ci(b0), "transformer_samples": 0.0, "optimizer_step": 0.0,
                    "rewards": 0.0})
    for j in pts:
        cs = [c for r in rs for c in r.get("curve", []) if c["point"] == j]
        out.append({"point": j, "overall": mean_ci([c["overall"] for c in cs]),
                    "transformer_samples": sum(c["transformer_samples"] for c in cs) / len(cs),
                    "optimizer_step": sum(c["optimizer_step"] for c in cs) / len(cs),
                    "rewards": sum(c["rewards"] for c in cs) / len(cs)})
    return out


def _point_value(run: dict, point: int, base: dict | None) -> float | None:
    if point == 0:
        return base["overall"] if base else None
    for c in run.get("curve", []):
        if c["point"] == point:
            return c["overall"]
    return None


def aggregate(cfg: AblationConfig, prep: dict) -> dict:
    """Per method: accuracy per category and overall at the endpoint (mean ± 95 % CI over seeds), learning
    curve, budget; paired comparisons (primary + Holm-corrected secondaries); the power calculation."""
    runs = _load_runs(cfg, prep)
    des = prep["design"]
    base = runs.get("base", {})
    methods = {}
    for m in ["base", *cfg.methods]:
        by_seed = runs.get(m, {})
        if not by_seed:
            continue
        rs = [by_seed[s] for s in sorted(by_seed)]
        entry = {"label": LABELS.get(m, "base model"), "seeds": sorted(by_seed),
                 "overall": mean_ci([r["overall"] for r in rs]),
                 "tasks": {t: mean_ci([r["tasks"][t] for r in rs if t in r["tasks"]]) for t in TAGS}}
        if m != "base":
            entry["gain"] = mean_ci([by_seed[s]["overall"] - base[s]["overall"] for s in sorted(by_seed) if s in base])
            entry["wall_s"] = mean_ci([r["wall_s"] for r in rs])
            entry["train_cpu_s"] = mean_ci([r["train_cpu_s"] for r in rs])
            entry["transformer_samples"] = mean_ci([r["transformer_samples"] for r in rs])
            entry["rewards"] = mean_ci([r["rewards"] for r in rs])
            tps = [r["transitions_per_sample"] for r in rs if r.get("transitions_per_sample") is not None]
            entry["transitions_per_sample"] = mean_ci(tps) if tps else None
            entry["optimizer_steps"] = sorted({r["optimizer_steps"] for r in rs})
            entry["chunk_sizes"] = rs[0]["chunk_sizes"]
            entry["design"] = des["arms"][m]
            entry["curve"] = _curve_stats(rs, base)
            curves = [{st: rew for st, rew, *_ in r["reward_curve"]} for r in rs]
            samples = [{st: x[0] for st, _, *x in r["reward_curve"] if x} for r in rs]
            steps = sorted(set().union(*curves))
            entry["reward_curve"] = []
            for st in steps:
                c = mean_ci([cv[st] for cv in curves if st in cv])
                xs = [sv[st] for sv in samples if st in sv]
                entry["reward_curve"].append((st, c["mean"], c.get("sd", 0.0), sum(xs) / len(xs) if xs else None))
        methods[m] = entry
    paired = []
    for role, (a, b) in [("primary", PRIMARY), *[("secondary", p) for p in SECONDARY]]:
        if a not in runs or b not in runs:
            continue
        common = sorted(set(runs[a]) & set(runs[b]))
        if not common:
            continue
        diffs = [runs[a][s]["overall"] - runs[b][s]["overall"] for s in common]
        pts = sorted({c["point"] for s in common for c in runs[a][s].get("curve", [])})
        per_point = []
        for j in ([0] if base else []) + pts:
            vals = {}
            for s in common:
                va = _point_value(runs[a][s], j, base.get(s))
                vb = _point_value(runs[b][s], j, base.get(s))
                if va is not None and vb is not None:
                    vals[s] = va - vb
            per_point.append({"point": j, "diff": mean_ci(list(vals.values())), "by_seed": vals})
        paired.append({"a": a, "b": b, "role": role, "seeds": common, "diff": mean_ci(diffs),
                       "wins": sum(d > 0 for d in diffs), "ties": sum(d == 0 for d in diffs),
                       "losses": sum(d < 0 for d in diffs), "curve": per_point})
    sec = [p for p in paired if p["role"] == "secondary"]
    for p, adj in zip(sec, holm([p["diff"].get("p", float("nan")) for p in sec])):
        p["p_holm"] = adj
    prim = next((p for p in paired if p["role"] == "primary"), None)
    primary = {**primary_endpoint(cfg), "planned_seeds": cfg.primary_seeds()}
    if prim:
        d = prim["diff"]
        primary.update({"seeds": prim["seeds"], "diff": d,
                        "ci": [d["mean"] - d["ci95"], d["mean"] + d["ci95"]] if d["n"] >= 2 else None,
                        "mde_at_seeds": min_detectable_effect(d["n"], d.get("sd", float("nan")), cfg.power, cfg.alpha)
                        if d["n"] >= 2 else float("nan"),
                        "mde_at_seeds_assumed_sd": min_detectable_effect(d["n"], cfg.assumed_sd, cfg.power, cfg.alpha)
                        if d["n"] >= 2 else float("nan")})
        stop, why = sequential_decision([d_ for d_ in d["values"]], min_seeds=cfg.min_seeds if cfg.sequential else
                                        cfg.primary_seeds(), max_seeds=cfg.max_seeds if cfg.sequential else
                                        cfg.primary_seeds(), half_width=cfg.stop_half_width)
        primary["status"] = "final" if stop else "interim"
        primary["status_reason"] = why
    else:
        primary.update({"seeds": [], "status": "interim", "status_reason": "no paired seed finished yet"})
    power = power_plan(cfg, prim["diff"] if prim else None)
    evsd = None
    if "base" in methods and base:
        r0 = next(iter(base.values()))
        acc = {t: methods["base"]["tasks"][t]["mean"] for t in TAGS if t in r0.get("images", {})}
        evsd = {"base_overall_sd": eval_sd(acc, r0.get("images", {})), "images_per_eval": r0.get("n_images"),
                "note": "binomial sd of one evaluation's overall score at the base model's per-category accuracy"}
    return {"format": FORMAT, "methods": methods, "paired": paired, "primary": primary, "power": power,
            "design": des, "eval_noise": evsd, "tags": list(TAGS)}


def _pm(c: dict | None, digits: int = 3) -> str:
    if not c or c.get("n", 0) == 0:
        return "–"
    if c["n"] < 2 or not math.isfinite(c["ci95"]):
        return f"{c['mean']:.{digits}f}"
    return f"{c['mean']:.{digits}f} ± {c['ci95']:.{digits}f}"


def _f(x, digits: int = 3) -> str:
    return "–" if x is None or (isinstance(x, float) and not math.isfinite(x)) else f"{x:.{digits}f}"


def markdown(result: dict) -> str:
    s = result["settings"]
    tc = s["train_config"]
    pr, pw, des = result["primary"], result["power"], result["design"]
    status = pr.get("status", "interim").upper()
    lines = [f"# Toy-world ablation: chunk vs step, budget-matched ({status})", "",
             f"**Status: {status}** — {pr.get('status_reason', '')}. Primary pair: {len(pr.get('seeds', []))} of "
             f"{pr['planned_seeds']} planned seeds.", "",
             f"Base model `{result['model']['key']}`; {tc['prompts_per_rank']} prompts × {tc['group_size']} samples "
             f"per optimizer step; {tc['sampling']['num_steps']} sampling steps at {tc['sampling']['height']}²; "
             f"lr {tc['lr']}, LoRA r{tc['lora']['rank']}; reward `toy_geneval` (graded credit). Evaluation: "
             f"{len(s['eval_prompts'])} held-out prompts × {s['eval_samples']} images at {s['eval_points']} points per "
             f"run, trained model alone, ODE, the same noise for every arm of a seed. Mean ± 95 % CI (t) over seeds.",
             ""]
    if pr.get("nightly_summary"):
        lines += [f"**Nightly series** — {pr['nightly_summary']}.", ""]
    if result.get("plan"):
        lines += [f"Dynamics plan (engine profile on **{result['plan'].get('trajectories', '?').upper()}** "
                  f"trajectories + `{s['plan']}`): chunk sizes {result['plan']['sizes']}.", ""]
    lines += ["## Pre-registered primary endpoint", "",
              f"- {pr['metric']}; {pr['estimand']}; {pr['test']}.",
              f"- Powered for Δ = {pr['powered_for']['delta']} at paired sd {pr['powered_for']['sd']} "
              f"({pr['powered_for']['power']:.0%} power): {pr['powered_for']['seeds']} seeds.",
              f"- Secondary ({pr['secondary_correction']}): " + ", ".join(f"`{x}`" for x in pr["secondary"]) + "."]
    if pr.get("sequential"):
        q = pr["sequential"]
        lines.append(f"- Sequential: from {q['min_seeds']} seeds, stop when {q['stop']} (at most {q['max_seeds']}).")
    if pr.get("diff"):
        d = pr["diff"]
        ci = pr.get("ci")
        lines += ["", f"**Primary result** (`{pr['a']}` − `{pr['b']}`, {d['n']} seeds): "
                  f"{_pm(d, 4)}" + (f" (95 % CI [{ci[0]:+.4f}, {ci[1]:+.4f}], p = {d.get('p', float('nan')):.3g})"
                                    if ci else "") +
                  f"; minimum detectable effect at {d['n']} seeds (80 % power): {_f(pr.get('mde_at_seeds'), 4)} at the "
                  f"observed sd, {_f(pr.get('mde_at_seeds_assumed_sd'), 4)} at the pre-registered sd."]
    lines += ["", "## Power calculation (scipy, " + pw["test"] + ")", "",
              f"Pre-registered paired sd {pw['assumed_sd']} (v1 ablation, 5 seeds). Seeds needed: "
              + ", ".join(f"Δ = {k}: {v}" for k, v in pw["seeds_for"].items())
              + f". Planned {pw['planned_seeds']} seeds: power {_f(pw['power_at_planned'], 3)} at Δ = "
                f"{pw['primary_delta']}, minimum detectable effect {_f(pw['mde_at_planned'], 4)}."]
    if pw.get("observed"):
        o = pw["observed"]
        lines.append(f"Observed so far: paired sd {o['sd']:.4f} over {o['seeds']} seeds → power "
                     f"{o['power_at_primary_delta']:.3f} at Δ = {pw['primary_delta']}, MDE {o['mde']:.4f}; "
                     f"seeds for Δ = {pw['primary_delta']} at this sd: {o['seeds_for_primary_delta']}.")
    if result.get("eval_noise") and result["eval_noise"].get("base_overall_sd") is not None:
        e = result["eval_noise"]
        lines.append(f"Evaluation noise: {e['images_per_eval']} images per evaluation, binomial sd of the overall "
                     f"score ≈ {_f(e['base_overall_sd'], 4)} at the base model's accuracies.")
    lines += ["", "## Budgets (from the configs; measured means in parentheses)", "", des["rule"] + ".", "",
              "| arm | chunks | fraction | transitions / sample | optimizer steps | rewarded images | transformer samples |",
              "|---|---|---|---|---|---|---|"]
    for m, a in des["arms"].items():  # every arm of the design, with the measured means once it has runs
        e = result["methods"].get(m, {})
        tps = a.get("transitions_per_sample")
        meas = e.get("transitions_per_sample")
        tcol = (f"{tps:g}" if tps is not None else "weighted" if a["kind"] == "chunk" else "one per branching step") + (
            f" ({meas['mean']:.2f})" if meas else "")
        frac = f"{a['timestep_fraction']:.4g}" if a.get("timestep_fraction") else "–"
        steps = (f"{a['optimizer_steps']}" if a.get("optimizer_steps") else "until the sample budget") + (
            f" ({'/'.join(map(str, e['optimizer_steps']))})" if e.get("optimizer_steps") else "")
        rew = (f"{a['rewards_per_step'] * a['optimizer_steps']}" if a.get("rewards_per_step") else "–") + (
            f" ({e['rewards']['mean']:.0f})" if e.get("rewards") else "")
        smp = (f"≤ {a['samples_per_step'] * a['optimizer_steps']}" if a.get("samples_per_step")
               else f"{a['sample_budget']}") + (f" ({e['transformer_samples']['mean']:.0f})"
                                                  if e.get("transformer_samples") else "")
        chunks = a["chunk_sizes"] if a["kind"] == "chunk" else a["kind"]
        lines.append(f"| `{m}` | {chunks} | {frac} | {tcol} | {steps} | {rew} | {smp} |")
    head = ["method", "seeds", "overall (final)", *[t.replace("_", " ") for t in result["tags"]], "gain vs base",
            "wall s"]
    lines += ["", "## Held-out accuracy at the endpoint", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, e in result["methods"].items():
        row = [e["label"] + ("" if m == "base" else f" (`{m}`)"), str(len(e["seeds"])), _pm(e["overall"]),
               *[_pm(e["tasks"][t], 2) for t in result["tags"]]]
        row += ["–", "–"] if m == "base" else [_pm(e["gain"]), f"{e['wall_s']['mean']:.0f}"]
        lines.append("| " + " | ".join(row) + " |")
    if result["paired"]:
        lines += ["", "## Paired comparisons (same training seed, same evaluation noise)", "",
                  "| comparison | role | seeds | mean diff ± 95 % CI | p | p (Holm) | wins / ties / losses |",
                  "|---|---|---|---|---|---|---|"]
        for p in result["paired"]:
            lines.append(f"| `{p['a']}` − `{p['b']}` | {p['role']} | {len(p['seeds'])} | {_pm(p['diff'], 4)} | "
                         f"{_f(p['diff'].get('p'), 3)} | {_f(p.get('p_holm'), 3) if p['role'] != 'primary' else '–'} | "
                         f"{p['wins']} / {p['ties']} / {p['losses']} |")
    curves = [(m, e) for m, e in result["methods"].items() if m != "base" and e.get("curve")]
    if curves:
        npts = max(len(e["curve"]) for _, e in curves)
        lines += ["", "## Learning curves (held-out accuracy per evaluation point; point 0 = base model)", "",
                  "| method | " + " | ".join(f"point {j}" for j in range(npts)) + " |", "|---|" + "---|" * npts]
        for m, e in curves:
            cells = [f"{_pm(c['overall'])} @ {c['transformer_samples']:.0f} samples" for c in e["curve"]]
            lines.append(f"| `{m}` | " + " | ".join(cells + ["–"] * (npts - len(cells))) + " |")
    lines += ["", f"Computed runs this invocation: {result.get('computed_runs')}; elapsed {result.get('elapsed_s')} s.",
              ""]
    return "\n".join(lines)


def plot_curves(result: dict, path: Path) -> Path | None:
    """Training reward (mean over seeds, ± sd band) per optimizer step, one line per method."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5), dpi=110)
    any_curve = False
    for i, (m, e) in enumerate(result["methods"].items()):
        curve = e.get("reward_curve")
        if not curve:
            continue
        x = [c[0] for c in curve]
        y = [c[1] for c in curve]
        sd = [c[2] if c[2] == c[2] else 0.0 for c in curve]
        ax.plot(x, y, label=e["label"], color=f"C{i}", marker="." if len(x) < 30 else None)
        ax.fill_between(x, [a - b for a, b in zip(y, sd)], [a + b for a, b in zip(y, sd)], color=f"C{i}", alpha=0.12)
        any_curve = True
    if not any_curve:
        plt.close(fig)
        return None
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training reward (toy_geneval, graded)")
    ax.set_title("Toy-world ablation: training reward (mean ± sd over seeds)")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_learning_curves(result: dict, path: Path) -> Path | None:
    """Three panels: (1) the primary paired difference per evaluation point, one thin line per seed and the
    mean ± 95 % CI; (2) held-out accuracy (mean ± 95 % CI) of every arm against cumulative transformer
    samples; (3) the training reward against cumulative transformer samples."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prim = next((p for p in result["paired"] if p["role"] == "primary"), None)
    arms = [(m, e) for m, e in result["methods"].items() if m != "base" and e.get("curve")]
    if not arms:
        return None
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.6), dpi=100)
    ax = axes[0]
    if prim and prim["curve"]:
        pts = [c["point"] for c in prim["curve"]]
        for s in prim["seeds"]:
            ys = [c["by_seed"].get(s, c["by_seed"].get(str(s))) for c in prim["curve"]]
            ax.plot(pts, ys, color="grey", alpha=0.35, linewidth=0.8)
        m_ = [c["diff"]["mean"] for c in prim["curve"]]
        h = [c["diff"]["ci95"] if math.isfinite(c["diff"].get("ci95", float("nan"))) else 0.0 for c in prim["curve"]]
        ax.plot(pts, m_, color="C3", linewidth=2.2, marker="o", label=f"mean ± 95 % CI ({len(prim['seeds'])} seeds)")
        ax.fill_between(pts, [a - b for a, b in zip(m_, h)], [a + b for a, b in zip(m_, h)], color="C3", alpha=0.2)
        ax.axhline(0, color="black", linewidth=0.8)
        ax.set_title(f"primary: {prim['a']} − {prim['b']} (per seed, paired)", fontsize=9)
        ax.legend(fontsize=7)
    ax.set_xlabel("evaluation point (0 = base model)")
    ax.set_ylabel("Δ held-out accuracy")
    ax = axes[1]
    for i, (m, e) in enumerate(arms):
        x = [c["transformer_samples"] for c in e["curve"]]
        y = [c["overall"]["mean"] for c in e["curve"]]
        h = [c["overall"]["ci95"] if math.isfinite(c["overall"].get("ci95", float("nan"))) else 0.0 for c in e["curve"]]
        ax.plot(x, y, marker="o", color=f"C{i}", label=f"{m} ({len(e['seeds'])})")
        ax.fill_between(x, [a - b for a, b in zip(y, h)], [a + b for a, b in zip(y, h)], color=f"C{i}", alpha=0.12)
    ax.set_xlabel("cumulative transformer samples")
    ax.set_ylabel("held-out accuracy (mean ± 95 % CI)")
    ax.set_title("learning curves, equal budgets", fontsize=9)
    ax.legend(fontsize=7)
    ax = axes[2]
    for i, (m, e) in enumerate(arms):
        rc = [c for c in e.get("reward_curve", []) if c[3] is not None]
        if rc:
            ax.plot([c[3] for c in rc], [c[1] for c in rc], color=f"C{i}", label=m, linewidth=1)
    ax.set_xlabel("cumulative transformer samples")
    ax.set_ylabel("training reward (mean over seeds)")
    ax.set_title("training reward", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def copy_results(src: Path, dst: Path) -> None:
    """Copy an ablation's outputs (not the per-run cache) to `dst`."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("ablation.json", "ablation.md", "curves.png", "reward_curves.png", "plan.json", "profile.json",
                 "profile.png"):
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)
