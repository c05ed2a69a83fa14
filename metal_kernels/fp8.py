"""FP8 (e4m3fn, e5m2) decode and encode with a tensorwise or per-row scale.

fp8_decode(data, fmt, scale=None, out_dtype=torch.bfloat16)
    data: uint8 bytes or a native torch.float8_e4m3fn / float8_e5m2 tensor, any shape.
    fmt: "e4m3fn" | "e5m2" (may be None for native float8 data; must agree with it otherwise).
    scale: None, a tensor (or number) with one element (tensorwise), or per row: shape (rows,) or
        (rows, 1) with rows = data.shape[0].
    Returns decode(data) * scale computed in fp32 and rounded once to out_dtype (float16, bfloat16
    or float32), same shape. Exact for all 256 codes: NaN codes give NaN, e5m2's +-inf codes give
    +-inf.

fp8_encode(x, fmt, scale=None) -> uint8
    x: float32/float16/bfloat16. Computes x / scale in fp32 (correctly rounded), then rounds to the
    nearest FP8 value (ties to even) with SATURATION: anything beyond the largest finite value,
    +-inf included, becomes +-max (448 for e4m3fn, 57344 for e5m2). NaN stays NaN (byte sign|0x7F).
    Bit-identical to torch's CPU cast
        (x.float() / scale).clamp(-max, max).to(torch.float8_*).view(torch.uint8)
    What torch's own CPU cast does (torch 2.13, checked in tests/test_fp8_kernels.py):
      * e4m3fn: the plain cast already saturates (inf -> 0x7E); NaN -> 0x7F / 0xFF keeping its sign.
      * e5m2: the plain cast does NOT saturate (values >= 61440 and inf -> 0x7C inf), hence the clamp;
        NaN -> 0x7F / 0xFF keeping its sign. Negative zero and negative values that round to zero
        give 0x80 in both formats.
      * A NaN *made* by the division (0/0, inf/inf, x/NaN scale) has a platform-dependent sign on
        the CPU (x86's default NaN is negative); those are not part of the bit-identity promise
        (only "it is a NaN code"). A NaN *input* keeps its sign on every backend.

fp8_max(fmt) -> largest finite value of the format.
"""
from __future__ import annotations

import math

import torch

from . import source
from .dtypes import FORMAT_OF_DTYPE, FP8_DTYPES, MSL_TYPE
from .registry import KernelSpec, register

__all__ = ["fp8_decode", "fp8_encode", "fp8_max", "FP8_FORMATS", "FP8_MAX"]

FP8_FORMATS = ("e4m3fn", "e5m2")
FP8_MAX = {"e4m3fn": 448.0, "e5m2": 57344.0}
# (mantissa bits, exponent bias, has infinities)
_LAYOUT = {"e4m3fn": (3, 7, False), "e5m2": (2, 15, True)}

GROUP = 256
MAX_THREADS = 1 << 24          # grid size per dimension; each thread strides beyond it
MAX_ROW = 1 << 30              # elements of a row in one launch (the kernels' 32-bit offsets in a row)
CHUNK = 16                     # elements a thread converts per step (one 16-byte load of FP8 bytes)
FP8_PARAMS = source.Params("fp8_params", "rows row_len scale_mode vec")


def fp8_max(fmt: str) -> float:
    """The largest finite value of an FP8 format ("e4m3fn" 448, "e5m2" 57344)."""
    return FP8_MAX[_check_fmt(fmt)]


def _check_fmt(fmt) -> str:
    if fmt not in FP8_FORMATS:
        raise ValueError(f"FP8 format {fmt!r} is not supported; expected one of {FP8_FORMATS}")
    return fmt


