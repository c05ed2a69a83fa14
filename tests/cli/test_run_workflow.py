"""`python -m comfy_metal run`: workflow format checks, finding ComfyUI, progress output, per-node
records; with COMFYUI_PATH, real headless runs of core-node workflows in a subprocess."""
from __future__ import annotations

import io
import json
import pathlib
import struct
import subprocess
import time

import pytest

from comfy_metal.nodes.cli import run_workflow as rw
from comfy_metal.nodes.common.comfyui import REQUIRED_COMFYUI_FILES

REPO = pathlib.Path(__file__).resolve().parents[2]
TINY_WORKFLOW = {
    "1": {"class_type": "EmptyImage", "inputs": {"width": 40, "height": 24, "batch_size": 1, "color": 0xFF8000},
          "_meta": {"title": "Blank image"}},
    "2": {"class_type": "SaveImage", "inputs": {"images": ["1", 0], "filename_prefix": "headless/img"}},
    "3": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 32, "batch_size": 2}},
    "4": {"class_type": "SaveLatent", "inputs": {"samples": ["3", 0], "filename_prefix": "latents/lat"}},
    # a core node with a comfy.utils.ProgressBar (one step per image), previewed into the temp folder
    "5": {"class_type": "EmptyImage", "inputs": {"width": 8, "height": 8, "batch_size": 3, "color": 0x2040FF}},
    "6": {"class_type": "ColorTransfer", "inputs": {"image_target": ["5", 0], "image_ref": ["1", 0],
                                                    "method": "histogram", "source_stats": "per_frame",
                                                    "strength": 1.0}},
    "7": {"class_type": "PreviewImage", "inputs": {"images": ["6", 0]}},
    # the pack's own diagnostic node: runs a kernel and records its backend
    "8": {"class_type": "MetalStatus", "inputs": {}},
}
UI_WORKFLOW = {"last_node_id": 2, "last_link_id": 1, "nodes": [{"id": 1, "type": "EmptyImage"}],
               "links": [[1, 1, 0, 2, 0, "IMAGE"]], "version": 0.4}


def _write(tmp_path, name, data) -> pathlib.Path:
    path = tmp_path / name
    path.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return path


# -- workflow format ----------------------------------------------------------------------------

def test_api_workflow_loads_and_post_body_is_accepted(tmp_path):
    assert rw.load_api_workflow(_write(tmp_path, "a.json", TINY_WORKFLOW)) == TINY_WORKFLOW
    body = {"prompt": TINY_WORKFLOW, "client_id": "x"}
    assert rw.load_api_workflow(_write(tmp_path, "b.json", body)) == TINY_WORKFLOW


def test_ui_format_is_refused_with_how_to_export(tmp_path):
    with pytest.raises(rw.RunError) as e:
        rw.load_api_workflow(_write(tmp_path, "ui.json", UI_WORKFLOW))
    assert e.value.code == rw.EXIT_USAGE
    msg = str(e.value)
    assert "ui.json" in msg and "UI-format" in msg and "API format" in msg and "Export (API)" in msg


@pytest.mark.parametrize("content, needle", [
    ("{not json", "is not a JSON file"),
    ("[1, 2]", "expected an API-format workflow"),
    ("{}", "expected an API-format workflow"),
    (json.dumps({"1": {"inputs": {}}}), "node '1' is not an API-format node"),
    (json.dumps({"1": {"class_type": "X", "inputs": [1]}}), "node '1' is not an API-format node"),
])
def test_bad_workflows_name_the_file_and_problem(tmp_path, content, needle):
    path = _write(tmp_path, "w.json", content)
    with pytest.raises(rw.RunError) as e:
        rw.load_api_workflow(path)
    assert needle in str(e.value) and str(path) in str(e.value)
    with pytest.raises(rw.RunError, match="no such file"):
        rw.load_api_workflow(tmp_path / "missing.json")


# -- finding ComfyUI ----------------------------------------------------------------------------

