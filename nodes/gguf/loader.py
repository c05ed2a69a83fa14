"""Nodes: Load Diffusion Model (GGUF, Metal), Load Text Encoder (GGUF, Metal), Load 2 / 3 / 4 Text Encoders
(GGUF, Metal).

The file is read through the `gguf` package (reader.py) into a state dict whose quantised tensors are
GGUFTensors (the file's blocks, logical `.shape`); ComfyUI's own model detection builds the model with
`model_options["custom_operations"]` = the GGUF op set (ops.py: the FP8 op set extended with ggml
blocks), wrapped in the FP8 ModelPatcher so LoRAs apply to the dequantised weights at forward time.
Weights stay quantised in memory; ComfyUI's memory manager sees their true size.
"""
from __future__ import annotations

import logging
import os
import time

import torch

from ..fp8.loader import (COMPUTE_DTYPES, FP8LoadError, _call_with_supported, _resolve_compute_dtype, _wrap_errors,
                          build_text_encoder, text_encoder_options)
from ..common.models import model_choices, require_model
from ..common.text_encoders import clip_types, default_device, multi_text_encoder_loaders
from ..fp8.nodes import _record
from ..fp8.ops import record_quantized, wrap_patcher
from .ops import RUN_KERNELS, GGUFTensor, gguf_modules, make_gguf_ops, weight_bytes
from .reader import (IMAGE_ARCHS, LLAMA_ARCHS, TEXT_ARCHS, GGUFFile, GGUFFileError, llama_state_dict,
                     t5_key, uses_llama_cpp_names)
from .tokenizer import spiece_model_from_gguf

log = logging.getLogger("comfy_metal")

# folder_paths kinds listing .gguf files in ComfyUI's model folders (as ComfyUI-GGUF lists them)
GGUF_FOLDERS = {"diffusion_models_gguf": "diffusion_models", "text_encoders_gguf": "text_encoders"}


def register_gguf_folders() -> None:
    """Add (or refresh) folder_paths kinds that list the .gguf files of diffusion_models (models/unet,
    models/diffusion_models and extra paths) and text_encoders (models/text_encoders, models/clip)."""
    import folder_paths

    table = getattr(folder_paths, "folder_names_and_paths", None)
    if table is None:                   # not ComfyUI's folder_paths (a stand-in: nothing to register)
        return
    for kind, source in GGUF_FOLDERS.items():
        paths = list(folder_paths.get_folder_paths(source))
        current = table.get(kind)
        if current is None or list(current[0]) != paths:
            table[kind] = (paths, {".gguf"})
            getattr(folder_paths, "filename_list_cache", {}).pop(kind, None)


def _gguf_path(kind: str, name: str) -> str:
    import folder_paths

    register_gguf_folders()
    return folder_paths.get_full_path_or_raise(kind, require_model("GGUF loader", kind.replace("_gguf", ""), name))


def _log_loaded(name, patcher_model, t0):
    stats = weight_bytes(patcher_model)
    log.info("comfy_metal: %s loaded in %.2fs: %d GGUF layers, %.3f bytes per quantised weight, %.1f MiB total",
             name, time.perf_counter() - t0, sum(1 for _ in gguf_modules(patcher_model)),
             stats["bytes_per_gguf_weight"], stats["total_bytes"] / 2**20)
    record_quantized(patcher_model, name)


def load_diffusion_model(path, compute_dtype="auto", model_options=None):
    """MODEL (a MetalFP8ModelPatcher over GGUF layers) from a .gguf diffusion model."""
    import comfy.model_management as mm
    import comfy.sd

    t0 = time.perf_counter()
    f = GGUFFile(path)
    log.info("comfy_metal: loading %s", f.describe())
    if f.arch in TEXT_ARCHS or (f.arch is not None and f.arch not in IMAGE_ARCHS and uses_llama_cpp_names(f)):
        raise GGUFFileError(f"{f.name}: architecture {f.arch!r} is a text model (llama.cpp tensor names), not a "
                            f"diffusion model: load it with Load Text Encoder (GGUF, Metal)")
    sd = f.state_dict()
    opts = dict(model_options or {})
    load_device = opts.get("load_device") or mm.get_torch_device()
    params = sum(t.logical_numel() if isinstance(t, GGUFTensor) else t.numel() for t in sd.values())
    dtype = _resolve_compute_dtype(compute_dtype, load_device, params)
    opts["custom_operations"] = make_gguf_ops(f.name, dtype)
    if dtype is not None:
        opts["dtype"] = dtype
    patcher = _wrap_errors(path, _call_with_supported, comfy.sd.load_diffusion_model_state_dict, sd,
                           model_options=opts, disable_dynamic=True)
    if patcher is None:
        raise GGUFFileError(f"{f.name}: ComfyUI does not recognise this model's architecture (general.architecture "
                            f"{f.arch!r}; {len(f.tensors)} tensors, first {[t.name for t in f.tensors[:3]]}). "
                            f"Known GGUF diffusion architectures: {', '.join(IMAGE_ARCHS)}")
    patcher = wrap_patcher(patcher)
    patcher.cached_patcher_init = None
    _log_loaded(f.name, patcher.model, t0)
    return patcher


