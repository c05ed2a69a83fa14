"""Fused scaled-dot-product attention (attention.metal) and its pure-torch reference.

flash_attention(q, k, v, mask=None, scale=None)
    q: (B, Hq, Lq, D); k, v: (B, Hk, Lk, D) with Hq % Hk == 0 (grouped-query attention when Hk < Hq);
       one dtype of float32 / float16 / bfloat16, on one device.
    mask: None, or bool (True = attend) or additive float, shaped to broadcast against
       (B, Hq, Lq, Lk) as ComfyUI's attention does: (Lq, Lk), (B|1, Lq, Lk) (batch, not heads),
       (B|1, Hq|1, Lq|1, Lk|1).
    scale: softmax scale, default 1 / sqrt(D).
    variant: "auto" (the simdgroup-matrix kernel for D % 8 == 0 and >= 32 query rows, else the
       simd-reduction kernel), "simd" or "mma" (the Metal kernel to use; the reference ignores it).
    Returns (B, Hq, Lq, D) in q.dtype. Softmax and accumulation in fp32; a query row whose every
    key is masked (bool False or -inf) gives zeros, not NaN.

The reference is chunked over queries (the score chunk stays under REFERENCE_CHUNK_BYTES) and runs
the softmax in fp32: the memory-bounded path on CPU and CUDA. The Metal kernel streams K/V through
an online softmax and never holds more than one block of scores.
"""
from __future__ import annotations

import math

import torch

from .dtypes import MSL_TYPE
from .registry import KernelSpec, register

__all__ = ["flash_attention", "attention_shape_class", "ATTENTION_HEAD_DIMS"]

DMAX = 256                      # ATTN_DMAX in attention.metal
ROWS = 16                       # ATTN_ROWS: query rows per threadgroup
GROUP_THREADS = 128             # ATTN_THREADS
MAX_LAUNCH_GROUPS = (1 << 31) // GROUP_THREADS // 2   # [[threadgroup_position_in_grid]] is 32-bit
MMA_ROWS = 32                   # ATTN_MMA_ROWS: query rows per threadgroup of the simdgroup-matrix kernels
MMA_MIN_QUERIES = 32            # "auto" takes the simdgroup-matrix kernels from this many query rows
VARIANTS = ("auto", "simd", "mma")
REFERENCE_CHUNK_BYTES = 256 << 20
ATTENTION_HEAD_DIMS = (40, 64, 72, 80, 96, 128, 160, 256)   # what ComfyUI's models use (all covered)


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
    """The simdgroup-matrix instantiation (64, 128, 256) for head dim D, or None (D % 8 != 0)."""
    if D % 8 or D == 0:
        return None
    return next((n for n in (64, 128, 256) if D <= n), None)


