"""FP8 loading inside a real ComfyUI ($COMFYUI_PATH; skipped with the reason printed otherwise).

A tiny random Flux-shaped diffusion model (ComfyUI's own Flux class, tiny widths and depth, weights
filled explicitly) is quantized to an FP8 comfy_quant file, loaded through MetalFP8ModelLoader and
sampled with ComfyUI's KSampler on CPU; the oracle is ComfyUI's stock UNETLoader on the same FP8 file
(ComfyUI dequantizes it itself). The same for a CLIP-L text encoder through CLIPTextEncode against
the stock CLIPLoader. Also: LoRA through ComfyUI's LoraLoaderModelOnly path, memory accounting,
the save node, and a whole node run with COMFY_METAL_BACKEND=emulator.
"""
from __future__ import annotations

import pytest
import torch

import fp8_models as fm

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

FLUX_CFG = dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=32, context_in_dim=64,
                hidden_size=128, mlp_ratio=4.0, num_heads=1, depth=2, depth_single_blocks=1,
                axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True, guidance_embed=False,
                txt_ids_dims=[])


@pytest.fixture(scope="module")
def flux_files(comfyui, loader_mod):
    """(bf16 file name, fp8 file name) in the diffusion_models folder."""
    import comfy.ldm.flux.model
    import comfy.ops
    from safetensors.torch import save_file

    quant = fm.pack_module(loader_mod, "nodes.fp8.quantize")
    folder = comfyui.models_dir("diffusion_models")
    net = comfy.ldm.flux.model.Flux(**FLUX_CFG, dtype=torch.float32, operations=comfy.ops.manual_cast)
    fm.fill_module_(net, seed=1)
    sd = {k: v.to(torch.bfloat16).contiguous() for k, v in net.state_dict().items()}
    src = folder / "tiny_flux_bf16.safetensors"
    save_file(sd, str(src))
    dst = folder / "tiny_flux_fp8.safetensors"
    if dst.exists():
        dst.unlink()
    summary = quant.quantize_file(str(src), str(dst), "e4m3fn")
    assert len(summary.errors) >= 8, summary.text()
    save_file(_dequantized(loader_mod, dst), str(folder / "tiny_flux_dequantized.safetensors"))
    comfyui.refresh_models()
    return src.name, dst.name, summary


def _dequantized(loader_mod, path) -> dict:
    fmt_mod = fm.pack_module(loader_mod, "nodes.fp8.formats")
    return fm.dequantized_file(fmt_mod, path)


def _conds(seed=0):
    g = torch.Generator().manual_seed(seed)
    pos = [[torch.randn(1, 7, 64, generator=g), {"pooled_output": torch.randn(1, 32, generator=g)}]]
    neg = [[torch.randn(1, 7, 64, generator=g), {"pooled_output": torch.randn(1, 32, generator=g)}]]
    return pos, neg


def _sample(comfyui, model, steps=3, hooks=None):
    pos, neg = _conds()
    if hooks is not None:   # a scheduled ("hook") LoRA, attached to the conditioning as ComfyUI's nodes do
        import comfy.hooks

        pos, neg = (comfy.hooks.set_hooks_for_conditioning(c, hooks) for c in (pos, neg))
    latent = {"samples": torch.zeros(1, 16, 8, 8)}
    (out,) = comfyui.nodes.KSampler().sample(model, 7, steps, 2.0, "euler", "simple", pos, neg, latent, denoise=1.0)
    return out["samples"].float()


def test_flux_fp8_matches_stock_loader(comfyui, loader_mod, flux_files):
    _, fp8_name, _ = flux_files
    (ours,) = loader_mod.MetalFP8ModelLoader().load(fp8_name, "auto", "fp32")
    (stock,) = comfyui.nodes.UNETLoader().load_unet(fp8_name, "default")
    ops_mod = fm.pack_module(loader_mod, "nodes.fp8.ops")
    n_fp8 = sum(1 for _ in ops_mod.fp8_modules(ours.model))
    assert n_fp8 >= 8
    a = _sample(comfyui, ours)
    b = _sample(comfyui, stock)
    assert torch.isfinite(a).all()
    rel = ((a - b).norm() / b.norm()).item()
    print(f"flux fp8 ours vs stock: rel {rel:.2e}, {n_fp8} FP8 layers")
    # Same FP8 values and scales dequantized by both; only summation order/dtype differ.
    assert rel < 1e-3, rel


