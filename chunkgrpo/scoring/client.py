"""The parent side of the scorer boundary: run `chunkgrpo.scoring.worker` in a reward-package venv.

    proc = WorkerProcess("hpsv3", Path("/opt/venv-hpsv3"))
    proc.start()
    header, _ = proc.request({"op": "load", "spec": {...}}, timeout=1800)
    header, body = proc.request({"op": "score", ...}, pixels, timeout=600)
    proc.close()

Which venv: `$CHUNKGRPO_VENV_<NAME>` (HPSV2 for hpsv2 and hpsv2.1, IMAGEREWARD, HPSV3, and optionally
PICKSCORE / CLIP), or an explicit path. chunkgrpo is not installed in those venvs: the worker's files
(`STAGED_MODULES`: `scoring/worker.py`, `scoring/backends.py` and the small modules they use, which import
only the standard library, numpy, PIL, torch and the reward package) are copied into a private folder
that becomes the worker's only PYTHONPATH entry, so the worker always speaks the parent's protocol
version. `run_module` stages one more such one-file module when it runs it (e.g. the random-weight model
builders `chunkgrpo.testing.tiny_scorers`). The worker's stderr (everything the packages print) goes to a
log file whose tail is quoted in errors. Timeouts are enforced on every read and write; a worker that
dies is reported with its exit status instead of hanging the caller.
"""

from __future__ import annotations

import atexit
import hashlib
import json
import os
import select
import shutil
import signal
import subprocess
import tempfile
import time
import weakref
from pathlib import Path

from chunkgrpo import threads
from chunkgrpo.errors import UserError
from chunkgrpo.scoring import worker as W

VENV_VARS = {"hpsv2": "CHUNKGRPO_VENV_HPSV2", "hpsv2.1": "CHUNKGRPO_VENV_HPSV2",
             "imagereward": "CHUNKGRPO_VENV_IMAGEREWARD", "hpsv3": "CHUNKGRPO_VENV_HPSV3",
             "pickscore": "CHUNKGRPO_VENV_PICKSCORE", "clip": "CHUNKGRPO_VENV_CLIP"}
# the worker's modules, staged into the reward venvs (they import only stdlib, numpy, PIL, torch and the
# reward packages)
STAGED_MODULES = ("chunkgrpo.scoring.worker", "chunkgrpo.scoring.backends", "chunkgrpo.scoring.hub_cache",
                  "chunkgrpo.gpu", "chunkgrpo.errors")
# set by torchrun / torch.distributed: a worker must never join the trainer's process group
_DIST_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
              "ROLE_RANK", "ROLE_WORLD_SIZE", "ROLE_NAME", "MASTER_ADDR", "MASTER_PORT")


class ScorerWorkerError(RuntimeError):
    """The worker crashed, timed out, or failed inside the package (not a configuration problem)."""


class WorkerCrashed(ScorerWorkerError):
    """The worker process died (or was never running)."""


class WorkerTimedOut(ScorerWorkerError):
    """The worker did not answer in time and was stopped."""


class _Crashed(Exception):
    pass


class _TimedOut(Exception):
    pass


def venv_var(name: str) -> str:
    return VENV_VARS.get(name, "CHUNKGRPO_VENV_" + "".join(c if c.isalnum() else "_" for c in name.upper()))


def venv_for(name: str, explicit: str | None = None) -> Path | None:
    """The venv that runs scorer `name`: `explicit` if given ("" = none, run in-process), else
    `$CHUNKGRPO_VENV_<NAME>`; None means in-process. The venv must have a python (UserError otherwise)."""
    var = venv_var(name)
    text = os.environ.get(var, "") if explicit is None else str(explicit)
    if not text.strip():
        return None
    venv = Path(text).expanduser()
    origin = f"{var}={text}" if explicit is None else f"venv={text}"
    if not venv.is_dir():
        raise UserError(
            f"scorer {name!r}: {origin} does not exist; build the reward venvs with "
            f"`bash scripts/reward-envs.sh` (or use the evaluation image), or unset {var} to score in-process"
        )
    if not venv_python(venv).is_file():
        raise UserError(f"scorer {name!r}: {origin} has no bin/python; it is not a virtual environment "
                        "(rebuild it with `bash scripts/reward-envs.sh`)")
    return venv.resolve()


