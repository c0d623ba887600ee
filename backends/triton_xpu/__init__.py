"""The ``triton_xpu`` backend: the ``triton`` backend's kernels launched on Intel XPU.

One kernel source (``vtp_runtime.backends.triton.kernels``): this is a subclass of
``TritonBackend`` that changes only its name, the device type it declares (``xpu``), its
environment probe, and the launch configuration ``XPU_CONFIG``. Every op and option the
``triton`` backend has, it has.

Availability (``probe``), each missing piece is one reason:

- ``torch.xpu`` exists and ``torch.xpu.is_available()`` (torch's native XPU support, torch
  >= 2.4). If intel-extension-for-pytorch is installed it is imported first
  (older stacks register the XPU device through it); a broken install is a reason.
- Triton's **active** backend is Intel's: ``triton.runtime.driver.active.get_current_target()``
  returns a ``GPUTarget`` whose ``backend`` is ``"xpu"`` (the same API on triton 3.6 and
  3.9; it raises when no driver, or more than one, is active).

Launch configuration. Intel GPUs run a Triton "warp" as one sub-group of 32 work-items on
one hardware thread, whose register file (128 GRF in the default mode) is far smaller than
what an NVIDIA warp may use; Intel's and liger-kernel's XPU tunings cap row tiles at
4096-8192 elements and keep few elements per work-item to avoid spills. ``XPU_CONFIG``
keeps 8 elements per work-item in the statistics and backward passes (1024-column tiles, 4
warps) and 4 in the JSD divergence pass, which holds two inputs and the mixture live
(512-column tiles). These are reasoned defaults, **not tuned on XPU hardware** (none was
available); pass ``TritonXPUBackend(config=...)`` to override.
"""

from __future__ import annotations

import importlib
import importlib.util

import torch

from vtp_runtime.registry import hookimpl

from ..triton.backend import TritonBackend, capabilities
from ..triton.config import LaunchConfig

XPU_CONFIG = LaunchConfig(
    block_stats=1024,
    warps_stats=4,  # 1024 / (4 warps x 32 lanes) = 8 elements per work-item
    block_div=512,
    warps_div=4,  # JSD divergence pass: more values live per element
    block_bwd=1024,
    warps_bwd=4,
    target_programs=2048,  # forward vocabulary splits; the same on every rank by construction
    max_splits=64,
    bwd_target_programs=4096,
    block_rows=64,
    warps_finish=2,
)

IPEX = "intel_extension_for_pytorch"


def load_ipex() -> tuple[str, str | None]:
    """(which XPU runtime is used, reason it cannot be used or None). Imports
    intel-extension-for-pytorch when it is installed; never raises."""
    try:
        installed = importlib.util.find_spec(IPEX) is not None
    except (ImportError, ValueError):
        installed = False
    if not installed:
        return "native torch.xpu", None
    try:
        mod = importlib.import_module(IPEX)
    except Exception as exc:
        return "intel-extension-for-pytorch", (
            f"intel-extension-for-pytorch is installed but fails to import ({type(exc).__name__}: {exc}); "
            f"fix or uninstall it (torch's native torch.xpu needs no extension)"
        )
    return f"intel-extension-for-pytorch {getattr(mod, '__version__', '?')}", None


def triton_target_backend() -> tuple[str | None, str | None]:
    """(the ``backend`` of Triton's active target, or None with the reason). Never raises."""
    try:
        from triton.runtime import driver
    except Exception as exc:
        return None, f"triton is not importable ({type(exc).__name__}: {exc}); pip install triton"
    try:
        return str(driver.active.get_current_target().backend), None
    except Exception as exc:  # no active driver, or several (TRITON_DEFAULT_BACKEND picks one)
        return None, (
            f"Triton has no usable active backend ({type(exc).__name__}: {exc}); "
            f"Intel's is needed (set TRITON_DEFAULT_BACKEND=intel if several are active)"
        )


class TritonXPUBackend(TritonBackend):
    """The Triton kernels on ``xpu`` tensors with ``XPU_CONFIG``."""

    name = "triton_xpu"
    priority = 20
    ops = capabilities(frozenset({"xpu"}))

    def probe(self, device_type: str) -> list[str]:
        if device_type != "xpu":
            # the declared capabilities already refuse other device types, with their own
            # line; the environment of an XPU is irrelevant to them
            return []
        runtime, ipex_problem = load_ipex()
        if ipex_problem:
            return [ipex_problem]
        xpu = getattr(torch, "xpu", None)
        if xpu is None or not hasattr(xpu, "is_available"):
            return [
                f"this torch ({torch.__version__}) has no torch.xpu; install a torch build with "
                f"XPU support (torch >= 2.4 from the XPU wheel index)"
            ]
        try:
            available = bool(xpu.is_available())
        except Exception as exc:
            available, detail = False, f": {type(exc).__name__}: {exc}"
        else:
            detail = ""
        if not available:
            return [
                f"no XPU device: torch.xpu.is_available() is False{detail} (runtime: {runtime}; "
                f"check the Intel GPU driver and ZE_AFFINITY_MASK)"
            ]
        backend, problem = triton_target_backend()
        if problem:
            return [problem]
        if backend != "xpu":
            return [
                f"Triton's active backend is {backend!r}, not Intel's 'xpu': install Intel's Triton "
                f"(pytorch-triton-xpu, which ships with torch's XPU wheels)"
            ]
        return []

    def config_for(self, device: torch.device) -> LaunchConfig:
        return self._config if self._config is not None else XPU_CONFIG


@hookimpl
def vtp_runtime_register_backends(register):
    register(TritonXPUBackend())
