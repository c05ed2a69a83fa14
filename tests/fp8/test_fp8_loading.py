"""FP8 checkpoint reading, FP8 layers, quantization and saving, without ComfyUI.

The FP8 layers are built with `make_fp8_ops(standalone=True)` (the same mixins ComfyUI's op set
uses, on plain torch.nn bases). Oracles: torch's own float8 casts (fp8_models.quantize_ref /
dequant_ref) and decode-then-F.linear in fp32.
"""
from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file, save_file

import fp8_models as fm
from comfy_metal.metal_kernels import dispatch
from comfy_metal.nodes.fp8 import quantize as fp8_quantize
from comfy_metal.nodes.fp8 import formats as fp8_formats, loader as fp8_loader, nodes as fp8_nodes, ops as fp8_ops

KINDS = [("plain", False, False), ("scaled_fp8", False, False), ("scaled_fp8", True, False),
         ("comfy_quant", False, False), ("comfy_quant", True, False), ("comfy_quant", False, True),
         ("comfy_quant", True, True)]


def _load(path, weight_mode="auto", storage=None, **net_kw):
    ck = fp8_formats.open_checkpoint(path)
    sd, summary = fp8_loader.build_state_dict(ck, weight_mode)
    net = fm.TinyNet(fp8_ops.make_fp8_ops(ck.name, storage=storage, standalone=True), **net_kw)
    missing, unexpected = net.load_state_dict(sd, strict=False)
    assert not missing and not unexpected, (missing, unexpected)
    return net, ck, summary


def _tensor_of(net, key):
    mod = net.get_submodule(key.rsplit(".", 1)[0])
    if key.endswith(".weight") and fp8_ops.is_fp8_module(mod):
        return mod.decoded_weight(dtype=torch.float32)
    return getattr(mod, key.rsplit(".", 1)[1]).float()


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("kind,rowwise,uint8", KINDS)
def test_formats_load_exact_values(tmp_path, kind, rowwise, uint8, fmt):
    sd = fm.tiny_state(seed=1)
    path = tmp_path / "m.safetensors"
    expect = fm.write_fp8(path, sd, kind, fmt, rowwise=rowwise, uint8_storage=uint8)
    net, ck, _ = _load(path)
    assert ck.quant_source == kind
    assert len(ck.layers) == 4 and {layer.fmt for layer in ck.layers.values()} == {fmt}
    assert all(layer.rowwise == rowwise for layer in ck.layers.values()) or kind == "plain"
    for key, want in expect.items():
        torch.testing.assert_close(_tensor_of(net, key), want, rtol=0, atol=0, msg=key)
    fp8 = dict(fp8_ops.fp8_modules(net))
    assert set(fp8) == {"embed", "fc1", "fc2", "conv"}
    assert all(m.weight.element_size() == 1 for m in fp8.values())


def test_prefixed_scaled_fp8_marker(tmp_path):
    """Full checkpoints prefix everything (model.diffusion_model.scaled_fp8)."""
    sd = fm.tiny_state()
    p = tmp_path / "m.safetensors"
    fm.write_fp8(p, sd, "scaled_fp8", prefix="model.diffusion_model.")
    ck = fp8_formats.open_checkpoint(p)
    assert ck.quant_source == "scaled_fp8" and len(ck.layers) == 4
    assert "model.diffusion_model.scaled_fp8" in ck.aux_keys
    assert not any(k.endswith(("scale_weight", "scale_input")) for k in ck.model_keys())


def test_uint8_storage_matches_native(tmp_path):
    """MPS before torch 2.15 holds FP8 as uint8 bytes: same results as native float8."""
    sd = fm.tiny_state(seed=2)
    p = tmp_path / "m.safetensors"
    fm.write_fp8(p, sd, "comfy_quant", rowwise=True)
    native, _, _ = _load(p)
    bytes_, _, _ = _load(p, storage=torch.uint8)
    assert bytes_.fc1.weight.dtype == torch.uint8 and native.fc1.weight.dtype == torch.float8_e4m3fn
    ids = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(bytes_(ids), native(ids), rtol=0, atol=0)
    torch.testing.assert_close(bytes_(ids[:1, :3]), native(ids[:1, :3]), rtol=0, atol=0)


