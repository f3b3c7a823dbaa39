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

Size note: one room (~630 lines) on purpose: prompts, rubric, parser, judge client and aggregation are one
protocol pinned to the official WISE_legacy scripts; the judge client is small and used only by this
protocol.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import os
import random
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Sequence

from PIL import Image

from chunkgrpo.config import Config, option
from chunkgrpo.errors import UserError

WISE_DIR_ENV = "CHUNKGRPO_WISE_DIR"
FILES = ("cultural_common_sense", "spatio-temporal_reasoning", "natural_science")
VARIANTS = ("rewrite", "original")
# (category, first id, last id, official overall weight)
CATEGORIES = (
    ("culture", 1, 400, 0.4),
    ("time", 401, 567, 0.167),
    ("space", 568, 700, 0.133),
    ("biology", 701, 800, 0.1),
    ("physics", 801, 900, 0.1),
    ("chemistry", 901, 1000, 0.1),
)
SCORE_KEYS = ("consistency", "realism", "aesthetic_quality")
N_PROMPT_IDS = 1000  # the official release: prompt ids 1..1000
PARSERS = ("official", "strict")
WEIGHTS = {"consistency": 0.7, "realism": 0.2, "aesthetic_quality": 0.1}
OFFICIAL_JUDGE = "gpt-4o-2024-05-13"
OFFICIAL_VARIANT = "original"  # WISE_legacy README: gpt_eval.py --json_path data/<category>.json

SYSTEM_PROMPT = (
    "You are a professional Vincennes image quality audit expert, please evaluate the image quality strictly "
    "according to the protocol."
)
# Verbatim from WISE_legacy/gpt_eval.py (build_evaluation_messages); {prompt} / {explanation} substituted.
# Its long lines and trailing spaces are the official text, kept as is (hence the noqa on the closing line).
RUBRIC = """Please evaluate strictly and return ONLY the three scores as requested.

# Text-to-Image Quality Evaluation Protocol

## System Instruction
You are an AI quality auditor for text-to-image generation. Apply these rules with ABSOLUTE RUTHLESSNESS. Only images meeting the HIGHEST standards should receive top scores.

**Input Parameters**  
- PROMPT: [User's original prompt to]  
- EXPLANATION: [Further explanation of the original prompt] 
---

## Scoring Criteria

**Consistency (0-2):**  How accurately and completely the image reflects the PROMPT.
* **0 (Rejected):**  Fails to capture key elements of the prompt, or contradicts the prompt.
* **1 (Conditional):** Partially captures the prompt. Some elements are present, but not all, or not accurately.  Noticeable deviations from the prompt's intent.
* **2 (Exemplary):**  Perfectly and completely aligns with the PROMPT.  Every single element and nuance of the prompt is flawlessly represented in the image. The image is an ideal, unambiguous visual realization of the given prompt.

**Realism (0-2):**  How realistically the image is rendered.
* **0 (Rejected):**  Physically implausible and clearly artificial. Breaks fundamental laws of physics or visual realism.
* **1 (Conditional):** Contains minor inconsistencies or unrealistic elements.  While somewhat believable, noticeable flaws detract from realism.
* **2 (Exemplary):**  Achieves photorealistic quality, indistinguishable from a real photograph.  Flawless adherence to physical laws, accurate material representation, and coherent spatial relationships. No visual cues betraying AI generation.

**Aesthetic Quality (0-2):**  The overall artistic appeal and visual quality of the image.
* **0 (Rejected):**  Poor aesthetic composition, visually unappealing, and lacks artistic merit.
* **1 (Conditional):**  Demonstrates basic visual appeal, acceptable composition, and color harmony, but lacks distinction or artistic flair.
* **2 (Exemplary):**  Possesses exceptional aesthetic quality, comparable to a masterpiece.  Strikingly beautiful, with perfect composition, a harmonious color palette, and a captivating artistic style. Demonstrates a high degree of artistic vision and execution.

---

## Output Format

**Do not include any other text, explanations, or labels.** You must return only three lines of text, each containing a metric and the corresponding score, for example:

**Example Output:**
Consistency: 2
Realism: 1
Aesthetic Quality: 0

---

**IMPORTANT Enforcement:**

Be EXTREMELY strict in your evaluation. A score of '2' should be exceedingly rare and reserved only for images that truly excel and meet the highest possible standards in each metric. If there is any doubt, downgrade the score.

For **Consistency**, a score of '2' requires complete and flawless adherence to every aspect of the prompt, leaving no room for misinterpretation or omission.

For **Realism**, a score of '2' means the image is virtually indistinguishable from a real photograph in terms of detail, lighting, physics, and material properties.

For **Aesthetic Quality**, a score of '2' demands exceptional artistic merit, not just pleasant visuals.

--- 
Here are the Prompt and EXPLANATION for this evaluation:
PROMPT: "{prompt}"
EXPLANATION: "{explanation}"
Please strictly adhere to the scoring criteria and follow the template format when providing your results."""  # noqa: E501

