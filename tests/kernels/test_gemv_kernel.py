"""GEMV (linear.metal / linear.py): the reference against a float64 matmul of the decoded weight (the
oracle), then the Metal kernel in the MSL emulator, through the real launch glue, on odd shapes."""
from __future__ import annotations

import itertools

import pytest
import torch
from synthetic_kernels import RecordingLibrary

from comfy_metal.metal_kernels import dispatch, linear
from comfy_metal.metal_kernels.dtypes import FP8_DTYPES
from comfy_metal.metal_kernels.linear import gemv_metal, gemv_reference

NATIVE = FP8_DTYPES
WEIGHT_TYPES = (torch.float32, torch.float16, torch.bfloat16, "e4m3fn", "e5m2")
EPS32 = 2.0 ** -24


def make_weight(kind, N, K, gen):
    """(weight as passed to gemv, kwargs, its exact float64 value)."""
    if isinstance(kind, str):
        raw = torch.randint(0, 256, (N, K), generator=gen, dtype=torch.uint8)
        raw = raw & 0xBF            # |w| < 2, no inf/NaN codes
        exact = raw.view(NATIVE[kind]).to(torch.float64)       # torch's own float8 cast, not ours
        return raw, {"fmt": kind}, exact
    w = torch.randn(N, K, generator=gen).to(kind)
    return w, {}, w.to(torch.float64)


def make_scale(mode, N, gen):
    if mode is None:
        return None
    if mode == "tensor":
        return torch.tensor([0.731])
    s = torch.rand(N, generator=gen) + 0.05
    return s if mode == "row" else s[:, None]


def oracle(x, w_exact, scale, bias):
    """float64 matmul of the decoded, scaled weight; also sum |x| |w s| (bounds fp32 rounding)."""
    w = w_exact
    if scale is not None:
        s = scale.double()
        w = w * (s.reshape(()) if s.numel() == 1 else s.reshape(-1, 1))
    x2 = x.reshape(-1, x.shape[-1]).double()
    y = x2 @ w.T
    mag = x2.abs() @ w.abs().T
    if bias is not None:
        y = y + bias.double()
        mag = mag + bias.double().abs()
    lead = tuple(x.shape[:-1])
    return y.reshape(lead + (w.shape[0],)), mag.reshape(lead + (w.shape[0],))


def assert_close_to_oracle(got, want, mag, K, out_dtype=torch.float32):
    """fp32 accumulation in any order: |err| <= (K + 3) * eps32 * sum|terms|, plus one rounding of the
    output dtype."""
    assert got.shape == want.shape, (got.shape, want.shape)
    assert got.dtype == out_dtype
    out_eps = {torch.float32: EPS32, torch.float16: 2.0 ** -11, torch.bfloat16: 2.0 ** -8}[out_dtype]
    bound = (K + 3) * EPS32 * mag + out_eps * want.abs() * 1.01 + 1e-30
    if out_dtype == torch.float16:
        bound = bound + 2.0 ** -24          # fp16 subnormal spacing
    err = (got.double() - want).abs()
    bad = err > bound
    assert not bad.any(), (f"{int(bad.sum())} of {bad.numel()} outputs off: max err {float(err.max()):.3g}, "
                           f"bound there {float(bound.flatten()[err.argmax()]):.3g}")


# ---------------------------------------------------------------------------------------------
# The reference against the float64 oracle
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind", WEIGHT_TYPES)
def test_reference_matches_float64_oracle(kind):
    gen = torch.Generator().manual_seed(1)
    for M, K, N in [(1, 1, 1), (3, 33, 5), (8, 257, 67), (5, 36, 4)]:
        for smode, with_bias in itertools.product((None, "tensor", "row", "row1"), (False, True)):
            x = torch.randn(M, K, generator=gen)
            w, kw, w_exact = make_weight(kind, N, K, gen)
            scale = make_scale(smode, N, gen)
            bias = torch.randn(N, generator=gen) if with_bias else None
            want, mag = oracle(x, w_exact, scale, bias)
            assert_close_to_oracle(gemv_reference(x, w, bias, scale=scale, **kw), want, mag, K)
            if isinstance(kind, str):   # native float8 weight, fmt inferred
                got = gemv_reference(x, w.view(NATIVE[kind]), bias, scale=scale)
                assert_close_to_oracle(got, want, mag, K)


