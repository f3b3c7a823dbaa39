"""Sharded (DCP) checkpoints of an FSDP full fine-tune on CPU (gloo, torch.multiprocessing): each rank's
file holds its half of the state, a checkpoint written by 2 ranks resumes on 1 and back on 2 with the
saved optimizer state, and an unchanged world size resumes bit-identically. The trainer is a small stand-in
(an MLP with FSDP units per block) driven through the real `Checkpointer`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from chunkgrpo.train import checkpoint_format as ckpt
from chunkgrpo.train import checkpoint_sharded as sharded
from tests.ranks import run_ranks

pytestmark = pytest.mark.integration

DIM = 256


class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.transformer_blocks = torch.nn.ModuleList([torch.nn.Linear(DIM, DIM) for _ in range(3)])
        self.proj_out = torch.nn.Linear(DIM, 8)

    def forward(self, x):
        for b in self.transformer_blocks:
            x = torch.tanh(b(x))
        return self.proj_out(x)


class Toy:
    """What the Checkpointer reads of a trainer, with a deterministic step (the same batch on every rank,
    so the averaged gradient of any world size is the single-process one)."""

    def __init__(self, out: Path, rank: int, world: int, ema: bool, checkpoint: dict | None = None,
                 local_rank: int | None = None):
        from chunkgrpo.train.config import TrainConfig
        from chunkgrpo.train.dist import DistInfo, shard_fsdp
        from chunkgrpo.train.ema import Ema

        self.cfg = TrainConfig.from_dict({"output_dir": str(out), "max_steps": 6, "distributed": "fsdp",
                                          "checkpoint": {"keep": 10, "every": 2, **(checkpoint or {})},
                                          "ema": {"decay": 0.9 if ema else 0.0}})
        self.out, self.info = out, DistInfo(rank, world, rank if local_rank is None else local_rank)
        torch.manual_seed(0)
        net = Net()
        if world > 1:
            shard_fsdp(net, mixed_bf16=False)
        self.model = SimpleNamespace(transformer=net)
        self.trainable = list(net.parameters())
        self.trainable_names = [n for n, _ in net.named_parameters()]
        self.optimizer = torch.optim.AdamW(self.trainable, lr=1e-2, weight_decay=0.01)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, lambda s: min(1.0, (s + 1) / 3))
        self.ema = Ema(self.trainable, 0.9) if ema else None
        self.iteration_idx = self.opt_step = 0
        self.history: list[dict] = []
        self.plan = SimpleNamespace(sizes=[1])
        self.prompts = ["p"]
        self.num_iterations, self.steps_per_iteration = 6, 1
        from chunkgrpo.train.checkpoint_policy import Checkpointer

        self.checkpoints = Checkpointer(self)

    def _is_fsdp(self) -> bool:
        return self.info.world > 1

    def _trainable_state(self) -> dict:  # the single-process checkpoint's weights
        return {n: p.detach().float().clone() for n, p in self.model.transformer.named_parameters()}

    def _progress(self):
        return 6, self.opt_step, "step"

    def step(self) -> None:
        g = torch.Generator().manual_seed(100 + self.opt_step)
        x = torch.randn(16, DIM, generator=g)
        loss = self.model.transformer(x).pow(2).mean()
        loss.backward()
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.opt_step += 1
        self.iteration_idx += 1
        if self.ema is not None:
            self.ema.after_iteration(self.iteration_idx)
        self.history.append({"optimizer_step": self.opt_step, "loss": float(loss.detach())})

    def train_to(self, steps: int) -> dict:
        """Optimizer steps up to `steps`, a checkpoint every second one; {step: full state when saved}."""
        states = {}
        while self.opt_step < steps:
            self.step()
            if self.opt_step % 2 == 0:
                self.checkpoints.save()
                states[self.opt_step] = self.full_state()
        return states

    def full_state(self) -> dict:
        """Weights, Adam moments and EMA as whole tensors by name (gathered), for comparisons."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=False)
        fresh = not self.optimizer.state
        msd, osd = get_state_dict(self.model.transformer, self.optimizer, options=opts)
        if fresh:  # get_state_dict initialised the moments with a zero step: not part of the training
            self.optimizer.state.clear()
            osd = {"state": {}}
        out = {f"w.{k}": v.clone() for k, v in msd.items()}
        for k, slots in osd["state"].items():
            out.update({f"{s}.{k}": v.clone() for s, v in slots.items()})
        if self.ema is not None:
            out.update({f"ema.{n}": (s.full_tensor() if hasattr(s, "full_tensor") else s).clone()
                        for n, s in zip(self.trainable_names, self.ema.shadow)})
        return out


