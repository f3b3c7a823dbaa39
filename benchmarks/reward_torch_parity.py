"""The same reward models scored on two builds of the reward venvs' shared torch: how far the scores move.

    .venv/bin/python benchmarks/reward_torch_parity.py --a .reward-envs --b /path/to/other-reward-envs \
        [--python-a .venv/bin/python --python-b .image-envs/eval/bin/python]

Each scorer's random-weight model (`chunkgrpo.testing.tiny_scorers`, the package's own classes) is built once
in root A's venv; the same files, images and prompts are then scored through the worker in root A's venv and
in root B's (the same locked packages, another torch/torchvision). Prints one JSON object: per scorer the
torch and torchvision each side ran, the scores of both, and the largest absolute and relative difference.
CLIP and PickScore, which run in the main environment (the eval image's sees the shared torch venv), are
scored in-process by each of `--python-a` / `--python-b` (interpreters with chunkgrpo importable) on one
random-weight tiny CLIP (`chunkgrpo.testing.clip`).
Nothing in either root is written to (no bytecode either).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _images(n: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    sizes = [(48, 40), (64, 64), (30, 90), (300, 200), (512, 128), (224, 224)]
    out = []
    for i in range(n):
        h, w = sizes[i % len(sizes)]
        y, x = np.mgrid[0:h, 0:w]
        arr = np.stack([x * 255 // max(w - 1, 1), y * 255 // max(h - 1, 1), np.full_like(x, 40 * i)], -1)
        out.append(Image.fromarray((arr + rng.integers(-30, 30, arr.shape)).clip(0, 255).astype(np.uint8)))
    return out


_IN_PROCESS = """
import json, sys
sys.path.insert(0, sys.argv[1])
import torch, numpy as np
from PIL import Image
from chunkgrpo.scoring import scorers as S
from benchmarks.reward_torch_parity import _images
name, weights, n = sys.argv[2], sys.argv[3], int(sys.argv[4])
prompts = json.loads(sys.argv[5])
with S.get_scorer(name, weights=weights, device="cpu", batch_size=n, venv="") as sc:
    out = sc.score(_images(n), prompts)
print(json.dumps({"torch": torch.__version__, "scores": [float(x) for x in out.double()]}))
"""


def _compare(row: dict, a: list[float], b: list[float]) -> None:
    import torch

    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    diff = (ta - tb).abs()
    row["max_abs_diff"] = float(diff.max())
    row["max_rel_diff"] = float((diff / ta.abs().clamp_min(1e-12)).max())
    row["identical"] = bool(torch.equal(ta, tb))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--a", required=True, help="reward-envs root A (builds the tiny models)")
    ap.add_argument("--b", required=True, help="reward-envs root B")
    ap.add_argument("--scorers", default="hpsv2.1,imagereward,hpsv3")
    ap.add_argument("--images", type=int, default=4)
    ap.add_argument("--python-a", help="interpreter A for CLIP / PickScore in-process (default: skip them)")
    ap.add_argument("--python-b", help="interpreter B for CLIP / PickScore in-process")
    args = ap.parse_args()
    os.environ["PYTHONDONTWRITEBYTECODE"] = "1"  # the workers inherit it

    from chunkgrpo.scoring import client as WC
    from chunkgrpo.scoring import scorers as S

    roots = {"a": Path(args.a).resolve(), "b": Path(args.b).resolve()}
    images = _images(args.images)
    prompts = ["a photo of a cat", "a red dog on a green chair", "the blue cat", "a photo of a cat",
               "a yellow car", "two birds"][: args.images]
    result: dict = {"roots": {k: str(v) for k, v in roots.items()}, "images": args.images,
                    "cpu": platform.processor() or platform.machine(), "scorers": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in [s.strip() for s in args.scorers.split(",") if s.strip()]:
            pkg = name.split(".")[0]
            venvs = {k: root / f"venv-{pkg}" for k, root in roots.items()}
            out = WC.run_module(venvs["a"], "chunkgrpo.testing.tiny_scorers", [pkg, str(Path(tmp) / pkg)],
                                timeout=3600)
            tiny = json.loads(out.strip().splitlines()[-1])
            cfg = {"weights": str(Path(tiny["weights"]).parent)}
            cfg.update({k: tiny[k] for k in ("model_config", "processor") if k in tiny})
            if "hf_home" in tiny:
                os.environ["HF_HOME"] = tiny["hf_home"]
            row: dict = {}
            scores = {}
            for side, venv in venvs.items():
                S._CHECKED.clear()
                opts = {"device": "cpu", "batch_size": len(images), "venv": str(venv), **cfg}
                with S.get_scorer(name, **opts) as scorer:
                    scores[side] = scorer.score(images, prompts[: len(images)]).double()
                    rt = scorer.info["runtime"]
                    row[side] = {"torch": rt.get("torch"), "torchvision": rt.get("torchvision"),
                                 "scores": [round(float(x), 8) for x in scores[side]]}
            _compare(row, scores["a"].tolist(), scores["b"].tolist())
            result["scorers"][name] = row
            os.environ.pop("HF_HOME", None)
        if args.python_a and args.python_b:
            import subprocess

            from chunkgrpo.testing.clip import make_tiny_clip

            clip = make_tiny_clip(Path(tmp) / "tiny-clip")
            for name in ("clip", "pickscore"):
                row = {}
                for side, py in (("a", args.python_a), ("b", args.python_b)):
                    res = subprocess.run(
                        [py, "-c", _IN_PROCESS, str(REPO), name, str(clip), str(len(images)),
                         json.dumps(prompts[: len(images)])],
                        capture_output=True, text=True, check=True, cwd="/", timeout=600)
                    row[side] = {"python": py, **json.loads(res.stdout.strip().splitlines()[-1])}
                _compare(row, row["a"]["scores"], row["b"]["scores"])
                result["scorers"][name] = row
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
