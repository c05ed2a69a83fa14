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
from synthetic_kernels import SRC, aligned

pytestmark = pytest.mark.skipif(not emu.available(), reason="clang-19 not installed: the MSL emulator needs it")


@pytest.fixture(scope="module")
def lib():
    return compile_library(SRC)


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


def test_simdgroup_matrix_on_16_bit_operands_is_counted_apart(lib):
    a = aligned(128, torch.float16, torch.randn(128))
    p = lib.mma_half.profile(aligned(128, torch.float16), a, 10, threads=64, group_size=64)
    assert p.mma == p.mma16 == 2 * 10
    q = lib.mma_loop.profile(aligned(128), aligned(128, fill=torch.randn(128)), 7, threads=64, group_size=64)
    assert q.mma == 2 * 7 and q.mma16 == 0


def test_msl_half_functions_count_as_fp16_arithmetic(lib):
    # the shim computes fma(half) and clamp(half) through float; on the GPU they are FP16 instructions
    p = lib.half_fma.profile(aligned(64, torch.float16), 10, threads=64, group_size=64)
    assert p.issue["fp32"][0] == 0 and p.issue["fp16"][0] > 0
    assert p.flops16 == p.flops > 0


def test_struct_copies_count_as_device_loads(lib):
    # `block34 b = a[tid]` is a memcpy in the IR: its bytes are loads on the GPU (and the DRAM floor)
    blocks = aligned(34 * 64, torch.uint8, torch.randint(0, 255, (34 * 64,), dtype=torch.uint8))
    p = lib.block_copy.profile(aligned(64), blocks, threads=64, group_size=64)
    assert p.buffers[1].read_bytes == 34 * 64
    ld = p.memory["device_load"]
    assert ld.distinct_bytes == 34 * 64 and max(ld.by_width) <= 16


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


@pytest.mark.parametrize("ir,want", [
    ("%5 = fadd <4 x float> %a, %b", [("fp32", "f_simple", 4, 1.0)]),
    ("%5 = fmul half %a, %b", [("fp16", "f_simple", 1, 1.0)]),
    ("%5 = tail call <2 x float> @llvm.fma.v2f32(<2 x float> %a, <2 x float> %b, <2 x float> %c)",
     [("fp32", "f_simple", 2, 2.0)]),
    ("%5 = sdiv i64 %a, %b", [("idiv64", "idiv64", 1, 0.0)]),
    ("%5 = urem i32 %a, %b", [("idiv32", "idiv32", 1, 0.0)]),
    # by a constant: a multiply-high sequence on the GPU (the back end, not the IR, makes it)
    ("%5 = udiv i32 %a, 24", [("idiv32", "idiv32_const", 1, 0.0)]),
    ("%5 = urem <2 x i32> %a, splat (i32 7)", [("idiv32", "irem32_const", 2, 0.0)]),
    ("%5 = srem i64 %a, 10", [("idiv64", "irem64_const", 1, 0.0)]),
    ("%5 = lshr i32 %a, %b", [("int32", "i_rshift_var", 1, 0.0)]),   # RSHIFT32 by a run-time amount: ~8
    ("%5 = lshr i32 %a, 4", [("int32", "i_shift", 1, 0.0)]),
    ("%5 = mul nsw i64 %a, %b", [("int64", "i64_mul", 1, 0.0)]),
    ("%5 = shl nuw i32 %a, 3", [("int32", "i_shift", 1, 0.0)]),
    ("%5 = icmp slt i64 %a, %b", [("int64", "i64_simple", 1, 0.0)]),
    ("%5 = sitofp i32 %a to float", [("conversion", "cvt32", 1, 0.0)]),
    ("%5 = fdiv float 1.000000e+00, %a", [("transcendental", "div", 1, 1.0)]),
    ("%5 = tail call noundef float @expf(float %a)", [("transcendental", "exp", 1, 0.0)]),
    ("%5 = select i1 %c, <4 x half> %a, <4 x half> %b", [("fp16", "f_simple", 4, 0.0)]),
    ("%5 = fpext half %a to float", []),                    # a free operand modifier on Apple GPUs
    ("%5 = getelementptr inbounds float, ptr %p, i64 %i", []),
    ("%5 = load <4 x float>, ptr %p, align 16", []),        # counted as a memory instruction instead
])
def test_instruction_classes(ir, want):
    from comfy_metal.metal_kernels.emulator.ir_mix import classify
    assert classify("  " + ir) == want


def _storage_at(n: int, skew: int, keep: list, fill=None) -> torch.Tensor:
    """A fresh float tensor (storage offset 0) whose storage starts `skew` bytes past a 128-byte boundary of
    host memory."""
    buf = (ctypes.c_char * (4 * n + 256))()
    keep.append(buf)
    t = torch.frombuffer(buf, dtype=torch.float32, count=n, offset=(-ctypes.addressof(buf)) % 128 + skew)
    assert t.untyped_storage().data_ptr() % 128 == skew and t.storage_offset() == 0
    if fill is not None:
        t.copy_(fill)
    return t


def test_sectors_and_lines_do_not_depend_on_where_the_host_put_the_storage(lib):
    """The GPU sees a tensor's storage at the start of its own buffer (line aligned): the counts are the
    same wherever the CPU allocator put it (it aligns to 64 bytes only), and a view keeps its offset."""
    keep, x = [], torch.randn(256 * 4)
    counts = []
    for skew in (0, 16, 64):
        a, out = _storage_at(256 * 4, skew, keep, fill=x), _storage_at(256 * 4, (skew + 32) % 128, keep)
        p = lib.copy4.profile(out, a, threads=256, group_size=64)
        ld, st = p.memory["device_load"], p.memory["device_store"]
        assert ld.sectors == st.sectors == 8 * 16 and ld.lines == st.lines == 8 * 4, skew
        assert [b.read_sectors for b in p.buffers] == [0, 128] and [b.written_sectors for b in p.buffers] == [128, 0]
        counts.append(_counts(p))
    assert counts[0] == counts[1] == counts[2]
    # a view 64 bytes into its storage straddles lines whatever the host address: 5 lines per 512 B
    for skew in (0, 64):
        base = _storage_at(256 * 4 + 16, skew, keep, fill=torch.randn(256 * 4 + 16))
        p = lib.copy4.profile(_storage_at(256 * 4, 0, keep), base[16:], threads=256, group_size=64)
        ld = p.memory["device_load"]
        assert ld.sectors == 8 * 16 and ld.lines == 8 * 5, skew
        assert p.buffers[1].read_sectors == 128
