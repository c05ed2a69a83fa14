"""Tests of the CPU MSL emulator (metal_kernels/emulator): binding, dispatch geometry, barriers,
SIMD collectives, guard regions, schedules, templates/macros and compile errors.

Every kernel here is a small hand-written toy; most live in one library compiled once per module.
"""
from __future__ import annotations

import os

import pytest
import torch

from comfy_metal.metal_kernels import emulator as emu
from comfy_metal.metal_kernels.emulator import (BarrierDivergence, EmulatorError, KernelCrash, MSLCompileError,
                                                OutOfBoundsWrite, compile_library)

pytestmark = pytest.mark.skipif(not emu.available(), reason="clang-19 not installed: the MSL emulator needs it "
                                                            "(apt-get install clang-19)")

SRC = r"""
#include <metal_stdlib>
#include <metal_simdgroup>
#include <metal_simdgroup_matrix>
using namespace metal;

kernel void vadd(device float* out [[buffer(0)]], const device float* a [[buffer(1)]],
                 const device float* b [[buffer(2)]], constant long& n [[buffer(3)]],
                 uint tid [[thread_position_in_grid]]) {
  if ((long)tid < n) out[tid] = a[tid] + b[tid];
}

// writes every visited index once: catches missing/duplicate threads
kernel void mark(device int* hits [[buffer(0)]], uint tid [[thread_position_in_grid]]) {
  hits[tid] += 1;
}

kernel void scalars(device long* out_i [[buffer(0)]], device float* out_f [[buffer(1)]],
                    constant long& i [[buffer(2)]], constant float& f [[buffer(3)]],
                    constant ulong& u [[buffer(4)]], constant long& flag [[buffer(5)]],
                    uint tid [[thread_position_in_grid]]) {
  out_i[0] = i; out_i[1] = (long)u; out_i[2] = flag; out_f[0] = f * 2.0f;
}

kernel void cast_scalars(device float* out [[buffer(0)]], constant half& h [[buffer(1)]],
                         constant int& k [[buffer(2)]], constant bfloat& b [[buffer(3)]],
                         uint tid [[thread_position_in_grid]]) {
  out[0] = float(h); out[1] = float(k); out[2] = float(b);
}

kernel void arrays(device long* out [[buffer(0)]], device float* outf [[buffer(1)]],
                   constant long* sizes [[buffer(2)]], constant float* w [[buffer(3)]],
                   uint tid [[thread_position_in_grid]]) {
  out[tid] = sizes[tid] * 10;
  outf[tid] = w[tid] + 0.5f;
}

kernel void tree_sum(device float* out [[buffer(0)]], const device float* x [[buffer(1)]],
                     uint lid [[thread_position_in_threadgroup]], uint gid [[threadgroup_position_in_grid]],
                     uint tpg [[threads_per_threadgroup]]) {
  threadgroup float buf[256];
  buf[lid] = x[gid * 256 + lid];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint s = tpg / 2; s > 0; s /= 2) {
    if (lid < s) buf[lid] += buf[lid + s];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (lid == 0) out[gid] = buf[0];
}

kernel void tree_sum_nobarrier(device float* out [[buffer(0)]], const device float* x [[buffer(1)]],
                               uint lid [[thread_position_in_threadgroup]],
                               uint gid [[threadgroup_position_in_grid]], uint tpg [[threads_per_threadgroup]]) {
  threadgroup float buf[256];
  buf[lid] = x[gid * 256 + lid];
  for (uint s = tpg / 2; s > 0; s /= 2) {
    if (lid < s) buf[lid] += buf[lid + s];
  }
  if (lid == 0) out[gid] = buf[0];
}

kernel void uninit_tg(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float buf[64];
  if (lid % 2 == 0) buf[lid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = buf[lid];
}

kernel void early_return(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float buf[64];
  if (lid == 5) return;
  buf[lid] = 1.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = buf[(lid + 1) % 64];
}

kernel void split_barrier(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  if (lid < 7) {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  } else {
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[lid] = 1.0f;
}

kernel void write_past(device float* out [[buffer(0)]], const device float* x [[buffer(1)]],
                       uint tid [[thread_position_in_grid]]) {
  out[tid + 1] = x[tid];
}

kernel void write_before(device float* out [[buffer(0)]], uint tid [[thread_position_in_grid]]) {
  if (tid == 0) out[-1] = 3.0f;
}

kernel void read_past(device float* out [[buffer(0)]], const device float* x [[buffer(1)]],
                      uint tid [[thread_position_in_grid]]) {
  out[tid] = x[tid + 1];
}

kernel void simd_ops(device float* sums [[buffer(0)]], device float* maxs [[buffer(1)]],
                     device float* bfly [[buffer(2)]], device float* bfly_short [[buffer(3)]],
                     device float* prefix [[buffer(4)]], device float* down [[buffer(5)]],
                     const device float* x [[buffer(6)]],
                     uint tid [[thread_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {
  float v = x[tid];
  sums[tid] = simd_sum(v);
  maxs[tid] = simd_max(v);
  float b = v;
  for (ushort o = 16; o > 0; o /= 2) b += simd_shuffle_xor(b, o);
  bfly[tid] = b;
  float c = v;
  for (ushort o = 8; o > 0; o /= 2) c += simd_shuffle_xor(c, o);
  bfly_short[tid] = c;
  prefix[tid] = simd_prefix_exclusive_sum(v);
  down[tid] = simd_shuffle_down(v, 1);
}

kernel void simd_divergent(device float* out [[buffer(0)]], uint lane [[thread_index_in_simdgroup]]) {
  float r = -1.0f;
  if (lane < 12) r = simd_sum(1.0f);
  out[lane] = r;
  float q;
  if (lane < 12) q = simd_sum(1.0f); else q = simd_sum(2.0f) * 10.0f;
  out[32 + lane] = q;
  out[64 + lane] = simd_sum(1.0f);  // after reconvergence every lane takes part
}

kernel void quads(device float* o [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  float v = float(i);
  o[i * 4 + 0] = quad_sum(v);
  o[i * 4 + 1] = quad_shuffle_xor(v, 1);
  o[i * 4 + 2] = quad_broadcast(v, 2);
  o[i * 4 + 3] = quad_shuffle_down(v, 1);
}

kernel void matmul8(device const float* A [[buffer(0)]], device const half* B [[buffer(1)]],
                    device float* C [[buffer(2)]], constant long& K [[buffer(3)]],
                    uint sg [[simdgroup_index_in_threadgroup]]) {
  simdgroup_float8x8 acc = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  for (long k = 0; k < K; k += 8) {
    simdgroup_float8x8 a;
    simdgroup_half8x8 b;
    simdgroup_load(a, A + 8 * K * sg + k, K);
    simdgroup_load(b, B + k * 8, 8);
    simdgroup_multiply_accumulate(acc, a, b, acc);
  }
  simdgroup_store(acc, C + 64 * sg, 8);
}

kernel void neighbour(device float* out [[buffer(0)]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float buf[64];
  buf[lid] = float(lid);
  // missing barrier: fine if lower threads happen to run first
  out[lid] = lid > 0 ? buf[lid - 1] : 0.0f;
}

kernel void run_order(device atomic_int* counter [[buffer(0)]], device int* order [[buffer(1)]],
                      uint tid [[thread_position_in_grid]]) {
  order[tid] = atomic_fetch_add_explicit(counter, 1, memory_order_relaxed);
}

kernel void simd_misc(device int* out [[buffer(0)]], uint lane [[thread_index_in_simdgroup]],
                      uint tid [[thread_position_in_grid]]) {
  int v = (int)lane;
  out[tid * 4 + 0] = simd_sum(v);
  out[tid * 4 + 1] = simd_broadcast(v, 3);
  out[tid * 4 + 2] = simd_any(lane == 7) ? 1 : 0;
  out[tid * 4 + 3] = simd_all(lane < 40) ? 1 : 0;
}

kernel void halfs(device half* h [[buffer(0)]], device bfloat* b [[buffer(1)]], device float* f [[buffer(2)]],
                  uint i [[thread_position_in_grid]]) {
  half x = h[i];
  h[i] = x * x + 1.5h;
  bfloat y = b[i];
  b[i] = y * bfloat(3.0f) - (bfloat)0.25f;
  half4 v = half4(x);
  float4 w = float4(v) * 2.0f;
  f[i] = w.x + w.w + float(exp(x)) + fast::max(float(y), 0.0f);
}

kernel void positions(device uint* out [[buffer(0)]],
                      uint3 gpos [[thread_position_in_grid]], uint3 lpos [[thread_position_in_threadgroup]],
                      uint3 group [[threadgroup_position_in_grid]], uint3 tpg [[threads_per_threadgroup]],
                      uint3 grid [[threads_per_grid]], uint3 ngroups [[threadgroups_per_grid]],
                      uint lindex [[thread_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                      uint sgi [[simdgroup_index_in_threadgroup]], uint tps [[threads_per_simdgroup]],
                      uint sgs [[simdgroups_per_threadgroup]], ushort2 gpos16 [[thread_position_in_grid]],
                      uint3 dtpg [[dispatch_threads_per_threadgroup]]) {
  uint idx = (gpos.z * grid.y + gpos.y) * grid.x + gpos.x;
  device uint* o = out + idx * 24;
  o[0] = gpos.x; o[1] = gpos.y; o[2] = gpos.z;
  o[3] = lpos.x; o[4] = lpos.y; o[5] = lpos.z;
  o[6] = group.x; o[7] = group.y; o[8] = group.z;
  o[9] = tpg.x; o[10] = tpg.y; o[11] = tpg.z;
  o[12] = grid.x; o[13] = grid.y; o[14] = grid.z;
  o[15] = ngroups.x; o[16] = ngroups.y; o[17] = ngroups.z;
  o[18] = lindex; o[19] = lane; o[20] = sgi; o[21] = tps; o[22] = sgs;
  o[23] = gpos16.x + 1000u * gpos16.y + 100000u * dtpg.x;
}

template <typename T>
kernel void scale(device T* x [[buffer(0)]], constant float& f [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  x[i] = T(float(x[i]) * f);
}
template [[host_name("scale_half")]] kernel void scale<half>(device half* x [[buffer(0)]],
                                                            constant float& f [[buffer(1)]],
                                                            uint i [[thread_position_in_grid]]);
template [[host_name("scale_float")]] kernel void scale<float>(device float*, constant float&, uint);
template [[host_name("scale_bfloat")]] kernel decltype(scale<bfloat>) scale<bfloat>;
template [[host_name("scale_int")]] void scale<int>(device int* x [[buffer(0)]], constant float& f [[buffer(1)]],
                                                   uint i [[thread_position_in_grid]]);

kernel void packed3(device packed_float3* p [[buffer(0)]], device float* o [[buffer(1)]],
                    uint i [[thread_position_in_grid]]) {
  float3 v = p[i];
  o[i] = v.x + p[i].y * 10.0f + p[i][2] * 100.0f;
  p[i] = float3(v.zyx);
  p[i].x += 1.0f;
}

#define UNARY_KERNEL(NAME, EXPR)                                                       \
  kernel void NAME(device float* y [[buffer(0)]], const device float* x [[buffer(1)]], \
                   uint i [[thread_position_in_grid]]) {                              \
    float v = x[i];                                                                  \
    y[i] = (EXPR);                                                                   \
  }
UNARY_KERNEL(square_k, v * v)
UNARY_KERNEL(negate_k, -v)

template <typename T, int N>
kernel void fill_n(device T* y [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  threadgroup T tile[N];
  if (i < N) tile[i] = T(N);  // one writer per element (several would race)
  threadgroup_barrier(mem_flags::mem_threadgroup);
  y[i] = tile[(i + 1) % N];
}
#define INSTANTIATE_FILL(T, N) \
  template [[host_name("fill_" #T "_" #N)]] kernel void fill_n<T, N>(device T* y [[buffer(0)]], uint i [[thread_position_in_grid]]);
INSTANTIATE_FILL(float, 4)
INSTANTIATE_FILL(half, 8)

kernel void atomics(device atomic_int* counter [[buffer(0)]], device atomic_float* fsum [[buffer(1)]],
                    uint tid [[thread_position_in_grid]]) {
  atomic_fetch_add_explicit(counter, 1, memory_order_relaxed);
  atomic_fetch_max_explicit(counter + 1, (int)tid, memory_order_relaxed);
  atomic_fetch_add_explicit(fsum, 0.5f, memory_order_relaxed);
}

kernel void divide(device int* x [[buffer(0)]], uint tid [[thread_position_in_grid]]) {
  x[tid] = 100 / x[tid];
}

kernel void wild_read(device float* x [[buffer(0)]], uint tid [[thread_position_in_grid]]) {
  x[tid] = x[tid + (1ul << 36)];
}

kernel void spin_forever(device int* x [[buffer(0)]], uint tid [[thread_position_in_grid]]) {
  while (((volatile device int*)x)[0] == 0) {
  }
}

kernel void address_mod64(device const float* x [[buffer(0)]], device long* out [[buffer(1)]],
                          uint tid [[thread_position_in_grid]]) {
  out[0] = (long)((ulong)x % 64ul);
}

kernel void inplace(device float* x [[buffer(0)]], const device float* y [[buffer(1)]],
                    uint tid [[thread_position_in_grid]]) {
  x[tid] = y[tid] + 1.0f;
}
"""


