"""comfy_quant block-format kernels against comfy_kitchen, the oracle ComfyUI itself dequantizes with.

Weights are quantized by comfy_kitchen's own quantizers (`QuantizedTensor.from_float` with ComfyUI's
layouts, `quantize_w4a8_int8_weight`, `quantize_convrot_w4a4_weight`); the pure-torch references and the
Metal kernels (quant.metal + common.metal through the real launch glue, in the strict MSL emulator) must
give comfy_kitchen's dequantized values bit for bit, in every output dtype: the stored basis against its
`dequantize_*` internals, the original basis (ConvRot rotated back) against its public dequantizers and
QuantizedTensor.dequantize(). Odd shapes: N and K off the 16/32 padding (a last partial block), K off the
16-byte chunk, more than one 128-row / 4-column tile of swizzled block scales, unaligned storage. The
GEMVs against float64 maths of the dequantized weight.
"""
from __future__ import annotations

import pytest
import torch

from comfy_metal.metal_kernels import dispatch, quant

ck = pytest.importorskip("comfy_kitchen", reason="comfy_kitchen (ComfyUI's requirements) is the oracle")
from comfy_kitchen.backends.eager import convrot_w4a4 as ck_w4a4  # noqa: E402
from comfy_kitchen.backends.eager import quantization as ck_q  # noqa: E402
from comfy_kitchen.backends.eager import w4a8_int8 as ck_w4a8  # noqa: E402
from comfy_kitchen.backends.eager.svdquant import _unpack_int4_row_major  # noqa: E402
from comfy_kitchen.tensor import QuantizedTensor  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.fixture(scope="module")
def lib():
    from comfy_metal.metal_kernels import emulator

    if not emulator.available():
        pytest.skip("the MSL emulator needs clang-19, which is not installed")
    return emulator.compile_library(dispatch.library_source(only="quant.metal"))


def assert_bits(got, want, what=""):
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape, got.dtype, want.dtype)
    g, w = got.float(), want.float()
    same = (g == w) | (torch.isnan(g) & torch.isnan(w))
    assert bool(same.all()), f"{what}: {int((~same).sum())} of {same.numel()} values differ, max " \
                             f"{(g - w).abs().nan_to_num(0).max().item():.3g}"
    assert torch.equal(g.signbit(), w.signbit()), f"{what}: signs of zeros differ"


