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
    (unpacked.parent / comfyui_env.READY_MARKER).write_text("digest")   # another environment's marker
    assert comfyui_env.comfyui_path_or_reason()[0] is None
    comfyui_env.ready_marker(unpacked).write_text("digest")
    assert comfyui_env.comfyui_path_or_reason() == (unpacked, None)


FAKE_REQUIREMENT = "comfy_metal_fake_requirement"


def _wheel(folder: pathlib.Path, name: str, version: str) -> pathlib.Path:
    """A pure-Python wheel of one empty module, written by hand (nothing is built or downloaded)."""
    import base64
    import hashlib
    import zipfile

    folder.mkdir(parents=True, exist_ok=True)
    info = f"{name}-{version}.dist-info"
    files = {f"{name}.py": "", f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: hand\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = [f"{path},sha256={base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b'=').decode()},"
              f"{len(text.encode())}" for path, text in files.items()] + [f"{info}/RECORD,,"]
    files[f"{info}/RECORD"] = "\n".join(record) + "\n"
    wheel = folder / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as z:
        for path, text in files.items():
            z.writestr(path, text)
    return wheel


def _fake_archive(folder: pathlib.Path, requirements: str) -> pathlib.Path:
    import tarfile

    tree = _fake_comfyui(folder / "src" / "ComfyUI")
    (tree / "requirements.txt").write_text(requirements)
    archive = folder / "ComfyUI-0badc0de.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(tree, arcname="ComfyUI")
    return archive


def test_comfyui_requirements_are_installed_in_each_python_environment(tmp_path):
    """Two environments share the unpacked ComfyUI (one cache), but each gets ComfyUI's requirements: the
    second venv must not take the first one's marker for its own (its ComfyUI tests would all fail with
    ModuleNotFoundError). A requirement removed from an environment is installed again."""
    _wheel(tmp_path / "wheels", FAKE_REQUIREMENT, "1.0")
    archive = _fake_archive(tmp_path, f"torch\n# a comment\n{FAKE_REQUIREMENT}>=1.0  # the one to install\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(COMFY_METAL_CACHE=str(tmp_path / "cache"), PIP_NO_INDEX="1", PIP_CONFIG_FILE=os.devnull,
               PIP_FIND_LINKS=str(tmp_path / "wheels"), PIP_DISABLE_PIP_VERSION_CHECK="1")
    env.pop(comfyui_env.ENV_VAR, None)
    script = ROOT / "tests" / "tools" / "prepare_comfyui.py"

    def python_of(venv):   # an empty venv that sees this Python's packages (pip, torch) but installs into its own
        subprocess.run([sys.executable, "-m", "venv", "--without-pip", "--system-site-packages", str(venv)],
                       check=True, timeout=120)
        return str(venv / "bin" / "python")

    def prepare(python):
        code = comfyui_env.checkout_import_code() + (f"import runpy; sys.argv = ['prepare', '--archive', {str(archive)!r}]; "
                                                     f"runpy.run_path({str(script)!r}, run_name='__main__')")
        proc = subprocess.run([python, "-c", code], env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        return proc.stdout

    def has_requirement(python):
        return subprocess.run([python, "-c", f"import {FAKE_REQUIREMENT}"], env=env, capture_output=True,
                              timeout=120).returncode == 0

    first, second = python_of(tmp_path / "venv-a"), python_of(tmp_path / "venv-b")
    assert not has_requirement(first) and not has_requirement(second)
    out = prepare(first)
    assert "unpacking" in out and "installing ComfyUI's requirements" in out, out
    assert has_requirement(first) and not has_requirement(second)
    out = prepare(second)
    assert "unpacking" not in out and f"missing here: {FAKE_REQUIREMENT}>=1.0" in out, out
    assert has_requirement(second)
    assert "installing" not in prepare(second)                # prepared: nothing to do
    markers = sorted(p.name for p in (tmp_path / "cache" / "ComfyUI-0badc0de").glob(comfyui_env.READY_MARKER + "-*"))
    assert len(markers) == 2
    subprocess.run([second, "-m", "pip", "uninstall", "-q", "-y", FAKE_REQUIREMENT], env=env, check=True,
                   capture_output=True, timeout=120)
    assert "installing" in prepare(second) and has_requirement(second)
