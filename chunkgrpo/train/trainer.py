"""The GRPO training engine: one rollout per iteration, policy updates on chunks (or steps).

Read top to bottom:
  Trainer.__init__   validate everything that can be checked before any GPU time is spent
  Trainer.setup      process group, model (+LoRA / full), FSDP or replicated, optimizer, caches, resume
                     (checkpoints: `chunkgrpo.train.checkpoint_policy.Checkpointer`; their format:
                     `chunkgrpo.train.checkpoint_format`)
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
import time
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch

from chunkgrpo.advantages import resolve_weights
from chunkgrpo.chunks import ChunkPlan, training_plan
from chunkgrpo.errors import Terminated, UserError
from chunkgrpo.locks import FileLock, LockHeld
from chunkgrpo.recipes import GRPO_METHODS
from chunkgrpo.scoring.remote import check_service
from chunkgrpo.scoring.rewards import get_reward
from chunkgrpo.train import checkpoint_format as ckpt
from chunkgrpo.train import dist as D
from chunkgrpo.train.checkpoint_policy import Checkpointer, config_hash
from chunkgrpo.train.config import TrainConfig
from chunkgrpo.train.context import IterationContext, NonFiniteLossError
from chunkgrpo.train.methods import get_method
from chunkgrpo.train.metric_names import training_metrics_for_mlflow
from chunkgrpo.train.model_load import load_policy_model, peft_lora_config, save_transformer_config

__all__ = ["NonFiniteLossError", "Trainer", "peft_lora_config", "run_training"]

log = logging.getLogger(__name__)


def canonical_safetensors_header(path: Path) -> None:
    """Rewrite a safetensors file's JSON header in place with its `__metadata__` keys sorted (same bytes
    otherwise, same length). safetensors serializes the metadata from a Rust HashMap, whose order is drawn
    anew in every process: the same LoRA weights were written as different bytes (the diffusers LoRA file
    has two metadata keys), so the model's manifest digest changed between identical runs."""
    import struct

    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        meta = header.pop("__metadata__", None)
        if not meta:
            return
        text = json.dumps({"__metadata__": dict(sorted(meta.items())), **header}, separators=(",", ":"),
                          ensure_ascii=False).encode()
        if len(text) > n:  # never: the same JSON reordered
            raise RuntimeError(f"{path}: canonical safetensors header longer than the original")
        f.seek(8)
        f.write(text.ljust(n, b" "))


def check_trained_units(cfg: TrainConfig, plan: ChunkPlan) -> None:
    """Chunk/step methods train int(K·timestep_fraction) units per sample (the references' count); a plan
    where that is 0 (e.g. `whole` with fraction 0.5: GCPO trains nothing) is rejected, not silently raised
    to 1."""
    if cfg.method not in GRPO_METHODS:
        return
    K = len(plan.sizes)
    if int(K * cfg.timestep_fraction) < 1:
        raise UserError(
            f"timestep_fraction={cfg.timestep_fraction} of {K} chunk(s) (sizes {plan.sizes}) "
            f"trains int({K}×{cfg.timestep_fraction}) = 0 units per sample; raise timestep_fraction to "
            f">= {1 / K:g} (e.g. 1.0 for 'whole') or plan more chunks"
        )


