"""Mixture-of-experts kernels and the sync-free MoE experts forward built on them.

Kernels (moe.metal, each with a pure-torch reference of the same signature):
  moe_route(logits, top_k, norm=True) -> (weights fp32 [T, K], experts int64 [T, K])
      softmax over the experts + top-k, descending; `norm` renormalises the K weights
      (Qwen3 norm_topk_prob; identical to GPT-OSS's softmax over the top-k logits).
  moe_experts_gemm(x, row_expert, weight, scale=None, bias=None, x_div=1, fmt=None) -> fp32 [P, N]
      out[p] = scale[e] * weight[e] @ x[p // x_div] + bias[e] with e = row_expert[p]; weight is a
      [E, N, K] bank in fp32/fp16/bf16 or FP8 (uint8 bytes or float8 dtype, `fmt` e4m3fn/e5m2).
      At decode time it runs all top-k experts of a token in one dispatch (one simdgroup per output
      column, 4 weights per lane per step).
  moe_grouped_gemm(xs, offsets, weight, scale=None, bias=None, fmt=None) -> fp32 [P, N]
      prefill: rows sorted by expert (offsets = cumulative rows per expert) through a tiled grouped
      GEMM (32x32 tiles, one expert per tile, K staged in threadgroup memory; the tile table is built
      on the device with a fixed size). Used for FP8 banks on MPS, and for plain banks where
      torch._grouped_mm is unavailable.

Orchestration (pure torch, no host syncs: no .item(), nonzero, bincount or host loop over experts):
  moe_group(experts, num_experts) -> (order, sorted_experts, offsets)
  moe_grouped_linear(xs, sorted_experts, offsets, weight, ...) -> [P, N]  (picks _grouped_mm / kernels)
  moe_experts_forward(x, experts, weights, gate_up, down, activation=...) -> [T, H]
"""
from __future__ import annotations

import functools

import torch

from . import dispatch
from .dtypes import DTYPE_OF_MSL, MSL_TYPE
from .registry import KernelSpec, register

__all__ = ["moe_route", "moe_experts_gemm", "moe_grouped_gemm", "moe_group", "moe_grouped_linear",
           "moe_experts_forward"]

FP8_FORMATS = {"e4m3fn": "e4m3", "e5m2": "e5m2"}
MAX_EXPERTS = 1024          # moe.metal MOE_MAX_EXPERTS
GEMM_ROWS = 8               # moe.metal MOE_ROWS
GEMM_GROUP = 256            # threads per group of moe_experts_gemm: 8 simdgroups = 8 output columns
DECODE_MAX_PAIRS = 64       # token-expert pairs up to which the unsorted per-pair kernel is used
TILED_MIN_ROWS_PER_EXPERT = 8   # sorted rows per expert (on average) from which the tiled grouped kernel runs


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
        return torch.ones(1, dtype=torch.float32, device=device), 0, 0
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


def moe_route_metal(lib, logits: torch.Tensor, top_k: int, norm: bool = True):
    _check_route(logits, top_k)
    E = logits.shape[-1]
    if E > MAX_EXPERTS:
        return moe_route_reference(logits, top_k, norm)
    x = logits.contiguous().view(-1, E)
    rows = x.shape[0]
    weights = torch.empty((rows, top_k), dtype=torch.float32, device=x.device)
    experts = torch.empty((rows, top_k), dtype=torch.int64, device=x.device)
    if rows:
        getattr(lib, f"moe_route_{MSL_TYPE[x.dtype]}")(x, weights, experts, E, int(top_k), int(bool(norm)),
                                                       threads=rows * 32, group_size=32)
    shape = tuple(logits.shape[:-1]) + (top_k,)
    return weights.view(shape), experts.view(shape)


