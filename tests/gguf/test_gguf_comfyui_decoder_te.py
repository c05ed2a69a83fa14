"""llama.cpp-named decoder text encoders (GGUF) end to end inside a real ComfyUI ($COMFYUI_PATH; skipped otherwise).

What ComfyUI-on-Mac users load: HiDream's Llama-3.1-8B and Qwen-Image's Qwen2.5-VL-7B text part as GGUF
files made by llama.cpp's convert_hf_to_gguf.py (llama.cpp tensor names `blk.0.attn_q`, Llama's q/k rows
in llama.cpp's rotary order). Here: ComfyUI's own encoder classes at tiny widths (workflow_models's
`<model>_model_config` entries; Llama-3 keeps its real 128256-token vocabulary and uses the stand-in
Llama-3 tokenizer where the ComfyUI archive lacks the real one), written as llama.cpp writes them
(gguf_models.write_llama_cpp_text_encoder: the gguf package's own name map, llama.cpp's permutation of the Llama
q/k rows, 2-D weights quantised with the gguf package, norms F32). Load Text Encoder (GGUF, Metal) and
CLIPTextEncode run through ComfyUI's executor in one prompt with the oracle: core's CLIPLoader on a
.safetensors of the same weights dequantised by the gguf package, in Hugging Face names and row order.
HiDream's whole set (CLIP-L/G .safetensors + T5 and Llama GGUFs) runs the same way through Load 4 Text
Encoders (GGUF, Metal) against core's QuadrupleCLIPLoader.
The Q8_0 weights are exact in fp16 (see EXACT_TOL), so both loaders hold identical weights: a Llama file
whose q/k rows stayed in llama.cpp's order measures about 0.4 relative here, a Qwen file without its q
biases about 6e-2.
"""
from __future__ import annotations

import importlib

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import gguf_models as gm
import workflow_models as wm

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TEXT = "a photo of a cat on a red sofa"
# ComfyUI runs these encoders in fp16/bf16 on a CPU: core's loader stores the dequantised weights in that dtype.
# The Q8_0 weights are snapped so that every dequantised value is exact there (power-of-two block scales;
# gguf_models.exact_in_half_q8_0): both encoders then hold identical weights and only the order of sums may
# differ. (Unsnapped, the fp16 rounding of core's copy alone moves the output by about 6e-4.)
EXACT_TOL = 1e-4


@pytest.fixture(scope="module")
def ops_mod(comfyui):
    return importlib.import_module(comfyui.pack_module.__name__ + ".nodes.gguf.ops")


def _write_pair(comfyui, stem: str, sd: dict, arch: str, qtype: str, **kwargs) -> tuple[str, str, int]:
    """(the llama.cpp-named .gguf, the oracle .safetensors, quantised tensors) in models/text_encoders;
    kwargs: gguf_models.write_llama_cpp_text_encoder's."""
    folder = comfyui.models_dir("text_encoders")
    gguf_name, deq_name = f"{stem}_{qtype}.gguf", f"{stem}_{qtype}_dequantized.safetensors"
    values, nq = gm.write_llama_cpp_text_encoder(folder / gguf_name, sd, arch, qtype, **kwargs)
    save_file({k: v.contiguous() for k, v in values.items()}, str(folder / deq_name))
    comfyui.refresh_models()
    return gguf_name, deq_name, nq


def _remove(comfyui, *names) -> None:
    for n in names:
        (comfyui.models_dir("text_encoders") / n).unlink(missing_ok=True)


def _conditioning(out) -> tuple[torch.Tensor, dict]:
    out = out[0] if isinstance(out, list) else out
    if not isinstance(out[0][0], torch.Tensor):
        out = out[0]
    return out[0][0], out[0][1]