# ------------------------------------------------------------------------------------------------
# Linear forward
# ------------------------------------------------------------------------------------------------

def _fp8_linear(n=96, k=80, rowwise=False, bias=True, fmt="e4m3fn", seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.1
    q, scale = fm.quantize_ref(w, fmt, rowwise)
    lin = fp8_ops.make_fp8_ops(standalone=True).Linear(k, n, bias=bias)
    sd = {"weight": q, "weight_scale": scale}
    if bias:
        sd["bias"] = torch.randn(n, generator=g) * 0.1
    lin.load_state_dict(sd, strict=False)
    return lin, fm.dequant_ref(q, scale), sd.get("bias")


@pytest.mark.parametrize("rowwise", [False, True])
@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_linear_decode_path_equals_decode_then_linear(rowwise, fmt):
    lin, wd, b = _fp8_linear(rowwise=rowwise, fmt=fmt)
    x = torch.randn(3, 7, 80, generator=torch.Generator().manual_seed(1))     # M = 21 > 8: decode path
    got = lin(x)
    want = torch.nn.functional.linear(x, wd, b)
    assert got.shape == (3, 7, 96)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("m", [1, 3, 8])
def test_linear_gemv_path_equals_decode_path(m, dtype):
    lin, wd, b = _fp8_linear(n=67, k=131, rowwise=m == 3)
    x = torch.randn(m, 131, generator=torch.Generator().manual_seed(m)).to(dtype)
    dispatch.last_backend.pop("gemv", None)
    got = lin(x)
    assert "gemv" in dispatch.last_backend            # M <= 8 went through the GEMV kernel function
    assert got.dtype == dtype
    want = torch.nn.functional.linear(x.float(), wd, b.float()).to(dtype)   # the decode path's result
    tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol * want.abs().max().item())


def test_embedding_decodes_only_rows_and_conv_decodes(monkeypatch):
    sd = fm.tiny_state(seed=4)
    ops = fp8_ops.make_fp8_ops(standalone=True)
    net = fm.TinyNet(ops)
    qsd = dict(sd)
    for k in ("embed.weight", "conv.weight"):
        q, s = fm.quantize_ref(sd[k], rowwise=True)
        qsd[k], qsd[k.replace("weight", "weight_scale")] = q, s
    net.load_state_dict(qsd, strict=False)
    ids = torch.tensor([[3, 0, 49, 3]])
    decode, gemv = fp8_ops._kernels()
    decoded_shapes = []

    def recording_decode(data, *args, **kwargs):
        decoded_shapes.append(tuple(data.shape))
        return decode(data, *args, **kwargs)

    monkeypatch.setattr(fp8_ops, "_kernels", lambda: (recording_decode, gemv))
    emb = net.embed(ids, out_dtype=torch.float32)
    assert decoded_shapes == [(4, net.embed.embedding_dim)]     # the 4 looked-up rows, not the table
    wd = net.embed.decoded_weight(dtype=torch.float32)
    torch.testing.assert_close(emb, wd[ids], rtol=0, atol=0)
    img = torch.randn(1, 3, 9, 7)
    torch.testing.assert_close(net.conv(img), torch.nn.functional.conv2d(
        img, net.conv.decoded_weight(dtype=torch.float32), net.conv.bias.float(), padding=1), rtol=1e-5, atol=1e-5)


# ------------------------------------------------------------------------------------------------
# Memory
# ------------------------------------------------------------------------------------------------

