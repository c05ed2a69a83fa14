"""GGUF reading and the GGUF op set without ComfyUI: the reader's state dict (logical shapes, F32/F16/BF16
as they are, ComfyUI-GGUF's orig_shape for reshaped tensors), the layers' forward paths against the
gguf package's dequantised values, GGUFTensor conversions, and the errors for bad files."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from comfy_metal.nodes.fp8 import ops as fp8_ops
from comfy_metal.nodes.gguf.ops import GGUFTensor, dequantize_tensor, make_gguf_ops, weight_bytes
from comfy_metal.nodes.gguf.reader import GGUFFile, GGUFFileError

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as np_dequantize, quantize as np_quantize  # noqa: E402

import gguf_models as gm  # noqa: E402

Q = gguf.GGMLQuantizationType


def _write(path, tensors, meta=None):
    """tensors: name -> (numpy array, ggml type or None for a plain array)."""
    w = gguf.GGUFWriter(str(path), "flux")
    for name, (arr, qtype) in tensors.items():
        if qtype is None:
            w.add_tensor(name, arr)
        else:
            w.add_tensor(name, arr, raw_shape=arr.shape, raw_dtype=qtype)
    for k, v in (meta or {}).items():
        w.add_array(k, v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture
def mixed_file(tmp_path):
    g = np.random.default_rng(0)
    lin = (g.standard_normal((48, 256)) * 0.05).astype(np.float32)
    emb = (g.standard_normal((11, 64)) * 0.5).astype(np.float32)
    conv = (g.standard_normal((32, 4, 1, 2, 2)) * 0.2).astype(np.float32)     # last dim 2: not whole blocks
    conv_q = np_quantize(conv.reshape(16, 32), Q.Q8_0)                         # stored reshaped, as ComfyUI-GGUF does
    bf = torch.randn(5, 7).bfloat16()
    tensors = {
        "lin.weight": (gm.quantize_q4_k(lin), Q.Q4_K),
        "lin.bias": ((g.standard_normal(48) * 0.1).astype(np.float32), None),
        "emb.weight": (np_quantize(emb, Q.Q5_1), Q.Q5_1),
        "conv.weight": (conv_q, Q.Q8_0),
        "conv.bias": (np.zeros(32, np.float32), None),
        "norm.weight": (np.ones(64, np.float16), None),
        "bf.weight": (bf.view(torch.int16).numpy().view(np.uint8).reshape(5, 14), Q.BF16),
    }
    path = tmp_path / "mixed.gguf"
    _write(path, tensors, {"comfy.gguf.orig_shape.conv.weight": [32, 4, 1, 2, 2]})
    oracle = {"lin.weight": np_dequantize(tensors["lin.weight"][0], Q.Q4_K),
              "emb.weight": np_dequantize(tensors["emb.weight"][0], Q.Q5_1),
              "conv.weight": np_dequantize(conv_q, Q.Q8_0).reshape(32, 4, 1, 2, 2),
              "bf.weight": bf.float().numpy()}
    return path, tensors, {k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in oracle.items()}


def test_reader_state_dict(mixed_file):
    path, tensors, oracle = mixed_file
    f = GGUFFile(path)
    assert f.arch == "flux" and f.qtype_counts() == {"Q4_K": 1, "F32": 2, "Q5_1": 1, "Q8_0": 1, "F16": 1, "BF16": 1}
    sd = f.state_dict()
    assert isinstance(sd["lin.weight"], GGUFTensor) and sd["lin.weight"].shape == (48, 256)
    assert sd["lin.weight"].dim() == 2 and sd["lin.weight"].size(1) == 256
    assert sd["conv.weight"].shape == (32, 4, 1, 2, 2) and sd["conv.weight"].gguf_qtype == "Q8_0"
    assert sd["norm.weight"].dtype == torch.float16 and sd["lin.bias"].dtype == torch.float32
    assert sd["bf.weight"].dtype == torch.bfloat16 and torch.equal(sd["bf.weight"].float(), oracle["bf.weight"])
    for k in ("lin.weight", "emb.weight", "conv.weight"):
        assert torch.equal(dequantize_tensor(sd[k]), oracle[k]), k
    # what ComfyUI's memory accounting sees: the block bytes
    assert sd["lin.weight"].nbytes == 48 * 144


def test_gguf_tensor_conversions(mixed_file):
    path, _, oracle = mixed_file
    t = GGUFFile(path).state_dict()["lin.weight"]
    assert type(t.to("cpu")) is GGUFTensor and t.to("cpu").shape == (48, 256)
    assert type(t.detach()) is GGUFTensor and type(t.clone()) is GGUFTensor
    assert torch.equal(t.to(torch.float32), oracle["lin.weight"])
    assert torch.equal(t.float(), oracle["lin.weight"])
    assert t.to(torch.float16).dtype == torch.float16
    r = torch.empty_like(t, dtype=torch.float32)
    assert r.shape == (48, 256)
    r.copy_(t)
    assert torch.equal(r, oracle["lin.weight"])
    p = torch.nn.Parameter(t, requires_grad=False)
    assert isinstance(p, torch.nn.Parameter) and p.shape == (48, 256)


class Net(torch.nn.Module):
    def __init__(self, ops):
        super().__init__()
        self.lin = ops.Linear(256, 48)
        self.emb = ops.Embedding(11, 64)
        self.conv = ops.Conv3d(4, 32, (1, 2, 2), stride=(1, 2, 2))


def test_op_set_forward_paths(mixed_file):
    path, _, oracle = mixed_file
    sd = GGUFFile(path).state_dict()
    net = Net(make_gguf_ops("mixed.gguf", standalone=True))
    missing, unexpected = net.load_state_dict({k: v for k, v in sd.items() if k.split(".")[0] in ("lin", "emb", "conv")},
                                              strict=False)
    assert not missing and not unexpected
    assert net.lin.weight.shape == (48, 256) and net.lin.gguf_qtype == "Q4_K"
    b = sd["lin.bias"].float()
    for M in (1, 5, 8, 9, 33):                       # GEMV for M <= 8, dequantise + matmul above
        x = torch.randn(M, 256)
        want = x.double() @ oracle["lin.weight"].double().T + b.double()
        torch.testing.assert_close(net.lin(x).double(), want, rtol=1e-5, atol=1e-5)
    ids = torch.tensor([[3, 0, 10], [7, 7, 1]])
    assert torch.equal(net.emb(ids), oracle["emb.weight"][ids])
    x = torch.randn(2, 4, 3, 8, 8)
    want = torch.nn.functional.conv3d(x, oracle["conv.weight"], None, stride=(1, 2, 2))
    torch.testing.assert_close(net.conv(x), want, rtol=1e-5, atol=1e-5)
    stats = weight_bytes(net)
    assert stats["gguf_bytes"] == 48 * 144 + 11 * 2 * 24 + 16 * 34
    # the module's state dict (what ComfyUI's module_size sums) holds the blocks, not a float copy
    assert net.state_dict()["lin.weight"].nbytes == 48 * 144
    # the status displays: the bytes held, and what the quantised layers would take in bf16
    held = sum(t.nbytes for t in net.state_dict().values())
    assert fp8_ops.quantized_memory(net) == (held, held - stats["gguf_bytes"] + 2 * (48 * 256 + 11 * 64 + 32 * 4 * 2 * 2))


def test_shape_mismatch_names_file_and_tensor(mixed_file):
    path, _, _ = mixed_file
    sd = GGUFFile(path).state_dict()
    ops = make_gguf_ops("mixed.gguf", standalone=True)
    lin = ops.Linear(128, 96)
    with pytest.raises(Exception, match=r"mixed\.gguf: tensor weight has shape \[48, 256\].*\[96, 128\]"):
        lin.load_state_dict({"weight": sd["lin.weight"]}, strict=False)


def test_truncated_file_names_the_tensor(mixed_file, tmp_path):
    path, _, _ = mixed_file
    data = path.read_bytes()
    for cut in (len(data) - 40, len(data) // 2 + 100):       # (the last tensor is 70 bytes + padding)
        bad = tmp_path / "cut.gguf"
        bad.write_bytes(data[:cut])
        with pytest.raises(GGUFFileError, match=r"cut\.gguf: tensor \S+ .*truncated"):
            GGUFFile(bad)
    bad.write_bytes(data[:40])
    with pytest.raises(GGUFFileError, match=r"cut\.gguf: not a readable GGUF file"):
        GGUFFile(bad)
    bad.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(GGUFFileError, match=r"cut\.gguf: not a readable GGUF file"):
        GGUFFile(bad)
    with pytest.raises(GGUFFileError, match="no such file"):
        GGUFFile(tmp_path / "absent.gguf")


def test_unknown_and_unsupported_types_list_the_supported_ones(mixed_file, tmp_path):
    path, _, _ = mixed_file
    # a ggml type number the gguf package does not know: patch the type id of the tensor "lin.weight"
    data = bytearray(path.read_bytes())
    name = b"lin.weight"
    i = data.index(name) + len(name)
    n_dims = int.from_bytes(data[i:i + 4], "little")
    t_off = i + 4 + 8 * n_dims
    assert int.from_bytes(data[t_off:t_off + 4], "little") == int(Q.Q4_K)
    data[t_off:t_off + 4] = (77).to_bytes(4, "little")
    bad = tmp_path / "type77.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(GGUFFileError, match=r"type77\.gguf: tensor lin\.weight has ggml type number 77.*Q4_K.*IQ4_XS"):
        GGUFFile(bad)
    # a known type this loader does not dequantise
    tq = tmp_path / "iq2.gguf"
    _write(tq, {"x.weight": (np.zeros((4, 66), np.uint8), Q.IQ2_XXS)})
    with pytest.raises(GGUFFileError, match=r"iq2\.gguf: tensor x\.weight is stored as IQ2_XXS.*Q8_0.*Q2_K.*BF16"):
        GGUFFile(tq).state_dict()


def test_small_m_follows_the_dispatch_measured_choice(mixed_file, monkeypatch):
    """Where the kernel dispatch measures (MPS), a Linear with <= 8 rows takes the fused GEMV only if it
    was measured faster than dequantise + matmul for that shape; both give the same values."""
    from comfy_metal import metal_kernels as mk
    from comfy_metal.metal_kernels import dispatch

    path, _, oracle = mixed_file
    sd = GGUFFile(path).state_dict()
    net = Net(make_gguf_ops("mixed.gguf", standalone=True))
    net.load_state_dict({k: v for k, v in sd.items() if k.startswith("lin.")}, strict=False)
    x = torch.randn(3, 256)
    want = net.lin(x)                                  # CPU: no measuring, the GEMV
    asked = []

    def fake_choice(kernel, shape_class, candidates, device, **kw):
        asked.append((kernel, shape_class, list(candidates)))
        return choice

    gemv_calls = []
    real_gemv = mk.gguf_gemv

    def counting_gemv(*a, **k):
        gemv_calls.append(1)
        return real_gemv(*a, **k)

    monkeypatch.setattr(mk, "gguf_gemv", counting_gemv)
    monkeypatch.setattr(dispatch, "measuring_enabled", lambda device: True, raising=False)
    monkeypatch.setattr(dispatch, "measured_choice", fake_choice, raising=False)
    for choice, calls in (("dequantize+matmul", 0), ("gemv", 1)):
        gemv_calls.clear()
        torch.testing.assert_close(net.lin(x), want, rtol=1e-5, atol=1e-5)
        assert len(gemv_calls) == calls, choice
    assert asked[0] == ("gguf_gemv", (3, 48, 256, "Q4_K", "float32"), ["dequantize+matmul", "gemv"])
