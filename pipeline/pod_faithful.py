"""Local tasks that run as their pods would: the compiled env, the pod's volumes, an audit of every write.

kfp.local passes a task's compiled container env to its subprocess but ignores the platform spec, so
`/cache/...` paths (components/k8s.py `STEP_ENV`) would point at the local root filesystem. Every local
run therefore maps each pod volume's mount path to a local folder (`Layout`):

* plain `--local`: one shared folder per volume under `<home>/pod-volumes/` (a cache kept between
  tasks and runs, like a PVC), written into each task's env in the pipeline's compiled spec, from which
  kfp.local reads it (`map_volumes`);
* `--pod-faithful` (`run_local(pod_faithful=True)`): each task gets fresh, empty folders (an emptyDir
  starts empty), `/tmp` and `$HOME` (the container's writable layer) map to `<task>/tmp`, the env is
  exactly the compiled one (host-only variables such as CHUNKGRPO_CACHE, TMPDIR, HF_HOME, XDG_* are
  dropped, so an unset variable falls back to `$HOME` as in the pod), no bytecode is written
  (read-only code), and a Python audit hook (`sys.addaudithook`, installed through `sitecustomize`
  in every Python process of the task, torchrun ranks included) records every path opened for
  writing, created, renamed or copied outside the allowed folders. After the task:

      used(volume) <= sizeLimit(volume) * r      for every emptyDir of the pod (not memory-backed)
      used(/tmp + $HOME) <= CONTAINER_LAYER * r
      no audited write outside the volumes, /tmp, the KFP pipeline root, /dev and /proc

  with r = bytes of the local model / bytes of FLUX.1-dev (`FLUX_DEV_BYTES`): the limits are those
  of the production pool (`SIZE_POOL`, h100) scaled to the model the demo runs, with a floor of
  `MIN_LIMIT` for the model-independent bits (logs, MLflow, prompt files) and, for register, the served
  code it packages into the registered model. A breach fails the task
  with one line naming the path and its bytes (`chunkgrpo pod-faithful: error: ...`).

  kfp.local has no public hook around a task's process, and a pod-faithful task needs one: fresh folders
  per task, an env without the host's variables (kfp.local adds the compiled env to its own process's),
  and the audit once the process has ended. `tasks_as_pods` therefore replaces the one function kfp.local's
  SubprocessRunner starts every task with (`subprocess_task_handler.run_local_subprocess(full_command,
  env_vars)`) by `Layout.run` for the duration of the run, and puts it back afterwards; a plain run
  leaves kfp.local as it is.

Limits: without root there is no private mount namespace, so the check is an audit, not an
enforcement; writes from native code that bypass Python's `open`/`os` (e.g. safetensors' Rust
writer) are seen only through the volume sizes. A volume's size is its largest of: its size when the
task ends, and its size just before each Python `shutil.rmtree` in it or `os.remove` of a file of 1 MiB
or more (`TemporaryDirectory` cleanup included), measured by the audit hook; so a model downloaded
into a temporary folder and deleted before the end is seen. A peak removed by native code is not.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path

# diffusers FLUX.1-dev as synced to S3: transformer 11.90e9 params bf16 (23.8 GB) + T5-XXL encoder
# 4.76e9 bf16 (9.52 GB) + CLIP-L (0.25 GB) + VAE (0.17 GB) + tokenizers/configs.
FLUX_DEV_BYTES = 33_740_000_000
CONTAINER_LAYER = 10 * 2**30   # /tmp and $HOME of a KFP step (= the training runtime's /tmp emptyDir)
MIN_LIMIT = 256 * 2**10        # floor of every scaled limit: logs, MLflow client files, prompt files
SIZE_POOL = "h100"             # the pool whose compiled volume sizes are scaled
TMP = "/tmp"
HOST_ONLY = ("HOME", "TMPDIR", "TMP", "TEMP", "CHUNKGRPO_CACHE", "HF_HOME",
             "TORCH_HOME", "XDG_CACHE_HOME", "XDG_CONFIG_HOME", "XDG_DATA_HOME", "TRITON_CACHE_DIR",
             "TORCHINDUCTOR_CACHE_DIR", "MPLCONFIGDIR", "PYTHONPYCACHEPREFIX")
_LOCK = threading.Lock()
_UNITS = {"Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
          "K": 1e3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12}

HOOK = '''"""chunkgrpo pod-faithful audit hook (written by pipeline/pod_faithful.py)."""
import os
import sys


def _install():
    log = os.environ.get("CHUNKGRPO_AUDIT_LOG")
    if not log:
        return
    allowed = os.environ.get("CHUNKGRPO_AUDIT_ALLOW", "").split(os.pathsep)
    roots = [p.rstrip(os.sep) for p in os.environ.get("CHUNKGRPO_AUDIT_ROOTS", "").split(os.pathsep) if p]
    peaks = os.environ.get("CHUNKGRPO_AUDIT_PEAKS", "")
    allow = tuple(p.rstrip(os.sep) + os.sep for p in allowed if p)
    seen = set()
    writing = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def record(path):
        if path is None or isinstance(path, int):
            return
        try:
            p = os.path.abspath(os.fsdecode(path))
        except Exception:
            return
        if p in seen or (p + os.sep).startswith(allow):
            return
        seen.add(p)
        with open(log, "a") as f:
            f.write(p + "\\n")

    def measure(root):
        total, inodes = 0, set()
        for top, _dirs, files in os.walk(root):
            for f in files:
                try:
                    st = os.lstat(os.path.join(top, f))
                except OSError:
                    continue
                if (st.st_dev, st.st_ino) not in inodes:  # a hard link takes no second copy of the bytes
                    inodes.add((st.st_dev, st.st_ino))
                    total += st.st_size
        return total

    def before_delete(path):
        # a folder's bytes just before something in it is deleted: the peak a pod's volume must hold
        try:
            p = os.path.abspath(os.fsdecode(path))
        except Exception:
            return
        for root in roots:
            if (p + os.sep).startswith(root + os.sep) and peaks:
                with open(peaks, "a") as f:
                    f.write(root + "\\t" + str(measure(root)) + "\\n")

    def hook(event, args):
        if event == "shutil.rmtree":
            before_delete(args[0])
        elif event == "os.remove" and not isinstance(args[0], int):
            try:
                big = os.lstat(args[0]).st_size >= 1 << 20
            except OSError:
                big = False
            if big:
                before_delete(args[0])
        elif event == "open":
            path, mode, flags = (list(args) + [None, None, 0])[:3]
            by_mode = isinstance(mode, str) and any(c in mode for c in "wax+")
            if by_mode or (mode is None and (flags or 0) & writing):
                record(path)
        elif event in ("os.mkdir", "os.symlink", "os.link"):
            record(args[0] if event == "os.mkdir" else args[1])
        elif event in ("os.rename", "shutil.copyfile", "shutil.copymode", "shutil.move"):
            record(args[1])

    sys.addaudithook(hook)


_install()
'''


def quantity(text: str) -> int:
    """A Kubernetes quantity (`10Gi`, `800G`) in bytes."""
    m = re.fullmatch(r"([0-9.]+)([A-Za-z]*)", str(text).strip())
    if not m or (m.group(2) and m.group(2) not in _UNITS):
        raise ValueError(f"bad quantity {text!r}")
    return int(float(m.group(1)) * _UNITS.get(m.group(2), 1))


@dataclasses.dataclass
class PodSpec:
    """What a task's pod declares: its container env and its emptyDir volumes (mount path -> sizeLimit
    bytes, 0 = none; memory-backed ones are not disk and are left out)."""

    env: dict[str, str]
    volumes: dict[str, int]
    image: str = ""  # the container image (pipeline/image_faithful.py runs the task in its environment)


def pod_specs(func) -> dict[str, PodSpec]:
    """{component function name: PodSpec} from a pipeline function's compiled IR and platform spec."""
    from google.protobuf import json_format

    spec = json_format.MessageToDict(func.pipeline_spec)
    platform = json_format.MessageToDict(func.platform_spec) if getattr(func, "platform_spec", None) else {}
    k8s = platform.get("platforms", {}).get("kubernetes", {}).get("deploymentSpec", {}).get("executors", {})
    out: dict[str, PodSpec] = {}
    for name, ex in spec.get("deploymentSpec", {}).get("executors", {}).items():
        c = ex.get("container") or {}
        args = c.get("args") or []
        fn = args[args.index("--function_to_execute") + 1] if "--function_to_execute" in args else name
        mounts = k8s.get(name, {}).get("emptyDirMounts", [])
        vols = {m["mountPath"]: quantity(m.get("sizeLimit") or "0") for m in mounts
                if m.get("medium") != "Memory"}
        # the /cache PVC (components/cache_volume.py)
        vols.update({m["mountPath"]: quantity(m.get("size") or "0")
                     for m in k8s.get(name, {}).get("genericEphemeralVolume", [])})
        out.setdefault(fn, PodSpec({e["name"]: e.get("value", "") for e in c.get("env") or []}, vols,
                                   c.get("image", "")))
    return out


