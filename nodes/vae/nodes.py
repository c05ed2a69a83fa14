"""ComfyUI nodes: "VAE Decode (Low Memory, Metal)" and "VAE Encode (Low Memory, Metal)".

Decode and encode within a memory budget (planner.py chooses how, engine.py runs it), on the VAE object
ComfyUI hands the node: SD/SDXL (4 ch) and Flux/SD3 (16 ch) KL VAEs, Wan 2.1 / Qwen-Image, Wan 2.2 and
HunyuanVideo 1.0 causal video VAEs. Any other VAE falls back to ComfyUI's own tiled decode/encode with
a log line.
"""
from __future__ import annotations

import logging

import torch

from . import codecs, memory
from .engine import TiledVAE, TilingOptions
from .planner import AUTO, EXACT, FEATHER
from ..status import recording_kernels
from ...metal_kernels.registry import REGISTRY

log = logging.getLogger("comfy_metal")

SEAM_MODES = [AUTO, FEATHER, EXACT]     # "auto" first: the default
# Names saved workflows may hold, mapped to the mode they meant (validated and run as that mode).
LEGACY_SEAM_MODES = {"feather + shared statistics": EXACT}
GIB = 1 << 30


def seam_mode(name: str) -> str:
    """The seam mode a widget value names (a current name, or one that saved workflows may hold)."""
    name = LEGACY_SEAM_MODES.get(name, name)
    if name not in SEAM_MODES:
        raise ValueError(f"seam_mode must be one of {SEAM_MODES}, got {name!r}")
    return name


def _common_inputs():
    return {
        "memory_budget_gb": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 512.0, "step": 0.25,
                                       "tooltip": "Working memory for the tiles in GiB (weights and the output "
                                                  "come on top). 0 = auto from the device's free memory."}),
        "overlap": ("INT", {"default": 0, "min": 0, "max": 128, "step": 1,
                            "tooltip": "Tile overlap in latent pixels. 0 = auto (3/8 of the tile, up to 24)."}),
        "temporal_chunk": ("INT", {"default": 0, "min": 0, "max": 4096, "step": 1,
                                   "tooltip": "Video VAEs: latent frames per chunk. 0 = auto: the VAE's own causal "
                                              "chunking with a per-tile temporal cache (exact in time, flat memory). "
                                              "Only used when falling back to ComfyUI's tiled decode."}),
        "temporal_overlap": ("INT", {"default": 0, "min": 0, "max": 64, "step": 1,
                                     "tooltip": "Video VAEs: latent frames of overlap for ComfyUI's fallback tiled "
                                                "decode. 0 = auto. The causal path needs none."}),
        "seam_mode": (SEAM_MODES, {"default": AUTO,
                                   "tooltip": "auto: exact whenever the budget holds it, unless it is predicted "
                                              "slower than ComfyUI's own tiled decode; else feather. The log line and "
                                              "the node badge say which ran and why. exact: the untiled result up to "
                                              "rounding -- the untiled decode when it fits, else stage by stage over "
                                              "the whole image in bands of rows (one pass; KL VAEs with whole-image "
                                              "GroupNorm statistics, Wan 2.1 / Qwen-Image, Wan 2.2 and HunyuanVideo "
                                              "in the VAE's own causal time chunks), else tiles in lock-step from one "
                                              "GroupNorm to the next (KL VAEs, several times feather's time). "
                                              "feather: one pass of overlapping tiles, each normalising itself, seams "
                                              "hidden by feathered overlaps."}),
    }


class _Progress:
    """comfy.utils.ProgressBar over tiles, created once the tile count is known."""

    def __init__(self):
        self.bar = None

    def __call__(self, done, total):
        try:
            import comfy.utils

            if self.bar is None:
                self.bar = comfy.utils.ProgressBar(total)
            self.bar.update_absolute(done, total)
        except Exception:   # no ComfyUI (tests) or an old ProgressBar: the log still has the ETA
            pass


def _options(memory_budget_gb, overlap, seam):
    return TilingOptions(budget_bytes=int(memory_budget_gb * GIB), overlap=overlap or None, seam=seam_mode(seam),
                         progress=_Progress())


def _validate_seam_mode(cls, seam_mode=AUTO):
    """ComfyUI's input check for seam_mode: the current names and the ones saved workflows hold."""
    return True if seam_mode in SEAM_MODES or seam_mode in LEGACY_SEAM_MODES else \
        f"seam_mode must be one of {SEAM_MODES}, got {seam_mode!r}"


def _load(vae, budget_bytes):
    try:
        import comfy.model_management as mm

        mm.load_models_gpu([vae.patcher], memory_required=max(1, budget_bytes),
                           force_full_load=getattr(vae, "disable_offload", False))
    except Exception as e:   # no ComfyUI (a bare VAE object in tests) or an API that moved
        if "comfy" not in str(e) and not isinstance(e, (ImportError, AttributeError)):
            raise


