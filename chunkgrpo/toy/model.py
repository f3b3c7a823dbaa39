"""The toy base model: a small FLUX (real diffusers/transformers classes) pretrained on toy scenes.

    folder = build_toy_model("models/toy", ToyModelConfig())      # `chunkgrpo toy-model --out DIR`

The folder is a diffusers `FluxPipeline` folder that `chunkgrpo.flux.load_flux` loads unchanged:

* **VAE** — `AutoencoderKL` with two blocks (latent 16×16×3 for a 32×32 image, 64 transformer tokens),
  weights set in closed form so that encode(x) = (mean over each 2×2 cell − m) / s per RGB channel and
  decode is its inverse followed by nearest ×2 up-sampling: exact on the world's 2×2-pixel cells
  (cell-space flow matching through the real class). Residual branches are zeroed (the ResNet blocks are
  identities) and the final GroupNorm+SiLU is made linear: each group holds (x, −x, K, −K), so its mean
  is 0 and its std ≈ K/√2 independent of x (relative error x²/2K² < 1e-6 for K = 1000), and a bias of +20
  puts the SiLU in its linear regime (error < 1e-7). Round trip error < 1/255 (tested).
* **Text encoders** — small CLIP and T5 trained jointly with the transformer during pretraining
  (`train_text`; frozen afterwards, like any FLUX's), tokenizers built locally from the world's
  vocabulary (one token per word).
* **Transformer** — `FluxTransformer2DModel` (default ~0.5 M parameters), pretrained by rectified
  flow matching (x_σ = (1−σ)x₀ + σε, target v = ε − x₀, σ = shift₃(u), u ~ U(0,1)) on category-balanced
  training scenes for a fixed number of optimizer steps, with an EMA of the weights saved.

Deliberately small and short: 3000 steps of 32 scenes with 2 threads (about 4.5 minutes on 2 quiet cores)
give a model that draws recognisable single objects (held-out accuracy ≈ 0.6) and is weak at counting,
positions and colour attribution (≈ 0.0–0.2), which leaves room for RL.

The parts live in `toy/config.py` (the config), `toy/components.py` (VAE, tokenizers, encoders,
transformer), `toy/pretrain.py` (the pretraining loop) and `toy/sampling.py` (sampling, accuracy, the
samples grid); this module writes and caches the folder.

Caching: the content hash covers the config and the source of `world.py` and of the modules above;
`build_toy_model` returns at once when `out` already holds that hash, copies from
`<cache>/toy-models/<hash>` when another call built it, and refuses to overwrite a non-empty folder that
is not a toy model.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np

from chunkgrpo.errors import UserError
from chunkgrpo.toy.components import build_components
from chunkgrpo.toy.config import FORMAT, META_FILE, ToyModelConfig
from chunkgrpo.toy.pretrain import pretrain
from chunkgrpo.toy.sampling import accuracy, heldout_error, samples_grid, sampling_config

__all__ = ["META_FILE", "ToyModelConfig", "build_toy_model", "model_key", "read_meta", "write_folder"]
RL_PER_CATEGORY = 24  # prompts per GenEval category in toy/train_prompts.txt
# the modules whose code determines the model (its weights and the folder's files), by name
MODEL_CODE = ("world.py", "config.py", "components.py", "pretrain.py", "sampling.py", "model.py")


def code_fingerprint(path: Path) -> str:
    """The code of a module as the model build sees it: its syntax tree without docstrings, line numbers or
    comments (`ast.dump`), so moving imports' layout, rewrapping comments or reformatting a statement keeps
    the key, while any change to what runs (a constant, an expression, an imported name) changes it."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body
                and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant)
                and isinstance(body[0].value.value, str)):
            node.body = body[1:] or [ast.Pass()]
    return ast.dump(tree, include_attributes=False)


def model_key(cfg: ToyModelConfig) -> str:
    """Content hash: the config and the code that determines the model (`MODEL_CODE`, by
    `code_fingerprint`: docstrings, comments and layout do not count)."""
    h = hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode())
    for f in (Path(__file__).parent / name for name in MODEL_CODE):
        h.update(f.name.encode())
        h.update(code_fingerprint(f).encode())
    return h.hexdigest()[:16]



def read_meta(path: str | os.PathLike) -> dict | None:
    f = Path(path) / META_FILE
    if not f.exists():
        return None
    try:
        return json.loads(f.read_text())
    except json.JSONDecodeError:
        return None


def _cache_root(cache_dir: str | os.PathLike | None) -> Path:
    from chunkgrpo.store.cache import cache_root

    return cache_root(cache_dir) / "toy-models"


