"""ComfyUI nodes of Comfy Metal and the logic behind them.

Each feature module defines NODE_CLASS_MAPPINGS / NODE_DISPLAY_NAME_MAPPINGS and imports
ComfyUI's `comfy.*` modules only inside the functions that run, so this package imports
without ComfyUI.
"""
from __future__ import annotations

import importlib
import logging

# Feature packages (nodes/<capability>/), in the order their nodes appear. A new capability adds its
# package name here; its __init__.py exports NODE_CLASS_MAPPINGS / NODE_DISPLAY_NAME_MAPPINGS.
FEATURE_MODULES = ("fp8", "gguf", "sampling", "vae", "moe", "attention", "status")

NODE_CLASS_MAPPINGS: dict = {}
NODE_DISPLAY_NAME_MAPPINGS: dict = {}
# feature module -> why it did not load (its nodes are missing; the others work)
FAILED_FEATURES: dict[str, str] = {}


def _load_features(names) -> None:
    for module_name in names:
        try:
            module = importlib.import_module(f".{module_name}", __name__)
        except Exception as e:  # one broken feature must not take every node of the pack down
            FAILED_FEATURES[module_name] = f"{type(e).__name__}: {e}"
            logging.getLogger("comfy_metal").exception("comfy_metal: the %s nodes failed to load", module_name)
            continue
        NODE_CLASS_MAPPINGS.update(getattr(module, "NODE_CLASS_MAPPINGS", {}))
        NODE_DISPLAY_NAME_MAPPINGS.update(getattr(module, "NODE_DISPLAY_NAME_MAPPINGS", {}))


_load_features(FEATURE_MODULES)
