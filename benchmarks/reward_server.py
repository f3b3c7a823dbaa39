"""Throughput of `chunkgrpo reward-server`: N training clients (threads, each a `RemoteReward`) scoring
batches of PNG images against one server process on 127.0.0.1. Prints JSON.

    .venv/bin/python benchmarks/reward_server.py                          # 8 clients, brightness, 64x64
    .venv/bin/python benchmarks/reward_server.py --clients 1 --size 256   # one client, larger images

What it measures: images scored per second of wall time, all clients together, including each client's
PNG encoding and the server's decoding (the scoring itself is the cheap `brightness` reward unless
--scorer names another), on whatever cores the machine has (the server and the clients share them).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def images(n: int, size: int, seed: int = 0):
    import torch
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    px = (torch.rand(n, size, size, 3, generator=g) * 255).to(torch.uint8).numpy()
    return [Image.fromarray(a, "RGB") for a in px]


def measure(url: str, scorer: str, clients: int, rounds: int, batch: int, size: int) -> dict:
    """`clients` threads, each scoring `rounds` batches of `batch` images of `size`²: images per second."""
    from chunkgrpo.scoring.remote import RemoteReward

    ims, prompts = images(batch, size), [f"p{i}" for i in range(batch)]
    done: list[int] = []

    def client():
        reward = RemoteReward(url, scorer, max_batch=batch)
        for _ in range(rounds):
            done.append(len(reward(ims, prompts)))

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if sum(done) != clients * rounds * batch:
        raise RuntimeError(f"{sum(done)} of {clients * rounds * batch} images scored")
    return {"images_per_s": round(sum(done) / wall, 1), "images": sum(done), "wall_s": round(wall, 3),
            "clients": clients, "batch": batch, "size": size, "scorer": scorer}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--scorer", default="brightness")
    p.add_argument("--clients", type=int, default=8)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--size", type=int, default=64)
    args = p.parse_args(argv)
    token = secrets.token_hex(16)
    os.environ["CHUNKGRPO_REWARD_TOKEN"] = token
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    server = subprocess.Popen(
        [sys.executable, "-m", "chunkgrpo", "reward-server", "--scorer", args.scorer, "--port", "0",
         "--max-batch", str(args.batch)],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
    try:
        url = server.stdout.readline().split()[-1]
        deadline = time.monotonic() + 300
        while True:
            try:
                with urllib.request.urlopen(f"{url}/readyz", timeout=5) as r:
                    if r.status == 200:
                        break
            except OSError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.1)
        result = measure(url, args.scorer, args.clients, args.rounds, args.batch, args.size)
    finally:
        server.terminate()
        server.wait(30)
    result.update(cores=os.cpu_count(), load_1min=round(os.getloadavg()[0], 2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
