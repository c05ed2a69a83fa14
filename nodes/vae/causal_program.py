"""The causal 3-D video VAEs (ComfyUI's Wan 2.1 / Qwen-Image and Wan 2.2 WanVAE) as a Program of stages, each
of which causal.py runs over the whole frame in bands of rows.

`program(first_stage_model, encode)` reads the VAE's own modules and checks each is what its stage assumes
(RMS norms, causal 3x3x3 convolutions, nearest 2x upsamples, stride-2 downsamples, per-frame attention);
anything else makes it return the reason as a string, which the planner names when it runs another
scheme.
"""
from __future__ import annotations

import dataclasses


# ---------------------------------------------------------------- stages


@dataclasses.dataclass
class Conv:
    """[RMS norm -> SiLU ->] causal 3x3x3 convolution (the first convolution, the head)."""
    conv: object
    norm: object = None
    kind = "conv"
    halo = 1

    def out_shape(self, c, t, h, w):
        return self.conv.out_channels, t, h, w


@dataclasses.dataclass
class Residual:
    """A ResidualBlock: x + conv2(SiLU(norm2(conv1(SiLU(norm1(x)))))), its shortcut the identity or a 1x1x1
    causal convolution. One band of output rows runs both convolutions (conv1 over two halo rows more)."""
    norm1: object
    conv1: object
    norm2: object
    conv2: object
    shortcut: object = None        # None: identity
    kind = "residual"
    halo = 2

    def out_shape(self, c, t, h, w):
        return self.conv2.out_channels, t, h, w


@dataclasses.dataclass
class Up:
    """Resample upsample2d/3d: [a causal (3, 1, 1) convolution doubling the frames, skipping frame 0,] then per
    frame a nearest 2x upsample and a 3x3 convolution [+ Wan 2.2's DupUp3D of the block input]."""
    resample: object               # nn.Sequential(Upsample, Conv2d)
    time_conv: object = None
    add: object = None             # Wan 2.2's DupUp3D over the kept block input
    kind = "up"
    halo = 1

    def out_shape(self, c, t, h, w, first=False):
        t_out = t if self.time_conv is None or first else 2 * t
        return self.resample[1].out_channels, t_out, 2 * h, 2 * w


@dataclasses.dataclass
class Down:
    """Resample downsample2d/3d: per frame a one-pixel zero pad (bottom, right) and a 3x3 stride-2
    convolution [, then a causal stride-2 (3, 1, 1) time convolution, frame 0 passing through]."""
    conv: object                   # the stride-2 Conv2d
    time_conv: object = None
    defer: bool = False            # Wan 2.1: a lone output frame waits for the next chunk (ComfyUI's deferral)
    kind = "down"
    halo = 1

    def out_shape(self, c, t, h, w):
        return self.conv.out_channels, t, h // 2, w // 2


class _InPlace:
    """A stage whose output has its input's shape (it works in place, or only keeps its input)."""
    halo = 0

    def out_shape(self, c, t, h, w):
        return c, t, h, w


@dataclasses.dataclass
class Attention(_InPlace):
    """The middle block's AttentionBlock: per frame, over the whole frame (query chunks keep the score matrix
    small and under MPS's 2^31-element limit), added to its input in place."""
    block: object
    kind = "attn"


@dataclasses.dataclass
class AddShortcut(_InPlace):
    """Wan 2.2's Down_ResidualBlock shortcut: AvgDown3D of the kept block input, added to the block's output."""
    add: object
    kind = "add"


@dataclasses.dataclass
class Keep(_InPlace):
    """Keep the input for a later stage's shortcut (Wan 2.2's up/down residual blocks)."""
    kind = "keep"


