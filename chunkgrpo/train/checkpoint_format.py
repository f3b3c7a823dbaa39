"""Training checkpoints: atomic local folders (staged, MANIFEST.json last, then renamed) mirrored
to S3 in the background through the artifact store (manifest last there too). Layout of
`output_dir/checkpoints/step-000010/`:

    trainable.safetensors   exact fp32 trainable parameters (LoRA or full), by parameter name
    optimizer.pt            optimizer state (full, gathered under FSDP): tensors + plain types only
    scheduler.pt            LR scheduler state: plain types only
    trainer_state.json      iteration, optimizer step, metrics history, config hash
    rng/rank{r}.pt          per-rank RNG states (torch, cuda, python, numpy) as tensors + plain types
    MANIFEST.json           sha256 + size of every file — written last

That is the layout of a single-process or DDP run. Under FSDP the weights, optimizer state and EMA are
each rank's shards instead (`dcp/`, torch.distributed.checkpoint; `chunkgrpo.train.checkpoint_sharded`),
written, hashed and mirrored by every rank in parallel; either layout resumes on any world size.

Nothing read back is trusted: a folder without a manifest is never resumed from; every file's size
and sha256 are checked against the manifest before use; `.pt` files are read with
`torch.load(weights_only=True)`, which refuses pickled code (a planted `__reduce__` payload is an
error, never executed — the manifest cannot vouch for it, whoever plants files writes the manifest
too). A checkpoint that fails any check is renamed aside (`step-000010.bad-1`), never deleted, and
the trainer falls back to the newest one that passes.

What a checkpoint IS lives here (the folder format, writing, verification, pruning, the S3 mirror);
how the trainer saves, resumes and mirrors its checkpoints is `chunkgrpo.train.checkpoint_policy`.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import random
import re
import shutil
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from chunkgrpo.backoff import retry_wait

log = logging.getLogger(__name__)
MANIFEST = "MANIFEST.json"
REQUIRED = ("trainable.safetensors", "optimizer.pt", "scheduler.pt", "trainer_state.json")
SHARDED_METADATA = "dcp/.metadata"  # the torch.distributed.checkpoint metadata of a sharded checkpoint
SHARDED_REQUIRED = (SHARDED_METADATA, "scheduler.pt", "trainer_state.json")
_STEP_RE = re.compile(r"^step-(\d+)$")


class CorruptCheckpointError(Exception):
    """A checkpoint folder that fails verification or cannot be read; the message names the file."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint could not be written (full disk, read-only folder); the staging folder is removed and
    the last complete checkpoint stays the newest."""


class _Failed:
    error: "CheckpointWriteError | None" = None


@contextlib.contextmanager
def writing(staging: Path):
    """Catch a write failure into `box.error` (a one-line CheckpointWriteError) instead of raising it, so
    every rank reaches the next collective; a failure that is not I/O (a bug) still raises."""
    box = _Failed()
    try:
        yield box
    except Exception as e:
        name = type(e).__name__
        io = isinstance(e, OSError) or name == "SafetensorError" or (
            isinstance(e, RuntimeError) and ("write" in str(e).lower() or "serializ" in str(e).lower()))
        if not io:
            raise
        box.error = CheckpointWriteError(f"cannot write checkpoint {staging.name} in {staging.parent}: "
                                         f"{_short(e)}; the last complete checkpoint is intact")


class MirrorBacklogError(RuntimeError):
    """Keeping the local checkpoint policy would delete a checkpoint that has not reached S3 yet."""


# ----------------------------------------------------------------------------------- RNG state


def rng_state() -> dict:
    """Every RNG the run uses, as tensors and plain Python values (loadable with weights_only=True)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    return {"torch": torch.get_rng_state(), "python": random.getstate(),
            "numpy": {"name": name, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                      "cached_gaussian": float(cached)},
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    n = state["numpy"]
    np.random.set_state((n["name"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    if state.get("cuda") is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# -------------------------------------------------------------------------------- folder names


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:06d}"


def step_of(path: Path) -> int:
    return int(_STEP_RE.match(path.name).group(1))


def is_complete(path: Path) -> bool:
    return (path / MANIFEST).exists()


def complete_checkpoints(root: Path) -> list[Path]:
    """Local folders `step-N` with a manifest, oldest first (folders set aside are not listed)."""
    if not root.exists():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and _STEP_RE.match(p.name) and is_complete(p)]
    return sorted(found, key=step_of)


def write_manifest(path: Path, meta: dict, files: dict | None = None) -> None:
    """MANIFEST.json of `path`: every file hashed here, or `files` ({rel: {sha256, size}}) as the ranks that
    wrote them hashed them (a sharded checkpoint; they must be exactly the folder's files)."""
    from chunkgrpo.store.manifest import Manifest, _now, build_manifest, require_files

    if files is None:
        manifest = build_manifest(path, meta=meta)
    else:
        require_files(path, files, "the ranks' file lists disagree with the folder")
        manifest = Manifest(files=dict(files), created=_now(), meta=dict(meta))
    tmp = path / (MANIFEST + ".tmp")
    tmp.write_bytes(manifest.to_json())
    tmp.replace(path / MANIFEST)


def staging_path(root: Path, step: int) -> Path:
    return root / f".staging-step-{step:06d}"


def stage_dir(root: Path, step: int) -> Path:
    """A fresh staging folder for step `step` (a crashed earlier attempt is discarded)."""
    staging = staging_path(root, step)
    if staging.exists():
        shutil.rmtree(staging)
    (staging / "rng").mkdir(parents=True)
    return staging


def set_aside(path: Path) -> Path:
    """Rename a bad checkpoint to `<name>.bad-<n>` next to it (kept for inspection, never deleted)."""
    n = 1
    while (target := path.with_name(f"{path.name}.bad-{n}")).exists():
        n += 1
    path.rename(target)
    return target


def finalize(staging: Path, root: Path, step: int, meta: dict, keep: int, mirror: "Mirror | None" = None,
             backlog: int = 0, files: dict | None = None) -> Path:
    """Manifest last (`files`: see `write_manifest`), then an atomic rename; prune older complete
    checkpoints (see `prune`)."""
    write_manifest(staging, meta, files)
    final = step_dir(root, step)
    if final.exists():
        set_aside(final)  # a folder for this step already exists (e.g. an unverified leftover): keep it
    staging.rename(final)
    prune(root, keep, mirror, backlog)
    return final


def prune(root: Path, keep: int, mirror: "Mirror | None" = None, backlog: int = 0) -> list[Path]:
    """Delete complete checkpoints older than the newest `keep` (0 = keep all) — never one that is not
    in S3 yet. Up to `backlog` of those are kept beyond `keep`; for older ones the mirror is waited
    for while it is working (upload lag is normal); if it is failing (S3 unreachable) that would be
    data loss: `MirrorBacklogError`, and nothing is deleted.

    With a mirror, a checkpoint it has uploaded is not kept locally beyond the newest one (resume
    downloads it again when needed): the node's disk holds the newest checkpoint plus those still on
    their way to S3, at most `keep` (+ `backlog` during an outage), not `keep` full copies. For
    FLUX.1-dev full fine-tuning one checkpoint is ~133 GiB (manifests/README.md, "Storage layout")."""
    if keep <= 0:
        return []
    complete = complete_checkpoints(root)
    old = complete[:-keep]
    if mirror is not None:
        in_s3 = [p for p in complete[:-1] if p not in old and mirror.is_mirrored(p)]
        held = [p for p in old if mirror.is_pending(p)]
        lost = [p for p in held[:max(0, len(held) - backlog)] if mirror.settle(p)]
        if lost:
            raise MirrorBacklogError(
                f"checkpoint.keep={keep} would delete {', '.join(p.name for p in lost)}, "
                "not yet mirrored to S3 "
                f"({mirror.last_error or 'S3 unreachable'}; checkpoint.mirror_backlog={backlog}); "
                "stopping instead "
                f"of losing them — they are intact in {root}"
            )
        old = [p for p in old if not mirror.is_pending(p)] + in_s3
    for p in old:
        shutil.rmtree(p, ignore_errors=True)
    return old


# ------------------------------------------------------------------------------ verification


def verify(path: Path) -> dict:
    """Check every file against the manifest (present, size, sha256); the manifest must list the
    required files. Returns the parsed manifest files; raises CorruptCheckpointError naming the file."""
    from chunkgrpo.store import StoreError
    from chunkgrpo.store.manifest import Manifest, file_sha256

    mpath = path / MANIFEST
    try:
        manifest = Manifest.from_json(mpath.read_bytes(), where=str(mpath))
    except (OSError, StoreError) as e:
        raise CorruptCheckpointError(f"{path.name}/{MANIFEST}: {e}") from None
    required = SHARDED_REQUIRED if SHARDED_METADATA in manifest.files else REQUIRED
    missing = [f for f in required if f not in manifest.files]
    if missing:
        raise CorruptCheckpointError(f"{path.name}: manifest lacks {', '.join(missing)}")
    for rel, entry in sorted(manifest.files.items()):
        f = path / rel
        if not f.is_file():
            raise CorruptCheckpointError(f"{path.name}/{rel}: missing")
        size = f.stat().st_size
        if size != int(entry["size"]):
            raise CorruptCheckpointError(f"{path.name}/{rel}: {size} bytes, manifest says {entry['size']}")
        if file_sha256(f) != entry["sha256"]:
            raise CorruptCheckpointError(f"{path.name}/{rel}: sha256 differs from the manifest")
    return manifest.files


def _short(e: BaseException) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else ""
    return f"{type(e).__name__}: {text[:160]}" if text else type(e).__name__


def _load_pt(path: Path):
    """torch.load restricted to tensors and plain types: pickled code is refused, not run."""
    return torch.load(path, map_location="cpu", weights_only=True)


@dataclass
class CheckpointData:
    """Everything a checkpoint holds for one rank, read into memory before any of it is applied."""

    path: Path
    state: dict
    weights: dict[str, torch.Tensor]
    optimizer: dict
    scheduler: dict
    rng: dict | None
    ema: dict[str, torch.Tensor] | None = None  # the EMA of the trainable weights, when the run keeps one
    sharded: bool = False  # weights, optimizer and EMA are in `dcp/`, read by each rank at apply time
    shards: dict | None = None  # what `checkpoint_sharded.load` read for this rank


def read(path: Path, rank: int = 0) -> CheckpointData:
    """Read a checkpoint (after `verify`); any unreadable or refused file is a CorruptCheckpointError."""
    from safetensors.torch import load_file

    current = ""
    sharded = (path / SHARDED_METADATA).is_file()
    try:
        current = "trainer_state.json"
        state = json.loads((path / current).read_text(encoding="utf-8"))
        for key in ("iteration", "optimizer_step"):
            if not isinstance(state.get(key), int):
                raise ValueError(f"no integer {key!r}")
        weights, optim, ema = {}, {}, None
        if not sharded:
            current = "trainable.safetensors"
            weights = load_file(str(path / current))
            current = "optimizer.pt"
            optim = _load_pt(path / current)
        current = "scheduler.pt"
        sched = _load_pt(path / current)
        for name, obj in (("optimizer.pt", optim), ("scheduler.pt", sched)):
            if not isinstance(obj, dict):
                current = name
                raise ValueError(f"expected a state dict, got {type(obj).__name__}")
        current = "ema.safetensors"
        if not sharded and (path / current).exists():
            ema = load_file(str(path / current))
        current = f"rng/rank{rank}.pt"
        rng = _load_pt(path / current) if (path / current).exists() else None
        if rng is not None and not (isinstance(rng, dict) and isinstance(rng.get("numpy"), dict)):
            raise ValueError("not an RNG state of this version")
    except Exception as e:
        raise CorruptCheckpointError(f"{path.name}/{current}: {_short(e)}") from None
    data = CheckpointData(path, state, weights, optim, sched, rng, ema, sharded)
    check_contents(data)
    return data


def check_contents(data: CheckpointData) -> None:
    """What a manifest cannot vouch for (whoever rewrites a file rewrites the manifest too): every
    floating tensor finite (trainable weights, EMA, optimizer moments), and a trainer state that agrees
    with the files — `optimizer_step` = the N of the folder `step-N` = the LR scheduler's step count
    = the largest AdamW `step`; `iteration` ≥ 0 with one history entry per iteration. Raises
    CorruptCheckpointError naming the first disagreement. (A sharded checkpoint's tensors are checked the
    same way by each rank on the shards it reads: `Checkpointer`.)"""
    name = data.path.name
    for label, tensors in (("trainable.safetensors", data.weights), ("ema.safetensors", data.ema or {}),
                           ("optimizer.pt", optimizer_tensors(data.optimizer))):
        bad = non_finite(tensors)
        if bad:
            raise CorruptCheckpointError(f"{name}/{label}: non-finite values in {len(bad)} tensor(s), "
                                         f"e.g. {bad[0]}")
    state = data.state
    step, iteration = state["optimizer_step"], state["iteration"]
    m = _STEP_RE.match(name)
    if step < 0 or iteration < 0:
        raise CorruptCheckpointError(f"{name}/trainer_state.json: negative optimizer_step={step} or "
                                     f"iteration={iteration}")
    if m and int(m.group(1)) != step:
        raise CorruptCheckpointError(f"{name}/trainer_state.json: optimizer_step={step} but the folder is "
                                     f"step {int(m.group(1))}")
    epoch = data.scheduler.get("last_epoch")
    if isinstance(epoch, int) and epoch != step:
        raise CorruptCheckpointError(f"{name}/trainer_state.json: optimizer_step={step} but scheduler.pt has "
                                     f"taken {epoch} steps")
    adam = [int(t.max()) if torch.is_tensor(t) else int(t)
            for slots in (data.optimizer.get("state") or {}).values() for k, t in (slots or {}).items()
            if k == "step" and (torch.is_tensor(t) or isinstance(t, (int, float)))]
    if adam and max(adam) != step:
        raise CorruptCheckpointError(f"{name}/trainer_state.json: optimizer_step={step} but optimizer.pt has "
                                     f"taken {max(adam)} steps")
    history = state.get("history")
    if not isinstance(history, list) or len(history) != iteration:
        n = len(history) if isinstance(history, list) else "no"
        raise CorruptCheckpointError(f"{name}/trainer_state.json: iteration={iteration} but {n} history "
                                     "entries")


def non_finite(tensors: dict[str, torch.Tensor]) -> list[str]:
    """Names of floating-point tensors holding NaN or ±inf."""
    return [n for n, t in tensors.items()
            if torch.is_tensor(t) and t.is_floating_point() and not bool(torch.isfinite(t).all())]


def optimizer_tensors(state: dict) -> dict[str, torch.Tensor]:
    """The floating tensors of an optimizer state dict, named `<param>.<slot>` (for finiteness checks)."""
    out = {}
    for pid, slots in (state.get("state") or {}).items():
        for slot, t in (slots or {}).items():
            if torch.is_tensor(t):
                out[f"{pid}.{slot}"] = t
    return out


# ------------------------------------------------------------------------------------- S3


def upload(path: Path, s3_prefix: str, store=None) -> str:
    """Mirror a complete checkpoint folder to S3 (`put_folder` writes the manifest last)."""
    from chunkgrpo.store.client import ArtifactStore

    uri = s3_prefix.rstrip("/") + "/" + path.name
    (store or ArtifactStore()).put_folder(path, uri, meta={"kind": "checkpoint"})
    return uri


def remote_checkpoints(s3_prefix: str, store=None) -> dict[int, str]:
    """{step: s3 URI} of the complete checkpoints under `s3_prefix`."""
    from chunkgrpo.store.client import ArtifactStore

    out = {}
    for uri in (store or ArtifactStore()).list_complete(s3_prefix):
        name = uri.rstrip("/").rsplit("/", 1)[-1]
        if m := _STEP_RE.match(name):
            out[int(m.group(1))] = uri
    return out


def download(uri: str, root: Path, step: int, store=None) -> Path:
    """Fetch one S3 checkpoint into `root/step-N` (checksums verified while downloading; a failed
    download leaves nothing behind — the S3 copy stays as it is)."""
    from chunkgrpo.store.client import ArtifactStore

    staging = root / f".download-step-{step:06d}"
    if staging.exists():
        shutil.rmtree(staging)
    try:
        (store or ArtifactStore()).get_folder(uri, staging)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    final = step_dir(root, step)
    if final.exists():
        set_aside(final)
    staging.rename(final)
    return final


def mirror_budget_s(pending_bytes: int, min_mb_s: float, slack_s: float) -> float:
    """Seconds the end of training waits for the S3 mirror: the bytes still to upload at the slowest
    acceptable rate, plus a fixed slack (connection set-up, the manifest, a retry)."""
    return slack_s + pending_bytes / (min_mb_s * 1e6)


class Mirror:
    """Uploads finished checkpoints to S3 from a background thread, in order, so training never waits
    on S3. While S3 is unreachable it keeps retrying (backoff doubling to `max_backoff_s`, one log
    line per failure) and training goes on writing local checkpoints; `pending()` tells the pruning
    which local folders must not be deleted yet; while somebody `wait`s, it retries every `drain_retry_s`."""

    def __init__(
        self, s3_prefix: str, *, store_factory=None, backoff_s: float = 2.0, max_backoff_s: float = 60.0,
        drain_retry_s: float = 2.0, guard=None, upload_part=None, retain=None,
    ):
        self.s3_prefix = s3_prefix
        self._guard = guard  # called before each upload; raises when this run may no longer write there
        # a sharded checkpoint's part: upload_part(folder, uri, store, job) (`checkpoint_sharded`)
        self._upload_part = upload_part
        self._retain_fn = retain  # retain(store): S3 retention after each upload that wrote a manifest
        self._jobs: dict[Path, dict] = {}  # sharded checkpoints: this rank's files (+ the manifest on rank 0)
        self._store_factory = store_factory
        self._store = None
        self.backoff_s, self.max_backoff_s = backoff_s, max_backoff_s
        self.drain_retry_s = drain_retry_s
        self._waiters = 0  # threads in `wait`: the loop retries at least every drain_retry_s
        self._queue: collections.deque[Path] = collections.deque()
        self._deferred: list[Path] = []  # submitted while held: queued by `release` (the final model first)
        self._held = False
        self._cv = threading.Condition()
        self._closing = False
        self.uploaded: list[str] = []
        self._mirrored: set[Path] = set()  # local folders whose upload completed (manifest in S3)
        self.failures = 0
        self.failing = False  # the last attempt failed (S3 unreachable); cleared by the next success
        self.last_error = ""
        self._thread = threading.Thread(target=self._loop, name="checkpoint-mirror", daemon=True)
        self._thread.start()

    def submit(self, path: Path, part: dict | None = None) -> None:
        """Queue a complete checkpoint folder; `part` (a sharded checkpoint) = {"files": this rank's
        {rel: entry}, "rank", "world", "manifest": bytes on rank 0 else None}: only those files go up."""
        with self._cv:
            if part is not None:
                self._jobs[path] = part
            if self._held:
                if path not in self._deferred:
                    self._deferred.append(path)
            elif path not in self._queue:
                self._queue.append(path)
            self._cv.notify_all()

    def hold(self) -> None:
        """Checkpoints submitted from now on wait (`release`); those already queued go on uploading."""
        with self._cv:
            self._held = True

    def release(self) -> None:
        with self._cv:
            self._held = False
            for p in self._deferred:
                if p not in self._queue:
                    self._queue.append(p)
            self._deferred.clear()
            self._cv.notify_all()

    def pending_bytes(self) -> int:
        """Bytes of the files still queued for upload (what the end-of-training wait is sized from)."""
        from chunkgrpo.store.manifest import file_sizes

        total = 0
        for p in self.pending():
            job = self._jobs.get(p)
            try:
                total += (sum(int(e["size"]) for e in job["files"].values()) if job is not None
                          else sum(file_sizes(p).values()))
            except OSError:
                continue
        return total

    def pending(self) -> list[Path]:
        with self._cv:
            return list(self._queue) + self._deferred

    def is_pending(self, path: Path) -> bool:
        with self._cv:
            return path in self._queue or path in self._deferred

    def is_mirrored(self, path: Path) -> bool:
        """`path` was uploaded by this mirror (its manifest is in S3) and has not been queued again."""
        with self._cv:
            return path in self._mirrored and path not in self._queue and path not in self._deferred

    def settle(self, path: Path) -> bool:
        """Wait while `path` is queued and the mirror is working (not failing); True if it is still
        not in S3 (the mirror is failing or closed)."""
        with self._cv:
            while path in self._queue and not self.failing and not self._closing:
                self._cv.wait(1.0)
            return path in self._queue

    def wait(self, timeout: float) -> bool:
        """Wait until everything submitted is in S3 (True) or `timeout` seconds pass (False)."""
        deadline = time.monotonic() + timeout
        with self._cv:
            self._waiters += 1
            self._cv.notify_all()
            try:
                while self._queue or self._deferred:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._cv.wait(min(left, 1.0))
            finally:
                self._waiters -= 1
        return True

    def close(self, timeout: float = 0.0) -> bool:
        """Wait up to `timeout` for pending uploads, then stop the thread (an upload in progress is
        abandoned; its folder has no manifest in S3, so it is never read as complete)."""
        drained = self.wait(timeout)
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join(timeout=1.0)
        return drained

    def _upload(self, path: Path) -> str:
        if self._store is None:
            from chunkgrpo.store.client import ArtifactStore

            self._store = (self._store_factory or ArtifactStore)()
        if self._guard is not None:
            self._guard()
        job = self._jobs.get(path)
        if job is None:
            uri = upload(path, self.s3_prefix, self._store)
        else:
            uri = self._upload_part(path, self.s3_prefix.rstrip("/") + "/" + path.name, self._store, job)
        if self._retain_fn is not None and (job is None or job["manifest"] is not None):
            self._retain()
        return uri

    def _retain(self) -> None:
        """S3 retention after an upload completed; a failure is one log line (the next upload retries)."""
        try:
            self._retain_fn(self._store)
        except Exception as e:
            log.warning("S3 retention under %s failed (%s); retried after the next upload", self.s3_prefix,
                        _short(e))

    def _loop(self) -> None:
        delay = self.backoff_s
        while True:
            with self._cv:
                while not self._queue and not self._closing:
                    self._cv.wait()
                if self._closing:
                    return
                path = self._queue[0]
            try:
                if not path.exists():  # set aside or removed meanwhile: nothing to mirror
                    uri = "(gone)"
                else:
                    uri = self._upload(path)
            except Exception as e:
                self.failures += 1
                self.last_error = _short(e)
                with self._cv:
                    self.failing = True
                    self._cv.notify_all()
                self._store = None  # a fresh client (new connection pool) on the next attempt
                log.warning("S3 mirror of %s failed (%s); retrying in %.0fs — training continues on local "
                            "checkpoints", path.name, self.last_error, delay)
                with self._cv:
                    if retry_wait(self._cv, lambda: self._closing, lambda: self._waiters > 0, delay,
                                  self.drain_retry_s):
                        return
                delay = min(self.max_backoff_s, delay * 2)
                continue
            delay = self.backoff_s
            with self._cv:
                if self._queue and self._queue[0] == path:
                    self._queue.popleft()
                    self._jobs.pop(path, None)
                self.failing = False
                self.uploaded.append(uri)
                if uri != "(gone)":
                    self._mirrored.add(path)
                self._cv.notify_all()
            if uri != "(gone)":
                log.info("checkpoint %s → %s", path.name, uri)
