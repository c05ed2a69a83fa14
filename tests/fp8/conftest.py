"""fp8 tests: the pack's FP8 node module as a running ComfyUI loaded it."""
import importlib

import pytest



@pytest.fixture(scope="module")
def loader_mod(comfyui):
    """The pack's FP8 node module as ComfyUI loaded it (under the pack folder's name)."""
    return importlib.import_module(comfyui.pack_module.__name__ + ".nodes.fp8.nodes")
