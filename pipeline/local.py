"""`chunkgrpo pipeline run --local`: the real pipeline under `kfp.local` against local S3 + MLflow.

    chunkgrpo pipeline run --local                 # toy model, 2 torchrun processes, a few min on 2 CPU cores

1. starts (or reuses) SeaweedFS + MLflow (`chunkgrpo.local_services`, state in <home>/local);
2. builds the pretrained toy-world FLUX model (`chunkgrpo.toy`, cached by content hash) under <home>
   if missing; its train prompts are the training data, its held-out prompts the evaluation set;
3. exports the services' env (S3 endpoint + keys, MLFLOW_TRACKING_URI) so every task inherits it;
4. runs the same pipeline function that is compiled for the cluster with
   `kfp.local.SubprocessRunner(use_venv=False)` (tasks run in this venv; Kubernetes settings such as
   GPUs, node selector, tolerations, /dev/shm and secrets are ignored by kfp.local with a warning),
   pipeline root <home>/kfp; each task's process is forked from a server that has imported torch, mlflow,
   diffusers and transformers once (pipeline/warm.py; `--cold-tasks`: kfp.local's fresh interpreters).
   Task retries are switched off locally (the cluster keeps them): against
   local services a failure is a real one, and a bad parameter must fail at once, not after minutes
   of retry back-off. The pod volumes the tasks' compiled env points at (`/cache`: TMPDIR, CHUNKGRPO_CACHE,
   ...) are mapped to folders under <home>/pod-volumes; `pod_faithful=True` (`--pod-faithful`) instead runs
   each task in fresh volume folders with its exact compiled env and audits its writes
   (pipeline/pod_faithful.py);
   kfp.local's task cache is on, with each task's compiled caching setting (as on the cluster: profile and
   plan are cached) or `--enable-caching true|false` for every task; its folder is named after a
   fingerprint of the chunkgrpo code and of the local files the parameters name (`cache_root`), so a
   rebuilt model or edited code never gets an earlier run's profile. A pod-faithful run executes every
   task (no cache: each task's writes are audited);
5. prints where every artifact is (local paths, s3:// URIs), the MLflow run and the registry outcome.

Console and log: every line the tasks and kfp print goes to `<home>/logs/<pipeline>-<time>.log`; the
console shows one line per task (`--verbose` streams everything). A failed task raises `TaskFailed`:
the task's name and the reason read from its log (the component's `UserError` message, or the
message of the exception that ended it), whether it was a user error, and the log's path;
`chunkgrpo pipeline run --local` prints that as one line and exits 2 (user error) or 1 (internal).
"""

import contextlib
import dataclasses
import functools
import io
import itertools
import json
import os
import re
import sys
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

# Parameters of the local runs (everything else keeps the pipeline's default): what both demos share, then
# per demo. `--demo toy` (default): the pretrained toy-world model, Chunk-GRPO with the exact GenEval reward
# (`toy_geneval`), evaluated on held-out toy prompts (attribute combinations never seen in training) by the
# exact toy detector. `--demo tiny`: the tiny random-weight FLUX (built in a second; nothing to learn, a
# brightness reward), the fast wiring check the tests use for pipeline mechanics.
LOCAL_TRAIN = {
    "method": "chunk", "nproc_per_node": 2, "chunks": "dynamics", "profile_seeds": 1, "device": "cpu",
    "gate_direction": "max", "gate_margin": 0.0, "experiment": "chunkgrpo-local",
    "artifact_root": "s3://chunkgrpo/pipeline-runs",
}
LOCAL_NIGHTLY = {"experiment": "chunkgrpo-local-nightly", "artifact_root": "s3://chunkgrpo/nightly"}
TINY_TRAIN = {
    **LOCAL_TRAIN,
    "preset": "tiny_cpu",
    "max_iterations": 30,
    "profile_prompts": 4,
    "eval_preset": "eval_tiny",
    "eval_num_prompts": 8,
    "model_name": "chunkgrpo-tiny",
    "gate_metric": "eval.hpdv2.brightness",
}
TINY_NIGHTLY = {
    **LOCAL_NIGHTLY, "model_name": "chunkgrpo-tiny", "eval_preset": "eval_tiny", "eval_benchmarks": ["hpdv2"],
    "eval_num_prompts": 4, "regression_metric": "hpdv2.brightness", "tolerance": 0.005,
}
TOY_TRAIN = {
    **LOCAL_TRAIN,
    "preset": "toy_cpu",
    # 25 rollouts at lr 4e-3 instead of toy_cpu's 100 at 1e-3: the shortest setting whose held-out gain
    # exceeded the base's seed spread on every training seed measured (42, 1, 7: +0.172, +0.099, +0.045;
    # 50 at 2e-3 gained +0.129, +0.081, +0.000), in a quarter of the training time
    # (benchmarks/results/demo-budget). policy_batch=64: a whole policy window (16 samples × one chunk of
    # ≤ 4 steps) in one forward/backward instead of about 16 (the policy phase 0.47 → 0.27-0.31 s per
    # rollout on 2 cores; the same gradients up to float rounding, tests/unit/train/test_grpo.py)
    "max_iterations": 25,
    "train_overrides": ["lr=0.004", "policy_batch=64"],
    "profile_prompts": 8,
    "eval_preset": "eval_toy",
    "eval_num_prompts": 0,
    "model_name": "chunkgrpo-toy",
    "gate_metric": "eval.geneval.overall",
}
TOY_NIGHTLY = {
    **LOCAL_NIGHTLY, "model_name": "chunkgrpo-toy", "eval_preset": "eval_toy", "eval_benchmarks": ["geneval"],
    "eval_num_prompts": 0, "regression_metric": "geneval.overall", "tolerance": 0.02, "ablation_seeds": 2,
    "ablation_steps": 4, "ablation_methods": ["step_flow", "chunk_dynamics"],
}
DEMOS = ("toy", "tiny")


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
    stages: dict = dataclasses.field(default_factory=dict)  # stage -> seconds (services, model, tasks, total)
    task_processes: dict = dataclasses.field(default_factory=dict)  # {"warm": n, "cold": n}, pipeline/warm.py

    @property
    def mlflow_run_id(self) -> str:
        return str(self.tasks.get("open-run", {}).get("parameters", {}).get("Output", ""))