def _device_context(vae):
    try:
        import comfy.model_management as mm

        return mm.cuda_device_context(torch.device(vae.device))
    except Exception:
        import contextlib

        return contextlib.nullcontext()


VAE_KERNELS = tuple(name for name in REGISTRY if name.startswith("vae_"))


def quality_note(info) -> str:
    """The badge's note: what ran, as its quality class against the untiled decode, and whether auto chose it."""
    return ("auto: " if info.auto else "") + info.mode + (", OVER BUDGET" if info.over_budget else "")


def _run_tiled(vae, codec, x, encode: bool, options):
    """The engine over `x` within the node's budget (auto: from the device's free memory, resolved here once),
    recorded for the node's badge with its quality note, and the node's one log line: how it ran, its quality
    class against the untiled run, auto's reason."""
    options.budget_bytes = options.budget_bytes or memory.auto_budget(codec.device)
    _load(vae, options.budget_bytes)
    engine = TiledVAE(codec, options)
    node = "MetalVAEEncodeTiled" if encode else "MetalVAEDecodeTiled"
    with _device_context(vae), recording_kernels(node, VAE_KERNELS, note=lambda: quality_note(engine.info)):
        out = engine.encode(x) if encode else engine.decode(x)
    info = engine.info
    path = "the down path stage by stage" if encode else "stage by stage"
    how = (f"{path} over the whole image in row bands ({info.bands} band forwards), 1 pass"
           if info.scheme == "stages" else "untiled, 1 pass" if info.scheme == "untiled" else
           f"{info.tiles} tiles of {info.tile} latent px (overlap {info.overlap}), {info.passes} pass(es)")
    log.info(f"comfy_metal: VAE {'encode' if encode else 'decode'} {tuple(x.shape)} -> {tuple(out.shape)} in "
             f"{info.seconds:.1f}s: " + how
             + (", shared GroupNorm statistics" if info.shared_stats else "")
             + (", mid block untiled" if (info.untiled_rest if encode else info.untiled_head) else "")
             + f"; quality vs untiled: {info.mode}"
             + (f"; {info.auto}" if info.auto else "")
             + (f"; OVER BUDGET, expected peak {info.expected_peak / GIB:.3f} GiB" if info.over_budget else "")
             + (f", {info.retries} OOM retries" if info.retries else "")
             + (", CPU fallback" if info.cpu_fallback else ""))
    return out


