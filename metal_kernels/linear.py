"""Single-row linear (GEMV) for small batches: y = x @ (decode(weight) * scale).T + bias.

gemv(x, weight, bias=None, *, fmt=None, scale=None, out_dtype=None)
    x: (..., K) float16/bfloat16/float32; meant for prod(...) <= 8 rows (more rows work, in chunks of
       8 that each re-read the weight: for large M decode the weight once and use matmul instead).
    weight: (N, K) float16/bfloat16/float32, or FP8: uint8 bytes with fmt="e4m3fn"/"e5m2", or a
       native torch.float8_e4m3fn / float8_e5m2 tensor (fmt inferred).
    scale: None | one-element tensor (tensorwise) | (N,) or (N, 1) per output row; applied to any
       weight type. bias: (N,) or None.
    Returns (..., N) in out_dtype (default x.dtype), accumulated in fp32.
"""
from __future__ import annotations

import itertools
import math

import torch

from . import source
from .dtypes import FORMAT_OF_DTYPE, MSL_KIND, MSL_TYPE
from .fp8 import _as_bytes, fp8_decode_reference, ones1, scale_mode
from .registry import KernelSpec, register

__all__ = ["gemv", "GEMV_MAX_M", "weight_bytes_per_element"]

# Rows of x per launch (more rows run in launches of this many, each reading the weight again).
GEMV_MAX_M = source.define("GEMV_MAX_M", 8)
# The kernel body for M rows is compiled for the power of two at or above M; its simdgroups each cover
# GEMV_ROWS[that power] output rows (more rows: more loads in flight; fewer: fewer registers for large M).
GEMV_ROWS = source.constexpr_table("gemv_rows", {1: 4, 2: 4, 4: 2, 8: 2})
GEMV_PARAMS = source.Params("gemv_params", "M N K row_bytes scale_mode has_bias bias_kind out_kind")
# Threads a threadgroup of the GEMV: two simdgroups. The kernel shares nothing between its simdgroups, so small
# groups only spread the work more evenly over the cores (3072 rows: 384 groups for 38 cores, not 96).
GEMV_GROUP = 64
VEC_BYTES = 16                   # bytes a lane loads per chunk in the vector kernels


def weight_bytes_per_element(weight: torch.Tensor) -> int:
    return 1 if weight.dtype == torch.uint8 or weight.dtype in FORMAT_OF_DTYPE else weight.element_size()


