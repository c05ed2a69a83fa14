"""Generate the example workflows in workflows/ (the single source of truth is the API-format prompt
of each workflow, written below in Python).

    COMFYUI_PATH=/work/comfyui python tests/tools/build_workflows.py [--check]

For each workflow it writes `workflows/<name>.api.json` (API format, what POST /prompt and
`python -m comfy_metal run` take) and `workflows/<name>.json` (UI format, drag-and-drop), laid out by
`workflow_tools.ui_from_api` from the object_info of a real ComfyUI with the pack loaded, plus Note
nodes naming the model files and where to get them. It also writes the object_info of the node types
the workflows use (`tests/tools/workflow_object_info.json`, file lists emptied) so the tests can check
the files without ComfyUI. `--check` writes nothing and exits 1 if a committed file differs.
"""
from __future__ import annotations

import argparse
import copy
import json
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
WORKFLOWS_DIR = ROOT / "workflows"
OBJECT_INFO_FILE = pathlib.Path(__file__).resolve().parent / "workflow_object_info.json"

HF = "https://huggingface.co/"
# The decode node of the pack (nodes/vae/nodes.py).
DECODE = "MetalVAEDecodeTiled"
# Images (GroupNorm KL VAE): budget from the free memory, seam mode auto (the node's default: exact, stage
# by stage over the whole image, where the budget holds it; feather tiles otherwise; docs/vae.md).
IMAGE_DECODE = {"memory_budget_gb": 0.0, "overlap": 0, "temporal_chunk": 0, "temporal_overlap": 0,
                "seam_mode": "auto"}
# Video (causal Wan VAE, RMS norms): a fixed 2 GiB of tile memory, the VAE's own causal chunking per tile.
VIDEO_DECODE = {"memory_budget_gb": 2.0, "overlap": 0, "temporal_chunk": 0, "temporal_overlap": 0,
                "seam_mode": "feather"}

# ------------------------------------------------------------------------------------------ models
# (ComfyUI models folder, file name, Hugging Face repository, path in the repository)
FLUX_MODEL = ("diffusion_models", "flux1-krea-dev_fp8_scaled.safetensors",
              "Comfy-Org/FLUX.1-Krea-dev_ComfyUI", "split_files/diffusion_models/flux1-krea-dev_fp8_scaled.safetensors")
CLIP_L = ("text_encoders", "clip_l.safetensors", "comfyanonymous/flux_text_encoders", "clip_l.safetensors")
T5XXL_FP8 = ("text_encoders", "t5xxl_fp8_e4m3fn_scaled.safetensors", "comfyanonymous/flux_text_encoders",
             "t5xxl_fp8_e4m3fn_scaled.safetensors")
FLUX_VAE = ("vae", "ae.safetensors", "Comfy-Org/Lumina_Image_2.0_Repackaged", "split_files/vae/ae.safetensors")
WAN_HIGH = ("diffusion_models", "wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors", "Comfy-Org/Wan_2.2_ComfyUI_Repackaged",
            "split_files/diffusion_models/wan2.2_t2v_high_noise_14B_fp8_scaled.safetensors")
WAN_LOW = ("diffusion_models", "wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors", "Comfy-Org/Wan_2.2_ComfyUI_Repackaged",
           "split_files/diffusion_models/wan2.2_t2v_low_noise_14B_fp8_scaled.safetensors")
UMT5 = ("text_encoders", "umt5_xxl_fp8_e4m3fn_scaled.safetensors", "Comfy-Org/Wan_2.1_ComfyUI_repackaged",
        "split_files/text_encoders/umt5_xxl_fp8_e4m3fn_scaled.safetensors")
WAN_VAE = ("vae", "wan_2.1_vae.safetensors", "Comfy-Org/Wan_2.2_ComfyUI_Repackaged", "split_files/vae/wan_2.1_vae.safetensors")
WAN5B_FP16 = ("diffusion_models", "wan2.2_ti2v_5B_fp16.safetensors", "Comfy-Org/Wan_2.2_ComfyUI_Repackaged",
              "split_files/diffusion_models/wan2.2_ti2v_5B_fp16.safetensors")
