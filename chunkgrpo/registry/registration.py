"""Register trained models as MLflow model versions (`register_model`, request `Registration`).

A registered version is an MLflow Model (`python_function`, model from code, no pickles; its files:
`chunkgrpo.registry.payload`) logged to an MLflow run under `model/` and registered with
`create_model_version(source=<run artifact uri>/model)`, so that

    model = mlflow.pyfunc.load_model("models:/chunkgrpo-flux@champion")   # base FLUX + the adapter
    model.predict(pd.DataFrame({"prompt": ["a red apple"], "seed": [7]}))
    # -> a DataFrame: prompt, seed, image (PNG base64)

works in any environment with `chunkgrpo` installed, and `mlflow models serve -m models:/NAME@champion`
installs what it needs from PyPI (the version carries its code and pinned requirements; the base model is
an `s3://` or hub reference, never a path of the registering machine: `served_base_model`).
For large full checkpoints the weights can stay in S3 (`include_weights=False`): only a pointer is logged
(checksum-verified on load).

`create_version` is the privileged half of registration: on a basic-auth MLflow only the promoter
identity may create versions or move aliases (MLflow checks EDIT on the model for both), so with
$CHUNKGRPO_PROMOTER_URL set the pipeline's user logs the MLflow model in its own run and asks the
promoter service to create the version (`promoter_client.request_version`). The tags promotion relies
on are computed by `create_version` itself: the evaluation run link and the gate metric's value, the gate
at registration and the model files' digest (`model.tree_sha256`; `load.load_pyfunc` refuses a version
whose files changed in the artifact store).

A version carries a short set of tags (base model, kind, eval protocol digest, evaluation run, gate metric
value, gate at registration, weights and model digests; through the promoter service the caller it
authenticated, `registered_by`; after promotion the gate's decision, its reason, the version's status and
one JSON promotion record). Everything else (every metric with its paired
statistics, the eval protocol, the chunk plan, checkpoint, code and config versions, who registered it)
is in DETAILS_ARTIFACT of the version's run (`version_details`; read back with `client.version_details`).
"""

from __future__ import annotations

import dataclasses
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

from chunkgrpo import tracking
from chunkgrpo.errors import UserError
from chunkgrpo.registry import gate, payload
from chunkgrpo.registry.client import actor, connect, current_identity, eval_run, now
from chunkgrpo.registry.promoter_client import request_version
from chunkgrpo.registry.promotion import gate_snapshot, init_gate, protected_aliases
from chunkgrpo.store.manifest import WEIGHTS_TAG as RUN_WEIGHTS_TAG
from chunkgrpo.store.manifest import Manifest, build_manifest, weights_sha256

log = logging.getLogger(__name__)

DETAILS_ARTIFACT = gate.DETAILS_ARTIFACT  # in the version's run: every metric and field of the request


def headline_tags(metrics: Mapping[str, float], gate_metric: str | None) -> dict[str, str]:
    """The version's one `metric.*` tag: the value of the gate metric (the number the gate compares);
    every other metric and statistic is in the version's details (DETAILS_ARTIFACT) and its evaluation run."""
    if gate_metric and gate_metric in metrics:
        return {f"{gate.METRIC_TAG}{gate_metric}": repr(metrics[gate_metric])}
    return {}


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


