"""What building the images' environments costs on a plain machine (CI): per image, the seconds of
`bash scripts/image-env.sh IMAGE` and the venv's size on disk.

    .venv/bin/python benchmarks/image_envs.py                # the up-to-date check (every env built)
    .venv/bin/python benchmarks/image_envs.py --fresh        # rebuild each env from scratch first (minutes)

A fresh build downloads every locked wheel once (pip's cache keeps them for the next build); the
up-to-date check reads package metadata only. Prints one line per image and the load average.
"""

import argparse
import os
import shutil
import subprocess
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
IMAGES = ("runtime", "eval", "launcher")


def size(path: Path) -> int:
    return sum(p.lstat().st_size for p in path.rglob("*") if p.is_file() and not p.is_symlink())


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fresh", action="store_true", help="remove each env first")
    args = ap.parse_args()
    root = Path(os.environ.get("CHUNKGRPO_IMAGE_ENVS") or REPO / ".image-envs")
    for image in IMAGES:
        if args.fresh:
            shutil.rmtree(root / image, ignore_errors=True)
        t0 = time.perf_counter()
        r = subprocess.run(["bash", str(REPO / "scripts" / "image-env.sh"), image], capture_output=True,
                           text=True)
        took = time.perf_counter() - t0
        if r.returncode:
            print(f"{image}: failed: {r.stderr.strip().splitlines()[-1:]}")
            return 1
        print(f"{image}: {took:.1f} s ({'fresh' if args.fresh else 'check'}), "
              f"{size(root / image) / 2**30:.2f} GiB")
    print(f"load average: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
