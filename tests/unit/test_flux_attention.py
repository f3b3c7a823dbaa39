"""`flux.use_training_attention`: cuDNN's fused attention is off for GPU training, untouched on the CPU."""

import torch

from chunkgrpo.flux import use_training_attention


def test_gpu_training_switches_cudnn_attention_off(monkeypatch):
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", lambda on: calls.append(on))
    calls: list[bool] = []
    assert use_training_attention("cuda:3") is True
    assert use_training_attention(torch.device("cuda")) is True
    assert calls == [False, False]


def test_cpu_leaves_the_backends_alone(monkeypatch):
    calls: list[bool] = []
    monkeypatch.setattr(torch.backends.cuda, "enable_cudnn_sdp", lambda on: calls.append(on))
    assert use_training_attention("cpu") is False
    assert calls == []


def test_the_real_flag_goes_off():
    before = torch.backends.cuda.cudnn_sdp_enabled()
    try:
        torch.backends.cuda.enable_cudnn_sdp(True)
        use_training_attention("cuda")
        assert torch.backends.cuda.cudnn_sdp_enabled() is False
    finally:
        torch.backends.cuda.enable_cudnn_sdp(before)
