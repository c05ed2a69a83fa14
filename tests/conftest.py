"""Test setup: import the repository root as the package `comfy_metal` (installed or not).

tests/ is deliberately not a package: tests/ and tests/helpers/ are on sys.path (pyproject's pytest
`pythonpath`), so shared test helpers are plain modules (`import comfyui_env`, `import fp8_models`),
and the repo root's __init__.py is only ever imported under the name `comfy_metal`. Each capability's
tests are in tests/<capability>/.
"""
from __future__ import annotations

import importlib.util
import os
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
if importlib.util.find_spec("torch") is None:   # one clear line instead of an import error per test module
    pytest.exit(f"comfy_metal's tests need the pack's dependencies (torch first), which {sys.executable} does not "
                f"have: run the README's test command, `bash tests/run.sh`, which installs them", returncode=4)
HELPERS = str(ROOT / "tests" / "helpers")
if HELPERS not in sys.path:  # pytest's `pythonpath` does this; a subprocess that imports conftest does not
    sys.path.insert(0, HELPERS)


def _map_repo_to_package() -> None:
    existing = sys.modules.get("comfy_metal")
    if existing is not None:
        return
    found = importlib.util.find_spec("comfy_metal")
    if found is not None and found.submodule_search_locations and \
            pathlib.Path(list(found.submodule_search_locations)[0]).resolve() == ROOT:
        return  # installed (editable) from this checkout
    spec = importlib.util.spec_from_file_location(
        "comfy_metal", ROOT / "__init__.py", submodule_search_locations=[str(ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["comfy_metal"] = module
    spec.loader.exec_module(module)


_map_repo_to_package()


class _RepoRootIsNotATestPackage:
    """The repository root has an __init__.py (it *is* the pack), so pytest would collect it as a
    Package and import that file under the folder's name at setup. A clone in
    custom_nodes/comfy-metal has no valid module name, and the relative imports inside would fail.
    The root is collected as a plain directory instead; the pack is imported only as
    `comfy_metal` (above). Registered as a plugin, not a conftest hook, so that it also sees the
    root, which lies above this folder."""

    @pytest.hookimpl(tryfirst=True)
    def pytest_collect_directory(self, path, parent):
        if pathlib.Path(path).resolve() == ROOT:
            return pytest.Dir.from_parent(parent, path=pathlib.Path(path))
        return None


def pytest_configure(config):
    config.pluginmanager.register(_RepoRootIsNotATestPackage(), "comfy_metal_repo_root")


def pytest_sessionstart(session):
    """Import the test oracles that touch torchvision before any ComfyUI fixture puts its
    torchvision stub on sys.path (transformers, imported by diffusers' VAEs, trusts find_spec)."""
    try:
        from diffusers import AutoencoderKL, AutoencoderKLWan  # noqa: F401
    except ImportError:
        pass

from comfyui_fixtures import *  # noqa: F401,F403,E402  (fixtures `comfyui`, `comfyui_path`)
from comfyui_marker import *  # noqa: F401,F403,E402  (marks the tests that need them `comfyui`)
import comfyui_env  # noqa: E402


def _export_found_comfyui() -> None:
    """Benches and subprocesses find ComfyUI through $COMFYUI_PATH: set it to the ComfyUI the tests
    found (the one the pack sits in, or the prepared archive) when the user did not."""
    if os.environ.get(comfyui_env.ENV_VAR, "").strip():
        return
    path, _ = comfyui_env.comfyui_path_or_reason()
    if path is not None:
        os.environ[comfyui_env.ENV_VAR] = str(path)


_export_found_comfyui()


@pytest.fixture
def reference_backend(monkeypatch):
    """Every public kernel takes its pure-torch reference."""
    from comfy_metal.metal_kernels import dispatch

    monkeypatch.setenv("COMFY_METAL_BACKEND", "reference")
    dispatch.reset()
    yield
    dispatch.reset()


@pytest.fixture
def emulator_backend(monkeypatch):
    """Every public kernel runs its real Metal source and launch glue through the MSL emulator on
    CPU tensors. Skips only when clang-19 is missing: an emulator that fails to import fails."""
    from comfy_metal.metal_kernels import dispatch, emulator

    if not emulator.available():
        pytest.skip("clang-19 not found: the MSL emulator cannot run")
    monkeypatch.setenv("COMFY_METAL_BACKEND", "emulator")
    monkeypatch.delenv("COMFY_METAL_REFERENCE", raising=False)
    dispatch.reset()
    yield
    dispatch.reset()


@pytest.fixture(autouse=True)
def private_dispatch_decisions(monkeypatch, tmp_path_factory, request):
    """The measured dispatch keeps its decisions in a file (metal_kernels/dispatch_decisions.py): each test
    gets its own, never the user's, and no test sees another's decisions."""
    folder = tmp_path_factory.getbasetemp() / "dispatch-decisions"
    folder.mkdir(exist_ok=True)
    name = "".join(c if c.isalnum() else "_" for c in request.node.nodeid)[-120:]
    monkeypatch.setenv("COMFY_METAL_DECISIONS", str(folder / f"{name}.json"))
