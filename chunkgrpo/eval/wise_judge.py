"""The WISE judge: `JudgeConfig` and `JudgeClient`, any OpenAI-compatible `/v1/chat/completions` endpoint
(retries with backoff on HTTP/network errors, refusals and unparsable answers). See `chunkgrpo.eval.wise`."""

from __future__ import annotations

import base64
import dataclasses
import io
import os
import random
import time
from pathlib import Path
from typing import Callable

from PIL import Image

from chunkgrpo.config import Config, option
from chunkgrpo.errors import UserError
from chunkgrpo.eval.wise_scores import (
    PARSERS,
    RUBRIC,
    SYSTEM_PROMPT,
    looks_like_refusal,
    parse_scores,
)


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

