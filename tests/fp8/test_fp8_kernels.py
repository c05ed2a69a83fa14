"""FP8 decode / encode: references against torch's own float8 casts (the oracle), then the Metal kernels
(fp8.metal + common.metal, through the real launch glue) in the MSL emulator against the references."""
from __future__ import annotations

import pytest
import torch

from comfy_metal.metal_kernels import dispatch, fp8
from comfy_metal.metal_kernels.fp8 import (decode_arith, decode_table, encode_arith, fp8_decode_metal,
                                           fp8_decode_reference, fp8_encode_metal, fp8_encode_reference)

NATIVE = {"e4m3fn": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
OUT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
CODES = torch.arange(256, dtype=torch.uint8)


def oracle_decode(raw, fmt, scale=None, out_dtype=torch.float32):
    """torch's own float8 cast, times the scale in fp32."""
    v = raw.view(NATIVE[fmt]).to(torch.float32)
    if scale is not None:
        s = scale.float()
        v = v * (s.reshape(()) if s.numel() == 1 else s.reshape((-1,) + (1,) * (raw.dim() - 1)))
    return v.to(out_dtype)


def oracle_encode(x, fmt, scale=None):
    v = x.float()
    if scale is not None:
        s = scale.float()
        v = v / (s.reshape(()) if s.numel() == 1 else s.reshape((-1,) + (1,) * (x.dim() - 1)))
    mx = fp8.FP8_MAX[fmt]
    return v.clamp(-mx, mx).to(NATIVE[fmt]).view(torch.uint8)


def assert_same_values(got, want):
    assert got.dtype == want.dtype and got.shape == want.shape, (got.dtype, got.shape, want.dtype, want.shape)
    g, w = got.float(), want.float()
    assert torch.equal(torch.isnan(g), torch.isnan(w)), "NaN in different places"
    ok = torch.isnan(w) | (g == w)
    assert bool(ok.all()), f"{int((~ok).sum())} values differ, first at {(~ok).nonzero()[:3].tolist()}"
    # +0 / -0 too
    assert torch.equal(torch.signbit(g[~torch.isnan(w)]), torch.signbit(w[~torch.isnan(w)]))


def assert_same_bytes(got, want, x=None):
    assert got.dtype == torch.uint8 and got.shape == want.shape
    bad = got != want
    if bad.any():
        i = bad.nonzero()[:5].flatten() if got.dim() == 1 else bad.reshape(-1).nonzero()[:5].flatten()
        where = "" if x is None else f" inputs {x.reshape(-1)[i].tolist()}"
        raise AssertionError(f"{int(bad.sum())} of {bad.numel()} bytes differ: got {got.reshape(-1)[i].tolist()} "
                             f"want {want.reshape(-1)[i].tolist()}{where}")


def _midpoints(fmt: str) -> torch.Tensor:
    vals = CODES.view(NATIVE[fmt]).double()
    vals = vals[torch.isfinite(vals)].unique()
    return ((vals[1:] + vals[:-1]) / 2).float()


def dense_sweep(fmt: str, n_random: int = 200_000) -> torch.Tensor:
    """Every fp16 value, every bf16 value, random fp32 bit patterns, and each FP8 rounding boundary
    (the midpoints between consecutive values) with its two fp32 neighbours."""
    gen = torch.Generator().manual_seed(11)
    all16 = torch.arange(65536, dtype=torch.int32).to(torch.int16)
    vals = CODES.view(NATIVE[fmt]).double()
    vals = vals[torch.isfinite(vals)].unique()
    mids = _midpoints(fmt)
    up, down = torch.tensor(float("inf")), torch.tensor(-float("inf"))
    mx = fp8.FP8_MAX[fmt]
    edges = torch.tensor([mx, -mx, mx * 1.0625, mx * 2, 0.0, -0.0, float("inf"), -float("inf"), float("nan"),
                          -float("nan"), 1e-45, -1e-45, 1e-38, 3.4e38, -3.4e38])
    return torch.cat([all16.view(torch.float16).float(), all16.view(torch.bfloat16).float(),
                      torch.randint(-2 ** 31, 2 ** 31 - 1, (n_random,), dtype=torch.int32, generator=gen).view(torch.float32),
                      torch.randn(n_random, generator=gen) * mx / 64,
                      mids, torch.nextafter(mids, up), torch.nextafter(mids, down), vals.float(), edges])


# ---------------------------------------------------------------------------------------------
# What torch's CPU cast does (documented in fp8.py; if a torch upgrade changes it, this fails)
# ---------------------------------------------------------------------------------------------
def test_torch_cpu_cast_behaviour_is_as_documented():
    x = torch.tensor([float("inf"), -float("inf"), float("nan"), -float("nan"), 1e6, -0.0, -1e-30])
    assert x.to(torch.float8_e4m3fn).view(torch.uint8).tolist() == [0x7E, 0xFE, 0x7F, 0xFF, 0x7E, 0x80, 0x80]
    assert x.to(torch.float8_e5m2).view(torch.uint8).tolist() == [0x7C, 0xFC, 0x7F, 0xFF, 0x7C, 0x80, 0x80]
    assert oracle_encode(x, "e5m2").tolist() == [0x7B, 0xFB, 0x7F, 0xFF, 0x7B, 0x80, 0x80]
    assert fp8.fp8_max("e4m3fn") == 448.0 and fp8.fp8_max("e5m2") == 57344.0
    with pytest.raises(ValueError, match="e4m3fn"):
        fp8.fp8_max("e4m3")


# ---------------------------------------------------------------------------------------------
# References against the oracle
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", fp8.FP8_FORMATS)
def test_decode_table_is_torchs_cast_for_all_256_codes(fmt):
    table = torch.tensor(decode_table(fmt), dtype=torch.float32)
    assert_same_values(table, oracle_decode(CODES, fmt))
    nan_codes = CODES[torch.isnan(table)].tolist()
    assert nan_codes == ([0x7F, 0xFF] if fmt == "e4m3fn" else [0x7D, 0x7E, 0x7F, 0xFD, 0xFE, 0xFF])
    if fmt == "e5m2":
        assert table[0x7C] == float("inf") and table[0xFC] == -float("inf")


@pytest.mark.parametrize("fmt", fp8.FP8_FORMATS)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_reference_decode_all_codes_with_each_scale_mode(fmt, out_dtype, monkeypatch):
    gen = torch.Generator().manual_seed(5)
    raw2 = CODES.reshape(16, 16)
    row_scale = torch.rand(16, generator=gen) * 3e-3 + 1e-4     # keeps fp16 finite
    cases = [(CODES, None), (CODES, torch.tensor([0.3])), (raw2, row_scale), (raw2, row_scale[:, None]),
             (raw2.reshape(16, 4, 4), row_scale), (CODES, torch.tensor(2.0, dtype=torch.bfloat16))]
    for raw, scale in cases:
        want = oracle_decode(raw, fmt, scale, out_dtype)
        assert_same_values(fp8_decode_reference(raw, fmt, scale=scale, out_dtype=out_dtype), want)
        # native float8 input, fmt inferred
        assert_same_values(fp8_decode_reference(raw.view(NATIVE[fmt]), None, scale=scale, out_dtype=out_dtype), want)
        # the table path used where torch has no float8 on the device (MPS before 2.15)
        monkeypatch.setattr(fp8, "native_fp8_on", lambda device, f: False)
        assert_same_values(fp8_decode_reference(raw, fmt, scale=scale, out_dtype=out_dtype), want)
        monkeypatch.undo()
    assert_same_values(decode_arith(CODES, fmt), oracle_decode(CODES, fmt))


@pytest.mark.parametrize("fmt", fp8.FP8_FORMATS)
def test_arithmetic_encoder_is_torchs_cast_on_a_dense_sweep(fmt):
    x = dense_sweep(fmt)
    assert_same_bytes(encode_arith(x, fmt), oracle_encode(x, fmt), x)


@pytest.mark.parametrize("fmt", fp8.FP8_FORMATS)
def test_reference_encode_with_scales_and_input_dtypes(fmt, monkeypatch):
    gen = torch.Generator().manual_seed(6)
    x = torch.randn(9, 13, generator=gen) * 300
    for dtype in OUT_DTYPES:
        xd = x.to(dtype)
        for scale in (None, torch.tensor([0.7]), torch.rand(9, generator=gen) + 0.01, torch.rand(9, 1, generator=gen) + 0.5):
            want = oracle_encode(xd, fmt, scale)
            assert_same_bytes(fp8_encode_reference(xd, fmt, scale), want)
            monkeypatch.setattr(fp8, "native_fp8_on", lambda device, f: False)
            assert_same_bytes(fp8_encode_reference(xd, fmt, scale), want)
            monkeypatch.undo()


def test_round_trip_of_every_finite_code_is_the_identity():
    for fmt in fp8.FP8_FORMATS:
        v = fp8_decode_reference(CODES, fmt, out_dtype=torch.float32)
        finite = torch.isfinite(v)
        assert torch.equal(fp8_encode_reference(v[finite], fmt), CODES[finite])


def test_bad_inputs_get_clear_errors():
    raw = torch.zeros(4, 3, dtype=torch.uint8)
    with pytest.raises(ValueError, match="need fmt"):
        fp8_decode_reference(raw, None)
    with pytest.raises(ValueError, match="does not match"):
        fp8_decode_reference(raw.view(torch.float8_e5m2), "e4m3fn")
    with pytest.raises(TypeError, match="not FP8"):
        fp8_decode_reference(torch.zeros(3), "e4m3fn")
    with pytest.raises(ValueError, match=r"\(4,\) or \(4, 1\)"):
        fp8_decode_reference(raw, "e4m3fn", scale=torch.ones(3))
    with pytest.raises(TypeError, match="out_dtype"):
        fp8_decode_reference(raw, "e4m3fn", out_dtype=torch.int32)
    with pytest.raises(TypeError, match="input dtype"):
        fp8_encode_reference(torch.zeros(3, dtype=torch.float64), "e5m2")


# ---------------------------------------------------------------------------------------------
# The Metal kernels in the emulator
# ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def lib():
    from comfy_metal.metal_kernels import emulator   # part of the pack: an import error is a failure

    if not emulator.available():
        pytest.skip("the MSL emulator needs clang-19, which is not installed")
    # common.metal + fp8.metal: exactly what dispatch compiles for these kernels if another file of the
    # library is broken (the whole library is compiled and linted in tests/emulator/test_msl_library.py)
    return emulator.compile_library(dispatch.library_source(only="fp8.metal"))


def _shapes():
    # odd sizes: a scalar tail, 16-element chunks and a tail, row lengths not multiples of 16 (per-row scales
    # then go element by element), rows of length 1, rows of whole chunks (16-byte loads with per-row scales)
    return [(1,), (7,), (257,), (5, 3), (3, 1), (6, 11), (2, 3, 5), (3, 32), (2, 3, 16), (5, 48)]


@pytest.mark.parametrize("fmt", fp8.FP8_FORMATS)
@pytest.mark.parametrize("out_dtype", OUT_DTYPES)
def test_emulated_decode_matches_reference(lib, fmt, out_dtype):
    gen = torch.Generator().manual_seed(7)
    # all 256 codes once (odd total length), then random codes in odd shapes with each scale mode
    assert_same_values(fp8_decode_metal(lib, torch.cat([CODES, CODES[:3]]), fmt, out_dtype=out_dtype),
                       oracle_decode(torch.cat([CODES, CODES[:3]]), fmt, None, out_dtype))
    for shape in _shapes():
        raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
        rows = shape[0]
        for scale in (None, torch.tensor([0.0123]), torch.rand(rows, generator=gen) * 1e-3 + 1e-5,
                      torch.rand(rows, 1, generator=gen) * 1e-3 + 1e-5):
            want = fp8_decode_reference(raw, fmt, scale=scale, out_dtype=out_dtype)
            assert_same_values(fp8_decode_metal(lib, raw, fmt, scale=scale, out_dtype=out_dtype), want)


@pytest.mark.parametrize("fmt", fp8.FP8_FORMATS)
@pytest.mark.parametrize("in_dtype", OUT_DTYPES)
def test_emulated_encode_matches_torch_cast(lib, fmt, in_dtype):
    gen = torch.Generator().manual_seed(8)
    if in_dtype == torch.float32:     # rounding boundaries, specials and random bit patterns
        x = dense_sweep(fmt, n_random=3000)
        x = torch.cat([x[131072:], x[:131072:97]])       # the fp16/bf16 grids are covered below
    else:                              # every value of the 16-bit type
        x = torch.arange(65536, dtype=torch.int32).to(torch.int16).view(in_dtype)
    assert_same_bytes(fp8_encode_metal(lib, x, fmt), oracle_encode(x, fmt), x)
    # x / s next to each rounding midpoint (x = mid * s and its fp32 neighbours): only a correctly
    # rounded division gets all of them (x * (1/s) is an ulp off for a few hundred of these)
    mids = _midpoints(fmt)
    for s in (0.37, 7.0):
        scale = torch.tensor([s])
        x0 = torch.cat([mids, -mids]) * scale
        xm = torch.cat([x0, torch.nextafter(x0, torch.tensor(float("inf"))),
                        torch.nextafter(x0, torch.tensor(-float("inf")))]).to(in_dtype)
        assert_same_bytes(fp8_encode_metal(lib, xm, fmt, scale), oracle_encode(xm, fmt, scale), xm)
    for shape in _shapes():
        xs = (torch.randn(shape, generator=gen) * 200).to(in_dtype)
        rows = shape[0]
        for scale in (torch.tensor([0.37]), torch.rand(rows, generator=gen) + 0.01, torch.rand(rows, 1, generator=gen) * 3):
            assert_same_bytes(fp8_encode_metal(lib, xs, fmt, scale), oracle_encode(xs, fmt, scale), xs)


def test_emulated_launch_glue_edge_cases(lib):
    gen = torch.Generator().manual_seed(9)
    # native float8 input, non-contiguous input, a view whose bytes start off 4-byte alignment
    raw = torch.randint(0, 256, (6, 10), generator=gen, dtype=torch.uint8)
    for data in (raw.view(torch.float8_e4m3fn), raw.t(), raw.reshape(-1)[3:42], raw[:, 1:8]):
        fmt = None if data.dtype != torch.uint8 else "e4m3fn"
        assert_same_values(fp8_decode_metal(lib, data, fmt, out_dtype=torch.float32),
                           fp8_decode_reference(data, fmt, out_dtype=torch.float32))
    x = torch.randn(5, 8, generator=gen)
    s = torch.rand(8, generator=gen) + 0.1
    assert_same_bytes(fp8_encode_metal(lib, x.t(), "e5m2", s), oracle_encode(x.t(), "e5m2", s))
    # 0-size tensors: no launch, right shape and dtype
    assert fp8_decode_metal(lib, torch.zeros(0, 5, dtype=torch.uint8), "e5m2", out_dtype=torch.float16).shape == (0, 5)
    assert fp8_encode_metal(lib, torch.zeros(3, 0), "e4m3fn", torch.ones(3)).shape == (3, 0)
    # a 0-d tensor
    assert_same_bytes(fp8_encode_metal(lib, torch.tensor(3.3), "e4m3fn"), oracle_encode(torch.tensor(3.3), "e4m3fn"))


def test_public_functions_run_the_emulated_kernels(monkeypatch):
    """The dispatch path: self-check in the emulator, then the real launch glue on CPU tensors."""
    from comfy_metal import metal_kernels
    from comfy_metal.metal_kernels import emulator

    if not emulator.available():
        pytest.skip("the MSL emulator needs clang-19, which is not installed")

    monkeypatch.setenv("COMFY_METAL_BACKEND", "emulator")
    monkeypatch.delenv("COMFY_METAL_REFERENCE", raising=False)
    dispatch.reset()
    try:
        raw = torch.randint(0, 256, (3, 13), dtype=torch.uint8, generator=torch.Generator().manual_seed(4))
        scale = torch.tensor([0.5, 2.0, 0.25])
        got = metal_kernels.fp8_decode(raw, "e5m2", scale, out_dtype=torch.float32)
        reason = dispatch.choose(fp8.fp8_decode.spec, torch.device("cpu"))[1]
        assert dispatch.last_backend["fp8_decode"] == "emulator", reason
        assert_same_values(got, oracle_decode(raw, "e5m2", scale))
        x = torch.randn(3, 13) * 10
        assert_same_bytes(metal_kernels.fp8_encode(x, "e4m3fn", scale), oracle_encode(x, "e4m3fn", scale))
        assert dispatch.last_backend["fp8_encode"] == "emulator", dispatch.choose(fp8.fp8_encode.spec, torch.device("cpu"))[1]
    finally:
        dispatch.reset()


def test_emulated_grid_stride_loop_covers_more_elements_than_threads(lib, monkeypatch):
    """Past MAX_THREADS * 4 elements each thread loops (the path that covers > 2^31-element tensors
    on the GPU); shrink the cap so a tiny tensor takes it."""
    monkeypatch.setattr(fp8, "MAX_THREADS", 3)
    gen = torch.Generator().manual_seed(10)
    raw = torch.randint(0, 256, (7, 9), generator=gen, dtype=torch.uint8)      # 63 elements, 12 threads' worth
    scale = torch.rand(7, generator=gen) + 0.5
    for fmt in fp8.FP8_FORMATS:
        assert_same_values(fp8_decode_metal(lib, raw, fmt, scale, out_dtype=torch.float32),
                           oracle_decode(raw, fmt, scale))
        x = torch.randn(7, 9, generator=gen) * 30
        assert_same_bytes(fp8_encode_metal(lib, x, fmt, scale), oracle_encode(x, fmt, scale))


def test_emulated_long_rows_go_in_pieces(lib, monkeypatch):
    """Rows longer than MAX_ROW (the kernels' 32-bit offsets in a row) are converted in pieces, each with its
    row's scale (made small here): 16-byte-aligned pieces, a tail piece, one row and several."""
    monkeypatch.setattr(fp8, "MAX_ROW", 32)
    gen = torch.Generator().manual_seed(11)
    for shape in ((3, 80), (100,), (2, 3, 40)):
        raw = torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8)
        for scale in (None, torch.rand(shape[0], generator=gen) + 0.5):
            for fmt in fp8.FP8_FORMATS:
                assert_same_values(fp8_decode_metal(lib, raw, fmt, scale, out_dtype=torch.float32),
                                   oracle_decode(raw, fmt, scale))
                x = torch.randn(shape, generator=gen) * 30
                assert_same_bytes(fp8_encode_metal(lib, x, fmt, scale), oracle_encode(x, fmt, scale))


