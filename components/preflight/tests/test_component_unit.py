"""preflight: python_func with local inputs (no S3/MLflow needed when nothing points there)."""

import pytest

from chunkgrpo.errors import UserError
from components.preflight.component import benchmark_preflight, preflight


def _run(tmp_path, **kw):
    from types import SimpleNamespace

    report = SimpleNamespace(path=str(tmp_path / "capacity.md"))
    base = dict(
        model="",
        prompts="",
        preset="tiny_cpu",
        train_overrides=[],
        reward_weights={},
        scorer_weights={},
        eval_preset="eval_tiny",
        eval_benchmarks=[],
        eval_overrides=[],
        artifact_root="",
        capacity=report,
    )
    return preflight.python_func(**{**base, **kw})


def test_ok_with_local_model_and_prompts(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    weights = {"hpsv3": str(tmp_path / "absent")}  # not used by tiny_cpu / eval_tiny: not checked
    assert (
        _run(tmp_path, model=str(tiny_model_dir), prompts=str(prompts), reward_weights=weights,
             scorer_weights=weights)
        == "ok"
    )


def test_every_problem_in_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(UserError) as exc:
        _run(tmp_path, model=str(tmp_path / "no-model"), prompts=str(tmp_path / "no.txt"),
             eval_benchmarks=["wise"])
    msg = str(exc.value)
    assert "\n" not in msg and "3 problem(s)" in msg
    assert "no-model" in msg and "no.txt" in msg and "OPENAI_API_KEY" in msg


def test_a_training_reward_the_image_cannot_build_is_named(tiny_model_dir, tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.setenv("CHUNKGRPO_VENV_IMAGEREWARD", str(tmp_path / "no-venv"))
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    with pytest.raises(UserError) as exc:
        _run(tmp_path, model=str(tiny_model_dir), prompts=str(prompts),
             train_overrides=["rewards=[{name: imagereward}]"])
    msg = str(exc.value)
    assert "\n" not in msg
    assert msg.startswith("preflight: 1 problem(s): chunkgrpo-runtime: reward imagereward: ")
    assert f"CHUNKGRPO_VENV_IMAGEREWARD={tmp_path / 'no-venv'} does not exist" in msg


def test_benchmark_preflight_names_everything_in_one_line(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(UserError) as exc:
        benchmark_preflight.python_func(
            model_name="m",
            alias="champion",
            base_model=str(tmp_path / "no-base"),
            eval_preset="eval_tiny",
            eval_benchmarks=["hpdv2", "wise"],
            eval_overrides=[],
            scorer_weights={},
            artifact_root="",
        )
    msg = str(exc.value)
    assert "\n" not in msg and "3 problem(s)" in msg
    assert "m@champion needs an MLflow server" in msg and "no-base" in msg and "OPENAI_API_KEY" in msg


def test_capacity_plan_is_a_markdown_artifact_and_a_problem_when_it_does_not_fit(tiny_model_dir, tmp_path,
                                                                                 monkeypatch):
    """On the H800 pool (its rendered training runtime) a recipe whose rollout decode cannot fit 80 GB fails
    the preflight in one line naming the resource and by how much; the plan is written first."""
    from types import SimpleNamespace

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    report = SimpleNamespace(path=str(tmp_path / "capacity.md"))
    assert _run(tmp_path, model=str(tiny_model_dir), prompts=str(prompts), pool="h800",
                capacity=report) == "ok"
    assert "# Capacity plan: tiny_cpu on h800" in (tmp_path / "capacity.md").read_text()
    huge = ["sampling.height=8192", "sampling.width=8192", "group_size=64", "grad_accum=64"]
    with pytest.raises(UserError) as exc:
        _run(
            tmp_path,
            model=str(tiny_model_dir),
            prompts=str(prompts),
            pool="h800",
            capacity=report,
            train_overrides=huge,
        )
    msg = str(exc.value)
    assert "\n" not in msg and "capacity: GPU memory per rank (decode phase): needs" in msg and "over)" in msg
    assert "does not fit" in (tmp_path / "capacity.md").read_text()


def test_capacity_plan_covers_every_node(tiny_model_dir, tmp_path, monkeypatch):
    """`nodes` (the multi-node pipeline's num_nodes) is planned: 2 pods of the H800 pool = 16 ranks."""
    from types import SimpleNamespace

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    for nodes, ranks in ((1, 8), (2, 16)):
        report = SimpleNamespace(path=str(tmp_path / f"capacity{nodes}.md"))
        assert _run(tmp_path, model=str(tiny_model_dir), prompts=str(prompts), pool="h800", capacity=report,
                    nodes=nodes) == "ok"
        assert f"{ranks} rank(s) (8 per node" in (tmp_path / f"capacity{nodes}.md").read_text()


def test_the_training_config_is_checked_as_the_train_step_loads_it(tiny_model_dir, tmp_path, monkeypatch):
    """`max_iterations` (a pipeline parameter, not an override) is validated with the preset: a bad value
    fails here in one line naming it; a good one passes."""
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    assert _run(tmp_path, model=str(tiny_model_dir), prompts=str(prompts), max_iterations=3) == "ok"
    with pytest.raises(UserError, match=r"^max_iterations must be >= 0 .*got max_iterations=-1$"):
        _run(tmp_path, model=str(tiny_model_dir), prompts=str(prompts), max_iterations=-1)
