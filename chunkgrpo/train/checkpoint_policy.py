"""The trainer's checkpoint policy: what a resumed run must share with its checkpoint, which checkpoint
to resume (the newest that verifies, local or in S3), restoring the trainer's state from it, saving it
(every rank collective; rank 0 writes, or under FSDP every rank its shards, on several nodes into its
own node's folder: `checkpoint_nodes`; manifest last), and the S3 mirror's lifetime.

`chunkgrpo.train.checkpoint_format` is what a checkpoint IS (the folder format, verification, pruning, the
background S3 mirror); this module is how the trainer USES it. A `Checkpointer` is built by the trainer
in `setup()` and reads and writes the trainer's state (model, optimizer, scheduler, EMA, counters).

Size note: ~615 lines on purpose: choosing, restoring and saving a checkpoint are one flow over the
trainer's state for both layouts (gathered and sharded); the sharded layout's own I/O is
`checkpoint_sharded`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import shutil
import time
from pathlib import Path

import torch

from chunkgrpo.errors import UserError
from chunkgrpo.store import StoreError
from chunkgrpo.train import checkpoint_format as ckpt
from chunkgrpo.train import checkpoint_sharded as sharded
from chunkgrpo.train import dist as D
from chunkgrpo.train.config import TrainConfig
from chunkgrpo.train.context import NonFiniteLossError

log = logging.getLogger(__name__)

# what a resumed run must share with its checkpoint (the rest — length, checkpointing, logging — may
# change); the chunk plan is compared by its sizes (a plan file's path may differ between retries)
RESUME_FIXED = ("model", "method", "lr", "betas", "weight_decay", "warmup_steps", "group_size",
                "timestep_fraction", "seed", "sampling", "rewards", "lora",
                # the objective: another loss is another experiment
                "clip_low", "clip_high", "adv_clip", "kl_coef", "kl_ref_coef", "max_grad_norm", "grad_accum",
                "chunk_weighting", "noise_weight_c", "adv_std", "adv_eps", "reward_weighting", "branch_steps",
                "granularities", "branch_update",
                # the EMA the exported model is, and the data order
                "ema", "prompts_per_rank")


def config_hash(cfg: TrainConfig) -> str:
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:12]


def resume_config(cfg: TrainConfig) -> dict:
    """The RESUME_FIXED fields, recorded in every checkpoint's trainer_state.json."""
    d = cfg.to_dict()
    return {k: d[k] for k in RESUME_FIXED}


def _kept_ema(state: dict) -> bool:
    """The checkpoint's run kept an EMA of the trainable weights (so it must hold ema.safetensors)."""
    ema = (state.get("config") or {}).get("ema")
    return int(state.get("ema_updates") or 0) > 0 or (isinstance(ema, dict) and (ema.get("decay") or 0) > 0)


def prompts_digest(prompts: list[str]) -> str:
    """sha256 of the training prompts (their content and order, not the file's path)."""
    return hashlib.sha256("\n".join(prompts).encode()).hexdigest()


def config_changes(recorded: dict, cfg: TrainConfig) -> list[str]:
    """`key: was → now` for every RESUME_FIXED field (nested ones by dotted name) that differs; a field
    the checkpoint did not record (written before it was fixed) is not compared."""
    from chunkgrpo.tracking import flatten

    was = flatten(recorded)
    now = flatten({k: v for k, v in resume_config(cfg).items() if k in recorded})
    return [f"{k}: {was.get(k)!r} → {now.get(k)!r}" for k in sorted(set(was) | set(now))
            if was.get(k) != now.get(k)]


def bounded_store(timeout_s: float):
    """An S3 client whose every request gives up after `timeout_s` (connect and read; the store's own
    defaults are sized for whole-folder work), one attempt per call: the caller's loop owns the retries."""
    from chunkgrpo.store.client import ArtifactStore, StoreConfig

    base = StoreConfig()
    return ArtifactStore(dataclasses.replace(base, retries=1,
                                             read_timeout_s=min(base.read_timeout_s, timeout_s),
                                             connect_timeout_s=min(base.connect_timeout_s, timeout_s)))


