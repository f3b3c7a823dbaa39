"""What every pipeline task shares: process setup, where a step's large outputs go, input files, results
that own a scratch folder (`chunkgrpo.tempdirs`)."""

from __future__ import annotations

from pathlib import Path


def stage_env(parent_run_id: str = "") -> None:
    """Logging to stdout (the KFP UI shows it), telemetry off, thread caps, the collector's start policy
    (`chunkgrpo.startup`) and the MLflow parent run the library's stage runs nest under. Call it first in
    a task: it must run before torch loads."""
    import logging
    import os

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True
    )
    os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    from chunkgrpo import shutdown, startup, threads

    startup.fewer_full_collections()  # before the stage imports torch, diffusers or mlflow
    threads.configure()  # torch threads capped at the task's cores; its children wait passively
    shutdown.fast_exit()  # the task's process exits without the interpreter's repeated final collections
    if parent_run_id:
        os.environ["CHUNKGRPO_MLFLOW_PARENT_RUN_ID"] = parent_run_id


def run_prefix(artifact_root: str, run_id: str, stage: str) -> str:
    """`<artifact_root>/<run id>/<stage>`: where a stage's large outputs go in S3."""
    if not artifact_root.startswith("s3://"):
        raise ValueError(f"artifact_root={artifact_root!r} must be an s3://bucket/prefix URI")
    return f"{artifact_root.rstrip('/')}/{run_id}/{stage}"


def local_file(path: str, into: str | Path = "") -> str:
    """A local path for `path`; an `s3://` object is downloaded (checksum-verified) into the folder `into`
    (a scratch folder of the caller, removed with it), else into a new temp dir the caller owns."""
    if not path.startswith("s3://"):
        return path
    import os
    import tempfile

    from chunkgrpo.store.client import ArtifactStore

    folder = str(into) if into else tempfile.mkdtemp(prefix="chunkgrpo-input-")
    dst = os.path.join(folder, path.rstrip("/").rsplit("/", 1)[-1])
    ArtifactStore().get_file(path, dst)
    return dst


class OwnsScratch:
    """A step's result whose files (`scratch`, a folder the step made) stay until `cleanup()`, or the end of
    a `with` block: `with step(req) as result: <copy the files out>`."""

    scratch: Path | None

    def cleanup(self) -> None:
        import shutil

        if self.scratch is not None:
            shutil.rmtree(self.scratch, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.cleanup()
