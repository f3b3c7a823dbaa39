"""Warm kfp.local tasks: each task's process forked from a server that has imported its libraries once.

    launcher = warm.launcher()            # one per process; its servers outlive a run (tests run many)
    launcher.prestart([env, ...])         # start the servers the coming tasks need, in the background
    launcher.run(full_command, env_vars)  # kfp.local's `run_local_subprocess` contract: output, exit code

Why: every kfp.local task is a new `python -m kfp.dsl.executor_main` that imports torch, mlflow, kfp and
(for the model tasks) diffusers and transformers before it does any work: 1.5 s for a task that only talks
to MLflow, 3-6 s for one that loads a model; on 2 cores a tiny-model pipeline spent about 40 of its 52 s
importing (`-X importtime`, ten tasks). A server (`python -m pipeline.warm`) imports them once
(`pipeline/warm_preload.py`), then forks one child per task. The child is the task's process: its own pid,
environment, working folder, stdin from /dev/null and stdout+stderr into a pipe the launcher streams like
kfp.local does; it writes the component's source to a fresh temporary folder and runs kfp's executor as the
task's `sh -ec` command would (`_KFP_RUNTIME=true python3 -m kfp.dsl.executor_main --component_module_path
...`), then exits as the interpreter would (non-daemon threads joined, atexit handlers run, the exit code of
`SystemExit`, 1 and the traceback for any other exception).

When a task runs warm (`match`): a server preloads under the environment of the first task it was started
for and records every variable its imports read (`warm_preload.IMPORT_ENV`, the value each import saw) plus,
compared by prefix, the variables native libraries read with getenv (`NATIVE_PREFIXES`) and those a module
keeps when it goes through the whole environment at import (`ITERATORS`: tqdm keeps `TQDM_*`, fsspec
`FSSPEC_*`, diffusers `COLAB_*`; an unknown such module makes the server take no task). A task is forked
from a server only when its environment has those same values, so its imported modules are the ones a fresh
interpreter would have built; otherwise a server is started for its environment (the pod-volume tasks, whose
cache variables differ, get their own). A command that is not a lightweight component's executor call, or a
launcher that cannot start a server (or whose server was killed before the task started), runs the task in a
fresh process (kfp.local's own runner): the same result, slower, and a line in the log saying why.
`--pod-faithful` runs never use it (each pod is a fresh process there), nor any system but Linux.

Not `multiprocessing`'s forkserver: it keeps one server per process with one preload list, and its
children run a pickled callable after re-importing the parent's `__main__`; tasks here need a server per
import environment and the executor's own command-line entry.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from pathlib import Path

from chunkgrpo.local_processes import child_stdio, run_as_main, signal_group

EXECUTOR = "kfp.dsl.executor_main"
# read by native code with getenv when it loads (OpenMP runtimes, MKL/OpenBLAS, ATen's CPU dispatch, the
# allocator, the interpreter), where the recording of os.environ cannot see it: compared by prefix
NATIVE_PREFIXES = ("OMP_", "GOMP_", "KMP_", "MKL_", "OPENBLAS_", "ATEN_", "TORCH_", "PYTORCH_", "LD_",
                   "MALLOC_", "PYTHON", "CHUNKGRPO_THREAD")
# read at import but not deciding what an import builds: pytest's per-test marker (mlflow's telemetry
# opt-out reads it; run_local turns telemetry off with MLFLOW_DISABLE_TELEMETRY) and the shell's
# last-command variable and folders (the task's folder is set with chdir)
IGNORED = frozenset({"PYTEST_CURRENT_TEST", "_", "PWD", "OLDPWD"})
MAX_SERVERS = 3
READY_TIMEOUT_S = 300.0  # a server's imports on a loaded 2-core machine (about 9 s idle)


# ---- what the server's imports read -------------------------------------------------------------------
# modules that iterate over the whole environment while they are imported, and what they take from it:
# the prefix of the variables it keeps, which the launcher then compares like the native ones. Any other
# module doing so makes the server refuse every task (they run cold).
ITERATORS = {
    "tqdm.utils": "TQDM_",  # envwrap: the TQDM_* defaults of its progress bars
    "diffusers.utils.import_utils": "COLAB_",  # "running in Colab?"
    "fsspec.config": "FSSPEC_",  # set_conf_env: fsspec's configuration from FSSPEC_* variables
}


_ABC = ("_collections_abc", "collections.abc")  # the module's __name__ is the latter


def _outside(frame):
    """The first frame that is not this module, os (getenv, copy) or the Mapping mixins."""
    skip = {__name__, "os", *_ABC}
    while frame is not None and frame.f_globals.get("__name__") in skip:
        frame = frame.f_back
    return frame


def _caller_module(frame) -> str:
    frame = _outside(frame)
    return frame.f_globals.get("__name__", "?") if frame is not None else "?"


class _Recording(os._Environ):
    """os.environ that remembers the value (None = unset) of every name at its first read through it, and
    which modules went through all of it: `for k in environ`, items(), values(), and the copies dict(),
    {**environ} and environ.copy() make (their reads of every name are not single reads)."""

    def __init__(self, environ, seen: dict, iterated: set):
        super().__init__(environ._data, environ.encodekey, environ.decodekey, environ.encodevalue,
                         environ.decodevalue)
        self._seen, self._iterated = seen, iterated
        self._copy: list = [None, 0]  # the frame copying the mapping (via keys()), reads left to it

    def _note(self, key):
        name = key.decode() if isinstance(key, bytes) else key
        if name not in self._seen:
            try:
                self._seen[name] = super().__getitem__(key)
            except KeyError:
                self._seen[name] = None

    def __getitem__(self, key):
        caller = sys._getframe(1)
        if caller.f_globals.get("__name__") in _ABC and caller.f_code.co_name == "__iter__":
            pass  # a step of items() / values()
        elif self._copy[1] > 0 and _outside(caller) is self._copy[0]:
            self._copy[1] -= 1  # dict(environ) reading every name after keys()
        else:
            self._note(key)
        return super().__getitem__(key)

    def __contains__(self, key):
        self._note(key)
        return super().__contains__(key)

    def __iter__(self):
        self._iterated.add(_caller_module(sys._getframe(1)))
        return super().__iter__()

    def keys(self):
        frame = _outside(sys._getframe(1))
        self._copy = [frame, len(self._data)]
        return super().keys()


def record_imports(modules) -> tuple[dict, list]:
    """Import `modules` (with `_KFP_RUNTIME=true`, as the task's command sets it: kfp then skips its
    client); returns (name -> value at its first read, None = unset; the modules that iterated over the
    whole environment)."""
    import importlib

    os.environ["_KFP_RUNTIME"] = "true"
    seen: dict = {}
    iterated: set = set()
    real = os.environ
    os.environ = _Recording(real, seen, iterated)
    try:
        for name in modules:
            importlib.import_module(name)
    finally:
        os.environ = real
    return dict(sorted(seen.items())), sorted(iterated)


# ---- the wire: length-prefixed JSON, a file descriptor riding on a request -----------------------------
def _send(sock: socket.socket, msg: dict, fds: list[int] | None = None) -> None:
    data = json.dumps(msg).encode()
    head = struct.pack("!Q", len(data))
    if fds:
        socket.send_fds(sock, [head], fds)
    else:
        sock.sendall(head)
    sock.sendall(data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise EOFError("warm task server closed the connection")
        buf += chunk
    return buf


def _recv(sock: socket.socket, with_fd: bool = False) -> tuple[dict, list[int]]:
    if with_fd:
        head, fds, _flags, _addr = socket.recv_fds(sock, 8, 1)
        if not head:
            raise EOFError("warm task server connection closed")
        head += _recv_exact(sock, 8 - len(head))
    else:
        head, fds = _recv_exact(sock, 8), []
    (n,) = struct.unpack("!Q", head)
    return json.loads(_recv_exact(sock, n)), list(fds)


# ---- what a task command is -----------------------------------------------------------------------------
def executor_task(full_command: list[str]) -> tuple[str, list[str]] | None:
    """(component source, executor arguments) of a lightweight component's command as kfp.local runs it
    (`sh -ec <script> <source> --executor_input ... --function_to_execute ...`), else None."""
    if len(full_command) < 4 or full_command[0] != "sh" or full_command[1] != "-ec":
        return None
    script = full_command[2]
    if f"-m {EXECUTOR}" not in script or "ephemeral_component.py" not in script:
        return None
    return full_command[3], list(full_command[4:])


def by_prefix(env: dict, prefixes) -> dict:
    return {k: v for k, v in env.items() if k.startswith(tuple(prefixes))}


def match(info: dict, env: dict) -> str:
    """'' when a task with environment `env` may run on the server that reported `info` (what its imports
    read: `import_env`; the variables compared by prefix: `prefixes`, with their values `by_prefix`);
    else the first variable that differs, or why the server takes no task."""
    if info.get("unknown_iterators"):
        return "the environment, iterated at import by " + ", ".join(info["unknown_iterators"])
    env = {**env, "_KFP_RUNTIME": "true"}  # the task's command sets it before python starts
    for k, v in info["import_env"].items():
        if k not in IGNORED and env.get(k) != v:
            return k
    mine, theirs = by_prefix(env, info["prefixes"]), info["by_prefix"]
    for k in sorted(set(mine) | set(theirs)):
        if mine.get(k) != theirs.get(k):
            return k
    return ""


# ---- the server (`python -m pipeline.warm <fd>`) and its children -----------------------------------
def _preload(kept: bool = False) -> tuple[dict, dict]:
    """Import `warm_preload`; (the info a launcher matches tasks against, the variables the imports set).
    `kept`: the info also lists the loaded files (`stale` checks them), which only a kept server needs."""
    before = dict(os.environ)
    from pipeline import warm_preload

    after = dict(os.environ)
    set_by_import = {k: after.get(k) for k in set(before) | set(after) if before.get(k) != after.get(k)}
    prefixes = [*NATIVE_PREFIXES, *(ITERATORS[m] for m in warm_preload.ITERATED if m in ITERATORS)]
    info = {"import_env": warm_preload.IMPORT_ENV, "set_by_import": set_by_import, "prefixes": prefixes,
            "by_prefix": by_prefix(before, prefixes), "pid": os.getpid(),
            "unknown_iterators": [m for m in warm_preload.ITERATED if m not in ITERATORS],
            "executable": sys.executable, "sources": loaded_sources() if kept else {}}
    return info, set_by_import


def loaded_sources() -> dict[str, list[int]]:
    """Every loaded module's file -> [mtime_ns, size]: what a kept server's code was built from."""
    out = {}
    for mod in list(sys.modules.values()):
        f = getattr(mod, "__file__", None)
        if f and f not in out:
            try:
                st = os.stat(f)
            except OSError:
                continue
            out[f] = [st.st_mtime_ns, st.st_size]
    return out


def stale(info: dict) -> str:
    """'' when a kept server's imports are what this interpreter would import now; else what changed (another
    Python, a source file edited, upgraded or removed since the server loaded it)."""
    if info.get("executable") != sys.executable:
        return f"it runs {info.get('executable')}, not {sys.executable}"
    for f, (mtime, size) in info.get("sources", {}).items():
        try:
            st = os.stat(f)
        except OSError:
            return f"{f} is gone"
        if (st.st_mtime_ns, st.st_size) != (mtime, size):
            return f"{f} changed"
    return ""


def serve(fd: int) -> None:
    """Preload, report what the imports read, then fork one child per request until the launcher hangs
    up. One task at a time: the reply to a request is the child's pid, then its exit code."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is for the tasks and the launcher
    sock = socket.socket(fileno=fd)
    info, set_by_import = _preload()
    _serve_connection(sock, info, set_by_import)