@dataclasses.dataclass(frozen=True)
class Registration:
    """What `register_model` registers, as a new version of registered model `name` (created if missing).

    model_dir: local folder with the weights (LoRA adapter or full transformer, diffusers layout).
    checkpoint_uri: `s3://` URI of the checkpoint folder in the artifact store (tagged; and the
      weights source when include_weights is False or model_dir is None).
    include_weights: copy the weights into MLflow (default: True for LoRA, False for full models
      when a checkpoint_uri is given).
    metrics: a caller's numbers (nested keys joined with '.'); non-finite values are refused.
    eval_run_id: the evaluation stage's MLflow run (metrics.json `mlflow_run_id`): tag eval.run_id.
      Promotion trusts only that run's metrics (`client.trusted_metric`), which become the `metric.*`
      tags; `metrics` must agree with the run where both name a value, and are otherwise only logged on
      the registration run and in MODEL_INFO.
    eval_protocol: how `metrics` were measured (`gate.eval_protocol(result, preset)`): version tags
      eval.protocol (+ .sha256); promotion never compares across protocols.
    sampling: hybrid-inference settings the pyfunc generates with (default: chunkgrpo.eval.hybrid's).
    plan, git, cfg_hash, tags: chunk plan, code version (default: `git_sha()`), config hash, more tags.
    gate_metric / gate_direction: the promotion gate of a NEW registered model (tags gate.metric /
      gate.direction; default eval.hpdv2.hpsv3 with its known direction). An existing model keeps
      its gate (a different request is logged and ignored): see `promotion.set_gate`.
    challenger_alias: alias given to the new version (None: none).
    """

    name: str
    base_model: str
    model_dir: str | Path | None = None
    kind: Literal["lora", "full"] = "lora"
    checkpoint_uri: str | None = None
    include_weights: bool | None = None
    metrics: Mapping[str, Any] | None = None
    eval_run_id: str | None = None
    eval_protocol: Mapping[str, Any] | None = None
    sampling: Mapping[str, Any] | None = None
    plan: Any = None
    git: str | None = None
    cfg_hash: str | None = None
    tags: Mapping[str, Any] | None = None
    gate_metric: str | None = None
    gate_direction: str | None = None
    challenger_alias: str | None = "challenger"

    def inline_weights(self) -> bool:
        """Whether the weights are copied into MLflow, after checking the request (UserError, one line)."""
        if self.kind not in ("lora", "full"):
            raise UserError(f"kind={self.kind!r} must be 'lora' or 'full'")
        if not self.base_model:
            raise UserError("base_model is required (HF id or path of the base FLUX model)")
        if self.model_dir is None and not self.checkpoint_uri:
            raise UserError("give model_dir (local weights) or checkpoint_uri (s3:// folder), or both")
        inline = self.include_weights
        if inline is None:
            inline = self.model_dir is not None and (self.kind == "lora" or not self.checkpoint_uri)
        if inline and self.model_dir is None:
            raise UserError("include_weights needs a local model_dir")
        if self.gate_direction not in (None, "", "max", "min"):
            raise UserError(f"gate_direction={self.gate_direction!r} must be max or min")
        gate.check_name(self.name)
        return inline


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


