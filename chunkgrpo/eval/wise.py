"""WISE (Niu et al. 2025, PKU-YuanGroup/WISE, legacy protocol): world-knowledge T2I benchmark with a VLM
judge.

- Prompts are NOT redistributable (no licence): `load_prompts(path)` reads the user's copy of the official
  release - a folder with `cultural_common_sense[_rewrite].json`, `spatio-temporal_reasoning[_rewrite].json`,
  `natural_science[_rewrite].json`, or one such JSON file. The rewritten variant (`*_rewrite.json`, the
  explicit prompts of the paper's Table 2) is the default; `variant="original"` uses the knowledge prompts.
  Either way the judge sees the (rewritten) Prompt plus the original Explanation, as in the paper.
- Images: one per prompt, `<image_dir>/<prompt_id>.png` (`image_path`).
- Judge: any OpenAI-compatible `/v1/chat/completions` endpoint (GPT-4o-2024-05-13 for the paper's numbers,
  or a vLLM-served open VLM - different judge, numbers not comparable). The rubric and system prompt are the
  official `gpt_eval.py` text; temperature 0, image sent as a base64 PNG data URL. The API key is read from
  an environment variable (`JudgeConfig.api_key_env`) and never logged or stored.
- Three 0-2 scores (Consistency, Realism, Aesthetic Quality) parsed as the official `extract_scores` of
  `WISE_legacy/gpt_eval.py` parses them, on every input (`parser="official"`, the default; re-implemented
  - the WISE repository has no licence - and checked against the official function on a committed table
  of cases, `tests/unit/eval/wise_extract_scores_cases.json`): see `parse_scores`. `parser="strict"`
  keeps the project's earlier reading: `<think>` blocks stripped, first match, 0-2 only, and the fallback
  needs an answer of exactly three bare lines; anything else is unparsable (and retried).
- HTTP/network errors, refusals (an OpenAI `refusal` instead of content) and unparsable answers are retried
  with exponential backoff; items still failing are counted and listed in the result (`failed`), never
  silently dropped, and excluded from the means (`failed_policy="exclude"`) or scored 0 (`"zero"`).
- Comparability with published WiScores needs all 1,000 prompt ids judged and scored (the official
  `Calculate.py` refuses `--category all` otherwise): `aggregate` reports `all_ids_scored`, and the
  evaluate stage marks any run with missing ids, missing images or failed items as not comparable.
- WiScore = (0.7 C + 0.2 R + 0.1 A) / 2 in [0, 1]; category score = mean WiScore over its prompt-id
  range; overall = 0.4 Culture + 0.167 Time + 0.133 Space + 0.1 Biology + 0.1 Physics + 0.1 Chemistry
  (the official weights = category sizes / 1000) when all six categories are present, else the mean over
  the evaluated prompts (flagged `complete: false`).
- The evaluate stage's use of it: `score_stage` (judge every label's folder) and `comparability_notes`.

The protocol's pieces: `chunkgrpo.eval.wise_scores` (categories, rubric, score parsers, WiScore) and
`chunkgrpo.eval.wise_judge` (the judge client); this module holds the prompts, the evaluation and the
aggregation, and every public name of the three.
"""

from __future__ import annotations

import dataclasses
import json
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

from chunkgrpo.errors import UserError
from chunkgrpo.eval.wise_judge import JudgeClient, JudgeConfig, JudgeResult, build_messages, encode_png
from chunkgrpo.eval.wise_scores import (
    CATEGORIES,
    FILES,
    N_PROMPT_IDS,
    OFFICIAL_JUDGE,
    OFFICIAL_VARIANT,
    PARSERS,
    RUBRIC,
    SCORE_KEYS,
    SYSTEM_PROMPT,
    VARIANTS,
    WEIGHTS,
    WISE_DIR_ENV,
    looks_like_refusal,
    out_of_range,
    parse_scores,
    wiscore,
)

__all__ = [
    "CATEGORIES", "FILES", "JudgeClient", "JudgeConfig", "JudgeResult", "N_PROMPT_IDS",
    "OFFICIAL_JUDGE", "OFFICIAL_VARIANT", "PARSERS", "RUBRIC", "SCORE_KEYS", "SYSTEM_PROMPT",
    "VARIANTS", "WEIGHTS", "WISE_DIR_ENV", "WisePrompt", "aggregate", "build_messages",
    "category_of", "comparability_notes", "encode_png", "evaluate", "expected_files", "image_path",
    "load_prompts", "looks_like_refusal", "out_of_range", "parse_scores", "score_stage", "wiscore",
]

# --------------------------------------------------------------------------------------------------
# prompts


@dataclasses.dataclass(frozen=True)
class WisePrompt:
    prompt_id: int
    prompt: str
    explanation: str
    category: str  # one of CATEGORIES' names, derived from prompt_id
    subcategory: str = ""


def category_of(prompt_id: int) -> str:
    for name, lo, hi, _ in CATEGORIES:
        if lo <= prompt_id <= hi:
            return name
    raise UserError(f"WISE prompt_id {prompt_id} is outside 1-1000")


