"""Per-image scorer latency on the random-weight models, through the real packages and the worker boundary.

    bash scripts/reward-envs.sh && .venv/bin/python benchmarks/scorer_latency.py
    .venv/bin/python benchmarks/scorer_latency.py --scorers hpsv2.1,clip --images 16 --batch 8 --res 1024

For each scorer: build its random-weight model with the package's own classes
(`chunkgrpo.testing.tiny_scorers`, in the reward venv), start its worker, score one warm-up batch, then time
`--images` images of `--res`x`--res` in batches of `--batch`. Prints one JSON object: per scorer the
worker start + model load time, seconds per image, the venv, the model class, and for CLIP/PickScore the
same scorer in-process (so the pipe overhead is visible). The models are reduced where the real ones do
not fit a CPU run (hpsv2: 2-layer ViT/text towers of width 64; hpsv3: a 2-layer Qwen2-VL; ImageReward keeps
its hard-coded BLIP ViT-L with a 2-layer BERT): these numbers measure preprocessing + plumbing + small
models, not the production models' FLOPs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _venv(name: str) -> Path | None:
    from chunkgrpo.scoring import client as WC

    var = WC.venv_var(name)
    root = Path(os.environ.get("CHUNKGRPO_REWARD_ENVS") or REPO / ".reward-envs")
    venv = Path(os.environ[var]) if os.environ.get(var) else root / f"venv-{name.split('.')[0]}"
    return venv if (venv / "bin" / "python").is_file() else None


def _images(n: int, res: int):
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(0)
    return [Image.fromarray(rng.integers(0, 255, (res, res, 3), dtype=np.uint8)) for _ in range(n)]


def _time(scorer, images, prompts, batch: int) -> float:
    scorer.score(images[:batch], prompts[:batch])  # warm-up
    t0 = time.perf_counter()
    scorer.score(images, prompts)
    return (time.perf_counter() - t0) / len(images)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--scorers", default="hpsv2.1,imagereward,hpsv3,pickscore,clip")
    ap.add_argument("--images", type=int, default=8)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--res", type=int, default=512)
    args = ap.parse_args()

    from chunkgrpo.scoring import client as WC
    from chunkgrpo.scoring import scorers as S
    from chunkgrpo.testing.clip import make_tiny_clip

    images = _images(args.images, args.res)
    prompts = [f"a photo of a cat number {i}" for i in range(args.images)]
    result: dict = {
        "images": args.images,
        "batch": args.batch,
        "res": args.res,
        "cpu": platform.processor() or platform.machine(),
        "threads": os.cpu_count(),
        "load_average": os.getloadavg(),
        "scorers": {},
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in [s.strip() for s in args.scorers.split(",") if s.strip()]:
            row: dict = {}
            try:
                if name in ("clip", "pickscore"):
                    clip_dir = make_tiny_clip(Path(tmp) / f"tiny-{name}")
                    local = S.get_scorer(
                        name, weights=str(clip_dir), device="cpu", batch_size=args.batch, venv=""
                    )
                    row["in_process_s_per_image"] = _time(local, images, prompts, args.batch)
                    cfg, venv, env = {"weights": str(clip_dir)}, Path(sys.prefix), {}
                else:
                    pkg = name.split(".")[0]
                    venv = _venv(name)
                    if venv is None:
                        row["skipped"] = f"no venv for {name}: run `bash scripts/reward-envs.sh`"
                        result["scorers"][name] = row
                        continue
                    out = WC.run_module(venv, "chunkgrpo.testing.tiny_scorers", [pkg, str(Path(tmp) / pkg)],
                                        timeout=3600)
                    tiny = json.loads(out.strip().splitlines()[-1])
                    cfg = {"weights": str(Path(tiny["weights"]).parent)}
                    cfg.update({k: tiny[k] for k in ("model_config", "processor") if k in tiny})
                    env = {"HF_HOME": tiny["hf_home"]} if "hf_home" in tiny else {}
                old = {k: os.environ.get(k) for k in env}
                os.environ.update(env)
                try:
                    t0 = time.perf_counter()
                    scorer = S.get_scorer(name, device="cpu", batch_size=args.batch, venv=str(venv), **cfg)
                    row["start_and_load_s"] = time.perf_counter() - t0
                    row["s_per_image"] = _time(scorer, images, prompts, args.batch)
                    info = scorer.info
                    row.update(
                        venv=info["venv"],
                        model_class=info["runtime"].get("model_class"),
                        package_version=info["runtime"].get("package_version"),
                        torch=info["runtime"].get("torch"),
                    )
                    scorer.close()
                finally:
                    for k, v in old.items():
                        os.environ.pop(k, None) if v is None else os.environ.__setitem__(k, v)
            except Exception as e:  # report and go on with the next scorer
                row["error"] = f"{type(e).__name__}: {e}"
            result["scorers"][name] = row
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
