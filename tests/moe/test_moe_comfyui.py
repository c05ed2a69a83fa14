"""ComfyUI's own GPT-OSS (Lens) encoder with the pack's sync-free experts op vs ComfyUI's default ops."""
from __future__ import annotations

import pytest
import torch

from comfy_metal.nodes.common import syncs as sync_count

TINY = dict(vocab_size=96, hidden_size=32, intermediate_size=24, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, num_local_experts=7, num_experts_per_tok=3, sliding_window=4)


def _lens_model(operations):
    from comfy.text_encoders import gpt_oss

    opts = {"gpt_oss_config": TINY, "selected_layers": (0, 1, 2), "txt_offset": 2, "custom_operations": operations}
    return gpt_oss.LensGptOssClipModel(device="cpu", dtype=torch.float32, model_options=opts)


def _state_dict():
    """Random weights for every tensor of the tiny GPT-OSS encoder (ComfyUI's layers skip init)."""
    V, H, I = TINY["vocab_size"], TINY["hidden_size"], TINY["intermediate_size"]
    E, nh, nkv, d = TINY["num_local_experts"], TINY["num_attention_heads"], TINY["num_key_value_heads"], TINY["head_dim"]
    shapes = {"embed_tokens.weight": (V, H), "norm.weight": (H,)}
    for i in range(TINY["num_hidden_layers"]):
        p = f"layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
            p + "self_attn.q_proj.weight": (nh * d, H), p + "self_attn.q_proj.bias": (nh * d,),
            p + "self_attn.k_proj.weight": (nkv * d, H), p + "self_attn.k_proj.bias": (nkv * d,),
            p + "self_attn.v_proj.weight": (nkv * d, H), p + "self_attn.v_proj.bias": (nkv * d,),
            p + "self_attn.o_proj.weight": (H, nh * d), p + "self_attn.o_proj.bias": (H,),
            p + "self_attn.sinks": (nh,),
            p + "mlp.router.weight": (E, H), p + "mlp.router.bias": (E,),
            p + "mlp.experts.gate_up_proj.weight": (E, 2 * I, H), p + "mlp.experts.gate_up_proj.bias": (E, 2 * I),
            p + "mlp.experts.down_proj.weight": (E, H, I), p + "mlp.experts.down_proj.bias": (E, H),
        })
    gen = torch.Generator().manual_seed(0)
    sd = {}
    for k, shape in sorted(shapes.items()):
        if "norm" in k:
            sd[k] = 1.0 + 0.1 * torch.randn(shape, generator=gen)
        else:
            sd[k] = torch.randn(shape, generator=gen) * (0.5 if "router" in k else 0.15)
    return sd


def test_gpt_oss_encoder_with_sync_free_experts_matches_default_ops(comfyui):
    import comfy.model_patcher
    import comfy.ops
    from comfy_metal.nodes.moe import experts_patch as moe_experts  # noqa: the pack as the tests import it

    sd = _state_dict()
    tokens = {"gpt_oss": [[(t, 1.0) for t in [3, 17, 5, 60, 61, 2, 9, 9, 40, 33, 12, 80, 1, 4, 7, 70, 71, 72, 73, 5, 6, 8, 10, 11, 13, 14]]]}
    default = _lens_model(comfy.ops.mixed_precision_ops({}, torch.float32, full_precision_mm=True))
    missing, unexpected = default.load_sd(dict(sd))
    assert not missing and not unexpected, (missing, unexpected)
    ours = _lens_model(moe_experts.make_operations({}, torch.float32))
    missing, unexpected = ours.load_sd(dict(sd))
    assert not missing and not unexpected, (missing, unexpected)
    assert type(ours.transformer.layers[0].mlp.experts.gate_up_proj).__name__ == "MoEExperts"
    assert hasattr(ours.transformer.layers[0].mlp.experts.gate_up_proj, "grouped_linear")

    want, _, want_extra = default.encode_token_weights(tokens["gpt_oss"])
    patcher = comfy.model_patcher.ModelPatcher(ours, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))
    patches = moe_experts.object_patches(ours)
    assert len(patches) == TINY["num_hidden_layers"]
    for k, fn in patches.items():
        patcher.add_object_patch(k, fn)
    patcher.patch_model()
    try:
        with sync_count.SyncCounter() as c:
            got, _, got_extra = ours.encode_token_weights(tokens["gpt_oss"])
        mlp = ours.transformer.layers[1].mlp
        x = torch.randn(1, 5, TINY["hidden_size"])
        with sync_count.SyncCounter() as c_layer:
            mlp(x)
        x1 = torch.randn(1, 1, TINY["hidden_size"])
        with sync_count.SyncCounter() as c_decode:
            mlp(x1)
    finally:
        patcher.unpatch_model()
    assert got.shape == want.shape and got.shape[1] == 24
    err = (got - want).abs().max().item()
    assert err < 1e-4, err
    assert torch.equal(got_extra["attention_mask"], want_extra["attention_mask"])
    assert c_layer.total == 0 and c_decode.total == 0, (c_layer.counts, c_decode.counts)
    # the default path syncs once per expert hit; ours adds none beyond the encoder's own
    with sync_count.SyncCounter() as c_default:
        default.transformer.layers[1].mlp(x)
    assert c_default.total > 0
    # after unpatching, ComfyUI's own forward is back
    with sync_count.SyncCounter() as c_after:
        ours.transformer.layers[1].mlp(x)
    assert c_after.total > 0


