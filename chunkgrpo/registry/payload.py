"""The files of a registered version: an MLflow Model (`python_function` flavour, "model from code")
whose artifact `model/` is the payload. Written at registration, read by the serving pyfunc.

    <MLflow model>/MLmodel, served_model_entry.py, requirements...   (`save_pyfunc`)
    <MLflow model>/code/chunkgrpo/                   (the modules the served code imports: served_code_files)
    <MLflow model>/artifacts/model/                               (PAYLOAD)
        pytorch_lora_weights.safetensors | transformer/...        (inline weights), or nothing (external)
        chunkgrpo_registration.json                                (MODEL_INFO, `model_info`)

MODEL_INFO holds: kind (lora/full), base model reference, weights inline or external (an S3
checkpoint URI and its manifest digest, checked on load: `weights_from_payload`), each inline file's
sha256, metrics, eval protocol, chunk plan, git sha, config hash and the hybrid-inference sampling
settings the pyfunc generates with. `tree_sha256` digests every file of the MLflow model (code too);
the registry records it as tag `model.tree_sha256` and refuses to load a changed version.

The pyfunc's code is `chunkgrpo/served_model_entry.py` -> `chunkgrpo.served_model.FluxPyfunc`, which imports
only this module of the registry (`MODEL_INFO`, `weights_from_payload`, `PARAM_DEFAULTS`).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from chunkgrpo.errors import UserError
from chunkgrpo.store.client import ArtifactStore
from chunkgrpo.store.manifest import Manifest, weights_sha256

MODEL_INFO = "chunkgrpo_registration.json"  # beside the trainer's chunkgrpo_model.json, never over it
MODEL_INFO_FORMAT = "chunkgrpo.registered-model/v1"
PAYLOAD = "artifacts/model"                 # where the pyfunc MLmodel keeps the weights + MODEL_INFO
# files MLflow writes into a `models:/` download that were never registered (not part of tree_sha256)
REGISTRY_FILES = ("registered_model_meta",)
# predict(params=...): 0 / -1 mean "as registered" (MLflow params need concrete defaults)
PARAM_DEFAULTS = {"mode": "hybrid", "num_steps": 0, "trained_steps": -1, "height": 0, "width": 0,
                  "guidance": -1.0, "batch_size": 4, "seed": 42}


def model_code_path() -> str:
    """The models-from-code script MLflow copies into every registered version."""
    return str(Path(__file__).parent.parent / "served_model_entry.py")


def signature():
    """The pyfunc's MLflow signature: prompt (+ optional seed) in; prompt, seed, image out; PARAM_DEFAULTS."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, ParamSchema, ParamSpec, Schema

    inputs = Schema([ColSpec("string", "prompt"), ColSpec("long", "seed", required=False)])
    outputs = Schema([ColSpec("string", "prompt"), ColSpec("long", "seed"), ColSpec("string", "image")])
    kinds = {str: "string", int: "long", float: "double"}
    params = ParamSchema([ParamSpec(k, kinds[type(v)], v) for k, v in PARAM_DEFAULTS.items()])
    return ModelSignature(inputs=inputs, outputs=outputs, params=params)


def model_info(
    *,
    kind: str,
    base_model: str,
    inline: bool,
    checkpoint_uri: str | None,
    manifest_sha: str | None,
    manifest: Manifest,
    metrics: Mapping[str, float],
    plan: Any,
    git: str,
    cfg_hash: str | None,
    created: str,
    eval_protocol: Mapping[str, Any] | None,
    sampling: Mapping[str, Any] | None,
) -> dict:
    """The MODEL_INFO document of a version (format MODEL_INFO_FORMAT)."""
    return {
        "format": MODEL_INFO_FORMAT,
        "kind": kind,
        "base_model": base_model,
        "weights": "inline" if inline else "external",
        "checkpoint_uri": checkpoint_uri or "",
        "manifest_sha256": manifest_sha or "",
        "content_sha256": manifest.content_sha256,
        "files": manifest.files,
        "metrics": dict(metrics),
        "plan": plan,
        "git_sha": git,
        "config_hash": cfg_hash or "",
        "created": created,
        "eval_protocol": dict(eval_protocol) if eval_protocol else None,
        "sampling": dict(sampling) if sampling else None,
    }


# The distributions the served code imports (chunkgrpo.served_model -> eval.hybrid, flux, store, registry):
# a serving machine installs them from public indexes; chunkgrpo itself travels in the model (code_paths).
SERVING_DISTRIBUTIONS = ("mlflow", "torch", "diffusers", "transformers", "accelerate", "peft", "safetensors",
                         "sentencepiece", "protobuf", "huggingface-hub", "numpy", "pandas", "pillow",
                         "pyyaml", "tqdm", "minio")


def serving_requirements() -> list[str]:
    """SERVING_DISTRIBUTIONS pinned to the versions installed here (`name==X.Y.Z`, without a local label
    such as `+cpu` that only a vendor's index has), so the served model runs with what it was tested with."""
    from importlib.metadata import PackageNotFoundError, version

    from packaging.version import Version

    out = []
    for name in SERVING_DISTRIBUTIONS:
        try:
            out.append(f"{name}=={Version(version(name)).public}")
        except PackageNotFoundError:  # optional here (e.g. protobuf): the resolver picks it for its users
            continue
    return out


SERVED_MODULE = "chunkgrpo.served_model"
SERVED_DATA = ("presets",)  # package data a served module reads (chunkgrpo.config's PRESET_DIR)


