"""The workflow checker itself: it must catch what a broken workflow gets wrong."""
import copy

import workflow_tools as wt

INFO = {
    "Loader": {"input": {"required": {"name": (["a.safetensors", "b.safetensors"],)}},
               "input_order": {"required": ["name"]}, "output": ["MODEL"], "output_name": ["MODEL"]},
    "Sampler": {"input": {"required": {"model": ("MODEL",), "seed": ("INT", {"default": 0, "min": 0, "max": 10, "control_after_generate": True}),
                                       "cfg": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 30.0}),
                                       "name": (["euler", "heun"],)}},
                "input_order": {"required": ["model", "seed", "cfg", "name"]}, "output": ["LATENT"], "output_name": ["LATENT"]},
    "Save": {"input": {"required": {"samples": ("LATENT",), "prefix": ("STRING", {"default": "x"})}},
             "input_order": {"required": ["samples", "prefix"]}, "output": [], "output_name": [], "output_node": True},
}
API = {"1": {"class_type": "Loader", "inputs": {"name": "a.safetensors"}},
       "2": {"class_type": "Sampler", "inputs": {"model": ["1", 0], "seed": 3, "cfg": 2.5, "name": "heun"}},
       "3": {"class_type": "Save", "inputs": {"samples": ["2", 0], "prefix": "out"}}}


def test_round_trip_is_clean():
    ui = wt.ui_from_api(API, INFO, notes=["where to get the model"])
    assert wt.validate_ui(ui, INFO) == []
    assert wt.validate_api(API, INFO) == []
    assert wt.api_from_ui(ui, INFO) == API


def test_catches_bad_values_types_and_nodes():
    bad = copy.deepcopy(API)
    bad["2"]["inputs"]["seed"] = 11
    bad["2"]["inputs"]["name"] = "dpm"
    bad["3"]["inputs"]["samples"] = ["1", 0]
    bad["4"] = {"class_type": "Nope", "inputs": {}}
    problems = "\n".join(wt.validate_api(bad, INFO))
    assert "> max 10" in problems and "'dpm' is not one of" in problems
    assert "takes LATENT, linked to MODEL" in problems and "'Nope' is not a known node" in problems


def test_catches_ui_link_type_mismatch_and_widget_count():
    ui = wt.ui_from_api(API, INFO)
    sampler = next(n for n in ui["nodes"] if n["type"] == "Sampler")
    sampler["widgets_values"].append("extra")
    link = ui["links"][0]
    link[5] = "CLIP"
    ui["nodes"][0]["outputs"][0]["type"] = "CLIP"
    problems = "\n".join(wt.validate_ui(ui, INFO))
    assert "extra widget values" in problems and "types differ" in problems


def test_linked_widget_and_model_folder_values():
    info = dict(INFO)
    info["Text"] = {"input": {"required": {"text": ("STRING", {"multiline": True})}},
                    "input_order": {"required": ["text"]}, "output": ["STRING"], "output_name": ["STRING"]}
    info["Encode"] = {"input": {"required": {"text": ("STRING", {"multiline": True}), "model": ("MODEL",),
                                             "folder": (["(none)"],)}},
                      "input_order": {"required": ["text", "model", "folder"]}, "output": ["LATENT"],
                      "output_name": ["LATENT"]}
    api = {"1": {"class_type": "Loader", "inputs": {"name": "a.safetensors"}},
           "2": {"class_type": "Text", "inputs": {"text": "a cat"}},
           "3": {"class_type": "Encode", "inputs": {"text": ["2", 0], "model": ["1", 0], "folder": "Some-LM/"}},
           "4": {"class_type": "Save", "inputs": {"samples": ["3", 0], "prefix": "out"}}}
    ui = wt.ui_from_api(api, info)
    encode = next(n for n in ui["nodes"] if n["type"] == "Encode")
    assert encode["widgets_values"][0] == ""          # a linked STRING widget keeps a string value
    assert wt.validate_ui(ui, info) == [] and wt.validate_api(api, info) == []
    assert wt.api_from_ui(ui, info) == api
    assert wt.validate_api(api, info, allow_missing_files=False)  # the folder is not an option