FLUX_GGUF = ("diffusion_models", "flux1-dev-Q4_K_S.gguf", "city96/FLUX.1-dev-gguf", "flux1-dev-Q4_K_S.gguf")
T5XXL_GGUF = ("text_encoders", "t5-v1_1-xxl-encoder-Q8_0.gguf", "city96/t5-v1_1-xxl-encoder-gguf",
              "t5-v1_1-xxl-encoder-Q8_0.gguf")
MOE_FOLDER = ("text_encoders", "Qwen3-30B-A3B-Instruct-2507/", "Qwen/Qwen3-30B-A3B-Instruct-2507", "(the whole repository)")

# Which tiny test model stands in for which file (tests/workflow_models.place_models roles).
TEST_ROLES = {FLUX_MODEL[1]: "flux_fp8", CLIP_L[1]: "clip_l", T5XXL_FP8[1]: "t5xxl", FLUX_VAE[1]: "flux_vae",
              WAN_HIGH[1]: "wan_high", WAN_LOW[1]: "wan_low", UMT5[1]: "umt5xxl", WAN_VAE[1]: "wan_vae",
              WAN5B_FP16[1]: "wan5b_fp16", MOE_FOLDER[1]: "moe_folder", FLUX_GGUF[1]: "flux_gguf",
              T5XXL_GGUF[1]: "t5xxl_gguf"}

FLUX_PROMPT = ("A red fox sitting in fresh snow at dawn, soft golden light, shallow depth of field, "
               "detailed fur, photograph")
WAN_PROMPT = ("A paper boat drifts down a rain-soaked city street at night, neon reflections ripple in the "
              "puddles, the camera follows slowly at ground level, cinematic")
WAN_NEGATIVE = ("blurry, low quality, static, overexposed, subtitles, watermark, deformed, extra limbs, "
                "still image, messy background")


def model_note(files, extra: str = "") -> str:
    lines = ["Model files this workflow expects (put each in ComfyUI/models/<folder>/):", ""]
    for folder, name, repo, path in files:
        lines.append(f"- {folder}/{name}")
        lines.append(f"    from Hugging Face: {repo}  ({path})")
    if extra:
        lines += ["", extra]
    return "\n".join(lines)


# ------------------------------------------------------------------------------------------ prompts

def _flux_t2i_graph(model_loader: dict, text_encoder_loader: dict, filename_prefix: str) -> dict:
    """Flux.1-dev text-to-image from the given loaders (nodes "1" and "2"): guidance 3.5, cfg 1, euler_metal,
    the low-memory decode."""
    return {
        "1": model_loader,
        "2": text_encoder_loader,
        "3": {"class_type": "VAELoader", "inputs": {"vae_name": FLUX_VAE[1]}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"text": FLUX_PROMPT, "clip": ["2", 0]}},
        "5": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["4", 0], "guidance": 3.5}},
        "6": {"class_type": "ConditioningZeroOut", "inputs": {"conditioning": ["4", 0]}},
        "7": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 1024, "height": 1024, "batch_size": 1}},
        "8": {"class_type": "KSampler",
              "inputs": {"model": ["1", 0], "seed": 42, "steps": 20, "cfg": 1.0, "sampler_name": "euler_metal",
                         "scheduler": "simple", "positive": ["5", 0], "negative": ["6", 0],
                         "latent_image": ["7", 0], "denoise": 1.0}},
        "9": {"class_type": DECODE, "inputs": {"samples": ["8", 0], "vae": ["3", 0], **IMAGE_DECODE}},
        "10": {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": filename_prefix}},
    }


