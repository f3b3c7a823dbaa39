"""Do a registered version's requirements resolve? The offline check behind serving a version with MLflow's
default environment manager (`mlflow models serve -m models:/NAME@champion` builds a fresh virtualenv with
the Python of the model's python_env.yaml and installs its requirements.txt).

    .venv/bin/python scripts/serving_requirements.py MODEL [--report FILE] [--project-extras core,store]

MODEL: a folder holding an MLflow model (its requirements.txt and python_env.yaml as registered), or a
`models:/NAME/VERSION` / `models:/NAME@ALIAS` URI (downloaded; needs MLFLOW_TRACKING_URI).

pip's resolver (`pip install --dry-run --ignore-installed --no-index --find-links WHEELHOUSE --report`) runs
twice on a wheelhouse built here, with no index:

- the wheelhouse: every distribution installed in this interpreter's environment (the project's `.venv`,
  which scripts/setup.sh installs and scripts/env_check.py checks against pyproject.toml) as a
  metadata-only wheel with its own name, version, Requires-Python and Requires-Dist (what an index serves
  a resolver for that version), and the project's own wheel (`pip wheel . --no-deps`);
- `requirements`: the model's requirements.txt alone, as the fresh virtualenv installs it: every pin and
  every dependency they pull must resolve to one consistent set;
- `with_project`: the same plus `chunkgrpo[<extras>]` from the project's wheel: a machine with the project
  installed (an image) accepts the model's pins under the project's own version ranges.

It also checks python_env.yaml (its Python is this interpreter's major.minor; its build dependencies are
pinned) and compares each resolved version with the pins of the image lock files (`images/*/*.lock`):
differences are listed, not failures (those locks hold the images' own environments, which a model served
in a fresh virtualenv does not share). Exit 0 with a JSON summary when both resolutions succeed, 1 with
pip's message when one is refused, 2 for a bad MODEL.

Limit: the installed torch is the CPU build (its metadata names no CUDA wheels); the PyPI build of the same
version adds the `nvidia-*` wheels it pins itself.
"""

from __future__ import annotations

import argparse
import base64
import hashlib
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from email.message import Message
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROJECT = "chunkgrpo"
HEADERS = ("Metadata-Version", "Name", "Version", "Requires-Python", "Requires-Dist", "Provides-Extra")


class Refused(Exception):
    """pip's resolver refused a requirement set."""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def _record_line(arc: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{arc},sha256={digest},{len(data)}"


def metadata_wheel(dist: metadata.Distribution, out: Path) -> Path:
    """A wheel of `dist` that holds only its metadata (the headers a resolver reads), tagged py3-none-any."""
    md = Message()
    for key in HEADERS:
        for value in dist.metadata.get_all(key) or []:
            md[key] = value
    stem = f"{re.sub(r'[-_.]+', '_', dist.metadata['Name'])}-{dist.version}"
    files = {f"{stem}.dist-info/METADATA": md.as_bytes(),
             f"{stem}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: serving_requirements\n"
                                        b"Root-Is-Purelib: true\nTag: py3-none-any\n"}
    record = f"{stem}.dist-info/RECORD"
    lines = [_record_line(a, d) for a, d in files.items()] + [f"{record},,"]
    files[record] = ("\n".join(lines) + "\n").encode()
    path = out / f"{stem}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for arc, data in files.items():
            z.writestr(arc, data)
    return path


def build_wheelhouse(out: Path, repo: Path = REPO) -> dict[str, str]:
    """Metadata wheels of every installed distribution but the project, and the project's own wheel.
    Returns name -> version of what it holds."""
    out.mkdir(parents=True, exist_ok=True)
    held: dict[str, str] = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if not name or _norm(name) in held or _norm(name) == PROJECT:
            continue
        metadata_wheel(dist, out)
        held[_norm(name)] = dist.version
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", str(repo), "--no-deps", "--no-build-isolation",
                        "--no-index", "--disable-pip-version-check", "-q", "-w", str(out)],
                       capture_output=True, text=True, timeout=600)
    if r.returncode:
        raise Refused(f"pip wheel . --no-deps failed: {r.stderr.strip()[-2000:]}")
    held[PROJECT] = metadata.version(PROJECT)
    return held


def resolve(requirements: list[str], wheelhouse: Path, work: Path, label: str) -> dict[str, str]:
    """pip's resolution of `requirements` (lines of a requirements file) from `wheelhouse` alone, as a fresh
    environment would install them: name -> version; Refused with pip's message when it cannot."""
    req_file, report = work / f"{label}.txt", work / f"{label}-report.json"
    req_file.write_text("\n".join(requirements) + "\n")
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed",
                        "--no-index", "--disable-pip-version-check", "--find-links", str(wheelhouse),
                        "--report", str(report), "-q", "-r", str(req_file)],
                       capture_output=True, text=True, timeout=600)
    if r.returncode:
        raise Refused(f"{label}: pip's resolver refused the requirements: "
                      f"{(r.stderr or r.stdout).strip()[-3000:]}")
    installs = json.loads(report.read_text())["install"]
    return {_norm(i["metadata"]["name"]): i["metadata"]["version"] for i in installs}