class S3UnreachableError(StoreError):
    """A checkpoint in S3 could not be read (S3 down, the connection cut, a timeout) for
    `checkpoint.s3_wait_s`: the run stops — an unreachable checkpoint is never counted as unverifiable,
    nothing is set aside or deleted, and training never starts from scratch because of it."""


def unreachable(e: BaseException) -> bool:
    """`e` says S3 could not be reached or did not answer (after the store's own retries), as opposed to
    content that was read and is wrong (a checksum mismatch, a bad manifest, a missing object)."""
    from chunkgrpo.store import ChecksumMismatchError
    from chunkgrpo.store.client import classify_error

    if isinstance(e, ChecksumMismatchError):
        return False
    if classify_error(e) == "transient":
        return True
    cause = e.__cause__
    return isinstance(e, StoreError) and cause is not None and classify_error(cause) == "transient"


def download_store(wait_s: float):
    """The resume download's S3 client: the store's retries (a cut transfer resumes at the byte offset
    reached), each request's connect and read timeout bounded like the listing's (s3_wait_s/4, ≤ 30 s)."""
    from chunkgrpo.store.client import ArtifactStore, StoreConfig

    bound = max(1.0, min(30.0, wait_s / 4))
    base = StoreConfig()
    return ArtifactStore(dataclasses.replace(base, read_timeout_s=min(base.read_timeout_s, bound),
                                             connect_timeout_s=min(base.connect_timeout_s, bound)))


def mirror_store(cfg: TrainConfig):
    """The mirror's S3 client: each request bounded by `checkpoint.mirror_timeout_s` (a hung server
    fails the attempt; the store's own read timeout is sized for whole-folder work) and one attempt
    per upload (the mirror's loop retries with backoff and tells pruning it is failing)."""
    return bounded_store(cfg.checkpoint.mirror_timeout_s)


