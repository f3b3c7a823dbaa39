"""The model cache: base and reward/scorer weights as checksummed S3 folder artifacts, and the
pipeline's weight URIs turned into stage overrides.

    chunkgrpo models sync black-forest-labs/FLUX.1-dev            # hub cache (or --download) -> s3://chunkgrpo-data/models/black-forest-labs/FLUX.1-dev
    chunkgrpo models sync /mnt/ImageReward --to s3://chunkgrpo-data/models/THUDM/ImageReward
    chunkgrpo models uri MizzenAI/HPSv3                            # where the pipeline looks for it

Nothing in a pipeline run downloads from a hub: the pipeline's `model` and `reward_weights` /
`scorer_weights` parameters point at these S3 folders (defaults: `DEFAULT_WEIGHTS`), the
preflight step checks they exist, and the stages download them checksum-verified into their cache.
`sync` is the one-time step that fills the cache (on a machine with hub access, or from a folder);
it is idempotent (an identical folder already in S3 is not uploaded again).
"""

from __future__ import annotations

import logging
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path

from chunkgrpo.errors import UserError

log = logging.getLogger(__name__)

MODEL_ROOT_ENV = "CHUNKGRPO_MODEL_ROOT"
DEFAULT_MODEL_ROOT = "s3://chunkgrpo-data/models"
BASE_MODEL = "black-forest-labs/FLUX.1-dev"
# What the paper's recipe and evaluation need besides the base model (hub id -> role).
REWARD_MODELS = {"hpsv3": "MizzenAI/HPSv3", "hpsv3.processor": "Qwen/Qwen2-VL-7B-Instruct",
                 "imagereward": "THUDM/ImageReward",
                 # ImageReward's package loads its BERT tokenizer by the hub name bert-base-uncased
                 "imagereward.processor": "google-bert/bert-base-uncased"}
# Repos of which a stage loads only a few named files (the BERT repo also holds 2 GB of weights in five
# formats that nothing loads).
ONLY_FILES = {"google-bert/bert-base-uncased": ["vocab.txt", "tokenizer_config.json", "tokenizer.json",
                                                "config.json"]}


def model_root() -> str:
    return (os.environ.get(MODEL_ROOT_ENV) or DEFAULT_MODEL_ROOT).rstrip("/")


def model_uri(hub_id: str, root: str | None = None) -> str:
    """`<root>/<org>/<name>`: where `sync` puts a hub model and where the pipeline looks for it."""
    if hub_id.count("/") != 1 or hub_id.startswith(("s3://", "/", ".")):
        raise UserError(f"{hub_id!r} is not a hub id like org/name")
    return f"{(root or model_root()).rstrip('/')}/{hub_id}"


def default_weights(root: str | None = None) -> dict[str, str]:
    """{role: s3 URI} for the reward/scorer weights of the paper's recipe (pipeline defaults)."""
    return {role: model_uri(hub, root) for role, hub in REWARD_MODELS.items()}


def pipeline_patterns(source: str, download: bool, revision: str | None) -> list[str] | None:
    """What of hub repo `source` a pipeline loads: for a diffusers pipeline repo (one with a
    `model_index.json`), that file and the folders of the components it names (FLUX.1-dev: scheduler,
    text encoders, tokenizers, transformer, VAE; not the repo's single-file `flux1-dev.safetensors` and
    `ae.safetensors`, 24 GB nothing loads); None (every file) for any other repo (reward weights, a
    reward's base model), whose files its loader reads; `ONLY_FILES` for a repo of which only a few
    files are loaded."""
    import json

    if source in ONLY_FILES:
        return list(ONLY_FILES[source])

    from huggingface_hub import hf_hub_download

    try:
        index = json.loads(Path(hf_hub_download(source, "model_index.json", revision=revision,
                                                local_files_only=not download,
                                                token=os.environ.get("HF_TOKEN") or None)).read_text())
    except Exception as e:  # no pipeline index (not a diffusers pipeline), or the repo cannot be read here
        log.info("%s: no model_index.json (%s); syncing every file", source, type(e).__name__)
        return None
    parts = sorted(k for k, v in index.items()
                   if not k.startswith("_") and isinstance(v, list) and len(v) == 2 and v[0] is not None)
    return ["model_index.json", *(f"{name}/*" for name in parts)]