def test_wan_fp8_matches_stock_loader(comfyui, loader_mod):
    """A second architecture: a tiny Wan 2.1 t2v (Conv3d patch embedding, 5-D video latents)."""
    import comfy.ldm.wan.model
    import comfy.ops
    from safetensors.torch import save_file

    quant = fm.pack_module(loader_mod, "nodes.fp8.quantize")
    ops_mod = fm.pack_module(loader_mod, "nodes.fp8.ops")
    folder = comfyui.models_dir("diffusion_models")
    net = comfy.ldm.wan.model.WanModel(model_type="t2v", dim=128, ffn_dim=256, num_heads=1, num_layers=2,
                                       dtype=torch.float32, operations=comfy.ops.manual_cast)
    fm.fill_module_(net, seed=2)
    src = folder / "tiny_wan_bf16.safetensors"
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in net.state_dict().items()}, str(src))
    del net
    dst = folder / "tiny_wan_fp8.safetensors"
    if dst.exists():
        dst.unlink()
    summary = quant.quantize_file(str(src), str(dst), "e4m3fn")
    assert len(summary.errors) >= 10, summary.text()
    comfyui.refresh_models()
    (ours,) = loader_mod.MetalFP8ModelLoader().load(dst.name, "auto", "fp32")
    (stock,) = comfyui.nodes.UNETLoader().load_unet(dst.name, "default")
    assert type(ours.model).__name__ == type(stock.model).__name__ == "WAN21"
    # The oracle really is ComfyUI's own FP8 path (its QuantizedTensor weights), not our op set.
    assert sum(type(getattr(m, "weight", None)).__name__ == "QuantizedTensor" for m in stock.model.modules()) \
        == len(summary.errors)
    assert sum(1 for _ in ops_mod.fp8_modules(ours.model)) == len(summary.errors)
    g = torch.Generator().manual_seed(0)
    pos, neg = [[torch.randn(1, 9, 4096, generator=g), {}]], [[torch.randn(1, 9, 4096, generator=g), {}]]
    latent = {"samples": torch.zeros(1, 16, 2, 8, 8)}
    outs = [comfyui.nodes.KSampler().sample(m, 3, 3, 3.0, "euler", "simple", pos, neg, latent)[0]["samples"].float()
            for m in (ours, stock)]
    rel = ((outs[0] - outs[1]).norm() / outs[1].norm()).item()
    print(f"wan fp8 ours vs stock: rel {rel:.2e}")
    assert torch.isfinite(outs[0]).all() and rel < 1e-3


def test_memory_accounting_sees_fp8_bytes(comfyui, loader_mod, flux_files):
    import comfy.model_management as mm

    bf16_name, fp8_name, _ = flux_files
    (ours,) = loader_mod.MetalFP8ModelLoader().load(fp8_name, "auto", "bf16")
    ops_mod = fm.pack_module(loader_mod, "nodes.fp8.ops")
    fp8_bytes = 0
    fp8_elems = 0
    for _, m in ops_mod.fp8_modules(ours.model):
        assert m.weight.element_size() == 1
        fp8_elems += m.weight.numel()
    # ComfyUI's own accounting (module_size = nbytes of the state dict) against a bf16 load.
    (bf16,) = loader_mod.MetalFP8ModelLoader().load(bf16_name, "auto", "bf16")
    size_fp8, size_bf16 = ours.model_size(), bf16.model_size()
    assert size_fp8 == mm.module_size(ours.model)
    saved = size_bf16 - size_fp8
    # Every FP8 weight saves one byte (bf16 -> fp8), minus 4 bytes of scale per layer.
    assert saved >= fp8_elems - 4 * 64, (size_fp8, size_bf16, fp8_elems)
    del fp8_bytes