def _encode_against_core(comfyui, gguf_name: str, deq_name: str, clip_type: str):
    """Load Text Encoder (GGUF, Metal) (node 1) and core's CLIPLoader on the dequantised file (node 3), each
    followed by CLIPTextEncode (nodes 2 and 4), in one prompt through ComfyUI's executor."""
    prompt = {"1": {"class_type": "MetalGGUFTextEncoderLoader",
                    "inputs": {"clip_name": gguf_name, "type": clip_type, "device": "cpu"}},
              "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": TEXT}},
              "3": {"class_type": "CLIPLoader", "inputs": {"clip_name": deq_name, "type": clip_type}},
              "4": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["3", 0], "text": TEXT}}}
    res = comfyui.run_prompt(prompt, execute=["1", "2", "3", "4"])
    clip = res.node_outputs["1"][0]
    clip = clip[0] if isinstance(clip, list) else clip
    return clip, _conditioning(res.node_outputs["2"][0]), _conditioning(res.node_outputs["4"][0])


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    assert a.shape == b.shape and torch.isfinite(a).all(), (a.shape, b.shape)
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def test_llama3_gguf_with_llama_cpp_names_matches_core_cliploader(comfyui, ops_mod, monkeypatch, tmp_path):
    """HiDream's Llama-3.1-8B as a llama.cpp Q8_0 GGUF (arch llama, q/k rows permuted, 2 heads / 1 KV head of
    128): ComfyUI detects it as HiDream's Llama and our encoding matches core's on the dequantised weights.
    A loader that kept llama.cpp's row order would rotate the wrong pairs of q/k features."""
    import comfy.sd

    wm.shrink_text_encoders(monkeypatch, comfy.sd)
    wm.use_llama3_tokenizer_stand_in(monkeypatch, tmp_path / "llama_tokenizer")
    cfg = wm.LLAMA3_8B
    sd = wm.llama3_state_dict()
    # what llama.cpp's converter also writes for Llama-3.1: the LM head (`output`, quantised) and the
    # llama3 rope scaling factors (`rope_freqs`, head_dim / 2 values); a text encoder ignores both
    g = torch.Generator().manual_seed(12)
    sd["lm_head.weight"] = torch.randn(sd["model.embed_tokens.weight"].shape, generator=g) * 0.05
    names = _write_pair(comfyui, "llama31_tiny", sd, "llama", "Q8_0",
                        heads=(cfg["num_attention_heads"], cfg["num_key_value_heads"]), permute_qk=True,
                        exact_in_half=True, extra_tensors={"rope_freqs.weight": np.linspace(1, 8, 64)})
    gguf_name, deq_name, nq = names
    try:
        clip, (a, ea), (b, eb) = _encode_against_core(comfyui, gguf_name, deq_name, "hidream")
    finally:
        _remove(comfyui, gguf_name, deq_name)
    te = clip.cond_stage_model
    assert te.llama is not None and te.clip_l is None and te.t5xxl is None
    layers = dict(ops_mod.gguf_modules(te))
    # every Linear of the two blocks (q, k, v, o, gate, up, down) and the embedding stay Q8_0 (the LM head
    # in the file is not part of the encoder)
    assert len(layers) == nq - 1 == 7 * cfg["num_hidden_layers"] + 1, (len(layers), nq)
    assert {m.gguf_qtype for m in layers.values()} == {"Q8_0"}
    ll_a, ll_b = ea["conditioning_llama3"], eb["conditioning_llama3"]
    # HiDream's conditioning_llama3: the hidden states of every layer, without the start token
    assert ll_a.shape[:2] == (1, cfg["num_hidden_layers"]) and ll_a.shape[-1] == cfg["hidden_size"]
    rel = _rel(ll_a, ll_b)
    print(f"llama-3 Q8_0 GGUF (llama.cpp names, permuted q/k) vs CLIPLoader(dequantised): rel {rel:.2e}")
    assert rel < EXACT_TOL, rel


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_qwen25_vl_gguf_with_llama_cpp_names_matches_core_cliploader(comfyui, ops_mod, monkeypatch, qtype):
    """Qwen-Image's Qwen2.5-VL-7B text part as a llama.cpp GGUF (arch qwen2vl: llama.cpp keeps Hugging Face's
    q/k row order; q/k/v biases F32): ComfyUI detects it as Qwen2.5-VL-7B (type qwen_image) and our encoding
    matches core's on the dequantised weights. Q8_0 at width 32 (weights exact in fp16, ComfyUI's text
    encoder dtype on a CPU); Q4_K at width 256 (rows of whole 256-value blocks), whose dequantised values are
    not exact in fp16: both encoders run in fp32 (ComfyUI's own --fp32-text-enc)."""
    import comfy.model_management
    import comfy.sd

    cfg = wm.QWEN25_7B if qtype == "Q8_0" else wm.QWEN25_7B_256
    wm.shrink_text_encoders(monkeypatch, comfy.sd, qwen25_7b=cfg)
    if qtype == "Q4_K":
        monkeypatch.setattr(comfy.model_management.args, "fp32_text_enc", True)
    gguf_name, deq_name, nq = _write_pair(comfyui, "qwen25vl_tiny", wm.qwen25_7b_text_state_dict(cfg=cfg),
                                          "qwen2vl", qtype,
                                          heads=(cfg["num_attention_heads"], cfg["num_key_value_heads"]),
                                          exact_in_half=qtype == "Q8_0")
    try:
        clip, (a, _), (b, _) = _encode_against_core(comfyui, gguf_name, deq_name, "qwen_image")
    finally:
        _remove(comfyui, gguf_name, deq_name)
    te = clip.cond_stage_model
    assert type(te).__name__ == "QwenImageTEModel_"
    layers = dict(ops_mod.gguf_modules(te))
    assert len(layers) == nq == 7 * cfg["num_hidden_layers"] + 1, (len(layers), nq)
    assert {m.gguf_qtype for m in layers.values()} == {qtype}
    assert a.shape[0] == 1 and a.shape[-1] == cfg["hidden_size"]
    if qtype == "Q4_K":
        assert te.qwen25_7b.transformer.dtype == torch.float32
    rel = _rel(a, b)
    print(f"qwen2.5-vl {qtype} GGUF (llama.cpp names) vs CLIPLoader(dequantised): rel {rel:.2e}")
    assert rel < EXACT_TOL, rel


