"""The emulator's profiling launches (`kernel.profile`): exact counts on synthetic kernels whose answer is
known, sampled == full on a homogeneous grid, the same counts with and without the race detector, and no
profiler in normal builds."""
from __future__ import annotations

import ctypes
import dataclasses

import pytest
import torch

from comfy_metal.metal_kernels import emulator as emu
from comfy_metal.metal_kernels.emulator import compile_library, set_checks

pytestmark = pytest.mark.skipif(not emu.available(), reason="clang-19 not installed: the MSL emulator needs it")

SRC = r"""
#include <metal_stdlib>
#include <metal_simdgroup>
#include <metal_simdgroup_matrix>
using namespace metal;

kernel void copy4(device float4* out [[buffer(0)]], const device float4* a [[buffer(1)]],
                  uint tid [[thread_position_in_grid]]) {
  out[tid] = a[tid];
}

kernel void stride8(device float* out [[buffer(0)]], const device float* a [[buffer(1)]],
                    uint tid [[thread_position_in_grid]]) {
  out[tid] = a[tid * 8];
}

kernel void tg_stride(device float* out [[buffer(0)]], constant int& stride [[buffer(1)]],
                      uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[32 * 32];
  t[lid * stride] = (float)lid;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = t[lid * stride];
}

kernel void half_branch(device float* out [[buffer(0)]], uint tid [[thread_position_in_grid]]) {
  if (tid % 2 == 0) {
    float v = out[tid];
    v = v * 1.5f + 0.25f;
    out[tid] = v;  // BRANCH BODY
  }
}

kernel void mma_loop(device float* out [[buffer(0)]], const device float* a [[buffer(1)]],
                     constant int& n [[buffer(2)]], uint sg [[simdgroup_index_in_threadgroup]]) {
  simdgroup_float8x8 A, B;
  simdgroup_float8x8 C = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  simdgroup_load(A, a, 8);
  simdgroup_load(B, a + 64, 8);
  for (int i = 0; i < n; i++) simdgroup_multiply_accumulate(C, A, B, C);
  simdgroup_store(C, out + sg * 64, 8);
}

kernel void div64(device long* out [[buffer(0)]], constant long& n [[buffer(1)]],
                  uint tid [[thread_position_in_grid]]) {
  long acc = 0;
  for (long i = 1; i <= n; i++) acc += ((long)tid + 1000) / i;
  out[tid] = acc;
}

kernel void div32(device int* out [[buffer(0)]], constant int& n [[buffer(1)]],
                  uint tid [[thread_position_in_grid]]) {
  int acc = 0;
  for (int i = 1; i <= n; i++) acc += ((int)tid + 1000) / i;
  out[tid] = acc;
}

kernel void reduce_loop(device float* out [[buffer(0)]], constant int& n [[buffer(1)]],
                        uint tid [[thread_position_in_grid]]) {
  float v = (float)tid;
  for (int i = 0; i < n; i++) v = simd_sum(v) * 0.5f;
  out[tid] = v;
}

// rows of a matrix times a vector every group reads whole: one thread per row
kernel void rows(device float* y [[buffer(0)]], const device float* w [[buffer(1)]],
                 const device float* x [[buffer(2)]], constant int& n [[buffer(3)]], constant int& k [[buffer(4)]],
                 uint row [[thread_position_in_grid]]) {
  if ((int)row >= n) return;
  float acc = 0.0f;
  for (int j = 0; j < k; j++) acc += w[row * k + j] * x[j];
  y[row] = acc;
}
"""


@pytest.fixture(scope="module")
def lib():
    return compile_library(SRC)


