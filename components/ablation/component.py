"""The nightly toy-world ablation that accumulates: each night adds `seeds` seeds of chunk (SDE dynamics plan)
vs step-level GRPO from the same toy base model to one series in S3 (runs keyed by seed, earlier nights'
runs reused), so the paired difference and its CI tighten night after night; a changed engine or
configuration starts a new series."""

from kfp import dsl
from kfp.dsl import Artifact, Markdown, Metrics, Output

from components._shared import run_prefix, stage_env
from components.images import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False, additional_funcs=[run_prefix, stage_env])
def toy_ablation(
    model: str,
    methods: list,
    seeds: int,
    steps: int,
    artifact_root: str,
    run_id: str,
    parent_run_id: str,
    results: Output[Artifact],
    table: Output[Markdown],
    curves: Output[Artifact],
    metrics: Output[Metrics],
    series_root: str = "",
    plan: str = "dynamics",
    eval_per_category: int = 4,
    eval_samples: int = 4,
    eval_points: int = 2,
):
    """Add `seeds` seeds of every method to the ablation series and report all seeds so far.

    Args:
        model: toy base model folder (`chunkgrpo toy-model --out DIR`) or an s3:// folder artifact of one.
        methods: arms of chunkgrpo.toy.ablation_design.ARMS; must hold the primary pair chunk_dynamics,
            step_flow.
        seeds: seeds added tonight (the series keeps every earlier night's).
        steps: optimizer steps per step/chunk run (a multiple of eval_points).
        artifact_root: s3:// prefix; tonight's results folder goes to <root>/<run_id>/ablation.
        run_id: KFP run id.
        parent_run_id: MLflow parent run id ('' = none): a nested run "ablation" gets metrics and artifacts.
        series_root: s3:// prefix of the accumulating series ('' = <artifact_root>/ablation-series); runs are
            kept under <series_root>/<series key>/runs/<method>/seed-<s>.json.
        plan: chunk strategy of chunk_dynamics (dynamics = planned on the SDE profile).
        eval_per_category: held-out prompts per GenEval category.
        eval_samples: images per held-out prompt.
        eval_points: evaluations per run (learning curve; the last is the endpoint).
    """
    import json
    import math
    import shutil
    import tempfile
    from pathlib import Path

    stage_env(parent_run_id)
    from chunkgrpo import tracking
    from chunkgrpo.flux import resolve_model_source
    from chunkgrpo.store.client import ArtifactStore
    from chunkgrpo.toy.ablation import AblationConfig, run_series

    out = Path(tempfile.mkdtemp(prefix="chunkgrpo-ablation-"))
    cfg = AblationConfig(
        model=resolve_model_source(model),
        out=str(out),
        methods=list(methods),
        seeds=seeds,
        steps=steps,
        eval_per_category=eval_per_category,
        eval_samples=eval_samples,
        eval_points=eval_points,
        plan=plan,
        profile_prompts=6,
        profile_seeds=1,
        progress=False,
    )
    root = series_root or artifact_root.rstrip("/") + "/ablation-series"
    with tracking.stage_run(
        "ablation", parent_run_id=parent_run_id or None, params=tracking.flatten(cfg.to_dict())
    ) as tr:
        result = run_series(cfg, root, seeds)
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
            flat.update(
                {
                    "ablation.primary.diff": d["mean"],
                    "ablation.primary.ci95": d["ci95"],
                    "ablation.primary.ci_low": d["mean"] - d["ci95"],
                    "ablation.primary.ci_high": d["mean"] + d["ci95"],
                    "ablation.primary.p": d.get("p", float("nan")),
                    "ablation.primary.mde": pr["mde_at_seeds"],
                    "ablation.primary.mde_assumed_sd": pr["mde_at_seeds_assumed_sd"],
                }
            )
        flat["ablation.primary.seeds"] = float(len(result["series"]["seeds"]))
        flat = {k: v for k, v in flat.items() if math.isfinite(v)}  # a category nobody scored: not logged
        tr.log_metrics(flat)
        for name in ("ablation.json", "ablation.md", "curves.png", "reward_curves.png"):
            if (out / name).exists():
                tr.log_artifact(out / name)
    for k, v in flat.items():
        metrics.log_metric(k, float(v))
    shutil.copyfile(out / "ablation.json", results.path)
    shutil.copyfile(out / "ablation.md", table.path)
    png = out / "curves.png" if (out / "curves.png").exists() else out / "reward_curves.png"
    if png.exists():
        shutil.copyfile(png, curves.path)
    uri = run_prefix(artifact_root, run_id, "ablation")
    ArtifactStore().put_folder(out, uri, meta={"kind": "ablation", "model": model})
    results.metadata.update({"output_uri": uri, "series_uri": result["series"]["uri"],
                             "methods": json.dumps(list(methods)), "seeds": len(result["series"]["seeds"]),
                             "seeds_added": len(result["series"]["seeds_added"]), "steps": steps})
    print((out / "ablation.md").read_text())
