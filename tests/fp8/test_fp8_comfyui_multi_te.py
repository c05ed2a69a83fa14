"""Load 2 / 3 / 4 Text Encoders (FP8, Metal) inside a real ComfyUI ($COMFYUI_PATH; skipped otherwise).

Flux's pair on tiny random encoders of the real architectures (ComfyUI's CLIP-L and T5-XXL classes with small
configs, as the workflow tests build them): CLIP-L as a bf16 file and T5 as a Comfy-Org "fp8_scaled" file
(a mixed set), loaded through MetalFP8DualTextEncoderLoader in ComfyUI's executor and encoded by
CLIPTextEncode; the oracle is ComfyUI's own DualCLIPLoader on the same weights with the T5 dequantized.
The nodes' inputs are ComfyUI's Dual/Triple/QuadrupleCLIPLoader's.
"""
from __future__ import annotations

import pytest
import torch

import fp8_models as fm
import workflow_models as wm

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture
def flux_pair(comfyui, loader_mod, monkeypatch):
    """(clip_l bf16, t5 fp8_scaled, t5 dequantized fp32) file names in models/text_encoders, tiny configs on."""
    import comfy.sd
    from safetensors.torch import save_file

    wm.shrink_text_encoders(monkeypatch, comfy.sd)
    folder = comfyui.models_dir("text_encoders")
    names = ("fp8multi_clip_l_bf16.safetensors", "fp8multi_t5xxl_fp8.safetensors",
             "fp8multi_t5xxl_deq_fp32.safetensors")
    clip_sd = {k: v.to(torch.bfloat16).contiguous() for k, v in wm.clip_l_state_dict().items()}
    save_file(clip_sd, str(folder / names[0]))
    wm.write_scaled_fp8(folder / names[1], wm.t5_state_dict("t5_config_xxl.json", wm.T5XXL))
    fmt_mod = fm.pack_module(loader_mod, "nodes.fp8.formats")
    deq = {k: v.contiguous() for k, v in fm.dequantized_file(fmt_mod, folder / names[1]).items()}   # fp32
    save_file(deq, str(folder / names[2]))
    comfyui.refresh_models()
    yield names
    for n in names:
        (folder / n).unlink(missing_ok=True)


def _cond(out):
    out = out[0] if isinstance(out, list) else out
    if not isinstance(out[0][0], torch.Tensor):
        out = out[0]
    return out[0][0].float(), out[0][1]["pooled_output"].float()


def test_dual_matches_core_dualcliploader_through_the_executor(comfyui, loader_mod, flux_pair):
    clip_l, t5_fp8, t5_deq = flux_pair
    text = "a photo of a cat on a red sofa"
    prompt = {"1": {"class_type": "MetalFP8DualTextEncoderLoader",
                    "inputs": {"clip_name1": clip_l, "clip_name2": t5_fp8, "type": "flux", "device": "cpu"}},
              "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": text}}}
    status = fm.pack_module(loader_mod, "nodes.status")
    _, start = status.records_since(0)
    res = comfyui.run_prompt(prompt, execute=["1", "2"])
    recs, _ = status.records_since(start)
    assert [(r["node_id"], r["backend"]) for r in recs if r["node_class"] == "MetalFP8DualTextEncoderLoader"] \
        == [("1", "none")], recs
    # the CLIPTextEncode badge: the FP8 kernels of the T5 ran inside the core node
    enc = [r for r in recs if r["node_id"] == "2"]
    assert len(enc) == 1 and enc[0]["kernels"] and set(enc[0]["kernels"]) <= {"fp8_decode", "gemv"}, enc
    ours = res.node_outputs["1"][0]
    ours = ours[0] if isinstance(ours, list) else ours
    ops_mod = fm.pack_module(loader_mod, "nodes.fp8.ops")
    assert sum(1 for _ in ops_mod.fp8_modules(ours.cond_stage_model)) >= 8    # the T5's Linear layers
    assert ops_mod.weight_bytes(ours.cond_stage_model)["bytes_per_fp8_weight"] < 1.01
    a, pa = _cond(res.node_outputs["2"][0])
    (stock,) = comfyui.nodes.DualCLIPLoader().load_clip(clip_l, t5_deq, "flux", "cpu")
    b, pb = _cond(comfyui.nodes.CLIPTextEncode().encode(stock, text))
    assert a.shape == b.shape and torch.isfinite(a).all()
    rel = ((a - b).norm() / b.norm()).item()
    relp = ((pa - pb).norm() / pb.norm()).item()
    print(f"flux pair fp8 ours vs DualCLIPLoader(dequantized): cond rel {rel:.2e}, pooled rel {relp:.2e}")
    # both compute in ComfyUI's text-encoder dtype (fp16 on CPU): the only difference is rounding
    assert rel < 1e-2 and relp < 1e-2


def test_inputs_are_cores_and_type_list_is_read_from_comfyui(comfyui):
    for ours, core, n in (("MetalFP8DualTextEncoderLoader", "DualCLIPLoader", 2),
                          ("MetalFP8TripleTextEncoderLoader", "TripleCLIPLoader", 3),
                          ("MetalFP8QuadrupleTextEncoderLoader", "QuadrupleCLIPLoader", 4)):
        mine = comfyui.object_info(ours)[ours]["input"]["required"]
        theirs = comfyui.object_info(core)[core]["input"]["required"]
        names = [f"clip_name{i}" for i in range(1, n + 1)]
        assert set(names) <= set(mine) and set(names) <= set(theirs)
        assert mine["device"][0] == ["gpu", "cpu"]
        if "type" in theirs:
            assert mine["type"][0] == theirs["type"][0]
        else:
            assert "type" not in mine


def test_a_bad_file_names_the_file(comfyui, loader_mod, flux_pair):
    clip_l, _, _ = flux_pair
    folder = comfyui.models_dir("text_encoders")
    bad = folder / "fp8multi_broken.safetensors"
    bad.write_bytes(b"not a safetensors file at all")
    comfyui.refresh_models()
    node = fm.pack_module(loader_mod, "nodes.fp8.nodes").MetalFP8DualTextEncoderLoader()
    try:
        with pytest.raises(Exception, match="fp8multi_broken"):
            node.load(clip_name1=clip_l, clip_name2=bad.name, type="flux", device="cpu")
    finally:
        bad.unlink()
