"""Comfy Metal: Apple Silicon first for ComfyUI.

ComfyUI imports this file from custom_nodes/<folder>; tests and scripts import it as `comfy_metal`.
Importing it needs no ComfyUI, touches no GPU and compiles nothing.
"""
from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

WEB_DIRECTORY = "./web"
__version__ = "0.1.0"

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
