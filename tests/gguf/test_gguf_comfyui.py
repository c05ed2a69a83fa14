"""GGUF loading inside a real ComfyUI ($COMFYUI_PATH; skipped with the reason printed otherwise).

A tiny random Flux (ComfyUI's own Flux class at tiny widths, weights filled explicitly) is written as
GGUF (Q8_0, Q4_K) with gguf.GGUFWriter, loaded through MetalGGUFModelLoader and sampled with ComfyUI's
KSampler on CPU. The oracle: the same file dequantised by the gguf package to fp32 .safetensors,
loaded with ComfyUI's stock UNETLoader. Also: weights stay quantised (memory accounting), LoRA, the
Metal kernels through the emulator, and bad files.
"""
from __future__ import annotations

import hashlib
import importlib

import numpy as np

import pytest
import torch

import gguf_models as gm

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

# hidden 256 (two heads of 128): the Linear rows are whole 256-value K-quant blocks, as in real Flux.
FLUX_CFG = dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=64,
                hidden_size=256, mlp_ratio=4.0, num_heads=2, depth=1, depth_single_blocks=1,
                axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True, guidance_embed=False,
                txt_ids_dims=[])


@pytest.fixture(scope="module")
def loader_mod(comfyui):
    return importlib.import_module(comfyui.pack_module.__name__ + ".nodes.gguf.loader")


@pytest.fixture(scope="module")
def ops_mod(comfyui):
    return importlib.import_module(comfyui.pack_module.__name__ + ".nodes.gguf.ops")


def _fill(module, seed):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if "norm" in name or name.endswith("scale"):
                p.copy_(1 + 0.05 * torch.randn(p.shape, generator=g))
            else:
                p.copy_(torch.randn(p.shape, generator=g) * (p.shape[-1] ** -0.5 if p.dim() >= 2 else 0.05))
    return module


@pytest.fixture(scope="module")
def flux_sd(comfyui):
    import comfy.ldm.flux.model
    import comfy.ops

    net = comfy.ldm.flux.model.Flux(**FLUX_CFG, dtype=torch.float32, operations=comfy.ops.manual_cast)
    _fill(net, seed=3)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.fixture(scope="module")
def flux_files(comfyui, flux_sd):
    """qtype -> (gguf file name, dequantised fp32 safetensors name, number of quantised tensors)."""
    from safetensors.torch import save_file

    folder = comfyui.models_dir("diffusion_models")
    out = {}
    for qtype in ("Q8_0", "Q4_K"):
        path = folder / f"tiny_flux_{qtype}.gguf"
        values, nq = gm.write_gguf(path, flux_sd, qtype, "flux")
        deq = folder / f"tiny_flux_{qtype}_dequantized.safetensors"
        save_file({k: v.contiguous() for k, v in values.items()}, str(deq))
        out[qtype] = (path.name, deq.name, nq)
    comfyui.refresh_models()
    return out


def _conds(seed=0):
    g = torch.Generator().manual_seed(seed)
    pos = [[torch.randn(1, 7, 64, generator=g), {"pooled_output": torch.randn(1, 32, generator=g)}]]
    neg = [[torch.randn(1, 7, 64, generator=g), {"pooled_output": torch.randn(1, 32, generator=g)}]]
    return pos, neg


def _sample(comfyui, model, steps=3):
    pos, neg = _conds()
    latent = {"samples": torch.zeros(1, 16, 8, 8)}
    (out,) = comfyui.nodes.KSampler().sample(model, 7, steps, 2.0, "euler", "simple", pos, neg, latent, denoise=1.0)
    return out["samples"].float()


