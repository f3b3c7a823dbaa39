"""plan under kfp.local (SubprocessRunner): the compiled component, its artifacts and return value."""

import json

import pytest
from kfp import dsl

from components.conftest import tiny_profile
from components.plan.component import plan

pytestmark = pytest.mark.integration


def test_plan_runs_locally(local_runner, text_artifact):
    @dsl.pipeline(name="plan-local")
    def p(profile: str) -> str:
        prof = text_artifact(text=profile)
        return plan(profile_json=prof.outputs["out"], chunks="uniform:3").outputs["Output"]

    task = p(profile=json.dumps(tiny_profile(10)))
    assert task.output == "sizes:3,3,3"
