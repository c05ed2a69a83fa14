"""Apple GPUs, M1 to M5, from published figures: the inputs of the roofline predictor (roofline.py).

Every row names its sources in the comment above it. Apple publishes GPU core counts and memory
bandwidth (and, for M1 and M2, FP32 TFLOPS); it does not publish GPU clocks, cache sizes or
threadgroup memory per core. Where a figure comes from a third party, or is an assumption, the row says
so in `notes` (and the bench table's header says that predictions are predictions).

Sources, cited by key in the rows:
  [apple-m1]     Apple Newsroom, 2020-11-10, "Apple unleashes M1": 8-core GPU, 2.6 TFLOPS.
  [apple-m1pm]   Apple Newsroom, 2021-10-18, "Introducing M1 Pro and M1 Max": 16/32-core GPU, 5.2/10.4 TFLOPS,
                 200/400 GB/s.
  [apple-m1u]    Apple Newsroom, 2022-03-08, "Apple unveils M1 Ultra": 64-core GPU, 21 TFLOPS, 800 GB/s.
  [apple-m2]     Apple Newsroom, 2022-06-06, "Apple unveils M2": 10-core GPU, 3.6 TFLOPS, 100 GB/s.
  [apple-m2pm]   Apple Newsroom, 2023-01-17, "Apple unveils M2 Pro and M2 Max": 19/38-core GPU, 200/400 GB/s.
  [apple-m2u]    Apple Newsroom, 2023-06-05, "Apple introduces M2 Ultra": 76-core GPU, 800 GB/s.
  [apple-m3]     Apple Newsroom, 2023-10-30, "Apple unveils M3, M3 Pro, and M3 Max": 10/18/40-core GPU,
                 100/150/400 GB/s (the 30-core M3 Max: 300 GB/s).
  [apple-m3u]    Apple Newsroom, 2025-03-05, "Apple reveals M3 Ultra": 80-core GPU, 819 GB/s.
  [apple-m4]     Apple Newsroom, 2024-05-07, "Apple introduces M4 chip": 10-core GPU, 120 GB/s.
  [apple-m4pm]   Apple Newsroom, 2024-10-30, "Apple introduces M4 Pro and M4 Max": 20/40-core GPU, 273/546 GB/s
                 (reported e.g. by https://www.macrumors.com/2024/10/30/apple-announces-m4-max-chip/).
  [apple-m5]     Apple Newsroom, 2025-10-15, "Apple unleashes M5": 10-core GPU with a Neural Accelerator in
                 each core, 153 GB/s (reported e.g. by https://the-decoder.com/apples-m5-chip-brings-faster-
                 ai-to-macbook-ipad-and-vision-pro/).
  [apple-m5pm]   Apple press release, 2026-03-03, M5 Pro and M5 Max: up to 20/40 GPU cores, 307/614 GB/s
                 (reported by https://www.lowyat.net/2026/385170/apple-m5-pro-m5-max/).
  [mb]           philipturner/metal-benchmarks, README (2024-09): GPU clocks of M1 (1.278 GHz), M1 Pro/Max/
                 Ultra (1.296 GHz) and M2 family (1.398 GHz); L3 (system level cache) sizes of M1, M1 Pro/Max/
                 Ultra, M2, M2 Pro/Max; per core: 128 FP32 ALUs, four schedulers each issuing one SIMT
                 instruction a cycle, 64 B/cycle on-core data bandwidth, ~32 B/cycle L2 bandwidth, ~60 KB of
                 threadgroup memory, 3072 threads at most, 128-byte cache lines, simdgroup_matrix FP32 at
                 101.7 FFMA per core-cycle (A15 and M1 onward).
  [mtl-fst]      Apple, Metal Feature Set Tables: 32 KiB threadgroup memory per threadgroup at most.
  [3p-db]        hmc-tech.com GPU comparison pages (third-party database, not Apple): M3 Max 1.398 GHz; M4
                 family figures between 1.47 and 1.68 GHz on different pages.
"""
from __future__ import annotations

import dataclasses

# Per-core constants of the Apple GPU architecture ([mb], measured on M1/M2; assumed for later generations)
ALUS_PER_CORE = 128                # FP32 lanes: 4 schedulers x 32
SCHEDULERS_PER_CORE = 4            # each issues one SIMT instruction a cycle
L1_BYTES_PER_CYCLE = 64            # on-core data bandwidth
L2_BYTES_PER_CYCLE = 32            # what one core can draw from the L2 / fabric
LINE_BYTES = 128
MMA_FMA_PER_CYCLE = 101.7          # simdgroup_matrix FP32, per core (A15/M1 onward)
MAX_THREADS_PER_CORE = 3072
TG_BANK_CYCLES_PER_CYCLE = 1.0     # ASSUMED: one 32-bank (128 B) threadgroup access a cycle per core
                                   # (Apple publishes no threadgroup bandwidth; [mb] lists it as TBD)
LAUNCH_OVERHEAD_US = 5.0           # ASSUMED: GPU time of one compute dispatch inside a command buffer
                                   # (no published figure; to be corrected from `bench` measurements on a Mac)


@dataclasses.dataclass(frozen=True)
class Chip:
    name: str
    gpu_cores: int
    clock_ghz: float
    memory_gbs: float               # unified memory bandwidth
    slc_mb: float                   # system level cache
    tg_kb_per_core: float           # threadgroup memory per core
    fp32_tflops_published: float | None = None   # Apple's figure where it published one
    notes: str = ""                 # third-party figures and assumptions in this row

    @property
    def fp32_tflops(self) -> float:
        """Peak FP32 FMA rate: cores x 128 lanes x 2 FLOPs x clock (Apple's GPUs run FP16 at the same rate)."""
        return self.gpu_cores * ALUS_PER_CORE * 2 * self.clock_ghz / 1e3

    @property
    def fp16_tflops(self) -> float:
        return self.fp32_tflops     # [mb]: "F16 is neither faster nor slower than F32"

    @property
    def mma_tflops(self) -> float:
        """simdgroup_matrix peak ([mb]: 101.7 FFMA per core-cycle)."""
        return self.gpu_cores * MMA_FMA_PER_CYCLE * 2 * self.clock_ghz / 1e3


