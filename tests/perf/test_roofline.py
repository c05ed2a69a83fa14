"""The chip table and the roofline predictor (metal_kernels/perf): published figures, and predictions on
synthetic kernels whose bottleneck is known (profiled in the emulator)."""
from __future__ import annotations

import pytest
import torch

from comfy_metal.metal_kernels import emulator as emu
from comfy_metal.metal_kernels.perf import CHIPS, chip, predict
from comfy_metal.metal_kernels.perf import chips as C
from comfy_metal.metal_kernels.perf.roofline import issue_cycles
from synthetic_kernels import SRC, aligned

pytestmark = pytest.mark.skipif(not emu.available(), reason="clang-19 not installed: the MSL emulator needs it")


@pytest.fixture(scope="module")
def lib():
    return emu.compile_library(SRC)


def test_chip_table_has_the_published_figures():
    assert (chip("M1 Max").memory_gbs, chip("M2 Max").gpu_cores, chip("M3 Max").gpu_cores) == (400, 38, 40)
    assert (chip("M4 Max").memory_gbs, chip("M5 Max").memory_gbs, chip("M5 Pro").memory_gbs) == (546, 614, 307)
    assert chip("m4max") is CHIPS["M4 Max"]
    for c in CHIPS.values():
        assert c.gpu_cores > 0 and c.clock_ghz > 1 and c.memory_gbs > 0 and c.slc_mb > 0 and c.tg_kb_per_core >= 32
        if c.fp32_tflops_published:        # the model's FP32 peak agrees with Apple's figure
            assert abs(c.fp32_tflops / c.fp32_tflops_published - 1) < 0.03, c.name
        if c.name[:2] in ("M3", "M4", "M5"):
            assert "assumed" in c.notes     # unpublished clocks are marked as such
        # FP16 runs at the FP32 rate on M1-M4 (metal-benchmarks); M5's 2x is a third-party report, marked so
        assert c.fp16_tflops == c.fp32_tflops * (2 if c.name.startswith("M5") else 1)
        assert c.dual_issue == (c.name[:2] not in ("M1", "M2"))
        assert c.mma_tflops < c.fp32_tflops                          # simdgroup_matrix reaches ~79% of the ALU
    assert all("reported" in c.notes for c in CHIPS.values() if c.name.startswith("M5"))
    for name in C.DEFAULT_COLUMNS + (C.REFERENCE_CHIP,):
        chip(name)
    with pytest.raises(ValueError, match="no such chip has been released"):
        chip("M4 Ultra")
    with pytest.raises(ValueError, match="unknown chip"):
        chip("M9")


def test_coalesced_copy_is_at_the_dram_roofline(lib):
    n = 1 << 20                                 # float4s: 16 MiB in, 16 MiB out
    p = lib.copy4.profile(torch.empty(4 * n), torch.randn(4 * n), threads=n, group_size=256, sample=3)
    r = predict(p, "M2 Max")
    assert r.bound == "dram" and r.roofline > 0.99
    want_us = 2 * 16 * 2**20 / 400e9 * 1e6 + C.LAUNCH_OVERHEAD_US
    assert abs(r.time_us / want_us - 1) < 0.01


def test_strided_load_wastes_sectors(lib):
    n = 1 << 18
    p = lib.stride8.profile(torch.empty(n), torch.randn(8 * n), threads=n, group_size=256, sample=3)
    r = predict(p, "M2 Max")
    assert r.bound == "dram"
    assert abs(r.roofline - (4 + 4) / (32 + 4)) < 0.01      # 4 useful bytes of each 32-byte sector read
    assert r.top.startswith("DRAM traffic is 4.5x the bytes used") and "fetched for 22% of their bytes" in r.top


@pytest.mark.parametrize("stride", [32, 33])
def test_bank_conflicts_bind_the_threadgroup_limit(lib, stride):
    p = lib.tg_loop.profile(torch.empty(32 * 512), stride, 64, threads=32 * 512, group_size=32, sample=3)
    r = predict(p, "M4 Max")
    if stride == 32:
        assert r.bound == "threadgroup" and "32.0-way bank conflicted" in r.top
    else:                                       # stride 33: every lane in its own bank
        assert p.memory["threadgroup_load"].bank_conflict == 1.0
        assert not any("bank conflicted" in t for _, t in r.inefficiencies)


