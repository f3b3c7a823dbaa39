"""`chunkgrpo pipeline run --local`: the real pipeline under `kfp.local` against local S3 + MLflow.

    chunkgrpo pipeline run --local                 # toy model, 2 torchrun processes, a few min on 2 CPU cores

1. starts (or reuses) SeaweedFS + MLflow (`chunkgrpo.services`, state in <home>/local);
2. builds the pretrained toy-world FLUX model (`chunkgrpo.toy`, cached by content hash) under <home>
   if missing; its train prompts are the training data, its held-out prompts the evaluation set
   (pipeline/demos.py);
3. exports the services' env (S3 endpoint + keys, MLFLOW_TRACKING_URI) so every task inherits it;
4. runs the same pipeline function that is compiled for the cluster with
   `kfp.local.SubprocessRunner(use_venv=False)`: every task is a fresh Python interpreter of this venv,
   started by kfp.local (Kubernetes settings such as GPUs, node selector, tolerations, /dev/shm and
   secrets are ignored by kfp.local with a warning), pipeline root <home>/kfp.
   Task retries are switched off locally (the cluster keeps them): against
   local services a failure is a real one, and a bad parameter must fail at once, not after minutes
   of retry back-off. The pod volumes the tasks' compiled env points at (`/cache`: TMPDIR, CHUNKGRPO_CACHE,
   ...) are mapped to folders under <home>/pod-volumes; the tasks without a volume inherit the run's
   own temp folder there as TMPDIR, removed when the run ends (`run_tmpdir`); `pod_faithful=True`
   (`--pod-faithful`) instead runs each task in fresh volume folders with its exact compiled env and audits
   its writes (pipeline/pod_faithful.py); `image_faithful=True` (`--image-faithful`) is a pod-faithful run
   whose tasks each start in the locally built environment of the image their pod uses
   (pipeline/image_faithful.py); kfp.local's task cache is on (pipeline/kfp_tasks.py); a pod-faithful run
   executes every task (no cache: each task's writes are audited);
5. prints where every artifact is (local paths, s3:// URIs), the MLflow run and the registry outcome
   (pipeline/summary.py).

Console and log (pipeline/task_log.py): every line goes to `<home>/logs/<pipeline>-<time>.log`, the
console shows one line per task; a failed task raises `TaskFailed`, which `chunkgrpo pipeline run --local`
prints as one line and exits 2 (user error) or 1 (internal).
"""

import contextlib
import dataclasses
import os
import sys
import time
import warnings
from pathlib import Path

from pipeline.demos import (
    DEMOS,
    TINY_NIGHTLY,
    TINY_TRAIN,
    TOY_NIGHTLY,
    TOY_TRAIN,
    model_to_s3,
    prepare_inputs,
    prepare_tiny_inputs,
    toy_eval_overrides,
)
from pipeline.kfp_tasks import (
    cache_fingerprint,
    cached_outputs,
    check_params,
    latest_run_dir,
    read_task_outputs,
    set_caching,
    without_retries,
)
from pipeline.summary import mlflow_url
from pipeline.task_log import ConsoleLog, cache_hits, rel, task_failure


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
    log_path: Path | None = None  # everything the tasks and kfp printed
    pod_report: list | None = None  # --pod-faithful: per task, bytes used per volume and its scaled limit
    images: dict | None = None  # --image-faithful: task -> "chunkgrpo-<image>: <the python it ran with>"
    stages: dict = dataclasses.field(default_factory=dict)  # stage -> seconds (services, model, tasks, total)

    @property
    def mlflow_run_id(self) -> str:
        return str(self.tasks.get("open-run", {}).get("parameters", {}).get("Output", ""))


def _user_error(message: str):
    from chunkgrpo.errors import UserError

    return UserError(message)


