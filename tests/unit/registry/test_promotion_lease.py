"""The promotion lock is a lease: `holder_gone` says when its holder can no longer hold it (lease expired,
or its process on this host is gone), so the next caller reclaims it at once instead of waiting it out."""

import os
import socket
import subprocess
import sys
import time

from chunkgrpo.registry.promotion import _process_start, holder_gone, lock_holder


def _tags(holder: str, expires_in: float) -> dict:
    now = time.time()
    return {"lock.holder": holder, "lock.expires": repr(now + expires_in), "lock.at": repr(now)}


def test_a_live_holder_with_a_valid_lease_keeps_the_lock():
    assert holder_gone(_tags(lock_holder(), 30)) == ""
    assert holder_gone(_tags("other-host:1:1:x", 30)) == ""  # another machine: only its lease tells


def test_an_expired_lease_is_reclaimed_wherever_its_holder_ran():
    assert "lease expired" in holder_gone(_tags("other-host:1:1:x", -1))


def test_a_dead_process_on_this_host_is_reclaimed_before_its_lease_ends():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    holder = f"{socket.gethostname()}:{proc.pid}:{_process_start(proc.pid)}:x"
    assert holder_gone(_tags(holder, 30)) == ""
    proc.kill()
    proc.wait()
    assert "is gone" in holder_gone(_tags(holder, 30))


def test_an_earlier_process_with_this_pid_is_gone():
    """A restarted promoter in a container runs as the same pid on the same host: its predecessor's lock
    is recognised as another incarnation's."""
    host, pid, start, _ = lock_holder().split(":")
    assert int(pid) == os.getpid()
    assert "earlier process" in holder_gone(_tags(f"{host}:{pid}:{start}:older", 30))


def test_a_lock_of_the_earlier_format_is_reclaimed_by_age():
    assert holder_gone({"lock.at": repr(time.time() - 3600)})
    assert holder_gone({"lock.at": repr(time.time())}) == ""
