"""kfp.local runs of the real train_and_evaluate pipeline with the method switch set to each branching
method, on the tiny model (2 torchrun processes), against the real local SeaweedFS + MLflow."""

import json
import uuid

import pytest

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("method", ["tempflow", "granular"])
def test_pipeline_trains_each_branching_method(services, tmp_path, method):
    from chunkgrpo.store.client import ArtifactStore
    from chunkgrpo.store.manifest import read_pointer
    from pipeline.local import run_local

    name = f"pipeline-{method}-{uuid.uuid4().hex[:6]}"
    r = run_local(
        "train_and_evaluate",
        {
            "method": method,
            "preset": f"{method}_grpo_tiny_cpu",
            "max_iterations": 2,
            "model_name": name,
            "profile_prompts": 2,
            "eval_num_prompts": 2,
        },
        home=tmp_path,
        services_env=services.env,
        demo="tiny",
    )
    t = r.tasks
    assert {"profile", "plan", "train", "evaluate", "register"} <= set(t)
    # the profile recorded both trajectory kinds and the plan says which one it used
    prof = json.loads(open(t["profile"]["artifacts"]["profile_json"]["uri"]).read())
    assert {"l1rel_sde", "l1rel_ode"} <= set(prof) and prof["trajectories"] == "sde"
    assert t["plan"]["artifacts"]["plan_json"]["metadata"]["trajectories"] == "sde"
    pointer = read_pointer(open(t["train"]["artifacts"]["trained_model"]["uri"]).read())
    assert pointer["method"] == method
    per_rollout = 1 if method == "tempflow" else 4  # per_iteration vs one step per branching step 0..3
    assert pointer["optimizer_steps"] == 2 * per_rollout
    info = json.loads(
        ArtifactStore(services.store_config).get_bytes(pointer["uri"] + "/chunkgrpo_model.json")
    )
    assert info["method"] == method and info["kind"] == "lora"
    assert "evaluate" in t and t["register"]["parameters"]["Output"]