def serve_kept(path: str) -> None:
    """A kept server (`--keep-services`): listens on the Unix socket `path` (mode 0600) and serves each
    connecting launcher like `serve`, from a forked handler of its own, until `chunkgrpo local down`
    (SIGTERM to its process group: the handlers stop their running tasks, then exit)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old = os.umask(0o177)
    try:
        listener.bind(path)  # before the imports: a launcher connects at once and waits for the info
    finally:
        os.umask(old)
    listener.listen(8)
    info, set_by_import = _preload(kept=True)
    listener.settimeout(5.0)  # to reap the handlers that ended
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            conn = None
        _reap_children()
        if conn is None:
            continue
        pid = os.fork()
        if pid == 0:
            listener.close()
            conn.settimeout(None)
            try:
                _serve_connection(conn, {**info, "pid": os.getpid()}, set_by_import, kept=True)
            except _Terminate:  # between two tasks: nothing to stop
                pass
            finally:
                os._exit(0)
        conn.close()


def _reap_children() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _serve_connection(sock: socket.socket, info: dict, set_by_import: dict, kept: bool = False) -> None:
    """Send `info`, then fork one child per request until the launcher hangs up. `kept`: each task is a
    process group of its own, stopped (SIGTERM, then SIGKILL) when the launcher hangs up mid-task (it was
    interrupted or killed) or this handler gets SIGTERM: a kept server's tasks are not the launcher's
    descendants, so nothing else would stop them."""
    if kept:
        signal.signal(signal.SIGTERM, _terminated)
    try:
        _send(sock, info)
    except OSError:  # the launcher is gone
        return
    while True:
        try:
            req, fds = _recv(sock, with_fd=True)
        except (EOFError, ConnectionError):
            return
        pid = os.fork()
        if pid == 0:
            sock.close()
            if kept:
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os.setpgid(0, 0)
            _child(req, fds[0], set_by_import)  # never returns
        if kept:
            with contextlib.suppress(OSError):  # both sides set it: no window where the group is missing
                os.setpgid(pid, pid)
        for f in fds:
            os.close(f)
        try:
            _send(sock, {"pid": pid})
            status = _wait_task(pid, sock) if kept else os.waitpid(pid, 0)[1]
            if status is None:  # the launcher hung up: the task was stopped
                return
            _send(sock, {"exit": os.waitstatus_to_exitcode(status)})
        except OSError:  # the launcher is gone (its task, if still running, is no longer ours to wait for)
            if kept:
                _stop_task(pid)
            return


class _Terminate(Exception):
    pass


def _terminated(signum, frame):
    raise _Terminate


def _wait_task(pid: int, sock: socket.socket, poll_s: float = 0.2) -> int | None:
    """The task's wait status; None if the launcher hung up first (the task is then stopped). SIGTERM to
    this handler stops the task, then exits."""
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return status
            if _hung_up(sock, poll_s):
                _stop_task(pid)
                return None
    except _Terminate:
        _stop_task(pid)
        os._exit(143)


def _stop_task(pid: int, grace_s: float = 10.0) -> None:
    """SIGTERM to the task's process group (the task, torchrun and its ranks), SIGKILL after `grace_s`."""
    import time

    signal_group(pid, pid, signal.SIGTERM)
    end = time.monotonic() + grace_s
    while time.monotonic() < end:
        with contextlib.suppress(ChildProcessError):
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
        time.sleep(0.1)
    signal_group(pid, pid, signal.SIGKILL)  # what is left of the group: ranks that outlived the task
    with contextlib.suppress(ChildProcessError):
        os.waitpid(pid, 0)


