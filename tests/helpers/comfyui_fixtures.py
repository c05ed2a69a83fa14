"""Pytest fixtures for tests against a real ComfyUI ($COMFYUI_PATH); conftest.py star-imports them.

* `comfyui_path` (session): pathlib.Path of the checkout; skips (reason printed) when
  COMFYUI_PATH is unset or not a ComfyUI checkout.
* `comfyui` (session): the in-process `comfyui_env.ComfyUIHarness`, our pack loaded as the
  custom node folder "comfy-metal". API: `.nodes` (ComfyUI's nodes module), `.run_prompt(prompt)`,
  `.models_dir(kind)`, `.object_info()`, `.pack_node_names`, `.pack_module`, `.server`,
  `.folder_paths`, `.execution`.
"""
from __future__ import annotations

import pytest

import comfyui_env

__all__ = ["comfyui_path", "comfyui"]


@pytest.fixture(scope="session")
def comfyui_path():
    return comfyui_env.require_comfyui_path()


@pytest.fixture(scope="session")
def comfyui(comfyui_path, tmp_path_factory):
    harness = comfyui_env.ComfyUIHarness(comfyui_path, tmp_path_factory.mktemp("comfyui-base"))
    harness.start()
    if not harness.pack_loaded:
        problems = "\n".join(harness.pack_load_problems()) or "(nothing logged)"
        harness.close()
        pytest.fail(f"ComfyUI could not load the pack from {harness.pack_link}:\n{problems}", pytrace=False)
    try:
        yield harness
    finally:
        harness.close()
