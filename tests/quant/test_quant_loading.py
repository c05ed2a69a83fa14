"""Reading comfy_quant block-format files and the layers that keep them (no ComfyUI needed).

Files are written with comfy_kitchen's own quantizers and ComfyUI's serialisation (quant_models.py);
the layers (the FP8 op set on plain torch.nn) must compute with comfy_kitchen's dequantized weights,
keep the stored bytes, apply LoRA patches to the dequantized weight, gather INT8 embedding rows like
comfy_kitchen, and choose the GEMV on (faked) MPS only where it was measured faster. Bad files: one
error naming the file, the tensor, what was expected and what was found.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

import quant_models as qm
from comfy_metal.metal_kernels import dispatch
from comfy_metal.nodes.fp8 import formats, loader
from comfy_metal.nodes.fp8 import ops as fp8_ops
from comfy_metal.nodes.quant import formats as qformats
from comfy_metal.nodes.quant import ops as qops

ck = pytest.importorskip("comfy_kitchen", reason="comfy_kitchen (ComfyUI's requirements) is the oracle")
from comfy_kitchen.tensor import QuantizedTensor  # noqa: E402
from fake_clock import FakeClock  # noqa: E402

K, N, HIDDEN = 128, 64, 256


def _sd(seed=0):
    g = torch.Generator().manual_seed(seed)
    return {"fc1.weight": torch.randn(HIDDEN, K, generator=g) * K ** -0.5,
            "fc1.bias": torch.randn(HIDDEN, generator=g) * 0.1,
            "fc2.weight": torch.randn(N, HIDDEN, generator=g) * HIDDEN ** -0.5,
            "norm.weight": torch.ones(K), "norm.bias": torch.zeros(K)}


class Net(torch.nn.Module):
    def __init__(self, ops):
        super().__init__()
        self.norm = ops.LayerNorm(K)
        self.fc1 = ops.Linear(K, HIDDEN)
        self.fc2 = ops.Linear(HIDDEN, N, bias=False)

    def forward(self, x):
        return self.fc2(torch.nn.functional.gelu(self.fc1(self.norm(x))))


def _load(path, name="test.safetensors"):
    ck_ = formats.open_checkpoint(path)
    sd, _ = loader.build_state_dict(ck_)
    net = Net(fp8_ops.make_fp8_ops(name, standalone=True))
    missing, unexpected = net.load_state_dict(sd, strict=False)
    assert not unexpected and missing == [], (missing, unexpected)
    return net, ck_


def _write(tmp_path, variant, sd=None):
    path = tmp_path / f"{variant}.safetensors"
    oracle = tmp_path / f"{variant}_deq.safetensors"
    layers = qm.write_comfy_quant(path, sd or _sd(), variant, oracle_path=oracle, comfyui=False)
    from safetensors.torch import load_file

    return path, layers, load_file(str(oracle))


@pytest.mark.parametrize("variant", list(qm.VARIANTS))
def test_layers_compute_with_comfy_kitchens_weights_at_the_stored_size(tmp_path, variant):
    path, layers, deq = _write(tmp_path, variant)
    assert layers == ["fc1", "fc2"]
    net, ck_ = _load(path)
    assert sorted(ck_.quant_layers) == ["fc1.weight", "fc2.weight"] and qm.VARIANTS[variant][0] in ck_.describe()
    ref = Net(fp8_ops.make_fp8_ops(standalone=True))
    ref.load_state_dict(deq)
    for M in (1, 3, 8, 20):              # GEMV and dequantise + matmul
        x = torch.randn(M, K)
        torch.testing.assert_close(net(x), ref(x), rtol=2e-5, atol=2e-6)
    # the standalone op set (no ComfyUI in its layers): every format weight-only
    assert qops.quant_paths(net) == {qops.WEIGHT_ONLY: 2}
    stats = qops.weight_bytes(net)
    assert stats["quant_weights"] == HIDDEN * K + N * HIDDEN
    held, as_bf16 = fp8_ops.quantized_memory(net)        # what the status displays say the loader saves
    assert held == sum(t.nbytes for t in net.state_dict().values())
    assert as_bf16 == held - stats["quant_bytes"] + 2 * stats["quant_weights"]
    bits = qm.VARIANTS[variant][4]
    assert bits <= stats["bits_per_quant_weight"] <= bits + 0.27 + (0.8 if variant == "nvfp4" else 0)  # N = 64:
    # NVFP4's swizzled block scales are padded to 128 rows
    for _, m in qops.quant_modules(net):
        assert m.weight.dtype == torch.uint8
        assert m.decoded_weight(dtype=torch.float32).shape == m.quant_shape


def test_lora_patch_applies_to_the_dequantized_weight(tmp_path):
    path, _, deq = _write(tmp_path, "asym_w4a8_int8")
    net, _ = _load(path)
    delta = torch.randn(HIDDEN, K) * 0.01
    net.fc1.weight_function = [lambda w: w + delta.to(w.dtype)]
    x = torch.randn(2, K)
    h = net.norm(x)
    torch.testing.assert_close(net.fc1(h), h @ (deq["fc1.weight"] + delta).T + deq["fc1.bias"], rtol=1e-5, atol=1e-5)
    assert net.fc1.quant_last_path == "dequantised (patched)"


@pytest.mark.parametrize("convrot", [0, 64])
def test_int8_embedding_gathers_rows_like_comfy_kitchen(convrot):
    from comfy_kitchen.backends.eager.quantization import dequantize_int8_embedding

    vocab, dim = 50, 128
    w = torch.randn(vocab, dim)
    kw = {"per_channel": True, "convrot": True, "convrot_groupsize": convrot} if convrot else {}
    qt = QuantizedTensor.from_float(w, "TensorWiseINT8Layout", **kw)
    sd = {f"emb.{k[4:]}": v for k, v in qt.state_dict("emb.weight").items()}
    conf = {"format": "int8_tensorwise", **({"convrot": True, "convrot_groupsize": convrot} if convrot else {})}
    sd["emb.comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)
    st = {torch.int8: "I8", torch.float32: "F32", torch.uint8: "U8"}
    entries = {k: formats.TensorEntry(k, st[v.dtype], tuple(v.shape), 0, 0) for k, v in sd.items()}
    q = qformats.describe_layer(entries, "emb", "int8_tensorwise", conf, "test")
    ops = fp8_ops.make_fp8_ops("emb.safetensors", standalone=True)
    emb = ops.Embedding(vocab, dim)
    state = {"weight": sd["emb.weight"], "weight_scale": sd["emb.weight_scale"],
             "comfy_metal_quant": qformats.marker_tensor(q.marker())}
    emb.load_state_dict(state, strict=False)
    ids = torch.tensor([[3, 7, 7], [0, 49, 12]])
    want = dequantize_int8_embedding(qt._qdata, qt._params.scale, ids, convrot, 0)
    got = emb(ids, out_dtype=torch.float32)
    assert torch.equal(got, want)
    assert emb.weight.nbytes == vocab * dim


def test_gemv_on_faked_mps_only_where_measured_faster(tmp_path, monkeypatch):
    """On MPS the fused GEMV runs only where it was timed faster than dequantise + matmul (faked here:
    CPU tensors, a fake clock); the INT8 family runs weight-only there and never calls _int_mm."""
    path, _, deq = _write(tmp_path, "int8_tensorwise")
    net, _ = _load(path)
    dispatch.reset()
    clock = FakeClock()
    monkeypatch.setattr(dispatch, "measuring_enabled", lambda device: True)
    monkeypatch.setattr(dispatch, "_clock", clock)
    monkeypatch.setattr(qops, "weight_only", lambda device: True)
    monkeypatch.setattr(torch, "_int_mm", lambda *a, **k: (_ for _ in ()).throw(
        NotImplementedError("aten::_int_mm not implemented for MPS")))
    from comfy_metal.metal_kernels import quant

    real_gemv = quant.quant_gemv
    def slow_gemv(*a, **k):
        clock.t += 5.0
        return real_gemv(*a, **k)

    monkeypatch.setattr(quant, "quant_gemv", slow_gemv)
    try:
        x = torch.randn(3, HIDDEN)
        torch.testing.assert_close(net.fc2(x), x @ deq["fc2.weight"].T, rtol=1e-5, atol=1e-5)
        (record,) = dispatch.measured_records()
        assert record["kernel"] == "quant_gemv" and record["choice"] == "dequantize+matmul"
        assert record["shape_class"] == [3, N, HIDDEN, "int8", "float32"]
    finally:
        dispatch.reset()


# -- bad files ---------------------------------------------------------------------------------------

def _tensors(path):
    from safetensors.torch import load_file

    return load_file(str(path))


def _bad(tmp_path, variant, edit, name):
    path, _, _ = _write(tmp_path, variant)
    t = _tensors(path)
    edit(t)
    bad = tmp_path / name
    save_file({k: v.contiguous() for k, v in t.items()}, str(bad))
    return bad


def _conf(t, layer, conf):
    t[f"{layer}.comfy_quant"] = torch.tensor(list(json.dumps(conf).encode()), dtype=torch.uint8)


BAD = {
    "malformed scale shape": ("nvfp4", lambda t: t.__setitem__("fc1.weight_scale", t["fc1.weight_scale"][:64]),
                              r"bad\.safetensors: tensor fc1\.weight_scale \(block scales of nvfp4 layer fc1 .*\) has "
                              r"shape \[64, 8\]; expected \[256, 8\] \(2048 values"),
    "missing weight_scale_2": ("nvfp4", lambda t: t.pop("fc2.weight_scale_2"),
                               r"bad\.safetensors: nvfp4 layer fc2 .* has no tensor fc2\.weight_scale_2 \(the tensor "
                               r"scale weight_scale_2\); expected it next to fc2\.weight"),
    "block size that does not divide": ("nvfp4", lambda t: t.__setitem__("fc2.weight", t["fc2.weight"][:, :124]),
                                        r"bad\.safetensors: tensor fc2\.weight .* holds \[64, 248\] values; nvfp4 "
                                        r"stores rows and columns padded to whole 16-value blocks"),
    "group size that does not divide": ("asym_w4a8_int8", lambda t: _conf(t, "fc1", {"format": "asym_w4a8_int8",
                                                                                      "group_size": 24}),
                                        r"bad\.safetensors: tensor fc1\.weight .*: w4a8: K = 128 with group size 24"),
    "unknown layout": ("int8_tensorwise", lambda t: _conf(t, "fc1", {"format": "svdquant_w4a4"}),
                       r"bad\.safetensors: layer fc1 .* is quantized as SVDQuant W4A4 \(which ComfyUI v0\.33 does not "
                       r"read either\).*supported: .*nvfp4"),
    "unknown format": ("int8_tensorwise", lambda t: _conf(t, "fc1", {"format": "int3_magic"}),
                       r"bad\.safetensors: layer fc1 .* unknown format 'int3_magic'.*supported: .*convrot_w4a4"),
    "wrong dtype": ("mxfp8", lambda t: t.__setitem__("fc1.weight_scale",
                                                     t["fc1.weight_scale"].view(torch.uint8).float()),
                    r"bad\.safetensors: tensor fc1\.weight_scale .* has dtype F32; expected F8_E8M0 or U8"),
    "asymmetric w4a8": ("asym_w4a8_int8", lambda t: t.__setitem__("fc1.weight_correction", torch.zeros(8, HIDDEN)),
                        r"bad\.safetensors: tensor fc1\.weight_correction: .* asymmetric"),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_files_name_file_tensor_expected_and_found(tmp_path, case):
    variant, edit, pattern = BAD[case]
    bad = _bad(tmp_path, variant, edit, "bad.safetensors")
    with pytest.raises(formats.CheckpointError, match=pattern):
        formats.open_checkpoint(bad)


def test_a_weight_that_does_not_fit_the_architecture(tmp_path):
    path, _, _ = _write(tmp_path, "nvfp4", {**_sd(), "fc1.weight": torch.randn(HIDDEN + 16, K)})
    sd, _ = loader.build_state_dict(formats.open_checkpoint(path))
    net = Net(fp8_ops.make_fp8_ops("arch.safetensors", standalone=True))
    with pytest.raises(fp8_ops.FP8LayerError, match=r"arch\.safetensors: tensor fc1\.weight \(nvfp4\) has shape "
                                                    r"\[272, 64\], but the architecture's Linear fc1 of shape "
                                                    r"\[256, 128\] needs \[256, 64\]"):
        net.load_state_dict(sd, strict=False)


def test_a_block_format_on_a_conv_layer_is_refused(tmp_path):
    ops = fp8_ops.make_fp8_ops("conv.safetensors", standalone=True)
    conv = ops.Conv2d(4, 32, 1)
    qt = QuantizedTensor.from_float(torch.randn(32, 4 * 4), "TensorWiseINT8Layout")
    marker = qformats.marker_tensor({"format": "int8", "comfy_format": "int8_tensorwise", "tensor": "c.weight"})
    with pytest.raises(fp8_ops.FP8LayerError, match=r"conv\.safetensors: tensor c\.weight is int8_tensorwise, but it "
                                                    r"belongs to a Conv2d"):
        conv.load_state_dict({"weight": qt._qdata, "weight_scale": qt._params.scale, "comfy_metal_quant": marker},
                             strict=False)


@pytest.mark.parametrize("variant", ["nvfp4", "mxfp8", "asym_w4a8_int8"])
def test_saving_writes_the_layers_back_as_stored(tmp_path, variant):
    """Save Model writes block-quantized layers as they were read (ComfyUI's tensors, dtypes and
    comfy_quant JSON): reading the saved file gives the same tensors."""
    from safetensors.torch import load_file

    from comfy_metal.nodes.fp8 import quantize

    path, _, _ = _write(tmp_path, variant)
    net, _ = _load(path)
    tensors, layers, _, _ = loader.model_state_for_saving(net)
    out = tmp_path / "saved.safetensors"
    quantize.atomic_save(tensors, str(out), quantize.quant_metadata(layers))
    before, after = load_file(str(path)), load_file(str(out))
    for k, v in before.items():
        if k.endswith(".bias") or k.startswith("norm."):     # not quantized: the saver's dtype rules apply
            continue
        if k.endswith(".comfy_quant"):
            assert json.loads(bytes(after[k].tolist())) == json.loads(bytes(v.tolist()))
        else:
            assert after[k].dtype == v.dtype and after[k].shape == v.shape, k
            assert torch.equal(after[k].reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), k
    assert sorted(formats.open_checkpoint(out).quant_layers) == ["fc1.weight", "fc2.weight"]


def test_int8_runs_weight_only_exactly_on_mps():
    """MPS has no _int_mm: the INT8 family runs weight-only there; CPU and CUDA keep ComfyUI's own path."""
    assert qops.weight_only("mps") and qops.weight_only(torch.device("mps"))
    assert not qops.weight_only("cpu") and not qops.weight_only("cuda")
    assert "no _int_mm" in qops.path_note({"int8", "w4a8"}, "mps")
    assert "nvfp4 weight-only" in qops.path_note({"nvfp4"}, "cpu")


def test_nvfp4_pre_quant_scale_multiplies_the_input(tmp_path):
    """ModelOpt NVFP4 files may carry a per-input-feature pre_quant_scale (AWQ smoothing): ComfyUI multiplies
    the input by it before the layer; so do the pack's layers. An input_scale (for FP4 activations) is ignored."""
    from safetensors.torch import load_file

    path, _, deq = _write(tmp_path, "nvfp4")
    t = load_file(str(path))
    pqs = torch.rand(K) + 0.5
    t["fc1.pre_quant_scale"] = pqs
    t["fc1.input_scale"] = torch.tensor(0.01)
    save_file(t, str(tmp_path / "pqs.safetensors"))
    net, ck_ = _load(tmp_path / "pqs.safetensors")
    assert "fc1.pre_quant_scale" in ck_.aux_keys and "fc1.input_scale" in ck_.aux_keys
    x = torch.randn(3, K)
    torch.testing.assert_close(net.fc1(x), (x * pqs) @ deq["fc1.weight"].T + deq["fc1.bias"], rtol=1e-5, atol=1e-5)