def test_quantize_on_load_and_save_roundtrip(comfyui, loader_mod, flux_files, tmp_path, caplog):
    import logging

    caplog.set_level(logging.INFO, logger="comfy_metal")
    bf16_name, fp8_name, _ = flux_files
    ops_mod = fm.pack_module(loader_mod, "nodes.fp8.ops")
    saver = loader_mod.MetalFP8SaveModel()
    for mode in ("e4m3fn rowwise", "e4m3fn tensorwise"):
        (q,) = loader_mod.MetalFP8ModelLoader().load(bf16_name, mode, "fp32")
        layers = dict(ops_mod.fp8_modules(q.model))
        assert len(layers) >= 8
        assert all((m.weight_scale.numel() > 1) == mode.endswith("rowwise") for m in layers.values())
        # The per-layer error summary is in the log.
        assert any("layers quantized" in r.getMessage() and "relative error" in r.getMessage()
                   for r in caplog.records), [r.getMessage() for r in caplog.records][-5:]
        caplog.clear()
        stem = "tiny_flux_saved_" + mode.split()[1]
        name = saver.save(q, stem, "e4m3fn tensorwise", False)["ui"]["text"][0]
        comfyui.refresh_models()
        with pytest.raises(FileExistsError):
            saver.save(q, stem, "e4m3fn tensorwise", False)
        (ours,) = loader_mod.MetalFP8ModelLoader().load(name, "auto", "fp32")
        a, c = _sample(comfyui, ours, 2), _sample(comfyui, q, 2)
        assert ((a - c).norm() / c.norm()).item() < 1e-5       # save -> load is lossless
        if mode.endswith("tensorwise"):
            # ComfyUI's stock loader reads the saved comfy_quant file with the same result. (Per-row
            # scales are a Comfy Metal extension: ComfyUI 0.33's FP8 layout is tensorwise only.)
            (stock,) = comfyui.nodes.UNETLoader().load_unet(name, "default")
            b = _sample(comfyui, stock, 2)
            assert ((a - b).norm() / b.norm()).item() < 1e-3


def test_save_node_quantizes_a_stock_model(comfyui, loader_mod, flux_files):
    """MetalFP8SaveModel on a MODEL from ComfyUI's stock loader (no FP8 layers): its Linear weights are
    quantized per the keep rules into a comfy_quant file that both loaders read the same way."""
    bf16_name, _, _ = flux_files
    (stock_bf16,) = comfyui.nodes.UNETLoader().load_unet(bf16_name, "default")
    name = loader_mod.MetalFP8SaveModel().save(stock_bf16, "tiny_flux_from_stock", "e4m3fn tensorwise",
                                               False)["ui"]["text"][0]
    comfyui.refresh_models()
    fmt_mod = fm.pack_module(loader_mod, "nodes.fp8.formats")
    with fmt_mod.open_checkpoint(comfyui.models_dir("diffusion_models") / name) as ck:
        assert ck.quant_source == "comfy_quant" and len(ck.layers) >= 8
        assert "img_in.weight" not in ck.layers and "final_layer.linear.weight" not in ck.layers
    (ours,) = loader_mod.MetalFP8ModelLoader().load(name, "auto", "fp32")
    (stock,) = comfyui.nodes.UNETLoader().load_unet(name, "default")
    a, b, ref = _sample(comfyui, ours, 2), _sample(comfyui, stock, 2), _sample(comfyui, stock_bf16, 2)
    assert ((a - b).norm() / b.norm()).item() < 1e-3
    assert ((a - ref).norm() / ref.norm()).item() < 0.1      # FP8 stays close to the original model


