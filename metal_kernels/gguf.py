"""GGUF (llama.cpp / ggml) block quantisations: dequantise to a float dtype, and a fused
dequantise + GEMV for small batches, both reading the quantised blocks directly.

Types: the keys of GGUF_TYPES (name -> its pure-torch reference and the offsets of its fp16 scales);
GGUF_QUANTS: name -> (elements per block, bytes per block), from gguf.GGML_QUANT_SIZES. A weight is held as
its file bytes: a uint8 tensor (..., row_bytes) whose last dimension is a whole number of blocks; its
logical shape is (..., row_bytes // bytes_per_block * elements_per_block).

Adding a type: a reference function below and its GGUF_TYPES entry, and its block struct in gguf.metal
(the kernel names, sizes and instantiations follow from the table).

gguf_dequantize(data, qtype, out_dtype=torch.float32)
    data: uint8 (..., row_bytes); qtype: a name of GGUF_QUANTS. Returns (..., K) in out_dtype
    (float32, float16 or bfloat16): each value is computed in fp32 with exactly the operations (and
    their order) of the gguf package's numpy dequantiser (`gguf.quants.dequantize`), so the float32
    result equals it bit for bit, then rounded once to out_dtype.

gguf_gemv(x, data, qtype, bias=None, out_dtype=None)
    y = x @ dequantize(data).T + bias, accumulated in fp32. x: (..., K) float32/float16/bfloat16
    (meant for <= 8 rows; more rows are processed 8 at a time), data: uint8 (N, row_bytes), bias (N,)
    or None. Returns (..., N) in out_dtype (default x.dtype).
"""
from __future__ import annotations

import dataclasses
import itertools
import math
from typing import Callable

import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from . import source
from .dtypes import MSL_TYPE
from .linear import GEMV_ARGS, VEC_BYTES, launch_gemv
from .registry import KernelSpec, register

__all__ = ["gguf_dequantize", "gguf_gemv", "GGUF_QUANTS", "gguf_logical_shape", "gguf_byte_shape"]

IQ4_VALUES = (-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113)
GROUP = 256
MAX_THREADS = 1 << 24          # dequantise grid; each thread strides beyond it
MAX_LAUNCH_VALUES = 1 << 31    # values one dequantise launch covers (its 32-bit offsets); more: more launches
GGUF_DEQUANT_PARAMS = source.Params("gguf_dequant_params", "chunks nthreads")


@dataclasses.dataclass(frozen=True)
class GGUFType:
    """reference: (n_blocks, bytes_per_block) uint8 -> (n_blocks, elements_per_block) float32, with the gguf
    package's operations in its order; f16_offsets: byte offsets of the block's fp16 scales (random test
    blocks get finite values there); chunk: the values one lane takes of a block in the kernels (emitted as
    GGUF_<NAME>_CHUNK). The MSL block struct is gguf_<name in lower case> of gguf.metal."""

    reference: Callable[[torch.Tensor], torch.Tensor]
    f16_offsets: tuple[int, ...]
    chunk: int


def _check_qtype(qtype) -> tuple[int, int]:
    """(elements per block, bytes per block) of a supported type, or a clear error."""
    if qtype not in GGUF_QUANTS:
        raise ValueError(f"GGUF quantisation {qtype!r} is not supported; supported: {', '.join(GGUF_QUANTS)} "
                         f"(and F32/F16/BF16, which load as plain tensors)")
    return GGUF_QUANTS[qtype]


