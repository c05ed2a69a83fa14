"""Kernels of the tiled low-memory VAE: 4-D/5-D constant and replicate padding, and the feather
blend-accumulate of a decoded tile into an fp32 accumulator."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from .dtypes import MSL_TYPE
from .registry import KernelSpec, register

__all__ = ["vae_pad", "vae_blend_accumulate"]

GROUP = 256
MAX_THREADS = 1 << 24   # grid-stride beyond this (the kernels loop with stride = threads)


# ---------------------------------------------------------------- padding

def _pad_args(x: torch.Tensor, pad, mode: str):
    """(pad_w_left, pad_w_right, pad_h_l, pad_h_r, pad_t_l, pad_t_r) validated, F.pad convention."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"vae_pad: expected a tensor, got {type(x).__name__}")
    if x.dim() not in (4, 5):
        raise ValueError(f"vae_pad: expected a 4-D [N, C, H, W] or 5-D [N, C, T, H, W] tensor, got shape {tuple(x.shape)}")
    pad = tuple(int(p) for p in pad)
    if len(pad) % 2 or len(pad) == 0 or len(pad) // 2 > x.dim() - 2:
        raise ValueError(f"vae_pad: pad {pad} must have 2, 4 (or 6 for 5-D) entries for a {x.dim()}-D tensor")
    if any(p < 0 for p in pad):
        raise ValueError(f"vae_pad: negative padding {pad} is not supported")
    if mode not in ("constant", "replicate"):
        raise ValueError(f"vae_pad: mode must be 'constant' or 'replicate', got {mode!r}")
    if mode == "replicate" and len(pad) // 2 != x.dim() - 2:
        raise ValueError(f"vae_pad: replicate padding of a {x.dim()}-D tensor needs {2 * (x.dim() - 2)} pad entries, got {len(pad)}")
    full = pad + (0,) * (6 - len(pad))
    if x.dim() == 4 and any(full[4:]):
        raise ValueError("vae_pad: a 4-D tensor has no temporal dim to pad")
    return full


def vae_pad_reference(x: torch.Tensor, pad, mode: str = "constant", value: float = 0.0) -> torch.Tensor:
    """torch.nn.functional.pad for 4-D/5-D tensors, constant or replicate, non-negative pads."""
    _pad_args(x, pad, mode)
    if mode == "replicate":
        return F.pad(x, tuple(int(p) for p in pad), mode="replicate")
    return F.pad(x, tuple(int(p) for p in pad), mode="constant", value=float(value))


def vae_pad_metal(lib, x: torch.Tensor, pad, mode: str = "constant", value: float = 0.0) -> torch.Tensor:
    wl, wr, hl, hr, tl, tr = _pad_args(x, pad, mode)
    if x.dtype not in MSL_TYPE or (mode == "replicate" and 0 in x.shape[2:]):
        return vae_pad_reference(x, pad, mode, value)
    xc = x.contiguous()
    if x.dim() == 4:
        n, c, h, w = xc.shape
        t = 1
    else:
        n, c, t, h, w = xc.shape
    ot, oh, ow = t + tl + tr, h + hl + hr, w + wl + wr
    out_shape = (n, c, oh, ow) if x.dim() == 4 else (n, c, ot, oh, ow)
    out = torch.empty(out_shape, dtype=x.dtype, device=x.device)
    total = out.numel()
    if total:
        threads = min(total, MAX_THREADS)
        kernel = getattr(lib, f"vae_pad_{MSL_TYPE[x.dtype]}")
        kernel(xc, out, total, t, h, w, ot, oh, ow, tl, hl, wl, int(mode == "replicate"), float(value),
               threads, threads=threads, group_size=GROUP)
    return out


def _pad_cases(device):
    gen = torch.Generator().manual_seed(1)
    cases = []
    for shape, pad, mode, dtype in [
        ((1, 3, 5, 7), (1, 2, 0, 3), "constant", torch.float32),
        ((2, 3, 3, 5, 7), (1, 1, 1, 1, 2, 0), "constant", torch.float16),
        ((1, 2, 3, 5, 9), (1, 1, 2, 1, 2, 0), "replicate", torch.float32),
        ((1, 5, 7, 3), (0, 1, 0, 1), "constant", torch.bfloat16),
        ((1, 3, 6, 5), (2, 1, 1, 2), "replicate", torch.float16),
    ]:
        x = torch.randn(shape, generator=gen).to(dtype).to(device)
        cases.append(((x, pad), {"mode": mode, "value": 0.5 if mode == "constant" and dtype != torch.float32 else 0.0}))
    return cases


vae_pad = register(KernelSpec(
    name="vae_pad",
    source="vae.metal",
    entry_points={f"vae_pad_{t}": ("tensor", "tensor") + ("int",) * 11 + ("float", "int")
                  for t in MSL_TYPE.values()},
    reference=vae_pad_reference,
    metal=vae_pad_metal,
    self_check_cases=_pad_cases,
    atol=0.0,
    rtol=0.0,
))


# ---------------------------------------------------------------- feather blend-accumulate

