"""The evaluate stage: hybrid-inference generation on HPDv2 / GenEval / WISE, scoring, metrics.json,
an HTML report, MLflow logging and (optionally) upload of everything to S3.

    cfg = EvalConfig.load("eval_hpdv2", ["model=s3://chunkgrpo/runs/r1/final", "output_dir=/tmp/eval"])
    result = run_evaluation(cfg)          # the dict that is also written to <output_dir>/metrics.json

Phases (each model = a label: "trained" = hybrid inference, "base" = the base model alone, same seeds):
1. generation: one base pipeline in memory (+ the LoRA adapter toggled per step, see `hybrid`), all
   benchmarks' images batched together, prompts encoded once per batch for both labels. Images are
   files under `<output_dir>/<benchmark>/<label>/` in each benchmark's official layout; with
   `resume=true` existing images made with the same generation settings (`generation.json`) are kept.
2. scoring (skipped with `generate_only=true`, e.g. when generation and scoring run in different
   images): scorers from `chunkgrpo.scoring.table.REWARDS` (programmatic) or `chunkgrpo.scoring.scorers`;
   GenEval detector + colour classifier; WISE judge.
3. statistics (`chunkgrpo.eval.stats`): base and trained share prompts and seeds, so every trained − base
   delta gets a paired bootstrap 95% CI, a win rate with its CI and n (HPDv2 per scorer, GenEval per task
   and overall, WISE per category and overall) -> `benchmarks.<b>.statistics` and flat metrics
   `<b>.<metric>.delta_ci_low|delta_ci_high|win_rate|...` (what promotion gates can name).
4. outputs: `metrics.json`, `report.html` (self-contained), `grids/*.png`, per-image `scores.jsonl`;
   `output_uri=s3://…` uploads the whole folder as a folder artifact (manifest last); then the MLflow stage
   run "evaluate" (metrics `hpdv2.hpsv3.trained`, …; report, metrics and grids as artifacts), fed from a
   background thread: MLflow down or dying never stops or delays the evaluation by more than
   `tracking_flush_timeout_s` at the end, and what it did not take is named in one warning line.

Comparability (`benchmarks.<b>.comparable_to_official` + `comparable_notes`, the reasons) is strict: the
paper's sampling, the official prompt set complete, every image present and scored, published scorer
weights/architectures (a random or tiny CLIP is never labelled as the published metric), the official
GenEval detector, rules and colour classifier, and for WISE all 1,000 prompt ids judged and scored by
gpt-4o-2024-05-13 on the original (not rewritten) prompts, parsed by the official parser.
"""

from __future__ import annotations

import dataclasses
import gc
import hashlib
import json
import logging
import math
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

from chunkgrpo.config import Config, option
from chunkgrpo.errors import UserError
from chunkgrpo.eval.wise import JudgeConfig
from chunkgrpo.scoring.adapters import RewardScorer
from chunkgrpo.scoring.backends import resolve_device

log = logging.getLogger(__name__)

METRICS_FORMAT = "chunkgrpo.eval-metrics/v1"
BENCHMARKS = ("hpdv2", "geneval", "wise")
LABELS = ("trained", "base")
MODE_OF = {"trained": "hybrid", "base": "base"}
# the paper's evaluation protocol (method.md §5; MixGRPO hybrid inference)
PAPER_SAMPLING = {"steps": 50, "trained_steps": 30, "height": 1024, "width": 1024, "guidance": 3.5,
                  "schedule": "dynamic"}
OFFICIAL_SCORERS = ("hpsv3", "imagereward", "hpsv2.1", "hpsv2", "pickscore", "clip")
OFFICIAL_WISE_JUDGE = "gpt-4o-2024-05-13"
OFFICIAL_WISE_VARIANT = "original"  # WISE_legacy README: gpt_eval.py --json_path data/<category>.json


