"""Model registry on MLflow 3: register trained models, champion/challenger promotion, rollback.

**What a registered version is.** An MLflow Model (an `MLmodel` with the `python_function`
flavour, "model from code": `chunkgrpo/serving.py`, no pickles) logged to an MLflow run under
`model/` and registered with `create_model_version(source=<run artifact uri>/model)`, so that

    model = mlflow.pyfunc.load_model("models:/chunkgrpo-flux@champion")   # base FLUX + the adapter
    model.predict(pd.DataFrame({"prompt": ["a red apple"], "seed": [7]}))  # -> prompt, seed, image (PNG base64)

works in any environment with `chunkgrpo` installed (the pyfunc's pip requirement). Its artifact
`artifacts/model/` is the payload, still a diffusers-loadable folder:

* the weights: a LoRA adapter (`pytorch_lora_weights.safetensors`, `FluxPipeline.load_lora_weights`)
  or a full transformer; for large full checkpoints the weights can stay in S3
  (`include_weights=False`) and only a pointer is logged (checksum-verified on load);
* `chunkgrpo_registration.json`: kind (lora/full), base model reference, S3 checkpoint URI, manifest
  digest, eval metrics and the **eval protocol** they were measured with, chunk plan, git sha,
  config hash, and the hybrid-inference sampling settings the pyfunc generates with.

`load_registered_model(...)` downloads a version (verified) and `load_pipeline(...)` builds a
diffusers `FluxPipeline` from it.

**Promotion** uses aliases (stages are deprecated): `champion` moves only if the candidate beats
the current champion on the gate metric by more than `margin`. The values come only from each
version's **evaluation run** (tag `eval.run_id`, written at registration from metrics.json's
`mlflow_run_id`; `trusted_metric`): never from a `metric.*` tag or a file a registering user wrote.
**The direction (and the metric) belong to the registered model**, not to the caller:
tags `gate.metric` / `gate.direction` are written when the model is first registered (or by an
explicit, logged `set_gate`), otherwise the direction of a known metric is used; a caller that
asks for another direction or metric is refused, so no flag can crown a worse model. The one
metric a caller may pick besides the model's is the confidence bound of that same metric's paired
trained − base delta (`<gate metric>.delta_ci_low` for higher-is-better, `.delta_ci_high` for
lower-is-better, see `chunkgrpo.eval.stats`): a stricter gate in the same direction, where `margin`
is an absolute threshold on the bound (`gate_decision`). Metrics measured under different **eval
protocols** (preset, benchmarks, prompt counts, seeds, sampling, scorers: tag
`eval.protocol.sha256`) are never compared. The old champion gets `previous`. Every decision is
written as tags (who, why, metrics, time) on the version and appended to the registered model's
`promotion.log` tag. Promoting the current champion again is a no-op; `force=True` skips the gate
and is recorded. `rollback` moves `champion` back to `previous`.

**Integrity.** A version is judged by the gate recorded at its registration (`gate.at_registration`);
`set_gate`, `force` and `rollback` are the promoter identity's (tag `promoter` of the registered
model, = the MLflow user that created it) and need a reason. Promotions hold `promotion_lock` (an
atomically created registered model) and re-read `champion` after moving it. `create_version` is the
privileged half of registration: on a basic-auth MLflow only the promoter identity may create
versions or move aliases (MLflow checks EDIT on the model for both), so pipeline users go through
`chunkgrpo.promoter`. Each version records `model.tree_sha256` (every file of the MLflow model, code
included); `load_pyfunc` refuses a version whose files changed in the artifact store.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import getpass
import hashlib
import json
import logging
import math
import os
import time
import uuid
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from chunkgrpo.config import Config, option
from chunkgrpo.errors import UserError
from chunkgrpo.store.manifest import Manifest, build_manifest

log = logging.getLogger(__name__)

MODEL_INFO = "chunkgrpo_registration.json"  # beside the trainer's chunkgrpo_model.json, never over it
MODEL_INFO_FORMAT = "chunkgrpo.registered-model/v1"
PAYLOAD = "artifacts/model"                 # where the pyfunc MLmodel keeps the weights + MODEL_INFO
METRIC_TAG = "metric."
GATE_METRIC_TAG, GATE_DIRECTION_TAG = "gate.metric", "gate.direction"     # registered-model tags
GATE_MARGIN_TAG = "gate.margin"
PROTOCOL_TAG, PROTOCOL_HASH_TAG = "eval.protocol", "eval.protocol.sha256"  # version tags
# Direction of metrics whose meaning is fixed (last dotted component, after stripping the
# .trained/.base/.delta/CI suffixes); anything else needs a gate.direction tag on the model.
KNOWN_DIRECTIONS = {name: "max" for name in (
    "hpsv3", "hpsv2", "hpsv2.1", "imagereward", "pickscore", "clip", "geneval", "overall", "wise", "wiscore",
    "brightness", "contrast", "color", "reward_mean")}
_MAX_TAG = 5000
_LOG_ENTRIES = 20
EVAL_RUN_TAG = "eval.run_id"               # version tag: the evaluation stage's run (the trusted metrics)
GATE_SNAPSHOT_TAG = "gate.at_registration"  # version tag: the model's gate when the version was created
TREE_TAG = "model.tree_sha256"             # version tag: digest of every file of the MLflow model (code too)
PROMOTER_TAG = "promoter"                  # registered-model tag: the identity that owns promotion
LOCK_SUFFIX = ".promotion-lock"            # registered model created/deleted as the promotion mutex
MAX_NAME_LEN = 200                         # MLflow's name column is 256 wide; the lock adds 15
# Registry calls: MLflow's defaults retry 7 times with backoff (~250 s on a dead server). A dead or hung
# server is caught first by a 5 s /health probe (`check_reachable`); the per-request read timeout stays
# long enough for the MLflow artifact proxy to finish storing a large upload (a FLUX LoRA, or inline
# full-model weights) after its last byte.
MLFLOW_TIMEOUT_S, MLFLOW_RETRIES = 120, 2


# ---------------------------------------------------------------------------------------- config


@dataclasses.dataclass
class GateConfig(Config):
    """When a candidate may replace the champion."""

    metric: str = option("", "metric compared; '' = the registered model's gate.metric tag (default "
                             "eval.hpdv2.hpsv3, mean HPSv3 on the HPDv2 test set), or that metric's CI bound "
                             "(<metric>.delta_ci_low, see gate_decision)")
    direction: str = option("", "'' = the registered model's (gate.direction tag, else the known direction of "
                                "the metric); 'max'/'min' only to assert it: a different one is refused")
    margin: float = option(0.0, "the candidate must beat the champion by MORE than this (absolute units); for a "
                                "CI-bound metric (*.delta_ci_low) the bound itself must exceed it (see gate_decision)")

    def __post_init__(self) -> None:
        if self.direction not in ("", "max", "min"):
            raise UserError(f"gate.direction={self.direction!r} must be 'max' or 'min' (or empty)")
        if self.margin < 0:
            raise UserError(f"gate.margin={self.margin} must be >= 0 (it is an improvement threshold)")


@dataclasses.dataclass
class RegistryConfig(Config):
    """Registered model name, aliases and promotion gate."""

    model_name: str = option("chunkgrpo-flux", "registered model name")
    experiment: str = option("chunkgrpo", "MLflow experiment for the registration run")
    champion_alias: str = option("champion", "alias of the serving model")
    previous_alias: str = option("previous", "alias of the champion before the last promotion (rollback target)")
    challenger_alias: str = option("challenger", "alias given to each newly registered version")
    gate: GateConfig = option(factory=GateConfig, help="promotion gate")

    def __post_init__(self) -> None:
        aliases = [self.champion_alias, self.previous_alias, self.challenger_alias]
        if len(set(aliases)) != 3 or not all(aliases):
            raise UserError(f"registry aliases must be three distinct non-empty names, got {aliases}")
        if not self.model_name.strip():
            raise UserError("registry.model_name must not be empty")


# ------------------------------------------------------------------------------------- pure logic


@dataclasses.dataclass
class GateResult:
    passed: bool
    reason: str
    improvement: float | None = None
    values: dict = dataclasses.field(default_factory=dict)  # the trusted candidate/champion values compared


DEFAULT_GATE_METRIC = "eval.hpdv2.hpsv3"


def known_direction(metric: str) -> str | None:
    """'max'/'min' for a metric whose meaning fixes its direction (e.g. ...hpsv3.trained), else None."""
    parts = metric.split(".")
    while parts and parts[-1] in ("trained", "base", "delta", "mean", "delta_ci_low", "delta_ci_high", "ci_low",
                                  "ci_high"):
        parts = parts[:-1]
    for n in (2, 1):
        key = ".".join(parts[-n:]) if len(parts) >= n else None
        if key in KNOWN_DIRECTIONS:
            return KNOWN_DIRECTIONS[key]
    return None


CI_BOUNDS = {".delta_ci_low": "max", ".delta_ci_high": "min"}


def gate_decision(candidate: float | None, champion: float | None, gate: GateConfig) -> GateResult:
    """Does `candidate` beat `champion` on the gate? Ties (improvement == margin) do not pass.

    `gate` is normally resolved from the registered model (`resolve_gate`); an empty direction here
    means the metric's known one (a CI bound: the direction in `CI_BOUNDS`). No champion -> pass. A
    missing candidate/champion value -> UserError (cannot compare; use force).

    CI-bound gates: when the metric is the lower bound of the 95% CI of trained − base
    (`eval.hpdv2.hpsv3.delta_ci_low`, direction max; `.delta_ci_high` with direction min for lower-is-better
    metrics), `margin` is an absolute threshold on the bound: the candidate passes only if its bound exceeds
    `margin` (margin 0 = significantly better than the base model), even when there is no champion, and, if
    the champion has the bound recorded, also exceeds the champion's bound.
    """
    if not gate.metric:
        raise UserError("gate_decision needs a resolved gate: a metric (resolve_gate gives the registered model's)")
    bound = next((suffix for suffix in CI_BOUNDS if gate.metric.endswith(suffix)), None)
    if gate.direction not in ("max", "min"):
        direction = CI_BOUNDS[bound] if bound else known_direction(gate.metric)
        if direction is None:
            raise UserError(f"the direction of {gate.metric!r} is unknown: record it on the registered model "
                            "(set_gate / promote --set-gate METRIC:max|min)")
        gate = dataclasses.replace(gate, direction=direction)
    if bound is not None:
        return _ci_gate(candidate, champion, gate, bound)
    if champion is None:
        return GateResult(True, "no current champion")
    if candidate is None:
        raise UserError(f"candidate has no value for {gate.metric!r}; register it with its metrics or use --force")
    improvement = candidate - champion if gate.direction == "max" else champion - candidate
    better = "higher" if gate.direction == "max" else "lower"
    verdict = (f"{gate.metric}: candidate {candidate:.6g} vs champion {champion:.6g} "
               f"({better} is better, improvement {improvement:+.6g}, margin {gate.margin:g})")
    return GateResult(improvement > gate.margin, verdict, improvement)


def _ci_gate(candidate: float | None, champion: float | None, gate: GateConfig, bound: str) -> GateResult:
    if gate.direction != CI_BOUNDS[bound]:
        raise UserError(f"gate.metric={gate.metric!r} is a CI {'lower' if bound.endswith('low') else 'upper'} bound: "
                        f"use direction={CI_BOUNDS[bound]} (got {gate.direction})")
    if candidate is None:
        raise UserError(f"candidate has no value for {gate.metric!r}; register it with its metrics or use --force")
    sign = 1.0 if gate.direction == "max" else -1.0
    # the bound must clear the margin (vs the base model) and the champion's bound
    threshold = sign * gate.margin if champion is None else (
        max(gate.margin, champion) if sign > 0 else min(-gate.margin, champion))
    improvement = sign * (candidate - threshold)
    vs = f"margin {sign * gate.margin:+g}" + ("" if champion is None else f" and champion's bound {champion:+.6g}")
    verdict = (f"{gate.metric}: candidate's CI bound of trained − base {candidate:+.6g} must be "
               f"{'above' if sign > 0 else 'below'} {vs}")
    return GateResult(improvement > 0, verdict, improvement)


def config_hash(cfg: Mapping[str, Any] | Config) -> str:
    """Short stable digest of a config (canonical JSON, secrets excluded by Config.to_dict)."""
    d = cfg.to_dict() if isinstance(cfg, Config) else dict(cfg)
    return hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()[:16]


def git_sha(cwd: str | Path | None = None) -> str:
    """HEAD commit (with -dirty), $CHUNKGRPO_GIT_SHA (set in images), or 'unknown'."""
    if os.environ.get("CHUNKGRPO_GIT_SHA"):
        return os.environ["CHUNKGRPO_GIT_SHA"]
    try:
        cwd = cwd or Path(__file__).resolve().parent
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True,
                             timeout=5, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=cwd,
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return sha + ("-dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


def _who(who: str | None) -> str:
    if who:
        return who
    try:
        return os.environ.get("CHUNKGRPO_USER") or getpass.getuser()
    except Exception:  # noqa: BLE001 - no passwd entry in some containers
        return "unknown"


def _tag(v: Any) -> str:
    s = v if isinstance(v, str) else json.dumps(v, sort_keys=True, default=str)
    return s if len(s) <= _MAX_TAG else s[: _MAX_TAG - 3] + "..."


def _float(v: Any) -> float | None:
    """A finite float, or None (missing, non-numeric, NaN or ±inf never enter a comparison)."""
    try:
        f = float(v)
    except (TypeError, ValueError):
        return None
    return f if math.isfinite(f) else None


def _finite(v: float) -> bool:
    """Finite and not MLflow's stand-in for ±inf (its SQL store saves inf as ±sys.float_info.max)."""
    return math.isfinite(v) and abs(v) < sys.float_info.max


