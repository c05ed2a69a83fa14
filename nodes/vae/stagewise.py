"""Exact low-memory decode of a KL decoder's up path, one stage at a time over the whole image.

Why not tiles with a halo: a tile of the up path is exact (with the whole image's GroupNorm statistics)
only where its zero padding is farther away than the receptive field of everything after the mid block,
~12 latent px on the SD decoder (six 3x3 convolutions at each of four resolutions plus the upsamplers).
Cores cut from tiles therefore need a halo of ~12 latent px on every side: at a small budget the tiles
are small and most of each one is halo (the lock-step engine ran 13 px tiles with a 4 px overlap at
ComfyUI's tiled peak and measured 32.7 dB), and a halo that large costs several passes' worth of work.

The cheaper exact scheme: the decoder is a chain of *stages* whose spatial reach is one pixel each (a
ResNet block's two halves, norm -> SiLU -> 3x3 conv; a nearest 2x upsample + 3x3 conv; norm_out ->
SiLU -> conv_out). Each stage runs over the whole image in bands of rows, reading its input band with a
one-row halo, and writes its output into a whole-image buffer (the stage's input and output buffers are
the only whole-image tensors alive; fp32 when the budget holds them, else fp16 -- bf16 where a value is
out of fp16's range). So a band's halo is one row of its own stage, not the receptive field of the whole
tail: each convolution runs once over the image plus 2 rows per band, i.e. one pass. GroupNorm
statistics are exact: a GroupNorm's input is a buffer produced by the previous stage, whose per-group
count/mean/M2 were accumulated band by band as it was written (fp32 per band, combined in float64).
The result equals the untiled decode up to float rounding (and the buffers' fp16 rounding when the
budget needs it).

Stages are built from the decoder's own modules (ComfyUI's `Decoder`, diffusers' `Decoder`) after
checking each is what the chain assumes (GroupNorm, stride-1 'same' convolutions, nearest 2x
upsampling); anything else (attention in the up path, other norms) gives None and the engine uses its
tiled paths.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable

import torch

from .shared_stats import GroupMoments, group_norm_with

# Working memory of a band, in units of (band rows + 2 halo rows) x width x element size, per channel:
# ResNet half A: input, norm/SiLU, conv output, statistics temporary; half B adds the shortcut and sum.
# Upsample: input, the 2x interpolation (4 x area), conv output and its statistics temporary (4 x area).
BAND_FACTOR = {"resnet_a": (2, 2), "resnet_b": (1, 5), "upsample": (5, 8), "out": (2, 2)}
STATS_OVERHEAD = 1.1    # the planner's time of a stage-wise decode vs one plain pass, before halos:
                        # GroupNorm statistics and the buffers' dtype conversions (measured on CPU)


def _same_conv_halo(conv) -> int | None:
    """Rows of reach of a stride-1 'same' 2-D convolution (k = 2 * padding + 1), None otherwise."""
    if not isinstance(conv, torch.nn.Conv2d):
        return None
    k, p, s, d = conv.kernel_size, conv.padding, conv.stride, conv.dilation
    if isinstance(p, str) or s != (1, 1) or d != (1, 1) or k[0] != 2 * p[0] + 1 or k[1] != 2 * p[1] + 1:
        return None
    return p[0]


@dataclasses.dataclass
class ResnetStage:
    norm1: torch.nn.GroupNorm
    conv1: torch.nn.Conv2d
    norm2: torch.nn.GroupNorm
    conv2: torch.nn.Conv2d
    shortcut: torch.nn.Conv2d | None
    act: Callable
    out_scale: float = 1.0
    kind = "resnet"


@dataclasses.dataclass
class UpsampleStage:
    module: Callable          # x -> nearest 2x upsample, then a 3x3 'same' conv
    conv: torch.nn.Conv2d
    kind = "upsample"


@dataclasses.dataclass
class OutStage:
    norm: torch.nn.GroupNorm
    act: Callable
    conv: torch.nn.Conv2d
    tanh: bool = False
    kind = "out"


def _checked(stages):
    """The stages, or None when a module breaks the one-row-reach assumption (or was not a stage: None)."""
    if any(s is None for s in stages):
        return None
    for s in stages:
        norms = [s.norm1, s.norm2] if s.kind == "resnet" else [s.norm] if s.kind == "out" else []
        if not all(isinstance(n, torch.nn.GroupNorm) for n in norms):
            return None
        convs = [s.conv1, s.conv2] if s.kind == "resnet" else [s.conv]
        if any(_same_conv_halo(c) not in (0, 1) for c in convs):
            return None
        if s.kind == "resnet" and s.shortcut is not None and _same_conv_halo(s.shortcut) != 0:
            return None
    return stages


def comfy_resnet_stage(block, act) -> ResnetStage | None:
    """A ComfyUI `ResnetBlock` as a stage (None for another module or a 3x3 conv shortcut)."""
    if type(block).__name__ != "ResnetBlock" or getattr(block, "use_conv_shortcut", False):
        return None
    return ResnetStage(block.norm1, block.conv1, block.norm2, block.conv2, getattr(block, "nin_shortcut", None), act)


def diffusers_resnet_stage(r) -> ResnetStage | None:
    """A diffusers `ResnetBlock2D` without resampling as a stage (None otherwise)."""
    if type(r).__name__ != "ResnetBlock2D" or r.upsample is not None or r.downsample is not None:
        return None
    return ResnetStage(r.norm1, r.conv1, r.norm2, r.conv2, r.conv_shortcut, r.nonlinearity, float(r.output_scale_factor))


def comfy_tail_stages(dec) -> list | None:
    """Stages of ComfyUI's 2-D `Decoder` after its mid block (`_comfy_kl_split`'s tail), or None."""
    import sys

    act = getattr(sys.modules.get(type(dec).__module__), "nonlinearity", None)
    if act is None or not hasattr(dec, "up") or not hasattr(dec, "norm_out"):
        return None
    stages = []
    for level in reversed(range(dec.num_resolutions)):
        if len(dec.up[level].attn) > 0:
            return None
        for block in dec.up[level].block:
            stages.append(comfy_resnet_stage(block, act))
        if level != 0:
            up = dec.up[level].upsample
            if type(up).__name__ != "Upsample" or not up.with_conv or up.scale_factor not in (2, 2.0):
                return None
            stages.append(UpsampleStage(up, up.conv))
    stages.append(OutStage(dec.norm_out, act, dec.conv_out, tanh=bool(getattr(dec, "tanh_out", False))))
    return _checked(stages)


def diffusers_tail_stages(dec) -> list | None:
    """Stages of diffusers' `Decoder` after its mid block (UpDecoderBlock2D chains), or None."""
    stages = []
    for up_block in dec.up_blocks:
        if type(up_block).__name__ != "UpDecoderBlock2D":
            return None
        stages += [diffusers_resnet_stage(r) for r in up_block.resnets]
        for u in up_block.upsamplers or []:
            if type(u).__name__ != "Upsample2D" or u.norm is not None or u.use_conv_transpose \
                    or not u.interpolate or not u.use_conv or u.name != "conv":
                return None
            stages.append(UpsampleStage(u, u.conv))
    if getattr(dec, "conv_norm_out", None) is None or type(dec.conv_norm_out).__name__ != "GroupNorm":
        return None
    return _checked(stages + [OutStage(dec.conv_norm_out, dec.conv_act, dec.conv_out)])