def text_encoder_state_dict(path) -> dict:
    """A text encoder's state dict from a .gguf (llama.cpp names of T5/UMT5 and Llama/Qwen mapped to
    ComfyUI's) or any file ComfyUI reads (.safetensors ...), for mixing a GGUF T5 with a safetensors CLIP."""
    if not str(path).lower().endswith(".gguf"):
        import comfy.utils

        return comfy.utils.load_torch_file(path, safe_load=True)
    f = GGUFFile(path)
    log.info("comfy_metal: loading text encoder %s", f.describe())
    if uses_llama_cpp_names(f):
        if f.arch not in TEXT_ARCHS:
            raise GGUFFileError(f"{f.name}: a {f.arch!r} text model with llama.cpp tensor names; this loader maps "
                                f"llama.cpp names for {', '.join(TEXT_ARCHS)} only (files with ComfyUI/Hugging Face "
                                f"tensor names load for every architecture)")
        if f.arch in LLAMA_ARCHS:
            return llama_state_dict(f)
        return t5_state_dict(f)
    return f.state_dict()


T5_VOCAB = 32128        # T5 v1.1's vocabulary: ComfyUI brings that tokenizer itself


def t5_state_dict(f: GGUFFile) -> dict:
    """A llama.cpp-named T5/UMT5 encoder in ComfyUI's names; for UMT5 (Wan), the sentencepiece model
    rebuilt from the GGUF's tokenizer metadata as `spiece_model`, which ComfyUI's UMT5 tokenizer reads."""
    sd = f.state_dict(t5_key)
    embd = next((t for t in f.tensors if t.name == "token_embd.weight"), None)
    vocab = int(embd.shape[-1]) if embd is not None else T5_VOCAB
    if vocab != T5_VOCAB and "spiece_model" not in sd:
        spiece = spiece_model_from_gguf(f.reader)
        if spiece is None:
            raise GGUFFileError(f"{f.name}: a T5-family encoder with a {vocab}-token vocabulary (UMT5?) whose GGUF "
                                f"metadata has no t5 tokenizer (tokenizer.ggml.tokens) to rebuild it from")
        sd["spiece_model"] = torch.frombuffer(bytearray(spiece), dtype=torch.uint8)
    return sd


def load_text_encoder(paths, clip_type="stable_diffusion", device="gpu", compute_dtype="auto", model_options=None):
    """CLIP from one or more text encoder files (GGUF or not), GGUF weights kept quantised."""
    paths = [paths] if isinstance(paths, (str, os.PathLike)) else list(paths)
    sds = [text_encoder_state_dict(p) for p in paths]
    names = "+".join(os.path.basename(str(p)) for p in paths)
    opts, dtype = text_encoder_options(model_options, device, compute_dtype)
    opts["custom_operations"] = make_gguf_ops(names, dtype)
    return build_text_encoder(names, sds, clip_type, opts, RUN_KERNELS)


# ------------------------------------------------------------------------------------------------
# Nodes
# ------------------------------------------------------------------------------------------------

_DTYPE_TIP = ("dtype the dequantised weights and activations are computed in; auto: ComfyUI's choice for "
              "this device (weights stay quantised in memory either way)")
_DEVICE_TIP = "gpu: run the encoder on the GPU (the default on Macs); cpu: keep it on the CPU"
_TYPE_TIP = "the text encoder family, as in ComfyUI's CLIPLoader (flux, wan, sd3, ...)"


def _text_encoder_files() -> list[str]:
    """.gguf text encoders plus ComfyUI's own text_encoders list (to pair a GGUF T5 with a CLIP file)."""
    import folder_paths

    register_gguf_folders()
    return model_choices("text_encoders", sorted(set(folder_paths.get_filename_list("text_encoders_gguf"))
                                                 | set(folder_paths.get_filename_list("text_encoders"))),
                         "a .gguf (or .safetensors) text encoder")


