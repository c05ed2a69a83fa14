"""Codecs: `decode(z_tile)` / `encode(x_tile)` adapters around a VAE's own modules (ComfyUI's VAE objects,
diffusers' AutoencoderKL / AutoencoderKLWan, HunyuanVideo, or a bare function)."""
from __future__ import annotations

import dataclasses
import sys
from typing import Callable

import torch

from . import causal_program, hunyuan
from .stagewise import comfy_tail_stages, diffusers_tail_stages
from .stagewise_encode import comfy_body_stages, diffusers_body_stages

# ---------------------------------------------------------------- codecs


@dataclasses.dataclass
class Codec:
    """How to run one VAE on tiles.

    decode(z) -> pixels for an image latent tile [N, C, h, w] (or a video tile, whole);
    decode_stream(z) -> iterator of pixel chunks [N, C, tc, H, W] in time order (causal video VAEs,
        each spatial tile with its own temporal cache); None for image VAEs;
    encode(x) -> latent for a pixel tile (already in the VAE's input range).
    scale: spatial pixels per latent pixel. module: the nn.Module holding the weights (GroupNorm
    discovery, CPU fallback). device/dtype: where and in what the VAE runs.
    """
    name: str
    scale: int
    decode: Callable | None
    encode: Callable | None = None
    decode_stream: Callable | None = None
    module: torch.nn.Module | None = None
    device: torch.device = torch.device("cpu")
    dtype: torch.dtype = torch.float32
    video: bool = False
    out_channels: int = 3
    latent_channels: int = 4
    sequential_blocks: bool = False   # the decoder is a plain chain of its blocks (shared statistics' cache)
    calibrate_all_frames: bool = False   # video: the decoder holds every latent frame at once (a mid block over
                                         # the whole clip), so its peak grows with the frame count: calibrate
                                         # the cost model on the real frame count, not on two frames
    attention_over_frames: bool = False  # video: the mid attention runs over all latent frames of a tile as one
                                         # sequence (HunyuanVideo 1.0), not frame by frame (Wan)
    # Image KL decoders split at the mid block: decode(z) == decode_tail(decode_head(z)). The head
    # (post_quant_conv, conv_in, mid block with its global attention) keeps the latent's grid, so the
    # engine runs it once over the whole latent and tiles only the tail (the up path), cut from the
    # whole-image mid output with a halo: the attention and the mid GroupNorms then see the whole image.
    decode_head: Callable | None = None
    decode_tail: Callable | None = None
    # The tail as a chain of one-row-reach stages (stagewise.py): exact shared statistics in one pass.
    decode_stages: list | None = None
    # Image KL encoders as a chain of stages: encode(x) == stages[-1](...stages[0](x)), one stage per
    # resolution level (conv_in with the first), then the rest (mid block with its global attention, norm_out,
    # conv_out, quant_conv, the posterior's mode); encode_scales[i] = input pixels per pixel of stage i's
    # output. The engine tiles only the first stages (the full-resolution ones, whose activations are what
    # needs tiling), blends their tiles at their output resolution, and runs the rest once over the whole
    # feature map: the attention and every later GroupNorm see the whole image.
    encode_stages: tuple = ()
    encode_scales: tuple = ()
    encode_reach: tuple = ()      # input pixels an output pixel of stage i depends on, each side (receptive radius)
    # The down path (all stages but the last) as one-row-reach stages (stagewise_encode.py): exact in one pass;
    # encode_input: the VAE's input transform for the pixels those stages read (the node sets process_input).
    encode_body_stages: list | None = None
    encode_input: Callable | None = None
    # Causal 3-D video VAEs (Wan 2.1 / Qwen-Image, Wan 2.2, HunyuanVideo 1.0): the decoder and the encoder as
    # stage programs (causal_program.Program, hunyuan.HunyuanProgram: run exact stage by stage over the whole
    # frame by `program.runner(...)`), or why not (`programs_note`).
    decode_program: object = None
    encode_program: object = None
    programs_note: str = ""

    def frames_out(self, t_latent: int) -> int:
        return t_latent if not self.video else 1 + 4 * (t_latent - 1)


def _module_device_dtype(module):
    for p in module.parameters():
        return p.device, p.dtype
    return torch.device("cpu"), torch.float32