def run_local(
    pipeline: str = "train_and_evaluate",
    params: dict | None = None,
    *,
    home: str | Path = ".chunkgrpo",
    keep_services: bool = False,
    s3_port: int = 8333,
    mlflow_port: int = 5000,
    services_env: dict | None = None,
    verbose: bool = False,
    demo: str = "toy",
    pod_faithful: bool = False,
    enable_caching: bool | None = None,
    image_faithful: bool = False,
) -> LocalRun:
    """Run a pipeline end to end with kfp.local. `services_env` = use already running services (tests).
    `demo`: toy (the pretrained toy-world model, default) or tiny (the random-weight tiny model: a
    seconds-long wiring check). `pod_faithful`: every task runs with its pod's compiled env in fresh
    folders standing for its volumes, and every write is audited against the volumes' sizeLimits
    scaled to the local model (pipeline/pod_faithful.py). `enable_caching`: None = each task's compiled
    caching setting, True/False = for every task (`--enable-caching`); a pod-faithful run caches nothing.
    `image_faithful`: pod-faithful, and every task runs in the local environment of its pod's image
    (scripts/image-env.sh; pipeline/image_faithful.py).
    Raises `TaskFailed` when a task fails (the reason is read from the run's log)."""
    from chunkgrpo.services import LocalServices, LocalServicesConfig
    from pipeline.compile import check_literal, pipeline_func

    if demo not in DEMOS:
        raise _user_error(f"--demo {demo!r} must be one of {', '.join(DEMOS)}")
    pod_faithful = pod_faithful or image_faithful
    if pod_faithful and enable_caching:
        raise _user_error("--pod-faithful runs and audits every task: it cannot take --enable-caching true")
    func, literals = pipeline_func(pipeline, pool="cpu", trainer="torchrun")
    if image_faithful:  # before any server starts: an image whose environment is not built fails at once
        from pipeline.image_faithful import envs_for
        from pipeline.pod_faithful import pod_specs

        envs_for({fn: spec.image for fn, spec in pod_specs(func).items()})
    without_retries(func)
    set_caching(func, enable_caching)
    check_params(func, params or {})  # before any server starts: a bad -p fails at once, in one line
    for k, v in (params or {}).items():
        try:
            check_literal(k, v, literals)
        except ValueError as e:
            raise _user_error(f"-p {e}") from None
    home = Path(home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    stages: dict[str, float] = {}  # where the wall time went: printed by summary_lines
    restore_sigterm = _sigterm_as_interrupt()
    svc, started = None, False
    if services_env is None:
        svc = LocalServices(
            LocalServicesConfig(home=str(home / "local"), s3_port=s3_port, mlflow_port=mlflow_port),
            command="chunkgrpo pipeline run --local",
        )
        started = any(s.state != "running" for s in svc.status().values())
        try:
            svc.up()
        except BaseException:  # interrupted or failed while starting: stop what this call started
            restore_sigterm()
            if started and not keep_services:
                svc.down()
            raise
        services_env = svc.env()
        stages["services"] = time.perf_counter() - t_start
    saved = {k: os.environ.get(k) for k in [*services_env, *_run_env(home, {})]}
    try:
        os.environ.update(services_env)
        os.environ.update(_run_env(home, os.environ))
        full, model_dir = _parameters(pipeline, demo, home, params or {})
        stages["model"] = time.perf_counter() - t_start - sum(stages.values())
        for k, v in full.items():
            check_literal(k, v, literals)
        with run_tmpdir(home) as tmp:
            result = _run_pipeline(func, pipeline, full, model_dir, home, services_env, verbose=verbose,
                                   pod_faithful=pod_faithful, stages=stages, image_faithful=image_faithful,
                                   tmp=tmp)
        result.services_kept = svc is None or keep_services or not started
        stages["total"] = time.perf_counter() - t_start
        return result
    finally:
        restore_sigterm()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        if svc is not None and started and not keep_services:
            svc.down()


def _parameters(pipeline: str, demo: str, home: Path, params: dict) -> tuple[dict, Path]:
    """The run's full parameters (the demo's, then `params`) and the local model folder they name."""
    if demo == "tiny":
        if pipeline == "train_and_evaluate":
            model, prompts = prepare_tiny_inputs(home)
            full = {**TINY_TRAIN, "model": str(model), "prompts": str(prompts), **params}
        else:
            full = {**TINY_NIGHTLY, **params}
    else:
        model, prompts = prepare_inputs(home)
        toy = {"eval_overrides": toy_eval_overrides(model)}
        if pipeline == "train_and_evaluate":
            full = {**TOY_TRAIN, **toy, "model": str(model), "prompts": str(prompts), **params}
        else:
            full = {**TOY_NIGHTLY, **toy, "ablation_model": str(model), **params}
    return full, Path(str(full.get("model") or full.get("ablation_model") or ""))


def _run_pipeline(func, pipeline: str, full: dict, model_dir: Path, home: Path, services_env: dict, *,
                  verbose: bool, pod_faithful: bool, stages: dict, image_faithful: bool = False,
                  tmp: Path | None = None) -> LocalRun:
    """Run the pipeline function under kfp.local with the console/log capture; the run's outputs.
    `tmp`: the run's temp folder (`run_tmpdir`), for kfp.local's workspace (None: kfp.local makes one in
    $TMPDIR and keeps it)."""
    from kfp import local

    from pipeline.pod_faithful import layout_for, map_volumes, tasks_as_pods

    root = home / "kfp"
    root.mkdir(exist_ok=True)
    before = set(root.glob("*"))
    cache_root = root / ".kfp_cache" / cache_fingerprint(full)
    local.init(
        runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True,
        enable_caching=not pod_faithful, cache_root=str(cache_root),
        workspace_root=str(tmp) if tmp else None,  # no task uses kfp's workspace
    )
    layout = layout_for(pipeline, func, home, faithful=pod_faithful, model_dir=model_dir, allow=[root],
                        image_faithful=image_faithful)
    if pod_faithful:
        if pipeline == "train_and_evaluate" and not str(full["model"]).startswith("s3://"):
            full["model"] = model_to_s3(model_dir, services_env)  # as on the cluster: pods download it
        run_tasks = tasks_as_pods(layout)
    else:
        map_volumes(func, layout)
        run_tasks = contextlib.nullcontext()
    log_dir = home / "logs"
    log_path = log_dir / f"{pipeline}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
    log_dir.mkdir(parents=True, exist_ok=True)
    where = "their images' Python environments" if image_faithful else "this Python environment"
    print(
        "note: kfp.local ignores the Kubernetes settings (GPUs, node selector, tolerations, /dev/shm, "
        f"secret env); tasks run in {where} with the local services' env, without retries",
        flush=True,
    )
    print(f"{pipeline}: running with kfp.local; full log: {rel(str(log_path))}", flush=True)
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as log, warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*have no effect in the current local runner.*")
        warnings.filterwarnings("ignore", message=".*custom or non-Python base image.*")
        out = ConsoleLog(log, sys.stdout, verbose)
        try:
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), cache_hits(out), run_tasks:
                func(**full)
        except RuntimeError as e:
            if "finished with status" not in str(e):
                raise
            log.flush()
            raise task_failure(log_path.read_text(encoding="utf-8"), pipeline, log_path, str(e)) from None
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM: the run's MLflow parent run ends KILLED
            end_parent_run_killed(root, func.name, before, services_env)
            raise
    wall = time.perf_counter() - t0
    stages["pipeline"] = wall
    stages.update({f"task {name}": s for name, s in out.took.items()})
    run_dir = latest_run_dir(root, func.name, before)
    tasks = {**cached_outputs(cache_root, out.cached), **read_task_outputs(run_dir)}
    result = LocalRun(pipeline, run_dir, wall, tasks, dict(services_env), full, services_kept=True,
                      log_path=log_path, stages=stages)
    result.pod_report = layout.report if pod_faithful else None
    result.images = dict(layout.ran_in) if image_faithful else None
    result.mlflow_url = mlflow_url(services_env.get("MLFLOW_TRACKING_URI", ""), result.mlflow_run_id)
    return result