def test_node_lists_gguf_files(comfyui, flux_files):
    from_node = comfyui.pack_module.NODE_CLASS_MAPPINGS["MetalGGUFModelLoader"].INPUT_TYPES()
    names = from_node["required"]["unet_name"][0]
    assert {v[0] for v in flux_files.values()} <= set(names)
    assert not any(n.endswith(".safetensors") for n in names)
    for spec in from_node["required"].values():
        assert "tooltip" in spec[1]


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_flux_gguf_matches_stock_loader_on_dequantised_file(comfyui, loader_mod, ops_mod, flux_files, qtype):
    name, deq_name, nq = flux_files[qtype]
    (ours,) = loader_mod.MetalGGUFModelLoader().load(name, "fp32")
    (stock,) = comfyui.nodes.UNETLoader().load_unet(deq_name, "default")
    assert type(ours.model).__name__ == type(stock.model).__name__ == "Flux"
    layers = dict(ops_mod.gguf_modules(ours.model))
    assert len(layers) == nq >= 8 and {m.gguf_qtype for m in layers.values()} == {qtype}
    a = _sample(comfyui, ours)
    b = _sample(comfyui, stock)
    assert torch.isfinite(a).all()
    rel = ((a - b).norm() / b.norm()).item()
    print(f"flux {qtype} ours vs stock on the dequantised file: rel {rel:.2e}, {nq} quantised layers")
    # Both compute with the same dequantised values in fp32; only summation order differs.
    assert rel < 1e-4, rel


def test_weights_stay_quantised_and_memory_manager_sees_it(comfyui, loader_mod, ops_mod, flux_files, flux_sd):
    import comfy.model_management as mm

    name, _, nq = flux_files["Q4_K"]
    (ours,) = loader_mod.MetalGGUFModelLoader().load(name, "bf16")
    stats = ops_mod.weight_bytes(ours.model)
    assert stats["bytes_per_gguf_weight"] == pytest.approx(144 / 256)       # 4.5 bits a weight
    for _, m in ops_mod.gguf_modules(ours.model):
        assert m.weight.dtype == torch.uint8
    # ComfyUI's own accounting (module sizes from the state dict) is the quantised size: 4.5 bits a
    # quantised weight, the rest (F32 in the file: biases, norms, layers whose rows are not whole blocks) as loaded
    quant_keys = [k for k, v in flux_sd.items() if gm.quantisable(k, v, "Q4_K")]
    assert len(quant_keys) == nq
    q_bytes = sum(flux_sd[k].numel() for k in quant_keys) * 144 // 256
    assert stats["gguf_bytes"] == q_bytes
    rest = sum(v.numel() for k, v in flux_sd.items() if k not in quant_keys)
    assert q_bytes + rest * 2 <= ours.model_size() <= q_bytes + rest * 4
    assert ours.model_size() < 0.4 * sum(v.numel() * 2 for v in flux_sd.values())      # vs a bf16 model
    mm.load_models_gpu([ours])
    assert mm.loaded_models() and any(lm.model is ours for lm in mm.current_loaded_models)


def test_lora_applies_to_dequantised_weight(comfyui, loader_mod, ops_mod, flux_files):
    """A LoRA patch on a GGUF layer through ComfyUI's add_patches: same result as the stock loader with
    the same LoRA on the dequantised file."""
    name, deq_name, _ = flux_files["Q8_0"]
    (ours,) = loader_mod.MetalGGUFModelLoader().load(name, "fp32")
    (stock,) = comfyui.nodes.UNETLoader().load_unet(deq_name, "default")
    key = "diffusion_model.double_blocks.0.img_attn.qkv.weight"
    g = torch.Generator().manual_seed(4)
    up, down = torch.randn(768, 4, generator=g) * 0.3, torch.randn(4, 256, generator=g) * 0.3
    import comfy.weight_adapter

    results = []
    for m in (ours, stock):
        m = m.clone()
        adapter = comfy.weight_adapter.LoRAAdapter(set(), (up, down, 1.0, None, None, None))
        assert m.add_patches({key: adapter}, 1.0) == [key]
        results.append(_sample(comfyui, m))
    plain = _sample(comfyui, ours)
    rel = ((results[0] - results[1]).norm() / results[1].norm()).item()
    assert rel < 1e-4, rel
    assert ((results[0] - plain).norm() / plain.norm()).item() > 1e-3       # the LoRA did something



