"""The two JSON formats the store writes: a folder artifact's `MANIFEST.json` (relative path -> sha256 +
size, written last by `ArtifactStore.put_folder`) and the "model pointer" (where a checkpoint folder
lives and what it is). Pure: local hashing and validation, no S3 calls."""

from __future__ import annotations

import dataclasses
import datetime as _dt
import hashlib
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from chunkgrpo.errors import UserError
from chunkgrpo.store import StoreError, parse_s3_uri

MANIFEST_NAME = "MANIFEST.json"
MANIFEST_FORMAT = "chunkgrpo.manifest/v1"
POINTER_FORMAT = "chunkgrpo.model-pointer/v1"
MiB = 1024 * 1024
CHUNK = 1 * MiB  # streaming block size for hashing and downloads


@dataclasses.dataclass
class Manifest:
    """What a complete folder artifact contains: relative path -> {sha256, size}."""

    files: dict[str, dict[str, Any]]
    created: str = ""
    meta: dict[str, Any] = dataclasses.field(default_factory=dict)
    format: str = MANIFEST_FORMAT

    @property
    def total_bytes(self) -> int:
        return sum(int(f["size"]) for f in self.files.values())

    def to_json(self) -> bytes:
        body = {"format": self.format, "created": self.created, "total_bytes": self.total_bytes,
                "files": {k: self.files[k] for k in sorted(self.files)}, "meta": self.meta}
        return (json.dumps(body, indent=1, sort_keys=False) + "\n").encode()

    @property
    def sha256(self) -> str:
        """Digest of the serialised manifest: identifies the folder content as a whole."""
        return hashlib.sha256(self.to_json()).hexdigest()

    @property
    def content_sha256(self) -> str:
        """Digest of the file list only (path, sha256, size): equal for equal content, any time."""
        body = json.dumps(
            {k: [self.files[k]["sha256"], int(self.files[k]["size"])] for k in sorted(self.files)}
        )
        return hashlib.sha256(body.encode()).hexdigest()

    @classmethod
    def from_json(cls, data: bytes | str, where: str = "manifest") -> "Manifest":
        try:
            body = json.loads(data)
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise StoreError(f"{where}: not valid JSON ({e})") from None
        if not isinstance(body, dict) or body.get("format") != MANIFEST_FORMAT or not isinstance(
                body.get("files"), dict):
            raise StoreError(f"{where}: not a {MANIFEST_FORMAT} manifest")
        for rel, entry in body["files"].items():
            _check_rel_path(rel, where)
            if not isinstance(entry, dict) or "sha256" not in entry or "size" not in entry:
                raise StoreError(f"{where}: entry {rel!r} lacks sha256/size")
        return cls(files=body["files"], created=body.get("created", ""), meta=body.get("meta") or {})


def _check_rel_path(rel: str, where: str = "manifest") -> None:
    p = Path(rel)
    if p.is_absolute() or ".." in p.parts or rel.startswith("/") or not rel:
        raise StoreError(f"{where}: unsafe path {rel!r}")


def file_sha256(path: str | Path, chunk: int = CHUNK) -> str:
    """Hex sha256 of a local file, streamed."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def _iter_files(local_dir: Path) -> Iterator[tuple[str, Path]]:
    for p in sorted(local_dir.rglob("*")):
        if p.is_file():
            rel = p.relative_to(local_dir).as_posix()
            if rel == MANIFEST_NAME:
                continue  # a downloaded folder re-uploaded: the manifest is regenerated
            yield rel, p


def file_sizes(local_dir: str | Path) -> dict[str, int]:
    """{relative path: size} of the files `build_manifest` would hash, without reading them."""
    return {rel: p.stat().st_size for rel, p in _iter_files(Path(local_dir))}


def require_files(local_dir: str | Path, files: dict, what: str) -> None:
    """`local_dir` holds exactly `files` ({rel: {sha256, size}}, e.g. as the processes that wrote them
    hashed them) at their sizes, else OSError `<folder name>: <what> (<first differing files>)`."""
    sizes = file_sizes(local_dir)
    if {k: int(v["size"]) for k, v in files.items()} != sizes:
        odd = sorted(set(sizes).symmetric_difference(files)) or sorted(
            k for k in files if int(files[k]["size"]) != sizes[k])
        raise OSError(f"{Path(local_dir).name}: {what} ({', '.join(odd[:3])})")


def build_manifest(local_dir: str | Path, meta: dict | None = None) -> Manifest:
    """Hash every file under `local_dir` (symlinks followed, MANIFEST.json itself skipped)."""
    local_dir = Path(local_dir)
    if not local_dir.is_dir():
        raise UserError(f"{local_dir} is not a directory")
    files = {rel: {"sha256": file_sha256(p), "size": p.stat().st_size} for rel, p in _iter_files(local_dir)}
    return Manifest(files=files, created=_now(), meta=dict(meta or {}))


def _now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")


# -------------------------------------------------------------------------------- model pointer


def make_pointer(uri: str, manifest_sha256: str, kind: str, base_model: str, **extra: Any) -> dict:
    """A "model pointer": where a checkpoint folder lives and what it is, as small JSON."""
    parse_s3_uri(uri)
    if kind not in ("lora", "full"):
        raise UserError(f"model kind {kind!r} must be 'lora' or 'full'")
    if not re.fullmatch(r"[0-9a-f]{64}", manifest_sha256 or ""):
        raise UserError(f"manifest_sha256 {manifest_sha256!r} is not a hex sha256")
    return {"format": POINTER_FORMAT, "uri": uri, "manifest_sha256": manifest_sha256, "kind": kind,
            "base_model": base_model, **extra}


def read_pointer(data: str | bytes | dict) -> dict:
    """Validate a model pointer (JSON text or dict) and return it as a dict."""
    body = json.loads(data) if isinstance(data, (str, bytes)) else dict(data)
    if body.get("format") != POINTER_FORMAT:
        raise UserError(f"not a {POINTER_FORMAT} model pointer: {str(body)[:200]}")
    missing = [k for k in ("uri", "manifest_sha256", "kind", "base_model") if k not in body]
    if missing:
        raise UserError(f"model pointer lacks {', '.join(missing)}")
    make_pointer(body["uri"], body["manifest_sha256"], body["kind"], body["base_model"])
    return body


# ------------------------------------------------------------------------------ weights identity

# MLflow run tags of an evaluation: the weights it scored and its base model (`weights_sha256`); the
# registry creates a version only from the run whose WEIGHTS_TAG equals the version's own weights.
WEIGHTS_TAG = "chunkgrpo.weights_sha256"
BASE_WEIGHTS_TAG = "chunkgrpo.base_weights_sha256"


def weights_sha256(folder: str | Path, exclude: tuple[str, ...] = ()) -> str:
    """The identity of a weights folder: `Manifest.content_sha256` (every file's relative path, sha256 and
    size) of its files, without the store's bookkeeping at its top (MANIFEST.json, hidden files such as the
    cache's `.manifest-sha256` stamp) and the top-level names in `exclude`. Equal for the same weights
    wherever they lie: a checkpoint folder in the store, its cached download, a registered payload."""
    root = Path(folder)
    if not root.is_dir():
        raise UserError(f"{root} is not a directory")
    files = {}
    for rel, p in _iter_files(root):
        top = rel.split("/", 1)[0]
        if top.startswith(".") or top in exclude:
            continue
        files[rel] = {"sha256": file_sha256(p), "size": p.stat().st_size}
    return Manifest(files=files).content_sha256