@contextlib.contextmanager
def run_tmpdir(home: Path):
    """The run's temp folder, `<home>/pod-volumes/tmp-*`, this process's TMPDIR while the run lasts: the
    TMPDIR of every task whose pod has no /cache volume (kfp.local starts them with this environment),
    removed with what they left there (kfp's `tmp.*` folder of each task's program, a failed step's
    scratch) when the run ends, on failure too. A task with a /cache volume keeps its compiled TMPDIR, the
    shared cache folder: the task's env is part of kfp.local's cache key, so it must not change between
    runs; its step removes its own scratch."""
    import shutil
    import tempfile

    parent = home / "pod-volumes"
    parent.mkdir(parents=True, exist_ok=True)
    path = Path(tempfile.mkdtemp(prefix="tmp-", dir=parent))
    before = os.environ.get("TMPDIR"), tempfile.tempdir
    os.environ["TMPDIR"], tempfile.tempdir = str(path), str(path)
    try:
        yield path
    finally:
        if before[0] is None:
            os.environ.pop("TMPDIR", None)
        else:
            os.environ["TMPDIR"] = before[0]
        tempfile.tempdir = before[1]
        shutil.rmtree(path, ignore_errors=True)


def _run_env(home: Path, environ) -> dict:
    """What a local run adds to the tasks' environment (on top of the services'): the model/weights cache
    under <home> unless one is set, and MLflow's telemetry off."""
    return {"CHUNKGRPO_CACHE": environ.get("CHUNKGRPO_CACHE", str(home / "cache")),
            "MLFLOW_DISABLE_TELEMETRY": "true"}


