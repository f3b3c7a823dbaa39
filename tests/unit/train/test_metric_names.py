"""Every metric a training iteration produces has an MLflow name under a namespace (reward/, policy/,
time/, count/); the internal keys the history and gate read stay as they are."""

import pytest

from chunkgrpo.train.config import TrainConfig
from chunkgrpo.train.metric_names import (
    TRAINING_METRIC_NAMES,
    UNMAPPED_PREFIX,
    training_metric_name,
    training_metrics_for_mlflow,
)
from chunkgrpo.train.trainer import Trainer

NAMESPACES = ("reward/", "policy/", "time/", "count/")


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "prompts.txt"
    p.write_text("a cat on a chair\na red car\nthree apples\na bowl of fruit\n")
    return p


def test_table_names_are_namespaced_and_distinct():
    names = list(TRAINING_METRIC_NAMES.values())
    assert len(set(names)) == len(names)
    assert all(n.startswith(NAMESPACES) for n in names)
    assert training_metric_name("reward_mean") == "reward/mean"
    assert training_metric_name("reward/pickscore") == "reward/pickscore"
    assert training_metric_name("time/rollout") == "time/rollout"
    assert training_metric_name("something_new") == UNMAPPED_PREFIX + "something_new"


@pytest.mark.parametrize("method,extra", [
    ("chunk", []),
    ("tempflow", ["group_size=4", "branch_steps=[0,2,3]", "lora.rank=4", "kl_ref_coef=0.004"]),
])
def test_every_iteration_metric_is_mapped(tiny_model_dir, prompts_file, tmp_path, method, extra):
    cfg = TrainConfig.load("tiny_cpu", [f"model={tiny_model_dir}", f"prompts={prompts_file}",
                                        f"output_dir={tmp_path}", "progress=false", f"method={method}",
                                        "max_steps=1", *extra])
    t = Trainer(cfg)
    t.setup()
    m = t.iteration()
    m["optimizer_step"] = t.opt_step  # the trainer adds it before logging
    out = training_metrics_for_mlflow(m)
    unmapped = sorted(k for k in m if training_metric_name(k).startswith(UNMAPPED_PREFIX))
    assert not unmapped, f"add these keys to TRAINING_METRIC_NAMES: {unmapped}"
    assert all(k.startswith(NAMESPACES) for k in out)
    assert len(out) == len(m)  # no two internal keys share an MLflow name
    assert out["reward/mean"] == m["reward_mean"] and out["policy/loss"] == m["loss"]
