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
  [mb-ilp]       the same, "ALU Bottlenecks": scalar instructions per core-cycle against simdgroups resident per
                 core (M1 Max, FADD/FFMA at ILP 4): ~42 of 128 at 2 simdgroups, ~72 at 4, ~90-104 at 6, ~110 at
                 8, ~118 at 12, ~122 at 16, ~124 at 24 ("ALU utilization maxes out at 24 simds/core"); MATMUL
                 8x8 (simdgroup_multiply_accumulate) occupies a scheduler ~17-18 cycles ("Intra-simd
                 communication"): it runs on the same pipelines as FFMA.
  [mtl-fst]      Apple, Metal Feature Set Tables: 32 KiB threadgroup memory per threadgroup at most.
  [apple-m3-gpu] Apple tech talk "Explore GPU advancements in M3 and A17 Pro" (developer.apple.com/videos/play/
                 tech-talks/111375, 2023): Dynamic Caching, flexible on-chip memory, and FP32, FP16 and integer
                 instructions executing in parallel (summarised e.g. in azhirnov/cpu-gpu-arch, gpu/Apple-M3.md,
                 and appleinsider.com, 2023-11-10).
  [3p-issue]     MacRumors forums, "Apple silicon Mac chips" thread, page 2 (third-party measurements, not
                 Apple): since M3 a scheduler co-issues two instructions a cycle (e.g. one FP32 and one FP16 or
                 integer); M5/A19 issue two FP16 instructions a cycle (A19 measured at ~1.7x the FP32 rate).
  [3p-db]        hmc-tech.com GPU comparison pages (third-party database, not Apple): M3 Max 1.398 GHz; M4
                 family figures between 1.47 and 1.68 GHz on different pages.
"""
from __future__ import annotations

import dataclasses

# Per-core constants of the Apple GPU architecture ([mb], measured on M1/M2; assumed for later generations)
ALUS_PER_CORE = 128                # FP32 lanes: 4 schedulers x 32
SCHEDULERS_PER_CORE = 4            # each issues one SIMT instruction a cycle (M1/M2; M3 on: see dual_issue)
L1_BYTES_PER_CYCLE = 64            # on-core data bandwidth
L2_BYTES_PER_CYCLE = 32            # what one core can draw from the L2 / fabric
LINE_BYTES = 128
MMA_FMA_PER_CYCLE = 101.7          # simdgroup_matrix FP32, per core (A15/M1 onward); FP16: 102.5
# scheduler cycles of one 8x8x8 simdgroup_multiply_accumulate: 512 FMAs at 101.7 a core-cycle over the 4
# schedulers. It occupies the scheduler and the FMA pipelines like the FFMAs it is made of ([mb-ilp]), so
# it adds to the issue cycles of the ALU instructions instead of overlapping them.
MMA_CYCLES = SCHEDULERS_PER_CORE * 512 / MMA_FMA_PER_CYCLE
MAX_THREADS_PER_CORE = 3072
MAX_SIMDGROUPS_PER_CORE = MAX_THREADS_PER_CORE // 32
# Fraction of the peak issue rate a core reaches with this many simdgroups resident ([mb-ilp], ILP 4,
# normalised to 125 instructions a cycle): latency is hidden only with enough simdgroups per scheduler.
# Interpolated linearly; 1 simdgroup: half the 2-simdgroup figure (ASSUMED, not measured). It assumes
# the kernel's own instruction-level parallelism is ~4 (independent accumulators, unrolled loops): a
# dependent chain runs slower still, which the model does not see.
ISSUE_EFFICIENCY = ((1, 0.17), (2, 0.34), (3, 0.47), (4, 0.58), (6, 0.76), (8, 0.88), (12, 0.94), (16, 0.97),
                    (24, 1.0))
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
    def generation(self) -> int:
        """1 for M1 ... 5 for M5."""
        return int(self.name[1])

    @property
    def dual_issue(self) -> bool:
        """M3 onward: a scheduler issues an FP32, an FP16 and an integer instruction of different simdgroups
        in the same cycle, two at most ([apple-m3-gpu], [3p-issue]); M1/M2 issue one instruction a cycle."""
        return self.generation >= 3

    @property
    def fp16_rate(self) -> float:
        """FP16 ALU instructions a scheduler issues per cycle: 1 on M1-M4 ([mb]: F16 = F32 throughput), 2 on
        M5 (REPORTED by third parties, [3p-issue]; not published by Apple)."""
        return 2.0 if self.generation >= 5 else 1.0

    @property
    def fp32_tflops(self) -> float:
        """Peak FP32 FMA rate: cores x 128 lanes x 2 FLOPs x clock."""
        return self.gpu_cores * ALUS_PER_CORE * 2 * self.clock_ghz / 1e3

    @property
    def fp16_tflops(self) -> float:
        return self.fp32_tflops * self.fp16_rate

    @property
    def mma_tflops(self) -> float:
        """simdgroup_matrix peak ([mb]: 101.7 FFMA per core-cycle, about 79% of the ALU peak; assumed the
        same on M3-M5: M5's per-core Neural Accelerators are reached through Metal 4's tensor APIs, not
        simdgroup_matrix)."""
        return self.gpu_cores * MMA_FMA_PER_CYCLE * 2 * self.clock_ghz / 1e3


def issue_efficiency(simdgroups_per_core: float) -> float:
    """ISSUE_EFFICIENCY at this many resident simdgroups per core."""
    pts = ISSUE_EFFICIENCY
    if simdgroups_per_core <= pts[0][0]:
        return pts[0][1] * max(simdgroups_per_core, 0.0) / pts[0][0]
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if simdgroups_per_core <= x1:
            return y0 + (y1 - y0) * (simdgroups_per_core - x0) / (x1 - x0)
    return pts[-1][1]


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
    # run at the M1-M4 rate. FP16 ALU rate 2x FP32: third-party report [3p-issue].
    Chip("M5", 10, _M5_CLK, 153, 8, 64, notes="clock assumed = M4; SLC, tg memory assumed; FP16 rate reported [3p-issue]; NA not modelled"),
    Chip("M5 Pro", 20, _M5_CLK, 307, 24, 64, notes="clock assumed = M4; SLC, tg memory assumed; FP16 rate reported [3p-issue]; NA not modelled"),
    Chip("M5 Max", 40, _M5_CLK, 614, 48, 64, notes="clock assumed = M4; SLC, tg memory assumed; FP16 rate reported [3p-issue]; NA not modelled"),
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