def test_gpt_oss_fp8_experts_stay_fp8_and_match_default_ops(comfyui):
    """FP8 expert banks in ComfyUI's format (comfy_quant, per-expert weight_scale): the pack's op reads
    the FP8 bytes + scales (no dequantized bank), and the conditioning matches ComfyUI's default ops."""
    import json

    import comfy.model_patcher
    import comfy.ops
    from comfy_metal.nodes.moe import experts_patch as moe_experts

    sd = _state_dict()
    E = TINY["num_local_experts"]
    for k in [k for k in sd if k.endswith("mlp.experts.gate_up_proj.weight") or k.endswith("mlp.experts.down_proj.weight")]:
        w = sd[k]
        scale = w.abs().amax(dim=(1, 2)) / 448.0
        sd[k] = (w / scale[:, None, None]).to(torch.float8_e4m3fn)
        prefix = k[: -len("weight")]
        sd[prefix + "weight_scale"] = scale
        sd[prefix + "comfy_quant"] = torch.tensor(list(json.dumps({"format": "float8_e4m3fn", "num_experts": E}).encode()),
                                                  dtype=torch.uint8)
    tokens = [[(t, 1.0) for t in [3, 17, 5, 60, 61, 2, 9, 9, 40, 33, 12, 80, 1, 4, 7, 70, 71, 72, 73, 5, 6]]]
    default = _lens_model(comfy.ops.mixed_precision_ops({}, torch.float32, full_precision_mm=True))
    default.load_sd(dict(sd))
    ours = _lens_model(moe_experts.make_operations({}, torch.float32))
    ours.load_sd(dict(sd))
    bank = ours.transformer.layers[0].mlp.experts.gate_up_proj
    x = torch.randn(3, TINY["hidden_size"])
    with moe_experts._bank(bank, x) as (w, fmt, scale, bias):
        assert fmt == "e4m3fn" and w.dtype == torch.uint8 and w.shape[0] == E
        assert scale is not None and scale.numel() == E
    want = default.encode_token_weights(tokens)[0]
    patcher = comfy.model_patcher.ModelPatcher(ours, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))
    for k, fn in moe_experts.object_patches(ours).items():
        patcher.add_object_patch(k, fn)
    patcher.patch_model()
    try:
        got = ours.encode_token_weights(tokens)[0]
    finally:
        patcher.unpatch_model()
    assert (got - want).abs().max().item() < 1e-4


def comfyui_device():
    import comfy.model_management

    return comfy.model_management.get_torch_device()


def _comfy_clip():
    """A comfy.sd.CLIP holding ComfyUI's (tiny, random) GPT-OSS Lens encoder, on the CPU."""
    import comfy.sd
    from comfy.text_encoders import gpt_oss

    import moe_testutil

    sd = _state_dict()

    class TinyLens(gpt_oss.LensTEModel):
        def __init__(self, device="cpu", dtype=None, model_options=None):
            mo = dict(model_options or {}, gpt_oss_config=TINY, selected_layers=(0, 2), txt_offset=0)
            super().__init__(device=device, dtype=torch.float32, model_options=mo)

    class Target:
        params = {}
        clip = TinyLens
        tokenizer = gpt_oss.LensTokenizer

    tok_json = moe_testutil.tiny_tokenizer_json(TINY["vocab_size"]).encode()
    clip = comfy.sd.CLIP(target=Target, tokenizer_data={"tokenizer_json": tok_json}, state_dict=[sd],
                         model_options={"load_device": torch.device("cpu"), "offload_device": torch.device("cpu"),
                                        "dtype": torch.float32})
    return clip


