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

Size note: the three trackers (`NullTracker`, `MlflowTracker`, `BackgroundTracker`) share one interface
and change together (a new logging call is added to all three), so they stay in one module.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import os
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from chunkgrpo.backoff import retry_wait
from chunkgrpo.errors import UserError

log = logging.getLogger(__name__)

PARENT_ENV = "CHUNKGRPO_MLFLOW_PARENT_RUN_ID"
_MAX_PARAM_LEN = 6000  # MLflow 3 param value limit
_MAX_TAG_LEN = 5000
_BATCH = 100  # MLflow accepts at most 100 params / 1000 metrics per log_batch


def tracking_enabled() -> bool:
    """True when MLFLOW_TRACKING_URI is set (the only way tracking is switched on)."""
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        return False
    credentials_from_uri()
    return True


def redact_uri(uri: str | None) -> str:
    """`uri` without the user:password part (`http://u:pw@host/x` -> `http://***@host/x`): for printing."""
    if not uri:
        return str(uri)
    from urllib.parse import urlsplit, urlunsplit

    try:
        parts = urlsplit(uri)
    except ValueError:
        return "<unparseable URI>"
    if "@" not in parts.netloc:
        return uri
    return urlunsplit(parts._replace(netloc="***@" + parts.netloc.rsplit("@", 1)[1]))


def credentials_from_uri() -> None:
    """Move credentials embedded in $MLFLOW_TRACKING_URI (`http://user:pw@host`) into
    MLFLOW_TRACKING_USERNAME / MLFLOW_TRACKING_PASSWORD and strip them from the URI, so that nothing
    MLflow or chunkgrpo prints (MLflow's "View run at <uri>" line, log lines, errors) contains them.
    Both given and different -> UserError (which one is meant is not ours to guess)."""
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    from urllib.parse import unquote, urlsplit, urlunsplit

    try:
        parts = urlsplit(uri)
    except ValueError:
        raise UserError(f"MLFLOW_TRACKING_URI {redact_uri(uri)!r} is not a valid URI") from None
    if parts.scheme not in ("http", "https") or "@" not in parts.netloc:
        return
    userinfo, host = parts.netloc.rsplit("@", 1)
    user, _, password = userinfo.partition(":")
    user, password = unquote(user), unquote(password)
    for key, value in (("MLFLOW_TRACKING_USERNAME", user), ("MLFLOW_TRACKING_PASSWORD", password)):
        if value and os.environ.get(key) and os.environ[key] != value:
            raise UserError(
                f"MLFLOW_TRACKING_URI {redact_uri(uri)!r} embeds credentials that differ from "
                f"${key}: give them once (preferably in MLFLOW_TRACKING_USERNAME/PASSWORD, from a Secret)"
            )
        if value:
            os.environ[key] = value
    os.environ["MLFLOW_TRACKING_URI"] = urlunsplit(parts._replace(netloc=host))
    try:  # a tracking URI MLflow already resolved from the environment
        import mlflow

        if "@" in (mlflow.get_tracking_uri() or ""):
            mlflow.set_tracking_uri(os.environ["MLFLOW_TRACKING_URI"])
    except Exception:
        pass


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
    def log_image(self, image: Any, key: str, step: int = 0) -> None: ...
    def log_table(self, data: Mapping[str, list], artifact_file: str) -> None: ...

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

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None,
                    timestamp_ms: int | None = None) -> None:
        import time

        from mlflow.entities import Metric

        ts = timestamp_ms or int(time.time() * 1000)
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

    def log_image(self, image: Any, key: str, step: int = 0) -> None:
        """A PIL image under `key` at `step` (the run page's image slider)."""
        self.client.log_image(self.run_id, image, key=key, step=step)

    def log_table(self, data: Mapping[str, list], artifact_file: str) -> None:
        """Rows (columns of equal length) appended to the run's table `artifact_file` (a .json). MLflow
        downloads the table to append to it: its download bar stays out of a log (`quiet_mlflow_progress`)."""
        from chunkgrpo.progress import quiet_mlflow_progress

        quiet_mlflow_progress()
        self.client.log_table(self.run_id, dict(data), artifact_file)

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