def _flat_metrics(metrics: Mapping[str, Any] | None, what: str = "metrics") -> dict[str, float]:
    """Flattened metrics; a non-numeric, NaN or infinite value is a UserError naming it (never dropped)."""
    from chunkgrpo.tracking import flatten

    if metrics is not None and not isinstance(metrics, Mapping):
        raise UserError(f"{what} must be a JSON object of metric name -> number, "
                        f"got {type(metrics).__name__}")
    out = {}
    for k, v in flatten(metrics or {}).items():
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(float(v)):
            raise UserError(f"{what}: {k} = {v!r} is not a finite number")
        out[k] = float(v)
    return out


def eval_protocol(result: Mapping[str, Any], preset: str = "") -> dict:
    """What an evaluation's numbers depend on besides the model: preset, benchmarks with their prompt
    counts, seeds, sampling (steps, trained steps, resolution, guidance, schedule), scorers, GenEval
    samples, WISE variant and judge. Two versions are compared only if this is identical."""
    cfg = dict(result.get("config") or {})
    benches = {b: {k: v for k, v in (e or {}).items() if k in ("n_prompts", "samples_per_prompt", "variant",
                                                                "official_prompts", "prompts_file", "metadata_file")}
               for b, e in sorted((result.get("benchmarks") or {}).items())}
    judge = (cfg.get("wise_judge") or {}).get("model") if "wise" in benches else None
    return {
        "preset": preset or cfg.get("preset", ""),
        "benchmarks": benches,
        "seed": result.get("seed", cfg.get("seed")),
        "sampling": dict(result.get("sampling") or {}),
        "scorers": sorted(cfg.get("scorers") or []) if "hpdv2" in benches else [],
        **({"geneval_samples": cfg.get("geneval_samples")} if "geneval" in benches else {}),
        **({"wise_variant": cfg.get("wise_variant"), "wise_judge": judge} if "wise" in benches else {}),
    }