def _child(req: dict, out_fd: int, set_by_import: dict) -> None:
    """The task's process: set up like a fresh `sh -ec` + `python3 -m kfp.dsl.executor_main`, run, exit."""
    code = 1
    try:
        child_stdio(out_fd)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        os.chdir(req["cwd"])
        env = {**req["env"], **{k: v for k, v in set_by_import.items() if v is not None}}
        env["_KFP_RUNTIME"] = "true"
        os.environ.clear()
        os.environ.update(env)
        import tempfile

        tempfile.tempdir = None  # from $TMPDIR again, as a fresh interpreter would
        if "numpy" in sys.modules:  # its global generator was seeded once, in the server
            sys.modules["numpy"].random.seed()
        program = Path(tempfile.mkdtemp(prefix="tmp."))  # `program_path=$(mktemp -d)`
        module = program / "ephemeral_component.py"
        module.write_text(req["source"], encoding="utf-8")
        sys.argv = [EXECUTOR, "--component_module_path", str(module), *req["args"]]
        sys.path[0] = os.getcwd()  # `python -m` puts the working folder first
        code = _run_executor()
    except BaseException:
        import traceback

        traceback.print_exc()
        sys.stderr.flush()
    finally:
        os._exit(code)


def _run_executor() -> int:
    """kfp's executor as `python -m` runs it, with the interpreter's exit: the exit code, threads joined,
    atexit handlers, streams flushed."""

    def executor():
        from kfp.dsl import executor_main

        executor_main.executor_main()

    return run_as_main(executor)


