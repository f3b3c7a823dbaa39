"""eval_preflight: python_func in this environment (the eval image's stand-in): scorers, their venvs, peft."""

import sys

import pytest

from chunkgrpo.errors import UserError
from components.eval_preflight.component import eval_preflight

BASE = dict(eval_preset="eval_tiny", eval_benchmarks=[], eval_overrides=[], scorer_weights={})


def test_programmatic_scorers_and_a_lora_model_pass():
    assert eval_preflight.python_func(**BASE, preset="tiny_cpu") == "ok"


def test_a_missing_scorer_venv_and_peft_fail_in_one_line(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "peft", None)  # as if the image lacked peft
    monkeypatch.setenv("CHUNKGRPO_VENV_HPSV2", str(tmp_path / "no-venv"))
    with pytest.raises(UserError) as e:
        eval_preflight.python_func(**{**BASE, "eval_overrides": ["scorers=[hpsv2.1]"],
                                      "scorer_weights": {"hpsv2.1": "s3://b/HPSv2"}}, preset="tiny_cpu")
    msg = str(e.value)
    assert msg.startswith("eval-image preflight: 2 problem(s): chunkgrpo-eval: ") and "\n" not in msg
    assert f"CHUNKGRPO_VENV_HPSV2={tmp_path / 'no-venv'} does not exist" in msg and "`peft`" in msg
