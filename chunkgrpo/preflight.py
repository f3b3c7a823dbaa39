"""Preflight: everything a pipeline run will need, checked in seconds before any GPU is requested.

    problems = check(PreflightSpec(model="s3://chunkgrpo-data/models/black-forest-labs/FLUX.1-dev",
                                   prompts="s3://chunkgrpo-data/prompts/hpdv2_train.txt",
                                   weights={"hpsv3": "s3://…/MizzenAI/HPSv3"}, benchmarks=["hpdv2", "wise"],
                                   artifact_root="s3://chunkgrpo-checkpoints/pipeline-runs"))
    require(spec)        # UserError with ONE line naming everything that is missing

Checks: S3 credentials and endpoint; the base model (an s3:// folder artifact with its manifest, a
local diffusers folder, or a hub id already in the local hub cache: nothing is downloaded); the
prompt file; every reward/scorer weight URI; the bucket of `artifact_root`; the WISE judge's API
key when `wise` is evaluated; the MLflow server (reachable, and the credentials accepted when it
runs with basic auth); every reward server the run scores with (reachable, loaded, serving the named
reward, accepting $CHUNKGRPO_REWARD_TOKEN: `scoring.remote.check_service`); with `device` set, that
CUDA can use the GPU it asks for (`chunkgrpo.gpu`); for a benchmark of a registry version
(`registered="name@alias"`, the nightly pipeline) that the alias exists, and the base model it was
registered with; and what the image lacks to build the step's rewards (`image_problems`, found by
`chunkgrpo.preflight_image`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import urllib.error
import urllib.request
from base64 import b64encode
from pathlib import Path

from chunkgrpo.errors import UserError


@dataclasses.dataclass
class PreflightSpec:
    model: str = ""
    prompts: str = ""
    weights: dict[str, str] = dataclasses.field(default_factory=dict)
    benchmarks: list[str] = dataclasses.field(default_factory=list)
    artifact_root: str = ""
    registered: str = ""  # "name@alias": the registry version a benchmark evaluates (needs MLflow)
    judge_key_env: str = "OPENAI_API_KEY"
    mlflow: bool = True
    timeout_s: float = 10.0
    device: str = ""  # the stage's device when preflight runs where the stage will ("" = not checked)
    reward_servers: list[tuple[str, str]] = dataclasses.field(default_factory=list)  # (name, url) served
    # what this image lacks for the step's rewards/scorers (`chunkgrpo.preflight_image`), found beforehand
    image_problems: list[str] = dataclasses.field(default_factory=list)


def _store():
    from chunkgrpo.store.client import ArtifactStore

    return ArtifactStore()


def _check_folder(what: str, uri: str, store, hint: str) -> str | None:
    if uri.startswith("s3://"):
        if store is None:
            return None  # reported once as missing credentials
        try:
            if store.read_manifest(uri) is not None:
                return None
            if store.list(uri):  # a plain prefix (weights uploaded by hand) is accepted
                return None
        except Exception as e:
            return f"{what} {uri}: S3 error ({type(e).__name__}: {str(e).splitlines()[0][:120]})"
        return f"{what} {uri} does not exist ({hint})"
    path = Path(uri).expanduser()
    if path.exists():
        return None
    return f"{what} {uri} does not exist ({hint})"


def _check_model(model: str, store) -> str | None:
    from chunkgrpo.model_cache import model_uri

    if not model:
        return "no base model given"
    if model.startswith("s3://") or Path(model).expanduser().exists() or model.startswith(("/", ".")):
        problem = _check_folder(
            "base model", model, store, "fill the cache once with `chunkgrpo models sync`"
        )
        if (
            problem is None
            and not model.startswith("s3://")
            and not (Path(model) / "model_index.json").exists()
        ):
            return f"base model {model} is not a diffusers folder (no model_index.json)"
        return problem
    try:
        from huggingface_hub import snapshot_download

        snapshot_download(model, local_files_only=True)
        return None
    except Exception:
        target = model_uri(model) if model.count("/") == 1 else "s3://…"
        return (f"base model {model!r} is not in this image's hub cache and is never downloaded at run time: "
                f"run `chunkgrpo models sync {model}` and use model={target}")


def _check_prompts(prompts: str, store) -> str | None:
    if not prompts:
        return "no prompt file given"
    if prompts.startswith("s3://"):
        if store is None:
            return None
        try:
            return None if store.exists(prompts) else f"prompt file {prompts} does not exist"
        except Exception as e:
            return f"prompt file {prompts}: S3 error ({type(e).__name__})"
    return None if Path(prompts).expanduser().is_file() else f"prompt file {prompts} does not exist"


def _mlflow_request(path: str, body: dict | None = None) -> urllib.request.Request:
    uri = os.environ.get("MLFLOW_TRACKING_URI", "").rstrip("/")
    req = urllib.request.Request(
        uri + path,
        data=None if body is None else json.dumps(body).encode(),
        method="GET" if body is None else "POST",
        headers={"Content-Type": "application/json"},
    )
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    if user and password:
        req.add_header("Authorization", "Basic " + b64encode(f"{user}:{password}".encode()).decode())
    return req


def _check_mlflow(timeout_s: float) -> str | None:
    from chunkgrpo.tracking import credentials_from_uri

    credentials_from_uri()  # user:password in the URI -> MLFLOW_TRACKING_USERNAME/PASSWORD, never printed
    uri = os.environ.get("MLFLOW_TRACKING_URI", "")
    if not uri:
        return None  # tracking off (open_run says so)
    if not uri.startswith("http"):
        return None
    req = _mlflow_request("/api/2.0/mlflow/experiments/search", {"max_results": 1})
    user = os.environ.get("MLFLOW_TRACKING_USERNAME")
    try:
        with urllib.request.urlopen(req, timeout=timeout_s):
            return None
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            who = f"user {user!r}" if user else "no credentials"
            return (f"MLflow {uri} refused the request (HTTP {e.code}, {who}): set MLFLOW_TRACKING_USERNAME/"
                    "PASSWORD (Secret chunkgrpo-mlflow)")
        return f"MLflow {uri} answered HTTP {e.code}"
    except (urllib.error.URLError, OSError) as e:
        return f"MLflow {uri} is not reachable ({getattr(e, 'reason', e)})"


def _registered_version(ref: str, timeout_s: float) -> tuple[dict | None, str | None]:
    """(model version JSON, None) for "name@alias" from the registry's REST API, or (None, problem)."""
    from urllib.parse import urlencode

    name, _, alias = ref.rpartition("@")
    if not name or not alias:
        return None, f"registered model {ref!r} must be name@alias"
    if not os.environ.get("MLFLOW_TRACKING_URI", "").startswith("http"):
        return (
            None,
            f"registered model {ref} needs an MLflow server (MLFLOW_TRACKING_URI, ConfigMap chunkgrpo-env)",
        )
    req = _mlflow_request(
        "/api/2.0/mlflow/registered-models/alias?" + urlencode({"name": name, "alias": alias})
    )
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as r:
            return json.loads(r.read()).get("model_version") or {}, None
    except urllib.error.HTTPError as e:
        if e.code == 404:
            return (
                None,
                f"registered model {name!r} has no version with alias {alias!r} (register and promote one)",
            )
        return None, f"registered model {ref}: MLflow answered HTTP {e.code}"
    except (urllib.error.URLError, OSError, ValueError) as e:
        return None, f"registered model {ref}: {getattr(e, 'reason', e)}"


