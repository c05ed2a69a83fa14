"""Nodes: Load Diffusion Model (FP8, Metal), Load Text Encoder (FP8, Metal), Load 2 / 3 / 4 Text Encoders
(FP8, Metal), Save Model (FP8 comfy_quant, Metal).

The node classes only; loading and saving are in loader.py.
"""
from __future__ import annotations

import logging
import os

from ..common.models import filename_list, model_choices, require_model
from ..common.text_encoders import clip_types, default_device, multi_text_encoder_loaders
from .loader import (COMPUTE_DTYPES, SAVE_MODES, WEIGHT_MODES, load_diffusion_model, load_text_encoder, quant_note,
                     save_model)

log = logging.getLogger("comfy_metal")


def _safe_output_path(folder: str, filename: str) -> str:
    name = filename.strip()
    if not name:
        raise ValueError("filename is empty")
    if os.path.isabs(name) or ".." in name.replace("\\", "/").split("/"):
        raise ValueError(f"filename {filename!r} must be a name inside the diffusion_models folder")
    if not name.endswith(".safetensors"):
        name += ".safetensors"
    return os.path.join(folder, name)


QUANTIZE_KERNELS = ["fp8_encode", "fp8_decode"]


def _record(node_class: str, kernels: list[str], note: str | None = None) -> None:
    from ..status import record_node_backend

    record_node_backend(node_class, kernels, note=note)


# The loader's attention option -> the Metal Attention mode (None: ComfyUI's own attention).
ATTENTION_OPTIONS = {"auto": "auto", "metal_flash": "always", "comfy default": None}


def with_attention(model, option: str = "auto"):
    """The loaded model with the pack's attention per the loader's `attention` option ("auto" patches
    only on MPS, where the measured dispatch decides per shape)."""
    from ...metal_kernels.probe import mps_available

    mode = ATTENTION_OPTIONS[option]
    if mode is None or (option == "auto" and not mps_available()):
        return model
    from ..attention.comfy_attention import patch_model

    return patch_model(model, mode)


class MetalFP8ModelLoader:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "unet_name": (model_choices("diffusion_models", filename_list("diffusion_models")), {"tooltip":
                          "The diffusion model file (from ComfyUI/models/diffusion_models/): FP8 files keep their "
                          "weights at 1 byte each, ComfyUI's NVFP4 / MXFP8 / INT8 / W4A8 / W4A4 (comfy_quant) files "
                          "at their own size; bf16/fp16/fp32 files load as they are unless weight_mode quantizes "
                          "them."}),
            "weight_mode": (WEIGHT_MODES, {"default": "auto", "tooltip":
                            "auto: quantized weights stay as stored, others as in the file. e4m3fn tensorwise/"
                            "rowwise, nvfp4, int8 tensorwise: also quantize bf16/fp16/fp32 Linear weights (norms, "
                            "embeddings, first/last layers stay; nvfp4 and int8 with ComfyUI's own quantizers)."}),
            "compute_dtype": (list(COMPUTE_DTYPES), {"default": "auto", "tooltip":
                              "The dtype activations are computed in (FP8 weights are widened to it inside each "
                              "layer). auto: the dtype ComfyUI picks for this model on this device (bf16 on Apple "
                              "GPUs)."}),
        }, "optional": {
            "attention": (list(ATTENTION_OPTIONS), {"default": "auto", "tooltip":
                          "auto: on Apple GPUs the model's attention goes through the Metal Attention dispatch "
                          "(the Metal kernel where it is measured faster than ComfyUI's, per shape); elsewhere "
                          "ComfyUI's. metal_flash: the pack's attention on every device. comfy default: "
                          "ComfyUI's own attention."}),
        }}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"
    CATEGORY = "Comfy Metal/Loaders"
    DESCRIPTION = ("Loads a diffusion model keeping FP8 weights at 1 byte each and ComfyUI's NVFP4, MXFP8, INT8, "
                   "W4A8 and W4A4 (comfy_quant) weights at their own size (Metal kernels on Apple GPUs; INT8 there "
                   "runs weight-only, without _int_mm).")

    def load(self, unet_name, weight_mode="auto", compute_dtype="auto", attention="auto"):
        import folder_paths

        if attention not in ATTENTION_OPTIONS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_OPTIONS)}, got {attention!r}")
        path = folder_paths.get_full_path_or_raise(
            "diffusion_models", require_model("MetalFP8ModelLoader", "unet_name", unet_name))
        model = load_diffusion_model(path, weight_mode, compute_dtype)
        model = with_attention(model, attention)
        # Quantizing on load encodes (and decodes, for the error summary); an FP8 file loads as is.
        _record("MetalFP8ModelLoader", QUANTIZE_KERNELS if weight_mode != "auto" else [],
                quant_note(model.model, model.load_device))
        return (model,)


