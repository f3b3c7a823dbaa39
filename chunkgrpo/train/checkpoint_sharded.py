"""Sharded checkpoints under FSDP: every rank writes, hashes and mirrors its own shards.

Layout of `checkpoints/step-000010/` written by an FSDP run of N ranks:

    dcp/.metadata           torch.distributed.checkpoint metadata: which bytes of which file hold what
    dcp/__{r}_0.distcp      rank r's shards of the trainable weights, optimizer moments and EMA
    scheduler.pt            LR scheduler state (rank 0)
    trainer_state.json      counters, history, config; "format": "dcp", "world_size": N (rank 0)
    rng/rank{r}.pt          rank r's RNG states
    MANIFEST.json           sha256 + size of every file above, written last by rank 0 from the
                            entries each rank computed for its own files

No rank gathers the full state: each writes and hashes about 1/N of it. The state is addressed by
parameter name, not by rank, so any world size reads it (`torch.distributed.checkpoint.load` reshards:
M ranks each read the byte ranges of their own shards; a single process reads whole tensors).

In S3 (`upload_part`) every rank uploads its own files, then `.parts/rank{r}.json` (its manifest
entries); rank 0 writes `MANIFEST.json` only once every rank's part lists exactly the files and
checksums of the manifest, so a checkpoint is complete in S3 only when every shard is there.

On several nodes with their own disks each node's folder holds its ranks' files and is a part, complete
only in S3 (`checkpoint_nodes`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import shutil
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from chunkgrpo.train import checkpoint_format as ckpt
from chunkgrpo.train import checkpoint_nodes as nodes
from chunkgrpo.train import dist as D
from chunkgrpo.train.context import NonFiniteLossError

log = logging.getLogger(__name__)
DCP_DIR = "dcp"
METADATA = ckpt.SHARDED_METADATA
REQUIRED = ckpt.SHARDED_REQUIRED
PARTS = ".parts"
READERS = ".readers"
READ_MARKER_S = 6 * 3600.0  # a reader's marker protects its checkpoint this long (a crashed reader's lapses)


def is_sharded(files) -> bool:
    """A manifest's file list (or a folder's names) is of a sharded checkpoint."""
    return METADATA in files


def own_files(folder: Path, rank: int) -> list[str]:
    """Relative paths of the files rank `rank` wrote into a checkpoint folder (rank 0: also the shared
    ones: the DCP metadata, scheduler and trainer state)."""
    rels = [f"{DCP_DIR}/{p.name}" for p in sorted((folder / DCP_DIR).glob(f"__{rank}_*.distcp"))]
    if (folder / "rng" / f"rank{rank}.pt").exists():
        rels.append(f"rng/rank{rank}.pt")
    if rank == 0:
        rels += [r for r in (METADATA, "scheduler.pt", "trainer_state.json") if (folder / r).exists()]
    return rels


def hash_files(folder: Path, rels: list[str]) -> dict[str, dict]:
    """{rel: {sha256, size}} of the given files (each rank hashes its own, in parallel with the others)."""
    from chunkgrpo.store.manifest import file_sha256

    return {rel: {"sha256": file_sha256(folder / rel), "size": (folder / rel).stat().st_size} for rel in rels}


def tree_map(fn, obj):
    """`fn` applied to every tensor of a nested dict/list state dict (other values kept)."""
    if torch.is_tensor(obj):
        return fn(obj)
    if isinstance(obj, dict):
        return {k: tree_map(fn, v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [tree_map(fn, v) for v in obj]
    return obj


def local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (a DTensor's local shard, a plain tensor itself)."""
    return t.to_local() if hasattr(t, "to_local") else t


def tensors(obj, prefix: str = "") -> dict[str, torch.Tensor]:
    """Every tensor of a nested state dict by dotted name (its local shard)."""
    out: dict[str, torch.Tensor] = {}
    if torch.is_tensor(obj):
        out[prefix] = local(obj)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            out.update(tensors(v, f"{prefix}.{k}" if prefix else str(k)))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            out.update(tensors(v, f"{prefix}.{i}"))
    return out


