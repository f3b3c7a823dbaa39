"""TrainConfig: every knob of the training stage, with help strings, validated on construction.

Presets for the paper's recipes live in `chunkgrpo/presets/*.yaml`; any field can be overridden as
`key=value` (nested with dots: `sampling.eta=0.3`, `lora.rank=64`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from chunkgrpo.config import Config, option
from chunkgrpo.errors import UserError
from chunkgrpo.rollout import SamplingConfig

METHODS = ("chunk", "chunk+ws", "dance", "tempflow", "granular")


@dataclass
class LoraConfig(Config):
    """LoRA adapter (peft) on the transformer; disabled = full fine-tuning."""

    enabled: bool = option(True, "train a LoRA adapter (false = full fine-tuning of the transformer)")
    rank: int = option(32, "LoRA rank r")
    alpha: float = option(64.0, "LoRA alpha (scale = alpha / rank)")
    dropout: float = option(0.0, "LoRA dropout")
    targets: list[str] = option(["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj",
                                 "to_add_out"], "module names to adapt (FLUX attention projections by default)")

    def __post_init__(self) -> None:
        if self.enabled and self.rank < 1:
            raise UserError(f"lora.rank must be >= 1, got {self.rank}")
        if self.enabled and not self.targets:
            raise UserError("lora.targets is empty; name at least one module (e.g. to_q)")


@dataclass
class RewardSpec(Config):
    """One training reward: a registry name, its weight and its options."""

    name: str = option("brightness", "reward name (see `chunkgrpo.train.rewards.REWARDS` or an eval scorer name)")
    weight: float = option(1.0, "weight in the advantage aggregation")
    options: dict[str, str] = option({}, "reward-specific options (e.g. target=0.8, model=DIR)")


@dataclass
class CheckpointConfig(Config):
    """Checkpoints: local folder + optional S3 mirror, manifest written last."""

    every: int = option(50, "save every N optimizer steps (0 = only at the end)")
    keep: int = option(3, "local checkpoints to keep (older complete ones are deleted)")
    s3_prefix: str = option("", "s3://bucket/prefix to mirror checkpoints to ('' = local only)")
    resume: bool = option(True, "resume from the latest complete checkpoint in output_dir (or S3) if any")


@dataclass
class TrackingConfig(Config):
    """MLflow logging (active when MLFLOW_TRACKING_URI is set)."""

    experiment: str = option("chunkgrpo", "MLflow experiment name")
    run_name: str = option("", "MLflow run name ('' = derived from the output dir)")
    parent_run_id: str = option("", "parent MLflow run id (pipeline run) to nest this run under")
    image_every: int = option(10, "log a sample image grid every N iterations (0 = never)")


@dataclass
class TrainConfig(Config):
    """The training stage."""

    model: str = option("", "base model: local diffusers FLUX folder, s3:// URI or cached hub id")
    prompts: str = option("", "training prompts (.txt/.jsonl/.tsv/.parquet)")
    output_dir: str = option("runs/train", "where checkpoints, the final model and logs go")
    method: Literal["chunk", "chunk+ws", "dance", "tempflow", "granular"] = option(
        "chunk", "chunk | chunk+ws (weighted chunk sampling) | dance (step-level) | tempflow | granular")
    chunks: str = option("sizes:2,3,4,7", "chunk plan: a plan.json path or a strategy (sizes:…, uniform:N, step, whole)")
    chunk_weighting: Literal["l1", "softmax"] = option("l1", "chunk+ws: how chunk weights become probabilities")
    sampling: SamplingConfig = option(factory=SamplingConfig, help="rollout sampling settings")
    group_size: int = option(12, "G: samples per prompt (the GRPO group)")
    prompts_per_rank: int = option(2, "prompts per rank per rollout (groups stay on one rank)")
    timestep_fraction: float = option(0.5, "fraction of units (chunks, or steps for dance) trained per sample")
    clip_low: float = option(5e-5, "PPO clip ε_lo (ratio lower bound 1 − ε_lo)")
    clip_high: float = option(5e-5, "PPO clip ε_hi (ratio upper bound 1 + ε_hi)")
    adv_clip: float = option(5.0, "advantage clip ±")
    kl_coef: float = option(0.0, "k3 KL-to-old-policy coefficient (0 = off)")
    lr: float = option(1e-5, "AdamW learning rate")
    weight_decay: float = option(1e-4, "AdamW weight decay")
    betas: list[float] = option([0.9, 0.999], "AdamW betas")
    warmup_steps: int = option(0, "linear warm-up optimizer steps")
    max_grad_norm: float = option(0.01, "gradient-norm clip (0 = off)")
    grad_accum: int = option(12, "samples per optimizer step (per rank)")
    max_steps: int = option(151, "optimizer steps to train")
    chunk_backward: Literal["auto", "graph", "per_step", "accumulate"] = option(
        "auto", "how off-policy chunk gradients are formed (all exact): graph = a unit's steps in one forward; "
        "per_step = no-grad ratio pass, then per-step backward; accumulate = per-step backward into a side "
        "gradient buffer, coefficient applied at the chunk's end (no extra pass); auto = graph for units "
        "within policy_batch, accumulate beyond (per_step for full fine-tuning)")
    policy_batch: int = option(4, "memory budget of the policy phase: most transformer inputs (sample, step) in "
                               "one training graph; units of one accumulation window are batched up to it")
    compile: Literal["off", "rollout", "all"] = option(
        "off", "torch.compile the transformer (chunk/step methods): for the rollout, or for rollout and training "
        "(the first iteration compiles)")
    debug_checks: bool = option(False, "also check values that live on the accelerator (σ order, std > 0) on every "
                                "step, at a host sync each; off = only host values are checked")
    recompute_old_logp: bool = option(False, "recompute off-policy old log-probs in the training layout (no-grad) instead of the rollout's")
    branch_steps: list[int] = option([], "tempflow/granular: trained branching steps (default: first half)")
    granularities: list[int] = option([1, 2], "granular: ODE granularities λ for multi-granularity advantages")
    rewards: list[RewardSpec] = option(factory=lambda: [RewardSpec()], help="training rewards (weighted advantage aggregation)")
    lora: LoraConfig = option(factory=LoraConfig, help="LoRA settings")
    distributed: Literal["ddp", "fsdp"] = option("ddp", "ddp (replicated, all-reduced grads) or fsdp (full shard, block-wrapped)")
    mixed_precision: Literal["auto", "fp32", "bf16"] = option("auto", "auto = bf16 autocast on GPU, fp32 on CPU (master weights fp32)")
    gradient_checkpointing: bool = option(True, "activation checkpointing in the transformer blocks")
    device: str = option("auto", "auto | cpu | cuda")
    seed: int = option(42, "base seed (rollout noise, unit selection and data order derive from it)")
    checkpoint: CheckpointConfig = option(factory=CheckpointConfig, help="checkpointing")
    tracking: TrackingConfig = option(factory=TrackingConfig, help="MLflow logging")
    embed_cache_dir: str = option("", "prompt-embedding cache dir ('' = output_dir/embeds)")
    progress: bool = option(True, "progress bar on rank 0")

    def __post_init__(self) -> None:
        if self.group_size < 2:
            raise UserError(f"group_size must be >= 2 for group-relative advantages, got {self.group_size}")
        if self.prompts_per_rank < 1:
            raise UserError(f"prompts_per_rank must be >= 1, got {self.prompts_per_rank}")
        if not 0 < self.timestep_fraction <= 1:
            raise UserError(f"timestep_fraction must be in (0, 1], got {self.timestep_fraction}")
        for name in ("clip_low", "clip_high", "lr", "adv_clip"):
            if getattr(self, name) < 0:
                raise UserError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.grad_accum < 1 or self.max_steps < 1:
            raise UserError(f"grad_accum and max_steps must be >= 1 (got {self.grad_accum}, {self.max_steps})")
        if self.method in ("chunk", "chunk+ws", "dance") and self.samples_per_rank % self.grad_accum:
            raise UserError(f"grad_accum={self.grad_accum} must divide prompts_per_rank × group_size = "
                            f"{self.samples_per_rank} (optimizer steps happen within one rollout)")
        if self.policy_batch < 1:
            raise UserError(f"policy_batch must be >= 1 (transformer inputs per training forward), got {self.policy_batch}")
        if not self.rewards:
            raise UserError("no training reward configured (rewards: [{name: ..., weight: ...}])")
        if len(self.betas) != 2:
            raise UserError(f"betas must have 2 values, got {self.betas}")
        if any(g < 1 for g in self.granularities):
            raise UserError(f"granularities must be >= 1, got {self.granularities}")
        bad = [k for k in self.branch_steps if not 0 <= k < self.sampling.num_steps - 1]
        if bad:
            raise UserError(f"branch_steps {bad} out of range 0..{self.sampling.num_steps - 2}")

    @property
    def trainable_steps(self) -> int:
        return self.sampling.num_steps - 1

    @property
    def samples_per_rank(self) -> int:
        return self.prompts_per_rank * self.group_size
