"""comfy_quant block formats inside a real ComfyUI ($COMFYUI_PATH; skipped with the reason printed otherwise).

A tiny random Flux (and a tiny Wan 2.1) of ComfyUI's own classes is quantized into each format of v0.33's
QUANT_ALGOS by ComfyUI's own quantizers (comfy.quant_ops layouts, comfy_kitchen underneath) and written the
way ComfyUI serialises them (tests/helpers/quant_models.py). Each file loads through Load Diffusion Model
(FP8, Metal) in ComfyUI's executor and samples through KSampler on CPU. Oracles: ComfyUI's stock UNETLoader
on the same file, and on the file's layers dequantized by ComfyUI's own QuantizedTensor.dequantize().
  * NVFP4 / MXFP8 run weight-only everywhere, as stock ComfyUI does without FP4/MXFP8 tensor cores: equal
    to both oracles up to fp32 summation order.
  * INT8, W4A8 and W4A4 run ComfyUI's own INT8 path on CPU (activations quantized, _int_mm): equal to the
    stock loader within the format's own activation rounding (the stock loader's distance to the
    dequantized weights); on (faked) MPS, without _int_mm, weight-only: equal to the dequantized weights.
The layers keep the stored bytes (the format's bits a weight), ComfyUI's memory manager counts them, the
Metal kernels run through the emulator, and bad files give one clear error while the server keeps running.
"""
from __future__ import annotations

import pytest
import torch

import comfyui_env
import fp8_models as fm
import quant_models as qm

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FLUX_CFG = dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=64,
                hidden_size=256, mlp_ratio=4.0, num_heads=2, depth=1, depth_single_blocks=1,
                axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True, guidance_embed=False,
                txt_ids_dims=[])
# As published quantized files do: the input / output projections stay high precision (ComfyUI's model
# detection reads img_in's shape).
FLUX_KEEP = ("img_in", "txt_in", "time_in", "vector_in", "final_layer")
WAN_KEEP = ("patch_embedding", "text_embedding", "time_embedding", "time_projection", "head")
FLOAT_FORMATS = ("nvfp4", "mxfp8")


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.fixture(scope="module")
def flux_sd(comfyui):
    import comfy.ldm.flux.model
    import comfy.ops

    net = comfy.ldm.flux.model.Flux(**FLUX_CFG, dtype=torch.float32, operations=comfy.ops.manual_cast)
    fm.fill_module_(net, seed=1)
    return {k: v.detach().clone() for k, v in net.state_dict().items()}


@pytest.fixture(scope="module")
def flux_file(comfyui, flux_sd):
    """variant -> (file name, oracle file name, quantized layer names), written once."""
    made = {}

    def get(variant):
        if variant not in made:
            folder = comfyui.models_dir("diffusion_models")
            name, oracle = f"tiny_flux_{variant}.safetensors", f"tiny_flux_{variant}_dequantized.safetensors"
            layers = qm.write_comfy_quant(folder / name, flux_sd, variant, FLUX_KEEP, folder / oracle)
            comfyui.refresh_models()
            made[variant] = (name, oracle, layers)
        return made[variant]
    return get


def _load_ours(comfyui, name):
    """Load Diffusion Model (FP8, Metal) through ComfyUI's executor: (MODEL, the node's badge record)."""
    import importlib

    status = importlib.import_module(comfyui.pack_module.__name__ + ".nodes.status")
    _, start = status.records_since(0)
    prompt = {"1": {"class_type": "MetalFP8ModelLoader",
                    "inputs": {"unet_name": name, "weight_mode": "auto", "compute_dtype": "fp32"}}}
    res = comfyui.run_prompt(prompt, execute=["1"])
    model = res.node_outputs["1"][0]
    recs, _ = status.records_since(start)
    (rec,) = [r for r in recs if r["node_class"] == "MetalFP8ModelLoader"]
    return (model[0] if isinstance(model, list) else model), rec


