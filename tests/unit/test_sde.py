import math

import pytest
import torch

from chunkgrpo import sde
from chunkgrpo.errors import UserError
from tests.cpu_kernels import tol

# float results compared across formulas and layouts: CI runs these under every ATEN_CPU_CAPABILITY
pytestmark = pytest.mark.exactness


def _independent_logp(x_next, mean, std):
    # log N(x'; mean, std²) per element via torch.distributions, averaged over non-batch dims
    d = torch.distributions.Normal(mean.double(), std.double())
    return d.log_prob(x_next.double()).flatten(1).mean(1)


@pytest.mark.parametrize("rule", ["flow", "dance"])
@pytest.mark.parametrize("sigma,sigma_next", [(1.0, 0.97), (0.7, 0.6), (0.3, 0.1667)])
def test_log_prob_is_the_gaussian_density(rule, sigma, sigma_next):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=g)
    v = torch.randn(3, 5, 8, generator=g)
    eta = 0.7
    x_next, lp = sde.sde_step(x, v, sigma, sigma_next, eta=eta, rule=rule, generator=g)
    # mean/std written out from method.md §2, independently of the module
    dt = sigma_next - sigma
    if rule == "flow":
        den = sigma_next if sigma == 1.0 else sigma
        gg = eta * math.sqrt(sigma / (1 - den))
    else:
        gg = eta
    mean = x + dt * (v + gg**2 / (2 * sigma) * (x + (1 - sigma) * v))
    std = torch.tensor(gg * math.sqrt(-dt))
    # fp32 module vs float64 reference: the element mean of 40 terms of order 1-100, 100 ulp of fp32
    torch.testing.assert_close(lp.double(), _independent_logp(x_next, mean, std), **tol(torch.float32))
    torch.testing.assert_close(sde.step_log_prob(x_next, x, v, sigma, sigma_next, eta=eta, rule=rule), lp,
                               **tol(torch.float32, ulps=10))
    assert lp.dtype == torch.float32 and lp.shape == (3,)


def test_eta_zero_sde_equals_ode_step():
    x, v = torch.randn(2, 4, 3), torch.randn(2, 4, 3)
    for rule in ("flow", "dance"):
        x_sde, lp = sde.sde_step(x, v, 0.8, 0.6, eta=0.0, rule=rule)
        torch.testing.assert_close(x_sde, sde.ode_step(x, v, 0.8, 0.6), **tol(torch.float32, ulps=10))
        assert torch.isnan(lp).all()  # deterministic step: no density


def test_log_prob_gradient_flows_to_velocity_and_is_per_sample_sigma():
    x = torch.randn(2, 6)
    v = torch.randn(2, 6, requires_grad=True)
    sig = torch.tensor([0.9, 0.5])
    sig_next = torch.tensor([0.8, 0.3])
    x_next, _ = sde.sde_step(x, v.detach(), sig, sig_next, eta=0.7, rule="flow")
    lp = sde.step_log_prob(x_next, x, v, sig, sig_next, eta=0.7, rule="flow")
    lp.sum().backward()
    assert v.grad is not None and torch.isfinite(v.grad).all() and v.grad.abs().sum() > 0
    # per-sample sigma gives the same as scalar sigma row by row
    for b in range(2):
        one = sde.step_log_prob(
            x_next[b : b + 1],
            x[b : b + 1],
            v[b : b + 1].detach(),
            float(sig[b]),
            float(sig_next[b]),
            eta=0.7,
            rule="flow",
        )
        torch.testing.assert_close(one, lp[b:b + 1].detach(), **tol(torch.float32, ulps=10))  # batch 1 vs 2


def test_bad_rule_and_direction_are_errors():
    x = torch.zeros(1, 2)
    with pytest.raises(UserError, match="'ddim'"):
        sde.sde_step(x, x, 0.5, 0.4, eta=0.3, rule="ddim")
    with pytest.raises(ValueError, match="smaller"):
        sde.sde_step(x, x, 0.4, 0.5, eta=0.3, rule="flow")


def _gaussian_velocity(m, s2):
    """Exact velocity E[ε − x0 | x_σ] for data N(m, s2) and x_σ = (1−σ)x0 + σε."""
    def v(x, sigma):
        a = 1.0 - sigma
        var = a * a * s2 + sigma * sigma
        centred = x - a * m
        e_eps = sigma / var * centred
        e_x0 = m + a * s2 / var * centred
        return e_eps - e_x0
    return v


@pytest.mark.parametrize("rule,eta", [("flow", 0.7), ("dance", 0.3)])
def test_sde_preserves_ode_marginals_on_1d_gaussian(rule, eta):
    """The SDE must reproduce the data distribution (mean, variance) like the ODE does."""
    from chunkgrpo.schedules import shift_sigmas

    m, s2 = 1.5, 0.25
    n, steps = 40000, 200
    vfield = _gaussian_velocity(m, s2)
    sig = shift_sigmas(steps, 3.0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(n, 1, generator=g, dtype=torch.float64).float()
    for i in range(steps):
        s, sn = float(sig[i]), float(sig[i + 1])
        v = vfield(x.double(), s).float()
        if i < steps - 1:
            x, _ = sde.sde_step(x, v, s, sn, eta=eta, rule=rule, generator=g)
        else:
            x = sde.ode_step(x, v, s, sn)
    se_mean = math.sqrt(s2 / n)
    se_var = s2 * math.sqrt(2 / (n - 1))
    assert abs(x.mean().item() - m) < 5 * se_mean + 0.01
    assert abs(x.var().item() - s2) < 5 * se_var + 0.01


def test_step_std_matches_definition():
    assert math.isclose(
        float(sde.step_std(0.5, 0.3, eta=0.3, rule="dance")), 0.3 * math.sqrt(0.2), rel_tol=1e-9
    )
    assert math.isclose(
        float(sde.step_std(0.5, 0.3, eta=0.7, rule="flow")), 0.7 * 1.0 * math.sqrt(0.2), rel_tol=1e-9
    )


def test_checks_of_device_values_only_with_debug_checks():
    """σ on the host is always validated; σ living on a device (here 'meta', whose values cannot be read)
    is not read — no host sync — unless debug checks are on."""
    from chunkgrpo import checks

    with pytest.raises(ValueError, match="smaller"):
        sde._check(torch.tensor([0.5]), torch.tensor([0.7]), 0.7, "flow")
    on_device = torch.tensor([0.5], device="meta"), torch.tensor([0.7], device="meta")
    sde._check(*on_device, 0.7, "flow")  # not read: no sync
    with checks.debug(True):
        with pytest.raises(RuntimeError):  # reading it is attempted (and impossible on 'meta')
            sde._check(*on_device, 0.7, "flow")
    sde._check(*on_device, 0.7, "flow")  # the previous setting is restored
