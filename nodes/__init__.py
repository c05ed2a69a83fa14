"""ComfyUI nodes of Comfy Metal and the logic behind them.

Each feature module defines NODE_CLASS_MAPPINGS / NODE_DISPLAY_NAME_MAPPINGS and imports
ComfyUI's `comfy.*` modules only inside the functions that run, so this package imports
without ComfyUI.
"""
from __future__ import annotations

import importlib
import importlib.util

# Feature modules, in the order their nodes appear.
FEATURE_MODULES = ("fp8_loader", "samplers", "vae_tiled", "moe_encoder", "status")

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}

for _module_name in FEATURE_MODULES:
    if importlib.util.find_spec(f".{_module_name}", __name__) is None:
        continue
    _module = importlib.import_module(f".{_module_name}", __name__)
    NODE_CLASS_MAPPINGS.update(getattr(_module, "NODE_CLASS_MAPPINGS", {}))
    NODE_DISPLAY_NAME_MAPPINGS.update(getattr(_module, "NODE_DISPLAY_NAME_MAPPINGS", {}))