class Trainer:
    def __init__(self, cfg: TrainConfig, check_device: bool = True):
        """`check_device=False` (a dry run): the GPU check is left to the caller, which reports it."""
        self.cfg = cfg
        # ---- checks that need no model (fail before any GPU time) ----
        from chunkgrpo.flux import resolve_model_source
        from chunkgrpo.gpu import require
        from chunkgrpo.prompts import load_prompts

        if check_device:
            require(cfg.device)  # first: a GPU CUDA cannot use stops the job here, before any download
        if not cfg.model:
            raise UserError("train needs a model (model=DIR)")
        if not cfg.prompts:
            raise UserError("train needs a prompt file (prompts=FILE)")
        # an s3:// model is fetched in setup(), once per node (`_fetch_model`); a local one is checked now
        self.model_path = "" if str(cfg.model).startswith("s3://") else resolve_model_source(cfg.model)
        self.prompts = load_prompts(cfg.prompts)
        self.plan = training_plan(cfg.method, cfg.chunks, cfg.trainable_steps)
        self.reward_weights = resolve_weights({r.name: r.weight for r in cfg.rewards},
                                              cfg.reward_weighting == "normalized")
        if len(self.reward_weights) != len(cfg.rewards):
            raise UserError(f"duplicate reward names in {[r.name for r in cfg.rewards]}")
        for r in cfg.rewards:  # a served reward's server answers before any model is loaded
            if r.url and (problem := check_service(r.url, r.name)):
                raise UserError(problem)
        check_trained_units(cfg, self.plan)
        self.method = get_method(cfg.method)
        self.out = Path(cfg.output_dir)
        self.iteration_idx = 0
        self.opt_step = 0
        self.history: list[dict] = []
        self.checkpoints: Checkpointer | None = None
        self._saving = False  # a checkpoint is being written: SIGTERM waits for it
        self._stop_signal = 0

    # ------------------------------------------------------------------ setup
    def setup(self) -> None:
        cfg = self.cfg
        self.info = D.setup(cfg.device, cfg.dist_timeout_s)
        if self.info.is_main:
            self._lock_output_dir()  # before any heavy work: a second run on this output_dir stops here
        if not self.model_path:
            self.model_path = self._fetch_model()
        dev = self.info.device
        from chunkgrpo.flux import use_training_attention

        use_training_attention(dev)
        self.bf16 = cfg.mixed_precision == "bf16" or (cfg.mixed_precision == "auto" and dev.type == "cuda")
        # FSDP (LoRA or full fine-tuning) builds the transformer sharded; otherwise whole, then broadcast
        self.model = load_policy_model(cfg, self.info, self.model_path, self.bf16)
        self.model.source = cfg.model
        tr = self.model.transformer
        # reward models after the transformer is sharded (never both whole on the device); their own
        # seeding leaves the global random state as the model load left it
        with torch.random.fork_rng(devices=[dev] if dev.type == "cuda" else []):
            self.reward_fns = {r.name: get_reward(r.name, r.options, str(dev), r.url) for r in cfg.rewards}
        self.trainable = [p for p in tr.parameters() if p.requires_grad]
        self.trainable_names = [n for n, p in tr.named_parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=cfg.lr, betas=tuple(cfg.betas),
                                           weight_decay=cfg.weight_decay)
        from chunkgrpo.train.ema import Ema

        self.ema = (
            Ema(self.trainable, cfg.ema.decay, cfg.ema.every, cfg.ema.warmup) if cfg.ema.decay > 0 else None
        )
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
        self.checkpoints = Checkpointer(self)
        if cfg.checkpoint.resume:
            self.checkpoints.resume()

    def _fetch_model(self) -> str:
        """One download per node: local rank 0 fills the node's model cache (`$CHUNKGRPO_CACHE`, on the
        pod's /cache volume; `store.cached_folder` verifies every file) while the other ranks wait
        (`dist.wait_all`: up to `io_wait_s`, saying what they wait for); then they read the same files,
        without touching S3. A failed download fails every rank (the others with one line pointing at
        it). Nodes sharing one cache volume are serialised by the cache entry's lock, so a shared cache is
        filled once too."""
        from chunkgrpo.flux import resolve_model_source
        from chunkgrpo.store.cache import cached_folder_entry

        err: BaseException | None = None
        path = ""
        if self.info.local_rank == 0:
            try:
                path = resolve_model_source(self.cfg.model)
            except Exception as e:
                err = e
        # waited for in the store, not a collective: a download longer than dist_timeout_s is no failure
        if D.wait_all("model fetch", err is not None, deadline_s=self.cfg.io_wait_s):
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
        # what close() may remove if setup fails before writing anything else
        self._made = [] if self.out.exists() else [self.out]
        self.out.mkdir(parents=True, exist_ok=True)
        path = self.out / ".train.lock"
        if not path.exists():
            self._made.insert(0, path)
        self._lock_file = FileLock(path)
        try:
            self._lock_file.acquire(blocking=False)
        except LockHeld as e:
            self._lock_file = None
            raise UserError(f"output_dir {self.out} is in use by another training process (pid {e.holder}); "
                            "stop it first (all its ranks) or choose another output_dir") from None

    # ------------------------------------------------------------------ model state
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

    def save_checkpoint(self) -> Path | None:
        """`Checkpointer.save` (all ranks call it); a SIGTERM arriving meanwhile waits until it is done."""
        self._saving = True
        try:
            return self.checkpoints.save()
        finally:
            self._saving = False
            if self._stop_signal:
                raise Terminated(self._stop_signal)

    # ------------------------------------------------------------------ one iteration
    def _generator(self, iteration: int) -> torch.Generator:
        return torch.Generator().manual_seed(
            self.cfg.seed * 7919 + iteration * 104729 + self.info.rank * 15485863
        )

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
            gn = (
                torch.norm(torch.stack([g.detach().float().norm() for g in grads]))
                if grads
                else torch.zeros(())
            )
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
            cfg=self.cfg,
            model=self.model,
            prompts=prompts,
            cond=self.embeds.get(prompts),
            reward_fns=self.reward_fns,
            reward_weights=self.reward_weights,
            plan=self.plan,
            device=self.info.device,
            iteration=self.iteration_idx,
            generator=self._generator(self.iteration_idx),
            autocast=self._autocast,
            optimizer_step=self._optimizer_step,
            fsdp=self._is_fsdp(),
            grad_sync=(self.model.transformer.set_requires_gradient_sync
                       if self._is_fsdp() and self.cfg.fsdp_grad_sync == "window" else None),
        )

    def iteration(self) -> dict:
        """One iteration of the configured method; returns its metrics (this rank's)."""
        result = self.method.iteration(self.context())
        self._last_images, self._last_prompts = result.images, result.prompts
        return result.metrics

    # ------------------------------------------------------------------ the loop
    def done(self) -> bool:
        """Training length in the configured unit: rollouts (max_iterations) or optimizer steps
        (max_steps)."""
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
                tracker.log_dict({"sizes": self.plan.sizes, "ranges": self.plan.ranges, "method": cfg.method},
                                 "chunk_plan.json")
            total, initial, unit = self._progress()
            bar = progress_bar(total=total, initial=initial, desc=f"train {cfg.method}", unit=unit,
                               disable=not (info.is_main and cfg.progress))
            while not self.done():
                t_it = time.perf_counter()
                try:
                    m = self.iteration()
                except NonFiniteLossError:
                    log.error("stopping: non-finite loss; the last complete checkpoint in %s is intact",
                              self.checkpoints.root)
                    raise
                self.iteration_idx += 1
                if self.ema is not None:
                    self.ema.after_iteration(self.iteration_idx)
                m["time/iteration"] = time.perf_counter() - t_it
                m["time/other"] = m["time/iteration"] - sum(
                    m[f"time/{k}"] for k in ("rollout", "reward", "policy")
                )
                m = D.all_reduce_mean(m, info.device)
                m["optimizer_step"] = self.opt_step
                self.history.append({k: m[k] for k in ("optimizer_step", "reward_mean", "loss", "grad_norm")})
                if info.is_main:
                    tracker.log_metrics(training_metrics_for_mlflow(m), step=self.opt_step)
                    if cfg.tracking.image_every and (self.iteration_idx - 1) % cfg.tracking.image_every == 0:
                        self._log_grid(tracker)
                    bar.update(self._progress()[1] - bar.n)
                    bar.set_postfix(reward=f"{m['reward_mean']:.4f}", loss=f"{m['loss']:.2e}")
                every = cfg.checkpoint.every
                crossed = every and (self.opt_step // every) > (
                    (self.opt_step - self.steps_per_iteration) // every
                )
                if crossed or self.done():
                    if self.done():
                        self.checkpoints.final_first()
                    self.save_checkpoint()
            bar.close()
            self._write_rank_state()
            final = self.export(self.out / "final")
            self.checkpoints.finish(final)
            if info.is_main:
                summary = {"optimizer_steps": self.opt_step, "iterations": self.iteration_idx,
                           "final_model": str(final), "history": self.history, "chunk_sizes": self.plan.sizes,
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
        path.write_text(
            json.dumps(
                {
                    "rank": self.info.rank,
                    "world": self.info.world,
                    "optimizer_step": self.opt_step,
                    "trainable_sha256": h.hexdigest(),
                    "sharded": self._is_fsdp(),
                    "history": self.history,
                }
            )
        )

    def _log_grid(self, tracker) -> None:
        from chunkgrpo.grids import image_grid

        n = self.cfg.group_size
        prompts = [str(p) for p in self._last_prompts[:n]]
        grid = image_grid(self._last_images[:n], cols=min(n, 6), labels=prompts or None)
        path = self.out / "samples" / f"iter-{self.iteration_idx:05d}.png"
        path.parent.mkdir(parents=True, exist_ok=True)
        grid.save(path)
        # the run page's image slider, by optimizer step; the prompts in full in samples/captions.json
        tracker.log_image(grid, key="samples", step=self.opt_step)
        if prompts:
            k = len(prompts)
            tracker.log_table({"step": [self.opt_step] * k, "iteration": [self.iteration_idx] * k,
                               "image": [f"samples/{path.name}"] * k, "sample": list(range(k)),
                               "prompt": prompts}, "samples/captions.json")
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
        if D.any_rank(bool(bad), self.info.device):
            raise NonFiniteLossError(f"non-finite trainable parameters ({bad[0] if bad else 'on rank 0'}); "
                                     f"final model not written")
        if not self.info.is_main:  # rank 0 writes; the others wait outside any collective (io_wait_s)
            if D.wait_all("export", False, deadline_s=self.cfg.io_wait_s):
                raise ckpt.CheckpointWriteError("rank 0 could not write the final model (see its log)")
            return out
        try:
            self._write_final(out, weights)
        except BaseException:
            D.wait_all("export", True, deadline_s=self.cfg.io_wait_s)
            raise
        D.wait_all("export", False, deadline_s=self.cfg.io_wait_s)
        return out

    def _write_final(self, out: Path, weights: dict) -> None:
        """Rank 0: the final model folder, written beside `out` and renamed into place."""
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
            FluxPipeline.save_lora_weights(
                staging,
                transformer_lora_layers=lora_sd,
                transformer_lora_adapter_metadata={
                    "r": lc.rank,
                    "lora_alpha": lc.alpha,
                    "target_modules": list(lc.targets),
                    "lora_dropout": lc.dropout,
                },
            )
            canonical_safetensors_header(staging / "pytorch_lora_weights.safetensors")
            kind = "lora"
        else:
            from safetensors.torch import save_file

            (staging / "transformer").mkdir()
            save_transformer_config(self.model.transformer, staging / "transformer")
            save_file(weights, str(staging / "transformer" / "diffusion_pytorch_model.safetensors"))
            kind = "full"
        meta = {
            "kind": kind,
            "base_model": self.cfg.model,
            "method": self.cfg.method,
            "chunk_sizes": self.plan.sizes,
            "optimizer_steps": self.opt_step,
            "config_hash": config_hash(self.cfg),
            "lora": self.cfg.lora.to_dict() if kind == "lora" else None,
            "sampling": self.cfg.sampling.to_dict(),
            "ema": {**self.cfg.ema.to_dict(), "updates": self.ema.updates} if self.ema is not None else None,
        }
        (staging / "chunkgrpo_model.json").write_text(json.dumps(meta, indent=1))
        ckpt.write_manifest(staging, {"kind": kind})
        if out.exists():
            import shutil

            shutil.rmtree(out)
        staging.rename(out)

    def close(self) -> None:
        if self.checkpoints is not None:
            self.checkpoints.close()
        lock = getattr(self, "_lock_file", None)
        if lock is not None:
            # a run that failed before writing anything (bad model, LoRA targets, ...) leaves nothing behind
            made = getattr(self, "_made", [])
            if made and {p.name for p in self.out.iterdir()} <= {".train.lock"}:
                for p in made:
                    p.unlink() if p.is_file() else p.rmdir()
            lock.release()  # releases the output_dir lock
            self._lock_file = None
        D.teardown()


def run_training(cfg: TrainConfig) -> dict:
    trainer = Trainer(cfg)
    try:
        trainer.setup()
        return trainer.train()
    finally:
        trainer.close()
