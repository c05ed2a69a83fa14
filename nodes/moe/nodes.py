"""Nodes: MetalMoETextEncoderLoader (-> CLIP), MetalPromptEnhancer (-> STRING), MetalMoEExpertsPatch.

The CLIP the loader returns is built in encoder.py; the experts patch is experts_patch.py."""
from __future__ import annotations

import logging
import os
import pathlib
import re

import torch

from . import qwen3 as qwen3_moe

from .encoder import layer_capture, make_clip, recording_kernels, resolve_device, resolve_dtype, underlying_moe

log = logging.getLogger("comfy_metal")

# ---------------------------------------------------------------------------------------- nodes

def _model_choices() -> list[str]:
    try:
        import folder_paths
    except ImportError:
        return []
    names = [n for n in folder_paths.get_filename_list("text_encoders") if n.endswith(".safetensors")]
    for base in folder_paths.get_folder_paths("text_encoders"):
        base = pathlib.Path(base)
        if base.is_dir():
            for cfg in sorted(base.glob("*/config.json")) + sorted(base.glob("*/*/config.json")):
                names.append(cfg.parent.relative_to(base).as_posix() + "/")
    return sorted(set(names))


def _resolve_model_path(name: str) -> str:
    if os.path.isabs(name) and os.path.exists(name):
        return name
    try:
        import folder_paths
    except ImportError:
        return name
    if name.endswith("/"):
        for base in folder_paths.get_folder_paths("text_encoders"):
            p = pathlib.Path(base) / name
            if p.is_dir():
                return str(p)
        raise FileNotFoundError(f"model folder {name!r} not found in the text_encoders folders")
    p = folder_paths.get_full_path("text_encoders", name)
    if p is None:
        raise FileNotFoundError(f"text encoder {name!r} not found in the text_encoders folders")
    return p


class MetalMoETextEncoderLoader:
    CATEGORY = "Comfy Metal/MoE"
    FUNCTION = "load"
    RETURN_TYPES = ("CLIP",)
    DESCRIPTION = ("Loads a Qwen3-MoE text encoder (Hugging Face folder with config.json + tokenizer.json, or one "
                   ".safetensors file; bf16 or FP8) with sync-free expert dispatch on the GPU. The conditioning is "
                   "the hidden states of `layer` (-1 = final normed state).")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "model": (_model_choices() or ["(put a model folder or .safetensors in models/text_encoders)"],),
                "device": (["gpu", "cpu"], {"default": "gpu"}),
                "dtype": (["auto", "bf16", "fp16", "fp32"], {"default": "auto"}),
                "layer": ("INT", {"default": -1, "min": -256, "max": 255,
                                  "tooltip": "-1: final normed hidden state; -2: output of the second-to-last layer; "
                                             ">= 0: output of that layer"}),
                "template": (["raw", "chat"], {"default": "raw",
                                               "tooltip": "chat: wrap the prompt in the model's chat template"}),
            },
            "optional": {
                "system_prompt": ("STRING", {"default": "", "multiline": True}),
                "path": ("STRING", {"default": "", "tooltip": "absolute path overriding `model`"}),
            },
        }

    def load(self, model, device="gpu", dtype="auto", layer=-1, template="raw", system_prompt="", path=""):
        where = path.strip() or _resolve_model_path(model)
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, dev)
        loaded = qwen3_moe.load(where, device=dev, dtype=dt)
        layer_capture(layer, loaded.config.num_hidden_layers)       # validate now, not at encode time
        log.info("comfy_metal: loaded %s (%s, %d layers, %d experts top-%d) on %s in %s", where,
                 loaded.config.model_type, loaded.config.num_hidden_layers, loaded.config.num_experts,
                 loaded.config.num_experts_per_tok, dev, dt)
        return (make_clip(loaded, layer, template, system_prompt),)


class MetalPromptEnhancer:
    CATEGORY = "Comfy Metal/MoE"
    FUNCTION = "enhance"
    RETURN_TYPES = ("STRING",)
    DESCRIPTION = ("Rewrites a prompt with the MoE language model of a MetalMoETextEncoderLoader CLIP (KV cache; "
                   "temperature 0 = greedy; one host sync per generated token).")

    @classmethod
    def INPUT_TYPES(cls):
        return {
            "required": {
                "clip": ("CLIP",),
                "prompt": ("STRING", {"multiline": True, "default": ""}),
                "system_prompt": ("STRING", {"multiline": True, "default":
                    "Rewrite the user's image prompt into one detailed, vivid description. Reply with the prompt only."}),
                "max_new_tokens": ("INT", {"default": 128, "min": 1, "max": 4096}),
                "temperature": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 4.0, "step": 0.05}),
                "top_p": ("FLOAT", {"default": 0.9, "min": 0.01, "max": 1.0, "step": 0.01}),
                "seed": ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF}),
            }
        }

    def enhance(self, clip, prompt, system_prompt="", max_new_tokens=128, temperature=0.0, top_p=0.9, seed=0):
        lm, tok = underlying_moe(clip)
        if hasattr(clip, "load_model"):
            clip.load_model()                          # ComfyUI: put the model on its load device
        text = tok.tokenizer.apply_chat_template(prompt, system_prompt or None)
        ids = tok.tokenizer.encode(text)
        if not ids:
            raise ValueError("MetalPromptEnhancer: the prompt encodes to no tokens")
        device = lm.device
        progress = None
        try:
            import comfy.utils

            progress = comfy.utils.ProgressBar(max_new_tokens)
        except ImportError:
            pass
        with recording_kernels("MetalPromptEnhancer"):
            out = lm.generate(torch.tensor([ids], device=device), max_new_tokens=max_new_tokens,
                              temperature=temperature, top_p=top_p, seed=seed,
                              eos_ids=tok.tokenizer.eos_ids() + lm.config.eos_ids(),
                              on_token=(lambda i, t: progress.update(1)) if progress is not None else None)
        text = tok.tokenizer.decode(out, skip_special_tokens=True)
        text = re.sub(r"<think>.*?(</think>|$)", "", text, flags=re.S)   # Qwen3 reasoning blocks, if any
        return (text.strip(),)


class MetalMoEExpertsPatch:
    CATEGORY = "Comfy Metal/MoE"
    FUNCTION = "patch"
    RETURN_TYPES = ("CLIP",)
    DESCRIPTION = ("Runs the experts of ComfyUI's own MoE text encoders (GPT-OSS / Lens) through the sync-free "
                   "grouped path (no per-expert host syncs; FP8 expert banks read as FP8 on Apple GPUs).")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"clip": ("CLIP",),
                             "device": (["keep", "gpu"], {"default": "keep", "tooltip":
                                        "gpu: run this text encoder on the GPU (ComfyUI keeps text encoders "
                                        "on the CPU on Macs)"})}}

    def patch(self, clip, device="keep"):
        from . import experts_patch as moe_experts

        patched = moe_experts.patch_clip(clip)
        if device == "gpu":
            if patched is clip:
                patched = clip.clone()
            patched.patcher.load_device = resolve_device("gpu")
        return (patched,)


NODE_CLASS_MAPPINGS = {
    "MetalMoETextEncoderLoader": MetalMoETextEncoderLoader,
    "MetalPromptEnhancer": MetalPromptEnhancer,
    "MetalMoEExpertsPatch": MetalMoEExpertsPatch,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "MetalMoETextEncoderLoader": "Load MoE Text Encoder (Metal)",
    "MetalPromptEnhancer": "Prompt Enhancer (MoE, Metal)",
    "MetalMoEExpertsPatch": "Sync-free MoE Experts (Metal)",
}
