"""The nightly toy-world ablation that accumulates: each night adds seeds of chunk (SDE dynamics plan) vs
step-level GRPO from the same toy base model to one series in S3 (earlier nights' runs reused), so the
paired difference and its CI tighten night after night; a changed engine or configuration starts a new
series."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

from chunkgrpo.config import option
from chunkgrpo.stages.task import OwnsScratch, run_prefix


@dataclass(frozen=True)
class AblationRequest:
    """Tonight's part of the accumulating ablation series."""

    model: str = option(help="toy base model folder or s3:// folder artifact of one")
    methods: list = option(["step_flow", "chunk_dynamics"],
                           "arms of chunkgrpo.toy.ablation_design.ARMS (with the primary pair)")
    seeds: int = option(2, "seeds added tonight")
    steps: int = option(8, "optimizer steps per run (a multiple of eval_points)")
    artifact_root: str = option("", "s3:// prefix; tonight's results go to <root>/<run_id>/ablation")
    run_id: str = option("", "KFP run id")
    parent_run_id: str = option("", "MLflow parent run id ('' = none)")
    series_root: str = option("", "s3:// prefix of the series ('' = <artifact_root>/ablation-series)")
    plan: str = option("dynamics", "chunk strategy of chunk_dynamics")
    eval_per_category: int = option(4, "held-out prompts per GenEval category")
    eval_samples: int = option(4, "images per held-out prompt")
    eval_points: int = option(2, "evaluations per run (the last is the endpoint)")


@dataclass(frozen=True)
class Ablation(OwnsScratch):
    """Tonight's results; `out` is a scratch folder, removed by `cleanup()` / a `with` block."""

    out: Path               # tonight's results folder (ablation.json, ablation.md, curves)
    metrics: dict           # flat finite metrics (per arm, paired differences, the primary pair's CI)
    metadata: dict          # output_uri, series_uri, methods, seeds, seeds_added, steps
    scratch: Path | None = None  # = out (uploaded to output_uri)

    @property
    def curves(self) -> Path | None:
        for name in ("curves.png", "reward_curves.png"):
            if (self.out / name).exists():
                return self.out / name
        return None


def flat_metrics(result: dict) -> dict:
    """The series result as flat metrics; a category nobody scored (NaN) is left out."""
    flat = {}
    for m, e in result["methods"].items():
        flat[f"ablation.{m}.overall"] = e["overall"]["mean"]
        for t, c in e["tasks"].items():
            flat[f"ablation.{m}.{t}"] = c["mean"]
    for p in result["paired"]:
        flat[f"ablation.paired.{p['a']}-{p['b']}"] = p["diff"]["mean"]
    pr = result["primary"]
    if pr.get("diff"):
        d = pr["diff"]
        flat.update({"ablation.primary.diff": d["mean"], "ablation.primary.ci95": d["ci95"],
                     "ablation.primary.ci_low": d["mean"] - d["ci95"],
                     "ablation.primary.ci_high": d["mean"] + d["ci95"],
                     "ablation.primary.p": d.get("p", float("nan")),
                     "ablation.primary.mde": pr["mde_at_seeds"],
                     "ablation.primary.mde_assumed_sd": pr["mde_at_seeds_assumed_sd"]})
    flat["ablation.primary.seeds"] = float(len(result["series"]["seeds"]))
    return {k: v for k, v in flat.items() if math.isfinite(v)}


def ablation(req: AblationRequest) -> Ablation:
    """Add `seeds` seeds of every method to the series, report all seeds so far (nested MLflow run
    "ablation"), and upload tonight's results folder (a scratch folder the result owns:
    `with ablation(req) as ab:`; removed here on failure)."""
    from chunkgrpo.tempdirs import owned_on_failure

    with owned_on_failure("chunkgrpo-ablation-") as out:
        return _ablation(req, out)


def _ablation(req: AblationRequest, out: Path) -> Ablation:
    from chunkgrpo import tracking
    from chunkgrpo.flux import resolve_model_source
    from chunkgrpo.store.client import ArtifactStore
    from chunkgrpo.toy.ablation import AblationConfig, run_series

    cfg = AblationConfig(model=resolve_model_source(req.model), out=str(out), methods=list(req.methods),
                         seeds=req.seeds, steps=req.steps, eval_per_category=req.eval_per_category,
                         eval_samples=req.eval_samples, eval_points=req.eval_points, plan=req.plan,
                         profile_prompts=6, profile_seeds=1, progress=False)
    root = req.series_root or req.artifact_root.rstrip("/") + "/ablation-series"
    with tracking.stage_run(
        "ablation", parent_run_id=req.parent_run_id or None, params=tracking.flatten(cfg.to_dict())
    ) as tr:
        result = run_series(cfg, root, req.seeds)
        flat = flat_metrics(result)
        tr.log_metrics(flat)
        for name in ("ablation.json", "ablation.md", "curves.png", "reward_curves.png"):
            if (out / name).exists():
                tr.log_artifact(out / name)
    uri = run_prefix(req.artifact_root, req.run_id, "ablation")
    ArtifactStore().put_folder(out, uri, meta={"kind": "ablation", "model": req.model})
    series = result["series"]
    meta = {"output_uri": uri, "series_uri": series["uri"], "methods": json.dumps(list(req.methods)),
            "seeds": len(series["seeds"]), "seeds_added": len(series["seeds_added"]), "steps": req.steps}
    print((out / "ablation.md").read_text())
    return Ablation(out, flat, meta, scratch=out)