@dataclasses.dataclass
class EvalConfig(Config):
    """The evaluate stage (`chunkgrpo evaluate --config eval_hpdv2 model=…`)."""

    model: str = option("", "trained model: the trainer's final/ folder (or its output_dir), an s3:// folder "
                            "artifact, or a model-pointer .json; empty = evaluate the base model alone")
    base_model: str = option("", "base FLUX pipeline (folder, s3://, or a hub id in the local cache); default: "
                                 "base_model recorded in the trained model's chunkgrpo_model.json")
    benchmarks: list[str] = option(["hpdv2"], "benchmarks to run: hpdv2 | geneval | wise")
    scorers: list[str] = option(["hpsv3", "imagereward"],
                                "HPDv2 scorers: programmatic rewards (brightness, color, contrast) or eval scorers "
                                "(hpsv3, imagereward, hpsv2.1, pickscore, clip)")
    scorer_weights: dict[str, str] = option({}, "weights per scorer: {name: local dir/file or s3:// prefix}")
    scorer_options: dict[str, dict] = option({}, "extra options per scorer, e.g. {pickscore: {processor: DIR}, "
                                                 "hpsv3: {processor: QWEN2VL_DIR}, brightness: {target: 0.5}}")
    scorer_device: str = option("auto", "device for scorers: auto | cpu | cuda | cuda:N")
    num_prompts: int = option(0, "use only the first N prompts of each benchmark (0 = all)")
    steps: int = option(50, "sampling steps N")
    trained_steps: int = option(30, "steps 0..K-1 with the trained model, the rest with the base model "
                                    "(K = steps: trained model alone)")
    schedule: Literal["dynamic", "shift"] = option("dynamic", "σ schedule: dynamic (diffusers FLUX pipeline) | shift")
    shift: float = option(3.0, "shift of the 'shift' schedule")
    height: int = option(1024, "image height")
    width: int = option(1024, "image width")
    guidance: float = option(3.5, "FLUX-dev guidance value")
    max_sequence_length: int = option(512, "T5 tokens per prompt")
    batch_size: int = option(4, "images per transformer batch")
    seed: int = option(42, "base seed: HPDv2 image i uses seed+i, GenEval sample k seed+k, WISE prompt id p seed+p")
    compare_base: bool = option(True, "also generate/score the base model with the same prompts and seeds")
    output_dir: str = option("eval", "local folder for images, metrics.json and report.html")
    output_uri: str = option("", "s3://bucket/prefix to upload output_dir to (folder artifact); empty = no upload")
    resume: bool = option(True, "keep images already in output_dir when they were made with the same settings")
    generate_only: bool = option(False, "only generate images (score later / elsewhere)")
    device: str = option("auto", "generation device: auto | cpu | cuda | cuda:N")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = option("auto", "model dtype (auto: bf16 on GPU)")
    offload: bool = option(False, "full fine-tunes: keep the inactive transformer on the CPU (two copies otherwise)")
    cache_dir: str = option("", "where s3:// models/weights are cached (default $CHUNKGRPO_CACHE or ~/.cache/chunkgrpo)")
    hpdv2_prompts: str = option("", "HPDv2 prompt file (default: the 400 official test prompts)")
    geneval_metadata: str = option("", "GenEval evaluation_metadata.jsonl (default: the official 553 prompts)")
    geneval_samples: int = option(4, "GenEval images per prompt (official: 4)")
    geneval_detector: Literal["mmdet", "transformers", "toy"] = option(
        "mmdet", "GenEval detector: mmdet (official Mask2Former, eval image) | transformers (not comparable) | "
                 "toy (exact detector of the toy world, chunkgrpo.toy; needs no weights)")
    geneval_detector_weights: str = option("", "detector checkpoint (mmdet .pth or its folder; transformers folder)")
    geneval_detector_config: str = option("", "mmdet config .py (default: the one shipped with mmdet)")
    geneval_color_model: str = option("", "CLIP ViT-L/14 folder for the colour classifier (transformers format)")
    wise_prompts: str = option("", "WISE prompt folder or JSON file (default $CHUNKGRPO_WISE_DIR)")
    wise_variant: Literal["rewrite", "original"] = option("rewrite", "WISE prompt variant")
    wise_judge: JudgeConfig = option(factory=JudgeConfig, help="WISE judge endpoint (OpenAI-compatible)")
    report_max_prompts: int = option(48, "prompt rows with images per benchmark in report.html: the largest "
                                         "changes, half improvements and half regressions")
    report_thumb_size: int = option(256, "thumbnail size (px, longest side) embedded in report.html")
    bootstrap_samples: int = option(2000, "bootstrap replicates for the CIs of trained − base deltas")
    bootstrap_seed: int = option(0, "seed of the bootstrap resampling (same inputs -> same intervals)")
    ci_level: float = option(0.95, "confidence level of the delta and win-rate intervals")
    experiment: str = option("chunkgrpo", "MLflow experiment when there is no parent run")
    parent_run_id: str = option("", "MLflow parent run id (default $CHUNKGRPO_MLFLOW_PARENT_RUN_ID)")
    tracking_timeout_s: int = option(10, "seconds per MLflow request; MLflow is fed from a background "
                                         "thread, evaluation never waits on it")
    tracking_flush_timeout_s: float = option(
        30.0, "after metrics.json is written (and uploaded), seconds to wait for MLflow to take the "
              "metrics and artifacts; then one warning line and exit 0 (the results are in metrics.json / "
              "output_uri)")

    def __post_init__(self) -> None:
        unknown = [b for b in self.benchmarks if b not in BENCHMARKS]
        if unknown or not self.benchmarks:
            raise UserError(f"benchmarks={self.benchmarks} must be a non-empty subset of {list(BENCHMARKS)}")
        self.benchmarks = list(dict.fromkeys(self.benchmarks))
        if "hpdv2" in self.benchmarks and not self.scorers and not self.generate_only:
            raise UserError("scorers is empty: name at least one HPDv2 scorer (e.g. hpsv3, imagereward)")
        from chunkgrpo.scoring.table import canonical_name

        try:
            from chunkgrpo.scoring.table import REWARDS
        except ImportError:  # a light (torch-less) environment validating a config: checked again at run time
            REWARDS = {"brightness": None, "color": None, "contrast": None}
        for name in self.scorers:
            if name not in REWARDS:
                try:
                    canonical_name(name)
                except UserError as e:
                    raise UserError(f"{e}; programmatic rewards: {', '.join(sorted(REWARDS))}") from None
        for key, what in (("num_prompts", 0), ("batch_size", 1), ("geneval_samples", 1),
                          ("report_max_prompts", 0), ("report_thumb_size", 16)):
            if getattr(self, key) < what:
                raise UserError(f"{key}={getattr(self, key)} must be >= {what}")
        if self.tracking_timeout_s < 1 or not 0 <= self.tracking_flush_timeout_s <= 600:
            raise UserError(f"tracking_timeout_s={self.tracking_timeout_s} must be >= 1 and "
                            f"tracking_flush_timeout_s={self.tracking_flush_timeout_s} in [0, 600]")
        if self.bootstrap_samples < 100:
            raise UserError(f"bootstrap_samples={self.bootstrap_samples} must be >= 100")
        if not 0.5 <= self.ci_level < 1:
            raise UserError(f"ci_level={self.ci_level} must be in [0.5, 1)")
        if self.output_uri and not self.output_uri.startswith("s3://"):
            raise UserError(f"output_uri={self.output_uri!r} must be an s3://bucket/prefix URI (or empty)")
        for key in ("device", "scorer_device"):
            dev = getattr(self, key)
            if dev not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", dev):
                raise UserError(f"{key}={dev!r} is not one of auto, cpu, cuda, cuda:N")
        if not self.output_dir:
            raise UserError("output_dir must be set")
        if not self.model and not self.base_model:
            raise UserError("set model (a trained model) and/or base_model (to evaluate the base model alone)")
        if not self.model and not self.compare_base:
            raise UserError("compare_base=false with no model leaves nothing to evaluate")
        self.hybrid()  # validates steps / trained_steps / resolution

    def hybrid(self):
        from chunkgrpo.eval.hybrid import HybridConfig

        return HybridConfig(num_steps=self.steps, trained_steps=self.trained_steps, schedule=self.schedule,
                            shift=self.shift, height=self.height, width=self.width, guidance=self.guidance,
                            max_sequence_length=self.max_sequence_length)

    def labels(self) -> list[str]:
        out = ["trained"] if self.model else []
        if self.compare_base or not self.model:
            out.append("base")
        return out


# --------------------------------------------------------------------------------------------------
# jobs


@dataclasses.dataclass(frozen=True)
class Job:
    """One image to generate per label: `<output_dir>/<benchmark>/<label>/<rel>`."""

    benchmark: str
    key: str       # prompt index / "index:k" / WISE prompt id
    prompt: str
    seed: int
    rel: str
    group: str = ""  # GenEval tag / WISE category