def _te_path(name: str) -> str:
    import folder_paths

    if name.lower().endswith(".gguf"):
        return _gguf_path("text_encoders_gguf", name)
    return folder_paths.get_full_path_or_raise("text_encoders", require_model("GGUF text encoder loader",
                                                                              "clip_name", name))


class MetalGGUFModelLoader:
    @classmethod
    def INPUT_TYPES(cls):
        import folder_paths

        register_gguf_folders()
        return {"required": {
            "unet_name": (model_choices("diffusion_models", folder_paths.get_filename_list("diffusion_models_gguf"),
                                        "a .gguf diffusion model"), {"tooltip":
                          ".gguf diffusion model in models/diffusion_models or models/unet (the files ComfyUI-GGUF "
                          "loads: Flux, SD3.5, Wan, HunyuanVideo, Qwen-Image, LTX ...)"}),
            "compute_dtype": (list(COMPUTE_DTYPES), {"default": "auto", "tooltip": _DTYPE_TIP}),
        }}

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"
    CATEGORY = "Comfy Metal/Loaders"
    DESCRIPTION = ("Loads a GGUF diffusion model keeping its weights quantised (Q8_0 ... Q2_K) in memory; Metal "
                   "kernels dequantise each layer at forward time on Apple GPUs.")

    def load(self, unet_name, compute_dtype="auto"):
        model = load_diffusion_model(_gguf_path("diffusion_models_gguf", unet_name), compute_dtype)
        _record("MetalGGUFModelLoader", [])
        return (model,)


class MetalGGUFTextEncoderLoader:
    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "clip_name": (_text_encoder_files(), {"tooltip": "text encoder in models/text_encoders or models/clip: "
                          "a .gguf (T5, UMT5, Llama, Qwen2/2.5-VL, Qwen3 with llama.cpp names, or ComfyUI names) or any file "
                          "CLIPLoader reads"}),
            "type": (clip_types(), {"tooltip": _TYPE_TIP}),
            "device": (["gpu", "cpu"], {"default": default_device(), "tooltip": _DEVICE_TIP}),
        }}

    RETURN_TYPES = ("CLIP",)
    FUNCTION = "load"
    CATEGORY = "Comfy Metal/Loaders"
    DESCRIPTION = "Loads a GGUF text encoder keeping its weights quantised; on Macs it runs on the GPU by default."

    def load(self, clip_name, type="stable_diffusion", device="gpu"):
        clip = load_text_encoder([_te_path(clip_name)], type, device)
        _record("MetalGGUFTextEncoderLoader", [])
        return (clip,)


_DUAL_FILE_TIPS = ("first text encoder (e.g. the T5 .gguf for Flux)",
                   "second text encoder (e.g. clip_l.safetensors for Flux)")
# Load 2 / 3 / 4 Text Encoders (GGUF, Metal): like ComfyUI's Dual/Triple/QuadrupleCLIPLoader (Flux: T5, CLIP-L;
# SD3.5: CLIP-L, CLIP-G, T5; HiDream: CLIP-L, CLIP-G, T5, Llama), any of the files a GGUF.
_MULTI = multi_text_encoder_loaders(
    "MetalGGUF",
    files=_text_encoder_files,
    file_tooltip=lambda i, n: (_DUAL_FILE_TIPS[i - 1] if n == 2 else
                               f"text encoder {i} of {n} (a .gguf or any file CLIPLoader reads)"),
    type_options={"default": "flux", "tooltip": _TYPE_TIP},
    device_tooltip=_DEVICE_TIP,
    descriptions={2: "Loads two text encoders (GGUF or not) as one CLIP, GGUF weights kept quantised.",
                  **{n: (f"Loads {n} text encoders (GGUF or not) as one CLIP (e.g. {models}), GGUF weights kept "
                         f"quantised; ComfyUI detects the family from the files.")
                     for n, models in ((3, "SD3.5"), (4, "HiDream"))}},
    load=lambda node, names, clip_type, device: load_text_encoder([_te_path(n) for n in names], clip_type, device))
MetalGGUFDualTextEncoderLoader = _MULTI["MetalGGUFDualTextEncoderLoader"]
MetalGGUFTripleTextEncoderLoader = _MULTI["MetalGGUFTripleTextEncoderLoader"]
MetalGGUFQuadrupleTextEncoderLoader = _MULTI["MetalGGUFQuadrupleTextEncoderLoader"]


__all__ = ["GGUFFileError", "FP8LoadError", "load_diffusion_model", "load_text_encoder"]