def _as_bytes(data: torch.Tensor, fmt, what: str = "fp8 data") -> tuple[torch.Tensor, str]:
    """(uint8 view of the bytes, format) for uint8 or native float8 `data`."""
    if not isinstance(data, torch.Tensor):
        raise TypeError(f"{what}: expected a tensor, got {type(data).__name__}")
    if data.dtype in FORMAT_OF_DTYPE:
        native_fmt = FORMAT_OF_DTYPE[data.dtype]
        if fmt is not None and fmt != native_fmt:
            raise ValueError(f"{what}: tensor dtype {data.dtype} does not match fmt={fmt!r}")
        return data.view(torch.uint8), native_fmt
    if data.dtype != torch.uint8:
        raise TypeError(f"{what}: dtype {data.dtype} is not FP8; expected uint8 bytes (with fmt) "
                        f"or torch.float8_e4m3fn / torch.float8_e5m2")
    if fmt is None:
        raise ValueError(f"{what}: uint8 bytes need fmt='e4m3fn' or fmt='e5m2'")
    return data, _check_fmt(fmt)


def scale_mode(scale, shape: tuple, device, what: str = "scale") -> tuple[int, torch.Tensor | None]:
    """Normalise `scale` for data of `shape`: (0, None) | (1, fp32 (1,)) | (2, fp32 (rows,))."""
    if scale is None:
        return 0, None
    if not isinstance(scale, torch.Tensor):
        scale = torch.tensor(float(scale), dtype=torch.float32)
    if not scale.is_floating_point():
        raise TypeError(f"{what}: dtype {scale.dtype} is not a float type")
    if scale.numel() == 1:
        return 1, scale.detach().reshape(1).to(device=device, dtype=torch.float32)
    rows = shape[0] if len(shape) else 1
    if tuple(scale.shape) not in ((rows,), (rows, 1)):
        raise ValueError(f"{what}: shape {tuple(scale.shape)} fits neither tensorwise (one element) nor "
                         f"per-row ({rows},) or ({rows}, 1) for data of shape {tuple(shape)}")
    return 2, scale.detach().reshape(rows).to(device=device, dtype=torch.float32)


def _broadcast_scale(mode: int, s: torch.Tensor | None, ndim: int) -> torch.Tensor | None:
    if mode == 0:
        return None
    if mode == 1:
        return s.reshape(())
    return s.reshape((-1,) + (1,) * max(ndim - 1, 0))


def native_fp8_on(device: torch.device, fmt: str) -> bool:
    """Whether torch can hold and cast float8 tensors of `fmt` on `device`."""
    if FP8_DTYPES[fmt] is None:
        return False
    if device.type == "mps":
        from .probe import fp8_storage_dtype

        return fp8_storage_dtype(device, fmt) != torch.uint8
    return True


# ---------------------------------------------------------------------------------------------
# Arithmetic decode / encode in plain torch (any device; the fallback where torch has no float8
# for the device, e.g. MPS before 2.15, and an independent check of torch's own cast in tests).
# ---------------------------------------------------------------------------------------------
def decode_table(fmt: str) -> list[float]:
    """The value of each of the 256 codes, from the bit layout (math.ldexp, not torch's cast)."""
    mbits, bias, has_inf = _LAYOUT[_check_fmt(fmt)]
    ebits = 7 - mbits
    emax = (1 << ebits) - 1
    out = []
    for code in range(256):
        sign = -1.0 if code & 0x80 else 1.0
        e = (code >> mbits) & emax
        m = code & ((1 << mbits) - 1)
        if has_inf and e == emax:
            v = math.inf if m == 0 else math.nan
        elif not has_inf and e == emax and m == (1 << mbits) - 1:
            v = math.nan
        elif e == 0:
            v = math.ldexp(m, 1 - bias - mbits)
        else:
            v = math.ldexp((1 << mbits) + m, e - bias - mbits)
        out.append(sign * v)
    return out


_TABLES: dict[tuple, torch.Tensor] = {}