def test_decode_self_check_compare_is_exact_but_tolerates_flushed_subnormals():
    want = torch.tensor([1.0, 2.0 ** -20, -(2.0 ** -20), float("nan"), 3.0], dtype=torch.float16)
    compare = fp8._decode_compare
    assert compare(want.clone(), want) is None
    flushed = want.clone()
    flushed[1:3] = 0.0                       # fp16 subnormals flushed to zero: accepted
    assert compare(flushed, want) is None
    off = want.clone()
    off[0] = 1.0009765625                    # one ulp off on a normal value: rejected
    assert "differ" in compare(off, want)
    nan_moved = want.clone()
    nan_moved[3] = 0.0
    assert "NaN" in compare(nan_moved, want)
    assert compare(want.float(), want) is not None


def test_launch_glue_makes_no_host_syncs():
    """The launchers only reshape, allocate and bind: nothing reads a device value back to the host."""
    from comfy_metal.nodes.common import syncs as sync_count

    class FakeLib:
        def __getattr__(self, name):
            return lambda *args, threads, group_size: None

    raw = torch.randint(0, 256, (6, 10), dtype=torch.uint8)
    scale = torch.rand(6) + 0.5
    x = torch.randn(6, 10)
    from comfy_metal.metal_kernels import linear

    with sync_count.SyncCounter() as counter:
        for _ in range(3):
            fp8_decode_metal(FakeLib(), raw, "e4m3fn", scale, out_dtype=torch.bfloat16)
            fp8_decode_metal(FakeLib(), raw.view(torch.float8_e5m2), None, torch.tensor(0.5))
            fp8_encode_metal(FakeLib(), x.to(torch.bfloat16), "e5m2", scale[:, None])
            linear.gemv_metal(FakeLib(), x[:3], raw, torch.randn(6), fmt="e4m3fn", scale=scale)
            linear.gemv_metal(FakeLib(), torch.randn(11, 10), x.to(torch.float16))     # M > 8: chunks
    assert counter.total == 0, dict(counter.counts)