class MetalVAEDecodeTiled:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "samples": ("LATENT", {"tooltip": "The latent to decode (image or video)."}),
            "vae": ("VAE", {"tooltip": "The VAE from a VAE loader; its own decoder runs tile by tile."}),
            **_common_inputs()}}

    RETURN_TYPES = ("IMAGE",)
    FUNCTION = "decode"
    VALIDATE_INPUTS = classmethod(_validate_seam_mode)
    CATEGORY = "Comfy Metal/VAE"
    DESCRIPTION = ("Decodes within a memory budget: image KL VAEs run their mid block over the whole latent, then "
                   "(seam mode auto) the up path stage by stage over the whole image where the budget holds it -- "
                   "the untiled decode's image -- else in overlapping feathered tiles; Wan 2.1 / Qwen-Image, "
                   "Wan 2.2 and HunyuanVideo run every stage over the whole frame in bands of rows with the VAE's "
                   "own causal chunking (the untiled decode's frames) where the budget holds it, else decode "
                   "causally chunk by chunk with a temporal cache per tile (memory flat in frames).")

    def decode(self, samples, vae, memory_budget_gb=0.0, overlap=0, temporal_chunk=0, temporal_overlap=0,
               seam_mode=AUTO):
        if getattr(vae, "first_stage_model", None) is None:
            raise ValueError("VAE Decode (Low Memory, Metal): the VAE input is empty (the checkpoint has no VAE)")
        latent = samples["samples"]
        if getattr(latent, "is_nested", False):
            latent = latent.unbind()[0]
        if getattr(vae, "latent_dim", 2) == 2 and latent.ndim == 5:
            latent = latent[:, :, 0]
        codec = codecs.codec_from_comfy(vae)
        if codec is None:
            return (self._fallback(vae, latent, overlap, temporal_chunk, temporal_overlap),)
        if latent.shape[1] != codec.latent_channels:
            raise ValueError(f"VAE Decode (Low Memory, Metal): the latent has {latent.shape[1]} channels "
                             f"(shape {tuple(latent.shape)}) but this VAE expects {codec.latent_channels}")
        out = _run_tiled(vae, codec, latent, encode=False, options=_options(memory_budget_gb, overlap, seam_mode))
        out = vae.process_output(out)
        out = out.to(device=getattr(vae, "output_device", out.device),
                     dtype=vae.vae_output_dtype() if hasattr(vae, "vae_output_dtype") else torch.float32)
        images = out.movedim(1, -1)
        if images.ndim == 5:
            images = images.reshape(-1, *images.shape[-3:])
        return (images,)

    def _fallback(self, vae, latent, overlap, temporal_chunk, temporal_overlap):
        log.info(f"comfy_metal: VAE Decode (Low Memory, Metal) has no tiling codec for "
                 f"{type(vae.first_stage_model).__name__}; using ComfyUI's own tiled decode")
        compression = vae.spacial_compression_decode()
        tile = max(8, 512 // compression)
        kwargs = dict(tile_x=tile, tile_y=tile, overlap=overlap or max(1, 64 // compression))
        if latent.ndim == 5 and vae.temporal_compression_decode() is not None:
            kwargs["tile_t"] = temporal_chunk or None
            kwargs["overlap_t"] = temporal_overlap or None
        images = vae.decode_tiled(latent, **kwargs)
        if images.ndim == 5:
            images = images.reshape(-1, *images.shape[-3:])
        return images


class MetalVAEEncodeTiled:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "pixels": ("IMAGE", {"tooltip": "The image (or video frames) to encode."}),
            "vae": ("VAE", {"tooltip": "The VAE from a VAE loader; its own encoder runs tile by tile."}),
            **_common_inputs()}}

    RETURN_TYPES = ("LATENT",)
    FUNCTION = "encode"
    VALIDATE_INPUTS = classmethod(_validate_seam_mode)
    CATEGORY = "Comfy Metal/VAE"
    DESCRIPTION = ("Encodes within a memory budget: KL VAEs run the down path stage by stage over the whole image "
                   "where the budget holds it, else overlapping feathered tiles run the encoder's full-resolution "
                   "levels and the rest of the encoder once over the whole image; Wan 2.1 / Qwen-Image, Wan 2.2 and "
                   "HunyuanVideo encode stage by stage over the whole frame with the VAE's own causal chunking; "
                   "other VAEs tile the whole encoder.")

    def encode(self, pixels, vae, memory_budget_gb=0.0, overlap=0, temporal_chunk=0, temporal_overlap=0,
               seam_mode=AUTO):
        if getattr(vae, "first_stage_model", None) is None:
            raise ValueError("VAE Encode (Low Memory, Metal): the VAE input is empty (the checkpoint has no VAE)")
        if pixels.ndim not in (4, 5) or pixels.shape[-1] < 1:
            raise ValueError(f"VAE Encode (Low Memory, Metal): expected an IMAGE [batch, height, width, channels], "
                             f"got shape {tuple(pixels.shape)}")
        codec = codecs.codec_from_comfy(vae)
        if codec is None or codec.encode is None:
            log.info(f"comfy_metal: VAE Encode (Low Memory, Metal) has no tiling codec for "
                     f"{type(vae.first_stage_model).__name__}; using ComfyUI's own tiled encode")
            return ({"samples": vae.encode_tiled(pixels[..., :3], tile_x=512, tile_y=512, overlap=overlap * 8 or 64)},)
        x = vae.vae_encode_crop_pixels(pixels).movedim(-1, 1)
        if getattr(vae, "latent_dim", 2) == 3 and x.ndim < 5:
            x = x.unsqueeze(2) if getattr(vae, "not_video", False) else x.movedim(1, 0).unsqueeze(0)
        raw_encode, stages = codec.encode, codec.encode_stages
        codec.encode = lambda t: raw_encode(vae.process_input(t))
        if stages:
            codec.encode_stages = (lambda t: stages[0](vae.process_input(t)), *stages[1:])
        codec.encode_input = vae.process_input
        out = _run_tiled(vae, codec, x, encode=True, options=_options(memory_budget_gb, overlap, seam_mode))
        out = out.to(device=getattr(vae, "output_device", out.device),
                     dtype=vae.vae_output_dtype() if hasattr(vae, "vae_output_dtype") else torch.float32)
        if getattr(vae, "format_encoded", None) is not None:
            out = vae.format_encoded(out)
        return ({"samples": out},)


NODE_CLASS_MAPPINGS = {
    "MetalVAEDecodeTiled": MetalVAEDecodeTiled,
    "MetalVAEEncodeTiled": MetalVAEEncodeTiled,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "MetalVAEDecodeTiled": "VAE Decode (Low Memory, Metal)",
    "MetalVAEEncodeTiled": "VAE Encode (Low Memory, Metal)",
}
