"""Exact low-memory encode: a KL encoder's down path one stage at a time over the whole image.

The encoder's counterpart of stagewise.py (read it first). The down path is a chain of stages whose
reach is one row each: conv_in, the two halves of each ResNet block (norm -> SiLU -> 3x3 conv), and each
level's downsample (a 3x3 stride-2 convolution after a one-pixel zero pad on the bottom and right). Each
stage runs over the whole image in bands of rows -- a downsample's band of output rows reads twice as many
input rows plus one -- and writes a whole-image buffer whose per-group GroupNorm moments are summed as it
is written, so every GroupNorm uses the whole image's statistics and each convolution runs once over the
image (plus a row per band edge): one pass, the same activations as the untiled encoder up to rounding
(and the buffers' fp16 rounding when the budget needs it). The rest of the encoder (its mid block with
the global attention, norm_out, conv_out, quant_conv, the posterior's mode) then runs once over the
latent-resolution buffer (encode_rest.py).

Stages come from the encoder's own modules (ComfyUI's `Encoder`, diffusers' `Encoder`) after checking each
is what the chain assumes; anything else (attention in the down path, other norms) gives None and the
engine uses tiles.
"""
from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F

from .shared_stats import GroupMoments
from .stagewise import StagePlan, StagewiseDecode, _bands, _Buffer, _checked, _resnet_cost, _same_conv_halo, \
    comfy_resnet_stage, diffusers_resnet_stage


@dataclasses.dataclass
class InStage:
    conv: torch.nn.Conv2d
    kind = "in"


@dataclasses.dataclass
class DownStage:
    conv: torch.nn.Conv2d     # 3x3, stride 2, no padding: the input is zero-padded by one on the bottom/right
    kind = "down"


def _down_ok(conv) -> bool:
    return isinstance(conv, torch.nn.Conv2d) and conv.kernel_size == (3, 3) and conv.stride == (2, 2) \
        and conv.padding == (0, 0) and conv.dilation == (1, 1)


def _checked_body(stages):
    if any(s is None for s in stages):
        return None
    first, rest = stages[0], stages[1:]
    if first.kind != "in" or _same_conv_halo(first.conv) != 1:
        return None
    if any(s.kind == "down" and not _down_ok(s.conv) for s in rest):
        return None
    return stages if _checked([s for s in rest if s.kind == "resnet"]) is not None else None


def comfy_body_stages(enc) -> list | None:
    """Stages of ComfyUI's 2-D `Encoder` before its mid block (conv_in and the down levels), or None."""
    import sys

    act = getattr(sys.modules.get(type(enc).__module__), "nonlinearity", None)
    if act is None or not hasattr(enc, "down") or getattr(enc, "carried", False):
        return None
    stages = [InStage(enc.conv_in)]
    for level in range(enc.num_resolutions):
        if len(enc.down[level].attn) > 0:
            return None
        for block in enc.down[level].block:
            stages.append(comfy_resnet_stage(block, act))
        if level != enc.num_resolutions - 1:
            down = enc.down[level].downsample
            if type(down).__name__ != "Downsample" or not down.with_conv:
                return None
            stages.append(DownStage(down.conv))
    return _checked_body(stages)


def diffusers_body_stages(enc) -> list | None:
    """Stages of diffusers' `Encoder` before its mid block (DownEncoderBlock2D chains), or None."""
    stages = [InStage(enc.conv_in)]
    for block in enc.down_blocks:
        if type(block).__name__ != "DownEncoderBlock2D":
            return None
        stages += [diffusers_resnet_stage(r) for r in block.resnets]
        for d in block.downsamplers or []:
            if type(d).__name__ != "Downsample2D" or d.norm is not None or not d.use_conv or d.padding != 0:
                return None
            stages.append(DownStage(d.conv))
    return _checked_body(stages)


class StagewiseEncode(StagewiseDecode):
    """Runs the body `stages` over whole-image pixels [N, 3, H, W] -> the body's output at latent resolution.
    `prepare`: the VAE's input transform (ComfyUI's process_input), applied to each band of pixels read."""

    def __init__(self, stages, device, dtype, workspace_factor: float = 1.0, prepare=None):
        super().__init__(stages, device, dtype, workspace_factor)
        self.prepare = prepare or (lambda t: t)

    def _stage_cost(self, i, s, inp, out, n, sb, esize):
        """As StagewiseDecode._stage_cost (whose plan() this chain uses: fp32 buffers when the chain fits with
        them, else 2-byte ones; band rows of each stage's output the most that fit next to its buffers). The
        input pixels are not counted (they exist before the encode); the last buffer is (the rest of the
        encoder reads it)."""
        (ci, h, w), (co, ho, wo) = inp, out
        if s.kind == "resnet":
            return (*_resnet_cost(s, ci, co, h, w, n, sb, esize, in_place_ok=True), ho)
        if s.kind == "down":
            return (n * sb * (ci * h * w + co * ho * wo),
                    (2 * 2 * ci + 2 * co) * n * wo * esize,      # 2 input rows (padded copy) + output
                    ho * wo * ci * co * 9, ho)
        return n * co * h * w * sb, (2 * ci + 2 * co) * n * w * esize, h * w * ci * co * 9, ho

    def run(self, x: torch.Tensor, plan: StagePlan, out_device=None) -> torch.Tensor:
        buf = _Buffer.wrap(x.to(self.device))          # the pixels: read only
        stats = None
        for i, s in enumerate(self.stages):
            rows = plan.rows[i]
            if s.kind == "in":
                buf, stats = self._in(s, buf, rows, plan.store_dtype)
            elif s.kind == "resnet":
                if stats is None:
                    stats = self._moments(buf.t, s, rows)
                buf, stats = self._resnet(s, buf, stats, rows, plan.store_dtype)
            else:
                buf, stats = self._down(s, buf, rows, plan.store_dtype)
        return buf.t

    def _next_groups(self, s):
        i = next(k for k, t in enumerate(self.stages) if t is s)
        nxt = self.stages[i + 1] if i + 1 < len(self.stages) else None
        return nxt.norm1.num_groups if nxt is not None and nxt.kind == "resnet" else None

    def _in(self, s: InStage, x: _Buffer, rows, store):
        n, _, hh, ww = x.t.shape
        out = _Buffer((n, s.conv.out_channels, hh, ww), store, x.t.device)
        mo = GroupMoments()
        groups = self._next_groups(s)
        for r0, r1 in _bands(hh, rows):
            t, a = self._read(x, r0, r1, 1)
            t = s.conv(self.prepare(t))[..., r0 - a:r1 - a, :]
            mo.add(t, groups)
            out.write(r0, r1, t)
            self.bands_run += 1
        return out, mo.final()

    def _down(self, s: DownStage, x: _Buffer, rows, store):
        n, _, hh, ww = x.t.shape
        ho, wo = hh // 2, ww // 2
        out = _Buffer((n, s.conv.out_channels, ho, wo), store, x.t.device)
        mo = GroupMoments()
        groups = self._next_groups(s)
        for r0, r1 in _bands(ho, rows):
            b = min(hh, 2 * r1 + 1)
            t = x.t[..., 2 * r0:b, :].to(self.dtype)
            t = s.conv(F.pad(t, (0, 1, 0, 1 if b == hh else 0)))          # the bottom pad only at the image's end
            mo.add(t, groups)
            out.write(r0, r1, t)
            self.bands_run += 1
        return out, mo.final()