def aligned(n: int, dtype=torch.float32, fill=None) -> torch.Tensor:
    """A tensor of n elements whose data starts on a 128-byte line."""
    es = torch.empty(0, dtype=dtype).element_size()
    buf = torch.empty(n + 256 // es, dtype=dtype)
    off = (-buf.data_ptr() % 128) // es
    t = buf[off:off + n]
    if fill is not None:
        t.copy_(fill)
    return t


def test_coalesced_float4_copy_uses_every_byte(lib):
    a, out = aligned(256 * 4, fill=torch.randn(256 * 4)), aligned(256 * 4)
    p = lib.copy4.profile(out, a, threads=256, group_size=64)
    ld, st = p.memory["device_load"], p.memory["device_store"]
    assert ld.instructions == st.instructions == 256 / 32
    assert ld.sector_efficiency == st.sector_efficiency == 1.0
    assert ld.sectors == 8 * 16 and ld.lines == 8 * 4           # 512 B per instruction: 16 sectors, 4 lines
    assert ld.by_width == {16: 8.0} and ld.mean_width == 16
    assert [b.read_bytes for b in p.buffers] == [0, 4096] and [b.written_bytes for b in p.buffers] == [4096, 0]


def test_stride_8_float_load_uses_an_eighth_of_each_sector(lib):
    a, out = aligned(256 * 8, fill=torch.randn(256 * 8)), aligned(256)
    p = lib.stride8.profile(out, a, threads=256, group_size=64)
    ld = p.memory["device_load"]
    assert ld.sector_efficiency == 0.125
    assert ld.sectors == 8 * 32 and ld.mean_width == 4
    assert p.memory["device_store"].sector_efficiency == 1.0
    assert p.buffers[1].read_bytes == 1024 and p.buffers[1].read_sectors == 256


@pytest.mark.parametrize("stride,conflict", [(32, 32.0), (1, 1.0), (2, 2.0)])
def test_threadgroup_stride_bank_conflicts(lib, stride, conflict):
    p = lib.tg_stride.profile(torch.empty(32), stride, threads=32, group_size=32)
    for kind in ("threadgroup_store", "threadgroup_load"):
        m = p.memory[kind]
        assert m.instructions == 1 and m.bank_conflict == conflict and m.bank_cycles == conflict
    assert p.barriers == 1 and p.threadgroup_bytes == 32 * 32 * 4


def test_branch_taken_by_half_the_lanes_is_half_active(lib):
    line = next(i for i, ln in enumerate(SRC.splitlines(), 1) if "BRANCH BODY" in ln)
    p = lib.half_branch.profile(aligned(64, fill=torch.randn(64)), threads=64, group_size=64)
    assert p.memory["device_load"].active_fraction == 0.5 and p.memory["device_store"].active_fraction == 0.5
    body = [b for b in p.blocks if b.line in (line - 2, line - 1, line)]
    assert body and all(b.active_fraction == 0.5 for b in body)
    entry = [b for b in p.blocks if b.active_fraction == 1.0]
    assert entry                                                # the condition runs on every lane


def test_simdgroup_matrix_loop_counts_its_multiply_accumulates(lib):
    a = aligned(128, fill=torch.randn(128))
    p = lib.mma_loop.profile(aligned(128), a, 7, threads=64, group_size=64)
    assert p.mma == 2 * 7 and p.mma_flops == 2 * 7 * 512 * 2
    assert p.flops == 0                                         # the per-lane emulation of the MMA is not ALU work
    ld = p.memory["device_load"]
    assert ld.instructions == 2 * 2 and ld.by_width == {8: 4.0}  # two simdgroup_loads per simdgroup, 8 B a lane
    assert ld.distinct_bytes == 2 * 2 * 256
    assert p.memory["device_store"].instructions == 2


def test_loop_of_64_bit_divisions_counts_int64_divides(lib):
    p = lib.div64.profile(torch.empty(32, dtype=torch.int64), 10, threads=32, group_size=32)
    assert p.issue["idiv64"][0] == 10 and p.issue["idiv32"][0] == 0
    p32 = lib.div32.profile(torch.empty(64, dtype=torch.int32), 6, threads=64, group_size=64)
    assert p32.issue["idiv32"][0] == 2 * 6 and p32.issue["idiv64"][0] == 0


def test_simd_reductions_counted_per_simdgroup(lib):
    p = lib.reduce_loop.profile(torch.empty(96), 5, threads=96, group_size=96)
    assert p.collectives["simd_reduce"] == 3 * 5 and p.collectives["simd_shuffle"] == 0


def _rows_args(n=1000, k=64):
    gen = torch.Generator().manual_seed(0)
    return (aligned(n), aligned(n * k, fill=torch.randn(n * k, generator=gen)),
            aligned(k, fill=torch.randn(k, generator=gen)), n, k)


def _counts(p):
    d = dataclasses.asdict(p)
    d.pop("groups_run")
    return d


def test_sampled_profile_of_a_homogeneous_grid_equals_the_full_one(lib):
    args = _rows_args()
    full = lib.rows.profile(*args, threads=1000, group_size=64)
    assert full.groups == full.groups_run == 16
    for n in (1, 3):
        sampled = lib.rows.profile(*args, threads=1000, group_size=64, sample=n)
        assert sampled.groups_run == (2 if n == 1 else 4)       # per class (full, partial edge): n groups
        assert _counts(sampled) == _counts(full)
    assert full.buffers[1].read_bytes == 1000 * 64 * 4 and full.buffers[2].read_bytes == 64 * 4


def test_counts_do_not_depend_on_the_race_detector(lib):
    args = _rows_args(200, 16)
    try:
        set_checks(True)
        on = lib.rows.profile(*args, threads=200, group_size=64)
        set_checks(False)
        off = lib.rows.profile(*args, threads=200, group_size=64)
    finally:
        set_checks(None)
    assert dataclasses.asdict(on) == dataclasses.asdict(off)


def test_normal_builds_contain_no_profiler(lib):
    with pytest.raises(AttributeError):
        getattr(lib._dll, "__emu_prof_begin")
    from comfy_metal.metal_kernels.emulator.profiler import profile_build
    assert isinstance(getattr(profile_build(lib).dll, "__emu_prof_begin"), ctypes._CFuncPtr)


def test_scaled_profile_multiplies_counts(lib):
    p = lib.stride8.profile(aligned(256), aligned(256 * 8, fill=torch.randn(256 * 8)), threads=256, group_size=64)
    q = p.scaled(3)
    assert q.groups == 3 * p.groups and q.memory["device_load"].sectors == 3 * p.memory["device_load"].sectors
    assert q.unique_bytes == 3 * p.unique_bytes and q.repeat == 3
    assert q.memory["device_load"].sector_efficiency == p.memory["device_load"].sector_efficiency
