"""The paper's ablation on the toy world: step-level vs chunk-level GRPO and its peers, same base model,
equal optimizer steps and equal sampling budget, several seeds, exact held-out GenEval accuracy.

    from chunkgrpo.toy.ablation import AblationConfig, run_ablation
    result = run_ablation(AblationConfig(model="models/toy", out="benchmarks/results/ablation", seeds=5))

Methods (every run: the `toy_cpu` preset, the same base model, prompts, reward and learning rate):

    step_flow        step-level GRPO, Flow-GRPO SDE (rule flow, η 0.7): the matched baseline of chunks
    step_dance       step-level GRPO, DanceGRPO SDE (rule dance, η 0.3)
    chunk_uniform    Chunk-GRPO, uniform chunks of 3 steps
    chunk_dynamics   Chunk-GRPO, chunks planned from this model's own dynamics profile (engine profile + plan)
    chunk_ws         chunk_dynamics + weighted chunk sampling (Eq. 16)
    tempflow         TempFlow-GRPO (ODE anchor, branching, noise-aware weights)
    granular         Granular-GRPO (branching, multi-granularity advantages λ ∈ {1, 2})

Budget: every optimizer step sees the rewards of P·G freshly sampled images (GRPO methods: one optimizer
step per rollout of P prompts × G samples; branching methods: one step per branching step, each with
P × G children — Granular additionally scores each child at its second granularity). All runs make the
same number of optimizer steps. Transformer sample-evaluations (what the budget costs in compute)
and wall time are measured and reported per method.

Evaluation: the trained model alone (all steps), ODE, on the world's held-out prompts (attribute
combinations never seen in training), `eval_samples` images per prompt, seeds 10 000 + 1 000·seed + k;
the base model is evaluated with the same seeds, so per-seed differences are paired.

Results are cached per (method, seed) under `<out>/runs/<method>/seed-<s>.json`, keyed by the run's
settings, the toy model and the engine's source; a re-run only computes what is missing or stale, so a
full ablation can be run incrementally and resumed. Outputs: `ablation.json`, `ablation.md`,
`reward_curves.png`, `profile.json` + `plan.json` (the dynamics plan).
"""

from __future__ import annotations

import dataclasses
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

log = logging.getLogger(__name__)

FORMAT = "chunkgrpo.toy-ablation/v1"
METHODS: dict[str, list[str]] = {
    "step_flow": ["method=dance", "sampling.rule=flow", "sampling.eta=0.7"],
    "step_dance": ["method=dance", "sampling.rule=dance", "sampling.eta=0.3"],
    "chunk_uniform": ["method=chunk", "chunks=uniform:3"],
    "chunk_dynamics": ["method=chunk", "chunks={plan}"],
    "chunk_ws": ["method=chunk+ws", "chunks={plan}"],
    "tempflow": ["method=tempflow"],
    "granular": ["method=granular"],
}
LABELS = {"step_flow": "step-level GRPO (flow)", "step_dance": "step-level GRPO (dance)",
          "chunk_uniform": "Chunk-GRPO, uniform 3", "chunk_dynamics": "Chunk-GRPO, dynamics plan",
          "chunk_ws": "Chunk-GRPO + weighted sampling", "tempflow": "TempFlow-GRPO", "granular": "Granular-GRPO"}
PAIRS = [("chunk_dynamics", "step_flow"), ("chunk_uniform", "step_flow"), ("chunk_dynamics", "step_dance")]
TAGS = ("single_object", "two_object", "counting", "colors", "position", "color_attr")
# two-sided 95 % Student-t quantiles by degrees of freedom
_T95 = {1: 12.706, 2: 4.303, 3: 3.182, 4: 2.776, 5: 2.571, 6: 2.447, 7: 2.365, 8: 2.306, 9: 2.262, 10: 2.228,
        12: 2.179, 15: 2.131, 20: 2.086, 30: 2.042}


def t95(df: int) -> float:
    if df < 1:
        return float("nan")
    keys = sorted(_T95)
    for k in keys:
        if df <= k:
            return _T95[k]
    return 1.96


def mean_ci(values: list[float]) -> dict:
    """Mean and the half-width of its 95 % t confidence interval (NaN with fewer than 2 values)."""
    n = len(values)
    if n == 0:
        return {"mean": float("nan"), "ci95": float("nan"), "n": 0, "values": []}
    m = sum(values) / n
    if n < 2:
        return {"mean": m, "ci95": float("nan"), "n": 1, "values": list(values)}
    sd = math.sqrt(sum((v - m) ** 2 for v in values) / (n - 1))
    return {"mean": m, "ci95": t95(n - 1) * sd / math.sqrt(n), "sd": sd, "n": n, "values": list(values)}


