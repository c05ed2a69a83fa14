"""bench: tiled low-memory VAE decode vs untiled and vs ComfyUI's VAEDecodeTiled (random weights, real shapes).

SDXL: a 1024x1024 image latent (128x128x4) through an SD/SDXL-width KL VAE (quick: 256x256).
Wan 2.2: a 720p latent (48 ch, 45x80, 16x) through the Wan 2.2 VAE when ComfyUI is importable (quick: tiny).
Peak = bytes of live tensors allocated during the decode (CUDA: peak allocated). ComfyUI's tiled decode
runs at the same tile size and overlap as ours. PSNR against the untiled decode of the same VAE.
"""
from __future__ import annotations

import logging
import math
import os
import sys
import time

import torch

from . import vae_tiling as vt
from .report import Table, bench_device, human_bytes, synchronize

log = logging.getLogger("comfy_metal")


def _measure(fn, device, inference=False):
    synchronize(device)
    t0 = time.perf_counter()
    grad = torch.inference_mode() if inference else torch.no_grad()   # ComfyUI runs nodes in inference mode
    with vt.measure_peak(device) as m, grad:
        out = fn()
        synchronize(device)
    return out, time.perf_counter() - t0, m["peak"]


def _psnr(a, b):
    a = a.detach().float().cpu().clamp(-1, 1)
    b = b.detach().float().cpu().clamp(-1, 1)
    mse = float(((a - b) ** 2).mean()) / 4.0     # [-1, 1] -> [0, 1]
    return float("inf") if mse == 0 else 10 * math.log10(1.0 / mse)


def _comfy():
    """comfy.sd (+ model_management) when ComfyUI is importable (inside ComfyUI, or COMFYUI_PATH set)."""
    path = os.environ.get("COMFYUI_PATH")
    if path and path not in sys.path:
        sys.path.insert(0, path)
        stubs = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests", "comfy_stubs")
        if os.path.isdir(stubs):
            sys.path.append(stubs)
    try:
        import comfy.cli_args

        if not (torch.cuda.is_available() or torch.backends.mps.is_available()):
            comfy.cli_args.args.cpu = True
        import comfy.sd  # noqa: F401

        return comfy.sd
    except Exception as e:
        return f"ComfyUI not importable ({type(e).__name__}: {str(e)[:80]})"


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


def _row(table, label, shape, device, ref, ref_t, ref_peak, ours, comfy_fn):
    out, t, peak = _measure(ours[0], device)
    info = ours[1]()
    comfy_cells = ["n/a", "n/a", "n/a"]
    if comfy_fn is not None:
        try:
            c_out, c_t, c_peak = _measure(comfy_fn, device, inference=True)
            comfy_cells = [round(c_t, 2), human_bytes(c_peak), round(_psnr(c_out, ref), 1)]
        except Exception as e:
            comfy_cells = [f"error: {type(e).__name__}: {str(e)[:60]}", "", ""]
    table.add(label, "x".join(map(str, shape)), f"{info.tiles}x{info.tile}px", round(ref_t, 2), human_bytes(ref_peak),
              round(t, 2), human_bytes(peak), round(_psnr(out, ref), 1), *comfy_cells)


COLUMNS = ["case", "latent", "tiles", "untiled s", "untiled peak", "ours s", "ours peak", "ours PSNR",
           "ComfyUI tiled s", "ComfyUI tiled peak", "ComfyUI PSNR"]


