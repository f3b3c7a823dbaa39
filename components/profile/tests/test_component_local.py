"""profile under kfp.local on the tiny model."""

import json

import pytest

from components.profile.component import profile

pytestmark = pytest.mark.integration


def test_profile_locally(local_runner, tiny_model_dir, tmp_path):
    prompts = tmp_path / "p.txt"
    prompts.write_text("a cat\n")
    task = profile(
        model=str(tiny_model_dir),
        prompts=str(prompts),
        preset="tiny_cpu",
        overrides=[],
        num_prompts=1,
        seeds=1,
        device="cpu",
    )
    prof = json.loads(open(task.outputs["profile_json"].path).read())
    assert len(prof["sigmas"]) == len(prof["l1rel"]) + 1 >= 3