class MetalFP8TextEncoderLoader:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "clip_name": (model_choices("text_encoders", filename_list("text_encoders")), {"tooltip":
                          "The text encoder file (from ComfyUI/models/text_encoders/); FP8 weights stay 1 byte "
                          "each, NVFP4 / MXFP8 / INT8 / W4 (comfy_quant) weights at their own size."}),
            "type": (clip_types(), {"tooltip": "Which model family the text encoder is for (as in ComfyUI's "
                                                "Load CLIP: flux, wan, sd3, ...); sets its tokenizer and layout."}),
            "device": (["gpu", "cpu"], {"default": default_device(), "tooltip":
                       "gpu: run the text encoder on ComfyUI's GPU (the Apple GPU on a Mac; the default there). "
                       "cpu: keep it on the CPU (ComfyUI's own choice for text encoders on Macs)."}),
        }}

    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load"
    CATEGORY = "Comfy Metal/Loaders"
    DESCRIPTION = ("Loads a text encoder keeping FP8 (and comfy_quant NVFP4 / MXFP8 / INT8 / W4) weights at their "
                   "stored size; on Macs it runs on the GPU by default.")

    def load(self, clip_name, type="stable_diffusion", device="gpu"):
        import folder_paths

        path = folder_paths.get_full_path_or_raise(
            "text_encoders", require_model("MetalFP8TextEncoderLoader", "clip_name", clip_name))
        clip = load_text_encoder(path, type, device)
        _record("MetalFP8TextEncoderLoader", [], quant_note(clip.cond_stage_model, clip.patcher.load_device))
        return (clip,)


def _load_text_encoders(node: str, names: list[str], clip_type: str, device: str):
    import folder_paths

    names = [require_model(node, f"clip_name{i}", name) for i, name in enumerate(names, 1)]
    return load_text_encoder([folder_paths.get_full_path_or_raise("text_encoders", name) for name in names],
                             clip_type, device)


_CORE_SETS = {2: ("DualCLIPLoader", "CLIP-L + T5 for Flux, ..."),
              3: ("TripleCLIPLoader", "CLIP-L + CLIP-G + T5 for SD3"),
              4: ("QuadrupleCLIPLoader", "CLIP-L + CLIP-G + T5 + Llama for HiDream")}
# Load 2 / 3 / 4 Text Encoders (FP8, Metal): the inputs of ComfyUI's Dual/Triple/QuadrupleCLIPLoader, through the
# single FP8 text encoder loader (load_text_encoder with a list of files).
_MULTI = multi_text_encoder_loaders(
    "MetalFP8",
    files=lambda: model_choices("text_encoders", filename_list("text_encoders")),
    file_tooltip=lambda i, n: (f"Text encoder file {i} of {n} (from ComfyUI/models/text_encoders/), FP8, "
                               "comfy_quant (NVFP4 / MXFP8 / INT8 / W4) or bf16/fp16; quantized weights stay at "
                               "their stored size."),
    type_options={"tooltip": "Which model family the pair is for (as in ComfyUI's DualCLIPLoader: flux, sdxl, sd3, "
                             "hunyuan_video, ...)."},
    device_tooltip=("gpu: run the text encoders on ComfyUI's GPU (the Apple GPU on a Mac; the default there). cpu: "
                    "keep them on the CPU (ComfyUI's own choice on Macs)."),
    descriptions={n: (f"Loads {n} text encoders as one CLIP, like ComfyUI's {core} ({sets}), keeping FP8 weights "
                      "at 1 byte each (FP8 and bf16 files can be mixed); on Macs it runs on the GPU by default.")
                  for n, (core, sets) in _CORE_SETS.items()},
    load=_load_text_encoders,
    note=lambda clip: quant_note(clip.cond_stage_model, clip.patcher.load_device))