def expected_files(variant: str = "rewrite") -> list[str]:
    suffix = "_rewrite" if variant == "rewrite" else ""
    return [f"{f}{suffix}.json" for f in FILES]


def load_prompts(path: str | os.PathLike | None = None, variant: str = "rewrite",
                 allow_partial: bool = False) -> list[WisePrompt]:
    """WISE prompts from the user's copy (a folder with the three official JSON files, or one JSON file;
    local or `s3://`).

    `path` defaults to `$CHUNKGRPO_WISE_DIR`. A folder must hold all three files of the variant unless
    `allow_partial`. Returns prompts sorted by prompt_id."""
    if variant not in VARIANTS:
        raise UserError(f"WISE variant {variant!r} is not one of {', '.join(VARIANTS)}")
    files = expected_files(variant)
    if path is None:
        path = os.environ.get(WISE_DIR_ENV)
        if not path:
            raise UserError(
                "WISE prompts are not redistributable: download the official release "
                "(github.com/PKU-YuanGroup/WISE, "
                f"WISE_legacy/data/) and pass its folder (or set ${WISE_DIR_ENV}); "
                f"expected files: {', '.join(files)}"
            )
    if str(path).startswith("s3://"):  # the user's copy in S3: the variant's files that exist there
        from chunkgrpo.eval import fetch_s3_files

        path = fetch_s3_files(str(path), files, what="WISE prompts")
    p = Path(path).expanduser()
    if p.is_file():
        paths = [p]
    elif p.is_dir():
        paths = [p / f for f in files if (p / f).exists()]
        missing = [f for f in files if not (p / f).exists()]
        if missing and (not allow_partial or not paths):
            other = [
                f
                for f in expected_files("original" if variant == "rewrite" else "rewrite")
                if (p / f).exists()
            ]
            hint = (
                f" (found the {'original' if variant == 'rewrite' else 'rewrite'} variant: pass variant=...)"
                if other
                else ""
            )
            raise UserError(
                f"WISE folder {str(p)!r} lacks {', '.join(missing)} for variant {variant!r}{hint}; "
                f"expected {', '.join(files)}"
            )
    else:
        raise UserError(
            f"WISE prompt path {str(p)!r} does not exist; expected a folder with {', '.join(files)}"
        )
    out: dict[int, WisePrompt] = {}
    for f in paths:
        try:
            data = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise UserError(f"{f}: invalid JSON: {e}") from None
        if not isinstance(data, list):
            raise UserError(f"{f}: expected a JSON list of prompt objects")
        for item in data:
            try:
                pid = int(item["prompt_id"])
                wp = WisePrompt(pid, str(item["Prompt"]), str(item.get("Explanation", "")), category_of(pid),
                                str(item.get("Subcategory", "")))
            except (KeyError, TypeError, ValueError) as e:
                raise UserError(f"{f}: prompt entry {item!r:.120} lacks prompt_id/Prompt ({e})") from None
            if pid in out:
                raise UserError(f"{f}: duplicate prompt_id {pid}")
            out[pid] = wp
    return [out[k] for k in sorted(out)]


def image_path(image_dir: str | os.PathLike, prompt_id: int) -> Path:
    """The official naming: `<image_dir>/<prompt_id>.png`."""
    return Path(image_dir) / f"{prompt_id}.png"


# --------------------------------------------------------------------------------------------------
# evaluation and aggregation


def evaluate(
    prompts: Sequence[WisePrompt],
    image_dir: str | os.PathLike,
    judge: JudgeClient | JudgeConfig | None = None,
    *,
    variant: str = "rewrite",
    progress: Callable[[int], None] | None = None,
) -> dict:
    """Judge `<image_dir>/<prompt_id>.png` for every prompt and aggregate (see `aggregate`).
    Missing images are reported in `missing` (and not judged)."""
    client = judge if isinstance(judge, JudgeClient) else JudgeClient(judge)
    todo, missing = [], []
    for p in prompts:
        path = image_path(image_dir, p.prompt_id)
        (todo if path.exists() else missing).append((p, path))
    if not todo:
        raise UserError(f"no WISE images found in {str(image_dir)!r} (expected <prompt_id>.png)")

    def run(item):
        p, path = item
        return p, path, client.judge(path, p.prompt, p.explanation)

    records = []
    with ThreadPoolExecutor(max_workers=client.config.workers) as pool:
        for i, (p, path, res) in enumerate(pool.map(run, todo)):
            rec = {"prompt_id": p.prompt_id, "category": p.category, "subcategory": p.subcategory,
                   "prompt": p.prompt, "image": str(path), "answer": res.answer, "attempts": res.attempts}
            if res.scores is not None:
                rec.update(res.scores)
                rec["wiscore"] = wiscore(**res.scores)
                bad = out_of_range(res.scores)
                if bad:
                    rec["out_of_range"] = bad
            else:
                rec["error"] = res.error
                if res.refused:
                    rec["refused"] = True
            records.append(rec)
            if progress:
                progress(i + 1)
    result = aggregate(records, failed_policy=client.config.failed_policy)
    result.update({
        "judge": {"model": client.config.model, "base_url": client.config.base_url,
                  "temperature": client.config.temperature, "max_attempts": client.config.max_attempts,
                  "parser": client.config.parser},
        "variant": variant,
        "missing": [p.prompt_id for p, _ in missing],
        "n_prompts": len(prompts),
    })
    return result