def optimizer_keys(osd: dict, names: list[str], by_name: bool) -> dict:
    """An optimizer state dict keyed by parameter name (`by_name`) or by index into `names` (the
    optimizer's parameter order), whichever it was keyed by before."""
    index = {n: i for i, n in enumerate(names)}
    conv = (lambda k: names[k] if isinstance(k, int) else k) if by_name else (
        lambda k: index[k] if isinstance(k, str) else k)
    return {**osd, "state": {conv(k): v for k, v in (osd.get("state") or {}).items()},
            "param_groups": [{**g, "params": [conv(k) for k in g["params"]]}
                             for g in osd.get("param_groups") or []]}


def adam_steps(optim_sd: dict) -> list[int]:
    """The `step` counts of an optimizer state dict (one per parameter)."""
    return [int(local(v).max()) if torch.is_tensor(v) else int(v)
            for slots in (optim_sd.get("state") or {}).values() for k, v in (slots or {}).items()
            if k == "step" and (torch.is_tensor(v) or isinstance(v, (int, float)))]


def gather(obj) -> list:
    """Every rank's `obj` (plain values), in rank order, on every rank; [obj] without a process group."""
    import torch.distributed as dist

    if not dist.is_initialized():
        return [obj]
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


# ------------------------------------------------------------------------------------- S3


def mirror_part(wait_s: float):
    """`Mirror`'s upload of a sharded checkpoint's part (its job: files, rank, world, manifest)."""
    return lambda folder, uri, store, job: upload_part(folder, uri, store, job["files"], job["rank"],
                                                       job["world"], job["manifest"], wait_s)


def upload_part(folder: Path, uri: str, store, files: dict[str, dict], rank: int, world: int,
                manifest: bytes | None, wait_s: float, poll_s: float = 0.5) -> str:
    """This rank's files of a sharded checkpoint to `uri` (an object already there with the same sha256 and
    size is kept: a retried upload sends only what is missing), then its part record. Rank 0 (`manifest`
    given) then waits up to `wait_s` for every rank's part to list exactly the manifest's entries and writes
    `MANIFEST.json` last; a part still missing or disagreeing then is a StoreError (the mirror retries)."""
    from chunkgrpo.store import StoreError
    from chunkgrpo.store.manifest import MANIFEST_NAME, Manifest

    base = uri.rstrip("/")

    def one(item: tuple[str, dict]) -> None:
        rel, entry = item
        st = store.stat(f"{base}/{rel}")
        if st is not None and st.get("sha256") == entry["sha256"] and int(st["size"]) == int(entry["size"]):
            return
        store.put_file(folder / rel, f"{base}/{rel}", sha256=entry["sha256"])

    with ThreadPoolExecutor(max_workers=max(1, int(getattr(store.config, "workers", 4)))) as pool:
        for _ in pool.map(one, sorted(files.items())):
            pass
    store.put_bytes(json.dumps(files, sort_keys=True).encode(), f"{base}/{PARTS}/rank{rank}.json",
                    content_type="application/json")
    if manifest is None:
        return base
    want = Manifest.from_json(manifest, where=f"{folder}/{MANIFEST_NAME}").files
    deadline = time.monotonic() + wait_s
    while True:
        missing = []
        covered: set[str] = set()
        for r in range(world):
            try:
                part = json.loads(store.get_bytes(f"{base}/{PARTS}/rank{r}.json"))
            except (FileNotFoundError, ValueError):
                missing.append(r)
                continue
            if any(want.get(rel) != {"sha256": e.get("sha256"), "size": e.get("size")}
                   for rel, e in part.items()):
                missing.append(r)  # a part of an earlier upload of this step: not this checkpoint's
                continue
            covered |= set(part)
        if not missing and covered == set(want):
            break
        if time.monotonic() > deadline:
            raise StoreError(f"{base}: the shards of rank(s) {missing or 'unknown'} did not reach S3 within "
                             f"{wait_s:.0f}s; the checkpoint stays incomplete there (no {MANIFEST_NAME})")
        time.sleep(poll_s)
    store.put_bytes(manifest, f"{base}/{MANIFEST_NAME}", content_type="application/json")
    return base


