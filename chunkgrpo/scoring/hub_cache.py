"""Put a local folder into the Hugging Face hub cache under a repo id, so code that loads a file *by hub
name* (ImageReward's `BertTokenizer.from_pretrained("bert-base-uncased")`) finds it offline.

    install_snapshot("bert-base-uncased", "/cache/weights/bert-base-uncased")

The entry is laid out as `huggingface_hub` stores downloads: `<hub cache>/models--<org>--<name>/
snapshots/<rev>/<files>` with `refs/main` naming `<rev>`; `<rev>` is a digest of the folder's files, so
re-installing the same folder is a no-op and a different one becomes the new `main`. The hub cache is
`$HF_HUB_CACHE`, else `$HF_HOME/hub`, else `~/.cache/huggingface/hub` (huggingface_hub's own order).
Standard library only: it is staged beside the scorer worker into the reward venvs.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def hub_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"])
    home = os.environ.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface")
    return Path(home) / "hub"


def install_snapshot(repo_id: str, folder: str | Path, cache: Path | None = None) -> Path:
    """Copy the files of `folder` into the hub cache as the `main` snapshot of `repo_id`; returns the
    snapshot folder. ValueError when `folder` has no files."""
    src = Path(folder)
    files = sorted(p for p in src.rglob("*") if p.is_file()) if src.is_dir() else []
    if not files:
        raise ValueError(f"{repo_id}: {str(src)!r} is not a folder with files")
    digest = hashlib.sha1()
    for p in files:
        digest.update(str(p.relative_to(src)).encode() + b"\0" + hashlib.sha256(p.read_bytes()).digest())
    rev = digest.hexdigest()
    repo = (cache or hub_cache_dir()) / ("models--" + repo_id.replace("/", "--"))
    snap = repo / "snapshots" / rev
    if not snap.is_dir():
        tmp = repo / "snapshots" / f".{rev}.tmp-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        for p in files:
            dst = tmp / p.relative_to(src)
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(p, dst)
        try:
            tmp.rename(snap)
        except OSError:  # another process installed the same snapshot first
            shutil.rmtree(tmp, ignore_errors=True)
    (repo / "refs").mkdir(parents=True, exist_ok=True)
    ref = repo / "refs" / f"main.tmp-{os.getpid()}"
    ref.write_text(rev)
    ref.replace(repo / "refs" / "main")
    return snap
