"""Evaluation: reward scorers, HPDv2 test prompts, GenEval rules and WISE judging.

Modules (import the one you need; this package import stays light, no torch):
- `chunkgrpo.eval.scorers`  - `get_scorer(name, **cfg)`: HPSv3, ImageReward, HPSv2(.1), PickScore, CLIP
                              behind one batch API `score(images, prompts) -> float32 tensor (n,)`.
- `chunkgrpo.eval.hpdv2`    - the 400 HPDv2 test prompts, one fixed seed per prompt, scorer means.
- `chunkgrpo.eval.geneval`  - GenEval layout, detector backends, the official scoring rules, aggregation.
- `chunkgrpo.eval.wise`     - WISE prompts (user-supplied), OpenAI-compatible judge, WiScore aggregation.

Benchmark prompt data is looked up, in order, at an explicit path, `$CHUNKGRPO_DATA_DIR`,
`<repo>/../shared/data` and `<repo>/data` (see `data_file`).
"""

from __future__ import annotations

import os
from pathlib import Path

from chunkgrpo.errors import UserError

DATA_DIR_ENV = "CHUNKGRPO_DATA_DIR"
_REPO_ROOT = Path(__file__).resolve().parents[2]


def data_dirs() -> list[Path]:
    """Candidate benchmark data directories, most specific first."""
    dirs = []
    env = os.environ.get(DATA_DIR_ENV)
    if env:
        dirs.append(Path(env).expanduser())
    dirs += [_REPO_ROOT.parent / "shared" / "data", _REPO_ROOT / "data"]
    return dirs


def data_file(relative: str, explicit: str | os.PathLike | None = None, what: str = "data file") -> Path:
    """Resolve a benchmark file: `explicit` if given (must exist), else `<data dir>/<relative>`."""
    if explicit is not None:
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
        f"to the folder that holds {relative!r}"
    )
