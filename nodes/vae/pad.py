"""Scoped Metal padding: the VAE's constant/replicate F.pad on 4-D/5-D MPS tensors through the vae_pad
kernel (a TorchFunctionMode active only inside a decode; torch < 2.15)."""
from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

# ---------------------------------------------------------------- scoped Metal padding


def _torch_before(major: int, minor: int) -> bool:
    try:
        v = tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    return v < (major, minor)


class MetalPadMode(TorchFunctionMode):
    """Route F.pad(4-D/5-D, constant|replicate, non-negative pads) on the given device types through
    the `vae_pad` kernel. Active only inside `with`; other calls pass through untouched."""

    def __init__(self, device_types=("mps",)):
        super().__init__()
        self.device_types = set(device_types)
        self.routed = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.pad or func is torch._C._nn.pad:
            x = args[0] if args else kwargs.get("input")
            pad = args[1] if len(args) > 1 else kwargs.get("pad")
            mode = args[2] if len(args) > 2 else kwargs.get("mode", "constant")
            value = args[3] if len(args) > 3 else kwargs.get("value", None)
            if (isinstance(x, torch.Tensor) and x.device.type in self.device_types and x.dim() in (4, 5)
                    and mode in ("constant", "replicate") and pad is not None and all(int(p) >= 0 for p in pad)
                    and (mode == "constant" or len(pad) == 2 * (x.dim() - 2))
                    and (x.dim() == 5 or len(pad) <= 4)
                    and x.dtype in (torch.float32, torch.float16, torch.bfloat16)):
                from ...metal_kernels.vae import vae_pad

                self.routed += 1
                return vae_pad(x, tuple(int(p) for p in pad), mode=mode, value=float(value or 0.0))
        return func(*args, **kwargs)


def pad_mode_for(device: torch.device, force: bool | None = None):
    """The scoped pad router when it is needed (MPS with torch < 2.15), or `force` says so."""
    if force or (force is None and device.type == "mps" and _torch_before(2, 15)):
        return MetalPadMode(device_types=(device.type,))
    return contextlib.nullcontext()
