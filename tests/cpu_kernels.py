"""What the tests may assume about floating-point results on an arbitrary x86-64 CPU.

torch picks its CPU kernels per processor (`torch.backends.cpu.get_cpu_capability()`: DEFAULT, AVX2,
AVX512; forced with `ATEN_CPU_CAPABILITY`). Kernels for different instruction sets, and for different
batch sizes on one instruction set, sum in different orders, so their float results differ in the last
bits. The rules the suite follows:

* **bit-exact** only for the same computation in the same layout (same inputs, batch size and kernels:
  a value recomputed, copied, loaded back, or resumed vs uninterrupted);
* across batch sizes, layouts or implementations: a tolerance derived from the dtype (`tol`, `PIXEL_TOL`);
* tests whose assertions depend on kernel numerics carry `@pytest.mark.exactness`; CI runs them under
  every capability (`.ci/run`).
"""

from __future__ import annotations

import contextlib
import os

import torch

# One uint8 level: a float pixel that lands within rounding noise of a .5 boundary may round either way.
PIXEL_TOL = 1


def tol(dtype: torch.dtype = torch.float32, ulps: float = 100.0) -> dict:
    """rtol = atol = `ulps` · machine epsilon of `dtype` — for values of order 1 computed through a few
    hundred reordered float operations (fp32: 100 ulp ≈ 1.2e-5; bf16: 100 ulp ≈ 0.78)."""
    eps = torch.finfo(dtype).eps
    return {"rtol": ulps * eps, "atol": ulps * eps}


def capability_forced_below_hardware() -> bool:
    """True when `ATEN_CPU_CAPABILITY` makes torch dispatch below what this processor supports."""
    forced = os.environ.get("ATEN_CPU_CAPABILITY", "").strip().lower()
    return bool(forced) and forced != "avx512" and torch.cpu._is_avx512_supported()


@contextlib.contextmanager
def bf16_attention_kernels():
    """bf16 attention that runs under any `ATEN_CPU_CAPABILITY`.

    torch 2.13 bug, not ours: on a processor with AMX, forcing a capability below AVX512 still routes bf16
    flash attention to AMX weight packing, which exists only in the AVX512 build of the kernel
    ("pack_vnni2 is only supported when avx512 is supported"). A processor that really lacks AVX-512 has
    no AMX and never takes that path, so only under such an override do we fall back to the math backend
    of scaled_dot_product_attention; otherwise nothing changes."""
    if capability_forced_below_hardware() and torch.cpu._is_amx_tile_supported():
        from torch.nn.attention import SDPBackend, sdpa_kernel

        with sdpa_kernel([SDPBackend.MATH]):
            yield
    else:
        yield
