"""The one fused sampler kernel, a linear combination of up to four tensors plus noise (`_launch_lincomb`),
the device-noise kernel, and the reference helpers every step shares (noise, NaN flags, shape checks)."""
from __future__ import annotations

from typing import Optional, Union

import torch

from ..dtypes import MSL_TYPE
from .noise import DeviceNoise, device_noise_reference

# --------------------------------------------------------------------------------------------
# Reference helpers
# --------------------------------------------------------------------------------------------

NoiseArg = Optional[Union[torch.Tensor, DeviceNoise]]


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _noise_ref(noise: NoiseArg, like: torch.Tensor, what: str) -> torch.Tensor:
    if noise is None:
        raise ValueError(f"{what}: this step adds noise but no noise was given")
    if isinstance(noise, DeviceNoise):
        return device_noise_reference(noise, like.shape, like.device)
    if noise.shape != like.shape:
        raise ValueError(f"{what}: noise has shape {tuple(noise.shape)}, expected {tuple(like.shape)} (the latent's)")
    return _f32(noise.to(like.device))


def _record(flags: Optional[torch.Tensor], step: int, out: torch.Tensor) -> None:
    if flags is not None and step >= 0:
        bad = (~torch.isfinite(out)).any().to(flags.dtype)
        flags[step] = torch.maximum(flags[step], bad)


def _finish(out: torch.Tensor, like: torch.Tensor, flags, step) -> torch.Tensor:
    out = out.to(like.dtype)
    _record(flags, step, out)
    return out


def _check_same(what: str, x: torch.Tensor, **others) -> None:
    if x.dtype not in MSL_TYPE:
        raise TypeError(f"{what}: latent dtype {x.dtype} is not supported; expected float32, float16 or bfloat16")
    for name, t in others.items():
        if t is not None and t.shape != x.shape:
            raise ValueError(f"{what}: {name} has shape {tuple(t.shape)}, expected {tuple(x.shape)} (the latent's)")


# --------------------------------------------------------------------------------------------
# The generic fused launch
# --------------------------------------------------------------------------------------------

_MAX_THREADS = 1 << 18
_GROUP = 256


def _launch_lincomb(lib, terms, noise: NoiseArg = None, noise_coef: float = 0.0, flags=None, step: int = -1,
                    dtype=None):
    """out = sum(c * t for t, c in terms) + noise_coef * noise, one kernel; terms[0] sets the shape, `dtype`
    (default terms[0]'s) the computation's storage type."""
    if not 1 <= len(terms) <= 4:
        raise ValueError(f"sampler kernel: {len(terms)} input tensors (1 to 4 supported)")
    first = terms[0][0]
    dtype = first.dtype if dtype is None else dtype
    ins = [t.to(dtype).contiguous() for t, _ in terms]
    coef = [float(c) for _, c in terms] + [0.0] * (4 - len(terms))
    x = ins[0]
    out = torch.empty_like(x)
    numel = x.numel()
    has_noise = 0
    noise_tensor = x
    keys, weights = [0, 0], [0.0]
    nkeys = 0
    if noise_coef != 0.0:
        if noise is None:
            raise ValueError("sampler kernel: this step adds noise but no noise was given")
        if isinstance(noise, DeviceNoise):
            if len(noise):
                keys = [int(k) for k in noise.keys]
                weights = [float(w) * noise_coef for w in noise.weights]
                nkeys = len(noise)
        else:
            if noise.shape != x.shape:
                raise ValueError(f"sampler kernel: noise has shape {tuple(noise.shape)}, expected {tuple(x.shape)}")
            noise_tensor = noise.to(device=x.device, dtype=dtype).contiguous()
            has_noise = 1
    coef.append(float(noise_coef) if has_noise else 0.0)
    if flags is None or step < 0:
        flag_buf, step = torch.zeros(1, dtype=torch.int32, device=x.device), -1
    else:
        flag_buf = flags
    if numel:
        threads = min(numel, _MAX_THREADS)
        kernel = getattr(lib, f"sampler_lincomb_{MSL_TYPE[dtype]}")
        pad = ins + [x] * (4 - len(ins))
        kernel(pad[0], pad[1], pad[2], pad[3], noise_tensor, out, flag_buf, coef, keys, weights,
               len(ins) - 1, has_noise, nkeys, int(step), numel, threads,
               threads=threads, group_size=min(_GROUP, threads))
    return out


def _entry(kind):
    lincomb = ("tensor",) * 7 + ("float[]", "int[]", "float[]") + ("int",) * 6
    noise = ("tensor", "int[]", "float[]", "int", "int", "int")
    kinds = {"lincomb": lincomb, "noise": noise}[kind]
    return {f"sampler_{kind}_{t}": kinds for t in MSL_TYPE.values()}


_LINCOMB_ENTRIES = _entry("lincomb")


# --------------------------------------------------------------------------------------------
# Device noise alone
# --------------------------------------------------------------------------------------------


def device_noise_ref(like: torch.Tensor, noise: DeviceNoise) -> torch.Tensor:
    """The DeviceNoise as a tensor shaped and typed like `like`."""
    _check_same("sampler_device_noise", like)
    return device_noise_reference(noise, like.shape, like.device, like.dtype)


def device_noise_metal(lib, like: torch.Tensor, noise: DeviceNoise) -> torch.Tensor:
    _check_same("sampler_device_noise", like)
    out = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    numel = out.numel()
    if numel:
        keys = [int(k) for k in noise.keys] or [0, 0]
        weights = [float(w) for w in noise.weights] or [0.0]
        threads = min(numel, _MAX_THREADS)
        getattr(lib, f"sampler_noise_{MSL_TYPE[like.dtype]}")(
            out, keys, weights, len(noise), numel, threads, threads=threads, group_size=min(_GROUP, threads))
    return out