def function_of(full_command: list[str]) -> str:
    cmd = list(full_command)
    return cmd[cmd.index("--function_to_execute") + 1] if "--function_to_execute" in cmd else ""


def dir_bytes(path: Path) -> int:
    """Bytes of the files under `path`, each hard-linked file once (as the disk holds it)."""
    if path.is_file() or path.is_symlink():
        return path.lstat().st_size
    total, inodes = 0, set()
    for root, _dirs, files in os.walk(path):
        for f in files:
            try:
                st = os.lstat(os.path.join(root, f))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) not in inodes:
                inodes.add((st.st_dev, st.st_ino))
                total += st.st_size
    return total


def remap(value: str, mapping: dict[str, Path]) -> str:
    """`value` with a leading pod mount path replaced by its local folder (longest mount first)."""
    for mount in sorted(mapping, key=len, reverse=True):
        if value == mount or value.startswith(mount.rstrip("/") + "/"):
            return str(mapping[mount]) + value[len(mount.rstrip("/")):]
    return value


def _name(mount: str) -> str:
    return mount.strip("/").replace("/", "-") or "root"


@dataclasses.dataclass
class Layout:
    """Local folders standing in for the pods' volumes; `faithful` adds the env isolation and audit."""

    root: Path
    specs: dict[str, PodSpec]
    faithful: bool = False
    limits: dict[str, dict[str, int]] = dataclasses.field(default_factory=dict)  # fn -> mount -> bytes
    scale: float = 1.0
    allow: tuple[str, ...] = ()      # further allowed roots (the KFP pipeline root)
    failures: list[str] = dataclasses.field(default_factory=list)
    images: dict = dataclasses.field(default_factory=dict)  # fn -> ImageEnv (--image-faithful)
    ran_in: dict = dataclasses.field(default_factory=dict)  # fn -> "chunkgrpo-<image>: <its python>"
    report: list[dict] = dataclasses.field(default_factory=list)  # per task: used bytes per volume
    _n: int = 0

    def task_dirs(self, fn: str) -> dict[str, Path]:
        spec = self.specs.get(fn) or PodSpec({}, {})
        if not self.faithful:
            return {m: self.root / _name(m) for m in spec.volumes}
        with _LOCK:  # tasks may run concurrently
            self._n += 1
            base = self.root / f"{self._n:02d}-{fn}"
        if base.exists():
            shutil.rmtree(base)
        return {m: base / _name(m) for m in [*spec.volumes, TMP]}

    def env(self, fn: str, dirs: dict[str, Path], hook_dir: Path | None = None,
            log: Path | None = None) -> dict:
        spec = self.specs.get(fn) or PodSpec({}, {})
        for d in dirs.values():
            d.mkdir(parents=True, exist_ok=True)
        mapped = {k: remap(v, dirs) for k, v in spec.env.items()}
        if not self.faithful:  # the host's HOME: /tmp is no volume, and a plain run is not audited
            if "HOME" in mapped and "HOME" in os.environ:
                mapped["HOME"] = os.environ["HOME"]
            return mapped
        env = {k: v for k, v in os.environ.items() if k not in HOST_ONLY}
        env["HOME"] = str(dirs[TMP])  # the image's HOME=/tmp unless the step sets one
        env["TMPDIR"] = str(dirs[TMP])
        env.update(mapped)
        env["PYTHONDONTWRITEBYTECODE"] = "1"
        if hook_dir is not None and log is not None:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (str(hook_dir), env.get("PYTHONPATH", "")) if p)
            allowed = [*map(str, dirs.values()), *self.allow, str(log), str(hook_dir), "/dev", "/proc"]
            peaks = log.with_name("peaks.log")
            env["CHUNKGRPO_AUDIT_LOG"] = str(log)
            env["CHUNKGRPO_AUDIT_ALLOW"] = os.pathsep.join([*allowed, str(peaks)])
            env["CHUNKGRPO_AUDIT_ROOTS"] = os.pathsep.join(map(str, dirs.values()))
            env["CHUNKGRPO_AUDIT_PEAKS"] = str(peaks)
        return env

    def audit(self, fn: str, dirs: dict[str, Path], log: Path | None) -> list[str]:
        """Problems of one finished task, largest first: volumes over their scaled sizeLimit, /tmp+$HOME
        over the scaled container layer, writes outside every allowed folder (path and bytes)."""
        problems: list[tuple[int, str]] = []
        limits = self.limits.get(fn, {})
        peaks = _peaks(log.with_name("peaks.log")) if log is not None else {}
        used, peak = {}, {}
        for mount, d in dirs.items():
            n = dir_bytes(d)
            used[mount] = n
            peak[mount] = max(n, peaks.get(str(d), 0))
            limit = limits.get(mount, 0)
            what = "/tmp and $HOME (the container layer)" if mount == TMP else f"volume {mount}"
            if limit and peak[mount] > limit:
                at = (f"largest: {_largest(d)}" if n >= peak[mount] else
                      f"{peak[mount]} bytes just before a delete, {n} at the end")
                problems.append((peak[mount], f"task {fn} wrote {peak[mount]} bytes to {what} > {limit} "
                                 f"bytes (its limit scaled to the local model, r={self.scale:.3g}); {at}"))
        self.report.append({"task": fn, "used": used, "peak": peak, "limits": dict(limits)})
        if log is not None and log.exists():
            for p in dict.fromkeys(log.read_text().splitlines()):
                path = Path(p)
                if path.exists() and not path.is_dir():
                    n = dir_bytes(path)
                    problems.append((n, f"task {fn} wrote {p} ({n} bytes) outside its pod's volumes"))
                elif not path.exists() and not path.name.endswith((".lock", ".tmp", ".part")):
                    problems.append((0, f"task {fn} wrote {p} (0 bytes, since removed) outside its pod's "
                                        "volumes"))
        return [m for _, m in sorted(problems, key=lambda t: -t[0])]

    def run(self, original, full_command: list[str], env_vars: dict | None = None) -> int:
        """kfp.local's task subprocess (`original`) as its pod: fresh volume folders, the exact compiled
        env, the audit afterwards (a breach fails the task)."""
        fn = function_of(full_command)
        if fn not in self.specs:
            return original(full_command=full_command, env_vars=env_vars)
        dirs = self.task_dirs(fn)
        base = next(iter(dirs.values())).parent
        hook_dir = base / ".audit-hook"
        hook_dir.mkdir(parents=True, exist_ok=True)
        (hook_dir / "sitecustomize.py").write_text(HOOK)
        log = base / "audit.log"
        env = self.env(fn, dirs, hook_dir, log)
        image = self.images.get(fn)
        if image is not None:  # the interpreter and variables of the image the task's pod uses
            from pipeline.image_faithful import command_in

            full_command = command_in(image, full_command, sys.executable)
            env.update(image.variables(env))
        proc = subprocess.Popen(full_command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace")
        assert proc.stdout is not None
        tail: list[str] = []
        for line in proc.stdout:
            sys.stdout.write(line)
            tail = [*tail[-199:], line]
        rc = proc.wait()
        if image is not None:
            self.ran_in[fn] = f"chunkgrpo-{image.image}: {image.python}"
        if rc and image is not None:
            from pipeline.image_faithful import missing_line, missing_package

            if package := missing_package(tail):
                line = missing_line(fn, image, package)
                self.failures.append(line)
                print(line, flush=True)
                return rc
        problems = self.audit(fn, dirs, log)
        if problems:
            more = f" (+{len(problems) - 1} more, see {base})" if len(problems) > 1 else ""
            line = f"chunkgrpo pod-faithful: error: {problems[0]}{more}"
            self.failures.append(line)
            print(line, flush=True)
            return rc or 3
        return rc


def _peaks(path: Path) -> dict[str, int]:
    """{folder: largest bytes it held just before a delete in it} from the audit hook's peak log."""
    out: dict[str, int] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            root, _, n = line.rpartition("\t")
            if root and n.isdigit():
                out[root] = max(out.get(root, 0), int(n))
    return out


def _largest(d: Path) -> str:
    best, size = None, -1
    for root, _dirs, files in os.walk(d):
        for f in files:
            p = os.path.join(root, f)
            try:
                n = os.lstat(p).st_size
            except OSError:
                continue
            if n > size:
                best, size = p, n
    return f"{best} ({size} bytes)" if best else "(empty)"


def served_code_bytes() -> int:
    """Bytes of the code a registered version carries (`served_code_files`, as MLflow copies them into the
    model folder register builds in its /tmp): the same at any model size."""
    from chunkgrpo.registry.payload import served_code_files

    return sum(f.stat().st_size for f in served_code_files().values())


def scaled_limits(specs: dict[str, PodSpec], scale: float) -> dict[str, dict[str, int]]:
    """Per task: every volume's sizeLimit and the container layer, times `scale` (at least MIN_LIMIT);
    register's container layer also holds the served code it packages (`served_code_bytes`), which does
    not scale with the model."""
    out = {}
    for fn, spec in specs.items():
        lim = {m: max(MIN_LIMIT, int(b * scale)) for m, b in spec.volumes.items() if b}
        code = served_code_bytes() if fn == "register" else 0
        lim[TMP] = max(MIN_LIMIT, int(CONTAINER_LAYER * scale)) + code
        out[fn] = lim
    return out


def layout_for(pipeline: str, func, home: Path, *, faithful: bool, model_dir: Path | None,
               allow=(), image_faithful: bool = False) -> Layout:
    """The Layout of a local run. Faithful: sizes from the `SIZE_POOL` compile of the same pipeline,
    scaled by r = bytes(model_dir) / FLUX_DEV_BYTES. `image_faithful` (implies faithful): every task in
    the local environment of its pod's image (pipeline/image_faithful.py)."""
    specs = pod_specs(func)
    if not faithful:
        return Layout(home / "pod-volumes", specs)
    from pipeline.compile import pipeline_func

    sized, _ = pipeline_func(pipeline, pool=SIZE_POOL, trainer="torchrun")
    big = pod_specs(sized)
    for fn, spec in specs.items():  # local env (cpu pool) with the production pool's volume sizes
        if fn in big:
            spec.volumes = {m: big[fn].volumes.get(m, b) for m, b in spec.volumes.items()}
    scale = dir_bytes(model_dir) / FLUX_DEV_BYTES if model_dir is not None and model_dir.exists() else 1e-4
    pods = home / "pods"
    runs = pods / f"run-{os.getpid()}-{len(list(pods.glob('run-*'))) if pods.exists() else 0}"
    images = {}
    if image_faithful:
        from pipeline.image_faithful import envs_for

        images = envs_for({fn: spec.image for fn, spec in specs.items()})
    return Layout(runs, specs, faithful=True, limits=scaled_limits(specs, scale), scale=scale,
                  allow=tuple(str(a) for a in allow), images=images)


def map_volumes(func, layout: Layout) -> int:
    """Point every pod volume's mount path in the tasks' compiled env at its local folder (`layout`, a plain
    run's: one shared folder per volume, created here), in place in the pipeline function's compiled spec,
    whose executors are what kfp.local starts each task with. Returns how many env values changed."""
    changed = 0
    executors = func.pipeline_spec.deployment_spec["executors"]
    for label in executors.keys():
        container = executors[label]["container"]
        fn = function_of(list(container["args"]) if "args" in container else [])
        if fn not in layout.specs or "env" not in container:
            continue
        mapped = layout.env(fn, layout.task_dirs(fn))
        for item in container["env"]:
            value = mapped.get(item["name"])
            if value is not None and value != item["value"]:
                item["value"] = value
                changed += 1
    return changed


@contextlib.contextmanager
def tasks_as_pods(layout: Layout):
    """While open, kfp.local runs every task through `layout.run` (a pod-faithful layout; see the module
    docstring for why this is the one hook into kfp.local); afterwards the report is written."""
    from kfp.local import subprocess_task_handler as handler

    original = handler.run_local_subprocess
    handler.run_local_subprocess = lambda full_command, env_vars=None: layout.run(
        original, full_command, env_vars)
    try:
        yield layout
    finally:
        handler.run_local_subprocess = original
        write_report(layout)


def write_report(layout: Layout) -> Path | None:
    if not layout.faithful:
        return None
    layout.root.mkdir(parents=True, exist_ok=True)
    path = layout.root / "pod-faithful.json"
    body = {"scale": layout.scale, "tasks": layout.report, "failures": layout.failures}
    if layout.images:
        body["images"] = layout.ran_in
    path.write_text(json.dumps(body, indent=1))
    return path
