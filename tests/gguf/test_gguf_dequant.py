"""GGUF dequantisation (metal_kernels/gguf.py): the pure-torch reference against the gguf package's own
numpy dequantiser (the oracle), bit for bit, for every supported type; the GEMV reference against a
float64 matmul of the oracle's values."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from comfy_metal.metal_kernels.gguf import (GGUF_QUANTS, gguf_byte_shape, gguf_dequantize_reference,
                                            gguf_gemv_reference, gguf_logical_shape, random_blocks)

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as np_dequantize, quantize as np_quantize  # noqa: E402

QTYPES = list(GGUF_QUANTS)
# The types the gguf package can quantise (the others are K-/IQ-quants it only dequantises).
QUANTISABLE = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"]


def oracle(data: torch.Tensor, qtype: str) -> torch.Tensor:
    return torch.from_numpy(np_dequantize(data.numpy(), gguf.GGMLQuantizationType[qtype]).copy())


def test_block_sizes_are_the_packages():
    for q, (bs, ts) in GGUF_QUANTS.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[q]] == (bs, ts), q


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("rows,blocks", [(1, 1), (7, 3), (13, 2)])
def test_random_blocks_bit_exact(qtype, rows, blocks):
    gen = torch.Generator().manual_seed(hash((qtype, rows, blocks)) % 2**31)
    data = random_blocks(qtype, rows, blocks, gen)
    got = gguf_dequantize_reference(data, qtype)
    want = oracle(data, qtype)
    assert got.dtype == torch.float32 and got.shape == want.shape == gguf_logical_shape(data.shape, qtype)
    assert torch.isfinite(want).all()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32)), \
        f"{int((got != want).sum())} values differ, max {float((got - want).abs().max()):.3g}"


@pytest.mark.parametrize("qtype", QTYPES)
def test_extreme_scales_and_subnormals_bit_exact(qtype):
    """Large, tiny and subnormal fp16 scales (and zero) still agree bit for bit."""
    gen = torch.Generator().manual_seed(5)
    data = random_blocks(qtype, 9, 2, gen)
    from comfy_metal.metal_kernels.gguf import GGUF_TYPES
    _, ts = GGUF_QUANTS[qtype]
    blocks = data.reshape(-1, ts)
    specials = torch.tensor([65504.0, -3.0e-8, 6.0e-5, 0.0, -1.0, 1e-7], dtype=torch.float16).view(torch.uint8)
    for i in range(blocks.shape[0]):
        for off in GGUF_TYPES[qtype].f16_offsets:
            k = (i + off) % 6
            blocks[i, off:off + 2] = specials[2 * k:2 * k + 2]
    got = gguf_dequantize_reference(data, qtype)
    want = oracle(data, qtype)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


@pytest.mark.parametrize("qtype", QUANTISABLE)
def test_package_quantised_weights_bit_exact(qtype):
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(11, 96, generator=gen) * 0.1
    data = torch.from_numpy(np_quantize(w.numpy(), gguf.GGMLQuantizationType[qtype]))
    assert data.dtype == torch.uint8 and data.shape == gguf_byte_shape(w.shape, qtype)
    got = gguf_dequantize_reference(data, qtype)
    assert torch.equal(got, oracle(data, qtype))
    # and it is a quantisation of w (a wrong layout would be far off)
    tol = {"Q8_0": 0.01, "Q5_0": 0.03, "Q5_1": 0.03}.get(qtype, 0.06)
    assert (got - w).abs().max() < tol * w.abs().max() * 4


@pytest.mark.parametrize("out_dtype", [torch.float16, torch.bfloat16])
def test_out_dtype_rounds_once_from_fp32(out_dtype):
    gen = torch.Generator().manual_seed(3)
    for qtype in QTYPES:
        data = random_blocks(qtype, 3, 1, gen)
        got = gguf_dequantize_reference(data, qtype, out_dtype)
        assert got.dtype == out_dtype
        assert torch.equal(got, oracle(data, qtype).to(out_dtype))


def test_leading_dims_and_errors():
    gen = torch.Generator().manual_seed(4)
    data = random_blocks("Q4_K", 6, 1, gen)
    got = gguf_dequantize_reference(data.reshape(2, 3, -1), "Q4_K")
    assert got.shape == (2, 3, 256)
    assert torch.equal(got.reshape(6, 256), oracle(data, "Q4_K"))
    with pytest.raises(ValueError, match="Q4_K.*Q8_0|supported"):
        gguf_dequantize_reference(data, "Q7_Z")
    with pytest.raises(ValueError, match="whole number"):
        gguf_dequantize_reference(data[:, :100], "Q4_K")
    with pytest.raises(TypeError, match="uint8"):
        gguf_dequantize_reference(data.float(), "Q4_K")
    assert gguf_dequantize_reference(torch.zeros(0, 144, dtype=torch.uint8), "Q4_K").shape == (0, 256)


@pytest.mark.parametrize("qtype", QTYPES)
def test_gemv_reference_matches_float64(qtype):
    gen = torch.Generator().manual_seed(6)
    N = 5
    data = random_blocks(qtype, N, 2, gen)
    K = gguf_logical_shape(data.shape, qtype)[1]
    w = oracle(data, qtype).double()
    for M in (1, 3, 8, 11):
        x = torch.randn(M, K, generator=gen)
        b = torch.randn(N, generator=gen)
        got = gguf_gemv_reference(x, data, qtype, b)
        want = x.double() @ w.T + b.double()
        mag = x.double().abs() @ w.abs().T + b.double().abs()
        assert ((got.double() - want).abs() <= (K + 3) * 2.0 ** -24 * mag + 1e-30).all()
    with pytest.raises(ValueError, match="features"):
        gguf_gemv_reference(torch.randn(1, K + 1), data, qtype)
