"""FSDP under real torchrun processes (gloo, CPU) with the sharded load (chunkgrpo/train/model_load.py):
each rank reads only its rows, and together they hold exactly the stored transformer (3 ranks: FSDP's
uneven split); 2 FSDP ranks train like 2 DDP replicas; LoRA under FSDP trains exactly as after the whole
load it replaces."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

pytestmark = pytest.mark.integration

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
WEIGHTS = "diffusion_pytorch_model.safetensors"


ROOT = Path(__file__).resolve().parents[2]
# `python -m chunkgrpo.train` with the whole load under FSDP: every rank reads the whole transformer, adds
# the adapters, then shards it (the load path LoRA under FSDP took before it was sharded)
WHOLE_LOAD = """
import runpy, sys
from chunkgrpo import threads
threads.set_env_policy()
import chunkgrpo.train.model_load as model_load
assert "sharded_load" in model_load.load_policy_model.__code__.co_names  # the switch this replaces
model_load.sharded_load = lambda cfg, world: False
sys.argv[0] = "chunkgrpo.train"
runpy.run_module("chunkgrpo.train", run_name="__main__", alter_sys=True)
"""


def _run(nproc, model, prompts, out, port, *over, script=None):
    entry = [str(script)] if script else ["-m", "chunkgrpo.train"]
    cmd = [TORCHRUN, f"--nproc_per_node={nproc}", "--master_addr=127.0.0.1", f"--master_port={port}",
           *entry, "--config", "tiny_cpu", f"model={model}", f"prompts={prompts}",
           f"output_dir={out}", "progress=false", "max_steps=2", *over]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error",
           "PYTHONPATH": str(ROOT)}
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]


def _train(nproc, model, prompts, out, port, *over):
    _run(nproc, model, prompts, out, port, "lora.enabled=false", *over)
    return load_file(str(out / "final" / "transformer" / WEIGHTS))


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "prompts.txt"
    p.write_text("a cat on a chair\na red car\nthree apples\na bowl of fruit\na dog in the park\na city\n")
    return p


def test_three_sharded_ranks_hold_exactly_the_stored_transformer(tiny_model_dir, prompts, tmp_path):
    """lr=0: the exported transformer (gathered from 3 ranks' shards; most dims do not split evenly in 3)
    is the stored one, bit for bit, and its config names the diffusers class."""
    import json

    final = _train(3, tiny_model_dir, prompts, tmp_path / "out", 29561, "distributed=fsdp", "lr=0")
    stored = load_file(str(tiny_model_dir / "transformer" / WEIGHTS))
    assert final.keys() == stored.keys()
    assert [k for k in stored if not torch.equal(final[k], stored[k].float())] == []
    assert any(v.ndim and v.shape[0] % 3 for v in stored.values())  # uneven splits were exercised
    config = json.loads((tmp_path / "out" / "final" / "transformer" / "config.json").read_text())
    assert config["_class_name"] == "FluxTransformer2DModel"
    ranks = [json.loads((tmp_path / "out" / "ranks" / f"rank{i}.json").read_text()) for i in range(3)]
    assert all(r["sharded"] for r in ranks) and len({r["trainable_sha256"] for r in ranks}) == 3


def test_fsdp_full_finetuning_trains_like_ddp(tiny_model_dir, prompts, tmp_path):
    """Same seeds, same maths: the two strategies differ only in the float reduction order (all-reduce vs
    reduce-scatter), which Adam's normalisation of these small gradients amplifies to ~1e-5; the weights
    agree within under half an Adam step (lr 1e-4 per step), and they moved by more than one."""
    base = load_file(str(tiny_model_dir / "transformer" / WEIGHTS))
    fsdp = _train(2, tiny_model_dir, prompts, tmp_path / "fsdp", 29562, "distributed=fsdp", "lr=1e-4")
    ddp = _train(2, tiny_model_dir, prompts, tmp_path / "ddp", 29563, "distributed=ddp", "lr=1e-4")
    assert fsdp.keys() == ddp.keys() == base.keys()
    assert max(float((fsdp[k] - ddp[k]).abs().max()) for k in base) < 4e-5
    assert max(float((fsdp[k] - base[k]).abs().max()) for k in base) > 1e-4


def test_lora_under_fsdp_trains_exactly_as_after_the_whole_load(tiny_model_dir, prompts, tmp_path):
    """bf16 base (as on a GPU) + fp32 adapters on 2 FSDP ranks, 2 optimizer steps at the same seed: the
    sharded load (meta build, adapters initialised on the host, each rank's rows read) and the whole load
    give bit-identical losses, rewards, gradient norms and exported adapters; the adapters moved; the
    export is the adapter alone (a diffusers LoRA file), as before."""
    import json

    over = ("distributed=fsdp", "lora.enabled=true", "mixed_precision=bf16", "seed=5", "lr=1e-3")
    whole_load = tmp_path / "whole_load.py"
    whole_load.write_text(WHOLE_LOAD)
    _run(2, tiny_model_dir, prompts, tmp_path / "sharded", 29564, *over)
    _run(2, tiny_model_dir, prompts, tmp_path / "whole", 29565, *over, script=whole_load)
    lora = "final/pytorch_lora_weights.safetensors"
    sharded, whole = (load_file(str(tmp_path / k / lora)) for k in ("sharded", "whole"))
    assert sharded.keys() == whole.keys() and any("lora_A" in k for k in whole)
    assert [k for k in whole if not torch.equal(sharded[k], whole[k])] == []
    assert any(v.abs().max() > 0 for k, v in whole.items() if "lora_B" in k)  # B starts at zero: it trained
    assert sorted(p.name for p in (tmp_path / "sharded" / "final").iterdir()) == sorted(
        p.name for p in (tmp_path / "whole" / "final").iterdir())
    assert not (tmp_path / "sharded" / "final" / "transformer").exists()  # the adapter only
    hist = [json.loads((tmp_path / k / "train_summary.json").read_text())["history"]
            for k in ("sharded", "whole")]
    assert len(hist[0]) >= 2 and hist[0] == hist[1]
