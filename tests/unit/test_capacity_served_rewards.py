"""The capacity plan of a run whose reward is served (`rewards: [{name, url}]`): the reward model leaves
every training rank's phases and the model cache, and the plan sizes the reward server instead."""

from __future__ import annotations

from chunkgrpo.capacity.io import CUDA_CONTEXT_BYTES
from chunkgrpo.capacity.plan import (
    ASSUMED_ITERATION_S,
    REWARD_MODELS,
    capacity_plan,
    render_markdown,
    render_table,
    reward_download_bytes,
)
from chunkgrpo.capacity.pool import load_pool
from chunkgrpo.train.config import TrainConfig

URL = "http://reward-hpsv3:8000"


def _gpu(plan) -> dict:
    return {i.what: i for i in plan.items if i.resource == "GPU memory per rank"}


def test_served_reward_leaves_the_ranks_and_sizes_the_server():
    pool = load_pool("h800")
    local = capacity_plan(TrainConfig.load("chunk_grpo_flux"), pool, preset="chunk_grpo_flux")
    served = capacity_plan(TrainConfig.load("chunk_grpo_flux", [f"rewards=[{{name: hpsv3, url: {URL}}}]"]),
                           pool, preset="chunk_grpo_flux")
    hpsv3 = REWARD_MODELS["hpsv3"][0] * REWARD_MODELS["hpsv3"][1]
    assert round(hpsv3 / 2**30, 1) == 15.4

    # in-process: the reward model is a part of every phase, and no server is planned
    assert all(i.parts["reward models"] == hpsv3 for i in _gpu(local).values())
    assert not [i for i in local.items if i.resource.startswith("reward server")]
    assert local.facts["reward_services"] == [] and local.facts["reward_bytes_freed_per_rank"] == 0
    assert "reward server" not in render_table(local) and "reward server" not in render_markdown(local)

    # served: no phase has a reward part, each is smaller by the model (and its worker's context), and so
    # is the model cache
    assert served.facts["reward_bytes_freed_per_rank"] == hpsv3
    for phase, item in _gpu(served).items():
        assert "reward models" not in item.parts, phase
        # the model, and the CUDA context of the worker process that scored with it
        assert _gpu(local)[phase].need - item.need == hpsv3 + CUDA_CONTEXT_BYTES, phase
    cache = {i.resource: i for i in local.items if i.resource.startswith("volume")}
    cache_served = {i.resource: i for i in served.items if i.resource.startswith("volume")}
    for name, item in cache.items():
        key = next(k for k in item.parts if k.startswith("model cache"))
        assert item.parts[key] - cache_served[name].parts[key] == reward_download_bytes("hpsv3")

    # the server: its GPU memory for the model, and the rate 8 ranks × 2 prompts × 12 images per iteration
    [row] = [i for i in served.items if i.resource == "reward server hpsv3"]
    assert row.need == hpsv3 and row.have == _gpu(served)["policy phase"].have and row.fits
    [svc] = served.facts["reward_services"]
    assert svc["url"] == URL and svc["images_per_iteration"] == 8 * 2 * 12
    assert svc["images_per_s"] == 192 / ASSUMED_ITERATION_S
    text = render_table(served)
    assert "served rewards free 15.4 GiB of GPU memory per rank" in text
    assert f"192 images per iteration / {ASSUMED_ITERATION_S:g} s per iteration (assumed)" in text
    md = render_markdown(served)  # the pipeline preflight's capacity report
    assert "| reward server hpsv3 | GPU memory (model) | 15.4 GiB |" in md
    assert "Served rewards free 15.4 GiB of GPU memory per rank." in md and "192 images per iteration" in md