def _fake_comfyui(root: pathlib.Path) -> pathlib.Path:
    root.mkdir(parents=True)
    for f in REQUIRED_COMFYUI_FILES:
        (root / f).write_text("")
    (root / "custom_nodes").mkdir()
    return root


def test_find_comfyui_order_and_errors(tmp_path, monkeypatch):
    a = _fake_comfyui(tmp_path / "A")
    b = _fake_comfyui(tmp_path / "B")
    monkeypatch.setenv("COMFYUI_PATH", str(b))
    assert rw.find_comfyui(str(a), pack_dirs=[]) == a.resolve()
    assert rw.find_comfyui(None, pack_dirs=[]) == b.resolve()
    monkeypatch.setenv("COMFYUI_PATH", str(tmp_path))
    with pytest.raises(rw.RunError, match=r"\$COMFYUI_PATH=.* is not a ComfyUI folder \(missing main.py"):
        rw.find_comfyui(None, pack_dirs=[])
    monkeypatch.delenv("COMFYUI_PATH")
    # the pack sitting in ComfyUI's custom_nodes (a symlink, as users install it)
    link = a / "custom_nodes" / "comfy-metal"
    link.symlink_to(REPO, target_is_directory=True)
    assert rw.find_comfyui(None, pack_dirs=[link]) == a.resolve()
    with pytest.raises(rw.RunError) as e:
        rw.find_comfyui(None, pack_dirs=[REPO])
    assert e.value.code == 2
    assert "no ComfyUI found" in str(e.value) and "--comfyui" in str(e.value) and "COMFYUI_PATH" in str(e.value)


def _cli(args, env_extra=None, cwd=None, timeout=300):
    """`python -m comfy_metal run ...` in a subprocess (ComfyUI's test stubs on PYTHONPATH); no
    COMFYUI_PATH unless given in env_extra."""
    import comfyui_env

    env = comfyui_env.comfy_subprocess_env()
    env.pop("COMFYUI_PATH", None)
    env.update(env_extra or {})
    return subprocess.run(comfyui_env.pack_command("run", *map(str, args)), capture_output=True,
                          text=True, env=env, cwd=cwd, timeout=timeout)