def test_reference_shapes_dtypes_and_errors():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(2, 3, 10, generator=gen).to(torch.bfloat16)
    w = torch.randn(7, 10, generator=gen).to(torch.float16)
    y = gemv_reference(x, w)
    assert y.shape == (2, 3, 7) and y.dtype == torch.bfloat16
    assert gemv_reference(x, w, out_dtype=torch.float32).dtype == torch.float32
    with pytest.raises(ValueError, match=r"expected \(N, 10\)"):
        gemv_reference(x, torch.zeros(7, 9))
    with pytest.raises(ValueError, match="need fmt"):
        gemv_reference(x, torch.zeros(7, 10, dtype=torch.uint8))
    with pytest.raises(ValueError, match="fmt"):
        gemv_reference(x, w, fmt="e4m3fn")
    with pytest.raises(ValueError, match=r"\(7,\) or \(7, 1\)"):
        gemv_reference(x, w, scale=torch.ones(10))
    with pytest.raises(ValueError, match="bias"):
        gemv_reference(x, w, torch.ones(6))
    with pytest.raises(TypeError, match="x must be"):
        gemv_reference(x.to(torch.int32), w)


# ---------------------------------------------------------------------------------------------
# The kernel in the emulator
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lib():
    try:
        from comfy_metal.metal_kernels import emulator
    except ImportError as e:
        pytest.skip(f"the MSL emulator package is not importable yet: {e}")
    if not emulator.available():
        pytest.skip("the MSL emulator needs clang-19, which is not installed")
    # common.metal + linear.metal (the whole library is compiled and linted in tests/emulator/test_msl_library.py)
    return emulator.compile_library(dispatch.library_source(only="linear.metal"))


@pytest.mark.parametrize("kind", WEIGHT_TYPES)
def test_emulated_gemv_all_small_shapes(lib, kind):
    """M 1..8 x K {1, 7, 33, 257} x N {1, 5, 67}; scale mode and bias rotate through the shapes so
    each shape meets one and every (scale, bias) pair meets many shapes."""
    gen = torch.Generator().manual_seed(3)
    pairs = list(itertools.product((None, "tensor", "row", "row1"), (False, True)))
    for i, (M, K, N) in enumerate(itertools.product(range(1, 9), (1, 7, 33, 257), (1, 5, 67))):
        smode, with_bias = pairs[i % len(pairs)]
        x = torch.randn(M, K, generator=gen)
        w, kw, w_exact = make_weight(kind, N, K, gen)
        scale = make_scale(smode, N, gen)
        bias = torch.randn(N, generator=gen) if with_bias else None
        want, mag = oracle(x, w_exact, scale, bias)
        got = gemv_metal(lib, x, w, bias, scale=scale, **kw)
        assert_close_to_oracle(got, want, mag, K)


@pytest.mark.parametrize("kind", WEIGHT_TYPES)
def test_emulated_gemv_vectorised_path_every_scale_and_bias(lib, kind):
    """K * element size % 16 == 0 takes the vector kernels (16 weight bytes a lane and chunk): one chunk,
    a partial step of the 32 lanes (K = 48 .. 528), several full steps; every M bucket with masked x rows
    (M = 3, 5, 7) and N not a multiple of the rows a simdgroup covers."""
    gen = torch.Generator().manual_seed(4)
    rec = RecordingLibrary(lib)
    shapes = [(1, 16, 3), (8, 48, 5), (3, 528, 9), (2, 272, 1), (5, 1040, 6), (7, 32, 2), (4, 64, 7)]
    for (M, K, N), smode, with_bias in itertools.product(shapes, (None, "tensor", "row", "row1"), (False, True)):
        x = torch.randn(M, K, generator=gen)
        w, kw, w_exact = make_weight(kind, N, K, gen)
        scale = make_scale(smode, N, gen)
        bias = torch.randn(N, generator=gen) if with_bias else None
        want, mag = oracle(x, w_exact, scale, bias)
        rec.launched.clear()
        assert_close_to_oracle(gemv_metal(rec, x, w, bias, scale=scale, **kw), want, mag, K)
        assert rec.launched and not rec.launched[0].endswith("_scalar"), (M, K, N, rec.launched)


@pytest.mark.parametrize("x_dtype,out_dtype", [(torch.float16, None), (torch.bfloat16, None),
                                               (torch.bfloat16, torch.float32), (torch.float32, torch.float16)])