def metrics_from_eval(result: Mapping[str, Any], preset: str = "") -> tuple[dict, dict, dict]:
    """(metrics, protocol, sampling) to register from an evaluation's metrics.json: every
    `<bench>.<metric>.trained` as `eval.<bench>.<metric>` (the `.base`/`.delta` and other values
    keep their full name under `eval.`), the eval protocol, and the hybrid sampling settings."""
    flat = dict(result.get("metrics") or {})
    metrics = {"eval": {(k[: -len(".trained")] if k.endswith(".trained") else k): v for k, v in flat.items()}}
    return metrics, eval_protocol(result, preset), dict(result.get("sampling") or {})


def protocol_hash(protocol: Mapping[str, Any]) -> str:
    return hashlib.sha256(json.dumps(protocol, sort_keys=True, default=str).encode()).hexdigest()[:16]


# ---------------------------------------------------------------------------------------- client


def _client():
    """An MlflowClient with bounded waits: each request times out after MLFLOW_TIMEOUT_S and is retried
    MLFLOW_RETRIES times (unless MLFLOW_HTTP_REQUEST_* say otherwise), and an unreachable server is
    reported in one line at once instead of after minutes of retries."""
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        raise UserError("MLFLOW_TRACKING_URI is not set: point it at the MLflow server (locally: "
                        "`chunkgrpo local up` then `eval \"$(chunkgrpo local env)\"`)")
    from chunkgrpo.tracking import credentials_from_uri

    credentials_from_uri()
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", str(MLFLOW_TIMEOUT_S))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", str(MLFLOW_RETRIES))
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR", "1")
    check_reachable(os.environ["MLFLOW_TRACKING_URI"])
    from mlflow import MlflowClient

    return MlflowClient()


def check_reachable(uri: str, timeout_s: float = 5.0) -> None:
    """UserError in one line when the MLflow server at `uri` does not answer its /health endpoint."""
    import urllib.error
    import urllib.request

    from chunkgrpo.tracking import redact_uri

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


def _not_found(e: Exception) -> bool:
    return getattr(e, "error_code", "") in ("RESOURCE_DOES_NOT_EXIST", "NOT_FOUND")


def _get_version(client, name: str, version: str | int):
    from mlflow.exceptions import MlflowException

    from chunkgrpo.tracking import redact_uri

    try:
        return client.get_model_version(name, str(version))
    except MlflowException as e:
        if not _not_found(e):
            raise UserError(f"MLflow could not read {name!r} v{version}: {str(e.message).splitlines()[0]}") from None
        raise UserError(f"model {name!r} has no version {version!r} in the registry at "
                        f"{redact_uri(os.environ.get('MLFLOW_TRACKING_URI'))}") from None


def _aliases(client, name: str) -> dict[str, str]:
    from mlflow.exceptions import MlflowException

    try:
        return {k: str(v) for k, v in (client.get_registered_model(name).aliases or {}).items()}
    except MlflowException as e:
        if not _not_found(e):
            raise UserError(f"MLflow could not read {name!r}: {str(e.message).splitlines()[0]}") from None
        raise UserError(f"no registered model named {name!r}") from None


def model_gate(client, name: str) -> tuple[str | None, str | None]:
    """(gate.metric, gate.direction) recorded on the registered model (None where absent)."""
    from mlflow.exceptions import MlflowException

    try:
        tags = client.get_registered_model(name).tags or {}
    except MlflowException as e:
        if not _not_found(e):
            raise UserError(f"MLflow could not read {name!r}: {str(e.message).splitlines()[0]}") from None
        raise UserError(f"no registered model named {name!r}") from None
    return tags.get(GATE_METRIC_TAG) or None, tags.get(GATE_DIRECTION_TAG) or None


def resolve_gate(client, name: str, gate: GateConfig | None = None) -> GateConfig:
    """The gate as the registered model defines it. The caller may name the metric/direction only to
    assert them: a metric other than the model's gate metric, or a direction other than the one
    recorded (or known) for the metric, is a UserError, whatever the caller wanted."""
    gate = gate or GateConfig()
    tag_metric, tag_direction = model_gate(client, name)
    metric = gate.metric or tag_metric or DEFAULT_GATE_METRIC
    if tag_metric and metric != tag_metric:
        # the one other choice: the CI bound of the model's own metric, in its own direction (stricter)
        bound = tag_metric + next((s for s, d in CI_BOUNDS.items() if d == tag_direction), "")
        if metric != bound or bound == tag_metric:
            raise UserError(f"{name!r} is gated on {tag_metric} (tag {GATE_METRIC_TAG}, set at registration); "
                            f"comparing on {metric} is refused (allowed: {tag_metric} or its CI bound "
                            f"{bound}; change it with `chunkgrpo promote --model {name} --set-gate`)")
        return GateConfig(metric=metric, direction=_asserted(gate, tag_direction, metric, name), margin=gate.margin)
    direction = tag_direction if (tag_direction and metric == (tag_metric or metric)) else known_direction(metric)
    if direction is None:
        raise UserError(f"the direction of {metric!r} is unknown: record it on {name!r} once with "
                        f"`chunkgrpo promote --model {name} --set-gate {metric}:max` (or :min)")
    return GateConfig(metric=metric, direction=_asserted(gate, direction, metric, name), margin=gate.margin)


def _asserted(gate: GateConfig, direction: str, metric: str, name: str) -> str:
    if gate.direction and gate.direction != direction:
        raise UserError(f"{metric} of {name!r} is {'higher' if direction == 'max' else 'lower'}-is-better "
                        f"({direction}, from the registered model); a gate with direction {gate.direction!r} is "
                        "refused")
    return direction


def metric_direction(client, name: str, metric: str, asserted: str = "") -> str:
    """Direction ('max'/'min') of `metric` (a registry metric name, e.g. eval.hpdv2.hpsv3 or its CI
    bound) for registered model `name`: the model's gate.direction when the metric (CI suffix
    stripped) is its gate metric, else the metric's known direction. `asserted` is only checked
    against that (a different one is a UserError); it decides only where nothing records one."""
    tag_metric, tag_direction = model_gate(client, name)
    base = next((metric[: -len(s)] for s in CI_BOUNDS if metric.endswith(s)), metric)
    direction = tag_direction if (tag_metric and tag_direction and base == tag_metric) else known_direction(metric)
    if direction is None:
        if asserted in ("max", "min"):
            return asserted
        raise UserError(f"the direction of {metric!r} is unknown for {name!r}: record it once with "
                        f"`chunkgrpo promote --model {name} --set-gate {base}:max` (or :min)")
    return _asserted(GateConfig(direction=asserted), direction, metric, name)


def current_identity() -> str:
    """The MLflow identity this process acts as: $MLFLOW_TRACKING_USERNAME ('' without auth)."""
    from chunkgrpo.tracking import credentials_from_uri

    credentials_from_uri()
    return os.environ.get("MLFLOW_TRACKING_USERNAME", "")


def require_promoter(client, name: str, action: str) -> str:
    """The promoter identity of `name` (tag `promoter`, written when the model was created), after
    checking that this process acts as it; UserError otherwise. On a basic-auth MLflow the server
    enforces the same (only the promoter holds more than READ on the model, see manifests/README.md);
    without auth (a local server) the tag is empty and anyone may act."""
    from mlflow.exceptions import MlflowException

    try:
        owner = (client.get_registered_model(name).tags or {}).get(PROMOTER_TAG, "")
    except MlflowException as e:
        if _not_found(e):
            raise UserError(f"no registered model named {name!r}") from None
        raise UserError(f"MLflow could not read {name!r}: {str(e.message).splitlines()[0]}") from None
    me = current_identity()
    if owner and me != owner:
        raise UserError(f"{action} on {name!r} is reserved to its promoter identity {owner!r} "
                        f"(this process acts as {me or 'nobody'!r})")
    return owner