def evaluation_inputs(eval_preset: str, eval_benchmarks: list, eval_overrides: list,
                      scorer_weights: dict) -> tuple[list[str], dict[str, str]]:
    """What an evaluation stage will read: its benchmark suites (`eval_benchmarks`, else the preset's, else
    hpdv2) and the scorer weight URIs it uses, labelled `scorer <name>` for the preflight report."""
    from chunkgrpo.config import load_yaml
    from chunkgrpo.model_cache import used_scorer_weights

    overrides = [
        *eval_overrides,
        *([f"benchmarks={json.dumps(list(eval_benchmarks))}"] if eval_benchmarks else []),
    ]
    benchmarks = list(eval_benchmarks) or list(load_yaml(eval_preset).get("benchmarks") or ["hpdv2"])
    weights = {
        f"scorer {k}": v for k, v in used_scorer_weights(eval_preset, overrides, dict(scorer_weights)).items()
    }
    return benchmarks, weights


def check(spec: PreflightSpec) -> list[str]:
    """Every problem found, one short sentence each ([] = ready to run)."""
    problems: list[str] = []
    if spec.device:  # a GPU asked for that CUDA cannot use (driver too old for torch's CUDA)
        from chunkgrpo.gpu import problem

        gpu_problem = problem(spec.device)
        if gpu_problem:
            problems.append(gpu_problem)
    mlflow_problem = _check_mlflow(spec.timeout_s) if spec.mlflow else None
    model = spec.model
    if spec.registered and not mlflow_problem:
        version, p = _registered_version(spec.registered, spec.timeout_s)
        if p:
            problems.append(p)
        elif not model:  # the base model the version was trained from (tag base_model)
            tags = {t.get("key"): t.get("value") for t in (version or {}).get("tags") or []}
            model = tags.get("base_model", "")
    needs_s3 = any(str(u).startswith("s3://") for u in [model, spec.prompts, spec.artifact_root,
                                                         *spec.weights.values()])
    store = None
    if needs_s3:
        try:
            store = _store()
        except UserError as e:
            problems.append(str(e).split(":")[0] + " (Secret chunkgrpo-s3 / ConfigMap chunkgrpo-env)")
    checks = []
    if model or not spec.registered:  # a benchmark of a registry version may leave the base model to it
        checks.append(_check_model(model, store))
    if spec.prompts or not spec.registered:
        checks.append(_check_prompts(spec.prompts, store))
    problems.extend(p for p in checks if p)
    for role, uri in sorted(spec.weights.items()):
        if uri:
            p = _check_folder(
                f"weights {role}", uri, store, "fill the cache once with `chunkgrpo models sync`"
            )
            if p:
                problems.append(p)
    if spec.artifact_root:
        if not spec.artifact_root.startswith("s3://"):
            problems.append(f"artifact_root {spec.artifact_root!r} must be an s3:// URI")
        elif store is not None:
            from chunkgrpo.store import parse_s3_uri

            bucket, _ = parse_s3_uri(spec.artifact_root)
            try:
                if not store._client.bucket_exists(bucket):
                    problems.append(f"bucket {bucket} of artifact_root does not exist")
            except Exception as e:
                problems.append(f"artifact_root bucket {bucket}: S3 error ({type(e).__name__}: "
                                f"{str(e).splitlines()[0][:120]})")
    if "wise" in spec.benchmarks and not os.environ.get(spec.judge_key_env):
        problems.append(f"WISE is evaluated but the judge key {spec.judge_key_env} is not set "
                        "(Secret chunkgrpo-judge, key OPENAI_API_KEY)")
    if mlflow_problem:
        problems.append(mlflow_problem)
    if spec.reward_servers:
        from chunkgrpo.scoring.remote import check_service

        for name, url in spec.reward_servers:
            if p := check_service(url, name, spec.timeout_s):
                problems.append(p)
    return problems + list(spec.image_problems)