def register_model(req: Registration, *, run_id: str | None = None, experiment: str = "chunkgrpo",
                   dedupe: bool = True, store=None) -> RegisteredVersion:
    """Register `req` as a new version of `req.name` (created if missing, with its gate).

    run_id: log into this run (e.g. the pipeline's register stage); default: a new run in
      `experiment` (nested under $CHUNKGRPO_MLFLOW_PARENT_RUN_ID if set).
    dedupe: if a version with the same weights content, kind and base model exists, return it
      (so a retried pipeline step does not create a second version).
    Everything is checked (request, metrics, evaluation run, model name) before anything is uploaded.
    """
    inline = req.inline_weights()
    flat = gate.flat_metrics(req.metrics)  # non-finite / non-numeric: refused before anything is written
    client = connect()
    if req.eval_run_id:
        run = eval_run(client, req.eval_run_id, req.name)
        run_metrics = gate.registry_metrics(run.data.metrics or {})
        gate.check_agrees(flat, run_metrics, req.eval_run_id)
        gate.check_run_finite(req.eval_run_id, run_metrics)
        if inline:  # checked again by create_version on the files it registers; here before any upload
            gate.check_weights_bound(req.eval_run_id, (run.data.tags or {}).get(RUN_WEIGHTS_TAG),
                                     weights_sha256(req.model_dir))
        flat = {**flat, **run_metrics}
    promoter_url = os.environ.get("CHUNKGRPO_PROMOTER_URL", "")
    if not promoter_url:
        # The registered model (and its gate) first: an invalid name fails here, before any upload.
        ensure_registered_model(client, req.name)
        init_gate(client, req.name, req.gate_metric or None, req.gate_direction or None)

    req = dataclasses.replace(req, base_model=served_base_model(req.base_model, store))
    manifest, manifest_sha = _manifest(req, store)
    if dedupe:
        # the digest create_version records (tag weights.sha256): the payload's files, or the pinned list
        digest = weights_sha256(req.model_dir) if inline else manifest.content_sha256
        existing = find_version(client, req.name, digest, req.kind, req.base_model)
        if existing is not None:
            log.info("model %s version %s already holds this content (%s...); reusing it", req.name,
                     existing.version, manifest.content_sha256[:12])
            return RegisteredVersion(req.name, str(existing.version), existing.source, existing.run_id,
                                     dict(existing.tags), reused=True)

    info = payload.model_info(kind=req.kind, base_model=req.base_model, inline=inline,
                              checkpoint_uri=req.checkpoint_uri, manifest_sha=manifest_sha, manifest=manifest,
                              metrics=flat, plan=req.plan, git=req.git or git_sha(), cfg_hash=req.cfg_hash,
                              created=now(), eval_protocol=req.eval_protocol, sampling=req.sampling)
    version_tags = _version_tags(req)
    details = version_details(req, info, flat)
    with tempfile.TemporaryDirectory(prefix="chunkgrpo-register-") as tmp:
        src = Path(tmp) / "src" / "model"  # becomes the MLflow model's artifacts/model
        src.parent.mkdir()
        if inline:  # hard links where it can (no second copy on disk); save_pyfunc copies them once
            shutil.copytree(req.model_dir, src, ignore=shutil.ignore_patterns("MANIFEST.json"),
                            copy_function=_link_or_copy)
        else:
            src.mkdir()
        (src / payload.MODEL_INFO).write_text(json.dumps(info, indent=1, sort_keys=True, default=str) + "\n")
        folder = Path(tmp) / "model"
        payload.save_pyfunc(folder, src)

        def log_and_create(run, artifact_path: str) -> Any:
            run.log_artifacts(folder, artifact_path)
            run.set_tags({"chunkgrpo.registered_model": req.name})
            # beside the model folder, never inside it (its files are the version's digest)
            run.log_dict(json.loads(json.dumps(details, default=str)), gate.details_artifact(artifact_path))
            if flat:
                run.log_metrics(flat)
            source = f"{run.artifact_uri}/{artifact_path}"
            gated = {"eval_run_id": req.eval_run_id, "gate_metric": req.gate_metric,
                     "gate_direction": req.gate_direction, "challenger_alias": req.challenger_alias}
            if promoter_url:  # the promoter identity creates the version (pipeline users: READ on models)
                return request_version(promoter_url, req.name, source, run.run_id, version_tags, **gated)
            return create_version(client, req.name, source, run.run_id, version_tags, **gated, local=folder)

        if run_id:  # a shared run may register several models
            mv = log_and_create(tracking.attach_run(client, run_id), f"model-{manifest.content_sha256[:12]}")
        else:
            tags = {"chunkgrpo.model": req.name}
            with tracking.stage_run("register", experiment=experiment, tags=tags) as run:
                mv = log_and_create(run, "model")
    log.info("registered %s version %s (%s, base %s) from %s", req.name, mv.version, req.kind, req.base_model,
             mv.source)
    return RegisteredVersion(req.name, str(mv.version), mv.source, mv.run_id, dict(mv.tags or version_tags))


def _link_or_copy(source: str, target: str) -> None:
    try:
        os.link(source, target)
    except OSError:  # another filesystem, or links not allowed
        shutil.copy2(source, target)