def test_bad_files_name_file_and_tensor(comfyui, loader_mod, flux_files, flux_sd, tmp_path):
    import folder_paths

    folder = comfyui.models_dir("diffusion_models")
    name, _, _ = flux_files["Q8_0"]
    data = (folder / name).read_bytes()
    # truncated
    (folder / "trunc.gguf").write_bytes(data[: len(data) - 5000])
    # a tensor shape that does not fit the architecture
    bad = dict(flux_sd)
    bad["double_blocks.0.img_mlp.0.weight"] = torch.randn(1024, 224)
    gm.write_gguf(folder / "badshape.gguf", bad, "Q8_0", "flux")
    # an architecture ComfyUI does not recognise
    gm.write_gguf(folder / "unknown_arch.gguf", {"foo.weight": torch.randn(64, 64), "bar.bias": torch.randn(3)},
                  "Q8_0", "mystery")
    comfyui.refresh_models()
    node = loader_mod.MetalGGUFModelLoader()
    with pytest.raises(loader_mod.GGUFFileError, match=r"trunc\.gguf: tensor .* truncated"):
        node.load("trunc.gguf", "fp32")
    with pytest.raises(Exception, match=r"badshape\.gguf.*double_blocks\.0\.img_mlp\.0\.weight.*\[1024, 224\]"):
        node.load("badshape.gguf", "fp32")
    with pytest.raises(loader_mod.GGUFFileError, match=r"unknown_arch\.gguf: ComfyUI does not recognise.*mystery"):
        node.load("unknown_arch.gguf", "fp32")
    assert folder_paths.get_full_path("diffusion_models_gguf", "trunc.gguf")


def test_node_through_executor_then_emulated_kernels_sample_the_same(comfyui, loader_mod, flux_files, monkeypatch):
    """The loader node runs through ComfyUI's executor; then the model samples with the real Metal
    kernels (gguf_dequantize for large M, gguf_gemv for the M = 2 modulation rows) in the MSL emulator,
    matching the reference run."""
    from comfy_metal.metal_kernels.emulator import available

    kernels = importlib.import_module(comfyui.pack_module.__name__ + ".metal_kernels")
    name, _, _ = flux_files["Q4_K"]
    prompt = {"1": {"class_type": "MetalGGUFModelLoader", "inputs": {"unet_name": name, "compute_dtype": "fp32"}}}
    res = comfyui.run_prompt(prompt, execute=["1"])
    model = res.node_outputs["1"][0]
    model = model[0] if isinstance(model, list) else model
    want = _sample(comfyui, model, steps=2)
    assert kernels.dispatch.last_backend.get("gguf_dequantize") == "reference"
    if not available():
        pytest.skip("clang-19 not found: the MSL emulator is unavailable")
    path = comfyui.models_dir("diffusion_models") / name
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    monkeypatch.setenv("COMFY_METAL_BACKEND", "emulator")
    kernels.dispatch.reset()
    try:
        got = _sample(comfyui, model, steps=2)
        backends = dict(kernels.dispatch.last_backend)
    finally:
        monkeypatch.delenv("COMFY_METAL_BACKEND")
        kernels.dispatch.reset()
    assert backends.get("gguf_dequantize") == "emulator" and backends.get("gguf_gemv") == "emulator", backends
    # the layers view the file through a copy-on-write map: the emulator's buffer copy-back never reaches it
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    rel = ((got - want).norm() / want.norm()).item()
    print(f"flux Q4_K emulated Metal kernels vs reference: rel {rel:.2e}")
    assert rel < 1e-4, rel


