"""Registration: a trained model (LoRA adapter or full transformer) becomes an MLflow model version
(alias `challenger`) with its evaluation metrics, the protocol they were measured with, and its chunk
plan; `register_trained` for the pipeline's model pointer, `register_folder` for the CLI."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from chunkgrpo.config import option


def check_model_name(name: str) -> None:
    """MLflow's registered-model name rules, checked before anything is uploaded."""
    from chunkgrpo.errors import UserError
    from chunkgrpo.registry.gate import check_name

    try:
        check_name(name)
    except UserError as e:
        raise UserError(f"--name: {e}") from None
    try:
        from mlflow.exceptions import MlflowException
        from mlflow.utils.validation import _validate_model_name
    except ImportError:  # private helper moved: the rules above still apply
        return
    try:
        _validate_model_name(name)
    except MlflowException as e:
        raise UserError(f"--name {name!r}: {e.message}") from None


# Largest LoRA adapter copied into MLflow (the version is then self-contained); a larger folder, and every
# full transformer, is registered by reference to its verified S3 checkpoint, so the register pod (a
# small CPU pod with no volume) never holds the weights: its disk use does not grow with the model.
INLINE_MAX_BYTES = 1 << 30


def register_trained(*, model_name: str, experiment: str, run_id: str, pointer: str | dict, evaluation: dict,
                     plan: dict | None, gate_metric: str = "", gate_direction: str = "",
                     eval_preset: str = "", inline_max_bytes: int = INLINE_MAX_BYTES) -> dict:
    """Register the model a pointer names, after checking its S3 manifest against the pointer's digest;
    the evaluation stage's run (`evaluation["mlflow_run_id"]`) becomes tag eval.run_id, the only source
    promotion trusts. A LoRA adapter of at most `inline_max_bytes` is copied into the version; anything
    else (a full fine-tune: 47.6 GB for FLUX.1-dev in fp32) is registered by reference: the version holds
    the checkpoint's URI and manifest digest, and loading it (`registry.load`, the served pyfunc) downloads
    the weights and checks them against that digest. Returns name, version, uri, source, run_id, reused,
    checkpoint_uri, weights ('inline' | 'external')."""
    import tempfile

    from chunkgrpo.registry.gate import metrics_from_eval
    from chunkgrpo.registry.registration import Registration, register_model
    from chunkgrpo.store.client import ArtifactStore
    from chunkgrpo.store.manifest import read_pointer

    pointer = read_pointer(pointer)
    metrics, protocol, sampling = metrics_from_eval(evaluation, eval_preset)
    store = ArtifactStore()
    remote = store.read_manifest(pointer["uri"])
    if remote is None:
        raise RuntimeError(f"{pointer['uri']} holds no complete model (no manifest)")
    if remote.sha256 != pointer["manifest_sha256"]:
        raise RuntimeError(f"{pointer['uri']} changed after training (manifest digest mismatch)")
    inline = pointer["kind"] == "lora" and remote.total_bytes <= inline_max_bytes
    with tempfile.TemporaryDirectory(prefix="chunkgrpo-register-") as tmp:
        if inline:  # a small adapter: copied into the version
            if store.get_folder(pointer["uri"], tmp).sha256 != pointer["manifest_sha256"]:
                raise RuntimeError(f"{pointer['uri']} changed after training (manifest digest mismatch)")
        req = Registration(model_name, pointer["base_model"], tmp if inline else None, kind=pointer["kind"],
                           checkpoint_uri=pointer["uri"], include_weights=inline, metrics=metrics, plan=plan,
                           cfg_hash=pointer.get("config_hash", ""),
                           tags={"kfp.run_id": run_id, "method": pointer.get("method", "")},
                           gate_metric=gate_metric or None, gate_direction=gate_direction or None,
                           eval_protocol=protocol, sampling=sampling,
                           eval_run_id=evaluation.get("mlflow_run_id") or None)  # the gate's only source
        rv = register_model(req, experiment=experiment, store=store)
    reused = " (existing version, same weights)" if rv.reused else ""
    how = "copied" if inline else f"by reference, {remote.total_bytes / 1e9:.1f} GB left in S3"
    print(f"registered {rv.uri}{reused} from {pointer['uri']} ({how})")
    return {"name": rv.name, "version": rv.version, "uri": rv.uri, "source": rv.source,
            "run_id": rv.run_id or "", "reused": rv.reused, "checkpoint_uri": pointer["uri"],
            "weights": "inline" if inline else "external"}