def test_resident_bytes_per_linear_weight(tmp_path):
    """CPU: the loaded model holds the FP8 bytes plus scales, <= 1.01 bytes a Linear weight."""
    sd = {"fc1.weight": torch.randn(1024, 512).to(torch.bfloat16), "fc1.bias": torch.zeros(1024),
          "fc2.weight": torch.randn(512, 1024).to(torch.bfloat16)}
    for rowwise in (False, True):
        p = tmp_path / f"m{rowwise}.safetensors"
        fm.write_fp8(p, sd, "comfy_quant", rowwise=rowwise)
        ck = fp8_formats.open_checkpoint(p)
        state, _ = fp8_loader.build_state_dict(ck)
        ops = fp8_ops.make_fp8_ops(standalone=True)
        net = torch.nn.Module()
        net.fc1, net.fc2 = ops.Linear(512, 1024), ops.Linear(1024, 512, bias=False)
        net.load_state_dict(state, strict=False)
        linear_weights = 1024 * 512 * 2
        resident = sum(m.weight.nbytes + m.weight_scale.nbytes for m in (net.fc1, net.fc2))
        assert resident / linear_weights <= 1.01, resident / linear_weights
        # What ComfyUI's module_size() sums: every tensor of the state dict.
        total = sum(t.nbytes for t in net.state_dict().values())
        assert total == resident + net.fc1.bias.nbytes
        assert net.fc1.weight.device.type == "cpu"
        # What the status displays report: these bytes, and what the FP8 layers would take in bf16.
        assert fp8_ops.quantized_memory(net) == (total, linear_weights * 2 + net.fc1.bias.nbytes)


def test_loaded_quantized_models_reach_the_status_and_leave_with_the_model():
    from comfy_metal.nodes import status

    status.clear_records()
    ops = fp8_ops.make_fp8_ops(standalone=True)
    net = torch.nn.Module()
    net.fc = ops.Linear(64, 32, bias=False)
    net.fc.load_state_dict({"weight": torch.randn(32, 64).to(torch.float8_e4m3fn), "weight_scale": torch.ones(())})
    plain = torch.nn.Linear(4, 4)
    fp8_ops.record_quantized(net, "tiny_fp8.safetensors")
    fp8_ops.record_quantized(plain, "plain.safetensors")        # no quantized layer: not reported
    assert status.loaded_models() == [{"name": "tiny_fp8.safetensors", "held_bytes": 32 * 64 + 4,
                                       "bf16_bytes": 32 * 64 * 2}]
    fp8_ops.record_quantized(net, "tiny_fp8.safetensors")       # the same model again: one entry
    assert len(status.loaded_models()) == 1
    del net
    import gc

    gc.collect()
    assert status.loaded_models() == []


PEAK_SCRIPT = textwrap.dedent("""
    import json, sys, torch
    sys.path.insert(0, sys.argv[2])
    import conftest
    from comfy_metal.nodes.fp8 import formats as fp8_formats, loader as fp8_loader, ops as fp8_ops
    layers, n, k = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    ops = fp8_ops.make_fp8_ops(standalone=True)
    net = torch.nn.Module()
    net.blocks = torch.nn.ModuleList([ops.Linear(k, n, bias=False) for _ in range(layers)])
    x = torch.randn(16, k)
    # Warm up (code pages of the decode/matmul kernels are file-backed RSS too), on a small layer.
    warm = ops.Linear(k, 64, bias=False)
    warm.load_state_dict({"weight": torch.randn(64, k).to(torch.float8_e4m3fn), "weight_scale": torch.ones(())})
    warm(x).sum().item()
    from safetensors import safe_open
    from comfy_metal.nodes.common.memory import proc_status_bytes as status, reset_peak_rss
    rss = lambda: status("VmRSS")
    # Reset the kernel's peak-RSS counter (VmHWM) so the peak measured is the load's, not the imports'.
    assert reset_peak_rss()
    base = rss()
    peak_before = status("VmHWM")
    ck = fp8_formats.open_checkpoint(sys.argv[1])
    sd, _ = fp8_loader.build_state_dict(ck, sys.argv[6])
    net.load_state_dict(sd, strict=False)
    del sd
    for b in net.blocks:        # touch every weight: decode each layer once (M=16 > 8 -> decode path)
        b(x).sum().item()
    touched = rss()
    peak = status("VmHWM")
    fp8 = sum(b.weight.nbytes for b in net.blocks)
    print(json.dumps({"base": base, "peak": peak, "peak_before": peak_before, "touched": touched, "fp8": fp8}))
""")


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"),
                    reason="needs Linux /proc (peak RSS reset via clear_refs, VmHWM)")