def _blend_args(acc, tile, wy, wx, offset):
    if not (isinstance(acc, torch.Tensor) and acc.dtype == torch.float32):
        raise TypeError(f"vae_blend_accumulate: the accumulator must be a float32 tensor, got "
                        f"{getattr(acc, 'dtype', type(acc).__name__)}")
    if acc.dim() not in (4, 5) or tile.dim() != acc.dim():
        raise ValueError(f"vae_blend_accumulate: accumulator {tuple(acc.shape)} and tile {tuple(tile.shape)} must both "
                         "be 4-D [N, C, H, W] or both 5-D [N, C, T, H, W]")
    if tile.shape[:2] != acc.shape[:2]:
        raise ValueError(f"vae_blend_accumulate: tile {tuple(tile.shape)} and accumulator {tuple(acc.shape)} differ in N or C")
    if wy.shape != (tile.shape[-2],) or wx.shape != (tile.shape[-1],):
        raise ValueError(f"vae_blend_accumulate: weights wy {tuple(wy.shape)} / wx {tuple(wx.shape)} must match the tile's "
                         f"height {tile.shape[-2]} and width {tile.shape[-1]}")
    offset = tuple(int(o) for o in offset)
    if len(offset) == 2:
        offset = (0,) + offset
    if len(offset) != 3 or (acc.dim() == 4 and offset[0] != 0):
        raise ValueError(f"vae_blend_accumulate: offset must be (y0, x0) or (t0, y0, x0), got {offset}")
    t0, y0, x0 = offset
    tt = tile.shape[2] if tile.dim() == 5 else 1
    at = acc.shape[2] if acc.dim() == 5 else 1
    if min(offset) < 0 or t0 + tt > at or y0 + tile.shape[-2] > acc.shape[-2] or x0 + tile.shape[-1] > acc.shape[-1]:
        raise ValueError(f"vae_blend_accumulate: tile {tuple(tile.shape)} at {offset} does not fit in {tuple(acc.shape)}")
    return t0, y0, x0


def vae_blend_accumulate_reference(acc: torch.Tensor, tile: torch.Tensor, wy: torch.Tensor, wx: torch.Tensor,
                                   offset=(0, 0)) -> torch.Tensor:
    """acc[..., t0:, y0:, x0:] += tile * wy[:, None] * wx[None, :] in float32 (in place); returns acc."""
    t0, y0, x0 = _blend_args(acc, tile, wy, wx, offset)
    h, w = tile.shape[-2:]
    weight = wy.float()[:, None] * wx.float()[None, :]
    if acc.dim() == 5:
        region = acc[:, :, t0:t0 + tile.shape[2], y0:y0 + h, x0:x0 + w]
    else:
        region = acc[:, :, y0:y0 + h, x0:x0 + w]
    region.add_(tile.float() * weight)
    return acc


def vae_blend_accumulate_metal(lib, acc, tile, wy, wx, offset=(0, 0)):
    t0, y0, x0 = _blend_args(acc, tile, wy, wx, offset)
    if tile.dtype not in MSL_TYPE:
        return vae_blend_accumulate_reference(acc, tile, wy, wx, offset)
    target = acc if acc.is_contiguous() else acc.contiguous()
    tc = tile.contiguous()
    wyc = wy.to(device=acc.device, dtype=torch.float32).contiguous()
    wxc = wx.to(device=acc.device, dtype=torch.float32).contiguous()
    total = tc.numel()
    if total:
        tt = tc.shape[2] if tc.dim() == 5 else 1
        at = target.shape[2] if target.dim() == 5 else 1
        threads = min(total, MAX_THREADS)
        kernel = getattr(lib, f"vae_blend_accumulate_{MSL_TYPE[tile.dtype]}")
        kernel(target, tc, wyc, wxc, total, tt, tc.shape[-2], tc.shape[-1], at, target.shape[-2], target.shape[-1],
               t0, y0, x0, threads, threads=threads, group_size=GROUP)
    if target is not acc:
        acc.copy_(target)
    return acc


def _blend_cases(device):
    gen = torch.Generator().manual_seed(2)
    cases = []
    for acc_shape, tile_shape, offset, dtype in [
        ((1, 3, 11, 13), (1, 3, 5, 7), (3, 6), torch.float32),
        ((2, 3, 5, 9, 7), (2, 3, 3, 4, 5), (1, 5, 2), torch.float16),
        ((1, 1, 6, 5), (1, 1, 6, 5), (0, 0), torch.bfloat16),
    ]:
        acc = torch.randn(acc_shape, generator=gen).to(device)
        tile = torch.randn(tile_shape, generator=gen).to(dtype).to(device)
        wy = torch.rand(tile_shape[-2], generator=gen).to(device)
        wx = torch.rand(tile_shape[-1], generator=gen).to(device)
        cases.append(((acc, tile, wy, wx), {"offset": offset}))
    return cases


vae_blend_accumulate = register(KernelSpec(
    name="vae_blend_accumulate",
    source="vae.metal",
    entry_points={f"vae_blend_accumulate_{t}": ("tensor",) * 4 + ("int",) * 11 for t in MSL_TYPE.values()},
    reference=vae_blend_accumulate_reference,
    metal=vae_blend_accumulate_metal,
    self_check_cases=_blend_cases,
    atol=1e-5,
    rtol=1e-5,
    writes=("acc",),
))
