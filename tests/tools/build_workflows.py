"""Generate the example workflows in workflows/ (the single source of truth is the API-format prompt
of each workflow, written below in Python).

    COMFYUI_PATH=/work/comfyui python tests/tools/build_workflows.py [--check]

For each workflow it writes `workflows/<name>.api.json` (API format, what POST /prompt and
`python -m comfy_metal run` take) and `workflows/<name>.json` (UI format, drag-and-drop), laid out by
`workflow_tools.ui_from_api` from the object_info of a real ComfyUI with the pack loaded, with a Note
beside the first node (what the workflow does, the files to download, why each pack node is there), the
download location of every model file in the frontend's `models` format (name, url, directory: its
Missing Models list offers them) and a view that opens readable (`fitted_view`). It also writes the
object_info of the node types the workflows use (`tests/tools/workflow_object_info.json`, file lists
emptied) so the tests can check the files without ComfyUI. `--check` writes nothing and exits 1 if a
committed file differs.
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


ALL_MODELS = (FLUX_MODEL, CLIP_L, T5XXL_FP8, FLUX_VAE, WAN_HIGH, WAN_LOW, UMT5, WAN_VAE, WAN5B_FP16, MOE_FOLDER,
              FLUX_GGUF, T5XXL_GGUF)


def is_folder(spec) -> bool:
    return spec[1].endswith("/")


def download_url(spec) -> str:
    """Where a model comes from: the file's download link on the Hugging Face hub, or for a model folder
    the repository's page (the whole repository is the folder)."""
    _, _, repo, path = spec
    return f"{HF}{repo}" if spec[1].endswith("/") else f"{HF}{repo}/resolve/main/{path}?download=true"


def model_entry(spec) -> dict:
    """A model in the frontend's `models` format (what ComfyUI's own templates carry)."""
    folder, name, _, _ = spec
    return {"name": name, "url": download_url(spec), "directory": folder}


def note(does: str, files, nodes: list[str], extra: str = "") -> str:
    """A workflow's Note in plain words: what it does, the files to download and where they go, and one
    line per Comfy Metal node on why it is there."""
    lines = [does, "", "Files to download: ComfyUI's Missing Models list links each one. Put each file in "
             "the folder shown, inside ComfyUI/models/, then press R:"]
    for spec in files:
        if is_folder(spec):
            lines.append(f"- {spec[0]}/{spec[1]}  the whole folder: every file of {download_url(spec)}")
        else:
            lines.append(f"- {spec[0]}/{spec[1]}")
    if extra:
        lines.append(extra)
    lines += ["", "Why the Comfy Metal nodes:"] + [f"- {line}" for line in nodes]
    lines += ["", "The Metal tab (lightning icon, left) shows what runs on the Mac's GPU."]
    return "\n".join(lines)


SAMPLER_LINE = ("{title}, sampler {sampler}: ComfyUI's {base} sampler with each step done in one GPU call "
                "(any sampler ending in _metal does this)")
DECODE_LINE = ("VAE Decode (Low Memory, Metal): turns the result into the {what} within a memory budget, so a "
               "large {what} does not run out of memory")


def flux_note(models: str, files, loader_lines: list[str], extra: str) -> str:
    """The Note of a Flux text-to-image workflow whose loaders read `models` (the KSampler and the decode are
    the same in each)."""
    return note(f"Flux text to image with {models}, made for Macs with Apple Silicon. Write your prompt in CLIP "
                "Text Encode, then press Run. Flux.1 needs cfg 1 with FluxGuidance 3.5: leave them as they are. "
                "The picture is saved in ComfyUI/output/comfy_metal/.", files,
                loader_lines + [SAMPLER_LINE.format(title="KSampler", sampler="euler_metal", base="euler"),
                                DECODE_LINE.format(what="picture")], extra)


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
    notes = [flux_note(
        "FP8 models", [FLUX_MODEL, CLIP_L, T5XXL_FP8, FLUX_VAE],
        ["Load Diffusion Model (FP8, Metal): keeps the FP8 model at its file size in the GPU's memory (stock "
         "ComfyUI on a Mac doubles it, or fails, before torch 2.15)",
         "Load 2 Text Encoders (FP8, Metal): runs both text encoders on the GPU (stock ComfyUI uses the CPU "
         "on a Mac)"],
        "Another Flux.1-dev FP8 file works too; the T5 may be t5xxl_fp16.safetensors.")]
    titles = {"1": "Load Diffusion Model (FP8, Metal)", "2": "Load 2 Text Encoders (FP8, Metal)",
              "9": "VAE Decode (Low Memory, Metal)"}
    return p, notes, titles