# official: a name (any case, up to two '*' either side), an optional ASCII ':' with whitespace (\s, which
# spans line breaks) around it, then ONE digit (\d: any Unicode decimal digit, e.g. '٣' reads 3)
_OFFICIAL_RE = re.compile(r"\*{0,2}(Consistency|Realism|Aesthetic Quality)\*{0,2}\s*:?\s*(\d)", re.IGNORECASE)
_OFFICIAL_BARE_RE = re.compile(r"^\s*([0-2])\s*$", re.MULTILINE)  # a line holding only 0, 1 or 2
_SCORE_RE = re.compile(
    r"\*{0,2}(Consistency|Realism|Aesthetic Quality)\*{0,2}\s*[:：]?\s*(\d)", re.IGNORECASE
)
_THINK_RE = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_REFUSAL_RE = re.compile(r"^\W*(i'm sorry|i am sorry|sorry|i can(?:no|')t|i'm unable|i am unable|i won't)",
                         re.IGNORECASE)


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
# parsing and scores


def _bare_lines(text: str) -> list[str]:
    return [ln.strip().strip("*").strip() for ln in text.strip().splitlines() if ln.strip()]


def _parse_official(text: str) -> dict[str, int] | None:
    """WISE `extract_scores` + the completeness check of `evaluate_image` (all three names or a retry)."""
    found: dict[str, int] = {}
    for name, digit in _OFFICIAL_RE.findall(text):
        # the key is the matched text lower-cased, as the official: a case-folded match such as 'ſ' for
        # 's' gives a key that is not a score name, so the answer is incomplete
        found[name.lower().replace(" ", "_")] = int(digit)  # the last match of a name wins
    if not found:  # the fallback runs only when no name matched at all
        bare = _OFFICIAL_BARE_RE.findall(text)
        if len(bare) >= 3:  # the FIRST three bare 0/1/2 lines, in the order C, R, A
            found = dict(zip(SCORE_KEYS, (int(v) for v in bare[:3])))
    if any(k not in found for k in SCORE_KEYS):
        return None
    return {k: found[k] for k in SCORE_KEYS}


def _parse_strict(text: str) -> dict[str, int] | None:
    text = _THINK_RE.sub("", text)
    found: dict[str, int] = {}
    for key, value in _SCORE_RE.findall(text):
        found.setdefault(key.lower().replace(" ", "_"), int(value))  # the first match wins
    if any(k not in found for k in SCORE_KEYS):
        lines = _bare_lines(text)
        if len(lines) == 3 and all(re.fullmatch(r"[0-2]", ln) for ln in lines):
            found = dict(zip(SCORE_KEYS, (int(ln) for ln in lines)))
    if any(k not in found or not 0 <= found[k] <= 2 for k in SCORE_KEYS):
        return None
    return {k: found[k] for k in SCORE_KEYS}


def parse_scores(text: str | None, parser: str = "official") -> dict[str, int] | None:
    """The three scores from a judge answer, or None when they cannot be read (the judge is asked again).

    `official` = WISE `extract_scores` (gpt_eval.py) with its caller's check, on every input:
    1. every match of `*{0,2}(Consistency|Realism|Aesthetic Quality)*{0,2}\\s*:?\\s*(\\d)` (case-insensitive,
       ASCII colon only, one digit) over the whole answer, the LAST match of each name winning; values are
       taken as given (0-9: a "3" stays 3, flagged by `out_of_range`; "10" reads 1);
    2. only if NO name matched: the FIRST three lines that are a bare `0`/`1`/`2` (surrounding whitespace
       allowed, nothing else: `**2**` or `3` do not count) give C, R, A;
    3. an answer without all three scores fails (the official retries it, up to 3 attempts).
    Nothing is stripped first (no `<think>` removal: the official does not). `strict`: `<think>` blocks
    removed, first match of each name, values 0-2 only, the fallback only for an answer of exactly three
    bare 0-2 lines (`*` around them allowed)."""
    if parser not in PARSERS:
        raise UserError(f"WISE parser={parser!r} must be one of {', '.join(PARSERS)}")
    if not text:
        return None
    return _parse_official(text) if parser == "official" else _parse_strict(text)


