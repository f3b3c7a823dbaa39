"""Reward / preference scorers behind one batch API.

    scorer = get_scorer("pickscore", weights="/models/PickScore_v1",
                        processor="/models/CLIP-ViT-H-14-laion2B")
    scores = scorer.score(images, prompts)      # float32 tensor, shape (n,), on CPU
    scorer.info                                 # name, model, weights, preprocessing, scale, backend, ...
    scorer.close()                              # stops its worker process, if any

Names: `hpsv3`, `imagereward`, `hpsv2.1` (and `hpsv2` = v2.0), `pickscore`, `clip`, with their aliases in
`chunkgrpo.scoring.table`.

Scales (what `score` returns; recorded in `info["scale"]`):
- pickscore : `logit_scale.exp() * cos(text, image)`, the raw PickScore logit as reported in papers
              (logit_scale.exp() is read from the checkpoint, 100.0 for PickScore_v1; FLUX ~ 22-23). Not the
              Flow-GRPO `/26` or MixGRPO `(s-18)/8` training normalisations.
- clip      : plain cosine of L2-normalised CLIP embeddings (x `multiplier`, default 1.0), the
              DanceGRPO / MixGRPO / GCPO convention Chunk-GRPO compares against (~0.2-0.4). Use
              `multiplier=100` for the torchmetrics "CLIPScore" convention (without its max(.,0)).
- hpsv2.1   : cosine of HPSv2.1's L2-normalised open_clip ViT-H-14 features, as `hpsv2.score` returns
              (~0.2-0.37; the HPSv2 benchmark prints x100).
- hpsv3     : mu (column 0) of HPSv3's predicted (mu, sigma), ~10-11 for FLUX.1-dev.
- imagereward: ImageReward's standardised reward ((r - 0.1672) / 1.0333), ~N(0,1) over its data.

Where a scorer runs. HPSv2, HPSv3 and ImageReward need their own packages (`hpsv2`, `hpsv3`,
`image-reward`), whose pins conflict with the main stack, so each has its own venv (built by
`scripts/reward-envs.sh`, or `/opt/venv-*` in the evaluation image). With `$CHUNKGRPO_VENV_<NAME>` set
(HPSV2 for hpsv2 and hpsv2.1, IMAGEREWARD, HPSV3; optionally PICKSCORE, CLIP) or `venv=` given, the
scorer starts `<venv>/bin/python -m chunkgrpo.scoring.worker <name>` once, which loads the model once and
scores batches streamed over pipes (`chunkgrpo.scoring.client`): a per-batch timeout, restart of a
crashed worker (the batch is retried), and errors that name the venv and quote the worker's log.
Without a venv the same backend code (`chunkgrpo.scoring.backends`) runs in-process. CLIP and PickScore
run on `transformers` CLIPModel; their preprocessing is PIL + torch (`ClipPreprocess`; no torchvision).

Weights always come from a local directory/file or an `s3://` prefix (downloaded through the store's
cache, in this process, before a worker starts: `chunkgrpo.scoring.weights`); hub ids are never resolved
(`HF_HUB_OFFLINE=1`).
"""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any, Callable, Sequence

import numpy as np
from PIL import Image

from chunkgrpo.config import Config, option
from chunkgrpo.errors import UserError
from chunkgrpo.scoring import backends as B
from chunkgrpo.scoring import client as WC
from chunkgrpo.scoring import worker as W
from chunkgrpo.scoring.client import ScorerWorkerError
from chunkgrpo.scoring.table import ALIASES, PACKAGE_SCORERS, SCORERS, canonical_name
from chunkgrpo.scoring.weights import Fetch, resolve_weights
from chunkgrpo.store.cache import cache_root

EVAL_IMAGE_HINT = "the evaluation image (images/eval)"


class ScorerError(RuntimeError):
    """A scorer produced something unusable (e.g. non-finite scores)."""


# --------------------------------------------------------------------------------------------------
# configuration


