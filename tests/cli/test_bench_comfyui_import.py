"""The benches import ComfyUI (with the import-only torchvision stub on a machine without torchvision)
and then transformers' models in the same process: the MoE bench must still find transformers."""
from __future__ import annotations

import subprocess
import sys

SCRIPT = """
from comfy_metal.nodes.common.comfyui import import_comfy
module, why_not = import_comfy("comfy.k_diffusion.sampling")
assert module is not None, why_not
from transformers import Qwen3MoeForCausalLM  # failed on the stub's missing pil_to_tensor before
print("ok")
"""


def test_transformers_models_import_after_comfyui(comfyui_path):
    import comfyui_env

    proc = subprocess.run([sys.executable, "-c", comfyui_env.checkout_import_code() + SCRIPT], capture_output=True, text=True, timeout=300,
                          env=comfyui_env.comfy_subprocess_env({"COMFYUI_PATH": str(comfyui_path),
                                                               "PYTHONPATH": ""}))
    assert proc.returncode == 0 and proc.stdout.strip().endswith("ok"), proc.stderr[-2000:]
