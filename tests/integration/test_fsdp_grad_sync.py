"""FSDP2 gradient synchronisation per policy window (`policy_window.window_backward(grad_sync=)`, wired by
the trainer to `set_requires_gradient_sync`): two gloo ranks on the CPU, a three-unit FSDP model, windows
of several backwards. Each FSDP unit reduce-scatters once per optimizer step, not once per backward, and
the updated parameters equal those of syncing after every backward."""

from __future__ import annotations

import os
import socket

import pytest
import torch

pytestmark = pytest.mark.integration

UNITS_PER_WINDOW = 4  # whole units, one per forward: 4 backwards per window
WINDOWS = 2  # optimizer steps
FSDP_UNITS = 3  # two wrapped blocks and the root (which holds the head's parameters)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Linear(6, 6), torch.nn.Linear(6, 1))


def _train(model, sync: bool, rank: int) -> tuple[int, list[torch.Tensor]]:
    """WINDOWS policy windows of UNITS_PER_WINDOW on-policy units (FSDP layout: one whole unit per forward)
    and an SGD step after each; returns the reduce-scatters issued and the full parameters after."""
    import torch.distributed as dist

    from chunkgrpo.train import policy_window as pw

    g = torch.Generator().manual_seed(100 + rank)  # ranks train different data
    feats = torch.randn(UNITS_PER_WINDOW * WINDOWS, 3, 6, generator=g)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    calls = [0]
    original = dist.reduce_scatter_single

    def counted(*a, **k):
        calls[0] += 1
        return original(*a, **k)

    dist.reduce_scatter_single = counted
    try:
        for w in range(WINDOWS):
            units = [pw.Unit(w * UNITS_PER_WINDOW + j, [0, 1, 2], torch.tensor(float(j) - 1.5), 0.25)
                     for j in range(UNITS_PER_WINDOW)]

            def forward(samples, steps):
                return model(feats[samples, steps]).squeeze(-1)

            pw.window_backward(units, forward, clip_low=0.2, clip_high=0.2, strategy="graph", budget=3,
                               units_per_forward=1, skip_clipped=False,
                               grad_sync=model.set_requires_gradient_sync if sync else None)
            opt.step()
            opt.zero_grad(set_to_none=True)
    finally:
        dist.reduce_scatter_single = original
    return calls[0], [p.full_tensor().detach().clone() for p in model.parameters()]


def _worker(rank: int, world: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        out = {}
        for sync in (True, False):
            model = _model()
            fully_shard(model[0])
            fully_shard(model[1])
            fully_shard(model)
            out[sync] = _train(model, sync, rank)
        # plain lists: a tensor through the queue would be shared memory of a process about to exit
        queue.put((rank, {k: (n, [t.tolist() for t in ps]) for k, (n, ps) in out.items()}))
    finally:
        dist.destroy_process_group()


def test_one_reduce_scatter_per_fsdp_unit_per_step_same_update():
    import torch.multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, 2, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = {}
        for _ in procs:
            rank, out = queue.get(timeout=240)
            results[rank] = {k: (n, [torch.tensor(t) for t in ps]) for k, (n, ps) in out.items()}
    finally:
        for p in procs:
            p.join(timeout=60)
            if p.is_alive():
                p.terminate()
    for rank, out in results.items():
        once, every = out[True], out[False]
        assert once[0] == FSDP_UNITS * WINDOWS, (rank, once[0])  # one per FSDP unit per optimizer step
        assert every[0] == FSDP_UNITS * WINDOWS * UNITS_PER_WINDOW, (rank, every[0])
        # same update: the reduced sum of the accumulated gradients vs the sum of reduced gradients
        # (fp32; only the order of the additions differs)
        for a, b in zip(once[1], every[1]):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
        start = [p.detach() for p in _model().parameters()]
        assert any(not torch.equal(a, s) for a, s in zip(once[1], start))  # the steps moved the weights
    torch.testing.assert_close(results[0][True][1], results[1][True][1], rtol=0, atol=0)  # one model
