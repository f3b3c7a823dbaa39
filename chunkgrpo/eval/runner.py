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
   images), each benchmark by its own module (`hpdv2`, `geneval` + `geneval_models`, `wise`): scorers
   built by `scorer_setup` (programmatic rewards or `chunkgrpo.scoring.scorers`); GenEval detector + colour
   classifier; WISE judge.
3. statistics (`chunkgrpo.eval.stats`): base and trained share prompts and seeds, so every trained − base
   delta gets a paired bootstrap 95% CI, a win rate with its CI and n (HPDv2 per scorer, GenEval per task
   and overall, WISE per category and overall) -> `benchmarks.<b>.statistics` and flat metrics
   `<b>.<metric>.delta_ci_low|delta_ci_high|win_rate|...` (what promotion gates can name).
4. outputs: `metrics.json`, `report.html` (self-contained), `grids/*.png`, per-image `scores.jsonl`;
   `output_uri=s3://…` uploads the whole folder as a folder artifact (manifest last); then the MLflow stage
   run "evaluate" (metrics `hpdv2.hpsv3.trained`, …; report, metrics and grids as artifacts), fed from a
   background thread: MLflow down or dying never stops or delays the evaluation by more than
   `tracking_flush_timeout_s` at the end, and what it did not take is named in one warning line.

Comparability (`benchmarks.<b>.comparable_to_official` + `comparable_notes`, the reasons; the rules live
in each benchmark's `comparability_notes`, the sampling rule with `config.PAPER_SAMPLING`) is strict: the
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
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from chunkgrpo import tracking
from chunkgrpo.errors import UserError
from chunkgrpo.eval import base_cache, geneval, geneval_models, hpdv2, load_rgb, scorer_setup, stats, wise
from chunkgrpo.eval.config import BENCHMARKS, LABELS, PAPER_SAMPLING, EvalConfig
from chunkgrpo.eval.hybrid import HybridSampler, load_trained
from chunkgrpo.eval.report import write_report
from chunkgrpo.grids import image_grid
from chunkgrpo.scoring.backends import resolve_device
from chunkgrpo.store.client import ArtifactStore
from chunkgrpo.store.manifest import BASE_WEIGHTS_TAG, WEIGHTS_TAG, weights_sha256

log = logging.getLogger(__name__)

METRICS_FORMAT = "chunkgrpo.eval-metrics/v1"
MODE_OF = {"trained": "hybrid", "base": "base"}


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


def image_jobs(cfg: EvalConfig) -> tuple[list[Job], dict]:
    """All images for all benchmarks, plus per-benchmark context (prompt sources, metadata)."""
    jobs: list[Job] = []
    ctx: dict[str, dict] = {}
    limit = cfg.num_prompts or None
    if "hpdv2" in cfg.benchmarks:
        path = cfg.hpdv2_prompts or None
        prompts = hpdv2.load_prompts(path)[:limit]
        official = hpdv2.is_official(path)
        for item in hpdv2.plan(prompts, cfg.seed):
            jobs.append(Job("hpdv2", str(item.index), item.prompt, item.seed, item.filename))
        ctx["hpdv2"] = {"prompts_file": str(path or hpdv2.PROMPTS_FILE), "official_prompts": official,
                        "n_prompts": len(prompts), "n_expected": hpdv2.N_PROMPTS,
                        "seeds": f"seed + index (seed={cfg.seed})"}
    if "geneval" in cfg.benchmarks:
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
            "sampling": cfg.sampling.to_dict(), "seed": cfg.seed, "dtype": cfg.dtype}