def out_of_range(scores: dict[str, int] | None) -> list[str]:
    """Sub-scores outside the rubric's 0-2 (kept as given by the official parser; flagged in records)."""
    return [k for k in SCORE_KEYS if scores and not 0 <= scores[k] <= 2]


def looks_like_refusal(text: str | None) -> bool:
    """A judge answer that declines to rate ("I'm sorry, I can't ...")."""
    return bool(text) and bool(_REFUSAL_RE.match(text.strip()))


def wiscore(consistency: float, realism: float, aesthetic_quality: float) -> float:
    """WiScore = (0.7 C + 0.2 R + 0.1 A) / 2, in [0, 1] for 0-2 inputs."""
    return (0.7 * consistency + 0.2 * realism + 0.1 * aesthetic_quality) / 2


# --------------------------------------------------------------------------------------------------
# judge client


@dataclasses.dataclass
class JudgeConfig(Config):
    """The WISE judge: an OpenAI-compatible chat-completions endpoint."""

    base_url: str = option(
        "https://api.openai.com/v1",
        "endpoint base URL, up to /v1 (e.g. http://vllm:8000/v1); /chat/completions is appended",
    )
    model: str = option("gpt-4o-2024-05-13", "judge model name (the paper used gpt-4o-2024-05-13)")
    api_key_env: str = option(
        "OPENAI_API_KEY", "environment variable holding the API key (empty/unset: no auth header)"
    )
    temperature: float = option(0.0, "sampling temperature (official: 0.0)")
    max_tokens: int = option(2000, "max tokens of the answer (official: 2000)")
    max_attempts: int = option(3, "attempts per image (HTTP errors and unparsable answers are retried)")
    backoff_s: float = option(2.0, "first retry delay in seconds; doubles each attempt (with jitter)")
    max_backoff_s: float = option(60.0, "cap on a single retry delay")
    timeout_s: float = option(120.0, "HTTP timeout per request")
    workers: int = option(4, "parallel requests")
    failed_policy: str = option("exclude", "failed items: 'exclude' from the means, or score them 'zero'")
    parser: str = option("official", "answer parser: 'official' (WISE extract_scores: last match, values "
                                     "as given, first three bare 0-2 lines only when no name matched) or "
                                     "'strict' (first match, 0-2 only, else retried)")
    extra_body: dict = option(
        {}, "extra JSON fields for the request, e.g. {chat_template_kwargs: {enable_thinking: false}}"
    )

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise UserError(f"judge base_url={self.base_url!r} must start with http:// or https://")
        if self.max_attempts < 1:
            raise UserError(f"judge max_attempts={self.max_attempts} must be >= 1")
        if self.workers < 1:
            raise UserError(f"judge workers={self.workers} must be >= 1")
        if self.backoff_s < 0 or self.max_backoff_s < 0:
            raise UserError("judge backoff_s / max_backoff_s must be >= 0")
        if self.failed_policy not in ("exclude", "zero"):
            raise UserError(f"judge failed_policy={self.failed_policy!r} must be 'exclude' or 'zero'")
        if not self.model:
            raise UserError("judge model must be set")
        if self.parser not in PARSERS:
            raise UserError(f"judge parser={self.parser!r} must be one of {', '.join(PARSERS)}")


@dataclasses.dataclass
class JudgeResult:
    scores: dict[str, int] | None
    answer: str | None
    attempts: int
    error: str | None = None
    refused: bool = False


class _RetryableError(Exception):
    pass


class _Refused(_RetryableError):
    """The API answered with a refusal (`message.refusal`) instead of content."""


class _ItemError(Exception):
    """A non-retryable failure of one request (e.g. HTTP 400 for this image): the item is failed."""