def test_gemv_with_16_byte_lanes_issues_a_quarter_of_the_loads_at_the_same_dram_time(lib):
    # fp32 GEMV, one simdgroup a row: float4 lanes move the same lines with a quarter of the load instructions;
    # large enough to be bandwidth-bound either way, as on the GPU
    n, k = 4096, 4096
    w, x = aligned(n * k, fill=torch.randn(n * k)), aligned(k, fill=torch.randn(k))
    p1 = lib.gemv_f1.profile(torch.empty(n), w, x, k, threads=32 * n, group_size=32, sample=3)
    p4 = lib.gemv_f4.profile(torch.empty(n), w, x, k // 4, threads=32 * n, group_size=32, sample=3)
    l1, l4 = p1.memory["device_load"], p4.memory["device_load"]
    assert l1.instructions == pytest.approx(4 * l4.instructions) and (l1.mean_width, l4.mean_width) == (4, 16)
    assert l1.lines == pytest.approx(l4.lines) and l1.sectors == pytest.approx(l4.sectors)
    assert p1.unique_bytes == p4.unique_bytes
    r1, r4 = predict(p1, "M2 Max"), predict(p4, "M2 Max")
    assert r1.bound == r4.bound == "dram" and r1.time_us == pytest.approx(r4.time_us)
    # ~6 instructions an element against ~2.5 (2 loads, 5 FP ops and 3 loop/address ops per 4 elements)
    assert r1.limits_us["issue"] > 2 * r4.limits_us["issue"]


def test_64_bit_divisions_bind_the_issue_limit(lib):
    p = lib.div64.profile(torch.empty(64 * 1024, dtype=torch.int64), 200, threads=64 * 1024, group_size=256, sample=3)
    r = predict(p, "M4 Max")
    assert r.bound == "issue" and r.top.startswith("64-bit integer divide/modulo")
    assert r.roofline < 0.05


def test_tiny_launches_report_the_launch_overhead(lib):
    p = lib.copy4.profile(torch.empty(4 * 256), torch.randn(4 * 256), threads=256, group_size=256)
    r = predict(p, "M4 Max")
    assert r.time_us > C.LAUNCH_OVERHEAD_US and any("launch overhead" in t for _, t in r.inefficiencies)
    assert any("threadgroups for 40 cores" in t for _, t in r.inefficiencies)


def test_launches_add_up(lib):
    p = lib.copy4.profile(torch.empty(4 * 4096), torch.randn(4 * 4096), threads=4096, group_size=256)
    one, two = predict(p, "M1"), predict([p, p], "M1")
    assert abs(two.time_us - 2 * one.time_us) < 1e-6 and abs(two.ideal_us - 2 * one.ideal_us) < 1e-9


MMA_ROUNDS, MMA_GROUPS = 50, 40 * 24          # groups of 2 simdgroups: 24 groups on each of 40 cores


def _mma(lib, name):
    a = aligned(128, fill=torch.randn(128))
    return getattr(lib, name).profile(aligned(MMA_GROUPS * 2 * 96), a, MMA_ROUNDS, threads=64 * MMA_GROUPS,
                                      group_size=64, sample=3)


def test_simdgroup_matrix_shares_the_issue_slots_with_the_alu(lib):
    # simdgroup_multiply_accumulate runs on the FMA pipelines (~20 scheduler cycles each): ALU work next to it
    # adds to the time, it does not hide behind it
    p, q = _mma(lib, "mma_only"), _mma(lib, "mma_fma16")
    m2 = chip("M2 Max")
    cp, cq = issue_cycles(p, m2), issue_cycles(q, m2)
    assert cp["mma"] == cq["mma"] == p.mma * C.MMA_CYCLES and p.mma == 2 * MMA_ROUNDS * MMA_GROUPS
    assert cq["fp32"] - cp["fp32"] == pytest.approx(16 * MMA_ROUNDS * 2 * MMA_GROUPS)     # 16 FMAs a round
    assert cq["total"] - cp["total"] == pytest.approx(cq["work"] - cp["work"])            # added, not hidden
    rp, rq = predict(p, m2), predict(q, m2)
    assert abs(rq.limits_us["issue"] / rp.limits_us["issue"] - cq["total"] / cp["total"]) < 1e-9
    busy = [r.time_us - C.LAUNCH_OVERHEAD_US for r in (rp, rq)]
    assert busy[1] > 1.5 * busy[0] and rp.bound == "mma"


def test_the_roofline_of_simdgroup_matrix_work_is_the_alu_peak(lib):
    # a kernel that does nothing but multiply-accumulate reaches 101.7 / 128 of the ALU peak, not 100%
    p = _mma(lib, "mma_only")
    r, c = predict(p, "M4 Max"), issue_cycles(p, chip("M4 Max"))
    assert r.bound == "mma"
    assert abs(r.roofline - C.MMA_FMA_PER_CYCLE / C.ALUS_PER_CORE * c["mma"] / c["total"]) < 1e-9
    half = predict(p, "M4 Max", flops=p.mma_flops / 2)       # the case says half the work was useful
    assert abs(half.ideal_us / r.ideal_us - 0.5) < 1e-9


ALU_ROUNDS, ALU_GROUPS = 100, 38 * 10          # groups of 64 threads: 10 groups on each of 38 cores (M2 Max)


def _alu(lib, name):
    n = 64 * ALU_GROUPS
    return getattr(lib, name).profile(torch.empty(n), ALU_ROUNDS, threads=n, group_size=64, sample=3)


def test_threadgroup_memory_limits_occupancy_and_the_issue_rate(lib):
    # 32 KiB a group: one group of 2 simdgroups per core (60 KB of threadgroup memory): latency is not hidden
    p, q = _alu(lib, "alu_fp"), _alu(lib, "alu_fp_tg32k")
    m2 = chip("M2 Max")
    rp, rq = predict(p, m2), predict(q, m2)
    assert (rp.simdgroups_per_core, rq.simdgroups_per_core) == (20, 2) and rq.groups_per_core == 1
    want = (issue_cycles(q, m2)["total"] / C.issue_efficiency(2)) / (issue_cycles(p, m2)["total"] / C.issue_efficiency(20))
    assert abs(rq.limits_us["issue"] / rp.limits_us["issue"] - want) < 1e-9 and want > 2.5
    assert any("2 simdgroups resident per core" in t for _, t in rq.inefficiencies)


def test_m3_on_co_issue_fp32_and_integer_instructions(lib):
    p, q = _alu(lib, "alu_fp"), _alu(lib, "alu_fp_int")
    sg = 2 * ALU_GROUPS
    fp32, ints = q.issue["fp32"][1], q.issue["int32"][1] + q.issue["conversion"][1]
    added = ints - p.issue["int32"][1] - p.issue["conversion"][1]
    assert fp32 == p.issue["fp32"][1] and added == pytest.approx(8 * ALU_ROUNDS * sg)   # 8 integer ops a round
    m2, m4 = issue_cycles(q, chip("M2 Max")), issue_cycles(q, chip("M4 Max"))
    assert m2["total"] == m2["work"]                                           # M2: one instruction a cycle
    assert m4["total"] == pytest.approx(m4["other"] + max(fp32, ints, (fp32 + ints) / 2))   # M4: they pair up
    assert m4["total"] < 0.6 * m2["total"]
    fp_only = issue_cycles(p, chip("M4 Max"))                                 # nothing to pair the FMAs with
    assert fp_only["total"] == pytest.approx(fp_only["other"] + p.issue["fp32"][1])


def test_m5_issues_fp16_at_twice_the_fp32_rate(lib):
    p = lib.half_fma.profile(aligned(64 * 40, torch.float16), 100, threads=64 * 40, group_size=64)
    m4, m5 = issue_cycles(p, chip("M4 Max")), issue_cycles(p, chip("M5 Max"))
    assert m4["fp16"] == p.issue["fp16"][1] > 0 and m5["fp16"] == m4["fp16"] / 2
