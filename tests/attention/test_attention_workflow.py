"""Tiny Flux and tiny Wan (ComfyUI's own model classes, random weights) through ComfyUI's KSampler with
the Metal Attention node, the kernel running in the MSL emulator (COMFY_METAL_BACKEND=emulator),
against the stock run of the same model ($COMFYUI_PATH; skipped with the reason otherwise)."""
from __future__ import annotations

import importlib

import pytest
import torch
from safetensors.torch import save_file

import workflow_models as wm

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def pack(comfyui):
    name = comfyui.pack_module.__name__
    return (importlib.import_module(name + ".nodes.attention.comfy_attention"),
            importlib.import_module(name + ".metal_kernels"))


def _unet(comfyui, name, sd, metadata=None):
    path = comfyui.models_dir("diffusion_models") / name
    save_file({k: v.contiguous() for k, v in sd.items()}, str(path), metadata=metadata)
    comfyui.refresh_models()
    (model,) = comfyui.nodes.UNETLoader().load_unet(name, "default")
    return model


def _sample(comfyui, model, latent, context_dim, extra=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    pos = [[torch.randn(1, 7, context_dim, generator=g), dict(extra or {})]]
    neg = [[torch.randn(1, 7, context_dim, generator=g), dict(extra or {})]]
    (out,) = comfyui.nodes.KSampler().sample(model, 5, 3, 2.5, "euler", "simple", pos, neg, {"samples": latent})
    return out["samples"].float()


def _with_metal_attention(comfyui, pack, model, monkeypatch):
    from comfy_metal.metal_kernels import emulator

    if not emulator.available():
        pytest.skip("clang-19 not found: the MSL emulator cannot run")
    ca, kernels = pack
    node = comfyui.nodes.NODE_CLASS_MAPPINGS["MetalAttention"]()
    (patched,) = node.patch(model, "auto")
    monkeypatch.setenv("COMFY_METAL_BACKEND", "emulator")
    kernels.dispatch.reset()
    calls = {"n": 0}
    real = ca.attention_kernels.flash_attention

    def counting(*a, **k):
        calls["n"] += 1
        return real(*a, **k)

    monkeypatch.setattr(ca.attention_kernels, "flash_attention", counting)
    return patched, calls


@pytest.mark.parametrize("arch", ["flux", "wan"])
def test_tiny_model_with_metal_attention_matches_stock(comfyui, pack, monkeypatch, arch):
    if arch == "flux":
        model = _unet(comfyui, "tiny_attention_flux.safetensors", wm.flux_state_dict(seed=11))
        latent = torch.zeros(1, 16, 8, 8)
        ctx, extra = wm.FLUX_CFG["context_in_dim"], {"pooled_output": torch.randn(1, wm.FLUX_CFG["vec_in_dim"],
                                                                                  generator=torch.Generator().manual_seed(1))}
    else:
        model = _unet(comfyui, "tiny_attention_wan.safetensors", wm.wan_state_dict(seed=12), wm.wan_metadata())
        latent = torch.zeros(1, 16, 2, 8, 8)
        ctx, extra = wm.WAN_CFG["text_dim"], {}
    stock = _sample(comfyui, model, latent, ctx, extra)
    patched, calls = _with_metal_attention(comfyui, pack, model, monkeypatch)
    try:
        ours = _sample(comfyui, patched, latent, ctx, extra)
        backend = pack[1].dispatch.last_backend.get("flash_attention")
    finally:
        monkeypatch.delenv("COMFY_METAL_BACKEND")
        pack[1].dispatch.reset()
    assert calls["n"] > 0, "the patched model never called the pack's attention"
    assert backend == "emulator"
    assert torch.isfinite(ours).all()
    rel = ((ours - stock).norm() / stock.norm()).item()
    print(f"{arch}: Metal Attention (emulated) vs stock: rel {rel:.2e}, {calls['n']} attention calls")
    assert rel < 1e-4, rel
    # the input model is untouched: sampling it again gives the stock result without the pack
    n = calls["n"]
    again = _sample(comfyui, model, latent, ctx, extra)
    assert calls["n"] == n and torch.equal(again, stock)


def test_fp8_loader_attention_option(comfyui, pack):
    """The FP8 loader's `attention` option: metal_flash patches the model, auto patches only on MPS
    (this is a CPU run: no patch), comfy default never patches."""
    loader_mod = importlib.import_module(comfyui.pack_module.__name__ + ".nodes.fp8.nodes")
    name = "tiny_attention_flux_loader.safetensors"
    save_file({k: v.contiguous() for k, v in wm.flux_state_dict(seed=13).items()},
              str(comfyui.models_dir("diffusion_models") / name))
    comfyui.refresh_models()
    loader = loader_mod.MetalFP8ModelLoader()

    def override(option):
        (model,) = loader.load(name, "auto", "fp32", attention=option)
        return model.model_options.get("transformer_options", {}).get("optimized_attention_override")

    patched = override("metal_flash")
    assert patched is not None
    q, k, v = (torch.randn(1, 5, 16) for _ in range(3))
    before = dict(pack[1].dispatch.last_backend)
    pack[1].dispatch.last_backend.pop("flash_attention", None)
    try:
        patched(None, q, k, v, 2)
        assert pack[1].dispatch.last_backend.get("flash_attention") == "reference"   # asked for: runs on CPU
    finally:
        pack[1].dispatch.last_backend.clear()
        pack[1].dispatch.last_backend.update(before)
    assert override("auto") is None
    assert override("comfy default") is None
    with pytest.raises(ValueError, match="attention must be one of"):
        loader.load(name, "auto", "fp32", attention="flash")
    spec = comfyui.object_info()["MetalFP8ModelLoader"]["input"]["optional"]["attention"]
    assert spec[0] == ["auto", "metal_flash", "comfy default"] and spec[1]["tooltip"]