def test_hidream_quadruple_with_gguf_t5_and_llama_matches_core_quadrupleclip_loader(comfyui, ops_mod, monkeypatch,
                                                                                     tmp_path):
    """HiDream's set as GGUF users load it: CLIP-L and CLIP-G .safetensors (bf16), T5-XXL and Llama-3.1-8B as
    llama.cpp-named Q8_0 GGUFs (arch t5encoder / llama, the Llama's q/k rows permuted). Load 4 Text Encoders
    (GGUF, Metal) sends each file to its encoder; the T5 conditioning, the Llama's conditioning_llama3 and the
    pooled output match core's QuadrupleCLIPLoader on the dequantised files."""
    import comfy.sd

    wm.shrink_text_encoders(monkeypatch, comfy.sd, clip_g=True, t5xxl=wm.T5XXL_24)
    wm.use_llama3_tokenizer_stand_in(monkeypatch, tmp_path / "llama_tokenizer")
    folder = comfyui.models_dir("text_encoders")
    clip_files = []
    for role, sd in (("clip_l", wm.clip_l_state_dict(over=wm.CLIP_LG)), ("clip_g", wm.clip_g_state_dict())):
        name = f"hidream_gguf_set_{role}_bf16.safetensors"
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in sd.items()}, str(folder / name))
        clip_files.append(name)
    cfg = wm.LLAMA3_8B
    t5 = _write_pair(comfyui, "hidream_gguf_set_t5xxl", wm.t5_state_dict("t5_config_xxl.json", wm.T5XXL_24),
                     "t5encoder", "Q8_0", exact_in_half=True)
    llama = _write_pair(comfyui, "hidream_gguf_set_llama", wm.llama3_state_dict(), "llama", "Q8_0",
                        heads=(cfg["num_attention_heads"], cfg["num_key_value_heads"]), permute_qk=True,
                        exact_in_half=True)
    ours = dict(zip(("clip_name1", "clip_name2", "clip_name3", "clip_name4"), clip_files + [t5[0], llama[0]]))
    core = dict(zip(("clip_name1", "clip_name2", "clip_name3", "clip_name4"), clip_files + [t5[1], llama[1]]))
    prompt = {"1": {"class_type": "MetalGGUFQuadrupleTextEncoderLoader", "inputs": {**ours, "device": "cpu"}},
              "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": TEXT}},
              "3": {"class_type": "QuadrupleCLIPLoader", "inputs": core},
              "4": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["3", 0], "text": TEXT}}}
    try:
        res = comfyui.run_prompt(prompt, execute=["1", "2", "3", "4"])
    finally:
        _remove(comfyui, *clip_files, *t5[:2], *llama[:2])
    clip = res.node_outputs["1"][0]
    te = (clip[0] if isinstance(clip, list) else clip).cond_stage_model
    assert None not in (te.clip_l, te.clip_g, te.t5xxl, te.llama)
    # the GGUF files' quantised tensors stay Q8_0 in their encoders (the CLIP files have none)
    for encoder, (_, _, nq) in ((te.t5xxl, t5), (te.llama, llama)):
        layers = dict(ops_mod.gguf_modules(encoder))
        assert len(layers) == nq and {m.gguf_qtype for m in layers.values()} == {"Q8_0"}, (len(layers), nq)
    assert not dict(ops_mod.gguf_modules(te.clip_l)) and not dict(ops_mod.gguf_modules(te.clip_g))
    (a, ea), (b, eb) = _conditioning(res.node_outputs["2"][0]), _conditioning(res.node_outputs["4"][0])
    assert a.shape == (1, 128, wm.T5XXL_24["d_model"]), a.shape
    assert ea["conditioning_llama3"].shape[:2] == (1, cfg["num_hidden_layers"])
    rel, rell = _rel(a, b), _rel(ea["conditioning_llama3"], eb["conditioning_llama3"])
    relp = _rel(ea["pooled_output"], eb["pooled_output"])
    print(f"hidream quad, T5 + Llama Q8_0 GGUFs (llama.cpp names) vs QuadrupleCLIPLoader(dequantised): "
          f"T5 cond rel {rel:.2e}, llama rel {rell:.2e}, pooled rel {relp:.2e}")
    assert rel < EXACT_TOL and rell < EXACT_TOL and relp < EXACT_TOL


