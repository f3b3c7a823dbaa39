"""The pretrained toy model shipped with the package, so a user's first main job does not pretrain.

    python -m chunkgrpo.toy.pretrained --from .chunkgrpo/models/toy    # refresh the shipped copy
    install(Path(".chunkgrpo/models/toy"))                             # the demo: copy it out (≈ 3 MB)

Why ship it: pretraining the default toy model (`ToyModelConfig()`, 3000 steps) takes ≈ 5.5 min on 2
idle cores, more than the whole first-run budget (3 min); the folder is ≈ 3 MB (a 0.5 M-parameter FLUX
transformer, small CLIP/T5, the closed-form VAE, the world's prompt files). It is built by the
project's own command (`chunkgrpo toy-model`, which records the config and the content key in
`toy_model.json`) and copied here with a `SHA256SUMS` of every file. Pretraining on another CPU
gives other floating-point rounding, so the shipped copy is *the* reference build, not a bit-exact
reproduction target; what must hold is that it is the model the current code would build:

* `packaged()` returns the shipped folder only when it is current (`is_current`: its recorded key is
  `model_key` of the default `ToyModelConfig()` — the config and the source of `world.py` and
  `model.py` — with, at most, another `threads`, the one field that changes only the floating-point
  summation order, not what is learned) and every file matches `SHA256SUMS`; otherwise None, and the
  demo pretrains the model (a test fails while the shipped copy is stale, so it is refreshed with the
  command above in the same change).
* `install(out)` copies it atomically (a temporary sibling, then one rename) and verifies the copy;
  a toy model of older code in `out` is replaced.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import sys
import tempfile
from pathlib import Path

from chunkgrpo.errors import UserError

log = logging.getLogger(__name__)

PACKAGED = Path(__file__).parent / "pretrained"
SUMS = "SHA256SUMS"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _files(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file() and p.name != SUMS)


def write_sums(folder: Path) -> Path:
    """`SHA256SUMS` (sha256sum format) of every file under `folder`."""
    lines = [f"{_sha256(p)}  {p.relative_to(folder).as_posix()}" for p in _files(folder)]
    (folder / SUMS).write_text("\n".join(lines) + "\n")
    return folder / SUMS


def verify(folder: Path) -> str | None:
    """None when every file under `folder` matches its SHA256SUMS (and nothing is missing or extra),
    else a one-line reason."""
    sums = folder / SUMS
    if not sums.is_file():
        return f"{sums} missing"
    want = {}
    for line in sums.read_text().splitlines():
        digest, _, name = line.partition("  ")
        want[name] = digest
    have = {p.relative_to(folder).as_posix(): p for p in _files(folder)}
    if set(want) != set(have):
        diff = sorted(set(want) ^ set(have))
        return f"files differ from {SUMS}: {', '.join(diff[:5])}"
    for name, digest in want.items():
        if _sha256(have[name]) != digest:
            return f"{name}: sha256 differs from {SUMS}"
    return None


RUNTIME_FIELDS = ("threads",)  # config fields that do not change the model (only float rounding)


def current_key(meta: dict | None) -> str | None:
    """The key the current code gives the default model with `meta`'s `RUNTIME_FIELDS` (None when `meta`
    is not a toy model's)."""
    from chunkgrpo.toy.model import ToyModelConfig, model_key

    if not meta or not isinstance(meta.get("config"), dict):
        return None
    default = ToyModelConfig().to_dict()
    runtime = {k: meta["config"][k] for k in RUNTIME_FIELDS if k in meta["config"]}
    try:
        return model_key(ToyModelConfig(**{**default, **runtime}))
    except (TypeError, UserError):
        return None


def is_current(meta: dict | None) -> bool:
    """Whether a toy model folder's `toy_model.json` is the default model of the current code (up to
    `RUNTIME_FIELDS`)."""
    key = current_key(meta)
    return key is not None and meta.get("key") == key


def packaged(folder: Path | None = None) -> Path | None:
    """The shipped toy model folder if it is the current default model and intact, else None."""
    from chunkgrpo.toy.model import read_meta

    folder = folder or PACKAGED
    meta = read_meta(folder)
    if meta is None:
        return None
    if not is_current(meta):
        log.warning("the shipped toy model %s is stale (key %s, current %s); pretraining instead", folder,
                    meta.get("key"), current_key(meta))
        return None
    reason = verify(folder)
    if reason is not None:
        log.warning("the shipped toy model %s is damaged (%s); pretraining instead", folder, reason)
        return None
    return folder


def install(out: str | os.PathLike, folder: Path | None = None) -> bool:
    """Copy the shipped toy model to `out` (absent, empty, or holding a toy model of older code, which it
    replaces: the demo's own folder after an upgrade); False if none is usable. The copy is verified in a
    temporary sibling first, so an interruption leaves `out` whole or absent."""
    from chunkgrpo.toy.model import read_meta

    src = packaged(folder)
    if src is None:
        return False
    out = Path(out)
    stale = read_meta(out) if out.is_dir() else None
    if out.exists() and any(out.iterdir()) and (stale is None or is_current(stale)):
        raise UserError(f"{out} is not empty; not overwriting it with the shipped toy model")
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}-", dir=out.parent))
    try:
        shutil.copytree(src, staging, dirs_exist_ok=True)
        reason = verify(staging)
        if reason is not None:
            raise RuntimeError(f"copy of the shipped toy model is damaged: {reason}")
        (staging / SUMS).unlink()
        if stale is not None:  # moved aside (onto an empty sibling), replaced, then deleted
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}-stale-", dir=out.parent))
            out.rename(old)
            staging.rename(out)
            shutil.rmtree(old)
        else:
            if out.exists():
                out.rmdir()
            staging.rename(out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return True


def ship(built: Path, dest: Path = PACKAGED) -> Path:
    """Replace the shipped copy by the toy model folder `built` (which must be the current default)."""
    from chunkgrpo.toy.model import ToyModelConfig, model_key, read_meta

    meta = read_meta(built)
    if meta is None:
        raise UserError(f"{built} is not a toy model folder (no toy_model.json)")
    if not is_current(meta):
        raise UserError(f"{built} was built with key {meta.get('key')}, the current default is "
                        f"{model_key(ToyModelConfig())}: rebuild it with `chunkgrpo toy-model --out {built}`")
    staging = Path(tempfile.mkdtemp(prefix=".pretrained-", dir=dest.parent))
    shutil.copytree(built, staging, dirs_exist_ok=True)
    write_sums(staging)
    if dest.exists():
        shutil.rmtree(dest)
    staging.rename(dest)
    return dest


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(description="Refresh the toy model shipped in chunkgrpo/toy/pretrained")
    ap.add_argument("--from", dest="built", required=True,
                    help="a folder built by `chunkgrpo toy-model --out DIR`")
    args = ap.parse_args(argv)
    try:
        dest = ship(Path(args.built))
    except UserError as e:
        print(f"chunkgrpo.toy.pretrained: error: {e}", file=sys.stderr)
        return 2
    size = sum(p.stat().st_size for p in dest.rglob("*") if p.is_file())
    print(f"shipped {args.built} -> {dest} ({size / 1e6:.1f} MB)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