@pytest.fixture(scope="module")
def lib():
    return compile_library(SRC)


def test_kernel_names_and_unknown_kernel(lib):
    names = lib.kernel_names
    for n in ("vadd", "scale_half", "scale_float", "scale_bfloat", "scale_int", "square_k", "negate_k", "fill_float_4",
              "fill_half_8"):
        assert n in names
    assert "scale" not in names and "fill_n" not in names  # templates themselves are not host kernels
    assert set(dir(lib)) == set(names)
    with pytest.raises(AttributeError) as e:
        lib.no_such_kernel
    assert "vadd" in str(e.value) and "no_such_kernel" in str(e.value)
    assert compile_library(SRC) is lib  # cached


@pytest.mark.parametrize("n,group", [(1, None), (1000, 64), (1001, 256), (4099, None), (33, 7)])
def test_vadd_odd_sizes_partial_groups(lib, n, group):
    a, b = torch.randn(n), torch.randn(n)
    out = torch.zeros(n)
    lib.vadd(out, a, b, n, threads=n, group_size=group)
    torch.testing.assert_close(out, a + b)
    hits = torch.zeros(n, dtype=torch.int32)
    lib.mark(hits, group_size=group)  # threads default to numel of the first tensor
    assert torch.equal(hits, torch.ones(n, dtype=torch.int32))