def set_gate(name: str, metric: str, direction: str, *, margin: float = 0.0, who: str | None = None,
             why: str = "", client=None, _registration: bool = False) -> None:
    """Record (or change) the gate metric, direction and margin of a registered model: an explicit,
    audited action of the promoter identity with a reason (`why`), never a side effect of promoting.
    It is not retroactive: a version keeps the gate recorded when it was registered (tag
    `gate.at_registration`) for its comparison with the champion."""
    client = client or _client()
    if direction not in ("max", "min") or not metric.strip():
        raise UserError(f"set_gate needs a metric and direction max|min, got {metric!r}:{direction!r}")
    if not math.isfinite(margin) or margin < 0:
        raise UserError(f"gate margin {margin!r} must be a finite number >= 0")
    if not why.strip():
        raise UserError("changing the gate changes how every future promotion is judged: "
                        "give a reason (--why)")
    known = known_direction(metric)
    if known and known != direction:
        raise UserError(f"{metric} is {'higher' if known == 'max' else 'lower'}-is-better by definition; "
                        f"direction {direction!r} is refused")
    if not _registration:
        require_promoter(client, name, "changing the gate")
    old = model_gate(client, name)
    client.set_registered_model_tag(name, GATE_METRIC_TAG, metric)
    client.set_registered_model_tag(name, GATE_DIRECTION_TAG, direction)
    client.set_registered_model_tag(name, GATE_MARGIN_TAG, repr(float(margin)))
    _append_log(client, name, {"action": "set_gate", "metric": metric, "direction": direction, "margin": margin,
                               "was": list(old), "by": _who(who), "identity": current_identity(), "at": _now(),
                               "why": why})


def gate_snapshot(client, name: str) -> dict:
    """The model's gate now (recorded on each new version as `gate.at_registration`)."""
    metric, direction = model_gate(client, name)
    margin = _float((client.get_registered_model(name).tags or {}).get(GATE_MARGIN_TAG)) or 0.0
    return {"metric": metric, "direction": direction, "margin": margin}


def version_gate(client, name: str, mv) -> GateConfig:
    """The gate a version is judged by: the one recorded when it was registered (a later set_gate
    does not apply to it), else the model's current gate."""
    try:
        snap = json.loads((mv.tags or {}).get(GATE_SNAPSHOT_TAG) or "null")
    except json.JSONDecodeError:
        snap = None
    if isinstance(snap, dict) and snap.get("metric") and snap.get("direction") in ("max", "min"):
        return GateConfig(metric=snap["metric"], direction=snap["direction"],
                          margin=float(snap.get("margin") or 0))
    return resolve_gate(client, name)


def _init_gate(client, name: str, metric: str | None, direction: str | None) -> None:
    """At registration: record the gate on a model that has none; a different request is only logged."""
    tag_metric, tag_direction = model_gate(client, name)
    if tag_metric:
        if (metric and metric != tag_metric) or (direction and direction != tag_direction):
            log.warning("%s is gated on %s (%s) since its first registration; the requested %s (%s) is ignored",
                        name, tag_metric, tag_direction, metric, direction)
        return
    metric = metric or DEFAULT_GATE_METRIC
    direction = direction or known_direction(metric)
    if direction is None:
        raise UserError(f"gate metric {metric!r} has no known direction: pass gate_direction=max|min")
    set_gate(name, metric, direction, who="registration", why="first registration", client=client,
             _registration=True)


# -------------------------------------------------------------------------------------- register


def check_name(name: str) -> None:
    """A registered model name MLflow stores faithfully (and leaves room for the promotion lock)."""
    if not isinstance(name, str) or not name.strip() or name != name.strip() or any(c in name for c in "/:\0"):
        raise UserError(f"{name!r} is not a valid registered model name (non-empty, no '/', ':' or NUL, "
                        "no leading/trailing spaces)")
    if len(name) > MAX_NAME_LEN:
        raise UserError(f"registered model name {name[:40]!r}... is {len(name)} characters; at most {MAX_NAME_LEN}")
    if name.endswith(LOCK_SUFFIX):
        raise UserError(f"registered model name {name!r} ends with {LOCK_SUFFIX!r}, reserved for promotion locks")


@dataclasses.dataclass
class RegisteredVersion:
    name: str
    version: str
    source: str
    run_id: str | None
    tags: dict[str, str]
    reused: bool = False

    @property
    def uri(self) -> str:
        return f"models:/{self.name}/{self.version}"