def test_unsupported_quant_type_through_executor_names_types(comfyui, flux_files, flux_sd):
    """A tensor in a ggml type outside the supported set: the node fails naming file, tensor and the
    supported types; the server keeps running."""
    import comfyui_env
    import gguf

    folder = comfyui.models_dir("diffusion_models")
    w = gguf.GGUFWriter(str(folder / "tq.gguf"), "flux")
    for k, v in flux_sd.items():
        if k == "double_blocks.0.img_mlp.0.weight":
            raw = np.zeros((v.shape[0], v.shape[1] // 256 * 66), dtype=np.uint8)       # TQ2_0 blocks
            w.add_tensor(k, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.TQ2_0)
        else:
            w.add_tensor(k, v.float().numpy())
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    comfyui.refresh_models()
    prompt = {"1": {"class_type": "MetalGGUFModelLoader", "inputs": {"unet_name": "tq.gguf", "compute_dtype": "fp32"}}}
    with pytest.raises(comfyui_env.ComfyPromptError) as e:
        comfyui.run_prompt(prompt, execute=["1"])
    msg = str(e.value)
    assert "tq.gguf" in msg and "double_blocks.0.img_mlp.0.weight" in msg and "TQ2_0" in msg, msg
    assert "Q4_K" in msg and "Q8_0" in msg and "IQ4_XS" in msg, msg
    prompt["1"]["inputs"]["unet_name"] = flux_files["Q8_0"][0]
    comfyui.run_prompt(prompt, execute=["1"])


def test_t5_llama_cpp_names_map_onto_comfyuis_t5(comfyui, loader_mod):
    """Every T5 encoder tensor name llama.cpp defines (from the gguf package's own tables) maps onto a
    parameter of ComfyUI's T5 encoder."""
    import gguf
    import comfy.ops
    import comfy.text_encoders.t5 as t5

    reader_mod = importlib.import_module(comfyui.pack_module.__name__ + ".nodes.gguf.reader")
    cfg = {"d_ff": 64, "d_kv": 8, "d_model": 32, "dense_act_fn": "gelu_pytorch_tanh", "is_gated_act": True,
           "model_type": "t5", "num_heads": 4, "num_layers": 2, "vocab_size": 100, "relative_attention_num_buckets": 32,
           "relative_attention_max_distance": 128}
    net = t5.T5(cfg, torch.float32, "cpu", comfy.ops.manual_cast)
    keys = set(net.state_dict())
    arch = gguf.MODEL_ARCH.T5ENCODER
    names = []
    for tensor in gguf.MODEL_TENSORS[arch]:
        base = gguf.TENSOR_NAMES[tensor]
        for bid in (0, 1):
            n = base.format(bid=bid) + ".weight"
            if tensor == gguf.MODEL_TENSOR.ENC_ATTN_REL_B and bid == 1:
                continue            # only the first block carries the relative attention bias
            names.append(n)
    mapped = {n: reader_mod.t5_key(n) for n in names}
    missing = {n: m for n, m in mapped.items() if m not in keys and not n.startswith("output")}
    assert not missing, missing
    assert "shared.weight" in mapped.values() and "encoder.final_layer_norm.weight" in mapped.values()


@pytest.fixture(scope="module")
def clip_l_gguf(comfyui):
    """A random full-size CLIP-L (its tokenizer ships with ComfyUI) as a Q8_0 GGUF with ComfyUI's
    tensor names, and the same values dequantised by the gguf package as fp16 safetensors."""
    import json
    import os

    import comfy.clip_model
    import comfy.ops
    import comfy.sd1_clip
    from safetensors.torch import save_file

    with open(os.path.join(os.path.dirname(comfy.sd1_clip.__file__), "sd1_clip_config.json")) as f:
        config = json.load(f)
    net = comfy.clip_model.CLIPTextModel(config, torch.float32, "cpu", comfy.ops.manual_cast)
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, p in net.named_parameters():
            p.copy_(1 + 0.05 * torch.randn(p.shape, generator=g) if "norm" in name and name.endswith("weight")
                    else torch.randn(p.shape, generator=g) * 0.02)
    sd = {k: v.detach().clone() for k, v in net.state_dict().items()}
    del net
    folder = comfyui.models_dir("text_encoders")
    values, nq = gm.write_gguf(folder / "clip_l_Q8_0.gguf", sd, "Q8_0", "clip")
    save_file({k: v.to(torch.float16).contiguous() for k, v in values.items()},
              str(folder / "clip_l_Q8_0_dequantized.safetensors"))
    comfyui.refresh_models()
    return "clip_l_Q8_0.gguf", "clip_l_Q8_0_dequantized.safetensors", nq


def test_text_encoder_matches_stock(comfyui, ops_mod, clip_l_gguf):
    name, deq_name, nq = clip_l_gguf
    text = "a photo of a cat on a red sofa"
    prompt = {"1": {"class_type": "MetalGGUFTextEncoderLoader",
                    "inputs": {"clip_name": name, "type": "stable_diffusion", "device": "cpu"}},
              "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": text}}}
    res = comfyui.run_prompt(prompt, execute=["1", "2"])
    ours, ca = res.node_outputs["1"][0], res.node_outputs["2"][0]
    ours = ours[0] if isinstance(ours, list) else ours
    if not isinstance(ca[0][0], torch.Tensor):
        ca = ca[0]
    layers = dict(ops_mod.gguf_modules(ours.cond_stage_model))
    assert len(layers) == nq >= 48
    assert any(type(m).__name__ == "Embedding" for m in layers.values())     # the token embedding stays Q8_0
    (stock,) = comfyui.nodes.CLIPLoader().load_clip(deq_name, "stable_diffusion", "cpu")
    (cb,) = comfyui.nodes.CLIPTextEncode().encode(stock, text)
    a, b = ca[0][0].float(), cb[0][0].float()
    pa, pb = ca[0][1]["pooled_output"].float(), cb[0][1]["pooled_output"].float()
    rel, relp = ((a - b).norm() / b.norm()).item(), ((pa - pb).norm() / pb.norm()).item()
    print(f"clip-l Q8_0 ours vs stock (dequantised): cond rel {rel:.2e}, pooled rel {relp:.2e}")
    assert torch.isfinite(a).all() and a.shape == b.shape
    assert rel < 1e-2 and relp < 1e-2


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_K"])
def test_wan_gguf_matches_stock_loader_on_dequantised_file(comfyui, loader_mod, ops_mod, qtype):
    """A second architecture: a tiny Wan 2.1 t2v (Conv3d patch embedding kept F32, 5-D video latents)."""
    import comfy.ldm.wan.model
    import comfy.ops
    from safetensors.torch import save_file

    folder = comfyui.models_dir("diffusion_models")
    net = comfy.ldm.wan.model.WanModel(model_type="t2v", dim=256, ffn_dim=512, num_heads=2, num_layers=2,
                                       dtype=torch.float32, operations=comfy.ops.manual_cast)
    _fill(net, seed=6)
    sd = {k: v.detach().clone() for k, v in net.state_dict().items()}
    del net
    values, nq = gm.write_gguf(folder / f"tiny_wan_{qtype}.gguf", sd, qtype, "wan")
    save_file({k: v.contiguous() for k, v in values.items()}, str(folder / f"tiny_wan_{qtype}_deq.safetensors"))
    save_file({k: v.contiguous() for k, v in sd.items()}, str(folder / "tiny_wan_unquantised.safetensors"))
    comfyui.refresh_models()
    (ours,) = loader_mod.MetalGGUFModelLoader().load(f"tiny_wan_{qtype}.gguf", "fp32")
    (stock,) = comfyui.nodes.UNETLoader().load_unet(f"tiny_wan_{qtype}_deq.safetensors", "default")
    assert type(ours.model).__name__ == type(stock.model).__name__ == "WAN21"
    assert len(dict(ops_mod.gguf_modules(ours.model))) == nq >= 10
    g = torch.Generator().manual_seed(0)
    pos, neg = [[torch.randn(1, 9, 4096, generator=g), {}]], [[torch.randn(1, 9, 4096, generator=g), {}]]
    latent = {"samples": torch.zeros(1, 16, 2, 8, 8)}
    (unquantised,) = comfyui.nodes.UNETLoader().load_unet("tiny_wan_unquantised.safetensors", "default")
    outs = [comfyui.nodes.KSampler().sample(m, 3, 3, 3.0, "euler", "simple", pos, neg, latent)[0]["samples"].float()
            for m in (ours, stock, unquantised)]
    rel = ((outs[0] - outs[1]).norm() / outs[1].norm()).item()
    rel_q = ((outs[2] - outs[1]).norm() / outs[1].norm()).item()
    print(f"wan {qtype} ours vs stock on the dequantised file: rel {rel:.2e}, {nq} quantised layers "
          f"(the quantisation itself moves the result by {rel_q:.2e})")
    assert torch.isfinite(outs[0]).all() and rel < 1e-4, rel
    assert rel_q > 1e-4 and rel < rel_q / 10          # the test sees the file's quantised values