def fp8_flux_t2i() -> tuple[dict, list[str], dict]:
    p = _flux_t2i_graph(
        {"class_type": "MetalFP8ModelLoader",
         "inputs": {"unet_name": FLUX_MODEL[1], "weight_mode": "auto", "compute_dtype": "auto", "attention": "auto"}},
        {"class_type": "MetalFP8DualTextEncoderLoader",
         "inputs": {"clip_name1": CLIP_L[1], "clip_name2": T5XXL_FP8[1], "type": "flux", "device": "gpu"}},
        "comfy_metal/flux_fp8")
    notes = [
        model_note([FLUX_MODEL, CLIP_L, T5XXL_FP8, FLUX_VAE],
                   "Any Flux.1-dev style FP8 file works in the FP8 loader (e.g. a flux1-dev fp8 e4m3fn "
                   "diffusion model); the T5 may be t5xxl_fp16.safetensors instead (same repository)."),
        "FP8 Flux text-to-image on a Mac (Comfy Metal).\n\n"
        "- Load Diffusion Model (FP8, Metal) keeps the FP8 weights at 1 byte each and runs them through "
        "the Metal FP8 kernels (about half the memory of bf16). Its attention option (auto) runs the "
        "model's attention through the Metal flash-attention kernel wherever it is measured faster than "
        "ComfyUI's.\n"
        "- Load 2 Text Encoders (FP8, Metal) loads CLIP-L with the FP8 T5-XXL (kept at 1 byte a weight) and "
        "runs them on the GPU (ComfyUI's DualCLIPLoader would run them on the CPU on a Mac).\n"
        "- KSampler with euler_metal: ComfyUI's euler with one fused Metal kernel per step and no host "
        "sync in the loop (any <sampler>_metal entry works).\n"
        "- Flux.1-dev is guidance-distilled: cfg 1.0 with FluxGuidance 3.5, negative zeroed out.\n"
        "- VAE Decode (Low Memory, Metal) decodes within a memory budget: stage by stage over the whole image "
        "(the same image as an untiled decode) where the budget holds it, else in feathered tiles from a "
        "whole-image mid block, so a 1024x1024 (or larger) decode fits in little memory.",
    ]
    titles = {"1": "Load Diffusion Model (FP8, Metal)", "2": "Load 2 Text Encoders (FP8, Metal)",
              "9": "VAE Decode (Low Memory, Metal)"}
    return p, notes, titles


def gguf_flux_t2i() -> tuple[dict, list[str], dict]:
    p = _flux_t2i_graph(
        {"class_type": "MetalGGUFModelLoader", "inputs": {"unet_name": FLUX_GGUF[1], "compute_dtype": "auto"}},
        {"class_type": "MetalGGUFDualTextEncoderLoader",
         "inputs": {"clip_name1": T5XXL_GGUF[1], "clip_name2": CLIP_L[1], "type": "flux", "device": "gpu"}},
        "comfy_metal/flux_gguf")
    notes = [
        model_note([FLUX_GGUF, T5XXL_GGUF, CLIP_L, FLUX_VAE],
                   "ComfyUI-GGUF users: the same files, in the same folders (models/unet or "
                   "models/diffusion_models for the model, models/clip or models/text_encoders for the T5). "
                   "Any quant works (Q8_0, Q6_K, Q5_K_S, Q4_K_S, Q4_0, Q3_K_S, Q2_K ...); the T5 may also be a "
                   "t5xxl .safetensors."),
        "GGUF Flux text-to-image on a Mac (Comfy Metal).\n\n"
        "- Load Diffusion Model (GGUF, Metal) keeps the weights quantised in memory (Q4_K_S: about 4.5 "
        "bits a weight, 6.8 GB for FLUX.1-dev) and dequantises each layer with a Metal kernel at forward "
        "time (a fused dequantise + GEMV kernel for small batches). LoRAs apply to the dequantised weights.\n"
        "- Load 2 Text Encoders (GGUF, Metal) takes the GGUF T5 (kept quantised) with the CLIP-L file.\n"
        "- KSampler with euler_metal; Flux.1-dev is guidance-distilled: cfg 1.0 with FluxGuidance 3.5.\n"
        "- VAE Decode (Low Memory, Metal) decodes within a memory budget: stage by stage over the whole image "
        "where the budget holds it, else in feathered tiles.",
    ]
    titles = {"1": "Load Diffusion Model (GGUF, Metal)", "2": "Load 2 Text Encoders (GGUF, Metal)",
              "9": "VAE Decode (Low Memory, Metal)"}
    return p, notes, titles