@dataclasses.dataclass
class ScorerConfig(Config):
    """How to build one scorer (`get_scorer(**cfg.to_dict())`)."""

    name: str = option("pickscore", "scorer name: hpsv3, imagereward, hpsv2.1, hpsv2, pickscore, clip")
    weights: str | None = option(
        None,
        "local directory/file or s3:// prefix with the scorer weights (hpsv2.1: the .pt file or its folder; "
        "hpsv3: folder with HPSv3.safetensors; imagereward: folder with ImageReward.pt + med_config.json; "
        "pickscore/clip: a transformers CLIP folder). Hub ids are never downloaded.",
    )
    processor: str | None = option(
        None,
        "pickscore/clip: folder (or s3:// prefix) with tokenizer + preprocessor_config.json when they are "
        "not in `weights` (PickScore_v1 uses laion/CLIP-ViT-H-14-laion2B-s32B-b79K's processor); "
        "hpsv3: local Qwen2-VL-7B-Instruct folder (base model); imagereward: the bert-base-uncased tokenizer "
        "folder (vocab.txt, tokenizer_config.json, config.json), installed into the HF cache under that name",
    )
    device: str = option("auto", "torch device: auto (cuda if available), cpu, cuda, cuda:1 ...")
    dtype: str = option("float32", "model dtype for pickscore/clip: float32, bfloat16, float16")
    batch_size: int = option(16, "images per forward pass (and per request to a worker)")
    cache_dir: str | None = option(None, "where s3:// weights are downloaded (default $CHUNKGRPO_CACHE, else "
                                         "~/.cache/chunkgrpo)")
    multiplier: float = option(
        1.0, "clip only: multiply the cosine by this (1.0 = plain cosine, 100 = torchmetrics)"
    )
    model_config: str | None = option(
        None,
        "hpsv2/hpsv2.1 only: an open_clip model-config JSON to build instead of ViT-H-14 (its file name "
        "is the architecture name; e.g. a reduced model for tests)",
    )
    venv: str | None = option(
        None, "venv whose python runs this scorer in a worker process (default: $CHUNKGRPO_VENV_<NAME>, e.g. "
              "CHUNKGRPO_VENV_HPSV3; \"\" = in-process even when that variable is set)")
    timeout: float = option(600.0, "worker only: seconds one batch may take before the worker is stopped")
    load_timeout: float = option(
        1800.0, "worker only: seconds the worker may take to import its package and load the model"
    )
    restarts: int = option(
        2, "worker only: times a crashed worker is restarted (and the batch retried) before failing"
    )

    def __post_init__(self) -> None:
        self.name = canonical_name(self.name)
        if self.batch_size < 1:
            raise UserError(f"scorer batch_size={self.batch_size} must be >= 1")
        if self.dtype not in _DTYPES:
            raise UserError(f"scorer dtype={self.dtype!r} is not one of {sorted(_DTYPES)}")
        if self.multiplier <= 0:
            raise UserError(f"scorer multiplier={self.multiplier} must be > 0")
        if self.multiplier != 1.0 and self.name != "clip":
            raise UserError(
                f"multiplier={self.multiplier} only applies to the 'clip' scorer, not {self.name!r}"
            )
        if self.model_config and not self.name.startswith("hpsv2"):
            raise UserError(
                f"model_config={self.model_config!r} only applies to hpsv2/hpsv2.1, not {self.name!r}"
            )
        if not self.timeout > 0 or not self.load_timeout > 0:
            raise UserError(
                f"scorer timeout={self.timeout} and load_timeout={self.load_timeout} must be > 0 seconds"
            )
        if self.restarts < 0:
            raise UserError(f"scorer restarts={self.restarts} must be >= 0")


_DTYPES = {"float32", "bfloat16", "float16"}


# --------------------------------------------------------------------------------------------------
# helpers: images and prompts


