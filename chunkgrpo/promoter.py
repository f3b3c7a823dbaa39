"""The promoter service: the one identity allowed to move `champion`, running the gate server-side.

MLflow's basic-auth app checks EDIT on the registered model for `set_registered_model_alias` (not
which version or which alias), so any identity that may edit the model may crown any version. The
pipeline identities therefore get READ on the registered model only, and the **promoter identity**
(its own Secret, MANAGE on the model, in a namespace the pipeline namespaces cannot read) moves
aliases, through this small HTTP service:

    chunkgrpo-promoter: python -m chunkgrpo.promoter --host 0.0.0.0 --port 8080
        env: MLFLOW_TRACKING_URI, MLFLOW_TRACKING_USERNAME/PASSWORD = the promoter identity

    POST /promote  {"name": ..., "version": ..., "metric": "", "margin": 0.0, "why": ...}
    POST /versions {"name": ..., "source": <artifact URI of an MLflow model in the caller's run>,
                    "run_id": ..., "eval_run_id": ..., "tags": {...}, "challenger_alias": "challenger",
                    "gate_metric": ..., "gate_direction": ..., "idempotency_key": ...}
        Authorization: Basic <the caller's MLflow credentials>

Requests are bounded: a body over 64 KiB gets 413; JSON nested deeper than 4 levels, an unknown field, a
`why` over gate.MAX_WHY characters or more than 100 tags get 400 with one line. `/versions` creates a
version only from a run the caller may write to, from a `source` inside that run, never with a protected
alias, and answers a repeated request with the version it created (`registration.create_version`). On
start the service reclaims promotion locks whose holders are gone (`promotion.reclaim_locks`).

Creating a version also needs EDIT on the registered model in MLflow (and EDIT moves aliases), so
registration's privileged half runs here too (`chunkgrpo.registry.registration.create_version`): the
caller logs the MLflow model in its own run, the promoter creates the version and computes every tag
promotion relies on (evaluation run link, gate metric value, gate at registration, model files' digest)
itself.

The caller is authenticated by MLflow itself (its credentials must read the registered model), the
gate runs here with the registry's rules (`chunkgrpo.registry.promotion.promote`: trusted metrics from the
evaluation run, the gate recorded at registration, the promotion lock), and the caller is recorded as
`by` in the version's `promotion.record`. The service never forces and never rolls back: those are
actions of a person holding the promoter credentials (`chunkgrpo promote --force/--rollback --why ...`).
`chunkgrpo promote` sends its request here when $CHUNKGRPO_PROMOTER_URL is set
(`chunkgrpo.registry.promoter_client`).
"""

from __future__ import annotations

import argparse
import base64
import json
import logging
import os
import threading
import urllib.error
import urllib.parse
import urllib.request
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from chunkgrpo.errors import UserError
from chunkgrpo.registry.client import connect, current_identity
from chunkgrpo.registry.gate import MAX_TAG, MAX_WHY, GateConfig, check_alias, check_why, number
from chunkgrpo.registry.promotion import promote, reclaim_locks
from chunkgrpo.registry.registration import create_version

log = logging.getLogger(__name__)
_MAX_BODY = 64 * 1024
_MAX_DEPTH = 4   # {"tags": {...}} is the deepest a request goes
_MAX_TAGS = 100
_LOCK = threading.Lock()  # one promotion at a time in this process (the registry's lock spans processes)


def _caller(header: str | None, name: str, path: str = "registered-models/get", key: str = "name") -> str:
    """The MLflow user named by a Basic Authorization header, if MLflow accepts it and lets it read
    `name` (a registered model, or with path="runs/get", key="run_id", a run)."""
    if not header or not header.startswith("Basic "):
        raise PermissionError("credentials required (HTTP Basic, the caller's MLflow user)")
    try:
        user = base64.b64decode(header[6:]).decode().split(":", 1)[0]
    except (ValueError, UnicodeDecodeError):
        raise PermissionError("malformed Authorization header") from None
    uri = os.environ["MLFLOW_TRACKING_URI"].rstrip("/")
    req = urllib.request.Request(
        f"{uri}/api/2.0/mlflow/{path}?{urllib.parse.urlencode({key: name})}",
        headers={"Authorization": header})
    try:
        with urllib.request.urlopen(req, timeout=10):
            return user
    except urllib.error.HTTPError as e:
        raise PermissionError(f"MLflow refused {user!r} reading {name!r} (HTTP {e.code})") from None


