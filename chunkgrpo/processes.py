"""Ports and process bookkeeping for the servers `chunkgrpo.services` starts on this machine: free
ports on 127.0.0.1 (and who holds a busy one), an HTTP health probe, and the identity of a started
process (pid + start time, so a reused pid is never taken for it), its liveness (a zombie leader with live
threads still holds its sockets), its process group's signals and the reaping of this process's children.
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
