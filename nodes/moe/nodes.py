"""Nodes: MetalMoETextEncoderLoader (-> CLIP), MetalPromptEnhancer (-> STRING), MetalMoEExpertsPatch.

The CLIP the loader returns is built in encoder.py; the experts patch is experts_patch.py."""
from __future__ import annotations

import collections
import logging
import os
import pathlib
import re
import threading
import weakref

import torch

from . import qwen3 as qwen3_moe

from ..common.models import is_placeholder, model_choices
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


MODEL_WHAT = "a model folder (config.json + tokenizer.json) or a .safetensors file"


def missing_model(model: str, path: str = "") -> str | None:
    """Why `model` cannot load, naming it and where it goes, or None when it is in text_encoders (or `path`,
    checked when loading, overrides it)."""
    if str(path or "").strip():
        return None
    if is_placeholder(model):
        return f"no model chosen: {model[1:-1]}"
    if model in _model_choices():
        return None
    if str(model).endswith("/"):
        return (f"the model folder {model!r} is not in ComfyUI/models/text_encoders/: download the whole Hugging "
                f"Face repository of the model (config.json, the tokenizer files and every .safetensors file) "
                f"into ComfyUI/models/text_encoders/{model}, then press R to refresh")
    return (f"{model!r} is not in ComfyUI/models/text_encoders/: put the .safetensors file there, then press R "
            f"to refresh")


# ------------------------------------------------------------------------- enhanced-text cache

def enhance_key(prompt, system_prompt, max_new_tokens, temperature, top_p, seed) -> tuple:
    """What the enhancer's text depends on besides the model. Greedy (temperature 0) ignores top_p and
    the seed, so they are not part of the key then: a new seed does not regenerate."""
    if temperature <= 0:
        return (prompt, system_prompt, int(max_new_tokens), 0.0, None, None)
    return (prompt, system_prompt, int(max_new_tokens), float(temperature), float(top_p), int(seed))


class EnhancedTextCache:
    """A small LRU of enhanced texts keyed on (model object, enhance_key). ComfyUI's own cache already
    skips the node when no input changed; this one also covers what ComfyUI cannot know (a new seed at
    temperature 0, or the same prompt again after other prompts). A model that is freed drops its
    entries (a new model object never matches an old one's)."""

    def __init__(self, size: int = 16):
        self.size = size
        self._items: collections.OrderedDict = collections.OrderedDict()
        self._lock = threading.Lock()

    def get(self, model, key):
        with self._lock:
            hit = self._items.get((id(model), key))
            if hit is None or hit[0]() is not model:
                return None
            self._items.move_to_end((id(model), key))
            return hit[1]

    def put(self, model, key, text: str) -> None:
        with self._lock:
            self._items[(id(model), key)] = (weakref.ref(model), text)
            self._items.move_to_end((id(model), key))
            while len(self._items) > self.size:
                self._items.popitem(last=False)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()


