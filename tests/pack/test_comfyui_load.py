"""A real ComfyUI ($COMFYUI_PATH) loads the pack cleanly: in a subprocess and in-process.

Skipped, with the reason printed, when COMFYUI_PATH is unset.
"""
from __future__ import annotations

import sys

import pytest

import comfyui_env


def _expected_node_names():
    import comfy_metal

    return sorted((getattr(comfy_metal, "NODE_CLASS_MAPPINGS", None) or {}).keys())


def test_main_py_quick_test_loads_pack_without_errors_or_warnings(comfyui_path, tmp_path):
    startup = comfyui_env.run_comfyui_quick_test(comfyui_path, tmp_path)
    print(f"main.py --quick-test-for-ci: exit {startup.returncode} in {startup.seconds:.1f}s")
    tail = startup.log[-6000:]
    assert startup.returncode == 0, f"{' '.join(startup.cmd)} exited {startup.returncode}:\n{tail}"
    assert "Import times for custom nodes" in startup.log, f"no custom node import block:\n{tail}"
    ours = startup.pack_import
    assert ours is not None, (f"{startup.pack_link.name} missing from the custom node import block: "
                              f"{startup.custom_node_imports}\n{tail}")
    assert not ours.failed, f"IMPORT FAILED for {ours.path}:\n{tail}"
    problems = startup.problem_lines()
    assert not problems, "warnings/errors mentioning the pack:\n" + "\n".join(problems)
    assert "comfy_extras/ nodes did not import correctly" not in startup.log, tail


def test_pack_nodes_registered_in_process(comfyui):
    assert comfyui.pack_loaded is True
    assert not comfyui.pack_load_problems(), "\n".join(comfyui.pack_load_problems())
    assert comfyui.pack_module is not None
    expected = _expected_node_names()
    registered = comfyui.nodes.NODE_CLASS_MAPPINGS
    missing = [name for name in expected if name not in registered]
    assert not missing, f"pack nodes not in nodes.NODE_CLASS_MAPPINGS: {missing}"
    # Every node ComfyUI got from the pack is one the pack exports, under the custom_nodes module.
    assert sorted(comfyui.pack_node_names) == expected
    for name in expected:
        assert registered[name].RELATIVE_PYTHON_MODULE == f"custom_nodes.{comfyui_env.PACK_LINK_NAME}"
    # The loaded module is the repo root, under ComfyUI's name for it (not `comfy_metal`).
    assert comfyui.pack_module.__file__ is not None
    assert sys.modules.get("comfy_metal") is not comfyui.pack_module


def test_pack_nodes_in_object_info(comfyui):
    info = comfyui.object_info()
    assert "KSampler" in info  # sanity: the route handler ran over the built-in nodes
    for name in _expected_node_names():
        assert name in info, f"{name} missing from /object_info"
        assert info[name]["python_module"] == f"custom_nodes.{comfyui_env.PACK_LINK_NAME}"


def test_run_prompt_with_builtin_nodes(comfyui):
    """The harness can execute a prompt in-process (built-in nodes only, no model files)."""
    prompt = {
        "1": {"class_type": "EmptyImage", "inputs": {"width": 8, "height": 8, "batch_size": 1, "color": 0}},
        "2": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}},
    }
    result = comfyui.run_prompt(prompt)
    assert "2" in result.outputs and result.outputs["2"]["images"], result.outputs
    out = comfyui.run_prompt(prompt, execute=["1"])
    assert tuple(out.node_outputs["1"][0][0].shape) == (1, 8, 8, 3)


def test_run_prompt_reports_comfyui_errors(comfyui):
    bad = {"1": {"class_type": "EmptyImage", "inputs": {"width": 8}},
           "2": {"class_type": "PreviewImage", "inputs": {"images": ["1", 0]}}}
    with pytest.raises(comfyui_env.ComfyPromptError, match="Required input is missing"):
        comfyui.run_prompt(bad)


def test_models_dir_is_seen_by_folder_paths(comfyui):
    d = comfyui.models_dir("checkpoints")
    (d / "tiny-test.safetensors").write_bytes(b"")
    assert "tiny-test.safetensors" in comfyui.folder_paths.get_filename_list("checkpoints")
    assert comfyui.folder_paths.get_full_path("checkpoints", "tiny-test.safetensors") == str(d / "tiny-test.safetensors")


def test_real_server_lists_pack_nodes_in_object_info(comfyui_path, tmp_path):
    """ComfyUI's HTTP server on 127.0.0.1:<free port> serves the pack's nodes in /object_info."""
    with comfyui_env.comfyui_server(comfyui_path, tmp_path) as server:
        info = server.get_json("/object_info")
        log = server.log()
    assert "KSampler" in info
    for name in _expected_node_names():
        assert name in info, f"{name} missing from the server's /object_info"
    ours = [e for e in comfyui_env.parse_custom_node_import_times(log)
            if e.path.endswith("/" + comfyui_env.PACK_LINK_NAME)]
    assert ours and not ours[0].failed, log[-6000:]