def _sigterm_as_interrupt():
    """Until the returned function is called, SIGTERM (a `kill`, a CI job's timeout, a test fixture
    stopping the run) is handled like Ctrl-C: the running tasks' processes (kfp.local's task subprocess
    and its torchrun workers; in a terminal Ctrl-C reaches their process group, a `kill` only this
    process) get SIGTERM, then `KeyboardInterrupt` unwinds this process, so the services it started
    are stopped. Main thread only (elsewhere a no-op)."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None

    def on_term(signum, frame):
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut the clean-up short
        _terminate_children()
        raise KeyboardInterrupt(f"signal {signum}")

    previous = signal.signal(signal.SIGTERM, on_term)
    return lambda: signal.signal(signal.SIGTERM, previous)


def _terminate_children(grace_s: float = 10.0) -> None:
    """SIGTERM to every descendant of this process in its session (by pid: the kfp.local task and its
    torchrun workers), SIGKILL to those alive after `grace_s`. The servers run in their own session and
    are stopped (or kept, `--keep-services`) by `LocalServices`."""
    import psutil

    try:
        sid = os.getsid(0)
        children = [p for p in psutil.Process().children(recursive=True) if _sid(p.pid) == sid]
    except psutil.Error:
        return
    for p in children:
        with contextlib.suppress(psutil.Error):
            p.terminate()
    _, alive = psutil.wait_procs(children, timeout=grace_s)
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()


def _sid(pid: int) -> int:
    try:
        return os.getsid(pid)
    except OSError:
        return -1


def end_parent_run_killed(root: Path, name: str, before: set, services_env: dict) -> None:
    """An interrupted run's MLflow parent run (opened by its open-run task; its close-run task never runs)
    ends KILLED with kfp.state=CANCELED instead of staying RUNNING. Best effort: the interruption is what
    the user sees, whatever MLflow answers."""
    uri = services_env.get("MLFLOW_TRACKING_URI", "")
    if not uri:
        return
    with contextlib.suppress(Exception):  # no run directory yet, no open-run output, MLflow unreachable
        run_dir = latest_run_dir(root, name, before)
        run_id = str(read_task_outputs(run_dir).get("open-run", {}).get("parameters", {}).get("Output", ""))
        if not run_id:
            return
        from mlflow import MlflowClient

        client = MlflowClient(uri)
        if client.get_run(run_id).info.status == "RUNNING":
            client.set_tag(run_id, "kfp.state", "CANCELED")
            client.set_terminated(run_id, status="KILLED")
