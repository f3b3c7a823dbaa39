"""A kfp.local run of the real train_and_evaluate pipeline with the method switch set to Granular-GRPO, on
the tiny model (2 torchrun processes), against the real local SeaweedFS + MLflow; then the same run again,
its profile and plan from kfp.local's task cache. (TempFlow-GRPO's run through the pipeline is the
image-faithful demo's, tests/pipeline/test_image_faithful.py.)"""

import json
import uuid

import pytest

pytestmark = pytest.mark.integration


def _params(method: str) -> dict:
    return {
        "method": method,
        "preset": f"{method}_grpo_tiny_cpu",
        "max_iterations": 2,
        "model_name": f"pipeline-{method}-{uuid.uuid4().hex[:6]}",
        "profile_prompts": 2,
        "eval_num_prompts": 2,
    }


@pytest.fixture(scope="module")
def runs() -> dict:
    """method -> (home, params, LocalRun) of this module's runs: the cache test reruns one (one file runs
    on one xdist worker, `--dist loadfile`)."""
    return {}


@pytest.mark.parametrize("method", ["granular"])
def test_pipeline_trains_a_branching_method(services, tmp_path, method, runs):
    from chunkgrpo.store.client import ArtifactStore
    from chunkgrpo.store.manifest import read_pointer
    from pipeline.local_run import run_local

    params = _params(method)
    r = run_local("train_and_evaluate", params, home=tmp_path, services_env=services.env, demo="tiny")
    runs[method] = (tmp_path, params, r)
    t = r.tasks
    assert {"profile", "plan", "train", "evaluate", "register"} <= set(t)
    # the profile recorded both trajectory kinds and the plan says which one it used
    prof = json.loads(open(t["profile"]["artifacts"]["profile_json"]["uri"]).read())
    assert {"l1rel_sde", "l1rel_ode"} <= set(prof) and prof["trajectories"] == "sde"
    assert t["plan"]["artifacts"]["plan_json"]["metadata"]["trajectories"] == "sde"
    pointer = read_pointer(open(t["train"]["artifacts"]["trained_model"]["uri"]).read())
    assert pointer["method"] == method
    per_rollout = 4  # one optimizer step per branching step 0..3
    assert pointer["optimizer_steps"] == 2 * per_rollout
    info = json.loads(
        ArtifactStore(services.store_config).get_bytes(pointer["uri"] + "/chunkgrpo_model.json")
    )
    assert info["method"] == method and info["kind"] == "lora"
    assert "evaluate" in t and t["register"]["parameters"]["Output"]


def test_a_second_run_takes_profile_and_plan_from_the_cache(services, tmp_path, runs):
    """kfp.local's task cache in `run_local` (pipeline/local_run.py): a second run in the same home with the
    same profile and plan inputs takes profile and plan (compiled with caching on) from the first run, also
    when the training and evaluation settings changed (shorter here); every other task runs."""
    from chunkgrpo.store.manifest import read_pointer
    from pipeline.local_run import run_local
    from pipeline.summary import summary_lines

    if "granular" not in runs:  # the first run's test was deselected: make the first run here
        params = _params("granular")
        runs["granular"] = (tmp_path, params, run_local("train_and_evaluate", params, home=tmp_path,
                                                        services_env=services.env, demo="tiny"))
    home, params, first = runs["granular"]
    assert not any(t.get("cached") for t in first.tasks.values())
    shorter = {**params, "max_iterations": 1, "eval_num_prompts": 1}  # not inputs of profile or plan
    second = run_local("train_and_evaluate", shorter, home=home, services_env=services.env, demo="tiny")

    assert {n for n, t in second.tasks.items() if t.get("cached")} == {"profile", "plan"}
    for task, name in (("profile", "profile_json"), ("plan", "plan_json")):
        assert second.tasks[task]["artifacts"][name] == first.tasks[task]["artifacts"][name]
    assert second.tasks["plan"]["parameters"] == first.tasks["plan"]["parameters"]
    # the tasks after them ran again, on the cached plan
    assert second.tasks["train"]["artifacts"]["trained_model"]["uri"].startswith(str(second.run_dir))
    pointer = read_pointer(open(second.tasks["train"]["artifacts"]["trained_model"]["uri"]).read())
    assert pointer["optimizer_steps"] == 4  # the second run's own length: one rollout of 4 branching steps
    assert second.stages["task profile"] == 0.0
    assert "cached: an earlier run's output" in "\n".join(summary_lines(second))