def venv_python(venv: Path) -> Path:
    return Path(venv) / "bin" / "python"


def _module_file(module: str) -> Path:
    """The source file of a one-file chunkgrpo module, by dotted name (nothing is imported)."""
    parts = module.split(".")
    if parts[0] != "chunkgrpo" or len(parts) < 2:
        raise ValueError(f"{module!r} is not a chunkgrpo module")
    return _PACKAGE_ROOT.joinpath(*parts[1:]).with_suffix(".py")


_PACKAGE_ROOT = Path(__file__).resolve().parent.parent


def stage_modules(extra: tuple[str, ...] = ()) -> Path:
    """A private folder (this process's, in $TMPDIR, removed when it exits) holding the `STAGED_MODULES` and
    the one-file modules `extra` (dotted names) at their package paths (`chunkgrpo/scoring/worker.py`, ...;
    each package `__init__` empty); made once per process and content, and made again if it was altered."""
    modules = tuple(dict.fromkeys(STAGED_MODULES + tuple(extra)))
    blobs = {"/".join(m.split(".")) + ".py": _module_file(m).read_bytes() for m in modules}
    digest = hashlib.sha256(b"".join(rel.encode() + b"\0" + blob for rel, blob in blobs.items()))
    digest = digest.hexdigest()[:16]
    made = _STAGED.get(digest)
    if made is not None and made[0] == os.getpid() and _staged_ok(made[1], blobs):
        return made[1]
    tmp = Path(tempfile.mkdtemp(prefix=f"chunkgrpo-worker-{digest}."))
    for rel, blob in blobs.items():
        path = tmp / rel
        for pkg in _package_dirs(rel):
            (tmp / pkg).mkdir(exist_ok=True)
            init = tmp / pkg / "__init__.py"
            if not init.exists():
                init.write_text('"""Only the scorer worker is staged here (chunkgrpo.scoring.client)."""\n'
                                if pkg == "chunkgrpo" else "")
        path.write_bytes(blob)
    (tmp / ".complete").write_text(digest + "\n")
    _STAGED[digest] = (os.getpid(), tmp)
    return tmp


_STAGED: dict[str, tuple[int, Path]] = {}  # content digest -> (the process that made it, its folder)


def _remove_staged() -> None:
    """The folders this process staged (at exit, once its workers are stopped)."""
    for digest, (pid, path) in list(_STAGED.items()):
        if pid == os.getpid():
            shutil.rmtree(path, ignore_errors=True)
            del _STAGED[digest]


def _package_dirs(rel: str) -> list[str]:
    """"chunkgrpo/scoring/worker.py" -> ["chunkgrpo", "chunkgrpo/scoring"]."""
    parts = rel.split("/")[:-1]
    return ["/".join(parts[: i + 1]) for i in range(len(parts))]


def _staged_ok(root: Path, blobs: dict[str, bytes]) -> bool:
    try:
        dirs = [root] + [root / d for d in dict.fromkeys(p for rel in blobs for p in _package_dirs(rel))]
        for d in dirs:
            st = os.lstat(d)
            if st.st_uid != os.getuid() or st.st_mode & 0o022 or not os.path.isdir(d) or os.path.islink(d):
                return False
        if not (root / ".complete").is_file():
            return False
        return all((root / rel).read_bytes() == blob for rel, blob in blobs.items())
    except OSError:
        return False