@pytest.mark.parametrize("mode", ["auto", "e4m3fn tensorwise"])
def test_peak_rss_during_load(tmp_path, mode):
    """Subprocess: peak RSS during load + first forward <= file size + 10% + the largest layer decoded.
    For mode "e4m3fn tensorwise" the file is bf16 and is quantized while loading, layer by layer."""
    layers, n, k = 64, 1024, 1024          # 64 Mi weights: 64 MiB FP8 / 128 MiB bf16
    g = torch.Generator().manual_seed(0)
    base_w = torch.randn(n, k, generator=g) * 0.05
    sd = {f"blocks.{i}.weight": (base_w * (1 + 0.01 * i)).to(torch.bfloat16) for i in range(layers)}
    del base_w
    p = tmp_path / "big.safetensors"
    if mode == "auto":
        fm.write_fp8(p, sd, "comfy_quant")
    else:
        save_file(sd, str(p))
    del sd
    file_size = os.path.getsize(p)
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, str(p), os.path.dirname(os.path.dirname(__file__)), str(layers), str(n),
                          str(k), mode], capture_output=True, text=True, timeout=300,
                         # freed buffers go back to the OS (glibc would keep them): RSS = memory in use
                         env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    assert out.returncode == 0, out.stderr[-3000:]
    r = json.loads(out.stdout.strip().splitlines()[-1])
    # The largest layer decoded: its fp32 result plus the reference decoder's fp32 temporary.
    largest_decoded = 2 * n * k * 4
    budget = file_size * 1.10 + largest_decoded
    grown = max(r["peak"], r["touched"]) - r["base"]
    print(f"{mode}: file {file_size / 2**20:.1f} MiB, RSS grew {grown / 2**20:.1f} MiB, budget {budget / 2**20:.1f} MiB")
    assert r["fp8"] == layers * n * k
    assert r["peak_before"] - r["base"] < 8 * 2**20        # the peak counter was reset before the load
    assert r["peak"] - r["base"] <= budget, r
    if mode == "auto":
        assert grown >= file_size * 0.9      # the weights really are resident (the measurement bites)


# ------------------------------------------------------------------------------------------------
# Quantization
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("rowwise", [False, True])
def test_quantize_error_within_fp8_bound(fmt, rowwise):
    g = torch.Generator().manual_seed(7)
    w = torch.randn(64, 300, generator=g) * torch.logspace(-3, 1, 64).unsqueeze(1)
    q, scale = fp8_quantize.quantize(w, fmt, rowwise)
    assert q.dtype == fm.FP8[fmt] and scale.shape == ((64,) if rowwise else ())
    dq = fp8_quantize.dequantize(q, scale, fmt)
    # amax maps to the format's max exactly (saturation never clips more than rounding)
    s = scale.reshape(-1, 1) if rowwise else scale
    scaled = (w / s).abs()
    tiny = {"e4m3fn": 2.0 ** -6, "e5m2": 2.0 ** -14}[fmt]         # smallest normal
    normal = scaled >= tiny
    rel = ((dq - w).abs() / w.abs())[normal]
    bound = fp8_quantize.fp8_error_bound(fmt)
    assert rel.max().item() <= bound * (1 + 1e-6), rel.max().item()
    assert scaled.max().item() <= fm.FMAX[fmt] * (1 + 1e-6)
    # Identical to torch's own saturating cast.
    ref_q, _ = fm.quantize_ref(w, fmt, rowwise)
    assert torch.equal(q.view(torch.uint8), ref_q.view(torch.uint8))


def test_quantize_saturates_and_keeps_zero_rows():
    w = torch.zeros(4, 8)
    w[1] = torch.linspace(-3, 5, 8)
    q, scale = fp8_quantize.quantize(w, "e4m3fn", rowwise=True)
    assert torch.all(scale[[0, 2, 3]] == 1.0)
    dq = fp8_quantize.dequantize(q, scale)
    assert torch.all(dq[0] == 0) and abs(dq[1].max().item() - 5.0) < 1e-6
    q2, _ = fp8_quantize.quantize(torch.tensor([[1e6, -1e6, 1.0]]), "e4m3fn", scale=torch.tensor(1.0))
    assert q2.float().tolist() == [[448.0, -448.0, 1.0]]


