"""The emulator harness catches broken kernels: real kernels of ours (GEMV, softmax) with one textual
mutation each are compiled in the emulator and must no longer match their reference (or must make the
emulator raise), while the unmutated source matches. A broken library also makes dispatch fall back
to the reference with a reason."""
from __future__ import annotations

import importlib
import logging

import pytest
import torch

from comfy_metal import metal_kernels
from comfy_metal.metal_kernels import dispatch, linear

softmax_module = importlib.import_module("comfy_metal.metal_kernels.softmax")   # the module, not the function

from comfy_metal.metal_kernels import emulator  # noqa: E402  (part of the pack: an import error is a failure)
if not emulator.available():
    pytest.skip("the MSL emulator needs clang-19, which is not installed", allow_module_level=True)

GEMV_SRC = dispatch.library_source(only="linear.metal")
SOFTMAX_SRC = dispatch.library_source(only="softmax.metal")


def mutate(src: str, old: str, new: str, count: int = 1) -> str:
    """Replace `old` (which must occur exactly `count` times) by `new`."""
    found = src.count(old)
    assert found == count, f"mutation target {old!r} occurs {found} times, expected {count}"
    return src.replace(old, new)


def gemv_problem(src: str, weight_kind="e4m3fn", K=33, M=3, N=6) -> str | None:
    """None if the kernels in `src` match the GEMV reference on a small odd case, else what went wrong
    (a mismatch or the emulator's own error)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(M, K, generator=gen)
    if weight_kind in ("e4m3fn", "e5m2"):
        w = torch.randint(0, 256, (N, K), generator=gen, dtype=torch.uint8) & 0xBF
        kw = {"fmt": weight_kind}
    else:
        w, kw = torch.randn(N, K, generator=gen).to(weight_kind), {}
    bias = torch.randn(N, generator=gen)
    scale = torch.rand(N, generator=gen) + 0.5
    want = linear.gemv_reference(x, w, bias, scale=scale, **kw)
    lib = emulator.compile_library(src)      # a mutation must still compile: a compile error is no catch
    try:
        got = linear.gemv_metal(lib, x, w, bias, scale=scale, **kw)
    except emulator.EmulatorError as e:
        return f"emulator raised {type(e).__name__}: {str(e)[:200]}"
    return dispatch.default_compare(linear.gemv.spec, got, want)


def softmax_problem(src: str, shape=(3, 300), dtype=torch.float32) -> str | None:
    gen = torch.Generator().manual_seed(1)
    x = (torch.randn(shape, generator=gen) * 3).to(dtype)
    want = softmax_module.softmax_reference(x)
    lib = emulator.compile_library(src)
    try:
        got = softmax_module.softmax_metal(lib, x)
    except emulator.EmulatorError as e:
        return f"emulator raised {type(e).__name__}: {str(e)[:200]}"
    return dispatch.default_compare(softmax_module.softmax.spec, got, want)


# ---------------------------------------------------------------------------------------------
# GEMV
# ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kind,K", [("e4m3fn", 33), (torch.float16, 33), (torch.float32, 36), ("e5m2", 36)])
def test_unmutated_gemv_matches(kind, K):
    assert gemv_problem(GEMV_SRC, kind, K) is None


LANE_LOOP = "for (uint c = lane; c < chunks; c += 32u)"


def test_off_by_one_loop_bound_reading_past_the_row_is_caught():
    # scalar kernels (odd K, one element a chunk): each lane's loop runs to c <= chunks, reading one
    # element past each weight row (the next row's first element, past the buffer for the last row) and
    # past each x row
    src = mutate(GEMV_SRC, LANE_LOOP, "for (uint c = lane; c <= chunks; c += 32u)")
    for kind in ("e4m3fn", torch.float32):
        problem = gemv_problem(src, kind, K=33)
        assert problem is not None, f"off-by-one over K not caught for {kind}"
    # K = 31: lane 31 reads exactly element K of row n
    assert gemv_problem(src, torch.float16, K=31) is not None


def test_vectorised_loop_overrun_is_caught():
    # the vector kernels load 16 weight bytes per lane and chunk: a bound of c <= chunks lets one lane load
    # 16 bytes past the row
    src = mutate(GEMV_SRC, LANE_LOOP, "for (uint c = lane; c <= chunks; c += 32u)")
    assert gemv_problem(src, "e5m2", K=48) is not None      # lane 3 starts at byte 48 = K
    assert gemv_problem(src, torch.float32, K=128) is not None


PARTIAL_SUM = """
// mutation: a butterfly that stops at offset 8 reduces groups of 16 lanes, not the whole simdgroup
inline float gemv_partial_sum(float v) {
    for (ushort off = 1; off <= 8; off <<= 1) v += simd_shuffle_xor(v, off);
    return v;
}
"""


def test_simd_reduction_over_too_few_lanes_is_caught():
    src = mutate(GEMV_SRC, "const float t = simd_sum(acc.v[r][m]);", "const float t = gemv_partial_sum(acc.v[r][m]);")
    src = mutate(src, "#define GEMV_TABLE_SIZE 16", PARTIAL_SUM + "\n#define GEMV_TABLE_SIZE 16")
    # K = 33 (one element a chunk): lanes 16..31 hold terms the partial butterfly never sees
    assert gemv_problem(src, torch.float32, K=33) is not None
    assert gemv_problem(src, "e4m3fn", K=512) is not None    # vector kernel: 32 chunks of 16, every lane busy
    # (with e4m3fn K = 128 only lanes 0..7 hold terms, which the partial butterfly does see: that is no bug)
    # the full butterfly (offsets 1..16) is a correct reduction: the harness does not cry wolf
    full = src.replace("off <= 8;", "off <= 16;")
    assert gemv_problem(full, torch.float32, K=33) is None


def test_missing_scale_or_bias_is_caught():
    src = mutate(GEMV_SRC, "fma(t, s, b), p.out_kind", "t + b, p.out_kind")
    assert gemv_problem(src, "e4m3fn") is not None
    src = mutate(GEMV_SRC, "fma(t, s, b), p.out_kind", "t * s, p.out_kind")
    assert gemv_problem(src, torch.float16) is not None


# ---------------------------------------------------------------------------------------------
# softmax (threadgroup memory and barriers)
# ---------------------------------------------------------------------------------------------
BARRIER = "threadgroup_barrier(mem_flags::mem_threadgroup);"


def test_unmutated_softmax_matches():
    assert softmax_problem(SOFTMAX_SRC) is None


@pytest.mark.parametrize("which", [0, 1])
def test_removed_threadgroup_barrier_is_caught(which):
    """Without the barrier, the exchange through NaN-filled threadgroup memory is read before (or
    overwritten while) it is written, under the emulator's shuffled thread order."""
    assert SOFTMAX_SRC.count(BARRIER) == 2
    parts = SOFTMAX_SRC.split(BARRIER)
    src = BARRIER.join(parts[:which + 1]) + "/* barrier removed */" + BARRIER.join(parts[which + 1:])
    assert src.count(BARRIER) == 1
    # several group sizes: 300 columns -> 512 threads per row, 40 -> 64, 1000 -> 1024
    problems = [softmax_problem(src, shape) for shape in ((3, 300), (2, 40), (2, 1000))]
    assert any(p is not None for p in problems), "a missing barrier went unnoticed"


