"""ComfyUI's comfy_quant block formats (comfy_kitchen's layouts): dequantise, and a fused dequantise +
GEMV for small batches, both reading the stored bytes and scales directly.

Formats (QUANT_FORMATS) and the tensors of a weight of logical shape (N, K), as ComfyUI stores them:
  nvfp4  qdata uint8 (Np, Kp / 2): e2m1 pairs, first value in the high nibble; Np, Kp = N, K rounded up
         to 16. scale: e4m3fn block scales (uint8 bytes or float8_e4m3fn), one per 16 values, in cuBLAS's
         swizzled layout of (roundup(Np, 128), roundup(Kp / 16, 4)). scale2: the float32 tensor scale.
  mxfp8  qdata e4m3fn (uint8 bytes or float8_e4m3fn) (Np, Kp), N, K rounded up to 32. scale: e8m0 block
         scales (uint8 bytes or float8_e8m0fnu), one per 32 values, swizzled (roundup(Np, 128),
         roundup(Kp / 32, 4)).
  int8   qdata int8 (N, K). scale: float32, one element (tensorwise) or (N,) / (N, 1) (per row).
  w4a8   qdata int8 (N, K / 2): unsigned nibbles, first value in the low nibble. scale: s_rel, one per
         group_size values of a row, (N, K / group_size), e4m3fn bytes or float32. scale2: s_channel
         float32 (N,). codebook: float32 (16,), the level of each nibble code, or None (code - 8).
  w4a4   qdata int8 (N, K / 2): signed nibbles (-8..7), first value in the low nibble. scale: float32 (N,).
The w4a8, w4a4 and rotated int8 layouts hold ConvRot-rotated weights (W_stored = W @ H per group, H a
regular Hadamard matrix): the kernels return the STORED basis; `rotate_weight` turns a dequantised weight
back, `rotate_activation` rotates x instead (x @ W.T == rotate_activation(x) @ W_stored.T).

quant_dequantize(qdata, fmt, scale, scale2=None, codebook=None, *, shape, group_size=0, out_dtype=float32)
    -> (N, K) in out_dtype (float32, float16, bfloat16): the values as comfy_kitchen's dequantize_*
    compute them (the nvfp4 scales multiplied in out_dtype, as there; the others in fp32, rounded once),
    bit for bit; the storage padding is dropped.
quant_gemv(x, qdata, fmt, scale, scale2=None, codebook=None, bias=None, *, shape, group_size=0)
    y = x @ quant_dequantize(...).T + bias, fp32 accumulation, in x.dtype. x: (..., K) float32/float16/
    bfloat16, meant for <= 8 rows (more rows run 8 at a time).
"""
from __future__ import annotations

import math

import torch

from . import source
from .dtypes import MSL_TYPE
from .fp8 import fp8_decode_reference
from .linear import GEMV_ARGS, GEMV_MAX_M, launch_gemv
from .registry import KernelSpec, register

__all__ = ["quant_dequantize", "quant_gemv", "dequantize_weight", "QUANT_FORMATS"]

QUANT_FORMATS = ("nvfp4", "mxfp8", "int8", "w4a8", "w4a4")
QUANT_GEMV_MAX_M = GEMV_MAX_M     # rows of x a GEMV launch takes (the skeleton of include/gemv.h)
VPC = {"nvfp4": 32, "mxfp8": 16, "int8": 16, "w4a8": 32, "w4a4": 32}     # values a 16-byte chunk
QUANT_GEMV_PARAMS = source.Params("quant_gemv_params", "K ncb group groups")
BLOCK = {"nvfp4": 16, "mxfp8": 32}
GROUP = 256
_E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_BYTES = (torch.uint8, torch.int8)


def _roundup(x: int, m: int) -> int:
    return (x + m - 1) // m * m