@pytest.mark.parametrize("arch,cls", [("LLAMA", "Llama2"), ("QWEN2VL", "Qwen25_7BVLI"), ("QWEN3", "Qwen3_4B")])
def test_llama_cpp_decoder_names_map_onto_comfyuis_text_models(comfyui, arch, cls):
    """Every decoder tensor name llama.cpp defines for the architecture (the gguf package's own tables)
    maps onto a parameter of ComfyUI's text model (built on the meta device, two layers)."""
    import gguf
    import comfy.ops
    import comfy.text_encoders.llama as llama

    reader_mod = importlib.import_module(comfyui.pack_module.__name__ + ".nodes.gguf.reader")
    net = getattr(llama, cls)({"num_hidden_layers": 2}, torch.float32, "meta", comfy.ops.manual_cast)
    keys = set(net.state_dict())
    a = getattr(gguf.MODEL_ARCH, arch)
    wanted = {gguf.MODEL_TENSOR.TOKEN_EMBD, gguf.MODEL_TENSOR.OUTPUT_NORM, gguf.MODEL_TENSOR.ATTN_NORM,
              gguf.MODEL_TENSOR.ATTN_Q, gguf.MODEL_TENSOR.ATTN_K, gguf.MODEL_TENSOR.ATTN_V, gguf.MODEL_TENSOR.ATTN_OUT,
              gguf.MODEL_TENSOR.FFN_NORM, gguf.MODEL_TENSOR.FFN_GATE, gguf.MODEL_TENSOR.FFN_UP,
              gguf.MODEL_TENSOR.FFN_DOWN, gguf.MODEL_TENSOR.ATTN_Q_NORM, gguf.MODEL_TENSOR.ATTN_K_NORM}
    names = [gguf.TENSOR_NAMES[t].format(bid=b) + ".weight" for t in gguf.MODEL_TENSORS[a] if t in wanted for b in (0, 1)]
    assert len(names) >= 22
    missing = {n: reader_mod.llama_key(n) for n in names if reader_mod.llama_key(n) not in keys}
    assert not missing, missing
    if arch == "QWEN2VL":      # Qwen2's q/k/v projections carry biases
        assert reader_mod.llama_key("blk.1.attn_k.bias") in keys


