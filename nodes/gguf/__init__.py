"""GGUF models (llama.cpp / ComfyUI-GGUF files) kept quantised on the Metal GPU."""
from __future__ import annotations

from .loader import (MetalGGUFDualTextEncoderLoader, MetalGGUFModelLoader, MetalGGUFQuadrupleTextEncoderLoader,
                     MetalGGUFTextEncoderLoader, MetalGGUFTripleTextEncoderLoader)

NODE_CLASS_MAPPINGS = {
    "MetalGGUFModelLoader": MetalGGUFModelLoader,
    "MetalGGUFTextEncoderLoader": MetalGGUFTextEncoderLoader,
    "MetalGGUFDualTextEncoderLoader": MetalGGUFDualTextEncoderLoader,
    "MetalGGUFTripleTextEncoderLoader": MetalGGUFTripleTextEncoderLoader,
    "MetalGGUFQuadrupleTextEncoderLoader": MetalGGUFQuadrupleTextEncoderLoader,
}
NODE_DISPLAY_NAME_MAPPINGS = {
    "MetalGGUFModelLoader": "Load Diffusion Model (GGUF, Metal)",
    "MetalGGUFTextEncoderLoader": "Load Text Encoder (GGUF, Metal)",
    "MetalGGUFDualTextEncoderLoader": "Load 2 Text Encoders (GGUF, Metal)",
    "MetalGGUFTripleTextEncoderLoader": "Load 3 Text Encoders (GGUF, Metal)",
    "MetalGGUFQuadrupleTextEncoderLoader": "Load 4 Text Encoders (GGUF, Metal)",
}