def test_qwen3_gguf_with_llama_cpp_names_matches_core_cliploader(comfyui, ops_mod, monkeypatch):
    """Qwen3 (Anima's Qwen3-0.6B; Z-Image's Qwen3-4B has the same tensors) as a llama.cpp Q8_0 GGUF (arch
    qwen3: Hugging Face's q/k row order, per-head q/k norms `attn_q_norm` / `attn_k_norm` F32): ComfyUI
    detects it as Qwen3-0.6B and our encoding matches core's on the dequantised weights."""
    import comfy.sd

    wm.shrink_text_encoders(monkeypatch, comfy.sd)
    cfg = wm.QWEN3_06B
    sd = wm.qwen3_06b_state_dict()
    assert "model.layers.0.self_attn.q_norm.weight" in sd
    gguf_name, deq_name, nq = _write_pair(comfyui, "qwen3_06b_tiny", sd, "qwen3", "Q8_0",
                                          heads=(cfg["num_attention_heads"], cfg["num_key_value_heads"]),
                                          exact_in_half=True)
    try:
        clip, (a, _), (b, _) = _encode_against_core(comfyui, gguf_name, deq_name, "stable_diffusion")
    finally:
        _remove(comfyui, gguf_name, deq_name)
    te = clip.cond_stage_model
    assert type(te).__name__ == "AnimaTEModel_"
    layers = dict(ops_mod.gguf_modules(te))
    assert len(layers) == nq == 7 * cfg["num_hidden_layers"] + 1, (len(layers), nq)
    assert {m.gguf_qtype for m in layers.values()} == {"Q8_0"}
    assert a.shape[0] == 1 and a.shape[-1] == cfg["hidden_size"]
    rel = _rel(a, b)
    print(f"qwen3 Q8_0 GGUF (llama.cpp names, q/k norms) vs CLIPLoader(dequantised): rel {rel:.2e}")
    assert rel < EXACT_TOL, rel