def check_before_generation(cfg: EvalConfig, *, scorers: dict | None = None, detector=None,
                            color_fn=None) -> dict:
    """Fail before hours of generation: scorer weights set (local paths exist), scorer packages importable,
    GenEval detector weights set, and GenEval's colour classifier loaded and run once on a test crop when
    the prompts have colour clauses (the official 553 have 194). Returns what it built (`color_fn`) so
    scoring reuses it."""
    built: dict[str, Any] = {}
    if cfg.generate_only:
        return built
    if "hpdv2" in cfg.benchmarks and scorers is None:
        scorer_setup.check_scorers(cfg)
    if "geneval" in cfg.benchmarks and cfg.named_detector():
        if color_fn is None and cfg.geneval_color_fn:  # a named classifier (e.g. the toy world's); no weights
            built["color_fn"] = geneval_models.named(cfg.geneval_color_fn)()
    elif "geneval" in cfg.benchmarks:
        if detector is None and not cfg.geneval_detector_weights:
            raise UserError("geneval needs detector weights: set geneval_detector_weights=PATH "
                            "(or generate_only=true to score later)")
        if detector is None and not cfg.geneval_detector_weights.startswith("s3://"):
            from chunkgrpo.scoring.weights import resolve_weights

            resolve_weights(cfg.geneval_detector_weights, what="geneval detector")
        metadata = geneval.load_metadata(cfg.geneval_metadata or None)[: cfg.num_prompts or None]
        n_color = geneval.color_clauses(metadata)
        if n_color and color_fn is None:
            if not cfg.geneval_color_model:
                raise UserError(f"{n_color} GenEval prompts have colour clauses: set geneval_color_model=DIR "
                                "(CLIP ViT-L/14 in transformers format, e.g. openai/clip-vit-large-patch14) "
                                "before generating (or generate_only=true to score later)")
            built["color_fn"] = geneval_models.check_color_classifier(cfg)
    return built



# --------------------------------------------------------------------------------------------------
# generation


def _job_hash(j: Job) -> str:
    return base_cache.job_hash(j.prompt, j.seed)


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
    if name == "auto":
        return torch.bfloat16 if str(device).startswith("cuda") else torch.float32
    return {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}[name]


def _generate(
    cfg: EvalConfig, out: Path, jobs: list[Job], labels: list[str], trained, base_model: str
) -> dict:
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
    t0 = time.perf_counter()
    device = resolve_device(cfg.device)
    sampler = HybridSampler.load(base_model, trained if "trained" in labels else None, device=device,
                                 dtype=_torch_dtype(cfg.dtype, device), offload=cfg.offload,
                                 cache_dir=cfg.cache_dir or None)
    hcfg = cfg.sampling
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



# --------------------------------------------------------------------------------------------------
# scoring


def _score(cfg: EvalConfig, bench: str, out: Path, jobs: list[Job], labels: list[str], ctx: dict,
           models: dict) -> tuple[dict, Any, dict]:
    """Score one benchmark: (results per label, per-image records for the statistics, scorer infos).
    `models` holds what the caller passed in (`scorers`, `detector`, `color_fn`, `judge`; None = build)."""
    if bench == "hpdv2":
        if models["scorers"] is None:
            models["scorers"] = scorer_setup.build_scorers(cfg)
        scorers = models["scorers"]
        infos = {n: scorer_setup._scorer_info(s, n) for n, s in scorers.items()}
        r = hpdv2.score_stage(out, jobs, labels, scorers, infos, cfg.batch_size)
        return r["results"], r["per_image"], r["scorers"]
    if bench == "geneval":
        detector, color_fn = geneval_models.build_models(cfg, models["detector"], models["color_fn"])
        r = geneval.score_stage(out, labels, detector, color_fn, geneval_models.color_info(color_fn), ctx)
        return r["results"], r["records"], {}
    client = models["judge"] if models["judge"] is not None else wise.JudgeClient(cfg.wise_judge)
    r = wise.score_stage(out, labels, ctx["prompts"], client, cfg.wise_variant)
    records = {lb: v.get("records", []) for lb, v in r["results"].items()}
    for v in r["results"].values():
        v.pop("records", None)
    return r["results"], records, {}


