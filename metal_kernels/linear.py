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

import math

import torch

from .dtypes import FORMAT_OF_DTYPE, MSL_TYPE
from .fp8 import _as_bytes, fp8_decode_reference, ones1, scale_mode
from .registry import KernelSpec, register

__all__ = ["gemv", "GEMV_MAX_M", "weight_bytes_per_element"]

GEMV_MAX_M = 8        # rows of x per dispatch (GEMV_MAX_M in linear.metal)
GEMV_COLS = 4         # output columns per simdgroup (GEMV_COLS in linear.metal)
GROUP = 256


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
    # The _k4 kernels load 4 weights and 4 x values as one vector, which must be aligned to its size.
    # A weight memory-mapped from a safetensors file can start anywhere: take the scalar kernel then
    # (copying the weight on every call would cost more than the vector loads gain).
    vec = K % 4 == 0 and w.data_ptr() % (4 * w.element_size()) == 0
    kernel = getattr(lib, f"gemv_{kind}{'_k4' if vec else ''}")
    xf = x2.to(torch.float32).contiguous()
    if vec and xf.data_ptr() % 16:            # x is small: copy it into a fresh (aligned) buffer
        xf = xf.clone()
    s_buf = s.contiguous() if mode else ones1(device)
    b_buf = bias.to(device=device, dtype=torch.float32).contiguous() if bias is not None else ones1(device)  # unread
    groups_of_cols = (N + GEMV_COLS - 1) // GEMV_COLS
    threads = groups_of_cols * 32
    group = min(GROUP, threads)
    chunks = []
    for m0 in range(0, M, GEMV_MAX_M):
        xm = xf if M <= GEMV_MAX_M else xf[m0:m0 + GEMV_MAX_M].clone()   # own buffer: no offsets
        mm = xm.shape[0]
        y = torch.empty(mm, N, dtype=torch.float32, device=device)
        kernel(xm, w, s_buf, b_buf, y, mm, K, N, mode, int(bias is not None), threads=threads, group_size=group)
        chunks.append(y)
    y = chunks[0] if len(chunks) == 1 else torch.cat(chunks)
    return y.to(out_dtype).reshape(lead + (N,))


def _cases(device):
    gen = torch.Generator().manual_seed(3)
    out = []
    # Every entry point (each weight type, scalar K and K % 4 == 0 "_k4") is exercised once: the
    # self-check is the only thing standing between an entry point and the user's model on a Mac.
    for (M, K, N), wkind, smode, with_bias in [((1, 33, 5), "e4m3fn", "row", True), ((3, 7, 6), torch.float16, None, False),
                                               ((8, 36, 9), "e5m2", "tensor", True), ((2, 40, 3), torch.bfloat16, "row", False),
                                               ((5, 12, 1), torch.float32, "tensor", True),
                                               ((1, 64, 7), "e4m3fn", "row", False), ((2, 13, 5), "e5m2", None, True),
                                               ((4, 28, 6), torch.float16, "tensor", True), ((1, 9, 4), torch.bfloat16, None, True),
                                               ((3, 11, 5), torch.float32, "row", False)]:
        x = torch.randn(M, K, generator=gen)
        if isinstance(wkind, str):
            # clearing bit 6 keeps |w| < 2: no inf/NaN codes, sums without catastrophic cancellation
            w = torch.randint(0, 256, (N, K), generator=gen, dtype=torch.uint8) & 0xBF
            kw = {"fmt": wkind}
        else:
            w, kw = torch.randn(N, K, generator=gen).to(wkind), {}
        if smode == "row":
            kw["scale"] = (torch.rand(N, 1, generator=gen) + 0.05).to(device)
        elif smode == "tensor":
            kw["scale"] = torch.tensor([0.02]).to(device)
        b = torch.randn(N, generator=gen).to(device) if with_bias else None
        out.append(((x.to(device), w.to(device), b), kw))
    return out


_KINDS = ("float", "half", "bfloat", "e4m3fn", "e5m2")
_ARGS = ("tensor", "tensor", "tensor", "tensor", "tensor", "int", "int", "int", "int", "int")

gemv = register(KernelSpec(
    name="gemv",
    measured_by_caller=True,
    source="linear.metal",
    entry_points={f"gemv_{k}{v}": _ARGS for k in _KINDS for v in ("", "_k4")},
    reference=gemv_reference,
    metal=gemv_metal,
    self_check_cases=_cases,
    atol=2e-4,
    rtol=2e-4,
))