def test_emulated_gemv_input_and_output_dtypes(lib, x_dtype, out_dtype):
    gen = torch.Generator().manual_seed(5)
    for kind in ("e4m3fn", torch.bfloat16):
        x = torch.randn(2, 3, 37, generator=gen).to(x_dtype)           # leading dims, M = 6
        w, kw, w_exact = make_weight(kind, 11, 37, gen)
        bias = torch.randn(11, generator=gen).to(torch.bfloat16)
        scale = torch.rand(11, 1, generator=gen) + 0.5
        want, mag = oracle(x, w_exact, scale, bias)
        got = gemv_metal(lib, x, w, bias, scale=scale, out_dtype=out_dtype, **kw)
        assert_close_to_oracle(got, want, mag, 37, out_dtype or x_dtype)


def test_emulated_gemv_launch_glue_edge_cases(lib):
    gen = torch.Generator().manual_seed(6)
    K, N = 12, 7
    # native float8 weight; a non-contiguous weight; a weight at an odd storage offset (scalar kernel)
    raw = torch.randint(0, 256, (N, K), generator=gen, dtype=torch.uint8) & 0xBF
    exact = raw.view(torch.float8_e5m2).double()
    x = torch.randn(3, K, generator=gen)
    want, mag = oracle(x, exact, None, None)
    assert_close_to_oracle(gemv_metal(lib, x, raw.view(torch.float8_e5m2)), want, mag, K)
    w_t = torch.randn(K, N, generator=gen).t()
    want, mag = oracle(x, w_t.double(), None, None)
    assert_close_to_oracle(gemv_metal(lib, x, w_t), want, mag, K)
    flat = torch.randint(0, 256, (N * K + 1,), generator=gen, dtype=torch.uint8) & 0xBF
    w_off = flat[1:].view(N, K)
    assert w_off.storage_offset() == 1
    want, mag = oracle(x, w_off.view(torch.float8_e4m3fn).double(), None, None)
    assert_close_to_oracle(gemv_metal(lib, x, w_off, fmt="e4m3fn"), want, mag, K)
    # non-contiguous x; M > 8 runs in chunks of 8
    xt = torch.randn(K, 11, generator=gen).t()
    w = torch.randn(N, K, generator=gen)
    b = torch.randn(N, generator=gen)
    want, mag = oracle(xt, w.double(), None, b)
    assert_close_to_oracle(gemv_metal(lib, xt, w, b), want, mag, K)
    # an fp32 x at an odd storage offset with K % 4 == 0 (the vector kernels load x as float4)
    x_off = torch.randn(2 * 36 + 1, generator=gen)[1:].view(2, 36)
    w36 = torch.randn(N, 36, generator=gen).to(torch.float16)
    want, mag = oracle(x_off, w36.double(), None, b)
    assert_close_to_oracle(gemv_metal(lib, x_off, w36, b), want, mag, 36)
    # 0-size: no rows, no columns, K = 0 (y = bias)
    assert gemv_metal(lib, torch.zeros(0, K), w).shape == (0, N)
    assert gemv_metal(lib, x, torch.zeros(0, K)).shape == (3, 0)
    y = gemv_metal(lib, torch.zeros(2, 0), torch.zeros(N, 0), b)
    assert torch.equal(y, b.expand(2, N))


def test_gemv_node_path_runs_the_emulated_kernel(monkeypatch):
    """Through the public function: dispatch self-checks the kernel in the emulator, then uses it."""
    pytest.importorskip("comfy_metal.metal_kernels.emulator")
    from comfy_metal import metal_kernels

    monkeypatch.setenv("COMFY_METAL_BACKEND", "emulator")
    monkeypatch.delenv("COMFY_METAL_REFERENCE", raising=False)
    dispatch.reset()
    try:
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(1, 2, 40, generator=gen).to(torch.bfloat16)
        raw = torch.randint(0, 256, (9, 40), generator=gen, dtype=torch.uint8) & 0xBF
        scale = torch.rand(9, generator=gen) + 0.1
        y = metal_kernels.gemv(x, raw, fmt="e4m3fn", scale=scale)
        assert dispatch.last_backend["gemv"] == "emulator", dispatch.choose(linear.gemv.spec, torch.device("cpu"))[1]
        want, mag = oracle(x, raw.view(torch.float8_e4m3fn).double(), scale, None)
        assert_close_to_oracle(y, want, mag, 40, torch.bfloat16)
    finally:
        dispatch.reset()


