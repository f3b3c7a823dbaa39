"""The promotion gate (a visible decision node) and the gated alias move."""

from kfp import dsl
from kfp.dsl import Markdown, Output

from components._shared import stage_env
from components.images import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False, additional_funcs=[stage_env])
def check_gate(model_name: str, version: str, metric: str, direction: str, margin: float) -> bool:
    """Does `version` beat the current champion on the gate metric (read-only)?

    Args:
        model_name: registered model name.
        version: candidate version (from register).
        metric: gate metric, a version tag `metric.<name>`, e.g. eval.hpdv2.hpsv3.
        direction: max (higher is better) | min.
        margin: the candidate must beat the champion by more than this.

    Returns:
        True when promote should run (no champion yet counts as a pass).
    """
    stage_env("")
    from mlflow import MlflowClient

    from chunkgrpo.registry import GateConfig, gate_decision, version_metric

    client = MlflowClient()
    gate = GateConfig(metric=metric, direction=direction, margin=margin)
    champion = (client.get_registered_model(model_name).aliases or {}).get("champion")
    if champion == str(version):
        print(f"v{version} already is the champion")
        return False
    candidate = version_metric(client, model_name, version, metric)
    if candidate is None:
        print(f"v{version} has no metric.{metric} tag: gate fails (promote manually with --force)")
        return False
    reference = version_metric(client, model_name, champion, metric) if champion else None
    if champion and reference is None:
        print(f"champion v{champion} has no metric.{metric} tag: cannot compare, gate fails")
        return False
    decision = gate_decision(candidate, reference, gate)
    print(f"gate {'PASSED' if decision.passed else 'not passed'}: {decision.reason}")
    return decision.passed


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False, additional_funcs=[stage_env])
def promote(model_name: str, version: str, metric: str, direction: str, margin: float, who: str, why: str,
            decision: Output[Markdown]) -> str:
    """Move the `champion` alias to `version` if it (still) passes the gate; old champion -> `previous`.

    Args:
        model_name: registered model name.
        version: version to promote.
        metric: gate metric (version tag metric.<name>).
        direction: max | min.
        margin: required improvement.
        who: actor recorded in the promotion tags.
        why: reason recorded in the promotion tags.

    Returns:
        promoted | rejected | noop (the registry's decision).
    """
    from pathlib import Path

    stage_env("")
    from chunkgrpo.registry import GateConfig
    from chunkgrpo.registry import promote as do_promote

    res = do_promote(model_name, version, GateConfig(metric=metric, direction=direction, margin=margin),
                     who=who, why=why)
    Path(decision.path).write_text(f"# Promotion\n\n`{res.line()}`\n")
    decision.metadata.update({"action": res.action, "version": res.version, "previous": res.previous or ""})
    print(res.line())
    return res.action
