"""The registry's MLflow connection and reads: a client with bounded waits (`connect`), this process's
identity (`current_identity`, `require_promoter`), registered models, versions and aliases, and the
trusted gate values (an evaluation run's metrics, `trusted_metric`). Every read turns MLflow's
errors into one-line UserErrors; the rules applied to what is read are `chunkgrpo.registry.gate`'s.

`connect` sets MLflow's `MLFLOW_HTTP_REQUEST_*` defaults for the process (where they are unset). They
cannot be scoped to one call: MLflow reads them from the environment at every request, its client has
no setting of its own for them, the client returned is used for many calls afterwards (by the
promoter's request threads too), and `chunkgrpo.tracking.BackgroundTracker` changes the same variables
from its own thread; tests restore them after each test (tests/conftest.py).
"""

from __future__ import annotations

import datetime as _dt
import getpass
import json
import os
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

from chunkgrpo.errors import UserError
from chunkgrpo.progress import quiet_mlflow_progress
from chunkgrpo.registry import gate
from chunkgrpo.store.manifest import WEIGHTS_TAG as RUN_WEIGHTS_TAG
from chunkgrpo.tracking import credentials_from_uri, redact_uri

# Registry calls: MLflow's defaults retry 7 times with backoff (~250 s on a dead server). A dead or hung
# server is caught first by a 5 s /health probe (`check_reachable`); the per-request read timeout stays
# long enough for the MLflow artifact proxy to finish storing a large upload (a FLUX LoRA, or inline
# full-model weights) after its last byte.
MLFLOW_TIMEOUT_S, MLFLOW_RETRIES = 120, 2


def connect():
    """An MlflowClient with bounded waits: each request times out after MLFLOW_TIMEOUT_S and is retried
    MLFLOW_RETRIES times (unless MLFLOW_HTTP_REQUEST_* say otherwise), and an unreachable server is
    reported in one line at once instead of after minutes of retries."""
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        raise UserError("MLFLOW_TRACKING_URI is not set: point it at the MLflow server (locally: "
                        "`chunkgrpo local up` then `eval \"$(chunkgrpo local env)\"`)")
    credentials_from_uri()
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(MLFLOW_TIMEOUT_S))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(MLFLOW_RETRIES))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    check_reachable(os.environ["MLFLOW_TRACKING_URI"])
    quiet_mlflow_progress()  # a log gets no carriage-return bar per downloaded artifact
    from mlflow import MlflowClient

    return MlflowClient()


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """UserError in one line when the MLflow server at `uri` does not answer its /health endpoint."""
    if not uri.startswith(("http://", "https://")):
        return
    try:
        with urllib.request.urlopen(uri.rstrip("/") + "/health", timeout=timeout_s):
            return
    except urllib.error.HTTPError:
        return  # it answered (an auth proxy may guard /health): the real call says what is wrong
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        raise UserError(f"MLflow at {redact_uri(uri)} is unreachable ({reason}); "
                        "nothing was changed") from None


def current_identity() -> str:
    """The MLflow identity this process acts as: $MLFLOW_TRACKING_USERNAME ('' without auth)."""
    credentials_from_uri()
    return os.environ.get("MLFLOW_TRACKING_USERNAME", "")


def actor(who: str | None = None) -> str:
    """Who is recorded as acting: `who`, else $CHUNKGRPO_USER, else the OS user ('unknown' without one)."""
    if who:
        return who
    try:
        return os.environ.get("CHUNKGRPO_USER") or getpass.getuser()
    except Exception:
        return "unknown"


def now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def not_found(e: Exception) -> bool:
    return getattr(e, "error_code", "") in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND")


