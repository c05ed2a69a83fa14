"""Exact low-memory decode and encode of HunyuanVideo 1.0's VAE, stage by stage over the whole frame.

ComfyUI builds this VAE as its SD Encoder/Decoder (comfy/ldm/modules/diffusionmodules/model.py) with carried
causal 3-D convolutions (`CarriedConv3d`, `conv_carry_causal_3d`): 16 latent channels, 8x spatial, 4x in time.
Unlike Wan's VAE it normalises with GroupNorm, whose statistics span a whole chunk of frames (every row of
every frame of it), and it pads with replicate padding in space and in time. Its decoder runs conv_in and the
mid block (attention over all latent frames as one sequence) once over the whole latent, then the up path on
chunks of two latent frames; its encoder runs the down path on pixel frame 0 alone, then on chunks of eight
frames, and the mid block, norm_out and conv_out once over all latent frames. Each causal convolution of a
chunk reads the last two frames of the previous chunk's input (its carry) before its own frames; the first
chunk replicates its first frame twice instead.

Here every stage runs over its chunk in bands of rows and writes a whole-chunk buffer, as for the Wan VAEs
(causal.py). A stage that starts with a GroupNorm first reads its input buffer once, band by band, for the
per-group moments (GroupMoments: fp32 per band, combined in float64), so every band is normalised with the
whole chunk's statistics. A ResNet block is two stages (norm1 -> SiLU -> conv1, then norm2 -> SiLU -> conv2
plus the block input, which the second stage writes into in place when it may). Each band reads its input
rows with the halo its 3x3 convolution reaches and replicates the frame's edge rows where the band touches
them; the carry is kept over the whole frame per convolution (two frames, written in place a band late).
So every frame equals ComfyUI's untiled run up to float rounding.

A convolution's input (the carry or the first frame twice, the band's frames, the replicated edge rows and
columns) is built in one tensor by indexing (`_join_pad`): no 5-D F.pad, which MPSGraph computes wrongly for
video tensors (pytorch #194922), and one copy of the band instead of ComfyUI's two.
"""
from __future__ import annotations

import dataclasses
import math
import sys

import torch
import torch.nn.functional as F

from .causal import CACHE_T, BandRunner, CausalPlan, _query_chunk, _weights, _writable
from .shared_stats import GroupMoments, group_norm_with
from .stagewise import _Buffer, _bands


# ---------------------------------------------------------------- stages


@dataclasses.dataclass
class GConv:
    """[GroupNorm -> SiLU ->] a carried causal (3, 3, 3) convolution, stride 1 or 2 in space and in time [+ the
    input kept by the stage before (a ResNet block's second half), through its 1x1x1 shortcut if it has one]."""
    conv: object                   # the CarriedConv3d's inner Conv3d
    norm: object = None
    keep: bool = False             # keep this stage's input for a later residual stage
    residual: bool = False
    shortcut: object = None        # the nin_shortcut's inner Conv3d (1x1x1)
    tanh: bool = False
    kind = "conv"

    def out_shape(self, c, t, h, w):
        st, ss = self.conv.stride[0], self.conv.stride[1]
        return self.conv.out_channels, (t + CACHE_T - 3) // st + 1, (h - 1) // ss + 1, (w - 1) // ss + 1


@dataclasses.dataclass
class GUp:
    """Upsample: nearest 2x in space [and in time, frame 0 of the first chunk once], then a carried 3x3x3
    convolution."""
    conv: object
    time: bool
    kind = "up"

    def out_shape(self, c, t, h, w, first=False):
        return self.conv.out_channels, (t if not self.time else 2 * t - 1 if first else 2 * t), 2 * h, 2 * w


@dataclasses.dataclass
class GAttn:
    """The mid block's AttnBlock: GroupNorm, 1x1x1 q/k/v, attention over every position of every frame as one
    sequence (queries in chunks under MPS's score limit), proj_out, added to its input in place."""
    block: object
    kind = "attn"

    def out_shape(self, c, t, h, w):
        return c, t, h, w


