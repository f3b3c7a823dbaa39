"""Single-process trainer behaviour on the tiny FLUX (CPU)."""

import json

import pytest
import torch
from safetensors.torch import load_file

from chunkgrpo.errors import UserError
from chunkgrpo.scoring.rewards import compute_rewards
from chunkgrpo.scoring.table import REWARDS
from chunkgrpo.train import checkpoint_format as ckpt
from chunkgrpo.train.config import TrainConfig
from chunkgrpo.train.trainer import NonFiniteLossError, Trainer, run_training


@pytest.fixture(scope="module")
def prompts_file(tmp_path_factory):
    p = tmp_path_factory.mktemp("data") / "prompts.txt"
    p.write_text("a cat on a chair\na red car\nthree apples\na bowl of fruit\n")
    return p


def _cfg(tiny_model_dir, prompts_file, out, *over):
    return TrainConfig.load(
        "tiny_cpu",
        [f"model={tiny_model_dir}", f"prompts={prompts_file}", f"output_dir={out}", "progress=false", *over],
    )


@pytest.mark.parametrize("method,extra", [("chunk", []), ("dance", ["timestep_fraction=0.34"]),
                                          ("chunk+ws", ["chunk_backward=graph"])])
def test_training_changes_lora_and_wastes_no_transformer_calls(
    tiny_model_dir, prompts_file, tmp_path, method, extra
):
    cfg = _cfg(
        tiny_model_dir,
        prompts_file,
        tmp_path,
        f"method={method}",
        "max_steps=2",
        "checkpoint.every=1",
        *extra,
    )
    t = Trainer(cfg)
    t.setup()
    before = {n: p.detach().clone() for n, p in t.model.transformer.named_parameters() if p.requires_grad}
    m = t.iteration()  # 8 samples, grad_accum 8 → one optimizer step, every unit on-policy
    t.iteration_idx += 1
    after = dict(t.model.transformer.named_parameters())
    assert any(not torch.equal(before[n], after[n]) for n in before if "lora_B" in n)
    assert all(
        torch.equal(before[n], after[n].detach()) for n in before if "lora_A" not in n and "lora_B" not in n
    )
    # rollout = N calls for the whole group, step 0 (same noise) once per prompt; training = exactly one
    # forward(+backward) per distinct trained (sample, step) input
    assert (
        m["rollout_samples"]
        == cfg.sampling.num_steps * cfg.samples_per_rank - (cfg.group_size - 1) * cfg.prompts_per_rank
    )
    assert m["transformer_samples"] == m["min_transformer_samples"]
    assert m["ratio_mean"] == 1.0 and m["clip_frac"] == 0.0  # on-policy exactness
    assert torch.isfinite(torch.tensor(m["loss"]))
    t.close()


def test_full_run_checkpoints_and_exports_loadable_lora(tiny_model_dir, prompts_file, tmp_path):
    cfg = _cfg(
        tiny_model_dir, prompts_file, tmp_path, "max_steps=3", "checkpoint.every=1", "checkpoint.keep=2"
    )
    summary = run_training(cfg)
    assert summary["optimizer_steps"] == 3 and len(summary["history"]) == 3
    done = ckpt.complete_checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in done] == ["step-000002", "step-000003"]  # keep=2 pruned step 1
    state = json.loads((done[-1] / "trainer_state.json").read_text())
    assert state["iteration"] == 3 and state["optimizer_step"] == 3
    final = tmp_path / "final"
    meta = json.loads((final / "chunkgrpo_model.json").read_text())
    assert meta["kind"] == "lora" and meta["chunk_sizes"] == [2, 2, 3]
    from diffusers import FluxPipeline

    pipe = FluxPipeline.from_pretrained(tiny_model_dir, dtype=torch.float32)
    pipe.load_lora_weights(final)
    sd = load_file(str(final / "pytorch_lora_weights.safetensors"))
    assert any(v.abs().sum() > 0 for k, v in sd.items() if "lora_B" in k)
    assert (tmp_path / "samples").exists()  # image grids every N iterations
    meta_keys = list(_header(final / "pytorch_lora_weights.safetensors")["__metadata__"])
    assert meta_keys == sorted(meta_keys) and len(meta_keys) == 2  # canonical_safetensors_header ran


def _header(path) -> dict:
    import struct

    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8:8 + n])


def test_the_same_lora_weights_are_written_as_the_same_bytes(tmp_path):
    """safetensors writes the metadata in a HashMap order drawn per map (8 saves of the same weights in
    one process gave two different files); after canonical_safetensors_header every save is identical,
    loads as before and keeps the metadata."""
    from diffusers import FluxPipeline
    from safetensors import safe_open

    from chunkgrpo.train.trainer import canonical_safetensors_header

    sd = {"transformer.a.lora_A.weight": torch.arange(6.0).reshape(2, 3), "transformer.a.lora_B.weight":
          torch.ones(3, 2)}
    files = []
    for i in range(8):
        FluxPipeline.save_lora_weights(tmp_path / str(i), transformer_lora_layers=sd,
                                       transformer_lora_adapter_metadata={"r": 2, "lora_alpha": 2,
                                                                          "target_modules": ["to_q"]})
        path = tmp_path / str(i) / "pytorch_lora_weights.safetensors"
        before = _header(path)
        canonical_safetensors_header(path)
        assert _header(path) == before  # the same header, reordered only
        files.append(path.read_bytes())
    assert len(set(files)) == 1
    loaded = load_file(str(tmp_path / "0" / "pytorch_lora_weights.safetensors"))
    want = {f"transformer.{k}": v.tolist() for k, v in sd.items()}
    assert {k: v.tolist() for k, v in loaded.items()} == want
    with safe_open(str(tmp_path / "0" / "pytorch_lora_weights.safetensors"), "pt") as f:
        assert json.loads(f.metadata()["lora_adapter_metadata"])["transformer.r"] == 2