# ---- the launcher (in the process that runs the pipeline) -----------------------------------------------
class _Server:
    def __init__(self, env: dict, log: Path | None):
        parent, child = socket.socketpair()
        out = open(log, "ab") if log else subprocess.DEVNULL  # its imports' warnings; closed below
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "pipeline.warm", str(child.fileno())],
                                         env=env, pass_fds=[child.fileno()], stdin=subprocess.DEVNULL,
                                         stdout=out, stderr=out, cwd=os.getcwd())
        finally:
            child.close()
            if log:
                out.close()
        self.sock = parent
        self.env = env
        self.info: dict | None = None
        self.failed = ""

    def ready(self, timeout_s: float = READY_TIMEOUT_S) -> bool:
        if self.info is None and not self.failed:
            self.sock.settimeout(timeout_s)
            try:
                self.info, _ = _recv(self.sock)
            except (OSError, EOFError, ValueError) as e:
                self.failed = f"{type(e).__name__}: {e}"
                self.close()
            finally:
                if not self.failed:
                    self.sock.settimeout(None)
        return self.info is not None

    def close(self, wait_s: float = 10.0) -> None:
        """Hang up (the server exits once its running task, if any, has ended); kill it after `wait_s`."""
        try:
            self.sock.close()
        finally:
            try:
                self.proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