def to_pil_list(images: Any) -> list[Image.Image]:
    """Accept a list of PIL images / HWC uint8 arrays, or a float tensor (n,3,H,W) in [0,1]; return RGB
    PILs."""
    try:
        import torch
    except ImportError:  # pragma: no cover - torch is always present where scorers run
        torch = None
    if torch is not None and isinstance(images, torch.Tensor):
        if images.ndim != 4 or images.shape[1] != 3:
            raise UserError(f"image tensor must be (n,3,H,W) in [0,1], got shape {tuple(images.shape)}")
        arr = (
            (images.detach().float().clamp(0, 1) * 255)
            .round()
            .to(torch.uint8)
            .permute(0, 2, 3, 1)
            .cpu()
            .numpy()
        )
        return [Image.fromarray(a) for a in arr]
    out = []
    for i, im in enumerate(images):
        if isinstance(im, Image.Image):
            out.append(im if im.mode == "RGB" else im.convert("RGB"))
        elif isinstance(im, np.ndarray) and im.ndim == 3 and im.dtype == np.uint8:
            out.append(Image.fromarray(im).convert("RGB"))
        else:
            raise UserError(
                f"images[{i}] is a {type(im).__name__}; expected a PIL image or an HWC uint8 array"
            )
    return out


def _check_pairs(images: Sequence, prompts: Sequence[str]) -> None:
    if isinstance(prompts, str):
        raise UserError("prompts must be a list of strings (one per image), not a single string")
    if len(images) != len(prompts):
        raise UserError(f"got {len(images)} images but {len(prompts)} prompts; pass one prompt per image")


def require_package(module: str, scorer: str, pip_spec: str) -> Any:
    """Import an evaluation-image-only package, or raise an actionable UserError.

    For the reward-package scorers (hpsv2, hpsv2.1, imagereward, hpsv3) this is the package preflight:
    with a venv configured for the scorer the check runs in that venv (and None is returned); in-process
    it also checks what the packages need besides weights (hpsv2's BPE vocabulary, ImageReward's
    bert-base-uncased tokenizer in the HF cache)."""
    key = str(scorer).strip().lower()
    key = ALIASES.get(key, key)
    if key in PACKAGE_SCORERS:
        check_scorer_package(key)
        return importlib.import_module(module) if WC.venv_for(key) is None else None
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise UserError(
            f"scorer {scorer!r} needs the `{module}` package, which is not importable here ({e}). "
            f"It lives only in {EVAL_IMAGE_HINT} because its pins conflict with the training stack: "
            "run this scorer there, "
            f"or `pip install {pip_spec}` in a separate venv (never the main one)."
        ) from None


_CHECKED: set[tuple[str, str]] = set()


def check_scorer_package(name: str, venv: str | None = None, *, processor: bool = False) -> None:
    """Preflight for a reward-package scorer, before any weights are read: its package imports (in its
    venv when one is configured) and the files it expects besides weights are there. UserError otherwise.
    `processor`: a tokenizer folder is given (ImageReward's BERT tokenizer is then installed into the HF
    cache at load, so its absence from the cache is not a problem)."""
    name = canonical_name(name)
    if name not in PACKAGE_SCORERS:
        return
    path = WC.venv_for(name, venv)
    key = (name, str(path), processor)
    if key in _CHECKED:
        return
    if path is None:
        module = B.PACKAGES[name][0]
        try:
            importlib.import_module(module)
        except ImportError as e:
            var = WC.venv_var(name)
            raise UserError(
                f"scorer {name!r} needs the `{module}` package, which is not importable here ({e}). Its pins "
                f"conflict with the training stack, so it runs in its own venv: set {var} to one "
                f"(build them with `bash scripts/reward-envs.sh`; "
                f"{EVAL_IMAGE_HINT} has them at /opt/venv-*), or "
                f"`pip install {SCORERS[name].pip}` in a separate venv (never the main one)."
            ) from None
        except FileNotFoundError as e:  # hpsv2 without its vocabulary fails like this at import
            raise UserError(B._HPSV2_VOCAB_HINT.format(err=e)) from None
        problems = B.check(name)
    else:
        problems, _ = WC.check(name, path)
        problems = [f"{p} [venv {path}]" for p in problems]
    if processor and name == "imagereward":
        problems = [p for p in problems if "bert-base-uncased" not in p]
    if problems:
        raise UserError("; ".join(problems))
    _CHECKED.add(key)


# --------------------------------------------------------------------------------------------------
# scorers