def plan_jobs(cfg: EvalConfig, out: Path) -> tuple[list[Job], dict]:
    """All images for all benchmarks, plus per-benchmark context (prompt sources, metadata)."""
    jobs: list[Job] = []
    ctx: dict[str, dict] = {}
    limit = cfg.num_prompts or None
    if "hpdv2" in cfg.benchmarks:
        from chunkgrpo.eval import hpdv2

        path = cfg.hpdv2_prompts or None
        prompts = hpdv2.load_prompts(path)[:limit]
        official = hpdv2.is_official(path)
        for item in hpdv2.plan(prompts, cfg.seed):
            jobs.append(Job("hpdv2", str(item.index), item.prompt, item.seed, item.filename))
        ctx["hpdv2"] = {"prompts_file": str(path or hpdv2.PROMPTS_FILE), "official_prompts": official,
                        "n_prompts": len(prompts), "n_expected": hpdv2.N_PROMPTS,
                        "seeds": f"seed + index (seed={cfg.seed})"}
    if "geneval" in cfg.benchmarks:
        from chunkgrpo.eval import geneval

        metadata = geneval.load_metadata(cfg.geneval_metadata or None)
        n_all = len(metadata)
        metadata = metadata[:limit]
        for j in geneval.generation_plan(metadata, "", cfg.geneval_samples, cfg.seed):
            jobs.append(Job("geneval", f"{j.index}:{j.sample}", j.prompt, j.seed, str(j.path), j.tag))
        ctx["geneval"] = {"metadata": metadata, "n_prompts": len(metadata), "n_all": n_all,
                          "samples_per_prompt": cfg.geneval_samples,
                          "metadata_file": cfg.geneval_metadata or geneval.METADATA_FILE,
                          "seeds": f"seed + k for sample k (seed={cfg.seed}), as the official generator"}
    if "wise" in cfg.benchmarks:
        from chunkgrpo.eval import wise

        prompts = wise.load_prompts(cfg.wise_prompts or None, cfg.wise_variant, allow_partial=True)[:limit]
        for p in prompts:
            jobs.append(Job("wise", str(p.prompt_id), p.prompt, cfg.seed + p.prompt_id,
                            wise.image_path("", p.prompt_id).name, p.category))
        ctx["wise"] = {"prompts": prompts, "n_prompts": len(prompts), "variant": cfg.wise_variant,
                       "seeds": f"seed + prompt_id (seed={cfg.seed})"}
    return jobs, ctx


def _fingerprint(cfg: EvalConfig, trained, base_model: str) -> dict:
    """What the images depend on: a different fingerprint means the images in output_dir are stale."""
    weights = None
    if trained is not None:
        h = hashlib.sha256()
        for f in sorted(p for p in trained.path.rglob("*") if p.is_file() and not p.name.startswith(".")):
            st = f.stat()
            h.update(f"{f.relative_to(trained.path)}:{st.st_size}:{st.st_mtime_ns}\n".encode())
        weights = h.hexdigest()[:16]
    return {"model": cfg.model, "trained_files": weights, "base_model": base_model,
            "sampling": cfg.hybrid().to_dict(), "seed": cfg.seed, "dtype": cfg.dtype}


# --------------------------------------------------------------------------------------------------
# scorers


def build_scorers(cfg: EvalConfig) -> dict[str, Any]:
    """name → object with `score(images, prompts)` and `info`."""
    from chunkgrpo.scoring.table import REWARDS

    out: dict[str, Any] = {}
    for name in cfg.scorers:
        opts = dict(cfg.scorer_options.get(name) or {})
        if name in REWARDS:
            out[name] = RewardScorer(name, opts)
            continue
        from chunkgrpo.scoring.scorers import get_scorer
        from chunkgrpo.scoring.table import canonical_name

        canon = canonical_name(name)
        weights = cfg.scorer_weights.get(name) or cfg.scorer_weights.get(canon) or opts.pop("weights", None)
        if not weights:
            raise UserError(f"scorer {canon!r} needs weights: set scorer_weights.{canon}=DIR (or an s3:// prefix)")
        opts.setdefault("device", cfg.scorer_device)
        if cfg.cache_dir:
            opts.setdefault("cache_dir", cfg.cache_dir)
        out[canon] = get_scorer(canon, weights=weights, **opts)
    return out


def _color_clauses(cfg: EvalConfig) -> int:
    from chunkgrpo.eval import geneval

    metadata = geneval.load_metadata(cfg.geneval_metadata or None)[: cfg.num_prompts or None]
    return sum(1 for md in metadata if any("color" in c for c in md.get("include", [])))


def preflight(cfg: EvalConfig, *, scorers: dict | None = None, detector=None, color_fn=None) -> dict:
    """Fail before hours of generation: scorer weights set (local paths exist), scorer packages importable,
    GenEval detector weights set, and GenEval's colour classifier loaded and run once on a test crop when
    the prompts have colour clauses (the official 553 have 194). Returns what it built (`color_fn`) so
    scoring reuses it."""
    built: dict[str, Any] = {}
    if cfg.generate_only:
        return built
    if "hpdv2" in cfg.benchmarks and scorers is None:
        from chunkgrpo.scoring.scorers import require_package
        from chunkgrpo.scoring.table import REWARDS, canonical_name
        from chunkgrpo.scoring.weights import resolve_weights

        packages = {"hpsv3": ("hpsv3", "hpsv3"), "imagereward": ("ImageReward", "image-reward"),
                    "hpsv2.1": ("hpsv2", "hpsv2"), "hpsv2": ("hpsv2", "hpsv2")}
        for name in cfg.scorers:
            if name in REWARDS:
                continue
            canon = canonical_name(name)
            weights = (cfg.scorer_weights.get(name) or cfg.scorer_weights.get(canon)
                       or (cfg.scorer_options.get(name) or {}).get("weights"))
            if not weights:
                raise UserError(f"scorer {canon!r} needs weights: set scorer_weights.{canon}=DIR (or an s3:// prefix)")
            if not str(weights).startswith("s3://"):
                resolve_weights(weights, what=canon)
            if canon in packages:
                require_package(packages[canon][0], canon, packages[canon][1])
    if "geneval" in cfg.benchmarks and cfg.geneval_detector == "toy":
        if color_fn is None:  # the toy world's exact palette classifier (chunkgrpo.toy); no weights
            from chunkgrpo.toy.detector import ToyColorClassifier

            built["color_fn"] = ToyColorClassifier()
    elif "geneval" in cfg.benchmarks:
        if detector is None and not cfg.geneval_detector_weights:
            raise UserError("geneval needs detector weights: set geneval_detector_weights=PATH "
                            "(or generate_only=true to score later)")
        if detector is None and not cfg.geneval_detector_weights.startswith("s3://"):
            from chunkgrpo.scoring.weights import resolve_weights

            resolve_weights(cfg.geneval_detector_weights, what="geneval detector")
        n_color = _color_clauses(cfg)
        if n_color and color_fn is None:
            if not cfg.geneval_color_model:
                raise UserError(f"{n_color} GenEval prompts have colour clauses: set geneval_color_model=DIR "
                                "(CLIP ViT-L/14 in transformers format, e.g. openai/clip-vit-large-patch14) "
                                "before generating (or generate_only=true to score later)")
            built["color_fn"] = _check_color_classifier(cfg)
    return built