def test_lora_applies_on_decoded_weight(comfyui, loader_mod, flux_files):
    """A LoRA on an FP8 layer (ComfyUI's own LoRA loading): equals the stock loader with the same LoRA
    on the dequantized fp32 weights, and the FP8 bytes stay untouched (no re-quantization). (ComfyUI's
    stock path on the FP8 file re-quantizes the patched weight, which adds FP8 rounding error.)"""
    _, fp8_name, _ = flux_files
    (ours,) = loader_mod.MetalFP8ModelLoader().load(fp8_name, "auto", "fp32")
    (stock,) = comfyui.nodes.UNETLoader().load_unet("tiny_flux_dequantized.safetensors", "default")
    key = "diffusion_model.double_blocks.0.img_attn.qkv.weight"
    op = ours.model.get_submodule(key.rsplit(".", 1)[0])
    before = op.weight.detach().clone()
    g = torch.Generator().manual_seed(3)
    up, down = torch.randn(op.out_features, 4, generator=g) * 0.5, torch.randn(4, op.in_features, generator=g) * 0.5
    layer = key[: -len(".weight")]
    lora = {f"{layer}.lora_up.weight": up, f"{layer}.lora_down.weight": down}
    import comfy.sd

    outs = []
    for m in (ours, stock):
        p, _ = comfy.sd.load_lora_for_models(m, None, dict(lora), 1.0, 0)   # what LoraLoaderModelOnly does
        assert key in p.patches, list(p.patches)[:3]
        outs.append(_sample(comfyui, p, 2))
    plain = _sample(comfyui, ours, 2)
    rel = ((outs[0] - outs[1]).norm() / outs[1].norm()).item()
    effect = ((outs[0] - plain).norm() / plain.norm()).item()
    print(f"lora: ours vs stock rel {rel:.2e}, lora effect {effect:.2e}")
    assert effect > 1e-3          # the LoRA changed the output
    assert rel < 1e-3
    assert torch.equal(op.weight.detach().cpu(), before.cpu()) and op.weight.element_size() == 1
    assert op.fp8_lora_patch is None   # unpatched after sampling
    # The same LoRA as a weight hook (Create Hook LoRA + conditioning hooks): applied on the decoded weight.
    import comfy.hooks

    hooked = [_sample(comfyui, m.clone(), 2, hooks=comfy.hooks.create_hook_lora(dict(lora), 1.0, 0.0))
              for m in (ours, stock)]
    rel_hook = ((hooked[0] - hooked[1]).norm() / hooked[1].norm()).item()
    print(f"hook lora: ours vs stock rel {rel_hook:.2e}")
    assert rel_hook < 1e-3
    assert ((hooked[0] - outs[0]).norm() / outs[0].norm()).item() < 1e-3    # same as the plain LoRA
    assert torch.equal(op.weight.detach().cpu(), before.cpu()) and op.fp8_hook_patch is None


def test_lora_full_and_lowvram_loads_agree(comfyui, loader_mod, flux_files):
    """ComfyUI's two ways of loading a patched layer: fully loaded (MetalFP8ModelPatcher installs the
    patch) and lowvram (ComfyUI's own LowVramPatch in weight_function); both give decode + LoRA."""
    import comfy.model_patcher
    import comfy.sd

    _, fp8_name, _ = flux_files
    (ours,) = loader_mod.MetalFP8ModelLoader().load(fp8_name, "auto", "fp32")
    key = "diffusion_model.single_blocks.0.linear1.weight"
    op = ours.model.get_submodule(key.rsplit(".", 1)[0])
    g = torch.Generator().manual_seed(4)
    up, down = torch.randn(op.out_features, 2, generator=g), torch.randn(2, op.in_features, generator=g)
    layer = key[: -len(".weight")]
    p, _ = comfy.sd.load_lora_for_models(ours, None, {f"{layer}.lora_up.weight": up,
                                                      f"{layer}.lora_down.weight": down}, 0.5, 0)
    x = torch.randn(12, op.in_features, generator=g)
    want = torch.nn.functional.linear(x, op.decoded_weight(dtype=torch.float32) + 0.5 * up @ down, op.bias)
    cpu = torch.device("cpu")
    p.patch_model(device_to=cpu, lowvram_model_memory=0)          # full load
    assert op.fp8_lora_patch is not None
    y_full = op(x)
    p.unpatch_model(cpu)
    assert op.fp8_lora_patch is None
    y_plain = op(x)
    p.patch_model(device_to=cpu, lowvram_model_memory=1)          # nothing fits: every layer lowvram
    assert any(isinstance(f, comfy.model_patcher.LowVramPatch) for f in op.weight_function)
    y_low, y_low_gemv = op(x), op(x[:2])                           # M = 2 with a patch: decode path
    p.unpatch_model(cpu)
    assert not op.weight_function and op.weight.element_size() == 1
    torch.testing.assert_close(y_full, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y_low, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y_low_gemv, want[:2], rtol=1e-5, atol=1e-5)
    assert (y_plain - want).abs().max() > 1e-2