def served_base_model(ref: str, store=None) -> str:
    """The base model reference as a serving machine resolves it: an `s3://` URI or a hub id as given; a
    local folder (a path no other machine has) is put into the S3 model cache (`model_cache.sync`, kept
    when an identical copy is there) at `<root>/local/<folder name>-<content digest>`, the root being
    $CHUNKGRPO_MODEL_ROOT, else the default model root when its bucket exists, else `models/` of the
    artifact bucket."""
    path = Path(ref).expanduser()
    if ref.startswith("s3://") or not path.is_dir():
        return ref
    from chunkgrpo import model_cache
    from chunkgrpo.store.client import ArtifactStore
    from chunkgrpo.store.manifest import build_manifest

    store = store or ArtifactStore()
    root = os.environ.get(model_cache.MODEL_ROOT_ENV, "")
    if not root:
        root = model_cache.DEFAULT_MODEL_ROOT
        try:
            store.require_bucket(root)
        except UserError:
            root = store.uri("models")
    digest = build_manifest(path).content_sha256
    uri, uploaded = model_cache.sync(str(path), f"{root.rstrip('/')}/local/{path.name}-{digest[:12]}",
                                     store=store)
    log.info("base model %s %s %s (what a served version loads)", path, "put at" if uploaded else "is at",
             uri)
    return uri


def _manifest(req: Registration, store) -> tuple[Manifest, str | None]:
    """The manifest of the registered files (the local folder's, else the checkpoint's) and the
    checkpoint's manifest digest (None without a checkpoint_uri); UserError for an incomplete one."""
    manifest: Manifest | None = None
    manifest_sha = None
    if req.model_dir is not None:
        model_dir = Path(req.model_dir)
        if not model_dir.is_dir():
            raise UserError(f"model dir {model_dir} does not exist or is not a directory")
        manifest = build_manifest(model_dir)
        if not manifest.files:
            raise UserError(f"model dir {model_dir} is empty")
    if req.checkpoint_uri:
        from chunkgrpo.store.client import ArtifactStore

        store = store or ArtifactStore()
        remote = store.read_manifest(req.checkpoint_uri)
        if remote is None:
            raise UserError(
                f"checkpoint {req.checkpoint_uri} is not a complete folder artifact (no manifest); "
                "refusing to register it"
            )
        manifest_sha = remote.sha256
        if manifest is None:
            manifest = remote
        elif remote.content_sha256 != manifest.content_sha256:
            log.warning("model dir %s differs from checkpoint %s; registering the local files", req.model_dir,
                        req.checkpoint_uri)
    assert manifest is not None
    return manifest, manifest_sha


def _version_tags(req: Registration) -> dict[str, str]:
    """The version's descriptive tags, what a reader of the registry needs at a glance: the base model,
    the kind of weights and the eval protocol's digest (promotion compares only equal ones);
    create_version adds the trusted ones. Everything else is in `version_details`."""
    tags = {"kind": req.kind, "base_model": req.base_model}
    if req.eval_protocol:
        tags[gate.PROTOCOL_HASH_TAG] = gate.protocol_hash(req.eval_protocol)
    return {k: gate.tag_text(v) for k, v in tags.items()}


def version_details(req: Registration, info: dict, flat: Mapping[str, float]) -> dict[str, Any]:
    """The version's details (DETAILS_ARTIFACT in its run): every metric with its paired statistics, the
    eval protocol, the chunk plan, the checkpoint, code and config versions, who registered it and when,
    and the request's own tags."""
    plan_json = json.dumps(req.plan, sort_keys=True, default=str) if req.plan is not None else ""
    return {
        "name": req.name,
        "kind": req.kind,
        "base_model": req.base_model,
        "checkpoint_uri": req.checkpoint_uri or "",
        "content_sha256": info["content_sha256"],
        "weights": info["weights"],
        "git_sha": info["git_sha"],
        "config_hash": req.cfg_hash or "",
        "registered_by": actor(None),
        "registered_at": info["created"],
        "metrics": dict(flat),
        "eval_run_id": req.eval_run_id or "",
        "eval_protocol": req.eval_protocol,
        "eval_protocol_sha256": gate.protocol_hash(req.eval_protocol) if req.eval_protocol else "",
        "chunk_plan": req.plan,
        "chunk_plan_sha256": hashlib.sha256(plan_json.encode()).hexdigest()[:16] if plan_json else "",
        "tags": {str(k): gate.tag_text(v) for k, v in (req.tags or {}).items()},
    }