@dataclasses.dataclass
class AblationConfig(Config):
    """The toy-world ablation (see the module docstring)."""

    model: str = option("", "toy model folder (`chunkgrpo toy-model --out DIR`); '' = build/reuse the default one "
                            "in .chunkgrpo/models/toy")
    out: str = option("benchmarks/results/ablation", "results folder (per-run cache, JSON, Markdown, PNG)")
    methods: list[str] = option(list(METHODS), f"methods to run, of {list(METHODS)}")
    seeds: int = option(5, "training seeds per method (0 .. seeds-1, offset by first_seed)")
    first_seed: int = option(0, "first training seed")
    steps: int = option(72, "optimizer steps per run (a multiple of the branching methods' steps per iteration)")
    preset: str = option("toy_cpu", "training preset every run starts from")
    overrides: list[str] = option([], "training overrides applied to every run (key=value)")
    eval_per_category: int = option(8, "held-out prompts per GenEval category")
    eval_samples: int = option(4, "images per held-out prompt")
    profile_prompts: int = option(12, "training prompts profiled for the dynamics plan")
    profile_seeds: int = option(2, "noise seeds per profiled prompt")
    plan: str = option("dynamics", "chunk strategy of chunk_dynamics / chunk_ws (planned on the profile)")
    jobs: int = option(1, "runs in parallel (processes); each uses `threads` torch threads")
    threads: int = option(1, "torch threads per run")
    progress: bool = option(True, "progress output")

    def __post_init__(self) -> None:
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise UserError(f"methods {bad or self.methods} must be a non-empty subset of {list(METHODS)}")
        self.methods = list(dict.fromkeys(self.methods))
        for name in ("seeds", "steps", "eval_per_category", "eval_samples", "jobs", "threads", "profile_prompts",
                     "profile_seeds"):
            if getattr(self, name) < 1:
                raise UserError(f"{name}={getattr(self, name)} must be >= 1")


# --------------------------------------------------------------------------------------------------
# one run


def engine_fingerprint() -> str:
    """Hash of the engine's source (a changed engine makes cached runs stale)."""
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
    plan = spec["plan_path"]
    method = [o.replace("{plan}", plan) for o in METHODS[spec["method"]]]
    return [*spec["overrides"], *method, f"model={spec['model']}", f"prompts={spec['prompts']}",
            f"seed={spec['seed']}", f"max_steps={spec['steps']}", "progress=false", "checkpoint.every=0",
            "checkpoint.resume=false", "tracking.image_every=0"]


def run_one(spec: dict) -> dict:
    """Train one (method, seed) and evaluate it on the held-out prompts (runs in a worker process)."""
    import torch

    from chunkgrpo.flux import load_flux
    from chunkgrpo.toy.model import accuracy, sampling_config
    from chunkgrpo.train.config import TrainConfig
    from chunkgrpo.train.trainer import Trainer

    torch.set_num_threads(spec["threads"])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    logging.getLogger("chunkgrpo").setLevel(logging.WARNING)
    t0, c0 = time.perf_counter(), time.process_time()
    records: list[dict] = []

    class RecordingTrainer(Trainer):
        def iteration(self) -> dict:
            m = super().iteration()
            records.append({"optimizer_step": self.opt_step, "reward_mean": m["reward_mean"],
                            "transformer_samples": m["transformer_samples"],
                            "transformer_forward": m["transformer_forward"],
                            "min_transformer_samples": m.get("min_transformer_samples")})
            return m

    with tempfile.TemporaryDirectory(prefix="chunkgrpo-ablation-") as tmp:
        cfg = TrainConfig.load(spec["preset"], [*_train_overrides(spec), f"output_dir={tmp}/run"])
        trainer = RecordingTrainer(cfg)
        trainer.setup()
        try:
            summary = trainer.train()
        finally:
            trainer.close()
        train_s, train_cpu = time.perf_counter() - t0, time.process_time() - c0
        model = load_flux(spec["model"])
        model.pipe.load_lora_weights(summary["final_model"])
    sampling = sampling_config(steps=cfg.sampling.num_steps, size=cfg.sampling.height)
    sampling = sampling.replace(max_sequence_length=cfg.sampling.max_sequence_length)
    acc = accuracy(model, spec["eval_metadata"], spec["eval_samples"], sampling, seed=eval_seed(spec["seed"]))
    return {"method": spec["method"], "seed": spec["seed"], "key": spec["key"],
            "overall": acc["overall"], "tasks": {k: v["score"] for k, v in acc["tasks"].items()},
            "n_images": acc["n_images"], "optimizer_steps": summary["optimizer_steps"],
            "iterations": summary["iterations"], "chunk_sizes": summary["chunk_sizes"],
            "reward_curve": [(r["optimizer_step"], r["reward_mean"]) for r in records],
            "transformer_samples": sum(r["transformer_samples"] for r in records),
            "transformer_forward": sum(r["transformer_forward"] for r in records),
            "min_transformer_samples": sum(r["min_transformer_samples"] or 0 for r in records),
            "train_wall_s": round(train_s, 2), "train_cpu_s": round(train_cpu, 2),
            "wall_s": round(time.perf_counter() - t0, 2), "cpu_s": round(time.process_time() - c0, 2),
            "config": cfg.to_dict()}