def test_keep_rules():
    kr = fp8_quantize.keep_reason
    assert kr("double_blocks.0.img_attn.qkv.weight", (384, 128), torch.bfloat16) is None
    assert kr("img_in.weight", (128, 64), torch.bfloat16)
    assert kr("final_layer.linear.weight", (64, 128), torch.bfloat16)
    assert kr("blocks.0.norm1.weight", (128,), torch.bfloat16)
    assert kr("text_model.embeddings.token_embedding.weight", (49408, 768), torch.float16)
    assert kr("blocks.0.attn.qkv.bias", (384,), torch.bfloat16)
    assert kr("blocks.0.small.weight", (8, 64), torch.bfloat16)            # small
    assert kr("blocks.0.conv.weight", (8, 3, 3, 3), torch.bfloat16)        # not a Linear weight
    assert kr("blocks.0.fc.weight", (256, 256), torch.float8_e4m3fn)       # already FP8


def test_quantize_file_and_atomic_save(tmp_path, caplog):
    sd = fm.tiny_state(d=128, hidden=256, out=128, seed=3)
    src = tmp_path / "bf16.safetensors"
    save_file(sd, str(src))
    dst = tmp_path / "fp8.safetensors"
    summary = fp8_quantize.quantize_file(str(src), str(dst), "e4m3fn")
    assert {e.key for e in summary.errors} == {"fc1.weight", "fc2.weight"}
    assert "embed.weight" in summary.kept and "norm.weight" in summary.kept
    assert all(0 < e.rel_error < 0.05 for e in summary.errors)
    text = summary.text()
    assert "2 layers quantized" in text and "fc1.weight" in text
    ck = fp8_formats.open_checkpoint(dst)
    assert ck.quant_source == "comfy_quant" and set(ck.layers) == {"fc1.weight", "fc2.weight"}
    meta = json.loads(ck.metadata["_quantization_metadata"])
    assert meta["layers"] == {"fc1": {"format": "float8_e4m3fn"}, "fc2": {"format": "float8_e4m3fn"}}
    # Never over an existing file; the source is never the destination; no temp files left.
    before = dst.read_bytes()
    with pytest.raises(FileExistsError):
        fp8_quantize.quantize_file(str(src), str(dst), "e4m3fn")
    with pytest.raises(FileExistsError):
        fp8_quantize.quantize_file(str(src), str(src), "e4m3fn", overwrite=True)
    assert dst.read_bytes() == before
    fp8_quantize.quantize_file(str(src), str(dst), "e4m3fn", rowwise=True, overwrite=True)
    assert fp8_formats.open_checkpoint(dst).layers["fc1.weight"].rowwise
    assert sorted(os.listdir(tmp_path)) == ["bf16.safetensors", "fp8.safetensors"]


def test_atomic_save_leaves_old_file_on_failure(tmp_path):
    dst = tmp_path / "out.safetensors"
    dst.write_bytes(b"old")
    with pytest.raises(Exception):
        fp8_quantize.atomic_save({"a": torch.zeros(2), "b": object()}, str(dst), overwrite=True)
    assert dst.read_bytes() == b"old" and os.listdir(tmp_path) == ["out.safetensors"]