def require(spec: PreflightSpec) -> None:
    problems = check(spec)
    if problems:
        raise UserError(f"preflight: {len(problems)} problem(s): " + "; ".join(problems))


GPU_POOLS = ("h800", "h100")  # pools with an overlay (manifests/overlays/prod-<pool>) and a known GPU size


def capacity_check(preset: str, overrides: list[str], model: str, pool: str, method: str = "chunk",
                   nodes: int = 1) -> tuple[str, list[str]]:
    """(Markdown, problems) of the training run's capacity plan (`chunkgrpo.capacity`) on `pool`: for an
    H800/H100 pool against its training runtime (the repository's overlay, or in a pod the cluster's
    ClusterTrainingRuntime), otherwise (cpu, gpu) on this machine's CPU with nothing limited. Each problem
    is one sentence `capacity: <resource> (<phase>): needs X of Y (+Z over)`."""
    from chunkgrpo.capacity.plan import capacity_plan, render_markdown
    from chunkgrpo.capacity.pool import load_pool, local_pool
    from chunkgrpo.recipes import preset_for
    from chunkgrpo.train.config import TrainConfig

    preset = preset_for(method, preset)
    cfg = TrainConfig.load(preset, [*overrides, *([f"model={model}"] if model else [])])
    if pool in GPU_POOLS:
        plan = capacity_plan(cfg, load_pool(pool), nodes=nodes, preset=preset)
    else:
        plan = capacity_plan(cfg, local_pool(), device="cpu", preset=preset)
    return render_markdown(plan), [f"capacity: {p}" for p in plan.problems()]