def codec_from_diffusers(vae) -> Codec:
    """diffusers AutoencoderKL (image) or AutoencoderKLWan (causal video)."""
    device, dtype = _module_device_dtype(vae)
    cls = type(vae).__name__
    if cls == "AutoencoderKLWan":
        import importlib

        wan = importlib.import_module(type(vae).__module__)
        patch = vae.config.patch_size

        def stream(z):
            x = vae.post_quant_conv(z)
            counts = getattr(vae, "_cached_conv_counts", None)
            n = counts["decoder"] if counts else sum(isinstance(m, wan.WanCausalConv3d) for m in vae.decoder.modules())
            cache = [None] * n
            for i in range(x.shape[2]):
                out = vae.decoder(x[:, :, i:i + 1], feat_cache=cache, feat_idx=[0], first_chunk=(i == 0))
                if patch is not None:
                    out = wan.unpatchify(out, patch_size=patch)
                yield out.clamp(-1.0, 1.0)

        def encode(x):
            return vae.encode(x).latent_dist.mode()

        scale = int(vae.spatial_compression_ratio) if hasattr(vae, "spatial_compression_ratio") else 8
        return Codec("diffusers-wan", scale, decode=lambda z: vae.decode(z).sample, encode=encode,
                     decode_stream=stream, module=vae, device=device, dtype=dtype, video=True,
                     out_channels=3, latent_channels=vae.config.z_dim)
    if cls in ("AutoencoderKL",):
        scale = 2 ** (len(vae.config.block_out_channels) - 1)
        dec = vae.decoder

        def head(z):
            if vae.post_quant_conv is not None:
                z = vae.post_quant_conv(z)
            return dec.mid_block(dec.conv_in(z), None)

        def tail(h):
            for up_block in dec.up_blocks:
                h = up_block(h, None)
            return dec.conv_out(dec.conv_act(dec.conv_norm_out(h)))

        split = type(dec).__name__ == "Decoder" and hasattr(dec, "mid_block") and hasattr(dec, "conv_norm_out")
        enc = vae.encoder

        def level(i):
            def run(h):
                return enc.down_blocks[i](enc.conv_in(h) if i == 0 else h)
            return run

        def enc_rest(h):
            h = enc.conv_out(enc.conv_act(enc.conv_norm_out(enc.mid_block(h))))
            if vae.quant_conv is not None:
                h = vae.quant_conv(h)
            return torch.chunk(h, 2, dim=1)[0]          # DiagonalGaussianDistribution(h).mode(): the mean

        stages, scales = (), ()
        if type(enc).__name__ == "Encoder" and getattr(enc, "mid_block", None) is not None \
                and hasattr(enc, "conv_norm_out") and not getattr(vae, "use_tiling", False):
            stages = (*(level(i) for i in range(len(enc.down_blocks))), enc_rest)
            downs = [bool(getattr(b, "downsamplers", None)) for b in enc.down_blocks]
            scales = _cumulative([2 if d else 1 for d in downs])
            reach = _reach([len(getattr(b, "resnets", ())) for b in enc.down_blocks], downs)
            stages, scales = (stages, scales) if scales[-1] == scale else ((), ())
        return Codec("diffusers-kl", scale, decode=lambda z: vae.decode(z).sample,
                     decode_head=head if split else None, decode_tail=tail if split else None,
                     decode_stages=diffusers_tail_stages(dec) if split else None,
                     encode_stages=stages, encode_scales=scales, encode_reach=reach if stages else (),
                     encode_body_stages=diffusers_body_stages(enc) if stages else None,
                     encode=lambda x: vae.encode(x).latent_dist.mode(), module=vae, device=device, dtype=dtype,
                     out_channels=vae.config.out_channels, latent_channels=vae.config.latent_channels,
                     sequential_blocks=True)
    raise TypeError(f"no tiling codec for diffusers model {cls}")