def _flux_sample(comfyui, model, steps=3):
    g = torch.Generator().manual_seed(0)
    pos = [[torch.randn(1, 7, 64, generator=g), {"pooled_output": torch.randn(1, 32, generator=g)}]]
    neg = [[torch.randn(1, 7, 64, generator=g), {"pooled_output": torch.randn(1, 32, generator=g)}]]
    latent = {"samples": torch.zeros(1, 16, 8, 8)}
    (out,) = comfyui.nodes.KSampler().sample(model, 7, steps, 2.0, "euler", "simple", pos, neg, latent)
    return out["samples"].float()


def _check_stored_size(pack, model, layers, variant, path):
    """Every quantized layer holds exactly the file's bytes (no high-precision copy), at the format's bits."""
    qops = pack("nodes.quant.ops")
    mods = dict(qops.quant_modules(model.model.diffusion_model))
    assert sorted(mods) == sorted(layers)
    from safetensors import safe_open

    file_bytes = 0
    with safe_open(str(path), "pt") as f:
        for layer in layers:
            file_bytes += sum(f.get_tensor(k).nbytes for k in f.keys()
                              if k.startswith(layer + ".") and not k.endswith((".comfy_quant", ".bias")))
    stats = qops.weight_bytes(model.model.diffusion_model)
    assert stats["quant_bytes"] == file_bytes
    for m in mods.values():
        assert m.weight.dtype == torch.uint8 and not any(
            t.is_floating_point() and t.numel() >= m.weight.numel() for t in m.state_dict().values())
    bits = qm.VARIANTS[variant][4]
    # the format's bits a weight, plus its per-row scales (32 bits a row: 0.25 bits at K = 128)
    assert bits <= stats["bits_per_quant_weight"] <= bits + 0.27, stats
    import comfy.model_management as mm

    assert model.model_size() == mm.module_size(model.model)
    return stats


@pytest.mark.parametrize("variant", list(qm.VARIANTS))
def test_flux_matches_stock_loader_at_its_own_size(comfyui, pack, flux_file, variant):
    name, oracle, layers = flux_file(variant)
    ours, rec = _load_ours(comfyui, name)
    (stock,) = comfyui.nodes.UNETLoader().load_unet(name, "default")
    (deq,) = comfyui.nodes.UNETLoader().load_unet(oracle, "default")
    # the oracle really is ComfyUI's own path: its QuantizedTensor weights
    assert sum(type(getattr(m, "weight", None)).__name__ == "QuantizedTensor"
               for m in stock.model.modules()) == len(layers) >= 12
    stats = _check_stored_size(pack, ours, layers, variant, comfyui.models_dir("diffusion_models") / name)
    a, b, c = (_flux_sample(comfyui, m) for m in (ours, stock, deq))
    assert torch.isfinite(a).all()
    qops = pack("nodes.quant.ops")
    paths = qops.quant_paths(ours.model)
    print(f"flux {variant}: ours vs stock {rel(a, b):.2e}, ours vs dequantized {rel(a, c):.2e}, stock vs "
          f"dequantized {rel(b, c):.2e}; {stats['bits_per_quant_weight']:.3f} bits a weight; {paths}")
    if qm.VARIANTS[variant][0] in FLOAT_FORMATS:
        assert paths == {qops.WEIGHT_ONLY: len(layers)}
        assert "weight-only" in rec["note"]
        assert rel(a, b) < 1e-5 and rel(a, c) < 1e-5
    else:
        assert paths == {qops.COMFY_PATH: len(layers)}
        assert "ComfyUI's own INT8 matmul" in rec["note"] and "cpu" in rec["note"]
        # Same computation as stock; a one-ulp difference upstream flips activation roundings, so the two
        # agree within the format's own activation rounding (stock's distance to the exact weights).
        assert rel(a, b) <= 2 * rel(b, c) + 1e-5


