"""Load registered versions, verified: the MLflow pyfunc (`load_pyfunc`, files checked against the
version's `model.tree_sha256`), the payload with its weights (`load_registered_model`), or a diffusers
`FluxPipeline` with the weights applied (`load_pipeline`)."""

from __future__ import annotations

import dataclasses
import json
import tempfile
from pathlib import Path
from urllib.parse import unquote

from chunkgrpo.errors import UserError
from chunkgrpo.registry.client import aliases, connect, get_version
from chunkgrpo.registry.gate import TREE_TAG
from chunkgrpo.registry.payload import MODEL_INFO, PAYLOAD, tree_sha256, weights_from_payload
from chunkgrpo.tempdirs import owned_on_failure


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


def _resolve_version(client, model_uri: str):
    """The model version a `models:/name/version` or `models:/name@alias` URI names."""
    if not model_uri.startswith("models:/"):
        raise UserError(f"{model_uri!r} is not a models:/NAME/VERSION or models:/NAME@ALIAS URI")
    ref = unquote(model_uri[len("models:/"):]).rstrip("/")
    if "@" in ref:
        name, alias = ref.rsplit("@", 1)
        version = aliases(client, name).get(alias)
        if not version:
            raise UserError(f"{name!r} has no alias {alias!r}")
    else:
        name, _, version = ref.rpartition("/")
    return get_version(client, name, version)


def load_pyfunc(model_uri: str, dst: str | Path | None = None):
    """`mlflow.pyfunc.load_model(model_uri)`, after checking that the downloaded MLflow model (its
    code `served_model_entry.py`, `MLmodel`, environment files and weights) is byte for byte what was
    registered (version tag model.tree_sha256, written at registration). A file replaced in the
    artifact store is refused in one line before any of it runs. Plain `mlflow.pyfunc.load_model`
    executes whatever code the artifact store holds: serve and evaluate the champion with this.
    Without `dst` the files go to a new temp folder the caller owns (removed here on failure)."""
    import mlflow

    client = connect()
    mv = _resolve_version(client, model_uri)
    expected = (mv.tags or {}).get(TREE_TAG)
    if not expected:
        raise UserError(f"{mv.name} v{mv.version} records no {TREE_TAG} (registered before code pinning): "
                        "re-register it to load it verified")
    with owned_on_failure("chunkgrpo-pyfunc-", dst) as dst:
        # the version's own source: exactly the files registered (a `models:/` download adds MLflow's
        # registered_model_meta, which tree_sha256 leaves out too)
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=mv.source, dst_path=str(dst)))
        actual = tree_sha256(local)
        if actual != expected:
            raise UserError(f"{mv.name} v{mv.version}: the model's files in the artifact store changed "
                            f"since registration ({TREE_TAG} {actual[:12]} != {expected[:12]}); refusing to "
                            "load it")
        return mlflow.pyfunc.load_model(str(local))


def load_registered_model(model_uri: str, dst: str | Path | None = None, store=None) -> LoadedModel:
    """Download `models:/name@alias` (or `models:/name/version`) and its external weights, verified.
    Without `dst` the files go to a new temp folder the caller owns (removed here on failure)."""
    import mlflow

    connect()  # clear error without a tracking URI
    with owned_on_failure("chunkgrpo-model-", dst) as dst:
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
        from chunkgrpo.flux import resolve_model_source  # the base model: s3://, folder or hub id

        pipe = FluxPipeline.from_pretrained(resolve_model_source(base_model or m.base_model), dtype=dtype)
        if m.kind == "lora":
            pipe.load_lora_weights(str(m.weights_dir))
        else:
            sub = m.weights_dir / "transformer"
            pipe.transformer = FluxTransformer2DModel.from_pretrained(
                str(sub if sub.is_dir() else m.weights_dir), dtype=dtype)
    return pipe.to(device) if device else pipe
