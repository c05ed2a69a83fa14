"""FP8 text encoder loading inside a real ComfyUI ($COMFYUI_PATH; skipped with the reason printed otherwise).

A random full-size CLIP-L text encoder (ComfyUI's own CLIPTextModel; its tokenizer ships with
ComfyUI) is quantized to an FP8 comfy_quant file and loaded through MetalFP8TextEncoderLoader;
CLIPTextEncode output is compared with ComfyUI's stock CLIPLoader on the same FP8 weights
dequantized.
"""
from __future__ import annotations

import os

import pytest
import torch

import fp8_models as fm

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def clip_l_file(comfyui, loader_mod):
    """A random full-size CLIP-L text encoder (its tokenizer ships with ComfyUI), quantized to FP8."""
    import comfy.clip_model
    import comfy.ops
    from safetensors.torch import save_file

    quant = fm.pack_module(loader_mod, "nodes.fp8.quantize")
    import json

    import comfy.sd1_clip

    cfg_path = os.path.join(os.path.dirname(comfy.sd1_clip.__file__), "sd1_clip_config.json")
    with open(cfg_path) as f:
        config = json.load(f)
    net = comfy.clip_model.CLIPTextModel(config, torch.float32, "cpu", comfy.ops.manual_cast)
    fm.fill_module_(net, seed=5, std=0.02)
    sd = {k: v.to(torch.float16).contiguous() for k, v in net.state_dict().items()}
    del net
    folder = comfyui.models_dir("text_encoders")
    src = folder / "tiny_clip_l_fp16.safetensors"
    save_file(sd, str(src))
    del sd
    dst = folder / "clip_l_fp8.safetensors"
    if dst.exists():
        dst.unlink()
    summary = quant.quantize_file(str(src), str(dst), "e4m3fn")
    src.unlink()
    comfyui.refresh_models()
    assert len(summary.errors) >= 48
    return dst.name


def test_text_encoder_matches_stock(comfyui, loader_mod, clip_l_file):
    """Oracle: ComfyUI's stock CLIPLoader on the same FP8 weights dequantized to fp32 (ComfyUI 0.33's
    CLIP-L path does not read comfy_quant scales itself, so it cannot load the FP8 file correctly)."""
    from safetensors.torch import save_file

    folder = comfyui.models_dir("text_encoders")
    # fp16 like ComfyUI's CPU text-encoder dtype: loading fp32 would round to the same fp16 values.
    fmt_mod = fm.pack_module(loader_mod, "nodes.fp8.formats")
    deq = {k: v.to(torch.float16) for k, v in fm.dequantized_file(fmt_mod, folder / clip_l_file).items()}
    save_file(deq, str(folder / "clip_l_dequantized.safetensors"))
    del deq
    comfyui.refresh_models()
    text = "a photo of a cat on a red sofa"
    # Ours through ComfyUI's executor: Load Text Encoder (FP8, Metal) -> CLIPTextEncode.
    prompt = {"1": {"class_type": "MetalFP8TextEncoderLoader",
                    "inputs": {"clip_name": clip_l_file, "type": "stable_diffusion", "device": "cpu"}},
              "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": text}}}
    status = fm.pack_module(loader_mod, "nodes.status")
    _, start = status.records_since(0)
    res = comfyui.run_prompt(prompt, execute=["1", "2"])
    recs, _ = status.records_since(start)       # the loader node's badge record, by its node id
    assert [(r["node_id"], r["backend"]) for r in recs if r["node_class"] == "MetalFP8TextEncoderLoader"] \
        == [("1", "none")], recs
    # CLIPTextEncode (a core node) ran the FP8 encoder: the forward hooks the loader put on it record
    # its FP8 kernels, with their backend, for node "2" (the reference on this CPU run).
    enc = [r for r in recs if r["node_id"] == "2"]
    assert len(enc) == 1 and enc[0]["node_class"] is None, recs
    assert enc[0]["kernels"] and set(enc[0]["kernels"]) <= {"fp8_decode", "gemv"}, enc
    assert all(k["backend"] == "reference" for k in enc[0]["kernels"].values()), enc
    assert enc[0]["backend"] == "reference" and status.node_backends["2"] is enc[0]
    ours, ca = res.node_outputs["1"][0], res.node_outputs["2"][0]
    ours = ours[0] if isinstance(ours, list) else ours          # the output cache keeps a list per slot
    if not isinstance(ca[0][0], torch.Tensor):                  # conditioning = [[cond, {pooled_output}]]
        ca = ca[0]
    (stock,) = comfyui.nodes.CLIPLoader().load_clip("clip_l_dequantized.safetensors", "stable_diffusion", "cpu")
    ops_mod = fm.pack_module(loader_mod, "nodes.fp8.ops")
    n = sum(1 for _ in ops_mod.fp8_modules(ours.cond_stage_model))
    assert n >= 48
    info = ops_mod.weight_bytes(ours.cond_stage_model)
    assert info["bytes_per_fp8_weight"] < 1.01
    (cb,) = comfyui.nodes.CLIPTextEncode().encode(stock, text)
    a, b = ca[0][0].float(), cb[0][0].float()
    pa, pb = ca[0][1]["pooled_output"].float(), cb[0][1]["pooled_output"].float()
    rel = ((a - b).norm() / b.norm()).item()
    relp = ((pa - pb).norm() / pb.norm()).item()
    print(f"clip-l fp8 ours vs stock(dequantized): cond rel {rel:.2e}, pooled rel {relp:.2e}")
    assert torch.isfinite(a).all() and a.shape == b.shape
    # Both compute in ComfyUI's text-encoder dtype (fp16 on CPU): the only difference is rounding.
    assert rel < 1e-2 and relp < 1e-2
