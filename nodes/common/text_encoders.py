"""What the FP8 and GGUF text encoder loaders share: ComfyUI's encoder type lists, read from ComfyUI at run
time, and the Load 2 / 3 / 4 Text Encoders node classes (ComfyUI's Dual/Triple/QuadrupleCLIPLoader inputs).
"""
from __future__ import annotations

import sys
from typing import Callable

# The `type` lists of ComfyUI v0.33's CLIPLoader and DualCLIPLoader, for when ComfyUI's own are not there.
CLIP_TYPES_FALLBACK = ["stable_diffusion", "stable_cascade", "sd3", "stable_audio", "mochi", "ltxv", "pixart", "cosmos",
                       "lumina2", "wan", "hidream", "chroma", "ace", "omnigen2", "qwen_image", "hunyuan_image", "flux2",
                       "ovis", "longcat_image", "cogvideox", "lens", "pixeldit", "ideogram4", "boogu", "krea2",
                       "joyimage", "mage", "minimax"]
DUAL_CLIP_TYPES_FALLBACK = ["sdxl", "sd3", "flux", "hunyuan_video", "hidream", "hunyuan_image", "hunyuan_video_15",
                            "kandinsky5", "kandinsky5_image", "ltxv", "newbie", "ace"]
SET_NAMES = {2: "Dual", 3: "Triple", 4: "Quadruple"}


def _comfy_type_list(loader: str, fallback: list[str]) -> list[str]:
    try:
        # ComfyUI's own nodes.py, already imported by ComfyUI before it loads packs. Looked up, not
        # imported: outside ComfyUI a bare `import nodes` could pick up an unrelated folder (even this
        # pack's own nodes/ when run from the repo root).
        return list(getattr(sys.modules["nodes"], loader).INPUT_TYPES()["required"]["type"][0])
    except Exception:
        return list(fallback)


def clip_types() -> list[str]:
    """The `type` list of ComfyUI's CLIPLoader (new types appear by themselves)."""
    return _comfy_type_list("CLIPLoader", CLIP_TYPES_FALLBACK)


def dual_clip_types() -> list[str]:
    """The `type` list of ComfyUI's DualCLIPLoader (flux, hunyuan_video, ...: the two-encoder families)."""
    return _comfy_type_list("DualCLIPLoader", DUAL_CLIP_TYPES_FALLBACK)


def default_device() -> str:
    """The loaders' device default: the GPU on Macs (ComfyUI keeps text encoders on the CPU there)."""
    from ...metal_kernels.probe import mps_available

    return "gpu" if mps_available() else "cpu"


def multi_text_encoder_loaders(prefix: str, *, files: Callable[[], list[str]], file_tooltip: Callable[[int, int], str],
                               type_options: dict, device_tooltip: str, descriptions: dict[int, str],
                               load: Callable[[str, list[str], str, str], object],
                               note: Callable[[object], str | None] | None = None) -> dict[str, type]:
    """The node classes `{prefix}{Dual,Triple,Quadruple}TextEncoderLoader`: n files (`files()`, the tooltip of
    file i of n `file_tooltip(i, n)`), a `type` from DualCLIPLoader's list for two files (three and four
    files: ComfyUI detects the family), and the device. `load(node class name, file names, type, device)`
    returns the CLIP; the node records its backend for the badge, with `note(clip)` where given."""

    def make(n: int) -> type:
        class Loader:
            @classmethod
            def INPUT_TYPES(cls):
                names = files()
                inputs = {f"clip_name{i}": (names, {"tooltip": file_tooltip(i, n)}) for i in range(1, n + 1)}
                if n == 2:
                    inputs["type"] = (dual_clip_types(), dict(type_options))
                inputs["device"] = (["gpu", "cpu"], {"default": default_device(), "tooltip": device_tooltip})
                return {"required": inputs}

            RETURN_TYPES = ("CLIP",)
            FUNCTION = "load"
            CATEGORY = "Comfy Metal/Loaders"
            DESCRIPTION = descriptions[n]

            def load(self, device="gpu", type="stable_diffusion", **clip_names):
                from ..status import record_node_backend

                node = Loader.__name__
                clip = load(node, [clip_names[f"clip_name{i}"] for i in range(1, n + 1)], type, device)
                record_node_backend(node, [], note=note(clip) if note else None)
                return (clip,)

        Loader.__name__ = Loader.__qualname__ = f"{prefix}{SET_NAMES[n]}TextEncoderLoader"
        return Loader

    return {cls.__name__: cls for cls in map(make, SET_NAMES)}
