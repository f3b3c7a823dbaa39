"""`chunkgrpo pipeline run --local`: the real pipeline under `kfp.local` against local S3 + MLflow.

    chunkgrpo pipeline run --local                      # tiny model, 2 torchrun processes, ~2 min on 2 CPU cores

1. starts (or reuses) SeaweedFS + MLflow (`chunkgrpo.local_services`, state in <home>/local);
2. builds the tiny random-weight FLUX model and a prompt file under <home> if missing;
3. exports the services' env (S3 endpoint + keys, MLFLOW_TRACKING_URI) so every task inherits it;
4. runs the same pipeline function that is compiled for the cluster with
   `kfp.local.SubprocessRunner(use_venv=False)` (tasks run in this venv; Kubernetes settings such as
   GPUs, node selector, tolerations, /dev/shm and secrets are ignored by kfp.local with a warning),
   pipeline root <home>/kfp;
5. prints where every artifact is (local paths, s3:// URIs), the MLflow run and the registry outcome.
"""

import dataclasses
import json
import os
import time
import warnings
from pathlib import Path

TINY_PROMPTS = """a red apple on a wooden table
a cat sitting on a windowsill at sunset
a blue car parked in front of a house
a bowl of fruit, studio lighting
a lighthouse on a rocky coast at night
a dog running in a green park
an astronaut riding a horse
three yellow balloons in a clear sky
"""

# Parameters of `train_and_evaluate` for the tiny CPU model (everything else keeps its default).
TINY_TRAIN = {
    "preset": "tiny_cpu", "method": "chunk", "max_iterations": 30, "nproc_per_node": 2,
    "chunk_strategy": "dynamics", "profile_prompts": 4, "profile_seeds": 1, "device": "cpu",
    "eval_preset": "eval_tiny", "eval_num_prompts": 8, "model_name": "chunkgrpo-tiny",
    "gate_metric": "eval.hpdv2.brightness", "gate_direction": "max", "gate_margin": 0.0,
    "experiment": "chunkgrpo-local", "artifact_root": "s3://chunkgrpo/pipeline-runs",
}
TINY_NIGHTLY = {
    "model_name": "chunkgrpo-tiny", "eval_preset": "eval_tiny", "eval_benchmarks": ["hpdv2"], "eval_num_prompts": 4,
    "regression_metric": "hpdv2.brightness", "tolerance": 0.005, "experiment": "chunkgrpo-local-nightly",
    "artifact_root": "s3://chunkgrpo/nightly",
}


@dataclasses.dataclass
class LocalRun:
    pipeline: str
    run_dir: Path
    wall_s: float
    tasks: dict            # task dir name -> {"artifacts": {name: {uri, metadata}}, "parameters": {...}}
    env: dict
    params: dict
    services_kept: bool
    mlflow_url: str = ""   # UI URL of the pipeline's MLflow parent run

    @property
    def mlflow_run_id(self) -> str:
        return str(self.tasks.get("open-run", {}).get("parameters", {}).get("Output", ""))


def prepare_inputs(home: Path) -> tuple[Path, Path]:
    """The tiny model and a prompt file under `home` (built once, then reused)."""
    model = home / "models" / "tiny-flux"
    if not (model / "model_index.json").exists():
        from chunkgrpo.tiny import build_tiny_flux

        print(f"building the tiny FLUX model in {model} ...", flush=True)
        build_tiny_flux(model, seed=0)
    prompts = home / "data" / "tiny_prompts.txt"
    if not prompts.exists():
        prompts.parent.mkdir(parents=True, exist_ok=True)
        prompts.write_text(TINY_PROMPTS)
    return model, prompts


def read_task_outputs(run_dir: Path) -> dict:
    """{task: {"artifacts": {name: {"uri", "metadata"}}, "parameters": {...}}} from executor_output.json files."""
    out: dict = {}
    for f in sorted(run_dir.rglob("executor_output.json")):
        task = f.parent.name
        body = json.loads(f.read_text())
        arts = {}
        for name, spec in (body.get("artifacts") or {}).items():
            a = (spec.get("artifacts") or [{}])[0]
            arts[name] = {"uri": a.get("uri", ""), "metadata": a.get("metadata") or {}}
        out[task] = {"artifacts": arts, "parameters": body.get("parameterValues") or {}}
    return out


def _latest_run_dir(root: Path, name: str, before: set) -> Path:
    dirs = [d for d in root.glob(f"{name}-*") if d.is_dir() and d not in before]
    if not dirs:
        raise RuntimeError(f"kfp.local wrote no run directory {name}-* under {root}")
    return max(dirs, key=lambda d: d.stat().st_mtime)