def worker_env(extra: dict | None = None, modules: tuple[str, ...] = ()) -> dict:
    env = {
        k: v
        for k, v in os.environ.items()
        if k not in _DIST_VARS
        and not k.startswith("TORCHELASTIC_")
        and k not in ("PYTHONHOME", "VIRTUAL_ENV")
    }
    env.update(PYTHONPATH=str(stage_modules(modules)), PYTHONSAFEPATH="1", PYTHONNOUSERSITE="1",
               PYTHONUNBUFFERED="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1",
               TOKENIZERS_PARALLELISM=env.get("TOKENIZERS_PARALLELISM", "false"))
    threads.set_env_policy(env)  # the worker loads torch: its OpenMP threads wait as this process's do
    env[W.PARENT_ENV] = str(os.getpid())
    env.update(extra or {})
    return env


def run_module(venv: Path, module: str, args: list[str], *, timeout: float, env: dict | None = None) -> str:
    """Run `python -m MODULE ARGS` in `venv`, MODULE (a one-file chunkgrpo module, e.g.
    "chunkgrpo.testing.tiny_scorers") staged beside the worker's modules; stdout on success."""
    cmd = [str(venv_python(venv)), "-m", module, *args]
    try:
        res = subprocess.run(cmd, env=worker_env(env, (module,)), capture_output=True, text=True,
                             timeout=timeout)
    except subprocess.TimeoutExpired:
        raise ScorerWorkerError(f"{' '.join(cmd)} did not finish within {timeout:g}s") from None
    if res.returncode != 0:
        tail = " | ".join(res.stderr.strip().splitlines()[-6:])
        raise ScorerWorkerError(f"{' '.join(cmd)} failed (exit {res.returncode}): {tail}")
    return res.stdout


_LIVE: "weakref.WeakSet[WorkerProcess]" = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for proc in list(_LIVE):
        proc.close(timeout=2.0)
    _remove_staged()


