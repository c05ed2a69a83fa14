"""The shared Metal kernel module of Comfy Metal.

Every kernel has MSL entry points in a .metal file of this folder, a pure-torch reference with the
public signature, and a registry entry (registry.py) tying them together. The public functions
below run Metal on MPS tensors (after a one-time self-check) and the reference everywhere else;
see dispatch.py for the backends and environment variables.

Importing this package compiles nothing and touches no GPU.
"""
from __future__ import annotations

from . import dispatch, probe
from .registry import REGISTRY, KernelSpec, register

# Domain modules register their kernels on import; their public functions are re-exported here.
from . import attention, fp8, gguf, linear, moe, quant, sampling, softmax, vae  # noqa: E402

__all__ = ["status", "capabilities", "REGISTRY", "KernelSpec", "register"]
for _module in (softmax, fp8, linear, sampling, vae, moe, gguf, attention, quant):
    for _name in _module.__all__:
        globals()[_name] = getattr(_module, _name)
        __all__.append(_name)

capabilities = probe.capabilities


def status(device=None, run_pending: bool = True) -> dict:
    """Capability probe plus each kernel's backend and the reason for it (runs pending self-checks
    unless run_pending=False: see dispatch.kernel_status)."""
    return {
        "capabilities": probe.capabilities(),
        "backend_setting": dispatch._env_backend(),
        "kernels": dispatch.kernel_status(device, run_pending=run_pending),
    }