def register_model(name: str, model_dir: str | Path | None = None, *, kind: Literal["lora", "full"] = "lora",
                   base_model: str, checkpoint_uri: str | None = None, metrics: Mapping[str, Any] | None = None,
                   plan: Any = None, git: str | None = None, cfg_hash: str | None = None,
                   include_weights: bool | None = None, run_id: str | None = None, experiment: str = "chunkgrpo",
                   tags: Mapping[str, Any] | None = None, challenger_alias: str | None = "challenger",
                   dedupe: bool = True, store=None, gate_metric: str | None = None,
                   gate_direction: str | None = None, eval_protocol: Mapping[str, Any] | None = None,
                   sampling: Mapping[str, Any] | None = None, eval_run_id: str | None = None) -> RegisteredVersion:
    """Register a trained model as a new version of `name` (created if missing).

    model_dir: local folder with the weights (LoRA adapter or full transformer, diffusers layout).
    checkpoint_uri: `s3://` URI of the checkpoint folder in the artifact store (tagged; and the
      weights source when include_weights is False or model_dir is None).
    include_weights: copy the weights into MLflow (default: True for LoRA, False for full models
      when a checkpoint_uri is given).
    run_id: log into this run (e.g. the pipeline's register stage); default: a new run in
      `experiment` (nested under $CHUNKGRPO_MLFLOW_PARENT_RUN_ID if set).
    dedupe: if a version with the same weights content, kind and base model exists, return it
      (so a retried pipeline step does not create a second version).
    gate_metric / gate_direction: the promotion gate of a NEW registered model (tags gate.metric /
      gate.direction; default eval.hpdv2.hpsv3 with its known direction). An existing model keeps
      its gate (a different request is logged and ignored): see `set_gate`.
    eval_protocol: how `metrics` were measured (`eval_protocol(result, preset)`): version tags
      eval.protocol (+ .sha256); promotion never compares across protocols.
    sampling: hybrid-inference settings the pyfunc generates with (default: chunkgrpo.eval.hybrid's).
    eval_run_id: the evaluation stage's MLflow run (metrics.json `mlflow_run_id`): tag eval.run_id.
      Promotion trusts only that run's metrics (`trusted_metric`), which become the `metric.*` tags;
      `metrics` (a caller's numbers) must agree with the run where both name a value, and are otherwise
      only logged on the registration run and in MODEL_INFO. Non-finite values are refused.
    """
    from chunkgrpo.tracking import stage_run

    if kind not in ("lora", "full"):
        raise UserError(f"kind={kind!r} must be 'lora' or 'full'")
    if not base_model:
        raise UserError("base_model is required (HF id or path of the base FLUX model)")
    if model_dir is None and not checkpoint_uri:
        raise UserError("give model_dir (local weights) or checkpoint_uri (s3:// folder), or both")
    if include_weights is None:
        include_weights = model_dir is not None and (kind == "lora" or not checkpoint_uri)
    if include_weights and model_dir is None:
        raise UserError("include_weights needs a local model_dir")
    if gate_direction not in (None, "", "max", "min"):
        raise UserError(f"gate_direction={gate_direction!r} must be max or min")
    check_name(name)
    flat = _flat_metrics(metrics)  # non-finite / non-numeric: refused before anything is written
    client = _client()
    if eval_run_id:
        run_metrics = eval_run_metrics(client, eval_run_id)
        for k, v in flat.items():
            if k in run_metrics and not math.isclose(v, run_metrics[k], rel_tol=1e-9, abs_tol=1e-12):
                raise UserError(f"metrics: {k} = {v!r} differs from evaluation run {eval_run_id}'s {run_metrics[k]!r}")
        bad = sorted(k for k, v in run_metrics.items() if not _finite(v))
        if bad:
            raise UserError(f"evaluation run {eval_run_id} logged non-finite values ({', '.join(bad[:3])}): "
                            "not registered")
        flat = {**flat, **run_metrics}
    promoter_url = os.environ.get("CHUNKGRPO_PROMOTER_URL", "")
    if not promoter_url:
        # The registered model (and its gate) first: an invalid name fails here, before any upload.
        _ensure_registered_model(client, name)
        _init_gate(client, name, gate_metric or None, gate_direction or None)

    manifest: Manifest | None = None
    manifest_sha = None
    if model_dir is not None:
        model_dir = Path(model_dir)
        if not model_dir.is_dir():
            raise UserError(f"model dir {model_dir} does not exist or is not a directory")
        manifest = build_manifest(model_dir)
        if not manifest.files:
            raise UserError(f"model dir {model_dir} is empty")
    if checkpoint_uri:
        from chunkgrpo.store.client import ArtifactStore

        store = store or ArtifactStore()
        remote = store.read_manifest(checkpoint_uri)
        if remote is None:
            raise UserError(f"checkpoint {checkpoint_uri} is not a complete folder artifact (no manifest); "
                            "refusing to register it")
        manifest_sha = remote.sha256
        if manifest is None:
            manifest = remote
        elif remote.content_sha256 != manifest.content_sha256:
            log.warning("model dir %s differs from checkpoint %s; registering the local files", model_dir,
                        checkpoint_uri)
    assert manifest is not None
    content = manifest.content_sha256
    plan_json = json.dumps(plan, sort_keys=True, default=str) if plan is not None else ""

    if dedupe:
        existing = _find_version(client, name, content, kind, base_model)
        if existing is not None:
            log.info("model %s version %s already holds this content (%s...); reusing it", name,
                     existing.version, content[:12])
            return RegisteredVersion(name, str(existing.version), existing.source, existing.run_id,
                                     dict(existing.tags), reused=True)

    info = {
        "format": MODEL_INFO_FORMAT, "kind": kind, "base_model": base_model,
        "weights": "inline" if include_weights else "external",
        "checkpoint_uri": checkpoint_uri or "", "manifest_sha256": manifest_sha or "",
        "content_sha256": content, "files": manifest.files, "metrics": flat, "plan": plan,
        "git_sha": git or git_sha(), "config_hash": cfg_hash or "", "created": _now(),
        "eval_protocol": dict(eval_protocol) if eval_protocol else None,
        "sampling": dict(sampling) if sampling else None,
    }
    version_tags = {
        "kind": kind, "base_model": base_model, "checkpoint_uri": checkpoint_uri or "",
        "git_sha": info["git_sha"], "config_hash": cfg_hash or "", "content_sha256": content,
        "weights": info["weights"], "registered_by": _who(None), "registered_at": info["created"],
        **({"chunk_plan": plan_json, "chunk_plan.sha256": hashlib.sha256(plan_json.encode()).hexdigest()[:16]}
           if plan is not None else {}),
        **{f"{METRIC_TAG}{k}": repr(v) for k, v in flat.items()},
        **({PROTOCOL_TAG: json.dumps(eval_protocol, sort_keys=True, default=str),
            PROTOCOL_HASH_TAG: protocol_hash(eval_protocol)} if eval_protocol else {}),
        **{str(k): v for k, v in (tags or {}).items()},
    }
    version_tags = {k: _tag(v) for k, v in version_tags.items()}

    with tempfile.TemporaryDirectory(prefix="chunkgrpo-register-") as tmp:
        payload = Path(tmp) / "src" / "model"  # becomes the MLflow model's artifacts/model
        payload.parent.mkdir()
        if include_weights:
            shutil.copytree(model_dir, payload, ignore=shutil.ignore_patterns("MANIFEST.json"))
        else:
            payload.mkdir()
        (payload / MODEL_INFO).write_text(json.dumps(info, indent=1, sort_keys=True, default=str) + "\n")
        folder = Path(tmp) / "model"
        _save_pyfunc(folder, payload)

        def log_and_create(run, artifact_path: str) -> Any:
            run.log_artifacts(folder, artifact_path)
            run.set_tags({"chunkgrpo.registered_model": name})
            if flat:
                run.log_metrics(flat)
            source = f"{run.artifact_uri}/{artifact_path}"
            if promoter_url:  # the promoter identity creates the version (pipeline users: READ on models)
                from chunkgrpo.promoter import request_version

                return request_version(promoter_url, name, source, run.run_id, version_tags, eval_run_id=eval_run_id,
                                       gate_metric=gate_metric, gate_direction=gate_direction,
                                       challenger_alias=challenger_alias)
            return create_version(client, name, source, run.run_id, version_tags, eval_run_id=eval_run_id,
                                  gate_metric=gate_metric, gate_direction=gate_direction,
                                  challenger_alias=challenger_alias, tree=tree_sha256(folder))

        if run_id:
            from chunkgrpo.tracking import MlflowTracker

            run = MlflowTracker(client, run_id, client.get_run(run_id).info.experiment_id)
            mv = log_and_create(run, f"model-{content[:12]}")  # a shared run may register several models
        else:
            with stage_run("register", experiment=experiment, tags={"chunkgrpo.model": name}) as run:
                mv = log_and_create(run, "model")
    log.info("registered %s version %s (%s, base %s) from %s", name, mv.version, kind, base_model, mv.source)
    return RegisteredVersion(name, str(mv.version), mv.source, mv.run_id, dict(mv.tags or version_tags))


TRUSTED_TAGS = (EVAL_RUN_TAG, GATE_SNAPSHOT_TAG, TREE_TAG, METRIC_TAG, "promotion.", "gate.")


def create_version(client, name: str, source: str, run_id: str, tags: Mapping[str, str], *,
                   eval_run_id: str | None = None, gate_metric: str | None = None, gate_direction: str | None = None,
                   challenger_alias: str | None = "challenger", tree: str | None = None):
    """The privileged half of registration (the promoter identity's, see `chunkgrpo.promoter`): create the
    registered model and its gate if new, and a version of it from `source` (an MLflow model logged in
    run `run_id`). The tags promotion relies on are computed here, never taken from the caller: the
    evaluation run link and its metrics (`metric.*`), the gate in force (`gate.at_registration`) and the
    model files' digest (`model.tree_sha256`, from `tree` when the caller is this process, else from the
    downloaded source: the code, MLmodel and a LoRA of up to a few hundred MB; full FLUX transformers
    are registered with external weights, so only their checksum-pinned pointer is downloaded)."""
    import mlflow

    check_name(name)
    _ensure_registered_model(client, name)
    _init_gate(client, name, gate_metric or None, gate_direction or None)
    clean = {k: v for k, v in tags.items() if not k.startswith(TRUSTED_TAGS)}
    if eval_run_id:
        run_metrics = eval_run_metrics(client, eval_run_id)
        bad = sorted(k for k, v in run_metrics.items() if not _finite(v))
        if bad:
            raise UserError(f"evaluation run {eval_run_id} logged non-finite values ({', '.join(bad[:3])}): "
                            "not registered")
        clean.update({f"{METRIC_TAG}{k}": repr(v) for k, v in run_metrics.items()})
        clean[EVAL_RUN_TAG] = eval_run_id
    clean[GATE_SNAPSHOT_TAG] = json.dumps(gate_snapshot(client, name), sort_keys=True)
    if tree is None:
        with tempfile.TemporaryDirectory(prefix="chunkgrpo-verify-") as tmp:
            tree = tree_sha256(mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=tmp))
    clean[TREE_TAG] = tree
    mv = client.create_model_version(name, source=source, run_id=run_id,
                                     tags={k: _tag(v) for k, v in clean.items()})
    if challenger_alias:
        client.set_registered_model_alias(name, challenger_alias, mv.version)
    return mv


