"""The pack imports without ComfyUI, touches no GPU, compiles nothing and starts no process at import,
and imports its own modules relatively (ComfyUI loads it under its folder name, not `comfy_metal`)."""
from __future__ import annotations

import ast
import json
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
COMFYUI_MODULES = ("comfy", "comfy_extras", "comfy_api", "folder_paths", "nodes", "server", "execution")

# Imports every module of the pack under a folder-like name, with every GPU / compile / process entry
# point replaced by one that records the call and raises.
_PROBE = r"""
import importlib, importlib.util, json, pkgutil, subprocess, sys, torch

touched = []
def trap(name):
    def f(*a, **k):
        touched.append(name)
        raise AssertionError(name + " called while importing the pack")
    return f

torch.mps.compile_shader = trap("torch.mps.compile_shader")
torch.backends.mps.is_available = trap("torch.backends.mps.is_available")
torch.cuda.is_available = trap("torch.cuda.is_available")
torch.cuda.init = trap("torch.cuda.init")
for name in ("synchronize", "current_allocated_memory", "driver_allocated_memory", "recommended_max_memory",
             "empty_cache"):
    if hasattr(torch.mps, name):
        setattr(torch.mps, name, trap("torch.mps." + name))
subprocess.Popen = trap("subprocess.Popen")

root, pack = sys.argv[1], "cm_folder_name"
spec = importlib.util.spec_from_file_location(pack, root + "/__init__.py", submodule_search_locations=[root])
m = importlib.util.module_from_spec(spec)
sys.modules[pack] = m
spec.loader.exec_module(m)
imported = []
for sub in ("nodes", "metal_kernels"):
    mod = importlib.import_module(pack + "." + sub)
    for info in pkgutil.walk_packages(mod.__path__, prefix=f"{pack}.{sub}."):   # every module, subpackages too
        importlib.import_module(info.name)
        imported.append(info.name[len(pack) + 1:])
print(json.dumps({"touched": touched, "modules": sorted(sys.modules), "imported": imported,
                  "nodes": sorted(m.NODE_CLASS_MAPPINGS)}))
"""


def test_pack_imports_without_comfyui_gpu_compiler_or_processes(tmp_path):
    # cwd outside the repo: a bare `import nodes` must not find the pack's own nodes/ folder either
    proc = subprocess.run([sys.executable, "-c", _PROBE, str(ROOT)], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["touched"] == []
    leaked = [name for name in out["modules"]
              if name.split(".")[0] in COMFYUI_MODULES]
    assert leaked == [], f"importing the pack imported ComfyUI modules: {leaked}"
    # absolute self-imports would load a second copy of the pack under its installed name
    assert not [n for n in out["modules"] if n == "comfy_metal" or n.startswith("comfy_metal.")]
    assert "nodes.fp8.loader" in out["imported"] and "metal_kernels.dispatch" in out["imported"]
    assert "MetalFP8ModelLoader" in out["nodes"]


def _pack_sources():
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in ("tests", "build", "workflows") or "egg-info" in str(rel) or rel.parts[0].startswith("."):
            continue
        yield rel, path.read_text()


def test_no_bare_nodes_import_and_no_module_level_comfyui_import():
    bare = re.compile(r"^\s*(import nodes\b|from nodes import)", re.M)
    problems = []
    for rel, text in _pack_sources():
        for match in bare.finditer(text):
            problems.append(f"{rel}:{text[:match.start()].count(chr(10)) + 1}: {match.group(0).strip()}")
        tree = ast.parse(text)
        # module level = not inside a function body (ifs / trys at module level count)
        stack = list(tree.body)
        while stack:
            node = stack.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if node.level == 0 else []
            else:
                stack.extend(ast.iter_child_nodes(node))
                continue
            for name in names:
                top = name.split(".")[0]
                if top in COMFYUI_MODULES or top == "comfy_metal":
                    problems.append(f"{rel}:{node.lineno}: module-level import of {name}")
    assert problems == [], "\n".join(problems)


def test_a_broken_feature_module_leaves_the_other_nodes_loaded(monkeypatch, caplog):
    import importlib as real_importlib
    import logging

    from comfy_metal import nodes

    real_import_module = real_importlib.import_module

    def import_module(name, package=None):
        if name == ".sampling":
            raise RuntimeError("boom in sampling")
        return real_import_module(name, package)

    monkeypatch.setattr(nodes.importlib, "import_module", import_module)
    monkeypatch.setattr(nodes, "NODE_CLASS_MAPPINGS", {})
    monkeypatch.setattr(nodes, "NODE_DISPLAY_NAME_MAPPINGS", {})
    monkeypatch.setattr(nodes, "FAILED_FEATURES", {})
    with caplog.at_level(logging.ERROR, logger="comfy_metal"):
        nodes._load_features(nodes.FEATURE_MODULES)
    assert "MetalFP8ModelLoader" in nodes.NODE_CLASS_MAPPINGS and "MetalStatus" in nodes.NODE_CLASS_MAPPINGS
    assert nodes.FAILED_FEATURES == {"sampling": "RuntimeError: boom in sampling"}
    assert any("sampling nodes failed to load" in r.getMessage() for r in caplog.records)