def codec_from_comfy(vae) -> Codec | None:
    """A codec over a ComfyUI VAE object (comfy.sd.VAE) for the architectures we know; None otherwise
    (the node then uses ComfyUI's own tiled decode)."""
    fsm = getattr(vae, "first_stage_model", None)
    if fsm is None:
        return None
    device = torch.device(getattr(vae, "device", "cpu"))
    dtype = getattr(vae, "vae_dtype", torch.float32)
    mod = type(fsm).__module__
    cls = type(fsm).__name__
    latent_dim = getattr(vae, "latent_dim", 2)
    scale = vae.spacial_compression_decode() if hasattr(vae, "spacial_compression_decode") else 8
    if getattr(vae, "handles_tiling", False) or getattr(fsm, "comfy_has_chunked_io", False):
        return None
    if mod.startswith("diffusers.") and cls in ("AutoencoderKL", "AutoencoderKLWan"):
        return codec_from_diffusers(fsm)     # a VAE-like wrapper around a diffusers model
    if latent_dim == 2 and cls in ("AutoencoderKL", "AutoencodingEngine", "AutoencodingEngineLegacy") \
            and type(getattr(fsm, "decoder", None)).__name__ == "Decoder" \
            and type(fsm.decoder).__module__.endswith("diffusionmodules.model") \
            and getattr(fsm, "bn", None) is None and getattr(vae, "extra_1d_channel", None) is None:
        head, tail = _comfy_kl_split(fsm)
        stages, scales, reach = _comfy_kl_encoder_stages(fsm, int(scale))
        return Codec("comfy-kl", int(scale), decode=lambda z: fsm.decode(z), encode=lambda x: fsm.encode(x),
                     decode_head=head, decode_tail=tail,
                     decode_stages=comfy_tail_stages(fsm.decoder) if tail is not None else None,
                     encode_stages=stages, encode_scales=scales, encode_reach=reach,
                     encode_body_stages=comfy_body_stages(fsm.encoder) if stages else None, module=fsm, device=device, dtype=dtype, out_channels=getattr(vae, "output_channels", 3),
                     latent_channels=vae.latent_channels, sequential_blocks=True)
    if latent_dim == 3 and cls == "WanVAE" and mod.endswith("wan.vae"):
        def stream(z):
            import comfy.ldm.wan.vae as wan

            # one latent frame is one chunk: no cache, as in ComfyUI's decode (a cache would keep every
            # convolution's input alive until the end)
            cache = [None] * wan.count_cache_layers(fsm.decoder) if z.shape[2] > 1 else None
            x = fsm.conv2(z)
            chunks = [(0, 1)] + [(1 + 2 * (i - 1), min(1 + 2 * i, x.shape[2])) for i in range(1, 1 + x.shape[2] // 2)]
            for a, b in chunks:
                if a >= b:
                    continue
                out = fsm.decoder(x[:, :, a:b], feat_cache=cache, feat_idx=[0])
                yield torch.cat(out, 2) if isinstance(out, (list, tuple)) else out
        return Codec("comfy-wan21", int(scale), decode=lambda z: fsm.decode(z), encode=lambda x: fsm.encode(x),
                     decode_stream=stream, module=fsm, device=device, dtype=dtype, video=True,
                     out_channels=getattr(vae, "conv_out_channels", 3), latent_channels=vae.latent_channels,
                     **_wan_programs(fsm))
    if latent_dim == 3 and cls == "WanVAE" and mod.endswith("wan.vae2_2"):
        def stream(z):
            import comfy.ldm.wan.vae2_2 as wan

            counter = getattr(wan, "count_conv3d", None)
            cache = [None] * (counter(fsm.decoder) if counter else 256)
            x = fsm.conv2(z)
            for i in range(x.shape[2]):
                out = fsm.decoder(x[:, :, i:i + 1], feat_cache=cache, feat_idx=[0], first_chunk=(i == 0))
                if isinstance(out, (list, tuple)):
                    out = torch.cat(out, 2)
                yield wan.unpatchify(out, patch_size=2)
        return Codec("comfy-wan22", int(scale), decode=lambda z: fsm.decode(z), encode=lambda x: fsm.encode(x),
                     decode_stream=stream, module=fsm, device=device, dtype=dtype, video=True,
                     out_channels=3, latent_channels=vae.latent_channels, **_wan_programs(fsm))
    hunyuan = _comfy_hunyuan_video_codec(vae, fsm, latent_dim, scale, device, dtype)
    if hunyuan is not None:
        return hunyuan
    return None


def _wan_programs(fsm) -> dict:
    """The Codec fields of a WanVAE's stage programs (causal_program.py)."""
    return _programs(causal_program.program(fsm, encode=False), causal_program.program(fsm, encode=True))


def _programs(dec, enc) -> dict:
    """The Codec fields of a video VAE's decoder and encoder stage programs: each a program, or None with the
    reason (a string in place of the program)."""
    notes = [f"{what}: {p}" for what, p in (("decoder", dec), ("encoder", enc)) if isinstance(p, str)]
    return {"decode_program": None if isinstance(dec, str) else dec,
            "encode_program": None if isinstance(enc, str) else enc, "programs_note": "; ".join(notes)}


def _comfy_kl_split(fsm):
    """(head, tail) of ComfyUI's 2-D SD Decoder (SD 1.x/2.x, SDXL, SD3, Flux), the same modules in the
    same order as `Decoder.forward`; (None, None) when its forward is not the plain chain (carried
    causal convolutions, batch splitting)."""
    dec = fsm.decoder
    dm = sys.modules.get(type(dec).__module__)
    nonlin = getattr(dm, "nonlinearity", None)
    if nonlin is None or getattr(dec, "carried", False) or getattr(fsm, "max_batch_size", None) \
            or not hasattr(dec, "mid") or not hasattr(fsm, "post_quant_conv"):
        return None, None

    def head(z):
        h = dec.conv_in(fsm.post_quant_conv(z))
        h = dec.mid.block_1(h, None)
        h = dec.mid.attn_1(h)
        return dec.mid.block_2(h, None)

    def tail(h):
        for level in reversed(range(dec.num_resolutions)):
            for i, block in enumerate(dec.up[level].block):
                h = block(h, None)
                if len(dec.up[level].attn) > 0:
                    h = dec.up[level].attn[i](h)
            if level != 0:
                h = dec.up[level].upsample(h)
        h = dec.conv_out(nonlin(dec.norm_out(h)))
        return torch.tanh(h) if getattr(dec, "tanh_out", False) else h

    return head, tail


def _reach(res_blocks, downsamples) -> tuple:
    """Receptive radius in input pixels after each down level of an SD encoder (conv_in, then per level
    `res_blocks[i]` ResNet blocks of two 3x3 convolutions at stride 2^i and a 3x3 stride-2 downsample),
    the rest keeping the last (it runs untiled)."""
    out, r, s = [], 1, 1
    for n, down in zip(res_blocks, downsamples):
        r += 2 * n * s + (2 * s if down else 0)
        s *= 2 if down else 1
        out.append(r)
    return (*out, r)


def _cumulative(factors) -> tuple:
    """Input pixels per output pixel after each stage, from each stage's own downscale factor; the rest
    (the last stage) keeps the last."""
    out, s = [], 1
    for k in factors:
        s *= k
        out.append(s)
    return (*out, s)


def _comfy_kl_encoder_stages(fsm, scale):
    """(stages, scales, reach) of ComfyUI's 2-D SD Encoder (SD 1.x/2.x, SDXL, SD3, Flux) and the rest of
    `fsm.encode`, the same modules in the same order as `Encoder.forward` + `encode`: one stage per down
    level (conv_in with the first, each level's downsample with it), then the rest: the mid block,
    norm_out, conv_out, quant_conv (the legacy engines have one) and the regulariser (the posterior's
    mode). ((), (), ()) when the encoder is not that plain chain (carried causal convolutions, batch splitting)."""
    enc = getattr(fsm, "encoder", None)
    dm = sys.modules.get(type(enc).__module__)
    nonlin = getattr(dm, "nonlinearity", None)
    if type(enc).__name__ != "Encoder" or nonlin is None or getattr(enc, "carried", False) \
            or getattr(fsm, "max_batch_size", None) or not hasattr(enc, "mid") \
            or not callable(getattr(fsm, "regularization", None)):
        return (), (), ()
    quant_conv = getattr(fsm, "quant_conv", None)
    last = enc.num_resolutions - 1

    def level(i):
        def run(h):
            if i == 0:
                h = enc.conv_in(h)
            for j, block in enumerate(enc.down[i].block):
                h = block(h, None)
                if len(enc.down[i].attn) > 0:
                    h = enc.down[i].attn[j](h)
            return enc.down[i].downsample(h) if i != last else h
        return run

    def rest(h):
        h = enc.mid.block_1(h, None)
        h = enc.mid.attn_1(h)
        h = enc.mid.block_2(h, None)
        h = enc.conv_out(nonlin(enc.norm_out(h)))
        if quant_conv is not None:
            h = quant_conv(h)
        return fsm.regularization(h)[0]

    scales = _cumulative([2 if i != last else 1 for i in range(last + 1)])     # 2-D Downsample: stride 2
    if scales[-1] != scale:
        return (), (), ()
    reach = _reach([len(enc.down[i].block) for i in range(last + 1)], [i != last for i in range(last + 1)])
    return (*(level(i) for i in range(last + 1)), rest), scales, reach


def _comfy_hunyuan_video_codec(vae, fsm, latent_dim, scale, device, dtype) -> Codec | None:
    """HunyuanVideo 1.0: ComfyUI's SD Encoder/Decoder (diffusionmodules.model) built with causal 3-D
    convolutions (`ddconfig["conv3d"]`, `time_compress=4`), 8x spatial, 4x temporal.

    Its decoder runs conv_in and the mid block (attention included) over every latent frame at once,
    then the up path on chunks of two latent frames, each causal convolution carrying its last two
    input frames to the next chunk (`conv_carry_causal_3d`). `decode_stream` drives the same modules in
    the same order and yields each chunk's frames as soon as they are decoded, so per spatial tile only
    the latent-resolution mid activations hold all frames; the full-resolution work is flat in the
    frame count. Decoders without the carried path (VideoConv3d: attention at some resolution) decode
    each spatial tile whole. The encoder chunks its input itself (`fsm.encode` per spatial tile). The carried
    decoder and encoder are also stage programs (hunyuan.py), which run exact over the whole frame."""
    dec, enc = getattr(fsm, "decoder", None), getattr(fsm, "encoder", None)
    if latent_dim != 3 or type(fsm).__name__ not in ("AutoencoderKL", "AutoencodingEngineLegacy") \
            or not type(fsm).__module__.endswith("models.autoencoder") or getattr(fsm, "bn", None) is not None:
        return None
    if type(dec).__name__ != "Decoder" or not type(dec).__module__.endswith("diffusionmodules.model"):
        return None
    conv3d = ("CarriedConv3d", "VideoConv3d")
    if type(getattr(dec, "conv_in", None)).__name__ not in conv3d:
        return None
    try:
        tc = vae.temporal_compression_decode() if hasattr(vae, "temporal_compression_decode") else None
    except Exception:
        tc = None
    if tc != 4:
        return None          # Codec.frames_out assumes 1 + 4 * (t - 1)
    encode = None
    if type(enc).__name__ == "Encoder" and type(enc).__module__.endswith("diffusionmodules.model") \
            and type(getattr(enc, "conv_in", None)).__name__ in conv3d:
        encode = lambda x: fsm.encode(x)
    stream = None
    dm = sys.modules.get(type(dec).__module__)
    step = getattr(dm, "conv_carry_causal_3d", None)
    if step is not None and getattr(dec, "carried", False) and hasattr(dm, "nonlinearity") \
            and all(len(getattr(u, "attn", ())) == 0 for u in dec.up) and not getattr(fsm, "max_batch_size", None):
        def stream(z):
            h = step([fsm.post_quant_conv(z)], dec.conv_in)
            h = dec.mid.block_1(h, None)
            h = dec.mid.attn_1(h)
            h = dec.mid.block_2(h, None)
            n = h.shape[2]
            carry_in = None
            for a in range(0, n, 2):
                carry_out = [] if a + 2 < n else None     # the last chunk carries nothing on
                x = h[:, :, a:a + 2]
                for level in reversed(range(dec.num_resolutions)):
                    for block in dec.up[level].block:
                        x = block(x, None, carry_in, carry_out)
                    if level != 0:
                        x = dec.up[level].upsample(x, carry_in, carry_out)
                x = step([dm.nonlinearity(dec.norm_out(x))], dec.conv_out, carry_in, carry_out)
                if getattr(dec, "tanh_out", False):
                    x = torch.tanh(x)
                yield x
                carry_in = carry_out
    return Codec("comfy-hunyuan-video", int(scale), decode=lambda z: fsm.decode(z), encode=encode,
                 decode_stream=stream, module=fsm, device=device, dtype=dtype, video=True,
                 out_channels=getattr(vae, "output_channels", 3), latent_channels=vae.latent_channels,
                 calibrate_all_frames=True, attention_over_frames=True,
                 **_programs(hunyuan.program(fsm, encode=False), hunyuan.program(fsm, encode=True) if encode else
                             "no carried causal 3-D encoder"))


def codec_from_fn(decode_fn, scale: int, encode_fn=None, module=None, device="cpu", dtype=torch.float32) -> Codec:
    """A codec over bare functions (tests, custom VAEs)."""
    return Codec("function", int(scale), decode=decode_fn, encode=encode_fn, module=module,
                 device=torch.device(device), dtype=dtype)
