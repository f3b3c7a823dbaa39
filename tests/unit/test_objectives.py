"""The losses of docs/method.md §4–5 (`chunkgrpo.objectives`): chunk ratio, clipping, KL, masks, unit
selection and chunk weighting."""

import pytest
import torch

from chunkgrpo import objectives as obj
from chunkgrpo.errors import UserError
from tests.cpu_kernels import tol

# float results compared across formulas and layouts: CI runs these under every ATEN_CPU_CAPABILITY
pytestmark = pytest.mark.exactness

CLIP = dict(clip_low=0.2, clip_high=0.3)


def _data(B=4, S=6, seed=0, spread=0.5):
    g = torch.Generator().manual_seed(seed)
    old = torch.randn(B, S, generator=g)
    new = (old + spread * torch.randn(B, S, generator=g)).requires_grad_(True)
    adv = torch.randn(B, generator=g)
    return new, old, adv


def _grad(fn, new):
    new.grad = None
    fn(new).backward()
    return new.grad.clone()


def test_chunk_ratio_is_geometric_mean_of_step_ratios():
    new, old, _ = _data()
    sizes = [2, 3, 1]
    cr = torch.exp(obj.chunk_log_ratio(new, old, sizes))
    step_ratios = torch.exp(new - old)
    expect = torch.stack([step_ratios[:, 0:2].prod(1) ** (1 / 2), step_ratios[:, 2:5].prod(1) ** (1 / 3),
                          step_ratios[:, 5]], dim=1)
    torch.testing.assert_close(cr, expect, **tol(torch.float32))  # product-root vs exp-mean: fp32


def test_all_ones_chunks_equal_step_level_loss_and_gradients():
    new, old, adv = _data(spread=0.3)
    def f_chunk(n):
        return obj.chunk_policy_loss(n, old, adv, [1] * 6, **CLIP)

    def f_step(n):
        return obj.step_policy_loss(n, old, adv, **CLIP)

    torch.testing.assert_close(f_chunk(new), f_step(new), **tol(torch.float32))
    torch.testing.assert_close(_grad(f_chunk, new), _grad(f_step, new), **tol(torch.float32))


def test_one_chunk_is_sequence_level():
    new, old, adv = _data(spread=0.3)
    loss = obj.chunk_policy_loss(new, old, adv, [6], **CLIP)
    seq_ratio = torch.exp((new - old).mean(1))
    expect = torch.maximum(-adv * seq_ratio, -adv * seq_ratio.clamp(0.8, 1.3)).mean()
    torch.testing.assert_close(loss, expect, **tol(torch.float32))


def test_asymmetric_clip_zeroes_gradient_only_on_the_clipped_side():
    old = torch.zeros(2, 1)
    new = torch.tensor([[0.5], [-0.5]], requires_grad=True)  # ratios e^0.5 = 1.65, e^-0.5 = 0.61
    adv = torch.tensor(
        [1.0, -1.0]
    )  # A>0 with ratio above 1+eps: clipped; A<0 with ratio below 1-eps: clipped
    loss = obj.step_policy_loss(new, old, adv, clip_low=0.2, clip_high=0.3)
    loss.backward()
    assert torch.equal(
        new.grad, torch.zeros_like(new.grad)
    )  # exact: the clipped branch does not depend on logp
    new2 = torch.tensor([[0.5], [-0.5]], requires_grad=True)
    obj.step_policy_loss(new2, old, -adv, clip_low=0.2, clip_high=0.3).backward()  # opposite signs: unclipped
    assert torch.all(new2.grad != 0)


def test_on_policy_ratio_is_exactly_one_and_gradient_flows():
    new, _, adv = _data()
    loss = obj.chunk_policy_loss(new, None, adv, [2, 4], clip_low=5e-5, clip_high=5e-5)
    loss.backward()
    # d/dlogp of mean_b mean_k (-A ρ_k) at ρ = 1: -A / (B · K · c_k)
    B, K = 4, 2
    expect = torch.cat(
        [(-adv / (B * K * 2)).view(-1, 1).expand(B, 2), (-adv / (B * K * 4)).view(-1, 1).expand(B, 4)], 1
    )
    torch.testing.assert_close(new.grad, expect, **tol(torch.float32, ulps=10))
    assert torch.equal(
        obj.log_ratio(new, None), torch.zeros_like(new)
    )  # exact: x − x is 0 for every finite x


def test_chunk_mask_averages_only_trained_chunks():
    new, old, adv = _data()
    sizes = [2, 2, 2]
    mask = torch.tensor([[True, False, False]] * 4)
    masked = obj.chunk_policy_loss(new, old, adv, sizes, chunk_mask=mask, **CLIP)
    only_first = obj.chunk_policy_loss(new[:, :2], old[:, :2], adv, [2], **CLIP)
    torch.testing.assert_close(masked, only_first, **tol(torch.float32))


def test_kl_k3_is_nonnegative_and_zero_on_policy():
    new, old, _ = _data()
    kl = obj.kl_k3(new, old)
    assert torch.all(kl >= -1e-7)
    assert torch.equal(obj.kl_k3(old, old), torch.zeros_like(old))  # exact: exp(0) − 1 − 0


def test_select_units_counts_and_weighted_preference():
    g = torch.Generator().manual_seed(0)
    m = obj.select_units(50, 4, 0.5, generator=g)
    assert m.shape == (50, 4) and torch.all(m.sum(1) == 2)
    w = torch.tensor([[0.97, 0.01, 0.01, 0.01]]).expand(400, 4)
    mw = obj.select_units(400, 4, 0.25, generator=g, weights=w)
    assert mw[:, 0].float().mean() > 0.9
    with pytest.raises(UserError, match="timestep_fraction"):
        obj.select_units(2, 4, 0.0)


def test_chunk_sampling_weights_from_own_trajectory():
    lat = torch.ones(2, 5, 3)
    lat[0, 1] = 3.0  # sample 0: big jump at transitions 0 and 1
    lat[1, 4] = 2.0  # sample 1: jump at transition 3
    w = obj.chunk_sampling_weights(lat, [2, 2])
    assert w.shape == (2, 2)
    torch.testing.assert_close(w.sum(1), torch.ones(2), **tol(torch.float32))
    assert w[0, 0] > w[0, 1] and w[1, 1] > w[1, 0]
    torch.testing.assert_close(
        obj.chunk_sampling_weights(lat, [2, 2], mode="softmax").sum(1), torch.ones(2), **tol(torch.float32)
    )


def test_bad_chunk_plans():
    new, old, adv = _data()
    with pytest.raises(UserError, match="sum to 5"):
        obj.chunk_policy_loss(new, old, adv, [2, 3], **CLIP)
    with pytest.raises(UserError, match="empty chunk"):
        obj.chunk_policy_loss(new, old, adv, [0, 6], **CLIP)