def prepare_tiny_inputs(home: Path) -> tuple[Path, Path]:
    """The tiny random-weight model and a prompt file under `home` (built once, then reused)."""
    model = home / "models" / "tiny-flux"
    if not (model / "model_index.json").exists():
        from chunkgrpo.testing.tiny import build_tiny_flux

        print(f"building the tiny FLUX model in {_rel(str(model))} ...", flush=True)
        build_tiny_flux(model, seed=0)
    prompts = home / "data" / "tiny_prompts.txt"
    if not prompts.exists():
        prompts.parent.mkdir(parents=True, exist_ok=True)
        prompts.write_text(TINY_PROMPTS)
    return model, prompts


def prepare_inputs(home: Path) -> tuple[Path, Path]:
    """The pretrained toy model under `home` and its training prompt file: the copy shipped with the
    package (`chunkgrpo.toy.pretrained`) when it is the current default model, else `chunkgrpo toy-model`
    (content-hash cached: pretrained once, ≈ 5.5 minutes on 2 cores)."""
    from chunkgrpo.toy.model import build_toy_model, read_meta
    from chunkgrpo.toy.pretrained import install, is_current

    model = home / "models" / "toy"
    meta = read_meta(model)
    if not is_current(meta) and install(model):  # the pretrained copy shipped with the package (≈ 3 MB)
        replaced = f"; the one there was built by other code (key {meta.get('key')})" if meta else ""
        print(
            f"toy-world base model: the pretrained copy shipped with chunkgrpo -> {_rel(str(model))}"
            f"{replaced}",
            flush=True,
        )
        meta = read_meta(model)
    if not is_current(meta):  # absent or stale: pretrain (cached by content hash)
        print(f"building the toy-world base model in {_rel(str(model))} (one-time pretraining, cached) ...",
              flush=True)
        build_toy_model(model)
    return model, model / read_meta(model)["files"]["train_prompts"]


def toy_eval_overrides(model: Path) -> list[str]:
    """The toy model's held-out prompt files for the `eval_toy` preset."""
    from chunkgrpo.toy.model import read_meta

    files = read_meta(model)["files"]
    return [
        f"geneval_metadata={model / files['heldout_metadata']}",
        f"hpdv2_prompts={model / files['heldout_prompts']}",
    ]


def model_to_s3(model: Path, services_env: dict) -> str:
    """Upload a local model folder to the local S3 (once per content) and return its `s3://` URI, so that a
    pod-faithful run fetches it into each task's cache volume as the cluster's pods do."""
    from chunkgrpo.store.client import ArtifactStore
    from chunkgrpo.store.manifest import build_manifest

    digest = build_manifest(model).content_sha256[:12]  # the files only: `sha256` has the creation time
    uri = f"s3://{services_env.get('CHUNKGRPO_S3_BUCKET') or 'chunkgrpo'}/models/local/{model.name}-{digest}"
    store = ArtifactStore()
    if store.read_manifest(uri) is None:
        store.put_folder(model, uri, meta={"kind": "model"})
    return uri


