"""fp8 tests: shared test helpers live in tests/helpers/ (on sys.path through pyproject's pythonpath)."""
import importlib

import pytest

from comfyui_marker import *  # noqa: F401,F403  (marks the ComfyUI integration tests `comfyui`)


@pytest.fixture(scope="module")
def loader_mod(comfyui):
    """The pack's FP8 node module as ComfyUI loaded it (under the pack folder's name)."""
    return importlib.import_module(comfyui.pack_module.__name__ + ".nodes.fp8.nodes")
