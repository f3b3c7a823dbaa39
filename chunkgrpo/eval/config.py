"""The evaluate stage's configuration (`chunkgrpo evaluate --config eval_hpdv2 model=…`).

Sampling is nested: `sampling.num_steps`, `sampling.trained_steps`, … (an `eval.hybrid.HybridConfig`,
i.e. `rollout.SamplingConfig`'s fields with the paper's evaluation defaults plus `trained_steps`), so a
value has the same name in training, evaluation and serving. `PAPER_SAMPLING` is the paper's protocol
(method.md §5; MixGRPO hybrid inference): a run that differs is marked not comparable.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Literal

from chunkgrpo.config import Config, option
from chunkgrpo.errors import UserError
from chunkgrpo.eval.hybrid import HybridConfig
from chunkgrpo.eval.wise import JudgeConfig

BENCHMARKS = ("hpdv2", "geneval", "wise")
LABELS = ("trained", "base")
# the paper's evaluation protocol (method.md §5; MixGRPO hybrid inference), in `sampling.` field names
PAPER_SAMPLING = {"num_steps": 50, "trained_steps": 30, "height": 1024, "width": 1024, "guidance": 3.5,
                  "schedule": "dynamic"}
DETECTORS = ("mmdet", "transformers")  # the weight-loading GenEval backends; anything else is module:attr
NAMED = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_][\w.]*")


@dataclasses.dataclass
class EvalConfig(Config):
    """The evaluate stage (`chunkgrpo evaluate --config eval_hpdv2 model=…`)."""

    model: str = option("", "trained model: the trainer's final/ folder (or its output_dir), an s3:// folder "
                            "artifact, or a model-pointer .json; empty = evaluate the base model alone")
    base_model: str = option(
        "",
        "base FLUX pipeline (folder, s3://, or a hub id in the local cache); default: "
        "base_model recorded in the trained model's chunkgrpo_model.json",
    )
    benchmarks: list[str] = option(["hpdv2"], "benchmarks to run: hpdv2 | geneval | wise")
    scorers: list[str] = option(
        ["hpsv3", "imagereward"],
        "HPDv2 scorers: programmatic rewards (brightness, color, contrast) or eval scorers "
        "(hpsv3, imagereward, hpsv2.1, pickscore, clip), or a user's scorer: an import path module:attr of a "
        "reward factory or an entry point of group chunkgrpo.scorers / chunkgrpo.rewards (docs/rewards.md)",
    )
    scorer_weights: dict[str, str] = option({}, "weights per scorer: {name: local dir/file or s3:// prefix}")
    scorer_options: dict[str, dict] = option(
        {},
        "extra options per scorer, e.g. {pickscore: {processor: DIR}, "
        "hpsv3: {processor: QWEN2VL_DIR}, brightness: {target: 0.5}}",
    )
    scorer_device: str = option("auto", "device for scorers: auto | cpu | cuda | cuda:N")
    num_prompts: int = option(0, "use only the first N prompts of each benchmark (0 = all)")
    sampling: HybridConfig = option(factory=HybridConfig, help="how images are sampled (`SamplingConfig`'s "
                                    "fields + trained_steps; defaults: the paper's evaluation protocol)")
    batch_size: int = option(4, "images per transformer batch")
    seed: int = option(
        42, "base seed: HPDv2 image i uses seed+i, GenEval sample k seed+k, WISE prompt id p seed+p"
    )
    compare_base: bool = option(True, "also generate/score the base model with the same prompts and seeds")
    output_dir: str = option("eval", "local folder for images, metrics.json and report.html")
    output_uri: str = option(
        "", "s3://bucket/prefix to upload output_dir to (folder artifact); empty = no upload"
    )
    resume: bool = option(
        True, "keep images already in output_dir when they were made with the same settings"
    )
    base_cache: str = option(
        "", "s3://bucket/prefix where base-model images are shared between evaluations (the pipelines: "
            "s3://<artifact bucket>/eval-base-cache); empty = generate them every time "
            "(chunkgrpo.eval.base_cache)"
    )
    generate_only: bool = option(False, "only generate images (score later / elsewhere)")
    device: str = option("auto", "generation device: auto | cpu | cuda | cuda:N")
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = option(
        "auto", "model dtype (auto: bf16 on GPU)"
    )
    offload: bool = option(
        False, "full fine-tunes: keep the inactive transformer on the CPU (two copies otherwise)"
    )
    cache_dir: str = option(
        "", "where s3:// models/weights are cached (default $CHUNKGRPO_CACHE or ~/.cache/chunkgrpo)"
    )
    hpdv2_prompts: str = option("", "HPDv2 prompt file (default: the 400 official test prompts)")
    geneval_metadata: str = option(
        "", "GenEval evaluation_metadata.jsonl (default: the official 553 prompts)"
    )
    geneval_samples: int = option(4, "GenEval images per prompt (official: 4)")
    geneval_detector: str = option(
        "mmdet",
        "GenEval detector: mmdet (official Mask2Former, eval image) | transformers (not comparable) | "
        "module:attr of a detector factory needing no weights (e.g. the toy world's exact detector, "
        "chunkgrpo.toy.detector:ToyDetector)",
    )
    geneval_detector_weights: str = option(
        "", "detector checkpoint (mmdet .pth or its folder; transformers folder)"
    )
    geneval_detector_config: str = option("", "mmdet config .py (default: the one shipped with mmdet)")
    geneval_color_model: str = option(
        "", "CLIP ViT-L/14 folder for the colour classifier (transformers format)"
    )
    geneval_color_fn: str = option("", "module:attr of a colour classifier factory (used instead of "
                                       "geneval_color_model), e.g. chunkgrpo.toy.detector:ToyColorClassifier")
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
        from chunkgrpo.scoring.custom import check_name  # no torch: configs validate anywhere

        for name in self.scorers:
            check_name(name, "scorer")  # built in, an import path module:attr or an entry point
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
        if self.base_cache:  # the same check as output_uri's, plus a valid bucket name and key
            from chunkgrpo.store import parse_s3_uri

            try:
                parse_s3_uri(self.base_cache)
            except UserError as e:
                raise UserError(f"base_cache: {e}") from None
        for key in ("device", "scorer_device"):
            dev = getattr(self, key)
            if dev not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", dev):
                raise UserError(f"{key}={dev!r} is not one of auto, cpu, cuda, cuda:N")
        if not self.output_dir:
            raise UserError("output_dir must be set")
        if not self.model and not self.base_model:
            raise UserError(
                "set model (a trained model) and/or base_model (to evaluate the base model alone)"
            )
        if not self.model and not self.compare_base:
            raise UserError("compare_base=false with no model leaves nothing to evaluate")
        if self.geneval_detector not in DETECTORS and not NAMED.fullmatch(self.geneval_detector):
            raise UserError(
                f"geneval_detector={self.geneval_detector!r} is not one of {', '.join(DETECTORS)} "
                "or a module:attr name"
            )
        if self.geneval_color_fn and not NAMED.fullmatch(self.geneval_color_fn):
            raise UserError(f"geneval_color_fn={self.geneval_color_fn!r} is not a module:attr name")

    def named_detector(self) -> bool:
        """Is `geneval_detector` a module:attr factory (not one of the weight-loading backends)?"""
        return self.geneval_detector not in DETECTORS

    def labels(self) -> list[str]:
        out = ["trained"] if self.model else []
        if self.compare_base or not self.model:
            out.append("base")
        return out



__all__ = ["EvalConfig", "BENCHMARKS", "LABELS", "PAPER_SAMPLING"]