ENHANCED = EnhancedTextCache()


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
                "model": (model_choices("text_encoders", _model_choices(), MODEL_WHAT), {"tooltip":
                          "A Qwen3-MoE / Qwen2-MoE model in ComfyUI/models/text_encoders/: a Hugging Face folder "
                          "(config.json + tokenizer.json + safetensors, listed with a trailing /) or one "
                          ".safetensors file."}),
                "device": (["gpu", "cpu"], {"default": "gpu", "tooltip":
                           "gpu: ComfyUI's GPU (the Apple GPU on a Mac), where the experts run without host "
                           "syncs. cpu: the CPU (slow; for machines without a GPU)."}),
                "dtype": (["auto", "bf16", "fp16", "fp32"], {"default": "auto", "tooltip":
                          "The dtype of the non-FP8 weights and the activations. auto: bf16 on a GPU, fp32 on the "
                          "CPU. FP8 weights stay FP8 either way."}),
                "layer": ("INT", {"default": -1, "min": -256, "max": 255,
                                  "tooltip": "-1: final normed hidden state; -2: output of the second-to-last layer; "
                                             ">= 0: output of that layer"}),
                "template": (["raw", "chat"], {"default": "raw",
                                               "tooltip": "chat: wrap the prompt in the model's chat template"}),
            },
            "optional": {
                "system_prompt": ("STRING", {"default": "", "multiline": True, "tooltip":
                                  "template chat only: the system message put before every prompt (empty: none)."}),
                "path": ("STRING", {"default": "", "tooltip": "An absolute path (folder or .safetensors) that "
                                    "overrides `model`; empty: use `model`."}),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, model, path=""):
        """When the prompt is queued, before any node runs: a model missing from text_encoders is named with where
        it goes (a folder is in no Missing Models list, and ComfyUI's own check only says "value not in list").
        A `path` linked from another node is not known yet: pick any listed model then."""
        return missing_model(model, path) or True

    def load(self, model, device="gpu", dtype="auto", layer=-1, template="raw", system_prompt="", path=""):
        if not path.strip() and is_placeholder(model):
            raise ValueError(f"MetalMoETextEncoderLoader: no model chosen: {model[1:-1]}")
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
                "clip": ("CLIP", {"tooltip": "The CLIP of a Load MoE Text Encoder (Metal) node: its language "
                                             "model writes the text."}),
                "prompt": ("STRING", {"multiline": True, "default": "", "tooltip":
                           "The short prompt to enhance (the user message)."}),
                "system_prompt": ("STRING", {"multiline": True, "default":
                    "Rewrite the user's image prompt into one detailed, vivid description. Reply with the prompt only.",
                    "tooltip": "The instruction the model follows (the system message)."}),
                "max_new_tokens": ("INT", {"default": 128, "min": 1, "max": 4096, "tooltip":
                                   "At most this many tokens are generated (about 3/4 of a word each); it stops "
                                   "earlier at the model's end of text."}),
                "temperature": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 4.0, "step": 0.05, "tooltip":
                                "0 = greedy: always the most likely token, the same text every run (seed unused). "
                                "> 0: sample, higher = more varied."}),
                "top_p": ("FLOAT", {"default": 0.9, "min": 0.01, "max": 1.0, "step": 0.01, "tooltip":
                          "temperature > 0 only: sample from the smallest set of tokens whose probabilities add "
                          "up to top_p (1 = all tokens). Unused at temperature 0."}),
                "seed": ("INT", {"default": 0, "min": 0, "max": 0xFFFFFFFFFFFFFFFF,
                                 "control_after_generate": "fixed", "tooltip":
                                 "temperature > 0 only: the sampling seed (same seed, same text). Unused at "
                                 "temperature 0 (greedy)."}),
            }
        }

    def enhance(self, clip, prompt, system_prompt="", max_new_tokens=128, temperature=0.0, top_p=0.9, seed=0):
        lm, tok = underlying_moe(clip)
        key = enhance_key(prompt, system_prompt, max_new_tokens, temperature, top_p, seed)
        cached = ENHANCED.get(lm, key)
        if cached is not None:
            log.info("comfy_metal: MetalPromptEnhancer: same model, prompt and settings as a recent run: "
                     "its text reused (no generation)")
            return (cached,)
        text = self._generate(clip, lm, tok, prompt, system_prompt, max_new_tokens, temperature, top_p, seed)
        ENHANCED.put(lm, key, text)
        return (text,)

    def _generate(self, clip, lm, tok, prompt, system_prompt, max_new_tokens, temperature, top_p, seed):
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
        return text.strip()


class MetalMoEExpertsPatch:
    CATEGORY = "Comfy Metal/MoE"
    FUNCTION = "patch"
    RETURN_TYPES = ("CLIP",)
    DESCRIPTION = ("Runs the experts of ComfyUI's own MoE text encoders (GPT-OSS / Lens) through the sync-free "
                   "grouped path (no per-expert host syncs; FP8 expert banks read as FP8 on Apple GPUs).")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"clip": ("CLIP", {"tooltip": "A CLIP from ComfyUI's own loaders with an MoE text "
                                                         "encoder (GPT-OSS / Lens); other CLIPs pass through."}),
                             "device": (["keep", "gpu"], {"default": "keep", "tooltip": "keep: where ComfyUI put it; "
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
