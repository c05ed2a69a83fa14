"""Kernels of the tiled low-memory VAE: 4-D/5-D constant and replicate padding, and the feather
blend-accumulate of a decoded tile into an fp32 accumulator."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from . import source
from .dtypes import MSL_TYPE
from .registry import KernelSpec, register

__all__ = ["vae_pad", "vae_blend_accumulate"]

GROUP = 256             # threads of a threadgroup: 32 columns x 8 rows
MAX_OFFSET = 1 << 32    # the kernels' offsets are 32-bit: a launch covers planes of fewer elements than this
PAD_PARAMS = source.Params("vae_pad_params", "planes in_t in_h in_w out_t out_h out_w pad_t pad_h pad_w replicate")
PAD_PLANES = 8          # planes a vae_pad thread takes (its index set-up shared by them)
BLEND_PARAMS = source.Params("vae_blend_params", "tile_t tile_h tile_w acc_t acc_h acc_w t0 y0 x0")


def _plane_launches(kernel, planes: int, plane_elems: int, w: int, h: int, args, per_thread: int = 1):
    """Launch kernel over (w, h, planes / per_thread) in runs of planes whose elements fit the 32-bit offsets:
    `args(p0, p1)` gives the arguments of planes p0..p1 (views starting at plane p0)."""
    per = (MAX_OFFSET - 1) // max(1, plane_elems)
    if per < 1:
        raise ValueError(f"vae: a plane of {plane_elems} elements exceeds the kernels' 32-bit offsets")
    gx = min(32, w)
    group = (gx, max(1, min(h, GROUP // gx)), 1)
    for p0 in range(0, planes, per):
        p1 = min(planes, p0 + per)
        kernel(*args(p0, p1), threads=(w, h, -(-(p1 - p0) // per_thread)), group_size=group)


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
    if x.dtype not in MSL_TYPE or 0 in x.shape[2:]:      # an empty plane: nothing to read, F.pad's answer
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
    if out.numel():
        src, dst = xc.view(n * c, t * h * w), out.view(n * c, ot * oh * ow)
        kernel = getattr(lib, f"vae_pad_{MSL_TYPE[x.dtype]}")

        def args(p0, p1):
            return src[p0:p1], dst[p0:p1], float(value), PAD_PARAMS.pack(
                planes=p1 - p0, in_t=t, in_h=h, in_w=w, out_t=ot, out_h=oh, out_w=ow, pad_t=tl, pad_h=hl, pad_w=wl,
                replicate=int(mode == "replicate"))
        _plane_launches(kernel, n * c, ot * oh * ow, ow, oh, args, PAD_PLANES)
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
    entry_points={f"vae_pad_{t}": ("tensor", "tensor", "float", "int[]") for t in MSL_TYPE.values()},
    instantiate={f"vae_pad_{t}": f"vae_pad<{t}>" for t in MSL_TYPE.values()},
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
    if tc.numel():
        tt = tc.shape[2] if tc.dim() == 5 else 1
        at = target.shape[2] if target.dim() == 5 else 1
        (h, w), (ah, aw) = tc.shape[-2:], target.shape[-2:]
        planes = tc.shape[0] * tc.shape[1]
        src, dst = tc.view(planes, tt * h * w), target.view(planes, at * ah * aw)
        params = BLEND_PARAMS.pack(tile_t=tt, tile_h=h, tile_w=w, acc_t=at, acc_h=ah, acc_w=aw, t0=t0, y0=y0, x0=x0)
        _plane_launches(getattr(lib, f"vae_blend_accumulate_{MSL_TYPE[tile.dtype]}"), planes, at * ah * aw, w, h,
                        lambda p0, p1: (dst[p0:p1], src[p0:p1], wyc, wxc, params))
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
    entry_points={f"vae_blend_accumulate_{t}": ("tensor",) * 4 + ("int[]",) for t in MSL_TYPE.values()},
    instantiate={f"vae_blend_accumulate_{t}": f"vae_blend_accumulate<{t}>" for t in MSL_TYPE.values()},
    reference=vae_blend_accumulate_reference,
    metal=vae_blend_accumulate_metal,
    self_check_cases=_blend_cases,
    atol=1e-5,
    rtol=1e-5,
    writes=("acc",),
))
