"""Kubeflow Pipelines v2 lightweight components, one per stage, thin adapters over `chunkgrpo.stages`.

Each runs on the project's own image (`components.images`, tag = package version) with
`install_kfp_package=False`. KFP embeds the function's source in the IR, so the body imports what it
needs from the image: it turns its Input/Output artifacts into paths and plain values, calls its stage
(`chunkgrpo.stages.<step>`, where all of the step's logic lives, shared with the CLI), and writes the
stage's result into its outputs. Large
outputs (checkpoints, image sets) go to S3 through `chunkgrpo.store.client.ArtifactStore`; the KFP
artifacts are small pointers, `Metrics`, `HTML` and `Markdown` (rendered by the KFP UI).

    components/<stage>/component.py   the component      components/<stage>/README.md   what it does
    components/k8s.py                 GPU pool placement, /dev/shm, credentials as env (kfp-kubernetes)
    components/images.py              image references
"""

from components.ablation.component import toy_ablation
from components.eval_preflight.component import eval_preflight
from components.evaluate.component import check_regression, evaluate
from components.launch_trainjob.component import launch_trainjob
from components.models.component import sync_models
from components.plan.component import plan
from components.preflight.component import benchmark_preflight, preflight
from components.profile.component import profile
from components.promote.component import check_gate, promote
from components.register.component import register
from components.tracking.component import close_run, open_run
from components.train.component import train

__all__ = [
    "preflight",
    "benchmark_preflight",
    "eval_preflight",
    "open_run",
    "close_run",
    "profile",
    "plan",
    "train",
    "launch_trainjob",
    "evaluate",
    "check_regression",
    "register",
    "check_gate",
    "promote",
    "sync_models",
    "toy_ablation",
]