class TooLarge(UserError):
    """A request body over _MAX_BODY bytes (HTTP 413)."""


def _depth(value, limit: int, level: int = 1) -> int:
    """Nesting depth of parsed JSON, refused past `limit` (UserError)."""
    if level > limit:
        raise UserError(f"JSON nested deeper than {limit} levels")
    children = value.values() if isinstance(value, dict) else value if isinstance(value, list) else ()
    return max((_depth(v, limit, level + 1) for v in children), default=level)


def _fields(req: dict, allowed: tuple[str, ...]) -> None:
    """Refuse a field the route does not know (a misspelt or smuggled one is never silently ignored)."""
    extra = sorted(set(req) - set(allowed))
    if extra:
        raise UserError(f"unknown field {extra[0][:60]!r} (expected: {', '.join(allowed)})")


def _text(req: dict, key: str, limit: int = 1000) -> str:
    v = req.get(key)
    if v is None:
        return ""
    if not isinstance(v, (str, int)) or isinstance(v, bool) or len(str(v)) > limit:
        raise UserError(f"{key} must be a string of at most {limit} characters")
    return str(v)


class _Handler(BaseHTTPRequestHandler):
    server_version = "chunkgrpo-promoter"

    def log_message(self, fmt, *args):
        log.info("%s %s", self.address_string(), fmt % args)

    def _answer(self, code: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            return self._answer(200, {"status": "ok"})
        return self._answer(404, {"error": "not found"})

    def do_POST(self):
        """One route per path; every route reads the same bounded JSON body and maps errors the same way:
        403 not allowed, 413 too large, 400 bad request (one line), 500 anything else (logged; the service
        keeps serving)."""
        route = {"/promote": self._promote, "/versions": self._create_version}.get(self.path)
        if route is None:
            return self._answer(404, {"error": "not found"})
        try:
            body = route(self._read())
        except PermissionError as e:
            return self._answer(403, {"error": _line(e)})
        except TooLarge as e:
            self.close_connection = True  # the unread body is not drained
            return self._answer(413, {"error": _line(e)})
        except (UserError, ValueError, TypeError) as e:
            return self._answer(400, {"error": _line(e)})
        except Exception as e:
            log.exception("%s failed", self.path)
            return self._answer(500, {"error": _line(f"{type(e).__name__}: {e}")})
        return self._answer(200, body)

    def _read(self) -> dict:
        try:
            length = int(self.headers.get("Content-Length") or 0)
        except ValueError:
            raise UserError("Content-Length is not a number") from None
        if length > _MAX_BODY:
            raise TooLarge(f"request body of {length} bytes; at most {_MAX_BODY}")
        if length <= 0:
            raise UserError("empty request body (expected a JSON object)")
        raw = self.rfile.read(length)
        # nesting is counted before parsing: the parser itself recurses once per level
        depth = level = 0
        in_string = escaped = False
        for c in raw.decode("utf-8", errors="replace"):
            if in_string:
                escaped, in_string = (False, True) if escaped else (c == "\\", c != '"')
            elif c == '"':
                in_string = True
            elif c in "[{":
                level += 1
                depth = max(depth, level)
                if depth > _MAX_DEPTH:
                    raise UserError(f"JSON nested deeper than {_MAX_DEPTH} levels")
            elif c in "]}":
                level -= 1
        try:
            req = json.loads(raw)
        except (ValueError, RecursionError) as e:
            raise UserError(f"request body is not JSON ({type(e).__name__})") from None
        if not isinstance(req, dict):
            raise UserError("expected a JSON object")
        _depth(req, _MAX_DEPTH)
        return req

    def _promote(self, req: dict) -> dict:
        """The gate, run here with the promoter's rights, for a caller who may read the model."""
        _fields(req, ("name", "version", "metric", "margin", "why"))
        name, version = _text(req, "name", 256), _text(req, "version", 20)
        if not name or not version.isdigit():
            raise UserError("expected {\"name\": ..., \"version\": N, \"why\": ...}")
        why = _text(req, "why", MAX_WHY + 1)
        check_why(why)
        margin = number(req.get("margin") or 0.0)
        if margin is None or margin < 0 or isinstance(req.get("margin"), bool):
            raise UserError(f"margin {str(req.get('margin'))[:40]!r} must be a finite number >= 0")
        who = _caller(self.headers.get("Authorization"), name)
        gate = GateConfig(metric=_text(req, "metric", 256), margin=margin)
        with _LOCK:
            res = promote(name, version, gate, who=who, why=why)
        return {"action": res.action, "name": res.name, "version": res.version, "previous": res.previous,
                "reason": res.reason}

    def _create_version(self, req: dict) -> dict:
        """A version of a registered model from an MLflow model the caller logged in its own run (one it
        may write to: the caller's credentials tag it), with the same checks as in-process registration
        (`registration.create_version`: the source inside the run, no protected alias, idempotent)."""
        _fields(req, ("name", "source", "run_id", "tags", "eval_run_id", "gate_metric", "gate_direction",
                      "challenger_alias", "idempotency_key"))
        name, source, run_id = _text(req, "name", 256), _text(req, "source"), _text(req, "run_id", 64)
        if not (name and source and run_id):
            raise UserError("expected {\"name\", \"source\", \"run_id\", \"tags\", \"eval_run_id\"}")
        tags = req.get("tags") or {}
        if not isinstance(tags, dict) or len(tags) > _MAX_TAGS or not all(
                isinstance(k, str) and len(k) <= 250 and isinstance(v, (str, int, float)) and not isinstance(
                    v, bool) and len(str(v)) <= MAX_TAG for k, v in tags.items()):
            raise UserError(f"tags must be an object of at most {_MAX_TAGS} name -> string "
                            f"(names up to 250, values up to {MAX_TAG} characters)")
        alias = req.get("challenger_alias")
        if alias is not None:
            check_alias(alias)
        key = _text(req, "idempotency_key", 128) or None
        eval_run_id = _text(req, "eval_run_id", 64) or None
        who = _caller(self.headers.get("Authorization"), run_id, "runs/get", "run_id")
        _caller_writes(self.headers.get("Authorization"), run_id)
        client = connect()
        with _LOCK:
            mv = create_version(client, name, source, run_id,
                                {**{k: str(v) for k, v in tags.items()}, "registered_by": who},
                                eval_run_id=eval_run_id,
                                gate_metric=_text(req, "gate_metric", 256) or None,
                                gate_direction=_text(req, "gate_direction", 3) or None,
                                challenger_alias=alias, key=key)
        return {"name": mv.name, "version": str(mv.version), "source": mv.source, "run_id": mv.run_id,
                "tags": dict(mv.tags or {})}


def _line(e) -> str:
    """An error as one line of at most 500 characters."""
    text = " ".join(str(e).split())
    return text if len(text) <= 500 else text[:497] + "..."


def _caller_writes(header: str | None, run_id: str) -> None:
    """PermissionError unless the caller may write to run `run_id` (MLflow's EDIT on its experiment):
    the caller's own credentials set the run's tag chunkgrpo.version_request."""
    uri = os.environ["MLFLOW_TRACKING_URI"].rstrip("/")
    body = json.dumps({"run_id": run_id, "key": "chunkgrpo.version_request", "value": "promoter"}).encode()
    req = urllib.request.Request(f"{uri}/api/2.0/mlflow/runs/set-tag", data=body, method="POST",
                                 headers={"Authorization": header or "", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=10):
            return
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            raise PermissionError(f"the caller may not write to run {run_id} (HTTP {e.code}): a version "
                                  "comes only from the caller's own run") from None
        raise UserError(f"run {run_id} cannot be tagged (HTTP {e.code})") from None


def serve(host: str, port: int) -> ThreadingHTTPServer:
    """A started promoter server (.shutdown() stops it); this process's MLflow identity is the promoter's."""
    client = connect()  # MLflow reachable, credentials out of the URI
    reclaim_locks(client)  # a promotion lock this service held before it was restarted
    if not current_identity():
        log.warning("promoter started without MLFLOW_TRACKING_USERNAME: "
                    "on a basic-auth MLflow it can move nothing")
    server = ThreadingHTTPServer((host, port), _Handler)
    threading.Thread(target=server.serve_forever, name="promoter", daemon=True).start()
    return server


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m chunkgrpo.promoter", description=__doc__.splitlines()[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    server = serve(a.host, a.port)
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        server.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
