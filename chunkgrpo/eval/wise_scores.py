"""The WISE protocol's fixed text and numbers: the categories and their prompt-id ranges, the official
system prompt and rubric, the score parsers (`parse_scores`, official and strict) and `wiscore`. See
`chunkgrpo.eval.wise` for the protocol."""

from __future__ import annotations

import re

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

