"""The toy base model's configuration (`ToyModelConfig`): the world, the FLUX parts' sizes, the pretraining.

`chunkgrpo.toy.model` builds the folder; the config's fields and the source of the modules that determine
the weights form its content key (`chunkgrpo.toy.model.model_key`).
"""

from __future__ import annotations

from dataclasses import dataclass

from chunkgrpo.config import Config, option
from chunkgrpo.errors import UserError

META_FILE = "toy_model.json"
FORMAT = "chunkgrpo.toy-model/v1"
RL_PER_CATEGORY = 24  # prompts per GenEval category in toy/train_prompts.txt


@dataclass
class ToyModelConfig(Config):
    """The toy base model: architecture, pretraining and the sampling used to measure it."""

    seed: int = option(0, "world seed (split, scenes) and weight-initialisation seed")
    size: int = option(32, "image size in pixels (square)")
    layers: int = option(2, "FLUX double-stream blocks")
    single_layers: int = option(2, "FLUX single-stream blocks")
    heads: int = option(4, "attention heads")
    head_dim: int = option(16, "attention head dimension (model width = heads × head_dim)")
    text_dim: int = option(64, "T5 width = the transformer's joint attention dimension")
    clip_dim: int = option(32, "CLIP width = pooled projection dimension")
    max_sequence_length: int = option(12, "T5 tokens per caption (the longest toy caption has 11 incl. </s>)")
    steps: int = option(3000, "pretraining optimizer steps")
    batch_size: int = option(32, "scenes per optimizer step")
    lr: float = option(2e-3, "AdamW peak learning rate (linear warm-up, cosine decay to 10 %)")
    warmup: int = option(50, "warm-up steps")
    ema: float = option(0.995, "EMA decay of the saved weights (0 = save the raw weights)")
    shift: float = option(3.0, "σ shift of the training-time noise levels (as the sampling schedule)")
    train_text: bool = option(
        True, "train the text encoders jointly (then frozen like any FLUX's); false = random features"
    )
    pool: int = option(16384, "distinct training scenes rendered (reused across epochs)")
    threads: int = option(
        2, "torch threads while pretraining (0 = torch's default; 1 is robust on a busy machine)"
    )
    sample_steps: int = option(10, "ODE steps used for the samples grid and the base accuracy")
    eval_per_category: int = option(
        16,
        "held-out prompts per category written to toy/heldout_metadata.jsonl (the "
        "demo's evaluation set) and used for the recorded base accuracy (0 = skip)",
    )
    eval_samples: int = option(4, "images per held-out prompt for the recorded base accuracy")

    def __post_init__(self) -> None:
        if self.size % 4 or self.size < 24:
            raise UserError(
                f"size={self.size} must be a multiple of 4 >= 24 (2×2-pixel cells, 2×2 latent patches)"
            )
        for name in (
            "layers",
            "heads",
            "head_dim",
            "text_dim",
            "clip_dim",
            "batch_size",
            "pool",
            "sample_steps",
        ):
            if getattr(self, name) < 1:
                raise UserError(f"{name}={getattr(self, name)} must be >= 1")
        if self.head_dim % 8:
            raise UserError(f"head_dim={self.head_dim} must be a multiple of 8 (rotary axes split it)")
        for name in ("single_layers", "steps", "warmup", "threads", "eval_per_category", "eval_samples"):
            if getattr(self, name) < 0:
                raise UserError(f"{name}={getattr(self, name)} must be >= 0")
        if not 0 <= self.ema < 1:
            raise UserError(f"ema={self.ema} must be in [0, 1)")
        if self.lr <= 0:
            raise UserError(f"lr={self.lr} must be > 0")

    @property
    def rope_axes(self) -> list[int]:
        a = self.head_dim // 4
        b = (self.head_dim - a) // 2
        return [a, b, self.head_dim - a - b]

