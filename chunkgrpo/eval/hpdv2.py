"""HPDv2 test benchmark: the 400 HPDv2 test prompts, one image per prompt, scorer means.

The prompt list is MixGRPO's `data/prompts_test.txt` (= GCPO's `test/test_prompts.csv`), i.e. the 400
prompts of HPDv2's `test.json` (Apache-2.0; Wu et al. 2023). The "HPD v2.1 (test)" label used by
Chunk-GRPO / GCPO leaderboards appears to mean these prompts scored with HPSv3 / ImageReward / ...

Seeds: one fixed seed per prompt, `base_seed + index` (default 42 + i), so every image is reproducible
regardless of batching, sharding or resumption. (GCPO reuses one torch.Generator seeded 42 sequentially
across prompts, which is not reproducible per prompt; numbers differ by sampling noise only.)
Images are written as `<out>/<index:03d>.png`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any, Mapping, Sequence

from chunkgrpo.errors import UserError
from chunkgrpo.eval import data_file, load_rgb

PROMPTS_FILE = "hpdv2/hpdv2_test_prompts_400.txt"
N_PROMPTS = 400
PROMPTS_SHA256 = "6eb1c5561a58da305155ba00755822de4f8b0bc239175e20334e431e978f4a82"
DEFAULT_SEED = 42
DEFAULT_SCORERS = ("hpsv3", "imagereward")


@dataclasses.dataclass(frozen=True)
class HPDv2Item:
    index: int
    prompt: str
    seed: int
    filename: str


def load_prompts(path: str | os.PathLike | None = None, *, strict: bool | None = None) -> list[str]:
    """The HPDv2 test prompts, one per line (blank lines dropped). With the default file (or `strict=True`)
    exactly 400 prompts are required; a custom list may have any length."""
    p = data_file(PROMPTS_FILE, path, what="HPDv2 test prompts (hpdv2_test_prompts_400.txt)")
    from chunkgrpo.inputs import read_text

    # a binary, non-UTF-8 or special file is one line naming it (read_text), not a decode traceback
    prompts = [ln.strip() for ln in read_text(p, "HPDv2 prompt file").splitlines() if ln.strip()]
    if strict is None:
        strict = path is None
    if strict and len(prompts) != N_PROMPTS:
        raise UserError(f"{p}: expected {N_PROMPTS} HPDv2 test prompts, found {len(prompts)}")
    if not prompts:
        raise UserError(f"{p}: no prompts")
    return prompts


def is_official(path: str | os.PathLike | None = None) -> bool:
    """True when the prompt file is byte-identical to the shared copy of the official 400 (sha256)."""
    p = data_file(PROMPTS_FILE, path, what="HPDv2 test prompts")
    return hashlib.sha256(p.read_bytes()).hexdigest() == PROMPTS_SHA256


def seed_for(index: int, base_seed: int = DEFAULT_SEED) -> int:
    """The fixed seed of prompt `index`."""
    if index < 0:
        raise UserError(f"prompt index {index} must be >= 0")
    return base_seed + index


def plan(prompts: Sequence[str], base_seed: int = DEFAULT_SEED) -> list[HPDv2Item]:
    """One image per prompt with its seed and file name."""
    return [HPDv2Item(i, p, seed_for(i, base_seed), f"{i:03d}.png") for i, p in enumerate(prompts)]


def score_images(images: Sequence[Any], prompts: Sequence[str], scorers: Mapping[str, Any],
                 batch_size: int | None = None) -> dict[str, list[float]]:
    """Run every scorer (`chunkgrpo.scoring.scorers.Scorer`) over the aligned images/prompts; per-image
    scores."""
    if len(images) != len(prompts):
        raise UserError(f"got {len(images)} images for {len(prompts)} prompts")
    out: dict[str, list[float]] = {}
    for name, scorer in scorers.items():
        vals: list[float] = []
        step = batch_size or len(images) or 1
        for i in range(0, len(images), step):
            vals += [float(v) for v in scorer.score(list(images[i : i + step]), list(prompts[i : i + step]))]
        out[name] = vals
    return out


def aggregate(scores: Mapping[str, Sequence[float]], infos: Mapping[str, dict] | None = None,
              n_expected: int | None = N_PROMPTS) -> dict:
    """Mean / std / standard error / n per scorer, with each scorer's `info` (preprocessing, scale, weights).
    Non-finite scores are counted in `n_nonfinite` and excluded from the statistics."""
    result: dict[str, Any] = {"benchmark": "hpdv2-test", "scorers": {}}
    ns = set()
    for name, vals in scores.items():
        vals = [float(v) for v in (vals.tolist() if hasattr(vals, "tolist") else vals)]
        finite = [v for v in vals if math.isfinite(v)]
        n = len(finite)
        mean = sum(finite) / n if n else float("nan")
        std = math.sqrt(sum((v - mean) ** 2 for v in finite) / (n - 1)) if n > 1 else 0.0
        entry = {"mean": mean, "std": std, "stderr": std / math.sqrt(n) if n else float("nan"), "n": n,
                 "n_nonfinite": len(vals) - n}
        if infos and name in infos:
            entry["info"] = dict(infos[name])
        result["scorers"][name] = entry
        ns.add(len(vals))
    result["n_images"] = max(ns) if ns else 0
    result["complete"] = n_expected is None or (ns == {n_expected})
    return result


# --------------------------------------------------------------------------------------------------
# the evaluate stage


def score_stage(out: Path, jobs: Sequence[Any], labels: Sequence[str], scorers: Mapping[str, Any],
                infos: Mapping[str, dict], batch_size: int) -> dict:
    """Score `<out>/hpdv2/<label>/<job.rel>` for every label; writes `<out>/hpdv2/scores.jsonl`.
    Returns {"results": {label: aggregate}, "per_image": {label: {scorer: [score per job]}}, "scorers"}."""
    jobs = [j for j in jobs if j.benchmark == "hpdv2"]
    infos = dict(infos)
    results, per_image = {}, {lb: {} for lb in labels}
    step = max(batch_size, 16)
    for lb in labels:
        scores: dict[str, list[float]] = {n: [] for n in scorers}
        for start in range(0, len(jobs), step):
            chunk = jobs[start:start + step]
            images = load_rgb([out / "hpdv2" / lb / j.rel for j in chunk])
            part = score_images(images, [j.prompt for j in chunk], scorers)
            for n, vals in part.items():
                scores[n] += vals
        results[lb] = aggregate(scores, infos, n_expected=N_PROMPTS)
        per_image[lb] = scores
    with open(out / "hpdv2" / "scores.jsonl", "w") as fp:
        for i, j in enumerate(jobs):
            fp.write(json.dumps({"index": int(j.key), "prompt": j.prompt, "seed": j.seed, "file": j.rel,
                                 **{lb: {n: per_image[lb][n][i] for n in scorers} for lb in labels}}) + "\n")
    return {"results": results, "per_image": per_image, "scorers": infos}


def comparability_notes(ctx: Mapping, results: Mapping) -> list[str]:
    """Why these HPDv2 results are not comparable with published numbers (empty: they are)."""
    notes = []
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
    return notes

