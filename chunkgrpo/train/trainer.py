"""The GRPO training engine: one rollout per iteration, policy updates on chunks (or steps).

Read top to bottom:
  Trainer.__init__   validate everything that can be checked before any GPU time is spent
  Trainer.setup      process group, model (+LoRA / full), FSDP or replicated, optimizer, caches, resume
  Trainer.train      iterations until `max_iterations` rollouts or `max_steps` optimizer steps (exactly one
                     is set); checkpoints; NaN guard
  Trainer.iteration  builds this rank's `IterationContext` and runs the method's iteration
                     (`chunkgrpo.train.methods`: grpo.iteration for chunk/chunk+ws/dance,
                     branching.iteration for tempflow/granular)
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import shutil
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from chunkgrpo import objectives as obj
from chunkgrpo.advantages import resolve_weights
from chunkgrpo.chunks import load_plan, plan_chunks
from chunkgrpo.errors import UserError
from chunkgrpo.scoring.rewards import get_reward
from chunkgrpo.train import checkpoint as ckpt
from chunkgrpo.train import dist as D
from chunkgrpo.train.config import TrainConfig
from chunkgrpo.train.context import IterationContext, NonFiniteLossError
from chunkgrpo.train.methods import get_method

__all__ = ["NonFiniteLossError", "Trainer", "config_hash", "resolve_chunk_sizes", "run_training"]

log = logging.getLogger(__name__)


def config_hash(cfg: TrainConfig) -> str:
    return hashlib.sha256(json.dumps(cfg.to_dict(), sort_keys=True).encode()).hexdigest()[:12]


# what a resumed run must share with its checkpoint (the rest — length, checkpointing, logging — may
# change); the chunk plan is compared by its sizes (a plan file's path may differ between retries)
RESUME_FIXED = ("model", "method", "lr", "betas", "weight_decay", "warmup_steps", "group_size",
                "timestep_fraction", "seed", "sampling", "rewards", "lora")


def resume_config(cfg: TrainConfig) -> dict:
    """The RESUME_FIXED fields, recorded in every checkpoint's trainer_state.json."""
    d = cfg.to_dict()
    return {k: d[k] for k in RESUME_FIXED}


def config_changes(recorded: dict, cfg: TrainConfig) -> list[str]:
    """`key: was → now` for every RESUME_FIXED field (nested ones by dotted name) that differs."""
    from chunkgrpo.tracking import flatten

    was, now = flatten(recorded), flatten(resume_config(cfg))
    return [f"{k}: {was.get(k)!r} → {now.get(k)!r}" for k in sorted(set(was) | set(now))
            if was.get(k) != now.get(k)]


def resolve_chunk_sizes(cfg: TrainConfig) -> list[int]:
    """The chunk sizes for the run (all 1 for step-level `dance`; the branching methods train single steps
    and ignore `chunks`), checked against num_steps − 1."""
    S = cfg.trainable_steps
    if cfg.method in ("dance", "tempflow", "granular"):
        return [1] * S
    spec = cfg.chunks.strip()
    if spec.endswith(".json"):
        return load_plan(spec, S)
    if spec.startswith("dynamics"):
        raise UserError("chunks=dynamics needs a profile: run `chunkgrpo profile` + `chunkgrpo plan` and pass plan.json")
    return plan_chunks(spec, S).sizes


def _bounded_store(timeout_s: float):
    """An S3 client whose every request gives up after `timeout_s` (connect and read; the store's own
    defaults are sized for whole-folder work), one attempt per call: the caller's loop owns the retries."""
    import dataclasses

    from chunkgrpo.store.client import ArtifactStore, StoreConfig

    base = StoreConfig()
    return ArtifactStore(dataclasses.replace(base, retries=1, read_timeout_s=min(base.read_timeout_s, timeout_s),
                                             connect_timeout_s=min(base.connect_timeout_s, timeout_s)))


def peft_lora_config(lc):
    """peft's LoraConfig for `lora` (LoraConfig of this package): rank, alpha, dropout, targets and the A
    initialisation (`default`: peft's Kaiming-uniform; `gaussian`: N(0, (1/r)²), TempFlow-GRPO's)."""
    from peft import LoraConfig

    return LoraConfig(r=lc.rank, lora_alpha=lc.alpha, lora_dropout=lc.dropout, target_modules=list(lc.targets),
                      init_lora_weights=True if lc.init == "default" else "gaussian")


def check_trained_units(cfg: TrainConfig, sizes: list[int]) -> None:
    """Chunk/step methods train int(K·timestep_fraction) units per sample (the references' count); a plan
    where that is 0 (e.g. `whole` with fraction 0.5: GCPO trains nothing) is rejected, not silently raised to 1."""
    if cfg.method not in ("chunk", "chunk+ws", "dance"):
        return
    K = len(sizes)
    if int(K * cfg.timestep_fraction) < 1:
        raise UserError(f"timestep_fraction={cfg.timestep_fraction} of {K} chunk(s) (sizes {sizes}) trains "
                        f"int({K}×{cfg.timestep_fraction}) = 0 units per sample; raise timestep_fraction to "
                        f">= {1 / K:g} (e.g. 1.0 for 'whole') or plan more chunks")