def _build(cfg: ToyModelConfig, out: Path, key: str, progress: bool) -> None:
    """Pretrain and write the folder `out` (which must not exist)."""
    with tempfile.TemporaryDirectory() as tmp:
        pipe = build_components(cfg, Path(tmp))
        stats = pretrain(pipe, cfg, progress=progress)
        write_folder(pipe, cfg, out, key, stats)


def write_folder(pipe, cfg: ToyModelConfig, out: Path, key: str, stats: dict) -> None:
    """Save the pretrained pipeline as a toy model folder: the diffusers folder, the world's prompt files,
    the samples grid and `toy_model.json` (with the base model's held-out accuracy)."""
    import torch

    from chunkgrpo.flux import FluxModel, quiet_library_progress
    from chunkgrpo.toy.world import World, write_metadata, write_prompts

    quiet_library_progress()
    pipe.save_pretrained(out)
    world = World(cfg.seed, cfg.size)
    data = out / "toy"
    train = world.prompts("train")
    heldout = world.eval_prompts(cfg.eval_per_category or 16, "heldout")
    write_metadata(heldout, data / "heldout_metadata.jsonl")
    write_prompts([md["prompt"] for md in heldout], data / "heldout_prompts.txt")
    write_metadata(
        world.eval_prompts(cfg.eval_per_category or 16, "train"), data / "train_eval_metadata.jsonl"
    )
    write_metadata(
        [md for mds in world.prompts("heldout").values() for md in mds], data / "heldout_all.jsonl"
    )
    # RL training prompts, category-balanced: RL_PER_CATEGORY per category (a fixed sample of the large
    # categories, the small ones repeated), so no category dominates the policy gradient
    rl = []
    rng = np.random.default_rng(cfg.seed)
    for mds in train.values():
        if len(mds) >= RL_PER_CATEGORY:
            rl += [
                mds[i]["prompt"] for i in sorted(rng.choice(len(mds), size=RL_PER_CATEGORY, replace=False))
            ]
        else:
            rl += [mds[i % len(mds)]["prompt"] for i in range(RL_PER_CATEGORY)]
    write_prompts(rl, data / "train_prompts.txt")
    (data / "split.json").write_text(json.dumps(world.split.to_dict(), indent=1))
    pipe_dtype = torch.float32
    model = FluxModel(pipe, device=torch.device("cpu"), dtype=pipe_dtype, source=str(out), path=str(out))
    sampling = sampling_config(cfg)
    samples_grid(model, world, sampling, out / "samples.png")
    base = None
    if cfg.eval_per_category and cfg.eval_samples:
        t0 = time.perf_counter()
        base = accuracy(
            model, world.eval_prompts(cfg.eval_per_category, "heldout"), cfg.eval_samples, sampling
        )
        base = {
            "overall": base["overall"],
            "partial": base["partial"],
            "tasks": {k: v["score"] for k, v in base["tasks"].items()},
            "n_images": base["n_images"],
            "sampling": sampling.to_dict(),
            "eval_s": round(time.perf_counter() - t0, 2),
        }
    stats["heldout_error"] = heldout_error(model, world, max_sequence_length=cfg.max_sequence_length)
    meta = {
        "format": FORMAT,
        "key": key,
        "config": cfg.to_dict(),
        "pretraining": stats,
        "base_accuracy": base,
        "files": {
            "train_prompts": "toy/train_prompts.txt",
            "heldout_metadata": "toy/heldout_metadata.jsonl",
            "heldout_prompts": "toy/heldout_prompts.txt",
            "train_eval_metadata": "toy/train_eval_metadata.jsonl",
            "samples": "samples.png",
        },
    }
    (out / META_FILE).write_text(json.dumps(meta, indent=1))


def build_toy_model(out: str | os.PathLike, cfg: ToyModelConfig | None = None, *, cache_dir=None,
                    progress: bool = True) -> Path:
    """The pretrained toy model folder at `out` (see the module docstring for the cache rules)."""
    cfg = cfg or ToyModelConfig()
    out = Path(out).expanduser()
    key = model_key(cfg)
    meta = read_meta(out)
    if meta is not None and meta.get("key") == key:
        return out
    if out.exists() and (not out.is_dir() or (meta is None and any(out.iterdir()))):
        raise UserError(
            f"--out {str(out)!r} exists and is not a toy model folder; choose an empty or new folder"
        )
    cached = _cache_root(cache_dir) / key
    if read_meta(cached) is None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=cached.parent))
        try:
            shutil.rmtree(staging)
            _build(cfg, staging, key, progress)
            if read_meta(cached) is None:  # another process may have finished first
                if cached.exists():
                    shutil.rmtree(cached)
                staging.rename(cached)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(cached, staging)
    if out.exists():
        shutil.rmtree(out)
    staging.rename(out)
    return out