def create_version(client, name: str, source: str, run_id: str, tags: Mapping[str, str], *,
                   eval_run_id: str | None = None, gate_metric: str | None = None,
                   gate_direction: str | None = None, challenger_alias: str | None = "challenger",
                   local: str | Path | None = None, key: str | None = None):
    """The privileged half of registration (the promoter identity's, see `chunkgrpo.promoter`): create the
    registered model and its gate if new, and a version of it from `source` (an MLflow model logged in
    run `run_id`, inside that run's artifacts: `check_source`).

    The tags promotion relies on are computed here, never taken from the caller: the model files' digest
    (`model.tree_sha256`) and the weights' digest (`weights.sha256`, `store.manifest.weights_sha256`),
    both from `local` (the caller's own copy, when the caller is this process) else from the downloaded
    source (the code, MLmodel and a LoRA of up to a few hundred MB; full FLUX transformers are registered
    with external weights, so only their checksum-pinned pointer is downloaded); the evaluation run link
    and the gate metric's value (`metric.<gate metric>`), only from a run that scored these weights
    (`gate.check_weights_bound`);
    the gate in force (`gate.at_registration`). The new version may get `challenger_alias`, never an alias
    the gate moves (`gate.check_alias`).

    Idempotent: a request naming the same run and source, or the same idempotency `key`, returns the
    version it created (tag `registration.key`); a key reused for another run or source is refused."""
    import mlflow

    gate.check_name(name)
    if challenger_alias:
        gate.check_alias(challenger_alias)
    if key is not None and not (isinstance(key, str) and key.replace("-", "").replace("_", "").isalnum()
                                and len(key) <= 128):
        raise UserError(f"idempotency key {str(key)[:80]!r} must be 1-128 letters, digits, '-' or '_'")
    source = check_source(client, run_id, source)
    existing = find_request(client, name, run_id, source, key)
    if existing is not None:
        log.info("%s v%s already holds %s (run %s): returning it", name, existing.version, source, run_id)
        return existing
    ensure_registered_model(client, name)
    if challenger_alias and challenger_alias in protected_aliases(client, name):
        raise UserError(f"alias {challenger_alias!r} of {name!r} is moved only by the promotion gate; "
                        "a new version may not take it")
    init_gate(client, name, gate_metric or None, gate_direction or None)
    clean = gate.untrusted(tags)
    with tempfile.TemporaryDirectory(prefix="chunkgrpo-verify-") as tmp:
        folder = Path(local) if local is not None else Path(
            mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=tmp))
        clean[gate.TREE_TAG] = payload.tree_sha256(folder)
        clean[gate.WEIGHTS_TAG] = payload.weights_digest(folder)
    if eval_run_id:
        run = eval_run(client, eval_run_id, name)
        gate.check_weights_bound(eval_run_id, (run.data.tags or {}).get(RUN_WEIGHTS_TAG),
                                 clean[gate.WEIGHTS_TAG])
        run_metrics = gate.registry_metrics(run.data.metrics or {})
        gate.check_run_finite(eval_run_id, run_metrics)
        clean[gate.EVAL_RUN_TAG] = eval_run_id
    snapshot = gate_snapshot(client, name)
    if eval_run_id:
        clean.update(headline_tags(run_metrics, snapshot.get("metric")))
    clean[gate.GATE_SNAPSHOT_TAG] = json.dumps(snapshot, sort_keys=True)
    if key:
        clean[gate.KEY_TAG] = key
    mv = client.create_model_version(name, source=source, run_id=run_id,
                                     tags={k: gate.tag_text(v) for k, v in clean.items()})
    if challenger_alias:
        client.set_registered_model_alias(name, challenger_alias, mv.version)
    return mv