@pytest.mark.parametrize("hard_links", [True, False])
def test_atomic_save_final_step_never_overwrites_a_file_created_meanwhile(tmp_path, monkeypatch, hard_links):
    """Another writer creates the file after the exists-check, while the temp file is written: the
    final step (os.link, or O_EXCL where hard links are unsupported) refuses; that file is untouched."""
    import safetensors.torch

    real_save = safetensors.torch.save_file
    dst = tmp_path / "out.safetensors"
    if not hard_links:
        def no_link(src, dst_):
            raise PermissionError(1, "Operation not permitted")  # as on file systems without hard links
        monkeypatch.setattr(os, "link", no_link)

    def save_then_race(tensors, filename, metadata=None):
        real_save(tensors, filename, metadata=metadata)
        dst.write_bytes(b"the user's file")

    monkeypatch.setattr(safetensors.torch, "save_file", save_then_race)
    with pytest.raises(FileExistsError, match="another writer"):
        fp8_quantize.atomic_save({"a": torch.arange(4.0)}, str(dst))
    assert dst.read_bytes() == b"the user's file" and os.listdir(tmp_path) == ["out.safetensors"]
    # without a race the same path publishes the file, and overwrite=True still replaces
    monkeypatch.setattr(safetensors.torch, "save_file", real_save)
    dst.unlink()
    fp8_quantize.atomic_save({"a": torch.arange(4.0)}, str(dst))
    assert torch.equal(load_file(str(dst))["a"], torch.arange(4.0))
    fp8_quantize.atomic_save({"a": torch.ones(2)}, str(dst), overwrite=True)
    assert torch.equal(load_file(str(dst))["a"], torch.ones(2)) and os.listdir(tmp_path) == ["out.safetensors"]


def test_quantize_on_load_modes(tmp_path):
    sd = fm.tiny_state(d=128, hidden=256, out=128, seed=3)
    p = tmp_path / "bf16.safetensors"
    save_file(sd, str(p))
    kw = dict(d=128, hidden=256, out=128, dtype=torch.float32)   # high-precision weights load as fp32
    auto, _, none = _load(p, "auto", **kw)
    assert none is None and not list(fp8_ops.fp8_modules(auto))
    for mode in ("e4m3fn tensorwise", "e4m3fn rowwise"):
        net, _, summary = _load(p, mode, **kw)
        assert set(dict(fp8_ops.fp8_modules(net))) == {"fc1", "fc2"}
        assert (net.fc1.weight_scale.numel() > 1) == mode.endswith("rowwise")
        assert max(e.rel_error for e in summary.errors) < 0.05
        ids = torch.randint(0, 50, (2, 5), generator=torch.Generator().manual_seed(0))
        ya, yq = auto(ids), net(ids)
        assert ((ya - yq).norm() / ya.norm()).item() < 0.1


# ------------------------------------------------------------------------------------------------
# Bad input
# ------------------------------------------------------------------------------------------------

def _raw_safetensors(path, header: dict, data: bytes = b""):
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)


def test_missing_file(tmp_path):
    with pytest.raises(fp8_formats.CheckpointMissing, match="nope.safetensors: file not found"):
        fp8_formats.open_checkpoint(tmp_path / "nope.safetensors")


def test_truncated_file_names_tensor(tmp_path):
    sd = fm.tiny_state()
    p = tmp_path / "m.safetensors"
    fm.write_fp8(p, sd, "comfy_quant")
    data = p.read_bytes()
    p.write_bytes(data[:-100])
    with pytest.raises(fp8_formats.CheckpointError) as e:
        fp8_formats.open_checkpoint(p)
    msg = str(e.value)
    assert "m.safetensors" in msg and "truncated" in msg and "tensor" in msg and "expected at least" in msg
    p.write_bytes(data[:5])
    with pytest.raises(fp8_formats.CheckpointError, match="truncated"):
        fp8_formats.open_checkpoint(p)


@pytest.mark.parametrize("entry", [{"dtype": "F32", "shape": [2], "data_offsets": ["0", None]},
                                   {"dtype": "F32", "shape": [-2], "data_offsets": [0, -8]},
                                   {"dtype": "F32", "shape": [2], "data_offsets": [0]}])
def test_malformed_header_entry_is_a_checkpoint_error(tmp_path, entry):
    p = tmp_path / "odd.safetensors"
    # a valid tensor after the malformed one: the message must come from the malformed entry itself
    header = json.dumps({"bad": entry, "ok": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}).encode()
    p.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 8)
    with pytest.raises(fp8_formats.CheckpointError, match="odd.safetensors: tensor bad: corrupt header entry"):
        fp8_formats.open_checkpoint(p)


