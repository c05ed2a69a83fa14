"""Make a real ComfyUI available to the integration tests (tests/run.sh runs this before pytest).

If $COMFYUI_PATH is set or the pack sits in <ComfyUI>/custom_nodes/, that ComfyUI is used and nothing
is done here. Otherwise the ComfyUI source archive beside the project (../shared/comfyui/ComfyUI-*.tar.gz)
is unpacked once into a cache folder outside the repository (tests/helpers/comfyui_env.py: cache_dir) and
ComfyUI's requirements are installed into this Python, keeping the torch already installed (a
constraint pins it), and without torchvision/torchaudio, whose import stubs stay in the test
environment (tests/comfy_stubs/). The unpacked tree is shared; the requirements are decided per Python
environment: each has its own marker (comfyui_env.ready_marker), and a marker only counts while every
requirement is still installed in that environment. Prints the path of the ComfyUI the tests will use,
or why none.

    python tests/tools/prepare_comfyui.py [--archive ComfyUI-xxxx.tar.gz]
"""
from __future__ import annotations

import argparse
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


def _torch_version() -> str | None:
    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None


def _requirements_digest(comfyui: pathlib.Path) -> str:
    """What the installed requirements depend on: ComfyUI's requirements.txt and the torch kept."""
    text = (comfyui / "requirements.txt").read_text()
    return hashlib.sha256(f"{text}\ntorch=={_torch_version()}".encode()).hexdigest()


def _requirements(comfyui: pathlib.Path) -> list[str]:
    """ComfyUI's requirement lines, less those never installed here (SKIPPED_REQUIREMENTS)."""
    lines = (raw.split("#", 1)[0].strip() for raw in (comfyui / "requirements.txt").read_text().splitlines())
    return [line for line in lines if line and _requirement_name(line) not in SKIPPED_REQUIREMENTS]


def missing_requirements(comfyui: pathlib.Path) -> list[str]:
    """The requirements not installed in this Python environment, or installed at a version the line
    excludes (read from the installed distributions' metadata: nothing is imported)."""
    try:
        from packaging.requirements import InvalidRequirement, Requirement
    except ImportError:                       # a bare venv: the names alone
        Requirement = None
    missing = []
    for line in _requirements(comfyui):
        try:
            installed = importlib.metadata.version(_requirement_name(line))
        except importlib.metadata.PackageNotFoundError:
            missing.append(line)
            continue
        if Requirement is not None:
            try:
                if not Requirement(line).specifier.contains(installed, prereleases=True):
                    missing.append(f"{line} (found {installed})")
            except InvalidRequirement:
                pass
    return missing


def _install_requirements(comfyui: pathlib.Path) -> None:
    """pip-install ComfyUI's requirements into this Python, with the current torch pinned by a
    constraint."""
    wanted, no_deps = [], []
    for line in _requirements(comfyui):
        (no_deps if _requirement_name(line) in NO_DEPS_REQUIREMENTS else wanted).append(line)
    with tempfile.TemporaryDirectory() as d:
        constraint = pathlib.Path(d) / "constraints.txt"
        torch_version = _torch_version()
        constraint.write_text(f"torch=={torch_version}\n" if torch_version else "")
        pip = [sys.executable, "-m", "pip", "install", "-q", "-c", str(constraint)]
        subprocess.run([*pip, *wanted], check=True)
        if no_deps:
            subprocess.run([*pip, "--no-deps", *no_deps], check=True)


def prepare_archive(archive: pathlib.Path) -> pathlib.Path:
    """Unpack `archive` (once, shared) and install its requirements into this Python environment
    (once per environment). Returns the unpacked ComfyUI."""
    target = comfyui_env.unpacked_archive_path(archive)
    if comfyui_env.missing_files(target):
        if target.exists():
            shutil.rmtree(target)
        print(f"unpacking {archive.name} into {target.parent}", flush=True)
        _unpack(archive, target)
    marker = comfyui_env.ready_marker(target)
    digest = _requirements_digest(target)
    marked = marker.is_file() and marker.read_text() == digest
    missing = missing_requirements(target)
    if not marked or missing:
        why = f"missing here: {', '.join(missing)}" if missing else "requirements or torch changed"
        print(f"installing ComfyUI's requirements into {sys.prefix} ({why}; torch stays as installed)",
              flush=True)
        _install_requirements(target)
        tmp = marker.with_name(f".{marker.name}.tmp-{os.getpid()}")
        tmp.write_text(digest)
        os.replace(tmp, marker)
    return target


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--archive", type=pathlib.Path,
                        help="prepare this ComfyUI source archive (instead of the one beside the project)")
    args = parser.parse_args(argv)
    if args.archive is None:
        path, reason = comfyui_env.comfyui_path_or_reason()
        if path is not None and (os.environ.get(comfyui_env.ENV_VAR) or comfyui_env.enclosing_comfyui()):
            print(f"ComfyUI for the integration tests: {path}")
            return 0
        args.archive = comfyui_env.shared_archive()
        if args.archive is None:
            print(reason)
            return 0
    print(f"ComfyUI for the integration tests: {prepare_archive(args.archive)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