def _comparability(cfg: EvalConfig, bench: str, ctx: dict, results: dict) -> tuple[bool, list[str]]:
    """Is this benchmark's number comparable with published ones? Returns (flag, reasons it is not).
    Every label's result is checked (a base run with failures makes the comparison not comparable)."""
    notes = []
    for k, v in PAPER_SAMPLING.items():
        have = getattr(cfg.sampling, k)
        if have != v and not (k == "trained_steps" and not cfg.model):
            notes.append(f"{k}={have} (paper: {v})")
    if bench == "hpdv2":
        notes += hpdv2.comparability_notes(ctx, results)
    elif bench == "geneval":
        notes += geneval.comparability_notes(ctx, results, cfg.geneval_samples)
    elif bench == "wise":
        notes += wise.comparability_notes(ctx, results, cfg.wise_variant)
    notes = list(dict.fromkeys(notes))
    return not notes, notes


def _benchmark_entry(cfg: EvalConfig, bench: str, out: Path, jobs: list[Job], labels: list[str], ctx: dict,
                     models: dict) -> tuple[dict, Any, dict]:
    """`benchmarks.<bench>` of metrics.json (+ its per-image records and scorer infos)."""
    entry: dict[str, Any] = {k: v for k, v in ctx.items() if k not in ("metadata", "prompts")}
    entry["images"] = {lb: f"{bench}/{lb}" for lb in labels}
    if cfg.generate_only:
        entry.update(results={}, comparable_to_official=False, comparable_notes=["generate_only: not scored"])
        return entry, None, {}
    results, per_image, infos = _score(cfg, bench, out, jobs, labels, ctx, models)
    entry["results"] = results
    entry["statistics"] = stats.compute_statistics(bench, per_image, results, samples=cfg.bootstrap_samples,
                                                   seed=cfg.bootstrap_seed, level=cfg.ci_level)
    entry["comparable_to_official"], entry["comparable_notes"] = _comparability(cfg, bench, ctx, results)
    return entry, per_image, infos



# --------------------------------------------------------------------------------------------------
# the stage


def _grids(out: Path, jobs: list[Job], labels: list[str], n: int = 16) -> list[Path]:
    paths = []
    (out / "grids").mkdir(exist_ok=True)
    for bench in dict.fromkeys(j.benchmark for j in jobs):
        bj = [j for j in jobs if j.benchmark == bench][:n]
        for lb in labels:
            files = [out / bench / lb / j.rel for j in bj if (out / bench / lb / j.rel).exists()]
            if not files:
                continue
            ims = load_rgb(files)
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



def _base_model(cfg: EvalConfig, trained) -> str:
    """The base model: the configured one, else the one the trained model records."""
    base_model = cfg.base_model or (trained.base_model if trained else "")
    if not base_model:
        raise UserError(f"the trained model {cfg.model!r} does not record its base model; set base_model=…")
    if trained and cfg.base_model and trained.base_model and cfg.base_model != trained.base_model:
        log.warning("base_model=%s differs from the one the model was trained on (%s)", cfg.base_model,
                    trained.base_model)
    return base_model


def _describe_models(cfg: EvalConfig, labels: list[str], trained, base_model: str) -> dict:
    """`models` of metrics.json: what each label is."""
    s = cfg.sampling
    out: dict[str, Any] = {}
    if trained and "trained" in labels:
        inference = f"hybrid: steps 0-{s.trained_steps - 1} trained, {s.trained_steps}-{s.num_steps - 1} base"
        out["trained"] = {**trained.describe(), "inference": inference}
    if "base" in labels:
        out["base"] = {"source": base_model}
    return out


def _weights_tags(trained, base_model: str) -> dict[str, str]:
    """The run tags binding the evaluation to the weights it scores: the trained weights' digest
    (`weights_sha256`, what registration requires to equal the registered version's) and, when the base
    model is a local folder, the base model's (a hub id is recorded by name, tag chunkgrpo.base_model)."""
    tags = {}
    if trained is not None:
        tags[WEIGHTS_TAG] = weights_sha256(trained.path)
    if base_model and Path(base_model).expanduser().is_dir():
        tags[BASE_WEIGHTS_TAG] = weights_sha256(Path(base_model).expanduser())
    return tags


