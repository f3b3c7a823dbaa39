"""The `toy_geneval` training reward: GenEval correctness of a toy image for its caption, scored by the
exact toy detector under the project's own GenEval rules (no learned model in the loop)."""

from __future__ import annotations

from functools import lru_cache

import torch

from chunkgrpo.errors import UserError
from chunkgrpo.toy.detector import ToyColorClassifier, ToyDetector, graded_credit, partial_credit, score
from chunkgrpo.toy.world import parse_caption


@lru_cache(maxsize=4096)
def _metadata(prompt: str) -> dict:
    return parse_caption(prompt)


def _mode(value) -> str:
    if isinstance(value, bool):
        return "clauses" if value else "false"
    text = str(value).strip().lower()
    if text in ("true", "1", "yes", "on", "clauses"):
        return "clauses"
    if text in ("false", "0", "no", "off"):
        return "false"
    if text == "graded":
        return "graded"
    raise UserError(f"toy_geneval reward: dense={value!r} must be false, true (clauses) or graded")


def toy_geneval_reward(dense=True):
    """(images, prompts) → float32 (n,): 1.0 when the image satisfies its caption by the GenEval rules,
    else 0.0 (`dense: false`); the fraction of satisfied clauses, capped at 0.99 (`dense: true`,
    `chunkgrpo.toy.detector.partial_credit`); or credit that grows continuously with the shape, colour and
    placement of the objects (`dense: graded`, `chunkgrpo.toy.detector.graded_credit`). Every mode gives
    exactly 1.0 iff the image is correct by the rules."""
    mode = _mode(dense)
    det, cf = ToyDetector(), ToyColorClassifier()

    def fn(images, prompts):
        out = []
        for im, p in zip(images, prompts):
            md = _metadata(p)
            if mode == "graded":
                out.append(graded_credit(im, md, det, cf))
            elif mode == "clauses":
                out.append(partial_credit(im, md, det, cf))
            else:
                out.append(float(score(im, md, det, cf)["correct"]))
        return torch.tensor(out, dtype=torch.float32)

    return fn
