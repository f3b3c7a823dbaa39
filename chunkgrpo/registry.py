"""Model registry on MLflow 3: register trained models, champion/challenger promotion, rollback.

**What a registered version is.** A plain artifact folder logged to an MLflow run under
`model/`, registered with `create_registered_model` + `create_model_version(source=<run artifact
uri>/model)` (MLflow 3's `register_model("runs:/.../model")` refuses plain folders). The folder holds

* the weights, diffusers-loadable: a LoRA adapter (`pytorch_lora_weights.safetensors`, loadable with
  `FluxPipeline.load_lora_weights(folder)`) or a full transformer (`FluxTransformer2DModel.from_pretrained`);
  for large full checkpoints the weights can stay in S3 (`include_weights=False`), and only a pointer
  is logged;
* `chunkgrpo_registration.json`: kind (lora/full), base model reference, S3 checkpoint URI, manifest digest,
  eval metrics, chunk plan, git sha, config hash.

`load_registered_model("models:/name@champion")` downloads it (and the external S3 weights, checksum
verified); `load_pipeline(...)` turns that into a diffusers `FluxPipeline`. This was chosen over a
pyfunc "model from code": no pickles, no code shipped into the registry, and any diffusers user
can load the folder directly.

**Promotion** uses aliases (stages are deprecated): `champion` moves only if the candidate beats
the current champion on the gate metric (read from `metric.<name>` version tags) by more than
`margin` in the gate direction; the old champion gets `previous`. A gate on a confidence bound of
the evaluation's paired trained − base delta (`eval.<bench>.<metric>.delta_ci_low`, see
`chunkgrpo.eval.stats`) reads `margin` as an absolute threshold on that bound instead (`gate_decision`). Every decision is written as
tags (who, why, metrics, time) on the version and appended to the registered model's
`promotion.log` tag. Promoting the current champion again is a no-op; `force=True` skips the gate
and is recorded. `rollback` moves `champion` back to `previous`.
"""

from __future__ import annotations

import dataclasses
import datetime as _dt
import getpass
import hashlib
import json
import logging
import os
import shutil
import subprocess
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from chunkgrpo.config import Config, option
from chunkgrpo.errors import UserError
from chunkgrpo.store import Manifest, build_manifest

log = logging.getLogger(__name__)

MODEL_INFO = "chunkgrpo_registration.json"  # beside the trainer's chunkgrpo_model.json, never over it
MODEL_INFO_FORMAT = "chunkgrpo.registered-model/v1"
METRIC_TAG = "metric."
_MAX_TAG = 5000
_LOG_ENTRIES = 20


# ---------------------------------------------------------------------------------------- config


@dataclasses.dataclass
class GateConfig(Config):
    """When a candidate may replace the champion."""

    metric: str = option("eval.hpdv2.hpsv3", "metric compared (mean HPSv3 on the HPDv2 test set by default)")
    direction: Literal["max", "min"] = option("max", "max: higher is better; min: lower is better")
    margin: float = option(0.0, "the candidate must beat the champion by MORE than this (absolute units); for a "
                                "CI-bound metric (*.delta_ci_low) the bound itself must exceed it (see gate_decision)")

    def __post_init__(self) -> None:
        if not self.metric.strip():
            raise UserError("gate.metric must name a metric, e.g. eval.hpdv2.hpsv3")
        if self.direction not in ("max", "min"):
            raise UserError(f"gate.direction={self.direction!r} must be 'max' or 'min'")
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


CI_BOUNDS = {".delta_ci_low": "max", ".delta_ci_high": "min"}


def gate_decision(candidate: float | None, champion: float | None, gate: GateConfig) -> GateResult:
    """Does `candidate` beat `champion` on the gate? Ties (improvement == margin) do not pass.

    No champion -> pass. A missing candidate/champion value -> UserError (cannot compare; use force).

    CI-bound gates: when the metric is the lower bound of the 95% CI of trained − base
    (`eval.hpdv2.hpsv3.delta_ci_low`, direction max; `.delta_ci_high` with direction min for lower-is-better
    metrics), `margin` is an absolute threshold on the bound: the candidate passes only if its bound exceeds
    `margin` (margin 0 = significantly better than the base model), even when there is no champion, and, if
    the champion has the bound recorded, also exceeds the champion's bound.
    """
    bound = next((suffix for suffix in CI_BOUNDS if gate.metric.endswith(suffix)), None)
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
    try:
        return float(v)
    except (TypeError, ValueError):
        return None


def _flat_metrics(metrics: Mapping[str, Any] | None) -> dict[str, float]:
    from chunkgrpo.tracking import flatten

    out = {}
    for k, v in flatten(metrics or {}).items():
        f = _float(v)
        if f is not None:
            out[k] = f
    return out


# ---------------------------------------------------------------------------------------- client


def _client():
    if not os.environ.get("MLFLOW_TRACKING_URI"):
        raise UserError("MLFLOW_TRACKING_URI is not set: point it at the MLflow server (locally: "
                        "`chunkgrpo local up` then `eval \"$(chunkgrpo local env)\"`)")
    from mlflow import MlflowClient

    return MlflowClient()