def test_corrupt_header(tmp_path):
    p = tmp_path / "bad.safetensors"
    p.write_bytes(struct.pack("<Q", 10) + b"{not json}" + b"\0" * 16)
    with pytest.raises(fp8_formats.CheckpointError, match="bad.safetensors: corrupt safetensors header"):
        fp8_formats.open_checkpoint(p)
    p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(fp8_formats.CheckpointError, match="header length"):
        fp8_formats.open_checkpoint(p)
    _raw_safetensors(p, {"w": {"dtype": "F32", "shape": [4], "data_offsets": [0, 8]}}, b"\0" * 8)
    with pytest.raises(fp8_formats.CheckpointError, match=r"tensor w: .*needs 16 bytes"):
        fp8_formats.open_checkpoint(p)


def test_unknown_dtype(tmp_path):
    p = tmp_path / "f4.safetensors"
    _raw_safetensors(p, {"blocks.0.weight": {"dtype": "F4", "shape": [4, 4], "data_offsets": [0, 8]}}, b"\0" * 8)
    with pytest.raises(fp8_formats.CheckpointError) as e:
        fp8_formats.open_checkpoint(p)
    msg = str(e.value)
    assert "f4.safetensors" in msg and "blocks.0.weight" in msg and "F4" in msg and "F8_E4M3" in msg


@pytest.mark.parametrize("fmt_name,label", [("svdquant_w4a4", "SVDQuant"), ("awq_w4a16", "AWQ"),
                                            ("fancy9", "unknown format")])
def test_unsupported_quant_formats(tmp_path, fmt_name, label):
    p = tmp_path / "q.safetensors"
    save_file({"fc1.weight": torch.zeros(4, 4, dtype=torch.uint8), "fc1.weight_scale": torch.ones(()),
               "fc1.comfy_quant": torch.tensor(list(json.dumps({"format": fmt_name}).encode()), dtype=torch.uint8)},
              str(p))
    with pytest.raises(fp8_formats.UnsupportedQuantFormat) as e:
        fp8_formats.open_checkpoint(p)
    msg = str(e.value)
    assert "q.safetensors" in msg and "fc1" in msg and label in msg and "supported: " in msg and "float8_e4m3fn" in msg


def test_bad_scale_and_shape_mismatch(tmp_path):
    sd = fm.tiny_state()
    p = tmp_path / "m.safetensors"
    fm.write_fp8(p, sd, "comfy_quant")
    from safetensors.torch import load_file

    t = load_file(str(p))
    t["fc1.weight_scale"] = torch.ones(7)
    save_file(t, str(tmp_path / "scale.safetensors"))
    ck = fp8_formats.open_checkpoint(tmp_path / "scale.safetensors")
    with pytest.raises(fp8_formats.CheckpointError) as e:
        fp8_loader.build_state_dict(ck)
    assert "scale.safetensors" in str(e.value) and "fc1.weight_scale" in str(e.value) and "[7]" in str(e.value)
    # A file whose layer shape does not fit the architecture.
    with pytest.raises(fp8_ops.FP8LayerError) as e:
        _load(p, hidden=200)
    msg = str(e.value)
    assert "m.safetensors" in msg and "fc1.weight" in msg and "[160, 64]" in msg and "[200, 64]" in msg
    # A comfy_quant layer listed without its weight.
    del t["fc2.weight"]
    t["fc1.weight_scale"] = torch.ones(())
    save_file(t, str(tmp_path / "noweight.safetensors"))
    with pytest.raises(fp8_formats.CheckpointError, match="no tensor fc2.weight"):
        fp8_formats.open_checkpoint(tmp_path / "noweight.safetensors")