def get_version(client, name: str, version: str | int):
    """The model version, or a one-line UserError (no such version / MLflow error)."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version(name, str(version))
    except MlflowException as e:
        if not not_found(e):
            raise UserError(
                f"MLflow could not read {name!r} v{version}: {str(e.message).splitlines()[0]}"
            ) from None
        raise UserError(f"model {name!r} has no version {version!r} in the registry at "
                        f"{redact_uri(os.environ.get('MLFLOW_TRACKING_URI'))}") from None


def registered_model(client, name: str):
    """The registered model, or a one-line UserError (no such model / MLflow error)."""
    from mlflow.exceptions import MlflowException

    try:
        return client.get_registered_model(name)
    except MlflowException as e:
        if not not_found(e):
            raise UserError(f"MLflow could not read {name!r}: {str(e.message).splitlines()[0]}") from None
        raise UserError(f"no registered model named {name!r}") from None


def aliases(client, name: str) -> dict[str, str]:
    """alias -> version of registered model `name`."""
    return {k: str(v) for k, v in (registered_model(client, name).aliases or {}).items()}


def model_tags(client, name: str) -> dict[str, str]:
    return dict(registered_model(client, name).tags or {})


def require_promoter(client, name: str, action: str) -> str:
    """The promoter identity of `name` (tag `promoter`, written when the model was created), after
    checking that this process acts as it; UserError otherwise. On a basic-auth MLflow the server
    enforces the same (only the promoter holds more than READ on the model, see manifests/README.md);
    without auth (a local server) the tag is empty and anyone may act."""
    owner = model_tags(client, name).get(gate.PROMOTER_TAG, "")
    me = current_identity()
    if owner and me != owner:
        raise UserError(f"{action} on {name!r} is reserved to its promoter identity {owner!r} "
                        f"(this process acts as {me or 'nobody'!r})")
    return owner


def set_version_tags(client, name: str, version: str, tags) -> None:
    for k, v in tags.items():
        client.set_model_version_tag(name, version, k, gate.tag_text(v))


def eval_run(client, run_id: str, name: str | None = None):
    """The evaluation stage's own run (tag chunkgrpo.stage=evaluate, FINISHED), or UserError. When the
    registered model `name` names the experiment trusted evaluations run in (tag gate.eval_experiment_id,
    one only the evaluator identity may write to), the run must lie in it."""
    from mlflow.exceptions import MlflowException

    if not isinstance(run_id, str) or not run_id.isalnum() or len(run_id) > 64:
        raise UserError(f"evaluation run id {str(run_id)[:80]!r} is not an MLflow run id")
    try:
        run = client.get_run(run_id)
    except MlflowException as e:
        raise UserError(
            f"evaluation run {run_id!r} cannot be read: {str(e.message).splitlines()[0]}"
        ) from None
    gate.check_eval_run(run_id, (run.data.tags or {}).get("chunkgrpo.stage"), run.info.status)
    trusted = model_tags(client, name).get(gate.EVAL_EXPERIMENT_TAG) if name and has_model(client, name) \
        else ""
    if trusted and str(run.info.experiment_id) != trusted:
        raise UserError(f"evaluation run {run_id} lies in experiment {run.info.experiment_id}, not in the "
                        f"evaluator's experiment {trusted} that {name!r} trusts "
                        f"(tag {gate.EVAL_EXPERIMENT_TAG})")
    return run


def has_model(client, name: str) -> bool:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
        return True
    except MlflowException:
        return False


def eval_run_metrics(client, run_id: str, name: str | None = None) -> dict[str, float]:
    """The registry metrics of an evaluation run, from the run itself (`gate.registry_metrics`)."""
    return gate.registry_metrics(eval_run(client, run_id, name).data.metrics or {})


def trusted_metric(client, name: str, version: str, metric: str) -> float:
    """The gate value of a version, read only from the evaluation run it links (tag eval.run_id), which
    must have scored the version's weights (`gate.check_weights_bound`): never from a `metric.*` tag or a
    file the registering user wrote. The value must have been logged
    exactly once (a re-logged metric is refused) and be finite; UserError otherwise."""
    mv = get_version(client, name, version)
    run_id = (mv.tags or {}).get(gate.EVAL_RUN_TAG)
    if not run_id:
        raise UserError(f"v{version} of {name!r} links no evaluation run (tag {gate.EVAL_RUN_TAG}): it was "
                        "registered without the evaluation's metrics.json, so it has no trusted metrics")
    run = eval_run(client, run_id, name)
    gate.check_weights_bound(run_id, (run.data.tags or {}).get(RUN_WEIGHTS_TAG),
                             (mv.tags or {}).get(gate.WEIGHTS_TAG), version)
    key = gate.run_metric_key(metric, run.data.metrics or {})
    if key is None:
        raise UserError(f"evaluation run {run_id} of v{version} has no metric for {metric}")
    history = [m.value for m in client.get_metric_history(run_id, key)]
    return gate.trusted_value(run_id, version, key, history)



def version_details(client, mv) -> dict:
    """The version's details (`gate.DETAILS_ARTIFACT` in its run: every metric, the eval protocol, the
    chunk plan, checkpoint, code and config versions, the request's tags); {} when it has none. They are
    descriptive, written by the registering user: nothing the gate trusts is read from them."""
    from mlflow.exceptions import MlflowException

    if not mv.run_id:
        return {}
    try:
        root = client.get_run(mv.run_id).info.artifact_uri.rstrip("/")
    except MlflowException:
        return {}
    source = (mv.source or "").rstrip("/")
    if not source.startswith(root + "/"):
        return {}
    path = gate.details_artifact(source[len(root) + 1:])
    quiet_mlflow_progress()  # a task log gets no carriage-return bar for the download
    with tempfile.TemporaryDirectory(prefix="chunkgrpo-details-") as tmp:
        try:
            local = client.download_artifacts(mv.run_id, path, tmp)
            details = json.loads(Path(local).read_text())
        except (MlflowException, OSError, ValueError):
            return {}
    return details if isinstance(details, dict) else {}


def registered_metric(client, mv, metric: str) -> float | None:
    """The value registry metric `metric` (`eval.<bench>.<metric>[.<stat>]`) had when version `mv` was
    registered: its evaluation run's (tag eval.run_id), else its details' (a version registered without
    an evaluation run); None when neither records it or it is not finite."""
    from mlflow.exceptions import MlflowException

    run_id = (mv.tags or {}).get(gate.EVAL_RUN_TAG)
    if run_id:
        try:
            metrics = client.get_run(run_id).data.metrics or {}
        except MlflowException:
            metrics = {}
        key = gate.run_metric_key(metric, metrics)
        if key is not None:
            return gate.number(metrics[key])
    return gate.number((version_details(client, mv).get("metrics") or {}).get(metric))
