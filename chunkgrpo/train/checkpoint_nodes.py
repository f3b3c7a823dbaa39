"""Sharded checkpoints across nodes that each have their own disk (FSDP with torchrun's
`LOCAL_WORLD_SIZE` < `WORLD_SIZE`, each pod with its own `/cache`).

Every rank writes its shards into its own node's `checkpoints/step-N/` (torch.distributed.checkpoint
writes each rank's file where that rank runs; the write results reach the coordinator through the process
group, and rank 0 writes `dcp/.metadata`, `scheduler.pt` and `trainer_state.json` on node 0). The ranks'
file entries (sha256, size) meet on rank 0 through the process group, not through a shared folder; rank 0
builds the checkpoint's manifest and every node receives it. A node's folder then holds its ranks' files
and `PART.json` — that manifest, listing every node's files — instead of `MANIFEST.json`: it is a node's
part, never complete by itself and never resumed from as it is.

The checkpoint is complete only in S3, under the rule of every sharded checkpoint: each rank uploads its
own files and `.parts/rank{r}.json`; rank 0 writes the S3 manifest once every rank's part is there. A
resume fetches into each node's folder the files its part lacks (the files it holds are kept when their
sha256 matches the S3 manifest), then every file is verified and torch.distributed.checkpoint reads it
on any world size.

Without `checkpoint.s3_prefix` there is no place where the nodes' parts meet, so such a run gathers its
checkpoints to rank 0 instead (`layout`).
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

from chunkgrpo.train import checkpoint_format as ckpt

log = logging.getLogger(__name__)
PART = "PART.json"


def layout(fsdp: bool, one_node: bool, s3: bool) -> tuple[str, str]:
    """(layout, the log line saying why): "gathered" (rank 0 writes the whole state), "sharded" (one
    node: every rank writes its shards into the one folder) or "node-sharded" (each node's ranks into
    that node's folder, complete in S3)."""
    if not fsdp:
        return "gathered", "checkpoints: one process or DDP, rank 0 writes the whole state"
    if one_node:
        return "sharded", "checkpoints: sharded, every rank writes its own shards into one folder"
    if s3:
        return "node-sharded", ("checkpoints: sharded across nodes, every rank writes its own shards to its "
                                "node's disk and uploads them; a checkpoint is complete in S3")
    return "gathered", ("checkpoints: gathered to rank 0, the ranks span several nodes and there is no "
                        "checkpoint.s3_prefix where the nodes' shards could meet")


def node_of(rank: int, local_rank: int) -> int:
    """A node's id: the rank of its local rank 0 (torchrun numbers a node's ranks consecutively)."""
    return rank - local_rank


def is_part(path: Path) -> bool:
    return (path / PART).is_file() and not ckpt.is_complete(path)


def parts(root: Path) -> list[Path]:
    """This node's parts `step-N` (oldest first)."""
    if not root.exists():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and ckpt._STEP_RE.match(p.name) and is_part(p)),
                  key=ckpt.step_of)


def finalize_part(staging: Path, root: Path, step: int, manifest: bytes, files: dict[str, dict]) -> Path:
    """A node's part: its files must be exactly `files` ({rel: {sha256, size}} of its ranks), then
    `PART.json` (the whole checkpoint's manifest) and an atomic rename to `step-N`."""
    from chunkgrpo.store.manifest import require_files

    require_files(staging, files, "this node's ranks' file lists disagree with its folder")
    tmp = staging / (PART + ".tmp")
    tmp.write_bytes(manifest)
    tmp.replace(staging / PART)
    final = ckpt.step_dir(root, step)
    if final.exists():
        ckpt.set_aside(final)
    staging.rename(final)
    return final


def prune_parts(root: Path, keep: int, pending: set[int], failing: bool, backlog: int) -> list[Path]:
    """This node's retention of its parts: the newest is kept, and each one some rank's mirror has not
    yet uploaded (a part already in S3 is downloaded again when needed; one that never reached it is
    no checkpoint); a complete copy a resume fetched is kept until a newer part is written. More than
    `backlog` parts beyond `keep` still waiting while the mirror is failing is MirrorBacklogError
    (nothing is deleted). `keep` = 0 keeps all."""
    if keep <= 0:
        return []
    found = parts(root)
    held = [p for p in found[:-keep] if ckpt.step_of(p) in pending]
    if failing and len(held) > backlog:
        raise ckpt.MirrorBacklogError(
            f"checkpoint.keep={keep}: this node's parts {', '.join(p.name for p in held)} have not reached "
            f"S3 (checkpoint.mirror_backlog={backlog}); stopping instead of losing them — they are intact "
            f"in {root}")
    newest = ckpt.step_of(found[-1]) if found else -1
    fetched = [p for p in ckpt.complete_checkpoints(root) if ckpt.step_of(p) < newest]
    doomed = [p for p in found[:-1] + fetched if ckpt.step_of(p) not in pending]
    for p in doomed:
        shutil.rmtree(p, ignore_errors=True)
    return doomed


def fill_part(uri: str, root: Path, step: int, store) -> Path:
    """Complete this node's part of step `step` from its S3 copy `uri`: the files the part holds are kept
    where their size and sha256 match the S3 manifest, the others are downloaded (checksums verified),
    then `MANIFEST.json` is written. A failure puts the part back as it was (less any file found wrong)."""
    from chunkgrpo.store import IncompleteArtifactError
    from chunkgrpo.store.manifest import MANIFEST_NAME, file_sha256

    base = uri.rstrip("/")
    manifest = store.read_manifest(base)
    if manifest is None:
        raise IncompleteArtifactError(f"{base} is not a complete checkpoint in S3 (no {MANIFEST_NAME})")
    part = ckpt.step_dir(root, step)
    staging = root / f".download-step-{step:06d}"
    if staging.exists():
        shutil.rmtree(staging)
    record = (part / PART).read_bytes()
    part.rename(staging)
    (staging / PART).unlink()
    kept = fetched = 0
    try:
        for rel, entry in sorted(manifest.files.items()):
            f = staging / rel
            if f.is_file() and f.stat().st_size == int(entry["size"]) and file_sha256(f) == entry["sha256"]:
                kept += int(entry["size"])
                continue
            f.unlink(missing_ok=True)
            store.get_file(f"{base}/{rel}", f, sha256=entry["sha256"], size=int(entry["size"]))
            fetched += int(entry["size"])
        listed = set(manifest.files)
        for f in [f for f in staging.rglob("*") if f.is_file()]:
            if f.relative_to(staging).as_posix() not in listed:
                f.unlink()
        (staging / MANIFEST_NAME).write_bytes(manifest.to_json())
    except BaseException:
        (staging / MANIFEST_NAME).unlink(missing_ok=True)
        (staging / PART).write_bytes(record)
        staging.rename(part)
        raise
    staging.rename(part)
    log.info("completed this node's part of %s from %s: kept %.1f MB on disk, downloaded %.1f MB", part.name,
             base, kept / 1e6, fetched / 1e6)
    return part