@dataclasses.dataclass
class Program:
    """A VAE's decoder or encoder as stages, with ComfyUI's chunking (module docstring)."""
    version: str                   # "wan21" or "wan22"
    encode: bool
    stages: list
    pre: object                    # decode: WanVAE.conv2 (1x1x1) over the latent; encode: None
    post: object                   # encode: WanVAE.conv1 (1x1x1) before the posterior's mean; decode: None
    latent_channels: int
    patch: int = 1                 # Wan 2.2: 2x2 pixel patches in channels

    def frames_used(self, frames: int) -> int:
        """Input frames the VAE reads (ComfyUI's Wan 2.1 encoder drops frames past 1 + 4k)."""
        return 1 + ((frames - 1) // 4) * 4 if self.encode and self.version == "wan21" else frames

    def chunks(self, frames: int) -> list[tuple[int, int]]:
        """ComfyUI's time chunks: (start, end) input frames per call of its decoder/encoder."""
        frames = self.frames_used(frames)
        step = (4 if self.version == "wan22" else 2) if self.encode else (1 if self.version == "wan22" else 2)
        return [(0, 1)] + [(a, min(frames, a + step)) for a in range(1, frames, step)]

    def out_frames(self, frames: int) -> int:
        if self.encode:
            return 1 + (self.frames_used(frames) - 1) // 4
        return 1 + 4 * (frames - 1)

    def runner(self, device, dtype, workspace_factor: float = 1.0, prepare=None):
        """What plans and runs this program (causal.CausalStages)."""
        from .causal import CausalStages

        return CausalStages(self, device, dtype, workspace_factor, prepare)


# ---------------------------------------------------------------- building the program from ComfyUI's modules


def _name(m) -> str:
    return type(m).__name__


def _rms_ok(m) -> bool:
    return _name(m) == "RMS_norm" and getattr(m, "channel_first", False)


def _conv_ok(conv, kt=3) -> bool:
    """A CausalConv3d of kernel (kt, 3, 3) (or 1x1x1), stride 1, 'same' spatial padding."""
    if _name(conv) != "CausalConv3d":
        return False
    k, s, d = tuple(conv.kernel_size), tuple(conv.stride), tuple(conv.dilation)
    if s != (1, 1, 1) or d != (1, 1, 1) or conv.groups != 1:
        return False
    if k == (1, 1, 1):
        return tuple(conv.padding) == (0, 0, 0)
    return k == (kt, 3, 3) and tuple(conv.padding) == (0, 1, 1) and getattr(conv, "_padding", None) == kt - 1


def _residual(block, out):
    """A ResidualBlock as a Residual stage; the reason as a string when it is not the chain it assumes."""
    r = list(block.residual)
    names = [_name(m) for m in r]
    if names != ["RMS_norm", "SiLU", "CausalConv3d", "RMS_norm", "SiLU", "Dropout", "CausalConv3d"] \
            or not (_rms_ok(r[0]) and _rms_ok(r[3]) and _conv_ok(r[2]) and _conv_ok(r[6])):
        return f"{_name(block)} is not RMS_norm/SiLU/CausalConv3d twice ({names})"
    short = block.shortcut
    if _name(short) == "Identity":
        short = None
    elif not (_conv_ok(short) and tuple(short.kernel_size) == (1, 1, 1)):
        return f"{_name(block)}'s shortcut {_name(short)} is not a 1x1x1 CausalConv3d"
    out.append(Residual(r[0], r[2], r[3], r[6], short))
    return None


def _attention(block, out):
    if _name(block) != "AttentionBlock" or _name(getattr(block, "to_qkv", None)) != "Conv2d" \
            or not hasattr(block, "proj") or not _rms_ok(getattr(block, "norm", None)):
        return f"{_name(block)} is not Wan's AttentionBlock"
    out.append(Attention(block))
    return None


def _resample(layer, out, add=None, defer=False):
    mode = getattr(layer, "mode", None)
    if mode in ("upsample2d", "upsample3d"):
        up, conv = layer.resample[0], layer.resample[1]
        if _name(up) != "Upsample" or tuple(up.scale_factor) != (2.0, 2.0) \
                or up.mode not in ("nearest", "nearest-exact") or _name(conv) != "Conv2d" \
                or tuple(conv.kernel_size) != (3, 3) or tuple(conv.padding) != (1, 1) or tuple(conv.stride) != (1, 1):
            return f"Resample({mode}) is not a nearest 2x upsample and a 3x3 convolution"
        tc = getattr(layer, "time_conv", None) if mode == "upsample3d" else None
        if tc is not None and (tuple(tc.kernel_size) != (3, 1, 1) or tc.out_channels != 2 * tc.in_channels):
            return "Resample(upsample3d)'s time_conv is not a (3, 1, 1) convolution doubling the channels"
        out.append(Up(layer.resample, tc, add=add))
        return None
    if mode in ("downsample2d", "downsample3d"):
        pad, conv = layer.resample[0], layer.resample[1]
        if _name(pad) != "ZeroPad2d" or tuple(pad.padding) != (0, 1, 0, 1) or _name(conv) != "Conv2d" \
                or tuple(conv.kernel_size) != (3, 3) or tuple(conv.stride) != (2, 2) or tuple(conv.padding) != (0, 0):
            return f"Resample({mode}) is not a zero pad and a 3x3 stride-2 convolution"
        tc = getattr(layer, "time_conv", None) if mode == "downsample3d" else None
        if tc is not None and (tuple(tc.kernel_size) != (3, 1, 1) or tuple(tc.stride) != (2, 1, 1)):
            return "Resample(downsample3d)'s time_conv is not a stride-2 (3, 1, 1) convolution"
        out.append(Down(conv, tc, defer=defer and tc is not None))
        return None
    return f"Resample mode {mode!r}"


def _block22(layer, stages, encode):
    """Wan 2.2's Up_ResidualBlock / Down_ResidualBlock: residual blocks and a resample, plus a shortcut of the
    block input (DupUp3D, added to the upsample's output; AvgDown3D, added after the block)."""
    inner = list(layer.upsamples if not encode else layer.downsamples)
    short = layer.avg_shortcut
    if short is not None:
        if _name(short) not in ("DupUp3D", "AvgDown3D"):
            return f"{_name(layer)}'s shortcut {_name(short)}"
        stages.append(Keep())
    for m in inner:
        n = _name(m)
        why = _residual(m, stages) if n == "ResidualBlock" else \
            _resample(m, stages, add=short if not encode else None) if n == "Resample" else f"{n} in {_name(layer)}"
        if why:
            return why
    if short is None:
        return None
    if encode:
        stages.append(AddShortcut(short))
    elif not inner or _name(inner[-1]) != "Resample":
        return f"{_name(layer)} has a shortcut but no resample to add it to"
    return None


def program(fsm, encode: bool):
    """The stages of ComfyUI's Wan 2.1 (comfy.ldm.wan.vae) or Wan 2.2 (vae2_2) WanVAE decoder or encoder, as a
    Program; a string naming what is not a stage this module knows otherwise."""
    mod = type(fsm).__module__
    version = "wan22" if mod.endswith("wan.vae2_2") else "wan21" if mod.endswith("wan.vae") else None
    if _name(fsm) != "WanVAE" or version is None:
        return f"{_name(fsm)} is not ComfyUI's WanVAE"
    part = fsm.encoder if encode else fsm.decoder
    if not _conv_ok(part.conv1):
        return "conv1 is not a causal 3x3x3 convolution"
    stages: list = [Conv(part.conv1)]
    order = (("downsamples", part.downsamples), ("middle", part.middle)) if encode else \
        (("middle", part.middle), ("upsamples", part.upsamples))
    for where, layers in order:
        for layer in layers:
            n = _name(layer)
            why = _residual(layer, stages) if n == "ResidualBlock" else \
                _attention(layer, stages) if n == "AttentionBlock" else \
                _resample(layer, stages, defer=encode and version == "wan21") if n == "Resample" else \
                _block22(layer, stages, encode) if n in ("Up_ResidualBlock", "Down_ResidualBlock") else \
                f"{n} in the {where}"
            if why:
                return why
    h = list(part.head)
    if [_name(m) for m in h] != ["RMS_norm", "SiLU", "CausalConv3d"] or not _rms_ok(h[0]) or not _conv_ok(h[2]):
        return "the head is not RMS_norm/SiLU/CausalConv3d"
    stages.append(Conv(h[2], norm=h[0]))
    for conv in (fsm.conv1, fsm.conv2):
        if _name(conv) != "CausalConv3d" or tuple(conv.kernel_size) != (1, 1, 1):
            return "WanVAE.conv1/conv2 are not 1x1x1 causal convolutions"
    return Program(version, encode, stages, pre=None if encode else fsm.conv2, post=fsm.conv1 if encode else None,
                   latent_channels=fsm.conv2.in_channels, patch=2 if version == "wan22" else 1)
