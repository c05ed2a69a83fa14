"""FP8 models: load FP8 (and comfy_quant) checkpoints without upcasting, run their linears through the
Metal FP8 kernels, save models back as FP8.

formats.py reads the files, ops.py is the FP8 op set ComfyUI's model building uses
(custom_operations), quantize.py writes FP8, loader.py builds models, nodes.py holds the node classes.
"""
from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS"]