def served_code_files(root: Path | None = None) -> dict[str, Path]:
    """The files of the `chunkgrpo` package a registered version carries (`code/chunkgrpo`), by their path
    relative to the package's parent: SERVED_MODULE and every chunkgrpo module its code imports anywhere
    (function bodies included, transitively), their packages' `__init__.py`, and SERVED_DATA. The served model
    imports its code from there, with no chunkgrpo installation on the serving machine; the rest of the
    package (training, CLI, the shipped toy model) stays out of every version. `root`: the folder holding
    the package (default: this one's; in an image, site-packages, whose other packages are never read)."""
    import ast

    root = root or Path(__file__).resolve().parent.parent.parent

    def source(module: str) -> Path | None:
        p = root.joinpath(*module.split("."))
        return next((f for f in (p / "__init__.py", p.with_suffix(".py")) if f.is_file()), None)

    seen: dict[str, Path] = {}
    todo = [SERVED_MODULE]
    while todo:
        module = todo.pop()
        if module in seen or module.split(".")[0] != "chunkgrpo":
            continue
        f = source(module)
        if f is None:  # a name imported from a module, not a module itself
            continue
        seen[module] = f
        parts = module.split(".")
        todo += [".".join(parts[:i]) for i in range(1, len(parts))]  # the packages it lives in
        package = parts if f.name == "__init__.py" else parts[:-1]
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                todo += [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = ".".join([*package[:len(package) - node.level + 1], node.module or ""] if node.level
                                else [node.module or ""]).strip(".")
                todo += [base, *(f"{base}.{a.name}" for a in node.names)]
    data = [f for d in SERVED_DATA for f in sorted((root / "chunkgrpo" / d).rglob("*")) if f.is_file()]
    return {f.relative_to(root).as_posix(): f for f in sorted([*seen.values(), *data])}


def served_code(dest: Path) -> Path:
    """`served_code_files` under `dest` (hard links where it can), returns `dest/chunkgrpo`."""
    for rel, src in served_code_files().items():
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        try:
            (dest / rel).hardlink_to(src)
        except OSError:
            (dest / rel).write_bytes(src.read_bytes())
    return dest / "chunkgrpo"


def save_pyfunc(folder: Path, payload: Path) -> None:
    """An MLflow Model directory (python_function flavour, model from code) whose artifact `model`
    is `payload` (weights + MODEL_INFO): mlflow.pyfunc.load_model and `mlflow models serve` work on the
    registered version with MLflow's own environment handling (its requirements resolve from PyPI)."""
    import tempfile
    import warnings

    import mlflow

    assert payload.name == Path(PAYLOAD).name, payload  # MLflow names the artifact dir after the source dir
    with warnings.catch_warnings(), tempfile.TemporaryDirectory(prefix="chunkgrpo-code-") as code:
        warnings.filterwarnings("ignore", message=".*input example.*")  # an example would load the model
        mlflow.pyfunc.save_model(
            path=str(folder), python_model=model_code_path(), artifacts={"model": str(payload)},
            code_paths=[str(served_code(Path(code)))], pip_requirements=serving_requirements(),
            signature=signature())


def weights_from_payload(payload: Path, info: dict, store=None) -> Path:
    """The diffusers-loadable weights of a registered payload: the folder itself (inline) or the S3
    checkpoint folder it points to, downloaded and checked against the recorded manifest digest."""
    if info.get("weights") != "external":
        for rel, entry in info.get("files", {}).items():
            if hashlib.sha256((payload / rel).read_bytes()).hexdigest() != entry["sha256"]:
                raise UserError(f"{payload}: {rel} does not match its recorded sha256")
        return payload
    store = store or ArtifactStore()
    weights = payload / "weights"
    manifest = store.get_folder(info["checkpoint_uri"], weights)
    if info.get("manifest_sha256") and manifest.sha256 != info["manifest_sha256"]:
        raise UserError(f"{info['checkpoint_uri']} changed since it was registered "
                        f"(manifest {manifest.sha256[:12]} != {info['manifest_sha256'][:12]})")
    return weights


def weights_digest(folder: str | Path) -> str:
    """The weights digest (`store.manifest.weights_sha256`) of an MLflow model folder of this layout: the
    payload's files without MODEL_INFO (inline weights), or, for external weights, the content digest
    MODEL_INFO pins (its file list, whose manifest digest `weights_from_payload` checks on load)."""
    root = Path(folder) / PAYLOAD
    try:
        info = json.loads((root / MODEL_INFO).read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{Path(folder).name}: not a chunkgrpo model ({MODEL_INFO} unreadable: "
                        f"{type(e).__name__})") from None
    if info.get("weights") == "external":
        files = info.get("files") if isinstance(info.get("files"), dict) else {}
        return Manifest(files=files).content_sha256
    return weights_sha256(root, exclude=(MODEL_INFO,))


def tree_sha256(folder: str | Path) -> str:
    """Digest of a folder: every file's relative path and sha256 (code, MLmodel, weights, env files),
    without what MLflow adds to a registered model's download (REGISTRY_FILES)."""
    root = Path(folder)
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = f.relative_to(root).as_posix()
        if rel in REGISTRY_FILES:
            continue
        h.update(rel.encode() + b"\0")
        h.update(hashlib.sha256(f.read_bytes()).hexdigest().encode() + b"\n")
    return h.hexdigest()
