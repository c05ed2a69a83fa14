"""Make a real ComfyUI available to the integration tests (tests/run.sh runs this before pytest).

If $COMFYUI_PATH is set or the pack sits in <ComfyUI>/custom_nodes/, that ComfyUI is used and nothing
is done here. Otherwise the ComfyUI source archive beside the project (../shared/comfyui/ComfyUI-*.tar.gz)
is unpacked once into a cache folder outside the repository (tests/helpers/comfyui_env.py: cache_dir) and
ComfyUI's requirements are installed into this Python, keeping the torch already installed (a
constraint pins it), and without torchvision/torchaudio, whose import stubs stay in the test
environment (tests/comfy_stubs/). Prints the path of the ComfyUI the tests will use, or why none.

    python tests/tools/prepare_comfyui.py
"""
from __future__ import annotations

import hashlib
import importlib.metadata
import os
import pathlib
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "helpers"))
import comfyui_env  # noqa: E402

# Not installable beside the pinned CPU torch wheel (stubbed in tests), or torch itself (pinned).
SKIPPED_REQUIREMENTS = ("torch", "torchvision", "torchaudio")
# Installed without its dependencies: it asks for torchvision, which is stubbed.
NO_DEPS_REQUIREMENTS = ("spandrel",)


def _requirement_name(line: str) -> str:
    return re.split(r"[<>=!~;\[ ]", line, maxsplit=1)[0].strip().lower()


def _unpack(archive: pathlib.Path, target: pathlib.Path) -> None:
    """Unpack into a temporary sibling folder, then rename: a half-unpacked tree is never used."""
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = pathlib.Path(tempfile.mkdtemp(prefix=".unpack-", dir=target.parent))
    try:
        with tarfile.open(archive) as tar:
            tar.extractall(tmp, filter="data")
        tops = [p for p in tmp.iterdir()]
        if len(tops) != 1 or not tops[0].is_dir():
            raise SystemExit(f"{archive}: expected one top folder, found {[p.name for p in tops]}")
        tops[0].rename(target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _requirements_digest(comfyui: pathlib.Path) -> str:
    """What the installed requirements depend on: ComfyUI's requirements.txt and the torch kept."""
    text = (comfyui / "requirements.txt").read_text()
    return hashlib.sha256(f"{text}\ntorch=={importlib.metadata.version('torch')}".encode()).hexdigest()


def _install_requirements(comfyui: pathlib.Path) -> None:
    """pip-install ComfyUI's requirements with the current torch pinned by a constraint."""
    wanted, no_deps = [], []
    for raw in (comfyui / "requirements.txt").read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        name = _requirement_name(line)
        if name in SKIPPED_REQUIREMENTS:
            continue
        (no_deps if name in NO_DEPS_REQUIREMENTS else wanted).append(line)
    with tempfile.TemporaryDirectory() as d:
        constraint = pathlib.Path(d) / "constraints.txt"
        constraint.write_text(f"torch=={importlib.metadata.version('torch')}\n")
        pip = [sys.executable, "-m", "pip", "install", "-q", "-c", str(constraint)]
        subprocess.run([*pip, *wanted], check=True)
        if no_deps:
            subprocess.run([*pip, "--no-deps", *no_deps], check=True)


def main() -> int:
    path, reason = comfyui_env.comfyui_path_or_reason()
    if path is not None and (os.environ.get(comfyui_env.ENV_VAR) or comfyui_env.enclosing_comfyui()):
        print(f"ComfyUI for the integration tests: {path}")
        return 0
    archive = comfyui_env.shared_archive()
    if archive is None:
        print(reason)
        return 0
    target = comfyui_env.unpacked_archive_path(archive)
    if comfyui_env.missing_files(target):
        if target.exists():
            shutil.rmtree(target)
        print(f"unpacking {archive.name} into {target.parent}", flush=True)
        _unpack(archive, target)
    marker = target.parent / comfyui_env.READY_MARKER
    digest = _requirements_digest(target)
    if not marker.is_file() or marker.read_text() != digest:
        print("installing ComfyUI's requirements (torch stays as installed)", flush=True)
        _install_requirements(target)
        marker.write_text(digest)
    print(f"ComfyUI for the integration tests: {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