def read_task_outputs(run_dir: Path) -> dict:
    """{task: {"artifacts": {name: {"uri", "metadata"}}, "parameters": {...}}} from executor_output.json
    files."""
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


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_TASK_START = re.compile(r"Executing task '([^']+)'")
_TASK_CACHED = re.compile(r"Task (\S+) cache hit \(key=([0-9a-f]+)\)")  # kfp.local's line for a cache hit
_TASK_END = re.compile(r"Task '([^']+)' finished with status (\w+)")
# a `chunkgrpo <command>: error: ...` line (the CLI inside the task, e.g. torchrun rank 0), or the last
# line of a traceback that ended in a UserError
_USER_ERROR = (re.compile(r"\bchunkgrpo [\w.-]+: error: (.+)$"),
               re.compile(r"(?:^|\s)(?:chunkgrpo\.errors\.)?UserError: (.+)$"))
_EXCEPTION = re.compile(
    r"^\s*((?:[A-Za-z_]\w*\.)*[A-Za-z_]\w*(?:Error|Exception|Exit|Interrupt|Failure)(?::.*)?)$"
)


class TaskFailed(Exception):
    """A pipeline task failed: `task`, the one-line `reason` read from its log, whether the reason is a
    user error (bad parameter or input: exit 2) or an internal failure (exit 1), and the full log."""

    def __init__(self, pipeline: str, task: str, reason: str, user_error: bool, log_path: Path):
        self.pipeline, self.task, self.reason, self.user_error, self.log_path = (
            pipeline,
            task,
            reason,
            user_error,
            log_path,
        )
        super().__init__(f"task '{task}' of {pipeline} failed: {reason} (full log: {_rel(str(log_path))})")


def task_failure(log_text: str, pipeline: str, log_path: Path, message: str = "") -> TaskFailed:
    """The failed task and its reason, from the run's log (`message`: kfp's exception text, a fallback)."""
    lines = [_ANSI.sub("", ln).rstrip() for ln in log_text.splitlines()]
    failed = [
        (i, m.group(1))
        for i, ln in enumerate(lines)
        if (m := _TASK_END.search(ln)) and m.group(2) == "FAILURE"
    ]
    if failed:
        end, task = failed[0]  # the first failure; later ones (an exit handler) are consequences
    else:
        names = re.findall(r"'([^']+)'", _ANSI.sub("", message))
        end, task = len(lines), names[0] if names else "?"
    start = max(
        (i for i, ln in enumerate(lines[:end]) if (m := _TASK_START.search(ln)) and m.group(1) == task),
        default=0,
    )
    section = lines[start:end]
    for pattern in _USER_ERROR:
        for ln in section:
            if m := pattern.search(ln):
                return TaskFailed(pipeline, task, m.group(1).strip(), True, log_path)
    last = ""
    in_traceback = False
    for ln in section:
        if ln.strip().startswith("Traceback (most recent call last)"):
            in_traceback = True
        elif in_traceback and (m := _EXCEPTION.match(ln)):
            last, in_traceback = m.group(1).strip(), False
    reason = last or (f"{_ANSI.sub('', message).strip()}" if message else "failed without an error message")
    return TaskFailed(pipeline, task, reason, False, log_path)


class _ConsoleLog(io.TextIOBase):
    """stdout/stderr of a local run: everything into the log file; on the console one line per task
    (or everything with `verbose`)."""

    def __init__(self, log, console, verbose: bool = False):
        self._log, self._console, self._verbose = log, console, verbose
        self._buf = ""
        self._started: dict[str, float] = {}
        self.took: dict[str, float] = {}  # task -> seconds, in finishing order
        self.cached: dict[str, str] = {}  # task -> the start of its cache key (kfp.local skipped it)

    def writable(self) -> bool:
        return True

    def write(self, s: str) -> int:
        self._log.write(s)
        if self._verbose:
            self._console.write(s)
        self._buf += s
        while "\n" in self._buf:
            line, self._buf = self._buf.split("\n", 1)
            self._progress(_ANSI.sub("", line))
        return len(s)

    def flush(self) -> None:
        self._log.flush()
        self._console.flush()

    def _progress(self, line: str) -> None:
        if m := _TASK_START.search(line):
            self._started[m.group(1)] = time.perf_counter()
        elif m := _TASK_END.search(line):
            self.took[m.group(1)] = time.perf_counter() - self._started.get(m.group(1), time.perf_counter())
        elif m := _TASK_CACHED.search(line):
            self.cached[m.group(1)], self.took[m.group(1)] = m.group(2), 0.0
        if self._verbose:
            return
        if m := _TASK_START.search(line):
            self._console.write(f"  {m.group(1)} ...\n")
        elif m := _TASK_CACHED.search(line):
            self._console.write(f"  {m.group(1)}: cached (an earlier run's outputs, same inputs)\n")
        elif m := _TASK_END.search(line):
            took = self.took[m.group(1)]
            word = "done" if m.group(2) == "SUCCESS" else m.group(2).lower()
            self._console.write(f"  {m.group(1)}: {word} ({took:.0f} s)\n")
        else:
            return
        self._console.flush()