def test_tensor_binding_uses_storage_offset_not_strides(lib):
    base = torch.zeros(20)
    view = base[5:15]
    lib.inplace(view, torch.arange(10, dtype=torch.float32))
    assert torch.equal(base[5:15], torch.arange(10, dtype=torch.float32) + 1)
    assert torch.equal(base[:5], torch.zeros(5)) and torch.equal(base[15:], torch.zeros(5))
    # the same tensor as input and output (aliasing) works in place
    x = torch.arange(8, dtype=torch.float32)
    lib.inplace(x, x)
    assert torch.equal(x, torch.arange(8, dtype=torch.float32) + 1)


def test_buffers_keep_the_host_alignment(lib):
    base = torch.zeros(64)
    out = torch.zeros(1, dtype=torch.int64)
    for off in (0, 1, 3, 4, 5):
        view = base[off:off + 8]
        lib.address_mod64(view, out, threads=1)
        assert out.item() == view.data_ptr() % 64  # misaligned float4 loads stay misaligned


def test_scalar_binding(lib):
    oi = torch.zeros(3, dtype=torch.int64)
    of = torch.zeros(1)
    lib.scalars(oi, of, 2**40 + 3, 0.75, 2**50 + 1, True, threads=1)
    assert oi.tolist() == [2**40 + 3, 2**50 + 1, 1]
    assert of.item() == 1.5
    out = torch.zeros(3)
    lib.cast_scalars(out, 1.5, 7, 2.5, threads=1, arg_casts={1: "fp16", 2: "int32", 3: "bf16"})
    assert out.tolist() == [1.5, 7.0, 2.5]
    with pytest.raises(ValueError, match="Unsupported cast"):
        lib.cast_scalars(out, 1.5, 7, 2.5, threads=1, arg_casts={1: "float64"})


