"""Every input of every pack node explains itself in ComfyUI's frontend (a tooltip saying what it does,
and what `auto` / 0 means where it has that value), the categories use one casing scheme, and an empty
model list says where to put a model in the same words in every loader.

Iterates the pack's NODE_CLASS_MAPPINGS (nodes added later are covered without a change here); file
lists come from a stand-in folder_paths with no files (workflow_tools.pack_object_info)."""
from __future__ import annotations

import sys
import types

import pytest

import workflow_tools as wt
from comfy_metal import NODE_CLASS_MAPPINGS
from comfy_metal.nodes.common import models

CATEGORIES = {"Comfy Metal", "Comfy Metal/Loaders", "Comfy Metal/Sampling", "Comfy Metal/VAE", "Comfy Metal/MoE",
              "Comfy Metal/Attention"}


def _inputs():
    info = wt.pack_object_info()
    for node, node_info in sorted(info.items()):
        for name, spec, _ in wt.ordered_inputs(node_info):
            yield node, name, spec


INPUTS = list(_inputs())


@pytest.mark.parametrize("node,name,spec", INPUTS, ids=[f"{n}.{i}" for n, i, _ in INPUTS])
def test_every_input_has_a_tooltip_that_says_what_auto_and_zero_mean(node, name, spec):
    opts = spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}
    tip = opts.get("tooltip")
    assert isinstance(tip, str) and len(tip.strip()) >= 15, f"{node}.{name} has no tooltip (or a bare one): {tip!r}"
    kind = wt.input_kind(spec)
    if kind == "COMBO" and "auto" in wt.combo_options(spec):
        assert "auto" in tip, f"{node}.{name}: the tooltip does not say what 'auto' means: {tip!r}"
    if kind in ("INT", "FLOAT") and opts.get("default") == 0 and opts.get("min", -1) <= 0:
        assert "0" in tip, f"{node}.{name}: default 0, and the tooltip does not say what 0 means: {tip!r}"


def test_inputs_were_found_for_every_node():
    with_inputs = {n for n, _, _ in INPUTS}
    assert set(NODE_CLASS_MAPPINGS) - with_inputs == {"MetalStatus"}    # the one node without inputs
    assert len(INPUTS) > 30


def test_categories_use_one_casing_scheme():
    bad = {n: cls.CATEGORY for n, cls in NODE_CLASS_MAPPINGS.items()
           if cls.CATEGORY not in CATEGORIES
           or any(part[:1] != part[:1].upper() for part in cls.CATEGORY.split("/"))}
    assert not bad, f"categories must be 'Comfy Metal/<Capitalised>': {bad}"


def test_empty_model_lists_say_where_to_put_a_model_the_same_way(monkeypatch):
    # a folder_paths with no files, even where an earlier test imported ComfyUI's and placed models
    empty = types.ModuleType("folder_paths")
    empty.get_filename_list = lambda kind: []
    empty.get_folder_paths = lambda kind: []
    monkeypatch.setitem(sys.modules, "folder_paths", empty)
    info = wt.pack_object_info()
    entries = {}
    for node, node_info in info.items():
        for name, spec, _ in wt.ordered_inputs(node_info):
            if wt.input_kind(spec) == "COMBO":
                opts = wt.combo_options(spec)
                if len(opts) == 1 and models.is_placeholder(opts[0]):
                    entries[f"{node}.{name}"] = opts[0]
    assert {"MetalFP8ModelLoader.unet_name", "MetalFP8TextEncoderLoader.clip_name",
            "MetalMoETextEncoderLoader.model", "MetalGGUFModelLoader.unet_name", "MetalGGUFTextEncoderLoader.clip_name",
            "MetalGGUFDualTextEncoderLoader.clip_name2"} <= set(entries), entries
    for key, entry in entries.items():
        assert entry.startswith("(put ") and "ComfyUI/models/" in entry and "press R" in entry, (key, entry)
    assert entries["MetalFP8ModelLoader.unet_name"] == models.empty_list_entry("diffusion_models")
    assert models.model_choices("vae", ["a.safetensors"]) == ["a.safetensors"]


def test_queueing_the_empty_list_entry_is_a_clear_error():
    entry = models.empty_list_entry("diffusion_models")
    with pytest.raises(ValueError, match=r"MetalFP8ModelLoader: no model chosen for 'unet_name': put a model "
                                         r"file in ComfyUI/models/diffusion_models/"):
        models.require_model("MetalFP8ModelLoader", "unet_name", entry)
    assert models.require_model("X", "y", "model.safetensors") == "model.safetensors"