_PARAM_TYPES = {
    "Integer": (int,),
    "Float": (int, float),
    "Boolean": (bool,),
    "String": (str,),
    "List": (list,),
    "Dict": (dict,),
    "Struct": (dict,),
}


def check_params(func, params: dict) -> None:
    """Parameter names and value types against the pipeline's inputs (UserError naming the bad one)."""
    from chunkgrpo.errors import UserError

    inputs = func.component_spec.inputs or {}
    for name, value in params.items():
        if name not in inputs:
            raise UserError(f"unknown pipeline parameter {name!r}; parameters: {', '.join(sorted(inputs))}")
        kinds = _PARAM_TYPES.get(inputs[name].type)
        if kinds and (not isinstance(value, kinds) or (isinstance(value, bool) and bool not in kinds)):
            raise UserError(
                f"-p {name}={value!r}: expected {inputs[name].type.lower()}, got {type(value).__name__}"
            )


def pipeline_tasks(func) -> dict:
    """{name: task spec} of every task of a kfp pipeline function: its root DAG's and those of the DAGs
    inside it (exit handler, conditions)."""
    spec = func.pipeline_spec
    dags = [spec.root.dag] + [
        c.dag for c in spec.components.values() if c.WhichOneof("implementation") == "dag"
    ]
    return {name: task for dag in dags for name, task in dag.tasks.items()}


def without_retries(func) -> int:
    """Clear the retry policy of every task of a kfp pipeline function (in place); returns how many had
    one."""
    n = 0
    for task in pipeline_tasks(func).values():
        if task.HasField("retry_policy"):
            task.ClearField("retry_policy")
            n += 1
    return n