class Scorer:
    """Base class: `score(images, prompts) -> torch.FloatTensor (n,)` on CPU; `info` describes it.

    Scores are checked: a backend that returns the wrong count or a non-finite value raises `ScorerError`
    naming the scorer, the images and their prompts."""

    name: str = ""
    batch_size: int = 16

    def score(self, images: Sequence[Image.Image], prompts: Sequence[str]):
        import torch

        _check_pairs(images, prompts)
        images = to_pil_list(images)
        prompts = list(prompts)
        if not images:
            return torch.zeros(0, dtype=torch.float32)
        out = []
        for i in range(0, len(images), self.batch_size):
            with torch.inference_mode():
                s = self._score_batch(images[i : i + self.batch_size], prompts[i : i + self.batch_size])
            out.append(torch.as_tensor(np.asarray(s) if not isinstance(s, torch.Tensor) else s)
                       .detach().float().reshape(-1).cpu())
        scores = torch.cat(out)
        if scores.shape != (len(images),):
            raise ScorerError(
                f"{self.name}: backend returned {tuple(scores.shape)} scores for {len(images)} images"
            )
        bad = (~torch.isfinite(scores)).nonzero().flatten().tolist()
        if bad:
            raise ScorerError(
                f"{self.name} returned non-finite scores for images {bad[:8]} "
                f"(prompts {[prompts[i] for i in bad[:3]]}); check the weights ({self._weights()})"
            )
        return scores

    __call__ = score

    def _weights(self) -> str:
        return str(getattr(self, "weights_source", None) or "?")

    def _score_batch(self, images: list[Image.Image], prompts: list[str]):  # pragma: no cover - abstract
        raise NotImplementedError

    @property
    def info(self) -> dict:
        raise NotImplementedError

    def close(self) -> None:
        """Release the model's worker process (no-op in-process)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _spec_errors(fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except B.SpecError as e:
        raise UserError(str(e)) from None


class _HFClipScorer(Scorer):
    """Shared transformers-CLIP path for `clip` and `pickscore`, in this process
    (`chunkgrpo.scoring.backends.ClipBackend`).
    `preprocess`, `embed_text`, `embed_images` and `cosine` are public (GenEval's colour classifier uses
    them)."""

    model_label = "CLIP"

    def __init__(self, model_dir: Path, processor_dir: Path | None = None, *, device: str = "auto",
                 dtype: str = "float32", batch_size: int = 16, weights_source: str | None = None,
                 multiplier: float = 1.0) -> None:
        self.batch_size = batch_size
        self.weights_source = weights_source or str(model_dir)
        self.backend = _spec_errors(
            lambda: B.ClipBackend(
                self.name,
                str(model_dir),
                str(processor_dir) if processor_dir else None,
                device=device,
                dtype=dtype,
                multiplier=multiplier,
            )
        )

    preprocess = property(lambda self: self.backend.preprocess,
                          lambda self, value: setattr(self.backend, "preprocess", value))
    model = property(lambda self: self.backend.model)
    tokenizer = property(lambda self: self.backend.tokenizer)
    device = property(lambda self: self.backend.device)
    dtype = property(lambda self: self.backend.dtype)
    multiplier = property(lambda self: self.backend.multiplier)
    max_length = property(lambda self: self.backend.max_length)
    processor_dir = property(lambda self: self.backend.processor_dir)

    def embed_text(self, prompts: list[str]):
        return self.backend.embed_text(prompts)

    def embed_images(self, images: list[Image.Image]):
        return self.backend.embed_images(images)

    def cosine(self, images: list[Image.Image], prompts: list[str]):
        return self.backend.cosine(images, prompts)

    def _score_batch(self, images, prompts):
        return self.backend._score(images, prompts)

    @property
    def info(self) -> dict:
        return {**self.backend.info, "weights": self.weights_source, "runs": "in-process"}


class ClipScorer(_HFClipScorer):
    name = "clip"


class PickScoreScorer(_HFClipScorer):
    name = "pickscore"


class InProcessScorer(Scorer):
    """A reward-package backend (`chunkgrpo.scoring.backends.load_backend`) in this process: the package
    must be importable here."""

    def __init__(
        self, name: str, spec: dict, *, batch_size: int = 16, weights_source: str | None = None
    ) -> None:
        self.name = name
        self.batch_size = batch_size
        self.weights_source = weights_source or spec.get("weights")
        self.backend = _spec_errors(lambda: B.load_backend(name, spec))
        self.model = self.backend.model

    def _score_batch(self, images, prompts):
        return self.backend.score(images, prompts)

    @property
    def info(self) -> dict:
        return {**self.backend.info, "weights": self.weights_source, "runs": "in-process",
                "runtime": W.runtime_info(self.name, self.backend)}


class WorkerScorer(Scorer):
    """A scorer whose model lives in a worker process in its own venv (`chunkgrpo.scoring.worker`): loaded
    once, batches of RGB pixels + prompts sent over pipes, scores back. A worker that crashes is restarted
    (model reloaded) and the batch retried up to `restarts` times; a batch that takes longer than `timeout`
    stops the worker and raises. Either way the caller gets `ScorerWorkerError`, never a hang."""

    def __init__(self, name: str, spec: dict, venv: Path, *, batch_size: int = 16, timeout: float = 600.0,
                 load_timeout: float = 1800.0, restarts: int = 2, weights_source: str | None = None) -> None:
        self.name = name
        self.spec = dict(spec)
        self.venv = Path(venv)
        self.batch_size = batch_size
        self.timeout = float(timeout)
        self.load_timeout = float(load_timeout)
        self.restarts = int(restarts)
        self.weights_source = weights_source or spec.get("weights")
        self.worker = WC.WorkerProcess(name, self.venv)
        self.restarted = 0
        self._ready: dict = {}
        self._start()

    def _start(self) -> None:
        self.worker.start()
        try:
            self._ready, _ = self.worker.request({"op": "load", "spec": self.spec}, timeout=self.load_timeout)
        except BaseException:
            self.worker.close()
            raise

    @property
    def pid(self) -> int | None:
        return self.worker.pid

    def _score_batch(self, images, prompts):
        shapes, pixels = W.pack_images(images)
        header = {"op": "score", "prompts": list(prompts), "shapes": shapes}
        last: WC.WorkerCrashed | None = None
        for _ in range(self.restarts + 1):
            if not self.worker.alive:  # crashed (or stopped after a timeout): reload the model
                self._start()
                self.restarted += 1
            try:
                reply, body = self.worker.request(header, pixels, timeout=self.timeout)
            except WC.WorkerCrashed as e:
                last = e
                continue
            scores = np.frombuffer(body, dtype="<f8")
            if reply.get("n") != len(images) or scores.shape != (len(images),):
                raise ScorerWorkerError(f"{self.worker.describe()} returned {scores.shape[0]} scores for "
                                        f"{len(images)} images")
            return scores.astype(np.float64)
        raise WC.WorkerCrashed(
            f"{last} - gave up after {self.restarts + 1} attempts ({self.restarts} restarts; "
            "raise `restarts` or read the log)"
        )

    @property
    def info(self) -> dict:
        return {
            **self._ready.get("info", {}),
            "weights": self.weights_source,
            "runs": "worker",
            "venv": str(self.venv),
            "runtime": self._ready.get("runtime", {}),
            "worker_restarts": self.restarted,
        }

    def close(self) -> None:
        self.worker.close()

    def __del__(self) -> None:  # pragma: no cover - best effort
        try:
            self.worker.close(timeout=1.0)
        except Exception:
            pass


# --------------------------------------------------------------------------------------------------
# building a scorer by name

def _local(path: Path, name: str, what: str) -> str:
    if not path.is_file():
        raise UserError(f"{name}: {what} {str(path)!r} not found")
    return str(path.resolve())


def scorer_spec(conf: ScorerConfig, *, fetch: Fetch | None = None) -> dict:
    """The plain-JSON spec a backend is built from: weights resolved to local files (s3:// downloaded into
    the cache here), checkpoint names filled in. UserError when a file is missing."""
    n = conf.name
    w = resolve_weights(conf.weights, what=n, cache_dir=conf.cache_dir, fetch=fetch)
    spec: dict[str, Any] = {"device": conf.device}
    if n in ("clip", "pickscore"):
        proc = resolve_weights(conf.processor, what=f"{n} processor", cache_dir=conf.cache_dir, fetch=fetch) \
            if conf.processor else None
        spec.update(
            weights=str(w.resolve()),
            processor=str(proc.resolve()) if proc else None,
            dtype=conf.dtype,
            multiplier=conf.multiplier,
        )
    elif n.startswith("hpsv2"):
        fname = "HPS_v2.1_compressed.pt" if n == "hpsv2.1" else "HPS_v2_compressed.pt"
        spec["weights"] = _local(w / fname if w.is_dir() else w, n, "checkpoint")
        if conf.model_config:
            spec["model_config"] = _local(Path(conf.model_config).expanduser(), n, "model_config")
    elif n == "imagereward":
        ckpt = w / "ImageReward.pt" if w.is_dir() else w
        spec["weights"] = _local(ckpt, n, "checkpoint (need ImageReward.pt and med_config.json)")
        spec["med_config"] = _local(ckpt.parent / "med_config.json", n,
                                    "med_config.json (need ImageReward.pt and med_config.json)")
        if conf.processor:
            tok = resolve_weights(conf.processor, what="imagereward tokenizer", cache_dir=conf.cache_dir,
                                  fetch=fetch)
            spec["tokenizer"] = str(tok.resolve())
    elif n == "hpsv3":
        spec["weights"] = _local(w / "HPSv3.safetensors" if w.is_dir() else w, n,
                                 "checkpoint (expected HPSv3.safetensors)")
        base = (
            resolve_weights(conf.processor, what="hpsv3 base model", cache_dir=conf.cache_dir, fetch=fetch)
            if conf.processor
            else None
        )
        if base is None and w.is_dir() and (w / "Qwen2-VL-7B-Instruct").is_dir():
            base = w / "Qwen2-VL-7B-Instruct"
        spec["processor"] = str(base.resolve()) if base else None
        config_dir = cache_root(conf.cache_dir) / "hpsv3"
        config_dir.mkdir(parents=True, exist_ok=True)
        spec["config_dir"] = str(config_dir)
    return spec


def get_scorer(name: str, *, fetch: Fetch | None = None, **cfg: Any) -> Scorer:
    """Build a scorer by name. `cfg` keys are `ScorerConfig` fields (weights, processor, device, dtype,
    batch_size, cache_dir, multiplier, model_config, venv, timeout, load_timeout, restarts).
    `fetch(uri, dest_dir)` downloads `s3://` weights when given. With a venv (`venv=` or
    `$CHUNKGRPO_VENV_<NAME>`) the model runs in a worker process in that venv; call `close()` (or use
    `with`) to stop it early, otherwise it stops with this process."""
    conf = ScorerConfig.from_dict({"name": name, **cfg})
    n = conf.name
    venv = WC.venv_for(n, conf.venv)
    if venv is None and n in PACKAGE_SCORERS:
        check_scorer_package(n, conf.venv, processor=bool(conf.processor))
    if conf.weights is None or str(conf.weights).strip() == "":
        raise UserError(f"{n}: no weights given; set `weights` to a local directory or an s3:// prefix")
    spec = scorer_spec(conf, fetch=fetch)
    src = str(conf.weights)
    if venv is not None:
        return WorkerScorer(n, spec, venv, batch_size=conf.batch_size, timeout=conf.timeout,
                            load_timeout=conf.load_timeout, restarts=conf.restarts, weights_source=src)
    if n in ("clip", "pickscore"):
        cls = ClipScorer if n == "clip" else PickScoreScorer
        return cls(
            Path(spec["weights"]),
            Path(spec["processor"]) if spec["processor"] else None,
            device=conf.device,
            dtype=conf.dtype,
            batch_size=conf.batch_size,
            weights_source=src,
            multiplier=conf.multiplier,
        )
    return InProcessScorer(n, spec, batch_size=conf.batch_size, weights_source=src)