def test_loader_node_through_executor_and_emulator(comfyui, loader_mod, flux_files, monkeypatch):
    """MetalFP8ModelLoader runs as a node through ComfyUI's executor; then the loaded model's forward
    runs fp8_decode and gemv through the MSL emulator."""
    from comfy_metal.metal_kernels import dispatch

    kernels = fm.pack_module(loader_mod, "metal_kernels")
    _, fp8_name, _ = flux_files
    prompt = {"1": {"class_type": "MetalFP8ModelLoader",
                    "inputs": {"unet_name": fp8_name, "weight_mode": "auto", "compute_dtype": "fp32"}}}
    res = comfyui.run_prompt(prompt, execute=["1"])
    model = res.node_outputs["1"][0]
    model = model[0] if isinstance(model, list) else model
    from comfy_metal.metal_kernels.emulator import available

    if not available():
        pytest.skip("clang-19 not found: the MSL emulator is unavailable")
    dm = model.model.diffusion_model
    op = dm.double_blocks[0].img_mod.lin
    monkeypatch.setenv("COMFY_METAL_BACKEND", "emulator")
    for mod in (dispatch, kernels.dispatch):
        mod.reset()
    try:
        x = torch.randn(2, op.in_features)
        y = op(x)                    # M = 2 -> gemv
        xb = torch.randn(9, op.in_features)
        yb = op(xb)                  # M = 9 -> fp8_decode + matmul
        backends = dict(kernels.dispatch.last_backend)
    finally:
        monkeypatch.delenv("COMFY_METAL_BACKEND")
        for mod in (dispatch, kernels.dispatch):
            mod.reset()
    w = op.decoded_weight(dtype=torch.float32)
    ref = torch.nn.functional.linear(x, w, op.bias)
    refb = torch.nn.functional.linear(xb, w, op.bias)
    assert backends.get("gemv") == "emulator" and backends.get("fp8_decode") == "emulator", backends
    torch.testing.assert_close(y, ref, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(yb, refb, rtol=1e-4, atol=1e-4)


def test_bad_files_give_clear_node_errors(comfyui, loader_mod, flux_files):
    folder = comfyui.models_dir("diffusion_models")
    _, fp8_name, _ = flux_files
    data = (folder / fp8_name).read_bytes()
    (folder / "truncated_fp8.safetensors").write_bytes(data[: len(data) // 2])
    comfyui.refresh_models()
    prompt = {"1": {"class_type": "MetalFP8ModelLoader",
                    "inputs": {"unet_name": "truncated_fp8.safetensors", "weight_mode": "auto",
                               "compute_dtype": "auto"}}}
    import comfyui_env

    with pytest.raises(comfyui_env.ComfyPromptError) as e:
        comfyui.run_prompt(prompt, execute=["1"])
    msg = str(e.value)
    assert "truncated_fp8.safetensors" in msg and "truncated" in msg and "tensor" in msg
    # The server keeps working: a good prompt runs afterwards.
    prompt["1"]["inputs"]["unet_name"] = fp8_name
    comfyui.run_prompt(prompt, execute=["1"])


# ------------------------------------------------------------------ saving a quantized fp16 Wan file

# Text width 32 (not Wan's 4096): ComfyUI detects it only from the file's "config" metadata.
WAN_META_CFG = dict(model_type="t2v", dim=128, ffn_dim=256, num_heads=1, num_layers=3, text_dim=32)


@pytest.fixture(scope="module")
def wan_fp16_file(comfyui):
    """A tiny Wan 2.1 t2v file in fp16 with "config" metadata (as the real Wan files carry)."""
    import json

    import comfy.ldm.wan.model
    import comfy.ops
    from safetensors.torch import save_file

    net = comfy.ldm.wan.model.WanModel(**WAN_META_CFG, dtype=torch.float32, operations=comfy.ops.manual_cast)
    fm.fill_module_(net, seed=5)
    src = comfyui.models_dir("diffusion_models") / "tiny_wan_meta_fp16.safetensors"
    meta = {"config": json.dumps({"transformer": {"text_dim": WAN_META_CFG["text_dim"]}}),
            "_quantization_metadata": json.dumps({"format_version": "1.0", "layers": {}})}
    save_file({k: v.to(torch.float16).contiguous() for k, v in net.state_dict().items()}, str(src), metadata=meta)
    comfyui.refresh_models()
    return src


def _saved(loader_mod, comfyui, src_name, stem, mode="e4m3fn rowwise"):
    (q,) = loader_mod.MetalFP8ModelLoader().load(src_name, mode, "fp32")
    target = comfyui.models_dir("diffusion_models") / (stem + ".safetensors")
    target.unlink(missing_ok=True)
    loader_mod.MetalFP8SaveModel().save(q, stem, mode, False)
    comfyui.refresh_models()
    return q, target


def _wan_sample(comfyui, model):
    g = torch.Generator().manual_seed(0)
    pos = [[torch.randn(1, 5, WAN_META_CFG["text_dim"], generator=g), {}]]
    neg = [[torch.randn(1, 5, WAN_META_CFG["text_dim"], generator=g), {}]]
    latent = {"samples": torch.zeros(1, 16, 1, 8, 8)}
    return comfyui.nodes.KSampler().sample(model, 3, 2, 3.0, "euler", "simple", pos, neg, latent)[0]["samples"].float()


def test_save_keeps_source_dtypes_and_is_smaller(comfyui, loader_mod, wan_fp16_file, caplog):
    """Quantize-on-load + save of an fp16 file: tensors that are not FP8 stay fp16 (not the float32 of
    the in-memory compute dtype), so the output is smaller than the source; the log says which dtype."""
    import logging

    from safetensors import safe_open

    caplog.set_level(logging.INFO, logger="comfy_metal")
    fmt_mod = fm.pack_module(loader_mod, "nodes.fp8.formats")
    q, target = _saved(loader_mod, comfyui, wan_fp16_file.name, "tiny_wan_meta_fp8_rowwise")
    # the model really computes in float32 in memory
    assert q.model.diffusion_model.head.head.weight.dtype == torch.float32
    with fmt_mod.open_checkpoint(target) as ck:
        assert len(ck.layers) >= 12
        rest = {k: ck.entries[k].dtype for k in ck.model_keys() if k not in ck.layers}
    assert rest and set(rest.values()) == {"F16"}, rest
    with safe_open(str(wan_fp16_file), "pt") as f:
        assert set(rest) <= set(f.keys())
    assert target.stat().st_size < wan_fp16_file.stat().st_size, (target.stat().st_size,
                                                                  wan_fp16_file.stat().st_size)
    msgs = [r.getMessage() for r in caplog.records]
    assert any("source file's dtype (float16)" in m for m in msgs), msgs[-3:]


def test_save_carries_metadata_and_reloads(comfyui, loader_mod, wan_fp16_file):
    """The source's header metadata (Wan's "config", which detection needs) is in the saved file,
    the stale quantization metadata replaced by the new one; the file reloads through the loader."""
    import json

    from safetensors import safe_open

    q, target = _saved(loader_mod, comfyui, wan_fp16_file.name, "tiny_wan_meta_fp8_tensorwise", "e4m3fn tensorwise")
    with safe_open(str(target), "pt") as f:
        meta = f.metadata()
    assert json.loads(meta["config"]) == {"transformer": {"text_dim": WAN_META_CFG["text_dim"]}}
    assert len(json.loads(meta["_quantization_metadata"])["layers"]) >= 12
    (again,) = loader_mod.MetalFP8ModelLoader().load(target.name, "auto", "fp32")
    assert type(again.model).__name__ == "WAN21"
    a, b = _wan_sample(comfyui, again), _wan_sample(comfyui, q)
    assert torch.isfinite(a).all() and ((a - b).norm() / b.norm()).item() < 1e-5


def test_badges_loader_saver_and_sampling(comfyui, loader_mod, wan_fp16_file):
    """record_node_backend: the loader and saver nodes record their kernels; a KSampler run of an FP8
    model records fp8_decode/gemv for the executing node (node_class None), once per run."""
    status = fm.pack_module(loader_mod, "nodes.status")
    _, start = status.records_since(0)
    q, _ = _saved(loader_mod, comfyui, wan_fp16_file.name, "tiny_wan_meta_badges")
    recs, mid = status.records_since(start)
    by_class = {r["node_class"]: r for r in recs}
    assert set(by_class["MetalFP8ModelLoader"]["kernels"]) == {"fp8_encode", "fp8_decode"}, recs
    assert by_class["MetalFP8ModelLoader"]["backend"] in ("reference", "metal", "emulator", "mixed")
    assert by_class["MetalFP8SaveModel"]["kernels"] == {}      # FP8 layers are saved as they are
    assert None not in by_class                                # nothing ran a sampler yet
    _wan_sample(comfyui, q)
    recs, _ = status.records_since(mid)
    runs = [r for r in recs if r["node_class"] is None]
    assert len(runs) == 1, recs
    assert "fp8_decode" in runs[0]["kernels"], runs[0]
