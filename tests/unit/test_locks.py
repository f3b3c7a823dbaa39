"""chunkgrpo.locks.FileLock: the contracts its docstring states (exclusive, blocking vs try-lock, released
on release/exit and when the holding process dies, holder pid in the message, fs errors not LockHeld)."""

from __future__ import annotations

import errno
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from chunkgrpo.locks import FileLock, LockHeld

_HOLD = """
import sys, time
from chunkgrpo.locks import FileLock
lock = FileLock(sys.argv[1]); lock.acquire()
print("held", flush=True)
{after}
"""


def _holder(path, after: str) -> subprocess.Popen:
    """A child process that takes the lock, prints 'held', then runs `after`."""
    p = subprocess.Popen([sys.executable, "-c", _HOLD.format(after=after), str(path)], stdout=subprocess.PIPE,
                         stdin=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


def test_second_holder_in_the_same_process_is_refused_then_admitted_after_release(tmp_path):
    path = tmp_path / "sub" / "x.lock"  # parent folders are created
    a, b = FileLock(path), FileLock(path)
    a.acquire(blocking=False)
    assert a.held and path.read_text() == str(os.getpid())
    with pytest.raises(LockHeld) as e:
        b.acquire(blocking=False)
    assert e.value.holder == str(os.getpid()) and e.value.path == path and not b.held
    a.release()
    assert not a.held
    b.acquire(blocking=False)
    b.release()
    b.release()  # releasing twice is a no-op


def test_acquiring_twice_through_one_object_is_an_error(tmp_path):
    lock = FileLock(tmp_path / "x.lock")
    with lock:
        with pytest.raises(RuntimeError, match="already locked"):
            lock.acquire()
    assert not lock.held


def test_try_lock_names_the_pid_of_another_process_and_blocking_waits_for_it(tmp_path):
    path = tmp_path / "x.lock"
    p = _holder(path, "sys.stdin.readline(); lock.release(); time.sleep(30)")
    try:
        with pytest.raises(LockHeld, match=f"locked by pid {p.pid}"):
            FileLock(path).acquire(blocking=False)
        got = threading.Event()

        def wait():
            with FileLock(path):
                got.set()

        t = threading.Thread(target=wait, daemon=True)
        t.start()
        time.sleep(0.3)
        assert not got.is_set()  # blocked while the child holds it
        p.stdin.write("go\n")
        p.stdin.flush()
        t.join(timeout=20)
        assert got.is_set()  # admitted after the child's release (the child is still alive)
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()


def test_released_when_the_holder_exits_without_releasing(tmp_path):
    path = tmp_path / "x.lock"
    p = _holder(path, "sys.stdin.readline(); sys.exit(0)")
    with pytest.raises(LockHeld):
        FileLock(path).acquire(blocking=False)
    p.communicate("go\n", timeout=20)
    assert p.returncode == 0
    with FileLock(path) as lock:
        assert lock.held


def test_released_when_the_holder_is_killed(tmp_path):
    path = tmp_path / "x.lock"
    p = _holder(path, "time.sleep(60)")
    with pytest.raises(LockHeld):
        FileLock(path).acquire(blocking=False)
    os.kill(p.pid, signal.SIGKILL)
    p.wait(timeout=20)
    lock = FileLock(path)
    lock.acquire(blocking=False)  # no stale lock after SIGKILL
    assert path.read_text() == str(os.getpid())
    lock.release()


def _take_and_report(path, q):
    lock = FileLock(path)
    try:
        lock.acquire(blocking=False)
        q.put("acquired")
    except LockHeld as e:
        q.put(f"held by {e.holder}")


def test_exclusive_across_processes(tmp_path):
    path = tmp_path / "x.lock"
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    with FileLock(path):
        proc = ctx.Process(target=_take_and_report, args=(path, q))
        proc.start()
        proc.join(timeout=60)
        assert q.get(timeout=5) == f"held by {os.getpid()}"


def test_a_filesystem_error_is_not_reported_as_held(tmp_path, monkeypatch):
    import chunkgrpo.locks as locks

    def nolock(f, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(locks.fcntl, "flock", nolock)
    lock = FileLock(tmp_path / "x.lock")
    with pytest.raises(OSError) as e:
        lock.acquire(blocking=False)
    assert e.value.errno == errno.ENOLCK and not isinstance(e.value, LockHeld) and not lock.held