def test_cli_without_comfyui_exits_2_with_help(tmp_path):
    wf = _write(tmp_path, "wf.json", TINY_WORKFLOW)
    proc = _cli([wf, "--out", tmp_path / "out"], cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "no ComfyUI found" in proc.stderr and "--comfyui" in proc.stderr
    assert "Traceback" not in proc.stderr
    assert not (tmp_path / "out" / "summary.json").exists()


def test_cli_with_a_broken_comfyui_exits_2(tmp_path):
    """A folder that looks like ComfyUI but cannot be imported: a clear error, no traceback."""
    fake = _fake_comfyui(tmp_path / "ComfyUI")
    wf = _write(tmp_path, "wf.json", TINY_WORKFLOW)
    proc = _cli([wf, "--out", tmp_path / "out"], env_extra={"COMFYUI_PATH": str(fake)}, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert f"could not import ComfyUI from {fake.resolve()}" in proc.stderr and "requirements.txt" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_cli_ui_format_exits_2(tmp_path):
    wf = _write(tmp_path, "ui.json", UI_WORKFLOW)
    proc = _cli([wf], cwd=tmp_path)
    assert proc.returncode == 2
    assert "API format" in proc.stderr and "Traceback" not in proc.stderr


# -- progress and records -------------------------------------------------------------------------

def test_format_bar():
    assert rw.format_bar(0, 4, width=8) == "[--------] 0/4   0%"
    assert rw.format_bar(3, 4, width=8) == "[######--] 3/4  75%"
    assert rw.format_bar(9, 4, width=8) == "[########] 9/4 100%"
    assert rw.format_bar(1, 0, width=4) == "[----] 1/0   0%"


def test_progress_printer_on_a_log_stream():
    out = io.StringIO()
    p = rw.ProgressPrinter(out, total_nodes=3)
    p.node("5", "KSampler")
    for i in range(1, 21):
        p.progress(i, 20)
    p.node("6", "VAEDecode")
    p.close()
    lines = out.getvalue().splitlines()
    assert lines[0] == "[1/3] node 5 KSampler"
    bars = [line for line in lines if "%" in line]
    assert [b.split()[-1] for b in bars] == ["5%", "25%", "50%", "75%", "100%"]  # one line per quarter
    assert lines[-1] == "[2/3] node 6 VAEDecode"


def test_node_recorder_times_nodes_and_marks_cached():
    prompt = {"1": {"class_type": "A", "inputs": {}, "_meta": {"title": "first"}},
              "2": {"class_type": "B", "inputs": {}}, "3": {"class_type": "C", "inputs": {}}}
    rec = rw.NodeRecorder(prompt, progress=None, interval=0.005)
    try:
        rec.on_event("execution_cached", {"nodes": ["3"]})
        rec.on_event("executing", {"node": "1"})
        buf = bytearray(32 << 20)  # the sampler sees RSS rise inside node 1
        time.sleep(0.05)
        rec.on_event("executing", {"node": "2"})
        del buf
        rec.on_event("execution_success", {})
    finally:
        rec.close()
    n = rec.nodes
    assert n["1"]["class"] == "A" and n["1"]["title"] == "first"
    assert n["1"]["seconds"] >= 0.04 and n["2"]["seconds"] < n["1"]["seconds"]
    assert n["3"]["cached"] is True and n["3"]["seconds"] == 0
    assert n["1"]["peak_memory"]["rss"] > 0
    assert rec.overall_peak["rss"] >= n["2"]["peak_memory"]["rss"]


def test_attach_backends_by_id_then_class():
    nodes = {"1": {"class": "MetalLoader", "backend": None}, "2": {"class": "MetalSampler", "backend": None},
             "3": {"class": "KSampler", "backend": None}}
    r_id = {"node_id": "2", "node_class": "MetalSampler", "backend": "metal", "time": 2}
    r_cls_old = {"node_id": None, "node_class": "MetalLoader", "backend": "metal", "time": 1}
    r_cls_new = {"node_id": None, "node_class": "MetalLoader", "backend": "reference", "time": 3}
    r_other = {"node_id": "99", "node_class": "MetalOther", "backend": "metal", "time": 4}
    rw.attach_backends(nodes, [r_cls_new, r_id, r_cls_old, r_other])
    assert nodes["1"]["backend"] is r_cls_new and nodes["2"]["backend"] is r_id and nodes["3"]["backend"] is None


def test_write_json_atomic(tmp_path):
    path = tmp_path / "summary.json"
    path.write_text("old")
    rw.write_json_atomic(path, {"a": pathlib.Path("/x")})
    assert json.loads(path.read_text()) == {"a": "/x"}
    assert [p.name for p in tmp_path.iterdir()] == ["summary.json"]


# -- real ComfyUI ---------------------------------------------------------------------------------

def _png_size(path: pathlib.Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    return struct.unpack(">II", data[16:24])


def test_headless_run_of_core_nodes(comfyui_path, tmp_path):
    wf = _write(tmp_path, "tiny_api.json", TINY_WORKFLOW)
    out = tmp_path / "out"
    models = tmp_path / "models"
    (models / "checkpoints").mkdir(parents=True)
    proc = _cli([wf, "--out", out, "--models", models], env_extra={"COMFYUI_PATH": str(comfyui_path)},
                cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert "[1/8] node" in proc.stderr and "node 2 SaveImage" in proc.stderr
    assert "3/3 100%" in proc.stderr  # ColorTransfer's progress bar reached the end
    assert "User settings have been changed" not in proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert summary["success"] is True and summary["error"] is None
    assert summary["comfyui"]["path"] == str(comfyui_path)
    assert summary["device"] == "cpu"
    assert set(summary["nodes"]) == set(TINY_WORKFLOW)
    for node_id, node in summary["nodes"].items():
        assert node["class"] == TINY_WORKFLOW[node_id]["class_type"]
        assert node["seconds"] >= 0 and node["cached"] is False
        assert node["peak_memory"]["rss"] > 50 << 20
        if node_id != "8":
            assert node["backend"] is None  # core nodes run no Comfy Metal kernel
    backend = summary["nodes"]["8"]["backend"]
    assert backend["node_id"] == "8" and backend["node_class"] == "MetalStatus"
    assert backend["backend"] == "reference" and backend["kernels"]["softmax"]["device"] == "cpu"
    assert summary["outputs"]["8"]["text"][0].startswith("No Apple GPU here")   # the Status node's verdict
    assert summary["nodes"]["1"]["title"] == "Blank image"
    image = out / "headless" / "img_00001_.png"
    assert _png_size(image) == (40, 24)
    latents = list((out / "latents").glob("lat_*.latent"))
    assert len(latents) == 1
    from safetensors.torch import load_file

    assert tuple(load_file(str(latents[0]))["latent_tensor"].shape) == (2, 4, 4, 8)
    assert sorted(summary["files"]) == sorted([str(image), str(latents[0])])  # previews are not outputs
    assert summary["outputs"]["7"]["images"][0]["type"] == "temp"
    assert sorted(p.name for p in out.iterdir()) == ["headless", "latents", "summary.json"]
    assert proc.stdout.split() == summary["files"]
    assert not list(comfyui_path.glob("user/comfyui.db"))


def test_headless_run_reports_validation_and_execution_errors(comfyui_path, tmp_path):
    env = {"COMFYUI_PATH": str(comfyui_path)}
    bad = _write(tmp_path, "bad_api.json", {
        "9": {"class_type": "NoSuchNode", "inputs": {}},
        "2": {"class_type": "SaveImage", "inputs": {"images": ["9", 0], "filename_prefix": "x"}}})
    proc = _cli([bad, "--out", tmp_path / "o1"], env_extra=env, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "o1" / "summary.json").read_text())
    assert summary["success"] is False and "NoSuchNode" in summary["error"]
    assert "NoSuchNode" in proc.stderr

    # A checkpoint in --models passes validation (the folder is registered), then fails to load.
    models = tmp_path / "models"
    (models / "checkpoints").mkdir(parents=True)
    from safetensors.torch import save_file
    import torch

    save_file({"junk": torch.zeros(2)}, str(models / "checkpoints" / "tiny.safetensors"))
    wf = _write(tmp_path, "ckpt_api.json", {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": "tiny.safetensors"}},
        "2": {"class_type": "VAEDecode", "inputs": {"samples": ["3", 0], "vae": ["1", 2]}},
        "3": {"class_type": "EmptyLatentImage", "inputs": {"width": 64, "height": 64, "batch_size": 1}},
        "4": {"class_type": "SaveImage", "inputs": {"images": ["2", 0], "filename_prefix": "x"}}})
    proc = _cli([wf, "--out", tmp_path / "o2", "--models", models], env_extra=env, cwd=tmp_path)
    assert proc.returncode == 1, proc.stderr[-3000:]
    summary = json.loads((tmp_path / "o2" / "summary.json").read_text())
    assert "value_not_in_list" not in json.dumps(summary)
    assert summary["error"].startswith("node 1 (CheckpointLoaderSimple) raised"), summary["error"][:500]
    assert summary["nodes"]["1"]["class"] == "CheckpointLoaderSimple"

    # ComfyUI options pass through --comfy-args; one ComfyUI rejects is a clear usage error.
    proc = _cli([wf, "--out", tmp_path / "o3", "--comfy-args=--no-such-comfy-option"], env_extra=env, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "ComfyUI rejected its command line" in proc.stderr and "--no-such-comfy-option" in proc.stderr