@pytest.mark.parametrize("variant", [v for v in qm.VARIANTS if qm.VARIANTS[v][0] not in FLOAT_FORMATS])
def test_int8_formats_on_faked_mps_run_weight_only_without_int_mm(comfyui, pack, flux_file, variant, monkeypatch):
    """MPS has no _int_mm (`aten::_int_mm not implemented for MPS` at step 0 in stock ComfyUI): there the
    INT8 family runs weight-only, so it samples like the dequantized weights, and _int_mm is never called."""
    name, oracle, layers = flux_file(variant)
    qops = pack("nodes.quant.ops")
    calls = []

    def no_int_mm(*a, **k):
        calls.append(1)
        raise NotImplementedError("aten::_int_mm not implemented for MPS")

    monkeypatch.setattr(qops, "weight_only", lambda device: True)
    monkeypatch.setattr(torch, "_int_mm", no_int_mm)
    ours, rec = _load_ours(comfyui, name)
    assert "weight-only" in rec["note"] and "no _int_mm" in rec["note"]
    (deq,) = comfyui.nodes.UNETLoader().load_unet(oracle, "default")
    a, c = _flux_sample(comfyui, ours), _flux_sample(comfyui, deq)
    assert calls == [] and qops.quant_paths(ours.model) == {qops.WEIGHT_ONLY: len(layers)}
    print(f"flux {variant} weight-only: vs dequantized {rel(a, c):.2e}")
    assert rel(a, c) < 1e-5


@pytest.mark.parametrize("variant", ["nvfp4", "int8_tensorwise", "asym_w4a8_int8"])
def test_wan_matches_stock_loader(comfyui, pack, variant):
    """A second architecture: a tiny Wan 2.1 t2v (Conv3d patch embedding, 5-D video latents)."""
    import comfy.ldm.wan.model
    import comfy.ops

    net = comfy.ldm.wan.model.WanModel(model_type="t2v", dim=128, ffn_dim=256, num_heads=1, num_layers=2,
                                       dtype=torch.float32, operations=comfy.ops.manual_cast)
    fm.fill_module_(net, seed=2)
    sd = {k: v.detach().clone() for k, v in net.state_dict().items()}
    del net
    folder = comfyui.models_dir("diffusion_models")
    name, oracle = f"tiny_wan_{variant}.safetensors", f"tiny_wan_{variant}_dequantized.safetensors"
    layers = qm.write_comfy_quant(folder / name, sd, variant, WAN_KEEP, folder / oracle)
    comfyui.refresh_models()
    ours, _ = _load_ours(comfyui, name)
    (stock,) = comfyui.nodes.UNETLoader().load_unet(name, "default")
    (deq,) = comfyui.nodes.UNETLoader().load_unet(oracle, "default")
    assert type(ours.model).__name__ == type(stock.model).__name__ == "WAN21"
    _check_stored_size(pack, ours, layers, variant, folder / name)
    g = torch.Generator().manual_seed(0)
    pos, neg = [[torch.randn(1, 9, 4096, generator=g), {}]], [[torch.randn(1, 9, 4096, generator=g), {}]]
    latent = {"samples": torch.zeros(1, 16, 2, 8, 8)}
    a, b, c = (comfyui.nodes.KSampler().sample(m, 3, 3, 3.0, "euler", "simple", pos, neg, latent)[0]["samples"]
               .float() for m in (ours, stock, deq))
    print(f"wan {variant}: ours vs stock {rel(a, b):.2e}, stock vs dequantized {rel(b, c):.2e}")
    assert torch.isfinite(a).all() and len(layers) >= 16
    assert rel(a, b) <= 2 * rel(b, c) + 1e-5


