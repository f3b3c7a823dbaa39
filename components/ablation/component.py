"""The reduced toy-world ablation of the nightly benchmark: step-level vs chunk-level GRPO from the same
toy base model, a few seeds and steps, exact held-out GenEval accuracy with 95 % CIs."""

from kfp import dsl
from kfp.dsl import Artifact, Markdown, Metrics, Output

from components._shared import run_prefix, stage_env
from components.images import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False, additional_funcs=[run_prefix, stage_env])
def toy_ablation(model: str, methods: list, seeds: int, steps: int, artifact_root: str, run_id: str,
                 parent_run_id: str, results: Output[Artifact], table: Output[Markdown], curves: Output[Artifact],
                 metrics: Output[Metrics]):
    """Train every method for `steps` optimizer steps × `seeds` seeds from the toy model and compare them.

    Args:
        model: toy base model folder (`chunkgrpo toy-model --out DIR`) or an s3:// folder artifact of one.
        methods: methods of chunkgrpo.toy.ablation.METHODS (e.g. ["step_flow", "chunk_dynamics"]).
        seeds: training seeds per method.
        steps: optimizer steps per run.
        artifact_root: s3:// prefix; the results folder goes to <root>/<run_id>/ablation.
        run_id: KFP run id.
        parent_run_id: MLflow parent run id ('' = none): a nested run "ablation" gets metrics and artifacts.
    """
    import json
    import math
    import shutil
    import tempfile
    from pathlib import Path

    stage_env(parent_run_id)
    from chunkgrpo import tracking
    from chunkgrpo.flux import resolve_model_source
    from chunkgrpo.store import ArtifactStore
    from chunkgrpo.toy.ablation import AblationConfig, run_ablation

    out = Path(tempfile.mkdtemp(prefix="chunkgrpo-ablation-"))
    cfg = AblationConfig(model=resolve_model_source(model), out=str(out), methods=list(methods), seeds=seeds,
                         steps=steps, eval_per_category=4, eval_samples=2, profile_prompts=6, profile_seeds=1,
                         progress=False)
    with tracking.stage_run("ablation", parent_run_id=parent_run_id or None, params=tracking.flatten(cfg.to_dict())) as tr:
        result = run_ablation(cfg)
        flat = {}
        for m, e in result["methods"].items():
            flat[f"ablation.{m}.overall"] = e["overall"]["mean"]
            for t, c in e["tasks"].items():
                flat[f"ablation.{m}.{t}"] = c["mean"]
        for p in result["paired"]:
            flat[f"ablation.paired.{p['a']}-{p['b']}"] = p["diff"]["mean"]
        flat = {k: v for k, v in flat.items() if math.isfinite(v)}  # a category nobody scored: not logged
        tr.log_metrics(flat)
        for name in ("ablation.json", "ablation.md", "reward_curves.png"):
            if (out / name).exists():
                tr.log_artifact(out / name)
    for k, v in flat.items():
        metrics.log_metric(k, float(v))
    shutil.copyfile(out / "ablation.json", results.path)
    shutil.copyfile(out / "ablation.md", table.path)
    if (out / "reward_curves.png").exists():
        shutil.copyfile(out / "reward_curves.png", curves.path)
    uri = run_prefix(artifact_root, run_id, "ablation")
    ArtifactStore().put_folder(out, uri, meta={"kind": "ablation", "model": model})
    results.metadata.update({"output_uri": uri, "methods": json.dumps(list(methods)), "seeds": seeds, "steps": steps})
    print((out / "ablation.md").read_text())
