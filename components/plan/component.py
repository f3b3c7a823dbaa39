"""Chunk planning from a dynamics profile -> plan JSON, a Markdown summary and an HTML page with the plot
(both rendered by the KFP UI's visualisation panel). The step is
`chunkgrpo.stages.plan.plan`."""

from kfp import dsl
from kfp.dsl import HTML, Artifact, Input, Markdown, Output

from components.images import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def plan(profile_json: Input[Artifact], chunks: str, plan_json: Output[Artifact], report: Output[Markdown],
         plot: Output[HTML]) -> str:
    """Segment the trainable steps into chunks.

    Args:
        profile_json: the profile from the `profile` step.
        chunks: the chunk plan spec: dynamics[:max=5,last=0.5] | uniform:N | sizes:a,b,.. | step | whole.

    Returns:
        The plan as a `sizes:a,b,...` chunks spec for the trainer (its `chunks`).
    """
    import shutil
    from pathlib import Path

    from chunkgrpo.stages.plan import plan as plan_stage
    from chunkgrpo.tempdirs import scratch

    with scratch("chunkgrpo-plan-") as src:  # removed once the plan is copied out
        shutil.copyfile(profile_json.path, src / "profile.json")  # the plan records the profile's file name
        p = plan_stage(src / "profile.json", chunks, src / "plan.json")
        shutil.copyfile(p.path, plan_json.path)
        Path(plot.path).write_text(p.html(chunks))  # the plot embedded, with the rationale and the chunks
    plan_json.metadata.update({"chunks": chunks, "sizes": p.sizes, "trajectories": p.data["trajectories"]})
    Path(report.path).write_text(p.markdown(chunks))
    print(f"plan {chunks}: sizes {p.sizes}")
    return p.spec
