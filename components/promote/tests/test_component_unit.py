"""check_gate / promote: python_func with the registry calls stubbed (the registry has its own tests)."""

from chunkgrpo.registry import promotion
from chunkgrpo.registry.gate import GateResult, PromotionResult
from components.promote.component import check_gate, promote


def test_check_gate_passes_the_registry_decision_through(monkeypatch):
    seen = {}

    def fake(name, version, gate):
        seen.update(name=name, version=version, gate=gate)
        return GateResult(False, "different protocols")

    monkeypatch.setattr(promotion, "gate_check", fake)
    assert check_gate.python_func(model_name="m", version="3", metric="", margin=0.1) is False
    assert seen["gate"].direction == "" and seen["gate"].margin == 0.1  # direction: the registered model's


def test_promote_writes_the_decision(monkeypatch, artifact):
    monkeypatch.setattr(promotion, "promote", lambda name, version, gate, who, why: PromotionResult(
        "promoted", name, version, "1", "better"))
    md = artifact("decision.md")
    assert (
        promote.python_func(model_name="m", version="2", metric="", margin=0.0, who="w", why="y", decision=md)
        == "promoted"
    )
    assert "m v2: promoted" in open(md.path).read() and md.metadata["previous"] == "1"
