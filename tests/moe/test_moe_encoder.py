"""MoE encoder nodes: loader -> CLIP -> CLIPTextEncode-style encode, prompt enhancer; against transformers;
the whole node in the MSL emulator; through a real ComfyUI when COMFYUI_PATH is set."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("tokenizers")

import moe_testutil  # noqa: E402
from comfy_metal.metal_kernels import dispatch  # noqa: E402
from comfy_metal.nodes.moe import encoder as moe_clip, nodes as moe_encoder, qwen3 as qwen3_moe  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3moe_enc")
    hf = moe_testutil.make_qwen3_moe(folder, seed=1)
    return folder, hf


def _hf_hidden(hf, ids):
    outs = []
    hooks = [l.register_forward_hook(lambda m, i, o: outs.append(o[0] if isinstance(o, tuple) else o))
             for l in hf.model.layers]
    try:
        with torch.no_grad():
            final = hf.model(ids).last_hidden_state
    finally:
        for h in hooks:
            h.remove()
    return outs, final


def test_loader_clip_encode_matches_transformers(tiny):
    folder, hf = tiny
    (clip,) = moe_encoder.MetalMoETextEncoderLoader().load("", device="cpu", dtype="fp32", layer=-1, path=str(folder))
    tokens = clip.tokenize("a red cat on the mat")
    ids = torch.tensor([[t for t, _ in tokens["qwen3moe"][0]]])
    assert ids.shape[1] == 6
    cond = clip.encode_from_tokens_scheduled(tokens)
    assert isinstance(cond, list) and len(cond) == 1 and cond[0][1]["pooled_output"] is None
    layer_outs, final = _hf_hidden(hf, ids)
    assert (cond[0][0] - final).abs().max().item() < 1e-4
    clip.clip_layer(-2)          # what CLIPSetLastLayer does: output of layer L-2
    c2 = clip.encode_from_tokens(tokens)
    assert (c2 - layer_outs[-2]).abs().max().item() < 1e-4
    (clip0,) = moe_encoder.MetalMoETextEncoderLoader().load("", device="cpu", dtype="fp32", layer=0, path=str(folder))
    assert (clip0.encode(["a red cat"][0]) - _hf_hidden(hf, ids[:, :3])[0][0]).abs().max().item() < 1e-4


def test_chat_template_and_prompt_enhancer_match_transformers_greedy(tiny):
    folder, hf = tiny
    (clip,) = moe_encoder.MetalMoETextEncoderLoader().load("", device="cpu", dtype="fp32", template="chat",
                                                            system_prompt="describe the image", path=str(folder))
    toks = clip.tokenize("a cat")["qwen3moe"][0]
    tok = clip.tokenizer.tokenizer
    assert [t for t, _ in toks][:2] == [tok.token_id("<|im_start|>"), tok.token_id("system")]
    assert [t for t, _ in toks][-2:] == [tok.token_id("<|im_start|>"), tok.token_id("assistant")]
    (text,) = moe_encoder.MetalPromptEnhancer().enhance(clip, "a cat", "describe the image", max_new_tokens=20,
                                                        temperature=0.0, top_p=1.0, seed=0)
    ids = torch.tensor([tok.encode(tok.apply_chat_template("a cat", "describe the image"))])
    with torch.no_grad():
        want = hf.generate(ids, max_new_tokens=20, do_sample=False, eos_token_id=tok.eos_ids(),
                           pad_token_id=0)[0, ids.shape[1]:].tolist()
    want = [t for t in want if t not in tok.eos_ids()]
    assert text == tok.decode(want, skip_special_tokens=True).strip()
    assert text
    (sampled,) = moe_encoder.MetalPromptEnhancer().enhance(clip, "a cat", "", 12, 1.0, 0.9, 5)
    moe_encoder.ENHANCED.clear()                      # the same seed samples the same text, not a cache hit
    (again,) = moe_encoder.MetalPromptEnhancer().enhance(clip, "a cat", "", 12, 1.0, 0.9, 5)
    assert sampled == again


def test_prompt_enhancer_reuses_text_for_same_model_prompt_and_settings(tiny, monkeypatch):
    """Greedy: a new seed (or top_p) gives the cached text without generating; a new prompt, token budget,
    temperature > 0 with a new seed, or another model object generates. The seed widget defaults to
    "fixed" (ComfyUI's control_after_generate), so ComfyUI's own cache is not defeated either."""
    folder, _ = tiny
    (clip,) = moe_encoder.MetalMoETextEncoderLoader().load("", device="cpu", dtype="fp32", path=str(folder))
    lm, _ = moe_clip.underlying_moe(clip)
    calls = []
    real = type(lm).generate
    monkeypatch.setattr(type(lm), "generate", lambda self, *a, **k: calls.append(k.get("seed")) or real(self, *a, **k))
    moe_encoder.ENHANCED.clear()
    node = moe_encoder.MetalPromptEnhancer()
    (first,) = node.enhance(clip, "a dog", "", 6, 0.0, 0.9, 1)
    assert node.enhance(clip, "a dog", "", 6, 0.0, 0.5, 12345) == (first,) and len(calls) == 1
    node.enhance(clip, "a dog", "", 7, 0.0, 0.9, 1)               # another budget
    node.enhance(clip, "a dog!", "", 6, 0.0, 0.9, 1)              # another prompt
    assert len(calls) == 3
    node.enhance(clip, "a dog", "", 6, 1.0, 0.9, 1)
    node.enhance(clip, "a dog", "", 6, 1.0, 0.9, 1)               # sampled, same seed: cached
    node.enhance(clip, "a dog", "", 6, 1.0, 0.9, 2)               # sampled, new seed: generated
    assert calls[3:] == [1, 2]
    (clip2,) = moe_encoder.MetalMoETextEncoderLoader().load("", device="cpu", dtype="fp32", path=str(folder))
    assert node.enhance(clip2, "a dog", "", 6, 0.0, 0.9, 1) == (first,) and len(calls) == 6   # a new model runs
    seed_spec = moe_encoder.MetalPromptEnhancer.INPUT_TYPES()["required"]["seed"][1]
    assert seed_spec["control_after_generate"] == "fixed"


def test_encode_and_enhancer_record_their_kernel_backends(tiny):
    """Node badges: an encode (inside CLIPTextEncode: node_class None, the executing node's id) and the
    prompt enhancer each leave a status record listing the MoE kernels that ran, with their backend; a
    kernel that did not run keeps its last backend and is not listed."""
    from comfy_metal.nodes import status

    folder, _ = tiny
    (clip,) = moe_encoder.MetalMoETextEncoderLoader().load("", device="cpu", dtype="fp32", path=str(folder))
    status.clear_records()
    dispatch.last_backend["moe_grouped_gemm"] = "metal"          # from an earlier node, say
    clip.encode_from_tokens_scheduled(clip.tokenize("a red cat on the mat"))
    records, index = status.records_since(0)
    assert len(records) == 1 and index == 1, records
    rec = records[0]
    assert rec["node_class"] is None and rec["node_id"] is None          # no ComfyUI executor here
    assert "moe_route" in rec["kernels"] and "moe_grouped_gemm" not in rec["kernels"], rec["kernels"]
    assert set(rec["kernels"]) <= set(moe_clip.MOE_NODE_KERNELS)
    assert rec["kernels"]["moe_route"]["backend"] == dispatch.last_backend["moe_route"]
    assert rec["backend"] in ("reference", "emulator", "metal")
    assert dispatch.last_backend["moe_grouped_gemm"] == "metal"        # put back: it did not run
    moe_encoder.MetalPromptEnhancer().enhance(clip, "a cat", "", 2, 0.0, 1.0, 0)
    records, _ = status.records_since(index)
    assert [r["node_class"] for r in records] == ["MetalPromptEnhancer"]
    assert "moe_route" in records[0]["kernels"]
    dispatch.last_backend.pop("moe_grouped_gemm", None)
    status.clear_records()


def test_loader_errors_are_clear(tiny, tmp_path):
    folder, _ = tiny
    node = moe_encoder.MetalMoETextEncoderLoader()
    with pytest.raises(qwen3_moe.ModelLoadError, match="no such file"):
        node.load("", device="cpu", path=str(tmp_path / "nope"))
    with pytest.raises(ValueError, match="layer 7 is out of range"):
        node.load("", device="cpu", layer=7, path=str(folder))
    with pytest.raises(ValueError, match="needs a CLIP from the MetalMoETextEncoderLoader"):
        moe_encoder.MetalPromptEnhancer().enhance(object(), "x")


def test_loader_and_encode_node_in_emulator(tiny, monkeypatch):
    """The loader + encode with COMFY_METAL_BACKEND=emulator: the real MSL router and experts kernels
    run through the real launch glue, and the conditioning matches the reference backend."""
    from comfy_metal.metal_kernels import emulator

    if not emulator.available():
        pytest.skip("the MSL emulator needs clang-19, which is not installed")
    folder, _ = tiny
    node = moe_encoder.MetalMoETextEncoderLoader()
    (clip,) = node.load("", device="cpu", dtype="fp32", path=str(folder))
    tokens = clip.tokenize("a big dog under the blue sky")
    want = clip.encode_from_tokens(tokens)
    monkeypatch.setenv("COMFY_METAL_BACKEND", "emulator")
    dispatch.reset()
    try:
        (clip_e,) = node.load("", device="cpu", dtype="fp32", path=str(folder))
        got = clip_e.encode_from_tokens_scheduled(clip_e.tokenize("a big dog under the blue sky"))[0][0]
        assert dispatch.last_backend["moe_route"] == "emulator"
        assert dispatch.last_backend["moe_experts_gemm"] == "emulator"
        assert dispatch.last_backend["gemv"] == "emulator"   # dense layers of <= 8 rows (7 tokens)
        from comfy_metal.nodes import status

        (rec,) = [r for r in status.records_since(0)[0] if r["node_class"] is None][-1:]
        assert rec["backend"] == "emulator", rec
        assert {"moe_route", "moe_experts_gemm", "gemv"} <= set(rec["kernels"])
        (text,) = moe_encoder.MetalPromptEnhancer().enhance(clip_e, "a cat", "", 3, 0.0, 1.0, 0)
    finally:
        dispatch.reset()
    assert (got - want).abs().max().item() < 1e-4
    (text_ref,) = moe_encoder.MetalPromptEnhancer().enhance(clip, "a cat", "", 3, 0.0, 1.0, 0)
    assert text == text_ref


def test_nodes_in_comfyui(comfyui, tiny):
    folder, hf = tiny
    assert {"MetalMoETextEncoderLoader", "MetalPromptEnhancer", "MetalMoEExpertsPatch"} <= set(comfyui.pack_node_names)
    prompt = {
        "1": {"class_type": "MetalMoETextEncoderLoader",
              "inputs": {"model": "x", "device": "gpu", "dtype": "fp32", "layer": -1, "template": "raw",
                         "system_prompt": "", "path": str(folder)}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a red cat on the mat", "clip": ["1", 0]}},
        "3": {"class_type": "MetalPromptEnhancer",
              "inputs": {"clip": ["1", 0], "prompt": "a cat", "system_prompt": "", "max_new_tokens": 6,
                         "temperature": 0.0, "top_p": 1.0, "seed": 0}},
    }
    # "model" is a combo: give it a value from the list ComfyUI validates against
    info = comfyui.object_info("MetalMoETextEncoderLoader")["MetalMoETextEncoderLoader"]
    prompt["1"]["inputs"]["model"] = info["input"]["required"]["model"][0][0]
    import importlib

    status = importlib.import_module(comfyui.pack_module.__name__ + ".nodes.status")
    _, start = status.records_since(0)
    res = comfyui.run_prompt(prompt, execute=["2", "3"])
    records, _ = status.records_since(start)
    # the encode ran inside the core CLIPTextEncode node: its record carries that node's id
    by_node = {(r["node_id"], r["node_class"]): r for r in records}
    assert ("2", None) in by_node and ("3", "MetalPromptEnhancer") in by_node, list(by_node)
    assert "moe_route" in by_node[("2", None)]["kernels"]
    cond = res.node_outputs["2"][0]
    while isinstance(cond, list) and len(cond) == 1:   # output cache: [outputs][batch] -> CONDITIONING
        cond = cond[0]
    ids = torch.tensor([qwen3_moe.Tokenizer((folder / "tokenizer.json").read_text()).encode("a red cat on the mat")])
    _, final = _hf_hidden(hf, ids)
    assert isinstance(cond[0], torch.Tensor), type(cond)
    clip = res.node_outputs["1"][0]
    clip = clip[0] if isinstance(clip, list) else clip
    assert type(clip).__module__ == "comfy.sd" and type(clip).__name__ == "CLIP"
    assert (cond[0] - final).abs().max().item() < 1e-4
    text = res.node_outputs["3"][0]
    text = text[0] if isinstance(text, list) else text
    assert isinstance(text, str) and text


def test_missing_model_is_named_before_the_run(comfyui, tiny):
    """Queued without its model folder, the loader fails ComfyUI's validation (no node runs) with the folder
    and where it goes; with the folder, or with a path, it validates."""
    import comfyui_env

    folder, _ = tiny
    prompt = {"1": {"class_type": "MetalMoETextEncoderLoader",
                    "inputs": {"model": "Qwen3-Not-Here-A3B/", "device": "cpu", "dtype": "fp32", "layer": -1,
                               "template": "raw", "system_prompt": "", "path": ""}},
              "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a cat", "clip": ["1", 0]}}}
    with pytest.raises(comfyui_env.ComfyPromptError) as raised:
        comfyui.run_prompt(prompt, execute=["2"])
    text = str(raised.value)
    assert "'Qwen3-Not-Here-A3B/' is not in ComfyUI/models/text_encoders/" in text, text
    assert "into ComfyUI/models/text_encoders/Qwen3-Not-Here-A3B/, then press R" in text
    assert "Value not in list" not in text
    import shutil

    placed = comfyui.models_dir("text_encoders") / "Qwen3-Tiny-Placed/"
    shutil.copytree(folder, placed, dirs_exist_ok=True)
    try:
        comfyui.refresh_models()
        prompt["1"]["inputs"]["model"] = "Qwen3-Tiny-Placed/"
        assert comfyui.run_prompt(prompt, execute=["2"]).node_outputs["2"]
    finally:
        shutil.rmtree(placed)
        comfyui.refresh_models()
    prompt["1"]["inputs"].update(model="Qwen3-Not-Here-A3B/", path=str(folder))
    assert comfyui.run_prompt(prompt, execute=["2"]).node_outputs["2"]
