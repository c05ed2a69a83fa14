"""Exact low-memory decode and encode of the causal 3-D video VAEs (Wan 2.1 and Qwen-Image, which uses it;
Wan 2.2 with its 48-channel, 16x latent), stage by stage over the whole frame.

These VAEs normalise per position (RMS over channels) and their only global operation is the middle block's
attention, frame by frame at latent resolution. Every other stage reaches a row or two: a residual block
(RMS norm -> SiLU -> causal 3x3x3 convolution, twice, plus its shortcut), a nearest 2x upsample + 3x3
convolution (with, in time, a causal (3, 1, 1) convolution that doubles the frames), a 3x3 stride-2
downsample (with a stride-2 causal time convolution). So each stage runs over the whole frame in bands of
rows, reading its input band with the halo its convolutions reach, and writes a whole-frame buffer: a
residual block with an identity shortcut writes into its own input (the rows a later band still reads wait
one band), so a stage holds at most its input and output as whole-frame tensors -- fp32 when the budget
holds them, else fp16, turning bf16 in place when a value leaves fp16's range (as the KL stages do,
stagewise.py). Each convolution runs once over the frame plus its halo rows per band edge.

Time follows ComfyUI's own chunking exactly (comfy/ldm/wan/vae.py, vae2_2.py): the decoder takes latent
frame 0 alone, then two frames at a time (Wan 2.1) or one (Wan 2.2), and after each temporal upsample of
Wan 2.1 the rest of the decoder runs on pieces of two frames; the encoders take pixel frame 0 alone, then
two (Wan 2.1, whose temporal downsamples hold back a lone output frame until the next chunk) or four (Wan
2.2). Each causal convolution keeps the last two frames of its input over the whole frame as its cache
(the first chunk's convolutions see zeros before frame 0, the temporal upsamples skip frame 0), so frame 0
and every later chunk are the untiled decode's up to float rounding. A single chunk (one Qwen-Image frame)
keeps no cache at all, as ComfyUI does.

The causal zero padding in time is built here (`time_cat`): on MPS through the pack's Metal pad kernel
(`vae_pad`), never MPSGraph's pad of a 5-D tensor (pytorch #194922: it corrupts video tensors there).

Stages come from the VAE's own modules (`causal_program.program`), each checked to be what its stage
assumes; a module that is not (another norm, attention with a time cache, ...) makes it return the reason,
which the planner names when it runs another scheme.
"""
from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F

from ...metal_kernels.probe import MPS_MAX_SCORE_ELEMENTS
from .causal_program import AddShortcut, Attention, Conv, Down, Program, Residual, Up
from .stagewise import _Buffer, _bands

CACHE_T = 2               # frames of history a causal (3, ., .) convolution keeps (ComfyUI's CACHE_T)
ATTENTION_CHUNK_BYTES = 64 << 20   # the mid attention's score matrix is built at most this big per query chunk


def metal_pads(device: torch.device) -> bool:
    """Whether 5-D pads on `device` go through the pack's Metal pad kernel (MPS: MPSGraph's pad corrupts them)."""
    return device.type == "mps"


def pad5(x: torch.Tensor, pad, value: float = 0.0, mode: str = "constant") -> torch.Tensor:
    """F.pad of a 5-D tensor (constant or replicate); on MPS the `vae_pad` kernel."""
    if metal_pads(x.device):
        from ...metal_kernels.vae import vae_pad

        return vae_pad(x, tuple(pad), mode=mode, value=value)
    if mode == "replicate":
        return F.pad(x, tuple(pad), mode="replicate")
    return F.pad(x, tuple(pad), value=value)


def time_cat(x: torch.Tensor, history: torch.Tensor | None, frames: int) -> torch.Tensor:
    """[zeros, history, x] along time with `frames` frames before x: a causal convolution's input (its zero
    padding where the history is shorter, at the start of the video)."""
    k = 0 if history is None else history.shape[2]
    zeros = frames - k
    if k == 0:
        return pad5(x, (0, 0, 0, 0, zeros, 0)) if zeros else x
    if metal_pads(x.device):
        out = pad5(x, (0, 0, 0, 0, frames, 0))
        out[:, :, zeros:frames] = history.to(x.dtype)
        return out
    parts = [history.to(x.dtype), x]
    if zeros:
        parts.insert(0, x.new_zeros((*x.shape[:2], zeros, *x.shape[3:])))
    return torch.cat(parts, 2)