def encode_png(image: Image.Image | str | os.PathLike) -> str:
    """Base64 PNG (the official sends the PNG file bytes; in-memory images are PNG-encoded)."""
    if isinstance(image, Image.Image):
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        data = buf.getvalue()
    else:
        data = Path(image).read_bytes()
    return base64.b64encode(data).decode("ascii")


def build_messages(prompt: str, explanation: str, image_b64: str) -> list[dict]:
    return [
        {"role": "system", "content": [{"type": "text", "text": SYSTEM_PROMPT}]},
        {"role": "user", "content": [
            {"type": "text", "text": RUBRIC.format(prompt=prompt, explanation=explanation)},
            {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{image_b64}"}},
        ]},
    ]


class JudgeClient:
    """Minimal chat-completions client (requests). `judge(...)` never raises for judge failures: it
    returns a `JudgeResult` with `scores=None` and the last error/answer after `max_attempts`."""

    def __init__(
        self, config: JudgeConfig | None = None, *, sleep: Callable[[float], None] = time.sleep
    ) -> None:
        import requests

        self.config = config or JudgeConfig()
        self._requests = requests
        self._session = requests.Session()
        self._sleep = sleep
        self._url = self.config.base_url.rstrip("/") + "/chat/completions"

    def __repr__(self) -> str:  # never show the key
        return f"JudgeClient(url={self._url!r}, model={self.config.model!r})"

    def _headers(self) -> dict[str, str]:
        headers = {"Content-Type": "application/json"}
        key = os.environ.get(self.config.api_key_env, "") if self.config.api_key_env else ""
        if key:
            headers["Authorization"] = f"Bearer {key}"
        return headers

    def complete(self, messages: list[dict]) -> str:
        """One request. Raises _RetryableError for transient failures (network, 408/409/425/429/5xx, malformed
        JSON), _ItemError for other 4xx (this item fails), UserError for 401/403/404 (configuration)."""
        c = self.config
        body = {
            "model": c.model,
            "messages": messages,
            "temperature": c.temperature,
            "max_tokens": c.max_tokens,
            **c.extra_body,
        }
        try:
            resp = self._session.post(self._url, json=body, headers=self._headers(), timeout=c.timeout_s)
        except self._requests.RequestException as e:
            raise _RetryableError(f"{type(e).__name__}: {e}") from None
        if resp.status_code in (408, 409, 425, 429) or resp.status_code >= 500:
            raise _RetryableError(f"HTTP {resp.status_code}: {resp.text[:200]}")
        if resp.status_code in (401, 403, 404):  # wrong key / model / URL: stop the whole run
            raise UserError(
                f"judge endpoint {self._url} answered HTTP {resp.status_code} (check base_url, model "
                f"and ${self.config.api_key_env}): {resp.text[:300]}"
            )
        if resp.status_code >= 400:
            raise _ItemError(f"HTTP {resp.status_code}: {resp.text[:200]}")
        try:
            message = resp.json()["choices"][0]["message"]
            content, refusal = message.get("content"), message.get("refusal")
        except (ValueError, KeyError, IndexError, TypeError, AttributeError) as e:
            raise _RetryableError(f"malformed response ({type(e).__name__}): {resp.text[:200]}") from None
        if refusal and not content:
            raise _Refused(str(refusal))
        return content or ""

    def _delay(self, attempt: int) -> float:
        c = self.config
        return min(c.max_backoff_s, c.backoff_s * (2 ** (attempt - 1))) * (0.5 + random.random() / 2)

    def judge(self, image: Image.Image | str | os.PathLike, prompt: str, explanation: str) -> JudgeResult:
        messages = build_messages(prompt, explanation, encode_png(image))
        answer: str | None = None
        error: str | None = None
        refused = False
        for attempt in range(1, self.config.max_attempts + 1):
            try:
                answer = self.complete(messages)
                scores = parse_scores(answer, self.config.parser)
                if scores is not None:
                    return JudgeResult(scores, answer, attempt)
                refused = looks_like_refusal(answer)
                error = "refused: judge declined to rate" if refused else "unparsable answer"
            except _Refused as e:
                answer, refused, error = None, True, f"refused: {e}"
            except _RetryableError as e:
                refused, error = False, str(e)
            except _ItemError as e:
                return JudgeResult(None, None, attempt, str(e))
            if attempt < self.config.max_attempts:
                self._sleep(self._delay(attempt))
        return JudgeResult(None, answer, self.config.max_attempts, error, refused)


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
