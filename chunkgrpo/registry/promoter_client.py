"""The client of the promoter service (`chunkgrpo.promoter`): the two registry actions a READ-only
pipeline identity asks of the promoter identity over HTTP, authenticated with this process's MLflow
credentials (HTTP Basic). `chunkgrpo register` / `promote` use it when $CHUNKGRPO_PROMOTER_URL is set.
"""

from __future__ import annotations

import base64
import json
import os
import urllib.error
import urllib.request
from types import SimpleNamespace

from chunkgrpo.errors import UserError
from chunkgrpo.registry.gate import PromotionResult
from chunkgrpo.tracking import credentials_from_uri, redact_uri


def _call(url: str, path: str, body: dict) -> dict:
    credentials_from_uri()
    user = os.environ.get("MLFLOW_TRACKING_USERNAME", "")
    password = os.environ.get("MLFLOW_TRACKING_PASSWORD", "")
    req = urllib.request.Request(url.rstrip("/") + path, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json"})
    if user:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
    try:
        with urllib.request.urlopen(req, timeout=600) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        try:
            reason = json.loads(e.read()).get("error", "")
        except (ValueError, AttributeError):
            reason = ""
        raise UserError(f"the promoter at {redact_uri(url)} refused: {reason or f'HTTP {e.code}'}") from None
    except (urllib.error.URLError, OSError) as e:
        raise UserError(f"the promoter at {redact_uri(url)} is unreachable "
                        f"({getattr(e, 'reason', e)})") from None


def request_version(url: str, name: str, source: str, run_id: str, tags: dict, *, eval_run_id=None,
                    gate_metric=None, gate_direction=None, challenger_alias="challenger",
                    idempotency_key: str | None = None):
    """Ask the promoter to create a version of `name` from the MLflow model at `source` (logged in this
    identity's run `run_id`): the registry half a READ-only pipeline user cannot do itself. Retrying is
    safe: the same run and source (or the same `idempotency_key`) answer with the version created first."""
    body = {"name": name, "source": source, "run_id": run_id, "tags": tags, "eval_run_id": eval_run_id,
            "gate_metric": gate_metric, "gate_direction": gate_direction,
            "challenger_alias": challenger_alias}
    if idempotency_key:
        body["idempotency_key"] = idempotency_key
    out = _call(url, "/versions", body)
    return SimpleNamespace(name=out["name"], version=out["version"], source=out["source"],
                           run_id=out["run_id"], tags=out["tags"])


def request_promotion(url: str, name: str, version: str, gate=None, why: str = "") -> PromotionResult:
    """Ask the promoter service at `url` to promote `name` v`version` (as `chunkgrpo promote` does
    when $CHUNKGRPO_PROMOTER_URL is set), authenticated with this process's MLflow credentials."""
    out = _call(url, "/promote", {"name": name, "version": str(version), "why": why,
                                  "metric": getattr(gate, "metric", "") or "",
                                  "margin": getattr(gate, "margin", 0.0)})
    return PromotionResult(out["action"], out["name"], out["version"], out.get("previous"), out["reason"])
