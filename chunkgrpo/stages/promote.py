"""The promotion gate (read-only decision) and the gated move of the `champion` alias; with
$CHUNKGRPO_PROMOTER_URL set, the promoter service (which alone may move `champion`) does the move."""

from __future__ import annotations

import os


def gate_config(metric: str | None = None, margin: float | None = None):
    """The GateConfig of a request (None = the registered model's metric / no margin)."""
    from chunkgrpo.registry.gate import GateConfig

    return GateConfig.from_dict({k: v for k, v in {"metric": metric, "margin": margin}.items()
                                 if v is not None})


def gate(model_name: str, version: str, metric: str = "", margin: float = 0.0):
    """Does `version` beat the champion on the registered model's gate? (a GateResult; no champion = pass)"""
    from chunkgrpo.registry.promotion import gate_check

    decision = gate_check(model_name, version, gate_config(metric, margin))
    print(f"gate {'PASSED' if decision.passed else 'not passed'}: {decision.reason}")
    return decision


def promote(model_name: str, version: str, metric: str | None = "", margin: float | None = 0.0, *,
            who: str | None = None, why: str = "", force: bool = False):
    """Move `champion` to `version` if it passes the gate (old champion -> `previous`); a PromotionResult.
    A gated promotion goes through the promoter service when $CHUNKGRPO_PROMOTER_URL is set; `force`
    (promoter identity only) skips the gate and is done here."""
    gate = gate_config(metric, margin)
    url = os.environ.get("CHUNKGRPO_PROMOTER_URL")
    if url and not force:
        from chunkgrpo.registry.promoter_client import request_promotion

        return request_promotion(url, model_name, version, gate, why=why)
    from chunkgrpo.registry.promotion import promote as registry_promote

    if force:
        return registry_promote(model_name, version, gate, force=True, who=who, why=why)
    return registry_promote(model_name, version, gate, who=who, why=why)
