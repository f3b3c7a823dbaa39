"""One exclusive inter-process lock on a file: `flock(2)` on `<path>`, the only lock the project uses.

    with FileLock(cache / ".locks" / "models-ab12.lock"):   # blocking: wait for the holder, then fill
        ...
    lock = FileLock(out / ".train.lock")
    lock.acquire(blocking=False)                              # try-lock: LockHeld if another holds it
    ...
    lock.release()

Contracts:
- **Exclusive across processes.** One holder at a time per path. Two `FileLock`s on one path in the same
  process also exclude each other (flock locks belong to an open file, not to a process).
- **Blocking vs try-lock.** `acquire()` waits until the holder releases; `acquire(blocking=False)`
  returns at once or raises `LockHeld`, whose `holder` is the pid the holder recorded in the file ("?"
  when unknown).
- **Released on exit and on death.** `release()`, leaving the `with` block, or the process ending in any
  way (exit, exception, SIGKILL, OOM kill): the kernel drops the lock when the last descriptor of the file
  closes, so a crashed holder never leaves a stale lock. The lock file itself stays (it is reused; its
  content is only the last holder's pid, for messages). A child made by a bare `fork()` inherits the
  descriptor and keeps the lock alive until it exits too; `subprocess` closes descriptors (close_fds).
- **Filesystems.** Local filesystems: as above. NFS (Linux clients): flock is emulated with byte-range
  locks that the server arbitrates, so processes on different nodes exclude each other, unless the
  volume is mounted `nolock` (then locks only exclude processes of the same node). A filesystem without
  lock support (some FUSE mounts) makes `acquire` raise the OSError the kernel gives (ENOLCK,
  EOPNOTSUPP, ...) unchanged: it is never reported as `LockHeld`.
"""

from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path
from typing import IO


class LockHeld(RuntimeError):
    """A try-lock found the lock held by another process (or another `FileLock` of this one)."""

    def __init__(self, path: Path, holder: str):
        super().__init__(f"{path} is locked by pid {holder}")
        self.path, self.holder = path, holder


class FileLock:
    """An exclusive `flock` on `path` (created with its parent folders if missing); see the module
    docstring."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        self._file: IO[str] | None = None

    @property
    def held(self) -> bool:
        return self._file is not None

    def acquire(self, blocking: bool = True) -> None:
        """Take the lock: wait for it (`blocking`), or raise `LockHeld` at once. Records this pid in the
        file."""
        if self._file is not None:
            raise RuntimeError(f"{self.path} is already locked by this FileLock")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        f = open(self.path, "a+")  # never truncates on open: a waiter does not erase the holder's pid
        try:
            fcntl.flock(f, fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
        except OSError as e:
            if not blocking and e.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                f.seek(0)
                holder = f.read().strip() or "?"
                f.close()
                raise LockHeld(self.path, holder) from None
            f.close()
            raise
        f.seek(0)
        f.truncate()
        f.write(str(os.getpid()))
        f.flush()
        self._file = f

    def release(self) -> None:
        """Drop the lock (closing the file releases it); a no-op when not held."""
        f, self._file = self._file, None
        if f is not None:
            f.close()

    def __enter__(self) -> FileLock:
        self.acquire()
        return self

    def __exit__(self, *exc) -> None:
        self.release()