@pytest.mark.parametrize("variant", ["nvfp4", "asym_w4a8_int8"])
def test_emulated_metal_kernels_sample_like_the_reference(comfyui, pack, flux_file, variant, monkeypatch):
    """The real Metal kernels (quant_gemv for the M = 2 modulation rows, quant_dequantize for the rest) in
    the MSL emulator, through the layers' launch glue, sample like the reference kernels; the file is
    never written to."""
    import hashlib

    from comfy_metal.metal_kernels.emulator import available

    if not available():
        pytest.skip("clang-19 not found: the MSL emulator cannot run")
    kernels = pack("metal_kernels")
    qops = pack("nodes.quant.ops")
    name, _, layers = flux_file(variant)
    path = comfyui.models_dir("diffusion_models") / name
    before = hashlib.sha256(path.read_bytes()).hexdigest()
    monkeypatch.setattr(qops, "weight_only", lambda device: True)      # the INT8 family's Mac path
    ours, _ = _load_ours(comfyui, name)
    want = _flux_sample(comfyui, ours, steps=1)
    monkeypatch.setenv("COMFY_METAL_BACKEND", "emulator")
    kernels.dispatch.reset()
    try:
        got = _flux_sample(comfyui, ours, steps=1)
        backends = dict(kernels.dispatch.last_backend)
    finally:
        monkeypatch.delenv("COMFY_METAL_BACKEND")
        kernels.dispatch.reset()
    assert backends.get("quant_dequantize") == "emulator" and backends.get("quant_gemv") == "emulator", backends
    assert hashlib.sha256(path.read_bytes()).hexdigest() == before
    print(f"flux {variant} emulated Metal kernels vs reference: rel {rel(got, want):.2e}")
    assert rel(got, want) < 1e-5


