"""The promotion gate (a visible decision node) and the gated alias move."""

from kfp import dsl
from kfp.dsl import Markdown, Output

from components._shared import stage_env
from components.images import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False, additional_funcs=[stage_env])
def check_gate(model_name: str, version: str, metric: str, margin: float) -> bool:
    """Does `version` beat the current champion on the registered model's gate (read-only)?

    The metric's direction is the registered model's (tag gate.direction, set at its first
    registration), never a run parameter; versions evaluated under different protocols are not compared.

    Args:
        model_name: registered model name.
        version: candidate version (from register).
        metric: gate metric ('' = the one recorded at the version's registration; only that or its CI bound);
            values come from each version's evaluation run (tag eval.run_id), never from tags.
        margin: the candidate must beat the champion by more than this.

    Returns:
        True when promote should run (no champion yet counts as a pass).
    """
    stage_env("")
    from chunkgrpo.registry.gate import GateConfig
    from chunkgrpo.registry.promotion import gate_check

    decision = gate_check(model_name, version, GateConfig(metric=metric, margin=margin))
    print(f"gate {'PASSED' if decision.passed else 'not passed'}: {decision.reason}")
    return decision.passed


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False, additional_funcs=[stage_env])
def promote(model_name: str, version: str, metric: str, margin: float, who: str, why: str,
            decision: Output[Markdown]) -> str:
    """Move the `champion` alias to `version` if it (still) passes the gate; old champion -> `previous`.
    With $CHUNKGRPO_PROMOTER_URL set (a cluster with the promoter service), the promoter identity does
    it and runs the gate; this step's credentials only read the registered model.

    Args:
        model_name: registered model name.
        version: version to promote.
        metric: gate metric ('' = the registered model's gate.metric; another one is refused).
        margin: required improvement.
        who: actor recorded in the promotion tags.
        why: reason recorded in the promotion tags.

    Returns:
        promoted | rejected | noop (the registry's decision).
    """
    from pathlib import Path

    stage_env("")
    import os

    from chunkgrpo.registry.gate import GateConfig
    from chunkgrpo.registry.promotion import promote as do_promote

    gate = GateConfig(metric=metric, margin=margin)
    if os.environ.get("CHUNKGRPO_PROMOTER_URL"):  # the promoter identity moves champion (server-side gate)
        from chunkgrpo.registry.promoter_client import request_promotion

        res = request_promotion(os.environ["CHUNKGRPO_PROMOTER_URL"], model_name, version, gate, why=why)
    else:
        res = do_promote(model_name, version, gate, who=who, why=why)
    Path(decision.path).write_text(f"# Promotion\n\n`{res.line()}`\n")
    decision.metadata.update({"action": res.action, "version": res.version, "previous": res.previous or ""})
    print(res.line())
    return res.action
