import math

import pytest
import torch

from chunkgrpo import schedules
from chunkgrpo.errors import UserError
from tests.cpu_kernels import tol

# float results compared across formulas and layouts: CI runs these under every ATEN_CPU_CAPABILITY
pytestmark = pytest.mark.exactness


def test_shift_schedule_matches_reference_values_and_integer_timesteps():
    s = schedules.shift_sigmas(16, 3.0)
    ref = [1.0, .9783, .9545, .9286, .9, .8684, .8333, .7941, .75, .7, .6429, .5769, .5, .4091, .3, .1667, 0]
    assert s.shape == (17,)
    assert torch.allclose(s, torch.tensor(ref, dtype=torch.float64), atol=1e-4)
    # exact integers: floor(1000·σ) of float64 σ with a 1e-6 guard, far above float64 rounding of any kernel
    t = schedules.model_timesteps(s).int().tolist()
    assert t == [1000, 978, 954, 928, 900, 868, 833, 794, 750, 700, 642, 576, 500, 409, 300, 166, 0]


def test_shift_formula_and_monotonic():
    u = torch.linspace(1, 0, 26, dtype=torch.float64)
    s = schedules.shift_sigmas(25, 3.0)
    torch.testing.assert_close(s, 3 * u / (1 + 2 * u), **tol(torch.float64))
    assert torch.all(s[1:] < s[:-1])


def test_dynamic_shift_matches_diffusers_flux_values():
    hi = schedules.dynamic_shift_sigmas(10, 4096)
    lo = schedules.dynamic_shift_sigmas(10, 1024)
    assert [round(float(x), 3) for x in hi] == [1, .966, .927, .881, .826, .76, .678, .575, .441, .26, 0]
    assert [round(float(x), 3) for x in lo] == [1, .944, .882, .814, .738, .652, .556, .446, .319, .173, 0]
    assert math.isclose(schedules.dynamic_shift_mu(256), 0.5) and math.isclose(
        schedules.dynamic_shift_mu(4096), 1.15
    )


def test_unquantized_timesteps_are_float_sigma_times_1000():
    s = schedules.dynamic_shift_sigmas(4, 256)
    torch.testing.assert_close(schedules.model_timesteps(s, quantize=False), s * 1000, **tol(torch.float64))


@pytest.mark.parametrize("bad", [0, -3])
def test_bad_step_count_is_a_user_error(bad):
    with pytest.raises(UserError, match="num_steps"):
        schedules.shift_sigmas(bad)


def test_unknown_schedule_named():
    with pytest.raises(UserError, match="'cosine'"):
        schedules.make_sigmas("cosine", 4)
