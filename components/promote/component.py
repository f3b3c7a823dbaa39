"""The promotion gate (a visible decision node) and the gated alias move. The steps are
`chunkgrpo.stages.promote.gate` and `chunkgrpo.stages.promote.promote`."""

from kfp import dsl
from kfp.dsl import Markdown, Output

from components.images import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
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
    from chunkgrpo.stages.task import stage_env

    stage_env("")
    from chunkgrpo.stages.promote import gate

    return gate(model_name, version, metric, margin).passed


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
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

    from chunkgrpo.stages.task import stage_env

    stage_env("")
    from chunkgrpo.stages.promote import promote as promote_stage

    res = promote_stage(model_name, version, metric, margin, who=who, why=why)
    Path(decision.path).write_text(f"# Promotion\n\n`{res.line()}`\n")
    decision.metadata.update({"action": res.action, "version": res.version, "previous": res.previous or ""})
    print(res.line())
    return res.action