class WorkerProcess:
    """One `python -m chunkgrpo.scoring.worker <name>` process in `venv`, spoken to over its stdin/stdout."""

    def __init__(self, name: str, venv: Path, *, env: dict | None = None) -> None:
        self.name = name
        self.venv = Path(venv)
        self.extra_env = dict(env or {})
        self.proc: subprocess.Popen | None = None
        self.log_path: Path | None = None
        self._log = None
        self._keep_log = False
        self.starts = 0

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc else None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def describe(self) -> str:
        return f"scorer {self.name!r} worker ({venv_python(self.venv)})"

    def start(self) -> None:
        self.close()
        fd, log = tempfile.mkstemp(prefix=f"chunkgrpo-{self.name}-worker-", suffix=".log")
        self.log_path, self._log = Path(log), os.fdopen(fd, "wb")
        self.proc = subprocess.Popen(
            [str(venv_python(self.venv)), "-m", "chunkgrpo.scoring.worker", self.name],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log, env=worker_env(self.extra_env),
            close_fds=True, start_new_session=True)
        os.set_blocking(self.proc.stdin.fileno(), False)
        self.starts += 1
        _LIVE.add(self)

    # ---- I/O with deadlines
    def _send(self, data: bytes, deadline: float) -> None:
        fd = self.proc.stdin.fileno()
        view = memoryview(data)
        while view:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _TimedOut()
            _, writable, _ = select.select([], [fd], [], min(left, 0.5))
            if not writable:
                if self.proc.poll() is not None:
                    raise _Crashed()
                continue
            try:
                n = os.write(fd, view[: 1 << 20])
            except BlockingIOError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                raise _Crashed() from None
            view = view[n:]

    def _recv(self, n: int, deadline: float) -> bytes:
        fd = self.proc.stdout.fileno()
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise _TimedOut()
            readable, _, _ = select.select([fd], [], [], min(left, 0.5))
            if not readable:
                continue
            chunk = os.read(fd, min(n - len(buf), 1 << 20))
            if not chunk:
                raise _Crashed()
            buf += chunk
        return bytes(buf)

    def request(self, header: dict, payload: bytes = b"", *, timeout: float) -> tuple[dict, bytes]:
        """Send one request, wait for its reply. ScorerWorkerError on crash or timeout (the worker is then
        stopped); UserError / ScorerWorkerError for an error reply (the worker stays up)."""
        if not self.alive:
            raise self._crash_error("is not running")
        deadline = time.monotonic() + timeout
        try:
            self._send(W.encode_frame(header, payload), deadline)
            nh, nb = W._FRAME.unpack(self._recv(W._FRAME.size, deadline))
            reply = json.loads(self._recv(nh, deadline))
            body = self._recv(nb, deadline) if nb else b""
        except _TimedOut:
            self.kill()
            raise WorkerTimedOut(
                f"{self.describe()} did not answer {header.get('op')!r} within {timeout:g}s and was stopped "
                f"(raise the scorer's timeout if the model is just slow); log: {self.log_path}{self._tail()}"
            ) from None
        except _Crashed:
            raise self._crash_error(f"died during {header.get('op')!r}") from None
        except BaseException:  # interrupted mid-request: a late reply would desynchronise the pipe
            self.kill()
            raise
        if reply.get("op") == "error":
            msg = reply.get("message", "unknown error")
            if reply.get("kind") == "user":
                raise UserError(msg)
            self._keep_log = True
            raise ScorerWorkerError(f"{self.describe()} failed: {msg}; log: {self.log_path}")
        return reply, body

    def _tail(self, lines: int = 3) -> str:
        self._keep_log = True  # an error message points at it
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines() if self.log_path else []
        except OSError:
            text = []
        return ("; last output: " + " | ".join(t.strip() for t in text[-lines:])) if text else ""

    def _crash_error(self, what: str) -> WorkerCrashed:
        code = None
        if self.proc is not None:
            try:
                code = self.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self.kill()
                code = self.proc.returncode
        status = (
            "" if code is None else f" (killed by signal {-code})" if code < 0 else f" (exit code {code})"
        )
        return WorkerCrashed(f"{self.describe()} {what}{status}; log: {self.log_path}{self._tail()}")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                self.proc.kill()
            self.proc.wait()

    def close(self, timeout: float = 5.0) -> None:
        """Ask the worker to exit, kill it after `timeout`, and release the pipes and log file."""
        proc = self.proc
        if proc is not None:
            if proc.poll() is None:
                try:
                    self._send(W.encode_frame({"op": "exit"}), time.monotonic() + 1.0)
                except (_Crashed, _TimedOut, OSError, ValueError):
                    pass
                try:
                    proc.wait(timeout=timeout)
                except subprocess.TimeoutExpired:
                    self.kill()
            for stream in (proc.stdin, proc.stdout):
                try:
                    stream.close()
                except OSError:
                    pass
        if self._log is not None:
            self._log.close()
            self._log = None
            if not self._keep_log and self.log_path is not None:
                self.log_path.unlink(missing_ok=True)
        self.proc = None
        _LIVE.discard(self)

    def __del__(self) -> None:  # pragma: no cover - best effort at garbage collection
        try:
            self.close(timeout=1.0)
        except Exception:
            pass


def check(
    name: str, venv: Path, *, timeout: float = 300.0, env: dict | None = None
) -> tuple[list[str], dict]:
    """Run the worker's package check for `name` in `venv`: (problems, runtime info). Loads no weights."""
    proc = WorkerProcess(name, venv, env=env)
    try:
        proc.start()
        reply, _ = proc.request({"op": "check"}, timeout=timeout)
        return list(reply.get("problems") or []), dict(reply.get("runtime") or {})
    finally:
        proc.close()


__all__ = [
    "WorkerProcess",
    "ScorerWorkerError",
    "WorkerCrashed",
    "WorkerTimedOut",
    "venv_for",
    "venv_var",
    "venv_python",
    "stage_modules",
    "check",
    "run_module",
    "worker_env",
]