def flash_attention_metal(lib, q, k, v, mask=None, scale=None, variant="auto"):
    _check_variant(variant)
    q, k, v, m4, scale = _prepare(q, k, v, mask, scale)
    B, Hq, Lq, D = q.shape
    Hk, Lk = k.shape[1], k.shape[2]
    if D > DMAX or D == 0:
        return flash_attention_reference(q, k, v, mask, scale)
    bucket = mma_bucket(D)
    if variant == "mma" and bucket is None:
        raise ValueError(f"flash_attention: variant 'mma' needs a head dim that is a multiple of 8, got {D}")
    use_mma = variant == "mma" or (variant == "auto" and bucket is not None and Lq >= MMA_MIN_QUERIES)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if out.numel() == 0:
        return out
    if Lk == 0:
        return out.zero_()
    qc, kc, vc = q.contiguous(), k.contiguous(), v.contiguous()
    if m4 is None:
        add, has_mask, strides = torch.zeros(1, dtype=torch.float32, device=q.device), 0, [0, 0, 0, 0]
    else:
        add = _additive(m4).contiguous()
        has_mask, strides = 1, _mask_strides(add)
    if use_mma:
        kernel, rows = getattr(lib, f"attention_mma{bucket}_{MSL_TYPE[q.dtype]}"), MMA_ROWS
    else:
        kernel, rows = getattr(lib, f"attention_{MSL_TYPE[q.dtype]}"), ROWS
    q_blocks = -(-Lq // rows)
    groups = B * Hq * q_blocks
    for g0 in range(0, groups, MAX_LAUNCH_GROUPS):
        n = min(MAX_LAUNCH_GROUPS, groups - g0)
        kernel(qc, kc, vc, add, out, Lq, Lk, D, Hq, Hk, float(scale * 1.4426950408889634), has_mask,
               *strides, g0, q_blocks, threads=n * GROUP_THREADS, group_size=GROUP_THREADS)
    return out


def attention_shape_class(q, k, mask=None) -> tuple:
    """The key under which the measured dispatch remembers its choice: dtype, head dim, query and
    key length buckets (powers of two), mask or not, GQA or not."""
    def bucket(n):
        return 1 << max(0, int(n) - 1).bit_length()
    return (str(q.dtype).replace("torch.", ""), int(q.shape[-1]), bucket(q.shape[-2]), bucket(k.shape[-2]),
            mask is not None, k.shape[1] != q.shape[1])


def _cases(device):
    gen = torch.Generator().manual_seed(14)
    out = []
    # every entry point (one per dtype); odd lengths; cross-attention; GQA; bool and additive masks
    # with broadcast dimensions and a fully masked row.
    for (B, Hq, Hk, Lq, Lk, D), dtype, mask_kind in [((1, 2, 2, 19, 37, 40), torch.float32, None),
                                                     ((2, 2, 1, 17, 33, 64), torch.float16, "bool"),
                                                     ((1, 3, 3, 5, 77, 72), torch.bfloat16, "add")]:
        q = torch.randn(B, Hq, Lq, D, generator=gen).to(dtype)
        k = torch.randn(B, Hk, Lk, D, generator=gen).to(dtype)
        v = torch.randn(B, Hk, Lk, D, generator=gen).to(dtype)
        mask = None
        if mask_kind == "bool":
            mask = torch.rand(B, 1, Lq, Lk, generator=gen) > 0.3
            mask[0, 0, 1] = False
        elif mask_kind == "add":
            mask = (torch.randn(Lq, Lk, generator=gen) * 2).to(dtype)
            mask[2] = float("-inf")
        out.append(((q.to(device), k.to(device), v.to(device)),
                    {"mask": None if mask is None else mask.to(device), "variant": "simd"}))
    # every simdgroup-matrix instantiation (head-dim bucket x dtype), odd lengths, a mask, GQA
    for i, (D, dtype) in enumerate([(d, t) for d in (40, 128, 160) for t in MSL_TYPE]):
        Hk = 1 if i % 2 else 2
        q = torch.randn(1, 2, 9 + i, D, generator=gen).to(dtype)
        k = torch.randn(1, Hk, 21 + 2 * i, D, generator=gen).to(dtype)
        v = torch.randn(1, Hk, 21 + 2 * i, D, generator=gen).to(dtype)
        mask = None
        if i % 3 == 0:
            mask = torch.rand(1, 1, 9 + i, 21 + 2 * i, generator=gen) > 0.25
            mask[..., 2, :] = False
        out.append(((q.to(device), k.to(device), v.to(device)),
                    {"mask": None if mask is None else mask.to(device), "variant": "mma"}))
    return out


flash_attention = register(KernelSpec(
    name="flash_attention",
    measured_by_caller=True,
    source="attention.metal",
    entry_points={name: ("tensor",) * 5 + ("int",) * 5 + ("float",) + ("int",) * 7
                  for t in MSL_TYPE.values()
                  for name in [f"attention_{t}"] + [f"attention_mma{n}_{t}" for n in (64, 128, 256)]},
    reference=flash_attention_reference,
    metal=flash_attention_metal,
    self_check_cases=_cases,
    atol=2e-5,
    rtol=1e-4,
))