def mark_reading(store, uri: str, who: str, expires_s: float) -> str:
    """A marker under a checkpoint in S3 while it is being read: S3 retention never deletes it meanwhile
    (until `expires_s` after the marker was written, so a crashed reader does not pin it forever)."""
    key = f"{uri.rstrip('/')}/{READERS}/{who}.json"
    store.put_bytes(json.dumps({"time": time.time(), "expires_s": float(expires_s)}).encode(), key,
                    content_type="application/json")
    return key


@contextlib.contextmanager
def reading(store, uri: str):
    """A reading marker under `uri` for the duration of the block (removed after; else it lapses)."""
    marker = mark_reading(store, uri, f"{socket.gethostname()}-{os.getpid()}", READ_MARKER_S)
    try:
        yield
    finally:
        try:
            store.delete(marker)
        except Exception as e:
            log.warning("could not remove the reading marker %s (%s); it lapses by itself", marker,
                        type(e).__name__)


def being_read(store, uri: str, now: float | None = None) -> bool:
    """A live reader's marker is under `uri`."""
    now = time.time() if now is None else now
    for e in store.list(f"{uri.rstrip('/')}/{READERS}/"):
        try:
            m = json.loads(store.get_bytes(store.uri(e.key)))
            if now - float(m["time"]) < float(m["expires_s"]):
                return True
        except (FileNotFoundError, ValueError, KeyError, TypeError):
            continue
    return False


def prune_remote(store, s3_prefix: str, keep: int, *, protect: set[int] = frozenset()) -> list[str]:
    """Delete the complete checkpoints under `s3_prefix` older than the newest `keep` (0 = keep all), each
    whole (`delete_prefix` removes its manifest first, so it is never seen complete with shards missing).
    Never the newest complete one, never one in `protect` (steps) or with a live reader's marker."""
    remote_checkpoints = ckpt.remote_checkpoints
    if keep <= 0:
        return []
    remote = remote_checkpoints(s3_prefix, store)
    steps = sorted(remote)
    deleted = []
    for step in steps[:-keep]:
        uri = remote[step]
        if step in protect or being_read(store, uri):
            continue
        store.delete_prefix(uri + "/")
        deleted.append(uri)
    if deleted:
        log.info("S3 retention (checkpoint.keep=%d): deleted %s", keep,
                 ", ".join(u.rsplit("/", 1)[-1] for u in deleted))
    return deleted


# --------------------------------------------------------------------------- the trainer's state


def state_dicts(t) -> dict:
    """The trainer `t`'s trainable weights, optimizer state and EMA as state dicts of this rank's shards
    (DTensors under FSDP, whole tensors otherwise; nothing gathered): {"model", "optim"[, "ema"]}."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    msd, osd = get_state_dict(t.model.transformer, t.optimizer)
    state = {"model": {n: msd[n] for n in t.trainable_names}, "optim": osd}
    if t.ema is not None:
        state["ema"] = dict(zip(t.trainable_names, t.ema.shadow))
    return state


def _first_failure(e: BaseException) -> str:
    failures = getattr(e, "failures", None) or {}
    for rank, f in sorted(failures.items()):
        inner = getattr(f, "exc", f)
        text = str(inner).strip()
        return f"rank {rank}: {type(inner).__name__}: {text.splitlines()[0][:160] if text else ''}"
    return f"{type(e).__name__}: {str(e).strip()[:160]}"


def save(state: dict, folder: Path) -> None:
    """Every rank writes its shards of `state` into `folder/dcp` (a collective; a failure on any rank is an
    OSError on every rank, naming the rank and its error)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save(state, checkpoint_id=str(folder / DCP_DIR))
    except CheckpointException as e:
        raise OSError(f"writing shards: {_first_failure(e)}") from None


