"""Register the trained model (with its eval metrics and chunk plan) as an MLflow model version."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Model, Output

from components._shared import stage_env
from components.images import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False, additional_funcs=[stage_env])
def register(model_name: str, experiment: str, run_id: str, parent_run_id: str, model: Input[Model],
             eval_results: Input[Artifact], plan_json: Input[Artifact], registered: Output[Artifact],
             gate_metric: str = "", gate_direction: str = "", eval_preset: str = "") -> str:
    """Register the model pointed to by `model` as a new version (alias `challenger`): an MLflow
    pyfunc (`mlflow.pyfunc.load_model("models:/<name>/<version>")` generates images), with the eval
    metrics, the eval protocol they were measured with, and the chunk plan.

    Args:
        model_name: registered model name.
        experiment: MLflow experiment of the registration run.
        run_id: KFP run id (version tag kfp.run_id).
        parent_run_id: MLflow parent run id; the registration run nests under it.
        model: model pointer from train / launch_trainjob (weights in S3).
        eval_results: metrics.json from evaluate; its `mlflow_run_id` (the evaluate stage's run) becomes tag
            eval.run_id, the only source promotion trusts; `<bench>.<metric>.trained` -> informational
            version tag `metric.eval.<bench>.<metric>`.
        plan_json: chunk plan (version tag chunk_plan).
        gate_metric: promotion gate metric of a NEW registered model (an existing model keeps its own).
        gate_direction: max | min for gate_metric of a new registered model ('' = the metric's known
            direction).
        eval_preset: the evaluation preset (recorded in the eval protocol).

    Returns:
        The model version (an existing one when the same weights were registered before).
    """
    import json
    import tempfile
    from pathlib import Path

    stage_env(parent_run_id)
    from chunkgrpo.registry.gate import metrics_from_eval
    from chunkgrpo.registry.registration import Registration, register_model
    from chunkgrpo.store.client import ArtifactStore
    from chunkgrpo.store.manifest import read_pointer

    pointer = read_pointer(Path(model.path).read_text())
    evaluation = json.loads(Path(eval_results.path).read_text())
    metrics, protocol, sampling = metrics_from_eval(evaluation, eval_preset)
    plan = json.loads(Path(plan_json.path).read_text()) if Path(plan_json.path).exists() else None
    with tempfile.TemporaryDirectory(prefix="chunkgrpo-register-") as tmp:
        manifest = ArtifactStore().get_folder(pointer["uri"], tmp)
        if manifest.sha256 != pointer["manifest_sha256"]:
            raise RuntimeError(f"{pointer['uri']} changed after training (manifest digest mismatch)")
        req = Registration(model_name, pointer["base_model"], tmp, kind=pointer["kind"],
                           checkpoint_uri=pointer["uri"], metrics=metrics, plan=plan,
                           cfg_hash=pointer.get("config_hash", ""),
                           tags={"kfp.run_id": run_id, "method": pointer.get("method", "")},
                           gate_metric=gate_metric or None, gate_direction=gate_direction or None,
                           eval_protocol=protocol, sampling=sampling,
                           eval_run_id=evaluation.get("mlflow_run_id") or None)  # the gate's only source
        rv = register_model(req, experiment=experiment)
    info = {"name": rv.name, "version": rv.version, "uri": rv.uri, "source": rv.source,
            "run_id": rv.run_id or "", "reused": rv.reused, "checkpoint_uri": pointer["uri"]}
    Path(registered.path).write_text(json.dumps(info, indent=1))
    registered.metadata.update(info)
    print(
        f"registered {rv.uri}{' (existing version, same weights)' if rv.reused else ''} from {pointer['uri']}"
    )
    return rv.version