def fp8_wan22_t2v() -> tuple[dict, list[str], dict]:
    p = {
        "1": {"class_type": "MetalFP8ModelLoader",
              "inputs": {"unet_name": WAN_HIGH[1], "weight_mode": "auto", "compute_dtype": "auto",
                         "attention": "auto"}},
        "2": {"class_type": "MetalFP8ModelLoader",
              "inputs": {"unet_name": WAN_LOW[1], "weight_mode": "auto", "compute_dtype": "auto",
                         "attention": "auto"}},
        "3": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["1", 0], "shift": 8.0}},
        "4": {"class_type": "ModelSamplingSD3", "inputs": {"model": ["2", 0], "shift": 8.0}},
        "5": {"class_type": "MetalFP8TextEncoderLoader", "inputs": {"clip_name": UMT5[1], "type": "wan", "device": "gpu"}},
        "6": {"class_type": "CLIPTextEncode", "inputs": {"text": WAN_PROMPT, "clip": ["5", 0]}},
        "7": {"class_type": "CLIPTextEncode", "inputs": {"text": WAN_NEGATIVE, "clip": ["5", 0]}},
        "8": {"class_type": "EmptyHunyuanLatentVideo", "inputs": {"width": 640, "height": 640, "length": 81, "batch_size": 1}},
        "9": {"class_type": "KSamplerAdvanced",
              "inputs": {"model": ["3", 0], "add_noise": "enable", "noise_seed": 42, "steps": 20, "cfg": 3.5,
                         "sampler_name": "uni_pc_metal", "scheduler": "simple", "positive": ["6", 0],
                         "negative": ["7", 0], "latent_image": ["8", 0], "start_at_step": 0, "end_at_step": 10,
                         "return_with_leftover_noise": "enable"}},
        "10": {"class_type": "KSamplerAdvanced",
               "inputs": {"model": ["4", 0], "add_noise": "disable", "noise_seed": 42, "steps": 20, "cfg": 3.5,
                          "sampler_name": "uni_pc_metal", "scheduler": "simple", "positive": ["6", 0],
                          "negative": ["7", 0], "latent_image": ["9", 0], "start_at_step": 10,
                          "end_at_step": 10000, "return_with_leftover_noise": "disable"}},
        "11": {"class_type": "VAELoader", "inputs": {"vae_name": WAN_VAE[1]}},
        "12": {"class_type": DECODE, "inputs": {"samples": ["10", 0], "vae": ["11", 0], **VIDEO_DECODE}},
        "13": {"class_type": "SaveAnimatedWEBP",
               "inputs": {"images": ["12", 0], "filename_prefix": "comfy_metal/wan22_fp8", "fps": 16.0,
                          "lossless": False, "quality": 90, "method": "default"}},
    }
    notes = [
        model_note([WAN_HIGH, WAN_LOW, UMT5, WAN_VAE]),
        "FP8 Wan 2.2 14B text-to-video on a Mac (Comfy Metal), as ComfyUI's own Wan 2.2 14B T2V template: "
        "the high-noise expert samples steps 0-10, the low-noise expert steps 10-20 (ModelSamplingSD3 shift 8).\n\n"
        "- Both experts load through Load Diffusion Model (FP8, Metal): FP8 weights stay 1 byte each; "
        "attention auto: Metal flash attention (memory linear in the 32k tokens) where measured faster.\n"
        "- Load Text Encoder (FP8, Metal) keeps UMT5-XXL's FP8 weights at 1 byte each and runs it on the GPU.\n"
        "- KSamplerAdvanced with uni_pc_metal (UniPC, the sampler of Wan's own examples): ComfyUI's uni_pc with "
        "its predictor and corrector each one fused Metal kernel, no host sync in the loop.\n"
        "- VAE Decode (Low Memory, Metal) decodes the video in spatial tiles within a 2 GiB working budget, "
        "each tile causally frame chunk by frame chunk, so memory stays flat in the number of frames. "
        "81 frames at 640x640 = 5 s at 16 fps.",
    ]
    titles = {"1": "High-noise expert (FP8, Metal)", "2": "Low-noise expert (FP8, Metal)",
              "5": "Load Text Encoder (FP8, Metal)",
              "12": "VAE Decode (Low Memory, Metal)"}
    return p, notes, titles


