"""GGUF Metal kernels (gguf.metal) in the MSL emulator, through the real launch glue: the dequantise
kernel equals the gguf package's numpy dequantiser bit for bit (fp32 output) at every type and odd row
counts, and rounds once to fp16/bf16; the fused dequantise + GEMV agrees with a float64 matmul of the
package's values within fp32 accumulation error; both pass their registry self-check."""
from __future__ import annotations

import pytest
import torch
from synthetic_kernels import RecordingLibrary

from comfy_metal.metal_kernels import dispatch
from comfy_metal.metal_kernels.dtypes import MSL_TYPE
from comfy_metal.metal_kernels.gguf import (GGUF_QUANTS, gguf_dequantize_metal, gguf_gemv_metal,
                                            gguf_logical_shape, random_blocks)

gguf = pytest.importorskip("gguf")
from gguf.quants import dequantize as np_dequantize  # noqa: E402

QTYPES = list(GGUF_QUANTS)


def oracle(data, qtype):
    return torch.from_numpy(np_dequantize(data.numpy(), gguf.GGMLQuantizationType[qtype]).copy())


@pytest.fixture(scope="module")
def lib():
    from comfy_metal.metal_kernels import emulator

    if not emulator.available():
        pytest.skip("the MSL emulator needs clang-19, which is not installed")
    return emulator.compile_library(dispatch.library_source(only="gguf.metal"))


@pytest.mark.parametrize("qtype", QTYPES)
def test_emulated_dequant_bit_exact(lib, qtype):
    gen = torch.Generator().manual_seed(7)
    for rows, blocks in [(1, 1), (7, 3), (5, 2)]:
        data = random_blocks(qtype, rows, blocks, gen)
        want = oracle(data, qtype)
        got = gguf_dequantize_metal(lib, data, qtype, torch.float32)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (qtype, rows, blocks)
        for dt in (torch.float16, torch.bfloat16):
            got = gguf_dequantize_metal(lib, data, qtype, dt)
            assert got.dtype == dt and torch.equal(got, want.to(dt)), (qtype, dt)


@pytest.mark.parametrize("qtype", QTYPES)
def test_emulated_dequant_extreme_scales_bit_exact(lib, qtype):
    """Large, tiny and subnormal fp16 scales (and zero) through the kernel: still the package's bits (the
    scales folded by powers of two, the quants read through half bits)."""
    from comfy_metal.metal_kernels.gguf import GGUF_TYPES

    gen = torch.Generator().manual_seed(5)
    data = random_blocks(qtype, 9, 2, gen)
    blocks = data.reshape(-1, GGUF_QUANTS[qtype][1])
    specials = torch.tensor([65504.0, -3.0e-8, 6.0e-5, 0.0, -1.0, 1e-7], dtype=torch.float16).view(torch.uint8)
    for i in range(blocks.shape[0]):
        for off in GGUF_TYPES[qtype].f16_offsets:
            k = (i + off) % 6
            blocks[i, off:off + 2] = specials[2 * k:2 * k + 2]
    got = gguf_dequantize_metal(lib, data, qtype, torch.float32)
    assert torch.equal(got.view(torch.int32), oracle(data, qtype).view(torch.int32))


def test_emulated_dequant_strides_past_the_grid(lib, monkeypatch):
    """More values than threads * 4: each thread strides (the MAX_THREADS cap, made small here)."""
    from comfy_metal.metal_kernels import gguf as mod

    monkeypatch.setattr(mod, "MAX_THREADS", 5)
    gen = torch.Generator().manual_seed(8)
    data = random_blocks("Q5_0", 3, 2, gen)
    assert torch.equal(gguf_dequantize_metal(lib, data, "Q5_0"), oracle(data, "Q5_0"))


def test_emulated_dequant_in_several_launches(lib, monkeypatch):
    """Past MAX_LAUNCH_VALUES values (the kernel's 32-bit offsets) the blocks go in several launches, each
    binding its own views of the input and the output (made small here)."""
    from comfy_metal.metal_kernels import gguf as mod

    monkeypatch.setattr(mod, "MAX_LAUNCH_VALUES", 256)
    gen = torch.Generator().manual_seed(13)
    for qtype in ("Q8_0", "Q4_K"):                     # 8 and 1 block(s) a launch
        data = random_blocks(qtype, 5, 3, gen)
        assert torch.equal(gguf_dequantize_metal(lib, data, qtype), oracle(data, qtype)), qtype