def _weights(conv, x):
    w = conv.weight.to(device=x.device, dtype=x.dtype)
    b = conv.bias.to(device=x.device, dtype=x.dtype) if conv.bias is not None else None
    return w, b


def causal_conv(conv, x: torch.Tensor, history: torch.Tensor | None) -> torch.Tensor:
    """ComfyUI's CausalConv3d over x [N, C, T, h, w] after `history` (its cache, or None at the start): zero
    padding in time to the kernel, the module's own spatial padding. Without history a single frame runs the
    kernel's last time tap as a 2-D convolution (ComfyUI's "causal_zero" path: the same sum)."""
    w, b = _weights(conv, x)
    kt = w.shape[2]
    if kt == 1 or (history is None and x.shape[2] == 1):
        y = F.conv2d(x.transpose(1, 2).flatten(0, 1), w[:, :, -1], b, conv.stride[1:], conv.padding[1:],
                     conv.dilation[1:], conv.groups)
        return y.unflatten(0, (x.shape[0], x.shape[2])).transpose(1, 2)
    return F.conv3d(time_cat(x, history, kt - 1), w, b, conv.stride, conv.padding, conv.dilation, conv.groups)


def _new_history(history, x, frames=CACHE_T):
    """The cache after x: the last `frames` frames of [history, x] (fewer at the start)."""
    if history is None or x.shape[2] >= frames:
        return x[:, :, -frames:]
    return torch.cat([history.to(x.dtype), x], 2)[:, :, -frames:]


def rms_silu(norm, x: torch.Tensor, act: bool = True) -> torch.Tensor:
    """ComfyUI's RMS_norm of x (F.normalize over channels * sqrt(C) * gamma [+ bias]) [then SiLU], with one
    temporary the size of x."""
    inv = torch.linalg.vector_norm(x, dim=1, keepdim=True).clamp_min_(1e-12).reciprocal_().mul_(norm.scale)
    y = x * inv
    del inv
    y.mul_(norm.gamma.to(y))
    if norm.bias is not None:
        y.add_(norm.bias.to(y))
    return F.silu(y, inplace=True) if act else y


class _Lagged:
    """Band writes into a tensor that the next band still reads `lag` rows above its own start (a stage
    writing into its own input, a cache updated in place): rows within `lag` of a band's end wait until a
    later band's write, which comes after that band has read its input."""

    def __init__(self, write, lag: int):
        self.write, self.lag, self.pending = write, lag, []

    def put(self, r0, r1, rows):
        self.pending.append((r0, rows))
        limit = r1 - self.lag
        keep = []
        for a, t in self.pending:
            b = a + t.shape[-2]
            if b <= limit:
                self.write(a, b, t)
            elif a < limit:
                self.write(a, limit, t[..., :limit - a, :])
                keep.append((limit, t[..., limit - a:, :].clone()))
            else:
                keep.append((a, t.clone() if t is rows else t))
        self.pending = keep

    def flush(self):
        for a, t in self.pending:
            self.write(a, a + t.shape[-2], t)
        self.pending = []


# ---------------------------------------------------------------- the plan and its cost


@dataclasses.dataclass
class CausalPlan:
    store_dtype: torch.dtype
    rows: list[int]               # band rows per stage (its output's rows for Down, its input's otherwise)
    peak: int                     # predicted peak bytes (buffers, caches, kept inputs, the largest band's work)
    work: float                   # predicted time in plain passes (>= 1)
    history: bool                 # more than one chunk: the stages keep causal caches
    tracked: int = 0              # `peak` without the CPU's invisible convolution workspace (what tensors hold)