class _Kept(_Server):
    """A connection to a kept server (`start_kept`): not this process's child, so closing only hangs up
    (a task still running is then stopped by the server's handler)."""

    def __init__(self, path: str, env: dict | None = None, proc: subprocess.Popen | None = None,
                 connect_timeout_s: float = 60.0):
        import time

        self.proc, self.env, self.info, self.failed, self.path = None, env, None, "", path
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        end = time.monotonic() + connect_timeout_s
        while True:  # a server just started binds its socket within a second (before its imports)
            try:
                self.sock.connect(path)
                return
            except (FileNotFoundError, ConnectionRefusedError) as e:
                if time.monotonic() > end or (proc is not None and proc.poll() is not None):
                    self.failed = f"{type(e).__name__}: {e}"
                    self.sock.close()
                    return
                time.sleep(0.05)

    def close(self, wait_s: float = 0.0) -> None:
        self.sock.close()


def _hung_up(sock: socket.socket, wait_s: float = 0.0) -> bool:
    """Whether the other end closed this idle connection within `wait_s` (neither side sends anything
    while idle: a launcher between tasks, a handler while its task runs)."""
    import select

    try:
        readable, _, _ = select.select([sock], [], [], wait_s)
        return bool(readable) and not sock.recv(1, socket.MSG_PEEK)
    except (OSError, ValueError):
        return True


def socket_path(home: Path, name: str) -> str:
    """A new path for the kept server `name` of the local services folder `home` to listen on (a random
    part: never another server's, even one another run starts at the same moment): in `home`, or (a Unix
    socket's path has at most 107 bytes) in the temporary folder under a name derived from it."""
    import secrets

    path = Path(home).resolve() / f"{name}-{secrets.token_hex(4)}.sock"
    if len(os.fsencode(path)) <= 100:
        return str(path)
    import hashlib
    import tempfile

    digest = hashlib.sha256(os.fsencode(path)).hexdigest()[:16]
    return str(Path(tempfile.gettempdir()) / f"chunkgrpo-tasks-{digest}.sock")


def start_kept(home: Path, name: str, env: dict, log: Path | None) -> dict:
    """Start the kept server `name` for environment `env` in a session of its own; its record for
    `LocalServices.adopt` (pid, process group, start time, command, socket, log)."""
    import time

    from chunkgrpo.local_processes import CHILDREN, start_time

    path = socket_path(home, name)
    cmd = [sys.executable, "-m", "pipeline.warm", "--listen", path]
    out = open(log, "ab") if log else subprocess.DEVNULL
    try:
        proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=out,
                                cwd=os.getcwd(), start_new_session=True)
    finally:
        if log:
            out.close()
    CHILDREN[proc.pid] = proc
    return {"pid": proc.pid, "pgid": proc.pid, "create_time": start_time(proc.pid), "cmd": cmd,
            "socket": path, "log": str(log or ""), "started_at": time.time()}