def _save_pyfunc(folder: Path, payload: Path) -> None:
    """An MLflow Model directory (python_function flavour, model from code) whose artifact `model`
    is `payload` (weights + MODEL_INFO): mlflow.pyfunc.load_model works on the registered version."""
    import warnings

    import mlflow

    from chunkgrpo import __version__, serving

    assert payload.name == Path(PAYLOAD).name, payload  # MLflow names the artifact dir after the source dir
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*input example.*")  # an example would load the model
        mlflow.pyfunc.save_model(
            path=str(folder), python_model=serving.model_code_path(), artifacts={"model": str(payload)},
            pip_requirements=[f"chunkgrpo[core,store]=={__version__}"], signature=serving.signature())


def _ensure_registered_model(client, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        try:
            client.create_registered_model(name, tags={"created_by": "chunkgrpo", PROMOTER_TAG: current_identity()},
                                           description="FLUX fine-tuned with chunkgrpo (see version tags)")
        except MlflowException as e:
            if "already exists" not in str(e).lower():
                raise


def _find_version(client, name: str, content: str, kind: str, base_model: str):
    from mlflow.exceptions import MlflowException

    try:
        versions = client.search_model_versions(f"name='{name}'")
    except MlflowException:
        return None
    for mv in sorted(versions, key=lambda v: int(v.version)):
        t = mv.tags or {}
        if t.get("content_sha256") == content and t.get("kind") == kind and t.get("base_model") == base_model:
            return mv
    return None


# ------------------------------------------------------------------------------------- promotion


def _eval_run(client, run_id: str):
    """The evaluation stage's own run (tag chunkgrpo.stage=evaluate, FINISHED), or UserError."""
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException as e:
        raise UserError(f"evaluation run {run_id!r} cannot be read: {str(e.message).splitlines()[0]}") from None
    stage = (run.data.tags or {}).get("chunkgrpo.stage")
    if stage != "evaluate":
        raise UserError(f"run {run_id} is not an evaluation run "
                        f"(tag chunkgrpo.stage={stage!r}, expected 'evaluate')")
    if run.info.status != "FINISHED":
        raise UserError(f"evaluation run {run_id} is {run.info.status}, not FINISHED: its metrics are not final")
    return run


def eval_run_metrics(client, run_id: str) -> dict[str, float]:
    """The registry metrics of an evaluation run, from the run itself (`<bench>.<m>.trained` ->
    `eval.<bench>.<m>`, everything else `eval.<key>`), as `metrics_from_eval` maps a metrics.json."""
    run = _eval_run(client, run_id)
    out = {}
    for k, v in (run.data.metrics or {}).items():
        out["eval." + (k[: -len(".trained")] if k.endswith(".trained") else k)] = v
    return out


def _run_metric_key(metric: str, keys) -> str | None:
    stem = metric[len("eval."):] if metric.startswith("eval.") else metric
    return next((k for k in (stem + ".trained", stem) if k in keys), None)


def trusted_metric(client, name: str, version: str, metric: str) -> float:
    """The gate value of a version, read only from the evaluation run it links (tag eval.run_id):
    never from a `metric.*` tag or a file the registering user wrote. The value must have been logged
    exactly once (a re-logged metric is refused) and be finite; UserError otherwise."""
    mv = _get_version(client, name, version)
    run_id = (mv.tags or {}).get(EVAL_RUN_TAG)
    if not run_id:
        raise UserError(f"v{version} of {name!r} links no evaluation run (tag {EVAL_RUN_TAG}): it was registered "
                        "without the evaluation's metrics.json, so it has no trusted metrics")
    run = _eval_run(client, run_id)
    key = _run_metric_key(metric, run.data.metrics or {})
    if key is None:
        raise UserError(f"evaluation run {run_id} of v{version} has no metric for {metric}")
    history = client.get_metric_history(run_id, key)
    if len(history) != 1:
        raise UserError(f"evaluation run {run_id} of v{version} logged {key} {len(history)} times: "
                        "an evaluation logs each result once, so it was altered; re-evaluate")
    value = history[0].value
    if not _finite(value):
        raise UserError(f"evaluation run {run_id} of v{version}: {key} = {value} is not finite")
    return value


def _protocol_of(client, name: str, version: str) -> str | None:
    return (_get_version(client, name, version).tags or {}).get(PROTOCOL_HASH_TAG)


@contextlib.contextmanager
def promotion_lock(client, name: str, timeout_s: float = 120.0, stale_s: float = 600.0) -> Iterator[None]:
    """Mutual exclusion of promoters of `name`, whatever machine they run on: the lock is the
    registered model `<name>.promotion-lock`, whose creation MLflow performs atomically (a second
    create fails with RESOURCE_ALREADY_EXISTS). A lock older than `stale_s` (a promoter killed while
    holding it) is broken; waiting longer than `timeout_s` is a UserError."""
    from mlflow.exceptions import MlflowException

    lock, token = name + LOCK_SUFFIX, uuid.uuid4().hex
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            client.create_registered_model(lock, tags={"lock.token": token, "lock.at": repr(time.time()),
                                                       "lock.by": _who(None), "chunkgrpo.lock_for": name},
                                           description=f"promotion lock of {name} (transient)")
            break
        except MlflowException as e:
            if getattr(e, "error_code", "") != "RESOURCE_ALREADY_EXISTS":
                raise UserError(f"cannot take the promotion lock of {name!r}: "
                                f"{str(e.message).splitlines()[0]}") from None
        try:
            held_at = _float((client.get_registered_model(lock).tags or {}).get("lock.at")) or time.time()
        except MlflowException:
            continue  # released in between: try again at once
        if time.time() - held_at > stale_s:
            log.warning("breaking the stale promotion lock of %s (held %.0f s)", name, time.time() - held_at)
            with contextlib.suppress(MlflowException):
                client.delete_registered_model(lock)
            continue
        if time.monotonic() > deadline:
            raise UserError(f"another promotion of {name!r} holds {lock!r} for more than {timeout_s:.0f} s; "
                            "nothing was changed")
        time.sleep(0.1 + 0.2 * (uuid.uuid4().int % 100) / 100)
    try:
        yield
    finally:
        with contextlib.suppress(MlflowException):
            if (client.get_registered_model(lock).tags or {}).get("lock.token") == token:
                client.delete_registered_model(lock)


@dataclasses.dataclass
class PromotionResult:
    action: Literal["promoted", "forced", "rejected", "noop", "rolled_back"]
    name: str
    version: str
    previous: str | None
    reason: str

    def line(self) -> str:
        prev = f" (previous: v{self.previous})" if self.previous else ""
        return f"{self.name} v{self.version}: {self.action}{prev} — {self.reason}"


def version_metric(client, name: str, version: str, metric: str) -> float | None:
    """The trusted gate metric of a version (its evaluation run's, `trusted_metric`); None if none."""
    try:
        return trusted_metric(client, name, version, metric)
    except UserError:
        return None


def _append_log(client, name: str, entry: dict) -> None:
    rm = client.get_registered_model(name)
    try:
        history = json.loads((rm.tags or {}).get("promotion.log", "[]"))
    except json.JSONDecodeError:
        history = []
    history = (history + [entry])[-_LOG_ENTRIES:]
    text = json.dumps(history, sort_keys=True)
    while len(text) > _MAX_TAG and len(history) > 1:
        history = history[1:]
        text = json.dumps(history, sort_keys=True)
    client.set_registered_model_tag(name, "promotion.log", text)


def _set_tags(client, name: str, version: str, tags: Mapping[str, Any]) -> None:
    for k, v in tags.items():
        client.set_model_version_tag(name, version, k, _tag(v))


def _same_protocol(client, name: str, candidate: str, champion: str) -> None:
    """UserError unless both versions' metrics were measured under the same eval protocol."""
    a = (_get_version(client, name, candidate).tags or {}).get(PROTOCOL_HASH_TAG)
    b = (_get_version(client, name, champion).tags or {}).get(PROTOCOL_HASH_TAG)
    if not a or not b:
        raise UserError(f"cannot compare v{candidate} with v{champion} of {name!r}: "
                        f"{'v' + candidate if not a else 'v' + champion} records no eval protocol "
                        f"({PROTOCOL_HASH_TAG}); re-evaluate it, or promote with --force")
    if a != b:
        raise UserError(f"v{candidate} and v{champion} of {name!r} were evaluated under different protocols "
                        f"({a} vs {b}: preset, prompts, seeds or sampling differ, see tag {PROTOCOL_TAG}); "
                        "re-evaluate both the same way, or promote with --force")


def effective_gate(client, name: str, mv, requested: GateConfig | None = None) -> GateConfig:
    """The gate `mv` is judged by: the one recorded at its registration (`version_gate`). A caller may
    only make it stricter: assert the same metric (or name that metric's CI bound, in its direction)
    and raise the margin; anything else is a UserError."""
    base = version_gate(client, name, mv)
    req = requested or GateConfig()
    metric, direction = base.metric, base.direction
    if req.metric and req.metric != base.metric:
        bound = base.metric + next((s for s, d in CI_BOUNDS.items() if d == base.direction), "")
        if req.metric != bound:
            raise UserError(f"v{mv.version} of {name!r} is gated on {base.metric} (recorded at its registration); "
                            f"comparing on {req.metric} is refused (allowed: {base.metric} or its CI bound {bound}; "
                            "the promoter changes the gate of future versions with `promote --set-gate`)")
        metric = bound
    direction = _asserted(req, direction, metric, name)
    return GateConfig(metric=metric, direction=direction, margin=max(base.margin, req.margin))


def _decide(client, name: str, version: str, champion: str | None, gate: GateConfig) -> GateResult:
    """The gate decision on trusted values (kept in `.values`); UserError when it cannot be made."""
    candidate = trusted_metric(client, name, version, gate.metric)
    reference = None
    if champion:
        reference = trusted_metric(client, name, champion, gate.metric)
        _same_protocol(client, name, version, champion)
    result = gate_decision(candidate, reference, gate)
    result.values = {"candidate": candidate, "champion": reference}
    return result


def gate_check(name: str, version: str | int, gate: GateConfig | None = None, *, client=None,
               champion_alias: str = "champion") -> GateResult:
    """Read-only: would `promote` move the champion to `version`? Never raises for a comparison that
    cannot be made (no evaluation run, other protocol, version already champion): `passed` is False
    and `reason` says why. The gate is the one recorded at the version's registration."""
    client = client or _client()
    version = str(version)
    mv = _get_version(client, name, version)
    gate = effective_gate(client, name, mv, gate)
    champion = _aliases(client, name).get(champion_alias)
    if champion == version:
        return GateResult(False, f"v{version} already is the {champion_alias}")
    try:
        return _decide(client, name, version, champion, gate)
    except UserError as e:
        return GateResult(False, str(e))


def promote(name: str, version: str | int, gate: GateConfig | None = None, *, force: bool = False,
            who: str | None = None, why: str = "", config: RegistryConfig | None = None,
            client=None) -> PromotionResult:
    """Give `version` the champion alias if it passes the gate (or `force`); old champion -> previous.

    The decision and the alias moves happen under `promotion_lock`, against the champion read inside
    it, and the champion is re-read after it is set (compare-and-set): concurrent promoters end with
    the best version as champion. Gate values are the versions' evaluation runs' (`trusted_metric`).
    `force` is reserved to the promoter identity, needs a reason, and is recorded (who, why, previous
    champion) on the version and in the model's `promotion.log`.
    Idempotent: promoting the current champion again changes nothing; re-running a rejected
    promotion rejects again without touching aliases.
    """
    cfg = config or RegistryConfig(model_name=name)
    client = client or _client()
    version = str(version)
    if force:
        if not why.strip():
            raise UserError("--force crowns a version without the gate: give the reason with --why")
        require_promoter(client, name, "--force")
    mv = _get_version(client, name, version)
    requested = gate if gate is not None else cfg.gate
    with promotion_lock(client, name):
        aliases = _aliases(client, name)
        champ = aliases.get(cfg.champion_alias)
        user, now = _who(who), _now()
        if champ == version:
            return PromotionResult("noop", name, version, aliases.get(cfg.previous_alias),
                                   f"already {cfg.champion_alias}")
        try:
            eff = effective_gate(client, name, mv, requested)
            decision = _decide(client, name, version, champ, eff)
        except UserError as e:
            if not force:
                raise
            eff = GateConfig(metric=requested.metric or "", margin=requested.margin)
            decision = GateResult(False, f"not comparable ({e})")
        gate_desc = {"metric": eff.metric, "direction": eff.direction, "margin": eff.margin,
                     "champion_version": champ, **decision.values}
        if not decision.passed and not force:
            _set_tags(client, name, version, {
                "promotion.status": "rejected", "promotion.reason": decision.reason, "promotion.by": user,
                "promotion.at": now, "promotion.gate": gate_desc, "promotion.why": why})
            _append_log(client, name, {"action": "rejected", "version": version, "champion": champ, "by": user,
                                       "at": now, "reason": decision.reason})
            log.info("%s v%s rejected: %s", name, version, decision.reason)
            return PromotionResult("rejected", name, version, champ, decision.reason)

        action = "promoted" if decision.passed else "forced"
        identity = current_identity()
        reason = decision.reason if decision.passed else (
            f"forced by {user}{f' ({identity})' if identity else ''}: {why} (gate: {decision.reason})")
        # previous first, then champion: a crash in between leaves a state that a re-run completes.
        if champ:
            client.set_registered_model_alias(name, cfg.previous_alias, champ)
            _set_tags(client, name, champ, {"promotion.status": cfg.previous_alias,
                                            "promotion.replaced_by": version, "promotion.replaced_at": now})
        client.set_registered_model_alias(name, cfg.champion_alias, version)
        after = _aliases(client, name).get(cfg.champion_alias)  # compare-and-set: re-read what was set
        if after != version:
            raise UserError(f"{name!r}: {cfg.champion_alias} is v{after} right after setting it to v{version} "
                            "(moved by something outside the promotion lock); re-run promote")
        _set_tags(client, name, version, {
            "promotion.status": cfg.champion_alias, "promotion.reason": reason, "promotion.by": user,
            "promotion.identity": identity, "promotion.at": now,
            "promotion.forced": str(action == "forced").lower(),
            "promotion.force_requested": str(force).lower(), "promotion.gate": gate_desc,
            "promotion.previous_version": champ or "", "promotion.why": why})
        _append_log(client, name, {"action": action, "version": version, "previous": champ, "by": user,
                                   "identity": identity, "at": now, "reason": reason, "why": why})
    log.info("%s v%s -> %s (%s)", name, version, cfg.champion_alias, reason)
    return PromotionResult(action, name, version, champ, reason)


def rollback(name: str, *, who: str | None = None, why: str = "", config: RegistryConfig | None = None,
             client=None) -> PromotionResult:
    """Move champion back to the `previous` version (promoter identity only, with a reason); the
    rolled-back version is tagged, `previous` cleared, and the log records who, why and from what."""
    cfg = config or RegistryConfig(model_name=name)
    client = client or _client()
    if not why.strip():
        raise UserError("--rollback replaces the champion without the gate: give the reason with --why")
    require_promoter(client, name, "--rollback")
    with promotion_lock(client, name):
        aliases = _aliases(client, name)
        prev, champ = aliases.get(cfg.previous_alias), aliases.get(cfg.champion_alias)
        if not prev:
            raise UserError(f"{name!r} has no {cfg.previous_alias!r} alias: nothing to roll back to "
                            f"(choose a version explicitly: chunkgrpo promote --model {name} --version N --force)")
        user, now, identity = _who(who), _now(), current_identity()
        client.set_registered_model_alias(name, cfg.champion_alias, prev)
        client.delete_registered_model_alias(name, cfg.previous_alias)
        reason = f"rollback from v{champ} by {user}{f' ({identity})' if identity else ''}: {why}"
        if champ:
            _set_tags(client, name, champ, {"promotion.status": "rolled_back", "promotion.rolled_back_by": user,
                                            "promotion.rolled_back_at": now, "promotion.rollback_why": why})
        _set_tags(client, name, prev, {"promotion.status": cfg.champion_alias, "promotion.reason": reason,
                                       "promotion.by": user, "promotion.identity": identity, "promotion.at": now,
                                       "promotion.previous_version": champ or ""})
        _append_log(client, name, {"action": "rollback", "version": prev, "previous": champ, "by": user,
                                   "identity": identity, "at": now, "why": why})
    log.info("%s: %s v%s -> v%s", name, cfg.champion_alias, champ, prev)
    return PromotionResult("rolled_back", name, prev, champ, reason)


def promotion_history(name: str, *, client=None) -> list[dict]:
    """The registered model's audit log (`promotion.log` tag): gate changes, promotions, forced
    promotions and rollbacks with who, identity, why, previous champion and time (newest last)."""
    client = client or _client()
    from mlflow.exceptions import MlflowException

    try:
        text = (client.get_registered_model(name).tags or {}).get("promotion.log", "[]")
    except MlflowException as e:
        raise UserError(f"no registered model named {name!r}" if _not_found(e)
                        else f"MLflow could not read {name!r}: {str(e.message).splitlines()[0]}") from None
    try:
        return list(json.loads(text))
    except (json.JSONDecodeError, TypeError):
        return []


# ------------------------------------------------------------------------------------------ load


@dataclasses.dataclass
class LoadedModel:
    path: Path          # downloaded registry folder
    weights_dir: Path   # diffusers-loadable weights (== path for inline weights)
    info: dict          # chunkgrpo_registration.json

    @property
    def kind(self) -> str:
        return self.info["kind"]

    @property
    def base_model(self) -> str:
        return self.info["base_model"]


def weights_from_payload(payload: Path, info: dict, store=None) -> Path:
    """The diffusers-loadable weights of a registered payload: the folder itself (inline) or the S3
    checkpoint folder it points to, downloaded and checked against the recorded manifest digest."""
    if info.get("weights") != "external":
        for rel, entry in info.get("files", {}).items():
            if hashlib.sha256((payload / rel).read_bytes()).hexdigest() != entry["sha256"]:
                raise UserError(f"{payload}: {rel} does not match its recorded sha256")
        return payload
    from chunkgrpo.store.client import ArtifactStore

    store = store or ArtifactStore()
    weights = payload / "weights"
    manifest = store.get_folder(info["checkpoint_uri"], weights)
    if info.get("manifest_sha256") and manifest.sha256 != info["manifest_sha256"]:
        raise UserError(f"{info['checkpoint_uri']} changed since it was registered "
                        f"(manifest {manifest.sha256[:12]} != {info['manifest_sha256'][:12]})")
    return weights


def tree_sha256(folder: str | Path) -> str:
    """Digest of a folder: every file's relative path and sha256 (code, MLmodel, weights, env files)."""
    root = Path(folder)
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        h.update(f.relative_to(root).as_posix().encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).hexdigest().encode() + b"\n")
    return h.hexdigest()