def _any_rank(flag: bool, device) -> bool:
    """True on every rank if `flag` is true on any (a collective: all ranks must call it)."""
    return D.all_reduce_max(1.0 if flag else 0.0, device) > 0


def _broadcast(obj):
    """Rank 0's `obj` on every rank (plain Python values)."""
    import torch.distributed as tdist

    if not tdist.is_initialized():
        return obj
    box = [obj]
    tdist.broadcast_object_list(box, src=0)
    return box[0]


class Trainer:
    def __init__(self, cfg: TrainConfig):
        self.cfg = cfg
        # ---- checks that need no model (fail before any GPU time) ----
        from chunkgrpo.flux import resolve_model_source
        from chunkgrpo.prompts import load_prompts

        if not cfg.model:
            raise UserError("train needs a model (model=DIR)")
        if not cfg.prompts:
            raise UserError("train needs a prompt file (prompts=FILE)")
        if cfg.device.startswith("cuda") and not torch.cuda.is_available():
            raise UserError(f"device={cfg.device} but no CUDA device is available (use device=auto or device=cpu)")
        # an s3:// model is fetched in setup(), once per node (`_fetch_model`); a local one is checked now
        self.model_path = "" if str(cfg.model).startswith("s3://") else resolve_model_source(cfg.model)
        self.prompts = load_prompts(cfg.prompts)
        self.sizes = resolve_chunk_sizes(cfg)
        self.ranges = obj.chunk_ranges(self.sizes)
        self.reward_weights = resolve_weights({r.name: r.weight for r in cfg.rewards},
                                              cfg.reward_weighting == "normalized")
        if len(self.reward_weights) != len(cfg.rewards):
            raise UserError(f"duplicate reward names in {[r.name for r in cfg.rewards]}")
        check_trained_units(cfg, self.sizes)
        self.method = get_method(cfg.method)
        self.out = Path(cfg.output_dir)
        self.iteration_idx = 0
        self.opt_step = 0
        self.history: list[dict] = []
        self.mirror: ckpt.Mirror | None = None
        self._saving = False  # a checkpoint is being written: SIGTERM waits for it
        self._stop_signal = 0

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg = self.cfg
        self.info = D.setup(cfg.device)
        if self.info.is_main:
            self._lock_output_dir()  # before any heavy work: a second run on this output_dir stops here
        if not self.model_path:
            self.model_path = self._fetch_model()
        dev = self.info.device
        self.bf16 = cfg.mixed_precision == "bf16" or (cfg.mixed_precision == "auto" and dev.type == "cuda")
        self.reward_fns = {r.name: get_reward(r.name, r.options, device=str(dev)) for r in cfg.rewards}
        from chunkgrpo.flux import load_flux

        base_dtype = torch.bfloat16 if (self.bf16 and cfg.lora.enabled) else torch.float32
        # frozen parts (text encoders, VAE) in bf16 under bf16 mixed precision, also for full fine-tuning
        self.model = load_flux(self.model_path, device=dev, dtype=base_dtype,
                               frozen_dtype=torch.bfloat16 if self.bf16 else None)
        self.model.source = cfg.model
        tr = self.model.transformer
        torch.manual_seed(cfg.seed)  # identical LoRA init on every rank
        if cfg.lora.enabled:
            try:
                tr.add_adapter(peft_lora_config(cfg.lora))
            except ValueError as e:  # peft's NoMatchingPeftModuleError is a ValueError
                raise UserError(f"lora.targets={list(cfg.lora.targets)} match no module of the transformer "
                                f"({str(e).splitlines()[0][:200]})") from None
            for n, p in tr.named_parameters():
                p.requires_grad_("lora_" in n)
        else:
            tr.requires_grad_(True)
        for p in tr.parameters():
            if p.requires_grad and p.dtype != torch.float32:
                p.data = p.data.float()  # fp32 master weights for everything trained
        if not any(p.requires_grad for p in tr.parameters()):
            raise UserError(f"no trainable parameters: lora.targets {cfg.lora.targets} match no module of the transformer")
        if cfg.gradient_checkpointing:
            tr.enable_gradient_checkpointing()
        if cfg.distributed == "fsdp" and self.info.enabled:
            D.shard_fsdp(tr, mixed_bf16=self.bf16)  # chunk/step methods then train whole units (train/grpo.py)
        else:
            D.broadcast_params(tr)
        self.trainable = [p for p in tr.parameters() if p.requires_grad]
        self.trainable_names = [n for n, p in tr.named_parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=cfg.lr, betas=tuple(cfg.betas),
                                           weight_decay=cfg.weight_decay)
        from chunkgrpo.train.ema import Ema

        self.ema = Ema(self.trainable, cfg.ema.decay, cfg.ema.every, cfg.ema.warmup) if cfg.ema.decay > 0 else None
        warm = max(0, cfg.warmup_steps)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: min(1.0, (s + 1) / warm) if warm else 1.0)
        # ---- data + text-embedding cache (encoders run once; freed afterwards) ----
        from chunkgrpo.train.data import EmbeddingCache, PromptStream

        self.stream = PromptStream(self.prompts, cfg.prompts_per_rank, self.info.world, cfg.seed)
        self.steps_per_iteration = self.method.steps_per_iteration(cfg)
        self.num_iterations = cfg.max_iterations or math.ceil(cfg.max_steps / self.steps_per_iteration)
        cache_dir = Path(cfg.embed_cache_dir or self.out / "embeds") / f"rank{self.info.rank}"
        self.embeds = EmbeddingCache(self.model, cache_dir, cfg.sampling.max_sequence_length)
        needed = self.stream.all_for(self.info.rank, range(self.num_iterations))
        t0 = time.perf_counter()
        encoded = self.embeds.precompute(needed)
        self.embeds.get(needed)  # into memory
        self.model.drop_text_encoders()
        log.info("rank %d: %d prompt embeddings (%d encoded) in %.1fs", self.info.rank, len(needed), encoded,
                 time.perf_counter() - t0)
        self.ckpt_root = self.out / "checkpoints"
        if self.info.is_main:
            self.ckpt_root.mkdir(parents=True, exist_ok=True)
        D.barrier()
        if cfg.checkpoint.s3_prefix and self.info.is_main:
            self.mirror = ckpt.Mirror(cfg.checkpoint.s3_prefix, store_factory=self._mirror_store)
        if cfg.checkpoint.resume:
            self._resume()

    def _fetch_model(self) -> str:
        """One download per node: local rank 0 fills the node's model cache (`$CHUNKGRPO_CACHE`, on the
        pod's /cache volume; `store.cached_folder` verifies every file) while the other ranks wait in a
        collective; then they read the same files, without touching S3. A failed download fails every
        rank (the others with one line pointing at it). Nodes sharing one cache volume are serialised by
        the cache entry's lock, so a shared cache is filled once too."""
        from chunkgrpo.flux import resolve_model_source
        from chunkgrpo.store.cache import cached_folder_entry

        err: BaseException | None = None
        path = ""
        if self.info.local_rank == 0:
            try:
                path = resolve_model_source(self.cfg.model)
            except Exception as e:  # noqa: BLE001 - re-raised below, after the other ranks know
                err = e
        if _any_rank(err is not None, self.info.device):  # a collective: the barrier of the other ranks
            if err is not None:
                raise err
            raise UserError(f"model {self.cfg.model} could not be fetched by local rank 0 of some node "
                            "(its error is in that rank's log)")
        if self.info.local_rank != 0:
            entry = cached_folder_entry(self.cfg.model, "models")
            if not (entry / ".manifest-sha256").exists():
                raise UserError(f"model {self.cfg.model}: local rank 0 reported it cached, but {entry} is "
                                "not (CHUNKGRPO_CACHE must be the same for every rank of a node)")
            path = resolve_model_source(entry)
        return path

    def _lock_output_dir(self) -> None:
        """One training process tree per output_dir: a second one (e.g. a restart while orphaned ranks
        of the first still run) is refused instead of racing it on the same checkpoints."""
        import fcntl
        import os

        # what close() may remove if setup fails before writing anything else
        self._made = [] if self.out.exists() else [self.out]
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / ".train.lock"
        if not path.exists():
            self._made.insert(0, path)
        self._lock_file = open(path, "a+")
        try:
            fcntl.flock(self._lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            self._lock_file.seek(0)
            holder = self._lock_file.read().strip() or "?"
            self._lock_file.close()
            raise UserError(f"output_dir {self.out} is in use by another training process (pid {holder}); "
                            "stop it first (all its ranks) or choose another output_dir") from None
        self._lock_file.seek(0)
        self._lock_file.truncate()
        self._lock_file.write(str(os.getpid()))
        self._lock_file.flush()

    # ------------------------------------------------------------------ resume / save
    def _resume(self) -> None:
        """Resume from the newest checkpoint that verifies (every file's size and sha256 against its
        manifest, `.pt` files readable as tensors + plain types only), local or in S3. A checkpoint that
        fails is renamed aside (never deleted) and the next older one is tried; one line says so."""
        cfg, info = self.cfg, self.info
        remote: dict[int, str] = {}
        if cfg.checkpoint.s3_prefix and info.local_rank == 0:
            remote = self._remote_checkpoints()
        local = [ckpt.step_of(p) for p in ckpt.complete_checkpoints(self.ckpt_root)] if info.local_rank == 0 else []
        # (step, source) newest first; the local copy of a step before its S3 copy
        candidates = sorted({(st, "local") for st in local} | {(st, "s3") for st in remote},
                            key=lambda c: (-c[0], c[1] != "local"))
        candidates = _broadcast(candidates)
        rejected: list[str] = []
        for step, source in candidates:
            path = ckpt.step_dir(self.ckpt_root, step)
            problem, own = "", False  # own: this node's copy failed (only then is it set aside here)
            if info.local_rank == 0:
                try:
                    if source == "s3" or (not ckpt.is_complete(path) and step in remote):
                        ckpt.download(remote[step], self.ckpt_root, step)
                    elif not ckpt.is_complete(path):
                        raise FileNotFoundError(f"{path.name} is not on this node")
                    ckpt.verify(path)
                except (ckpt.CorruptCheckpointError, OSError) as e:
                    problem, own = str(e), isinstance(e, ckpt.CorruptCheckpointError)
                except Exception as e:  # noqa: BLE001 - a download that failed verification, S3 errors
                    from chunkgrpo.store import StoreError

                    if not isinstance(e, (StoreError, UserError)):
                        raise
                    problem = f"{source} copy: {e}"
            data = None
            if not _any_rank(bool(problem), info.device):
                try:
                    data = ckpt.read(path, info.rank)
                except ckpt.CorruptCheckpointError as e:
                    problem, own = str(e), True
                if _any_rank(bool(problem), info.device):
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
            self._apply_checkpoint(data)
            if info.is_main:
                older = f" (newer {', '.join(dict.fromkeys(rejected))} failed verification, see above)" if rejected else ""
                log.info("resumed from %s (iteration %d, optimizer step %d)%s", path, self.iteration_idx,
                         self.opt_step, older)
                if rejected:
                    log.warning("fell back to %s: the newer checkpoint(s) %s failed verification and were set aside",
                                path.name, ", ".join(dict.fromkeys(rejected)))
                if self.mirror is not None:  # local checkpoints that never reached S3 (an earlier outage)
                    for p in ckpt.complete_checkpoints(self.ckpt_root):
                        if ckpt.step_of(p) not in remote:
                            self.mirror.submit(p)
            return
        if rejected and info.is_main:
            log.warning("no checkpoint verifies (%s set aside); starting from scratch", ", ".join(rejected))

    def _mirror_store(self):
        """The mirror's S3 client: each request bounded by `checkpoint.mirror_timeout_s` (a hung server
        fails the attempt; the store's own read timeout is sized for whole-folder work) and one attempt
        per upload (the mirror's loop retries with backoff and tells pruning it is failing)."""
        return _bounded_store(self.cfg.checkpoint.mirror_timeout_s)

    def _remote_checkpoints(self, sleep=time.sleep) -> dict[int, str]:
        """The S3 checkpoints, retried with exponential backoff (1 s doubling to 30 s) for
        `checkpoint.s3_wait_s` while S3 is unreachable or hung (each request bounded by a read timeout
        of s3_wait_s/4 capped at 30 s, not the store's upload-sized one). Still unreachable then: with
        local checkpoints, one line and those are used; without, one line and a StoreError — never a
        silent start from scratch while S3 may hold this run's checkpoints."""
        from chunkgrpo.store import StoreError

        cfg = self.cfg.checkpoint
        store = _bounded_store(max(1.0, min(30.0, cfg.s3_wait_s / 4)))
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
        if ckpt.complete_checkpoints(self.ckpt_root):
            log.warning("S3 unreachable for %.0fs (%s): resuming from the local checkpoints in %s; S3 may "
                        "hold newer ones", waited, reason, self.ckpt_root)
            return {}
        raise StoreError(f"cannot list checkpoints at {cfg.s3_prefix} for {waited:.0f}s ({reason}); refusing "
                         "to start from scratch while S3 may hold this run's checkpoints — re-run once S3 "
                         "answers, or checkpoint.resume=false to start over") from None

    def _apply_checkpoint(self, data: ckpt.CheckpointData) -> None:
        state = data.state
        limit_steps = self.num_iterations * self.steps_per_iteration
        if state["optimizer_step"] > limit_steps or state["iteration"] > self.num_iterations:
            total, _, unit = self._progress()
            raise UserError(f"checkpoint {data.path} is at optimizer_step={state['optimizer_step']} "
                            f"(iteration {state['iteration']}), beyond this run's end ({total} {unit}s); "
                            "raise max_steps/max_iterations or use another output_dir")
        changes = config_changes(state["config"], self.cfg) if isinstance(state.get("config"), dict) else []
        if isinstance(state.get("chunk_sizes"), list) and state["chunk_sizes"] != self.sizes:
            changes.append(f"chunk sizes: {state['chunk_sizes']} → {self.sizes}")
        if changes and not self.cfg.checkpoint.allow_config_change:
            raise UserError(f"checkpoint {data.path} was trained with another config ({'; '.join(changes)}); "
                            "refusing to resume (checkpoint.allow_config_change=true to resume anyway, or "
                            "another output_dir)")
        if state.get("config_hash") != config_hash(self.cfg):
            log.warning("resuming from %s written with a different config (hash %s, now %s)", data.path,
                        state.get("config_hash"), config_hash(self.cfg))
        missing = [n for n in self.trainable_names if n not in data.weights]
        if missing:
            raise UserError(f"checkpoint {data.path} lacks trainable parameters {missing[:3]} (LoRA/full mismatch?)")
        self._load_trainable(data.weights)
        self._load_optimizer(data.optimizer)
        self.scheduler.load_state_dict(data.scheduler)
        if data.rng is not None:
            ckpt.set_rng_state(data.rng)
        if self.ema is not None and data.ema is not None:
            self._load_ema(data.ema, int(state.get("ema_updates", 0)))
        self.iteration_idx = int(state["iteration"])
        self.opt_step = int(state["optimizer_step"])
        self.history = state.get("history", [])

    def _load_ema(self, weights: dict[str, torch.Tensor], updates: int) -> None:
        """Checkpoint EMA → shadow: load it into the parameters, capture, put the trained weights back."""
        trained = {n: w for n, w in zip(self.trainable_names, (p.detach().clone() for p in self.trainable))}
        self._load_trainable(weights)
        self.ema.capture(updates)
        with torch.no_grad():
            for n, p in zip(self.trainable_names, self.trainable):
                p.copy_(trained[n])

    def _is_fsdp(self) -> bool:
        return self.cfg.distributed == "fsdp" and self.info.enabled

    def _trainable_state(self) -> dict[str, torch.Tensor]:
        tr = self.model.transformer
        if self._is_fsdp():
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

            # collective; with cpu_offload only rank 0 receives the gathered tensors
            full = get_model_state_dict(tr, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
            if not self.info.is_main:
                return {}
            return {n: full[n].float().contiguous() for n in self.trainable_names}
        named = dict(tr.named_parameters())
        return {n: named[n].detach().float().cpu().contiguous() for n in self.trainable_names}

    def _load_trainable(self, weights: dict[str, torch.Tensor]) -> None:
        tr = self.model.transformer
        if self._is_fsdp():
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

            set_model_state_dict(tr, {n: weights[n] for n in self.trainable_names},
                                 options=StateDictOptions(full_state_dict=True, strict=False))
            return
        named = dict(tr.named_parameters())
        with torch.no_grad():
            for n in self.trainable_names:
                named[n].copy_(weights[n].to(named[n].device, named[n].dtype))

    def _optimizer_state(self) -> dict:
        if self._is_fsdp():
            from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

            return get_optimizer_state_dict(self.model.transformer, self.optimizer,
                                            options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return self.optimizer.state_dict()

    def _load_optimizer(self, state: dict) -> None:
        if self._is_fsdp():
            from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

            set_optimizer_state_dict(self.model.transformer, self.optimizer, state,
                                     options=StateDictOptions(full_state_dict=True))
            return
        self.optimizer.load_state_dict(state)

    def _write_checkpoint_files(self, staging: Path, weights: dict, ema_weights: dict | None,
                                optim: dict) -> None:
        """Rank 0's files of a checkpoint, into its staging folder (the manifest comes later)."""
        from safetensors.torch import save_file

        save_file(weights, str(staging / "trainable.safetensors"))
        if ema_weights is not None:
            save_file(ema_weights, str(staging / "ema.safetensors"))
        torch.save(optim, staging / "optimizer.pt")
        torch.save(self.scheduler.state_dict(), staging / "scheduler.pt")
        state = {"iteration": self.iteration_idx, "optimizer_step": self.opt_step,
                 "config_hash": config_hash(self.cfg), "config": resume_config(self.cfg),
                 "history": self.history,
                 "world_size": self.info.world, "chunk_sizes": self.sizes,
                 "ema_updates": self.ema.updates if self.ema is not None else 0}
        (staging / "trainer_state.json").write_text(json.dumps(state, indent=1))

    def save_checkpoint(self) -> Path | None:
        """All ranks call this (FSDP gathers are collective); rank 0 writes; manifest last. Weights and
        optimizer state must be finite: a NaN/inf is never committed (NonFiniteLossError instead, the
        previous checkpoint stays the latest). A full or read-only file system is one line
        (CheckpointWriteError), the staging folder removed. A SIGTERM arriving meanwhile waits until it
        is done."""
        self._saving = True
        try:
            ema_weights = None
            if self.ema is not None:  # clone: without FSDP the state dict aliases the live parameters
                with self.ema.swapped():
                    ema_weights = {k: v.clone() for k, v in self._trainable_state().items()}
            weights = self._trainable_state()
            optim = self._optimizer_state()
            bad = []
            if self.info.is_main:
                bad = (ckpt.non_finite(weights) + ckpt.non_finite(ckpt.optimizer_tensors(optim))
                       + [f"ema:{n}" for n in ckpt.non_finite(ema_weights or {})])
            if _any_rank(bool(bad), self.info.device):
                raise NonFiniteLossError(
                    f"non-finite values at optimizer step {self.opt_step} "
                    f"({f'{len(bad)} tensors, e.g. {bad[0]}' if bad else 'on rank 0'}); checkpoint not written — "
                    f"the last complete one in {self.ckpt_root} is intact")
            staging = ckpt.staging_path(self.ckpt_root, self.opt_step)
            final, error = None, None
            with ckpt.writing(staging) as failed:
                if self.info.is_main:
                    ckpt.stage_dir(self.ckpt_root, self.opt_step)
            if _any_rank(failed.error is not None, self.info.device):  # rank 0 has a fresh staging folder
                if self.info.is_main:
                    shutil.rmtree(staging, ignore_errors=True)
                raise failed.error or ckpt.CheckpointWriteError("rank 0 could not create the staging folder")
            with ckpt.writing(staging) as failed:
                torch.save(ckpt.rng_state(), staging / "rng" / f"rank{self.info.rank}.pt")
            if self.info.is_main and failed.error is None:
                with ckpt.writing(staging) as failed:
                    self._write_checkpoint_files(staging, weights, ema_weights, optim)
            if _any_rank(failed.error is not None, self.info.device):
                if self.info.is_main:
                    shutil.rmtree(staging, ignore_errors=True)
                raise failed.error or ckpt.CheckpointWriteError(
                    "checkpoint write failed on another rank (see its log)")
            if self.info.is_main:  # every rank's RNG file is in place (the all-reduce above)
                mirror = self.mirror
                try:
                    final = ckpt.finalize(staging, self.ckpt_root, self.opt_step,
                                          {"kind": "checkpoint", "step": self.opt_step}, self.cfg.checkpoint.keep,
                                          mirror=mirror, backlog=self.cfg.checkpoint.mirror_backlog)
                except ckpt.MirrorBacklogError as e:
                    error = e
                    final = ckpt.step_dir(self.ckpt_root, self.opt_step)
                except OSError as e:  # the manifest or the rename: a full or read-only file system
                    shutil.rmtree(staging, ignore_errors=True)
                    error = ckpt.CheckpointWriteError(
                        f"cannot write checkpoint {staging.name}: {ckpt._short(e)}; the last complete "
                        f"checkpoint in {self.ckpt_root} is intact")
                    final = None
                if mirror is not None and final is not None:
                    mirror.submit(final)
            if _any_rank(error is not None, self.info.device):
                if error is not None:
                    raise error
                raise ckpt.MirrorBacklogError("rank 0 stopped: checkpoints are not reaching S3 (see its log)")
            return final
        finally:
            self._saving = False
            if self._stop_signal:
                from chunkgrpo.errors import Terminated

                raise Terminated(self._stop_signal)

    # ------------------------------------------------------------------ one iteration
    def _generator(self, iteration: int) -> torch.Generator:
        return torch.Generator().manual_seed(self.cfg.seed * 7919 + iteration * 104729 + self.info.rank * 15485863)

    def _autocast(self):
        """bf16 autocast (GPU by default; on CPU with mixed_precision=bf16, which exercises the same path)."""
        if self.bf16:
            return torch.autocast(self.info.device.type, dtype=torch.bfloat16)
        return nullcontext()

    def _optimizer_step(self) -> dict:
        cfg = self.cfg
        if not self._is_fsdp():
            D.all_reduce_grads(self.trainable)
        grads = [p.grad for p in self.trainable if p.grad is not None]
        if cfg.max_grad_norm > 0:
            gn = torch.nn.utils.clip_grad_norm_(self.trainable, cfg.max_grad_norm)
        else:
            gn = torch.norm(torch.stack([g.detach().float().norm() for g in grads])) if grads else torch.zeros(())
        gn = float(gn.full_tensor() if hasattr(gn, "full_tensor") else gn)
        if not math.isfinite(gn):
            raise NonFiniteLossError(f"non-finite gradient norm at optimizer step {self.opt_step + 1}")
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.opt_step += 1
        return {"grad_norm": gn}

    def context(self) -> IterationContext:
        """This rank's view of the current iteration, handed to the method."""
        prompts = self.stream.batch(self.iteration_idx, self.info.rank)
        return IterationContext(
            cfg=self.cfg, model=self.model, prompts=prompts, cond=self.embeds.get(prompts),
            reward_fns=self.reward_fns, reward_weights=self.reward_weights, sizes=self.sizes, ranges=self.ranges,
            device=self.info.device, iteration=self.iteration_idx, generator=self._generator(self.iteration_idx),
            autocast=self._autocast, optimizer_step=self._optimizer_step, fsdp=self._is_fsdp())

    def iteration(self) -> dict:
        """One iteration of the configured method; returns its metrics (this rank's)."""
        result = self.method.iteration(self.context())
        self._last_images, self._last_prompts = result.images, result.prompts
        return result.metrics

    # ------------------------------------------------------------------ the loop
    def done(self) -> bool:
        """Training length in the configured unit: rollouts (max_iterations) or optimizer steps (max_steps)."""
        if self.cfg.max_iterations:
            return self.iteration_idx >= self.cfg.max_iterations
        return self.opt_step >= self.cfg.max_steps

    def _progress(self) -> tuple[int, int, str]:
        """(total, done, unit) for the progress bar."""
        if self.cfg.max_iterations:
            return self.cfg.max_iterations, self.iteration_idx, "rollout"
        return self.cfg.max_steps, self.opt_step, "step"

    def train(self) -> dict:
        from chunkgrpo import tracking
        from chunkgrpo.progress import progress_bar

        cfg, info = self.cfg, self.info
        # MLflow is fed from a background thread: an outage never blocks or stops training
        tracker_cm = (tracking.background_stage_run(
            "train", parent_run_id=cfg.tracking.parent_run_id or None, experiment=cfg.tracking.experiment,
            params=tracking.flatten(cfg.to_dict()),
            tags={"chunkgrpo.method": cfg.method, "chunkgrpo.config_hash": config_hash(cfg)},
            timeout_s=cfg.tracking.timeout_s, flush_timeout_s=cfg.tracking.flush_timeout_s)
                      if info.is_main else nullcontext(tracking.NullTracker()))
        summary: dict = {}
        with self._sigterm_guard(), tracker_cm as tracker:
            if info.is_main:
                tracker.log_dict({"sizes": self.sizes, "ranges": self.ranges, "method": cfg.method}, "chunk_plan.json")
            total, initial, unit = self._progress()
            bar = progress_bar(total=total, initial=initial, desc=f"train {cfg.method}", unit=unit,
                               disable=not (info.is_main and cfg.progress))
            while not self.done():
                t_it = time.perf_counter()
                try:
                    m = self.iteration()
                except NonFiniteLossError:
                    log.error("stopping: non-finite loss; the last complete checkpoint in %s is intact", self.ckpt_root)
                    raise
                self.iteration_idx += 1
                if self.ema is not None:
                    self.ema.after_iteration(self.iteration_idx)
                m["time/iteration"] = time.perf_counter() - t_it
                m["time/other"] = m["time/iteration"] - sum(m[f"time/{k}"] for k in ("rollout", "reward", "policy"))
                m = D.all_reduce_mean(m, info.device)
                m["optimizer_step"] = self.opt_step
                self.history.append({k: m[k] for k in ("optimizer_step", "reward_mean", "loss", "grad_norm")})
                if info.is_main:
                    tracker.log_metrics({k.replace("/", "_"): v for k, v in m.items()}, step=self.opt_step)
                    if cfg.tracking.image_every and (self.iteration_idx - 1) % cfg.tracking.image_every == 0:
                        self._log_grid(tracker)
                    bar.update(self._progress()[1] - bar.n)
                    bar.set_postfix(reward=f"{m['reward_mean']:.4f}", loss=f"{m['loss']:.2e}")
                every = cfg.checkpoint.every
                crossed = every and (self.opt_step // every) > ((self.opt_step - self.steps_per_iteration) // every)
                if crossed or self.done():
                    self.save_checkpoint()
            bar.close()
            self._write_rank_state()
            final = self.export(self.out / "final")
            self._wait_for_mirror()
            if info.is_main:
                summary = {"optimizer_steps": self.opt_step, "iterations": self.iteration_idx,
                           "final_model": str(final), "history": self.history, "chunk_sizes": self.sizes,
                           "config_hash": config_hash(cfg)}
                (self.out / "train_summary.json").write_text(json.dumps(summary, indent=1))
                tracker.log_dict(summary, "train_summary.json")
        # after the tracker's flush: a run first created while MLflow was coming back from an outage has
        # its id only now (reading it inside the block raced with the background thread)
        if info.is_main and summary and getattr(tracker, "run_id", None):
            summary["mlflow_run_id"] = tracker.run_id
        return summary

    @contextmanager
    def _sigterm_guard(self):
        """SIGTERM (a pod eviction, torchrun stopping its workers) raises `Terminated` — after the
        checkpoint being written, if any, is complete — so the MLflow run is marked KILLED."""
        import signal
        import threading

        from chunkgrpo.errors import Terminated

        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def on_term(signum, frame):
            first = not self._stop_signal
            self._stop_signal = signum
            if first and not self._saving:
                raise Terminated(signum)
            # while saving: save_checkpoint raises once the checkpoint is committed

        previous = signal.signal(signal.SIGTERM, on_term)
        try:
            yield
        finally:
            signal.signal(signal.SIGTERM, previous)

    def _wait_for_mirror(self) -> None:
        """End of training: every checkpoint must reach S3 (bounded wait), else fail loudly — the local
        checkpoints are intact and re-running the same command retries the upload. Once all are in S3,
        the local ones beyond `checkpoint.keep` (held back while S3 was down) are deleted."""
        if self.mirror is None:
            return
        if not self.mirror.wait(self.cfg.checkpoint.mirror_wait_s):
            from chunkgrpo.store import StoreError

            left = [p.name for p in self.mirror.pending()]
            raise StoreError(f"training finished (final model in {self.out / 'final'}) but {', '.join(left)} did not "
                             f"reach {self.cfg.checkpoint.s3_prefix} within {self.cfg.checkpoint.mirror_wait_s:.0f}s "
                             f"({self.mirror.last_error}); they are intact in {self.ckpt_root} — re-run to retry the upload")
        # what `checkpoint.keep` held back during an outage can go now that it is in S3
        ckpt.prune(self.ckpt_root, self.cfg.checkpoint.keep, self.mirror, self.cfg.checkpoint.mirror_backlog)

    def _write_rank_state(self) -> None:
        """Each rank records a checksum of its trainable parameters (replicas must agree; under FSDP
        each rank holds a shard, so the checksum is of its local shard)."""
        h = hashlib.sha256()
        named = dict(self.model.transformer.named_parameters())
        for name in sorted(self.trainable_names):
            t = named[name].detach()
            t = t.to_local() if hasattr(t, "to_local") else t
            h.update(name.encode())
            h.update(t.float().cpu().numpy().tobytes())
        path = self.out / "ranks" / f"rank{self.info.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"rank": self.info.rank, "world": self.info.world, "optimizer_step": self.opt_step,
                                    "trainable_sha256": h.hexdigest(), "sharded": self._is_fsdp(),
                                    "history": self.history}))

    def _log_grid(self, tracker) -> None:
        from chunkgrpo.grids import image_grid

        grid = image_grid(self._last_images[: self.cfg.group_size], cols=min(self.cfg.group_size, 6))
        path = self.out / "samples" / f"iter-{self.iteration_idx:05d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        grid.save(path)
        tracker.log_artifact(path, "samples")

    # ------------------------------------------------------------------ export
    def export(self, out: Path) -> Path:
        """The final model: a diffusers LoRA folder (or a full transformer) + `chunkgrpo_model.json`;
        the EMA weights when `ema.decay` > 0 (what the references evaluate). Never written with NaN/inf."""
        if self.ema is not None:  # clone: without FSDP the state dict aliases the live parameters
            with self.ema.swapped():
                weights = {k: v.clone() for k, v in self._trainable_state().items()}
        else:
            weights = self._trainable_state()
        bad = ckpt.non_finite(weights) if self.info.is_main else []
        if _any_rank(bool(bad), self.info.device):
            raise NonFiniteLossError(f"non-finite trainable parameters ({bad[0] if bad else 'on rank 0'}); "
                                     f"final model not written")
        if not self.info.is_main:
            D.barrier()
            return out
        staging = out.with_name(out.name + ".partial")
        if staging.exists():
            import shutil

            shutil.rmtree(staging)
        staging.mkdir(parents=True)
        if self.cfg.lora.enabled:
            from diffusers import FluxPipeline
            from peft.utils import get_peft_model_state_dict

            lora_sd = get_peft_model_state_dict(self.model.transformer, state_dict=weights)
            lc = self.cfg.lora
            FluxPipeline.save_lora_weights(staging, transformer_lora_layers=lora_sd, transformer_lora_adapter_metadata={
                "r": lc.rank, "lora_alpha": lc.alpha, "target_modules": list(lc.targets), "lora_dropout": lc.dropout})
            kind = "lora"
        else:
            from safetensors.torch import save_file

            (staging / "transformer").mkdir()
            self.model.transformer.save_config(staging / "transformer")
            save_file(weights, str(staging / "transformer" / "diffusion_pytorch_model.safetensors"))
            kind = "full"
        meta = {"kind": kind, "base_model": self.cfg.model, "method": self.cfg.method, "chunk_sizes": self.sizes,
                "optimizer_steps": self.opt_step, "config_hash": config_hash(self.cfg),
                "lora": self.cfg.lora.to_dict() if kind == "lora" else None, "sampling": self.cfg.sampling.to_dict(),
                "ema": {**self.cfg.ema.to_dict(), "updates": self.ema.updates} if self.ema is not None else None}
        (staging / "chunkgrpo_model.json").write_text(json.dumps(meta, indent=1))
        ckpt.write_manifest(staging, {"kind": kind})
        if out.exists():
            import shutil

            shutil.rmtree(out)
        staging.rename(out)
        D.barrier()
        return out

    def close(self) -> None:
        if self.mirror is not None:
            self.mirror.close(timeout=0)  # an unfinished upload has no manifest in S3: never read as complete
        lock = getattr(self, "_lock_file", None)
        if lock is not None:
            # a run that failed before writing anything (bad model, LoRA targets, ...) leaves nothing behind
            made = getattr(self, "_made", [])
            if made and {p.name for p in self.out.iterdir()} <= {".train.lock"}:
                for p in made:
                    p.unlink() if p.is_file() else p.rmdir()
            lock.close()  # releases the output_dir lock
            self._lock_file = None
        D.teardown()


def run_training(cfg: TrainConfig) -> dict:
    trainer = Trainer(cfg)
    try:
        trainer.setup()
        return trainer.train()
    finally:
        trainer.close()
