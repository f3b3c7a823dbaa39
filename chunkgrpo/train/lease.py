"""One writer per checkpoint prefix in S3: a lease object `<checkpoint.s3_prefix>/WRITER.json` naming the
training that mirrors there (host, pid, output dir, seed), its last heartbeat and how long after it the lease
expires. It is taken before the first mirror upload and renewed by a heartbeat thread while training runs.

- no lease: this run creates it (`If-None-Match: *`);
- a lease of the same run (same `checkpoint.writer_id`, or without one the same output dir, and the same
  seed: a retried pod of the run) is taken back;
- a lease whose heartbeat is older than its stated expiry is taken over, with one warning line;
- a live lease of another run: UserError in one line naming the holder — two trainings never interleave
  their checkpoints under one prefix.

Every write is an S3 conditional write (create-only, or `If-Match` the ETag that was read), so two
writers racing for the same lease cannot both win: the loser's write is refused and it re-reads. A writer
whose lease was taken over (its heartbeat stalled past the expiry) notices at its next heartbeat and
stops mirroring with one error line. Staleness compares the holder's heartbeat with this host's clock:
clocks that differ shift the expiry by that much (S3 itself refuses requests from clocks off by more than
15 minutes, so the shift is bounded).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass

from chunkgrpo.errors import UserError
from chunkgrpo.store import PreconditionFailedError

log = logging.getLogger(__name__)
LEASE_NAME = "WRITER.json"


@dataclass
class Holder:
    """Who writes under a checkpoint prefix; `heartbeat` in Unix seconds, stale `expires_s` after it."""

    host: str
    pid: int
    output_dir: str
    seed: int
    heartbeat: float
    expires_s: float
    writer_id: str = ""  # the run's own name for itself (a pipeline run id); '' = output_dir and seed

    def same_run(self, other: "Holder") -> bool:
        if self.writer_id or other.writer_id:
            return (self.writer_id, self.seed) == (other.writer_id, other.seed)
        return (self.output_dir, self.seed) == (other.output_dir, other.seed)

    def describe(self, now: float) -> str:
        who = f"writer_id={self.writer_id} " if self.writer_id else ""
        return (f"{who}host={self.host} pid={self.pid} output_dir={self.output_dir} seed={self.seed}, "
                f"heartbeat {now - self.heartbeat:.0f}s ago (expires after {self.expires_s:.0f}s)")


class LeaseLostError(RuntimeError):
    """Another writer took this run's lease over (its heartbeat had stalled past the expiry)."""


class WriterLease:
    """The lease of `prefix` for this run; `acquire()` before the first upload, `release()` at the end."""

    def __init__(self, store, prefix: str, *, output_dir: str, seed: int, expires_s: float,
                 writer_id: str = "", clock=time.time):
        self.store, self.prefix, self.clock = store, prefix.rstrip("/"), clock
        self.key = f"{self.prefix}/{LEASE_NAME}"
        self.me = Holder(socket.gethostname(), os.getpid(), str(output_dir), int(seed), 0.0, float(expires_s),
                         writer_id)
        self.etag: str | None = None
        self.lost = ""
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def _read(self) -> tuple[Holder | None, str | None]:
        try:
            raw, etag = self.store.get_bytes_etag(self.key)
        except FileNotFoundError:
            return None, None
        try:
            fields = {k: v for k, v in json.loads(raw).items() if k in Holder.__dataclass_fields__}
            return Holder(**fields), etag
        except (ValueError, TypeError, AttributeError):
            return Holder("?", 0, "(unreadable lease)", 0, 0.0, 0.0), etag  # unreadable: treated as stale

    def _write(self, etag: str | None) -> None:
        self.me.heartbeat = self.clock()
        self.etag = self.store.put_bytes_if(json.dumps(asdict(self.me)).encode(), self.key, etag)

    def acquire(self) -> None:
        """Take the lease (see the module doc); UserError naming the holder if another live run has it."""
        for _ in range(5):  # a lost race re-reads: the winner is then a live holder (or ourselves)
            holder, etag = self._read()
            now = self.clock()
            try:
                if holder is None:
                    self._write(None)
                elif holder.same_run(self.me):
                    self._write(etag)
                    if holder.pid != self.me.pid or holder.host != self.me.host:
                        log.info("checkpoint writer lease %s taken back by this run (was %s)", self.key,
                                 holder.describe(now))
                elif now - holder.heartbeat > holder.expires_s:
                    self._write(etag)
                    log.warning("checkpoint writer lease %s was stale; taken over from %s", self.key,
                                holder.describe(now))
                else:
                    raise UserError(f"{self.prefix} is the checkpoint prefix of another training ("
                                    f"{holder.describe(now)}); refusing to write there — use another "
                                    "checkpoint.s3_prefix, or wait until its lease expires")
                return
            except PreconditionFailedError:
                continue
        raise UserError(f"{self.prefix}: could not take the checkpoint writer lease {self.key} "
                        "(it kept changing under concurrent writers)")

    def ensure(self) -> None:
        """Before an upload: take the lease if it is not held yet (S3 was unreachable at start); raise if
        it was lost or another live run holds it."""
        if self.lost:
            raise LeaseLostError(self.lost)
        if self.etag is None:
            self.acquire()
            self.start_heartbeat()

    def renew(self) -> None:
        """Heartbeat: rewrite the lease if it is still ours; LeaseLostError if another run took it."""
        try:
            self._write(self.etag)
        except PreconditionFailedError:
            holder, _ = self._read()
            who = holder.describe(self.clock()) if holder else "deleted"
            self.lost = f"checkpoint writer lease {self.key} was taken over ({who})"
            raise LeaseLostError(self.lost) from None

    def start_heartbeat(self) -> None:
        """Renew every expires_s/4 in a background thread (S3 errors are retried at the next beat)."""
        def beat() -> None:
            while not self._stop.wait(self.me.expires_s / 4):
                try:
                    self.renew()
                except LeaseLostError as e:
                    log.error("%s; this run no longer mirrors its checkpoints there", e)
                    return
                except Exception as e:  # S3 down: the next beat retries; the lease stays ours until expiry
                    log.warning("checkpoint writer lease heartbeat failed (%s)", type(e).__name__)

        if self._thread is not None:
            return
        self._stop.clear()
        self._thread = threading.Thread(target=beat, name="checkpoint-lease", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the heartbeat, keeping the lease (it expires `expires_s` after the last beat)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def release(self) -> None:
        """Delete the lease if it is still ours (a finished run leaves the prefix free). S3 has no
        conditional delete: a takeover between the read and the delete (only possible once this lease
        expired) is the one race window left; the run that took over recreates it at its next beat."""
        self.stop()
        if self.lost or self.etag is None:
            return
        try:
            holder, etag = self._read()
            if holder is not None and etag == self.etag:
                self.store.delete(self.key)
        except Exception as e:  # S3 down at the end: the lease expires by itself
            log.warning("could not release checkpoint writer lease %s (%s); it expires after %.0fs",
                        self.key, type(e).__name__, self.me.expires_s)