def _worker(rank: int, world: int, port: int, out: str, steps: int, result: str, ema: bool,
            checkpoint: dict | None) -> None:
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS="1")
    torch.set_num_threads(1)
    if world > 1:
        dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        t = Toy(Path(out), rank, world, ema, checkpoint)
        t.checkpoints.resume()
        resumed_at = t.opt_step
        state_at_resume = t.full_state()
        states = t.train_to(steps)
        final = t.full_state()
        t.checkpoints.finish()
        t.checkpoints.close()
        if rank == 0:
            torch.save({"resumed_at": resumed_at, "at_resume": state_at_resume, "final": final,
                        "states": states, "history": t.history}, result)
    finally:
        if world > 1:
            dist.destroy_process_group()


def _run(world: int, out: Path, steps: int, tag: str, ema: bool = False,
         checkpoint: dict | None = None) -> dict:
    from chunkgrpo.processes import free_port

    result = out.parent / f"{tag}.pt"
    run_ranks(_worker, (world, free_port(), str(out), steps, str(result), ema, checkpoint), world)
    return torch.load(result, weights_only=True)


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_two_ranks_one_rank_two_ranks_continue_the_same_training(tmp_path):
    ref = _run(1, tmp_path / "ref", 6, "ref")  # uninterrupted, one process

    run = tmp_path / "run"
    a = _run(2, run, 2, "a")  # 2 FSDP ranks: a sharded checkpoint at step 2
    step2 = ckpt.step_dir(run / "checkpoints", 2)
    files = json.loads((step2 / "MANIFEST.json").read_text())["files"]
    assert sharded.is_sharded(files)
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "rng/rank1.pt"} <= set(files)
    assert "optimizer.pt" not in files and "trainable.safetensors" not in files
    assert json.loads((step2 / "trainer_state.json").read_text())["format"] == "dcp"
    ckpt.verify(step2)
    # each rank's file holds its half of weights + both Adam moments: at most about half of the state
    state_bytes = sum(v.numel() * v.element_size() for k, v in a["final"].items()
                      if not k.startswith("step."))
    largest = max(int(e["size"]) for e in files.values())
    assert largest <= 0.55 * state_bytes, (largest, state_bytes)

    b = _run(1, run, 4, "b")  # resumed by 1 process from the 2-rank checkpoint
    assert b["resumed_at"] == 2
    # the resharded optimizer state and weights are those of the uninterrupted run at step 2
    assert _same(b["at_resume"], ref["states"][2])
    assert _same(b["final"], ref["states"][4])

    c = _run(2, run, 6, "c")  # and back on 2 ranks from the 1-process checkpoint at step 4
    assert c["resumed_at"] == 4
    assert _same(c["at_resume"], ref["states"][4])
    assert _same(c["final"], ref["final"])
    assert [h["loss"] for h in c["history"]] == [h["loss"] for h in ref["history"]]


def test_same_world_size_resumes_bit_identically_with_ema(tmp_path):
    """(The synchronous save; the other tests save asynchronously, the default.)"""
    sync = {"async_save": False}
    whole = _run(2, tmp_path / "whole", 4, "whole", ema=True, checkpoint=sync)
    run = tmp_path / "run"
    _run(2, run, 2, "first", ema=True, checkpoint=sync)
    second = _run(2, run, 4, "second", ema=True, checkpoint=sync)
    assert second["resumed_at"] == 2
    assert any(k.startswith("ema.") for k in whole["final"])
    assert _same(second["final"], whole["final"])
    assert [h["loss"] for h in second["history"]] == [h["loss"] for h in whole["history"]]


def test_a_corrupt_shard_is_set_aside_and_the_older_checkpoint_resumes(tmp_path):
    run = tmp_path / "run"
    _run(2, run, 4, "first")
    step4 = ckpt.step_dir(run / "checkpoints", 4)
    shard = step4 / "dcp" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    again = _run(2, run, 4, "again")
    assert again["resumed_at"] == 2  # step 4 failed its checksum: set aside, step 2 used
    assert (run / "checkpoints" / "step-000004.bad-1").is_dir()


def test_every_rank_mirrors_its_shards_and_s3_keeps_the_newest(services_env, tmp_path):
    """2 FSDP ranks mirror to the real local S3 (each its own shards, rank 0 the manifest last) with
    checkpoint.keep=2: S3 holds the two newest sharded checkpoints, each whole; a fresh single process
    resumes from S3 with the 2-rank state."""
    from chunkgrpo.store.client import ArtifactStore

    prefix = f"s3://{services_env.store_config.bucket}/runs/sharded/ckpt"
    over = {"s3_prefix": prefix, "keep": 2}
    a = _run(2, tmp_path / "a", 6, "a", checkpoint=over)
    st = ArtifactStore()
    assert [u.rsplit("/", 1)[-1] for u in st.list_complete(prefix)] == ["step-000004", "step-000006"]
    assert not st.list(prefix + "/step-000002/")  # pruned whole, not only its manifest
    files = st.read_manifest(prefix + "/step-000006").files
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "dcp/.metadata", "rng/rank1.pt"} <= set(files)
    b = _run(1, tmp_path / "b", 6, "b", checkpoint=over)  # an empty output_dir: from S3
    assert b["resumed_at"] == 6
    assert _same(b["at_resume"], a["final"])