@contextlib.contextmanager
def _cache_hits(out):
    """Pass kfp.local's cache-hit lines to `out`. kfp logs them at INFO on the root logger before it
    sets up its own log handler for the task, so with the root logger's default level they are dropped;
    meanwhile the root logger takes INFO and a handler forwards those lines only (the handlers already
    there keep the root's former level)."""
    import logging

    class Hits(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            msg = record.getMessage()
            if _TASK_CACHED.search(msg):
                out.write(msg + "\n")

    root, handler = logging.getLogger(), Hits(logging.INFO)
    level = root.level
    others = [(h, h.level) for h in root.handlers]
    for h, lv in others:
        h.setLevel(max(lv, level))
    root.addHandler(handler)
    root.setLevel(min(level, logging.INFO) if level else logging.INFO)
    try:
        yield
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        for h, lv in others:
            h.setLevel(lv)


def set_caching(func, enabled: bool | None) -> int:
    """Set every task's caching option of a kfp pipeline function (in place), as `enable_caching` at
    submission does on the cluster; None keeps each task's compiled setting. Returns how many tasks."""
    if enabled is None:
        return 0
    tasks = pipeline_tasks(func)
    for task in tasks.values():
        task.caching_options.enable_cache = enabled
    return len(tasks)


def _local_paths(value) -> list[Path]:
    """Existing absolute local paths among a parameter value's strings (also `key=/path` overrides)."""
    if isinstance(value, dict):
        return [p for v in value.values() for p in _local_paths(v)]
    if isinstance(value, list):
        return [p for v in value for p in _local_paths(v)]
    if not isinstance(value, str):
        return []
    out = []
    for s in {value, value.split("=", 1)[-1]}:
        if s.startswith("/") and "\n" not in s and Path(s).exists():
            out.append(Path(s))
    return out


FINGERPRINT_FILES = 200_000  # entries of one folder that `cache_fingerprint` looks at (FLUX.1-dev: ~30)


def cache_fingerprint(params: dict, code: list[Path] | None = None) -> str:
    """What kfp.local's cache key leaves out, as one hash: kfp keys a task by its component, command,
    arguments and env, so a parameter naming a path stays the same key when the files behind it change,
    and the library code a component imports is not part of it (on the cluster the image tag is). This
    hashes the path, size and modification time of every file of the chunkgrpo and components packages
    and of every local file or folder a parameter names (`model`, `prompts`, `key=/path` overrides): a
    rebuilt model, an edited prompt file or changed code gives another fingerprint. Stat only, no file
    contents: a FLUX.1-dev folder (≈ 30 GB) costs as little as the toy model. `code`: the code folders
    (default: the two packages)."""
    import hashlib

    import chunkgrpo
    import components

    roots = code if code is not None else [Path(chunkgrpo.__file__).parent, Path(components.__file__).parent]
    roots = [*roots, *sorted({p.resolve() for p in _local_paths(params)})]
    h = hashlib.sha256()
    for root in roots:
        # at most FINGERPRINT_FILES entries per folder: a parameter naming "/" or a huge tree costs seconds
        entries = [root] if root.is_file() else itertools.islice(root.rglob("*"), FINGERPRINT_FILES)
        files = sorted(f for f in entries if f.is_file() and "__pycache__" not in f.parts)
        h.update(f"{root}\n".encode())
        for f in files:
            st = f.stat()
            rel = f.relative_to(root) if f != root else f.name
            h.update(f"{rel}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    return h.hexdigest()[:16]


def cached_outputs(cache_root: Path, cached: dict) -> dict:
    """{task: {"artifacts", "parameters", "cached": True}} of the tasks kfp.local took from its cache
    (`cached`: task -> the start of its key, from kfp's log line), read by kfp's own `LocalCache`."""
    from kfp import dsl
    from kfp.local.cache import LocalCache

    cache = LocalCache(str(cache_root))
    out: dict = {}
    for task, key in cached.items():
        entries = sorted(cache_root.glob(f"{key}*.json"))
        outputs = cache.get(entries[0].stem) if len(entries) == 1 else None
        if outputs is None:
            continue
        arts, pars = {}, {}
        for name, v in outputs.items():
            if isinstance(v, list) and v and isinstance(v[0], dsl.Artifact):
                v = v[0]
            if isinstance(v, dsl.Artifact):
                arts[name] = {"uri": v.uri, "metadata": v.metadata or {}}
            else:
                pars[name] = v
        out[task] = {"artifacts": arts, "parameters": pars, "cached": True}
    return out


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
    warm: bool = True,
) -> LocalRun:
    """Run a pipeline end to end with kfp.local. `services_env` = use already running services (tests).
    `demo`: toy (the pretrained toy-world model, default) or tiny (the random-weight tiny model: a
    seconds-long wiring check). `pod_faithful`: every task runs with its pod's compiled env in fresh
    folders standing for its volumes, and every write is audited against the volumes' sizeLimits
    scaled to the local model (pipeline/pod_faithful.py). `enable_caching`: None = each task's compiled
    caching setting, True/False = for every task (`--enable-caching`); a pod-faithful run caches nothing.
    Raises `TaskFailed` when a task fails (the reason is read from the run's log)."""
    from kfp import local

    from chunkgrpo.local_services import SERVICES, LocalServices, LocalServicesConfig
    from pipeline.compile import check_literal, pipeline_func

    if demo not in DEMOS:
        from chunkgrpo.errors import UserError

        raise UserError(f"--demo {demo!r} must be one of {', '.join(DEMOS)}")
    if pod_faithful and enable_caching:
        from chunkgrpo.errors import UserError

        raise UserError("--pod-faithful runs and audits every task: it cannot take --enable-caching true")
    func, literals = pipeline_func(pipeline, pool="cpu", trainer="torchrun")
    without_retries(func)
    set_caching(func, enable_caching)
    check_params(func, params or {})  # before any server starts: a bad -p fails at once, in one line
    for k, v in (params or {}).items():
        try:
            check_literal(k, v, literals)
        except ValueError as e:
            from chunkgrpo.errors import UserError

            raise UserError(f"-p {e}") from None
    home = Path(home).resolve()
    home.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    # warm task processes on Linux only: on macOS a forked child of a process that loaded Apple's frameworks
    # may crash
    warm = warm and not pod_faithful and sys.platform == "linux"
    launcher = _prestart(pipeline, func, home, keep_services) if warm else None
    stages: dict[str, float] = {}  # where the wall time went: printed by summary_lines
    restore_sigterm = _sigterm_as_interrupt()
    svc, started = None, False
    if services_env is None:
        svc = LocalServices(
            LocalServicesConfig(home=str(home / "local"), s3_port=s3_port, mlflow_port=mlflow_port)
        )
        started = any(s.state != "running" for n, s in svc.status().items() if n in SERVICES)
        try:
            svc.up()
        except BaseException:  # interrupted or failed while starting: stop what this call started
            restore_sigterm()
            if started and not keep_services:
                svc.down()
            raise
        services_env = svc.env()
        stages["services"] = time.perf_counter() - t_start
    saved = {k: os.environ.get(k) for k in [*services_env, *_run_env(home, {}, warm)]}
    try:
        os.environ.update(services_env)
        os.environ.update(_run_env(home, os.environ, warm))
        if demo == "tiny":
            if pipeline == "train_and_evaluate":
                model, prompts = prepare_tiny_inputs(home)
                full = {**TINY_TRAIN, "model": str(model), "prompts": str(prompts), **(params or {})}
            else:
                full = {**TINY_NIGHTLY, **(params or {})}
        else:
            model, prompts = prepare_inputs(home)
            toy = {"eval_overrides": toy_eval_overrides(model)}
            if pipeline == "train_and_evaluate":
                full = {**TOY_TRAIN, **toy, "model": str(model), "prompts": str(prompts), **(params or {})}
            else:
                full = {**TOY_NIGHTLY, **toy, "ablation_model": str(model), **(params or {})}
        stages["model"] = time.perf_counter() - t_start - sum(stages.values())
        for k, v in full.items():
            check_literal(k, v, literals)
        root = home / "kfp"
        root.mkdir(exist_ok=True)
        before = set(root.glob("*"))
        cache_root = root / ".kfp_cache" / cache_fingerprint(full)
        local.init(
            runner=local.SubprocessRunner(use_venv=False), pipeline_root=str(root), raise_on_error=True,
            enable_caching=not pod_faithful, cache_root=str(cache_root),
        )
        from kfp.local import subprocess_task_handler as kfp_subprocess

        from pipeline.pod_faithful import layout_for, write_report

        model_dir = Path(str(full.get("model") or full.get("ablation_model") or ""))
        layout = layout_for(pipeline, func, home, faithful=pod_faithful, model_dir=model_dir, allow=[root])
        if pod_faithful and pipeline == "train_and_evaluate" and not str(full["model"]).startswith("s3://"):
            full["model"] = model_to_s3(model_dir, services_env)  # as on the cluster: pods download it
        log_dir = home / "logs"
        log_path = log_dir / f"{pipeline}-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}.log"
        log_dir.mkdir(parents=True, exist_ok=True)
        original = kfp_subprocess.run_local_subprocess
        runner, counted = original, {}
        if launcher is not None:
            runner = functools.partial(launcher.run, cold=original)
            counted = dict(launcher.runs)
        print(
            "note: kfp.local ignores the Kubernetes settings (GPUs, node selector, tolerations, /dev/shm, "
            "secret env); tasks run in this Python environment with the local services' env, without retries",
            flush=True,
        )
        print(f"{pipeline}: running with kfp.local; full log: {_rel(str(log_path))}", flush=True)
        t0 = time.perf_counter()
        with open(log_path, "w", encoding="utf-8") as log, warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*have no effect in the current local runner.*")
            warnings.filterwarnings("ignore", message=".*custom or non-Python base image.*")
            out = _ConsoleLog(log, sys.stdout, verbose)
            try:
                with contextlib.redirect_stdout(out), contextlib.redirect_stderr(out), _cache_hits(out):
                    kfp_subprocess.run_local_subprocess = lambda full_command, env_vars=None: layout.run(
                        runner, full_command, env_vars)
                    try:
                        func(**full)
                    finally:
                        kfp_subprocess.run_local_subprocess = original
                        write_report(layout)
            except RuntimeError as e:
                if "finished with status" not in str(e):
                    raise
                log.flush()
                raise task_failure(log_path.read_text(encoding="utf-8"), pipeline, log_path, str(e)) from None
        wall = time.perf_counter() - t0
        stages["pipeline"] = wall
        stages.update({f"task {name}": s for name, s in out.took.items()})
        run_dir = _latest_run_dir(root, func.name, before)
        tasks = {**cached_outputs(cache_root, out.cached), **read_task_outputs(run_dir)}
        result = LocalRun(pipeline, run_dir, wall, tasks, dict(services_env), full,
                          services_kept=svc is None or keep_services or not started, log_path=log_path,
                          stages=stages)
        result.pod_report = layout.report if pod_faithful else None
        if launcher is not None:
            result.task_processes = {k: v - counted.get(k, 0) for k, v in launcher.runs.items()}
        result.mlflow_url = _mlflow_url(services_env.get("MLFLOW_TRACKING_URI", ""), result.mlflow_run_id)
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


def _run_env(home: Path, environ, warm: bool) -> dict:
    """What a local run adds to the tasks' environment (on top of the services'): the model/weights cache
    under <home> unless one is set, MLflow's telemetry off, and for warm runs torchrun workers forked from
    their preloaded launcher (chunkgrpo.torchrun_local, unless the variable is set already)."""
    from chunkgrpo.torchrun_local import ENV_FORK

    env = {"CHUNKGRPO_CACHE": environ.get("CHUNKGRPO_CACHE", str(home / "cache")),
           "MLFLOW_DISABLE_TELEMETRY": "true"}
    if warm:
        env[ENV_FORK] = environ.get(ENV_FORK, "1")
    return env


def _prestart(pipeline: str, func, home: Path, keep: bool = False):
    """The warm task servers (pipeline/warm.py) for the environments the tasks will have (the services'
    variables aside, which no import reads), started now so that their imports run while the services
    start and the model is prepared. A kept server (below) comes first."""
    from pipeline import warm as warm_tasks
    from pipeline.pod_faithful import layout_for

    launcher = warm_tasks.launcher()
    (home / "logs").mkdir(parents=True, exist_ok=True)
    launcher.log = home / "logs" / "warm-servers.log"
    layout = layout_for(pipeline, func, home, faithful=False, model_dir=None)
    base = {**os.environ, **_run_env(home, os.environ, True)}
    envs = [{**base, **layout.env(fn, layout.task_dirs(fn))} for fn in layout.specs]
    _kept_servers(launcher, home / "local", envs, keep)
    launcher.prestart(envs)
    return launcher


KEPT = "tasks"  # the kept task servers' names in <home>/local/state.json: tasks-1, tasks-2 (`local status`)


def _kept_servers(launcher, local_home: Path, envs: list[dict], keep: bool) -> None:
    """Servers started once: the task servers recorded under `local_home` by an earlier `--keep-services`
    run are used when they answer and their code is what this run would import (`warm.stale`); else they
    are stopped. `keep` (`--keep-services`): each of this run's task environments (`envs`: the tasks
    without volumes, the /cache-volume tasks) that no kept server covers gets one, started in a session of
    its own and recorded there, so that the next run forks its tasks without waiting for imports; a kept
    server covering none of them (started from another environment) is replaced. `chunkgrpo local down`
    stops them with the services."""
    from chunkgrpo.local_processes import CHILDREN
    from chunkgrpo.local_services import SERVICES, LocalServices, LocalServicesConfig
    from pipeline import warm as warm_tasks

    svc = LocalServices(LocalServicesConfig(home=str(local_home)))
    states = svc.status()
    usable = {}  # name -> attached server
    for name, st in states.items():
        if name in SERVICES or not name.startswith(KEPT):
            continue
        rec = svc.record(name)
        why, server = "", None
        if st.state != "running":
            why = "its process is gone"
        else:
            server = launcher.attach(rec["socket"])
            if server is None or not server.ready():
                why = f"its socket {rec['socket']} does not answer"
            else:
                why = warm_tasks.stale(server.info)
        if keep and not why and not any(not warm_tasks.match(server.info, env) for env in envs):
            why = "it was started from another environment"
        if not why:
            usable[name] = server
            continue
        if server is not None:
            launcher._drop(server)
        print(f"chunkgrpo warm tasks: the kept task server {name} (pid {rec['pid']}) is not used ({why}); "
              "stopping it", flush=True)
        svc.stop(name)
    if usable:
        print("chunkgrpo warm tasks: tasks fork from the kept task server(s) "
              + ", ".join(f"{n} (pid {svc.record(n)['pid']})" for n in sorted(usable)), flush=True)
    if not keep:
        return
    local_home.mkdir(parents=True, exist_ok=True)
    os.chmod(local_home, 0o700)
    started: list[dict] = []
    for env in envs:
        if any(not warm_tasks.match(s.info, env) for s in usable.values()) or any(e == env for e in started):
            continue
        name = next(f"{KEPT}-{i}" for i in range(1, 100) if f"{KEPT}-{i}" not in usable
                    and svc.record(f"{KEPT}-{i}") is None)
        rec = warm_tasks.start_kept(local_home, name, env, launcher.log)
        adopted = None
        try:
            adopted = svc.adopt(name, rec)
        finally:
            if not adopted:  # failed, or another run in this home took the name meanwhile: not kept
                proc = CHILDREN.pop(rec["pid"])
                proc.kill()
                proc.wait()
        if adopted is False:
            print(f"chunkgrpo warm tasks: another run keeps {name} now; this run's tasks use their own "
                  "servers", flush=True)
            continue
        launcher.attach(rec["socket"], env, proc=CHILDREN.get(rec["pid"]))
        started.append(env)


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


def stage_lines(stages: dict) -> list[str]:
    """The per-stage time breakdown of a local run (seconds, with the share of the total)."""
    total = stages.get("total") or sum(v for k, v in stages.items() if k in ("services", "model", "pipeline"))
    if not total:
        return []
    out = ["  time breakdown   (where the wall time went)"]
    for name, s in stages.items():
        if name == "total":
            continue
        indent = "      " if name.startswith("task ") else "    "
        out.append(f"{indent}{name:<24} {s:7.1f} s  {100 * s / total:5.1f} %")
    out.append(f"    {'total':<24} {total:7.1f} s")
    return out


def _mlflow_url(tracking_uri: str, run_id: str) -> str:
    if not (tracking_uri and run_id):
        return ""
    try:
        from mlflow import MlflowClient

        exp = MlflowClient(tracking_uri).get_run(run_id).info.experiment_id
        return f"{tracking_uri}/#/experiments/{exp}/runs/{run_id}"
    except Exception:
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
    if r.log_path is not None:
        lines.append(f"  full log         {_rel(str(r.log_path))}")
    run_id = r.mlflow_run_id
    if run_id:
        lines.append(f"  MLflow run       {run_id}  {r.mlflow_url}")
    cached = lambda task: "; cached: an earlier run's output" if t[task].get("cached") else ""  # noqa: E731
    if "profile" in t:
        lines.append(f"  profile          {_rel(art('profile', 'profile_json')['uri'])}  (+ plot.png: "
                     f"{_rel(art('profile', 'plot')['uri'])}{cached('profile')})")
    if "plan" in t:
        lines.append(f"  plan             {par('plan', 'Output')}  {_rel(art('plan', 'plan_json')['uri'])}  "
                     f"(Markdown: {_rel(art('plan', 'report')['uri'])}{cached('plan')})")
    if "train" in t:
        m = art("train", "trained_model")
        lines.append(f"  trained model    {m['metadata'].get('uri', '?')}  (manifest sha256 "
                     f"{str(m['metadata'].get('manifest_sha256', ''))[:12]}..)")
        lines.append(f"    pointer        {_rel(m['uri'])}")
        met = art("train", "metrics")["metadata"]
        lines.append("    metrics        " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(met.items())))
    if "evaluate" in t:
        res = art("evaluate", "results")
        lines.append(
            f"  evaluation       {res['metadata'].get('output_uri', '')}  (images, metrics.json, report.html)"
        )
        lines.append(f"    report (HTML)  {_rel(art('evaluate', 'report')['uri'])}")
        met = art("evaluate", "metrics")["metadata"]
        lines.append("    metrics        " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(met.items())
                                                       if k.rsplit(".", 1)[-1] in ("trained", "base")))
    if "register" in t:
        reg = art("register", "registered")["metadata"]
        lines.append(
            f"  registered       {reg.get('uri', '?')}"
            f"{' (existing version, same weights)' if reg.get('reused') else ''}"
            f"  source {reg.get('source', '')}"
        )
    if "check-gate" in t:
        passed = par("check-gate", "Output")
        lines.append(
            f"  promotion gate   {'passed' if passed else 'not passed'} ({r.params.get('gate_metric')}, "
            f"{r.params.get('gate_direction')} is better)"
        )
        if "promote" in t:
            lines.append(f"  promote          {par('promote', 'Output')}  -> "
                         f"models:/{r.params.get('model_name')}@champion")
        else:
            lines.append("  promote          skipped (gate not passed); champion unchanged")
    if "check-regression" in t:
        lines.append(f"  regression       {'REGRESSION' if par('check-regression', 'Output') else 'none'}  "
                     f"(summary: {_rel(art('check-regression', 'summary')['uri'])})")
    lines += stage_lines(r.stages)
    if r.task_processes:
        warm, cold = r.task_processes.get("warm", 0), r.task_processes.get("cold", 0)
        lines.append(f"  task processes   {warm} forked from a warm server (torch, mlflow imported once), "
                     f"{cold} fresh interpreter(s)")
    s3 = env.get("CHUNKGRPO_S3_ENDPOINT", "")
    state = "still running" if r.services_kept else "stopped"
    lines.append(
        f"  services         S3 {s3} (bucket {env.get('CHUNKGRPO_S3_BUCKET', '')}), "
        f"MLflow {mlflow}: {state}"
    )
    home = _rel(str(r.run_dir.parent.parent / "local"))
    if r.services_kept:
        lines.append(
            "                   browse MLflow at the URL above; stop them (and the kept task server) with "
            f"`chunkgrpo local down --home {home}`"
        )
    else:
        lines.append(
            f"                   data kept in {home}; browse it again with "
            f"`chunkgrpo local up --home {home}` "
            "(or rerun with --keep-services)"
        )
    return lines
