"""Single-rank I/O waited for outside any collective (`dist.wait_all`): two gloo ranks whose process
group times out collectives after 2 s (`dist.setup(timeout_s=)`, `TrainConfig.dist_timeout_s`). Rank 0
sleeps 4 s in a simulated download; rank 1 waits in the store and both ranks' collectives afterwards
succeed. The same sleep before a barrier fails it: the collective timeout is real."""

from __future__ import annotations

import os
import socket
import time

import pytest

pytestmark = pytest.mark.integration

COLLECTIVE_TIMEOUT_S = 2.0
DOWNLOAD_S = 4.0  # twice the collective timeout


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank: int, port: int, queue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank),
                      WORLD_SIZE="2")
    import torch
    import torch.distributed as dist

    from chunkgrpo.train import dist as D

    torch.set_num_threads(1)
    D.setup("cpu", timeout_s=COLLECTIVE_TIMEOUT_S)
    lines: list[str] = []
    result = {}
    try:
        t0 = time.monotonic()
        if rank == 0:
            time.sleep(DOWNLOAD_S)  # the model fetch of local rank 0
        result["failed"] = D.wait_all("model fetch", False, deadline_s=60, progress_s=1, say=lines.append)
        result["waited_s"] = time.monotonic() - t0
        x = torch.ones(1)
        dist.all_reduce(x)  # the process group survived the wait
        result["all_reduce"] = float(x)
        if rank == 0:
            time.sleep(DOWNLOAD_S)  # the same I/O inside a collective
        try:
            dist.barrier()
            result["barrier"] = "ok"
        except Exception as e:
            result["barrier"] = f"{type(e).__name__}: {str(e)[:120]}"
    except Exception as e:
        result["error"] = f"{type(e).__name__}: {e}"
    result["lines"] = lines
    queue.put((rank, result))


def test_long_single_rank_io_waits_outside_the_collective_timeout():
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = _free_port()
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=240) for _ in procs)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.terminate()
                p.join(timeout=10)
    waiting = results[1]
    assert "error" not in waiting and "error" not in results[0], results
    assert waiting["failed"] == [] and results[0]["failed"] == []
    assert waiting["waited_s"] >= DOWNLOAD_S - 0.5  # it waited through rank 0's download ...
    assert waiting["waited_s"] > COLLECTIVE_TIMEOUT_S  # ... longer than any collective may
    assert waiting["all_reduce"] == 2.0 and results[0]["all_reduce"] == 2.0
    assert any(line.startswith("waiting for rank 0: model fetch, ") and line.endswith(" s of 60 s")
               for line in waiting["lines"]), waiting["lines"]
    assert waiting["barrier"] != "ok", waiting  # control: a collective does time out at 2 s
