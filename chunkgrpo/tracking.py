"""Thin MLflow tracking helpers: one parent run per pipeline run, one nested run per stage.

Library code can always call these: without `MLFLOW_TRACKING_URI` every tracker is a no-op
(`NullTracker`), so tests and offline runs need no server.

    with start_pipeline_run("chunkgrpo", run_name="nightly", tags={"git_sha": sha}) as run:
        run.log_params(flatten(cfg.to_dict()))
        with run.stage("train") as st:            # nested run (mlflow.parentRunId = run.run_id)
            st.log_metrics({"loss": 0.1}, step=10)
            st.log_artifacts("out/samples", "samples")

Across processes (KFP components), pass `run.run_id` on and attach a stage to it with
`stage_run("evaluate", parent_run_id=...)`, or set `CHUNKGRPO_MLFLOW_PARENT_RUN_ID`.
The MLflow client API is used with explicit run ids (no global "active run" state), so threads
and nested stages cannot mix runs up.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

PARENT_ENV = "CHUNKGRPO_MLFLOW_PARENT_RUN_ID"
_MAX_PARAM_LEN = 6000  # MLflow 3 param value limit
_MAX_TAG_LEN = 5000
_BATCH = 100  # MLflow accepts at most 100 params / 1000 metrics per log_batch


def tracking_enabled() -> bool:
    """True when MLFLOW_TRACKING_URI is set (the only way tracking is switched on)."""
    return bool(os.environ.get("MLFLOW_TRACKING_URI"))


def flatten(d: Mapping[str, Any], prefix: str = "", sep: str = ".") -> dict[str, Any]:
    """{"a": {"b": 1}, "c": [1, 2]} -> {"a.b": 1, "c": "[1, 2]"} (lists/tuples stay one value)."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{sep}{k}" if prefix else str(k)
        if isinstance(v, Mapping):
            out.update(flatten(v, key, sep))
        else:
            out[key] = v
    return out


def _text(v: Any, limit: int) -> str:
    s = v if isinstance(v, str) else repr(v) if isinstance(v, (list, tuple)) else str(v)
    return s if len(s) <= limit else s[: limit - 3] + "..."


class NullTracker:
    """Does nothing; what library code gets when MLflow is not configured."""

    enabled = False
    run_id: str | None = None
    experiment_id: str | None = None

    def log_params(self, params: Mapping[str, Any]) -> None: ...
    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None: ...
    def log_metric(self, key: str, value: float, step: int | None = None) -> None: ...
    def set_tags(self, tags: Mapping[str, Any]) -> None: ...
    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None: ...
    def log_artifacts(self, local_dir: str | Path, artifact_path: str | None = None) -> None: ...
    def log_dict(self, obj: Any, artifact_file: str) -> None: ...

    @property
    def artifact_uri(self) -> str | None:
        return None

    @contextlib.contextmanager
    def stage(self, name: str, params: Mapping[str, Any] | None = None,
              tags: Mapping[str, Any] | None = None) -> Iterator["NullTracker"]:
        yield self


