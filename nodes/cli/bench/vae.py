"""bench: low-memory VAE decode and encode vs untiled and vs ComfyUI's tiled nodes (random weights, real shapes).

One table per case; rows are decoders (encoders), measured one after another in this process:
* sdxl: a 1024x1024 image latent (128x128x4) through a KL VAE of SDXL's widths (quick: 256x256), ours at
  ComfyUI's tile size.
* peak / encode: SD- and Flux-width KL VAEs at a budget equal to ComfyUI's measured tiled peak, feather, exact
  and auto side by side, decode and encode.
* video: the causal 3-D VAEs at their real widths at ComfyUI tiled's measured peak -- a Qwen-Image frame
  (Wan 2.1's VAE; decode and encode), a Wan 2.1 clip, a Wan 2.2 clip and a HunyuanVideo 1.0 clip -- exact and
  auto, and the node's default (auto budget); needs ComfyUI (COMFYUI_PATH).

ComfyUI's VAEDecodeTiled / VAEEncodeTiled run with the nodes' defaults (512 px tiles, 64 px overlap; for
video 64 frames / 8 overlap), through the nodes themselves when ComfyUI's nodes.py is importable. Time = wall
seconds of one run; peak = bytes of live tensors allocated during it (weights excluded; CUDA: peak
allocated); PSNR in dB against the untiled run of the same VAE and input.
"""
from __future__ import annotations

import logging
import math
import sys
import time

import torch

from ... import vae as vt
from ...common.comfyui import import_comfy
from ...common.quality import psnr as psnr_db
from ...common.report import Table, bench_device, human_bytes, synchronize

log = logging.getLogger("comfy_metal")

COMFY_TILE_PX, COMFY_OVERLAP_PX = 512, 64            # VAEDecodeTiled's defaults
COMFY_TEMPORAL, COMFY_TEMPORAL_OVERLAP = 64, 8
# Model widths and latent sizes; tests shrink them.
SDXL_WIDTHS = (128, 256, 512, 512)                  # SDXL's VAE block_out_channels
SDXL_SIDE = {False: 128, True: 32}                   # latent side: 1024 px (quick: 256 px)
COLUMNS = ["decoder", "tiles", "seconds", "peak", "PSNR dB", "time / ComfyUI tiled", "peak / ComfyUI tiled"]


def _measure(fn, device, inference=False):
    synchronize(device)
    t0 = time.perf_counter()
    grad = torch.inference_mode() if inference else torch.no_grad()   # ComfyUI runs nodes in inference mode
    with vt.measure_peak(device) as m, grad:
        out = fn()
        synchronize(device)
    return out, time.perf_counter() - t0, m["peak"]


def _psnr(a, b):
    """PSNR of two [-1, 1] images (clamped), as ComfyUI shows them in [0, 1]."""
    return psnr_db(a.detach().cpu().clamp(-1, 1), b.detach().cpu().clamp(-1, 1), peak=2.0)


def _comfy():
    """comfy.sd when ComfyUI is importable (inside ComfyUI, or COMFYUI_PATH set); else the reason."""
    module, why_not = import_comfy("comfy.sd")
    return module if module is not None else why_not


def _comfy_node_class(name):
    """A class of ComfyUI's own nodes.py (its top-level module `nodes`, importable once ComfyUI's folder
    is on sys.path); LookupError when that module is not ComfyUI's or does not import."""
    import importlib

    try:
        module = importlib.import_module("nodes")
    except Exception as e:
        raise LookupError(f"ComfyUI's nodes.py does not import: {e}") from e
    if not hasattr(module, name):
        raise LookupError(f"the top-level module 'nodes' ({getattr(module, '__file__', '?')}) has no {name}")
    return getattr(module, name)


