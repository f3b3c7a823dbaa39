"""`backends.load_state_strict`: the scorer checkpoints load strictly, and a checkpoint that does not fit
fails in one line naming the keys (the real ImageReward package test, with its own
model class, is in test_scorers_packages.py)."""

from __future__ import annotations

import pytest
import torch

from chunkgrpo.scoring.backends import SpecError, load_state_strict


class _Head(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = torch.nn.Linear(4, 4)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 1))
        self.register_buffer("ids", torch.arange(4))
        self.register_buffer("scratch", torch.ones(2), persistent=False)


def _empty_head() -> _Head:
    """Parameters on the meta device, buffers real: what
    `accelerate.init_empty_weights(include_buffers=False)` builds."""
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        return _Head()


def test_a_full_checkpoint_loads_every_weight():
    src, dst = _Head(), _Head()
    load_state_strict(dst, src.state_dict(), "ckpt")
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values()))


def test_missing_weights_name_the_keys_in_one_line():
    state = {k: v for k, v in _Head().state_dict().items() if not k.startswith("mlp.")}
    with pytest.raises(SpecError) as e:
        load_state_strict(_Head(), state, "imagereward: checkpoint 'x.pt'")
    msg = str(e.value)
    assert "\n" not in msg
    assert msg == (
        "imagereward: checkpoint 'x.pt' does not fit the model: it lacks 4 of the model's 7 weights "
        "(mlp.0.bias, mlp.0.weight, mlp.2.bias, mlp.2.weight)"
    )


def test_extra_weights_and_shapes_are_refused():
    state = {**_Head().state_dict(), "text_decoder.w": torch.zeros(1)}
    with pytest.raises(SpecError, match=r"has 1 weights the model does not \(text_decoder.w\)"):
        load_state_strict(_Head(), state, "ckpt")
    bad = {**_Head().state_dict(), "body.weight": torch.zeros(5, 4)}
    with pytest.raises(
        SpecError, match=r"ckpt does not fit the model: .*body.weight.*size mismatch|size mismatch"
    ):
        load_state_strict(_Head(), bad, "ckpt")
    with pytest.raises(SpecError, match="not a state dict"):
        load_state_strict(_Head(), [1, 2], "ckpt")


def test_a_gpu_asked_for_but_unusable_is_one_line_never_the_cpu(monkeypatch):
    """The scorers' device: `cuda`, or `auto` in a task given GPUs, with a torch that sees none (here: the
    CPU build) is a SpecError naming torch and the environment; `auto` without a grant is the CPU."""
    import torch

    from chunkgrpo.scoring.backends import SpecError, resolve_device

    if torch.cuda.is_available():
        pytest.skip("this machine has a usable GPU")
    monkeypatch.delenv("NVIDIA_VISIBLE_DEVICES", raising=False)
    assert resolve_device("auto") == "cpu" and resolve_device("cpu") == "cpu"
    with pytest.raises(SpecError, match=r"device=cuda but torch .* \[torch of "):
        resolve_device("cuda")
    monkeypatch.setenv("NVIDIA_VISIBLE_DEVICES", "GPU-0a1b")
    with pytest.raises(SpecError, match=r"device=auto in a task that was given GPUs"):
        resolve_device("auto")


def test_the_worker_stages_every_module_its_imports_need(tmp_path):
    """The staged folder alone provides chunkgrpo to the reward venvs: each staged module imports from it,
    and so do the modules they import (chunkgrpo.gpu, chunkgrpo.errors); nothing comes from elsewhere."""
    import subprocess
    import sys

    from chunkgrpo.scoring.client import STAGED_MODULES, stage_modules

    root = stage_modules()
    code = ("import importlib, sys\n"
            + "".join(f"importlib.import_module({m!r})\n" for m in STAGED_MODULES)
            + "import chunkgrpo.scoring.backends as b\nb.resolve_device('cpu')\n"
            + "print('\\n'.join(m.__file__ for n, m in sys.modules.items() if n.startswith('chunkgrpo')))\n")
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin", "PYTHONSAFEPATH": "1", "PYTHONNOUSERSITE": "1"}
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr[-2000:]
    files = [f for f in r.stdout.splitlines() if f]
    assert files and all(f.startswith(str(root)) for f in files), files


def test_an_empty_model_takes_a_half_precision_checkpoint_in_its_own_dtype():
    src = _Head()
    half = {k: (v.half() if v.is_floating_point() else v) for k, v in src.state_dict().items()}
    dst = _empty_head()
    assert all(p.is_meta for p in dst.parameters()) and not dst.ids.is_meta
    load_state_strict(dst, half, "ckpt", assign=True)
    assert not any(t.is_meta for t in [*dst.parameters(), *dst.buffers()])
    for k, v in dst.state_dict().items():
        assert v.dtype == src.state_dict()[k].dtype  # float32 (int64 for the index buffer)
        assert torch.equal(v, half[k].to(v.dtype))
    assert torch.equal(dst.scratch, torch.ones(2))  # a buffer the checkpoint does not hold stays built
    x = torch.randn(2, 4)
    copied = _Head()
    load_state_strict(copied, half, "ckpt")  # the copying load of the same checkpoint computes the same
    assert torch.equal(dst.mlp(dst.body(x)), copied.mlp(copied.body(x)))


def test_an_empty_model_refuses_what_does_not_fit_as_a_built_one():
    state = {k: v for k, v in _Head().state_dict().items() if not k.startswith("mlp.")}
    with pytest.raises(SpecError, match=r"^ckpt does not fit the model: it lacks 4 of the model's 7 weights"):
        load_state_strict(_empty_head(), state, "ckpt", assign=True)
    bad = {**_Head().state_dict(), "body.weight": torch.zeros(5, 4)}
    with pytest.raises(SpecError, match=r"size mismatch"):
        load_state_strict(_empty_head(), bad, "ckpt", assign=True)
