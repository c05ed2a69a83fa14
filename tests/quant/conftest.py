"""quant tests: the pack's modules as a running ComfyUI loaded them."""
import importlib

import pytest


@pytest.fixture(scope="module")
def pack(comfyui):
    """pack("nodes.quant.ops") -> the pack's module as ComfyUI loaded it (under the pack folder's name)."""
    return lambda name: importlib.import_module(comfyui.pack_module.__name__ + "." + name)
