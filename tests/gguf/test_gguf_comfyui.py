"""GGUF loading inside a real ComfyUI ($COMFYUI_PATH; skipped with the reason printed otherwise).

A tiny random Flux (ComfyUI's own Flux class at tiny widths, weights filled explicitly) is written as
GGUF (Q8_0, Q4_K) with gguf.GGUFWriter, loaded through MetalGGUFModelLoader and sampled with ComfyUI's
KSampler on CPU. The oracle: the same file dequantised by the gguf package to fp32 .safetensors,
loaded with ComfyUI's stock UNETLoader. Also: weights stay quantised (memory accounting), LoRA, the
Metal kernels through the emulator, and bad files.
"""
from __future__ import annotations

import importlib

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