def shapes(prog: Program, x_shape, chunk_frames: int, first: bool):
    """[(stage, (C, T, H, W) in, out)] along the program for one chunk of `chunk_frames` input frames. After
    Wan 2.1's temporal upsamples the decoder runs on two-frame pieces: such an upsample's `out` is its whole
    output, the next stage's input a piece."""
    _, c, _, h, w = x_shape
    if prog.encode and prog.patch > 1:
        c, h, w = c * prog.patch ** 2, h // prog.patch, w // prog.patch
    if not prog.encode:
        c = prog.pre.out_channels
    t = chunk_frames
    out = []
    for s in prog.stages:
        if s.kind == "up":
            o = s.out_shape(c, t, h, w, first=first)
            nxt = (o[0], 2, o[2], o[3]) if _splits(prog, o[1]) else o
        else:
            o = s.out_shape(c, t, h, w)
            if s.kind == "down" and s.time_conv is not None and not first:
                o = (o[0], 2 if s.defer else max(1, t // 2), o[2], o[3])
            nxt = o
        out.append((s, (c, t, h, w), o))
        c, t, h, w = nxt
    return out


def _splits(prog: Program, frames: int) -> bool:
    """Whether the decoder runs the rest on two-frame pieces after an upsample with this many frames (Wan 2.1's
    run_up, which keeps the upsample's whole output meanwhile)."""
    return not prog.encode and prog.version == "wan21" and frames > 2


class BandRunner:
    """What the video VAEs' stage runners share (CausalStages here, hunyuan.HunyuanStages): the program, where
    and in what it runs, and where a band's output goes."""

    def __init__(self, prog, device, dtype, workspace_factor: float = 1.0, prepare=None):
        self.prog = prog
        self.device, self.dtype = torch.device(device), dtype
        self.workspace = workspace_factor
        self.prepare = prepare or (lambda t: t)
        self.bands_run = 0
        self.nonfinite = 0          # decode: NaN/inf values written to the output

    def _out(self, shape, rows, rows_total, like):
        """A stage's output buffer: none when it runs as one band (`rows` of `rows_total`) in the compute dtype
        (its result is the buffer), else a whole-frame buffer in the plan's storage dtype."""
        if rows >= rows_total and self.plan_.store_dtype == self.dtype:
            return None
        return _Buffer(shape, self.plan_.store_dtype, like.device)

    @staticmethod
    def _writer(target, lag):
        """Band rows into `target` (a cache updated in place) `lag` rows late (_Lagged); None without a target."""
        if target is None:
            return None

        def write(r0, r1, rows):
            target[..., r0:r1, :] = rows
        return _Lagged(write, lag)

    def _deliver(self, sink, out, r0, r1, y):
        """Band rows r0:r1 of a stage's output: into the decoded video (`sink`, the last stage), the stage's
        buffer `out`, or, when there is neither (the stage runs as one band), returned as the stage's result."""
        if sink is not None:
            self._emit(sink, r0, r1, y)
        elif out is None:
            return y
        else:
            out.write(r0, r1, y)
        return None

    def _emit(self, sink, r0, r1, y):
        """The decoder's last stage writes into the output (Wan 2.2: unpatchified to pixels)."""
        p = getattr(self.prog, "patch", 1)
        if p > 1:
            y = _unpatchify(y, p)
        f0 = self.sink_frame
        self.nonfinite += int(y.isfinite().logical_not_().sum())
        sink[:, :, f0:f0 + y.shape[2], r0 * p:r1 * p, :] = y.to(sink.device, sink.dtype)


class CausalStages(BandRunner):
    """Runs a Program over a whole latent (decode) or video (encode) per its CausalPlan."""

    # ---- planning

    def _cost(self, s, inp, out, n, sb, esize, history):
        """(output buffer bytes, working bytes per band row, multiply-adds, rows the bands split, cache bytes)
        of a stage on a chunk (C, T, H, W) `inp` -> `out`: buffers of `sb` bytes, compute of `esize`, the
        convolutions reading a cache (`history`) or not. The working bytes follow the band code below: the
        input band's copy (when the buffer's dtype is not the compute dtype), the norm's output, the
        time-padded input and the convolution's output alive at once."""
        (ci, t, h, w), (co, to, ho, wo) = inp, out
        copy = ci * t if sb != esize else 0
        out_bytes = n * co * to * ho * wo * sb

        def cat(c, frames):            # the time-padded input of a (3, ., .) convolution
            return c * (frames + CACHE_T) if history or frames > 1 else 0

        if s.kind == "conv":
            kt = s.conv.kernel_size[0]
            cache = n * ci * CACHE_T * h * w * sb if kt > 1 else 0
            per_row = copy + ci * t * (s.norm is not None) + (cat(ci, t) if kt > 1 else 0) + co * to
            return out_bytes, n * w * esize * per_row, to * ho * wo * ci * co * 9 * kt, h, cache
        if s.kind == "residual":
            cm = s.conv1.out_channels
            cache = n * (ci + cm) * CACHE_T * h * w * sb
            per_row = copy + max(ci * t + cat(ci, t) + cm * t, cm * t + cat(cm, t) + co * to,
                                 co * to * (1 + (s.shortcut is not None)))
            return out_bytes, n * w * esize * per_row, t * h * w * (ci * cm + cm * co) * 27, h, cache
        if s.kind == "up":
            cm = s.resample[1].in_channels
            cache = n * ci * CACHE_T * h * w * sb if s.time_conv is not None else 0
            time = ci * t + cat(ci, t) + 4 * ci * t if s.time_conv is not None and to > t else 0
            flat = ci * to if to > 1 else 0         # frames into the batch: a copy unless there is one frame
            # the resample's upsampled input and its convolution's output; then (a shortcut: Wan 2.2's DupUp3D)
            # that output and the sum, the upsampled input freed by then
            per_row = copy + max(time, flat + 4 * cm * to + 4 * co * to, 2 * 4 * co * to * (s.add is not None))
            flops = to * ho * wo * cm * co * 9 + (t * h * w * ci * 2 * ci * 3 if time else 0)
            return out_bytes, n * w * esize * per_row, flops, h, cache
        if s.kind == "down":
            cache = n * co * ho * wo * sb * (2 if s.defer else 1) if s.time_conv is not None else 0
            per_row = 2 * (copy + 2 * ci * t) + co * t * (1 + 2 * (s.time_conv is not None))
            flops = t * ho * wo * ci * co * 9 + (to * ho * wo * co * co * 3 if s.time_conv is not None else 0)
            return out_bytes, n * wo * esize * per_row, flops, ho, cache
        if s.kind == "add":
            fs = s.add.factor_s
            return 0, n * w * esize * (2 * co * to + 2 * s.add.in_channels * t * fs * fs), 0, h, 0
        if s.kind == "attn":
            hw = h * w
            frame = n * esize * ci * hw * 5 + n * _query_chunk(n, hw) * hw * esize
            return frame, 0, t * (hw * ci * ci * 4 + 2 * hw * hw * ci), h, 0
        return 0, 0, 0, h, 0

    def _kept(self, sh, i, n, sb):
        """(bytes held while stage i runs for later stages -- block inputs kept for a shortcut, the whole output
        of an upsample whose pieces run -- and whether stage i writes its output into its own input: a
        Residual with an identity shortcut over a buffer nobody keeps)."""
        stack, wholes = [], []
        for j in range(i):
            s, inp, out = sh[j]
            if s.kind == "keep":
                stack.append(inp)
            elif getattr(s, "add", None) is not None and stack:
                stack.pop()
            if s.kind == "up" and _splits(self.prog, out[1]):
                wholes.append(out)
        s, inp, out = sh[i]
        kept = sum(n * sb * math.prod(k) for k in stack + wholes)
        in_place = s.kind == "residual" and s.shortcut is None and inp == out and i > 0 \
            and sh[i - 1][0].kind != "keep"
        return kept, in_place

    def plan(self, x_shape, budget: float) -> CausalPlan | None:
        """Buffers in fp32 when the whole program fits the budget with them, else in 2-byte storage; each
        stage's band rows the most that fit next to its input and output buffers, the kept block inputs and
        every stage's cache. None when even one-row bands with 2-byte buffers do not fit."""
        prog = self.prog
        n, frames = x_shape[0], x_shape[2]
        chunks = prog.chunks(frames)
        history = len(chunks) > 1
        esize = torch.empty(0, dtype=self.dtype).element_size()
        steady = max((b - a for a, b in chunks[1:]), default=1)
        kinds = [shapes(prog, x_shape, 1, True)] + ([shapes(prog, x_shape, steady, False)] if history else [])
        stores = (self.dtype, torch.float16) if self.dtype == torch.float32 else (self.dtype,)
        for store in stores:
            sb = torch.empty(0, dtype=store).element_size()
            caches = sum(self._cost(s, i_, o, n, sb, esize, True)[4] for s, i_, o in kinds[-1]) if history else 0
            rows, peak, tracked, work, flops = [], 0.0, 0.0, 0.0, 0.0
            for i in range(len(prog.stages)):
                allowed, need = None, []
                for k, sh in enumerate(kinds):
                    s, inp, out = sh[i]
                    out_bytes, per_row, cost, band_rows, _ = self._cost(s, inp, out, n, sb, esize, k > 0)
                    kept, in_place = self._kept(sh, i, n, sb)
                    # the input chunk: the encoder's prepared pixels (patchified for Wan 2.2) in the compute dtype
                    in_bytes = n * (esize if i == 0 else sb) * math.prod(inp)
                    out_bytes = 0 if in_place else out_bytes
                    base = caches + kept + in_bytes + out_bytes
                    r = int((budget - base) // (per_row * self.workspace)) - 2 * s.halo if per_row > 0 else band_rows
                    if base > budget:
                        r = 0
                    allowed = min(band_rows, r) if allowed is None else min(allowed, r)
                    need.append((base, per_row, out_bytes, cost, s.halo))
                if allowed < 1:
                    break
                halo = need[-1][4]
                r = allowed         # the most rows that fit: the fewest bands, the budget used (the last band is short)
                rows.append(r)
                bands = math.ceil(band_rows / r)
                # one band in the compute dtype: its result is the output buffer (no copy); an upsample's shortcut
                # sum is a tensor of its own beside the convolution's output
                one = (bands == 1 and sb == esize and s.kind in ("conv", "residual", "up")
                       and getattr(s, "add", None) is None)
                for factor in (self.workspace, 1.0):
                    top = max(b - (ob if one else 0) + p * factor * (r + (2 * hl if bands > 1 else 0))
                              for b, p, ob, _, hl in need)
                    peak, tracked = (max(peak, top), tracked) if factor == self.workspace else (peak, max(tracked, top))
                cost = need[-1][3]
                flops += cost
                work += cost * (1 + 2 * halo * (bands - 1) / max(1, band_rows))
            else:
                convert = 1.0 if store == self.dtype else 1.05        # the buffers' dtype conversions
                return CausalPlan(store, rows, int(peak), convert * work / max(flops, 1.0), history, int(tracked))
        return None

    # ---- running

    def run(self, x: torch.Tensor, plan: CausalPlan, out=None, out_device=None):
        """Decode: x the latent [N, z, T, h, w] -> `out` [N, C, T', H, W] (written). Encode: x the pixels in the
        VAE's input range [N, C, T, H, W] -> the latent (fp32, on `out_device`)."""
        self.plan_ = plan
        self.state: dict = {}
        self.kept: list = []
        prog = self.prog
        chunks = prog.chunks(x.shape[2])
        if prog.encode:
            def pixels(a, b):          # the chunk as the first stage reads it (no other reference kept)
                px = self.prepare(x[:, :, a:b].to(device=self.device, dtype=self.dtype))
                return _Buffer.wrap(_patchify(px, prog.patch) if prog.patch > 1 else px)

            outs = []
            for k, (a, b) in enumerate(chunks):
                res = self._run(0, pixels(a, b), first=k == 0, final=k == len(chunks) - 1, sink=None)
                if res is not None:
                    outs.append(res)
            z = causal_conv(prog.post, torch.cat(outs, 2), None)
            return z[:, :prog.latent_channels].to(device=out_device or self.device, dtype=torch.float32)
        z = causal_conv(prog.pre, x.to(device=self.device, dtype=self.dtype), None)
        self.sink_frame = 0
        for k, (a, b) in enumerate(chunks):
            self._run(0, _Buffer.wrap(z[:, :, a:b]), first=k == 0, final=k == len(chunks) - 1, sink=out)
        return out

    def _run(self, i, buf, first, final, sink):
        prog = self.prog
        for j in range(i, len(prog.stages)):
            s = prog.stages[j]
            if buf.t.shape[2] == 0:
                return None
            if s.kind == "keep":
                self.kept.append(buf)
            elif s.kind == "conv":
                buf = self._conv(j, s, buf, sink if j == len(prog.stages) - 1 and not prog.encode else None)
            elif s.kind == "residual":
                buf = self._residual(j, s, buf)
            elif s.kind == "up":
                buf = self._up(j, s, buf, first)
                if prog.version == "wan21" and buf.t.shape[2] > 2:      # ComfyUI's run_up: two-frame pieces
                    whole = buf
                    for f0 in range(0, whole.t.shape[2], 2):
                        piece = _Buffer.wrap(whole.t[:, :, f0:f0 + 2])
                        piece.readonly = False
                        self._run(j + 1, piece, first, final, sink)
                    return None
            elif s.kind == "down":
                buf = self._down(j, s, buf, first, final)
            elif s.kind == "add":
                buf = self._add_shortcut(j, s, buf)
            else:
                buf = self._attention(s, buf)
        if prog.encode:
            return buf.t.to(self.dtype) if buf.t.shape[2] else None
        return None

    def _bands(self, j, rows_total):
        return _bands(rows_total, self.plan_.rows[j])

    def _history(self, j, key, shape, new_frames):
        """(the cache of stage j, the tensor its band rows go to, lag): updated in place when it keeps its
        frame count (the next band still reads `lag` rows of the old one above its start), else a new one."""
        old = self.state.get((j, key))
        if not self.plan_.history:
            return old, None
        frames = min(CACHE_T, new_frames + (0 if old is None else old.shape[2]))
        if old is not None and old.shape[2] == frames:
            return old, old
        new = torch.empty((*shape[:2], frames, *shape[3:]), dtype=self.plan_.store_dtype, device=self.device)
        self.state[(j, key)] = new
        return old, new

    def _conv(self, j, s: Conv, x: _Buffer, sink):
        n, ci, t, hh, ww = x.t.shape
        co = s.conv.out_channels
        kt = s.conv.kernel_size[0]
        hist, new = self._history(j, "h", x.t.shape, t) if kt > 1 else (None, None)
        cache = self._writer(new, 1 if new is hist else 0)
        out = None if sink is not None else self._out((n, co, t, hh, ww), self.plan_.rows[j], hh, x.t)
        result = None
        for r0, r1 in self._bands(j, hh):
            a, b = max(0, r0 - 1), min(hh, r1 + 1)
            band = x.t[..., a:b, :].to(self.dtype)
            if s.norm is not None:
                band = rms_silu(s.norm, band)
            hb = hist[..., a:b, :] if hist is not None else None
            y = causal_conv(s.conv, band, hb)[..., r0 - a:r1 - a, :]
            if cache is not None:
                cache.put(r0, r1, _new_history(hb, band)[..., r0 - a:r1 - a, :])
            del band, hb
            result = self._deliver(sink, out, r0, r1, y)
            del y
            self.bands_run += 1
        if cache is not None:
            cache.flush()
        if sink is not None:
            self.sink_frame += t
            return _Buffer.wrap(x.t[:, :, :0])
        return out if out is not None else _writable(result)

    def _residual(self, j, s: Residual, x: _Buffer):
        n, ci, t, hh, ww = x.t.shape
        cm, co = s.conv1.out_channels, s.conv2.out_channels
        hist1, new1 = self._history(j, "a", x.t.shape, t)
        hist2, new2 = self._history(j, "b", (n, cm, t, hh, ww), t)
        cache1, cache2 = self._writer(new1, 2 if new1 is hist1 else 0), self._writer(new2, 1 if new2 is hist2 else 0)
        one = self.plan_.rows[j] >= hh
        in_place = s.shortcut is None and ci == co and not x.readonly and not any(k is x for k in self.kept)
        out = None if one and self.plan_.store_dtype == self.dtype else x if in_place else \
            _Buffer((n, co, t, hh, ww), self.plan_.store_dtype, x.t.device)
        writer = _Lagged(out.write, 2 if out is x else 0) if out is not None else None
        result = None
        for r0, r1 in self._bands(j, hh):
            a0, a1 = max(0, r0 - 1), min(hh, r1 + 1)
            x0, x1 = max(0, a0 - 1), min(hh, a1 + 1)
            xb = x.t[..., x0:x1, :].to(self.dtype)
            h = rms_silu(s.norm1, xb)
            hb = hist1[..., x0:x1, :] if hist1 is not None else None
            a = causal_conv(s.conv1, h, hb)[..., a0 - x0:a1 - x0, :]
            if cache1 is not None:
                cache1.put(r0, r1, _new_history(hb, h)[..., r0 - x0:r1 - x0, :])
            del h, hb
            g = rms_silu(s.norm2, a)
            del a
            hb = hist2[..., a0:a1, :] if hist2 is not None else None
            y = causal_conv(s.conv2, g, hb)[..., r0 - a0:r1 - a0, :]
            if cache2 is not None:
                cache2.put(r0, r1, _new_history(hb, g)[..., r0 - a0:r1 - a0, :])
            del g, hb
            sc = xb[..., r0 - x0:r1 - x0, :]
            y.add_(sc if s.shortcut is None else causal_conv(s.shortcut, sc, None))
            del xb, sc
            if writer is None:
                result = y
            else:
                writer.put(r0, r1, y)
            del y
            self.bands_run += 1
        for w in (cache1, cache2, writer):
            if w is not None:
                w.flush()
        return out if out is not None else _writable(result)

    def _up(self, j, s: Up, x: _Buffer, first):
        n, ci, t, hh, ww = x.t.shape
        co = s.resample[1].out_channels
        temporal = s.time_conv is not None and not first
        to = 2 * t if temporal else t
        hist, new = self._history(j, "h", x.t.shape, t) if temporal else (None, None)
        cache = self._writer(new, 1 if new is hist else 0)
        kept = self.kept.pop() if s.add is not None else None
        out = self._out((n, co, to, 2 * hh, 2 * ww), self.plan_.rows[j], hh, x.t)
        result = None
        for r0, r1 in self._bands(j, hh):
            a, b = max(0, r0 - 1), min(hh, r1 + 1)
            band = x.t[..., a:b, :].to(self.dtype)
            if temporal:
                hb = hist[..., a:b, :] if hist is not None else None
                tc = causal_conv(s.time_conv, band, hb)
                if cache is not None:
                    cache.put(r0, r1, _new_history(hb, band)[..., r0 - a:r1 - a, :])
                del hb
                # [N, 2C, T, rows, W] -> frames 2t (channels :C) and 2t + 1 (C:), as ComfyUI's Resample stacks them
                band = tc.unflatten(1, (2, ci)).permute(0, 2, 3, 1, 4, 5).flatten(2, 3)
                del tc
            tb = band.shape[2]
            y = s.resample(band.transpose(1, 2).flatten(0, 1))
            del band
            y = y.unflatten(0, (n, tb)).transpose(1, 2)[..., 2 * (r0 - a):2 * (r1 - a), :]
            if kept is not None:
                y = y + s.add(kept.t[..., r0:r1, :].to(self.dtype), first_chunk=first)
            result = self._deliver(None, out, 2 * r0, 2 * r1, y)
            del y
            self.bands_run += 1
        if cache is not None:
            cache.flush()
        return out if out is not None else _writable(result)

    def _down(self, j, s: Down, x: _Buffer, first, final):
        n, ci, t, hh, ww = x.t.shape
        co = s.conv.out_channels
        ho, wo = hh // 2, ww // 2
        temporal = s.time_conv is not None and not first
        if s.time_conv is not None and first and self.plan_.history:
            self.state[(j, "last")] = torch.empty((n, co, 1, ho, wo), dtype=self.plan_.store_dtype, device=self.device)
        last = self.state.get((j, "last"))
        to = (t + 1 - 3) // 2 + 1 if temporal else t
        deferred = self.state.pop((j, "deferred"), None) if temporal else None
        lead = 0 if deferred is None else deferred.shape[2]
        total = lead + to
        if temporal and s.defer and total == 1 and not final:
            keep = torch.empty((n, co, 1, ho, wo), dtype=self.plan_.store_dtype, device=self.device)
            self.state[(j, "deferred")] = keep
            out = _Buffer.wrap(keep)
        else:
            keep = None
            out = _Buffer((n, co, total, ho, wo), self.plan_.store_dtype, x.t.device)
            if lead:
                out.t[:, :, :lead] = deferred
        del deferred
        for r0, r1 in self._bands(j, ho):
            b = min(hh, 2 * r1 + 1)
            band = x.t[..., 2 * r0:b, :].to(self.dtype)
            flat = F.pad(band.transpose(1, 2).flatten(0, 1), (0, 1, 0, 1 if b == hh else 0))   # 4-D: per frame
            del band
            y = s.conv(flat).unflatten(0, (n, t)).transpose(1, 2)
            del flat
            if s.time_conv is not None:
                if temporal:
                    prev = last[..., r0:r1, :].to(self.dtype, copy=True)
                    last[..., r0:r1, :] = y[:, :, -1:]
                    tin = torch.cat([prev, y], 2)
                    y = F.conv3d(tin, *_weights(s.time_conv, tin), stride=s.time_conv.stride)
                    del tin, prev
                elif last is not None:
                    last[..., r0:r1, :] = y[:, :, -1:]
            if keep is not None:
                keep[..., r0:r1, :] = y
            else:
                self._write_frames(out, lead, r0, r1, y)
            del y
            self.bands_run += 1
        if keep is not None:
            return _Buffer.wrap(keep[:, :, :0])
        return out

    @staticmethod
    def _write_frames(out: _Buffer, lead, r0, r1, y):
        if lead == 0:
            out.write(r0, r1, y)
        else:
            out.t[:, :, lead:, r0:r1, :] = y.to(out.t.dtype)

    def _add_shortcut(self, j, s: AddShortcut, y: _Buffer):
        """y += AvgDown3D(the kept block input), band by band (its spatial factor maps y's rows to the input's)."""
        kept = self.kept.pop()
        fs = s.add.factor_s
        y = _writable(y.t) if y.readonly else y
        for r0, r1 in self._bands(j, y.t.shape[-2]):
            band = y.t[..., r0:r1, :].to(self.dtype) + _avg_down(s.add, kept.t[..., fs * r0:fs * r1, :].to(self.dtype))
            y.write(r0, r1, band)
            del band
            self.bands_run += 1
        return y

    def _attention(self, s: Attention, x: _Buffer):
        blk = s.block
        n, c, t, hh, ww = x.t.shape
        hw = hh * ww
        chunk = _query_chunk(n, hw)
        x = _writable(x.t.clone()) if x.readonly else x
        for f in range(t):
            frame = x.t[:, :, f].to(self.dtype)
            q, k, v = blk.to_qkv(rms_silu(blk.norm, frame, act=False)).chunk(3, dim=1)
            q, k, v = (u.reshape(n, 1, c, hw).transpose(2, 3).contiguous() for u in (q, k, v))
            o = torch.empty_like(q)
            for a in range(0, hw, chunk):
                o[:, :, a:a + chunk] = F.scaled_dot_product_attention(q[:, :, a:a + chunk], k, v)
            del q, k, v
            y = blk.proj(o.transpose(2, 3).reshape(n, c, hh, ww)) + frame
            del o
            x.t[:, :, f] = y.to(x.t.dtype)
        return x


def _writable(t) -> _Buffer:
    b = _Buffer.wrap(t)
    b.readonly = False
    return b


def _query_chunk(n, hw) -> int:
    """Queries per chunk of the mid attention: a score matrix of at most ATTENTION_CHUNK_BYTES (fp32) and
    under MPS's 2^31-element limit."""
    return max(1, min(hw, ATTENTION_CHUNK_BYTES // max(1, n * hw * 4), (MPS_MAX_SCORE_ELEMENTS - 1) // max(1, n * hw)))


def _patchify(x, p):
    """comfy.ldm.wan.vae2_2.patchify: "b c f (h q) (w r) -> b (c r q) f h w"."""
    n, c, t, h, w = x.shape
    x = x.reshape(n, c, t, h // p, p, w // p, p).permute(0, 1, 6, 4, 2, 3, 5)
    return x.reshape(n, c * p * p, t, h // p, w // p)


def _unpatchify(x, p):
    """comfy.ldm.wan.vae2_2.unpatchify: "b (c r q) f h w -> b c f (h q) (w r)"."""
    n, cp, t, h, w = x.shape
    c = cp // (p * p)
    return x.reshape(n, c, p, p, t, h, w).permute(0, 1, 4, 5, 3, 6, 2).reshape(n, c, t, h * p, w * p)


def _avg_down(m, x):
    """Wan 2.2's AvgDown3D with its front time padding through `time_cat` (no 5-D F.pad on MPS)."""
    pad_t = (m.factor_t - x.shape[2] % m.factor_t) % m.factor_t
    x = time_cat(x, None, pad_t) if pad_t else x
    b, c, t, h, w = x.shape
    ft, fs = m.factor_t, m.factor_s
    x = x.view(b, c, t // ft, ft, h // fs, fs, w // fs, fs).permute(0, 1, 3, 5, 7, 2, 4, 6).contiguous()
    x = x.view(b, m.out_channels, m.group_size, t // ft, h // fs, w // fs)
    return x.mean(dim=2)