def _stage_run(cfg: EvalConfig, out: Path, base_model: str, trained=None):
    """The MLflow stage run "evaluate", fed from a background thread (as in training): an unreachable or
    dying tracking server never blocks or fails the evaluation. The results are written and uploaded
    first, then handed to MLflow, which gets at most tracking_flush_timeout_s more (then one warning
    line; the results stay intact). Its tags name the weights scored (`_weights_tags`)."""
    params = tracking.flatten({k: v for k, v in cfg.to_dict().items()})
    tags = {"chunkgrpo.model": cfg.model or "(base only)", "chunkgrpo.base_model": base_model,
            **_weights_tags(trained, base_model)}
    where = f"{out / 'metrics.json'}" + (f" and {cfg.output_uri}" if cfg.output_uri else "")
    return tracking.background_stage_run("evaluate", parent_run_id=cfg.parent_run_id or None,
                                         experiment=cfg.experiment, params=params, tags=tags,
                                         timeout_s=cfg.tracking_timeout_s, kept_in=where,
                                         flush_timeout_s=cfg.tracking_flush_timeout_s)


def _publish(cfg: EvalConfig, out: Path, base_model: str, metrics: dict, grids: list[Path], tracker,
             captions: dict[str, list] | None = None) -> None:
    """Upload output_dir (when output_uri is set), then hand metrics and artifacts to MLflow."""
    if cfg.output_uri:  # the results are safe in S3 before MLflow is asked for anything more
        meta = {"kind": "eval", "model": cfg.model or base_model}
        ArtifactStore().put_folder(out, cfg.output_uri, meta=meta)
        log.info("uploaded %s to %s", out, cfg.output_uri)
    if metrics:
        tracker.log_metrics(metrics)
    tracker.log_artifact(out / "metrics.json")
    tracker.log_artifact(out / "report.html")
    for g in grids:
        tracker.log_artifact(g, "grids")
        with Image.open(g) as im:  # the run page's image view, one key per benchmark and label
            tracker.log_image(im.convert("RGB"), key=f"grids.{g.stem}", step=0)
    if captions:  # each grid cell's item key and full prompt
        tracker.log_table(captions, "grids/captions.json")


def _grid_captions(jobs: list[Job], grids: list[Path], n: int = 16) -> dict[str, list]:
    """Columns grid/key/prompt for the cells of `_grids`' images (a benchmark's first n items)."""
    rows: dict[str, list] = {"grid": [], "key": [], "prompt": []}
    for g in grids:
        bench = g.stem.rsplit("_", 1)[0]
        for j in [j for j in jobs if j.benchmark == bench][:n]:
            rows["grid"].append(f"grids/{g.name}")
            rows["key"].append(j.key)
            rows["prompt"].append(j.prompt)
    return rows