def bench(quick: bool = False) -> list[Table]:
    device = bench_device()
    table = Table(f"VAE decode, low memory (device {device.type}, random weights)", COLUMNS,
                  note="PSNR in dB against the untiled decode of the same VAE; peak = tensor bytes during the decode.")
    try:  # before ComfyUI's path (its test stubs shadow torchvision, which diffusers imports)
        from diffusers import AutoencoderKL
    except Exception as e:
        AutoencoderKL = None
        diffusers_problem = f"{type(e).__name__}: {e}"
    comfy_sd = _comfy()
    if isinstance(comfy_sd, str):
        table.note += f"\nComfyUI columns n/a: {comfy_sd}"

    # ---- SDXL-width KL VAE
    side = 32 if quick else 128
    try:
        if AutoencoderKL is None:
            raise RuntimeError(f"diffusers is needed to build the SDXL-width VAE ({diffusers_problem})")
        torch.manual_seed(0)
        dvae = AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                             block_out_channels=(128, 256, 512, 512), layers_per_block=2, latent_channels=4)
        sd = _random_sd(dvae)
        z = torch.randn(1, 4, side, side, device=device)
        tile = max(16, side // 2)
        overlap = max(4, tile // 4)
        if not isinstance(comfy_sd, str):
            vae = comfy_sd.VAE(sd=sd, device=device, dtype=torch.float32)
            fsm = vae.first_stage_model.to(device)
            ref, ref_t, ref_peak = _measure(lambda: fsm.decode(z), device)
            codec = vt.codec_from_comfy(vae)
            comfy_fn = lambda: vae.decode_tiled(z, tile_x=tile, tile_y=tile, overlap=overlap).movedim(-1, 1) * 2 - 1
        else:
            dvae.load_state_dict(sd)
            dvae = dvae.to(device).eval()
            ref, ref_t, ref_peak = _measure(lambda: dvae.decode(z).sample, device)
            codec = vt.codec_from_diffusers(dvae)
            comfy_fn = None
        eng = vt.TiledVAE(codec, vt.TilingOptions(tile=tile, overlap=overlap))
        _row(table, f"SDXL {side * 8}^2, feather", z.shape, device, ref, ref_t, ref_peak,
             (lambda: eng.decode(z), lambda: eng.info), comfy_fn)
        eng2 = vt.TiledVAE(codec, vt.TilingOptions(tile=tile, overlap=overlap, shared_stats=True))
        _row(table, f"SDXL {side * 8}^2, shared stats", z.shape, device, ref, ref_t, ref_peak,
             (lambda: eng2.decode(z), lambda: eng2.info), None)
        table.note += (f"\nshared stats: all tiles in lock-step from one GroupNorm to the next "
                       f"({eng2.info.passes} passes over {eng2.info.tiles} tiles, each recomputing only the block "
                       f"holding its GroupNorm; finished blocks cached on the CPU, up to the budget, counted in "
                       f"'ours peak' on CPU). Exact statistics need a halo (overlap / 2) of ~17 latent px (the SD "
                       f"decoder's conv receptive field, measured 16.25); at {overlap}px overlap both modes are "
                       f"limited by the halo (and the mid-block attention sees one tile).")
        del ref
    except Exception as e:
        table.note += f"\nSDXL case failed: {type(e).__name__}: {e}"

    # ---- Wan 2.2 VAE (ComfyUI's), 720p latent
    if not isinstance(comfy_sd, str):
        try:
            import comfy.ldm.wan.vae2_2 as wan22

            dim = 160   # ComfyUI builds the Wan 2.2 VAE at its real width
            model = wan22.WanVAE(dim=dim, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                                 temperal_downsample=[False, True, True])
            vae = comfy_sd.VAE(sd=_random_sd(model), device=device, dtype=torch.float32)
            h, w, t = (4, 6, 2) if quick else (45, 80, 5)
            z = torch.randn(1, 48, t, h, w, device=device)
            fsm = vae.first_stage_model.to(device)
            ref, ref_t, ref_peak = _measure(lambda: fsm.decode(z), device)
            tile = max(4, min(h, w) // 2 + 2)
            overlap = max(2, tile // 4)
            codec = vt.codec_from_comfy(vae)
            eng = vt.TiledVAE(codec, vt.TilingOptions(tile=tile, overlap=overlap))
            comfy_fn = lambda: vae.decode_tiled(z, tile_x=tile, tile_y=tile, overlap=overlap, tile_t=64,
                                                overlap_t=8).movedim(-1, 1) * 2 - 1
            _row(table, f"Wan 2.2 {h * 16}x{w * 16}x{1 + 4 * (t - 1)}f", z.shape, device, ref, ref_t, ref_peak,
                 (lambda: eng.decode(z), lambda: eng.info), comfy_fn)
        except Exception as e:
            table.note += f"\nWan 2.2 case failed: {type(e).__name__}: {e}"
    else:
        table.note += "\nWan 2.2 case needs ComfyUI's Wan 2.2 VAE (set COMFYUI_PATH)."
    return [table]
