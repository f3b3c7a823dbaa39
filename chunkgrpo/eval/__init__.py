"""Evaluation: HPDv2 test prompts, GenEval rules and WISE judging, over the scorers of `chunkgrpo.scoring`.

Modules (import the one you need; this package import stays light, no torch):
- `chunkgrpo.eval.hpdv2`    - the 400 HPDv2 test prompts, one fixed seed per prompt, scorer means.
- `chunkgrpo.eval.geneval`  - GenEval layout, detector backends, the official scoring rules, aggregation.
- `chunkgrpo.eval.wise`     - WISE prompts (user-supplied), OpenAI-compatible judge, WiScore aggregation;
                              its rubric and score parsers are `wise_scores`, its judge client `wise_judge`.
- `chunkgrpo.eval.geneval_models` - GenEval's detector backends and colour classifier (torch, lazily).
- `chunkgrpo.eval.config`   - `EvalConfig` (sampling nested: `sampling.num_steps`, `sampling.trained_steps`).
- `chunkgrpo.eval.runner`   - the evaluate stage (`run_evaluation`): orchestration over the modules here;
                              `scorer_setup` builds and checks its HPDv2 scorers, `stats` pairs the labels'
                              records and computes the paired statistics and flat metrics, `report` renders
                              the HTML report (its Jinja2 templates: `chunkgrpo/eval/templates/`).

Benchmark prompt data ships with the package (`chunkgrpo/data/`, licences and provenance in its
README.md). A file is looked up, in order, at an explicit path or `s3://` URI, under
`$CHUNKGRPO_DATA_DIR`, then in the package data (see `data_file`).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from chunkgrpo.errors import UserError

DATA_DIR_ENV = "CHUNKGRPO_DATA_DIR"
PACKAGE_DATA_DIR = Path(__file__).resolve().parents[1] / "data"


def data_dirs() -> list[Path]:
    """Candidate benchmark data directories, most specific first: `$CHUNKGRPO_DATA_DIR`, package data."""
    dirs = []
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        dirs.append(Path(env).expanduser())
    dirs.append(PACKAGE_DATA_DIR)
    return dirs


def fetch_s3_file(uri: str, what: str = "data file") -> Path:
    """Download one `s3://` object into the cache (`$CHUNKGRPO_CACHE`, default ~/.cache/chunkgrpo) and
    return the local path; a changed object (size/etag) is downloaded again, an unchanged one reused."""
    from chunkgrpo.store.cache import cached_file

    return cached_file(uri, "data", what)


def fetch_s3_files(uri: str, names: list[str] | tuple[str, ...], what: str = "data folder") -> Path:
    """A local folder holding the objects `<uri>/<name>` that exist (e.g. a user's WISE prompt folder in S3);
    a URI naming one object (ending in one of `names`' suffixes) is fetched alone into a folder of its own."""
    from chunkgrpo.store.client import ArtifactStore

    uri = uri.rstrip("/")
    if any(uri.endswith(Path(n).suffix) for n in names):
        return fetch_s3_file(uri, what)
    store = ArtifactStore()
    found = [fetch_s3_file(f"{uri}/{n}", what) for n in names if store.stat(f"{uri}/{n}") is not None]
    if not found:
        raise UserError(f"{what} {uri} holds none of {', '.join(names)}")
    folder = found[0].parent.parent / (
        "folder-" + hashlib.sha256("\0".join(map(str, found)).encode()).hexdigest()[:16]
    )
    folder.mkdir(parents=True, exist_ok=True)
    for f in found:
        link = folder / f.name
        if not link.exists():
            link.symlink_to(f)
    return folder


def data_file(relative: str, explicit: str | os.PathLike | None = None, what: str = "data file") -> Path:
    """Resolve a benchmark file: `explicit` if given (a local path that must exist, or an `s3://` URI that
    is downloaded), else `$CHUNKGRPO_DATA_DIR/<relative>`, else the package's copy
    `chunkgrpo/data/<relative>`."""
    if explicit is not None and str(explicit) != "":
        if str(explicit).startswith("s3://"):
            return fetch_s3_file(str(explicit), what)
        path = Path(explicit).expanduser()
        if not path.exists():
            raise UserError(f"{what} {str(path)!r} does not exist")
        return path
    tried = []
    for d in data_dirs():
        path = d / relative
        if path.exists():
            return path
        tried.append(str(path))
    raise UserError(
        f"{what} not found (tried {', '.join(tried)}); pass its path explicitly or set ${DATA_DIR_ENV} "
        f"to a folder that holds {relative!r} (a broken install? reinstall chunkgrpo)"
    )


def load_rgb(paths) -> list:
    """The images at `paths` as RGB PIL images (files closed after reading)."""
    from PIL import Image

    out = []
    for p in paths:
        with Image.open(p) as im:
            out.append(im.convert("RGB"))
    return out
