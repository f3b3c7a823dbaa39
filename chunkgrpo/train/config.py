"""TrainConfig: every knob of the training stage, with help strings, validated on construction.

Presets for the paper's recipes live in `chunkgrpo/presets/*.yaml`; any field can be overridden as
`key=value` (nested with dots: `sampling.eta=0.3`, `lora.rank=64`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from chunkgrpo.config import Config, check_finite, option
from chunkgrpo.errors import UserError
from chunkgrpo.recipes import BRANCHING_METHODS, GRPO_METHODS, METHOD_NAMES
from chunkgrpo.rollout import SamplingConfig
from chunkgrpo.train.dist import DEFAULT_TIMEOUT_S

# Samples one rank rolls out per iteration (prompts_per_rank × group_size): far above what any GPU holds,
# below the sizes at which a rollout's tensor sizes overflow.
MAX_SAMPLES_PER_RANK = 2**16


@dataclass
class LoraConfig(Config):
    """LoRA adapter (peft) on the transformer; disabled = full fine-tuning."""

    enabled: bool = option(True, "train a LoRA adapter (false = full fine-tuning of the transformer)")
    rank: int = option(32, "LoRA rank r")
    alpha: float = option(64.0, "LoRA alpha (scale = alpha / rank)")
    dropout: float = option(0.0, "LoRA dropout")
    init: Literal["default", "gaussian"] = option(
        "default",
        "initialisation of A (B = 0 either way): default = peft's Kaiming-uniform, sd 1/sqrt(3·fan_in) "
        "(≈ 0.010 on FLUX's 3072-wide layers); gaussian = N(0, (1/r)²), TempFlow-GRPO's reference",
    )
    targets: list[str] = option(
        ["to_q", "to_k", "to_v", "to_out.0", "add_q_proj", "add_k_proj", "add_v_proj", "to_add_out"],
        "module names to adapt (FLUX attention projections by default)",
    )

    def __post_init__(self) -> None:
        check_finite(self, "lora.")
        if not 0 <= self.dropout < 1:
            raise UserError(f"lora.dropout must be in [0, 1), got {self.dropout}")
        if self.enabled and self.rank < 1:
            raise UserError(f"lora.rank must be >= 1, got {self.rank}")
        if self.enabled and not self.targets:
            raise UserError("lora.targets is empty; name at least one module (e.g. to_q)")
        if self.init not in ("default", "gaussian"):
            raise UserError(f"lora.init={self.init!r} must be 'default' or 'gaussian'")


@dataclass
class RewardSpec(Config):
    """One training reward: a registry name, its weight and its options."""

    name: str = option("brightness", "reward name: a built-in reward or scorer (`chunkgrpo.scoring.table`), "
                                     "an import path module:attr of a factory, or an entry point of group "
                                     "chunkgrpo.rewards (docs/rewards.md)")
    weight: float = option(1.0, "weight in the advantage aggregation")
    options: dict[str, str] = option({}, "reward-specific options (e.g. target=0.8, model=DIR); with url: "
                                     "the client's (max_batch, deadline_s, timeout_s, backoff_s)")
    url: str = option("", "a reward server (`chunkgrpo reward-server`) that scores `name`, e.g. "
                          "http://hpsv3-reward:8080 ('' = score in this process); "
                          "token: $CHUNKGRPO_REWARD_TOKEN")

    def __post_init__(self) -> None:
        check_finite(self, f"rewards[{self.name}].")
        if self.url:  # the server resolves the name
            from chunkgrpo.scoring.remote import check_url

            self.url = check_url(self.url)
            return
        from chunkgrpo.scoring.custom import check_name  # imports the factory only, no torch, no model

        check_name(self.name, "reward")


@dataclass
class CheckpointConfig(Config):
    """Checkpoints: local folder + optional S3 mirror, manifest written last."""

    every: int = option(50, "save every N optimizer steps (0 = only at the end)")
    keep: int = option(
        3, "local checkpoints to keep (older ones are deleted, once in S3 when mirrored; 0 = all)"
    )
    s3_prefix: str = option("", "s3://bucket/prefix to mirror checkpoints to ('' = local only)")
    resume: bool = option(
        True, "resume from the newest checkpoint in output_dir (or S3) that verifies against its manifest"
    )
    mirror_backlog: int = option(
        0,
        "S3 outage: checkpoints not yet in S3 kept beyond `keep`; "
        "one more stops training instead of deleting it",
    )
    mirror_wait_s: float = option(
        120.0, "at the end of training, the S3 mirror's wait beyond what its bytes take at mirror_min_mb_s "
        "(connections, the manifest, a retry) before failing"
    )
    final_uri: str = option(
        "", "s3://bucket/prefix/final: the trainer uploads its final model there before the last "
        "checkpoint's upload starts ('' = the caller uploads it)"
    )
    async_save: bool = option(
        True, "FSDP: each rank's shards are copied to host memory and written by a background thread "
        "(torch.distributed.checkpoint.async_save) while training goes on; a commit thread then hashes them "
        "and rank 0 writes the manifest. At most one save is in flight: the next checkpoint, and the end of "
        "training, wait for it"
    )
    mirror_min_mb_s: float = option(
        50.0, "the slowest S3 upload rate (MB/s, per rank) a run accepts: the end-of-training wait is the "
        "bytes still to upload at this rate plus mirror_wait_s (a full FLUX.1-dev checkpoint of ~143 GB "
        "from one rank: ~48 min; sharded over 8 ranks: ~6 min)"
    )
    allow_config_change: bool = option(False, "resume even though the checkpoint was trained with another "
                                       "base model, method, lr, optimizer, LoRA, sampling, rewards, seed or "
                                       "chunk sizes (refused otherwise)")
    s3_wait_s: float = option(900.0, "resume: seconds to keep retrying (with backoff) an S3 that cannot be "
                              "read (down, connection cut, timing out) before failing in one line; an "
                              "unreachable checkpoint is never taken for a bad one, and training never "
                              "starts from scratch while S3 may hold its checkpoints. 900 s outlasts an S3 "
                              "restart or rolling upgrade; a pod failing sooner would only be retried into "
                              "the same outage")
    lease_expiry_s: float = option(300.0, "S3 mirror: the writer lease under s3_prefix (one training per "
                                   "prefix) expires this long after its last heartbeat (renewed every "
                                   "quarter of it); a stale lease is taken over, a live one of another run "
                                   "refuses to start. 300 s: a retried pod reaches the lease after loading "
                                   "the model, by then its dead predecessor's lease has expired")
    writer_id: str = option("", "who this training is for the writer lease ('' = output_dir and seed); a "
                            "pipeline sets its run id, so a retried pod with a fresh output_dir takes its "
                            "run's lease back at once")
    mirror_timeout_s: float = option(120.0, "S3 mirror: read timeout of each upload request (one part, "
                                     "<= 64 MiB); a hung S3 server fails the attempt after this instead of "
                                     "stalling training, and the mirror retries with backoff")

    def __post_init__(self) -> None:
        check_finite(self, "checkpoint.")
        for name in ("every", "keep", "mirror_backlog", "mirror_wait_s", "s3_wait_s"):
            if getattr(self, name) < 0:
                raise UserError(f"checkpoint.{name} must be >= 0, got {getattr(self, name)}")
        for name in ("mirror_timeout_s", "lease_expiry_s", "mirror_min_mb_s"):
            if getattr(self, name) <= 0:
                raise UserError(f"checkpoint.{name} must be > 0, got {getattr(self, name)}")
        if self.final_uri:
            if not self.final_uri.startswith("s3://"):
                raise UserError(f"checkpoint.final_uri={self.final_uri!r} is not an S3 URI (expected "
                                "s3://bucket/prefix)")
            from chunkgrpo.store import parse_s3_uri

            parse_s3_uri(self.final_uri)
        if self.s3_prefix:
            if not self.s3_prefix.startswith("s3://"):
                raise UserError(f"checkpoint.s3_prefix={self.s3_prefix!r} is not an S3 URI (expected s3://bucket/prefix)")
            from chunkgrpo.store import parse_s3_uri

            parse_s3_uri(self.s3_prefix)  # a valid bucket name


@dataclass
class TrackingConfig(Config):
    """MLflow logging (active when MLFLOW_TRACKING_URI is set)."""

    experiment: str = option("chunkgrpo", "MLflow experiment name")
    run_name: str = option("", "MLflow run name ('' = derived from the output dir)")
    parent_run_id: str = option("", "parent MLflow run id (pipeline run) to nest this run under")
    image_every: int = option(10, "log a sample image grid every N iterations (0 = never)")
    timeout_s: int = option(
        10, "seconds per MLflow request; requests run in a background thread, training never waits"
    )
    flush_timeout_s: float = option(
        60.0, "at the end of training, seconds to wait for buffered metrics to reach MLflow"
    )

    def __post_init__(self) -> None:
        check_finite(self, "tracking.")
        if self.image_every < 0:
            raise UserError(f"tracking.image_every must be >= 0, got {self.image_every}")
        if self.timeout_s < 1 or self.flush_timeout_s < 0:
            raise UserError(
                f"tracking.timeout_s must be >= 1 and flush_timeout_s >= 0, got {self.timeout_s}, "
                f"{self.flush_timeout_s}"
            )


@dataclass
class EmaConfig(Config):
    """EMA of the trainable weights; the exported model is the EMA (DanceGRPO, Flow-GRPO / TempFlow)."""

    decay: float = option(0.0, "EMA decay d (0 = off; DanceGRPO 0.995, TempFlow 0.9)")
    every: int = option(1, "update every N iterations (rollouts)")
    warmup: bool = option(False, "decay min(d, (1+n)/(10+n)) for the n-th update (Flow-GRPO / TempFlow)")

    def __post_init__(self) -> None:
        if not 0 <= self.decay < 1:
            raise UserError(f"ema.decay must be in [0, 1), got {self.decay}")
        if self.every < 1:
            raise UserError(f"ema.every must be >= 1, got {self.every}")


@dataclass
class TrainConfig(Config):
    """The training stage."""

    model: str = option("", "base model: local diffusers FLUX folder, s3:// URI or cached hub id")
    prompts: str = option("", "training prompts (.txt/.jsonl/.tsv/.parquet)")
    output_dir: str = option("runs/train", "where checkpoints, the final model and logs go")
    method: Literal[METHOD_NAMES] = option(
        "chunk", "chunk | chunk+ws (weighted chunk sampling) | dance (step-level) | tempflow | granular")
    chunks: str = option("sizes:2,3,4,7", "chunk plan spec (chunk/chunk+ws): a plan.json path, sizes:…, "
                         "uniform:N, step or whole (`chunkgrpo.chunks`)")
    chunk_weighting: Literal["l1", "softmax"] = option(
        "l1", "chunk+ws: how chunk weights become probabilities"
    )
    sampling: SamplingConfig = option(factory=SamplingConfig, help="rollout sampling settings")
    group_size: int = option(12, "G: samples per prompt (the GRPO group)")
    prompts_per_rank: int = option(2, "prompts per rank per rollout (groups stay on one rank)")
    timestep_fraction: float = option(
        0.5, "fraction of units (chunks, or steps for dance) trained per sample"
    )
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
    max_steps: int = option(
        0,
        "optimizer steps to train (0 = count iterations instead); set exactly one of "
        "max_steps / max_iterations (a command-line override of one clears the preset's other)",
    )
    max_iterations: int = option(
        0,
        "iterations (= rollouts; the papers' 'training steps') to train (0 = count "
        "optimizer steps instead); each makes the method's optimizer steps per rollout",
    )
    chunk_backward: Literal["auto", "graph", "per_step", "accumulate"] = option(
        "auto",
        "how off-policy chunk gradients are formed (all exact): graph = a unit's steps in one forward; "
        "per_step = no-grad ratio pass, then per-step backward; accumulate = per-step backward into a side "
        "gradient buffer, coefficient applied at the chunk's end (no extra pass); auto = graph for units "
        "within policy_batch, accumulate beyond (per_step for full fine-tuning)",
    )
    policy_batch: int = option(
        4,
        "memory budget of the policy phase: most transformer inputs (sample, step) in "
        "one training graph; units of one accumulation window are batched up to it",
    )
    compile: Literal["off", "rollout", "all"] = option(
        "off",
        "torch.compile the transformer (chunk/step methods): for the rollout, or for rollout and training "
        "(the first iteration compiles)",
    )
    compile_backend: Literal["inductor", "aot_eager_decomp_partition", "aot_eager", "eager"] = option(
        "inductor",
        "torch.compile backend when compile is on: inductor (generated kernels: Triton on GPUs, C++ on CPU); "
        "aot_eager_decomp_partition / aot_eager / eager run the captured graphs without generated kernels "
        "(to tell a compiler problem from a capture problem; no kernel compilation)",
    )
    debug_checks: bool = option(
        False,
        "also check values that live on the accelerator (σ order, std > 0) on every "
        "step, at a host sync each; off = only host values are checked",
    )
    recompute_old_logp: bool = option(
        False, "recompute off-policy old log-probs in the training layout (no-grad) instead of the rollout's"
    )
    branch_steps: list[int] = option(
        [],
        "tempflow/granular: trained branching steps ([] = the method's default: "
        "tempflow all trainable steps 0..N-2, granular the first half 0..N/2-1)",
    )
    granularities: list[int] = option(
        [1, 2], "granular: ODE granularities λ for multi-granularity advantages"
    )
    branch_update: Literal["auto", "per_step", "per_iteration"] = option(
        "auto",
        "tempflow/granular: per_step = one optimizer step per trained branching step k (G2RPO's per-k "
        "released trainer, train_g2rpo_hps.py); per_iteration = the loss of each k divided by K, "
        "one optimizer step per iteration "
        "(TempFlow; G2RPO's Eq. 9 / Algorithm 1 and train_g2rpo_hps_clip.py @0e69799); "
        "auto = per_step for granular, per_iteration for tempflow",
    )
    noise_weight_c: float = option(
        0.0,
        "tempflow: c in the step weight c·std_k (0 = 1/mean(std over trained "
        "steps), weights average 1 as in the paper; TempFlow's released FLUX code: 1.73)",
    )
    kl_ref_coef: float = option(
        0.0,
        "tempflow/granular: β of the KL to the reference (base) model, "
        "mean((μ_θ − μ_ref)²)/(2·std²) per branching step (TempFlow: 0.004); needs LoRA",
    )
    adv_std: Literal["unbiased", "population"] = option(
        "unbiased",
        "group std of the advantage: unbiased (DanceGRPO/G2RPO/Chunk-GRPO) "
        "or population (Flow-GRPO/TempFlow)",
    )
    adv_eps: float = option(1e-8, "added to the group std (1e-8 DanceGRPO family, 1e-4 Flow-GRPO/TempFlow)")
    reward_weighting: Literal["given", "normalized"] = option(
        "given", "multi-reward weights as given (DanceGRPO, G2RPO) or normalised to sum 1 (MixGRPO)")
    rewards: list[RewardSpec] = option(
        factory=lambda: [RewardSpec()], help="training rewards (weighted advantage aggregation)"
    )
    lora: LoraConfig = option(factory=LoraConfig, help="LoRA settings")
    ema: EmaConfig = option(factory=EmaConfig, help="EMA of the trainable weights (exported model = EMA)")
    distributed: Literal["ddp", "fsdp"] = option(
        "ddp", "ddp (replicated, all-reduced grads) or fsdp (full shard, block-wrapped)"
    )
    fsdp_grad_sync: Literal["window", "backward"] = option(
        "window",
        "fsdp: gradient reduce-scatter once per optimizer step, at the last backward of a policy window "
        "(between its backwards every rank keeps unsharded fp32 gradients: 4 bytes per trainable "
        "parameter, in the capacity plan) or after every backward (sharded gradients only, one "
        "reduce-scatter per backward)",
    )
    dist_timeout_s: float = option(
        DEFAULT_TIMEOUT_S,
        "seconds a collective may wait for the slowest rank before the run fails (the process group's "
        "timeout; NCCL's watchdog). Default: twice the capacity plan's longest single-rank I/O phase for "
        "FLUX.1-dev full fine-tuning at 200 MB/s, rounded up to the hour; the plan warns when a run's "
        "estimate is longer",
    )
    io_wait_s: float = option(
        DEFAULT_TIMEOUT_S,
        "deadline of a wait for another rank's single-rank I/O (model fetch by each node's local rank 0, "
        "writing the final model): waited for outside any collective, with a progress line every minute; "
        "past it the run fails naming the phase",
    )
    mixed_precision: Literal["auto", "fp32", "bf16"] = option(
        "auto", "auto = bf16 autocast on GPU, fp32 on CPU (master weights fp32)"
    )
    gradient_checkpointing: bool = option(True, "activation checkpointing in the transformer blocks")
    device: str = option("auto", "auto | cpu | cuda | cuda:N (one GPU, single process); cuda, or auto in a "
                         "task given GPUs, fails at once when CUDA cannot use the GPU (driver too old)")
    seed: int = option(42, "base seed (rollout noise, unit selection and data order derive from it)")
    checkpoint: CheckpointConfig = option(factory=CheckpointConfig, help="checkpointing")
    tracking: TrackingConfig = option(factory=TrackingConfig, help="MLflow logging")
    embed_cache_dir: str = option("", "prompt-embedding cache dir ('' = output_dir/embeds)")
    progress: bool = option(True, "progress bar on rank 0")

    def __post_init__(self) -> None:
        check_finite(self)  # NaN/inf pass every `< 0` check below
        if not str(self.output_dir).strip():
            raise UserError("output_dir='' is empty; name the run's folder (e.g. output_dir=runs/train) — "
                            "an empty one would write into the current directory")
        if not 0 <= self.seed < 2**32:
            raise UserError(f"seed={self.seed} must be in 0..{2**32 - 1}")
        for name in ("model", "prompts"):  # an s3:// location is checked (bucket name, no '..') up front
            value = getattr(self, name)
            if isinstance(value, str) and value.startswith("s3://"):
                from chunkgrpo.store import parse_s3_uri

                try:
                    parse_s3_uri(value)
                except UserError as e:
                    raise UserError(f"{name}={value}: {e}") from None
        if self.device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", self.device):
            raise UserError(f"device={self.device!r} is not one of auto, cpu, cuda, cuda:N")
        if self.max_grad_norm < 0:
            raise UserError(f"max_grad_norm must be >= 0 (0 = no clipping), got {self.max_grad_norm}")
        if self.weight_decay < 0 or self.kl_coef < 0:
            raise UserError(f"weight_decay and kl_coef must be >= 0, got {self.weight_decay}, {self.kl_coef}")
        if self.warmup_steps < 0:
            raise UserError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.group_size < 2:
            raise UserError(f"group_size must be >= 2 for group-relative advantages, got {self.group_size}")
        if self.prompts_per_rank < 1:
            raise UserError(f"prompts_per_rank must be >= 1, got {self.prompts_per_rank}")
        if self.samples_per_rank > MAX_SAMPLES_PER_RANK:  # tensor sizes past this overflow, not just OOM
            raise UserError(f"prompts_per_rank={self.prompts_per_rank} × group_size={self.group_size} = "
                            f"{self.samples_per_rank} samples per rank is over {MAX_SAMPLES_PER_RANK}")
        if not 0 < self.timestep_fraction <= 1:
            raise UserError(f"timestep_fraction must be in (0, 1], got {self.timestep_fraction}")
        for name in ("clip_low", "clip_high", "lr", "adv_clip"):
            if getattr(self, name) < 0:
                raise UserError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.grad_accum < 1:
            raise UserError(f"grad_accum must be >= 1, got {self.grad_accum}")
        for unit in ("max_iterations", "max_steps"):
            if getattr(self, unit) < 0:
                raise UserError(
                    f"{unit} must be >= 0 (0 = use the other unit), got {unit}={getattr(self, unit)}"
                )
        if (self.max_steps > 0) == (self.max_iterations > 0):
            raise UserError(
                f"set exactly one of max_iterations (rollouts) and max_steps (optimizer steps); got "
                f"max_iterations={self.max_iterations}, max_steps={self.max_steps} (set the other to 0)"
            )
        if self.kl_ref_coef < 0 or self.noise_weight_c < 0 or self.adv_eps < 0:
            raise UserError(f"kl_ref_coef, noise_weight_c and adv_eps must be >= 0 (got {self.kl_ref_coef}, "
                            f"{self.noise_weight_c}, {self.adv_eps})")
        if self.kl_ref_coef > 0 and self.method not in BRANCHING_METHODS:
            raise UserError(
                f"kl_ref_coef={self.kl_ref_coef} (KL to the reference model) is implemented for tempflow/"
                f"granular; method={self.method} has kl_coef (KL to the old policy)"
            )
        if self.kl_ref_coef > 0 and not self.lora.enabled:
            raise UserError(
                f"kl_ref_coef={self.kl_ref_coef} needs lora.enabled=true (the reference model is the "
                "base with the adapter disabled; a full fine-tune would need a second transformer copy)"
            )
        if self.method in GRPO_METHODS and self.samples_per_rank % self.grad_accum:
            raise UserError(f"grad_accum={self.grad_accum} must divide prompts_per_rank × group_size = "
                            f"{self.samples_per_rank} (optimizer steps happen within one rollout)")
        for name in ("dist_timeout_s", "io_wait_s"):
            if not getattr(self, name) > 0:
                raise UserError(f"{name}={getattr(self, name)} must be > 0 seconds")
        if self.policy_batch < 1:
            raise UserError(
                "policy_batch must be >= 1 (transformer inputs per training forward), "
                f"got {self.policy_batch}"
            )
        if not self.rewards:
            raise UserError("no training reward configured (rewards: [{name: ..., weight: ...}])")
        if len(self.betas) != 2 or not all(0 <= b < 1 for b in self.betas):
            raise UserError(f"betas must be 2 values in [0, 1), got {self.betas}")
        if any(g < 1 for g in self.granularities):
            raise UserError(f"granularities must be >= 1, got {self.granularities}")
        bad = [k for k in self.branch_steps if not 0 <= k < self.sampling.num_steps - 1]
        if bad:
            raise UserError(f"branch_steps {bad} out of range 0..{self.sampling.num_steps - 2}")

    @classmethod
    def load(cls, source=None, overrides: list[str] | None = None) -> "TrainConfig":
        """As `Config.load`; an override that sets one training-length unit (max_steps or max_iterations) to
        a non-zero value clears the other one from the preset, so `max_steps=10` on the command line just
        works."""
        from chunkgrpo.config import parse_override

        keys = {parse_override(o)[0]: parse_override(o)[1] for o in overrides or []}
        extra = []
        for unit, other in (("max_steps", "max_iterations"), ("max_iterations", "max_steps")):
            if unit in keys and other not in keys and keys[unit] not in (0, "0", None, ""):
                extra.append(f"{other}=0")
        return super().load(source, [*(overrides or []), *extra])

    def to_dict(self) -> dict:
        """As `Config.to_dict`; a reward scored in-process has no `url` key, so its record (checkpoints
        compare it on resume, runs hash it) is what it was before rewards could be served."""
        d = super().to_dict()
        for r in d.get("rewards", []):
            if not r.get("url"):
                r.pop("url", None)
        return d

    @property
    def trainable_steps(self) -> int:
        return self.sampling.num_steps - 1

    @property
    def samples_per_rank(self) -> int:
        return self.prompts_per_rank * self.group_size