def _get_version(client, name: str, version: str | int):
    from mlflow.exceptions import MlflowException

    try:
        return client.get_model_version(name, str(version))
    except MlflowException:
        raise UserError(f"model {name!r} has no version {version!r} in the registry at "
                        f"{os.environ.get('MLFLOW_TRACKING_URI')}") from None


def _aliases(client, name: str) -> dict[str, str]:
    from mlflow.exceptions import MlflowException

    try:
        return {k: str(v) for k, v in (client.get_registered_model(name).aliases or {}).items()}
    except MlflowException:
        raise UserError(f"no registered model named {name!r}") from None


# -------------------------------------------------------------------------------------- register


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
                   dedupe: bool = True, store=None) -> RegisteredVersion:
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
    client = _client()

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
        from chunkgrpo.store import ArtifactStore

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
    flat = _flat_metrics(metrics)
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
    }
    version_tags = {
        "kind": kind, "base_model": base_model, "checkpoint_uri": checkpoint_uri or "",
        "git_sha": info["git_sha"], "config_hash": cfg_hash or "", "content_sha256": content,
        "weights": info["weights"], "registered_by": _who(None), "registered_at": info["created"],
        **({"chunk_plan": plan_json, "chunk_plan.sha256": hashlib.sha256(plan_json.encode()).hexdigest()[:16]}
           if plan is not None else {}),
        **{f"{METRIC_TAG}{k}": repr(v) for k, v in flat.items()},
        **{str(k): v for k, v in (tags or {}).items()},
    }
    version_tags = {k: _tag(v) for k, v in version_tags.items()}

    with tempfile.TemporaryDirectory(prefix="chunkgrpo-register-") as tmp:
        folder = Path(tmp) / "model"
        if include_weights:
            shutil.copytree(model_dir, folder, ignore=shutil.ignore_patterns("MANIFEST.json"))
        else:
            folder.mkdir()
        (folder / MODEL_INFO).write_text(json.dumps(info, indent=1, sort_keys=True, default=str) + "\n")

        def log_and_create(run, artifact_path: str) -> Any:
            run.log_artifacts(folder, artifact_path)
            run.set_tags({"chunkgrpo.registered_model": name})
            if flat:
                run.log_metrics(flat)
            source = f"{run.artifact_uri}/{artifact_path}"
            _ensure_registered_model(client, name)
            return client.create_model_version(name, source=source, run_id=run.run_id, tags=version_tags)

        if run_id:
            from chunkgrpo.tracking import MlflowTracker

            run = MlflowTracker(client, run_id, client.get_run(run_id).info.experiment_id)
            mv = log_and_create(run, f"model-{content[:12]}")  # a shared run may register several models
        else:
            with stage_run("register", experiment=experiment, tags={"chunkgrpo.model": name}) as run:
                mv = log_and_create(run, "model")
    if challenger_alias:
        client.set_registered_model_alias(name, challenger_alias, mv.version)
    log.info("registered %s version %s (%s, base %s) from %s", name, mv.version, kind, base_model, mv.source)
    return RegisteredVersion(name, str(mv.version), mv.source, mv.run_id, dict(mv.tags or version_tags))