def _check_color_classifier(cfg: EvalConfig):
    """Load the colour classifier and classify one synthetic crop: bad weights fail here, not after generation."""
    import numpy as np
    from PIL import Image

    from chunkgrpo.eval import geneval

    try:
        clf = geneval.ClipColorClassifier(cfg.geneval_color_model, device=cfg.scorer_device)
        probe = Image.new("RGB", (32, 32), (200, 30, 30))
        mask = np.ones((32, 32), bool)
        colors = clf(probe, [geneval.Detection((0.0, 0.0, 32.0, 32.0), 1.0, mask)], "car")
    except UserError as e:
        raise UserError(f"geneval colour classifier {cfg.geneval_color_model!r}: {e}") from None
    except Exception as e:  # noqa: BLE001 - any failure here would otherwise surface after generation
        raise UserError(f"geneval colour classifier {cfg.geneval_color_model!r} does not run: "
                        f"{type(e).__name__}: {e}") from None
    if len(colors) != 1 or colors[0] not in geneval.COLORS:
        raise UserError(f"geneval colour classifier {cfg.geneval_color_model!r} returned {colors!r} for one crop")
    return clf


# The published CLIP-family metrics use ViT-H/14 (PickScore_v1; the DFN5B / laion CLIP score of the
# DanceGRPO lineage); GenEval's colour classifier is CLIP ViT-L/14 "openai".
_CLIP_ARCH = {"vit-h-14": {"vision_hidden": 1280, "vision_layers": 32, "patch": 14, "text_hidden": 1024},
              "vit-l-14": {"vision_hidden": 1024, "vision_layers": 24, "patch": 14, "text_hidden": 768}}
_PUBLISHED_ARCH = {"clip": "vit-h-14", "pickscore": "vit-h-14"}


def clip_published_check(model, arch: str) -> str | None:
    """Why a transformers CLIPModel is NOT the published model of architecture `arch` (None if it may be):
    a different size, or a logit scale still at its initial value (untrained / random weights)."""
    cfg = getattr(model, "config", None)
    if cfg is None or not hasattr(cfg, "vision_config"):
        return "not a CLIP model"
    want = _CLIP_ARCH[arch]
    v, t = cfg.vision_config, cfg.text_config
    have = {"vision_hidden": v.hidden_size, "vision_layers": v.num_hidden_layers, "patch": v.patch_size,
            "text_hidden": t.hidden_size}
    if have != want:
        return (f"architecture (vision width {have['vision_hidden']}, {have['vision_layers']} layers, patch "
                f"{have['patch']}; text width {have['text_hidden']}) is not {arch.upper()}")
    scale = getattr(model, "logit_scale", None)
    init = getattr(cfg, "logit_scale_init_value", None)
    if scale is not None and init is not None and abs(float(scale) - float(init)) < 1e-6:
        return f"logit_scale is still its initial value {float(init):g}: untrained (random) weights"
    return None


def _published(name: str, scorer) -> tuple[bool, str]:
    """Is this scorer the published metric of that name? (flag, reason when not)."""
    if isinstance(scorer, RewardScorer):
        return False, f"{name} is a programmatic reward, not a published metric"
    info = getattr(scorer, "info", {}) or {}
    if info.get("name", name) not in OFFICIAL_SCORERS:
        return False, f"{name} is not one of the published metrics ({', '.join(OFFICIAL_SCORERS)})"
    if info.get("published") is False or info.get("random_weights"):
        return False, str(info.get("published_note") or f"{name} runs random / non-published weights")
    arch = _PUBLISHED_ARCH.get(info.get("name", name))
    if arch is not None:
        model = getattr(scorer, "model", None)
        why = clip_published_check(model, arch) if model is not None else "model not inspectable"
        if why:
            return False, f"{name}: {why}"
    return True, ""


def _scorer_info(scorer, name: str | None = None) -> dict:
    info = dict(scorer.info)
    ok, why = _published(name or info.get("name", ""), scorer)
    info["comparable_to_official"] = ok
    if not ok:
        info["not_published_because"] = why
    return info


# --------------------------------------------------------------------------------------------------
# the stage


def _job_hash(j: Job) -> str:
    return hashlib.sha256(f"{j.prompt}\n{j.seed}".encode()).hexdigest()[:16]


def _prepare_resume(cfg: EvalConfig, out: Path, jobs: list[Job], settings: dict) -> None:
    """Delete images that must not be reused, then record what the kept/new images are.

    `generation.json` holds the generation settings and, per image, a hash of its prompt and seed. With
    other settings (or resume=false) every image is regenerated; otherwise only images whose prompt/seed
    changed (e.g. another prompt file) are."""
    path = out / "generation.json"
    old = json.loads(path.read_text()) if path.exists() else None
    wipe = old is not None and (old.get("settings") != settings or not cfg.resume)
    if old is not None and old.get("settings") != settings:
        log.warning("%s holds images made with other generation settings: regenerating them", out)
    recorded = {} if (old is None or wipe) else dict(old.get("images") or {})
    for bench in BENCHMARKS:
        for lb in LABELS:
            d = out / bench / lb
            if not d.exists():
                continue
            for f in d.rglob("*.png"):
                key = f"{bench}/{f.relative_to(d)}"
                if wipe or key not in recorded:
                    f.unlink()
    images = {}
    for j in jobs:
        key, h = f"{j.benchmark}/{j.rel}", _job_hash(j)
        if recorded.get(key) not in (None, h):
            for lb in LABELS:
                (out / j.benchmark / lb / j.rel).unlink(missing_ok=True)
        images[key] = h
    keep = {k: v for k, v in recorded.items() if k not in images}
    path.write_text(json.dumps({"settings": settings, "images": {**keep, **images}}, indent=1))


