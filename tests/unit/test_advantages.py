import pytest
import torch

from chunkgrpo.advantages import aggregate_advantages, group_advantages, normalize_group
from chunkgrpo.errors import UserError
from tests.cpu_kernels import tol

# float results compared across formulas and layouts: CI runs these under every ATEN_CPU_CAPABILITY
pytestmark = pytest.mark.exactness


def test_group_normalisation_unbiased_std_per_prompt():
    r = torch.tensor([1.0, 2.0, 3.0, 10.0, 10.0, 40.0])
    a = group_advantages(r, 3)
    g1 = (torch.tensor([1.0, 2, 3]) - 2) / (torch.tensor([1.0, 2, 3]).std(unbiased=True) + 1e-8)
    torch.testing.assert_close(
        a[:3], g1, **tol(torch.float32, ulps=10)
    )  # float64 maths, fp32 result vs fp32 reference
    torch.testing.assert_close(
        a[3:].sum(), torch.tensor(0.0), **tol(torch.float32)
    )  # centred within its own group


def test_zero_variance_group_gives_exact_zeros_not_nan():
    r = torch.tensor([0.3, 0.3, 0.3, 0.3, 1.0, 2.0])
    a = group_advantages(r, 3)
    assert torch.equal(a[:3], torch.zeros(3))  # exact by construction, not by arithmetic
    assert torch.isfinite(a).all()


def test_clipping_at_plus_minus_clip():
    r = torch.tensor([0.0] * 99 + [1.0])  # one outlier: (1 - 0.01)/0.1 ≈ 9.9 before clipping
    a = group_advantages(r, 100, clip=5.0)
    assert a.max().item() == pytest.approx(5.0)
    assert normalize_group(r, 100).max().item() > 9


def test_multi_reward_normalises_each_then_weighted_sum():
    hps = torch.tensor([1.0, 2.0, 3.0, 4.0])
    clip = torch.tensor([100.0, 300.0, 200.0, 400.0])
    agg = aggregate_advantages({"hps": hps, "clip": clip}, {"hps": 0.7, "clip": 1.4}, 4)
    expect = 0.7 * normalize_group(hps, 4) + 1.4 * normalize_group(clip, 4)
    torch.testing.assert_close(agg, expect.float().clamp(-5, 5), **tol(torch.float32, ulps=10))
    # the raw scale of a reward does not matter after per-reward normalisation
    agg2 = aggregate_advantages({"hps": hps * 1000, "clip": clip}, {"hps": 0.7, "clip": 1.4}, 4)
    torch.testing.assert_close(agg, agg2, **tol(torch.float32))


def test_non_finite_reward_named_and_bad_group():
    with pytest.raises(ValueError, match=r"sample\(s\) \[1\]"):
        group_advantages(torch.tensor([1.0, float("nan"), 2.0, 3.0]), 2)
    with pytest.raises(UserError, match="group_size"):
        group_advantages(torch.tensor([1.0, 2.0]), 1)
    with pytest.raises(UserError, match="no weight"):
        aggregate_advantages({"a": torch.ones(4)}, {}, 2)