def run_evaluation(cfg: EvalConfig, *, detector=None, color_fn: Callable | None = None, judge=None,
                   scorers: dict | None = None) -> dict:
    """Run the evaluate stage; returns the metrics dict (also written to `<output_dir>/metrics.json`).

    `detector` / `color_fn` (GenEval), `judge` (a `wise.JudgeClient`) and `scorers` ({name: obj with
    score()/info}) override what the config would build (tests, notebooks)."""
    t_start = time.perf_counter()
    from chunkgrpo.gpu import require

    for dev in dict.fromkeys((cfg.device, cfg.scorer_device)):  # before any model or bucket is touched
        require(dev)
    if cfg.output_uri:  # before any work: results must never be "uploaded" to a bucket that does not exist
        ArtifactStore().require_bucket(cfg.output_uri)
    out = Path(cfg.output_dir).expanduser()
    labels = cfg.labels()
    trained = load_trained(cfg.model, cache_dir=cfg.cache_dir or None) if cfg.model else None  # before mkdir
    base_model = _base_model(cfg, trained)
    if Path(base_model).is_dir():  # another architecture is refused before anything is written
        from chunkgrpo.flux import check_model_folder

        check_model_folder(base_model)
    jobs, ctx = image_jobs(cfg)  # a bad prompt file is refused before the output folder exists
    out.mkdir(parents=True, exist_ok=True)
    built = check_before_generation(cfg, scorers=scorers, detector=detector, color_fn=color_fn)
    models = {"scorers": scorers, "detector": detector, "judge": judge,
              "color_fn": color_fn if color_fn is not None else built.get("color_fn")}
    for lb in labels if "geneval" in ctx else ():
        geneval.write_layout(ctx["geneval"]["metadata"], out / "geneval" / lb)
    _prepare_resume(cfg, out, jobs, _fingerprint(cfg, trained, base_model))
    cache = None
    if "base" in labels and cfg.base_cache:  # the base label's images shared between evaluations
        device = resolve_device(cfg.device)
        cache = base_cache.open_cache(cfg.base_cache, base_model, cfg.sampling.to_dict(), cfg.seed,
                                      str(_torch_dtype(cfg.dtype, device)), device)
    from_cache = cache.fetch(out, jobs) if cache else 0
    with _stage_run(cfg, out, base_model, trained) as tracker:
        gen_stats = _generate(cfg, out, jobs, labels, trained, base_model)
        if cache:
            gen_stats.update(base_from_cache=from_cache, base_to_cache=cache.store_new(out, jobs),
                             base_cache=cache.root)
        log.info("generation: %s", gen_stats)
        benchmarks, scorer_infos, per_image = {}, {}, {}
        t_score = time.perf_counter()
        for bench in cfg.benchmarks:
            benchmarks[bench], records, infos = _benchmark_entry(cfg, bench, out, jobs, labels, ctx[bench],
                                                                 models)
            scorer_infos.update(infos)
            if records is not None:
                per_image[bench] = records
        metrics = stats.flat_metrics(benchmarks)
        result: dict[str, Any] = {
            "format": METRICS_FORMAT, "labels": labels,
            "models": _describe_models(cfg, labels, trained, base_model),
            "base_model": base_model, "sampling": cfg.sampling.to_dict(), "seed": cfg.seed,
            "benchmarks": benchmarks, "scorers": scorer_infos, "metrics": metrics, "generation": gen_stats,
            "timing": {"generation_s": gen_stats.get("generation_s", 0.0),
                       "scoring_s": round(time.perf_counter() - t_score, 3)},
            "report": "report.html", "output_dir": str(out), "output_uri": cfg.output_uri or None,
            "mlflow_run_id": _run_id(tracker, cfg.tracking_timeout_s), "config": cfg.to_dict(),
        }
        grids = _grids(out, jobs, labels)
        report_jobs = {b: [j for j in jobs if j.benchmark == b] for b in cfg.benchmarks}
        write_report(out / "report.html", result, out, report_jobs, per_image,
                     max_prompts=cfg.report_max_prompts, thumb=cfg.report_thumb_size)
        result["timing"]["total_s"] = round(time.perf_counter() - t_start, 3)
        (out / "metrics.json").write_text(json.dumps(result, indent=1, default=_json_default))
        _publish(cfg, out, base_model, metrics, grids, tracker, _grid_captions(jobs, grids))
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
            verdict = {1: "trained better", -1: "trained worse", 0: "no significant difference"}[
                c["significance"]
            ]
            ci = (
                f"{round(100 * c['level'])}% CI {c['ci_low']:+.4f}, {c['ci_high']:+.4f}"
                if c.get("ci_low") is not None
                else c.get("note", "no interval")
            )
            lines.append(f"  {bench}.{metric}: trained − base {c['delta']:+.4f} [{ci}] "
                         f"win rate {c['win_rate']:.0%} (n={c['n']}): {verdict}")
        if not res:
            lines.append(f"{bench}: images generated (not scored)")
        if res and not b.get("comparable_to_official"):
            lines.append(
                f"  {bench}: not comparable to published numbers: {'; '.join(b.get('comparable_notes', []))}"
            )
    return lines




__all__ = ["run_evaluation", "image_jobs", "check_before_generation", "summary_lines", "METRICS_FORMAT"]
