"""A pipeline function as kfp.local runs it locally: its tasks, their parameters, retries and caching,
kfp.local's task cache and the outputs the tasks wrote.

kfp.local's task cache is on, with each task's compiled caching setting (as on the cluster: profile and
plan are cached) or `--enable-caching true|false` for every task; its folder is named after a
fingerprint of the chunkgrpo code and of the local files the parameters name (`cache_fingerprint`), so a
rebuilt model or edited code never gets an earlier run's profile.
"""

import itertools
import json
from pathlib import Path


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


def latest_run_dir(root: Path, name: str, before: set) -> Path:
    dirs = [d for d in root.glob(f"{name}-*") if d.is_dir() and d not in before]
    if not dirs:
        raise RuntimeError(f"kfp.local wrote no run directory {name}-* under {root}")
    return max(dirs, key=lambda d: d.stat().st_mtime)


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
