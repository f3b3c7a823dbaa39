"""kfp's task setters name their caller without `inspect.stack()` (tests/kfp_frames.py), with kfp's error."""

import pytest


def test_the_patch_is_in_place_and_keeps_kfps_error():
    from kfp import dsl
    from kfp.dsl import pipeline_task

    from tests import kfp_frames

    ours = kfp_frames._ensure_container_spec_exists
    assert pipeline_task.PipelineTask._ensure_container_spec_exists is ours

    @dsl.component
    def leaf() -> int:
        return 1

    @dsl.pipeline
    def inner() -> int:
        return leaf().output

    with pytest.raises(ValueError, match="^set_cpu_request can only be used on single-step components"):
        @dsl.pipeline
        def outer():
            inner().set_cpu_request("1")

    @dsl.pipeline
    def fine():
        leaf().set_cpu_request("1")  # a single-step component: accepted