class MlflowTracker(NullTracker):
    """Logs into one MLflow run (by id)."""

    enabled = True

    def __init__(self, client, run_id: str, experiment_id: str):
        self.client = client
        self.run_id = run_id
        self.experiment_id = experiment_id

    def __repr__(self) -> str:
        return f"MlflowTracker(run_id={self.run_id!r})"

    def log_params(self, params: Mapping[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(str(k), _text(v, _MAX_PARAM_LEN)) for k, v in flatten(params).items()]
        for i in range(0, len(items), _BATCH):
            self.client.log_batch(self.run_id, params=items[i:i + _BATCH])

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        import time

        from mlflow.entities import Metric

        ts = int(time.time() * 1000)
        items = []
        for k, v in flatten(metrics).items():
            try:
                value = float(v)
            except (TypeError, ValueError):
                log.debug("metric %s=%r is not a number; skipped", k, v)
                continue
            if math.isfinite(value):
                items.append(Metric(str(k), value, ts, step or 0))
            else:
                log.warning("metric %s=%r is not finite; skipped", k, v)
        for i in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[i:i + 1000])

    def log_metric(self, key: str, value: float, step: int | None = None) -> None:
        self.log_metrics({key: value}, step)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(str(k), _text(v, _MAX_TAG_LEN)) for k, v in tags.items()]
        for i in range(0, len(items), _BATCH):
            self.client.log_batch(self.run_id, tags=items[i:i + _BATCH])

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_artifacts(self, local_dir: str | Path, artifact_path: str | None = None) -> None:
        self.client.log_artifacts(self.run_id, str(local_dir), artifact_path)

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, obj, artifact_file)

    @property
    def artifact_uri(self) -> str | None:
        return self.client.get_run(self.run_id).info.artifact_uri

    @contextlib.contextmanager
    def stage(self, name: str, params: Mapping[str, Any] | None = None,
              tags: Mapping[str, Any] | None = None) -> Iterator["MlflowTracker"]:
        """A nested run under this one; FINISHED on success, FAILED on an exception."""
        with _run(self.client, self.experiment_id, name, {"chunkgrpo.stage": name, **(tags or {})},
                  parent_run_id=self.run_id, params=params) as child:
            yield child


def _client():
    from mlflow import MlflowClient

    return MlflowClient()


def _experiment_id(client, experiment: str) -> str:
    exp = client.get_experiment_by_name(experiment)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp.experiment_id)
        return exp.experiment_id
    try:
        return client.create_experiment(experiment)
    except Exception:  # noqa: BLE001 - created concurrently by another stage
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            raise
        return exp.experiment_id


@contextlib.contextmanager
def _run(client, experiment_id: str, run_name: str, tags: Mapping[str, Any] | None,
         parent_run_id: str | None = None, params: Mapping[str, Any] | None = None) -> Iterator[MlflowTracker]:
    all_tags = {k: _text(v, _MAX_TAG_LEN) for k, v in (tags or {}).items()}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    run = client.create_run(experiment_id, run_name=run_name, tags=all_tags)
    tracker = MlflowTracker(client, run.info.run_id, experiment_id)
    if params:
        tracker.log_params(params)
    try:
        yield tracker
    except BaseException:
        client.set_terminated(run.info.run_id, status="FAILED")
        raise
    client.set_terminated(run.info.run_id, status="FINISHED")


@contextlib.contextmanager
def start_pipeline_run(experiment: str, run_name: str, tags: Mapping[str, Any] | None = None,
                       params: Mapping[str, Any] | None = None) -> Iterator[NullTracker]:
    """The parent run of one pipeline run (a NullTracker when MLflow is not configured)."""
    if not tracking_enabled():
        log.debug("MLFLOW_TRACKING_URI not set: tracking disabled")
        yield NullTracker()
        return
    client = _client()
    with _run(client, _experiment_id(client, experiment), run_name,
              {"chunkgrpo.kind": "pipeline", **(tags or {})}, params=params) as run:
        log.info("MLflow run %s (experiment %r) at %s", run.run_id, experiment, os.environ["MLFLOW_TRACKING_URI"])
        yield run


@contextlib.contextmanager
def stage_run(name: str, parent_run_id: str | None = None, experiment: str | None = None,
              params: Mapping[str, Any] | None = None, tags: Mapping[str, Any] | None = None
              ) -> Iterator[NullTracker]:
    """A stage run nested under `parent_run_id` (default $CHUNKGRPO_MLFLOW_PARENT_RUN_ID).

    Without a parent, the stage becomes a top-level run in `experiment` (default "chunkgrpo").
    """
    if not tracking_enabled():
        yield NullTracker()
        return
    client = _client()
    parent_run_id = parent_run_id or os.environ.get(PARENT_ENV) or None
    if parent_run_id:
        experiment_id = client.get_run(parent_run_id).info.experiment_id
    else:
        experiment_id = _experiment_id(client, experiment or "chunkgrpo")
    with _run(client, experiment_id, name, {"chunkgrpo.stage": name, **(tags or {})},
              parent_run_id=parent_run_id, params=params) as run:
        yield run
