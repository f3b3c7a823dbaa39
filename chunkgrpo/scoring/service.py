"""A reward served over HTTP (`chunkgrpo reward-server`): one named reward or scorer, many trainers.

Wire format (JSON, UTF-8):

    POST /score   Authorization: Bearer $CHUNKGRPO_REWARD_TOKEN
        {"prompts": ["a cat", ...], "images": ["<base64 PNG>", ...]}          (same length, >= 1)
    200 {"scores": [0.71, ...], "scorer": NAME, "version": "chunkgrpo X.Y.Z"}  (one float per image, in order)
    400 bad request · 401 missing/wrong token · 413 body over --max-request-bytes or more than --max-batch
    images · 503 not ready yet (the reward is still loading) · 500 the reward failed (logged here)
    every error: {"error": "<one line>"}

    GET /healthz   200 while the process serves          GET /readyz   200 once the reward is loaded, else 503
    GET /metrics   Prometheus text format: requests by status, images, batch sizes, latency
    GET /info      Authorization as /score: 200 {"scorer": NAME, "version": ..., "max_batch": N,
                   "ready": bool}, 401 otherwise (a client checks its token and the scorer, scoring nothing)

Images are decoded to RGB `PIL.Image`s: exactly what the reward receives in a training process, so a
served reward gives the same numbers as the in-process one (PNG is lossless). Scoring calls are
serialised (one batch at a time through the model); HTTP parsing and PNG decoding run per connection
thread. The token is compared in constant time and never logged; without a token the server listens only
on a loopback address.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import io
import json
import logging
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from chunkgrpo import __version__
from chunkgrpo.errors import UserError

log = logging.getLogger("chunkgrpo.reward_server")

TOKEN_ENV = "CHUNKGRPO_REWARD_TOKEN"
LOOPBACK = ("127.0.0.1", "localhost", "::1")
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
_LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class _Reject(Exception):
    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code


class Metrics:
    """Counters and histograms in the Prometheus text exposition format (no client library needed)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.requests: dict[int, int] = {}
        self.images = 0
        self.batch = [0] * (len(_BATCH_BUCKETS) + 1)
        self.batch_sum = 0
        self.latency = [0] * (len(_LATENCY_BUCKETS) + 1)
        self.latency_sum = 0.0

    @staticmethod
    def _bucket(value, bounds) -> int:
        return next((i for i, b in enumerate(bounds) if value <= b), len(bounds))

    def request(self, code: int) -> None:
        with self.lock:
            self.requests[code] = self.requests.get(code, 0) + 1

    def scored(self, n: int, seconds: float) -> None:
        with self.lock:
            self.images += n
            self.batch[self._bucket(n, _BATCH_BUCKETS)] += 1
            self.batch_sum += n
            self.latency[self._bucket(seconds, _LATENCY_BUCKETS)] += 1
            self.latency_sum += seconds

    @staticmethod
    def _histogram(name: str, help_: str, counts, bounds, total) -> list[str]:
        out = [f"# HELP {name} {help_}", f"# TYPE {name} histogram"]
        cum = 0
        for b, c in zip([*bounds, "+Inf"], counts):
            cum += c
            out.append(f'{name}_bucket{{le="{b}"}} {cum}')
        return [*out, f"{name}_sum {total}", f"{name}_count {cum}"]

    def text(self, scorer: str) -> str:
        with self.lock:
            lines = ["# HELP chunkgrpo_reward_requests_total HTTP requests to /score by status code",
                     "# TYPE chunkgrpo_reward_requests_total counter"]
            lines += [f'chunkgrpo_reward_requests_total{{code="{c}",scorer="{scorer}"}} {n}'
                      for c, n in sorted(self.requests.items())]
            lines += ["# HELP chunkgrpo_reward_images_total images scored",
                      "# TYPE chunkgrpo_reward_images_total counter",
                      f'chunkgrpo_reward_images_total{{scorer="{scorer}"}} {self.images}']
            lines += self._histogram("chunkgrpo_reward_batch_size", "images per scored request", self.batch,
                                     _BATCH_BUCKETS, self.batch_sum)
            lines += self._histogram("chunkgrpo_reward_latency_seconds", "seconds to decode and score one "
                                     "request", self.latency, _LATENCY_BUCKETS, round(self.latency_sum, 6))
        return "\n".join(lines) + "\n"


