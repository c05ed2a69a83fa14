"""Finding a ComfyUI outside ComfyUI: for `run`, the benches and the test harness (one place).

A ComfyUI checkout is a folder with main.py, nodes.py, execution.py, server.py and folder_paths.py.
Looked for in $COMFYUI_PATH, else (`find_comfyui_dir`) the ComfyUI whose custom_nodes/ holds this pack,
else a sys.path entry (inside ComfyUI, its folder is on sys.path).
"""
from __future__ import annotations

import importlib
import os
import pathlib
import sys

COMFYUI_ENV = "COMFYUI_PATH"
REQUIRED_COMFYUI_FILES = ("main.py", "nodes.py", "execution.py", "server.py", "folder_paths.py")
PACK_ROOT = pathlib.Path(__file__).resolve().parents[2]     # the repository root = the pack's folder
STUBS_DIR = PACK_ROOT / "tests" / "comfy_stubs"              # import-only torchvision/torchaudio (in a clone)


def missing_comfyui_files(path) -> list[str]:
    """The files a ComfyUI checkout has that `path` lacks ([] = it is one)."""
    return [f for f in REQUIRED_COMFYUI_FILES if not (pathlib.Path(path) / f).is_file()]


def is_comfyui_checkout(path) -> bool:
    return not missing_comfyui_files(path)


def comfyui_in_custom_nodes(pack_dirs=None) -> pathlib.Path | None:
    """The ComfyUI holding this pack in its custom_nodes/ (`pack_dirs`: where the pack is, as installed
    (maybe a symlink) and resolved), or None."""
    if pack_dirs is None:
        pack_dirs = (pathlib.Path(os.path.abspath(__file__)).parents[2], PACK_ROOT)
    for pack in map(pathlib.Path, pack_dirs):
        if pack.parent.name == "custom_nodes" and is_comfyui_checkout(pack.parent.parent):
            return pack.parent.parent.resolve()
    return None


def find_comfyui_dir() -> pathlib.Path | None:
    """$COMFYUI_PATH when it is a checkout, else the ComfyUI holding this pack, else a sys.path entry."""
    raw = os.environ.get(COMFYUI_ENV, "").strip()
    if raw and is_comfyui_checkout(pathlib.Path(raw).expanduser()):
        return pathlib.Path(raw).expanduser().resolve()
    found = comfyui_in_custom_nodes()
    if found is not None:
        return found
    for entry in sys.path:
        if entry and is_comfyui_checkout(entry):
            return pathlib.Path(entry).resolve()
    return None


def import_comfy(module: str):
    """(ComfyUI's `module`, None), importing it from the ComfyUI found (CPU mode on a machine without a GPU),
    or (None, why not). Inside ComfyUI the already-imported module."""
    if module in sys.modules:
        return sys.modules[module], None
    path = find_comfyui_dir()
    if path is None:
        return None, f"ComfyUI not found (set {COMFYUI_ENV})"
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))
    if STUBS_DIR.is_dir() and str(STUBS_DIR) not in sys.path:
        try:  # transformers notes once, at import, whether torchvision exists: let it see the truth first
            import transformers.utils.import_utils  # noqa: F401
        except ImportError:
            pass
        sys.path.append(str(STUBS_DIR))   # last: a really installed torchvision/torchaudio wins
    try:
        import torch

        import comfy.cli_args  # parses no command line unless ComfyUI's main enabled it

        if not torch.cuda.is_available() and not (hasattr(torch.backends, "mps") and torch.backends.mps.is_available()):
            comfy.cli_args.args.cpu = True  # a standalone process on a CPU-only machine
        return importlib.import_module(module), None
    except Exception as e:
        return None, f"ComfyUI not importable ({type(e).__name__}: {str(e)[:80]})"