def base_one(spec: dict) -> dict:
    """The base model's held-out accuracy with a seed's evaluation noise."""
    import torch

    from chunkgrpo.flux import load_flux
    from chunkgrpo.toy.model import accuracy, sampling_config

    torch.set_num_threads(spec["threads"])
    t0 = time.perf_counter()
    model = load_flux(spec["model"])
    sampling = sampling_config(steps=spec["num_steps"], size=spec["size"]).replace(
        max_sequence_length=spec["max_sequence_length"])
    acc = accuracy(model, spec["eval_metadata"], spec["eval_samples"], sampling, seed=eval_seed(spec["seed"]))
    return {"method": "base", "seed": spec["seed"], "key": spec["key"], "overall": acc["overall"],
            "tasks": {k: v["score"] for k, v in acc["tasks"].items()}, "n_images": acc["n_images"],
            "wall_s": round(time.perf_counter() - t0, 2)}


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
    """Profile the base model with the engine (Eq. 15) and plan chunks from it (cached in `out`)."""
    from chunkgrpo.chunks import plan_chunks, write_plan
    from chunkgrpo.dynamics import ProfileConfig, profile_model, write_profile
    from chunkgrpo.flux import load_flux

    key = _key({"model": model_dir, "n": cfg.profile_prompts, "seeds": cfg.profile_seeds, "plan": cfg.plan,
                "sampling": train_cfg.sampling.to_dict(), "engine": engine_fingerprint()})
    plan_path = out / "plan.json"
    if plan_path.exists():
        old = json.loads(plan_path.read_text())
        if old.get("ablation_key") == key:
            return old
    s = train_cfg.sampling.replace(stochastic="none")
    pcfg = ProfileConfig(model=model_dir, prompts="(ablation)", out=str(out / "profile.json"),
                         num_prompts=cfg.profile_prompts, seeds=cfg.profile_seeds, sampling=s)
    profile = profile_model(load_flux(model_dir), prompts[: cfg.profile_prompts], pcfg, progress=False)
    write_profile(profile, out / "profile.json")
    plan = plan_chunks(cfg.plan, train_cfg.trainable_steps, profile["l1rel"])
    d = plan.to_dict(profile)
    d["ablation_key"] = key
    write_plan(d, plan_path)
    return d