def _torch_dtype(name: str, device: str):
    import torch

    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def _generate(cfg: EvalConfig, out: Path, jobs: list[Job], labels: list[str], trained, base_model: str) -> dict:
    """Generate every missing image; returns timing/counters."""
    missing: dict[tuple[str, ...], list[Job]] = {}
    for j in jobs:
        need = tuple(lb for lb in labels if not (out / j.benchmark / lb / j.rel).exists())
        if need:
            missing.setdefault(need, []).append(j)
    n_missing = sum(len(v) * len(k) for k, v in missing.items())
    stats = {"images_generated": n_missing, "images_reused": len(jobs) * len(labels) - n_missing,
             "generation_s": 0.0}
    if not missing:
        return stats
    import torch

    from chunkgrpo.eval.hybrid import HybridSampler

    t0 = time.perf_counter()
    device = resolve_device(cfg.device)
    sampler = HybridSampler.load(base_model, trained if "trained" in labels else None, device=device,
                                 dtype=_torch_dtype(cfg.dtype, device), offload=cfg.offload,
                                 cache_dir=cfg.cache_dir or None)
    hcfg = cfg.hybrid()
    done = 0
    total = n_missing
    try:
        for need, group in missing.items():
            modes = [MODE_OF[lb] for lb in need]
            label_of = {MODE_OF[lb]: lb for lb in need}

            def save(mode, idx, images, group=group):
                nonlocal done
                for i, im in zip(idx, images):
                    j = group[i]
                    path = out / j.benchmark / label_of[mode] / j.rel
                    path.parent.mkdir(parents=True, exist_ok=True)
                    im.save(path)
                done += len(images)
                log.info("generated %d/%d images", done, total)

            sampler.generate_modes([j.prompt for j in group], [j.seed for j in group], hcfg, modes,
                                   batch_size=cfg.batch_size, on_batch=save)
        stats["transformer_calls"] = dict(sampler.calls)
        stats["adapter_switches"] = sampler.switches
        stats["n_transformers"] = len(sampler.transformers())
        if torch.cuda.is_available() and device.startswith("cuda"):
            stats["cuda_max_allocated_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    finally:
        del sampler
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    stats["generation_s"] = round(time.perf_counter() - t0, 3)
    return stats


def _load_images(paths: Sequence[Path]):
    from PIL import Image

    out = []
    for p in paths:
        with Image.open(p) as im:
            out.append(im.convert("RGB"))
    return out


def _score_hpdv2(cfg: EvalConfig, out: Path, jobs: list[Job], labels: list[str], scorers: dict, ctx: dict) -> dict:
    from chunkgrpo.eval import hpdv2

    jobs = [j for j in jobs if j.benchmark == "hpdv2"]
    infos = {n: _scorer_info(s, n) for n, s in scorers.items()}
    n_expected = hpdv2.N_PROMPTS
    results, per_image = {}, {lb: {} for lb in labels}
    step = max(cfg.batch_size, 16)
    for lb in labels:
        scores: dict[str, list[float]] = {n: [] for n in scorers}
        for start in range(0, len(jobs), step):
            chunk = jobs[start:start + step]
            images = _load_images([out / "hpdv2" / lb / j.rel for j in chunk])
            part = hpdv2.score_images(images, [j.prompt for j in chunk], scorers)
            for n, vals in part.items():
                scores[n] += vals
        results[lb] = hpdv2.aggregate(scores, infos, n_expected=n_expected)
        per_image[lb] = scores
    with open(out / "hpdv2" / "scores.jsonl", "w") as fp:
        for i, j in enumerate(jobs):
            fp.write(json.dumps({"index": int(j.key), "prompt": j.prompt, "seed": j.seed, "file": j.rel,
                                 **{lb: {n: per_image[lb][n][i] for n in scorers} for lb in labels}}) + "\n")
    return {"results": results, "per_image": per_image, "scorers": infos}


def _color_info(color_fn) -> dict:
    """What the colour classifier is, and whether it is the official CLIP ViT-L/14."""
    if color_fn is None:
        return {"name": None, "comparable_to_official": False, "note": "no colour classifier"}
    info = dict(getattr(color_fn, "info", {}) or {})
    clip = getattr(getattr(color_fn, "_clip", None), "model", None)
    why = clip_published_check(clip, "vit-l-14") if clip is not None else "not inspectable (custom color_fn)"
    info.update({"name": type(color_fn).__name__, "comparable_to_official": why is None})
    if why:
        info["note"] = f"colour classifier {why}"
    return info


def _score_geneval(cfg: EvalConfig, out: Path, labels: list[str], detector, color_fn, ctx: dict) -> dict:
    from chunkgrpo.eval import geneval

    if detector is None and cfg.geneval_detector == "toy":
        from chunkgrpo.toy.detector import ToyColorClassifier, ToyDetector

        detector, color_fn = ToyDetector(), color_fn or ToyColorClassifier()
    if detector is None:
        if not cfg.geneval_detector_weights:
            raise UserError("geneval needs detector weights: set geneval_detector_weights=PATH "
                            "(or generate_only=true to score later)")
        if cfg.geneval_detector == "mmdet":
            detector = geneval.MMDetDetector(cfg.geneval_detector_weights, config=cfg.geneval_detector_config or None,
                                             device=resolve_device(cfg.scorer_device))
        else:
            detector = geneval.TransformersMask2FormerDetector(cfg.geneval_detector_weights,
                                                               device=cfg.scorer_device)
    if color_fn is None and cfg.geneval_color_model:
        color_fn = geneval.ClipColorClassifier(cfg.geneval_color_model, device=cfg.scorer_device)
    color = _color_info(color_fn)
    n_expected = ctx["n_prompts"] * ctx["samples_per_prompt"]
    results, records = {}, {}
    for lb in labels:
        root = out / "geneval" / lb
        recs = geneval.evaluate_folder(root, detector, color_fn)
        for r in recs:
            try:
                r["filename"] = str(Path(r["filename"]).relative_to(out))
            except (TypeError, ValueError):
                pass
        with open(root / "results.jsonl", "w") as fp:
            for r in recs:
                fp.write(json.dumps(r) + "\n")
        res = geneval.summarize(recs, detector)
        res["color_classifier"] = color
        res["n_expected_images"] = n_expected
        res["file_discovery"] = geneval.FILE_DISCOVERY
        res["unusual_files"] = geneval.unusual_sample_names(root)
        results[lb] = res
        records[lb] = recs
    return {"results": results, "records": records}


def _score_wise(cfg: EvalConfig, out: Path, labels: list[str], ctx: dict, judge) -> dict:
    from chunkgrpo.eval import wise

    client = judge if judge is not None else wise.JudgeClient(cfg.wise_judge)
    results = {}
    for lb in labels:
        res = wise.evaluate(ctx["prompts"], out / "wise" / lb, client, variant=cfg.wise_variant)
        for r in res.get("records", []):
            try:
                r["image"] = str(Path(r["image"]).relative_to(out))
            except ValueError:
                pass
        with open(out / "wise" / lb / "results.jsonl", "w") as fp:
            for r in res.get("records", []):
                fp.write(json.dumps(r) + "\n")
        results[lb] = res
    return {"results": results}


def _ids(xs: Sequence[int], limit: int = 8) -> str:
    xs = sorted(xs)
    return ", ".join(map(str, xs[:limit])) + (f", … (+{len(xs) - limit})" if len(xs) > limit else "")


def _comparability(cfg: EvalConfig, bench: str, ctx: dict, results: dict) -> tuple[bool, list[str]]:
    """Is this benchmark's number comparable with published ones? Returns (flag, reasons it is not).
    Every label's result is checked (a base run with failures makes the comparison not comparable)."""
    notes = []
    sampling = {"steps": cfg.steps, "trained_steps": cfg.trained_steps, "height": cfg.height, "width": cfg.width,
                "guidance": cfg.guidance, "schedule": cfg.schedule}
    for k, v in PAPER_SAMPLING.items():
        if sampling[k] != v and not (k == "trained_steps" and not cfg.model):
            notes.append(f"{k}={sampling[k]} (paper: {v})")
    if bench == "hpdv2":
        if not ctx["official_prompts"]:
            notes.append("prompt file is not the official 400 HPDv2 test prompts")
        if ctx["n_prompts"] != ctx["n_expected"]:
            notes.append(f"{ctx['n_prompts']} of {ctx['n_expected']} prompts")
        for lb, r in results.items():
            for name, s in r["scorers"].items():
                info = s.get("info") or {}
                if not info.get("comparable_to_official"):
                    notes.append(info.get("not_published_because") or f"scorer {name} is not a published metric")
                if s.get("n_nonfinite"):
                    notes.append(f"[{lb}] {s['n_nonfinite']} non-finite {name} scores excluded")
    elif bench == "geneval":
        from chunkgrpo.eval.geneval import GenEvalRules

        official_rules = dataclasses.asdict(GenEvalRules())
        if ctx["n_prompts"] != ctx["n_all"] or ctx["n_all"] != 553:
            notes.append(f"{ctx['n_prompts']} of 553 prompts")
        if cfg.geneval_samples != 4:
            notes.append(f"{cfg.geneval_samples} samples per prompt (official: 4)")
        for lb, r in results.items():
            if r.get("n_images", 0) < r.get("n_expected_images", 0):
                notes.append(f"[{lb}] {r['n_expected_images'] - r['n_images']} of {r['n_expected_images']} "
                             "images missing")
            if not (r.get("detector") or {}).get("comparable_to_official"):
                notes.append(f"detector {(r.get('detector') or {}).get('name')} is not the official mmdet "
                             "Mask2Former Swin-S checkpoint")
            if not r.get("complete"):
                notes.append(f"[{lb}] not all 6 GenEval tasks evaluated")
            if r.get("rules") and r["rules"] != official_rules:
                notes.append("scoring rules differ from the official options")
            color = r.get("color_classifier") or {}
            if not color.get("comparable_to_official"):
                notes.append(color.get("note") or "colour classifier is not CLIP ViT-L/14 (openai)")
    elif bench == "wise":
        n_ids = ctx["n_prompts"]
        variant = ctx.get("variant", cfg.wise_variant)
        if variant != OFFICIAL_WISE_VARIANT:
            notes.append(f"WISE prompt variant {variant!r} (the official gpt_eval.py usage and the WISE "
                         f"leaderboard judge the {OFFICIAL_WISE_VARIANT!r} prompts)")
        if n_ids != 1000:
            notes.append(f"{n_ids} of 1000 WISE prompt ids evaluated (the official Calculate.py needs all 1000)")
        for lb, r in results.items():
            if r.get("missing"):
                notes.append(f"[{lb}] {len(r['missing'])} images missing (prompt ids {_ids(r['missing'])})")
            if r.get("n_failed"):
                policy = "scored 0" if r.get("failed_policy") == "zero" else "excluded from the means"
                ids = [f["prompt_id"] for f in r.get("failed", [])]
                notes.append(f"[{lb}] {r['n_failed']} judgements failed ({policy}; prompt ids {_ids(ids)})")
            if n_ids == 1000 and not r.get("all_ids_scored"):
                notes.append(f"[{lb}] not all 1000 prompt ids scored")
            judge = r.get("judge") or {}
            if judge.get("model") != OFFICIAL_WISE_JUDGE:
                notes.append(f"judge {judge.get('model')} (paper: {OFFICIAL_WISE_JUDGE})")
            if judge.get("parser", "official") != "official":
                notes.append(f"judge answers parsed with the {judge.get('parser')} parser (official: WISE "
                             "extract_scores, parser=official)")
    notes = list(dict.fromkeys(notes))
    return not notes, notes


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


# --------------------------------------------------------------------------------------------------
# statistics (paired: same prompts and seeds for both labels)


def _geneval_key(rec: dict) -> tuple[int, str] | None:
    """(prompt index, sample file) of a GenEval record, from `<index>/samples/<k>.png` in its filename."""
    parts = Path(str(rec.get("filename") or "")).parts
    if len(parts) >= 3 and parts[-2] == "samples" and parts[-3].isdigit():
        return int(parts[-3]), parts[-1]
    return None


def geneval_prompt_pairs(records: dict) -> dict[int, dict]:
    """Per prompt index: tag and the mean `correct` of its images present for both labels."""
    by = {lb: {k: r for r in recs if (k := _geneval_key(r)) is not None} for lb, recs in records.items()}
    common = set(by.get("trained", {})) & set(by.get("base", {}))
    out: dict[int, dict] = {}
    for key in sorted(common):
        idx = key[0]
        e = out.setdefault(idx, {"tag": by["base"][key]["tag"], "prompt": by["base"][key]["prompt"],
                                 "trained": [], "base": [], "files": []})
        e["files"].append(key[1])
        for lb in ("trained", "base"):
            e[lb].append(float(bool(by[lb][key]["correct"])))
    for e in out.values():
        for lb in ("trained", "base"):
            e[f"{lb}_mean"] = sum(e[lb]) / len(e[lb])
    return out


def wise_pairs(records: dict, failed_policy: str = "exclude") -> dict[int, dict]:
    """Per WISE prompt id: category and WiScore per label (None = failed/excluded, 0.0 with policy 'zero')."""
    out: dict[int, dict] = {}
    for lb in ("trained", "base"):
        for r in records.get(lb) or []:
            e = out.setdefault(int(r["prompt_id"]), {"category": r.get("category"), "trained": None, "base": None})
            w = r.get("wiscore")
            e[lb] = float(w) if w is not None else (0.0 if failed_policy == "zero" else None)
    return out


def compute_statistics(bench: str, per_image: Any, results: dict, *, samples: int, seed: int,
                       level: float) -> dict[str, dict]:
    """Paired bootstrap cells `{metric: stats.cell(...)}` for one benchmark (needs both labels)."""
    from chunkgrpo.eval import stats

    if not {"trained", "base"} <= set(results):
        return {}
    kw = {"samples": samples, "seed": seed, "level": level}
    nan = float("nan")
    cells: dict[str, dict] = {}
    if bench == "hpdv2":
        for name in per_image["trained"]:
            cells[name] = stats.cell(per_image["trained"][name], per_image["base"][name], **kw)
    elif bench == "geneval":
        pairs = geneval_prompt_pairs(per_image)
        tags = [e["tag"] for e in pairs.values()]
        t = [e["trained_mean"] for e in pairs.values()]
        b = [e["base_mean"] for e in pairs.values()]
        # overall = unweighted mean of the task means (GenEval summary_scores)
        cells["overall"] = stats.cell(t, b, strata=tags, **kw)
        for tag in dict.fromkeys(tags):
            sel = [i for i, g in enumerate(tags) if g == tag]
            cells[tag] = stats.cell([t[i] for i in sel], [b[i] for i in sel], **kw)
    elif bench == "wise":
        from chunkgrpo.eval.wise import CATEGORIES

        policy = next(iter(results.values())).get("failed_policy", "exclude")
        pairs = wise_pairs(per_image, policy)
        cats = [e["category"] for e in pairs.values()]
        t = [nan if e["trained"] is None else e["trained"] for e in pairs.values()]
        b = [nan if e["base"] is None else e["base"] for e in pairs.values()]
        if all(r.get("complete") for r in results.values()):  # official weights, as wise.aggregate
            cells["overall"] = stats.cell(t, b, strata=cats, strata_weights={n: w for n, _, _, w in CATEGORIES}, **kw)
        else:  # mean over the evaluated prompts
            cells["overall"] = stats.cell(t, b, **kw)
        for name, *_ in CATEGORIES:
            sel = [i for i, c in enumerate(cats) if c == name]
            if sel:
                cells[name] = stats.cell([t[i] for i in sel], [b[i] for i in sel], **kw)
    return cells


STAT_METRICS = {"delta_ci_low": "ci_low", "delta_ci_high": "ci_high", "win_rate": "win_rate",
                "win_rate_ci_low": "win_ci_low", "win_rate_ci_high": "win_ci_high", "n_pairs": "n"}


def flat_metrics(benchmarks: dict) -> dict[str, float]:
    """`<benchmark>.<metric>.<label>` (each label's own mean, as the benchmark reports it) and `.delta`, the
    **paired** trained − base (`statistics.<metric>.delta`: the mean difference over the pairs with both
    sides scored, the same pairs as its CI; absent without a statistics cell) for MLflow, plus the paired
    statistics
    `.delta_ci_low` / `.delta_ci_high` (bootstrap CI of the delta), `.win_rate` (+ `_ci_low/_ci_high`)
    and `.n_pairs`: a promotion gate or the nightly regression check can name e.g.
    `hpdv2.hpsv3.delta_ci_low` (registered as `eval.hpdv2.hpsv3.delta_ci_low`)."""
    out: dict[str, float] = {}
    for bench, b in benchmarks.items():
        res = b.get("results") or {}
        for lb, r in res.items():
            if bench == "hpdv2":
                for name, s in r["scorers"].items():
                    out[f"hpdv2.{name}.{lb}"] = s["mean"]
            elif bench == "geneval":
                out[f"geneval.overall.{lb}"] = r["overall"]
                for tag, t in r["tasks"].items():
                    out[f"geneval.{tag}.{lb}"] = t["score"]
            elif bench == "wise":
                if r.get("overall") is not None:
                    out[f"wise.overall.{lb}"] = r["overall"]
                for cat, c in (r.get("categories") or {}).items():
                    if c.get("wiscore") is not None:
                        out[f"wise.{cat}.{lb}"] = c["wiscore"]
    for bench, b in benchmarks.items():
        for metric, cell in (b.get("statistics") or {}).items():
            # the delta of the same pairs as its CI (each label's own mean above may use other items,
            # e.g. when some judgements failed for one label only)
            if _finite(cell.get("delta")):
                out[f"{bench}.{metric}.delta"] = cell["delta"]
            for suffix, field in STAT_METRICS.items():
                v = cell.get(field)
                if _finite(v):
                    out[f"{bench}.{metric}.{suffix}"] = v
    return {k: float(v) for k, v in out.items() if _finite(v)}


def _grids(out: Path, jobs: list[Job], labels: list[str], n: int = 16) -> list[Path]:
    from chunkgrpo.grids import image_grid

    paths = []
    (out / "grids").mkdir(exist_ok=True)
    for bench in dict.fromkeys(j.benchmark for j in jobs):
        bj = [j for j in jobs if j.benchmark == bench][:n]
        for lb in labels:
            files = [out / bench / lb / j.rel for j in bj if (out / bench / lb / j.rel).exists()]
            if not files:
                continue
            ims = _load_images(files)
            size = min(256, ims[0].size[0])
            grid = image_grid([im.resize((size, size)) for im in ims], cols=4, labels=[j.key for j in bj])
            p = out / "grids" / f"{bench}_{lb}.png"
            grid.save(p)
            paths.append(p)
    return paths


def _json_default(o):
    if isinstance(o, Path):
        return str(o)
    if dataclasses.is_dataclass(o):
        return dataclasses.asdict(o)
    return str(o)


def run_evaluation(cfg: EvalConfig, *, detector=None, color_fn: Callable | None = None, judge=None,
                   scorers: dict | None = None) -> dict:
    """Run the evaluate stage; returns the metrics dict (also written to `<output_dir>/metrics.json`).

    `detector` / `color_fn` (GenEval), `judge` (a `wise.JudgeClient`) and `scorers` ({name: obj with
    score()/info}) override what the config would build (tests, notebooks)."""
    from chunkgrpo import tracking

    t_start = time.perf_counter()
    if cfg.output_uri:  # before any work: results must never be "uploaded" to a bucket that does not exist
        from chunkgrpo.store.client import ArtifactStore

        ArtifactStore().require_bucket(cfg.output_uri)
    out = Path(cfg.output_dir).expanduser()
    labels = cfg.labels()
    trained = None
    if cfg.model:
        from chunkgrpo.eval.hybrid import load_trained

        # verified before output_dir exists
        trained = load_trained(cfg.model, cache_dir=cfg.cache_dir or None)
    out.mkdir(parents=True, exist_ok=True)
    base_model = cfg.base_model or (trained.base_model if trained else "")
    if not base_model:
        raise UserError(f"the trained model {cfg.model!r} does not record its base model; set base_model=…")
    if trained and cfg.base_model and trained.base_model and cfg.base_model != trained.base_model:
        log.warning("base_model=%s differs from the one the model was trained on (%s)", cfg.base_model,
                    trained.base_model)
    built = preflight(cfg, scorers=scorers, detector=detector, color_fn=color_fn)
    color_fn = color_fn if color_fn is not None else built.get("color_fn")
    jobs, ctx = plan_jobs(cfg, out)
    if "geneval" in ctx:
        from chunkgrpo.eval import geneval

        for lb in labels:
            geneval.write_layout(ctx["geneval"]["metadata"], out / "geneval" / lb)

    _prepare_resume(cfg, out, jobs, _fingerprint(cfg, trained, base_model))

    params = tracking.flatten({k: v for k, v in cfg.to_dict().items()})
    tags = {"chunkgrpo.model": cfg.model or "(base only)", "chunkgrpo.base_model": base_model}
    # MLflow is fed from a background thread (as in training): an unreachable or dying tracking server never
    # blocks or fails the evaluation. The results are written and uploaded first, then handed to MLflow,
    # which gets at most tracking_flush_timeout_s more (then one warning line; the results stay intact).
    where = f"{out / 'metrics.json'}" + (f" and {cfg.output_uri}" if cfg.output_uri else "")
    with tracking.background_stage_run("evaluate", parent_run_id=cfg.parent_run_id or None,
                                       experiment=cfg.experiment, params=params, tags=tags,
                                       timeout_s=cfg.tracking_timeout_s, kept_in=where,
                                       flush_timeout_s=cfg.tracking_flush_timeout_s) as tracker:
        gen_stats = _generate(cfg, out, jobs, labels, trained, base_model)
        log.info("generation: %s", gen_stats)
        benchmarks: dict[str, dict] = {}
        scorer_infos: dict[str, dict] = {}
        per_image: dict[str, Any] = {}
        t_score = time.perf_counter()
        for bench in cfg.benchmarks:
            c = ctx[bench]
            entry: dict[str, Any] = {k: v for k, v in c.items() if k not in ("metadata", "prompts")}
            entry["images"] = {lb: f"{bench}/{lb}" for lb in labels}
            if not cfg.generate_only:
                if bench == "hpdv2":
                    if scorers is None:
                        scorers = build_scorers(cfg)
                    r = _score_hpdv2(cfg, out, jobs, labels, scorers, c)
                    scorer_infos.update(r["scorers"])
                    per_image["hpdv2"] = r["per_image"]
                elif bench == "geneval":
                    r = _score_geneval(cfg, out, labels, detector, color_fn, c)
                    per_image["geneval"] = r["records"]
                else:
                    r = _score_wise(cfg, out, labels, c, judge)
                    per_image["wise"] = {lb: v.get("records", []) for lb, v in r["results"].items()}
                    for v in r["results"].values():
                        v.pop("records", None)
                entry["results"] = r["results"]
                entry["statistics"] = compute_statistics(bench, per_image[bench], r["results"],
                                                         samples=cfg.bootstrap_samples, seed=cfg.bootstrap_seed,
                                                         level=cfg.ci_level)
                ok, notes = _comparability(cfg, bench, c, r["results"])
                entry["comparable_to_official"] = ok
                entry["comparable_notes"] = notes
            else:
                entry["results"] = {}
                entry["comparable_to_official"] = False
                entry["comparable_notes"] = ["generate_only: not scored"]
            benchmarks[bench] = entry
        metrics = flat_metrics(benchmarks)
        result: dict[str, Any] = {
            "format": METRICS_FORMAT,
            "labels": labels,
            "models": {
                **({"trained": {**trained.describe(), "inference": f"hybrid: steps 0-{cfg.trained_steps - 1} trained, "
                                f"{cfg.trained_steps}-{cfg.steps - 1} base"}} if trained and "trained" in labels else {}),
                **({"base": {"source": base_model}} if "base" in labels else {}),
            },
            "base_model": base_model,
            "sampling": cfg.hybrid().to_dict(),
            "seed": cfg.seed,
            "benchmarks": benchmarks,
            "scorers": scorer_infos,
            "metrics": metrics,
            "generation": gen_stats,
            "timing": {"generation_s": gen_stats.get("generation_s", 0.0),
                       "scoring_s": round(time.perf_counter() - t_score, 3)},
            "report": "report.html",
            "output_dir": str(out),
            "output_uri": cfg.output_uri or None,
            "mlflow_run_id": _run_id(tracker, cfg.tracking_timeout_s),
            "config": cfg.to_dict(),
        }
        grids = _grids(out, jobs, labels)
        from chunkgrpo.eval.report import write_report

        report_jobs = {b: [j for j in jobs if j.benchmark == b] for b in cfg.benchmarks}
        write_report(out / "report.html", result, out, report_jobs, per_image,
                     max_prompts=cfg.report_max_prompts, thumb=cfg.report_thumb_size)
        result["timing"]["total_s"] = round(time.perf_counter() - t_start, 3)
        (out / "metrics.json").write_text(json.dumps(result, indent=1, default=_json_default))
        if cfg.output_uri:  # the results are safe in S3 before MLflow is asked for anything more
            from chunkgrpo.store.client import ArtifactStore

            ArtifactStore().put_folder(out, cfg.output_uri,
                                       meta={"kind": "eval", "model": cfg.model or base_model})
            log.info("uploaded %s to %s", out, cfg.output_uri)
        if metrics:
            tracker.log_metrics(metrics)
        tracker.log_artifact(out / "metrics.json")
        tracker.log_artifact(out / "report.html")
        for g in grids:
            tracker.log_artifact(g, "grids")
    return result


def _run_id(tracker, wait_s: float) -> str | None:
    """The MLflow run id for metrics.json: the background thread normally created the run long before
    (during generation); a server that is up but slow gets at most `wait_s`; a failing one none."""
    if not getattr(tracker, "enabled", False) or tracker.run_id:
        return tracker.run_id
    deadline = time.monotonic() + wait_s
    while tracker.run_id is None and not getattr(tracker, "failures", 0) and time.monotonic() < deadline:
        time.sleep(0.1)
    return tracker.run_id


def summary_lines(result: dict) -> list[str]:
    """Human-readable one-liners for the CLI."""
    lines = []
    for bench, b in result["benchmarks"].items():
        res = b.get("results") or {}
        if bench == "hpdv2":
            for lb, r in res.items():
                vals = ", ".join(f"{n} {s['mean']:.4f}±{s['stderr']:.4f}" for n, s in r["scorers"].items())
                lines.append(f"hpdv2 [{lb}] n={r['n_images']}: {vals}")
        elif bench == "geneval":
            for lb, r in res.items():
                lines.append(f"geneval [{lb}] overall {r['overall']:.4f} over {r['n_images']} images")
        elif bench == "wise":
            for lb, r in res.items():
                ov = r.get("overall")
                lines.append(f"wise [{lb}] overall {ov if ov is None else round(ov, 4)} "
                             f"({r['n_scored']} scored, {r['n_failed']} failed)")
        for metric, c in (b.get("statistics") or {}).items():
            if c.get("delta") is None:
                continue
            verdict = {1: "trained better", -1: "trained worse", 0: "no significant difference"}[c["significance"]]
            ci = (f"{round(100 * c['level'])}% CI {c['ci_low']:+.4f}, {c['ci_high']:+.4f}" if c.get("ci_low") is not None
                  else c.get("note", "no interval"))
            lines.append(f"  {bench}.{metric}: trained − base {c['delta']:+.4f} [{ci}] "
                         f"win rate {c['win_rate']:.0%} (n={c['n']}): {verdict}")
        if not res:
            lines.append(f"{bench}: images generated (not scored)")
        if res and not b.get("comparable_to_official"):
            lines.append(f"  {bench}: not comparable to published numbers: {'; '.join(b.get('comparable_notes', []))}")
    return lines


__all__ = ["EvalConfig", "run_evaluation", "build_scorers", "flat_metrics", "plan_jobs", "summary_lines",
           "BENCHMARKS", "LABELS", "METRICS_FORMAT"]