def gguf_flux_t2i() -> tuple[dict, list[str], dict]:
    p = _flux_t2i_graph(
        {"class_type": "MetalGGUFModelLoader", "inputs": {"unet_name": FLUX_GGUF[1], "compute_dtype": "auto"}},
        {"class_type": "MetalGGUFDualTextEncoderLoader",
         "inputs": {"clip_name1": T5XXL_GGUF[1], "clip_name2": CLIP_L[1], "type": "flux", "device": "gpu"}},
        "comfy_metal/flux_gguf")
    notes = [flux_note(
        "GGUF models (the files ComfyUI-GGUF uses)", [FLUX_GGUF, T5XXL_GGUF, CLIP_L, FLUX_VAE],
        ["Load Diffusion Model (GGUF, Metal): keeps the model compressed in memory (Q4_K_S: 6.8 GB for "
         "Flux.1-dev, where bf16 needs 24 GB) and unpacks each layer on the GPU as it runs",
         "Load 2 Text Encoders (GGUF, Metal): the compressed T5 with CLIP-L, on the GPU"],
        "GGUF files already in models/unet or models/clip work from there. Any other quantization works "
        "(Q8_0 ... Q2_K: smaller files, lower quality).")]
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
    notes = [note(
        "Wan 2.2 14B text to video with FP8 models (5 seconds at 640x640, 16 frames a second), made for Macs "
        "with Apple Silicon. Write what should happen in the first CLIP Text Encode and what to avoid in the "
        "second, then press Run. The video is saved in ComfyUI/output/comfy_metal/.",
        [WAN_HIGH, WAN_LOW, UMT5, WAN_VAE],
        ["High-noise expert and Low-noise expert (Load Diffusion Model, FP8, Metal): Wan 2.2 uses two models, one for "
         "the first 10 steps and one for the last 10; both stay at their file size in the GPU's memory",
         "Load Text Encoder (FP8, Metal): runs the text encoder on the GPU at its file size",
         SAMPLER_LINE.format(title="KSamplerAdvanced", sampler="uni_pc_metal", base="uni_pc"),
         "VAE Decode (Low Memory, Metal): turns the result into video in pieces within 2 GB, so memory "
         "stays the same however many frames"])]
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
        "3": {"class_type": "MetalFP8DualTextEncoderLoader",
              "inputs": {"clip_name1": CLIP_L[1], "clip_name2": T5XXL_FP8[1], "type": "flux", "device": "gpu"}},
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
    notes = [note(
        "A language model rewrites your short prompt into a detailed one, then Flux draws it. Made for Macs "
        "with Apple Silicon and a lot of memory: the language model alone is 61 GB. Write the short prompt in "
        "Prompt Enhancer (MoE, Metal), then press Run. The picture is saved in ComfyUI/output/comfy_metal/.",
        [MOE_FOLDER, FLUX_MODEL, CLIP_L, T5XXL_FP8, FLUX_VAE],
        ["Load MoE Text Encoder (Metal): loads the language model onto the GPU (a mixture-of-experts model: "
         "only a few of its parts work on each word)",
         "Prompt Enhancer (MoE, Metal): writes the detailed prompt (the same text every run at temperature 0)",
         "Load 2 Text Encoders (FP8, Metal) and Load Diffusion Model (FP8, Metal): Flux's models at their "
         "file size, on the GPU",
         "Metal Sampler Select: the dpmpp_2m sampler with each step done in one GPU call",
         DECODE_LINE.format(what="picture")],
        "The Missing Models list does not show the folder: get it from the link above.")]
    titles = {"1": "Load MoE Text Encoder (Metal)", "2": "Prompt Enhancer (MoE, Metal)",
              "3": "Load 2 Text Encoders (FP8, Metal)", "6": "Load Diffusion Model (FP8, Metal)", "9": "Metal Sampler Select",
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
    notes = [note(
        "Makes an FP8 copy of a model: half the size on disk and in memory. Run it once, then use the new "
        "file in the other workflows (or in ComfyUI's own Load Diffusion Model).",
        [WAN5B_FP16],
        ["Load + quantize (FP8, Metal): reads the model and converts its large layers to FP8 one at a time, "
         "so the whole model is never in memory twice",
         "Save Model (FP8, Metal): writes models/diffusion_models/wan2.2_ti2v_5B_fp8_e4m3fn_rowwise"
         ".safetensors, and never replaces a file that exists unless overwrite is on"],
        "Any bf16 or fp16 model in diffusion_models works instead: pick it in the first node.")]
    titles = {"1": "Load + quantize (FP8, Metal)", "2": "Save Model (FP8, Metal)"}
    return p, notes, titles


WORKFLOWS = {
    "fp8_flux_t2i": fp8_flux_t2i,
    "fp8_wan22_t2v": fp8_wan22_t2v,
    "gguf_flux_t2i": gguf_flux_t2i,
    "moe_t2i_prompt_enhancer": moe_t2i_prompt_enhancer,
    "quantize_and_save": quantize_and_save,
}


def model_specs(name: str) -> list[tuple]:
    """The model table entries of every model a workflow names, in the order its nodes name them."""
    prompt, _, _ = WORKFLOWS[name]()
    by_name = {spec[1]: spec for spec in ALL_MODELS}
    out = []
    for node in prompt.values():
        for value in node["inputs"].values():
            if isinstance(value, str) and value in by_name and by_name[value] not in out:
                out.append(by_name[value])
    return out


def model_files(name: str) -> list[tuple[str, str]]:
    """(models folder, file or folder name) of every model a workflow names."""
    return [(spec[0], spec[1]) for spec in model_specs(name)]


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


# The view a workflow opens with (its `extra.ds`), on a 1400x800 page (a browser window on a 1440x900 Mac
# screen): the Note and as many of the first columns of nodes as fit at a readable zoom, left-aligned in the
# part of the canvas nothing covers (below the workflow tabs and the menu, right of the sidebar's icon strip,
# above the bottom bar, clear of the minimap the frontend shows at the bottom right); the rest of the graph
# continues to the right. LiteGraph draws node text only from a zoom of min_font_size_for_lod 8 / (14 px *
# sqrt(devicePixelRatio)): 0.57 on a plain screen, 0.40 on a Retina one, so READABLE_SCALE holds on both.
VIEW_WINDOW = (1400, 800)
VIEW_MARGINS = {"left": 64, "top": 100, "right": 24, "bottom": 72}
MINIMAP = (1140, 540, 1400, 745)   # the minimap's box on that page (x0, y0, x1, y1), shown by default
TITLE_HEIGHT = 30      # LiteGraph.NODE_TITLE_HEIGHT: a node's title bar is drawn above its pos
READABLE_SCALE = 0.6
MAX_SCALE = 1.0
VIEW_PAD = 20.0        # graph units around the fitted nodes


def node_bounds(nodes: list[dict]) -> tuple[float, float, float, float]:
    """(x0, y0, x1, y1) in graph coordinates around every node, title bars included."""
    x0 = min(n["pos"][0] for n in nodes)
    y0 = min(n["pos"][1] - TITLE_HEIGHT for n in nodes)
    x1 = max(n["pos"][0] + n["size"][0] for n in nodes)
    y1 = max(n["pos"][1] + n["size"][1] for n in nodes)
    return x0, y0, x1, y1


def screen_box(node: dict, ds: dict) -> tuple[float, float, float, float]:
    """A node's box on the page (title bar included) under the view `ds` (screen = (graph + offset) * scale)."""
    (ox, oy), s = ds["offset"], ds["scale"]
    return ((node["pos"][0] + ox) * s, (node["pos"][1] - TITLE_HEIGHT + oy) * s,
            (node["pos"][0] + node["size"][0] + ox) * s, (node["pos"][1] + node["size"][1] + oy) * s)


def unhidden(box, window=VIEW_WINDOW, margins=VIEW_MARGINS, minimap=MINIMAP) -> bool:
    """Whether a page box lies in the part of the canvas nothing covers."""
    x0, y0, x1, y1 = box
    inside = (x0 >= margins["left"] and y0 >= margins["top"] and x1 <= window[0] - margins["right"]
              and y1 <= window[1] - margins["bottom"])
    under_minimap = x1 > minimap[0] and y1 > minimap[1] and x0 < minimap[2] and y0 < minimap[3]
    return inside and not under_minimap


def fit(nodes: list[dict], window=VIEW_WINDOW, margins=VIEW_MARGINS) -> dict:
    """The `extra.ds` that fits the nodes' bounds (VIEW_PAD around them) into the unhidden area, top-left."""
    x0, y0, x1, y1 = node_bounds(nodes)
    x0, y0, x1, y1 = x0 - VIEW_PAD, y0 - VIEW_PAD, x1 + VIEW_PAD, y1 + VIEW_PAD
    area_w = window[0] - margins["left"] - margins["right"]
    area_h = window[1] - margins["top"] - margins["bottom"]
    scale = min(area_w / (x1 - x0), area_h / (y1 - y0), MAX_SCALE)
    scale = int(scale * 1000) / 1000          # rounded down: still fits, and a stable file
    return {"scale": scale, "offset": [round(margins["left"] / scale - x0, 1), round(margins["top"] / scale - y0, 1)]}


def columns(nodes: list[dict]) -> list[list[dict]]:
    """The nodes by column (same x), left to right: the Note column first."""
    xs = sorted({n["pos"][0] for n in nodes})
    return [[n for n in nodes if n["pos"][0] == x] for x in xs]


def view_nodes(nodes: list[dict]) -> list[dict]:
    """The nodes the view is fitted to: the first columns, as many as fit readable and unhidden (at least the
    Note's column and the first node's)."""
    cols = columns(nodes)
    best = cols[0] + cols[1]
    for k in range(3, len(cols) + 1):
        chosen = [n for col in cols[:k] for n in col]
        ds = fit(chosen)
        if ds["scale"] < READABLE_SCALE:
            break                     # more columns only zoom out further
        if all(unhidden(screen_box(n, ds)) for n in chosen):
            best = chosen
    return best


def fitted_view(nodes: list[dict]) -> dict:
    ds = fit(view_nodes(nodes))
    if ds["scale"] < READABLE_SCALE:
        raise SystemExit(f"the Note and the first nodes do not fit at zoom {READABLE_SCALE} (only {ds['scale']})")
    return ds


def add_model_entries(ui: dict, specs: list[tuple]) -> None:
    """Each loader node lists the models its widgets name in `properties.models`, and the workflow lists every
    model file in `models` (the frontend's Missing Models list reads both; older frontends the second). A model
    folder is only on its node: it is no file the frontend could download."""
    by_name = {spec[1]: spec for spec in specs}
    for n in ui["nodes"]:
        named = [by_name[v] for v in n.get("widgets_values", []) if isinstance(v, str) and v in by_name]
        if named:
            n["properties"]["models"] = [model_entry(spec) for spec in named]
    ui["models"] = [model_entry(spec) for spec in specs if not is_folder(spec)]


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
        add_model_entries(ui, model_specs(name))
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
