"""What a pytest run leaves in the temp folder: runs pytest on the given test files (or node ids) with
TMPDIR pointed at a fresh empty folder, then counts every entry left in it, grouped by name prefix.

    python benchmarks/tmp_leaks.py tests/pipeline/test_local_run.py [--pytest-args "-n 0"] [--out F.json]

Counted: the folder's own top-level entries (pytest's basetemp folder `pytest-of-<user>` aside), the
entries left behind in the test session's own TMPDIR (each `<basetemp>/tmp` folder,
tests/session_tmpdir.py), and, for the local runs the tests made (any `.chunkgrpo` home under the
folder), the entries of the folders standing for the tasks' pod volumes (`pod-volumes/*`, kept between
plain runs, and a pod-faithful run's `pods/run-*/<task>/*`) other than the caches (`chunkgrpo`,
`inductor`, `xdg`, `huggingface`, torch's per-user inductor cache, dotfiles). Prints one JSON object;
the fresh folder is removed afterwards unless `--keep`.
"""

import argparse
import collections
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from getpass import getuser
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_TAIL = re.compile(r"[A-Za-z0-9_]{8}(\.[a-z]+)?")  # tempfile's 8 random characters (+ an extension)


def kind(name: str) -> str:
    """The name without its random or numbered tail: `chunkgrpo-train-a1b2c3d4` -> `chunkgrpo-train`,
    `tmpab12cd34` -> `tmp`."""
    if name.startswith("tmp") and _TAIL.fullmatch(name[3:]):  # tempfile's default prefix
        return "tmp"
    if re.fullmatch(r"tmp\.[A-Za-z0-9]{10}", name):  # `mktemp -d`: kfp's folder of a task's program
        return "tmp.*"
    parts = re.split(r"([-_.])", name)
    for i in range(0, len(parts), 2):
        rest = "".join(parts[i:])
        if re.search(r"\d", parts[i]) or (i and _TAIL.fullmatch(rest)):
            head = "".join(parts[:i]).rstrip("-_.")
            return head or re.match(r"[A-Za-z]*", name).group(0) or name
    return name


def leftovers(folder: Path) -> dict:
    """{"top": [names], "session": [names]}: top-level entries besides pytest's basetemp folder, and the
    entries of every per-session TMPDIR (`<basetemp>/tmp`) under it."""
    top = sorted(p.name for p in folder.iterdir() if not p.name.startswith("pytest-of-"))
    bases = [b for b in folder.glob("pytest-of-*/pytest-*") if not b.is_symlink()]  # not pytest-current
    session = sorted(p.name for base in bases for tmp in [base / "tmp", *base.glob("popen-gw*/tmp")]
                     if tmp.is_dir() for p in tmp.iterdir())
    caches = {"chunkgrpo", "inductor", "xdg", "huggingface", "torch", "triton", "torchinductor_" + getuser(),
              "sitecustomize.py"}  # the last: a pod-faithful run's audit hook
    vols = [*folder.glob("**/.chunkgrpo/pod-volumes/*"), *folder.glob("**/.chunkgrpo/pods/run-*/*/*")]
    volumes = sorted(str(p.relative_to(folder)) for v in vols if v.is_dir() for p in v.iterdir()
                     if p.name not in caches and not p.name.startswith("."))
    return {"top": top, "session": session, "volumes": volumes}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("tests", nargs="+")
    ap.add_argument("--pytest-args", default="-n 0")
    ap.add_argument("--keep", action="store_true", help="keep the fresh TMPDIR folder")
    ap.add_argument("--out", default="")
    args = ap.parse_args(argv)
    fresh = Path(tempfile.mkdtemp(prefix="tmp-leaks-"))
    try:
        env = {**os.environ, "TMPDIR": str(fresh)}
        t0 = time.perf_counter()
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            *args.pytest_args.split(), *args.tests], cwd=ROOT, env=env)
        found = leftovers(fresh)
        result = {"tests": args.tests, "pytest_exit": r.returncode, "wall_s": round(time.perf_counter() - t0),
                  "entries_top": len(found["top"]), "entries_session": len(found["session"]),
                  "by_kind": dict(collections.Counter(map(kind, found["top"] + found["session"]))),
                  "entries_volumes": len(found["volumes"]),
                  "volumes_by_kind": dict(collections.Counter(kind(Path(v).name) for v in found["volumes"])),
                  "names": found}
        print(json.dumps(result, indent=1))
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
        return 0
    finally:
        if args.keep:
            print(f"kept {fresh}", file=sys.stderr)
        else:
            shutil.rmtree(fresh, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