def _resolve_version(client, model_uri: str):
    """The model version a `models:/name/version` or `models:/name@alias` URI names."""
    from urllib.parse import unquote

    if not model_uri.startswith("models:/"):
        raise UserError(f"{model_uri!r} is not a models:/NAME/VERSION or models:/NAME@ALIAS URI")
    ref = unquote(model_uri[len("models:/"):]).rstrip("/")
    if "@" in ref:
        name, alias = ref.rsplit("@", 1)
        version = _aliases(client, name).get(alias)
        if not version:
            raise UserError(f"{name!r} has no alias {alias!r}")
    else:
        name, _, version = ref.rpartition("/")
    return _get_version(client, name, version)


def load_pyfunc(model_uri: str, dst: str | Path | None = None):
    """`mlflow.pyfunc.load_model(model_uri)`, after checking that the downloaded MLflow model (its
    code `serving_model.py`, `MLmodel`, environment files and weights) is byte for byte what was
    registered (version tag model.tree_sha256, written at registration). A file replaced in the
    artifact store is refused in one line before any of it runs. Plain `mlflow.pyfunc.load_model`
    executes whatever code the artifact store holds: serve and evaluate the champion with this."""
    import mlflow

    client = _client()
    mv = _resolve_version(client, model_uri)
    expected = (mv.tags or {}).get(TREE_TAG)
    if not expected:
        raise UserError(f"{mv.name} v{mv.version} records no {TREE_TAG} (registered before code pinning): "
                        "re-register it to load it verified")
    dst = Path(dst or tempfile.mkdtemp(prefix="chunkgrpo-pyfunc-"))
    local = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{mv.name}/{mv.version}",
                                                     dst_path=str(dst)))
    actual = tree_sha256(local)
    if actual != expected:
        raise UserError(f"{mv.name} v{mv.version}: the model's files in the artifact store changed since "
                        f"registration ({TREE_TAG} {actual[:12]} != {expected[:12]}); refusing to load it")
    return mlflow.pyfunc.load_model(str(local))