def _comfy_tiled_decode(vae, z):
    """ComfyUI's VAEDecodeTiled at its defaults -> pixels in [-1, 1], channels first. Through the node
    class when ComfyUI's nodes.py imports, else the same arithmetic on vae.decode_tiled."""
    try:
        node = _comfy_node_class("VAEDecodeTiled")()
        (img,) = node.decode(vae, {"samples": z}, COMFY_TILE_PX, COMFY_OVERLAP_PX, COMFY_TEMPORAL, COMFY_TEMPORAL_OVERLAP)
        if z.dim() == 5:
            img = img.reshape(z.shape[0], -1, *img.shape[1:]).movedim(-1, 1)     # [N, C, T, H, W]
        else:
            img = img.movedim(-1, 1)
    except LookupError:
        f = vae.spacial_compression_decode()
        kw = {}
        if z.dim() == 5:
            tc = vae.temporal_compression_decode()
            t = max(2, COMFY_TEMPORAL // tc)
            kw = {"tile_t": t, "overlap_t": max(1, min(t // 2, COMFY_TEMPORAL_OVERLAP // tc))}
        img = vae.decode_tiled(z, tile_x=COMFY_TILE_PX // f, tile_y=COMFY_TILE_PX // f, overlap=COMFY_OVERLAP_PX // f, **kw)
        img = img.movedim(-1, 1)
    return img * 2 - 1


def _random_sd(module: torch.nn.Module, seed=0) -> dict:
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for k, v in module.state_dict().items():
        if v.is_floating_point():
            fan_in = max(1, v[0].numel()) if v.dim() > 1 else 1
            sd[k] = (torch.randn(v.shape, generator=gen) / math.sqrt(fan_in)) if v.dim() > 1 else \
                (torch.ones(v.shape) if k.endswith(("weight", "gamma")) else torch.zeros(v.shape))
        else:
            sd[k] = v.clone()
    return sd


class _Case:
    """One table: rows are decoders (or encoders) of the same input; ratios against ComfyUI's tiled node.
    `psnr(out, ref)`: the PSNR in dB against the reference row (images in [-1, 1] by default)."""

    def __init__(self, title, device, columns=COLUMNS, psnr=None):
        self.table = Table(title, list(columns), note="")
        self.device = device
        self.ref = None
        self.comfy = None     # (seconds, peak)
        self.psnr = psnr or _psnr

    def note(self, text):
        self.table.note += ("\n" if self.table.note else "") + text

    def run(self, label, fn, tiles="", inference=False, reference=False, comfy=False):
        print(f"[bench vae] {self.table.title}: {label} ...", file=sys.stderr, flush=True)
        try:
            out, t, peak = _measure(fn, self.device, inference=inference)
        except Exception as e:
            self.table.add(label, tiles() if callable(tiles) else tiles, f"error: {type(e).__name__}: {str(e)[:70]}",
                           "", "", "", "")
            return None
        if reference:
            self.ref = out
        if comfy:
            self.comfy = (t, peak)
        psnr = "—" if reference else (round(self.psnr(out, self.ref), 1) if self.ref is not None else "n/a")
        ratio_t = ratio_p = "1x" if comfy else "n/a"
        if self.comfy and not comfy:
            ratio_t = f"{t / self.comfy[0]:.2f}x"
            ratio_p = f"{peak / self.comfy[1]:.2f}x" if self.comfy[1] else "n/a"
        self.table.add(label, tiles() if callable(tiles) else tiles, round(t, 2), human_bytes(peak), psnr,
                       ratio_t, ratio_p)
        print(f"[bench vae]   {t:.1f} s, peak {human_bytes(peak)}, PSNR {psnr}", file=sys.stderr, flush=True)
        return out


def _ours(case, label, codec, z, tile, overlap, seam="feather"):
    # the tile is fixed; the auto budget only sizes shared statistics' block cache (a quarter of it)
    eng = vt.TiledVAE(codec, vt.TilingOptions(tile=tile, overlap=overlap, seam=seam))
    case.run(label, lambda: eng.decode(z),
             tiles=lambda: "{} x {}x{} (ov {})".format(eng.info.tiles, *eng.info.tile_shape, eng.info.overlap))
    return eng


def _plan_cell(info):
    """What ran: the stage-by-stage exact decode's bands, or the tiles."""
    if info.scheme == "stages":
        return f"stages, {info.bands} bands (1 pass)"
    return "{} x {}x{} (ov {}, {} passes)".format(info.tiles, *info.tile_shape, info.overlap, info.passes)


def _comfy_tiles(z, scale):
    t, o = COMFY_TILE_PX // scale, COMFY_OVERLAP_PX // scale
    return f"3 passes, {t}x{t} (ov {o})" if z.dim() == 4 else f"{t}x{t} (ov {o})"


def _sdxl(quick, device, comfy_sd, AutoencoderKL, diffusers_problem) -> Table:
    side = SDXL_SIDE[quick]
    case = _Case(f"VAE decode, SDXL {side * 8}x{side * 8} (latent 4x{side}x{side}; device {device.type}, "
                 f"random weights)", device)
    try:
        if AutoencoderKL is None:
            raise RuntimeError(f"diffusers is needed to build the SDXL-width VAE ({diffusers_problem})")
        torch.manual_seed(0)
        dvae = AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                             block_out_channels=SDXL_WIDTHS, layers_per_block=2, latent_channels=4)
        sd = _random_sd(dvae)
        z = torch.randn(1, 4, side, side, device=device)
        if quick:
            tile, comfy_overlap = 16, 2
        else:
            tile, comfy_overlap = COMFY_TILE_PX // 8, COMFY_OVERLAP_PX // 8
        if not isinstance(comfy_sd, str):
            # decoder weights only (the bench decodes): ComfyUI infers the decoder's widths from them
            decoder_sd = {k: v for k, v in sd.items() if not k.startswith(("encoder.", "quant_conv."))}
            vae = comfy_sd.VAE(sd=decoder_sd, device=device, dtype=torch.float32)
            fsm = vae.first_stage_model.to(device)
            codec = vt.codec_from_comfy(vae)
            case.run("untiled (ComfyUI VAE.decode)", lambda: fsm.decode(z), "1", reference=True)
            if quick:
                case.run("ComfyUI tiled", lambda: vae.decode_tiled(z, tile_x=tile, tile_y=tile,
                                                                    overlap=comfy_overlap).movedim(-1, 1) * 2 - 1,
                         f"3 passes, {tile}x{tile} (ov {comfy_overlap})", inference=True, comfy=True)
            else:
                case.run("ComfyUI VAEDecodeTiled (defaults)", lambda: _comfy_tiled_decode(vae, z),
                         _comfy_tiles(z, 8), inference=True, comfy=True)
        else:
            dvae.load_state_dict(sd)
            dvae = dvae.to(device).eval()
            codec = vt.codec_from_diffusers(dvae)
            case.run("untiled (diffusers decode)", lambda: dvae.decode(z).sample, "1", reference=True)
            case.note(f"ComfyUI rows n/a: {comfy_sd}")
        _ours(case, "ours, feather, ComfyUI's overlap", codec, z, tile, comfy_overlap)
        _ours(case, "ours, feather", codec, z, tile, vt.default_overlap(tile))
        eng = _ours(case, "ours, shared GroupNorm stats", codec, z, tile, vt.default_overlap(tile), seam="exact")
        case.note(f"Ours is one pass at ComfyUI's tile size (tiles shrunk to the shortest length covering the "
                  f"image). Shared stats runs all tiles in lock-step from one GroupNorm to the next "
                  f"({eng.info.passes} passes, each recomputing only the block holding that GroupNorm from each "
                  f"tile's latest finished block, cached: {human_bytes(eng.info.stats_cache_peak)} at most, "
                  f"within a quarter of the auto budget, counted in its peak). Feather-only tiles each "
                  f"normalise themselves; PSNR rises with the overlap up to the decoder's receptive field "
                  f"(~16 latent px of halo).")
    except Exception as e:
        case.note(f"SDXL case failed: {type(e).__name__}: {e}")
    return case.table


PEAK_CASES = {False: [("SD/SDXL", 4, SDXL_WIDTHS), ("Flux", 16, SDXL_WIDTHS)],
              True: [("SD/SDXL", 4, (32, 64, 128, 128)), ("Flux", 16, (32, 64, 128, 128))]}
PEAK_LATENT = {False: (56, 88), True: (20, 28)}      # 448x704 (quick: 160x224): non-square


def _at_comfy_peak(quick, device, comfy_sd, AutoencoderKL, diffusers_problem) -> list[Table]:
    """Our decoder given ComfyUI's tiled peak as its budget, feather, exact (shared
    statistics; stage by stage when it fits) and auto (what the node runs by default) side by side, for an
    SD-width (4 ch) and a Flux-width (16 ch) KL VAE at a non-square size."""
    tables = []
    h, w = PEAK_LATENT[quick]
    for name, ch, widths in PEAK_CASES[quick]:
        case = _Case(f"VAE decode at ComfyUI's tiled peak, {name} width ({ch} ch) {w * 8}x{h * 8} "
                     f"(latent {ch}x{h}x{w}; device {device.type}, random weights)", device)
        tables.append(case.table)
        try:
            if isinstance(comfy_sd, str) or AutoencoderKL is None:
                raise RuntimeError(f"needs ComfyUI and diffusers: {comfy_sd if isinstance(comfy_sd, str) else diffusers_problem}")
            torch.manual_seed(0)
            dvae = AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4,
                                 up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=widths,
                                 layers_per_block=2, latent_channels=ch)
            sd = {k: v for k, v in _random_sd(dvae).items() if not k.startswith(("encoder.", "quant_conv."))}
            del dvae
            vae = comfy_sd.VAE(sd=sd, device=device, dtype=torch.float32)
            fsm = vae.first_stage_model.to(device)
            codec = vt.codec_from_comfy(vae)
            z = torch.randn(1, ch, h, w, device=device)
            case.run("untiled (ComfyUI VAE.decode)", lambda: fsm.decode(z), "1", reference=True)
            if quick:
                tile, ov = 12, 2
                case.run("ComfyUI tiled", lambda: vae.decode_tiled(z, tile_x=tile, tile_y=tile, overlap=ov)
                         .movedim(-1, 1) * 2 - 1, f"3 passes, {tile}x{tile} (ov {ov})", inference=True, comfy=True)
            else:
                case.run("ComfyUI VAEDecodeTiled (defaults)", lambda: _comfy_tiled_decode(vae, z),
                         _comfy_tiles(z, 8), inference=True, comfy=True)
            if not case.comfy:
                continue
            budget = int(case.comfy[1])
            got, chose = {}, ""
            for label, seam in (("feather", "feather"), ("exact (shared statistics)", "exact"), ("auto", "auto")):
                eng = vt.TiledVAE(codec, vt.TilingOptions(budget_bytes=budget, seam=seam))
                case.run(f"ours, budget = ComfyUI tiled peak, {label}", lambda: eng.decode(z),
                         tiles=lambda: _plan_cell(eng.info))
                got[label] = case.table.rows[-1][4]
                chose = eng.info.auto or chose
            case.note(f"Budget = ComfyUI's measured tiled peak ({human_bytes(budget)}). PSNR vs untiled: feather "
                      f"{got.get('feather')} dB, exact {got.get('exact (shared statistics)')} dB, auto "
                      f"{got.get('auto')} dB ({chose}). conv_in and the mid block (attention included) run once "
                      f"over the whole latent; exact then runs the up path stage by stage over the whole image in "
                      f"bands of rows (one pass), feather cuts tiles from the mid output.")
        except Exception as e:
            case.note(f"{name} case failed: {type(e).__name__}: {e}")
    return tables


ENCODE_COLUMNS = ["encoder", *COLUMNS[1:]]
COMFY_ENCODER_WIDTHS = (128, 256, 512, 512)     # the encoder comfy.sd builds for SD-layout state dicts
QUICK_ENCODE_TILE_PX = 160


def _latent_psnr(a, b):
    """PSNR of a latent against the untiled one, the peak being the untiled latent's largest magnitude."""
    b = b.detach().cpu().float()
    return psnr_db(a.detach().cpu(), b, peak=float(b.abs().max()))


def _bench_image(h, w, seed=0):
    """A deterministic test picture [1, h, w, 3] in [0, 1]: smooth colour regions (a coarse random grid,
    bicubic), a few hard-edged rectangles and mild pixel noise, so the encoder sees edges, gradients and
    texture as in a photo."""
    gen = torch.Generator().manual_seed(seed)
    img = torch.nn.functional.interpolate(torch.rand(1, 3, h // 64 + 2, w // 64 + 2, generator=gen), size=(h, w),
                                          mode="bicubic", align_corners=True)
    for _ in range(6):
        y0, x0 = int(torch.randint(0, h - h // 4, (), generator=gen)), int(torch.randint(0, w - w // 4, (), generator=gen))
        img[..., y0:y0 + h // 5, x0:x0 + w // 6] = torch.rand(1, 3, 1, 1, generator=gen)
    img = img + 0.03 * torch.randn(img.shape, generator=gen)
    return img.clamp(0, 1).movedim(1, -1).contiguous()


def _comfy_kl_vae(comfy_sd, AutoencoderKL, widths, channels, quant_conv, device):
    """A ComfyUI VAE (comfy.sd.VAE) with encoder and decoder, random weights at `widths`. ComfyUI detects
    the architecture from the state dict, and builds the encoder at SD's width (ch 128); other widths go
    through its `config` argument (then always with quant_conv)."""
    dvae = AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                         block_out_channels=widths, layers_per_block=2, latent_channels=channels,
                         use_quant_conv=quant_conv, use_post_quant_conv=quant_conv)
    sd = _random_sd(dvae)
    del dvae
    if tuple(widths) == COMFY_ENCODER_WIDTHS:
        return comfy_sd.VAE(sd=sd, device=device, dtype=torch.float32)
    ddconfig = {"double_z": True, "z_channels": channels, "resolution": 256, "in_channels": 3, "out_ch": 3,
                "ch": widths[0], "ch_mult": [w // widths[0] for w in widths], "num_res_blocks": 2,
                "attn_resolutions": [], "dropout": 0.0}
    vae = comfy_sd.VAE(sd=sd, device=device, dtype=torch.float32,
                       config={"params": {"ddconfig": ddconfig, "embed_dim": channels}})
    vae.latent_channels = channels      # the config path keeps SD's 4
    return vae


def _comfy_tiled_encode(vae, pixels, quick):
    """ComfyUI's VAEEncodeTiled at its defaults (512 px tiles, 64 px overlap; quick: 160 / 16, about the same
    share of the image) -> latent."""
    if not quick:
        try:
            node = _comfy_node_class("VAEEncodeTiled")()
            return node.encode(vae, pixels, COMFY_TILE_PX, COMFY_OVERLAP_PX, COMFY_TEMPORAL, COMFY_TEMPORAL_OVERLAP)[0]["samples"]
        except LookupError:
            pass
    tile, overlap = (QUICK_ENCODE_TILE_PX, 16) if quick else (COMFY_TILE_PX, COMFY_OVERLAP_PX)
    return vae.encode_tiled(pixels, tile_x=tile, tile_y=tile, overlap=overlap)


def _encode_at_comfy_peak(quick, device, comfy_sd, AutoencoderKL, diffusers_problem) -> list[Table]:
    """Our encoder given ComfyUI's tiled-encode peak as its budget, feather and exact (shared
    statistics) side by side, SD-width (4 ch) and Flux-width (16 ch, no quant_conv) KL VAEs, non-square."""
    tables = []
    h, w = PEAK_LATENT[quick]
    for name, ch, widths in PEAK_CASES[quick]:
        case = _Case(f"VAE encode at ComfyUI's tiled peak, {name} width ({ch} ch) {w * 8}x{h * 8} "
                     f"(latent {ch}x{h}x{w}; device {device.type}, random weights)", device, ENCODE_COLUMNS,
                     psnr=_latent_psnr)
        tables.append(case.table)
        try:
            if isinstance(comfy_sd, str) or AutoencoderKL is None:
                raise RuntimeError(f"needs ComfyUI and diffusers: {comfy_sd if isinstance(comfy_sd, str) else diffusers_problem}")
            torch.manual_seed(0)
            vae = _comfy_kl_vae(comfy_sd, AutoencoderKL, widths, ch, quant_conv=(name != "Flux" or quick), device=device)
            fsm = vae.first_stage_model.to(device)
            codec = vt.codec_from_comfy(vae)
            pixels = _bench_image(h * 8, w * 8)
            x = vae.process_input(pixels.movedim(-1, 1)).to(device)
            case.run("untiled (ComfyUI encode)", lambda: fsm.encode(x), "1", reference=True)
            t = QUICK_ENCODE_TILE_PX if quick else COMFY_TILE_PX
            case.run("ComfyUI tiled" if quick else "ComfyUI VAEEncodeTiled (defaults)",
                     lambda: _comfy_tiled_encode(vae, pixels, quick), f"3 passes, {t} px (ov {16 if quick else 64})",
                     inference=True, comfy=True)
            if not case.comfy:
                continue
            budget = int(case.comfy[1])
            got, chose, tiled = {}, "", None
            for label, seam in (("feather", "feather"), ("exact (shared statistics)", "exact"), ("auto", "auto")):
                eng = vt.TiledVAE(codec, vt.TilingOptions(budget_bytes=budget, seam=seam))
                case.run(f"ours, budget = ComfyUI tiled peak, {label}", lambda: eng.encode(x),
                         tiles=lambda: _plan_cell(eng.info))
                got[label] = case.table.rows[-1][4]
                chose = eng.info.auto or chose
                tiled = eng.info if seam == "feather" else tiled
            case.note(f"Budget = ComfyUI's measured tiled-encode peak ({human_bytes(budget)}). Latent PSNR vs the "
                      f"untiled encode (peak = its largest magnitude): feather {got.get('feather')} dB, exact "
                      f"{got.get('exact (shared statistics)')} dB, auto {got.get('auto')} dB ({chose}). Exact runs "
                      f"the encoder's down path stage by stage over the whole image in bands of rows when it fits "
                      f"(one pass), else tiles in lock-step. "
                      + (f"Feather's tiles run the encoder's first {tiled.tiled_stages} of {len(codec.encode_stages) - 1} "
                         f"down levels, blended at their output resolution; the rest, its mid block (attention "
                         f"included), norm_out and conv_out run once over the whole image."
                         if tiled is not None and tiled.untiled_rest else "Feather's tiles ran the whole encoder "
                         "(its rest did not fit untiled)."))
        except Exception as e:
            case.note(f"{name} encode case failed: {type(e).__name__}: {e}")
    return tables


WAN21_DIM = 96                                       # Wan 2.1's / Qwen-Image's VAE width (comfy/sd.py reads it)
WAN22_DIM, WAN22_DEC_DIM = 160, 256                  # ComfyUI's Wan 2.2 VAE (comfy/sd.py)
# HunyuanVideo 1.0's VAE as comfy/sd.py builds it for the `decoder.conv_in.conv.weight` layout (its real width)
HUNYUAN_DDCONFIG = {"double_z": True, "z_channels": 16, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                    "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0,
                    "conv3d": True, "time_compress": 4}
# (title, VAE, latent (frames, h, w)) per case; quick: the same VAEs at their real widths, smaller frames
VIDEO_CASES = {
    False: [("Qwen-Image frame", "wan21", (1, 80, 80)), ("Wan 2.1 clip", "wan21", (3, 24, 32)),
            ("Wan 2.2 clip", "wan22", (3, 8, 12)), ("HunyuanVideo clip", "hunyuan", (3, 16, 24))],
    True: [("Qwen-Image frame", "wan21", (1, 10, 12)), ("Wan 2.1 clip", "wan21", (2, 4, 6)),
           ("Wan 2.2 clip", "wan22", (2, 3, 4)), ("HunyuanVideo clip", "hunyuan", (2, 4, 6))],
}


def _comfy_video_vae(comfy_sd, which, device):
    """A ComfyUI VAE object (comfy.sd.VAE) of Wan 2.1 / Qwen-Image, Wan 2.2 or HunyuanVideo 1.0 at its real width,
    random weights."""
    if which == "hunyuan":
        from comfy.ldm.models.autoencoder import AutoencoderKL

        model = AutoencoderKL(ddconfig=HUNYUAN_DDCONFIG, embed_dim=16)
    elif which == "wan21":
        import comfy.ldm.wan.vae as wan

        model = wan.WanVAE(dim=WAN21_DIM, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                           temperal_downsample=[False, True, True])
    else:
        import comfy.ldm.wan.vae2_2 as wan

        model = wan.WanVAE(dim=WAN22_DIM, dec_dim=WAN22_DEC_DIM, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2,
                           attn_scales=[], temperal_downsample=[False, True, True])
    torch.manual_seed(0)
    vae = comfy_sd.VAE(sd=_random_sd(model), device=device, dtype=torch.float32)
    del model
    vae.first_stage_model.to(device)
    return vae


def _quick_tiled(vae, z=None, pixels=None):
    """ComfyUI's tiled decode/encode with its default tiles scaled to the quick sizes: 4/5 of the frame's side
    with 1/8 of that overlap, as its 512 px tiles (64 px overlap) are to the full-size Qwen-Image frame."""
    if z is not None:
        tile = max(2, min(z.shape[-2], z.shape[-1]) * 4 // 5)
        return vae.decode_tiled(z, tile_x=tile, tile_y=tile, overlap=max(1, tile // 8), tile_t=16,
                                overlap_t=2).movedim(-1, 1) * 2 - 1
    f = vae.spacial_compression_encode()
    tile = max(2 * f, min(pixels.shape[1], pixels.shape[2]) * 4 // 5 // f * f)
    return vae.encode_tiled(pixels, tile_x=tile, tile_y=tile, overlap=max(f, tile // 8 // f * f), tile_t=64,
                            overlap_t=8)


def _ours_at_peak(case, codec, run, budget):
    """Our rows at ComfyUI tiled's peak (exact, auto), then the node's default (auto budget, seam auto); the
    note gives the default's peak against ComfyUI's untiled one."""
    chose, default = "", None
    for label, seam, b in (("exact", "exact", budget), ("auto", "auto", budget), ("default (auto budget)", "auto", 0)):
        eng = vt.TiledVAE(codec, vt.TilingOptions(budget_bytes=b, seam=seam))
        prefix = "ours, budget = ComfyUI tiled peak, " if b else "ours, "
        case.run(prefix + label, lambda: run(eng), tiles=lambda: _plan_cell(eng.info))
        if b and seam == "auto":
            chose = eng.info.auto
        if not b and case.table.rows[-1][3]:
            default = case.table.rows[-1][3]
    return chose, default


def _video_at_comfy_peak(quick, device, comfy_sd) -> list[Table]:
    """The causal 3-D VAEs at ComfyUI tiled's measured peak: a Qwen-Image frame (Wan 2.1's VAE, decode and
    encode), a Wan 2.1 clip, a Wan 2.2 clip and a HunyuanVideo clip (decode), each at the VAE's real width. Rows: ComfyUI's untiled
    run (the PSNR reference), ComfyUI's tiled node at its defaults (the budget), ours exact and auto at that
    budget, and ours at the node's default (auto budget)."""
    tables = []
    if isinstance(comfy_sd, str):
        return [Table("VAE decode/encode, Wan 2.1 / Qwen-Image / Wan 2.2 / HunyuanVideo", COLUMNS,
                      note=f"Needs ComfyUI's video VAEs (set COMFYUI_PATH): {comfy_sd}")]
    vaes = {}
    for title, which, (t, h, w) in VIDEO_CASES[quick]:
        vae = vaes.get(which) or vaes.setdefault(which, _comfy_video_vae(comfy_sd, which, device))
        fsm = vae.first_stage_model
        codec = vt.codec_from_comfy(vae)
        f = codec.scale
        frames = 1 + 4 * (t - 1)
        zc = vae.latent_channels
        encodes = [False, True] if t == 1 else [False]
        for encode in encodes:
            what = "encode" if encode else "decode"
            case = _Case(f"VAE {what} at ComfyUI's tiled peak, {title} {w * f}x{h * f}, {frames} frame(s) "
                         f"(latent {zc}x{t}x{h}x{w}; device {device.type}, random weights, real width)", device,
                         ENCODE_COLUMNS if encode else COLUMNS, psnr=_latent_psnr if encode else None)
            tables.append(case.table)
            try:
                torch.manual_seed(1)
                if encode:
                    pixels = _bench_image(h * f, w * f)
                    x = vae.process_input(pixels.movedim(-1, 1)).movedim(1, 0).unsqueeze(0).to(device)

                    case.run("untiled (ComfyUI encode)", lambda: fsm.encode(x), "1", reference=True)
                    tiled = (lambda: _quick_tiled(vae, pixels=pixels)) if quick else \
                        (lambda: _comfy_tiled_encode(vae, pixels, False))
                    case.run("ComfyUI tiled" if quick else "ComfyUI VAEEncodeTiled (defaults)", tiled,
                             "1 pass, 3-D tiles", inference=True, comfy=True)
                    run = lambda eng: eng.encode(x)
                else:
                    x = torch.randn(1, zc, t, h, w, device=device)
                    case.run("untiled (ComfyUI VAE.decode)", lambda: fsm.decode(x), "1", reference=True)
                    tiled = (lambda: _quick_tiled(vae, z=x)) if quick else (lambda: _comfy_tiled_decode(vae, x))
                    case.run("ComfyUI tiled" if quick else "ComfyUI VAEDecodeTiled (defaults)", tiled,
                             _comfy_tiles(x, f), inference=True, comfy=True)
                    run = lambda eng: eng.decode(x)
                if not case.comfy:
                    continue
                untiled_peak = next((r[3] for r in case.table.rows if r[0].startswith("untiled")), "")
                chose, default = _ours_at_peak(case, codec, run, int(case.comfy[1]))
                case.note(f"Budget = ComfyUI's measured tiled {what} peak ({human_bytes(int(case.comfy[1]))}); auto: "
                          f"{chose or '?'}. Exact runs every stage over the whole frame in bands of rows, chunk by "
                          f"chunk in time with ComfyUI's own chunking and whole-frame causal caches. The default "
                          f"row (auto budget) peaks at {default} against the untiled run's {untiled_peak}.")
            except Exception as e:
                case.note(f"{title} {what} case failed: {type(e).__name__}: {e}")
    return tables


PARTS = ("sdxl", "peak", "encode", "video")     # `bench --only vae:encode` runs one part ("wan": video)


def bench(quick: bool = False, parts=None) -> list[Table]:
    """The VAE tables; `parts` (names from PARTS) picks some of them, default all."""
    parts = ["video" if p == "wan" else p for p in parts or ()]
    unknown = set(parts) - set(PARTS)
    if unknown:
        raise ValueError(f"bench vae: unknown part(s) {sorted(unknown)}; known: {', '.join(PARTS)}")
    parts = set(parts or PARTS)
    device = bench_device()
    AutoencoderKL, diffusers_problem = None, ""
    try:  # before ComfyUI's path (its test stubs shadow torchvision, which diffusers imports)
        from diffusers import AutoencoderKL
    except Exception as e:
        diffusers_problem = f"{type(e).__name__}: {e}"
    comfy_sd = _comfy()
    args = (quick, device, comfy_sd, AutoencoderKL, diffusers_problem)
    return [*([_sdxl(*args)] if "sdxl" in parts else []), *(_at_comfy_peak(*args) if "peak" in parts else []),
            *(_encode_at_comfy_peak(*args) if "encode" in parts else []),
            *(_video_at_comfy_peak(quick, device, comfy_sd) if "video" in parts else [])]