@dataclass(frozen=True)
class FolderRegistration:
    """A folder (or s3:// checkpoint folder) to register, as `chunkgrpo register` takes it."""

    model_dir: str = option(help="folder with the weights, or an s3:// checkpoint folder")
    name: str = option(help="registered model name")
    base_model: str = option(help="base model reference (hub id or path)")
    kind: str = option("lora", "lora | full")
    metrics: str | None = option(None, "JSON file of evaluation metrics (an evaluation's metrics.json)")
    plan: str | None = option(None, "JSON file with the chunk plan")
    checkpoint_uri: str | None = option(None, "s3:// URI of the checkpoint folder")
    config_hash: str = option("", "hash of the training config")
    git_sha: str | None = option(None, "code version (default: git HEAD or $CHUNKGRPO_GIT_SHA)")
    external_weights: bool = option(False, "keep the weights at checkpoint_uri instead of copying them")
    experiment: str = option("chunkgrpo", "MLflow experiment of the registration run")
    gate_metric: str | None = option(None, "gate metric of a new registered model")
    gate_direction: str | None = option(None, "max | min of gate_metric for a new registered model")
    eval_preset: str = option("", "evaluation preset the metrics file came from (protocol)")
    eval_run_id: str | None = option(None, "the evaluation's MLflow run (default: the metrics file's)")


def _read_json(path: str | None, what: str):
    from chunkgrpo.inputs import read_json

    return read_json(path, f"--{what}") if path else None


def register_folder(req: FolderRegistration):
    """Register a folder; bad metrics (NaN, ±inf, non-numeric, not an object) are refused in one line
    before anything is uploaded. Returns the registry's RegisteredVersion."""
    import tempfile

    from chunkgrpo.errors import UserError
    from chunkgrpo.registry.gate import flat_metrics, metrics_from_eval
    from chunkgrpo.registry.registration import Registration, register_model

    check_model_name(req.name)  # before any upload or run is created
    metrics, plan = _read_json(req.metrics, "metrics"), _read_json(req.plan, "plan")
    if metrics is not None and not isinstance(metrics, dict):
        raise UserError(f"--metrics {req.metrics}: expected a JSON object (an evaluation's metrics.json), "
                        f"got a JSON {type(metrics).__name__}")
    protocol = sampling = None
    eval_run_id = req.eval_run_id
    if isinstance(metrics, dict) and str(metrics.get("format", "")).startswith("chunkgrpo.eval-metrics/"):
        eval_run_id = eval_run_id or metrics.get("mlflow_run_id") or None
        metrics, protocol, sampling = metrics_from_eval(metrics, req.eval_preset)
    flat_metrics(metrics, f"--metrics {req.metrics}")  # NaN/inf/non-numeric: one line, before any upload
    checkpoint = req.checkpoint_uri
    with tempfile.TemporaryDirectory(prefix="chunkgrpo-ckpt-") as tmp:
        model_dir = req.model_dir
        if model_dir.startswith("s3://"):
            checkpoint = checkpoint or model_dir
            if req.kind == "full" or req.external_weights:  # by reference to that folder: nothing downloaded
                checkpoint, model_dir = req.model_dir, None
            else:
                from chunkgrpo.store.client import ArtifactStore

                ArtifactStore().get_folder(req.model_dir, tmp)
                model_dir = tmp
        elif not Path(model_dir).is_dir():
            raise FileNotFoundError(2, "no such directory", model_dir)
        reg = Registration(req.name, req.base_model, model_dir, kind=req.kind, checkpoint_uri=checkpoint,
                           include_weights=False if req.external_weights else None, metrics=metrics,
                           eval_run_id=eval_run_id, eval_protocol=protocol, sampling=sampling, plan=plan,
                           git=req.git_sha, cfg_hash=req.config_hash, gate_metric=req.gate_metric,
                           gate_direction=req.gate_direction)
        return register_model(reg, experiment=req.experiment)


def read_plan(path: str | Path) -> dict | None:
    """A plan JSON file, None when the file is absent (a run without a plan step)."""
    return json.loads(Path(path).read_text()) if Path(path).exists() else None