class _MetadataUnpickler(pickle.Unpickler):
    """torch.distributed.checkpoint's `.metadata` is a pickle: only its own record types, torch's sizes,
    dtypes, layouts and memory formats and plain containers are built from it; anything else (a planted
    `__reduce__` payload) is refused, never run."""

    def find_class(self, module: str, name: str):
        plain = (module == "builtins" and name in {"set", "frozenset", "tuple", "list", "dict", "slice"}) or (
            module == "torch.serialization" and name == "_get_layout") or (  # a layout by its name
            module == "pathlib" and name in {"PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"})
        if (module.startswith("torch.distributed.checkpoint.") and not name.startswith("_load")) or plain or (
                module == "collections" and name == "OrderedDict") or (
                module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None),
                                                                    (torch.dtype, torch.layout,
                                                                     torch.memory_format)))):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name} is not allowed in checkpoint metadata")


def _reader(path: Path):
    """A FileSystemReader whose metadata is read by `_MetadataUnpickler`."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            with open(Path(self.path) / ".metadata", "rb") as f:
                metadata = _MetadataUnpickler(f).load()
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return Reader(str(path))


def _planner():
    """The default load planner, reading non-tensor items (optimizer param groups) as plain types only."""
    from torch.distributed.checkpoint._traverse import set_element
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class Planner(DefaultLoadPlanner):
        def load_bytes(self, read_item, value):
            value = torch.load(value, weights_only=True)
            if self.flatten_state_dict:
                set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], value)
            else:
                self.state_dict[read_item.dest_index.fqn] = value

    return Planner()


def load(t, folder: Path, step: int, ema: bool) -> dict:
    """The shards this rank needs, read into copies of its state dicts (resharded when another world size
    wrote them); the live model and optimizer are untouched until `apply`. Raises CorruptCheckpointError
    (unreadable, a tensor not finite, an optimizer step count other than `step`, an EMA missing) or
    UserError (the checkpoint lacks trainable parameters: LoRA vs full). Collective: every rank calls it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from chunkgrpo.errors import UserError
    CorruptCheckpointError, non_finite = ckpt.CorruptCheckpointError, ckpt.non_finite
    name = folder.name
    try:
        keys = _reader(folder / DCP_DIR).read_metadata().state_dict_metadata
    except Exception as e:
        raise CorruptCheckpointError(f"{name}/{METADATA}: {type(e).__name__}: {str(e)[:160]}") from None
    missing = [n for n in t.trainable_names if f"model.{n}" not in keys]
    if missing:
        raise UserError(f"checkpoint {folder} lacks trainable parameters {missing[:3]} (LoRA/full mismatch?)")
    if ema and not any(k.startswith("ema.") for k in keys):
        raise CorruptCheckpointError(f"{name}/{DCP_DIR}: no EMA, but the run that wrote it kept one")
    fresh = not t.optimizer.state
    state = tree_map(lambda x: x.detach().clone(), state_dicts(t))
    if fresh:  # get_state_dict initialised the moments (a zero step); a rejected checkpoint leaves none
        t.optimizer.state.clear()
    if not ema:
        state.pop("ema", None)
    try:
        dcp.load(state, storage_reader=_reader(folder / DCP_DIR), planner=_planner())
    except CheckpointException as e:
        raise CorruptCheckpointError(f"{name}/{DCP_DIR}: {_first_failure(e)}") from None
    bad = non_finite(tensors(state))
    if bad:
        raise CorruptCheckpointError(f"{name}/{DCP_DIR}: non-finite values in {len(bad)} tensor(s), "
                                     f"e.g. {bad[0]}")
    steps = adam_steps(state["optim"])
    if steps and max(steps) != step:
        raise CorruptCheckpointError(f"{name}/trainer_state.json: optimizer_step={step} but {DCP_DIR} holds "
                                     f"an optimizer that has taken {max(steps)} steps")
    return state


