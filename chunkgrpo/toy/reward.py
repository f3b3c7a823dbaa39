"""The `toy_geneval` training reward: GenEval correctness of a toy image for its caption, scored by the
exact toy detector under the project's own GenEval rules (no learned model in the loop)."""

from __future__ import annotations

from functools import lru_cache

import torch

from chunkgrpo.errors import UserError
from chunkgrpo.toy.detector import ToyColorClassifier, ToyDetector, partial_credit, score
from chunkgrpo.toy.world import parse_caption


@lru_cache(maxsize=4096)
def _metadata(prompt: str) -> dict:
    return parse_caption(prompt)


def _flag(value, name: str) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on"):
        return True
    if text in ("false", "0", "no", "off"):
        return False
    raise UserError(f"toy_geneval reward: {name}={value!r} must be true or false")


def toy_geneval_reward(dense=True):
    """(images, prompts) → float32 (n,): 1.0 when the image satisfies its caption by the GenEval rules,
    else 0.0, or with `dense` the partial credit in [0, 0.99] (`chunkgrpo.toy.detector.partial_credit`)."""
    dense = _flag(dense, "dense")
    det, cf = ToyDetector(), ToyColorClassifier()

    def fn(images, prompts):
        out = []
        for im, p in zip(images, prompts):
            md = _metadata(p)
            out.append(partial_credit(im, md, det, cf) if dense else float(score(im, md, det, cf)["correct"]))
        return torch.tensor(out, dtype=torch.float32)

    return fn
