"""The test command works from any checkout, and finds a real ComfyUI in the documented order."""
from __future__ import annotations

import os
import pathlib
import shutil
import subprocess
import sys

import pytest

import comfyui_env

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("folder", ["comfy-metal", "ComfyUI-Metal"])
def test_suite_runs_from_a_checkout_whose_name_is_no_module_name(tmp_path, folder):
    """The README installs the pack as custom_nodes/comfy-metal: pytest must not import the root
    __init__.py under that folder's name (every test would error at setup)."""
    clone = tmp_path / "custom_nodes" / folder
    shutil.copytree(ROOT, clone, ignore=shutil.ignore_patterns(".git", "__pycache__", "*.egg-info",
                                                               ".pytest_cache", "node_modules"))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_CURRENT_TEST")}
    small_test_file = next(ROOT.glob("tests/**/test_msl_scan.py")).relative_to(ROOT)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           str(small_test_file)], cwd=clone, env=env, capture_output=True, text=True,
                          timeout=300)
    tail = "\n".join((proc.stdout + proc.stderr).splitlines()[-15:])
    assert proc.returncode == 0, tail
    assert " passed" in tail and "error" not in tail.lower(), tail


def _fake_comfyui(path: pathlib.Path) -> pathlib.Path:
    path.mkdir(parents=True)
    for name in ("main.py", "nodes.py", "execution.py", "server.py", "folder_paths.py"):
        (path / name).write_text("")
    return path


def test_comfyui_path_comes_first(tmp_path, monkeypatch):
    fake = _fake_comfyui(tmp_path / "ComfyUI")
    monkeypatch.setenv("COMFYUI_PATH", str(fake))
    assert comfyui_env.comfyui_path_or_reason() == (fake.resolve(), None)
    monkeypatch.setenv("COMFYUI_PATH", str(tmp_path))
    path, reason = comfyui_env.comfyui_path_or_reason()
    assert path is None and "is not a ComfyUI checkout (missing main.py" in reason


def test_then_the_comfyui_the_pack_sits_in(tmp_path, monkeypatch):
    comfy = _fake_comfyui(tmp_path / "ComfyUI")
    pack = comfy / "custom_nodes" / "comfy-metal"
    pack.mkdir(parents=True)
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    monkeypatch.setattr(comfyui_env, "REPO_ROOT", pack)
    assert comfyui_env.comfyui_path_or_reason() == (comfy, None)


def test_then_the_prepared_archive_else_a_reason(tmp_path, monkeypatch):
    monkeypatch.delenv("COMFYUI_PATH", raising=False)
    monkeypatch.setattr(comfyui_env, "REPO_ROOT", tmp_path / "checkout")
    monkeypatch.setattr(comfyui_env, "ARCHIVE_DIR", tmp_path / "shared" / "comfyui")
    monkeypatch.setenv("COMFY_METAL_CACHE", str(tmp_path / "cache"))
    path, reason = comfyui_env.comfyui_path_or_reason()
    assert path is None and "COMFYUI_PATH is unset" in reason and "ComfyUI-*.tar.gz" in reason

    comfyui_env.ARCHIVE_DIR.mkdir(parents=True)
    (comfyui_env.ARCHIVE_DIR / "ComfyUI-0123abcd.tar.gz").write_bytes(b"")
    path, reason = comfyui_env.comfyui_path_or_reason()
    assert path is None and "prepare_comfyui.py" in reason

    unpacked = _fake_comfyui(tmp_path / "cache" / "ComfyUI-0123abcd" / "ComfyUI")
    assert comfyui_env.comfyui_path_or_reason()[0] is None  # requirements not installed yet
    (unpacked.parent / comfyui_env.READY_MARKER).write_text("digest")
    assert comfyui_env.comfyui_path_or_reason() == (unpacked, None)