def test_llama_rows_restored_after_llama_cpp_permutation(comfyui):
    """llama.cpp's converter reorders the rows of Llama q/k projections per head (its `permute`); the
    loader restores them, on plain tensors and on quantised blocks alike."""
    reader_mod = importlib.import_module(comfyui.pack_module.__name__ + ".nodes.gguf.reader")
    ops = importlib.import_module(comfyui.pack_module.__name__ + ".nodes.gguf.ops")
    from gguf.quants import dequantize, quantize

    w = np.random.default_rng(1).standard_normal((64, 96)).astype(np.float32)
    for heads in (4, 8):
        p = gm.llama_cpp_permute(w, heads)
        assert not np.array_equal(p, w)
        back = reader_mod.unpermute_rows(torch.from_numpy(p), heads)
        assert torch.equal(back, torch.from_numpy(w))
        raw = torch.from_numpy(quantize(p, gm.Q.Q8_0))
        t = reader_mod.unpermute_rows(ops.GGUFTensor(raw, "Q8_0", (64, 96)), heads)
        assert t.shape == (64, 96)
        assert torch.equal(ops.dequantize_tensor(t), torch.from_numpy(dequantize(quantize(w, gm.Q.Q8_0),
                                                                                   gm.Q.Q8_0)))


def test_every_gguf_node_has_tooltips_and_the_loaders_category(comfyui):
    gguf_nodes = {k: v for k, v in comfyui.pack_module.NODE_CLASS_MAPPINGS.items() if "GGUF" in k}
    assert set(gguf_nodes) == {"MetalGGUFModelLoader", "MetalGGUFTextEncoderLoader", "MetalGGUFDualTextEncoderLoader",
                               "MetalGGUFTripleTextEncoderLoader", "MetalGGUFQuadrupleTextEncoderLoader"}
    info = comfyui.object_info()
    for name, cls in gguf_nodes.items():
        assert cls.CATEGORY == "Comfy Metal/Loaders" and name in info
        for spec in cls.INPUT_TYPES()["required"].values():
            assert spec[1].get("tooltip"), (name, spec)



