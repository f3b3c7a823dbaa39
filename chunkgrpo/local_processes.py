"""Ports and process bookkeeping for the servers `chunkgrpo.local_services` starts on this machine: free
ports on 127.0.0.1 (and who holds a busy one), an HTTP health probe, and the identity of a started
process (pid + start time, so a reused pid is never taken for it), its liveness (a zombie leader with live
threads still holds its sockets), its process group's signals, the reaping of this process's children, and
for a forked child that stands in for a fresh interpreter: its standard streams and its exit.
psutil is optional: without it liveness falls back to `kill(pid, 0)`.
"""

from __future__ import annotations

import contextlib
import errno
import os
import socket
import subprocess
import urllib.error
import urllib.request

HOST = "127.0.0.1"  # never bind anything else

CHILDREN: dict[int, subprocess.Popen] = {}  # processes started by this Python process (to reap them)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return s.getsockname()[1]


def free_ports(n: int) -> list[int]:
    """n distinct TCP ports on 127.0.0.1 that are free right now (held open together while picking)."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.bind((HOST, 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def port_in_use(port: int) -> bool:
    """Would a server fail to listen on 127.0.0.1:port? (SO_REUSEADDR like Go/uvicorn: TIME_WAIT is fine)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((HOST, port))
        except OSError as e:
            return e.errno in (errno.EADDRINUSE, errno.EACCES)
        return False


def port_owner(port: int) -> str:
    """Best-effort 'pid 123 (weed)' for a listening port (psutil; may need privileges)."""
    try:
        import psutil

        for c in psutil.net_connections(kind="tcp"):
            if c.laddr and c.laddr.port == port and c.status == psutil.CONN_LISTEN and c.pid:
                return f"pid {c.pid} ({psutil.Process(c.pid).name()})"
    except Exception:
        pass
    return "another process"


def http_ok(url: str, want_200: bool, timeout: float = 2.0) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status == 200 or not want_200
    except urllib.error.HTTPError as e:
        return not want_200 and e.code < 500
    except (urllib.error.URLError, OSError, ValueError):
        return False


def start_time(pid: int) -> float | None:
    """The process's start time (psutil's create_time), or None (no psutil, no such process)."""
    try:
        import psutil

        return psutil.Process(pid).create_time()
    except Exception:
        return None


def alive(pid: int | None, create_time: float | None = None) -> bool:
    """Is this exact process (same start time) alive and not a zombie?"""
    if not pid:
        return False
    child = CHILDREN.get(pid)
    if child is not None:
        # our own child: gone only once reaped (a killed multi-threaded process keeps its sockets
        # until its last thread exits, even while the leader already shows as a zombie)
        if child.poll() is not None:
            return False
    try:
        import psutil

        p = psutil.Process(pid)
        if p.status() == psutil.STATUS_ZOMBIE and child is None and p.num_threads() <= 1:
            return False
        return create_time is None or abs(p.create_time() - create_time) < 1.0
    except ImportError:
        try:
            os.kill(pid, 0)
            return True
        except OSError:
            return False
    except Exception:
        return False


def any_alive(procs: list, pid: int) -> bool:
    child = CHILDREN.get(pid)
    if child is not None:
        child.poll()  # reap our own child so it does not linger as a zombie
    if not procs:
        return alive(pid)
    import psutil

    for p in procs:
        try:
            if p.is_running() and (p.status() != psutil.STATUS_ZOMBIE or p.num_threads() > 1):
                return True  # a zombie leader with live threads still holds its sockets
        except psutil.NoSuchProcess:
            continue
    return False


def signal_group(pgid: int | None, pid: int, sig: int) -> None:
    try:
        if pgid:
            os.killpg(pgid, sig)
        else:
            os.kill(pid, sig)
    except ProcessLookupError:
        pass


def reap(pid: int | None) -> None:
    """Collect the exit status of a process this Python process started (no zombie left)."""
    child = CHILDREN.pop(pid, None) if pid else None
    if child is not None:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=5)


def child_stdio(out_fd: int) -> None:
    """In a forked child: stdout and stderr into `out_fd` (closed here), stdin from /dev/null, as a fresh
    process started with a pipe for its output and no input would have them."""
    os.dup2(out_fd, 1)
    os.dup2(out_fd, 2)
    os.close(out_fd)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)


def interpreter_teardown() -> None:
    """What the interpreter does at exit before the process ends: wait for non-daemon threads, run the atexit
    handlers, flush the standard streams (a forked child ends with `os._exit`, which does none of it)."""
    import atexit
    import sys
    import threading

    try:
        threading._shutdown()  # the interpreter waits for non-daemon threads before atexit
    except Exception:
        pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def run_as_main(fn) -> int:
    """Run `fn()` as a program's main code and return the exit code the interpreter would: SystemExit's
    (a non-integer code printed, then 1), 1 and the traceback for any other exception; then
    `interpreter_teardown`."""
    import sys
    import traceback

    code = 0
    try:
        fn()
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    interpreter_teardown()
    return code