def load_registered_model(model_uri: str, dst: str | Path | None = None, store=None) -> LoadedModel:
    """Download `models:/name@alias` (or `models:/name/version`) and its external weights, verified."""
    import mlflow

    _client()  # clear error without a tracking URI
    dst = Path(dst or tempfile.mkdtemp(prefix="chunkgrpo-model-"))
    dst.mkdir(parents=True, exist_ok=True)
    path = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(dst)))
    if (path / "MLmodel").exists() and (path / PAYLOAD / MODEL_INFO).exists():
        path = path / PAYLOAD  # pyfunc layout: the weights + registration are the model's artifact
    info_file = path / MODEL_INFO
    if not info_file.exists():
        raise UserError(f"{model_uri} was not registered by chunkgrpo (no {MODEL_INFO})")
    info = json.loads(info_file.read_text())
    weights = weights_from_payload(path, info, store)
    return LoadedModel(path, weights, info)


def load_pipeline(model_uri: str, dtype=None, device: str | None = None, base_model: str | None = None):
    """A diffusers FluxPipeline with the registered weights (LoRA loaded, or transformer replaced)."""
    import torch
    from diffusers import FluxPipeline, FluxTransformer2DModel

    dtype = dtype or torch.float32
    with tempfile.TemporaryDirectory(prefix="chunkgrpo-model-") as tmp:  # weights end up in memory
        m = load_registered_model(model_uri, tmp)
        pipe = FluxPipeline.from_pretrained(base_model or m.base_model, dtype=dtype)
        if m.kind == "lora":
            pipe.load_lora_weights(str(m.weights_dir))
        else:
            sub = m.weights_dir / "transformer"
            pipe.transformer = FluxTransformer2DModel.from_pretrained(
                str(sub if sub.is_dir() else m.weights_dir), dtype=dtype)
    return pipe.to(device) if device else pipe
