"""The chip table and the roofline predictor (metal_kernels/perf): published figures, and predictions on
synthetic kernels whose bottleneck is known (profiled in the emulator)."""
from __future__ import annotations

import pytest
import torch

from comfy_metal.metal_kernels import emulator as emu
from comfy_metal.metal_kernels.perf import CHIPS, chip, predict
from comfy_metal.metal_kernels.perf import chips as C
from synthetic_kernels import SRC

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