class Checkpointer:
    """Checkpoints of one trainer (`chunkgrpo.train.trainer.Trainer`, after its model, optimizer and
    caches are set up): `resume()` once, `save()` at every checkpoint, `finish()` after the final
    model, `close()` always."""

    def __init__(self, trainer):
        self.t = trainer
        self.cfg: TrainConfig = trainer.cfg
        self.root: Path = trainer.out / "checkpoints"
        self.mirror: ckpt.Mirror | None = None
        info = trainer.info
        if info.local_rank == 0:  # every node's own disk
            self.root.mkdir(parents=True, exist_ok=True)
        D.barrier()
        self.lease = None
        self.config_changes: list[dict] = []  # resumes that changed the config (allow_config_change)
        error: Exception | None = None
        if self.cfg.checkpoint.s3_prefix and info.is_main:
            try:
                self.lease = self.take_lease()
            except (UserError, StoreError) as e:
                error = e
        if D.any_rank(error is not None, info.device):
            raise error or UserError(f"rank 0 could not take the checkpoint writer lease of "
                                     f"{self.cfg.checkpoint.s3_prefix} (see its log)")
        # under FSDP every rank mirrors its own shards; rank 0 (the lease holder) writes the manifest; on
        # several nodes each node's folder holds its ranks' shards (`checkpoint_nodes`)
        self.layout, why = sharded.nodes.layout(trainer._is_fsdp(), info.one_node,
                                                bool(self.cfg.checkpoint.s3_prefix))
        self.sharded, self.node_local = self.layout != "gathered", self.layout == "node-sharded"
        if info.is_main:
            log.info("%s (%d ranks)", why, info.world)
        self.pending = None  # an asynchronous sharded save in flight (`checkpoint_sharded.Pending`)
        self.async_group = None  # its collectives' own gloo group, beside training's
        if self.sharded and self.cfg.checkpoint.async_save:
            import torch.distributed as dist

            self.async_group = dist.new_group(backend="gloo")
        if self.cfg.checkpoint.s3_prefix and (info.is_main or self.sharded):
            c = self.cfg.checkpoint
            self.mirror = ckpt.Mirror(
                c.s3_prefix, store_factory=lambda: mirror_store(self.cfg),
                guard=self.lease.ensure if info.is_main else None,
                upload_part=sharded.mirror_part(max(c.mirror_timeout_s, c.mirror_wait_s)),
                retain=(lambda store: sharded.prune_remote(store, c.s3_prefix, c.keep)) if c.keep else None)

    def take_lease(self):
        """The writer lease of `checkpoint.s3_prefix` (`chunkgrpo.train.lease`), kept alive by a heartbeat:
        another live writer there refuses this run now (UserError naming it). S3 unreachable now: one line,
        and the mirror takes the lease before its first upload instead (training goes on with local
        checkpoints meanwhile, as during any outage; a refusal then stops the mirror, never mixes runs)."""
        from chunkgrpo.train.lease import WriterLease

        cfg = self.cfg.checkpoint
        lease = WriterLease(bounded_store(max(1.0, min(30.0, cfg.s3_wait_s / 4))), cfg.s3_prefix,
                            output_dir=str(self.t.out.resolve()), seed=self.cfg.seed,
                            expires_s=cfg.lease_expiry_s, writer_id=cfg.writer_id)
        try:
            lease.acquire()
            lease.start_heartbeat()
        except StoreError as e:
            if not unreachable(e):
                raise
            log.warning("cannot take the checkpoint writer lease of %s now (%s); the mirror takes it before "
                        "its first upload", cfg.s3_prefix, str(e).splitlines()[0][:200])
        return lease

    # ------------------------------------------------------------------ resume
    def resume(self) -> None:
        """Resume from the newest checkpoint that verifies (every file's size and sha256 against its
        manifest, `.pt` files readable as tensors + plain types only), local or in S3. A checkpoint that
        fails is renamed aside (never deleted) and the next older one is tried; one line says so."""
        t, info = self.t, self.t.info
        remote: dict[int, str] = {}
        if self.cfg.checkpoint.s3_prefix and info.local_rank == 0:
            remote = self.remote_checkpoints()
        local = ([ckpt.step_of(p) for p in ckpt.complete_checkpoints(self.root)]
                 if info.local_rank == 0 else [])
        # (step, source) newest first; the local copy of a step before its S3 copy
        candidates = sorted({(st, "local") for st in local} | {(st, "s3") for st in remote},
                            key=lambda c: (-c[0], c[1] != "local"))
        candidates = D.broadcast_object(candidates)
        rejected: list[str] = []
        for step, source in candidates:
            path = ckpt.step_dir(self.root, step)
            problem, own = "", False  # own: this node's copy failed (only then is it set aside here)
            fatal = ""  # S3 could not be read: stop every rank, set nothing aside
            if info.local_rank == 0:
                try:
                    if source == "s3" or (not ckpt.is_complete(path) and step in remote):
                        self.download(step, remote[step])
                    elif not ckpt.is_complete(path):
                        raise FileNotFoundError(f"{path.name} is not on this node")
                    ckpt.verify(path)
                except S3UnreachableError as e:
                    fatal = str(e)
                except (ckpt.CorruptCheckpointError, OSError) as e:
                    problem, own = str(e), isinstance(e, ckpt.CorruptCheckpointError)
                except Exception as e:
                    from chunkgrpo.store import StoreError

                    if not isinstance(e, (StoreError, UserError)):
                        raise
                    problem = f"{source} copy: {e}"
            if D.any_rank(bool(fatal), info.device):
                raise S3UnreachableError(fatal or f"another node could not read checkpoint {path.name} "
                                         f"from {self.cfg.checkpoint.s3_prefix} (see its log); nothing was "
                                         "set aside")
            data = None
            if not D.any_rank(bool(problem), info.device):
                try:
                    data = ckpt.read(path, info.rank)
                    if not data.sharded and data.ema is None and _kept_ema(data.state):
                        raise ckpt.CorruptCheckpointError(
                            f"{path.name}/ema.safetensors: missing, but the run that wrote it kept an EMA")
                except ckpt.CorruptCheckpointError as e:
                    problem, own = str(e), True
                if D.any_rank(bool(problem), info.device):
                    data = None
                    problem = problem or "unreadable on another rank"
                elif data.sharded:  # every rank reads its shards (collective), checked before any is applied
                    try:
                        data.shards = sharded.load(t, path, int(data.state["optimizer_step"]),
                                                   _kept_ema(data.state) and t.ema is not None)
                    except ckpt.CorruptCheckpointError as e:
                        problem, own = str(e), True
                    if D.any_rank(bool(problem), info.device):
                        data = None
                        problem = problem or "unreadable on another rank"
            else:
                problem = problem or "failed verification on another node"
            if data is None:
                aside = ""
                if own and info.local_rank == 0 and path.exists():
                    aside = str(ckpt.set_aside(path))
                D.barrier()
                if own or info.is_main:
                    log.warning("checkpoint %s (%s) is unusable: %s%s", path.name, source, problem,
                                f"; kept aside as {aside}" if aside else "")
                rejected.append(path.name)
                continue
            self.apply(data)
            if info.is_main:
                newer = ", ".join(dict.fromkeys(rejected))
                older = f" (newer {newer} failed verification, see above)" if rejected else ""
                log.info("resumed from %s (iteration %d, optimizer step %d)%s", path, t.iteration_idx,
                         t.opt_step, older)
                if rejected:
                    log.warning("fell back to %s: the newer checkpoint(s) %s failed verification and were "
                                "set aside", path.name, newer)
                if self.mirror is not None:  # local checkpoints that never reached S3 (an earlier outage)
                    for p in ckpt.complete_checkpoints(self.root):
                        if ckpt.step_of(p) not in remote:
                            self.mirror.submit(p)
            return
        if rejected and info.is_main:
            log.warning("no checkpoint verifies (%s set aside); starting from scratch", ", ".join(rejected))

    def download(self, step: int, uri: str, sleep=time.sleep) -> Path:
        """Fetch the S3 checkpoint `uri` into `root/step-N`. While S3 cannot be read (down, the connection
        cut mid-download, timing out) it is retried with backoff (1 s doubling to 30 s) for
        `checkpoint.s3_wait_s`, then S3UnreachableError in one line naming the endpoint, the checkpoint and
        the cause: a checkpoint that could not be read is never taken for one that fails verification.
        Content that was read and is wrong (checksum, manifest) raises as before, for the caller to reject."""
        cfg = self.cfg.checkpoint
        store = download_store(cfg.s3_wait_s)
        t0, delay = time.monotonic(), 1.0
        while True:
            try:  # the marker keeps S3 retention (of any writer of this prefix) off it while it is read
                with sharded.reading(store, uri):
                    if sharded.nodes.is_part(ckpt.step_dir(self.root, step)):  # this node's part: the rest
                        return sharded.nodes.fill_part(uri, self.root, step, store)
                    return ckpt.download(uri, self.root, step, store)
            except Exception as e:
                if not unreachable(e):
                    raise
                error = e
            waited = time.monotonic() - t0
            if waited + delay > cfg.s3_wait_s:
                break
            log.warning("cannot download checkpoint %s (%s); retrying in %.0fs (checkpoint.s3_wait_s=%.0f)",
                        uri, str(error).splitlines()[0][:200], delay, cfg.s3_wait_s)
            sleep(delay)
            delay = min(30.0, delay * 2)
        reason = ckpt._short(error.__cause__ or error)
        raise S3UnreachableError(
            f"cannot read checkpoint {uri} from S3 at {store.config.url} for {time.monotonic() - t0:.0f}s "
            f"({reason}); nothing was set aside or deleted — re-run once S3 answers "
            f"(checkpoint.s3_wait_s={cfg.s3_wait_s:.0f})")

    def remote_checkpoints(self, sleep=time.sleep) -> dict[int, str]:
        """The S3 checkpoints, retried with exponential backoff (1 s doubling to 30 s) for
        `checkpoint.s3_wait_s` while S3 is unreachable or hung (each request bounded by a read timeout
        of s3_wait_s/4 capped at 30 s, not the store's upload-sized one). Still unreachable then: with
        local checkpoints, one line and those are used; without, one line and a StoreError — never a
        silent start from scratch while S3 may hold this run's checkpoints."""
        from chunkgrpo.store import StoreError

        cfg = self.cfg.checkpoint
        store = bounded_store(max(1.0, min(30.0, cfg.s3_wait_s / 4)))
        t0, delay = time.monotonic(), 1.0
        while True:
            try:
                return ckpt.remote_checkpoints(cfg.s3_prefix, store)
            except StoreError as e:
                error = e
            waited = time.monotonic() - t0
            if waited + delay > cfg.s3_wait_s:
                break
            log.warning("cannot list checkpoints at %s (%s); retrying in %.0fs (checkpoint.s3_wait_s=%.0f)",
                        cfg.s3_prefix, str(error).splitlines()[0][:200], delay, cfg.s3_wait_s)
            sleep(delay)
            delay = min(30.0, delay * 2)
        waited = time.monotonic() - t0
        reason = str(error).splitlines()[0][:300]
        if ckpt.complete_checkpoints(self.root):
            log.warning("S3 unreachable for %.0fs (%s): resuming from the local checkpoints in %s; S3 may "
                        "hold newer ones", waited, reason, self.root)
            return {}
        raise StoreError(f"cannot list checkpoints at {cfg.s3_prefix} for {waited:.0f}s ({reason}); refusing "
                         "to start from scratch while S3 may hold this run's checkpoints — re-run once S3 "
                         "answers, or checkpoint.resume=false to start over") from None

    def apply(self, data: ckpt.CheckpointData) -> None:
        """The trainer's state from a read checkpoint, after checking it belongs to this run."""
        t, state = self.t, data.state
        limit_steps = t.num_iterations * t.steps_per_iteration
        if state["optimizer_step"] > limit_steps or state["iteration"] > t.num_iterations:
            total, _, unit = t._progress()
            raise UserError(f"checkpoint {data.path} is at optimizer_step={state['optimizer_step']} "
                            f"(iteration {state['iteration']}), beyond this run's end ({total} {unit}s); "
                            "raise max_steps/max_iterations or use another output_dir")
        changes = config_changes(state["config"], self.cfg) if isinstance(state.get("config"), dict) else []
        if isinstance(state.get("chunk_sizes"), list) and state["chunk_sizes"] != t.plan.sizes:
            changes.append(f"chunk sizes: {state['chunk_sizes']} → {t.plan.sizes}")
        digest = prompts_digest(t.prompts)
        if isinstance(state.get("prompts_sha256"), str) and state["prompts_sha256"] != digest:
            changes.append(f"prompts (sha256): {state['prompts_sha256'][:12]} → {digest[:12]}")
        if changes and not self.cfg.checkpoint.allow_config_change:
            raise UserError(f"checkpoint {data.path} was trained with another config ({'; '.join(changes)}); "
                            "refusing to resume (checkpoint.allow_config_change=true to resume anyway, or "
                            "another output_dir)")
        self.config_changes = list(state.get("config_changes") or [])
        if changes:  # allowed: recorded in every later checkpoint's trainer_state.json
            self.config_changes.append({"at_optimizer_step": int(state["optimizer_step"]),
                                        "from": data.path.name, "changes": changes, "time": time.time()})
            log.warning("resuming %s with a changed config (checkpoint.allow_config_change=true): %s",
                        data.path, "; ".join(changes))
        if state.get("config_hash") != config_hash(self.cfg):
            log.warning("resuming from %s written with a different config (hash %s, now %s)", data.path,
                        state.get("config_hash"), config_hash(self.cfg))
        if data.sharded:
            sharded.apply(t, data.shards, int(state.get("ema_updates", 0)))
        else:
            missing = [n for n in t.trainable_names if n not in data.weights]
            if missing:
                raise UserError(f"checkpoint {data.path} lacks trainable parameters {missing[:3]} "
                                "(LoRA/full mismatch?)")
            self._load_trainable(data.weights)
            self._load_optimizer(data.optimizer)
        t.scheduler.load_state_dict(data.scheduler)
        if data.rng is not None:
            ckpt.set_rng_state(data.rng)
        if t.ema is not None and data.ema is not None:
            self._load_ema(data.ema, int(state.get("ema_updates", 0)))
        t.iteration_idx = int(state["iteration"])
        t.opt_step = int(state["optimizer_step"])
        t.history = state.get("history", [])

    def _load_ema(self, weights: dict[str, torch.Tensor], updates: int) -> None:
        """Checkpoint EMA → shadow: load it into the parameters, capture, put the trained weights back."""
        t = self.t
        trained = {n: w for n, w in zip(t.trainable_names, (p.detach().clone() for p in t.trainable))}
        self._load_trainable(weights)
        t.ema.capture(updates)
        with torch.no_grad():
            for n, p in zip(t.trainable_names, t.trainable):
                p.copy_(trained[n])

    def _load_trainable(self, weights: dict[str, torch.Tensor]) -> None:
        t = self.t
        tr = t.model.transformer
        if t._is_fsdp():
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(tr, {n: weights[n] for n in t.trainable_names},
                                 options=StateDictOptions(full_state_dict=True, strict=False))
            return
        named = dict(tr.named_parameters())
        with torch.no_grad():
            for n in t.trainable_names:
                named[n].copy_(weights[n].to(named[n].device, named[n].dtype))

    def _optimizer_state(self) -> dict:
        t = self.t
        if t._is_fsdp():
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            return get_optimizer_state_dict(t.model.transformer, t.optimizer,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return t.optimizer.state_dict()

    def _load_optimizer(self, state: dict) -> None:
        """A full optimizer state, keyed by parameter index (a single process or DDP wrote it) or by name
        (FSDP): converted to what this run's layout loads, so either resumes on any world size."""
        t = self.t
        state = sharded.optimizer_keys(state, t.trainable_names, by_name=t._is_fsdp())
        if t._is_fsdp():
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(t.model.transformer, t.optimizer, state,
                                     options=StateDictOptions(full_state_dict=True))
            return
        t.optimizer.load_state_dict(state)

    # ------------------------------------------------------------------ save
    def _write_files(self, staging: Path, weights: dict, ema_weights: dict | None, optim: dict) -> None:
        """Rank 0's files of a checkpoint, into its staging folder (the manifest comes later)."""
        from safetensors.torch import save_file

        save_file(weights, str(staging / "trainable.safetensors"))
        if ema_weights is not None:
            save_file(ema_weights, str(staging / "ema.safetensors"))
        torch.save(optim, staging / "optimizer.pt")
        self._write_shared(staging)

    def _write_shared(self, staging: Path, fmt: str = "full") -> None:
        """Rank 0's scheduler and trainer state (both layouts)."""
        t = self.t
        torch.save(t.scheduler.state_dict(), staging / "scheduler.pt")
        state = {"format": fmt, "iteration": t.iteration_idx, "optimizer_step": t.opt_step,
                 "config_hash": config_hash(self.cfg), "config": resume_config(self.cfg),
                 "history": t.history,
                 "world_size": t.info.world, "chunk_sizes": t.plan.sizes,
                 "prompts_sha256": prompts_digest(t.prompts), "config_changes": self.config_changes,
                 "ema_updates": t.ema.updates if t.ema is not None else 0}
        (staging / "trainer_state.json").write_text(json.dumps(state, indent=1))

    def save(self) -> Path | None:
        """All ranks call this; rank 0 writes (under FSDP every rank its shards:
        `checkpoint_sharded.save_checkpoint`); manifest last. Weights and optimizer state must be finite:
        a NaN/inf is never committed (NonFiniteLossError instead, the previous checkpoint stays the
        latest). A full or read-only file system is one line (CheckpointWriteError), the staging folder
        removed."""
        if self.sharded:
            return sharded.save_checkpoint(self)
        t, info = self.t, self.t.info
        ema_weights = None
        if t.ema is not None:  # clone: without FSDP the state dict aliases the live parameters
            with t.ema.swapped():
                ema_weights = {k: v.clone() for k, v in t._trainable_state().items()}
        weights = t._trainable_state()
        optim = self._optimizer_state()
        bad = []
        if info.is_main:
            bad = (ckpt.non_finite(weights) + ckpt.non_finite(ckpt.optimizer_tensors(optim))
                   + [f"ema:{n}" for n in ckpt.non_finite(ema_weights or {})])
        if D.any_rank(bool(bad), info.device):
            raise NonFiniteLossError(
                f"non-finite values at optimizer step {t.opt_step} "
                f"({f'{len(bad)} tensors, e.g. {bad[0]}' if bad else 'on rank 0'}); checkpoint not written — "
                f"the last complete one in {self.root} is intact")
        staging = ckpt.staging_path(self.root, t.opt_step)
        final, error = None, None
        with ckpt.writing(staging) as failed:
            if info.is_main:
                ckpt.stage_dir(self.root, t.opt_step)
        if D.any_rank(failed.error is not None, info.device):  # rank 0 has a fresh staging folder
            if info.is_main:
                shutil.rmtree(staging, ignore_errors=True)
            raise failed.error or ckpt.CheckpointWriteError("rank 0 could not create the staging folder")
        if info.one_node:
            with ckpt.writing(staging) as failed:
                torch.save(ckpt.rng_state(), staging / "rng" / f"rank{info.rank}.pt")
        else:  # each node has its own disk: rank 0 writes every rank's RNG file into its folder
            import torch.distributed as dist

            states: list = [None] * info.world
            dist.all_gather_object(states, ckpt.rng_state())
            with ckpt.writing(staging) as failed:
                if info.is_main:
                    for r, state in enumerate(states):
                        torch.save(state, staging / "rng" / f"rank{r}.pt")
        if info.is_main and failed.error is None:
            with ckpt.writing(staging) as failed:
                self._write_files(staging, weights, ema_weights, optim)
        if D.any_rank(failed.error is not None, info.device):
            if info.is_main:
                shutil.rmtree(staging, ignore_errors=True)
            raise failed.error or ckpt.CheckpointWriteError(
                "checkpoint write failed on another rank (see its log)")
        if info.is_main:  # every rank's RNG file is in place (the all-reduce above)
            mirror = self.mirror
            try:
                final = ckpt.finalize(staging, self.root, t.opt_step,
                                      {"kind": "checkpoint", "step": t.opt_step}, self.cfg.checkpoint.keep,
                                      mirror=mirror, backlog=self.cfg.checkpoint.mirror_backlog)
            except ckpt.MirrorBacklogError as e:
                error = e
                final = ckpt.step_dir(self.root, t.opt_step)
            except OSError as e:  # the manifest or the rename: a full or read-only file system
                shutil.rmtree(staging, ignore_errors=True)
                error = ckpt.CheckpointWriteError(
                    f"cannot write checkpoint {staging.name}: {ckpt._short(e)}; the last complete "
                    f"checkpoint in {self.root} is intact")
                final = None
            if mirror is not None and final is not None:
                mirror.submit(final)
        if D.any_rank(error is not None, info.device):
            if error is not None:
                raise error
            raise ckpt.MirrorBacklogError("rank 0 stopped: checkpoints are not reaching S3 (see its log)")
        return final

    # ------------------------------------------------------------------ end of training
    def final_first(self) -> None:
        """Before the last checkpoint (every rank): with `checkpoint.final_uri`, its upload waits until the
        final model is in S3 (`finish`), so a job stopped during the long checkpoint uploads has its model."""
        if self.mirror is not None and self.cfg.checkpoint.final_uri:
            self.mirror.hold()

    def _upload_final(self, final: Path | None) -> None:
        """Rank 0 uploads the final model to `checkpoint.final_uri` (manifest last); every rank then lets
        its mirror go on with the checkpoints held back by `final_first`."""
        cfg, info = self.cfg.checkpoint, self.t.info
        error = None
        if cfg.final_uri and info.is_main and final is not None:
            from chunkgrpo.store.client import ArtifactStore

            try:
                ArtifactStore().put_folder(final, cfg.final_uri, meta={"kind": "model"})
            except StoreError as e:
                error = e
        if self.mirror is not None:
            self.mirror.release()
        if cfg.final_uri and D.any_rank(error is not None, info.device):
            raise error or StoreError(f"rank 0 could not upload the final model to {cfg.final_uri}")

    def finish(self, final: Path | None = None) -> None:
        """End of training (every rank): every checkpoint must reach S3 within a wait sized from the bytes
        this rank still has to upload at `checkpoint.mirror_min_mb_s` plus `checkpoint.mirror_wait_s`,
        else fail loudly — the local checkpoints are intact and re-running the same command retries the
        upload. Once all are in S3, the local ones beyond `checkpoint.keep` (held back while S3 was down)
        are deleted."""
        sharded.complete_pending(self)  # the last asynchronous save is committed (and queued) first
        self._upload_final(final)
        cfg = self.cfg.checkpoint
        if not cfg.s3_prefix:
            return
        drained, budget = True, 0.0
        if self.mirror is not None:
            budget = ckpt.mirror_budget_s(self.mirror.pending_bytes(), cfg.mirror_min_mb_s, cfg.mirror_wait_s)
            drained = self.mirror.wait(budget)
        if D.any_rank(not drained, self.t.info.device):
            from chunkgrpo.store import StoreError

            if drained:
                raise StoreError(f"training finished but another rank's checkpoint shards did not reach "
                                 f"{cfg.s3_prefix} (see its log); they are intact in {self.root} — re-run to "
                                 "retry the upload")
            left = [p.name for p in self.mirror.pending()]
            raise StoreError(
                f"training finished (final model in {self.t.out / 'final'}) but {', '.join(left)} "
                f"did not reach {cfg.s3_prefix} within {budget:.0f}s "
                f"({self.mirror.last_error or 'too slow'}; "
                f"checkpoint.mirror_min_mb_s={cfg.mirror_min_mb_s:g}); "
                f"they are intact in {self.root} — re-run to retry the upload"
            )
        if self.node_local and sharded.lead(self):  # every part is in S3: each node keeps its newest
            sharded.nodes.prune_parts(self.root, cfg.keep, set(), False, cfg.mirror_backlog)
        if not sharded.lead(self):
            return
        # what `checkpoint.keep` held back during an outage can go now that it is in S3
        ckpt.prune(self.root, cfg.keep, self.mirror, cfg.mirror_backlog)
        if not self.t.info.is_main:
            return
        if self.lease is not None:  # every checkpoint is in S3: the prefix is free for another run
            self.lease.release()
            self.lease = None

    def close(self) -> None:
        if self.pending is not None:  # a stop (SIGTERM, an error) lets the save in flight finish, bounded
            self.pending.thread.join(timeout=self.cfg.checkpoint.mirror_timeout_s)
        if self.mirror is not None:
            self.mirror.close(timeout=0)  # an unfinished upload has no manifest in S3: never read as complete
        if self.lease is not None:  # unfinished: the lease stays (a retry of this run takes it back) and
            self.lease.stop()       # expires checkpoint.lease_expiry_s after its last heartbeat
