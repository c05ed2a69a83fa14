"""Mixture-of-experts kernels and the sync-free MoE experts forward built on them.

Kernels (moe.metal, each with a pure-torch reference of the same signature):
  moe_route(logits, top_k, norm=True) -> (weights fp32 [T, K], experts int64 [T, K])
      softmax over the experts + top-k, descending; `norm` renormalises the K weights
      (Qwen3 norm_topk_prob; identical to GPT-OSS's softmax over the top-k logits).
  moe_experts_gemm(x, row_expert, weight, scale=None, bias=None, x_div=1, fmt=None) -> fp32 [P, N]
      out[p] = scale[e] * weight[e] @ x[p // x_div] + bias[e] with e = row_expert[p]; weight is a
      [E, N, K] bank in fp32/fp16/bf16 or FP8 (uint8 bytes or float8 dtype, `fmt` e4m3fn/e5m2).
      At decode time it runs all top-k experts of a token in one dispatch, each pair a GEMV through the
      dense GEMV's skeleton (include/gemv.h).
  moe_grouped_gemm(xs, offsets, weight, scale=None, bias=None, fmt=None) -> fp32 [P, N]
      prefill: rows sorted by expert (offsets = cumulative rows per expert) through a grouped GEMM of
      simdgroup_matrix tiles (32 rows of one expert x 128 columns, weights decoded while staging, in bf16 or
      fp16 where that is exact; each threadgroup finds its tile from the offsets on the device). Used for FP8 banks on MPS, and for
      plain banks where torch._grouped_mm is unavailable.

Orchestration (pure torch, no host syncs: no .item(), nonzero, bincount or host loop over experts):
  moe_group(experts, num_experts) -> (order, sorted_experts, offsets)
  moe_grouped_linear(xs, sorted_experts, offsets, weight, ...) -> [P, N]  (picks _grouped_mm / kernels)
  moe_experts_forward(x, experts, weights, gate_up, down, activation=...) -> [T, H]
"""
from __future__ import annotations

import functools
import itertools

import torch

from . import dispatch, source
from .dtypes import DTYPE_OF_MSL, MSL_KIND, MSL_TYPE
from .fp8 import ones1
from .linear import GEMV_GROUP, GEMV_PARAMS, GEMV_ROWS, VEC_BYTES
from .registry import KernelSpec, register

__all__ = ["moe_route", "moe_experts_gemm", "moe_grouped_gemm", "moe_group", "moe_grouped_linear",
           "moe_experts_forward"]

FP8_FORMATS = {"e4m3fn": "e4m3", "e5m2": "e5m2"}
# weight kind of an entry-point name -> its element type in include/gemv_formats.h / fp8.h
WEIGHT_ELEMENTS = {"float": "gemv_float", "half": "gemv_half", "bfloat": "gemv_bfloat", "e4m3": "fp8_e4m3fn",
                   "e5m2": "fp8_e5m2"}
ROUTE_LANE_SLOTS = (1, 2, 4, 8, 16, 32)   # experts a lane of moe_route holds: instantiated for E <= 32 x these
MAX_EXPERTS = 32 * ROUTE_LANE_SLOTS[-1]   # moe_route's limit (more: the reference); its picks are lanes: K <= 32
MAX_ROUTE_TOP_K = 32
DECODE_MAX_PAIRS = 64       # token-expert pairs up to which the unsorted per-pair kernel is used
# The grouped GEMM's tile: rows of one expert x output columns, K step, threads (4 simdgroups)
GEMM_BM = source.define("MOE_GEMM_BM", 32)
GEMM_BN = source.define("MOE_GEMM_BN", 128)
GEMM_BK = source.define("MOE_GEMM_BK", 32)
GEMM_THREADS = source.define("MOE_GEMM_THREADS", 128)
ROUTE_PARAMS = source.Params("moe_route_params", "rows experts top_k norm")
PAIR_PARAMS = source.Params("moe_gemv_params", "expert_bytes scale_stride bias_stride y_stride")
GROUPED_PARAMS = source.Params("moe_gemm_params", "rows N K row_bytes experts scale_stride_e scale_stride_n has_bias")


# ----------------------------------------------------------------------------------------- helpers

def _fp8_format(weight: torch.Tensor, fmt: str | None) -> str | None:
    """The FP8 format of a weight bank, None if it is a plain float bank."""
    if weight.dtype == getattr(torch, "float8_e4m3fn", None):
        return "e4m3fn"
    if weight.dtype == getattr(torch, "float8_e5m2", None):
        return "e5m2"
    if weight.dtype == torch.uint8:
        if fmt not in FP8_FORMATS:
            raise ValueError(f"moe: a uint8 expert weight bank needs fmt='e4m3fn' or 'e5m2', got {fmt!r}")
        return fmt
    if weight.dtype not in MSL_TYPE:
        raise TypeError(f"moe: expert weight dtype {weight.dtype} is not supported "
                        "(float32, float16, bfloat16, float8_e4m3fn, float8_e5m2 or uint8 FP8 bytes)")
    return None


