"""Fused scaled-dot-product attention (attention.metal) and its pure-torch reference.

flash_attention(q, k, v, mask=None, scale=None)
    q: (B, Hq, Lq, D); k, v: (B, Hk, Lk, D) with Hq % Hk == 0 (grouped-query attention when Hk < Hq);
       one dtype of float32 / float16 / bfloat16, on one device.
    mask: None, or bool (True = attend) or additive float, shaped to broadcast against
       (B, Hq, Lq, Lk) as ComfyUI's attention does: (Lq, Lk), (B|1, Lq, Lk) (batch, not heads),
       (B|1, Hq|1, Lq|1, Lk|1).
    scale: softmax scale, default 1 / sqrt(D).
    variant: which Metal kernel runs (the reference ignores it): "auto" (the simdgroup-matrix kernel
       attention_mma for D % 8 == 0 and more than VEC_MAX_QUERIES query rows, else the vector kernel
       attention_vec), "simd" (the vector kernel) or "mma" (the simdgroup-matrix kernel).
    Returns (B, Hq, Lq, D) in q.dtype. Softmax and accumulation in fp32; a query row whose every
    key is masked (bool False or -inf) gives zeros, not NaN.

The reference is chunked over queries (the score chunk stays under REFERENCE_CHUNK_BYTES) and runs
the softmax in fp32: the memory-bounded path on CPU and CUDA. The Metal kernels (attention.metal: how they
work) stream K/V through an online softmax and never hold more than one block of scores.
"""
from __future__ import annotations

import math

import torch

from . import source
from .dtypes import MSL_TYPE
from .registry import KernelSpec, register

__all__ = ["flash_attention", "attention_shape_class", "ATTENTION_HEAD_DIMS"]

