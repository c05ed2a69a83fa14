"""Metal Attention: a MODEL whose attention is the pack's fused flash attention (Metal on Apple GPUs),
through ComfyUI's own extension point (ModelPatcher.set_model_optimized_attention), never slower
than ComfyUI's attention by measurement. See comfy_attention.py for the rules."""
from __future__ import annotations


class MetalAttention:
    CATEGORY = "Comfy Metal/Attention"
    FUNCTION = "patch"
    RETURN_TYPES = ("MODEL",)
    DESCRIPTION = ("Runs the model's attention through Comfy Metal's fused flash-attention kernel on Apple GPUs: "
                   "fp32 softmax and accumulation, memory linear in the sequence length, correct past 2^31 score "
                   "elements. In auto mode each attention shape is timed once against ComfyUI's own attention "
                   "and the faster one is kept, so it never makes a Mac slower; on CPU/CUDA ComfyUI's attention "
                   "stays.")

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "model": ("MODEL", {"tooltip": "The diffusion model whose attention is replaced (a patched clone is "
                                           "returned; the input model is unchanged)."}),
            "mode": (["auto", "always"], {"default": "auto", "tooltip":
                     "auto: on Apple GPUs time the Metal kernel against ComfyUI's attention once per shape and "
                     "keep the faster; elsewhere keep ComfyUI's attention. always: use the pack's attention on "
                     "every device (Metal on MPS, else its PyTorch reference)."}),
        }}

    def patch(self, model, mode="auto"):
        from .comfy_attention import patch_model

        return (patch_model(model, mode),)


NODE_CLASS_MAPPINGS = {"MetalAttention": MetalAttention}
NODE_DISPLAY_NAME_MAPPINGS = {"MetalAttention": "Metal Attention"}