def moe_t2i_prompt_enhancer() -> tuple[dict, list[str], dict]:
    p = {
        "1": {"class_type": "MetalMoETextEncoderLoader",
              "inputs": {"model": MOE_FOLDER[1], "device": "gpu", "dtype": "auto", "layer": -1, "template": "chat",
                         "system_prompt": "", "path": ""}},
        "2": {"class_type": "MetalPromptEnhancer",
              "inputs": {"clip": ["1", 0], "prompt": "a fox in the snow at dawn",
                         "system_prompt": "Rewrite the user's image prompt into one detailed, vivid description "
                                          "of a photograph. Reply with the prompt only.",
                         "max_new_tokens": 96, "temperature": 0.0, "top_p": 0.9, "seed": 0}},
        "3": {"class_type": "DualCLIPLoader",
              "inputs": {"clip_name1": CLIP_L[1], "clip_name2": T5XXL_FP8[1], "type": "flux", "device": "default"}},
        "4": {"class_type": "CLIPTextEncode", "inputs": {"text": ["2", 0], "clip": ["3", 0]}},
        "5": {"class_type": "FluxGuidance", "inputs": {"conditioning": ["4", 0], "guidance": 3.5}},
        "6": {"class_type": "MetalFP8ModelLoader",
              "inputs": {"unet_name": FLUX_MODEL[1], "weight_mode": "auto", "compute_dtype": "auto",
                         "attention": "auto"}},
        "7": {"class_type": "BasicGuider", "inputs": {"model": ["6", 0], "conditioning": ["5", 0]}},
        "8": {"class_type": "RandomNoise", "inputs": {"noise_seed": 7}},
        "9": {"class_type": "MetalSamplerSelect",
              "inputs": {"sampler_name": "dpmpp_2m", "noise_mode": "fast", "eta": 1.0, "s_noise": 1.0}},
        "10": {"class_type": "BasicScheduler", "inputs": {"model": ["6", 0], "scheduler": "simple", "steps": 20, "denoise": 1.0}},
        "11": {"class_type": "EmptySD3LatentImage", "inputs": {"width": 1024, "height": 1024, "batch_size": 1}},
        "12": {"class_type": "SamplerCustomAdvanced",
               "inputs": {"noise": ["8", 0], "guider": ["7", 0], "sampler": ["9", 0], "sigmas": ["10", 0],
                          "latent_image": ["11", 0]}},
        "13": {"class_type": "VAELoader", "inputs": {"vae_name": FLUX_VAE[1]}},
        "14": {"class_type": DECODE, "inputs": {"samples": ["12", 0], "vae": ["13", 0], **IMAGE_DECODE}},
        "15": {"class_type": "SaveImage", "inputs": {"images": ["14", 0], "filename_prefix": "comfy_metal/moe_enhanced"}},
    }
    notes = [
        model_note([MOE_FOLDER, FLUX_MODEL, CLIP_L, T5XXL_FP8, FLUX_VAE],
                   "The MoE language model is a Hugging Face folder (config.json, tokenizer.json, "
                   "tokenizer_config.json, model-*.safetensors + index): put the whole folder in "
                   "models/text_encoders/. There is no Comfy-Org repackage of a Qwen3-MoE language model; "
                   "Qwen's own repository is the source. bf16 weights are about 61 GB (a Mac with 96 GB or "
                   "more); any Qwen3-MoE / Qwen2-MoE folder or single .safetensors file works."),
        "MoE prompt enhancer -> Flux text-to-image (Comfy Metal).\n\n"
        "- Load MoE Text Encoder (Metal) loads the Qwen3-MoE model with sync-free expert dispatch on the GPU; "
        "Prompt Enhancer (MoE, Metal) rewrites the short prompt with it (greedy at temperature 0).\n"
        "- The enhanced text is encoded by Flux's own text encoders (CLIP-L + T5-XXL). The MoE loader's CLIP "
        "output (hidden states [tokens, 2048] for Qwen3-30B-A3B, no pooled vector) would need an image model "
        "trained on that conditioning; no released model is, so here the MoE model only enhances the prompt.\n"
        "- SamplerCustomAdvanced with Metal Sampler Select (dpmpp_2m, fast device-side noise).\n"
        "- VAE Decode (Low Memory, Metal) for the decode.",
    ]
    titles = {"1": "Load MoE Text Encoder (Metal)", "2": "Prompt Enhancer (MoE, Metal)",
              "6": "Load Diffusion Model (FP8, Metal)", "9": "Metal Sampler Select",
              "14": "VAE Decode (Low Memory, Metal)"}
    return p, notes, titles