def _stage_experiment_id(client, parent_run_id: str | None, experiment: str | None) -> str:
    """Where a stage's run goes: its parent run's experiment, else `experiment` (default "chunkgrpo")."""
    if parent_run_id:
        return client.get_run(parent_run_id).info.experiment_id
    return _experiment_id(client, experiment or "chunkgrpo")


def attach_run(client, run_id: str) -> MlflowTracker:
    """A tracker logging into the existing run `run_id` (e.g. a pipeline stage's, shared by several calls)."""
    return MlflowTracker(client, run_id, client.get_run(run_id).info.experiment_id)


def _client():
    from mlflow import MlflowClient

    credentials_from_uri()
    return MlflowClient()


def _experiment_id(client, experiment: str) -> str:
    exp = client.get_experiment_by_name(experiment)
    if exp is not None:
        if exp.lifecycle_stage == "deleted":
            client.restore_experiment(exp.experiment_id)
        return exp.experiment_id
    try:
        return client.create_experiment(experiment)
    except Exception:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            raise
        return exp.experiment_id


@contextlib.contextmanager
def _run(
    client,
    experiment_id: str,
    run_name: str,
    tags: Mapping[str, Any] | None,
    parent_run_id: str | None = None,
    params: Mapping[str, Any] | None = None,
) -> Iterator[MlflowTracker]:
    all_tags = {k: _text(v, _MAX_TAG_LEN) for k, v in (tags or {}).items()}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id
    run = client.create_run(experiment_id, run_name=run_name, tags=all_tags)
    with _ended(MlflowTracker(client, run.info.run_id, experiment_id), params) as tracker:
        yield tracker


@contextlib.contextmanager
def _ended(tracker: MlflowTracker, params: Mapping[str, Any] | None = None) -> Iterator[MlflowTracker]:
    """`tracker` (params logged first), its run ended FINISHED, FAILED on an exception, or KILLED when
    interrupted (SIGTERM as `Terminated`, Ctrl-C): never left RUNNING by a run that stopped."""
    from chunkgrpo.errors import Terminated

    if params:
        tracker.log_params(params)
    try:
        yield tracker
    except BaseException as e:
        killed = isinstance(e, (Terminated, KeyboardInterrupt))
        tracker.client.set_terminated(tracker.run_id, status="KILLED" if killed else "FAILED")
        raise
    tracker.client.set_terminated(tracker.run_id, status="FINISHED")


def _kfp_run(client, experiment_id: str, kfp_run_id: str) -> str | None:
    runs = client.search_runs([experiment_id], filter_string=f"tags.`kfp.run_id` = '{kfp_run_id}'",
                              max_results=1)
    return runs[0].info.run_id if runs else None


def find_pipeline_run(client, experiment: str, kfp_run_id: str) -> str | None:
    """The id of the pipeline run tagged `kfp.run_id` = `kfp_run_id` in `experiment` (None: none, or no
    such experiment)."""
    exp = client.get_experiment_by_name(experiment)
    return _kfp_run(client, exp.experiment_id, kfp_run_id) if exp else None


def open_pipeline_run(client, experiment: str, run_name: str, tags: Mapping[str, Any] | None = None,
                      kfp_run_id: str = "") -> tuple[MlflowTracker, bool]:
    """The parent run of one pipeline run (tag chunkgrpo.kind=pipeline; `kfp_run_id` as tag kfp.run_id),
    and whether it was created: a run with the same `kfp_run_id` (a retried step) is found again, not
    duplicated. The run stays RUNNING: the caller (or `start_pipeline_run`) ends it. Every pipeline run
    is opened here: `start_pipeline_run` and the pipeline's `open_run` component."""
    experiment_id = _experiment_id(client, experiment)
    found = _kfp_run(client, experiment_id, kfp_run_id) if kfp_run_id else None
    if found:
        return MlflowTracker(client, found, experiment_id), False
    all_tags = {"chunkgrpo.kind": "pipeline", **({"kfp.run_id": kfp_run_id} if kfp_run_id else {}),
                **(tags or {})}
    run = client.create_run(experiment_id, run_name=run_name,
                            tags={k: _text(v, _MAX_TAG_LEN) for k, v in all_tags.items()})
    return MlflowTracker(client, run.info.run_id, experiment_id), True