class _Buffer:
    """A whole-image activation written band by band: fp32 (the compute dtype), or 2-byte storage that
    starts as fp16 and turns into bf16 in place (same bytes, chunk by chunk) the first time a band is out
    of fp16's range."""

    def __init__(self, shape, dtype, device):
        self.t = torch.empty(shape, dtype=dtype, device=device)

    @classmethod
    def wrap(cls, t):
        """An existing tensor, read only (the head's output: kept intact so that a failed stage-wise run
        can fall back to tiles from it)."""
        b = cls.__new__(cls)
        b.t, b.readonly = t, True
        return b

    readonly = False

    def write(self, r0, r1, band):
        if self.t.dtype == torch.float16 and band.numel() and max(abs(float(v)) for v in torch.aminmax(band)) >= 60000.0:
            # Every row, not only those written so far: an in-place ResNet stage writes into its own input
            # buffer, whose rows below this band still hold the fp16 input that later bands read.
            bf = self.t.view(torch.bfloat16)
            rows = self.t.shape[-2]
            step = max(1, rows // 16)
            for a in range(0, rows, step):
                b = min(rows, a + step)
                bf[..., a:b, :] = self.t[..., a:b, :].to(torch.bfloat16)
            self.t = bf
        self.t[..., r0:r1, :] = band

    @property
    def nbytes(self):
        return self.t.numel() * self.t.element_size()


def _bands(rows_total: int, rows: int):
    for r0 in range(0, rows_total, rows):
        yield r0, min(rows_total, r0 + rows)


@dataclasses.dataclass
class StagePlan:
    store_dtype: torch.dtype
    rows: list[int]               # band rows per stage (input resolution)
    peak: int                     # predicted peak bytes (whole-image buffers + the largest band's work)
    work: float                   # predicted time in plain passes of the tail (>= 1)


def _resnet_cost(s, ci, co, h, w, n, sb, esize, in_place_ok: bool):
    """(resident bytes, working bytes per band row, multiply-adds) of a ResNet stage: its input and output
    buffers (one when it writes in place: same width, no shortcut, an input it may overwrite) and a band's
    working set of its two halves."""
    in_place = in_place_ok and ci == co and s.shortcut is None
    resident = n * h * w * sb * (ci + co + (0 if in_place else co))
    per_row = max(sum(f * c for f, c in zip(BAND_FACTOR["resnet_a"], (ci, co))),
                  BAND_FACTOR["resnet_b"][1] * co + ci) * n * w * esize
    return resident, per_row, h * w * (ci * co + co * co) * 9


class StagewiseDecode:
    """Runs `stages` over a whole-image head output `h` [N, C, H, W] (see the module docstring)."""

    def __init__(self, stages, device, dtype, workspace_factor: float = 1.0):
        self.stages = stages
        self.device, self.dtype = torch.device(device), dtype
        self.workspace = workspace_factor
        self.bands_run = 0

    # ---- planning

    def _shapes(self, shape):
        """(stage, input (C, H, W), output (C, H, W)) along the chain."""
        n, c, h, w = shape
        out = []
        for s in self.stages:
            if s.kind == "resnet":
                o = (s.conv2.out_channels, h, w)
            elif s.kind == "upsample":
                o = (s.conv.out_channels, 2 * h, 2 * w)
            elif s.kind == "down":                      # the encoder's downsample (stagewise_encode.py)
                o = (s.conv.out_channels, h // 2, w // 2)
            else:
                o = (s.conv.out_channels, h, w)
            out.append((s, (c, h, w), o))
            c, h, w = o
        return out

    def plan(self, shape, budget: float) -> StagePlan | None:
        """Buffers in fp32 if the whole chain fits the budget with them, else in 2-byte storage; the band
        rows of each stage are the most that fit next to its buffers. None when even one-row bands with
        2-byte buffers do not fit."""
        n = shape[0]
        esize = torch.empty(0, dtype=self.dtype).element_size()
        for store in ((self.dtype, torch.float16) if self.dtype == torch.float32 else (self.dtype,)):
            sb = torch.empty(0, dtype=store).element_size()
            rows, peak, work, flops = [], 0.0, 0.0, 0.0
            for i, (s, inp, out) in enumerate(self._shapes(shape)):
                resident, per_row, cost, band_rows = self._stage_cost(i, s, inp, out, n, sb, esize)
                per_row *= self.workspace
                r = int((budget - resident) // per_row) - 2 if per_row > 0 else band_rows
                if r < 1:
                    break
                r = min(r, band_rows)
                r = math.ceil(band_rows / math.ceil(band_rows / r))          # balanced bands
                rows.append(r)
                peak = max(peak, resident + per_row * (r + 2))
                flops += cost
                work += cost * (1 + 2 * math.ceil(band_rows / r) / band_rows)
            else:
                return StagePlan(store, rows, int(peak), STATS_OVERHEAD * work / max(flops, 1.0))
        return None

    def _stage_cost(self, i, s, inp, out, n, sb, esize):
        """(resident bytes, working bytes per band row, multiply-adds, rows the bands split) of stage i with
        input (C, H, W) `inp` and output `out`, buffers of `sb` bytes and compute of `esize` bytes an element
        (bands of an upsample count its input rows)."""
        (ci, h, w), (co, ho, wo) = inp, out
        if s.kind == "resnet":
            return (*_resnet_cost(s, ci, co, h, w, n, sb, esize, in_place_ok=i > 0), h)
        if s.kind == "upsample":
            return (n * sb * (ci * h * w + co * ho * wo),
                    sum(f * c for f, c in zip(BAND_FACTOR["upsample"], (ci, co))) * n * w * esize,
                    ho * wo * ci * co * 9, h)
        return (n * h * w * sb * ci, sum(f * c for f, c in zip(BAND_FACTOR["out"], (ci, co))) * n * w * esize,
                h * w * ci * co * 9, h)

    # ---- running

    def run(self, h: torch.Tensor, plan: StagePlan, out_device) -> torch.Tensor:
        x = _Buffer.wrap(h.to(self.device))        # the head's output (latent resolution): kept as it is
        stats_of = None
        out = None
        for i, s in enumerate(self.stages):
            last = i == len(self.stages) - 1
            rows = plan.rows[i]
            if stats_of is None and s.kind != "upsample":
                stats_of = self._moments(x.t, s, rows)
            if s.kind == "resnet":
                x, stats_of = self._resnet(s, x, stats_of, rows, plan.store_dtype)
            elif s.kind == "upsample":
                x, stats_of = self._upsample(s, x, rows, plan.store_dtype)
            else:
                out = self._out(s, x, stats_of, rows, out_device)
            if last and out is None:
                raise RuntimeError("stage-wise decode: the chain does not end with the output stage")
        return out

    def _moments(self, t, stage, rows):
        norm = stage.norm1 if stage.kind == "resnet" else getattr(stage, "norm", None)
        if norm is None:
            return None
        m = GroupMoments()
        for r0, r1 in _bands(t.shape[-2], rows):
            m.add(t[..., r0:r1, :].to(self.dtype), norm.num_groups)
        return m.final()

    def _read(self, buf, r0, r1, halo):
        rows = buf.t.shape[-2]
        a, b = max(0, r0 - halo), min(rows, r1 + halo)
        return buf.t[..., a:b, :].to(self.dtype), a

    def _resnet(self, s: ResnetStage, x: _Buffer, stats_x, rows, store):
        n, _, hh, ww = x.t.shape
        co = s.conv2.out_channels
        y = _Buffer((n, s.conv1.out_channels, hh, ww), store, x.t.device)
        my = GroupMoments()
        for r0, r1 in _bands(hh, rows):
            t, a = self._read(x, r0, r1, 1)
            t = s.conv1(s.act(group_norm_with(s.norm1, t, stats_x)))[..., r0 - a:r1 - a, :]
            my.add(t, s.norm2.num_groups)
            y.write(r0, r1, t)
            self.bands_run += 1
        del t
        stats_y = my.final()
        in_place = x.t.shape[1] == co and s.shortcut is None and not x.readonly
        out = x if in_place else _Buffer((n, co, hh, ww), store, x.t.device)
        mo = GroupMoments()
        for r0, r1 in _bands(hh, rows):
            t, a = self._read(y, r0, r1, 1)
            t = s.conv2(s.act(group_norm_with(s.norm2, t, stats_y)))[..., r0 - a:r1 - a, :]
            sc = x.t[..., r0:r1, :].to(self.dtype)
            if s.shortcut is not None:
                sc = s.shortcut(sc)
            t = sc + t
            if s.out_scale != 1.0:
                t = t / s.out_scale
            mo.add(t, self._next_groups(s))
            out.write(r0, r1, t)
            self.bands_run += 1
        return out, mo.final()

    def _next_groups(self, s):
        """Groups of the GroupNorm that reads this stage's output (None: the next stage is an upsample,
        whose output gets its own moments)."""
        i = next(k for k, t in enumerate(self.stages) if t is s)
        nxt = self.stages[i + 1] if i + 1 < len(self.stages) else None
        if nxt is None or nxt.kind == "upsample":
            return None
        return (nxt.norm1 if nxt.kind == "resnet" else nxt.norm).num_groups

    def _upsample(self, s: UpsampleStage, x: _Buffer, rows, store):
        n, c, hh, ww = x.t.shape
        out = _Buffer((n, s.conv.out_channels, 2 * hh, 2 * ww), store, x.t.device)
        mo = GroupMoments()
        groups = self._next_groups(s)
        for r0, r1 in _bands(hh, rows):
            t, a = self._read(x, r0, r1, 1)
            t = s.module(t)[..., 2 * (r0 - a):2 * (r1 - a), :]
            mo.add(t, groups)
            out.write(2 * r0, 2 * r1, t)
            self.bands_run += 1
        return out, mo.final()

    def _out(self, s: OutStage, x: _Buffer, stats_x, rows, out_device):
        n, _, hh, ww = x.t.shape
        img = torch.empty((n, s.conv.out_channels, hh, ww), dtype=torch.float32, device=out_device)
        for r0, r1 in _bands(hh, rows):
            t, a = self._read(x, r0, r1, 1)
            t = s.conv(s.act(group_norm_with(s.norm, t, stats_x)))[..., r0 - a:r1 - a, :]
            if s.tanh:
                t = torch.tanh(t)
            img[..., r0:r1, :] = t.to(img.device, torch.float32)
            self.bands_run += 1
        return img
