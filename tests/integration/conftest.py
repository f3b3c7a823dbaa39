"""Fixtures shared by the integration tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def trained_dir(tiny_model_dir, tmp_path_factory):
    """A LoRA-trained folder over the tiny model (seed 1), as the trainer's `final/` holds it."""
    from tests.unit.eval.test_hybrid import make_lora_dir

    return make_lora_dir(tiny_model_dir, tmp_path_factory.mktemp("trained") / "final", seed=1)