def quantize_and_save() -> tuple[dict, list[str], dict]:
    p = {
        "1": {"class_type": "MetalFP8ModelLoader",
              "inputs": {"unet_name": WAN5B_FP16[1], "weight_mode": "e4m3fn rowwise", "compute_dtype": "auto",
                         "attention": "comfy default"}},
        "2": {"class_type": "MetalFP8SaveModel",
              "inputs": {"model": ["1", 0], "filename": "wan2.2_ti2v_5B_fp8_e4m3fn_rowwise",
                         "quantize_mode": "e4m3fn rowwise", "overwrite": False}},
    }
    notes = [
        model_note([WAN5B_FP16],
                   "Any bf16 / fp16 / fp32 diffusion model in models/diffusion_models/ can be the source."),
        "Quantize a diffusion model to FP8 and save it (Comfy Metal).\n\n"
        "- Load Diffusion Model (FP8, Metal) with weight_mode 'e4m3fn rowwise' quantizes the Linear weights "
        "one at a time while loading (never a full-precision copy of the model in memory); norms, "
        "embeddings, first/last layers stay in their precision.\n"
        "- Save Model (FP8 comfy_quant, Metal) writes models/diffusion_models/"
        "wan2.2_ti2v_5B_fp8_e4m3fn_rowwise.safetensors in ComfyUI's comfy_quant format (atomic write; "
        "it refuses to overwrite an existing file unless 'overwrite' is on). Load the result with the "
        "FP8 loader or ComfyUI's own Load Diffusion Model.",
    ]
    titles = {"1": "Load + quantize (FP8, Metal)", "2": "Save Model (FP8, Metal)"}
    return p, notes, titles


WORKFLOWS = {
    "fp8_flux_t2i": fp8_flux_t2i,
    "fp8_wan22_t2v": fp8_wan22_t2v,
    "gguf_flux_t2i": gguf_flux_t2i,
    "moe_t2i_prompt_enhancer": moe_t2i_prompt_enhancer,
    "quantize_and_save": quantize_and_save,
}


def model_files(name: str) -> list[tuple[str, str]]:
    """(models folder, file or folder name) of every model a workflow names."""
    prompt, _, _ = WORKFLOWS[name]()
    out = []
    for node in prompt.values():
        for value in node["inputs"].values():
            if isinstance(value, str) and value in TEST_ROLES:
                for spec in (FLUX_MODEL, CLIP_L, T5XXL_FP8, FLUX_VAE, WAN_HIGH, WAN_LOW, UMT5, WAN_VAE,
                             WAN5B_FP16, MOE_FOLDER, FLUX_GGUF, T5XXL_GGUF):
                    if spec[1] == value and (spec[0], spec[1]) not in out:
                        out.append((spec[0], spec[1]))
    return out


# ------------------------------------------------------------------------------------------ output

def is_file_choice(value) -> bool:
    import workflow_tools as wt

    return isinstance(value, str) and (value.lower().endswith(wt.MODEL_FILE_SUFFIXES) or value.endswith("/")
                                       or value.startswith("(put "))


def normalize_object_info(info: dict) -> dict:
    """object_info without the parts that depend on the models present (file lists of loaders)."""
    import workflow_tools as wt

    info = copy.deepcopy(info)
    for section in ("required", "optional"):
        for name, spec in (info.get("input", {}).get(section) or {}).items():
            if wt.input_kind(spec) != "COMBO":
                continue
            if isinstance(spec[0], list):
                spec[0] = [v for v in spec[0] if not is_file_choice(v)]
            elif len(spec) > 1 and isinstance(spec[1], dict) and isinstance(spec[1].get("options"), list):
                spec[1]["options"] = [v for v in spec[1]["options"] if not is_file_choice(v)]
    return info


def used_object_info(object_info: dict) -> dict:
    types = sorted({n["class_type"] for build in WORKFLOWS.values() for n in build()[0].values()})
    missing = [t for t in types if t not in object_info]
    if missing:
        raise SystemExit(f"ComfyUI's object_info has no {missing} (is the pack loaded, are all its nodes there?)")
    return {t: normalize_object_info(object_info[t]) for t in types}


# The view a workflow opens with (its `extra.ds`): every node, Notes included, inside the part of a
# 1400x800 page (a browser window on a 1440x900 Mac screen) the frontend's canvas shows unhidden (below
# the workflow tabs and the menu, right of the sidebar's icon strip, above the bottom-right canvas
# controls), scaled down to fit, never up. On a Retina screen the frontend draws node text from a scale
# of about 0.4 (LiteGraph's min_font_size_for_lod 8 / (14 px * sqrt(2))); every workflow here fits above it.
VIEW_WINDOW = (1400, 800)
VIEW_MARGINS = {"left": 64, "top": 100, "right": 24, "bottom": 72}
TITLE_HEIGHT = 30      # LiteGraph.NODE_TITLE_HEIGHT: a node's title bar is drawn above its pos
MAX_SCALE = 1.0