def decode_weight(weight: torch.Tensor, fmt: str | None = None, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Expert weights (any supported storage) as `dtype` values, without scale."""
    f8 = _fp8_format(weight, fmt)
    if f8 is None:
        return weight.to(dtype)
    fp8_dtype = torch.float8_e4m3fn if f8 == "e4m3fn" else torch.float8_e5m2
    raw = weight.view(torch.uint8) if weight.dtype != torch.uint8 else weight
    if raw.device.type == "mps":  # no float8 on MPS before torch 2.15: decode on the CPU view-free path
        return raw.cpu().view(fp8_dtype).to(dtype).to(raw.device)
    return raw.view(fp8_dtype).to(dtype)


def _scale_table(scale, num_experts: int, ncols: int, device):
    """(fp32 scale tensor, stride per expert, stride per output row) from None, a number, a scalar,
    an [E] / [E, 1] tensor (per expert) or an [E, N] tensor (per expert output row)."""
    if scale is None:
        return ones1(device), 0, 0
    if not isinstance(scale, torch.Tensor):
        return torch.full((1,), float(scale), dtype=torch.float32, device=device), 0, 0
    s = scale.to(device=device, dtype=torch.float32)
    if s.numel() == 1:
        return s.reshape(1).contiguous(), 0, 0
    if s.numel() == num_experts and (s.dim() == 1 or (s.dim() == 2 and s.shape[1] == 1)):
        return s.reshape(-1).contiguous(), 1, 0
    if s.dim() == 2 and tuple(s.shape) == (num_experts, ncols):
        return s.contiguous(), ncols, 1
    raise ValueError(f"moe: weight scale must be a scalar, one value per expert ({num_experts}) or "
                     f"[experts, out] = [{num_experts}, {ncols}]; got shape {tuple(scale.shape)}")


def _apply_scale(y: torch.Tensor, scale, row_expert: torch.Tensor) -> torch.Tensor:
    """y [P, N] times the scale of each row's expert (global, per expert or per expert row)."""
    if scale is None:
        return y
    if not isinstance(scale, torch.Tensor) or scale.numel() == 1:
        return y * (scale.reshape(()).to(y.dtype) if isinstance(scale, torch.Tensor) else float(scale))
    s = scale.to(device=y.device, dtype=y.dtype)
    if s.dim() == 2 and s.shape[1] == y.shape[1] and s.shape[1] != 1:
        return y * s[row_expert]
    return y * s.reshape(-1)[row_expert].unsqueeze(-1)


# ------------------------------------------------------------------------------------------ router

def _check_route(logits: torch.Tensor, top_k: int) -> None:
    if logits.dtype not in MSL_TYPE:
        raise TypeError(f"moe_route: logits dtype {logits.dtype} is not supported")
    if not 1 <= top_k <= logits.shape[-1]:
        raise ValueError(f"moe_route: top_k={top_k} must be in 1..{logits.shape[-1]} (the number of experts)")


def moe_route_reference(logits: torch.Tensor, top_k: int, norm: bool = True):
    """Softmax over experts (fp32) then top-k (descending); `norm` renormalises the K weights."""
    _check_route(logits, top_k)
    probs = torch.softmax(logits.float(), dim=-1)
    weights, experts = torch.topk(probs, top_k, dim=-1)
    if norm:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, experts


ROUTE_GROUP = 128           # threads of a moe_route threadgroup: 4 rows


def moe_route_metal(lib, logits: torch.Tensor, top_k: int, norm: bool = True):
    _check_route(logits, top_k)
    E = logits.shape[-1]
    if E > MAX_EXPERTS or top_k > MAX_ROUTE_TOP_K:
        return moe_route_reference(logits, top_k, norm)
    x = logits.contiguous().view(-1, E)
    rows = x.shape[0]
    if rows * E >= 1 << 32:
        raise ValueError(f"moe_route: {rows} rows of {E} logits exceed the kernel's 32-bit offsets")
    weights = torch.empty((rows, top_k), dtype=torch.float32, device=x.device)
    experts = torch.empty((rows, top_k), dtype=torch.int64, device=x.device)
    if rows:
        slots = next(n for n in ROUTE_LANE_SLOTS if 32 * n >= E)
        params = ROUTE_PARAMS.pack(rows=rows, experts=E, top_k=top_k, norm=int(bool(norm)))
        getattr(lib, f"moe_route_{MSL_TYPE[x.dtype]}_{slots}")(x, weights, experts, params, threads=rows * 32,
                                                               group_size=min(ROUTE_GROUP, rows * 32))
    shape = tuple(logits.shape[:-1]) + (top_k,)
    return weights.view(shape), experts.view(shape)


def _route_cases(device):
    """One case per entry point (logits type x experts a lane holds): E at both ends of each lane-slot count
    (1, 32, 33, ... 1000), K from 1 to the 32 lanes, with and without renormalising."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for i, (dtype, slots) in enumerate(itertools.product(MSL_TYPE, ROUTE_LANE_SLOTS)):
        low = 1 if slots == 1 else 16 * slots + 1
        E = (low, 32 * slots - 24 if slots > 1 else 5, min(1000, 32 * slots))[i % 3]
        k = min(E, (1, 8, 32, 3)[i % 4])
        rows = (1, 7, 3, 5)[i % 4]
        # distinct values, exact in every dtype (7 mantissa bits): the top-k order is unambiguous
        p = torch.stack([torch.randperm(E, generator=gen) for _ in range(rows)])
        x = torch.ldexp(1 + (p % 128).float() / 128, p // 128 - 4)
        out.append(((x.to(dtype).to(device), k), {"norm": i % 2 == 0}))
    return out


def _route_compare(got, want):
    gw, ge = got
    ww, we = want
    if ge.shape != we.shape or not torch.equal(ge.cpu(), we.cpu()):
        return "expert ids differ"
    if not torch.allclose(gw.cpu().float(), ww.cpu().float(), atol=1e-5, rtol=1e-5):
        return f"weights differ by {(gw.cpu() - ww.cpu()).abs().max().item():.3g}"
    return None


moe_route = register(KernelSpec(
    name="moe_route",
    source="moe.metal",
    entry_points={f"moe_route_{t}_{n}": ("tensor", "tensor", "tensor", "int[]")
                  for t in MSL_TYPE.values() for n in ROUTE_LANE_SLOTS},
    instantiate={f"moe_route_{t}_{n}": f"moe_route<{t}, {n}>" for t in MSL_TYPE.values() for n in ROUTE_LANE_SLOTS},
    reference=moe_route_reference,
    metal=moe_route_metal,
    self_check_cases=_route_cases,
    compare=_route_compare,
))


# ------------------------------------------------------------------------- per-pair expert GEMV/GEMM

def _check_gemm(x, row_expert, weight, x_div):
    if weight.dim() != 3:
        raise ValueError(f"moe_experts_gemm: weight must be an [experts, out, in] bank, got shape {tuple(weight.shape)}")
    if x.dim() != 2 or x.shape[1] != weight.shape[2]:
        raise ValueError(f"moe_experts_gemm: x must be [rows, {weight.shape[2]}], got {tuple(x.shape)}")
    if x.dtype not in MSL_TYPE:
        raise TypeError(f"moe_experts_gemm: x dtype {x.dtype} is not supported")
    if row_expert.dim() != 1 or row_expert.shape[0] != x.shape[0] * x_div:
        raise ValueError(f"moe_experts_gemm: row_expert must have x.shape[0] * x_div = {x.shape[0] * x_div} "
                         f"entries, got shape {tuple(row_expert.shape)}")


def moe_experts_gemm_reference(x, row_expert, weight, scale=None, bias=None, x_div: int = 1, fmt=None):
    """out[p] = scale[e] * weight[e] @ x[p // x_div] + bias[e], e = row_expert[p]; fp32 [P, N].
    Gathers (then decodes) only the weight rows the pairs use, in chunks of bounded memory."""
    _check_gemm(x, row_expert, weight, x_div)
    E, N, K = weight.shape
    P = row_expert.shape[0]
    _scale_table(scale, E, N, x.device)  # validates the shape
    xf = x.float()
    if x_div != 1:
        xf = xf.repeat_interleave(x_div, dim=0, output_size=P)
    out = torch.empty((P, N), dtype=torch.float32, device=x.device)
    chunk = max(1, (64 << 20) // max(1, N * K * 4))
    for start in range(0, P, chunk):
        e = row_expert[start:start + chunk]
        w = decode_weight(weight[e], fmt)                       # [c, N, K] fp32
        out[start:start + chunk] = torch.bmm(w, xf[start:start + chunk].unsqueeze(-1)).squeeze(-1)
    out = _apply_scale(out, scale, row_expert)
    if bias is not None:
        out = out + bias.float()[row_expert]
    return out


def _kernel_weight(weight: torch.Tensor, fmt):
    """(weight kind of the entry-point name, the bank as a contiguous tensor (FP8 as uint8 bytes), bytes a value)."""
    f8 = _fp8_format(weight, fmt)
    w = weight.contiguous()
    if f8:
        return FP8_FORMATS[f8], (w if w.dtype == torch.uint8 else w.view(torch.uint8)), 1
    return MSL_TYPE[w.dtype], w, w.element_size()


def _kernel_bias(bias, device) -> torch.Tensor:
    """The [E, N] bias in a type the kernels read (fp32, fp16 or bf16), or ones1 (unread) without one."""
    if bias is None:
        return ones1(device)
    b = bias.to(device=device)
    return (b if b.dtype in MSL_KIND else b.float()).contiguous()


def _aligned(*tensors) -> bool:
    return all(t.data_ptr() % VEC_BYTES == 0 for t in tensors)


def _lane_use(chunks: int) -> float:
    """The share of lane steps doing work when 32 lanes take `chunks` chunks of a row."""
    return chunks / (32 * -(-chunks // 32))


# the expert GEMV's weight loads: entry-point suffix -> gemv_formats.h format of element type {e}
PAIR_LAYOUTS = {"": "gemv_vec<{e}>", "_vec8": "gemv_vec<{e}, 8>", "_scalar": "gemv_elem<{e}>"}


def pair_layout(K: int, size: int, x_size: int, aligned: bool) -> str:
    """The expert GEMV's entry-point suffix for rows of K values of `size` bytes: 16-byte loads where the rows
    are whole 16-byte chunks and the buffers aligned; for FP8 rows 8-byte loads where they keep more lanes busy
    (768 bytes: 48 chunks of 16 fill 1.5 lane steps, 96 of 8 fill 3); else element by element."""
    row = K * size
    if not aligned or (K * x_size) % VEC_BYTES:
        return "_scalar"
    if size == 1 and row % 8 == 0 and (row % VEC_BYTES or _lane_use(row // 8) > _lane_use(row // VEC_BYTES)):
        return "_vec8"
    return "" if row % VEC_BYTES == 0 else "_scalar"


def moe_experts_gemm_metal(lib, x, row_expert, weight, scale=None, bias=None, x_div: int = 1, fmt=None):
    _check_gemm(x, row_expert, weight, x_div)
    E, N, K = weight.shape
    P = row_expert.shape[0]
    if not (P and N and K):                 # nothing to launch (and no 0-byte buffers to bind)
        return moe_experts_gemm_reference(x, row_expert, weight, scale, bias, x_div, fmt)
    wname, w, size = _kernel_weight(weight, fmt)
    s, se, sn = _scale_table(scale, E, N, x.device)
    b = _kernel_bias(bias, x.device)
    xc = x.contiguous()
    # vector loads of weight rows and x rows (a bank memory-mapped at an odd offset takes the element-wise
    # kernel; x is small: an aligned copy)
    layout = pair_layout(K, size, xc.element_size(), _aligned(w))
    if layout != "_scalar" and not _aligned(xc):
        xc = xc.clone()
    out = torch.empty((P, N), dtype=torch.float32, device=x.device)
    params = GEMV_PARAMS.pack(M=1, N=N, K=K, row_bytes=K * size, scale_mode=0 if scale is None else 2 if sn else 1,
                              has_bias=int(bias is not None), bias_kind=MSL_KIND[b.dtype],
                              out_kind=MSL_KIND[torch.float32])
    pair = PAIR_PARAMS.pack(expert_bytes=N * K * size, scale_stride=se, bias_stride=N * b.element_size(),
                            y_stride=N * out.element_size())
    threads = -(-N // GEMV_ROWS[1]) * 32
    kernel = getattr(lib, f"moe_experts_gemm_{wname}_{MSL_TYPE[x.dtype]}{layout}")
    kernel(xc, row_expert.to(torch.int64).contiguous(), w, s, b, out, params, pair,
           threads=(threads, x_div, P // x_div), group_size=(min(GEMV_GROUP, threads), 1, 1))
    return out


def _case_bank(E, N, K, wkind, gen):
    """An [E, N, K] expert bank of the given kind: float/half/bfloat values, or e4m3fn/e5m2 FP8 bytes
    (uint8) with the fmt to pass."""
    src = torch.randn(E, N, K, generator=gen)
    if wkind in FP8_FORMATS:
        f8 = torch.float8_e4m3fn if wkind == "e4m3fn" else torch.float8_e5m2
        return src.to(f8).view(torch.uint8), wkind
    return (src * 0.2).to(DTYPE_OF_MSL[wkind]), None


def _case_scale(kind, E, N, gen):
    return {None: None, "scalar": torch.tensor(0.75), "expert": torch.rand(E, generator=gen) + 0.5,
            "row": torch.rand(E, N, generator=gen) + 0.5}[kind]


CASE_WEIGHTS = ("float", "half", "bfloat", "e4m3fn", "e5m2")
CASE_SCALES = (None, "scalar", "expert", "row")


def _entry_point_cases(fp8_layouts=("vec", "elem")):
    """(i, weight kind, activation dtype, load layout) for every entry point of a GEMM kernel: layouts vec
    (16-byte loads) and elem (element-wise), FP8 banks also those of fp8_layouts."""
    return enumerate((w, x, layout) for w in CASE_WEIGHTS for x in MSL_TYPE
                     for layout in (fp8_layouts if w in FP8_FORMATS else ("vec", "elem")))


def _gemm_cases(device):
    """One case per entry point (weight kind x activation type x 16-byte / 8-byte / element-wise loads). The
    shapes rotate through the tail paths: N not a multiple of the 4 rows a simdgroup covers (5, 7, 9, 13) and a
    single row; 16-byte K of 16, 48 and 144 (float: 36 chunks, a second lane step), FP8 512 (whole lane steps:
    16-byte loads); FP8 8-byte K of 24 (three chunks), 48 and 776 (97 chunks: a 1-lane fourth step);
    element-wise K of 7, 13 and 33; a token's row shared by its x_div pairs (1, 2 or 8); every scale kind,
    with and without bias."""
    gen = torch.Generator().manual_seed(2)
    out = []
    for i, (wkind, xdtype, layout) in _entry_point_cases(("vec", "vec8", "elem")):
        E, N = (3, 5, 2, 4)[i % 4], (5, 7, 9, 1, 13)[i % 5]
        K = {"vec": (512,) * 3 if wkind in FP8_FORMATS else (16, 48, 144), "vec8": (24, 48, 776),
             "elem": (7, 13, 33)}[layout][i % 3]
        rows, x_div = (2, 3, 1)[i % 3], (1, 2, 8)[i % 3]
        w, fmt = _case_bank(E, N, K, wkind, gen)
        x = torch.randn(rows, K, generator=gen).to(xdtype)
        row_e = torch.randint(0, E, (rows * x_div,), generator=gen)
        scale = _case_scale(CASE_SCALES[i % 4], E, N, gen)
        bias = torch.randn(E, N, generator=gen) if i % 3 else None
        args = [t.to(device) if isinstance(t, torch.Tensor) else t for t in (x, row_e, w, scale, bias)]
        out.append((tuple(args), {"x_div": x_div, "fmt": fmt}))
    return out


# entry point -> template: every weight kind x activation type x load layout (8-byte loads: FP8 only)
_PAIR_GEMV = {f"moe_experts_gemm_{w}_{x}{suffix}": f"moe_gemv<{layout.format(e=e)}, {x}>"
              for w, e in WEIGHT_ELEMENTS.items() for x in MSL_TYPE.values()
              for suffix, layout in PAIR_LAYOUTS.items() if suffix != "_vec8" or w in FP8_FORMATS.values()}

moe_experts_gemm = register(KernelSpec(
    name="moe_experts_gemm",
    source="moe.metal",
    entry_points={name: ("tensor",) * 6 + ("int[]",) * 2 for name in _PAIR_GEMV},
    instantiate=_PAIR_GEMV,
    reference=moe_experts_gemm_reference,
    metal=moe_experts_gemm_metal,
    self_check_cases=_gemm_cases,
    atol=1e-4,
    rtol=1e-4,
))


# ---------------------------------------------------------------------- tiled grouped GEMM (prefill)

def _check_grouped(xs, offsets, weight):
    if weight.dim() != 3:
        raise ValueError(f"moe_grouped_gemm: weight must be an [experts, out, in] bank, got shape {tuple(weight.shape)}")
    if xs.dim() != 2 or xs.shape[1] != weight.shape[2]:
        raise ValueError(f"moe_grouped_gemm: xs must be [rows, {weight.shape[2]}], got {tuple(xs.shape)}")
    if xs.dtype not in MSL_TYPE:
        raise TypeError(f"moe_grouped_gemm: xs dtype {xs.dtype} is not supported")
    if offsets.dim() != 1 or offsets.shape[0] != weight.shape[0]:
        raise ValueError(f"moe_grouped_gemm: offsets must have one entry per expert ({weight.shape[0]}), "
                         f"got shape {tuple(offsets.shape)}")


def row_experts_from_offsets(offsets: torch.Tensor, rows: int) -> torch.Tensor:
    """Expert of each sorted row from cumulative counts (sync-free)."""
    return torch.searchsorted(offsets.to(torch.int64), torch.arange(rows, device=offsets.device), right=True)


def moe_grouped_gemm_reference(xs, offsets, weight, scale=None, bias=None, fmt=None):
    """Rows xs [P, K] sorted by expert (offsets = cumulative rows per expert) times their expert's
    weight: fp32 [P, N] = scale[e] * weight[e] @ xs[p] + bias[e]."""
    _check_grouped(xs, offsets, weight)
    return moe_experts_gemm_reference(xs, row_experts_from_offsets(offsets, xs.shape[0]), weight, scale, bias, fmt=fmt)


def moe_grouped_gemm_metal(lib, xs, offsets, weight, scale=None, bias=None, fmt=None):
    _check_grouped(xs, offsets, weight)
    E, N, K = weight.shape
    P = xs.shape[0]
    if not (P and N and K):
        return moe_grouped_gemm_reference(xs, offsets, weight, scale, bias, fmt)
    wname, w, size = _kernel_weight(weight, fmt)
    s, se, sn = _scale_table(scale, E, N, xs.device)
    b = _kernel_bias(bias, xs.device).float()
    x = xs.contiguous()
    vec = (K * size) % VEC_BYTES == 0 and (K * x.element_size()) % VEC_BYTES == 0 and _aligned(w, x)
    out = torch.empty((P, N), dtype=torch.float32, device=xs.device)
    tiles = min(P, -(-P // GEMM_BM) + E)      # row tiles at most: each expert's rows in tiles of GEMM_BM
    params = GROUPED_PARAMS.pack(rows=P, N=N, K=K, row_bytes=K * size, experts=E, scale_stride_e=se,
                                 scale_stride_n=sn, has_bias=int(bias is not None))
    kernel = getattr(lib, f"moe_grouped_gemm_{wname}_{MSL_TYPE[x.dtype]}{'' if vec else '_scalar'}")
    kernel(x, offsets.to(device=xs.device, dtype=torch.int32).contiguous(), w, s, b, out, params,
           threads=(-(-N // GEMM_BN) * GEMM_THREADS, tiles), group_size=(GEMM_THREADS, 1))
    return out


# rows per expert: empty experts first, last and between; an expert of one row; tiles of exactly 32 rows;
# experts of several tiles (37, 64, 70: a last tile of 5, 0 or 6 rows)
_GROUPED_COUNTS = ([5, 0, 37], [1, 2, 3, 70], [32, 31], [0, 0, 5], [1], [0, 9, 0, 64, 2])


def _grouped_cases(device):
    """One case per entry point, as _gemm_cases: N of one or two 128-column tiles (33, 130, 65, 7, 1); 16-byte K
    of 32 (one K step), 48 (a step and a 16-value tail, element-wise) and 96; element-wise K of 7, 33 and 70."""
    gen = torch.Generator().manual_seed(3)
    out = []
    for i, (wkind, xdtype, layout) in _entry_point_cases():
        vec = layout == "vec"
        counts = _GROUPED_COUNTS[i % len(_GROUPED_COUNTS)]
        E, P, N = len(counts), sum(counts), (33, 130, 65, 7, 1)[i % 5]
        K = (32, 48, 96)[i % 3] if vec else (7, 33, 70)[i % 3]
        w, fmt = _case_bank(E, N, K, wkind, gen)
        xs = torch.randn(P, K, generator=gen).to(xdtype)
        offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
        scale = _case_scale(CASE_SCALES[i % 4], E, N, gen)
        bias = torch.randn(E, N, generator=gen) if i % 3 else None
        args = [t.to(device) if isinstance(t, torch.Tensor) else t for t in (xs, offsets, w, scale, bias)]
        out.append((tuple(args), {"fmt": fmt}))
    return out


def grouped_staging(wkind: str, xtype: str) -> str:
    """The grouped GEMM's staging type (moe.metal) for weights of kind `wkind` and x of MSL type `xtype`: a
    16-bit type where it holds both exactly (bf16 x with bf16 or FP8 weights: bfloat; fp16 x with fp16 or FP8
    weights: half; FP8 e4m3fn is staged as value / 256), else fp32."""
    if xtype in ("bfloat", "half") and wkind in (xtype, *FP8_FORMATS.values()):
        return f"moe_stage_{xtype}"
    return "moe_stage_float"


_GROUPED = {f"moe_grouped_gemm_{w}_{x}{suffix}": f"moe_grouped_gemm<{e}, {x}, {grouped_staging(w, x)}, {vec}>"
            for w, e in WEIGHT_ELEMENTS.items() for x in MSL_TYPE.values()
            for suffix, vec in (("", "true"), ("_scalar", "false"))}

moe_grouped_gemm = register(KernelSpec(
    name="moe_grouped_gemm",
    measured_by_caller=True,          # moe_grouped_linear times it against the platform path
    source="moe.metal",
    entry_points={name: ("tensor",) * 6 + ("int[]",) for name in _GROUPED},
    instantiate=_GROUPED,
    reference=moe_grouped_gemm_reference,
    metal=moe_grouped_gemm_metal,
    self_check_cases=_grouped_cases,
    atol=1e-4,
    rtol=1e-4,
))


# ------------------------------------------------------------------------------- sync-free grouping

def moe_group(experts: torch.Tensor, num_experts: int):
    """Group the token-expert pairs by expert on the device, with fixed-size outputs only.

    experts: [T, K] int. Returns (order [T*K] int64: pair index of each sorted row, sorted_experts
    [T*K] int64, offsets [E] int32: cumulative row counts per expert, as torch._grouped_mm wants).
    No bincount/nonzero/.item(): counts come from scatter_add into a fixed [E] buffer.
    """
    flat = experts.reshape(-1)
    sorted_experts, order = torch.sort(flat, stable=True)
    counts = torch.zeros(num_experts, dtype=torch.int32, device=flat.device)
    counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32))
    offsets = torch.cumsum(counts, 0, dtype=torch.int32)
    return order, sorted_experts, offsets


@functools.lru_cache(maxsize=None)
def _grouped_mm_works(device_type: str, dtype: torch.dtype) -> bool:
    """Whether torch._grouped_mm runs for this device and dtype (probed once on tiny inputs)."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        xc = torch.randint(-3, 4, (5, 8), generator=gen).to(dtype)
        wc = torch.randint(-3, 4, (3, 16, 8), generator=gen).to(dtype)
        offs = torch.tensor([1, 1, 5], dtype=torch.int32)
        y = torch._grouped_mm(xc.to(device_type), wc.to(device_type).transpose(-2, -1),
                              offs=offs.to(device_type)).cpu().float()
        want = torch.cat([xc[:1].float() @ wc[0].float().T, xc[1:].float() @ wc[2].float().T])
        return tuple(y.shape) == (5, 16) and bool(torch.equal(y, want))   # small integers: exact
    except Exception:
        return False


def _grouped_mm_ok(weight: torch.Tensor) -> bool:
    es = weight.element_size()
    return (weight.dtype in (torch.bfloat16, torch.float32, torch.float16)
            and (weight.shape[1] * es) % 16 == 0 and (weight.shape[2] * es) % 16 == 0
            and weight.is_contiguous() and _grouped_mm_works(weight.device.type, weight.dtype))


def _gemm_backend(device: torch.device) -> str:
    """metal, emulator or reference: what moe_experts_gemm runs on this device."""
    return dispatch.choose(moe_experts_gemm.spec, device)[0]


def _grouped_mm(xs, sorted_experts, offsets, weight, s, bias):
    y = torch._grouped_mm(xs.to(weight.dtype), weight.transpose(-2, -1), offs=offsets)
    y = _apply_scale(y, s, sorted_experts)
    if bias is not None:
        y = y + bias.to(y.dtype)[sorted_experts]
    return y


def _platform_grouped_linear(xs, sorted_experts, offsets, weight, scale, bias, f8, compute_dtype):
    """moe_grouped_linear without the pack's kernels: torch._grouped_mm on the bank where the device has it for
    these dims (an FP8 bank decoded to compute_dtype first, when the rows use as many experts as there are),
    else each row's own expert weights gathered (and decoded): the grouped kernel's reference."""
    if f8 is None:
        if _grouped_mm_ok(weight):
            return _grouped_mm(xs, sorted_experts, offsets, weight, scale, bias)
    elif xs.shape[0] >= weight.shape[0]:
        cd = compute_dtype if compute_dtype in (torch.bfloat16, torch.float32, torch.float16) else torch.float32
        wd = decode_weight(weight, f8, cd)
        if _grouped_mm_ok(wd):
            return _grouped_mm(xs, sorted_experts, offsets, wd, scale, bias)
    return moe_experts_gemm_reference(xs, sorted_experts, weight, scale, bias, fmt=f8)


def moe_grouped_linear(xs, sorted_experts, offsets, weight, scale=None, bias=None, fmt=None,
                       compute_dtype=None):
    """Rows `xs` [P, K] sorted by expert (sorted_experts, offsets from moe_group) times their expert's
    weight [E, N, K] (+ bias [E, N]). Returns [P, N] (float32 from the kernel, the bank's dtype from
    torch._grouped_mm).

    Where the grouped kernel passed its self-check (Metal on MPS, the emulator) it runs, on MPS only where
    `dispatch.measured_choice` timed it faster than the platform path for this shape class (once per
    process); the platform path is torch._grouped_mm (FP8 banks decoded to compute_dtype first) or, where
    the device lacks it, each row's weights gathered: `_platform_grouped_linear`, also what CPU and CUDA run.
    """
    f8 = _fp8_format(weight, fmt)
    dev = xs.device
    backend = dispatch.choose(moe_grouped_gemm.spec, dev)[0]

    def platform():
        return _platform_grouped_linear(xs, sorted_experts, offsets, weight, scale, bias, f8, compute_dtype)

    def kernel():
        return moe_grouped_gemm(xs, offsets, weight, scale, bias, fmt=fmt)
    if backend == "reference":
        return platform()
    if backend == "metal" and dispatch.measuring_enabled(dev):
        shape_class = ("linear", f8 or str(weight.dtype), tuple(weight.shape), str(xs.dtype),
                       1 << max(0, xs.shape[0] - 1).bit_length())
        if dispatch.measured_choice("moe_grouped_gemm", shape_class, {"platform": platform, "metal": kernel},
                                    dev) == "platform":
            return platform()
    return kernel()


# -------------------------------------------------------------------------------- whole experts op

def _activation(h: torch.Tensor, activation: str, alpha: float, limit: float) -> torch.Tensor:
    if activation == "silu_glu":          # [gate | up] halves (Qwen3 / Mixtral style)
        gate, up = h.chunk(2, dim=-1)
        return torch.nn.functional.silu(gate) * up
    if activation == "gpt_oss_glu":       # interleaved gate/up, clamped, sigmoid(alpha * gate), (up + 1)
        gate = h[..., ::2].clamp(max=limit)
        up = h[..., 1::2].clamp(min=-limit, max=limit)
        glu = gate * torch.sigmoid(gate * alpha)
        return torch.addcmul(glu, up, glu)
    raise ValueError(f"moe: unknown activation {activation!r} (silu_glu or gpt_oss_glu)")


def moe_experts_forward(x, experts, weights, gate_up, down, *, activation: str = "silu_glu",
                        gate_up_bias=None, down_bias=None, gate_up_scale=None, down_scale=None,
                        fmt: str | None = None, alpha: float = 1.702, limit: float = 7.0,
                        out_dtype: torch.dtype | None = None):
    """The experts of one MoE layer for tokens x [T, H], routed to experts [T, K] with weights [T, K].

    gate_up: [E, 2I, H] bank (gate then up halves for silu_glu, interleaved for gpt_oss_glu);
    down: [E, H, I]. Returns sum_k weights[t, k] * expert_k(x[t]) as [T, H] (out_dtype or x.dtype).
    Sync-free: with a kernel backend (Metal, emulator) few pairs run unsorted through one per-pair
    kernel dispatch per projection; otherwise the pairs are sorted by expert on the device and run as
    grouped matmuls.
    """
    T, H = x.shape
    K = experts.shape[-1]
    E = gate_up.shape[0]
    P = T * K
    out_dtype = out_dtype or x.dtype
    if T == 0:
        return x.new_zeros((0, H), dtype=out_dtype)
    flat_e = experts.reshape(-1)
    if P <= DECODE_MAX_PAIRS and _gemm_backend(x.device) != "reference":
        # decode on the kernel: every pair of a token in one dispatch, the token's row shared by its
        # K pairs (the reference would copy each pair's weights; it takes the grouped path instead)
        h = moe_experts_gemm(x, flat_e, gate_up, gate_up_scale, gate_up_bias, x_div=K, fmt=fmt)
        h = _activation(h, activation, alpha, limit)
        y = moe_experts_gemm(h, flat_e, down, down_scale, down_bias, fmt=fmt)          # [P, H] fp32
    else:
        order, sorted_e, offsets = moe_group(experts, E)
        xs = x.index_select(0, order // K)
        h = moe_grouped_linear(xs, sorted_e, offsets, gate_up, gate_up_scale, gate_up_bias, fmt, x.dtype)
        h = _activation(h, activation, alpha, limit)
        ys = moe_grouped_linear(h, sorted_e, offsets, down, down_scale, down_bias, fmt, x.dtype)
        y = torch.empty((P, H), dtype=ys.dtype, device=x.device)
        y.index_copy_(0, order, ys)                                                        # unsort
    out = (y.view(T, K, H).float() * weights.reshape(T, K, 1).float()).sum(dim=1)
    return out.to(out_dtype)