@contextlib.contextmanager
def start_pipeline_run(experiment: str, run_name: str, tags: Mapping[str, Any] | None = None,
                       params: Mapping[str, Any] | None = None) -> Iterator[NullTracker]:
    """The parent run of one pipeline run in this process (`open_pipeline_run`), ended FINISHED (FAILED on
    an exception); a NullTracker when MLflow is not configured."""
    if not tracking_enabled():
        log.debug("MLFLOW_TRACKING_URI not set: tracking disabled")
        yield NullTracker()
        return
    client = _client()
    with _ended(open_pipeline_run(client, experiment, run_name, tags)[0], params) as run:
        log.info("MLflow run %s (experiment %r) at %s", run.run_id, experiment,
                 redact_uri(os.environ["MLFLOW_TRACKING_URI"]))
        yield run


# ------------------------------------------------------------------------ background tracking


def _transient(exc: BaseException) -> bool:
    """True for failures that may pass (server down, timeout, 5xx, 429); False for a rejected call."""
    from mlflow.exceptions import MlflowException

    if isinstance(exc, MlflowException):
        code = exc.get_http_status_code()
        return code >= 500 or code == 429
    return isinstance(exc, (OSError, TimeoutError, ConnectionError))


class BackgroundTracker(NullTracker):
    """An MLflow run fed from a background thread, so training never waits on the tracking server.

    Every call returns at once: it is queued (arguments copied) and a worker thread delivers the queue
    in order — creating the run first, whenever the server answers. A failed delivery is retried
    with backoff (1 s doubling to 30 s) while the server is down, unavailable (5xx) or slow (each
    request has a `timeout_s` limit and no MLflow-internal retries); a call the server rejects (4xx)
    is dropped with a warning. `close(status)` queues the run's end (FINISHED / FAILED / KILLED)
    and waits at most `flush_timeout_s` for the queue to drain, retrying at least every
    `drain_retry_s` meanwhile (a server back within the wait is used, not slept through at a long
    backoff); what is left is reported in one line and dropped — the trainer keeps its own metrics
    history on disk.
    """

    enabled = True

    def __init__(self, open_run: Callable[[Any], tuple[str, str]], *, timeout_s: int = 10,
                 flush_timeout_s: float = 60.0, max_pending: int = 100_000, backoff_s: float = 1.0,
                 max_backoff_s: float = 30.0, drain_retry_s: float = 1.0,
                 kept_in: str = "the run's train_summary.json"):
        import threading

        self._open_run = open_run
        self.timeout_s = max(1, int(timeout_s))
        self.flush_timeout_s = flush_timeout_s
        self.kept_in = kept_in  # where the undelivered values are kept (named in the one-line warning)
        self.max_pending = max_pending
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.drain_retry_s = drain_retry_s
        self._ops: collections.deque = collections.deque()
        self._cv = threading.Condition()
        self._inner: MlflowTracker | None = None
        self._closing = False
        self._draining = False  # close() is waiting for the queue: retry at least every drain_retry_s
        self._busy = False
        self.dropped = 0
        self.failures = 0
        self.last_error = ""
        self._env_before = {k: os.environ.get(k) for k in _BOUNDED_ENV}
        os.environ.update(
            {
                "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0",  # our loop retries, without blocking anyone
                "MLFLOW_HTTP_REQUEST_TIMEOUT": str(self.timeout_s),
            }
        )
        self._thread = threading.Thread(target=self._loop, name="mlflow-tracker", daemon=True)
        self._thread.start()

    def __repr__(self) -> str:
        return f"BackgroundTracker(run_id={self.run_id!r}, pending={self.pending})"

    @property
    def run_id(self) -> str | None:  # type: ignore[override]
        return self._inner.run_id if self._inner else None

    @property
    def experiment_id(self) -> str | None:  # type: ignore[override]
        return self._inner.experiment_id if self._inner else None

    @property
    def pending(self) -> int:
        with self._cv:
            return len(self._ops) + (1 if self._busy else 0)

    def _submit(self, what: str, fn: Callable[[MlflowTracker], None]) -> None:
        with self._cv:
            if self._closing:
                return
            if len(self._ops) >= self.max_pending:
                self._ops.popleft()
                self.dropped += 1
                if self.dropped == 1 or self.dropped % 1000 == 0:
                    log.warning(
                        "MLflow unreachable: %d tracking calls dropped (buffer of %d full)",
                        self.dropped,
                        self.max_pending,
                    )
            self._ops.append((what, fn))
            self._cv.notify_all()

    def log_params(self, params: Mapping[str, Any]) -> None:
        params = dict(flatten(params))
        self._submit("log_params", lambda t: t.log_params(params))

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        import time

        metrics, ts = dict(flatten(metrics)), int(time.time() * 1000)
        self._submit("log_metrics", lambda t: t.log_metrics(metrics, step, timestamp_ms=ts))

    def log_metric(self, key: str, value: float, step: int | None = None) -> None:
        self.log_metrics({key: value}, step)

    def set_tags(self, tags: Mapping[str, Any]) -> None:
        tags = dict(tags)
        self._submit("set_tags", lambda t: t.set_tags(tags))

    def log_artifact(self, path: str | Path, artifact_path: str | None = None) -> None:
        self._submit("log_artifact", lambda t: t.log_artifact(path, artifact_path))

    def log_artifacts(self, local_dir: str | Path, artifact_path: str | None = None) -> None:
        self._submit("log_artifacts", lambda t: t.log_artifacts(local_dir, artifact_path))

    def log_dict(self, obj: Any, artifact_file: str) -> None:
        import json

        frozen = json.loads(json.dumps(obj, default=str))  # a snapshot: later changes are not logged
        self._submit("log_dict", lambda t: t.log_dict(frozen, artifact_file))

    def log_image(self, image: Any, key: str, step: int = 0) -> None:
        frozen = image.copy()  # a snapshot: later changes are not logged
        self._submit("log_image", lambda t: t.log_image(frozen, key, step))

    def log_table(self, data: Mapping[str, list], artifact_file: str) -> None:
        frozen = {k: list(v) for k, v in data.items()}
        self._submit("log_table", lambda t: t.log_table(frozen, artifact_file))

    @property
    def artifact_uri(self) -> str | None:
        return None  # never block on the server; use run_id

    def flush(self, timeout: float) -> bool:
        """Wait until everything queued is delivered (True) or `timeout` seconds pass (False)."""
        import time

        deadline = time.monotonic() + timeout
        with self._cv:
            while self._ops or self._busy:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(min(left, 0.5))
        return True

    def close(self, status: str = "FINISHED", timeout: float | None = None) -> bool:
        """Queue the run's end with `status`, wait up to `timeout` (default flush_timeout_s), stop."""
        self._submit("set_terminated", lambda t: t.client.set_terminated(t.run_id, status=status))
        with self._cv:
            self._draining = True
            self._cv.notify_all()
        done = self.flush(self.flush_timeout_s if timeout is None else timeout)
        with self._cv:
            left = len(self._ops) + (1 if self._busy else 0)
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout=2.0)
        for k, v in self._env_before.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if not done:
            where = f"run {self.run_id} stays RUNNING" if self.run_id else "the run was never created"
            log.warning(
                "MLflow at %s unreachable (%s): %d tracking calls not delivered, %s; the metrics are in %s",
                redact_uri(os.environ.get("MLFLOW_TRACKING_URI")),
                self.last_error or "no answer",
                left,
                where,
                self.kept_in,
            )
        return done

    def _loop(self) -> None:
        delay = self.backoff_s
        while True:
            with self._cv:
                while not self._ops and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
                what, fn = self._ops[0]
                self._busy = True
            try:
                if self._inner is None:
                    client = _client()
                    run_id, experiment_id = self._open_run(client)
                    self._inner = MlflowTracker(client, run_id, experiment_id)
                    log.info("MLflow run %s", run_id)
                fn(self._inner)
                ok = True
            except Exception as e:
                ok = False
                self.last_error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                if not _transient(e) and self._inner is None:
                    log.warning("MLflow refused to create the run (%s); tracking is off for this stage",
                                self.last_error)
                    with self._cv:
                        self.dropped += len(self._ops)
                        self._ops.clear()
                        self._busy = False
                        self._closing = True
                        self._cv.notify_all()
                    return
                if not _transient(e):
                    log.warning("MLflow rejected %s (%s); skipped", what, self.last_error)
                    ok = True  # drop it: retrying cannot help
                else:
                    self.failures += 1
                    if self.failures == 1 or self.failures % 10 == 0:
                        log.warning("MLflow unreachable (%s); %d tracking calls buffered, retrying in %.0fs; "
                                    "training continues", self.last_error, len(self._ops), delay)
            with self._cv:
                self._busy = False
                if ok:
                    if self._ops and self._ops[0][1] is fn:
                        self._ops.popleft()
                    delay = self.backoff_s
                    self._cv.notify_all()
                    continue
                self._cv.notify_all()
                if retry_wait(self._cv, lambda: self._closing, lambda: self._draining, delay,
                              self.drain_retry_s):
                    return
                delay = min(self.max_backoff_s, delay * 2)


