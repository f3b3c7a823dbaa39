"""Is `.venv` complete for this checkout? `scripts/setup.sh` asks before it skips installing.

    .venv/bin/python scripts/env_check.py     # exit 0: complete; 1: one line per missing requirement

Complete means: `chunkgrpo` is installed and importable (its editable install still finds this checkout),
every package of the locks `setup.sh` installs (`images/runtime/requirements.lock`, the training image's
packages, and `requirements-dev.lock`, the test tools) is installed at its pinned version, and every
requirement of `chunkgrpo[all,dev]` (followed through `chunkgrpo[core]`-style self-references) at a version
its specifier accepts, `torch` included. It reads package metadata only (`importlib.metadata`): about
0.2 s, where importing torch, diffusers, kfp and mlflow to find out took 8-9 s on 2 cores, on every run of
the README's two commands. A package whose files were damaged after a complete install is not detected
unless it fails at import; `pip install --force-reinstall --no-deps NAME==VERSION` repairs it.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

DIST = "chunkgrpo"
EXTRAS = ("all", "dev")
REPO = Path(__file__).resolve().parents[1]
LOCKS = (REPO / "images" / "runtime" / "requirements.lock", REPO / "requirements-dev.lock")
_PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([^\s;\\]+)", re.M)


def pins(locks=LOCKS) -> dict[str, str]:
    """{package: version} of every `name==version` line of the lock files."""
    return {name: version for lock in locks for name, version in _PIN.findall(Path(lock).read_text())}


def unpinned(want: dict[str, str], get=metadata.distribution) -> list[str]:
    """The locked packages that are missing or at another version (`"name==1.2: installed 1.1"`); a local
    version label (`+cpu`) is ignored."""
    found = []
    for name, version in sorted(want.items()):
        try:
            have = get(name).version
        except metadata.PackageNotFoundError:
            found.append(f"{name}=={version}: not installed")
            continue
        if have.split("+")[0] != version:
            found.append(f"{name}=={version}: installed {have}")
    return found


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
        problems = unpinned(pins()) + unmet()
    except ImportError as e:  # packaging itself (pip's and most packages' dependency) is missing
        problems = [f"{e.name}: not installed"]
    if not problems and find_spec(DIST) is None:
        problems = [f"{DIST}: installed but not importable (an editable install whose folder moved?)"]
    for p in problems[:10]:
        print(f"env_check: {p}", file=sys.stderr)
    if len(problems) > 10:
        print(f"env_check: ... and {len(problems) - 10} more (run `bash scripts/setup.sh`)", file=sys.stderr)
    return 1 if problems else 0


if __name__ == "__main__":
    raise SystemExit(main())
