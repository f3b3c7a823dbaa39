"""GPUs where GPUs were requested: resolve a stage's `device` and fail fast when CUDA cannot use a GPU.

A stage asks for a GPU with ``device=cuda`` (or ``cuda:N``), or with ``device=auto`` inside a task that was
given GPUs (the NVIDIA device plugin sets ``NVIDIA_VISIBLE_DEVICES`` to the granted GPUs' ids; an image's own
``all`` is not a grant). If CUDA then sees no device (typically a torch built for a newer CUDA than the node's
driver supports), :func:`require` raises the project's bad-input error with ONE line naming the driver found,
the CUDA version torch was built for and the fix, before any model is loaded. Without this, ``device=auto``
on such a node would run a GPU job on the CPU for days.

The driver version is read from ``/proc/driver/nvidia/version`` (the kernel module, visible in containers
that were given GPUs); no ``nvidia-smi`` is needed.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from chunkgrpo.errors import UserError

PROC_VERSION = Path("/proc/driver/nvidia/version")

# Oldest Linux driver that runs binaries of each CUDA major release under CUDA minor-version compatibility
# (CUDA Toolkit release notes, "CUDA Toolkit and Minimum Required Driver Version for CUDA Minor Version
# Compatibility"). torch's wheels carry SASS for sm_80/sm_90, so no PTX JIT (which would need the newer
# driver of the full-compatibility table) happens on A100/H100/H800.
MIN_DRIVER = {11: "450.80.02", 12: "525.60.13", 13: "580.65.06"}

# The CUDA of the default runtime image's torch (images/runtime/Dockerfile), the one with the widest driver
# support; a CUDA 13 build is the image's build option.
DEFAULT_IMAGE_CUDA = "12.6"

# NVIDIA_VISIBLE_DEVICES values that grant no particular GPU (an image's default, or explicitly none).
NOT_A_GRANT = {"", "all", "none", "void"}


def driver_version(proc_version: Path | None = None) -> str | None:
    """The NVIDIA kernel driver's version (e.g. '570.124.06'), or None when no driver is loaded."""
    try:
        text = Path(proc_version or PROC_VERSION).read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None
    m = re.search(r"Kernel Module(?: for [\w-]+)?\s+(\d+\.\d+(?:\.\d+)?)", text) or re.search(
        r"\b(\d{3}\.\d+(?:\.\d+)?)\b", text)
    return m.group(1) if m else None


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v))


def min_driver(cuda: str) -> str | None:
    """The oldest driver that runs binaries built for CUDA `cuda` ('12.6' -> '525.60.13'), None if unknown."""
    major = _version_tuple(cuda)[:1]
    return MIN_DRIVER.get(major[0]) if major else None


def gpus_granted(env: dict | None = None) -> bool:
    """True when the environment says this task was given GPUs (the device plugin's
    NVIDIA_VISIBLE_DEVICES)."""
    env = os.environ if env is None else env
    return env.get("NVIDIA_VISIBLE_DEVICES", "").strip().lower() not in NOT_A_GRANT


def _torch_cuda() -> tuple[str, str | None, bool]:
    """(torch version, the CUDA it was built for or None for a CPU-only build, whether CUDA sees a device)."""
    import torch

    return torch.__version__, torch.version.cuda, bool(torch.cuda.is_available())


def no_gpu_message(device: str, *, driver: str | None, torch_version: str, torch_cuda: str | None,
                   granted: bool = False) -> str:
    """The one line that explains why `device` has no CUDA device here, and what fixes it."""
    asked = f"device={device}" + (" in a task that was given GPUs (NVIDIA_VISIBLE_DEVICES)"
                                  if granted else "")
    found = f"NVIDIA driver {driver}" if driver else "no NVIDIA driver"
    if torch_cuda is None:
        return (f"{asked} but torch {torch_version} is a CPU-only build ({found}): install a CUDA build of "
                "torch (the runtime image has one), or set device=cpu")
    built = f"torch {torch_version} is built for CUDA {torch_cuda}"
    need = min_driver(torch_cuda)
    if not driver:
        return (f"{asked} but CUDA sees no GPU: no NVIDIA driver ({PROC_VERSION} is absent) and {built}"
                + (f" (needs driver >= {need})" if need else "")
                + ": run on a GPU node (request nvidia.com/gpu), or set device=cpu")
    if need and _version_tuple(driver) < _version_tuple(need):
        fix = f"run on a pool whose driver is >= {need}"
        older = min_driver(DEFAULT_IMAGE_CUDA)
        if _version_tuple(torch_cuda)[:1] > _version_tuple(DEFAULT_IMAGE_CUDA)[:1] and older:
            fix += (f", or use the runtime image built for CUDA {DEFAULT_IMAGE_CUDA} (its default build; "
                    f"needs driver >= {older})")
        return (f"{asked} but CUDA sees no GPU: NVIDIA driver {driver} is older than {need}, the minimum for "
                f"CUDA {torch_cuda} ({built}): {fix}")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return (f"{asked} but CUDA sees no GPU although NVIDIA driver {driver} supports CUDA {torch_cuda} "
            f"({built})"
            + (f"; CUDA_VISIBLE_DEVICES={visible!r} hides the GPUs" if visible is not None else
               "; the container was given no GPU device (request nvidia.com/gpu)"))


def problem(device: str, env: dict | None = None) -> str | None:
    """The one-line reason `device` cannot get the GPU it asks for here, or None when it can (or asks
    for none)."""
    wants_gpu = device.startswith("cuda") or (device == "auto" and gpus_granted(env))
    if not wants_gpu:
        return None
    torch_version, torch_cuda, available = _torch_cuda()
    if available:
        return None
    return no_gpu_message(device, driver=driver_version(), torch_version=torch_version, torch_cuda=torch_cuda,
                          granted=device == "auto")


def require(device: str, env: dict | None = None) -> str:
    """`device` resolved to 'cuda'/'cuda:N'/'cpu'; UserError (one line, exit 2) when a GPU was asked for
    (explicitly, or by `auto` in a task given GPUs) and CUDA cannot use one. Call it before loading
    anything."""
    p = problem(device, env)
    if p:
        raise UserError(p)
    if device == "auto":
        _, _, available = _torch_cuda()
        return "cuda" if available else "cpu"
    return device
