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
                    "run_id": ..., "eval_run_id": ..., "tags": {...}}
        Authorization: Basic <the caller's MLflow credentials>

Creating a version also needs EDIT on the registered model in MLflow (and EDIT moves aliases), so
registration's privileged half runs here too (`chunkgrpo.registry.registration.create_version`): the
caller logs the MLflow model in its own run, the promoter creates the version and computes every tag
promotion relies on (evaluation run link and metrics, gate at registration, model files' digest) itself.

The caller is authenticated by MLflow itself (its credentials must read the registered model), the
gate runs here with the registry's rules (`chunkgrpo.registry.promotion.promote`: trusted metrics from the
evaluation run, the gate recorded at registration, the promotion lock), and the caller is recorded as
`promotion.by`. The service never forces and never rolls back: those are actions of a person holding
the promoter credentials (`chunkgrpo promote --force/--rollback --why ...`). `chunkgrpo promote` sends
its request here when $CHUNKGRPO_PROMOTER_URL is set (`chunkgrpo.registry.promoter_client`).
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
from chunkgrpo.registry.gate import GateConfig
from chunkgrpo.registry.promotion import promote
from chunkgrpo.registry.registration import create_version

log = logging.getLogger(__name__)
_MAX_BODY = 64 * 1024
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
        403 not allowed, 400 bad request, 500 anything else (logged; the service keeps serving)."""
        route = {"/promote": self._promote, "/versions": self._create_version}.get(self.path)
        if route is None:
            return self._answer(404, {"error": "not found"})
        try:
            body = route(self._read())
        except PermissionError as e:
            return self._answer(403, {"error": str(e)})
        except (UserError, ValueError, TypeError) as e:
            return self._answer(400, {"error": str(e)})
        except Exception as e:
            log.exception("%s failed", self.path)
            return self._answer(500, {"error": f"{type(e).__name__}: {e}"})
        return self._answer(200, body)

    def _read(self) -> dict:
        length = int(self.headers.get("Content-Length") or 0)
        if not 0 < length <= _MAX_BODY:
            raise UserError(f"request body of {length} bytes (1..{_MAX_BODY})")
        req = json.loads(self.rfile.read(length))
        if not isinstance(req, dict):
            raise UserError("expected a JSON object")
        return req

    def _promote(self, req: dict) -> dict:
        """The gate, run here with the promoter's rights, for a caller who may read the model."""
        if not req.get("name") or not str(req.get("version", "")).isdigit():
            raise UserError("expected {\"name\": ..., \"version\": N, \"why\": ...}")
        who = _caller(self.headers.get("Authorization"), str(req["name"]))
        gate = GateConfig(metric=str(req.get("metric") or ""), margin=float(req.get("margin") or 0.0))
        with _LOCK:
            res = promote(str(req["name"]), str(req["version"]), gate, who=who, why=str(req.get("why") or ""))
        return {"action": res.action, "name": res.name, "version": res.version, "previous": res.previous,
                "reason": res.reason}

    def _create_version(self, req: dict) -> dict:
        """A version of a registered model from an MLflow model the caller logged in its own run."""
        name, source, run_id = (str(req.get(k) or "") for k in ("name", "source", "run_id"))
        if not (name and source and run_id):
            raise UserError("expected {\"name\", \"source\", \"run_id\", \"tags\", \"eval_run_id\"}")
        who = _caller(self.headers.get("Authorization"), run_id, "runs/get", "run_id")
        client = connect()
        run = client.get_run(run_id)
        if not source.startswith(run.info.artifact_uri.rstrip("/") + "/"):
            raise UserError(f"source {source!r} is not an artifact of run {run_id}")
        tags = {str(k): str(v) for k, v in (req.get("tags") or {}).items()}
        with _LOCK:
            mv = create_version(client, name, source, run_id, {**tags, "registered_by": who},
                                eval_run_id=req.get("eval_run_id") or None,
                                gate_metric=req.get("gate_metric") or None,
                                gate_direction=req.get("gate_direction") or None,
                                challenger_alias=req.get("challenger_alias"))
        return {"name": mv.name, "version": str(mv.version), "source": mv.source, "run_id": mv.run_id,
                "tags": dict(mv.tags or {})}


def serve(host: str, port: int) -> ThreadingHTTPServer:
    """A started promoter server (.shutdown() stops it); this process's MLflow identity is the promoter's."""
    connect()  # MLflow reachable, credentials out of the URI
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
