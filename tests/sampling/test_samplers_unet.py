"""Every Metal sampler against ComfyUI's sampler of the same name on a real (tiny, random) model:
ComfyUI's KSampler node with the SD1.5 UNet architecture, epsilon and flow (rectified-flow model
sampling), `<name>_metal` with exact noise gives `<name>`'s latent (fp32, 1e-5). Needs COMFYUI_PATH."""
from __future__ import annotations

import pytest
import torch

from comfy_metal.metal_kernels import dispatch
from comfy_metal.nodes import sampling as S
from test_samplers import _conds, _tiny_unet_patcher


@pytest.fixture(scope="module")
def unets(comfyui):
    return {kind: _tiny_unet_patcher(kind) for kind in ("eps", "flow")}


@pytest.mark.parametrize("kind", ["eps", "flow"])
@pytest.mark.parametrize("name", S.SAMPLER_NAMES)
def test_ksampler_metal_equals_comfyui_on_tiny_unet(comfyui, unets, name, kind, monkeypatch):
    monkeypatch.setenv(S.NOISE_ENV, "exact")
    monkeypatch.setenv("COMFY_METAL_BACKEND", "reference")
    dispatch.reset()
    positive, negative = _conds()
    latent = {"samples": torch.zeros(1, 4, 8, 8)}
    scheduler = "karras" if kind == "eps" else "simple"
    node = comfyui.nodes.KSampler()
    (want,) = node.sample(unets[kind], 3, 3, 2.0, name, scheduler, positive, negative, latent)
    (got,) = node.sample(unets[kind], 3, 3, 2.0, f"{name}_metal", scheduler, positive, negative, latent)
    dispatch.reset()
    assert torch.isfinite(want["samples"]).all()
    scale = max(want["samples"].abs().max().item(), 1.0)
    torch.testing.assert_close(got["samples"], want["samples"], atol=1e-5 * scale, rtol=1e-5)
