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

**Equal budgets by construction** (`ablation_design.design()`; step/chunk arms: the same optimizer steps,
rollouts and expected transitions per sample; branching arms: the same cumulative transformer samples).

The report states each arm's trained transitions per sample, rewarded images and transformer samples.

**Pre-registered primary endpoint** (fixed before the run, written into the config and results file):
held-out GenEval accuracy at the final evaluation point, `chunk_dynamics − step_flow`, paired by seed,
two-sided paired t at α = 0.05. Seeds = `seeds_needed(Δ = primary_delta, σ = assumed_sd)` at 80 % power
unless given; `sequential` adds seeds until the 95 % CI excludes 0 or its half-width is below
`stop_half_width`. Secondary comparisons are Holm-corrected.

**Evaluation** (`ablation_runs`): `eval_points` checkpoints per run, each on the world's held-out prompts
(attribute combinations never seen in training) with the same noise for every arm of a seed.

Results are cached per (method, seed) under `<out>/runs/<method>/seed-<s>.json`, keyed by the run's
settings, the toy model and the engine's source; a re-run only computes what is missing or stale, so the
ablation can be run incrementally, resumed, and extended by seeds (the outputs are rewritten after every
finished run, so an interrupted run leaves a valid interim report). Outputs: `ablation.json`,
`ablation.md`, `curves.png` (learning curves + training reward), `reward_curves.png`, `profile.json/png`
and `plan.json`. Modules: `ablation_design` (arms, budgets, power), `ablation_runs` (one run, the engine
fingerprint), `ablation_report` (aggregation, Markdown, plots); this one holds the configuration, the plan,
the per-run cache and the order of the runs.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import time
from pathlib import Path

from chunkgrpo.config import Config, option
from chunkgrpo.errors import UserError
from chunkgrpo.toy.ablation_design import ARMS, PRIMARY, PRIOR_SD, design
from chunkgrpo.toy.ablation_report import (
    aggregate,
    markdown,
    nightly_summary,
    plot_curves,
    plot_learning_curves,
)
from chunkgrpo.toy.ablation_runs import base_one, engine_fingerprint, run_one
from chunkgrpo.toy.power import seeds_needed, sequential_decision

log = logging.getLogger(__name__)


@dataclasses.dataclass
class AblationConfig(Config):
    """The toy-world ablation (see the module docstring)."""

    model: str = option(
        "",
        "toy model folder (`chunkgrpo toy-model --out DIR`); '' = build/reuse the default one "
        "in .chunkgrpo/models/toy",
    )
    out: str = option("benchmarks/results/ablation", "results folder (per-run cache, JSON, Markdown, PNG)")
    methods: list[str] = option(
        list(ARMS), f"methods to run, of {list(ARMS)}; must hold the primary pair"
    )
    seeds: int = option(0, "training seeds of the primary pair (0 = the power calculation's number for "
                           "primary_delta at assumed_sd)")
    secondary_seeds: int = option(0, "training seeds of the other methods (0 = as many as the primary pair)")
    first_seed: int = option(0, "first training seed")
    steps: int = option(
        72, "optimizer steps per step/chunk run; branching runs stop at the same transformer samples"
    )
    eval_points: int = option(
        4, "evaluations per run, evenly spaced over its budget (the last one is the endpoint)"
    )
    timestep_fraction: float = option(
        0.6667,
        "chunk arms train int(K·fraction) of their K chunks per sample; step "
        "arms get the fraction that trains the same expected transitions",
    )
    uniform: str = option(
        "uniform:3", "chunk strategy of chunk_uniform (its K must match the equal-transition budget)"
    )
    preset: str = option("toy_cpu", "training preset every run starts from")
    overrides: list[str] = option([], "training overrides applied to every run (key=value)")
    eval_per_category: int = option(
        16, "held-out prompts per GenEval category (at most what the world holds)"
    )
    eval_samples: int = option(16, "images per held-out prompt")
    profile_prompts: int = option(12, "training prompts profiled for the dynamics plan")
    profile_seeds: int = option(2, "noise seeds per profiled prompt")
    plan: str = option("dynamics", "chunk strategy of chunk_dynamics / chunk_ws (planned on the SDE profile)")
    primary_delta: float = option(0.03, "pre-registered effect the primary comparison is powered for")
    assumed_sd: float = option(
        PRIOR_SD, "pre-registered sd of the paired primary difference (from the v1 ablation)"
    )
    power: float = option(0.8, "target power of the primary comparison")
    alpha: float = option(0.05, "two-sided significance level (secondaries: Holm-corrected at this level)")
    sequential: bool = option(
        False,
        "add primary seeds one at a time until the 95 % CI excludes 0 or its half-width "
        "< stop_half_width (or max_seeds)",
    )
    min_seeds: int = option(5, "sequential: seeds before the stop rule is looked at")
    max_seeds: int = option(80, "sequential: most primary seeds")
    stop_half_width: float = option(
        0.015, "sequential: stop once the primary 95 % CI half-width is below this"
    )
    compute: bool = option(True, "false = only rebuild the report from the cached runs (nothing is trained)")
    engine_pin: str = option(
        "",
        "report-only: read the cached runs of this engine fingerprint (ablation.json "
        "settings.engine) although the source has changed since; '' = this source's",
    )
    jobs: int = option(1, "runs in parallel (processes); each uses `threads` torch threads")
    threads: int = option(1, "torch threads per run")
    progress: bool = option(True, "progress output")

    def __post_init__(self) -> None:
        bad = [m for m in self.methods if m not in ARMS]
        if bad or not self.methods:
            raise UserError(f"methods {bad or self.methods} must be a non-empty subset of {list(ARMS)}")
        self.methods = list(dict.fromkeys(self.methods))
        missing = [m for m in PRIMARY if m not in self.methods]
        if missing:
            raise UserError(
                f"methods {self.methods} lack {missing}: the pre-registered primary comparison is "
                f"{PRIMARY[0]} − {PRIMARY[1]}"
            )
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
            raise UserError(
                f"engine_pin={self.engine_pin!r} is not this source's engine ({engine_fingerprint()}): "
                f"only a report-only run (compute=false) may read another engine's runs"
            )
        if self.steps % self.eval_points:
            raise UserError(f"steps={self.steps} must be a multiple of eval_points={self.eval_points}")

    def primary_seeds(self) -> int:
        """Planned primary seeds: as given, else the power calculation's number."""
        return self.seeds or seeds_needed(self.primary_delta, self.assumed_sd, self.power, self.alpha)

    def other_seeds(self) -> int:
        return self.secondary_seeds or self.primary_seeds()


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
    key = _key(
        {
            "model": model_dir,
            "n": cfg.profile_prompts,
            "seeds": cfg.profile_seeds,
            "plan": cfg.plan,
            "sampling": s.to_dict(),
            "trajectories": "sde",
            "engine": cfg.engine_pin or engine_fingerprint(),
        }
    )
    plan_path = out / "plan.json"
    if plan_path.exists():
        old = json.loads(plan_path.read_text())
        if old.get("ablation_key") == key:
            return old
    if s.eta <= 0 or s.stochastic == "none":
        raise UserError(f"the dynamics plan is made on the training SDE, but sampling has eta={s.eta}, "
                        f"stochastic={s.stochastic!r}")
    pcfg = ProfileConfig(
        model=model_dir,
        prompts="(ablation)",
        out=str(out / "profile.json"),
        num_prompts=cfg.profile_prompts,
        seeds=cfg.profile_seeds,
        sampling=s,
        trajectories="sde",
    )
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
        raise UserError(
            f"model={str(model_dir)!r} is not a toy model folder (build one with `chunkgrpo toy-model`)"
        )
    model_dir = str(model_dir.resolve())
    prompts_file = str(Path(model_dir) / meta["files"]["train_prompts"])
    base_cfg = TrainConfig.load(cfg.preset, [*cfg.overrides, f"model={model_dir}", f"prompts={prompts_file}"])
    world = World(meta["config"]["seed"], meta["config"]["size"])
    eval_md = world.eval_prompts(cfg.eval_per_category, "heldout")
    plan = None
    if any(ARMS[m].get("chunks") == "{plan}" for m in cfg.methods):
        plan = dynamics_plan(cfg, model_dir, load_prompts(prompts_file), out, base_cfg)
        log.info("dynamics plan (SDE profile): %s", plan["sizes"])
    des = design(cfg, base_cfg, plan["sizes"] if plan else None)
    return {
        "out": out,
        "model_dir": model_dir,
        "meta": meta,
        "prompts_file": prompts_file,
        "base_cfg": base_cfg,
        "eval_md": eval_md,
        "plan": plan,
        "design": des,
    }