def test_softmax_launches_in_row_chunks_past_the_32_bit_grid(monkeypatch):
    """Huge row counts are split into launches of < 2^31 threads (here shrunk to a few rows each): every
    chunk binds its own buffer offset and the result is unchanged; a 0-d tensor takes the reference."""
    monkeypatch.setattr(softmax_module, "MAX_LAUNCH_THREADS", 64)
    gen = torch.Generator().manual_seed(2)
    lib = emulator.compile_library(SOFTMAX_SRC)
    for shape in ((5, 7), (3, 40)):            # 32 threads per row: 2-row chunks; 64: 1-row chunks
        x = torch.randn(shape, generator=gen) * 3
        got = softmax_module.softmax_metal(lib, x)
        assert dispatch.default_compare(softmax_module.softmax.spec, got, softmax_module.softmax_reference(x)) is None
    assert softmax_module.softmax_metal(lib, torch.tensor(2.0)).item() == 1.0


def test_softmax_partial_simd_reduction_is_caught():
    src = mutate(SOFTMAX_SRC, "return float2(m, simd_sum(s));",
                 "return float2(m, s + simd_shuffle_xor(s, 1) + simd_shuffle_xor(s, 2));")
    assert softmax_problem(src) is not None


def test_softmax_off_by_one_write_past_the_row_is_caught():
    # the write loop runs one column too far: the last row writes past the output buffer
    src = mutate(SOFTMAX_SRC, "for (long c = tid; c < ncols; c += group_size) {                                        \\\n        float v = float(x[base + c]) * inv_temperature;                                     \\\n        y[",
                 "for (long c = tid; c <= ncols; c += group_size) {                                        \\\n        float v = float(x[base + c]) * inv_temperature;                                     \\\n        y[")
    problem = softmax_problem(src, (2, 37))
    assert problem is not None