def check_source(client, run_id: str, source: str) -> str:
    """`source`, normalised, after checking it lies inside run `run_id`'s own artifacts: no '..', no
    other run, no other scheme or store; UserError (one line) otherwise."""
    from mlflow.exceptions import MlflowException

    if not isinstance(run_id, str) or not run_id.isalnum() or len(run_id) > 64:
        raise UserError(f"run_id {str(run_id)[:80]!r} is not an MLflow run id")
    if not isinstance(source, str) or not source or len(source) > 1000 or "\\" in source or "\0" in source:
        raise UserError(f"source {str(source)[:80]!r} is not an artifact URI")
    try:
        root = client.get_run(run_id).info.artifact_uri.rstrip("/")
    except MlflowException as e:
        raise UserError(f"run {run_id!r} cannot be read: {str(e.message).splitlines()[0]}") from None
    if not source.startswith(root + "/"):
        raise UserError(f"source {source[:200]!r} is not an artifact of run {run_id} ({root}/...)")
    rel = source[len(root) + 1:]
    parts = rel.split("/")
    if any(p in ("", ".", "..") for p in parts) or "%" in rel:
        raise UserError(f"source {source[:200]!r}: path {rel[:120]!r} inside run {run_id} is not a plain "
                        "relative path ('..', '.', '//' and %-escapes are refused)")
    return f"{root}/{rel}"


def find_request(client, name: str, run_id: str, source: str, key: str | None):
    """The version an earlier identical request created: same idempotency key (which must then name the
    same run and source), else the same run and source; None if none."""
    from mlflow.exceptions import MlflowException

    try:
        if key:
            by_key = [mv for mv in client.search_model_versions(f"tags.`{gate.KEY_TAG}` = '{key}'")
                      if mv.name == name]
            for mv in by_key:
                if mv.run_id != run_id or mv.source != source:
                    raise UserError(f"idempotency key {key!r} already created {name} v{mv.version} from "
                                    f"another run or source; use a new key")
                return mv
        same = [mv for mv in client.search_model_versions(f"run_id = '{run_id}'")
                if mv.name == name and mv.source == source]
    except MlflowException as e:
        raise UserError(f"MLflow could not search versions of {name!r}: "
                        f"{str(e.message).splitlines()[0]}") from None
    return min(same, key=lambda mv: int(mv.version)) if same else None


def ensure_registered_model(client, name: str) -> None:
    """Create registered model `name` (tag `promoter`: this identity) unless it exists."""
    from mlflow.exceptions import MlflowException

    try:
        client.get_registered_model(name)
    except MlflowException:
        try:
            client.create_registered_model(name, tags={"created_by": "chunkgrpo",
                                                       gate.PROMOTER_TAG: current_identity()},
                                           description="FLUX fine-tuned with chunkgrpo (see version tags)")
        except MlflowException as e:
            if "already exists" not in str(e).lower():
                raise


def find_version(client, name: str, weights: str, kind: str, base_model: str):
    """The oldest version of `name` holding the same weights (tag weights.sha256, which the registry
    computed), kind and base model; None if none."""
    from mlflow.exceptions import MlflowException

    try:
        versions = client.search_model_versions(f"name='{name}'")
    except MlflowException:
        return None
    for mv in sorted(versions, key=lambda v: int(v.version)):
        t = mv.tags or {}
        if t.get(gate.WEIGHTS_TAG) == weights and t.get("kind") == kind and t.get("base_model") == base_model:
            return mv
    return None