def test_kernels_bench_tables(monkeypatch):
    """`bench(quick)` of nodes/cli/bench/kernels.py at a toy size: both tables, every row filled (the GEMV
    crossover by M is bench_fp8's table)."""
    from comfy_metal.nodes.cli.bench import kernels as bench_kernels

    monkeypatch.setattr(bench_kernels, "SIZES", {True: 64, False: 64})
    tables = bench_kernels.bench(quick=True)
    titles = [t.title for t in tables]
    assert titles == ["Kernels: Metal vs reference", "GEMV weight storage by type"]
    kernels, storage = tables
    assert {r[0] for r in kernels.rows} == {"fp8_decode", "fp8_encode", "gemv"}
    assert all(isinstance(r[2], float) and r[2] > 0 for r in kernels.rows)
    assert [r[1] for r in storage.rows] == [4, 2, 2, 1, 1]
    for t in tables:
        assert t.title in t.render()


@pytest.mark.skipif(not __import__("comfy_metal.metal_kernels.emulator", fromlist=["available"]).available(),
                    reason="clang-19 not found: the MSL emulator cannot run")
def test_misaligned_weight_storage_takes_the_scalar_kernel():
    """A weight memory-mapped from a safetensors file can start at any byte (storage_offset 0, base
    off alignment): the vector kernels would do misaligned 16-byte loads, so the glue must pick
    the scalar kernel, and the result must still match."""
    from comfy_metal.metal_kernels import dispatch as dispatch_module
    from comfy_metal.metal_kernels.emulator import compile_library

    lib = compile_library(dispatch_module.library_source())
    launched = []

    class Recording:
        def __getattr__(self, name):
            launched.append(name)
            return getattr(lib, name)

    gen = torch.Generator().manual_seed(11)
    x = torch.randn(2, 32, generator=gen)
    for dtype in (torch.float32, torch.float16):
        size = torch.tensor([], dtype=dtype).element_size()
        raw = bytearray((7 * 32 + 4) * size)
        w = next(t for t in (torch.frombuffer(raw, dtype=dtype, offset=o * size, count=7 * 32) for o in range(4))
                 if t.data_ptr() % (4 * size) != 0).view(7, 32)
        w.copy_(torch.randn(7, 32, generator=gen))
        assert w.storage_offset() == 0
        launched.clear()
        torch.testing.assert_close(gemv_metal(Recording(), x, w), gemv_reference(x, w), atol=1e-4, rtol=1e-3)
        assert launched and launched[0].endswith("_scalar"), launched
        aligned = w.clone()
        launched.clear()
        gemv_metal(Recording(), x, aligned)
        assert launched and not launched[0].endswith("_scalar"), launched


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_emulated_gemv_fp8_special_codes(lib, fmt):
    """Every FP8 code, NaN and (e5m2) infinity included, in the vector and the scalar kernels: the outputs
    are NaN / inf exactly where the reference's are, and the rest within fp32 accumulation error (the
    e4m3fn NaN code is the one select of the half-bits decode)."""
    gen = torch.Generator().manual_seed(12)
    for K in (256, 255):                                  # vector (16 codes a lane) and scalar kernels
        codes = torch.arange(256, dtype=torch.uint8)[:K]
        w = torch.stack([codes.roll(17 * n) for n in range(5)])      # (5, K): every code in every row
        w[1] &= 0xBF                                                  # one row without specials
        x = torch.rand(2, K, generator=gen) + 0.5                     # positive: inf stays inf
        got = gemv_metal(lib, x, w, fmt=fmt, scale=torch.tensor([0.5]))
        want = gemv_reference(x, w, fmt=fmt, scale=torch.tensor([0.5]))
        assert torch.equal(torch.isnan(got), torch.isnan(want)), (K, got, want)
        assert torch.isnan(want).any() and not torch.isnan(want[:, 1]).any()
        finite = torch.isfinite(want)
        assert torch.equal(got[~finite & ~torch.isnan(want)], want[~finite & ~torch.isnan(want)])
        torch.testing.assert_close(got[finite], want[finite], rtol=1e-5, atol=1e-3)