def decode_arith(raw: torch.Tensor, fmt: str) -> torch.Tensor:
    """uint8 codes -> float32 through the 256-entry table (any device)."""
    key = (fmt, str(raw.device))
    table = _TABLES.get(key)
    if table is None:
        table = _TABLES[key] = torch.tensor(decode_table(fmt), dtype=torch.float32).to(raw.device)
    return table[raw.to(torch.int32)]


def encode_arith(v: torch.Tensor, fmt: str) -> torch.Tensor:
    """float32 -> saturating RNE FP8 codes (uint8) by integer bit manipulation (any device).
    The same algorithm as fp8_encode_bits in common.metal."""
    mbits, bias, _ = _LAYOUT[_check_fmt(fmt)]
    maxbits = int(torch.tensor(FP8_MAX[fmt], dtype=torch.float32).view(torch.int32))
    maxcode = 0x7E if fmt == "e4m3fn" else 0x7B
    u = v.to(torch.float32).contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    sign = (u >> 24) & 0x80
    a = u & 0x7FFFFFFF
    drop = 23 - mbits
    normal = ((a + ((1 << (drop - 1)) - 1) + ((a >> drop) & 1)) >> drop) - ((127 - bias) << mbits)
    e = (a >> 23) - 127
    mant = (a & 0x7FFFFF) | torch.where((a >> 23) != 0, 0x800000, 0)
    shift = (23 + (1 - bias - mbits) - e).clamp(1, 26)
    q = mant >> shift
    rem = mant & ((1 << shift) - 1)
    half = 1 << (shift - 1)
    sub = q + ((rem > half) | ((rem == half) & ((q & 1) == 1))).to(torch.int64)
    sub = torch.where(shift >= 26, 0, sub)
    code = torch.where(a >= ((128 - bias) << 23), normal, sub)
    code = torch.where(a >= maxbits, maxcode, code)
    code = torch.where(a > 0x7F800000, 0x7F, code)
    return (sign | code).to(torch.uint8)


# ---------------------------------------------------------------------------------------------
# References (the public signatures)
# ---------------------------------------------------------------------------------------------
def _check_out_dtype(out_dtype) -> None:
    if out_dtype not in MSL_TYPE:
        raise TypeError(f"fp8_decode: out_dtype {out_dtype} is not supported; expected float32, float16 or bfloat16")


def fp8_decode_reference(data: torch.Tensor, fmt: str | None = None, scale=None,
                         out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    raw, fmt = _as_bytes(data, fmt, "fp8_decode: data")
    _check_out_dtype(out_dtype)
    mode, s = scale_mode(scale, tuple(raw.shape), raw.device, "fp8_decode: scale")
    if native_fp8_on(raw.device, fmt):
        native = raw.view(FP8_DTYPES[fmt])
        if mode == 0:
            return native.to(out_dtype)          # exact: every FP8 value fits fp16/bf16/fp32
        values = native.to(torch.float32)
    else:
        values = decode_arith(raw, fmt)
        if mode == 0:
            return values.to(out_dtype)
    return (values * _broadcast_scale(mode, s, raw.dim())).to(out_dtype)


def _check_encode_input(x) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"fp8_encode: expected a tensor, got {type(x).__name__}")
    if x.dtype not in MSL_TYPE:
        raise TypeError(f"fp8_encode: input dtype {x.dtype} is not supported; expected float32, float16 or bfloat16")


def fp8_encode_reference(x: torch.Tensor, fmt: str, scale=None) -> torch.Tensor:
    _check_encode_input(x)
    _check_fmt(fmt)
    mode, s = scale_mode(scale, tuple(x.shape), x.device, "fp8_encode: scale")
    v = x.to(torch.float32)
    if mode:
        v = v / _broadcast_scale(mode, s, x.dim())
    if native_fp8_on(v.device, fmt):
        mx = FP8_MAX[fmt]
        return v.clamp(-mx, mx).to(FP8_DTYPES[fmt]).view(torch.uint8)
    return encode_arith(v, fmt)


