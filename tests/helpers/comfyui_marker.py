"""Marks every test that needs a real ComfyUI (it uses the `comfyui_path` fixture, directly or through
`comfyui` or another fixture) with the registered marker `comfyui`, so `pytest -m comfyui` selects the
ComfyUI integration tests and `-m "not comfyui"` leaves them out.

tests/conftest.py imports the hook (`from comfyui_marker import *`), so it covers every test folder.
"""
from __future__ import annotations

import pytest

__all__ = ["pytest_collection_modifyitems"]

COMFYUI_FIXTURES = ("comfyui_path", "comfyui")


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("comfyui") is None and \
                any(name in getattr(item, "fixturenames", ()) for name in COMFYUI_FIXTURES):
            item.add_marker(pytest.mark.comfyui)