DMAX = 256                      # the largest head dim of the kernels
QUERY_BLOCK = source.define("ATTN_BQ", 32)      # query rows per threadgroup of attention_mma (8 a simdgroup)
MMA_SIMDS = source.define("ATTN_SIMDS", QUERY_BLOCK // 8)
VEC_ROWS = source.define("ATTN_VEC_ROWS", 8)    # (query row, head) pairs per threadgroup of attention_vec
VEC_SIMDS = source.define("ATTN_VEC_SIMDS", 4)
GROUP_THREADS = 32 * MMA_SIMDS                  # threads a threadgroup of either kernel
assert GROUP_THREADS == 32 * VEC_SIMDS
MAX_LAUNCH_GROUPS = (1 << 31) // GROUP_THREADS // 2   # [[threadgroup_position_in_grid]] is 32-bit
VEC_MAX_QUERIES = 8             # "auto" takes the vector kernel up to this many query rows (decode)
VARIANTS = ("auto", "simd", "mma")
REFERENCE_CHUNK_BYTES = 256 << 20
# What ComfyUI's models use (SD1.5 40/80/160, SDXL 64, PixArt 72, Flux/SD3/Wan 128, ...): one attention_mma
# instantiation each; another multiple of 8 runs zero-padded in the next one up.
ATTENTION_HEAD_DIMS = (40, 64, 72, 80, 96, 128, 160, 256)
VEC_SLOTS = (2, 4, 8)           # attention_vec<T, NT> holds NT elements a lane: D <= 32 NT
ATTENTION_PARAMS = source.Params("attention_params", "Lq Lk D Hq Hk has_mask mask_sb mask_sh mask_sq mask_sk "
                                                     "group_base q_blocks splits split_keys pairs")
# attention_vec splits the keys over more threadgroups (merged by attention_vec_merge) until the grid has
# VEC_TARGET_GROUPS of them, each split holding at least VEC_MIN_SPLIT_KEYS keys
VEC_TARGET_GROUPS = 128
VEC_MIN_SPLIT_KEYS = 256
LOG2E = 1.4426950408889634


def _prepare(q, k, v, mask, scale):
    """Validate; return (q, k, v, mask4 or None, scale) with mask4 a 4-D view broadcastable to
    (B, Hq, Lq, Lk), still in its own dtype."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"flash_attention: {name} must be a tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"flash_attention: {name} must be 4-D (batch, heads, tokens, head_dim), "
                             f"got shape {tuple(t.shape)}")
    if q.dtype not in MSL_TYPE:
        raise TypeError(f"flash_attention: dtype {q.dtype} is not supported; expected float32, float16 or bfloat16")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"flash_attention: q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"flash_attention: q, k, v are on {q.device}, {k.device}, {v.device}")
    B, Hq, Lq, D = q.shape
    if k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(f"flash_attention: k {tuple(k.shape)} and v {tuple(v.shape)} must both be "
                         f"({B}, heads, tokens, {D}) for q {tuple(q.shape)}")
    Hk, Lk = k.shape[1], k.shape[2]
    if Hk == 0 or Hq % Hk:
        raise ValueError(f"flash_attention: q has {Hq} heads, k/v have {Hk}: q heads must be a multiple of k/v heads")
    m4 = None
    if mask is not None:
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"flash_attention: mask must be a tensor, got {type(mask).__name__}")
        if mask.dtype != torch.bool and not mask.is_floating_point():
            raise TypeError(f"flash_attention: mask must be bool or floating point, got {mask.dtype}")
        if not 2 <= mask.dim() <= 4:
            raise ValueError(f"flash_attention: mask must be 2-D to 4-D, got shape {tuple(mask.shape)}")
        # ComfyUI's convention (attention_pytorch): 2-D is (Lq, Lk), 3-D is (batch, Lq, Lk)
        m4 = mask[None, None] if mask.dim() == 2 else mask[:, None] if mask.dim() == 3 else mask
        for size, full, what in zip(m4.shape, (B, Hq, Lq, Lk), ("batch", "heads", "query tokens", "key tokens")):
            if size not in (1, full):
                raise ValueError(f"flash_attention: mask of shape {tuple(mask.shape)} does not broadcast to "
                                 f"(batch, heads, query tokens, key tokens) = {(B, Hq, Lq, Lk)} ({what})")
        m4 = m4.to(q.device)
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    return q, k, v, m4, scale


def _additive(m4: torch.Tensor) -> torch.Tensor:
    """The mask as fp32 additive values (bool: True -> 0, False -> -inf)."""
    if m4.dtype == torch.bool:
        return torch.zeros(m4.shape, dtype=torch.float32, device=m4.device).masked_fill_(~m4, float("-inf"))
    return m4.to(torch.float32)


def _check_variant(variant):
    if variant not in VARIANTS:
        raise ValueError(f"flash_attention: variant must be one of {VARIANTS}, got {variant!r}")


def flash_attention_reference(q, k, v, mask=None, scale=None, variant="auto"):
    _check_variant(variant)
    q, k, v, m4, scale = _prepare(q, k, v, mask, scale)
    B, Hq, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    G = Hq // Hk
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    if Lk == 0:
        return out.zero_()
    kf = k.to(torch.float32).unsqueeze(2)                     # (B, Hk, 1, Lk, D): shared by the group
    vf = v.to(torch.float32).unsqueeze(2)
    add = None if m4 is None else _additive(m4)               # (B|1, Hq|1, Lq|1, Lk)
    chunk = max(1, REFERENCE_CHUNK_BYTES // max(1, B * Hq * Lk * 4))
    for i0 in range(0, Lq, chunk):
        i1 = min(Lq, i0 + chunk)
        qc = (q[:, :, i0:i1].to(torch.float32) * scale).reshape(B, Hk, G, i1 - i0, D)
        s = torch.matmul(qc, kf.transpose(-1, -2))               # (B, Hk, G, c, Lk) fp32 scores
        if add is not None:
            a = add if add.shape[2] == 1 else add[:, :, i0:i1]
            s.add_(a.expand(B, Hq, i1 - i0, Lk).reshape(B, Hk, G, i1 - i0, Lk))
        row_max = s.amax(dim=-1, keepdim=True)
        row_max.masked_fill_(torch.isneginf(row_max), 0.0)      # fully masked row: exp(-inf) = 0 below
        p = s.sub_(row_max).exp_()
        denom = p.sum(dim=-1, keepdim=True)
        o = torch.matmul(p, vf).div_(denom.masked_fill_(denom == 0, 1.0))
        out[:, :, i0:i1] = o.reshape(B, Hq, i1 - i0, D).to(q.dtype)
    return out


def _mask_strides(add: torch.Tensor) -> list[int]:
    """Element strides of a contiguous 4-D mask, 0 along its broadcast (size-1) dimensions."""
    strides = list(add.stride())
    return [0 if n == 1 else s for n, s in zip(add.shape, strides)]


def mma_bucket(D: int) -> int | None:
    """The attention_mma instantiation (a head dim of ATTENTION_HEAD_DIMS) for head dim D, or None (D % 8 != 0
    or D > DMAX)."""
    if D % 8 or D == 0:
        return None
    return next((n for n in ATTENTION_HEAD_DIMS if D <= n), None)


def vec_slots(D: int) -> int:
    """NT of the attention_vec instantiation for head dim D (D <= 32 NT)."""
    return next(n for n in VEC_SLOTS if D <= 32 * n)


def _aligned(t: torch.Tensor) -> torch.Tensor:
    """t contiguous and 16-byte aligned (the kernels load 16-byte vectors; a view may start anywhere)."""
    t = t.contiguous()
    return t if t.data_ptr() % 16 == 0 else t.clone()


def flash_attention_metal(lib, q, k, v, mask=None, scale=None, variant="auto"):
    _check_variant(variant)
    q, k, v, m4, scale = _prepare(q, k, v, mask, scale)
    B, Hq, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    if D > DMAX or D == 0 or max(Lq, Lk) * D >= 1 << 31:    # in-head offsets are 32-bit in the kernels
        return flash_attention_reference(q, k, v, mask, scale)
    bucket = mma_bucket(D)
    if variant == "mma" and bucket is None:
        raise ValueError(f"flash_attention: variant 'mma' needs a head dim that is a multiple of 8, got {D}")
    use_mma = variant == "mma" or (variant == "auto" and bucket is not None and Lq > VEC_MAX_QUERIES)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    if Lk == 0:
        return out.zero_()
    qc, kc, vc = _aligned(q), _aligned(k), _aligned(v)
    if m4 is None:
        add, has_mask, strides = torch.zeros(1, dtype=torch.float32, device=q.device), 0, [0, 0, 0, 0]
    else:
        add = _additive(m4).contiguous()
        has_mask, strides = 1, _mask_strides(add)
    t = MSL_TYPE[q.dtype]
    fields = dict(Lq=Lq, Lk=Lk, D=D, Hq=Hq, Hk=Hk, has_mask=has_mask, mask_sb=strides[0], mask_sh=strides[1],
                  mask_sq=strides[2], mask_sk=strides[3], pairs=B * Hq * Lq)
    if use_mma:
        q_blocks = -(-Lq // QUERY_BLOCK)
        fields.update(q_blocks=q_blocks, splits=1, split_keys=Lk)
        _launch(getattr(lib, f"attention_mma{bucket}_{t}"), B * Hq * q_blocks, fields,
                (qc, kc, vc, add, out), (float(scale * LOG2E),))
        return out
    q_blocks = -(-(Hq // Hk) * Lq // VEC_ROWS)
    groups = B * Hk * q_blocks
    splits = 1
    if groups < VEC_TARGET_GROUPS:
        splits = max(1, min(-(-VEC_TARGET_GROUPS // groups), Lk // VEC_MIN_SPLIT_KEYS))
    split_keys = -(-Lk // splits)
    splits = -(-Lk // split_keys)                            # no empty split
    fields.update(q_blocks=q_blocks, splits=splits, split_keys=split_keys)
    part = torch.empty(B * Hq * Lq * splits * (D + 2) if splits > 1 else 1, dtype=torch.float32, device=q.device)
    _launch(getattr(lib, f"attention_vec{vec_slots(D)}_{t}"), groups * splits, fields, (qc, kc, vc, add, out),
            (float(scale * LOG2E), part))
    if splits > 1:
        pairs = B * Hq * Lq
        merge = getattr(lib, f"attention_vec_merge_{t}")
        for g0 in range(0, -(-pairs // VEC_SIMDS), MAX_LAUNCH_GROUPS):
            n = min(MAX_LAUNCH_GROUPS, -(-pairs // VEC_SIMDS) - g0)
            merge(part, out, ATTENTION_PARAMS.pack(**{**fields, "q_blocks": 1, "group_base": g0 * VEC_SIMDS}),
                  threads=n * GROUP_THREADS, group_size=GROUP_THREADS)
    return out


def _launch(kernel, groups: int, fields: dict, tensors: tuple, rest: tuple) -> None:
    """kernel(*tensors, params, *rest) over `groups` threadgroups, in launches of at most MAX_LAUNCH_GROUPS."""
    for g0 in range(0, groups, MAX_LAUNCH_GROUPS):
        n = min(MAX_LAUNCH_GROUPS, groups - g0)
        kernel(*tensors, ATTENTION_PARAMS.pack(**fields, group_base=g0), *rest, threads=n * GROUP_THREADS,
               group_size=GROUP_THREADS)


def attention_shape_class(q, k, mask=None) -> tuple:
    """The key under which the measured dispatch remembers its choice: dtype, head dim, query and
    key length buckets (powers of two), mask or not, GQA or not."""
    def bucket(n):
        return 1 << max(0, int(n) - 1).bit_length()
    return (str(q.dtype).replace("torch.", ""), int(q.shape[-1]), bucket(q.shape[-2]), bucket(k.shape[-2]),
            mask is not None, k.shape[1] != q.shape[1])


def _cases(device):
    """One case per entry point (the self-check is all that stands between an entry point and a user's model on
    a Mac): every attention_mma head dim and attention_vec width in each dtype, with odd lengths (partial query
    and key blocks), cross-attention, GQA, bool and additive masks with broadcast dimensions and a fully
    masked row."""
    gen = torch.Generator().manual_seed(14)
    out = []

    def add(B, Hq, Hk, Lq, Lk, D, dtype, mask_kind, variant):
        q = torch.randn(B, Hq, Lq, D, generator=gen).to(dtype)
        k = torch.randn(B, Hk, Lk, D, generator=gen).to(dtype)
        v = torch.randn(B, Hk, Lk, D, generator=gen).to(dtype)
        mask = None
        if mask_kind == "bool":
            mask = torch.rand(B, 1, Lq, Lk, generator=gen) > 0.3
            mask[..., Lq // 2, :] = False
        elif mask_kind == "add":
            mask = (torch.randn(Lq, Lk, generator=gen) * 2).to(dtype)
            mask[Lq // 2] = float("-inf")
        out.append(((q.to(device), k.to(device), v.to(device)),
                    {"mask": None if mask is None else mask.to(device), "variant": variant}))

    kinds = (None, "bool", "add")
    for i, (D, dtype) in enumerate((d, t) for d in ATTENTION_HEAD_DIMS for t in MSL_TYPE):
        add(1, 2, 1 if i % 2 else 2, 9 + i, 21 + 2 * i, D, dtype, kinds[i % 3], "mma")
    for i, (n, dtype) in enumerate((n, t) for n in VEC_SLOTS for t in MSL_TYPE):
        add(2 if i % 2 else 1, 4, 2 if i % 3 else 4, 1 + i % 5, 17 + 3 * i, 32 * n - 4 * (i % 3), dtype,
            kinds[i % 3], "simd")
    for i, dtype in enumerate(MSL_TYPE):             # keys split over threadgroups: attention_vec_merge
        add(1, 2, 1, 2, 2 * VEC_MIN_SPLIT_KEYS + 37 * i, 64, dtype, kinds[(i + 1) % 3], "simd")
    return out


def _predict_cases():
    """bench --predict: the model shapes of perf/cases.py (Flux, SDXL, Wan prefill: attention_mma) and a decode
    shape for attention_vec (Qwen3-4B's 32 query heads over 8 k/v heads, one query row, 4096 cached keys)."""
    from .perf.cases import CASES, PredictCase

    def decode(lib, device):
        gen = torch.Generator().manual_seed(6)
        q = torch.randn(1, 32, 1, 128, generator=gen).to(device=device, dtype=torch.bfloat16)
        k, v = (torch.randn(1, 8, 4096, 128, generator=gen).to(device=device, dtype=torch.bfloat16) for _ in range(2))
        return flash_attention_metal(lib, q, k, v)
    return CASES["flash_attention"]() + [PredictCase("decode: 32 heads / 8 k/v heads, 1 x 4096 tokens, D128, bf16",
                                                     decode, sample=None)]


_INSTANCES = {**{f"attention_mma{d}_{t}": f"attention_mma<{t}, {d}>" for t in MSL_TYPE.values()
                 for d in ATTENTION_HEAD_DIMS},
              **{f"attention_vec{n}_{t}": f"attention_vec<{t}, {n}>" for t in MSL_TYPE.values() for n in VEC_SLOTS},
              **{f"attention_vec_merge_{t}": f"attention_vec_merge<{t}>" for t in MSL_TYPE.values()}}

flash_attention = register(KernelSpec(
    name="flash_attention",
    measured_by_caller=True,
    source="attention.metal",
    entry_points={name: ("tensor", "tensor", "int[]") if "merge" in name
                  else ("tensor",) * 5 + ("int[]", "float") + (("tensor",) if name.startswith("attention_vec") else ())
                  for name in _INSTANCES},
    instantiate=_INSTANCES,
    reference=flash_attention_reference,
    metal=flash_attention_metal,
    self_check_cases=_cases,
    atol=2e-5,
    rtol=1e-4,
    predict_cases=_predict_cases,
))