# ---------------------------------------------------------------------------------------------
# Metal launchers
# ---------------------------------------------------------------------------------------------
_ONES: dict[str, torch.Tensor] = {}


def ones1(device) -> torch.Tensor:
    """A cached fp32 [1.0] on `device`, bound where a kernel's optional buffer is unused (saves a fill
    launch per call on MPS). Kernels only read it."""
    key = str(device)
    t = _ONES.get(key)
    if t is None:
        t = _ONES[key] = torch.ones(1, dtype=torch.float32, device=device)
    return t


def _launch(kernel, src: torch.Tensor, out: torch.Tensor, mode: int, s) -> None:
    """The launches of a decode/encode kernel over contiguous `src` into `out` (same shape); the scale is
    per row of dim 0 (mode 2), else the data are one row. Rows are cut into pieces of at most MAX_ROW
    elements (a piece of a scaled row takes that row's scale as a tensorwise one)."""
    n = src.numel()
    if n == 0:
        return
    rows = (src.shape[0] if src.dim() else 1) if mode == 2 else 1
    row_len = n // rows
    src, out = src.reshape(rows, row_len), out.view(rows, row_len)
    scale = s.contiguous() if mode else ones1(src.device)
    if row_len <= MAX_ROW:
        pieces = [(src, out, mode, scale, rows, row_len)]
    else:                                   # MAX_ROW is a multiple of 16: every piece stays 16-byte aligned
        pieces = [(src[r, i:i + MAX_ROW], out[r, i:i + MAX_ROW], min(mode, 1), scale[r:r + 1] if mode else scale,
                   1, min(MAX_ROW, row_len - i)) for r in range(rows) for i in range(0, row_len, MAX_ROW)]
    for a, b, m, sc, nr, nl in pieces:
        vec = (nl % CHUNK == 0 or nr == 1) and a.data_ptr() % 16 == 0 and b.data_ptr() % 16 == 0
        tx, ty = min(-(-nl // CHUNK), MAX_THREADS), min(nr, MAX_THREADS)
        gx = min(tx, GROUP)
        gy = min(ty, max(1, GROUP // gx))
        params = FP8_PARAMS.pack(rows=nr, row_len=nl, scale_mode=m, vec=int(vec))
        kernel(a, b, sc, params, threads=(tx, ty), group_size=(gx, gy))


def fp8_decode_metal(lib, data: torch.Tensor, fmt: str | None = None, scale=None,
                     out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    raw, fmt = _as_bytes(data, fmt, "fp8_decode: data")
    _check_out_dtype(out_dtype)
    mode, s = scale_mode(scale, tuple(raw.shape), raw.device, "fp8_decode: scale")
    raw = raw.contiguous()
    out = torch.empty(raw.shape, dtype=out_dtype, device=raw.device)
    _launch(getattr(lib, f"fp8_decode_{fmt}_{MSL_TYPE[out_dtype]}"), raw, out, mode, s)
    return out


def fp8_encode_metal(lib, x: torch.Tensor, fmt: str, scale=None) -> torch.Tensor:
    _check_encode_input(x)
    _check_fmt(fmt)
    mode, s = scale_mode(scale, tuple(x.shape), x.device, "fp8_encode: scale")
    x = x.contiguous()
    out = torch.empty(x.shape, dtype=torch.uint8, device=x.device)
    _launch(getattr(lib, f"fp8_encode_{MSL_TYPE[x.dtype]}_{fmt}"), x, out, mode, s)
    return out


# ---------------------------------------------------------------------------------------------
# Self-check cases and registration
# ---------------------------------------------------------------------------------------------
def _decode_cases(device):
    gen = torch.Generator().manual_seed(1)
    codes = torch.arange(256, dtype=torch.uint8)
    out = []
    for fmt in FP8_FORMATS:
        # every code, odd length (255 + tail), no scale, float32 out
        out.append(((codes[:255].to(device), fmt), {"out_dtype": torch.float32}))
        # (7, 37) tensorwise scale, bf16 out
        raw = torch.randint(0, 256, (7, 37), generator=gen, dtype=torch.uint8)
        out.append(((raw.to(device), fmt), {"scale": torch.tensor([0.37]).to(device), "out_dtype": torch.bfloat16}))
        # (5, 3, 3) per-row scale, fp16 out (values kept in fp16 range)
        raw = torch.randint(0, 256, (5, 3, 3), generator=gen, dtype=torch.uint8)
        sc = torch.rand(5, 1, generator=gen) * 1e-3 + 1e-4
        out.append(((raw.to(device), fmt), {"scale": sc.to(device), "out_dtype": torch.float16}))
    return out


def _encode_cases(device):
    gen = torch.Generator().manual_seed(2)
    out = []
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 448.0, 464.0, 500.0,
                            -57344.0, 61440.0, 1e-9, -1e-9, 0.0029296875, 2 ** -10, 2 ** -17])
    for fmt in FP8_FORMATS:
        x = torch.cat([special, torch.randn(38, generator=gen) * 50])
        out.append(((x.to(device), fmt), {}))
        x = (torch.randn(6, 11, generator=gen) * 3).to(torch.float16)
        out.append(((x.to(device), fmt), {"scale": torch.tensor(0.013).to(device)}))
        x = (torch.randn(3, 9, generator=gen) * 100).to(torch.bfloat16)
        out.append(((x.to(device), fmt), {"scale": (torch.rand(3, generator=gen) + 0.1).to(device)}))
    return out


def _exact(got, want):
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"got {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}"
    bad = got.cpu() != want.cpu()
    return None if not bad.any() else f"{int(bad.sum())} of {bad.numel()} bytes differ"


def _decode_compare(got, want):
    """Exact, except that a GPU that flushes subnormal results to zero may return 0 where the reference
    is a subnormal of the output type (|value| < its smallest normal): tiny scaled values only, and
    refusing the kernel for them would cost every FP8 load its fast path."""
    if got.dtype != want.dtype or got.shape != want.shape:
        return f"got {got.dtype} {tuple(got.shape)}, expected {want.dtype} {tuple(want.shape)}"
    g, w = got.cpu().float(), want.cpu().float()
    if not torch.equal(torch.isnan(g), torch.isnan(w)):
        return "NaN in different places"
    flushed = (g == 0) & (w.abs() < torch.finfo(want.dtype).tiny)
    bad = ~(torch.isnan(w) | (g == w) | flushed)
    return None if not bad.any() else f"{int(bad.sum())} of {bad.numel()} values differ (decode must be exact)"


_ARGS = ("tensor", "tensor", "tensor", "int[]")
_DECODE = {f"fp8_decode_{f}_{t}": f"fp8_decode<fp8_{f}, {t}>" for f in FP8_FORMATS for t in MSL_TYPE.values()}
_ENCODE = {f"fp8_encode_{t}_{f}": f"fp8_encode<{t}, fp8_{f}>" for f in FP8_FORMATS for t in MSL_TYPE.values()}

fp8_decode = register(KernelSpec(
    name="fp8_decode",
    source="fp8.metal",
    entry_points={name: _ARGS for name in _DECODE},
    instantiate=_DECODE,
    reference=fp8_decode_reference,
    metal=fp8_decode_metal,
    self_check_cases=_decode_cases,
    atol=0.0,
    rtol=0.0,
    compare=_decode_compare,
))

fp8_encode = register(KernelSpec(
    name="fp8_encode",
    source="fp8.metal",
    entry_points={name: _ARGS for name in _ENCODE},
    instantiate=_ENCODE,
    reference=fp8_encode_reference,
    metal=fp8_encode_metal,
    self_check_cases=_encode_cases,
    atol=0.0,
    rtol=0.0,
    compare=_exact,
))
