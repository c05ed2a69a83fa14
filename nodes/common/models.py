"""The model lists of the pack's loaders, and what an empty one says (the same words in every loader).

With no model installed a loader's list holds one entry naming the folder to put a model in; picking
that entry and queueing fails with the same words (never a "file not found" for a made-up name).
"""
from __future__ import annotations

PLACEHOLDER_PREFIX = "(put "   # tests/tools/build_workflows.py drops such entries from the snapshot


def empty_list_entry(folder: str, what: str = "a model file") -> str:
    """The single entry of an empty list: where to put a model, and how to see it without a restart."""
    return f"(put {what} in ComfyUI/models/{folder}/, then press R to refresh)"


def model_choices(folder: str, names: list[str], what: str = "a model file") -> list[str]:
    """`names` (the files a loader can open), or the one entry saying where to put a model."""
    return list(names) if names else [empty_list_entry(folder, what)]


def is_placeholder(name) -> bool:
    return isinstance(name, str) and name.startswith(PLACEHOLDER_PREFIX)


def require_model(node: str, input_name: str, name: str) -> str:
    """`name`, or a clear error when the empty list's entry was queued."""
    if is_placeholder(name):
        raise ValueError(f"{node}: no model chosen for {input_name!r}: {name[1:-1]}")
    return name


def filename_list(folder: str) -> list[str]:
    """ComfyUI's file list for `folder` (folder_paths), empty outside ComfyUI."""
    try:
        import folder_paths
    except ImportError:
        return []
    return folder_paths.get_filename_list(folder)