def test_nan_loss_stops_run_and_keeps_last_good_checkpoint(
    tiny_model_dir, prompts_file, tmp_path, monkeypatch
):
    calls = {"n": 0}

    def flaky(**_):
        def fn(images, prompts):
            calls["n"] += 1
            r = torch.rand(len(images))
            if calls["n"] == 3:
                r[1] = float("nan")
            return r
        return fn

    monkeypatch.setitem(REWARDS, "flaky", flaky)
    cfg = _cfg(
        tiny_model_dir,
        prompts_file,
        tmp_path,
        "max_steps=5",
        "checkpoint.every=1",
        "checkpoint.keep=5",
        "rewards=[{name: flaky, weight: 1.0}]",
    )
    with pytest.raises(ValueError, match=r"reward 'flaky' is non-finite for samples \[1\]"):
        run_training(cfg)
    done = ckpt.complete_checkpoints(tmp_path / "checkpoints")
    assert [p.name for p in done] == ["step-000001", "step-000002"]
    assert not list((tmp_path / "checkpoints").glob(".staging*"))
    assert not (tmp_path / "final").exists()


def test_non_finite_loss_guard(tiny_model_dir, prompts_file, tmp_path, monkeypatch):
    cfg = _cfg(tiny_model_dir, prompts_file, tmp_path, "max_steps=2", "checkpoint.every=1")
    t = Trainer(cfg)
    t.setup()
    import chunkgrpo.train.grpo as tm

    nan = {"loss": torch.tensor(float("nan")), "ratio": torch.tensor(1.0), "log_ratio": torch.tensor(0.0),
           "clipped": torch.tensor(False)}
    monkeypatch.setattr(tm.policy_window, "window_backward", lambda units, *a, **k: [nan for _ in units])
    with pytest.raises(NonFiniteLossError, match="non-finite loss"):
        t.iteration()
    t.close()


@pytest.mark.parametrize("over,match", [
    (["model=/no/such/model"], "does not exist"),
    (["chunks=sizes:2,2,2"], "sum to 6 but there are 7 trainable steps"),
    (["group_size=1"], "group_size must be >= 2"),
    (["grad_accum=3"], "must divide"),
    (["rewards=[{name: nope}]"], "unknown reward .nope."),
])
def test_bad_input_fails_before_training(tiny_model_dir, prompts_file, tmp_path, over, match):
    with pytest.raises(UserError, match=match):
        cfg = _cfg(tiny_model_dir, prompts_file, tmp_path, *over)
        t = Trainer(cfg)
        t.setup()  # the unknown-reward case fails here, before any rollout
    assert not (tmp_path / "checkpoints").exists() or not any((tmp_path / "checkpoints").iterdir())


def test_empty_prompt_file(tiny_model_dir, tmp_path):
    empty = tmp_path / "empty.txt"
    empty.write_text("\n\n")
    with pytest.raises(UserError, match="contains no prompts"):
        Trainer(TrainConfig.load("tiny_cpu", [f"model={tiny_model_dir}", f"prompts={empty}"]))


def test_non_finite_rewards_named():
    with pytest.raises(ValueError, match=r"non-finite for samples \[0\]"):
        compute_rewards({"b": lambda im, p: torch.tensor([float("inf"), 1.0])}, [None, None], ["a", "b"])


def test_kl_term_costs_no_extra_transformer_calls(tiny_model_dir, prompts_file, tmp_path):
    """Off-policy units (after the first optimizer step of a rollout) with a KL term: the KL rides on
    the unit's own forward, so graph mode still makes exactly the minimum number of calls."""
    cfg = _cfg(tiny_model_dir, prompts_file, tmp_path, "max_steps=2", "grad_accum=4", "kl_coef=0.1",
               "chunk_backward=graph")
    t = Trainer(cfg)
    t.setup()
    m = t.iteration()
    assert t.opt_step == 2  # 8 samples, accum 4: the second half is off-policy
    assert m["transformer_samples"] == m["min_transformer_samples"]
    assert m["ratio_mean"] != 1.0 and m["kl_k3"] > 0
    t.close()


def test_setup_chooses_the_training_attention_for_its_device(tiny_model_dir, prompts_file, tmp_path,
                                                              monkeypatch):
    """`Trainer.setup` routes its device through `flux.use_training_attention` (cuDNN attention off on a
    GPU: its backward fails on FLUX at 720², measured on an H200) before the model loads."""
    import chunkgrpo.flux as F

    seen = []
    real_load = F.load_flux
    monkeypatch.setattr(F, "use_training_attention", lambda dev: seen.append(("attention", str(dev))))
    monkeypatch.setattr(F, "load_flux", lambda *a, **k: seen.append(("load",)) or real_load(*a, **k))
    t = Trainer(_cfg(tiny_model_dir, prompts_file, tmp_path, "max_steps=1"))
    t.setup()
    t.close()
    assert seen[:2] == [("attention", "cpu"), ("load",)]