def run_ablation(cfg: AblationConfig) -> dict:
    """Run (or resume) the ablation; returns the aggregated result (also written to `<out>/ablation.json`)."""
    from chunkgrpo.prompts import load_prompts
    from chunkgrpo.toy.model import build_toy_model, read_meta
    from chunkgrpo.toy.world import World
    from chunkgrpo.train.config import TrainConfig

    t_start = time.perf_counter()
    out = Path(cfg.out)
    out.mkdir(parents=True, exist_ok=True)
    model_dir = Path(cfg.model) if cfg.model else build_toy_model(Path(".chunkgrpo/models/toy"))
    meta = read_meta(model_dir)
    if meta is None:
        raise UserError(f"model={str(model_dir)!r} is not a toy model folder (build one with `chunkgrpo toy-model`)")
    model_dir = str(model_dir.resolve())
    prompts_file = str(Path(model_dir) / meta["files"]["train_prompts"])
    prompts = load_prompts(prompts_file)
    base_cfg = TrainConfig.load(cfg.preset, [*cfg.overrides, f"model={model_dir}", f"prompts={prompts_file}"])
    world = World(meta["config"]["seed"], meta["config"]["size"])
    eval_md = world.eval_prompts(cfg.eval_per_category, "heldout")
    plan = None
    if any("{plan}" in o for m in cfg.methods for o in METHODS[m]):
        plan = dynamics_plan(cfg, model_dir, prompts, out, base_cfg)
        log.info("dynamics plan: %s", plan["sizes"])
    common = {"model_key": meta["key"], "preset": cfg.preset, "overrides": cfg.overrides, "steps": cfg.steps,
              "eval": [cfg.eval_per_category, cfg.eval_samples], "engine": engine_fingerprint(),
              "plan": plan["sizes"] if plan else None}
    specs = []
    for m in ["base", *cfg.methods]:
        for s in range(cfg.first_seed, cfg.first_seed + cfg.seeds):
            key = _key({**common, "method": m, "seed": s, "method_overrides": METHODS.get(m)})
            path = out / "runs" / m / f"seed-{s}.json"
            spec = {"method": m, "seed": s, "key": key, "path": str(path), "model": model_dir,
                    "prompts": prompts_file, "preset": cfg.preset, "overrides": list(cfg.overrides),
                    "steps": cfg.steps, "threads": cfg.threads, "eval_metadata": eval_md,
                    "eval_samples": cfg.eval_samples, "plan_path": str(out / "plan.json"),
                    "num_steps": base_cfg.sampling.num_steps, "size": base_cfg.sampling.height,
                    "max_sequence_length": base_cfg.sampling.max_sequence_length}
            if path.exists() and json.loads(path.read_text()).get("key") == key:
                continue
            specs.append(spec)
    todo = len(specs)
    log.info("ablation: %d runs to compute (%d cached)", todo, (1 + len(cfg.methods)) * cfg.seeds - todo)
    if specs:
        _execute(specs, cfg)
    result = aggregate(cfg, out)
    result["plan"] = plan
    result["model"] = {"path": model_dir, "key": meta["key"], "pretraining": meta.get("pretraining"),
                       "base_accuracy": meta.get("base_accuracy")}
    result["settings"] = {**cfg.to_dict(), "train_config": base_cfg.to_dict(),
                          "eval_prompts": [md["prompt"] for md in eval_md], "engine": engine_fingerprint()}
    result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
    result["computed_runs"] = todo
    _write_json(out / "ablation.json", result)
    (out / "ablation.md").write_text(markdown(result))
    plot_curves(result, out / "reward_curves.png")
    return result


def _execute(specs: list[dict], cfg: AblationConfig) -> None:
    from chunkgrpo.progress import progress_bar

    fn = {True: base_one, False: run_one}
    bar = progress_bar(total=len(specs), desc="ablation runs", disable=not cfg.progress)
    if cfg.jobs == 1:
        for spec in specs:
            res = fn[spec["method"] == "base"](spec)
            _write_json(Path(spec["path"]), res)
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
                _write_json(Path(spec["path"]), res)
                bar.update(1)
                bar.set_postfix(last=f"{spec['method']}/{spec['seed']}={res['overall']:.3f}")
    bar.close()


# --------------------------------------------------------------------------------------------------
# aggregation and outputs


