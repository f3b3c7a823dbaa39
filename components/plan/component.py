"""Chunk planning from a dynamics profile -> plan JSON + Markdown summary for the KFP UI."""

from kfp import dsl
from kfp.dsl import Artifact, Input, Markdown, Output

from components.images import RUNTIME_IMAGE


@dsl.component(base_image=RUNTIME_IMAGE, install_kfp_package=False)
def plan(profile_json: Input[Artifact], chunks: str, plan_json: Output[Artifact], report: Output[Markdown],
         plot: Output[Artifact]) -> str:
    """Segment the trainable steps into chunks.

    Args:
        profile_json: the profile from the `profile` step.
        chunks: the chunk plan spec: dynamics[:max=5,last=0.5] | uniform:N | sizes:a,b,.. | step | whole.

    Returns:
        The plan as a `sizes:a,b,...` chunks spec for the trainer (its `chunks`).
    """
    import json
    import shutil
    import tempfile
    from pathlib import Path

    from chunkgrpo.chunks import plan_from_profile

    src = Path(tempfile.mkdtemp(prefix="chunkgrpo-plan-"))
    shutil.copyfile(profile_json.path, src / "profile.json")
    d, path = plan_from_profile(src / "profile.json", chunks, src / "plan.json")
    shutil.copyfile(path, plan_json.path)
    if path.with_suffix(".png").exists():
        shutil.copyfile(path.with_suffix(".png"), plot.path)
    sizes = [int(s) for s in d["sizes"]]
    plan_json.metadata.update({"chunks": chunks, "sizes": sizes, "trajectories": d["trajectories"]})
    rows = "\n".join(f"| {c['index']} | {c['steps'][0]}-{c['steps'][1]} | {c['size']} |" for c in d["chunks"])
    rationale = d.get("rationale") or ""
    Path(report.path).write_text(
        f"# Chunk plan\n\n**chunks** `{chunks}` -> **sizes** `{sizes}` "
        f"({d['trainable_steps']} trainable steps of {d['num_steps']}, planned on the "
        f"{d['trajectories'].upper()} profile)\n\n"
        f"{rationale if isinstance(rationale, str) else json.dumps(rationale)}\n\n"
        f"| chunk | steps | size |\n|---|---|---|\n{rows}\n")
    print(f"plan {chunks}: sizes {sizes}")
    return "sizes:" + ",".join(str(s) for s in sizes)