def quant_layout(fmt: str, shape, group_size: int = 0) -> dict:
    """The stored shapes of a weight of logical `shape` (N, K): {"qdata": shape, "scale": shape (nvfp4 / mxfp8:
    the swizzled tiles' (rows, columns)), "scale2": values or None, "padded": (Np, Kp)}, and "ncb" (tiles a row
    of scale tiles) for the block formats. Raises ValueError naming what does not fit (an odd K of 4-bit
    values, a bad group size)."""
    if fmt not in QUANT_FORMATS:
        raise ValueError(f"quant format {fmt!r} is not supported; expected one of {', '.join(QUANT_FORMATS)}")
    N, K = (int(s) for s in shape)
    if fmt in BLOCK:
        pad = BLOCK[fmt] if fmt == "nvfp4" else 32
        Np, Kp = _roundup(N, pad), _roundup(K, pad)
        blocks = Kp // BLOCK[fmt]
        scale_rows, scale_cols = _roundup(Np, 128), _roundup(blocks, 4)
        qshape = (Np, Kp // 2) if fmt == "nvfp4" else (Np, Kp)
        return {"qdata": qshape, "scale": (scale_rows, scale_cols), "scale2": 1 if fmt == "nvfp4" else None,
                "padded": (Np, Kp), "ncb": scale_cols // 4}
    if fmt == "int8":
        return {"qdata": (N, K), "scale": "1 or N", "scale2": None, "padded": (N, K)}
    if K % 2:
        raise ValueError(f"{fmt}: K = {K} is odd; two 4-bit values share a byte")
    if fmt == "w4a8":
        g = int(group_size)
        if g < 4 or K % 16 or K % g or (16 % g and g % 16):
            raise ValueError(f"w4a8: K = {K} with group size {g}: K must be a multiple of 16 and of the group "
                             "size, and the group size >= 4, dividing 16 or a multiple of 16")
        return {"qdata": (N, K // 2), "scale": (N, K // g), "scale2": N, "padded": (N, K)}
    return {"qdata": (N, K // 2), "scale": (N,), "scale2": None, "padded": (N, K)}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def _check(qdata, fmt, scale, scale2, codebook, shape, group_size, what):
    """Validate and normalise: (qdata uint8, scale (uint8 bytes or float32), scale2 float32 or None,
    codebook float32 or None, N, K, layout)."""
    if shape is None or len(tuple(shape)) != 2:
        raise ValueError(f"{what}: shape must be the logical (N, K) of the weight, got {shape!r}")
    lay = quant_layout(fmt, shape, group_size)
    N, K = (int(s) for s in shape)
    allowed = _BYTES + ((getattr(torch, "float8_e4m3fn", None),) if fmt == "mxfp8" else ())
    if not isinstance(qdata, torch.Tensor) or qdata.dtype not in allowed:
        raise TypeError(f"{what}: {fmt} data must be uint8/int8{'/float8_e4m3fn' if fmt == 'mxfp8' else ''} "
                        f"bytes, got {getattr(qdata, 'dtype', type(qdata).__name__)}")
    if tuple(qdata.shape) != lay["qdata"]:
        raise ValueError(f"{what}: {fmt} data of a {N}x{K} weight must have shape {lay['qdata']}, "
                         f"got {tuple(qdata.shape)}")
    if not isinstance(scale, torch.Tensor):
        raise TypeError(f"{what}: {fmt} needs a scale tensor, got {type(scale).__name__}")
    if fmt in BLOCK:
        if scale.element_size() != 1:
            raise TypeError(f"{what}: {fmt} block scales must be 1-byte codes, got {scale.dtype}")
        want = lay["scale"][0] * lay["scale"][1]
        if scale.numel() != want:
            raise ValueError(f"{what}: {fmt} block scales of a {N}x{K} weight must hold {want} values "
                             f"{lay['scale']}, got {tuple(scale.shape)}")
        s = _bytes(scale.contiguous()).reshape(-1)
    elif fmt == "w4a8":
        if tuple(scale.shape) != lay["scale"]:
            raise ValueError(f"{what}: w4a8 s_rel must have shape {lay['scale']}, got {tuple(scale.shape)}")
        s = _bytes(scale) if scale.element_size() == 1 else scale.to(torch.float32)
        if s.element_size() == 1 and scale.dtype not in (torch.uint8, getattr(torch, "float8_e4m3fn", None)):
            raise TypeError(f"{what}: w4a8 s_rel must be float8_e4m3fn (or its uint8 bytes) or float32, "
                            f"got {scale.dtype}")
    else:
        rows_ok = tuple(scale.shape) in ((N,), (N, 1))
        if not scale.is_floating_point() or not (rows_ok or (fmt == "int8" and scale.numel() == 1)):
            raise ValueError(f"{what}: {fmt} scale must be float {'one element or ' if fmt == 'int8' else ''}"
                             f"({N},) / ({N}, 1), got {scale.dtype} {tuple(scale.shape)}")
        s = scale.to(torch.float32).reshape(-1)
    s2 = None
    if fmt == "nvfp4" or fmt == "w4a8":
        need = lay["scale2"]
        if not isinstance(scale2, torch.Tensor) or scale2.numel() != need or not scale2.is_floating_point():
            name = "the tensor scale (weight_scale_2)" if fmt == "nvfp4" else "s_channel"
            raise ValueError(f"{what}: {fmt} needs {name}: {need} float value(s), got "
                             f"{getattr(scale2, 'dtype', None)} {tuple(getattr(scale2, 'shape', ()))}")
        s2 = scale2.to(torch.float32).reshape(-1)
    cb = None
    if fmt == "w4a8" and codebook is not None:
        if not isinstance(codebook, torch.Tensor) or codebook.numel() != 16:
            raise ValueError(f"{what}: w4a8 codebook must hold 16 levels, got "
                             f"{tuple(getattr(codebook, 'shape', ()))}")
        cb = codebook.to(torch.float32).reshape(16)
    return _bytes(qdata), s, s2, cb, N, K, lay


def check_weight(qdata, fmt, scale, scale2=None, codebook=None, *, shape, group_size=0, what="weight") -> None:
    """Raise TypeError / ValueError (starting with `what`) if the tensors do not make a `fmt` weight of `shape`."""
    _check(qdata, fmt, scale, scale2, codebook, shape, group_size, what)


def _check_out_dtype(out_dtype, what):
    if out_dtype not in MSL_TYPE:
        raise TypeError(f"{what}: out_dtype {out_dtype} is not supported; expected float32, float16 or bfloat16")


def _unswizzle(s: torch.Tensor, N: int, nblocks: int, lay: dict) -> torch.Tensor:
    """Block scale bytes in the swizzled layout (quant_swizzle in quant.metal) -> (N, nblocks) in row order:
    tile (row block, column block) holds row r at [r % 32][r / 32 % 4][column % 4]."""
    rows, cols = lay["scale"]
    t = s.reshape(rows // 128, cols // 4, 32, 4, 4).permute(0, 3, 2, 1, 4)
    return t.reshape(rows, cols)[:N, :nblocks]


def _e8m0(e: torch.Tensor) -> torch.Tensor:
    e = e.to(torch.int32)
    return torch.where(e == 0, torch.zeros_like(e), e << 23).view(torch.float32)


def _nibble_values(q: torch.Tensor, levels: torch.Tensor, high_first: bool) -> torch.Tensor:
    """uint8 (R, C) of two 4-bit codes a byte -> (R, 2C) of levels[code] in value order (levels: 16 values;
    one lookup of a 256-entry table of pairs per byte)."""
    code = torch.arange(256, device=levels.device)
    first, second = (code >> 4, code & 15) if high_first else (code & 15, code >> 4)
    pairs = torch.stack([levels[first], levels[second]], dim=-1)            # (256, 2)
    return torch.nn.functional.embedding(q.to(torch.int32), pairs).reshape(q.shape[0], -1)


def _w4a8_grid(q, s, cb, N, K, group_size) -> torch.Tensor:
    """The weight on the INT8 grid (N, K) float32: comfy_kitchen's _dequant_int4_grouped_to_int8."""
    levels = cb if cb is not None else _cached("grid", q.device)
    values = _nibble_values(q, levels, high_first=False)
    srel = fp8_decode_reference(s, "e4m3fn", out_dtype=torch.float32) if s.dtype == torch.uint8 else s
    values = values.view(N, K // group_size, group_size) * srel.float().unsqueeze(-1)
    return values.view(N, K).round().clamp_(-127, 127)


def quant_dequantize_reference(qdata, fmt, scale, scale2=None, codebook=None, *, shape, group_size=0,
                               out_dtype=torch.float32):
    q, s, s2, cb, N, K, lay = _check(qdata, fmt, scale, scale2, codebook, shape, group_size, "quant_dequantize")
    _check_out_dtype(out_dtype, "quant_dequantize")
    dev = q.device
    if fmt in BLOCK:
        Kp, blk = lay["padded"][1], BLOCK[fmt]
        codes = _unswizzle(s, N, Kp // blk, lay)
        if fmt == "nvfp4":
            vals = _nibble_values(q[:N], torch.tensor(_E2M1, dtype=out_dtype, device=dev), high_first=True)
            bs = fp8_decode_reference(codes, "e4m3fn", out_dtype=torch.float32)
            total = s2.reshape(()).to(out_dtype) * bs.to(out_dtype)      # in out_dtype, as comfy_kitchen
            out = vals.view(N, Kp // blk, blk) * total.unsqueeze(-1)
        else:
            vals = fp8_decode_reference(q[:N], "e4m3fn", out_dtype=torch.float32)
            out = (vals.view(N, Kp // blk, blk) * _e8m0(codes).unsqueeze(-1)).to(out_dtype)
        out = out.view(N, Kp)
        return out if K == Kp else out[:, :K].contiguous()
    if fmt == "int8":
        sc = s.reshape(()) if s.numel() == 1 else s.reshape(N, 1)
        return (q.view(torch.int8).float() * sc).to(out_dtype)
    if fmt == "w4a8":
        return (_w4a8_grid(q, s, cb, N, K, group_size) * s2.reshape(N, 1)).to(out_dtype)
    signed = _nibble_values(q, _cached("signed", dev), high_first=False)
    return (signed * s.reshape(N, 1)).to(out_dtype)


def _prepare_gemv(x, bias, K, N, what):
    if not isinstance(x, torch.Tensor) or x.dtype not in MSL_TYPE:
        raise TypeError(f"{what}: x must be a float32/float16/bfloat16 tensor, got {getattr(x, 'dtype', x)}")
    if x.dim() < 1 or x.shape[-1] != K:
        raise ValueError(f"{what}: x has shape {tuple(x.shape)}, expected (..., {K})")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (N,)):
        raise ValueError(f"{what}: bias must have shape ({N},), got {tuple(getattr(bias, 'shape', ()))}")
    lead = tuple(x.shape[:-1])
    return x.reshape(math.prod(lead), K), lead


def quant_gemv_reference(x, qdata, fmt, scale, scale2=None, codebook=None, bias=None, *, shape, group_size=0):
    N, K = (int(s) for s in shape)
    x2, lead = _prepare_gemv(x, bias, K, N, "quant_gemv")
    w = quant_dequantize_reference(qdata, fmt, scale, scale2, codebook, shape=shape, group_size=group_size)
    y = x2.to(torch.float32) @ w.T
    if bias is not None:
        y = y + bias.to(device=y.device, dtype=torch.float32)
    return y.to(x.dtype).reshape(lead + (N,))


# ------------------------------------------------------------------------------------------------
# Metal launch glue
# ------------------------------------------------------------------------------------------------

_CACHED: dict[tuple, torch.Tensor] = {}


def _cached(name: str, device) -> torch.Tensor:
    """16 cached floats on `device`: "grid" the W4A8 levels without a codebook (code - 8), "signed" the W4A4
    nibbles' values, "dummy" bound where a kernel's optional input is unused (never read)."""
    key = (name, str(device))
    t = _CACHED.get(key)
    if t is None:
        t = {"grid": torch.arange(16, dtype=torch.float32) - 8.0,             # code - 8
             "signed": torch.tensor([float(c - 16 * (c >= 8)) for c in range(16)]),   # two's complement
             "dummy": torch.zeros(16)}[name]
        t = _CACHED[key] = t.to(device)
    return t


def _dummy(device) -> torch.Tensor:
    return _cached("dummy", device)


def _kind(fmt: str, s: torch.Tensor) -> str:
    return "w4a8f" if fmt == "w4a8" and s.dtype == torch.float32 else fmt


def _param(fmt, s, lay, group_size) -> int:
    if fmt in BLOCK:
        return lay["ncb"]
    if fmt == "int8":
        return 1 if s.numel() == 1 else 2
    return int(group_size)


def _buffers(q, fmt, s, s2, cb, device):
    q = q.contiguous()
    vec = q.shape[1] % 16 == 0 and q.data_ptr() % 16 == 0
    if fmt in ("int8", "w4a4"):
        s2, s = s, _dummy(device)
    if fmt == "w4a8" and cb is None:
        cb = _cached("grid", device)
    return q, s.contiguous(), (s2 if s2 is not None else _dummy(device)).contiguous(), \
        (cb if cb is not None else _dummy(device)).contiguous(), vec


def quant_dequantize_metal(lib, qdata, fmt, scale, scale2=None, codebook=None, *, shape, group_size=0,
                           out_dtype=torch.float32):
    q, s, s2, cb, N, K, lay = _check(qdata, fmt, scale, scale2, codebook, shape, group_size, "quant_dequantize")
    _check_out_dtype(out_dtype, "quant_dequantize")
    out = torch.empty(N, K, dtype=out_dtype, device=q.device)
    if N == 0 or K == 0:
        return out
    p = _param(fmt, s, lay, group_size)
    kind = _kind(fmt, s)
    q, s, s2, cb, vec = _buffers(q, fmt, s, s2, cb, q.device)
    threads = N * ((K + VPC[fmt] - 1) // VPC[fmt])
    kernel = getattr(lib, f"quant_dequant_{kind}_{MSL_TYPE[out_dtype]}")
    ovec = K * out.element_size() % 16 == 0        # whole 16-byte vectors a row (out itself is fresh: aligned)
    kernel(q, s, s2, cb, out, N, K, q.shape[1], p, int(vec), int(ovec), threads=threads,
           group_size=min(GROUP, threads))
    return out


def _gemv_variant(kind: str, row_bytes: int, ptr: int, group_size: int) -> str:
    """The entry point suffix for a weight: "" 16-byte chunks a lane (rows of whole 16-byte vectors, the
    storage 16-byte aligned), "_8" 8-byte chunks (rows of 8-byte multiples; NVFP4 always: one block a lane,
    and half the x bytes a step through the caches of 16-byte chunks), "_g" (w4a8: 16-byte chunks, a group
    size other than 16), "_b" byte chunks (odd rows, unaligned storage)."""
    fast16 = kind not in ("w4a8", "w4a8f") or group_size == 16
    if row_bytes % 16 == 0 and ptr % 16 == 0 and kind != "nvfp4":
        return "" if fast16 else "_g"
    if row_bytes % 8 == 0 and ptr % 8 == 0 and kind in _CB8 and fast16:
        return "_8"
    return "_b"


def quant_gemv_metal(lib, x, qdata, fmt, scale, scale2=None, codebook=None, bias=None, *, shape, group_size=0):
    q, s, s2, cb, N, K, lay = _check(qdata, fmt, scale, scale2, codebook, shape, group_size, "quant_gemv")
    x2, lead = _prepare_gemv(x, bias, K, N, "quant_gemv")
    M = x2.shape[0]
    device = x.device
    if M == 0 or N == 0 or K == 0:
        y = torch.zeros(lead + (N,), dtype=torch.float32, device=device)
        if bias is not None:
            y = y + bias.to(device=device, dtype=torch.float32)
        return y.to(x.dtype)
    kind = _kind(fmt, s)
    q = q.contiguous()
    row_bytes = q.shape[1]
    width = lay["padded"][1]                  # the stored values a row (nvfp4 / mxfp8: K padded)
    # the row / tensor scale of the skeleton: mode 1 one value, 2 one a row
    if fmt in ("int8", "w4a4"):
        mode, sc, blk = (1 if s.numel() == 1 else 2), s, _dummy(device)
    elif fmt == "nvfp4":
        mode, sc, blk = 1, s2, s
    elif fmt == "w4a8":
        mode, sc, blk = 2, s2, s
    else:
        mode, sc, blk = 0, None, s
    if fmt == "w4a8" and cb is None:
        cb = _cached("grid", device)
    cb = (cb if cb is not None else _dummy(device)).contiguous()
    variant = _gemv_variant(kind, row_bytes, q.data_ptr(), int(group_size))
    xw = x2.contiguous()
    if width != K or xw.data_ptr() % 16 or (width * xw.element_size()) % 16:
        # the stored row width, zeros beyond K, in a fresh (16-byte aligned) buffer; rows of whole 16-byte
        # vectors wherever the vector kernels load x 16 bytes at a time
        step = 16 // xw.element_size() if variant != "_b" else 1
        xp = torch.zeros(M, -(-width // step) * step, dtype=x.dtype, device=device)
        xp[:, :K] = xw
        xw, width = xp, xp.shape[1]
    # the skeleton's K: the x row stride and (the vector kernels) whole chunks of the stored row
    kx = width if variant != "_b" else lay["padded"][1]
    if variant == "_b" and width != kx:
        xw = xw[:, :kx].contiguous()          # byte chunks: x rows of exactly the stored width
    lay_ncb = lay.get("ncb", 0)
    groups = K // int(group_size) if fmt == "w4a8" else 0
    params = QUANT_GEMV_PARAMS.pack(K=K, ncb=lay_ncb, group=int(group_size), groups=groups)
    kernel = getattr(lib, f"quant_gemv_{kind}_{MSL_TYPE[x.dtype]}{variant}")
    y = launch_gemv(kernel, xw, q, mode, sc, bias, x.dtype, N, row_bytes,
                    extra=(blk.contiguous(), cb, params))
    return y.reshape(lead + (N,))


# ------------------------------------------------------------------------------------------------
# ConvRot rotation (regular Hadamard matrices, as comfy_kitchen builds them)
# ------------------------------------------------------------------------------------------------

_HADAMARD: dict[tuple, torch.Tensor] = {}


def hadamard(size: int, device="cpu", dtype=torch.float32) -> torch.Tensor:
    """The normalised regular Hadamard matrix of `size` (a power of 4): kron powers of the 4x4 regular
    Hadamard, divided by sqrt(size). Symmetric and orthogonal; its entries are +-2^-k, exact in every
    float dtype."""
    key = (int(size), str(device), dtype)
    h = _HADAMARD.get(key)
    if h is not None:
        return h
    if size < 4 or size & (size - 1) or (size.bit_length() - 1) % 2:
        raise ValueError(f"ConvRot group size {size} is not a power of 4 (4, 16, 64, 256, 1024, ...)")
    h4 = torch.tensor([[1, 1, 1, -1], [1, 1, -1, 1], [1, -1, 1, 1], [-1, 1, 1, 1]], dtype=dtype, device=device)
    h = h4
    while h.shape[0] < size:
        h = torch.kron(h, h4)
    h = _HADAMARD[key] = h / (size ** 0.5)
    return h


def rotate_weight(w: torch.Tensor, group: int) -> torch.Tensor:
    """w (N, K) -> w @ H.T per group of `group` columns, in w's dtype (comfy_kitchen's _rotate_weight:
    the same matmul, so the same bits on the same device)."""
    N, K = w.shape
    if K % group:
        raise ValueError(f"ConvRot: {K} columns are not a multiple of the group size {group}")
    h_t = hadamard(group, w.device, w.dtype).T
    return torch.matmul(w.reshape(N, K // group, group), h_t).reshape(N, K)


def rotate_activation(x: torch.Tensor, group: int) -> torch.Tensor:
    """x (..., K) -> x @ H per group of `group` features (comfy_kitchen's _rotate_activation)."""
    K = x.shape[-1]
    if K % group:
        raise ValueError(f"ConvRot: {K} features are not a multiple of the group size {group}")
    h = hadamard(group, x.device, x.dtype)
    return torch.matmul(x.reshape(-1, K // group, group), h).reshape(x.shape)


# ------------------------------------------------------------------------------------------------
# Self-check inputs: random valid weights of every format, odd shapes, every entry point
# ------------------------------------------------------------------------------------------------

def random_weight(fmt: str, N: int, K: int, gen: torch.Generator, *, group_size: int = 16, f32_srel=False,
                  codebook=True):
    """(qdata, scale, scale2, codebook, kwargs) of a random valid `fmt` weight of shape (N, K): random codes,
    finite scales of moderate size (no NaN codes). For tests and self-checks."""
    lay = quant_layout(fmt, (N, K), group_size)

    def rbytes(shape, lo=0, hi=256):
        return torch.randint(lo, hi, shape, generator=gen, dtype=torch.int64).to(torch.uint8)

    kw = {"shape": (N, K)}
    if fmt == "nvfp4":
        rows, cols = lay["scale"]
        scale = rbytes((rows, cols), 0x28, 0x48)                    # e4m3 2^-2 .. 2^2
        return rbytes(lay["qdata"]), scale, torch.rand((), generator=gen) * 0.02 + 1e-3, None, kw
    if fmt == "mxfp8":
        q = rbytes(lay["qdata"]) & 0xBF                            # |v| < 2: no NaN codes
        return q, rbytes(lay["scale"], 118, 132), None, None, kw
    if fmt == "int8":
        scale = torch.rand(N, generator=gen) * 0.01 + 1e-3
        return rbytes(lay["qdata"]).view(torch.int8), scale, None, None, kw
    if fmt == "w4a8":
        kw["group_size"] = group_size
        srel = torch.rand(lay["scale"], generator=gen) * 120 + 4
        if not f32_srel:
            srel = srel.to(torch.float8_e4m3fn).view(torch.uint8)
        cb = torch.sort(torch.rand(16, generator=gen) * 2 - 1).values if codebook else None
        sch = torch.rand(N, generator=gen) * 0.01 + 1e-3
        return rbytes(lay["qdata"]).view(torch.int8), srel, sch, cb, kw
    return rbytes(lay["qdata"]).view(torch.int8), torch.rand(N, generator=gen) * 0.1 + 1e-3, None, None, kw


# (format, N, K, variant): odd N, K not a multiple of the chunk, the last partial block where the format
# has one (nvfp4 / mxfp8 padding), both w4a8 scale types and the codebook-free grid; between them every GEMV
# variant of _gemv_variant (16- and 8-byte chunks, other group sizes, byte chunks for odd rows and for storage
# at an odd address: "unaligned").
_SHAPES = [("nvfp4", 5, 40, {}), ("nvfp4", 18, 96, {}), ("nvfp4", 3, 20, {}), ("nvfp4", 4, 64, {"unaligned": True}),
           ("mxfp8", 7, 50, {}), ("mxfp8", 33, 64, {}), ("mxfp8", 2, 16, {}), ("mxfp8", 3, 40, {"unaligned": True}),
           ("int8", 5, 37, {}), ("int8", 9, 64, {}), ("int8", 3, 8, {}),
           ("w4a8", 6, 48, {"group_size": 16}), ("w4a8", 5, 64, {"group_size": 32, "codebook": False}),
           ("w4a8", 4, 80, {"group_size": 16, "f32_srel": True}), ("w4a8", 3, 32, {"group_size": 16}),
           ("w4a8", 5, 48, {"group_size": 16, "unaligned": True}),
           ("w4a8", 4, 64, {"group_size": 16, "f32_srel": True}), ("w4a8", 3, 64, {"group_size": 64, "f32_srel": True}),
           ("w4a8", 2, 48, {"group_size": 48, "f32_srel": True}),
           ("w4a4", 5, 70, {}), ("w4a4", 8, 64, {}), ("w4a4", 3, 6, {}), ("w4a4", 3, 48, {})]


def _unaligned(t: torch.Tensor) -> torch.Tensor:
    """t's bytes at an odd address (a memory-mapped tensor can start anywhere)."""
    b = t.contiguous().view(torch.uint8).reshape(-1)
    buf = torch.zeros(b.numel() + 1, dtype=torch.uint8, device=t.device)
    buf[1:] = b
    return buf[1:].view(t.dtype).view(t.shape)


def _cases(device, gemv: bool):
    """Every shape of _SHAPES in every float dtype: each entry point runs at least once."""
    gen = torch.Generator().manual_seed(25)
    out = []
    for i, (fmt, N, K, variant) in enumerate(_SHAPES):
        variant = dict(variant)
        odd = variant.pop("unaligned", False)
        q, s, s2, cb, kw = random_weight(fmt, N, K, gen, **variant)
        args = tuple(None if t is None else t.to(device) for t in (q, s, s2, cb))
        if odd:
            args = (_unaligned(args[0]),) + args[1:]
        args = args[:1] + (fmt,) + args[1:]
        for j, dtype in enumerate(MSL_TYPE):
            if gemv:
                M = 1 + (3 * i + j) % QUANT_GEMV_MAX_M
                x = torch.randn(M, K, generator=gen).to(dtype).to(device)
                bias = torch.randn(N, generator=gen).to(dtype).to(device) if (i + j) % 2 else None
                out.append(((x,) + args + (bias,), kw))
            else:
                out.append((args, {**kw, "out_dtype": dtype}))
    if not gemv:        # int8 tensorwise
        q, _, _, _, kw = random_weight("int8", 4, 20, gen)
        out.append(((q.to(device), "int8", torch.tensor([0.02]).to(device)), {**kw, "out_dtype": torch.float32}))
    return out


def _predict_gemv():
    """`bench --predict` cases: each format's GEMV at M = 1 on the decode shapes (Flux's 3072 square,
    Llama-3-8B's 4096 -> 14336), bf16 activations."""
    from .perf.cases import GEMV_SHAPES, PredictCase

    def case(fmt, n, k, variant):
        def run(lib, device):
            gen = torch.Generator().manual_seed(6)
            q, s, s2, cb, kw = random_weight(fmt, n, k, gen, **variant)
            x = torch.randn(1, k, generator=gen).to(device=device, dtype=torch.bfloat16)
            to = (lambda t: None if t is None else t.to(device))
            return quant_gemv_metal(lib, x, to(q), fmt, to(s), to(s2), to(cb), **kw)
        return run
    return [PredictCase(f"{fmt} M=1 {lbl}", case(fmt, n, k, variant), quick=(fmt, lbl) == ("nvfp4", "3072x3072"))
            for fmt, variant in (("nvfp4", {}), ("mxfp8", {}), ("int8", {}), ("w4a8", {"group_size": 16}),
                                 ("w4a4", {}))
            for lbl, n, k in GEMV_SHAPES]


def _predict_dequant():
    from .perf.cases import PredictCase

    def case(fmt, variant):
        def run(lib, device):
            q, s, s2, cb, kw = random_weight(fmt, 3072, 3072, torch.Generator().manual_seed(7), **variant)
            to = (lambda t: None if t is None else t.to(device))
            return quant_dequantize_metal(lib, to(q), fmt, to(s), to(s2), to(cb), out_dtype=torch.bfloat16, **kw)
        return run
    return [PredictCase(f"{fmt} 3072x3072 -> bf16", case(fmt, variant), quick=fmt == "nvfp4")
            for fmt, variant in (("nvfp4", {}), ("mxfp8", {}), ("int8", {}), ("w4a8", {"group_size": 16}))]


_KINDS = ("nvfp4", "mxfp8", "int8", "w4a8", "w4a8f", "w4a4")

quant_dequantize = register(KernelSpec(
    name="quant_dequantize",
    source="quant.metal",
    entry_points={f"quant_dequant_{k}_{t}": ("tensor",) * 5 + ("int",) * 6
                  for k in _KINDS for t in MSL_TYPE.values()},
    reference=quant_dequantize_reference,
    metal=quant_dequantize_metal,
    self_check_cases=lambda device: _cases(device, gemv=False),
    predict_cases=_predict_dequant,
    atol=0.0,
    rtol=0.0,
))

# the GEMV instantiations: kind -> {suffix: format}
_CB8 = ("nvfp4", "w4a8", "w4a8f", "w4a4")
_GEMV_FORMATS = {
    "nvfp4": {"_8": "quant_gemv_nvfp4<8>", "_b": "quant_gemv_nvfp4<1>"},
    "mxfp8": {"": "quant_gemv_mxfp8<16>", "_b": "quant_gemv_mxfp8<1>"},
    "int8": {"": "gemv_vec<quant_int8_elem>", "_b": "gemv_elem<quant_int8_elem>"},
    "w4a4": {"": "quant_gemv_w4a4<16>", "_8": "quant_gemv_w4a4<8>", "_b": "quant_gemv_w4a4<1>"},
    **{k: {"": f"quant_gemv_w4a8<16, {f}, true>", "_8": f"quant_gemv_w4a8<8, {f}, true>",
           "_g": f"quant_gemv_w4a8<16, {f}, false>", "_b": f"quant_gemv_w4a8<1, {f}, false>"}
       for k, f in (("w4a8", "false"), ("w4a8f", "true"))},
}
_GEMV_INSTANCES = {f"quant_gemv_{k}_{t}{suffix}": f"quant_gemv<{fmt}, {t}>"
                   for k, variants in _GEMV_FORMATS.items() for suffix, fmt in variants.items()
                   for t in MSL_TYPE.values()}

quant_gemv = register(KernelSpec(
    name="quant_gemv",
    measured_by_caller=True,
    source="quant.metal",
    entry_points={name: GEMV_ARGS + ("tensor", "tensor", "int[]") for name in _GEMV_INSTANCES},
    instantiate=_GEMV_INSTANCES,
    reference=quant_gemv_reference,
    metal=quant_gemv_metal,
    self_check_cases=lambda device: _cases(device, gemv=True),
    predict_cases=_predict_gemv,
    atol=2e-4,
    rtol=2e-4,
))


def dequantize_weight(qdata, fmt, scale, scale2=None, codebook=None, *, shape, group_size=0, convrot=0,
                      out_dtype=torch.float32) -> torch.Tensor:
    """The weight in its ORIGINAL basis: quant_dequantize, rotated back where the layout is ConvRot-rotated
    (convrot = its group size), in comfy_kitchen's dtypes: w4a8 rotates in out_dtype, w4a4 and int8 in
    float32 before the one rounding to out_dtype (dequantize_w4a8_int8_weight,
    dequantize_convrot_w4a4_weight, dequantize_int8_convrot_weight_dtype)."""
    if not convrot:
        return quant_dequantize(qdata, fmt, scale, scale2, codebook, shape=shape, group_size=group_size,
                                out_dtype=out_dtype)
    inner = out_dtype if fmt == "w4a8" else torch.float32
    stored = quant_dequantize(qdata, fmt, scale, scale2, codebook, shape=shape, group_size=group_size,
                              out_dtype=inner)
    return rotate_weight(stored, int(convrot)).to(out_dtype)