def apply(t, state: dict, ema_updates: int) -> None:
    """Load what `load` read into the trainer's model, optimizer and EMA."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

    if t.ema is not None and "ema" in state:
        t.ema.shadow = [state["ema"][n].float() for n in t.trainable_names]
        t.ema.updates = int(ema_updates)
    set_state_dict(t.model.transformer, t.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=StateDictOptions(strict=False))


class _Collectives:
    """any-rank / gather / broadcast on the default group (the training thread) or on the checkpoint's own
    gloo group (the commit thread of an asynchronous save, beside training's collectives)."""

    def __init__(self, device, group=None):
        self.device, self.group = device, group

    def any(self, flag: bool) -> bool:
        import torch.distributed as dist

        if self.group is None:
            return D.any_rank(flag, self.device)
        t = torch.tensor([1.0 if flag else 0.0])
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=self.group)
        return bool(t.item() > 0)

    def gather(self, obj) -> list:
        import torch.distributed as dist

        if self.group is None:
            return gather(obj)
        out = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(out, obj, group=self.group)
        return out


class Pending:
    """An asynchronous save: its shards are being written by torch.distributed.checkpoint's thread; this
    rank's commit thread then hashes its files and commits the checkpoint with the other ranks (manifest,
    rename, mirror) on the checkpoint's own process group, while training goes on."""

    def __init__(self, cp, future, staging: Path, step: int):
        self.error: BaseException | None = None
        self.final: Path | None = None
        self.step = step
        self.thread = threading.Thread(target=self._run, args=(cp, future, staging, step), daemon=True,
                                       name="checkpoint-commit")
        self.thread.start()

    def _run(self, cp, future, staging: Path, step: int) -> None:
        try:
            error = None
            try:
                future.result()
            except BaseException as e:  # CheckpointException is a BaseException
                error = ckpt.CheckpointWriteError(
                    f"cannot write checkpoint {staging.name}: {_first_failure(e)}; the last complete "
                    "checkpoint is intact")
            self.final = commit(cp, staging, step, error, _Collectives(cp.t.info.device, cp.async_group))
        except BaseException as e:
            self.error = e


def complete_pending(cp) -> Path | None:
    """Wait for the asynchronous save in flight, if any (every rank calls it): its error, if it failed on
    any rank, is raised here on every rank, as a synchronous save would have."""
    pending, cp.pending = cp.pending, None
    if pending is None:
        return None
    pending.thread.join()
    if D.any_rank(pending.error is not None, cp.t.info.device):
        raise pending.error or ckpt.CheckpointWriteError(
            f"checkpoint step {pending.step} failed on another rank (see its log)")
    return pending.final


def save_checkpoint(cp) -> Path | None:
    """A checkpoint of the Checkpointer `cp`'s trainer under FSDP (all ranks call it): every rank writes
    its shards and RNG state and hashes its own files; rank 0 writes the scheduler and trainer state, then
    the manifest from every rank's entries, then renames. Each rank's mirror uploads its own files; rank
    0's writes the S3 manifest last. With `checkpoint.async_save` the shards are copied to host memory
    and written in the background (`Pending`), and None is returned; the previous asynchronous save is
    completed first, so at most one is in flight."""
    complete_pending(cp)
    t, info = cp.t, cp.t.info
    state = state_dicts(t)
    bad = ckpt.non_finite(tensors(state))
    if D.any_rank(bool(bad), info.device):
        raise NonFiniteLossError(
            f"non-finite values at optimizer step {t.opt_step} "
            f"({f'{len(bad)} tensors, e.g. {bad[0]}' if bad else 'on another rank'}); checkpoint not "
            f"written — the last complete one in {cp.root} is intact")
    staging = ckpt.staging_path(cp.root, t.opt_step)
    with ckpt.writing(staging) as failed:
        if lead(cp):
            ckpt.stage_dir(cp.root, t.opt_step)
    if not D.any_rank(failed.error is not None, info.device):
        with ckpt.writing(staging) as failed:
            (staging / "rng").mkdir(parents=True, exist_ok=True)
            torch.save(ckpt.rng_state(), staging / "rng" / f"rank{info.rank}.pt")
            if info.is_main:
                cp._write_shared(staging, fmt="dcp")
        if not D.any_rank(failed.error is not None, info.device):
            if cp.async_group is not None:
                import torch.distributed.checkpoint as dcp

                future = dcp.async_save(state, checkpoint_id=str(staging / DCP_DIR),
                                        process_group=cp.async_group)
                cp.pending = Pending(cp, future, staging, t.opt_step)
                return None
            with ckpt.writing(staging) as failed:
                save(state, staging)  # collective: raises on every rank if one fails
    return commit(cp, staging, t.opt_step, failed.error, _Collectives(info.device))