def _route_cases(device):
    gen = torch.Generator().manual_seed(1)
    out = []
    for rows, E, k, dtype, norm in [(1, 5, 2, torch.float32, True), (7, 33, 3, torch.float16, False),
                                    (3, 128, 8, torch.bfloat16, True), (5, 1, 1, torch.float32, True)]:
        # distinct values so the top-k order is unambiguous in every dtype
        x = torch.stack([torch.randperm(E, generator=gen).float() * 0.25 - E / 8 for _ in range(rows)])
        out.append(((x.to(dtype).to(device), k), {"norm": norm}))
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
    entry_points={f"moe_route_{t}": ("tensor", "tensor", "tensor", "int", "int", "int") for t in MSL_TYPE.values()},
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


def moe_experts_gemm_metal(lib, x, row_expert, weight, scale=None, bias=None, x_div: int = 1, fmt=None):
    _check_gemm(x, row_expert, weight, x_div)
    E, N, K = weight.shape
    P = row_expert.shape[0]
    f8 = _fp8_format(weight, fmt)
    wname = FP8_FORMATS[f8] if f8 else MSL_TYPE[weight.dtype]
    w = weight.contiguous()
    if f8 and w.dtype != torch.uint8:
        w = w.view(torch.uint8)
    s, se, sn = _scale_table(scale, E, N, x.device)
    b = bias.to(device=x.device, dtype=torch.float32).contiguous() if bias is not None else \
        torch.zeros(1, dtype=torch.float32, device=x.device)
    out = torch.empty((P, N), dtype=torch.float32, device=x.device)
    if P and N:
        simds = GEMM_GROUP // 32
        groups = ((N + simds - 1) // simds) * ((P + GEMM_ROWS - 1) // GEMM_ROWS)
        kernel = getattr(lib, f"moe_experts_gemm_{wname}_{MSL_TYPE[x.dtype]}")
        kernel(x.contiguous(), row_expert.to(torch.int64).contiguous(), w, s, b, out, P, N, K, int(x_div),
               se, sn, int(bias is not None), threads=groups * GEMM_GROUP, group_size=GEMM_GROUP)
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


# One case per (weight kind, activation type): every entry point of moe_experts_gemm is self-checked.
# Small odd shapes; K covers the scalar tail only, one 128-wide step + tail (129, 140, 150) and
# several steps + tail (300); P > MOE_ROWS (9, 11) gives several row blocks; x_div shares rows.
_GEMM_CASES = [  # E, N, K, P, x_div, weight, x, scale, bias
    (5, 7, 33, 3, 3, "float", "float", None, True),
    (2, 3, 17, 4, 2, "float", "half", "expert", False),
    (3, 5, 129, 5, 1, "float", "bfloat", "row", True),
    (4, 17, 20, 6, 1, "half", "float", "expert", True),
    (3, 6, 45, 2, 1, "half", "half", "scalar", False),
    (2, 9, 7, 7, 7, "half", "bfloat", "row", True),
    (3, 5, 150, 4, 2, "bfloat", "float", "scalar", False),
    (2, 4, 11, 3, 1, "bfloat", "half", None, True),
    (3, 13, 40, 11, 1, "bfloat", "bfloat", "expert", False),
    (7, 9, 65, 4, 2, "e4m3fn", "float", "row", True),
    (2, 6, 33, 5, 1, "e4m3fn", "half", "expert", False),
    (3, 6, 300, 5, 5, "e4m3fn", "bfloat", "expert", False),
    (3, 7, 19, 3, 3, "e5m2", "float", None, True),
    (2, 5, 31, 9, 1, "e5m2", "half", None, False),
    (4, 3, 140, 6, 2, "e5m2", "bfloat", "row", True),
]


def _gemm_cases(device):
    gen = torch.Generator().manual_seed(2)
    out = []
    for E, N, K, P, x_div, wkind, xkind, sc, with_bias in _GEMM_CASES:
        w, fmt = _case_bank(E, N, K, wkind, gen)
        x = torch.randn(P // x_div, K, generator=gen).to(DTYPE_OF_MSL[xkind])
        row_e = torch.randint(0, E, (P,), generator=gen)
        scale = _case_scale(sc, E, N, gen)
        bias = torch.randn(E, N, generator=gen) if with_bias else None
        args = [t.to(device) if isinstance(t, torch.Tensor) else t for t in (x, row_e, w, scale, bias)]
        out.append((tuple(args), {"x_div": x_div, "fmt": fmt}))
    return out


moe_experts_gemm = register(KernelSpec(
    name="moe_experts_gemm",
    source="moe.metal",
    entry_points={f"moe_experts_gemm_{w}_{x}": ("tensor",) * 6 + ("int",) * 7
                  for w in ("float", "half", "bfloat", "e4m3", "e5m2") for x in MSL_TYPE.values()},
    reference=moe_experts_gemm_reference,
    metal=moe_experts_gemm_metal,
    self_check_cases=_gemm_cases,
    atol=1e-4,
    rtol=1e-4,
))


# ---------------------------------------------------------------------- tiled grouped GEMM (prefill)

TILE = 32   # MOE_TM = MOE_TN in moe.metal


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


def tile_table(offsets: torch.Tensor, rows: int):
    """(tile_expert, tile_row0, tile_rows) int64 [ceil(rows/32) + E]: each expert's rows cut into tiles
    of <= 32; unused tiles have 0 rows. Fixed size, built with device ops only."""
    E = offsets.shape[0]
    off = offsets.to(torch.int64)
    counts = torch.diff(off, prepend=off.new_zeros(1))
    starts = off - counts
    tiles = (counts + TILE - 1) // TILE
    tile_end = torch.cumsum(tiles, 0)
    T = (rows + TILE - 1) // TILE + E
    t = torch.arange(T, device=off.device)
    e = torch.searchsorted(tile_end, t, right=True)
    valid = e < E
    ec = e.clamp(max=E - 1)
    local = t - (tile_end[ec] - tiles[ec])
    row0 = starts[ec] + local * TILE
    nrows = (counts[ec] - local * TILE).clamp(0, TILE) * valid
    return ec.contiguous(), row0.contiguous(), nrows.contiguous()


def moe_grouped_gemm_metal(lib, xs, offsets, weight, scale=None, bias=None, fmt=None):
    _check_grouped(xs, offsets, weight)
    E, N, K = weight.shape
    P = xs.shape[0]
    f8 = _fp8_format(weight, fmt)
    wname = FP8_FORMATS[f8] if f8 else MSL_TYPE[weight.dtype]
    w = weight.contiguous()
    if f8 and w.dtype != torch.uint8:
        w = w.view(torch.uint8)
    s, se, sn = _scale_table(scale, E, N, xs.device)
    b = bias.to(device=xs.device, dtype=torch.float32).contiguous() if bias is not None else \
        torch.zeros(1, dtype=torch.float32, device=xs.device)
    out = torch.empty((P, N), dtype=torch.float32, device=xs.device)
    if P and N:
        te, tr0, tn = tile_table(offsets, P)
        groups = te.shape[0] * ((N + TILE - 1) // TILE)
        kernel = getattr(lib, f"moe_grouped_gemm_{wname}_{MSL_TYPE[xs.dtype]}")
        kernel(xs.contiguous(), te, tr0, tn, w, s, b, out, N, K, se, sn, int(bias is not None),
               threads=groups * 256, group_size=256)
    return out


# One case per (weight kind, activation type): every entry point of moe_grouped_gemm is self-checked.
# Small odd shapes: experts with no rows, experts with more than one 32-row tile (37, 70), N across
# two column tiles (33, 40), K not a multiple of the 32-wide K step; and one case with no rows at all.
_GROUPED_CASES = [  # E, N, K, rows per expert, weight, x, scale, bias
    (3, 33, 40, [5, 0, 37], "float", "float", "expert", True),
    (2, 5, 9, [3, 4], "float", "half", None, False),
    (3, 11, 33, [0, 6, 1], "float", "bfloat", "row", True),
    (2, 7, 20, [4, 3], "half", "float", "expert", True),
    (3, 6, 17, [2, 0, 5], "half", "half", "scalar", False),
    (1, 9, 35, [7], "half", "bfloat", "row", True),
    (2, 3, 50, [1, 5], "bfloat", "float", None, True),
    (2, 40, 31, [33, 31], "bfloat", "half", None, True),
    (4, 5, 12, [2, 2, 2, 2], "bfloat", "bfloat", "expert", False),
    (3, 8, 70, [3, 0, 4], "e4m3fn", "float", "row", True),
    (2, 5, 23, [6, 1], "e4m3fn", "half", None, False),
    (4, 7, 65, [1, 2, 3, 70], "e4m3fn", "bfloat", "row", False),
    (2, 9, 41, [3, 3], "e5m2", "float", "expert", True),
    (3, 4, 16, [1, 1, 1], "e5m2", "half", None, False),
    (2, 6, 33, [5, 2], "e5m2", "bfloat", "row", True),
    (5, 9, 16, [0, 0, 0, 0, 0], "float", "float", None, False),
]


def _grouped_cases(device):
    gen = torch.Generator().manual_seed(3)
    out = []
    for E, N, K, counts, wkind, xkind, sc, with_bias in _GROUPED_CASES:
        P = sum(counts)
        w, fmt = _case_bank(E, N, K, wkind, gen)
        xs = torch.randn(P, K, generator=gen).to(DTYPE_OF_MSL[xkind])
        offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
        scale = _case_scale(sc, E, N, gen)
        bias = torch.randn(E, N, generator=gen) if with_bias else None
        args = [t.to(device) if isinstance(t, torch.Tensor) else t for t in (xs, offsets, w, scale, bias)]
        out.append((tuple(args), {"fmt": fmt}))
    return out


moe_grouped_gemm = register(KernelSpec(
    name="moe_grouped_gemm",
    source="moe.metal",
    entry_points={f"moe_grouped_gemm_{w}_{x}": ("tensor",) * 8 + ("int",) * 5
                  for w in ("float", "half", "bfloat", "e4m3", "e5m2") for x in MSL_TYPE.values()},
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


def moe_grouped_linear(xs, sorted_experts, offsets, weight, scale=None, bias=None, fmt=None,
                       compute_dtype=None):
    """Rows `xs` [P, K] sorted by expert (sorted_experts, offsets from moe_group) times their expert's
    weight [E, N, K] (+ bias [E, N]). Returns [P, N] (float32 from the kernel, the bank's dtype from
    torch._grouped_mm).

    Plain banks: torch._grouped_mm where the device has it (aligned dims), else the grouped kernel
    (Metal on MPS, the emulator, or its reference). FP8 banks: the grouped Metal kernel on MPS (and in
    the emulator); elsewhere decoded to compute_dtype once per call and run through
    torch._grouped_mm when there are at least as many rows as experts, else only the rows' weights
    are gathered and decoded (the kernel's reference).
    """
    E = weight.shape[0]
    f8 = _fp8_format(weight, fmt)
    dev = xs.device
    s = scale
    backend = _gemm_backend(dev)
    tiled = backend != "reference" and xs.shape[0] >= TILED_MIN_ROWS_PER_EXPERT * E
    if f8 is None:
        if backend != "emulator" and _grouped_mm_ok(weight):
            return _grouped_mm(xs, sorted_experts, offsets, weight, s, bias)
        if tiled:
            return moe_grouped_gemm(xs, offsets, weight, s, bias, fmt=fmt)
        return moe_experts_gemm(xs, sorted_experts, weight, s, bias, fmt=fmt)
    if tiled:
        return moe_grouped_gemm(xs, offsets, weight, s, bias, fmt=fmt)
    if backend != "reference" or xs.shape[0] < E:
        return moe_experts_gemm(xs, sorted_experts, weight, s, bias, fmt=fmt)
    cd = compute_dtype if compute_dtype in (torch.bfloat16, torch.float32, torch.float16) else torch.float32
    wd = decode_weight(weight, f8, cd)
    if _grouped_mm_ok(wd):
        return _grouped_mm(xs, sorted_experts, offsets, wd, s, bias)
    return moe_experts_gemm(xs, sorted_experts, wd, s, bias)


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