MetalFP8DualTextEncoderLoader = _MULTI["MetalFP8DualTextEncoderLoader"]
MetalFP8TripleTextEncoderLoader = _MULTI["MetalFP8TripleTextEncoderLoader"]
MetalFP8QuadrupleTextEncoderLoader = _MULTI["MetalFP8QuadrupleTextEncoderLoader"]


class MetalFP8SaveModel:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "The model to save; its FP8 layers are written as they are."}),
            "filename": ("STRING", {"default": "model_fp8_e4m3fn", "tooltip":
                         "File name inside ComfyUI/models/diffusion_models/ (.safetensors is added); no folders "
                         "outside it."}),
            "quantize_mode": (SAVE_MODES, {"default": "e4m3fn tensorwise", "tooltip":
                              "For models without FP8 layers: how to quantize their Linear weights (tensorwise: "
                              "one scale per weight; rowwise: one scale per output row, more accurate)."}),
            "overwrite": ("BOOLEAN", {"default": False, "tooltip":
                          "Off: refuse to replace an existing file of that name. On: replace it (atomic write)."}),
        }}

    RETURN_TYPES = ()
    FUNCTION = "save"
    OUTPUT_NODE = True
    CATEGORY = "Comfy Metal/Loaders"
    DESCRIPTION = "Saves a MODEL with FP8 weights to diffusion_models in ComfyUI's comfy_quant format (atomic write)."

    def save(self, model, filename, quantize_mode="e4m3fn tensorwise", overwrite=False):
        import folder_paths

        folder = folder_paths.get_folder_paths("diffusion_models")[0]
        path = _safe_output_path(folder, filename)
        path, summary = save_model(model, path, overwrite=overwrite, quantize_mode=quantize_mode)
        if summary.errors:
            log.info("comfy_metal: %s", summary.text())
        log.info("comfy_metal: saved %s", path)
        _record("MetalFP8SaveModel", QUANTIZE_KERNELS if summary.errors else [])
        return {"ui": {"text": [os.path.basename(path)]}}


NODE_CLASS_MAPPINGS = {
    "MetalFP8ModelLoader": MetalFP8ModelLoader,
    "MetalFP8TextEncoderLoader": MetalFP8TextEncoderLoader,
    "MetalFP8DualTextEncoderLoader": MetalFP8DualTextEncoderLoader,
    "MetalFP8TripleTextEncoderLoader": MetalFP8TripleTextEncoderLoader,
    "MetalFP8QuadrupleTextEncoderLoader": MetalFP8QuadrupleTextEncoderLoader,
    "MetalFP8SaveModel": MetalFP8SaveModel,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "MetalFP8ModelLoader": "Load Diffusion Model (FP8, Metal)",
    "MetalFP8TextEncoderLoader": "Load Text Encoder (FP8, Metal)",
    "MetalFP8DualTextEncoderLoader": "Load 2 Text Encoders (FP8, Metal)",
    "MetalFP8TripleTextEncoderLoader": "Load 3 Text Encoders (FP8, Metal)",
    "MetalFP8QuadrupleTextEncoderLoader": "Load 4 Text Encoders (FP8, Metal)",
    "MetalFP8SaveModel": "Save Model (FP8 comfy_quant, Metal)",
}