def lead(cp) -> bool:
    """This rank writes its folder's shared parts: rank 0, and under `node_local` each node's local rank 0."""
    info = cp.t.info
    return info.is_main or (cp.node_local and info.local_rank == 0)


def prune_node(cp, coll: _Collectives) -> BaseException | None:
    """Every node's retention of its parts (collective: the steps any rank's mirror still has to upload)."""
    pending = [ckpt.step_of(p) for p in cp.mirror.pending()] if cp.mirror is not None else []
    failing = cp.mirror is not None and cp.mirror.failing
    every = coll.gather((pending, failing))
    if not lead(cp):
        return None
    c = cp.cfg.checkpoint
    try:
        nodes.prune_parts(cp.root, c.keep, {s for p, _ in every for s in p}, any(f for _, f in every),
                          c.mirror_backlog)
    except ckpt.MirrorBacklogError as e:
        return e
    return None


def commit(cp, staging: Path, step: int, error: BaseException | None, coll: _Collectives) -> Path | None:
    """After every rank wrote its files: each hashes its own, rank 0 writes the manifest from all the
    entries and renames, every rank queues its files for the S3 mirror. Collective over `coll`."""
    info = cp.t.info
    entries: dict = {}
    if not coll.any(error is not None):
        with ckpt.writing(staging) as failed:
            entries = hash_files(staging, own_files(staging, info.rank))
        error = failed.error
    if coll.any(error is not None):
        if lead(cp):
            shutil.rmtree(staging, ignore_errors=True)
        raise error or ckpt.CheckpointWriteError("checkpoint write failed on another rank (see its log)")
    node = nodes.node_of(info.rank, info.local_rank)
    every = coll.gather((node, entries))  # the entries meet on every rank through the process group
    files = {rel: e for _, part in every for rel, e in part.items()}
    meta = {"kind": "checkpoint", "step": step, "format": "dcp", "world_size": info.world}
    manifest = None
    if cp.node_local:  # rank 0's manifest (its creation time) is every node's record of the checkpoint
        from chunkgrpo.store.manifest import Manifest, _now

        manifest = coll.gather(Manifest(files=dict(files), created=_now(), meta=meta).to_json()
                               if info.is_main else None)[0]
    final = None
    if lead(cp):
        try:
            if cp.node_local:
                mine = {rel: e for n, part in every if n == node for rel, e in part.items()}
                final = nodes.finalize_part(staging, cp.root, step, manifest, mine)  # retention: prune_node
            else:
                final = ckpt.finalize(staging, cp.root, step, meta, cp.cfg.checkpoint.keep,
                                      mirror=cp.mirror, backlog=cp.cfg.checkpoint.mirror_backlog,
                                      files=files)
        except ckpt.MirrorBacklogError as e:
            error, final = e, ckpt.step_dir(cp.root, step)
        except OSError as e:
            shutil.rmtree(staging, ignore_errors=True)
            error = ckpt.CheckpointWriteError(
                f"cannot write checkpoint {staging.name}: {ckpt._short(e)}; the last complete checkpoint "
                f"in {cp.root} is intact")
    committed = all(coll.gather(final is not None or not lead(cp)))
    if committed and cp.mirror is not None:
        path = ckpt.step_dir(cp.root, step)
        if info.is_main and manifest is None:
            manifest = (path / ckpt.MANIFEST).read_bytes()
        cp.mirror.submit(path, {"files": entries, "rank": info.rank, "world": info.world,
                                "manifest": manifest if info.is_main else None})
    if cp.node_local:
        pruned = prune_node(cp, coll)
        error = error or pruned
    if coll.any(error is not None):
        if error is not None:
            raise error
        raise ckpt.MirrorBacklogError("rank 0 stopped: checkpoints are not reaching S3 (see its log)")
    return final if committed else None
