"""MoE text encoders: the pack's Qwen3-MoE model (qwen3/), the CLIP built on it (encoder.py), the
sync-free experts patch for ComfyUI's own MoE encoders (experts_patch.py) and the nodes (nodes.py)."""
from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