def _local_source(source: str, download: bool, revision: str | None) -> tuple[Path, list[str] | None]:
    """The local folder of `source` and the patterns of what of it to sync (None = all)."""
    path = Path(source).expanduser()
    if path.is_dir():
        return path, None
    if source.count("/") != 1:
        raise UserError(f"{source!r} is neither a folder nor a hub id (org/name)")
    from huggingface_hub import snapshot_download

    patterns = pipeline_patterns(source, download, revision)
    try:
        return Path(snapshot_download(source, revision=revision, local_files_only=not download,
                                      allow_patterns=patterns, token=os.environ.get("HF_TOKEN") or None)), \
            patterns
    except Exception as e:
        how = (
            "download failed"
            if download
            else "not in the local hub cache (pass --download on a machine with hub access)"
        )
        raise UserError(f"{source}: {how} ({type(e).__name__}: {str(e).splitlines()[0][:200]})") from None


def sync(source: str, dest: str | None = None, *, download: bool = False, revision: str | None = None,
         store=None) -> tuple[str, bool]:
    """Put `source` (a folder or a hub id) into S3 as a folder artifact. Returns (uri, uploaded);
    an identical complete folder already there is kept (uploaded=False)."""
    from chunkgrpo.store.client import ArtifactStore
    from chunkgrpo.store.manifest import build_manifest

    if dest is None:
        dest = model_uri(source)
    if not dest.startswith("s3://"):
        raise UserError(f"destination {dest!r} must be an s3:// URI")
    store = store or ArtifactStore()
    store.require_bucket(dest)  # before any download: a missing bucket is never "uploaded"
    local, patterns = _local_source(source, download, revision)
    with tempfile.TemporaryDirectory(prefix="chunkgrpo-sync-") as view:
        if patterns is not None:  # a hub cache may hold more of the repo than was asked for: only these
            local = _selected(local, patterns, Path(view))
        _refuse_broken_links(local)
        want = build_manifest(local)
        if not want.files:
            raise UserError(f"{local} is empty")
        have = store.read_manifest(dest)
        if have is not None and have.content_sha256 == want.content_sha256:
            log.info("%s already holds %s (%d files)", dest, source, len(want.files))
            return dest, False
        recorded = _source_label(source)
        _refuse_foreign_prefix(store, dest, have, {recorded, source}, set(want.files))
        store.put_folder(local, dest,
                         meta={"kind": "model-cache", "source": recorded, "revision": revision or ""})
    return dest, True


def _selected(folder: Path, patterns: list[str], view: Path) -> Path:
    """`view` holding links to the files of `folder` that match `patterns` (fnmatch on the relative path)."""
    import fnmatch

    for p in sorted(folder.rglob("*")):
        rel = p.relative_to(folder).as_posix()
        if p.is_file() and any(fnmatch.fnmatch(rel, pat) for pat in patterns):
            (view / rel).parent.mkdir(parents=True, exist_ok=True)
            (view / rel).symlink_to(p.resolve())
    return view


def _source_label(source: str) -> str:
    """What a sync records as its source: a hub id as given, a folder as its absolute path (the same
    folder synced again from another working directory is recognised)."""
    path = Path(source).expanduser()
    return str(path.resolve()) if path.is_dir() else source


def _refuse_broken_links(local: Path) -> None:
    """A dangling symlink is a file the model lacks: refused, naming it, before anything is uploaded."""
    for dirpath, dirnames, filenames in os.walk(local, followlinks=True):
        for name in [*dirnames, *filenames]:
            p = Path(dirpath) / name
            if p.is_symlink() and not p.exists():
                raise UserError(
                    f"{p} is a broken symlink (to {os.readlink(p)}); fix or remove it before syncing")