def _t5_tokenizer_metadata(spiece: bytes) -> dict:
    """What llama.cpp's converter writes for a T5/UMT5 tokenizer, read from the sentencepiece model with
    sentencepiece itself: pieces, scores, types, normalisation flags, special ids."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_proto=spiece)
    n = sp.get_piece_size()
    types = [2 if sp.is_unknown(i) else 3 if sp.is_control(i) else 6 if sp.is_byte(i) else 5 if sp.is_unused(i)
             else 1 for i in range(n)]
    return {"tokens": [sp.id_to_piece(i) for i in range(n)], "scores": [sp.get_score(i) for i in range(n)],
            "types": types, "unk": sp.unk_id(), "eos": sp.eos_id(), "pad": sp.pad_id()}


def test_umt5_gguf_with_rebuilt_tokenizer_matches_stock(comfyui, ops_mod, monkeypatch):
    """A tiny UMT5 (Wan's encoder) as a llama.cpp-named Q8_0 GGUF whose tokenizer is only metadata: the
    loader rebuilds the sentencepiece model; CLIPTextEncode (type wan) matches ComfyUI's stock CLIPLoader
    on the dequantised weights with the original sentencepiece model, and the tokenizers agree."""
    import comfy.sd
    import gguf
    import sentencepiece as spm
    from safetensors.torch import save_file

    import workflow_models as wm

    wm.shrink_text_encoders(monkeypatch, comfy.sd)
    sd = wm.t5_state_dict("umt5_config_xxl.json", wm.UMT5XXL, seed=7)
    spiece = wm.tiny_spiece_model()
    meta = _t5_tokenizer_metadata(spiece)
    folder = comfyui.models_dir("text_encoders")
    path = folder / "umt5_tiny_Q8_0.gguf"
    w = gguf.GGUFWriter(str(path), "t5encoder")
    w.add_tokenizer_model("t5")
    w.add_token_list(meta["tokens"])
    w.add_token_scores(meta["scores"])
    w.add_token_types(meta["types"])
    w.add_unk_token_id(meta["unk"])
    w.add_eos_token_id(meta["eos"])
    w.add_pad_token_id(meta["pad"])
    w.add_add_space_prefix(True)
    w.add_remove_extra_whitespaces(True)
    values = {}
    for k, v in sd.items():
        name = k
        for a, b in wm._T5_TO_LLAMA_CPP:
            name = name.replace(a, b)
        a = v.float().contiguous().numpy()
        if gm.quantisable(k, v, "Q8_0"):
            raw = gm.quantize(a, "Q8_0")
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
            values[k] = torch.from_numpy(gm.np_dequantize(raw, gm.Q.Q8_0).copy()).reshape(v.shape)
        else:
            w.add_tensor(name, a)
            values[k] = v.float()
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    values["spiece_model"] = torch.frombuffer(bytearray(spiece), dtype=torch.uint8)
    save_file({k: t.contiguous() for k, t in values.items()}, str(folder / "umt5_tiny_deq.safetensors"))
    comfyui.refresh_models()

    loader = importlib.import_module(comfyui.pack_module.__name__ + ".nodes.gguf.loader")
    rebuilt = loader.text_encoder_state_dict(str(path))["spiece_model"]
    a, b = spm.SentencePieceProcessor(model_proto=bytes(rebuilt.numpy())), spm.SentencePieceProcessor(model_proto=spiece)
    for text in ("a cat sits on the red mat", "  Camera   moves slowly, at NIGHT!  ", "rain über forest 123"):
        assert a.encode(text) == b.encode(text), text
    (ours,) = comfyui.pack_module.NODE_CLASS_MAPPINGS["MetalGGUFTextEncoderLoader"]().load(path.name, "wan", "cpu")
    assert len(dict(ops_mod.gguf_modules(ours.cond_stage_model))) > 0
    (stock,) = comfyui.nodes.CLIPLoader().load_clip("umt5_tiny_deq.safetensors", "wan", "cpu")
    text = "a paper boat on a rainy street at night"
    (ca,) = comfyui.nodes.CLIPTextEncode().encode(ours, text)
    (cb,) = comfyui.nodes.CLIPTextEncode().encode(stock, text)
    x, y = ca[0][0].float(), cb[0][0].float()
    rel = ((x - y).norm() / y.norm()).item()
    print(f"umt5 Q8_0 ours vs stock (dequantised, original tokenizer): rel {rel:.2e}")
    assert x.shape == y.shape and torch.isfinite(x).all() and rel < 1e-2