def series_key(cfg: AblationConfig, prep: dict) -> str:
    """What a seed's runs depend on besides the seed: a changed engine, model or design starts a new
    series."""
    return _key({"model_key": prep["meta"]["key"], "preset": cfg.preset, "overrides": cfg.overrides,
                 "steps": cfg.steps, "eval": [cfg.eval_per_category, cfg.eval_samples, cfg.eval_points],
                 "engine": cfg.engine_pin or engine_fingerprint(),
                 "plan": prep["plan"]["sizes"] if prep["plan"] else None,
                 "design": prep["design"]["arms"], "uniform": cfg.uniform})


def _spec(cfg: AblationConfig, prep: dict, method: str, seed: int) -> dict:
    series = series_key(cfg, prep)
    arm = prep["design"]["arms"].get(method, {"kind": "base"})
    key = _key({"series": series, "method": method, "seed": seed, "method_overrides": ARMS.get(method)})
    bc = prep["base_cfg"]
    return {
        "method": method,
        "seed": seed,
        "key": key,
        "path": str(prep["out"] / "runs" / method / f"seed-{seed}.json"),
        "model": prep["model_dir"],
        "prompts": prep["prompts_file"],
        "preset": cfg.preset,
        "overrides": list(cfg.overrides),
        "steps": cfg.steps,
        "threads": cfg.threads,
        "arm": arm,
        "eval_metadata": prep["eval_md"],
        "eval_samples": cfg.eval_samples,
        "eval_points": cfg.eval_points,
        "plan_path": str(prep["out"] / "plan.json"),
        "uniform": cfg.uniform,
        "sample_budget": prep["design"]["sample_budget"],
        "num_steps": bc.sampling.num_steps,
        "size": bc.sampling.height,
        "max_sequence_length": bc.sampling.max_sequence_length,
    }


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
                _execute(
                    [s for s in (_spec(cfg, prep, m, seed) for m in primary) if not _cached(s)],
                    cfg,
                    finish_one,
                )
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
    specs = [
        _spec(night, prep, m, s_)
        for s_ in range(start, start + new_seeds)
        for m in ["base", *PRIMARY, *others]
    ]
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
    result["series"] = {"key": key, "uri": s3_uri(bucket, prefix), "seeds_before": len(done_before),
                        "seeds_added": [s_ for s_ in seeds_now if s_ not in done_before], "seeds": seeds_now,
                        "runs_reused": sum(len(v) for v in _load_runs(night, prep).values()) - len(todo),
                        "runs_computed": len(todo)}
    result["primary"]["nightly_summary"] = nightly_summary(result, key, seeds_now)
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
    result = aggregate(cfg, _load_runs(cfg, prep), prep["design"])
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
