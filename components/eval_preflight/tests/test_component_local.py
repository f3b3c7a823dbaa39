"""eval_preflight under kfp.local: the task passes for the tiny demo's evaluation and fails for a scorer
whose venv does not exist."""

import pytest

from components.eval_preflight.component import eval_preflight

pytestmark = pytest.mark.integration


def test_eval_preflight_locally(local_runner, tmp_path, monkeypatch):
    args = dict(eval_preset="eval_tiny", eval_benchmarks=[], scorer_weights={}, preset="tiny_cpu")
    task = eval_preflight(eval_overrides=[], **args)
    assert task.output == "ok"
    monkeypatch.setenv("CHUNKGRPO_VENV_IMAGEREWARD", str(tmp_path / "no-venv"))  # the task inherits it
    with pytest.raises(RuntimeError):  # the task fails (kfp.local raise_on_error)
        eval_preflight(eval_overrides=["scorers=[imagereward]"], **args)