_M1_CLK, _M1X_CLK, _M2_CLK = 1.278, 1.296, 1.398
_M3_CLK = 1.398                     # [3p-db] (M3 Max); assumed for M3 / M3 Pro / M3 Ultra
_M4_CLK = 1.578                     # ASSUMED within the [3p-db] range 1.47-1.68 GHz
_M5_CLK = 1.578                     # ASSUMED: unpublished, taken equal to M4's

CHIPS: dict[str, Chip] = {c.name: c for c in [
    # [apple-m1] cores, TFLOPS; [mb] clock, SLC, threadgroup memory. Bandwidth not in Apple's release:
    # LPDDR4X-4266 on a 128-bit bus = 68.25 GB/s (derived).
    Chip("M1", 8, _M1_CLK, 68.25, 8, 60, 2.6, notes="bandwidth derived from LPDDR4X-4266 x 128 bit"),
    # [apple-m1pm] cores, TFLOPS, bandwidth; [mb] clock, SLC, threadgroup memory
    Chip("M1 Pro", 16, _M1X_CLK, 200, 24, 60, 5.2),
    Chip("M1 Max", 32, _M1X_CLK, 400, 48, 60, 10.4),
    # [apple-m1u]; [mb] clock, SLC
    Chip("M1 Ultra", 64, _M1X_CLK, 800, 96, 60, 21.0),
    # [apple-m2]; [mb] clock, SLC
    Chip("M2", 10, _M2_CLK, 100, 8, 60, 3.6),
    # [apple-m2pm] cores, bandwidth; [mb] clock (">= 1.398"), SLC
    Chip("M2 Pro", 19, _M2_CLK, 200, 24, 60),
    Chip("M2 Max", 38, _M2_CLK, 400, 48, 60),
    # [apple-m2u]; clock as M2 Max ([mb]); SLC assumed 2 x M2 Max
    Chip("M2 Ultra", 76, _M2_CLK, 800, 96, 60, notes="SLC assumed 2 x M2 Max"),
    # [apple-m3] cores, bandwidth; clock [3p-db]; SLC and threadgroup memory per core unpublished
    Chip("M3", 10, _M3_CLK, 100, 8, 64, notes="clock assumed = M3 Max [3p-db]; SLC, threadgroup memory assumed"),
    Chip("M3 Pro", 18, _M3_CLK, 150, 24, 64, notes="clock assumed = M3 Max [3p-db]; SLC, threadgroup memory assumed"),
    Chip("M3 Max", 40, _M3_CLK, 400, 48, 64, notes="clock third-party [3p-db]; SLC, threadgroup memory assumed"),
    # [apple-m3u]
    Chip("M3 Ultra", 80, _M3_CLK, 819, 96, 64, notes="clock assumed = M3 Max [3p-db]; SLC, threadgroup memory assumed"),
    # [apple-m4] / [apple-m4pm] cores, bandwidth; clock assumed; no M4 Ultra was released
    Chip("M4", 10, _M4_CLK, 120, 8, 64, notes="clock assumed (1.47-1.68 GHz reported [3p-db]); SLC, tg memory assumed"),
    Chip("M4 Pro", 20, _M4_CLK, 273, 24, 64, notes="clock assumed (1.47-1.68 GHz reported [3p-db]); SLC, tg memory assumed"),
    Chip("M4 Max", 40, _M4_CLK, 546, 48, 64, notes="clock assumed (1.47-1.68 GHz reported [3p-db]); SLC, tg memory assumed"),
    # [apple-m5] / [apple-m5pm] cores, bandwidth; clock unpublished (assumed = M4); no M5 Ultra in the sources.
    # The per-core Neural Accelerators are reached through Metal 4 tensor APIs; simdgroup_matrix is assumed to
    # run at the M1-M4 rate.
    Chip("M5", 10, _M5_CLK, 153, 8, 64, notes="clock assumed = M4; SLC, tg memory assumed; Neural Accelerators not modelled"),
    Chip("M5 Pro", 20, _M5_CLK, 307, 24, 64, notes="clock assumed = M4; SLC, tg memory assumed; Neural Accelerators not modelled"),
    Chip("M5 Max", 40, _M5_CLK, 614, 48, 64, notes="clock assumed = M4; SLC, tg memory assumed; Neural Accelerators not modelled"),
]}

NOT_RELEASED = ("M4 Ultra", "M5 Ultra")     # no such chip in the cited sources
DEFAULT_COLUMNS = ("M2 Max", "M3 Max", "M4 Max", "M5 Max")
REFERENCE_CHIP = "M4 Max"                   # the bench's roofline / bound / inefficiency columns


def chip(name: str) -> Chip:
    """Look a chip up by name, forgiving case and spacing ("m4max", "M4 Max")."""
    key = name.replace(" ", "").lower()
    for c in CHIPS.values():
        if c.name.replace(" ", "").lower() == key:
            return c
    if key in (n.replace(" ", "").lower() for n in NOT_RELEASED):
        raise ValueError(f"{name!r}: no such chip has been released (see metal_kernels/perf/chips.py)")
    raise ValueError(f"unknown chip {name!r}; known: {', '.join(CHIPS)}")