@pytest.mark.parametrize("qtype", QTYPES)
def test_emulated_gemv_against_float64(lib, qtype):
    gen = torch.Generator().manual_seed(9)
    for M, N, blocks, with_bias in [(1, 5, 1, True), (3, 9, 2, False), (8, 4, 3, True), (11, 3, 1, True)]:
        data = random_blocks(qtype, N, blocks, gen)
        K = gguf_logical_shape(data.shape, qtype)[1]
        w = oracle(data, qtype).double()
        x = torch.randn(M, K, generator=gen)
        b = torch.randn(N, generator=gen) if with_bias else None
        got = gguf_gemv_metal(lib, x, data, qtype, b)
        want = x.double() @ w.T
        mag = x.double().abs() @ w.abs().T
        if b is not None:
            want, mag = want + b.double(), mag + b.double().abs()
        bound = (K + 3) * 2.0 ** -24 * mag + 1e-30
        err = (got.double() - want).abs()
        assert got.shape == (M, N) and (err <= bound).all(), (qtype, M, float(err.max()))


@pytest.mark.parametrize("qtype", QTYPES)
def test_emulated_gemv_tail_paths(lib, qtype):
    """Every M = 1..8 (the M buckets 1, 2, 4, 8 and their masked x rows), N not a multiple of the rows a
    simdgroup covers, rows of one block and rows whose chunks end in a partial step of the 32 lanes, an odd
    number of blocks a row (rows of 34-, 18-, 22-, 110-, 210-byte blocks start 2-aligned only), half and
    bfloat activations converted in the kernel and every output type: within fp32 accumulation error of a
    float64 matmul of the package's values."""
    bs, _ = GGUF_QUANTS[qtype]
    gen = torch.Generator().manual_seed(11)
    rec = RecordingLibrary(lib)
    out_dtypes = (None, torch.float32, torch.float16, torch.bfloat16)
    for M in range(1, 9):
        N = (1, 3, 5, 6, 9, 2, 7, 4)[M - 1]
        blocks = (1, 17 if bs == 32 else 5)[M % 2]
        xdtype = (torch.float32, torch.float16, torch.bfloat16)[M % 3]
        out_dtype = out_dtypes[M % 4]
        data = random_blocks(qtype, N, blocks, gen, scale=0.01)
        K = gguf_logical_shape(data.shape, qtype)[1]
        w = oracle(data, qtype).double()
        x = torch.randn(M, K, generator=gen).to(xdtype)
        b = torch.randn(N, generator=gen).to(xdtype) if M % 2 else None
        rec.launched.clear()
        got = gguf_gemv_metal(rec, x, data, qtype, b, out_dtype=out_dtype)
        assert rec.launched == [f"gguf_gemv_{qtype.lower()}_{MSL_TYPE[xdtype]}"]
        want = x.double() @ w.T
        mag = x.double().abs() @ w.abs().T
        if b is not None:
            want, mag = want + b.double(), mag + b.double().abs()
        out = out_dtype or xdtype
        eps = {torch.float32: 2.0 ** -24, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[out]
        bound = (K + 3) * 2.0 ** -24 * mag + 1.01 * eps * want.abs() + 1e-6
        err = (got.double() - want).abs()
        assert got.shape == (M, N) and got.dtype == out and (err <= bound).all(), (qtype, M, N, K, float(err.max()))


def test_emulated_gemv_dtypes_and_leading_dims(lib):
    gen = torch.Generator().manual_seed(10)
    data = random_blocks("Q4_K", 6, 1, gen, scale=0.002)
    x = torch.randn(2, 3, 256, generator=gen).to(torch.bfloat16)
    got = gguf_gemv_metal(lib, x, data, "Q4_K", out_dtype=torch.float16)
    want = x.reshape(6, 256).double() @ oracle(data, "Q4_K").double().T
    assert got.shape == (2, 3, 6) and got.dtype == torch.float16
    assert torch.allclose(got.reshape(6, 6).double(), want, atol=2e-2, rtol=2e-3)
    assert gguf_gemv_metal(lib, torch.zeros(0, 256), data, "Q4_K").shape == (0, 6)


@pytest.mark.usefixtures("emulator_backend")
def test_self_checks_pass_in_the_emulator():
    from comfy_metal.metal_kernels import gguf_dequantize, gguf_gemv

    for fn in (gguf_dequantize, gguf_gemv):
        backend, reason = dispatch.choose(fn.spec, torch.device("cpu"))
        assert backend == "emulator", reason
    # the self-check exercises every entry point
    cases = gguf_dequantize.spec.self_check_cases(torch.device("cpu"))
    seen = {(args[1], kw["out_dtype"]) for args, kw in cases}
    assert len(seen) == len(gguf_dequantize.spec.entry_points)
    assert {args[2] for args, _ in gguf_gemv.spec.self_check_cases(torch.device("cpu"))} == set(QTYPES)