@dataclasses.dataclass
class HunyuanProgram:
    """HunyuanVideo 1.0's decoder or encoder: `whole` runs once over all (latent) frames, `chunked` chunk by chunk
    with carried convolutions (decode: whole then chunked; encode: chunked then whole)."""
    encode: bool
    whole: list
    chunked: list
    pre: object                    # decode: post_quant_conv (1x1x1 Conv3d)
    post: object                   # encode: quant_conv (1x1x1 Conv3d)
    regularize: object             # encode: the posterior's mode
    latent_channels: int
    time_compress: int = 4

    def frames_used(self, frames: int) -> int:
        """Input frames the encoder reads (ComfyUI's drops frames past 1 + 4k)."""
        return 1 + ((frames - 1) // self.time_compress) * self.time_compress if self.encode else frames

    def chunks(self, frames: int) -> list[tuple[int, int]]:
        """ComfyUI's chunks of the chunked part: (start, end) input frames."""
        if not self.encode:
            return [(a, min(frames, a + 2)) for a in range(0, frames, 2)]
        used, step = self.frames_used(frames), 2 * self.time_compress
        return [(0, 1)] + [(a, min(used, a + step)) for a in range(1, used, step)]

    def out_frames(self, frames: int) -> int:
        if self.encode:
            return 1 + (self.frames_used(frames) - 1) // self.time_compress
        return 1 + self.time_compress * (frames - 1)

    def runner(self, device, dtype, workspace_factor: float = 1.0, prepare=None):
        return HunyuanStages(self, device, dtype, workspace_factor, prepare)


# ---------------------------------------------------------------- building the program from ComfyUI's modules


def _name(m) -> str:
    return type(m).__name__


def _inner(conv, kernel=3):
    """A CarriedConv3d's inner Conv3d when it is the carried (kernel, kernel, kernel) convolution, else None."""
    if _name(conv) != "CarriedConv3d":
        return None
    c = conv.conv
    if tuple(c.kernel_size) != (kernel,) * 3 or tuple(c.padding) != (0, 0, 0) or tuple(c.dilation) != (1, 1, 1) \
            or c.groups != 1 or c.stride[1] != c.stride[2] or c.stride[1] not in (1, 2) or c.stride[0] not in (1, 2) \
            or (kernel == 1 and tuple(c.stride) != (1, 1, 1)):
        return None
    return c


def _gn(m) -> bool:
    return isinstance(m, torch.nn.GroupNorm) and m.affine


def _resnet(block, out):
    if _name(block) != "ResnetBlock" or getattr(block, "use_conv_shortcut", False) \
            or getattr(block, "temb_proj", None) is not None:
        return f"{_name(block)} is not a ResnetBlock without time embedding"
    c1, c2 = _inner(block.conv1), _inner(block.conv2)
    if c1 is None or c2 is None or c1.stride != (1, 1, 1) or c2.stride != (1, 1, 1) \
            or not (_gn(block.norm1) and _gn(block.norm2)):
        return "a ResnetBlock is not GroupNorm/SiLU/carried 3x3x3 convolution twice"
    short = None
    if block.in_channels != block.out_channels:
        short = _inner(getattr(block, "nin_shortcut", None), kernel=1)
        if short is None:
            return "a ResnetBlock's shortcut is not a 1x1x1 convolution"
    out += [GConv(c1, block.norm1, keep=True), GConv(c2, block.norm2, residual=True, shortcut=short)]
    return None


def _attn(block, out):
    if _name(block) != "AttnBlock" or not _gn(getattr(block, "norm", None)) or any(
            not isinstance(getattr(block, k, None), torch.nn.Conv3d) or tuple(getattr(block, k).kernel_size) != (1, 1, 1)
            for k in ("q", "k", "v", "proj_out")):
        return f"the mid block's {_name(block)} is not an AttnBlock with 1x1x1 projections"
    out.append(GAttn(block))
    return None


def _mid(mid, out):
    return _resnet(mid.block_1, out) or _attn(mid.attn_1, out) or _resnet(mid.block_2, out)


def program(fsm, encode: bool):
    """HunyuanVideo 1.0's decoder or encoder (ComfyUI's AutoencoderKL with carried 3-D convolutions) as a
    HunyuanProgram; a string naming what is not a stage this module knows otherwise."""
    part = getattr(fsm, "encoder" if encode else "decoder", None)
    dm = sys.modules.get(type(part).__module__)
    if part is None or not getattr(part, "carried", False) or getattr(dm, "conv_carry_causal_3d", None) is None:
        return "not ComfyUI's carried causal 3-D Encoder/Decoder"
    if getattr(fsm, "max_batch_size", None) or getattr(fsm, "bn", None) is not None:
        return "batch splitting or a latent batch norm"
    levels = part.down if encode else part.up
    if any(len(lv.attn) for lv in levels):
        return "attention outside the mid block"
    whole, chunked = [], []
    if encode:
        c = _inner(part.conv_in)
        if c is None or c.stride != (1, 1, 1):
            return "conv_in is not a carried 3x3x3 convolution"
        chunked.append(GConv(c))
        for i, lv in enumerate(part.down):
            for block in lv.block:
                why = _resnet(block, chunked)
                if why:
                    return why
            if i != part.num_resolutions - 1:
                d = _inner(getattr(lv.downsample, "conv", None))
                if d is None or d.stride[1] != 2 or not lv.downsample.with_conv:
                    return "a Downsample is not a carried stride-2 3x3x3 convolution"
                chunked.append(GConv(d))
        why = _mid(part.mid, whole)
        co = _inner(part.conv_out)
        if why or co is None or co.stride != (1, 1, 1) or not _gn(part.norm_out):
            return why or "norm_out/conv_out are not GroupNorm and a carried 3x3x3 convolution"
        whole.append(GConv(co, part.norm_out))
        post = getattr(fsm, "quant_conv", None)
        reg = getattr(fsm, "regularization", None)
        if not isinstance(post, torch.nn.Conv3d) or tuple(post.kernel_size) != (1, 1, 1) or not callable(reg):
            return "quant_conv is not a 1x1x1 Conv3d"
        return HunyuanProgram(True, whole, chunked, None, post, reg, latent_channels=post.out_channels // 2,
                              time_compress=2 ** sum(s.conv.stride[0] == 2 for s in chunked))
    c = _inner(part.conv_in)
    if c is None or c.stride != (1, 1, 1):
        return "conv_in is not a carried 3x3x3 convolution"
    whole.append(GConv(c))
    why = _mid(part.mid, whole)
    if why:
        return why
    for level in reversed(range(part.num_resolutions)):
        for block in part.up[level].block:
            why = _resnet(block, chunked)
            if why:
                return why
        if level != 0:
            up = part.up[level].upsample
            sf = up.scale_factor if isinstance(up.scale_factor, (tuple, list)) else (up.scale_factor,) * 3
            u = _inner(getattr(up, "conv", None))
            if not up.with_conv or u is None or u.stride != (1, 1, 1) or tuple(float(s) for s in sf) not in (
                    (2.0, 2.0, 2.0), (1.0, 2.0, 2.0)):
                return "an Upsample is not nearest 2x and a carried 3x3x3 convolution"
            chunked.append(GUp(u, time=float(sf[0]) == 2.0))
    co = _inner(part.conv_out)
    if co is None or co.stride != (1, 1, 1) or not _gn(part.norm_out):
        return "norm_out/conv_out are not GroupNorm and a carried 3x3x3 convolution"
    chunked.append(GConv(co, part.norm_out, tanh=bool(getattr(part, "tanh_out", False))))
    pre = getattr(fsm, "post_quant_conv", None)
    if not isinstance(pre, torch.nn.Conv3d) or tuple(pre.kernel_size) != (1, 1, 1):
        return "post_quant_conv is not a 1x1x1 Conv3d"
    return HunyuanProgram(False, whole, chunked, pre, None, None, latent_channels=pre.in_channels,
                          time_compress=2 ** sum(s.kind == "up" and s.time for s in chunked))


# ---------------------------------------------------------------- the runner


def _pointwise(conv, x):
    """A 1x1x1 Conv3d."""
    return F.conv3d(x, *_weights(conv, x))


def _join_pad(hist, act, top: int, bottom: int):
    """A carried convolution's input, as ComfyUI's conv_carry_causal_3d builds it: [the carry (or, at the start,
    the first frame twice), act] along time, replicate-padded by one column each side and by `top` / `bottom`
    rows (the band's frame edges). Built in one tensor by indexing: no 5-D F.pad (MPS: pytorch #194922)."""
    n, c, t, r, w = act.shape
    k = CACHE_T
    out = act.new_empty((n, c, k + t, r + top + bottom, w + 2))
    inner = out[:, :, :, top:top + r, 1:w + 1]
    inner[:, :, :k] = act[:, :, :1] if hist is None else hist
    inner[:, :, k:] = act
    out[:, :, :, top:top + r, 0] = out[:, :, :, top:top + r, 1]
    out[:, :, :, top:top + r, w + 1] = out[:, :, :, top:top + r, w]
    if top:
        out[:, :, :, 0] = out[:, :, :, 1]
    if bottom:
        out[:, :, :, -1] = out[:, :, :, -2]
    return out


def _carry_rows(tin, r0, r1):
    """The next chunk's carry from a joined input: its last two frames, rows r0:r1, without the padded columns."""
    return tin[:, :, -CACHE_T:, r0:r1, 1:-1]


def _up2(x, time: bool, first: bool):
    """Nearest 2x in space [and in time: frame 0 of the first chunk once, as ComfyUI's Upsample]."""
    if time:
        idx = torch.arange(x.shape[2], device=x.device).repeat_interleave(2)
        x = x.index_select(2, idx[1:] if first else idx)
    n, c, t, h, w = x.shape
    return x[:, :, :, :, None, :, None].expand(n, c, t, h, 2, w, 2).reshape(n, c, t, 2 * h, 2 * w)


class HunyuanStages(BandRunner):
    """Runs a HunyuanProgram over a whole latent (decode) or video (encode) per its CausalPlan."""

    # ---- planning

    def _segments(self, x_shape):
        """[([(stage, (C, T, H, W) in, out)] over the largest chunk, whether it reads carries, whether it is the
        chunked part)] in run order, and the shape held beside the chunked part (decode: the mid output; encode:
        the chunks' outputs)."""
        prog = self.prog
        n, c, frames, h, w = x_shape
        chunks = prog.chunks(frames)

        def walk(stages, c, t, h, w, first):
            out = []
            for s in stages:
                o = s.out_shape(c, t, h, w, first=first) if s.kind == "up" else s.out_shape(c, t, h, w)
                out.append((s, (c, t, h, w), o))
                c, t, h, w = o
            return out, (c, t, h, w)

        big, single = max(b - a for a, b in chunks), len(chunks) == 1
        if prog.encode:
            ch, (co, _, ho, wo) = walk(prog.chunked, c, big, h, w, single)
            lat = (co, prog.out_frames(frames), ho, wo)        # every chunk's output, joined in time
            wh, _ = walk(prog.whole, *lat, True)
            return [(ch, not single, True), (wh, False, False)], lat
        wh, mid = walk(prog.whole, prog.pre.out_channels, frames, h, w, True)
        ch, _ = walk(prog.chunked, mid[0], big, h, w, single)
        return [(wh, False, False), (ch, not single, True)], mid

    def _stage_cost(self, s, inp, out, n, sb, esize):
        """(output buffer bytes, working bytes per band row, multiply-adds, band rows, carry bytes) of a stage on a
        chunk (C, T, H, W) `inp` -> `out`, following the band code below: the input rows (a copy when the buffers'
        dtype is not the compute dtype), the GroupNorm's output, the carry and the frames joined and padded, the
        convolution's output [and the shortcut's]."""
        (ci, t, h, w), (co, to, ho, wo) = inp, out
        out_bytes = n * co * to * ho * wo * sb
        copy = ci * t if sb != esize else 0
        if s.kind == "attn":
            seq = t * h * w
            frame = n * esize * ci * seq * 5 + n * _query_chunk(n, seq) * seq * esize
            return frame, 0, seq * ci * ci * 4 + 2 * seq * seq * ci, h, 0
        if s.kind == "up":             # per input row: 4 output pixels an input pixel
            tu = to
            up = 4 * ci * tu
            per_row = copy + max(ci * t + up, up + 4 * ci * (tu + CACHE_T), 4 * ci * (tu + CACHE_T) + 4 * co * tu)
            cache = n * ci * CACHE_T * ho * wo * sb
            return out_bytes, n * w * esize * per_row, to * ho * wo * ci * co * 27, h, cache
        k = 2 if s.conv.stride[1] == 2 else 1       # input rows an output row reads
        act = k * ci * t
        tin = k * ci * (t + CACHE_T)
        norm = copy * k + act if s.norm is not None else 0
        res = co * to * ((s.shortcut is not None) + (sb != esize)) if s.residual else 0
        per_row = max(norm, act + tin, tin + co * to + res)
        cache = n * ci * CACHE_T * h * w * sb
        flops = to * ho * wo * ci * co * 27 + (to * ho * wo * ci * co if s.shortcut is not None else 0)
        return out_bytes, n * w * esize * per_row, flops, ho, cache

    def plan(self, x_shape, budget: float) -> CausalPlan | None:
        """Buffers in fp32 when every stage fits the budget with them, else in 2-byte storage; each stage's band
        rows the most that fit next to its input and output buffers, the kept block input, the carries and
        what the other segment holds. None when even one-row bands with 2-byte buffers do not fit."""
        n = x_shape[0]
        esize = torch.empty(0, dtype=self.dtype).element_size()
        segments, held = self._segments(tuple(x_shape))
        history = any(h for _, h, _ in segments)
        stores = (self.dtype, torch.float16) if self.dtype == torch.float32 else (self.dtype,)
        for store in stores:
            sb = torch.empty(0, dtype=store).element_size()
            rows, peak, tracked, work, flops = [], 0.0, 0.0, 0.0, 0.0
            ok = True
            for shapes, carried, chunked in segments:
                held_bytes = n * esize * math.prod(held) if chunked else 0     # the other segment's output
                caches = sum(self._stage_cost(s, i, o, n, sb, esize)[4] for s, i, o in shapes
                             if s.kind != "attn") if carried else 0
                kept = 0            # a ResNet block's input, kept for its second half
                for idx, (s, inp, out) in enumerate(shapes):
                    out_bytes, per_row, cost, band_rows, _ = self._stage_cost(s, inp, out, n, sb, esize)
                    in_bytes = n * (esize if idx == 0 else sb) * math.prod(inp)
                    base = held_bytes + caches + in_bytes + out_bytes
                    if getattr(s, "residual", False):
                        in_place = s.shortcut is None and idx > 1    # the block's input is a buffer of its own
                        base += kept - (out_bytes if in_place else 0)
                    kept = in_bytes if getattr(s, "keep", False) else kept
                    fit = (budget - base) / (per_row * self.workspace) if per_row > 0 else band_rows
                    r = 0 if base > budget else band_rows if fit >= band_rows else min(band_rows, int(fit) - 2)
                    if r < 1:
                        ok = False
                        break
                    rows.append(r)
                    bands = math.ceil(band_rows / r)
                    work_rows = per_row * (r + (2 if bands > 1 else 0))
                    peak, tracked = max(peak, base + work_rows * self.workspace), max(tracked, base + work_rows)
                    flops += cost
                    work += cost * (1 + 2 * (bands - 1) / max(1, band_rows))
                if not ok:
                    break
            if ok:
                convert = 1.0 if store == self.dtype else 1.05
                return CausalPlan(store, rows, int(peak), convert * work / max(flops, 1.0), history, int(tracked))
        return None

    # ---- running

    def run(self, x: torch.Tensor, plan: CausalPlan, out=None, out_device=None):
        """Decode: x the latent [N, z, T, h, w] -> `out` [N, C, T', H, W] (written). Encode: x the pixels in the
        VAE's input range [N, C, T, H, W] -> the latent (fp32, on `out_device`)."""
        self.plan_, self.state, self.kept = plan, {}, []
        prog = self.prog
        chunks = prog.chunks(x.shape[2])
        if prog.encode:
            parts = []
            for k, (a, b) in enumerate(chunks):
                px = self.prepare(x[:, :, a:b].to(device=self.device, dtype=self.dtype))
                res = self._segment(prog.chunked, _Buffer.wrap(px), 0, k == 0, k < len(chunks) - 1, None)
                parts.append(res.t.to(self.dtype))
                del px, res
            h = torch.cat(parts, 2)
            del parts
            h = self._segment(prog.whole, _Buffer.wrap(h), len(prog.chunked), True, False, None).t.to(self.dtype)
            z = prog.regularize(_pointwise(prog.post, h))[0]
            return z.to(device=out_device or self.device, dtype=torch.float32)
        z = _pointwise(prog.pre, x.to(device=self.device, dtype=self.dtype))
        mid = self._segment(prog.whole, _Buffer.wrap(z), 0, True, False, None)
        del z
        self.sink_frame = 0
        for k, (a, b) in enumerate(chunks):
            self._segment(prog.chunked, _Buffer.wrap(mid.t[:, :, a:b]), len(prog.whole), k == 0,
                          k < len(chunks) - 1, out)
        return out

    def _segment(self, stages, buf, base, first, carry, sink):
        """Runs `stages` (plan rows from index `base`) over one chunk; `carry`: keep each convolution's carry for
        the next chunk."""
        rows = self.plan_.rows[base:base + len(stages)]
        for j, s in enumerate(stages):
            last = j == len(stages) - 1
            if s.kind == "attn":
                buf = self._attention(s, buf)
            elif s.kind == "up":
                buf = self._up(base + j, s, buf, rows[j], first, carry)
            else:
                buf = self._conv(base + j, s, buf, rows[j], first, carry, sink if last else None)
        return buf

    def _moments(self, buf, norm, rows):
        m = GroupMoments()
        for r0, r1 in _bands(buf.t.shape[-2], rows):
            m.add(buf.t[..., r0:r1, :].to(self.dtype), norm.num_groups)
        return m.final()

    def _history(self, key, shape, carry):
        """(the carry of this convolution from the last chunk, the tensor this chunk's carry goes to: the same one,
        written in place, once it exists; None for the last chunk, whose carry nobody reads)."""
        old = self.state.get(key)
        if not carry:
            return old, None
        if old is not None and tuple(old.shape) == tuple(shape):
            return old, old
        new = torch.empty(shape, dtype=self.plan_.store_dtype, device=self.device)
        self.state[key] = new
        return old, new

    def _conv(self, j, s: GConv, x: _Buffer, rows, first, carry, sink):
        n, ci, t, hh, ww = x.t.shape
        co, to, ho, wo = s.out_shape(ci, t, hh, ww)
        stride = s.conv.stride[1]
        stats = self._moments(x, s.norm, rows) if s.norm is not None else None
        res = self.kept.pop() if s.residual else None
        if s.keep:
            self.kept.append(x)
        hist, new = self._history((j, "c"), (n, ci, CACHE_T, hh, ww), carry)
        cache = self._writer(new, 1)
        in_place = res is not None and s.shortcut is None and not res.readonly and tuple(res.t.shape) == (n, co, to, ho, wo)
        out = None if sink is not None else res if in_place else self._out((n, co, to, ho, wo), rows, ho, x.t)
        result = None
        for r0, r1 in _bands(ho, rows):
            i0, i1 = (r0 - 1, r1 + 1) if stride == 1 else (2 * r0 - 1, 2 * r1)
            a, b = max(0, i0), min(hh, i1)
            own = (r0, r1) if stride == 1 else (2 * r0, min(hh, 2 * r1))
            act = x.t[..., a:b, :].to(self.dtype)
            if s.norm is not None:
                act = F.silu(group_norm_with(s.norm, act, stats), inplace=True)
            tin = _join_pad(hist[..., a:b, :] if hist is not None else None, act, a - i0, i1 - b)
            del act
            if cache is not None:
                cache.put(own[0], own[1], _carry_rows(tin, own[0] - a + (a - i0), own[1] - a + (a - i0)))
            y = F.conv3d(tin, *_weights(s.conv, tin), stride=s.conv.stride)
            del tin
            if res is not None:
                sc = res.t[..., r0:r1, :].to(self.dtype)
                y.add_(_pointwise(s.shortcut, sc) if s.shortcut is not None else sc)
                del sc
            if s.tanh:
                y = torch.tanh(y)
            result = self._deliver(sink, out, r0, r1, y)
            del y
            self.bands_run += 1
        if cache is not None:
            cache.flush()
        if sink is not None:
            self.sink_frame += to
            return None
        return out if out is not None else _writable(result)

    def _up(self, j, s: GUp, x: _Buffer, rows, first, carry):
        n, ci, t, hh, ww = x.t.shape
        co, to, ho, wo = s.out_shape(ci, t, hh, ww, first=first)
        tu = (to if s.time else t)
        hist, new = self._history((j, "c"), (n, ci, CACHE_T, ho, wo), carry)
        cache = self._writer(new, 1)
        out = self._out((n, co, to, ho, wo), rows, hh, x.t)
        result = None
        for q0, q1 in _bands(hh, rows):
            a, b = max(0, q0 - 1), min(hh, q1 + 1)
            u0, u1 = max(0, 2 * q0 - 1), min(ho, 2 * q1 + 1)       # the upsampled rows the convolution reads
            up = _up2(x.t[..., a:b, :].to(self.dtype), s.time, first)[..., u0 - 2 * a:u1 - 2 * a, :]
            assert up.shape[2] == tu
            top = int(q0 == 0)
            tin = _join_pad(hist[..., u0:u1, :] if hist is not None else None, up, top, int(q1 == hh))
            del up
            if cache is not None:
                cache.put(2 * q0, 2 * q1, _carry_rows(tin, 2 * q0 - u0 + top, 2 * q1 - u0 + top))
            y = F.conv3d(tin, *_weights(s.conv, tin))
            del tin
            result = self._deliver(None, out, 2 * q0, 2 * q1, y)
            del y
            self.bands_run += 1
        if cache is not None:
            cache.flush()
        return out if out is not None else _writable(result)

    def _attention(self, s: GAttn, x: _Buffer):
        blk = s.block
        n, c, t, hh, ww = x.t.shape
        seq = t * hh * ww
        chunk = _query_chunk(n, seq)
        stats = self._moments(x, blk.norm, hh)
        h = group_norm_with(blk.norm, x.t.to(self.dtype), stats)
        q, k, v = (_pointwise(getattr(blk, m), h).reshape(n, 1, c, seq).transpose(2, 3).contiguous()
                   for m in ("q", "k", "v"))
        del h
        o = torch.empty_like(q)
        for a in range(0, seq, chunk):
            o[:, :, a:a + chunk] = F.scaled_dot_product_attention(q[:, :, a:a + chunk], k, v)
        del q, k, v
        y = _pointwise(blk.proj_out, o.transpose(2, 3).reshape(n, c, t, hh, ww))
        del o
        y.add_(x.t.to(self.dtype))
        if x.readonly:
            return _writable(y) if self.plan_.store_dtype == self.dtype else self._store(y)
        x.write(0, hh, y)
        return x

    def _store(self, y):
        b = _Buffer(tuple(y.shape), self.plan_.store_dtype, y.device)
        b.write(0, y.shape[-2], y)
        return b