def gguf_logical_shape(byte_shape, qtype) -> tuple[int, ...]:
    """(..., row_bytes) of qtype blocks -> the (..., K) shape of the values they hold."""
    bs, ts = _check_qtype(qtype)
    byte_shape = tuple(int(s) for s in byte_shape)
    if not byte_shape or byte_shape[-1] % ts:
        raise ValueError(f"{qtype}: {list(byte_shape)} bytes is not a whole number of {ts}-byte blocks per row")
    return byte_shape[:-1] + (byte_shape[-1] // ts * bs,)


def gguf_byte_shape(shape, qtype) -> tuple[int, ...]:
    """(..., K) values -> the (..., row_bytes) shape of their qtype blocks."""
    bs, ts = _check_qtype(qtype)
    shape = tuple(int(s) for s in shape)
    if not shape or shape[-1] % bs:
        raise ValueError(f"{qtype}: a row of {shape[-1] if shape else 0} values is not a whole number of "
                         f"{bs}-value blocks")
    return shape[:-1] + (shape[-1] // bs * ts,)


def _check_data(data, qtype, what="gguf data") -> tuple[int, int]:
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{what}: expected a uint8 tensor, got {type(data).__name__}")
    if data.dtype != torch.uint8:
        raise TypeError(f"{what}: dtype {data.dtype}; GGUF blocks are held as uint8 bytes")
    if data.dim() < 1:
        raise ValueError(f"{what}: needs at least one dimension (..., row_bytes)")
    bs, ts = _check_qtype(qtype)
    if data.shape[-1] % ts:
        raise ValueError(f"{what}: rows of {data.shape[-1]} bytes are not a whole number of {qtype} blocks "
                         f"({ts} bytes each)")
    return bs, ts


def _check_out_dtype(out_dtype):
    if out_dtype not in MSL_TYPE:
        raise TypeError(f"out_dtype {out_dtype} is not supported; expected float32, float16 or bfloat16")


# ------------------------------------------------------------------------------------------------
# The pure-torch reference, one function per type on (n_blocks, bytes_per_block) uint8 -> (n_blocks,
# elements_per_block) float32. Same operations in the same order as gguf/quants.py.
# ------------------------------------------------------------------------------------------------

def _f16(b: torch.Tensor, off: int) -> torch.Tensor:
    return b[:, off:off + 2].contiguous().view(torch.float16).to(torch.float32)        # (nb, 1)


def _i8(u: torch.Tensor) -> torch.Tensor:
    """uint8 bytes read as int8, as float32 (exact; on CPU much faster than an int8 -> float32 cast)."""
    return (u ^ 0x80).to(torch.float32) - 128.0


def _shifts(values, shape, device):
    return torch.tensor(values, dtype=torch.uint8, device=device).reshape(shape)


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """(nb, n) bytes -> (nb, n // group, 2, group): low nibbles of each group of bytes, then high."""
    nb = qs.shape[0]
    q = qs.reshape(nb, -1, 1, group) >> _shifts([0, 4], (1, 1, 2, 1), qs.device)
    return q & 0x0F


def _bits(qh: torch.Tensor, nbits: int, step: int, mask: int) -> torch.Tensor:
    """(nb, n) bytes -> (nb, 1, nbits // step, n): the fields at bit offsets 0, step, ... of each byte."""
    nb = qh.shape[0]
    sh = _shifts(list(range(0, 8, step))[: nbits // step], (1, 1, -1, 1), qh.device)
    return (qh.reshape(nb, 1, 1, -1) >> sh) & mask


def _q8_0(b):
    d = _f16(b, 0)
    x = _i8(b[:, 2:])
    return x * d


def _q4_0(b):
    d = _f16(b, 0)
    q = _nibbles(b[:, 2:], 16).reshape(b.shape[0], -1).to(torch.float32) - 8.0
    return d * q


def _q4_1(b):
    d, m = _f16(b, 0), _f16(b, 2)
    q = _nibbles(b[:, 4:], 16).reshape(b.shape[0], -1).to(torch.float32)
    return (d * q) + m


def _q5_low_high(qh: torch.Tensor, qs: torch.Tensor) -> torch.Tensor:
    nb = qh.shape[0]
    # bit j of the little-endian uint32 qh is the 5th bit of element j
    hi = ((qh.reshape(nb, 4, 1) >> _shifts(list(range(8)), (1, 1, 8), qh.device)) & 1).reshape(nb, 32)
    lo = _nibbles(qs, 16).reshape(nb, 32)
    return lo | (hi << 4)


def _q5_0(b):
    d = _f16(b, 0)
    q = _q5_low_high(b[:, 2:6], b[:, 6:]).to(torch.float32) - 16.0
    return d * q


def _q5_1(b):
    d, m = _f16(b, 0), _f16(b, 2)
    q = _q5_low_high(b[:, 4:8], b[:, 8:]).to(torch.float32)
    return (d * q) + m


def _q2_k(b):
    nb = b.shape[0]
    scales, qs = b[:, 0:16], b[:, 16:80]
    d, dmin = _f16(b, 80), _f16(b, 82)
    dl = (d * (scales & 0x0F).to(torch.float32)).reshape(nb, 16, 1)
    ml = (dmin * (scales >> 4).to(torch.float32)).reshape(nb, 16, 1)
    q = (qs.reshape(nb, -1, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), b.device)) & 3
    q = q.reshape(nb, 16, 16).to(torch.float32)
    return (dl * q - ml).reshape(nb, 256)


def _q3_k(b):
    nb = b.shape[0]
    hmask, qs, scales = b[:, 0:32], b[:, 32:96], b[:, 96:108]
    d = _f16(b, 108)
    lsc = (scales[:, :8].reshape(nb, 1, 8) >> _shifts([0, 4], (1, 2, 1), b.device)).reshape(nb, 16) & 0x0F
    hsc = (scales[:, 8:].reshape(nb, 1, 4) >> _shifts([0, 2, 4, 6], (1, 4, 1), b.device)).reshape(nb, 16) & 3
    sc = (lsc | (hsc << 4)).to(torch.float32) - 32.0
    dl = (d * sc).reshape(nb, 16, 1)
    ql = (qs.reshape(nb, -1, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), b.device)).reshape(nb, 16, 16) & 3
    qh = (hmask.reshape(nb, -1, 1, 32) >> _shifts(list(range(8)), (1, 1, 8, 1), b.device)).reshape(nb, 16, 16) & 1
    qh = qh ^ 1                              # the offset is 4 when the mask bit is 0
    q = ql.to(torch.float32) - (qh << 2).to(torch.float32)
    return (dl * q).reshape(nb, 256)


def _k_scale_min(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins packed in 12 bytes (Q4_K, Q5_K)."""
    nb = s.shape[0]
    s = s.reshape(nb, 3, 4)
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def _q4_k(b):
    nb = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    dd = (d * sc.to(torch.float32)).reshape(nb, -1, 1)
    dm = (dmin * mn.to(torch.float32)).reshape(nb, -1, 1)
    q = _nibbles(b[:, 16:144], 32).reshape(nb, -1, 32).to(torch.float32)
    return (dd * q - dm).reshape(nb, 256)


def _q5_k(b):
    nb = b.shape[0]
    d, dmin = _f16(b, 0), _f16(b, 2)
    sc, mn = _k_scale_min(b[:, 4:16])
    dd = (d * sc.to(torch.float32)).reshape(nb, -1, 1)
    dm = (dmin * mn.to(torch.float32)).reshape(nb, -1, 1)
    ql = _nibbles(b[:, 48:176], 32).reshape(nb, -1, 32)
    qh = _bits(b[:, 16:48], 8, 1, 1).reshape(nb, -1, 32)
    q = (ql | (qh << 4)).to(torch.float32)
    return (dd * q - dm).reshape(nb, 256)


def _q6_k(b):
    nb = b.shape[0]
    ql, qh = b[:, 0:128], b[:, 128:192]
    scales = _i8(b[:, 192:208])
    d = _f16(b, 208)
    d = (d * scales).reshape(nb, 16, 1)
    lo = _nibbles(ql, 64).reshape(nb, -1, 32)
    hi = ((qh.reshape(nb, -1, 1, 32) >> _shifts([0, 2, 4, 6], (1, 1, 4, 1), b.device)) & 3).reshape(nb, -1, 32)
    q = ((lo | (hi << 4)).to(torch.float32) - 32.0).reshape(nb, 16, -1)
    return (d * q).reshape(nb, 256)


def _iq4_lookup(idx: torch.Tensor) -> torch.Tensor:
    table = torch.tensor(IQ4_VALUES, dtype=torch.float32, device=idx.device)
    return table[idx.long()]


def _iq4_nl(b):
    d = _f16(b, 0)
    q = _iq4_lookup(_nibbles(b[:, 2:], 16).reshape(b.shape[0], -1))
    return d * q


def _iq4_xs(b):
    nb = b.shape[0]
    d = _f16(b, 0)
    sh = b[:, 2:4].contiguous().view(torch.int16).to(torch.int32) & 0xFFFF                   # (nb, 1)
    sl = (b[:, 4:8].reshape(nb, 4, 1) >> _shifts([0, 4], (1, 1, 2), b.device)).reshape(nb, 8) & 0x0F
    shifts = torch.arange(0, 16, 2, dtype=torch.int32, device=b.device).reshape(1, 8)
    shi = ((sh >> shifts) & 3).to(torch.uint8)
    sc = (sl | (shi << 4)).to(torch.float32) - 32.0
    dl = (d * sc).reshape(nb, -1, 1)
    q = _iq4_lookup(_nibbles(b[:, 8:136], 16).reshape(nb, 8, 32))
    return (dl * q).reshape(nb, 256)


# The one table of the supported types (in the order of the tables that list them: bytes a weight, roughly).
GGUF_TYPES: dict[str, GGUFType] = {
    "Q8_0": GGUFType(_q8_0, (0,), 8),
    "Q6_K": GGUFType(_q6_k, (208,), 8),
    "Q5_K": GGUFType(_q5_k, (0, 2), 32),
    "Q5_1": GGUFType(_q5_1, (0, 2), 16),
    "Q5_0": GGUFType(_q5_0, (0,), 16),
    "Q4_K": GGUFType(_q4_k, (0, 2), 32),
    "Q4_1": GGUFType(_q4_1, (0, 2), 16),
    "Q4_0": GGUFType(_q4_0, (0,), 16),
    "IQ4_XS": GGUFType(_iq4_xs, (0,), 32),
    "IQ4_NL": GGUFType(_iq4_nl, (0,), 16),
    "Q3_K": GGUFType(_q3_k, (108,), 32),
    "Q2_K": GGUFType(_q2_k, (80, 82), 32),
}
# name -> (elements per block, bytes per block), ggml's layouts; emitted as GGUF_<NAME>_BLOCK / _BYTES.
GGUF_QUANTS: dict[str, tuple[int, int]] = {q: tuple(GGML_QUANT_SIZES[GGMLQuantizationType[q]]) for q in GGUF_TYPES}
for _q, (_bs, _ts) in GGUF_QUANTS.items():
    source.define(f"GGUF_{_q}_BLOCK", _bs)
    source.define(f"GGUF_{_q}_BYTES", _ts)
    source.define(f"GGUF_{_q}_CHUNK", GGUF_TYPES[_q].chunk)


def gguf_dequantize_reference(data, qtype, out_dtype=torch.float32):
    bs, ts = _check_data(data, qtype)
    _check_out_dtype(out_dtype)
    shape = gguf_logical_shape(data.shape, qtype)
    if math.prod(shape) == 0:
        return torch.zeros(shape, dtype=out_dtype, device=data.device)
    blocks = data.contiguous().reshape(-1, ts)
    return GGUF_TYPES[qtype].reference(blocks).reshape(shape).to(out_dtype)


def _prepare_gemv(x, data, qtype, bias, out_dtype):
    if not isinstance(x, torch.Tensor) or x.dtype not in MSL_TYPE:
        raise TypeError(f"gguf_gemv: x must be a float32/float16/bfloat16 tensor, got "
                        f"{getattr(x, 'dtype', type(x).__name__)}")
    if x.dim() < 1:
        raise ValueError("gguf_gemv: x must have at least one dimension (..., K)")
    _check_data(data, qtype, "gguf_gemv: weight")
    if data.dim() != 2:
        raise ValueError(f"gguf_gemv: weight must be (N, row_bytes), got {tuple(data.shape)}")
    if data.device != x.device:
        raise ValueError(f"gguf_gemv: weight is on {data.device} but x is on {x.device}")
    N, K = gguf_logical_shape(data.shape, qtype)
    if x.shape[-1] != K:
        raise ValueError(f"gguf_gemv: x has {x.shape[-1]} features but the {qtype} weight holds rows of {K}")
    if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (N,)
                             or not bias.is_floating_point()):
        raise ValueError(f"gguf_gemv: bias must be a float tensor of shape ({N},)")
    out_dtype = x.dtype if out_dtype is None else out_dtype
    _check_out_dtype(out_dtype)
    lead = tuple(x.shape[:-1])
    return x.reshape(math.prod(lead), K), N, K, lead, out_dtype


def gguf_gemv_reference(x, data, qtype, bias=None, out_dtype=None):
    x2, N, K, lead, out_dtype = _prepare_gemv(x, data, qtype, bias, out_dtype)
    w = gguf_dequantize_reference(data, qtype, torch.float32)
    y = x2.to(torch.float32) @ w.T
    if bias is not None:
        y = y + bias.to(device=y.device, dtype=torch.float32)
    return y.to(out_dtype).reshape(lead + (N,))


# ------------------------------------------------------------------------------------------------
# Metal launch glue (gguf.metal)
# ------------------------------------------------------------------------------------------------

def _aligned(t: torch.Tensor) -> torch.Tensor:
    """`t` contiguous at a 16-byte aligned address (the kernels' widest loads): a copy only for a view that
    starts elsewhere (a file's blocks and a fresh tensor are aligned)."""
    t = t.contiguous()
    return t if t.data_ptr() % VEC_BYTES == 0 else t.clone()


def gguf_dequantize_metal(lib, data, qtype, out_dtype=torch.float32):
    bs, ts = _check_data(data, qtype)
    _check_out_dtype(out_dtype)
    shape = gguf_logical_shape(data.shape, qtype)
    out = torch.empty(shape, dtype=out_dtype, device=data.device)
    if out.numel() == 0:
        return out
    src = _aligned(data).reshape(-1)
    flat = out.reshape(-1)
    kernel = getattr(lib, f"gguf_dequant_{qtype.lower()}_{MSL_TYPE[out_dtype]}")
    lanes = bs // GGUF_TYPES[qtype].chunk
    blocks, step = src.numel() // ts, max(1, MAX_LAUNCH_VALUES // bs)
    for b0 in range(0, blocks, step):
        nb = min(step, blocks - b0)
        nthreads = min(nb * lanes, MAX_THREADS)
        kernel(src[b0 * ts:(b0 + nb) * ts], flat[b0 * bs:(b0 + nb) * bs],
               GGUF_DEQUANT_PARAMS.pack(chunks=nb * lanes, nthreads=nthreads), threads=nthreads,
               group_size=min(GROUP, nthreads))
    return out


def gguf_gemv_metal(lib, x, data, qtype, bias=None, out_dtype=None):
    x2, N, K, lead, out_dtype = _prepare_gemv(x, data, qtype, bias, out_dtype)
    M = x2.shape[0]
    device = x.device
    if M == 0 or N == 0:
        y = torch.zeros(lead + (N,), dtype=torch.float32, device=device)
        if bias is not None:
            y = y + bias.to(device=device, dtype=torch.float32)
        return y.to(out_dtype)
    x2 = _aligned(x2)                         # x is small: a copy if it starts off 16 bytes
    w = _aligned(data)
    kernel = getattr(lib, f"gguf_gemv_{qtype.lower()}_{MSL_TYPE[x2.dtype]}")
    y = launch_gemv(kernel, x2, w, 0, None, bias, out_dtype, N, w.shape[1])
    return y.reshape(lead + (N,))


# ------------------------------------------------------------------------------------------------
# Self-check inputs: random blocks with finite scales, every type (and every output dtype)
# ------------------------------------------------------------------------------------------------

def random_blocks(qtype: str, rows: int, blocks_per_row: int, gen: torch.Generator,
                  scale: float = 0.05) -> torch.Tensor:
    """uint8 (rows, blocks_per_row * bytes_per_block): random bytes, fp16 scales random but finite."""
    _, ts = _check_qtype(qtype)
    raw = torch.randint(0, 256, (rows * blocks_per_row, ts), generator=gen, dtype=torch.uint8)
    for off in GGUF_TYPES[qtype].f16_offsets:
        d = (torch.randn(rows * blocks_per_row, 1, generator=gen) * scale).to(torch.float16)
        raw[:, off:off + 2] = d.view(torch.uint8)
    return raw.reshape(rows, blocks_per_row * ts)


def _dequant_cases(device):
    gen = torch.Generator().manual_seed(18)
    out = []
    for i, (qtype, dtype) in enumerate(itertools.product(GGUF_TYPES, MSL_TYPE)):
        rows = (3, 1, 2)[i % 3]
        out.append(((random_blocks(qtype, rows, 1 + i % 2, gen).to(device), qtype), {"out_dtype": dtype}))
    return out


def _gemv_cases(device):
    """Every (type, activation dtype) entry point; M, N, the bias and the output type rotate."""
    gen = torch.Generator().manual_seed(81)
    out = []
    for i, (qtype, xdtype) in enumerate(itertools.product(GGUF_TYPES, MSL_TYPE)):
        M, N = (1, 5, 8, 3)[i % 4], (3, 7, 1, 6, 5)[i % 5]
        data = random_blocks(qtype, N, 1 + i % 2, gen, scale=0.002)
        K = gguf_logical_shape(data.shape, qtype)[1]
        x = torch.randn(M, K, generator=gen).to(xdtype)
        b = torch.randn(N, generator=gen).to((xdtype, torch.float32)[i % 2]).to(device) if i % 3 else None
        kw = {"out_dtype": (None, torch.float32)[i % 2]}
        out.append(((x.to(device), data.to(device), qtype, b), kw))
    return out


_DEQUANT = {f"gguf_dequant_{q.lower()}_{t}": f"gguf_dequant<gguf_{q.lower()}, {t}>"
            for q in GGUF_TYPES for t in MSL_TYPE.values()}
_GEMV = {f"gguf_gemv_{q.lower()}_{t}": f"gemv<gguf_format<gguf_{q.lower()}>, {t}>"
         for q in GGUF_TYPES for t in MSL_TYPE.values()}

gguf_dequantize = register(KernelSpec(
    name="gguf_dequantize",
    source="gguf.metal",
    entry_points={name: ("tensor", "tensor", "int[]") for name in _DEQUANT},
    instantiate=_DEQUANT,
    reference=gguf_dequantize_reference,
    metal=gguf_dequantize_metal,
    self_check_cases=_dequant_cases,
    atol=1e-6,
    rtol=1e-6,
))

gguf_gemv = register(KernelSpec(
    name="gguf_gemv",
    measured_by_caller=True,
    source="gguf.metal",
    entry_points={name: GEMV_ARGS for name in _GEMV},
    instantiate=_GEMV,
    reference=gguf_gemv_reference,
    metal=gguf_gemv_metal,
    self_check_cases=_gemv_cases,
    atol=2e-4,
    rtol=2e-4,
))