def test_array_binding(lib):
    out = torch.zeros(3, dtype=torch.int64)
    outf = torch.zeros(3)
    lib.arrays(out, outf, [1, 2, 3], [0.25, 1.0, -2.0], threads=3)
    assert out.tolist() == [10, 20, 30]
    assert outf.tolist() == [0.75, 1.5, -1.5]
    with pytest.raises(ValueError, match="Empty list"):
        lib.arrays(out, outf, [], [1.0], threads=3)


@pytest.mark.parametrize("sched", ["forward", "reverse", "shuffle", "shuffle:7"])
def test_tree_reduction_with_barriers(lib, sched):
    x = torch.randn(4 * 256)
    out = torch.zeros(4)
    with emu.schedule(sched):
        lib.tree_sum(out, x, threads=1024, group_size=256)
    torch.testing.assert_close(out, x.view(4, 256).sum(1), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("sched", ["forward", "reverse", "shuffle"])
def test_missing_barrier_is_a_race_under_every_schedule(lib, sched):
    """The race detector sees the missing barrier whatever the order (under forward and reverse the numbers
    even come out right); with the checks off, the default shuffled schedule still gets them wrong."""
    x = torch.randn(4 * 256)
    out = torch.zeros(4)
    with emu.schedule(sched), pytest.raises(emu.DataRace, match=r"tree_sum_nobarrier: data race on threadgroup "
                                                                  r"array 'buf'.*no threadgroup_barrier"):
        lib.tree_sum_nobarrier(out, x, threads=1024, group_size=256)
    if sched == "shuffle":
        emu.set_checks(False)
        try:
            lib.tree_sum_nobarrier(out, x, threads=1024, group_size=256)
        finally:
            emu.set_checks(None)
        assert not torch.allclose(out, x.view(4, 256).sum(1), atol=1e-3)  # wrong or NaN


def test_schedule_env_and_setter(lib, monkeypatch):
    x = torch.randn(256)
    out = torch.zeros(1)
    monkeypatch.setenv("COMFY_METAL_EMU_SCHEDULE", "reverse")
    assert emu.get_schedule() == "reverse"
    lib.tree_sum(out, x, threads=256, group_size=256)
    torch.testing.assert_close(out, x.sum().reshape(1), rtol=1e-5, atol=1e-4)
    emu.set_schedule("forward")
    try:
        assert emu.get_schedule() == "forward"
    finally:
        emu.set_schedule(None)
    with pytest.raises(ValueError):
        emu.set_schedule("sideways")


def test_threadgroup_memory_starts_as_nan(lib):
    out = torch.zeros(64)
    with pytest.raises(emu.UninitializedRead, match=r"'uninit_tg': the result depends on memory the kernel never "
                                                     r"wrote.*argument 0 \(tensor \(64,\) float32\) differs at byte "
                                                     r"offset 4 \(128 bytes"):
        lib.uninit_tg(out, threads=64, group_size=64)
    emu.set_checks(False)  # unchecked: the NaN fill is visible
    try:
        lib.uninit_tg(out, threads=64, group_size=64)
    finally:
        emu.set_checks(None)
    assert torch.equal(out[0::2], torch.ones(32))
    assert torch.isnan(out[1::2]).all()


def test_early_return_before_barrier_is_divergence(lib):
    with pytest.raises(BarrierDivergence) as e:
        lib.early_return(torch.zeros(64), threads=64, group_size=64)
    msg = str(e.value)
    assert "early_return" in msg and "divergent" in msg and "5(5,0,0)" in msg


def test_barriers_at_different_call_sites_are_divergence(lib):
    with pytest.raises(BarrierDivergence, match="different threadgroup_barrier call sites"):
        lib.split_barrier(torch.zeros(32), threads=32, group_size=32)


def test_out_of_bounds_write_is_reported(lib):
    out = torch.zeros(10)
    with pytest.raises(OutOfBoundsWrite) as e:
        lib.write_past(out, torch.ones(10))
    msg = str(e.value)
    assert "write_past" in msg and "argument 0" in msg and "byte offset 40" in msg
    assert torch.equal(out[1:], torch.ones(9))  # in-bounds writes were copied back
    with pytest.raises(OutOfBoundsWrite, match=r"argument 0 .*byte offset -4"):
        lib.write_before(torch.zeros(4))


def test_out_of_bounds_read_sees_nan(lib):
    out = torch.zeros(10)
    with pytest.raises(emu.UninitializedRead, match=r"'read_past'.*argument 0 \(tensor \(10,\) float32\) differs "
                                                     r"at byte offset 36 \(4 bytes"):
        lib.read_past(out, torch.ones(10))
    assert torch.equal(out[:9], torch.ones(9))
    assert torch.isnan(out[9])  # the caller gets the first (NaN-guarded) run's result


def test_simd_collectives_match_torch(lib):
    n = 96 + 20  # three full simdgroups and a partial one
    x = torch.randn(n)
    outs = [torch.zeros(n) for _ in range(6)]
    lib.simd_ops(*outs, x, threads=n, group_size=n)
    sums, maxs, bfly, bfly_short, prefix, down = outs
    full = x[:96].view(3, 32)
    torch.testing.assert_close(sums[:96].view(3, 32), full.sum(1, keepdim=True).expand(3, 32), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sums[96:], x[96:].sum().expand(20), rtol=1e-5, atol=1e-5)
    assert torch.equal(maxs[:96].view(3, 32), full.max(1, keepdim=True).values.expand(3, 32))
    torch.testing.assert_close(bfly[:96].view(3, 32), full.sum(1, keepdim=True).expand(3, 32), rtol=1e-5, atol=1e-5)
    # a butterfly over too few lanes (offsets 8..1) only sums 16-lane halves: wrong answer
    assert not torch.allclose(bfly_short[:96].view(3, 32), full.sum(1, keepdim=True).expand(3, 32), atol=1e-3)
    halves = full.view(3, 2, 16).sum(2, keepdim=True).expand(3, 2, 16).reshape(3, 32)
    torch.testing.assert_close(bfly_short[:96].view(3, 32), halves, rtol=1e-5, atol=1e-5)
    excl = torch.cumsum(full, 1) - full
    torch.testing.assert_close(prefix[:96].view(3, 32), excl, rtol=1e-5, atol=1e-5)
    # shuffle_down: lane+1, the top lane keeps its own value
    exp_down = torch.cat([full[:, 1:], full[:, 31:]], 1)
    assert torch.equal(down[:96].view(3, 32), exp_down)
    # the partial simdgroup (20 lanes): lane 19 reads nonexistent lane 20 -> NaN
    assert torch.isnan(down[96 + 19])
    # the butterfly in the partial simdgroup reads inactive lanes -> NaN
    assert torch.isnan(bfly[96:]).all()


def test_simd_divergent_lanes_are_inactive(lib):
    out = torch.zeros(96)
    lib.simd_divergent(out, threads=32, group_size=32)
    assert torch.equal(out[:12], torch.full((12,), 12.0))
    assert torch.equal(out[12:32], torch.full((20,), -1.0))
    # if/else: each branch reduces over its own lanes only
    assert torch.equal(out[32:44], torch.full((12,), 12.0))
    assert torch.equal(out[44:64], torch.full((20,), 400.0))
    assert torch.equal(out[64:], torch.full((32,), 32.0))


def test_simdgroup_matrix_multiply(lib):
    a = torch.randn(16, 24)
    b = torch.randn(24, 8).half()
    c = torch.zeros(16, 8)
    lib.matmul8(a, b, c, 24, threads=64, group_size=64)  # two simdgroups, one 8-row block each
    torch.testing.assert_close(c, a @ b.float(), rtol=1e-5, atol=1e-5)


def test_quad_collectives(lib):
    o = torch.zeros(40)
    lib.quads(o, threads=10)
    o = o.view(10, 4)
    assert o[:8, 0].tolist() == [6.0] * 4 + [22.0] * 4 and o[8:, 0].tolist() == [17.0, 17.0]
    assert o[:, 1].tolist() == [1, 0, 3, 2, 5, 4, 7, 6, 9, 8]
    assert o[:8, 2].tolist() == [2.0] * 4 + [6.0] * 4 and torch.isnan(o[8:, 2]).all()  # lane 10 does not exist
    assert o[:9, 3].tolist() == [1, 2, 3, 3, 5, 6, 7, 7, 9] and torch.isnan(o[9, 3])


def test_schedules_differ_and_neighbour_race_is_caught(lib):
    orders = {}
    for sched in ("forward", "reverse", "shuffle", "shuffle:1", "shuffle:2"):
        counter = torch.zeros(1, dtype=torch.int32)
        order = torch.zeros(64, dtype=torch.int32)
        with emu.schedule(sched):
            lib.run_order(counter, order, threads=64, group_size=64)
        assert sorted(order.tolist()) == list(range(64))
        orders[sched] = order.tolist()
    assert orders["forward"] == list(range(64))
    assert orders["reverse"] == list(range(63, -1, -1))
    shuffled = [orders[k] for k in ("shuffle", "shuffle:1", "shuffle:2")]
    assert all(o not in (orders["forward"], orders["reverse"]) for o in shuffled)
    assert len({tuple(o) for o in shuffled}) == 3
    expected = torch.tensor([0.0] + list(range(63)), dtype=torch.float32)
    out = torch.zeros(64)
    emu.set_checks(False)
    try:
        with emu.schedule("forward"):
            lib.neighbour(out, threads=64, group_size=64)
        assert torch.equal(out, expected)  # the race is invisible in program order...
        lib.neighbour(out, threads=64, group_size=64)
        assert torch.isnan(out).any()      # ...the default (shuffled) schedule exposes it
    finally:
        emu.set_checks(None)
    with emu.schedule("forward"), pytest.raises(emu.DataRace, match="neighbour: data race on threadgroup array 'buf'"):
        lib.neighbour(out, threads=64, group_size=64)  # and the race detector reports it under any schedule


def test_simd_int_broadcast_vote(lib):
    out = torch.zeros(64 * 4, dtype=torch.int32)
    lib.simd_misc(out, threads=64, group_size=64)
    o = out.view(64, 4)
    assert (o[:, 0] == 496).all() and (o[:, 1] == 3).all() and (o[:, 2] == 1).all() and (o[:, 3] == 1).all()


def test_half_and_bfloat_arithmetic(lib):
    h = torch.linspace(-2, 2, 37, dtype=torch.float16)
    b = torch.linspace(-3, 3, 37, dtype=torch.bfloat16)
    f = torch.zeros(37)
    h0, b0 = h.clone(), b.clone()
    lib.halfs(h, b, f)
    torch.testing.assert_close(h, (h0 * h0 + 1.5).to(torch.float16), rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(b, (b0 * 3.0 - 0.25).to(torch.bfloat16), rtol=1e-2, atol=1e-2)
    exp_f = 4 * h0.float() + torch.exp(h0.float()).half().float() + b0.float().clamp(min=0)
    torch.testing.assert_close(f, exp_f, rtol=3e-3, atol=3e-3)


@pytest.mark.parametrize("threads,group", [((7, 5), (4, 2)), ((5, 3, 4), (2, 2, 3)), ((70, 3), None),
                                           ((37,), (16,))])
def test_grid_position_attributes(lib, threads, group):
    t3 = list(threads) + [1] * (3 - len(threads))
    if group is None:  # torch's multi-dimensional default: (max threads per group, 1, 1)
        g3 = [1024, 1, 1]
    else:
        g3 = list(group) + [1] * (3 - len(group))
    n = t3[0] * t3[1] * t3[2]
    out = torch.zeros(n * 24, dtype=torch.int32)
    lib.positions(out, threads=list(threads), group_size=None if group is None else list(group))
    got = out.view(n, 24).tolist()
    ng = [(t3[d] + g3[d] - 1) // g3[d] for d in range(3)]
    for z in range(t3[2]):
        for y in range(t3[1]):
            for x in range(t3[0]):
                p = [x, y, z]
                lp = [p[d] % g3[d] for d in range(3)]
                gr = [p[d] // g3[d] for d in range(3)]
                tpg = [min(g3[d], t3[d] - gr[d] * g3[d]) for d in range(3)]  # edge groups are smaller
                lin = lp[0] + tpg[0] * (lp[1] + tpg[1] * lp[2])
                total = tpg[0] * tpg[1] * tpg[2]
                exp = p + lp + gr + tpg + t3 + ng + [lin, lin % 32, lin // 32, 32, (total + 31) // 32,
                                                    x + 1000 * y + 100000 * g3[0]]
                assert got[(z * t3[1] + y) * t3[0] + x] == exp, (x, y, z)


def test_templates_and_macro_stamped_kernels(lib):
    h = torch.ones(5, dtype=torch.float16)
    lib.scale_half(h, 2.5)
    assert torch.equal(h, torch.full((5,), 2.5, dtype=torch.float16))
    f = torch.ones(5)
    lib.scale_float(f, -1.5)
    assert torch.equal(f, torch.full((5,), -1.5))
    b = torch.ones(5, dtype=torch.bfloat16)
    lib.scale_bfloat(b, 4.0)
    assert torch.equal(b, torch.full((5,), 4.0, dtype=torch.bfloat16))
    i = torch.full((4,), 3, dtype=torch.int32)
    lib.scale_int(i, 2.0)
    assert i.tolist() == [6] * 4
    x = torch.randn(9)
    y = torch.zeros(9)
    lib.square_k(y, x)
    torch.testing.assert_close(y, x * x)
    lib.negate_k(y, x)
    assert torch.equal(y, -x)
    y4 = torch.zeros(8)
    lib.fill_float_4(y4, threads=8, group_size=8)
    assert torch.equal(y4, torch.full((8,), 4.0))
    y8 = torch.zeros(16, dtype=torch.float16)
    lib.fill_half_8(y8, threads=16, group_size=16)
    assert torch.equal(y8, torch.full((16,), 8.0, dtype=torch.float16))


def test_packed_float3_is_12_bytes(lib):
    p = torch.arange(12, dtype=torch.float32)
    o = torch.zeros(4)
    lib.packed3(p, o, threads=4)
    assert o.tolist() == [210.0, 543.0, 876.0, 1209.0]
    assert p.tolist() == [3, 1, 0, 6, 4, 3, 9, 7, 6, 12, 10, 9]


def test_atomics(lib):
    c = torch.zeros(2, dtype=torch.int32)
    s = torch.zeros(1)
    lib.atomics(c, s, threads=1000, group_size=128)
    assert c.tolist() == [1000, 999]
    assert s.item() == 500.0


def test_crashes_become_exceptions(lib):
    with pytest.raises(KernelCrash, match="SIGFPE"):
        lib.divide(torch.tensor([1, 0, 2], dtype=torch.int32))
    with pytest.raises(KernelCrash, match="SIGSEGV"):
        lib.wild_read(torch.zeros(4))
    x = torch.tensor([1, 2, 4], dtype=torch.int32)
    lib.divide(x)  # the process and the runtime survive
    assert x.tolist() == [100, 50, 25]


def test_endless_loop_times_out(lib, monkeypatch):
    monkeypatch.setenv("COMFY_METAL_EMU_TIMEOUT", "0.3")
    with pytest.raises(KernelCrash, match="timeout"):
        lib.spin_forever(torch.zeros(2, dtype=torch.int32))
    lib.spin_forever(torch.ones(2, dtype=torch.int32))  # terminates


def test_dispatch_argument_checks(lib):
    with pytest.raises(ValueError, match="Threadgroup size exceeds"):
        lib.mark(torch.zeros(4096, dtype=torch.int32), group_size=2048)
    with pytest.raises(ValueError, match="same number of dimensions"):
        lib.mark(torch.zeros(16, dtype=torch.int32), threads=(4, 4), group_size=4)
    with pytest.raises(ValueError, match="Number of threads"):
        lib.scalars(1, 2.0)
    with pytest.raises(TypeError):
        lib.mark(object())
    lib.mark(torch.zeros(0, dtype=torch.int32))  # zero threads: nothing runs


def test_million_threads_all_run(lib):
    """A 2^20-thread grid (1024 full threadgroups) runs every thread exactly once. How fast the emulator
    runs it is a benchmark figure (emulator README), not something a test on a shared machine can hold."""
    n = 1 << 20
    a, b = torch.randn(n), torch.randn(n)
    out = torch.zeros(n)
    lib.vadd(out, a, b, n)
    torch.testing.assert_close(out, a + b)


def test_compile_error_surfaces_clang_message():
    src = ("#include <metal_stdlib>\nusing namespace metal;\n"
           "kernel void broken(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {\n"
           "  x[i] = undefined_name * 2.0f;\n}\n")
    with pytest.raises(MSLCompileError) as e:
        compile_library(src)
    msg = str(e.value)
    assert "msl_source.metal:4:" in msg and "undefined_name" in msg and "error" in msg


def test_unsized_threadgroup_parameter_compiles_but_is_refused_at_launch():
    """Metal compiles a [[threadgroup(n)]] parameter; torch's kernels cannot size it (no
    setThreadgroupMemoryLength): the launch is refused, pointing at specialize()."""
    lib = compile_library("kernel void k(device float* x [[buffer(0)]], threadgroup float* t [[threadgroup(0)]], "
                          "uint i [[thread_position_in_grid]]) { x[i] = t[0]; }")
    assert lib.kernel_names == ["k"]
    with pytest.raises(EmulatorError, match=r"threadgroup\(0\)\]\] has no size.*specialise"):
        lib.k(torch.zeros(4))
    # like torch, a library without kernels compiles (and has no kernels)
    assert compile_library("inline float helper(float x) { return x; }").kernel_names == []


def test_cache_dir_and_hash(tmp_path, monkeypatch):
    monkeypatch.setenv("COMFY_METAL_EMU_CACHE", str(tmp_path))
    src = ("kernel void only_here(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]) "
           "{ x[i] = 7.0f; }\n")
    lib1 = compile_library(src)
    files = sorted(p.suffix for p in tmp_path.iterdir())
    assert files == [".json", ".so"]
    x = torch.zeros(3)
    lib1.only_here(x)
    assert x.tolist() == [7.0] * 3
    assert not any(p.name.endswith(".tmp") for p in tmp_path.iterdir())
    assert os.path.commonpath([str(tmp_path), str(next(tmp_path.glob("*.so")))]) == str(tmp_path)


def test_window_binds_only_a_byte_range_at_the_tensors_address():
    """`windows={arg: (start, end)}` (emulator only) guards and copies just those bytes of a tensor; the kernel
    addresses the tensor as usual, and a write outside the window hits the guard."""
    lib = compile_library("#include <metal_stdlib>\nusing namespace metal;\n"
                          "kernel void put(device float* o [[buffer(0)]], constant long& at [[buffer(1)]],\n"
                          "                uint i [[thread_position_in_grid]]) { o[at + i] = 1.0f; }\n")
    out = torch.zeros(256)
    lib.put(out, 64, threads=64, windows={0: (256, 512)})
    assert out[64:128].eq(1).all() and out[:64].eq(0).all() and out[128:].eq(0).all()
    with pytest.raises(OutOfBoundsWrite):
        lib.put(out, 65, threads=64, windows={0: (256, 512)})
    with pytest.raises(ValueError, match="outside"):
        lib.put(out, 0, threads=1, windows={0: (0, 4096)})