def _weight(N, K, seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    w[0, : min(K, 8)] = 0.0                     # a zero block
    return w.to(dtype)


def both(lib, args, kw):
    return quant.quant_dequantize_reference(*args, **kw), quant.quant_dequantize_metal(lib, *args, **kw)


# (N, K): inside one tile; N, K off the padding (last partial block); two row tiles and > 4 block columns
BLOCK_SHAPES = [(48, 80), (40, 72), (33, 50), (200, 272)]


@pytest.mark.parametrize("N, K", BLOCK_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nvfp4_matches_comfy_kitchen(lib, N, K, dtype):
    qt = QuantizedTensor.from_float(_weight(N, K, 1, dtype), "TensorCoreNVFP4Layout")
    want = qt.dequantize()                                       # ComfyUI's QuantizedTensor dequantisation
    full = ck_q.dequantize_nvfp4(qt._qdata, qt._params.scale, qt._params.block_scale, dtype)
    assert torch.equal(full[:N, :K], want)
    args = (qt._qdata, "nvfp4", qt._params.block_scale, qt._params.scale)
    for got in both(lib, args, {"shape": (N, K), "out_dtype": dtype}):
        assert_bits(got, want, f"nvfp4 {N}x{K} {dtype}")


@pytest.mark.parametrize("N, K", BLOCK_SHAPES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mxfp8_matches_comfy_kitchen(lib, N, K, dtype):
    qt = QuantizedTensor.from_float(_weight(N, K, 2, dtype), "TensorCoreMXFP8Layout")
    want = qt.dequantize()
    args = (qt._qdata, "mxfp8", qt._params.scale)
    for got in both(lib, args, {"shape": (N, K), "out_dtype": dtype}):
        assert_bits(got, want, f"mxfp8 {N}x{K} {dtype}")


@pytest.mark.parametrize("N, K", [(48, 80), (5, 37), (33, 50)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("per_channel", [False, True])
def test_int8_matches_comfy_kitchen(lib, N, K, dtype, per_channel):
    qt = QuantizedTensor.from_float(_weight(N, K, 3, dtype), "TensorWiseINT8Layout", per_channel=per_channel)
    want = qt.dequantize()
    args = (qt._qdata, "int8", qt._params.scale)
    for got in both(lib, args, {"shape": (N, K), "out_dtype": dtype}):
        assert_bits(got, want, f"int8 {N}x{K} {dtype}")


@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_convrot_matches_comfy_kitchen(lib, dtype):
    N, K, g = 24, 128, 64
    qt = QuantizedTensor.from_float(_weight(N, K, 4, dtype), "TensorWiseINT8Layout", per_channel=True, convrot=True,
                                    convrot_groupsize=g)
    args = (qt._qdata, "int8", qt._params.scale)
    stored = ck_q.dequantize_int8_simple(qt._qdata, qt._params.scale)
    for got in both(lib, args, {"shape": (N, K), "out_dtype": torch.float32}):
        assert_bits(got, stored, "int8 convrot stored basis")
    assert_bits(quant.dequantize_weight(*args, shape=(N, K), convrot=g, out_dtype=dtype), qt.dequantize(),
                "int8 convrot original basis")


@pytest.mark.parametrize("N, K, group, convrot", [(24, 64, 16, 16), (7, 48, 16, 16), (16, 128, 32, 64)])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("codebook", [True, False])
def test_w4a8_matches_comfy_kitchen(lib, N, K, group, convrot, dtype, codebook):
    qd, s_rel, s_ch, corr, cb = ck_w4a8.quantize_w4a8_int8_weight(_weight(N, K, 5, dtype), group_size=group,
                                                                   convrot_groupsize=convrot, codebook=codebook)
    assert corr is None and (cb is not None) == codebook
    grid = ck_w4a8._dequant_int4_grouped_to_int8(qd, s_rel, cb, group)
    stored = ck_w4a8._dequantize_w4a8_int8_weight_from_int8(grid, s_ch, None, group, dtype)
    args = (qd, "w4a8", s_rel, s_ch, cb)
    kw = {"shape": (N, K), "group_size": group, "out_dtype": dtype}
    for got in both(lib, args, kw):
        assert_bits(got, stored, f"w4a8 {N}x{K} g{group} {dtype}")
    want = ck_w4a8.dequantize_w4a8_int8_weight(qd, s_rel, s_ch, cb, None, group, convrot, dtype)
    assert_bits(quant.dequantize_weight(*args, convrot=convrot, **kw), want, "w4a8 original basis")
    # and as ComfyUI's QuantizedTensor
    qt = QuantizedTensor(qd, "AsymW4A8Int8Layout", QuantizedTensor.from_float(
        _weight(N, K, 5, dtype), "AsymW4A8Int8Layout", group_size=group, convrot_groupsize=convrot,
        codebook=codebook)._params)
    assert_bits(qt.dequantize(), want)


def test_w4a8_float32_group_scales(lib):
    N, K = 8, 64
    qd, s_rel, s_ch, _, cb = ck_w4a8.quantize_w4a8_int8_weight(_weight(N, K, 6), group_size=16, convrot_groupsize=16,
                                                                scale_dtype=torch.float32)
    assert s_rel.dtype == torch.float32
    stored = ck_w4a8._dequantize_w4a8_int8_weight_from_int8(
        ck_w4a8._dequant_int4_grouped_to_int8(qd, s_rel, cb, 16), s_ch, None, 16, torch.float32)
    for got in both(lib, (qd, "w4a8", s_rel, s_ch, cb), {"shape": (N, K), "group_size": 16}):
        assert_bits(got, stored)


@pytest.mark.parametrize("N, K, convrot", [(24, 64, 16), (5, 128, 64), (3, 256, 256)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_w4a4_matches_comfy_kitchen(lib, N, K, convrot, dtype):
    qd, scales = ck_w4a4.quantize_convrot_w4a4_weight(_weight(N, K, 7, dtype), convrot, 64)
    stored = _unpack_int4_row_major(qd).float() * scales.reshape(-1, 1)
    args = (qd, "w4a4", scales)
    for got in both(lib, args, {"shape": (N, K)}):
        assert_bits(got, stored, f"w4a4 {N}x{K}")
    want = ck_w4a4.dequantize_convrot_w4a4_weight(qd, scales, convrot, 64, dtype)
    assert_bits(quant.dequantize_weight(*args, shape=(N, K), convrot=convrot, out_dtype=dtype), want)
    qt = QuantizedTensor.from_float(_weight(N, K, 7, dtype), "TensorCoreConvRotW4A4Layout", convrot_groupsize=convrot)
    assert_bits(quant.dequantize_weight(qt._qdata, "w4a4", qt._params.scale, shape=(N, K), convrot=convrot,
                                        out_dtype=dtype), qt.dequantize())


def test_hadamard_is_comfy_kitchens(lib):
    from comfy_kitchen.tensor.int8_utils import _build_hadamard

    for g in (4, 16, 64, 256):
        for dtype in DTYPES:
            assert torch.equal(quant.hadamard(g, "cpu", dtype), _build_hadamard(g, "cpu", dtype))
    x = torch.randn(3, 128)
    assert torch.equal(quant.rotate_activation(x, 64), ck_q._rotate_activation(x, _build_hadamard(64), 64))
    with pytest.raises(ValueError, match="power of 4"):
        quant.hadamard(32)


def test_unaligned_storage_takes_the_byte_path(lib):
    """Weights viewed at an odd byte offset (a memory-mapped tensor can start anywhere): the kernels load
    byte by byte instead of 16-byte vectors (a misaligned vector load faults in the emulator, as on the GPU)."""
    N, K = 40, 96
    qt = QuantizedTensor.from_float(_weight(N, K, 8), "TensorCoreNVFP4Layout")
    q = qt._qdata
    buf = torch.zeros(q.numel() + 1, dtype=torch.uint8)
    buf[1:] = q.reshape(-1)
    odd = buf[1:].view(q.shape)
    assert odd.data_ptr() % 16
    args = (odd, "nvfp4", qt._params.block_scale, qt._params.scale)
    assert_bits(quant.quant_dequantize_metal(lib, *args, shape=(N, K)), qt.dequantize())
    x = torch.randn(2, K)
    y = quant.quant_gemv_metal(lib, x, *args, shape=(N, K))
    torch.testing.assert_close(y, x @ qt.dequantize().T, rtol=1e-5, atol=1e-5)


CASES = [("nvfp4", 40, 72, {}), ("nvfp4", 200, 272, {}), ("mxfp8", 33, 50, {}), ("int8", 5, 37, {}),
         ("int8", 48, 80, {}), ("w4a8", 7, 48, {"group_size": 16}),
         ("w4a8", 5, 64, {"group_size": 32, "codebook": False}),
         ("w4a8", 4, 80, {"group_size": 16, "f32_srel": True}), ("w4a4", 5, 70, {}), ("w4a4", 9, 256, {})]


@pytest.mark.parametrize("fmt, N, K, variant", CASES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gemv_matches_float64_maths(lib, fmt, N, K, variant, dtype):
    gen = torch.Generator().manual_seed(9)
    q, s, s2, cb, kw = quant.random_weight(fmt, N, K, gen, **variant)
    w64 = quant.quant_dequantize_reference(q, fmt, s, s2, cb, **kw).double()
    for M in (1, 2, 5, 8, 11):
        x = torch.randn(M, K, generator=gen).to(dtype)
        bias = torch.randn(N, generator=gen).to(dtype) if M % 2 else None
        want = x.double() @ w64.T + (bias.double() if bias is not None else 0)
        for name, fn in (("reference", quant.quant_gemv_reference),
                         ("emulator", lambda *a, **k: quant.quant_gemv_metal(lib, *a, **k))):
            y = fn(x, q, fmt, s, s2, cb, bias, **kw)
            assert y.dtype == dtype and y.shape == (M, N)
            tol = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
            scale = x.double().abs() @ w64.abs().T + (bias.double().abs() if bias is not None else 0) + 1e-3
            err = ((y.double() - want).abs() / scale).max().item()
            assert err < tol, f"{name} {fmt} {N}x{K} M={M} {dtype}: error {err:.3g}"


def test_bad_inputs_name_what_was_expected_and_found():
    gen = torch.Generator().manual_seed(1)
    q, s, s2, cb, kw = quant.random_weight("nvfp4", 40, 72, gen)
    with pytest.raises(ValueError, match=r"block scales .* must hold 1024 values .* got \(64,\)"):
        quant.quant_dequantize(q, "nvfp4", s.reshape(-1)[:64], s2, shape=(40, 72))
    with pytest.raises(ValueError, match=r"tensor scale \(weight_scale_2\)"):
        quant.quant_dequantize(q, "nvfp4", s, None, shape=(40, 72))
    with pytest.raises(ValueError, match=r"must have shape \(48, 40\), got \(48, 36\)"):
        quant.quant_dequantize(q[:, :36], "nvfp4", s, s2, shape=(40, 72))
    with pytest.raises(ValueError, match=r"group size 24"):
        quant.quant_layout("w4a8", (8, 48), 24)
    with pytest.raises(ValueError, match=r"not supported; expected one of"):
        quant.quant_layout("svdquant", (8, 48))
    with pytest.raises(TypeError, match="out_dtype"):
        quant.quant_dequantize(q, "nvfp4", s, s2, shape=(40, 72), out_dtype=torch.int32)


def test_public_functions_run_the_emulated_kernels(monkeypatch):
    """The dispatch path: self-check in the emulator (every entry point), then the launch glue."""
    from comfy_metal.metal_kernels import emulator

    if not emulator.available():
        pytest.skip("the MSL emulator needs clang-19, which is not installed")
    monkeypatch.setenv("COMFY_METAL_BACKEND", "emulator")
    dispatch.reset()
    try:
        gen = torch.Generator().manual_seed(2)
        q, s, s2, cb, kw = quant.random_weight("w4a8", 6, 48, gen)
        y = quant.quant_gemv(torch.randn(3, 48), q, "w4a8", s, s2, cb, **kw)
        w = quant.quant_dequantize(q, "w4a8", s, s2, cb, **kw)
        assert y.shape == (3, 6) and w.shape == (6, 48)
        for name in ("quant_gemv", "quant_dequantize"):
            assert dispatch.last_backend[name] == "emulator", dispatch.choose(
                getattr(quant, name).spec, torch.device("cpu"))[1]
    finally:
        dispatch.reset()