# ---------------------------------------------------------------------------------------------
# dispatch falls back to the reference when the library is broken
# ---------------------------------------------------------------------------------------------
def _patched_library_source(monkeypatch, old, new):
    real = dispatch.library_source

    def mutated(only=None):
        src = real(only)
        return src.replace(old, new) if old in src else src

    assert old in real()
    monkeypatch.setattr(dispatch, "library_source", mutated)


def test_compile_error_in_a_mutated_library_falls_back_with_the_reason(emulator_backend, monkeypatch, caplog):
    _patched_library_source(monkeypatch, "const float t = simd_sum(acc.v[r][m]);", "const float t = simd_sum(acc.v[r][m])")
    x, w = torch.randn(2, 33), torch.randn(5, 33)
    with caplog.at_level(logging.WARNING, logger="comfy_metal"):
        y = metal_kernels.gemv(x, w)
    assert torch.equal(y, linear.gemv_reference(x, w))
    assert dispatch.last_backend["gemv"] == "reference"
    backend, reason = dispatch.choose(linear.gemv.spec, torch.device("cpu"))
    assert backend == "reference" and "failed to compile" in reason
    assert any("gemv" in r.getMessage() and "failed to compile" in r.getMessage() for r in caplog.records)


def test_wrong_results_fail_the_self_check_and_fall_back(emulator_backend, monkeypatch):
    _patched_library_source(monkeypatch, "fma(t, s, b), p.out_kind", "t + b, p.out_kind")
    x, w = torch.randn(2, 33), torch.randn(5, 33)
    scale = torch.rand(5) + 0.5
    y = metal_kernels.gemv(x, w, scale=scale)
    assert torch.equal(y, linear.gemv_reference(x, w, scale=scale))
    backend, reason = dispatch.choose(linear.gemv.spec, torch.device("cpu"))
    assert backend == "reference" and "self-check case" in reason


def test_the_unmutated_library_is_used(emulator_backend):
    x, w = torch.randn(2, 33), torch.randn(5, 33)
    metal_kernels.gemv(x, w)
    assert dispatch.last_backend["gemv"] == "emulator", dispatch.choose(linear.gemv.spec, torch.device("cpu"))[1]


# ---------------------------------------------------------------------------------------------
# FP8 (exact comparisons: a single wrong byte is a failure)
# ---------------------------------------------------------------------------------------------
FP8_SRC = dispatch.library_source(only="fp8.metal")
fp8_module = importlib.import_module("comfy_metal.metal_kernels.fp8")


def fp8_encode_problem(src: str, fmt: str, x: torch.Tensor, scale=None) -> str | None:
    got = fp8_module.fp8_encode_metal(emulator.compile_library(src), x, fmt, scale)
    return fp8_module._exact(got, fp8_module.fp8_encode_reference(x, fmt, scale))


def _all_fp16() -> torch.Tensor:
    return torch.arange(65536, dtype=torch.int32).to(torch.int16).view(torch.float16)


def test_unmutated_fp8_encode_matches():
    for fmt in ("e4m3fn", "e5m2"):
        assert fp8_encode_problem(FP8_SRC, fmt, _all_fp16()) is None


def test_round_half_up_instead_of_to_even_is_caught():
    src = mutate(FP8_SRC, "(rem > half_unit || (rem == half_unit && (q & 1u)))", "(rem >= half_unit)")
    for fmt in ("e4m3fn", "e5m2"):
        assert fp8_encode_problem(src, fmt, _all_fp16()) is not None   # ties among the subnormals


def test_missing_saturation_is_caught():
    src = mutate(FP8_SRC, "if (a >= MAXBITS) return uchar(sign | MAXCODE);", "")
    x = torch.tensor([448.0, 460.0, 1e4, float("inf"), -float("inf"), 57344.0, 7e4])
    for fmt in ("e4m3fn", "e5m2"):
        assert fp8_encode_problem(src, fmt, x) is not None


def test_decode_dropping_the_last_odd_element_is_caught():
    src = mutate(FP8_SRC, "for (uint k = i; k < end; ++k) io_store(", "for (uint k = i; k + 1 < end; ++k) io_store(")
    raw = torch.arange(7, dtype=torch.uint8) + 0x30
    lib = emulator.compile_library(src)
    got = fp8_module.fp8_decode_metal(lib, raw, "e4m3fn", out_dtype=torch.float32)
    assert fp8_module._decode_compare(got, fp8_module.fp8_decode_reference(raw, "e4m3fn", out_dtype=torch.float32))