def aggregate(cfg: AblationConfig, out: Path) -> dict:
    """Per method: accuracy per category and overall (mean ± 95 % CI over seeds), cost; paired comparisons."""
    seeds = list(range(cfg.first_seed, cfg.first_seed + cfg.seeds))
    runs: dict[str, dict[int, dict]] = {}
    for m in ["base", *cfg.methods]:
        for s in seeds:
            p = out / "runs" / m / f"seed-{s}.json"
            if p.exists():
                runs.setdefault(m, {})[s] = json.loads(p.read_text())
    methods = {}
    for m, by_seed in runs.items():
        rs = [by_seed[s] for s in sorted(by_seed)]
        entry = {"label": LABELS.get(m, "base model"), "seeds": sorted(by_seed),
                 "overall": mean_ci([r["overall"] for r in rs]),
                 "tasks": {t: mean_ci([r["tasks"][t] for r in rs if t in r["tasks"]]) for t in TAGS}}
        if m != "base":
            base = runs.get("base", {})
            entry["gain"] = mean_ci([by_seed[s]["overall"] - base[s]["overall"] for s in sorted(by_seed) if s in base])
            entry["wall_s"] = mean_ci([r["wall_s"] for r in rs])
            entry["train_cpu_s"] = mean_ci([r["train_cpu_s"] for r in rs])
            entry["transformer_samples"] = mean_ci([r["transformer_samples"] for r in rs])
            entry["min_transformer_samples"] = mean_ci([r["min_transformer_samples"] for r in rs])
            entry["optimizer_steps"] = sorted({r["optimizer_steps"] for r in rs})
            entry["chunk_sizes"] = rs[0]["chunk_sizes"]
            curves = [dict(r["reward_curve"]) for r in rs]
            steps = sorted(set().union(*curves))
            entry["reward_curve"] = [(st, mean_ci([c[st] for c in curves if st in c])["mean"],
                                      mean_ci([c[st] for c in curves if st in c]).get("sd", 0.0)) for st in steps]
        methods[m] = entry
    paired = []
    for a, b in PAIRS:
        if a in runs and b in runs:
            common = sorted(set(runs[a]) & set(runs[b]))
            diffs = [runs[a][s]["overall"] - runs[b][s]["overall"] for s in common]
            paired.append({"a": a, "b": b, "seeds": common, "diff": mean_ci(diffs),
                           "wins": sum(d > 0 for d in diffs), "ties": sum(d == 0 for d in diffs),
                           "losses": sum(d < 0 for d in diffs)})
    return {"format": FORMAT, "methods": methods, "paired": paired, "tags": list(TAGS)}


def _pm(c: dict, digits: int = 3) -> str:
    if not c or c.get("n", 0) == 0:
        return "–"
    if c["n"] < 2 or not math.isfinite(c["ci95"]):
        return f"{c['mean']:.{digits}f}"
    return f"{c['mean']:.{digits}f} ± {c['ci95']:.{digits}f}"


def markdown(result: dict) -> str:
    s = result["settings"]
    tc = s["train_config"]
    lines = ["# Toy-world ablation: held-out GenEval accuracy (exact detector)", "",
             f"Base model `{result['model']['key']}`; {s['steps']} optimizer steps per run; "
             f"{tc['prompts_per_rank']} prompts × {tc['group_size']} samples per optimizer step; "
             f"{tc['sampling']['num_steps']} sampling steps at {tc['sampling']['height']}²; lr {tc['lr']}, LoRA r{tc['lora']['rank']}; "
             f"reward `toy_geneval` (graded credit). Evaluation: {len(s['eval_prompts'])} held-out prompts × "
             f"{s['eval_samples']} images, trained model alone, ODE. Mean ± 95 % CI (t) over seeds.", ""]
    if result.get("plan"):
        lines.append(f"Dynamics plan (engine profile + `{s['plan']}`): chunk sizes {result['plan']['sizes']}.")
        lines.append("")
    head = ["method", "seeds", "overall", *[t.replace("_", " ") for t in result["tags"]], "gain vs base",
            "wall s", "transformer samples"]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for m, e in result["methods"].items():
        row = [e["label"] + ("" if m == "base" else f" (`{m}`)"), str(len(e["seeds"])), _pm(e["overall"]),
               *[_pm(e["tasks"][t], 2) for t in result["tags"]]]
        if m == "base":
            row += ["–", "–", "–"]
        else:
            row += [_pm(e["gain"]), f"{e['wall_s']['mean']:.0f}", f"{e['transformer_samples']['mean']:.0f}"]
        lines.append("| " + " | ".join(row) + " |")
    if result["paired"]:
        lines += ["", "Paired comparisons (same training seed, same evaluation noise): difference in overall accuracy.",
                  "", "| comparison | seeds | mean diff ± 95 % CI | wins / ties / losses |", "|---|---|---|---|"]
        for p in result["paired"]:
            lines.append(f"| `{p['a']}` − `{p['b']}` | {len(p['seeds'])} | {_pm(p['diff'])} | "
                         f"{p['wins']} / {p['ties']} / {p['losses']} |")
    lines += ["", f"Computed runs this invocation: {result.get('computed_runs')}; elapsed {result.get('elapsed_s')} s.", ""]
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


def copy_results(src: Path, dst: Path) -> None:
    """Copy an ablation's outputs (not the per-run cache) to `dst`."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("ablation.json", "ablation.md", "reward_curves.png", "plan.json", "profile.json", "profile.png"):
        if (src / name).exists():
            shutil.copyfile(src / name, dst / name)
