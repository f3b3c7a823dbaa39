"""Is `.venv` complete for this checkout? `scripts/setup.sh` asks before it skips installing.

    .venv/bin/python scripts/env_check.py     # exit 0: complete; 1: one line per missing requirement

Complete means: `chunkgrpo` is installed and importable (its editable install still finds this checkout),
and every requirement of `chunkgrpo[all,dev]` (the extras `setup.sh`
installs, followed through `chunkgrpo[core]`-style self-references) is installed at a version its specifier
accepts, `torch` included. It reads package metadata only (`importlib.metadata`): about 0.2 s, where
importing torch, diffusers, kfp and mlflow to find out took 8-9 s on 2 cores, on every run of the README's
two commands. A package whose files were damaged after a complete install is not detected (it was not
before either, unless it failed at import); `pip install -e .[all,dev]` by hand repairs it.
"""

from __future__ import annotations

import sys
from importlib import metadata

DIST = "chunkgrpo"
EXTRAS = ("all", "dev")


def unmet(dist: str = DIST, extras: tuple[str, ...] = EXTRAS, get=metadata.distribution) -> list[str]:
    """The requirements of `dist[extras]` that are missing or at a version their specifier refuses
    (`"name>=1: installed 0.9"`, `"name: not installed"`), followed through the extras' self-references."""
    from packaging.requirements import Requirement  # main() reports it missing in one line

    try:
        root = get(dist)
    except metadata.PackageNotFoundError:
        return [f"{dist}: not installed"]
    found: list[str] = []
    todo, done, checked = ["", *extras], set(), set()  # "": the base dependencies (no marker)
    while todo:
        extra = todo.pop()
        if extra in done:
            continue
        done.add(extra)
        for line in root.requires or []:
            req = Requirement(line)
            if req.marker is not None and not req.marker.evaluate({"extra": extra}):
                continue
            if req.marker is None and extra != "":
                continue  # a base dependency: checked under ""
            if req.name == dist:
                todo.extend(req.extras)
                continue
            spec = f"{req.name}{req.specifier}"
            if spec in checked:
                continue
            checked.add(spec)
            try:
                version = get(req.name).version
            except metadata.PackageNotFoundError:
                found.append(f"{spec}: not installed")
                continue
            if req.specifier and not req.specifier.contains(version, prereleases=True):
                found.append(f"{spec}: installed {version}")
    return found


def main() -> int:
    from importlib.util import find_spec

    try:
        problems = unmet()
    except ImportError as e:  # packaging itself (pip's and most packages' dependency) is missing
        problems = [f"{e.name}: not installed"]
    if not problems and find_spec(DIST) is None:
        problems = [f"{DIST}: installed but not importable (an editable install whose folder moved?)"]
    for p in problems:
        print(f"env_check: {p}", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