_BOUNDED_ENV = ("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "MLFLOW_HTTP_REQUEST_TIMEOUT")


@contextlib.contextmanager
def background_stage_run(name: str, parent_run_id: str | None = None, experiment: str | None = None,
                         params: Mapping[str, Any] | None = None, tags: Mapping[str, Any] | None = None,
                         timeout_s: int = 10, flush_timeout_s: float = 60.0,
                         kill_flush_timeout_s: float = 10.0,
                         kept_in: str = "the run's train_summary.json") -> Iterator[NullTracker]:
    """Like `stage_run`, but nothing waits on MLflow (see `BackgroundTracker`): the run is created,
    fed and ended from a background thread. The run ends FINISHED, FAILED on an exception, or
    KILLED on SIGTERM (`Terminated`) / Ctrl-C, then waits at most `flush_timeout_s`
    (`kill_flush_timeout_s` when killed: a pod has a short grace period)."""
    from chunkgrpo.errors import Terminated

    if not tracking_enabled():
        yield NullTracker()
        return
    parent_run_id = parent_run_id or os.environ.get(PARENT_ENV) or None
    all_tags = {k: _text(v, _MAX_TAG_LEN) for k, v in {"chunkgrpo.stage": name, **(tags or {})}.items()}
    if parent_run_id:
        all_tags["mlflow.parentRunId"] = parent_run_id

    def open_run(client) -> tuple[str, str]:
        experiment_id = _stage_experiment_id(client, parent_run_id, experiment)
        run = client.create_run(experiment_id, run_name=name, tags=all_tags)
        return run.info.run_id, experiment_id

    tracker = BackgroundTracker(open_run, timeout_s=timeout_s, flush_timeout_s=flush_timeout_s,
                                kept_in=kept_in)
    if params:
        tracker.log_params(params)
    status, wait = "FINISHED", flush_timeout_s
    try:
        yield tracker
    except (Terminated, KeyboardInterrupt):
        status, wait = "KILLED", min(flush_timeout_s, kill_flush_timeout_s)
        raise
    except BaseException:
        status = "FAILED"
        raise
    finally:
        tracker.close(status, timeout=wait)


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
    with _run(client, _stage_experiment_id(client, parent_run_id, experiment), name,
              {"chunkgrpo.stage": name, **(tags or {})},
              parent_run_id=parent_run_id, params=params) as run:
        yield run