def node_bounds(nodes: list[dict]) -> tuple[float, float, float, float]:
    """(x0, y0, x1, y1) in graph coordinates around every node, title bars included."""
    x0 = min(n["pos"][0] for n in nodes)
    y0 = min(n["pos"][1] - TITLE_HEIGHT for n in nodes)
    x1 = max(n["pos"][0] + n["size"][0] for n in nodes)
    y1 = max(n["pos"][1] + n["size"][1] for n in nodes)
    return x0, y0, x1, y1


def fitted_view(nodes: list[dict], window=VIEW_WINDOW, margins=VIEW_MARGINS, pad: float = 20.0) -> dict:
    """The `extra.ds` (LiteGraph's DragAndScale: screen = (graph + offset) * scale) that fits the nodes'
    bounds, with `pad` graph units around them, centred in the window's unhidden area."""
    x0, y0, x1, y1 = node_bounds(nodes)
    x0, y0, x1, y1 = x0 - pad, y0 - pad, x1 + pad, y1 + pad
    area_w = window[0] - margins["left"] - margins["right"]
    area_h = window[1] - margins["top"] - margins["bottom"]
    scale = min(area_w / (x1 - x0), area_h / (y1 - y0), MAX_SCALE)
    scale = int(scale * 1000) / 1000          # rounded down: still fits, and a stable file
    left = margins["left"] + (area_w - (x1 - x0) * scale) / 2
    top = margins["top"] + (area_h - (y1 - y0) * scale) / 2
    return {"scale": scale, "offset": [round(left / scale - x0, 1), round(top / scale - y0, 1)]}


def dumps(obj) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def render(object_info: dict) -> dict[pathlib.Path, str]:
    """{path: text} of every generated file."""
    import workflow_tools as wt

    files = {}
    for name, build in WORKFLOWS.items():
        prompt, notes, titles = build()
        problems = wt.validate_api(prompt, object_info)
        if problems:
            raise SystemExit(f"{name}: invalid prompt:\n" + "\n".join(problems))
        ui = wt.ui_from_api(prompt, object_info, notes=notes, titles=titles)
        ui["extra"]["ds"] = fitted_view(ui["nodes"])
        if wt.api_from_ui(ui, object_info) != prompt:
            raise SystemExit(f"{name}: the UI layout does not round-trip to the prompt")
        files[WORKFLOWS_DIR / f"{name}.api.json"] = dumps(prompt)
        files[WORKFLOWS_DIR / f"{name}.json"] = dumps(ui)
    files[OBJECT_INFO_FILE] = dumps(used_object_info(object_info))
    return files


def live_object_info() -> dict:
    """object_info of a real ComfyUI ($COMFYUI_PATH) with the pack loaded, in this process."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "helpers")]
    import conftest  # noqa: F401  (the repo as the package comfy_metal)
    import comfyui_env

    path, reason = comfyui_env.comfyui_path_or_reason()
    if path is None:
        raise SystemExit(reason)
    harness = comfyui_env.ComfyUIHarness(path, tempfile.mkdtemp(prefix="comfy-metal-wf-"))
    harness.start()
    if not harness.pack_loaded:
        raise SystemExit("ComfyUI could not load the pack:\n" + "\n".join(harness.pack_load_problems()))
    try:
        return harness.object_info()
    finally:
        harness.close()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed files, write nothing")
    args = ap.parse_args(argv)
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "helpers")]
    files = render(live_object_info())
    stale = [p for p, text in files.items() if not p.exists() or p.read_text() != text]
    if args.check:
        for p in stale:
            print(f"out of date: {p.relative_to(ROOT)}")
        return 1 if stale else 0
    WORKFLOWS_DIR.mkdir(exist_ok=True)
    for p, text in files.items():
        if p in stale:
            tmp = p.with_suffix(p.suffix + ".tmp")
            tmp.write_text(text)
            tmp.replace(p)
            print(f"wrote {p.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
