"""A reward scored by a reward server (`chunkgrpo.scoring.service`): `rewards: [{name: hpsv3, url: ...}]`.

`RemoteReward(url, name)` is a reward like any other, `fn(images, prompts) -> float32 tensor (n,)`. It
sends the images as base64 PNG in batches of at most `max_batch`, with `Authorization: Bearer
$CHUNKGRPO_REWARD_TOKEN` when that is set. Scoring is idempotent, so a request that fails in a way that may
pass (connection refused or reset, timeout, HTTP 429/502/503/504) is retried with exponential backoff until
`deadline_s` after the call began; then, or at once for any other answer (400, 401, 413, 500), the run
stops with one line naming the URL and the cause. A reward is never dropped or zero-filled: the answer must
hold one finite score per image and come from the scorer named in the config.
"""

from __future__ import annotations

import base64
import io
import json
import os
import random
import time
import urllib.error
import urllib.parse
import urllib.request

from chunkgrpo.errors import UserError
from chunkgrpo.scoring.service import TOKEN_ENV

RETRY_CODES = (429, 502, 503, 504)


class RewardServiceError(UserError):
    """The reward server could not score a batch: one line naming its URL and the cause."""


def check_url(url: str) -> str:
    """An http(s)://host[:port] base URL (any trailing slash removed); UserError otherwise."""
    u = urllib.parse.urlsplit(str(url).strip())
    if u.scheme not in ("http", "https") or not u.hostname:
        raise UserError(f"reward url {url!r} must look like http://host:port")
    try:
        _ = u.port  # a non-numeric port raises here
    except ValueError:
        raise UserError(f"reward url {url!r} has a bad port") from None
    return str(url).strip().rstrip("/")


def _canon(name) -> str:
    from chunkgrpo.scoring.table import canonical_name

    try:
        return canonical_name(name)  # scorer aliases and case are one name
    except UserError:
        return str(name)


def _png(im) -> str:
    buf = io.BytesIO()
    im.convert("RGB").save(buf, format="PNG", compress_level=1)
    return base64.b64encode(buf.getvalue()).decode("ascii")


class RemoteReward:
    """A reward scored by the reward server at `url` (the server must serve `name`)."""

    def __init__(self, url: str, name: str, max_batch: int | str = 32, deadline_s: float | str = 120.0,
                 timeout_s: float | str = 60.0, backoff_s: float | str = 0.5) -> None:
        self.url = check_url(url)
        self.name = name
        try:
            self.max_batch, self.deadline_s = int(max_batch), float(deadline_s)
            self.timeout_s, self.backoff_s = float(timeout_s), float(backoff_s)
        except ValueError as e:
            raise UserError(f"reward {name!r} at {self.url}: bad client option ({e})") from None
        if self.max_batch < 1 or self.deadline_s <= 0 or self.timeout_s <= 0 or self.backoff_s < 0:
            raise UserError(f"reward {name!r} at {self.url}: max_batch >= 1, deadline_s > 0, timeout_s > 0 "
                            "and backoff_s >= 0 are needed")

    def _fail(self, cause: str) -> RewardServiceError:
        return RewardServiceError(f"reward {self.name!r} at {self.url}/score: {cause}")

    def _post(self, body: bytes, deadline: float) -> dict:
        headers = {"Content-Type": "application/json"}
        token = os.environ.get(TOKEN_ENV)
        if token:
            headers["Authorization"] = f"Bearer {token}"
        attempt, cause = 0, ""
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise self._fail(f"{cause}; gave up after {attempt} attempts in {self.deadline_s:g} s")
            req = urllib.request.Request(f"{self.url}/score", data=body, headers=headers, method="POST")
            try:
                with urllib.request.urlopen(req, timeout=min(self.timeout_s, max(left, 0.1))) as r:
                    return json.loads(r.read())
            except urllib.error.HTTPError as e:
                try:
                    detail = json.loads(e.read()).get("error", "")
                except (ValueError, AttributeError, OSError):
                    detail = ""
                cause = f"HTTP {e.code}" + (f" ({detail})" if detail else "")
                if e.code not in RETRY_CODES:
                    raise self._fail(cause) from None
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError) as e:
                reason = getattr(e, "reason", e)
                cause = " ".join(f"{type(reason).__name__}: {reason}".split())
            except ValueError:
                raise self._fail("the answer is not JSON") from None
            attempt += 1
            pause = min(self.backoff_s * 2 ** (attempt - 1), 10.0) * (0.5 + random.random() / 2)
            time.sleep(max(0.0, min(pause, deadline - time.monotonic())))

    def __call__(self, images, prompts):
        import torch

        images, prompts = list(images), list(prompts)
        deadline = time.monotonic() + self.deadline_s
        scores: list[float] = []
        for i in range(0, len(images), self.max_batch):
            part = images[i:i + self.max_batch]
            body = json.dumps({"prompts": [str(p) for p in prompts[i:i + self.max_batch]],
                               "images": [_png(im) for im in part]}).encode()
            answer = self._post(body, deadline)
            got = answer.get("scores") if isinstance(answer, dict) else None
            if not isinstance(got, list) or len(got) != len(part):
                n = len(got) if isinstance(got, list) else "no"
                raise self._fail(f"{n} scores for {len(part)} images")
            served = answer.get("scorer")
            if _canon(served) != _canon(self.name):
                raise self._fail(f"the server scores with {served!r}, not {self.name!r}")
            try:
                values = [float(x) for x in got]
            except (TypeError, ValueError):
                raise self._fail("scores are not numbers") from None
            bad = [i + k for k, v in enumerate(values) if v != v or v in (float("inf"), float("-inf"))]
            if bad:
                raise self._fail(f"non-finite scores for samples {bad[:8]}")
            scores += values
        return torch.tensor(scores, dtype=torch.float32)


def check_service(url: str, name: str, timeout_s: float = 10.0) -> str | None:
    """Whether the reward server at `url` can score `name` for a run, asked once with no retry and scoring
    nothing: GET /readyz (reachable, loaded, serving `name`), then GET /info with the token (accepted).
    None when it can, else one line naming the URL and the cause."""
    try:
        base = check_url(url)
    except UserError as e:
        return str(e)
    where = f"reward {name!r} at {base}"

    def ask(path: str) -> tuple[int, dict]:
        token = os.environ.get(TOKEN_ENV)
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        req = urllib.request.Request(base + path, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                code, raw = r.status, r.read()
        except urllib.error.HTTPError as e:
            code, raw = e.code, e.read()
        try:
            answer = json.loads(raw)
        except ValueError:
            answer = None
        return code, answer if isinstance(answer, dict) else {}

    try:
        code, ready = ask("/readyz")
        served = ready.get("scorer")
        if code in (200, 503) and served is not None and _canon(served) != _canon(name):
            return f"{where}: the server scores with {served!r}, not {name!r}"
        if code == 503:
            return f"{where}/readyz: not ready (HTTP 503: the reward is still loading)"
        if code != 200 or served is None:
            return f"{where}/readyz: HTTP {code} without a scorer (is this a chunkgrpo reward-server?)"
        code, answer = ask("/info")
    except (urllib.error.URLError, OSError) as e:
        reason = getattr(e, "reason", e)
        return f"{where} is not reachable ({' '.join(f'{type(reason).__name__}: {reason}'.split())})"
    if code == 401:
        return f"{where}/info: unauthorised (HTTP 401: ${TOKEN_ENV} is missing or wrong)"
    if code != 200:
        detail = answer.get("error", "")
        return f"{where}/info: HTTP {code}" + (f" ({detail})" if detail else "")
    return None