def _prepare(x, weight, bias, fmt, scale, out_dtype):
    """Validate and normalise: (x2 (M, K), kind, weight (N, K) [uint8 for FP8], fmt, lead shape, N,
    scale mode, scale fp32, bias, out_dtype)."""
    if not isinstance(x, torch.Tensor) or x.dtype not in MSL_TYPE:
        raise TypeError(f"gemv: x must be a float32/float16/bfloat16 tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() < 1:
        raise ValueError("gemv: x must have at least one dimension (..., K)")
    if not isinstance(weight, torch.Tensor):
        raise TypeError(f"gemv: weight must be a tensor, got {type(weight).__name__}")
    if weight.dtype in MSL_TYPE:
        if fmt is not None:
            raise ValueError(f"gemv: fmt={fmt!r} given for a {weight.dtype} weight (fmt is for FP8 bytes)")
        kind, w = MSL_TYPE[weight.dtype], weight
    else:
        w, fmt = _as_bytes(weight, fmt, "gemv: weight")
        kind = fmt
    if w.device != x.device:
        raise ValueError(f"gemv: weight is on {w.device} but x is on {x.device}")
    K = x.shape[-1]
    if w.dim() != 2 or w.shape[1] != K:
        raise ValueError(f"gemv: weight has shape {tuple(w.shape)}, expected (N, {K}) for x of shape {tuple(x.shape)}")
    N = w.shape[0]
    mode, s = scale_mode(scale, (N, K), w.device, "gemv: scale")
    if bias is not None:
        if not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (N,) or not bias.is_floating_point():
            raise ValueError(f"gemv: bias must be a float tensor of shape ({N},), got "
                             f"{getattr(bias, 'dtype', type(bias).__name__)} {tuple(getattr(bias, 'shape', ()))}")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    if out_dtype not in MSL_TYPE:
        raise TypeError(f"gemv: out_dtype {out_dtype} is not supported; expected float32, float16 or bfloat16")
    lead = tuple(x.shape[:-1])
    x2 = x.reshape(math.prod(lead), K)
    return x2, kind, w, fmt, lead, N, mode, s, bias, out_dtype


def gemv_reference(x, weight, bias=None, *, fmt=None, scale=None, out_dtype=None):
    x2, kind, w, fmt, lead, N, mode, s, bias, out_dtype = _prepare(x, weight, bias, fmt, scale, out_dtype)
    if kind in MSL_TYPE.values():
        wf = w.to(torch.float32)
        if mode:
            wf = wf * (s.reshape(()) if mode == 1 else s.reshape(-1, 1))
    else:
        wf = fp8_decode_reference(w, fmt, scale=s if mode else None, out_dtype=torch.float32)
    y = x2.to(torch.float32) @ wf.T
    if bias is not None:
        y = y + bias.to(device=y.device, dtype=torch.float32)
    return y.to(out_dtype).reshape(lead + (N,))


def gemv_bucket(m: int) -> int:
    """The M the kernel body for m rows is compiled for (the power of two at or above m)."""
    return 1 << (m - 1).bit_length()


def launch_gemv(kernel, x2, w, mode: int, s, bias, out_dtype, N: int, row_bytes: int, extra=()) -> torch.Tensor:
    """y (M, N) in out_dtype from a gemv<F, XT> kernel of include/gemv.h: x2 (M, K) contiguous in XT, w the
    weight bytes (row n at n * row_bytes), scale mode and fp32 scale, bias (N,) or None; `extra`: the
    arguments the kernel takes after the params (quant.metal's block scales). Launches of at most GEMV_MAX_M
    rows, each writing its rows of y in place."""
    M, K = x2.shape
    device = x2.device
    y = torch.empty(M, N, dtype=out_dtype, device=device)
    if bias is not None:
        bias = bias.to(device)
        if bias.dtype not in MSL_KIND:
            bias = bias.to(torch.float32)
        bias = bias.contiguous()
    s_buf = s.contiguous() if mode else ones1(device)
    b_buf = bias if bias is not None else ones1(device)                 # unread without a bias
    if GEMV_MAX_M * K >= 1 << 32 or max(GEMV_ROWS.values()) * row_bytes >= 1 << 32:
        raise ValueError(f"gemv: {M}x{K} activations or rows of {row_bytes} bytes exceed the kernel's 32-bit offsets")
    for m0 in range(0, M, GEMV_MAX_M):
        mm = min(GEMV_MAX_M, M - m0)
        threads = -(-N // GEMV_ROWS[gemv_bucket(mm)]) * 32
        params = GEMV_PARAMS.pack(M=mm, N=N, K=K, row_bytes=row_bytes, scale_mode=mode,
                                  has_bias=int(bias is not None), bias_kind=MSL_KIND[b_buf.dtype],
                                  out_kind=MSL_KIND[out_dtype])
        kernel(x2[m0:m0 + mm], w, s_buf, b_buf, y[m0:m0 + mm], params, *extra, threads=threads,
               group_size=min(GEMV_GROUP, threads))
    return y


def gemv_metal(lib, x, weight, bias=None, *, fmt=None, scale=None, out_dtype=None):
    x2, kind, w, fmt, lead, N, mode, s, bias, out_dtype = _prepare(x, weight, bias, fmt, scale, out_dtype)
    M, K = x2.shape
    device = x.device
    if M == 0 or N == 0 or K == 0:           # nothing to launch (and no 0-byte buffers to bind)
        y = torch.zeros(lead + (N,), dtype=torch.float32, device=device)
        if bias is not None:
            y = y + bias.to(device=device, dtype=torch.float32)
        return y.to(out_dtype)
    w = w.contiguous()                        # a no-op for the usual contiguous weight
    size = w.element_size()
    # The vector kernels load 16 weight bytes and up to 16 bytes of x at once, aligned to their size. A
    # weight memory-mapped from a safetensors file can start anywhere: the scalar kernel takes it then
    # (copying the weight on every call would cost more than the vector loads gain).
    vec = (K * size) % VEC_BYTES == 0 and w.data_ptr() % VEC_BYTES == 0
    x2 = x2.contiguous()
    if vec and x2.data_ptr() % VEC_BYTES:
        x2 = x2.clone()                       # x is small: an aligned copy
    kernel = getattr(lib, f"gemv_{kind}_{MSL_TYPE[x2.dtype]}{'' if vec else '_scalar'}")
    y = launch_gemv(kernel, x2, w, mode, s, bias, out_dtype, N, K * size)
    return y.reshape(lead + (N,))


def _cases(device):
    """One case per entry point (weight type x activation type x vector/scalar kernel): the self-check is
    the only thing standing between an entry point and the user's model on a Mac. M, N, the scale mode,
    the bias and the output type rotate through the cases: every M bucket, rows past N, masked x rows."""
    gen = torch.Generator().manual_seed(3)
    out = []
    weights = [torch.float32, torch.float16, torch.bfloat16, "e4m3fn", "e5m2"]
    for i, (wkind, xdtype, vec) in enumerate(itertools.product(weights, MSL_TYPE, (True, False))):
        M, N = (1, 3, 8, 2, 5, 4)[i % 6], (5, 7, 9, 1)[i % 4]
        K = 48 if vec else 13
        x = torch.randn(M, K, generator=gen).to(xdtype)
        if isinstance(wkind, str):
            # clearing bit 6 keeps |w| < 2: no inf/NaN codes, sums without catastrophic cancellation
            w = torch.randint(0, 256, (N, K), generator=gen, dtype=torch.uint8) & 0xBF
            kw = {"fmt": wkind}
        else:
            w, kw = torch.randn(N, K, generator=gen).to(wkind), {}
        smode = (None, "row", "tensor")[i % 3]
        if smode == "row":
            kw["scale"] = (torch.rand(N, 1, generator=gen) + 0.05).to(device)
        elif smode == "tensor":
            kw["scale"] = torch.tensor([0.02]).to(device)
        kw["out_dtype"] = (None, torch.float32, xdtype)[i % 3]
        b = torch.randn(N, generator=gen).to((xdtype, torch.float32)[i % 2]).to(device) if i % 4 else None
        out.append(((x.to(device), w.to(device), b), kw))
    return out


GEMV_ARGS = ("tensor", "tensor", "tensor", "tensor", "tensor", "int[]")
# weight kind -> its element type in linear.metal / fp8.h
_ELEMENTS = {"float": "gemv_float", "half": "gemv_half", "bfloat": "gemv_bfloat", "e4m3fn": "fp8_e4m3fn",
             "e5m2": "fp8_e5m2"}
_INSTANCES = {f"gemv_{w}_{x}{suffix}": f"gemv<gemv_{layout}<{e}>, {x}>"
              for w, e in _ELEMENTS.items() for x in MSL_TYPE.values()
              for suffix, layout in (("", "vec"), ("_scalar", "elem"))}

gemv = register(KernelSpec(
    name="gemv",
    measured_by_caller=True,
    source="linear.metal",
    entry_points={name: GEMV_ARGS for name in _INSTANCES},
    instantiate=_INSTANCES,
    reference=gemv_reference,
    metal=gemv_metal,
    self_check_cases=_cases,
    atol=2e-4,
    rtol=2e-4,
))