def aggregate(records: Sequence[dict], failed_policy: str = "exclude") -> dict:
    """Per-category mean WiScore (and mean sub-scores), overall, failures.

    A record is scored when it has `wiscore` (else it is failed). Failed items are listed in `failed`
    (prompt_id + error) and `n_failed`; with `failed_policy="zero"` they count as WiScore 0."""
    if failed_policy not in ("exclude", "zero"):
        raise UserError(f"failed_policy={failed_policy!r} must be 'exclude' or 'zero'")
    cats: dict[str, dict[str, Any]] = {}
    failed = []
    for r in sorted(records, key=lambda r: r["prompt_id"]):
        cat = r.get("category") or category_of(int(r["prompt_id"]))
        c = cats.setdefault(cat, {"wiscores": [], "consistency": [], "realism": [], "aesthetic_quality": [],
                                  "n_failed": 0})
        if "wiscore" in r and r["wiscore"] is not None:
            c["wiscores"].append(float(r["wiscore"]))
            for k in SCORE_KEYS:
                c[k].append(float(r[k]))
        else:
            c["n_failed"] += 1
            failed.append({"prompt_id": r["prompt_id"], "error": r.get("error"), "answer": r.get("answer")})
            if failed_policy == "zero":
                c["wiscores"].append(0.0)

    def mean(xs):
        return sum(xs) / len(xs) if xs else None

    categories = {}
    for name, _, _, _ in CATEGORIES:
        if name in cats:
            c = cats[name]
            categories[name] = {
                "wiscore": mean(c["wiscores"]),
                "n": len(c["wiscores"]),
                "n_failed": c["n_failed"],
                **{f"mean_{k}": mean(c[k]) for k in SCORE_KEYS},
            }
    all_scores = [s for c in cats.values() for s in c["wiscores"]]
    scored_ids = {int(r["prompt_id"]) for r in records if r.get("wiscore") is not None}
    complete = all(n in categories and categories[n]["wiscore"] is not None for n, *_ in CATEGORIES)
    if complete:
        overall = sum(w * categories[n]["wiscore"] for n, _, _, w in CATEGORIES)
        overall_rule = "official weights 0.4/0.167/0.133/0.1/0.1/0.1"
    else:
        overall = mean(all_scores)
        overall_rule = "mean over evaluated prompts (not all 6 categories present)"
    return {
        "benchmark": "wise",
        "overall": overall,
        "overall_rule": overall_rule,
        "complete": complete,
        "categories": categories,
        "n_scored": sum(1 for r in records if r.get("wiscore") is not None),
        "n_expected_ids": N_PROMPT_IDS,
        "all_ids_scored": scored_ids == set(range(1, N_PROMPT_IDS + 1)),
        "n_out_of_range": sum(1 for r in records if r.get("out_of_range")),
        "n_refused": sum(1 for r in records if r.get("refused")),
        "n_failed": len(failed),
        "failed": failed,
        "failed_policy": failed_policy,
        "records": list(records),
    }


# --------------------------------------------------------------------------------------------------
# the evaluate stage


def score_stage(out: Path, labels: Sequence[str], prompts: Sequence[WisePrompt], judge: JudgeClient,
                variant: str) -> dict:
    """Judge `<out>/wise/<label>/` for every label; writes `<out>/wise/<label>/results.jsonl` (image paths
    relative to `out`). Returns {"results": {label: aggregate with its "records"}}."""
    results = {}
    for lb in labels:
        res = evaluate(prompts, out / "wise" / lb, judge, variant=variant)
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


def comparability_notes(ctx: dict, results: dict, variant: str) -> list[str]:
    """Why these WISE results are not comparable with published numbers (empty: they are): all 1,000
    prompt ids judged and scored by the official judge on the original prompts, official parser."""
    notes = []
    n_ids = ctx["n_prompts"]
    variant = ctx.get("variant", variant)
    if variant != OFFICIAL_VARIANT:
        notes.append(f"WISE prompt variant {variant!r} (the official gpt_eval.py usage and the WISE "
                     f"leaderboard judge the {OFFICIAL_VARIANT!r} prompts)")
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
        if judge.get("model") != OFFICIAL_JUDGE:
            notes.append(f"judge {judge.get('model')} (paper: {OFFICIAL_JUDGE})")
        if judge.get("parser", "official") != "official":
            notes.append(f"judge answers parsed with the {judge.get('parser')} parser (official: WISE "
                         "extract_scores, parser=official)")
    return notes