def test_standalone_forward_through_emulator(tmp_path, monkeypatch):
    """The FP8 layers' forward runs the real fp8_decode and gemv Metal kernels in the MSL emulator."""
    from comfy_metal.metal_kernels.emulator import available

    if not available():
        pytest.skip("clang-19 not found: the MSL emulator is unavailable")
    lin, wd, b = _fp8_linear(n=13, k=20, rowwise=True)
    monkeypatch.setenv("COMFY_METAL_BACKEND", "emulator")
    dispatch.reset()
    try:
        x1 = torch.randn(3, 20)
        y1 = lin(x1)
        x2 = torch.randn(10, 20)
        y2 = lin(x2)
        backends = dict(dispatch.last_backend)
    finally:
        monkeypatch.delenv("COMFY_METAL_BACKEND")
        dispatch.reset()
    assert backends.get("gemv") == "emulator" and backends.get("fp8_decode") == "emulator", backends
    torch.testing.assert_close(y1, torch.nn.functional.linear(x1, wd, b), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y2, torch.nn.functional.linear(x2, wd, b), rtol=1e-5, atol=1e-5)


def test_save_dtype_rules_source_then_storage_then_bf16():
    """Tensors the saver does not quantize: the source file's dtype (looked up through the prefix
    ComfyUI strips from the file's keys), else the 16-bit storage dtype, else bf16 -- never float32
    just because the model computes in float32."""
    ops = fp8_ops.make_fp8_ops(standalone=True)
    net = torch.nn.Module()
    net.proj = ops.Linear(256, 128)
    net.norm = torch.nn.LayerNorm(128)
    net.proj.load_state_dict({"weight": torch.randn(128, 256), "bias": torch.randn(128)})
    tensors, layers, summary, rules = fp8_loader.model_state_for_saving(net, "e4m3fn tensorwise", None, torch.float32)
    assert layers == {"proj": "e4m3fn"} and len(summary.errors) == 1
    assert tensors["proj.weight"].dtype == torch.float8_e4m3fn
    assert {tensors[k].dtype for k in ("proj.bias", "norm.weight", "norm.bias")} == {torch.bfloat16}
    assert sum(rules.values()) == 3 and all(d == torch.bfloat16 for _, d in rules)
    tensors, _, _, _ = fp8_loader.model_state_for_saving(net, "e4m3fn tensorwise", None, torch.float16)
    assert tensors["norm.weight"].dtype == torch.float16
    src = {"model.diffusion_model.norm.weight": torch.float32, "model.diffusion_model.norm.bias": torch.float16}
    tensors, _, _, _ = fp8_loader.model_state_for_saving(net, "e4m3fn tensorwise", src, torch.bfloat16)
    assert tensors["norm.weight"].dtype == torch.float32 and tensors["norm.bias"].dtype == torch.float16
    assert tensors["proj.bias"].dtype == torch.bfloat16


def test_quantize_file_carries_metadata(tmp_path):
    """quantize_file keeps the source header metadata (model detection may need it), replacing the
    stale quantization keys with its own."""
    from safetensors import safe_open

    src, dst = tmp_path / "src.safetensors", tmp_path / "dst.safetensors"
    meta = {"config": json.dumps({"transformer": {"text_dim": 32}}), "comfy_metal": "old",
            "_quantization_metadata": json.dumps({"format_version": "1.0", "layers": {}})}
    save_file(fm.tiny_state(hidden=320, d=64), str(src), metadata=meta)
    summary = fp8_quantize.quantize_file(str(src), str(dst))
    assert summary.errors
    with safe_open(str(dst), "pt") as f:
        out = f.metadata()
    assert out["config"] == meta["config"] and "comfy_metal" not in out
    assert set(json.loads(out["_quantization_metadata"])["layers"]) == {e.key[: -len(".weight")] for e in summary.errors}


def test_fp8_nodes_category():
    """The FP8 nodes sit with the pack's other nodes in the node library, under Comfy Metal/Loaders."""
    assert set(fp8_nodes.NODE_CLASS_MAPPINGS) == {"MetalFP8ModelLoader", "MetalFP8TextEncoderLoader",
                                                   "MetalFP8DualTextEncoderLoader", "MetalFP8TripleTextEncoderLoader",
                                                   "MetalFP8QuadrupleTextEncoderLoader", "MetalFP8SaveModel"}
    assert {cls.CATEGORY for cls in fp8_nodes.NODE_CLASS_MAPPINGS.values()} == {"Comfy Metal/Loaders"}
