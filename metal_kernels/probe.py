"""Capability probe: what this torch build and device can do. Cheap; touches no GPU memory."""
from __future__ import annotations

import functools
import platform

import torch


def _version_tuple(v: str) -> tuple[int, int]:
    parts = v.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


TORCH_VERSION = _version_tuple(torch.__version__)
# Attention score matrices of this many elements or more come out silently wrong on MPS (any torch
# version so far): the pack's attention and the tiled VAE keep every score matrix below it.
MPS_MAX_SCORE_ELEMENTS = 2 ** 31


def mps_available() -> bool:
    try:
        return bool(torch.backends.mps.is_available())
    except Exception:
        return False


@functools.lru_cache(maxsize=None)
def capabilities() -> dict:
    mps = mps_available()
    f = torch.nn.functional
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": f"{platform.system()} {platform.machine()}",
        "mps_available": mps,
        "cuda_available": torch.cuda.is_available(),
        # float8_e4m3fn tensors live on MPS from torch 2.15; e5m2 never does.
        "native_fp8_e4m3fn_on_mps": mps and TORCH_VERSION >= (2, 15),
        "native_fp8_e5m2_on_mps": False,
        "float8_dtypes": hasattr(torch, "float8_e4m3fn") and hasattr(torch, "float8_e5m2"),
        # every float8 dtype this torch has (e8m0fnu: the MX block scales)
        "float8_dtype_names": " ".join(sorted(n[len("float8_"):] for n in dir(torch) if n.startswith("float8_")
                                              and isinstance(getattr(torch, n), torch.dtype))),
        "F.scaled_mm": hasattr(f, "scaled_mm"),
        "torch._scaled_mm": hasattr(torch, "_scaled_mm"),
        "torch._grouped_mm": hasattr(torch, "_grouped_mm"),
        "torch.mps.compile_shader": hasattr(torch, "mps") and hasattr(torch.mps, "compile_shader"),
        # MPSGraph's constant pad blows up driver memory and corrupts data at H*W >= 2^16 before 2.15.
        "mps_pad_is_safe": TORCH_VERSION >= (2, 15),
        "mps_recommended_max_memory": _mps_recommended_max_memory() if mps else None,
    }


def _mps_recommended_max_memory():
    try:
        return int(torch.mps.recommended_max_memory())
    except Exception:
        return None


def fp8_storage_dtype(device: torch.device | str, fmt: str) -> torch.dtype:
    """How FP8 bytes are stored on `device`: native float8 where the device has it, else uint8."""
    device = torch.device(device)
    native = torch.float8_e4m3fn if fmt == "e4m3fn" else torch.float8_e5m2
    if device.type == "mps":
        if fmt == "e4m3fn" and capabilities()["native_fp8_e4m3fn_on_mps"]:
            return native
        return torch.uint8
    return native