class RewardService:
    """What the HTTP handler serves: the reward (built later by `load`), its limits and its metrics."""

    def __init__(self, name: str, build: Callable[[], Callable], *, max_batch: int = 64,
                 max_request_bytes: int = 64 << 20, token: str | None = None) -> None:
        if max_batch < 1 or max_request_bytes < 1:
            raise UserError(f"--max-batch={max_batch} and --max-request-bytes={max_request_bytes} "
                            "must be >= 1")
        self.name, self.build = name, build
        self.max_batch, self.max_request_bytes, self.token = max_batch, max_request_bytes, token or None
        self.fn: Callable | None = None
        self.score_lock = threading.Lock()
        self.metrics = Metrics()
        self.version = f"chunkgrpo {__version__}"

    def load(self) -> None:
        self.fn = self.build()

    def authorized(self, header: str | None) -> bool:
        if not self.token:
            return True
        scheme, _, value = (header or "").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(value.strip().encode(), self.token.encode())

    def score(self, req) -> dict:
        from PIL import Image

        if not isinstance(req, dict):
            raise _Reject(400, "the body must be a JSON object {prompts: [...], images: [...]}")
        prompts, images = req.get("prompts"), req.get("images")
        if not isinstance(prompts, list) or not isinstance(images, list):
            raise _Reject(400, "prompts and images must be lists")
        if len(prompts) != len(images) or not images:
            raise _Reject(400, f"{len(images)} images for {len(prompts)} prompts "
                               "(need the same number, >= 1)")
        if len(images) > self.max_batch:
            raise _Reject(413, f"{len(images)} images in one request; at most {self.max_batch}")
        if not all(isinstance(p, str) for p in prompts) or not all(isinstance(i, str) for i in images):
            raise _Reject(400, "prompts must be strings and images base64 PNG strings")
        t0 = time.perf_counter()
        decoded = []
        for i, data in enumerate(images):
            try:
                im = Image.open(io.BytesIO(base64.b64decode(data, validate=True)))
                decoded.append(im.convert("RGB"))
            except (binascii.Error, ValueError, OSError, Image.DecompressionBombError) as e:
                raise _Reject(400, f"images[{i}] is not a base64 PNG ({type(e).__name__})") from None
        if self.fn is None:
            raise _Reject(503, f"{self.name} is still loading")
        with self.score_lock:
            out = self.fn(decoded, prompts)
        scores = [float(x) for x in (out.tolist() if hasattr(out, "tolist") else out)]
        self.metrics.scored(len(images), time.perf_counter() - t0)
        # a non-finite score is sent as JSON's NaN/Infinity: the client refuses it, naming this server
        return {"scores": scores, "scorer": self.name, "version": self.version}


class _Handler(BaseHTTPRequestHandler):
    server_version = "chunkgrpo-reward-server"
    service: RewardService  # set on the subclass made by `serve`

    def log_message(self, fmt, *args):  # the request line only: headers (the token) are never logged
        log.debug("%s %s", self.address_string(), fmt % args)

    def _answer(self, code: int, body, content_type: str = "application/json") -> None:
        data = body.encode() if isinstance(body, str) else json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _drain(self, length: int) -> None:
        """Read (and drop) a refused body of at most 8 MiB, so that the client reads the 413 instead of a
        connection reset; a larger one is left unread."""
        left = length if length <= 8 << 20 else 0
        while left > 0:
            chunk = self.rfile.read(min(left, 1 << 16))
            if not chunk:
                break
            left -= len(chunk)

    def do_GET(self):
        s = self.service
        if self.path == "/healthz":
            return self._answer(200, {"status": "ok"})
        if self.path == "/readyz":
            ready = s.fn is not None
            body = {"ready": ready, "scorer": s.name, "version": s.version}
            return self._answer(200 if ready else 503, body)
        if self.path == "/metrics":
            return self._answer(200, s.metrics.text(s.name), "text/plain; version=0.0.4")
        if self.path == "/info":
            if not s.authorized(self.headers.get("Authorization")):
                return self._answer(401, {"error": "missing or wrong bearer token"})
            return self._answer(200, {"scorer": s.name, "version": s.version, "max_batch": s.max_batch,
                                      "ready": s.fn is not None})
        return self._answer(404, {"error": "not found"})

    def do_POST(self):
        s = self.service
        if self.path != "/score":
            return self._answer(404, {"error": "not found"})
        try:
            if not s.authorized(self.headers.get("Authorization")):
                raise _Reject(401, "missing or wrong bearer token")
            try:
                length = int(self.headers.get("Content-Length") or 0)
            except ValueError:
                raise _Reject(400, "Content-Length is not a number") from None
            if length > s.max_request_bytes:
                self._drain(length)
                raise _Reject(413, f"request body of {length} bytes; at most {s.max_request_bytes}")
            if length <= 0:
                raise _Reject(400, "empty request body (expected a JSON object)")
            try:
                req = json.loads(self.rfile.read(length))
            except (ValueError, RecursionError):
                raise _Reject(400, "the body is not JSON") from None
            body, code = s.score(req), 200
        except _Reject as e:
            body, code = {"error": str(e)}, e.code
            if code in (401, 413):
                self.close_connection = True  # an unread body is not drained
        except Exception as e:
            log.exception("scoring failed")
            body, code = {"error": " ".join(f"{type(e).__name__}: {e}".split())[:400]}, 500
        s.metrics.request(code)
        return self._answer(code, body)


def serve(service: RewardService, host: str = "127.0.0.1", port: int = 0) -> ThreadingHTTPServer:
    """A listening server in a daemon thread (`.shutdown()` stops it); `service.load()` is the caller's."""
    if not service.token and host not in LOOPBACK:
        raise UserError(f"--host {host} without ${TOKEN_ENV}: set a token to listen beyond this machine")
    handler = type("Handler", (_Handler,), {"service": service})
    try:
        server = ThreadingHTTPServer((host, port), handler)
    except OSError as e:
        raise UserError(f"cannot listen on {host}:{port} ({e.strerror or e})") from None
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, name="reward-server", daemon=True).start()
    return server