def test_bad_file_through_executor_names_file_tensor_expected_found(comfyui, flux_file, flux_sd):
    """A malformed NVFP4 file fails the node with one error naming the file, the tensor, what was expected
    and what was found; the server keeps running and loads the next file."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    name, _, layers = flux_file("nvfp4")
    folder = comfyui.models_dir("diffusion_models")
    with safe_open(str(folder / name), "pt") as f:
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    layer = layers[0]
    bad = dict(tensors)
    bad[f"{layer}.weight_scale"] = bad[f"{layer}.weight_scale"][:64]           # half the block scales
    save_file(bad, str(folder / "bad_scales_nvfp4.safetensors"))
    comfyui.refresh_models()
    prompt = {"1": {"class_type": "MetalFP8ModelLoader",
                    "inputs": {"unet_name": "bad_scales_nvfp4.safetensors", "weight_mode": "auto",
                               "compute_dtype": "fp32"}}}
    with pytest.raises(comfyui_env.ComfyPromptError) as e:
        comfyui.run_prompt(prompt, execute=["1"])
    msg = str(e.value)
    assert "bad_scales_nvfp4.safetensors" in msg and f"{layer}.weight_scale" in msg, msg
    assert "expected" in msg and "[64, " in msg, msg
    prompt["1"]["inputs"]["unet_name"] = name
    comfyui.run_prompt(prompt, execute=["1"])


@pytest.mark.parametrize("mode, variant", [("nvfp4", "nvfp4"), ("int8 tensorwise", "int8_tensorwise")])
def test_quantize_on_load_equals_comfyuis_own_quantization(comfyui, pack, flux_sd, mode, variant):
    """weight_mode nvfp4 / int8 tensorwise quantizes a bf16 file's Linear weights while loading, with ComfyUI's
    own quantizers: the layers hold exactly what a file quantized by ComfyUI would (same bytes), at that size."""
    from safetensors.torch import save_file

    folder = comfyui.models_dir("diffusion_models")
    src = folder / "tiny_flux_bf16_quant_src.safetensors"
    if not src.exists():
        save_file({k: v.to(torch.bfloat16).contiguous() for k, v in flux_sd.items()}, str(src))
        comfyui.refresh_models()
    (ours,) = pack("nodes.fp8.nodes").MetalFP8ModelLoader().load(src.name, mode, "fp32")
    qops = pack("nodes.quant.ops")
    mods = dict(qops.quant_modules(ours.model.diffusion_model))
    assert len(mods) >= 8 and qops.quant_formats(ours.model) == {qm.VARIANTS[variant][0]: len(mods)}
    import comfy.quant_ops as cq

    bf16 = {k: v.to(torch.bfloat16) for k, v in flux_sd.items()}
    for name, m in mods.items():
        qt = cq.QuantizedTensor.from_float(bf16[name + ".weight"].float(), qm.VARIANTS[variant][1])
        assert torch.equal(m.weight.view(torch.uint8), qt._qdata.view(torch.uint8)), name
    stats = qops.weight_bytes(ours.model)
    assert qm.VARIANTS[variant][4] <= stats["bits_per_quant_weight"] <= qm.VARIANTS[variant][4] + 0.01
    assert torch.isfinite(_flux_sample(comfyui, ours, steps=1)).all()


@pytest.mark.parametrize("variant", ["asym_w4a8_int8"])
def test_text_encoder_matches_stock_on_the_dequantized_weights(comfyui, pack, variant, monkeypatch):
    """A full-size random CLIP-L (ComfyUI's CLIPTextModel, its tokenizer ships with ComfyUI) with its Linear
    layers quantized by ComfyUI, through Load Text Encoder (FP8, Metal) and CLIPTextEncode in the executor,
    weight-only (W4A8: the Mac path, faked here), against the stock CLIPLoader on ComfyUI's dequantized
    weights (fp16, ComfyUI's CPU text-encoder dtype)."""
    import json
    import os

    import comfy.clip_model
    import comfy.ops
    import comfy.sd1_clip
    from safetensors.torch import load_file, save_file

    with open(os.path.join(os.path.dirname(comfy.sd1_clip.__file__), "sd1_clip_config.json")) as f:
        config = json.load(f)
    net = comfy.clip_model.CLIPTextModel(config, torch.float32, "cpu", comfy.ops.manual_cast)
    fm.fill_module_(net, seed=5, std=0.02)
    sd = {k: v.detach().clone() for k, v in net.state_dict().items()}
    del net
    folder = comfyui.models_dir("text_encoders")
    name, oracle = f"clip_l_{variant}.safetensors", f"clip_l_{variant}_dequantized.safetensors"
    layers = qm.write_comfy_quant(folder / name, sd, variant, ("embeddings", "text_projection"), folder / oracle)
    save_file({k: v.to(torch.float16).contiguous() for k, v in load_file(str(folder / oracle)).items()},
              str(folder / oracle))
    comfyui.refresh_models()
    assert len(layers) == 72
    qops = pack("nodes.quant.ops")
    monkeypatch.setattr(qops, "weight_only", lambda device: True)
    text = "a photo of a cat on a red sofa"
    prompt = {"1": {"class_type": "MetalFP8TextEncoderLoader",
                    "inputs": {"clip_name": name, "type": "stable_diffusion", "device": "cpu"}},
              "2": {"class_type": "CLIPTextEncode", "inputs": {"clip": ["1", 0], "text": text}}}
    res = comfyui.run_prompt(prompt, execute=["1", "2"])
    ours, ca = res.node_outputs["1"][0], res.node_outputs["2"][0]
    ours = ours[0] if isinstance(ours, list) else ours
    if not isinstance(ca[0][0], torch.Tensor):
        ca = ca[0]
    assert len(dict(qops.quant_modules(ours.cond_stage_model))) == 72
    assert qops.quant_paths(ours.cond_stage_model) == {qops.WEIGHT_ONLY: 72}
    (stock,) = comfyui.nodes.CLIPLoader().load_clip(oracle, "stable_diffusion", "cpu")
    (cb,) = comfyui.nodes.CLIPTextEncode().encode(stock, text)
    a, b = ca[0][0].float(), cb[0][0].float()
    pa, pb = ca[0][1]["pooled_output"].float(), cb[0][1]["pooled_output"].float()
    print(f"clip-l {variant} ours vs stock(dequantized): cond rel {rel(a, b):.2e}, pooled rel {rel(pa, pb):.2e}")
    # both in ComfyUI's CPU text-encoder dtype (fp16): only the rounding of the dequantized weights differs
    assert torch.isfinite(a).all() and a.shape == b.shape and rel(a, b) < 1e-2 and rel(pa, pb) < 1e-2