def run_local(pipeline: str = "train_and_evaluate", params: dict | None = None, *, home: str | Path = ".chunkgrpo",
              keep_services: bool = False, s3_port: int = 8333, mlflow_port: int = 5000,
              services_env: dict | None = None) -> LocalRun:
    """Run a pipeline end to end with kfp.local. `services_env` = use already running services (tests)."""
    from kfp import local

    from chunkgrpo.local_services import LocalServices, LocalServicesConfig
    from pipeline.compile import check_literal, pipeline_func

    home = Path(home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    svc, started = None, False
    if services_env is None:
        svc = LocalServices(LocalServicesConfig(home=str(home / "local"), s3_port=s3_port, mlflow_port=mlflow_port))
        started = any(s.state != "running" for s in svc.status().values())
        svc.up()
        services_env = svc.env()
    saved = {k: os.environ.get(k) for k in [*services_env, "CHUNKGRPO_CACHE", "MLFLOW_DISABLE_TELEMETRY"]}
    try:
        os.environ.update(services_env)
        os.environ.setdefault("CHUNKGRPO_CACHE", str(home / "cache"))
        os.environ["MLFLOW_DISABLE_TELEMETRY"] = "true"
        func, literals = pipeline_func(pipeline, pool="cpu", trainer="torchrun")
        if pipeline == "train_and_evaluate":
            model, prompts = prepare_inputs(home)
            full = {**TINY_TRAIN, "model": str(model), "prompts": str(prompts), **(params or {})}
        else:
            full = {**TINY_NIGHTLY, **(params or {})}
        for k, v in full.items():
            check_literal(k, v, literals)
        root = home / "kfp"
        root.mkdir(exist_ok=True)
        before = set(root.glob("*"))
        local.init(runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True)
        print("note: kfp.local ignores the Kubernetes settings (GPUs, node selector, tolerations, /dev/shm, "
              "secret env); tasks run in this Python environment with the local services' env", flush=True)
        t0 = time.perf_counter()
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*have no effect in the current local runner.*")
            warnings.filterwarnings("ignore", message=".*custom or non-Python base image.*")
            func(**full)
        wall = time.perf_counter() - t0
        run_dir = _latest_run_dir(root, func.name, before)
        result = LocalRun(pipeline, run_dir, wall, read_task_outputs(run_dir), dict(services_env), full,
                          services_kept=svc is None or keep_services or not started)
        result.mlflow_url = _mlflow_url(services_env.get("MLFLOW_TRACKING_URI", ""), result.mlflow_run_id)
        return result
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if svc is not None and started and not keep_services:
            svc.down()


def _mlflow_url(tracking_uri: str, run_id: str) -> str:
    if not (tracking_uri and run_id):
        return ""
    try:
        from mlflow import MlflowClient

        exp = MlflowClient(tracking_uri).get_run(run_id).info.experiment_id
        return f"{tracking_uri}/#/experiments/{exp}/runs/{run_id}"
    except Exception:  # noqa: BLE001 - the summary must not fail the run
        return tracking_uri


def _rel(p: str) -> str:
    try:
        return str(Path(p).resolve().relative_to(Path.cwd()))
    except ValueError:
        return p


def summary_lines(r: LocalRun) -> list[str]:
    t, env = r.tasks, r.env
    mlflow = env.get("MLFLOW_TRACKING_URI", "")
    art = lambda task, name: t.get(task, {}).get("artifacts", {}).get(name, {})  # noqa: E731
    par = lambda task, name, default="": t.get(task, {}).get("parameters", {}).get(name, default)  # noqa: E731
    lines = [f"{r.pipeline}: SUCCEEDED in {r.wall_s:.1f} s (kfp.local, SubprocessRunner)",
             f"  kfp run dir      {_rel(str(r.run_dir))}"]
    run_id = r.mlflow_run_id
    if run_id:
        lines.append(f"  MLflow run       {run_id}  {r.mlflow_url}")
    if "profile" in t:
        lines.append(f"  profile          {_rel(art('profile', 'profile_json')['uri'])}  (+ plot.png: "
                     f"{_rel(art('profile', 'plot')['uri'])})")
    if "plan" in t:
        lines.append(f"  plan             {par('plan', 'Output')}  {_rel(art('plan', 'plan_json')['uri'])}  "
                     f"(Markdown: {_rel(art('plan', 'report')['uri'])})")
    if "train" in t:
        m = art("train", "trained_model")
        lines.append(f"  trained model    {m['metadata'].get('uri', '?')}  (manifest sha256 "
                     f"{str(m['metadata'].get('manifest_sha256', ''))[:12]}..)")
        lines.append(f"    pointer        {_rel(m['uri'])}")
        met = art("train", "metrics")["metadata"]
        lines.append("    metrics        " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(met.items())))
    if "evaluate" in t:
        res = art("evaluate", "results")
        lines.append(f"  evaluation       {res['metadata'].get('output_uri', '')}  (images, metrics.json, report.html)")
        lines.append(f"    report (HTML)  {_rel(art('evaluate', 'report')['uri'])}")
        met = art("evaluate", "metrics")["metadata"]
        lines.append("    metrics        " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(met.items())
                                                       if not k.endswith(".delta")))
    if "register" in t:
        reg = art("register", "registered")["metadata"]
        lines.append(f"  registered       {reg.get('uri', '?')}{' (existing version, same weights)' if reg.get('reused') else ''}"
                     f"  source {reg.get('source', '')}")
    if "check-gate" in t:
        passed = par("check-gate", "Output")
        lines.append(f"  promotion gate   {'passed' if passed else 'not passed'} ({r.params.get('gate_metric')}, "
                     f"{r.params.get('gate_direction')} is better)")
        if "promote" in t:
            lines.append(f"  promote          {par('promote', 'Output')}  -> "
                         f"models:/{r.params.get('model_name')}@champion")
        else:
            lines.append("  promote          skipped (gate not passed); champion unchanged")
    if "check-regression" in t:
        lines.append(f"  regression       {'REGRESSION' if par('check-regression', 'Output') else 'none'}  "
                     f"(summary: {_rel(art('check-regression', 'summary')['uri'])})")
    s3 = env.get("CHUNKGRPO_S3_ENDPOINT", "")
    state = "still running" if r.services_kept else "stopped"
    lines.append(f"  services         S3 {s3} (bucket {env.get('CHUNKGRPO_S3_BUCKET', '')}), MLflow {mlflow}: {state}")
    home = _rel(str(r.run_dir.parent.parent / "local"))
    if r.services_kept:
        lines.append(f"                   browse MLflow at the URL above; stop them with `chunkgrpo local down --home {home}`")
    else:
        lines.append(f"                   data kept in {home}; browse it again with `chunkgrpo local up --home {home}` "
                     "(or rerun with --keep-services)")
    return lines