def _refuse_foreign_prefix(store, dest: str, have, sources: set[str], new_files: set[str]) -> None:
    """`sync` replaces only what an earlier sync of the same source put at `dest`: a prefix holding
    anything else (another model, a README, a half-upload of other files) is refused, nothing deleted.

    An earlier sync is recognised by the manifest it wrote last (meta kind 'model-cache' and the same
    source); without a manifest (an interrupted upload), only objects the new folder would rewrite
    under the same name are tolerated."""
    from chunkgrpo.store import parse_s3_uri
    from chunkgrpo.store.client import folder_prefix
    from chunkgrpo.store.manifest import MANIFEST_NAME

    source = min(sources, key=len)
    if have is not None:
        meta = have.meta or {}
        if meta.get("kind") == "model-cache" and meta.get("source") in sources:
            return
        was = f"a sync of {meta['source']}" if meta.get("kind") == "model-cache" and meta.get("source") \
            else f"a folder artifact ({meta.get('kind') or 'not from models sync'})"
        raise UserError(f"{dest} already holds {was} ({len(have.files)} files), not {source}; "
                        "choose an empty prefix or remove it first")
    _, key = parse_s3_uri(dest)
    base = folder_prefix(key)
    others = sorted(e.key[len(base):] for e in store.list(dest.rstrip("/") + "/")
                    if e.key[len(base):] not in new_files and e.key[len(base):] != MANIFEST_NAME)
    if others:
        shown = ", ".join(others[:3]) + (f", ... ({len(others)} in all)" if len(others) > 3 else "")
        raise UserError(f"{dest} is not empty and not an earlier sync of {source}: it holds {shown}; "
                        "choose an empty prefix or remove it first")


# ------------------------------------------------------------------------- weight URIs -> overrides


def reward_weight_overrides(preset: str, overrides: list[str], weights: Mapping[str, str]) -> list[str]:
    """Training overrides that point the preset's rewards at `weights` ({reward: uri,
    '<reward>.processor': uri}); rewards the preset does not use are ignored. No torch needed."""
    from chunkgrpo.config import _set_dotted, load_yaml, parse_override

    data = load_yaml(preset)
    for text in overrides or []:
        key, value = parse_override(text)
        _set_dotted(data, key, value)
    rewards = data.get("rewards") or [{"name": "brightness"}]
    out = []
    for i, r in enumerate(rewards):
        name = (r or {}).get("name", "")
        if weights.get(name):
            out.append(f"rewards.{i}.options.weights={weights[name]}")
        if weights.get(f"{name}.processor"):
            out.append(f"rewards.{i}.options.processor={weights[name + '.processor']}")
    return out


def scorer_weight_overrides(weights: Mapping[str, str]) -> list[str]:
    """Evaluation overrides for `weights` ({scorer: uri, '<scorer>.processor': uri})."""
    out = []
    for key, uri in sorted(weights.items()):
        if not uri:
            continue
        if key.endswith(".processor"):
            out.append(f"scorer_options.{key[: -len('.processor')]}.processor={uri}")
        else:
            out.append(f"scorer_weights.{key}={uri}")
    return out


def _preset_with(preset: str, overrides: list[str]) -> dict:
    from chunkgrpo.config import _set_dotted, load_yaml, parse_override

    data = load_yaml(preset)
    for text in overrides or []:
        key, value = parse_override(text)
        _set_dotted(data, key, value)
    return data


def used_reward_weights(preset: str, overrides: list[str], weights: Mapping[str, str]) -> dict[str, str]:
    """The entries of `weights` the training preset (+ overrides) actually uses."""
    names = {(r or {}).get("name", "") for r in (_preset_with(preset, overrides).get("rewards") or [])}
    return {k: v for k, v in weights.items() if v and k.split(".processor")[0] in names}


def used_scorer_weights(eval_preset: str, overrides: list[str], weights: Mapping[str, str]) -> dict[str, str]:
    """The entries of `weights` the evaluation preset (+ overrides) scores HPDv2 with."""
    data = _preset_with(eval_preset, overrides)
    if "hpdv2" not in (data.get("benchmarks") or ["hpdv2"]):
        return {}
    names = set(data.get("scorers") or [])
    return {k: v for k, v in weights.items() if v and k.split(".processor")[0] in names}