def _ensure_registered_model(client, name: str) -> None:
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        try:
            client.create_registered_model(name, tags={"created_by": "chunkgrpo"},
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
    """The gate metric of a version, from its `metric.<name>` tag."""
    mv = _get_version(client, name, version)
    return _float((mv.tags or {}).get(METRIC_TAG + metric))


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


def promote(name: str, version: str | int, gate: GateConfig | None = None, *, force: bool = False,
            who: str | None = None, why: str = "", config: RegistryConfig | None = None,
            client=None) -> PromotionResult:
    """Give `version` the champion alias if it passes the gate (or `force`); old champion -> previous.

    Idempotent: promoting the current champion again changes nothing; re-running a rejected
    promotion rejects again without touching aliases.
    """
    cfg = config or RegistryConfig(model_name=name)
    gate = gate or cfg.gate
    client = client or _client()
    version = str(version)
    mv = _get_version(client, name, version)
    aliases = _aliases(client, name)
    champ = aliases.get(cfg.champion_alias)
    user, now = _who(who), _now()
    if champ == version:
        return PromotionResult("noop", name, version, aliases.get(cfg.previous_alias),
                               f"already {cfg.champion_alias}")
    cand_val = _float((mv.tags or {}).get(METRIC_TAG + gate.metric))
    champ_val = version_metric(client, name, champ, gate.metric) if champ else None
    try:
        decision = gate_decision(cand_val, champ_val, gate)
    except UserError:
        if not force:
            if champ and champ_val is None and cand_val is not None:
                raise UserError(f"cannot compare: {cfg.champion_alias} v{champ} of {name!r} has no "
                                f"{METRIC_TAG}{gate.metric} tag; use --force to promote anyway") from None
            raise
        decision = GateResult(False, f"{gate.metric} missing (candidate {cand_val}, champion {champ_val})")
    gate_desc = {"metric": gate.metric, "direction": gate.direction, "margin": gate.margin,
                 "candidate": cand_val, "champion": champ_val, "champion_version": champ}
    if not decision.passed and not force:
        _set_tags(client, name, version, {
            "promotion.status": "rejected", "promotion.reason": decision.reason, "promotion.by": user,
            "promotion.at": now, "promotion.gate": gate_desc, "promotion.why": why})
        _append_log(client, name, {"action": "rejected", "version": version, "champion": champ, "by": user,
                                   "at": now, "reason": decision.reason})
        log.info("%s v%s rejected: %s", name, version, decision.reason)
        return PromotionResult("rejected", name, version, champ, decision.reason)

    action = "promoted" if decision.passed else "forced"
    reason = decision.reason if decision.passed else f"forced by {user} (gate: {decision.reason})"
    # previous first, then champion: a crash in between leaves a state that a re-run completes.
    if champ:
        client.set_registered_model_alias(name, cfg.previous_alias, champ)
        _set_tags(client, name, champ, {"promotion.status": cfg.previous_alias, "promotion.replaced_by": version,
                                        "promotion.replaced_at": now})
    client.set_registered_model_alias(name, cfg.champion_alias, version)
    _set_tags(client, name, version, {
        "promotion.status": cfg.champion_alias, "promotion.reason": reason, "promotion.by": user,
        "promotion.at": now, "promotion.forced": str(bool(force and not decision.passed)).lower(),
        "promotion.force_requested": str(force).lower(), "promotion.gate": gate_desc,
        "promotion.previous_version": champ or "", "promotion.why": why})
    _append_log(client, name, {"action": action, "version": version, "previous": champ, "by": user, "at": now,
                               "reason": reason, "why": why})
    log.info("%s v%s -> %s (%s)", name, version, cfg.champion_alias, reason)
    return PromotionResult(action, name, version, champ, reason)


def rollback(name: str, *, who: str | None = None, why: str = "", config: RegistryConfig | None = None,
             client=None) -> PromotionResult:
    """Move champion back to the `previous` version; the rolled-back version is tagged, `previous` cleared."""
    cfg = config or RegistryConfig(model_name=name)
    client = client or _client()
    aliases = _aliases(client, name)
    prev, champ = aliases.get(cfg.previous_alias), aliases.get(cfg.champion_alias)
    if not prev:
        raise UserError(f"{name!r} has no {cfg.previous_alias!r} alias: nothing to roll back to "
                        f"(choose a version explicitly: chunkgrpo promote --model {name} --version N --force)")
    user, now = _who(who), _now()
    client.set_registered_model_alias(name, cfg.champion_alias, prev)
    client.delete_registered_model_alias(name, cfg.previous_alias)
    reason = f"rollback from v{champ} by {user}" + (f": {why}" if why else "")
    if champ:
        _set_tags(client, name, champ, {"promotion.status": "rolled_back", "promotion.rolled_back_by": user,
                                        "promotion.rolled_back_at": now, "promotion.rollback_why": why})
    _set_tags(client, name, prev, {"promotion.status": cfg.champion_alias, "promotion.reason": reason,
                                   "promotion.by": user, "promotion.at": now})
    _append_log(client, name, {"action": "rollback", "version": prev, "from": champ, "by": user, "at": now,
                               "why": why})
    log.info("%s: %s v%s -> v%s", name, cfg.champion_alias, champ, prev)
    return PromotionResult("rolled_back", name, prev, champ, reason)


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


def load_registered_model(model_uri: str, dst: str | Path | None = None, store=None) -> LoadedModel:
    """Download `models:/name@alias` (or `models:/name/version`) and its external weights, verified."""
    import mlflow

    _client()  # clear error without a tracking URI
    dst = Path(dst or tempfile.mkdtemp(prefix="chunkgrpo-model-"))
    dst.mkdir(parents=True, exist_ok=True)
    path = Path(mlflow.artifacts.download_artifacts(artifact_uri=model_uri, dst_path=str(dst)))
    info_file = path / MODEL_INFO
    if not info_file.exists():
        raise UserError(f"{model_uri} was not registered by chunkgrpo (no {MODEL_INFO})")
    info = json.loads(info_file.read_text())
    weights = path
    if info.get("weights") == "external":
        from chunkgrpo.store import ArtifactStore

        store = store or ArtifactStore()
        weights = path / "weights"
        manifest = store.get_folder(info["checkpoint_uri"], weights)
        if info.get("manifest_sha256") and manifest.sha256 != info["manifest_sha256"]:
            raise UserError(f"{info['checkpoint_uri']} changed since {model_uri} was registered "
                            f"(manifest {manifest.sha256[:12]} != {info['manifest_sha256'][:12]})")
    else:
        for rel, entry in info.get("files", {}).items():
            if hashlib.sha256((path / rel).read_bytes()).hexdigest() != entry["sha256"]:
                raise UserError(f"{model_uri}: {rel} does not match its recorded sha256")
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
