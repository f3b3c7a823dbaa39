"""Register the trained model (with its eval metrics and chunk plan) as an MLflow model version. The step
is `chunkgrpo.stages.register.register_trained`."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Model, Output

from components.images import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def register(model_name: str, experiment: str, run_id: str, parent_run_id: str, model: Input[Model],
             eval_results: Input[Artifact], plan_json: Input[Artifact], registered: Output[Artifact],
             gate_metric: str = "", gate_direction: str = "", eval_preset: str = "") -> str:
    """Register the model pointed to by `model` as a new version (alias `challenger`): an MLflow
    pyfunc (`mlflow.pyfunc.load_model("models:/<name>/<version>")` generates images), with the eval
    metrics, the eval protocol they were measured with, and the chunk plan.

    Args:
        model_name: registered model name.
        experiment: MLflow experiment of the registration run.
        run_id: KFP run id (kfp.run_id in the version's registration/details.json).
        parent_run_id: MLflow parent run id; the registration run nests under it.
        model: model pointer from train / launch_trainjob (weights in S3).
        eval_results: metrics.json from evaluate; its `mlflow_run_id` (the evaluate stage's run) becomes tag
            eval.run_id, the only source promotion trusts; the gate metric -> informational version tag
            `metric.eval.<bench>.<metric>`, every metric -> registration/details.json.
        plan_json: chunk plan (in registration/details.json).
        gate_metric: promotion gate metric of a NEW registered model (an existing model keeps its own).
        gate_direction: max | min for gate_metric of a new registered model ('' = the metric's known
            direction).
        eval_preset: the evaluation preset (recorded in the eval protocol).

    Returns:
        The model version (an existing one when the same weights were registered before).
    """
    import json
    from pathlib import Path

    from chunkgrpo.stages.task import stage_env

    stage_env(parent_run_id)
    from chunkgrpo.stages.register import read_plan, register_trained

    info = register_trained(model_name=model_name, experiment=experiment, run_id=run_id,
                            pointer=Path(model.path).read_text(),
                            evaluation=json.loads(Path(eval_results.path).read_text()),
                            plan=read_plan(plan_json.path), gate_metric=gate_metric,
                            gate_direction=gate_direction, eval_preset=eval_preset)
    Path(registered.path).write_text(json.dumps(info, indent=1))
    registered.metadata.update(info)
    return info["version"]