def test_experts_patch_node_on_a_comfy_clip(comfyui):
    """MetalMoEExpertsPatch on a comfy.sd.CLIP holding ComfyUI's GPT-OSS encoder: same conditioning,
    no host syncs left in the encode, the original CLIP untouched."""
    clip = _comfy_clip()
    node = comfyui.nodes.NODE_CLASS_MAPPINGS["MetalMoEExpertsPatch"]()
    (patched,) = node.patch(clip, "keep")
    (on_gpu,) = node.patch(clip, "gpu")   # ComfyUI's device (the CPU in this harness)
    assert on_gpu.patcher.load_device == comfyui_device()
    ours = [k for k in patched.patcher.object_patches if k.endswith(".experts.forward")]
    assert patched is not clip and len(ours) == TINY["num_hidden_layers"]
    assert not [k for k in clip.patcher.object_patches if k.endswith(".experts.forward")]
    tokens = clip.tokenize("a red cat on the mat under the big blue sky")
    want = clip.encode_from_tokens(tokens)
    with sync_count.SyncCounter() as c_default:
        clip.encode_from_tokens(tokens)
    with sync_count.SyncCounter() as c_patched:
        got = patched.encode_from_tokens(tokens)
    assert want.shape == got.shape and want.shape[1] > 0
    assert (got - want).abs().max().item() < 1e-4
    assert c_patched.total < c_default.total, (c_patched.counts, c_default.counts)
    assert c_patched.counts["aten::nonzero"] == 0 and c_patched.counts["aten::_local_scalar_dense"] == 0, c_patched.counts


def test_experts_patch_records_a_badge_for_the_executing_node(comfyui, monkeypatch):
    """The patched encoder run inside a core node (CLIPTextEncode's executing context) records its experts
    kernels (here the real MSL in the emulator) for that node's badge; the unpatched CLIP sharing the model
    records nothing."""
    import importlib

    from comfy_execution.utils import CurrentNodeContext
    from comfy_metal.metal_kernels import emulator

    # The node runs the pack as ComfyUI imported it: its own status and dispatch modules.
    status = importlib.import_module(comfyui.pack_module.__name__ + ".nodes.status")
    dispatch = importlib.import_module(comfyui.pack_module.__name__ + ".metal_kernels.dispatch")

    if not emulator.available():
        pytest.skip("the MSL emulator needs clang-19, which is not installed")
    clip = _comfy_clip()
    (patched,) = comfyui.nodes.NODE_CLASS_MAPPINGS["MetalMoEExpertsPatch"]().patch(clip, "keep")
    tokens = clip.tokenize("a red cat")
    monkeypatch.setenv("COMFY_METAL_BACKEND", "emulator")
    dispatch.reset()
    try:
        _, start = status.records_since(0)
        with CurrentNodeContext("p", "7"):
            patched.encode_from_tokens(tokens)
        recs, start = status.records_since(start)
        assert len(recs) == 1 and recs[0]["node_id"] == "7" and recs[0]["node_class"] is None, recs
        kernels = {k: v["backend"] for k, v in recs[0]["kernels"].items()}
        assert kernels and set(kernels) <= {"moe_experts_gemm", "moe_grouped_gemm"}, recs   # per-pair or tiled
        assert set(kernels.values()) == {"emulator"}, recs
        assert recs[0]["backend"] == "emulator" and status.node_backends["7"] is recs[0]
        with CurrentNodeContext("p", "8"):
            clip.encode_from_tokens(tokens)
        assert status.records_since(start)[0] == []
    finally:
        dispatch.reset()


def test_gpt_oss_sync_free_experts_in_emulator(comfyui, monkeypatch):
    """The patched GPT-OSS experts with COMFY_METAL_BACKEND=emulator: the per-pair kernel (few tokens) and the
    tiled grouped kernel (more tokens) run the real MSL and match ComfyUI's default ops."""
    import comfy.ops
    from comfy_metal.metal_kernels import dispatch, emulator
    from comfy_metal.nodes.moe import experts_patch as moe_experts

    if not emulator.available():
        pytest.skip("the MSL emulator needs clang-19, which is not installed")
    sd = _state_dict()
    default = _lens_model(comfy.ops.mixed_precision_ops({}, torch.float32, full_precision_mm=True))
    default.load_sd(dict(sd))
    ours = _lens_model(moe_experts.make_operations({}, torch.float32))
    ours.load_sd(dict(sd))
    mlps = [layer.mlp for layer in ours.transformer.layers]
    dmlps = [layer.mlp for layer in default.transformer.layers]
    gen = torch.Generator().manual_seed(1)
    monkeypatch.setenv("COMFY_METAL_BACKEND", "emulator")
    dispatch.reset()
    try:
        for T, kernel in ((5, "moe_experts_gemm"), (30, "moe_grouped_gemm")):   # 15 pairs / 90 pairs over 7 experts
            x = torch.randn(1, T, TINY["hidden_size"], generator=gen)
            for mlp, dmlp in zip(mlps, dmlps):
                experts = mlp.experts
                flat = x.reshape(-1, TINY["hidden_size"])
                scores, idx = mlp.router(flat)
                got = moe_experts.experts_forward(experts, flat, idx, scores)
                assert dispatch.last_backend[kernel] == "emulator"
                want = dmlp.experts(flat, idx, scores)
                assert (got - want).abs().max().item() < 1e-4
    finally:
        dispatch.reset()