def lock_pins(root: Path = REPO) -> dict[str, dict[str, str]]:
    """lock file (repository-relative) -> name -> pinned version, for every `images/*/*.lock`."""
    out = {}
    for lock in sorted(root.glob("images/*/*.lock")):
        pins = dict(re.findall(r"^([A-Za-z0-9][A-Za-z0-9_.-]*)==([^\s\\;]+)", lock.read_text(), re.M))
        out[lock.relative_to(root).as_posix()] = {_norm(k): v for k, v in pins.items()}
    return out


def model_files(model: str, work: Path) -> Path:
    """The MLflow model folder MODEL names (downloaded for a models:/ URI)."""
    if model.startswith("models:/"):
        import mlflow

        return Path(mlflow.artifacts.download_artifacts(artifact_uri=model, dst_path=str(work / "model")))
    path = Path(model)
    if not (path / "requirements.txt").is_file() or not (path / "python_env.yaml").is_file():
        raise ValueError(f"{model}: not an MLflow model folder (no requirements.txt / python_env.yaml)")
    return path


def python_env(folder: Path) -> dict:
    """python_env.yaml's Python and build dependencies, after checking them (ValueError otherwise)."""
    import yaml

    env = yaml.safe_load((folder / "python_env.yaml").read_text()) or {}
    python = str(env.get("python", ""))
    here = f"{sys.version_info.major}.{sys.version_info.minor}"
    if python.rsplit(".", python.count(".") - 1)[0] != here:
        raise ValueError(f"python_env.yaml asks for Python {python!r}; this check runs on {here}")
    build = [str(b) for b in env.get("build_dependencies") or []]
    if env.get("dependencies") != ["-r requirements.txt"]:
        raise ValueError(f"python_env.yaml dependencies {env.get('dependencies')!r} are not "
                         "the requirements file")
    return {"python": python, "build_dependencies": build}


def check(model: str, project_extras: str = "core,store", wheelhouse: Path | None = None) -> dict:
    """Resolve the model's requirements (alone, and with the project's wheel) from `wheelhouse` (built
    here when None); the JSON summary."""
    with tempfile.TemporaryDirectory(prefix="serving-reqs-") as tmp:
        work = Path(tmp)
        folder = model_files(model, work)
        env = python_env(folder)
        reqs = [ln.strip() for ln in (folder / "requirements.txt").read_text().splitlines()
                if ln.strip() and not ln.startswith("#")]
        unpinned = [r for r in reqs if "==" not in r or "+" in r]
        if unpinned:
            raise ValueError(f"requirements not pinned to a public version: {unpinned}")
        house = Path(wheelhouse) if wheelhouse else work / "wheelhouse"
        if not wheelhouse:
            build_wheelhouse(house)
        held = len(list(house.glob("*.whl")))
        alone = resolve(reqs, house, work, "requirements")
        with_project = resolve([*reqs, f"{PROJECT}[{project_extras}]"], house, work, "with_project")
        build = resolve([b for b in env["build_dependencies"] if "==" in b], house, work, "build")
    pins = {_norm(r.split("==")[0]): r.split("==")[1] for r in reqs}
    differences = {lock: {n: {"model": alone[n], "lock": v} for n, v in locked.items()
                          if n in alone and alone[n].split("+")[0] != v}
                   for lock, locked in lock_pins().items()}
    return {"model": model, "python": env["python"], "requirements": pins,
            "resolved": {"requirements": len(alone), "with_project": len(with_project),
                         "build_dependencies": len(build)},
            "pins_kept": all(alone.get(n, "").split("+")[0] == v for n, v in pins.items()),
            "wheelhouse": held, "lock_differences": {k: v for k, v in differences.items() if v}}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="MLflow model folder or models:/ URI")
    ap.add_argument("--project-extras", default="core,store",
                    help="extras of the project's wheel (with_project)")
    ap.add_argument("--report", help="also write the JSON summary here")
    args = ap.parse_args(argv)
    try:
        out = check(args.model, args.project_extras)
    except ValueError as e:
        print(f"serving_requirements: {e}", file=sys.stderr)
        return 2
    except Refused as e:
        print(f"serving_requirements: {e}", file=sys.stderr)
        return 1
    text = json.dumps(out, indent=1, sort_keys=True)
    if args.report:
        Path(args.report).write_text(text + "\n")
    print(text)
    return 0 if out["pins_kept"] else 1


if __name__ == "__main__":
    sys.exit(main())
