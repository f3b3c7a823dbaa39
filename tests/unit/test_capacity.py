"""The capacity plan (chunkgrpo/capacity/): exact parameter counts on the meta device, the meta simulation
of activation memory against real CPU allocations, the pool read from the rendered manifests, one-line
failures, and the prediction against a real training iteration of the project's trainer on the CPU.

Measurement: torch's profiler with `profile_memory=True` records every allocation and free of c10's CPU
allocator (the `[memory]` events, signed byte counts), so their running sum is the exact number of bytes
torch has allocated, independent of glibc's caching (RSS would not be) and of Python's allocator
(tracemalloc does not see torch). Tolerance: the measured peak of one steady-state training iteration
(rollout, decode, policy windows, optimizer step; the second iteration, after AdamW's state exists) is
within 5 % of the predicted working set. The prediction leaves out only small tensors (log-probs,
advantages, the decoded images' float copy, gradient-norm temporaries): measured 0.2–1.0 % above it on
the tiny and mid models, with and without gradient checkpointing, LoRA and full fine-tuning.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from chunkgrpo.capacity.arch import (
    FLUX_DEV,
    FLUX_DEV_TRANSFORMER_PARAMS,
    LiveBytes,
    ModelArch,
    param_count,
    transformer_activation_peak,
)
from chunkgrpo.capacity.plan import capacity_plan
from chunkgrpo.capacity.pool import load_pool, local_pool
from chunkgrpo.errors import UserError

REPO = Path(__file__).resolve().parents[2]
# what the plan counts as resident before an iteration starts (the rest is the iteration's working set)
RESIDENT = {"transformer weights", "AdamW state", "EMA", "VAE", "reward models", "prompt embeddings"}


def test_flux_dev_parameter_counts_are_the_published_ones():
    arch = ModelArch(**FLUX_DEV)
    tr = arch.build("transformer")
    assert all(p.device.type == "meta" for p in tr.parameters())  # no weights were allocated
    assert param_count(tr) == FLUX_DEV_TRANSFORMER_PARAMS == 11_901_408_320
    assert param_count(arch.build("text_encoder_2")) == 4_762_310_656  # T5 v1.1 XXL encoder
    assert param_count(arch.build("text_encoder")) == 123_060_480      # CLIP ViT-L/14 text model
    assert param_count(arch.build("vae")) == 83_819_683


def test_live_bytes_counts_new_storages_once_and_frees_them():
    param = torch.zeros(1000)
    with LiveBytes() as m:
        a = torch.empty(1000)          # 4000 bytes
        v = a.view(10, 100).t()        # a view: no new storage
        w = param.t()                  # a view of a storage made outside: not counted
        b = a * 2                      # 4000 more
        assert m.live == 8000
        del a, v, b
        assert m.live == 0
    assert m.peak == 8000 and w is not None


def _real_peak(fn) -> int:
    """Peak bytes allocated by torch's CPU allocator while `fn` runs (profiler memory events)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        fn()
    events = sorted((e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"),
                    key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return peak


@pytest.mark.parametrize("checkpointing", [False, True])
def test_meta_simulation_equals_real_cpu_allocations(tiny_model_dir, checkpointing):
    """One forward + backward of the real tiny transformer on the CPU allocates exactly what the meta
    simulation predicts (parameter gradients pre-allocated in both)."""
    from diffusers import FluxTransformer2DModel

    arch = ModelArch.from_folder(tiny_model_dir)
    meta = arch.build("transformer")
    meta.requires_grad_(True)
    predicted, _ = transformer_activation_peak(meta, 3, 64, 16, torch.float32, grad=True,
                                                 checkpointing=checkpointing)
    real = FluxTransformer2DModel.from_config(arch.transformer)
    if checkpointing:
        real.enable_gradient_checkpointing()
    for p in real.parameters():
        p.grad = torch.zeros_like(p)
    c = real.config
    kw = dict(hidden_states=torch.randn(3, 64, c.in_channels),
              encoder_hidden_states=torch.randn(3, 16, c.joint_attention_dim),
              pooled_projections=torch.randn(3, c.pooled_projection_dim), timestep=torch.rand(3),
              img_ids=torch.zeros(64, 3), txt_ids=torch.zeros(16, 3), guidance=None)

    def step():
        out = real(**kw, return_dict=False)[0].float()
        out.sum().backward()

    measured = _real_peak(step)
    assert measured == pytest.approx(predicted, rel=0.02), (measured, predicted)


# the mid model's real iterations take 11-14 s of CPU each: the integration tier (the tiny one: the fast tier)
_MID = pytest.mark.integration


@pytest.mark.parametrize("size,gc,lora", [("tiny", False, True), pytest.param("mid", True, False, marks=_MID),
                                          pytest.param("mid", False, False, marks=_MID),
                                          pytest.param("mid", False, True, marks=_MID)])
def test_prediction_matches_a_real_training_iteration(tmp_path, size, gc, lora):
    """The trainer's own iteration (rollout of a group, decode, reward, policy windows, optimizer step) on
    the tiny and mid models: measured peak within 5 % of the plan's working set."""
    from chunkgrpo.testing.tiny import build_tiny_flux
    from chunkgrpo.train.config import TrainConfig
    from chunkgrpo.train.trainer import Trainer

    model = build_tiny_flux(tmp_path / "m", size=size)
    (tmp_path / "p.txt").write_text("a red cat\na blue dog\n")
    # fixed layout: 4 samples (no shared step 0), 4 units of 2 steps, 2 trained per sample, windows of 4
    # inputs
    cfg = TrainConfig.load(
        "tiny_cpu",
        [
            f"model={model}",
            f"prompts={tmp_path / 'p.txt'}",
            f"output_dir={tmp_path / 'out'}",
            "max_iterations=2",
            "sampling.height=128",
            "sampling.width=128",
            "sampling.max_sequence_length=32",
            "sampling.num_steps=9",
            "sampling.same_noise=false",
            "chunks=uniform:2",
            "group_size=4",
            "grad_accum=4",
            "policy_batch=4",
            "chunk_backward=graph",
            f"gradient_checkpointing={str(gc).lower()}",
            f"lora.enabled={str(lora).lower()}",
            "checkpoint.every=0",
            "checkpoint.resume=false",
            "tracking.image_every=0",
            "progress=false",
        ],
    )
    trainer = Trainer(cfg)
    try:
        trainer.setup()
        trainer.iteration()  # the first one also creates AdamW's state
        trainer.iteration_idx += 1
        measured = _real_peak(trainer.iteration)
    finally:
        trainer.close()
    plan = capacity_plan(cfg, local_pool(), device="cpu", arch=ModelArch.from_folder(model))
    work = {i.what: sum(v for k, v in i.parts.items() if k not in RESIDENT)
            for i in plan.items if i.resource == "GPU memory per rank"}
    predicted = max(work["rollout phase"], work["decode phase"], work["policy phase"])
    assert measured == pytest.approx(predicted, rel=0.05), (measured, predicted, work)


def _kubectl() -> str:
    venv = Path(sys.executable).parent / "kubectl"
    return str(venv) if venv.exists() else (shutil.which("kubectl") or pytest.skip("no kubectl"))


def test_pool_is_read_from_the_rendered_overlay():
    """--pool h800 = the ClusterTrainingRuntime of manifests/overlays/prod-h800 as kustomize renders it:
    GPUs, memory limit, volumes and env are the rendered ones (whatever a manifest change makes them)."""
    from kubernetes.utils import parse_quantity

    out = subprocess.run(
        [_kubectl(), "kustomize", str(REPO / "manifests/overlays/prod-h800")],
        capture_output=True,
        text=True,
        check=True,
    )
    rt = next(d for d in yaml.safe_load_all(out.stdout) if d and d.get("kind") == "ClusterTrainingRuntime")
    pod = rt["spec"]["template"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    limits = pod["containers"][0]["resources"]["limits"]
    pool = load_pool("h800")
    assert pool.gpu_product == pod["nodeSelector"]["nvidia.com/gpu.product"] == "NVIDIA-H800"
    assert pool.gpus_per_node == int(limits["nvidia.com/gpu"]) == 8
    assert pool.memory_limit == int(parse_quantity(limits["memory"]))
    sizes = {v["name"]: v["emptyDir"].get("sizeLimit") for v in pod["volumes"] if "emptyDir" in v}
    claims = {v["name"]: v["ephemeral"]["volumeClaimTemplate"]["spec"]
              for v in pod["volumes"] if "ephemeral" in v}
    sizes.update({n: c["resources"]["requests"]["storage"] for n, c in claims.items()})  # a claim's size
    for v in pool.volumes:
        assert v.size_limit == (int(parse_quantity(sizes[v.name])) if sizes.get(v.name) else None)
    home = pool.env.get("HOME", "")
    cache = pool.env.get("CHUNKGRPO_CACHE") or f"{home}/.cache/chunkgrpo"
    assert pool.volume_for(cache) is not None  # placed on the volume its path is under


def _runtime_yaml(tmp_path, gpu_mem_product="NVIDIA-H800", tmp_size="10Gi", memory="16Gi") -> Path:
    rt = {
        "kind": "ClusterTrainingRuntime",
        "metadata": {"name": "chunkgrpo-torch"},
        "spec": {
            "template": {
                "spec": {
                    "replicatedJobs": [
                        {
                            "template": {
                                "spec": {
                                    "template": {
                                        "spec": {
                                            "nodeSelector": {"nvidia.com/gpu.product": gpu_mem_product},
                                            "containers": [
                                                {
                                                    "name": "node",
                                                    "env": [{"name": "HOME", "value": "/tmp"}],
                                                    "resources": {
                                                        "limits": {"nvidia.com/gpu": 2, "memory": memory}
                                                    },
                                                    "volumeMounts": [
                                                        {"name": "tmp", "mountPath": "/tmp"},
                                                        {"name": "cache", "mountPath": "/cache"},
                                                    ],
                                                }
                                            ],
                                            # /cache: where the launcher's output_dir (/cache/train)
                                            # lives, as in the real runtime
                                            "volumes": [
                                                {"name": "tmp", "emptyDir": {"sizeLimit": tmp_size}},
                                                {"name": "cache", "emptyDir": {"sizeLimit": "40Gi"}},
                                            ],
                                        }
                                    }
                                }
                            }
                        }
                    ]
                }
            }
        },
    }
    path = tmp_path / "runtime.yaml"
    path.write_text(yaml.safe_dump(rt))
    return path


def test_cli_fails_in_one_line_naming_the_resource_and_the_excess(tiny_model_dir, tmp_path, capsys):
    from chunkgrpo.cli import main

    runtime = _runtime_yaml(tmp_path, tmp_size="64Ki")  # the tiny model alone needs more than 64 KiB
    rc = main(["capacity", "--config", "tiny_cpu", "--pool", "h800", "--runtime", str(runtime),
               f"model={tiny_model_dir}"])
    out, err = capsys.readouterr()
    assert rc == 2
    line = err.strip().splitlines()[-1]
    assert "volume tmp (/tmp)" in line and "over)" in line and "+" in line
    assert "volume tmp (/tmp)" in out  # the table was printed first
    rc = main(
        [
            "capacity",
            "--config",
            "tiny_cpu",
            "--pool",
            "h800",
            "--runtime",
            str(_runtime_yaml(tmp_path)),
            f"model={tiny_model_dir}",
            "--json",
        ]
    )
    out, _ = capsys.readouterr()
    assert rc == 0
    import json

    plan = json.loads(out)
    assert plan["fits"] and plan["world"] == 2 and plan["pool"]["gpus_per_node"] == 2


def test_bad_pool_inputs_are_one_line_user_errors(tmp_path):
    with pytest.raises(UserError, match="no overlay"):
        load_pool("h900")
    with pytest.raises(UserError, match="no known memory size"):
        load_pool("x", str(_runtime_yaml(tmp_path, gpu_mem_product="NVIDIA-X1")))
    with pytest.raises(UserError, match="does not exist"):
        load_pool("h800", str(tmp_path / "absent.yaml"))


def test_flux_full_finetune_plan_shards_weights_and_counts_checkpoints():
    """chunk_grpo_flux on the H800 pool: FSDP shards the fp32 master weights and AdamW over 8 ranks,
    the load phase holds this rank's fp32 shards only (the sharded load), a checkpoint is weights + AdamW."""
    from chunkgrpo.train.config import TrainConfig

    plan = capacity_plan(TrainConfig.load("chunk_grpo_flux"), load_pool("h800"), preset="chunk_grpo_flux")
    W = FLUX_DEV_TRANSFORMER_PARAMS
    gpu = {i.what: i for i in plan.items if i.resource == "GPU memory per rank"}
    assert plan.world == 8 and plan.facts["fsdp"] and plan.facts["policy_inputs_per_forward"] == 7
    assert gpu["policy phase"].parts["transformer weights"] == 4 * W // 8
    assert gpu["policy phase"].parts["AdamW state"] == 8 * W // 8
    assert plan.facts["load_path"] == "sharded"
    assert 4 * W / 8 <= gpu["load phase"].parts["transformer shard (fp32, 1/n)"] <= 1.001 * 4 * W / 8
    assert "whole transformer in the load dtype" not in gpu["load phase"].parts
    # the host holds one tensor's rows of the transformer, no copy: a pod's load is the frozen components
    # (bf16, T5's `wo` in fp32 while it loads) on 8 ranks, below the 8 ranks' checkpoint shares
    assert plan.facts["transformer_load_host_bytes"] < 2**30
    host = next(i for i in plan.items if i.resource == "host memory per pod")
    assert host.parts["peak of load / checkpoint"] == 12 * W
    assert plan.facts["checkpoint_bytes"] == 12 * W
    # /cache is a generic ephemeral volume (a claim, not node disk): no disk-backed emptyDir is left to count
    eph = [i for i in plan.items if i.resource == "ephemeral storage per pod"]
    assert [i.need for i in eph] == [0]
    assert all(i.need > 0 for i in plan.items if i not in eph)
    # the frozen text encoders and VAE load in bf16 (`load_flux(frozen_dtype=)`): T5-XXL, CLIP and the VAE
    load = gpu["load phase"]
    assert load.parts["text encoders + VAE"] < 2 * 5_000_000_000
    assert load.need <= load.have, f"load phase {load.need / 2**30:.1f} GiB > {load.have / 2**30:.1f} GiB"
    assert all(i.need <= i.have for i in plan.items if i.have), [
        i.what for i in plan.items if i.need > (i.have or 1e30)
    ]


def test_frozen_components_load_in_the_frozen_dtype(tiny_model_dir):
    """Full fine-tuning keeps the transformer in fp32 (master weights) and its frozen parts in bf16."""
    import torch

    from chunkgrpo.flux import load_flux

    m = load_flux(tiny_model_dir, dtype=torch.float32, frozen_dtype=torch.bfloat16)
    assert next(m.pipe.transformer.parameters()).dtype == torch.float32
    for name in ("text_encoder", "text_encoder_2", "vae"):
        assert next(getattr(m.pipe, name).parameters()).dtype == torch.bfloat16, name
    emb = m.encode_prompts(["a red cube"], max_sequence_length=16)
    assert emb.prompt_embeds.dtype == torch.float32 and torch.isfinite(emb.prompt_embeds).all()


def test_model_cache_counts_every_downloaded_file_and_no_unloaded_copy():
    """The model cache of chunk_grpo_flux (HPSv3 in-process): the FLUX folders the pipeline loads (bf16),
    nothing for the hub's single-file copies `models sync` leaves out, and both downloads of HPSv3 (its
    checkpoint and the Qwen2-VL-7B-Instruct base model it builds on, 16.6 GB each)."""
    from chunkgrpo.capacity.plan import REWARD_MODELS, reward_download_bytes
    from chunkgrpo.train.config import TrainConfig

    plan = capacity_plan(TrainConfig.load("chunk_grpo_flux"), load_pool("h800"), preset="chunk_grpo_flux")
    assert [r.name for r in TrainConfig.load("chunk_grpo_flux").rewards] == ["hpsv3"]
    (cache,) = [v for i in plan.items for k, v in i.parts.items() if k.startswith("model cache")]
    f = plan.facts
    flux = 2 * (FLUX_DEV_TRANSFORMER_PARAMS + f["text_encoder_params"] + f["text_encoder_2_params"]
                + f["vae_params"])
    assert 33.0e9 < flux < 34.0e9  # the diffusers folders of FLUX.1-dev (pod_faithful.FLUX_DEV_BYTES)
    assert reward_download_bytes("hpsv3") == 4 * REWARD_MODELS["hpsv3"][0] > 33e9
    assert cache == flux + reward_download_bytes("hpsv3")
