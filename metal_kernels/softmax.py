"""Row softmax over the last dimension, fp16/bf16/fp32 in and out, optional temperature."""
from __future__ import annotations

import torch

from .dtypes import MSL_TYPE
from .registry import KernelSpec, register

__all__ = ["softmax"]

MAX_ROW = 262_144
MAX_LAUNCH_THREADS = 1 << 31   # [[threadgroup_position_in_grid]] and the grid are 32-bit: launch in row chunks


def _check(x: torch.Tensor, temperature: float) -> None:
    if x.dtype not in MSL_TYPE:
        raise TypeError(f"softmax: tensor dtype {x.dtype} is not supported; expected float32, float16 or bfloat16")
    if not temperature > 0:
        raise ValueError(f"softmax: temperature must be > 0, got {temperature}")


def softmax_reference(x: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """softmax(x / temperature) over the last dimension, computed in float32, returned in x.dtype."""
    _check(x, temperature)
    return torch.softmax(x.float() * (1.0 / temperature), dim=-1).to(x.dtype)


def group_size_for(ncols: int) -> int:
    """Threads per row: enough to cover short rows in one step, 1024 at most."""
    g = 32
    while g < ncols and g < 1024:
        g *= 2
    return g


def softmax_metal(lib, x: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    _check(x, temperature)
    if x.dim() == 0 or x.shape[-1] > MAX_ROW:
        return softmax_reference(x, temperature)
    x2 = x.contiguous().view(-1, x.shape[-1])
    rows, ncols = x2.shape
    y = torch.empty_like(x2)
    if rows and ncols:
        g = group_size_for(ncols)
        kernel = getattr(lib, f"softmax_rows_{MSL_TYPE[x.dtype]}")
        chunk = max(1, MAX_LAUNCH_THREADS // g)
        for r0 in range(0, rows, chunk):       # row slices bind as buffer + offset
            r1 = min(rows, r0 + chunk)
            kernel(x2[r0:r1], y[r0:r1], ncols, float(1.0 / temperature), threads=(r1 - r0) * g, group_size=g)
    return y.view(x.shape)


def _cases(device):
    gen = torch.Generator().manual_seed(0)
    out = []
    for shape, dtype, t in [((3, 1), torch.float32, 1.0), ((5, 33), torch.float16, 0.7),
                            ((2, 1000), torch.bfloat16, 1.0), ((4, 97), torch.float32, 2.5)]:
        x = (torch.randn(shape, generator=gen) * 4).to(dtype)
        x[0, 0] = float("-inf")
        out.append(((x.to(device),), {"temperature": t}))
    return out


softmax = register(KernelSpec(
    name="softmax",
    source="softmax.metal",
    entry_points={f"softmax_rows_{t}": ("tensor", "tensor", "int", "float") for t in MSL_TYPE.values()},
    reference=softmax_reference,
    metal=softmax_metal,
    self_check_cases=_cases,
    atol=1e-6,
    rtol=1e-5,
))