class Launcher:
    """The servers of this process (at most MAX_SERVERS, oldest stopped first) and the task runner."""

    def __init__(self, log: Path | None = None):
        self.servers: list[_Server] = []
        self.log = log
        self.lock = threading.Lock()
        self.runs = {"warm": 0, "cold": 0}
        self.last_pid = 0

    def prestart(self, envs: list[dict]) -> None:
        """Start a server for each environment no server covers yet (imports run while the caller goes on)."""
        with self.lock:
            for env in envs:
                if not any(s.env == env or (s.info is not None and not match(s.info, env))
                           for s in self.servers):
                    self._start(env)

    def attach(self, path: str, env: dict | None = None,
               proc: subprocess.Popen | None = None) -> _Kept | None:
        """Use the kept server listening on `path` first (`env`: the environment it was started with, if
        this process started it: it then covers that environment before its imports are done); None if it
        cannot be reached."""
        with self.lock:
            for s in list(self.servers):
                if isinstance(s, _Kept) and s.path == path:
                    if not s.failed and not _hung_up(s.sock):
                        return s
                    self.servers.remove(s)  # that server was stopped or replaced since
                    s.close()
            s = _Kept(path, env, proc)
            if s.failed:
                return None
            while len(self.servers) >= MAX_SERVERS:
                self.servers.pop(0).close()
            self.servers.insert(0, s)
            return s

    def _start(self, env: dict) -> _Server:
        while len(self.servers) >= MAX_SERVERS:
            self.servers.pop(0).close()
        s = _Server(env, self.log)
        self.servers.append(s)
        return s

    def _ready(self, s: _Server) -> bool:
        if s.ready():
            return True
        self.servers.remove(s)
        where = f", see {self.log}" if self.log else ""
        print(f"chunkgrpo warm tasks: a server did not start ({s.failed}{where}); its task runs cold",
              flush=True)
        return False

    def server_for(self, env: dict) -> _Server | None:
        """A ready server whose imports saw what this environment holds, started if none; None if it
        cannot start."""
        with self.lock:
            for s in list(self.servers):
                if self._ready(s) and not match(s.info, env):
                    return s
            s = self._start(env)
            if not self._ready(s):
                return None
            why = match(s.info, env)
            if why:  # its own environment does not reproduce: nothing else will
                print(f"chunkgrpo warm tasks: a fresh server differs from its task in {why}; the task runs "
                      "cold", flush=True)
                return None
            return s

    def run(self, full_command: list[str], env_vars: dict | None = None, cold=None) -> int:
        """Run one task; kfp.local's contract: its output lines printed, its exit code returned. `cold`:
        the runner for a task that cannot run warm (default kfp.local's)."""
        from kfp.local import subprocess_task_handler

        cold = cold or subprocess_task_handler.run_local_subprocess
        task = executor_task(full_command)
        env = {**os.environ, **(env_vars or {})}
        server = self.server_for(env) if task is not None else None
        if server is None:
            self.runs["cold"] += 1
            return cold(full_command=full_command, env_vars=env_vars)
        source, args = task
        r, w = os.pipe()
        gone = None
        try:
            _send(server.sock, {"env": env, "cwd": os.getcwd(), "source": source, "args": args}, fds=[w])
        except OSError as e:
            gone = e
        finally:
            os.close(w)
        if gone is not None:  # the server was killed: nothing has started, so the task runs cold
            os.close(r)
            self._drop(server)
            print(f"chunkgrpo warm tasks: the server is gone ({gone}); the task runs cold", flush=True)
            self.runs["cold"] += 1
            return cold(full_command=full_command, env_vars=env_vars)
        self.runs["warm"] += 1
        try:
            with open(r, encoding="utf-8", errors="replace") as out:
                reply, _ = _recv(server.sock)
                self.last_pid = reply["pid"]
                for line in out:
                    print(line, end="")
            print("\n")
            reply, _ = _recv(server.sock)
            return int(reply["exit"])
        except BaseException:  # interrupted, or the server died mid-task: it is not reused
            self._drop(server)
            raise

    def _drop(self, server: _Server) -> None:
        with self.lock:
            if server in self.servers:
                self.servers.remove(server)
        server.close(wait_s=0)

    def close(self) -> None:
        with self.lock:
            while self.servers:
                self.servers.pop().close()


_LAUNCHER: Launcher | None = None


def launcher() -> Launcher:
    """This process's launcher (its servers are stopped at exit; they also stop when this process dies)."""
    global _LAUNCHER
    if _LAUNCHER is None:
        _LAUNCHER = Launcher()
        atexit.register(_LAUNCHER.close)
    return _LAUNCHER


if __name__ == "__main__":
    if sys.argv[1] == "--listen":
        serve_kept(sys.argv[2])
    else:
        serve(int(sys.argv[1]))
    os._exit(0)  # nothing to flush: skip the teardown of torch and mlflow (a second or more)
