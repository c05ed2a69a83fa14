"""The roofline predictor: an emulator `Profile` and a `Chip` -> predicted time, % of roofline, the binding
limit and the main inefficiencies in plain words. A model, not a measurement (see the emulator README's
"Performance model" section for what it leaves out).

Per launch, each limit is a time (the profile's counts, the chip's rates from chips.py):
  dram         unique bytes (in 32-byte sectors) / memory bandwidth, and no faster than the active cores
               can draw (32 B/cycle each);
  l1           device-memory transactions: 128-byte lines x 2 cycles (64 B/cycle per core);
  issue        scheduler cycles / (4 schedulers x cores x the issue efficiency of the resident simdgroups):
               the ALU classes at their measured cost, simdgroup_matrix multiply-accumulates (~20 cycles
               each: they run on the FMA pipelines), one per memory instruction, the SIMD collectives at
               their cost. M1/M2 issue one instruction a cycle; M3 on co-issue their FP32, FP16 and integer
               instructions, two a cycle at most (memory and SIMD instructions issue alone);
  threadgroup  bank cycles of threadgroup loads and stores (one 32-bank access a cycle per core, assumed);
  mma          the simdgroup_matrix part of `issue` (reported; the bound reads "mma" when it is most of it).
Core-bound limits use the busiest core: G groups on C cores leave G / (C x ceil(G / C)) of them in use, and
a core holds min(groups per core by occupancy, ceil(G / C)) groups at once.
predicted = max(limits) + launch overhead; ideal = max(unique bytes / bandwidth, useful FLOPs / ALU peak)
(the case's own FLOP count where it gives one, else the FLOPs executed, simdgroup_matrix ones included:
the roofline is the chip's, however the kernel computes); % of roofline = ideal / max(limits).
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, Sequence

from ..emulator.profiler import MACS_PER_MMA, Profile
from . import chips as C

LIMITS = ("dram", "l1", "issue", "threadgroup", "mma")
# scheduler cycles of one SIMD collective ([mb] "Intra-simd communication", M1 Max): SUM/PRODUCT/BITWISE
# reductions 14.5-17 (15 taken), prefix sums 11.6-13 (counted with the reductions), broadcast/shuffle/
# ballot ~2; quad reductions ~6, quad shuffles ~2. simdgroup_barrier and threadgroup barriers: ASSUMED 2.
COLLECTIVE_CYCLES = {"simd_shuffle": 2.0, "simd_reduce": 15.0, "quad_shuffle": 2.0, "quad_reduce": 6.0,
                     "simdgroup_barrier": 2.0}
BARRIER_CYCLES = 2.0
MEMORY_INSTRUCTION_CYCLES = 1.0
# the issue classes by pipeline (M3 on co-issue across pipelines)
INT_CLASSES = ("int32", "int64", "idiv32", "idiv64", "conversion", "transcendental")


def issue_cycles(p: Profile, chip: C.Chip) -> dict:
    """Scheduler cycles of one launch on `chip`: {"fp32", "fp16", "int", "mma", "other" (memory, SIMD
    collectives, barriers), "work" (all of them, one a cycle), "total" (the time they take: "work" on
    M1/M2, with co-issue on M3 on)}."""
    mma16 = p.mma16 * C.MMA_CYCLES
    c = {"mma": p.mma * C.MMA_CYCLES,
         "fp32": p.issue["fp32"][1] + (p.mma - p.mma16) * C.MMA_CYCLES,
         "fp16": p.issue["fp16"][1] / chip.fp16_rate + mma16,
         "int": sum(p.issue[k][1] for k in INT_CLASSES),
         "other": MEMORY_INSTRUCTION_CYCLES * sum(x.instructions for x in p.memory.values())
         + sum(COLLECTIVE_CYCLES[k] * v for k, v in p.collectives.items()) + BARRIER_CYCLES * p.barriers}
    alu = c["fp32"] + c["fp16"] + c["int"]
    c["work"] = alu + c["other"]
    c["total"] = c["other"] + (max(alu / 2, c["fp32"], c["fp16"], c["int"]) if chip.dual_issue else alu)
    return c


def occupancy(p: Profile, chip: C.Chip) -> float:
    """Threadgroups resident per core: threads (3072 a core) and threadgroup memory limit it."""
    by_threads = C.MAX_THREADS_PER_CORE // max(1, p.threads_per_group)
    by_tg = (chip.tg_kb_per_core * 1024) // p.threadgroup_bytes if p.threadgroup_bytes else by_threads
    return float(max(1, min(by_threads, by_tg)))


def resident_simdgroups(p: Profile, chip: C.Chip) -> float:
    """Simdgroups a busy core holds at once: its groups (by occupancy, at most its share of the grid) x
    simdgroups per group."""
    per_core = math.ceil(p.groups / chip.gpu_cores)
    return min(C.MAX_SIMDGROUPS_PER_CORE, min(occupancy(p, chip), per_core) * p.simdgroups_per_group)


@dataclasses.dataclass
class Prediction:
    chip: str
    time_us: float                  # predicted time of the launches, launch overheads included
    limits_us: dict                 # LIMITS -> µs (summed over the launches)
    bound: str                      # the binding limit (of the launch that takes longest)
    ideal_us: float
    roofline: float                 # ideal / max(limits), 0..1
    groups_per_core: float          # occupancy of the longest launch: resident threadgroups per core
    simdgroups_per_core: float      # of the longest launch: simdgroups a busy core holds at once
    inefficiencies: list            # [(share of the time, plain words)], at most 3: first those of the binding
                                    # limit (by the modelled saving), then the others

    @property
    def top(self) -> str:
        return self.inefficiencies[0][1] if self.inefficiencies else "none above 2% of the time"


def compute_peak_tflops(flops16: float, flops: float, chip: C.Chip) -> float:
    """The ALU peak FLOPs are measured against: the FP16 one for mostly 16-bit work, else the FP32 one."""
    return chip.fp16_tflops if flops and flops16 > 0.5 * flops else chip.fp32_tflops


def _executed_flops(p: Profile) -> tuple[float, float]:
    """(all, 16-bit) FLOPs the launch executes: the lanes' arithmetic and the simdgroup matrices."""
    return p.flops + p.mma_flops, p.flops16 + 2.0 * MACS_PER_MMA * p.mma16


def _launch(p: Profile, chip: C.Chip, locate: Callable[[int], str] | None, useful_flops: float | None):
    hz = chip.clock_ghz * 1e9
    groups = p.groups
    busy = groups / (chip.gpu_cores * math.ceil(groups / chip.gpu_cores))   # the busiest core's share
    cores = chip.gpu_cores * busy
    active_cores = min(chip.gpu_cores, groups)
    resident = resident_simdgroups(p, chip)
    eff = C.issue_efficiency(resident)
    m = p.memory
    dev = [m["device_load"], m["device_store"]]
    cyc = issue_cycles(p, chip)
    issue_rate = C.SCHEDULERS_PER_CORE * cores * eff * hz            # scheduler cycles per second
    dram_bytes = p.unique_sector_bytes
    limits = {
        "dram": max(dram_bytes / (chip.memory_gbs * 1e9), dram_bytes / (active_cores * C.L2_BYTES_PER_CYCLE * hz)),
        "l1": sum(x.lines for x in dev) * (C.LINE_BYTES / C.L1_BYTES_PER_CYCLE) / (cores * hz),
        "issue": cyc["total"] / issue_rate,
        "threadgroup": (m["threadgroup_load"].bank_cycles + m["threadgroup_store"].bank_cycles)
        / (C.TG_BANK_CYCLES_PER_CYCLE * cores * hz),
        "mma": cyc["mma"] / issue_rate,
    }
    t = max(limits.values())
    bound = max(LIMITS[:4], key=limits.get)
    if bound == "issue" and cyc["mma"] >= 0.5 * cyc["work"]:
        bound = "mma"
    flops, flops16 = _executed_flops(p)
    if useful_flops is not None:
        flops16, flops = (useful_flops if flops16 > 0.5 * flops else 0.0), useful_flops
    ideal = max(p.unique_bytes / (chip.memory_gbs * 1e9),
                flops / (compute_peak_tflops(flops16, flops, chip) * 1e12))
    overhead = C.LAUNCH_OVERHEAD_US * 1e-6
    items = []                      # (limit the waste is part of, wasted fraction of that limit, plain words)

    def at(kind_filter, key):
        """' (worst: file:line)': the access site of this kind that contributes most to `key`."""
        sites = [s for s in p.sites if kind_filter(s) and s.line] if locate is not None else []
        return f" (worst: {locate(max(sites, key=key).line)})" if sites else ""

    work = cyc["work"] or 1.0       # shares of the scheduler's work (before co-issue)
    for cls, words in (("int64", "64-bit integer ops"), ("idiv64", "64-bit integer divide/modulo"),
                       ("idiv32", "32-bit integer divide/modulo"),
                       ("conversion", "int<->float conversions and rounding"),
                       ("transcendental", "transcendentals/divides"), ("int32", "32-bit integer ops")):
        frac = p.issue[cls][1] / work
        if frac >= 0.05:
            items.append(("issue", frac, f"{words}: {100 * frac:.0f}% of issue cycles"))
    coll = sum(COLLECTIVE_CYCLES[k] * v for k, v in p.collectives.items()) / work
    if coll >= 0.05:
        items.append(("issue", coll, f"SIMD collectives: {100 * coll:.0f}% of issue cycles"))
    if eff < 0.9:
        items.append(("issue", 1 - eff, f"{resident:.3g} simdgroups resident per core: the schedulers issue "
                                        f"{100 * eff:.0f}% of the time (latency not hidden; 24 keep them busy)"))
    dev_sectors = sum(x.sectors for x in dev) or 1.0
    for kind, what in (("device_load", "device loads"), ("device_store", "device stores")):
        x = m[kind]
        if x.instructions and x.mean_width < 16:
            waste = (1 - x.mean_width / 16) * MEMORY_INSTRUCTION_CYCLES * x.instructions / work
            if waste >= 0.01:
                items.append(("issue", waste, f"{what} use {x.mean_width:.3g} B a lane: {x.mean_width / 16:.2g} of a "
                              f"16 B vector" + at(lambda s, k=kind: s.kind == k, lambda s: s.instructions * (16 - s.width))))
        if x.sectors and x.sector_efficiency < 0.9:
            waste = (1 - x.sector_efficiency) * x.sectors / dev_sectors
            items.append(("l1", waste, f"{what} use {100 * x.sector_efficiency:.0f}% of each 32-byte sector they touch"
                          + at(lambda s, k=kind: s.kind == k, lambda s: s.sectors * 32 - s.distinct_bytes)))
    if dram_bytes and p.unique_bytes < 0.9 * dram_bytes:
        items.append(("dram", 1 - p.unique_bytes / dram_bytes,
                      f"DRAM traffic is {dram_bytes / p.unique_bytes:.1f}x the bytes used: whole 32-byte sectors are "
                      f"fetched for {100 * p.unique_bytes / dram_bytes:.0f}% of their bytes"
                      + at(lambda s: s.kind.startswith("device"), lambda s: s.sectors * 32 - s.distinct_bytes)))
    traffic = 32.0 * sum(x.sectors for x in dev)
    if p.unique_bytes and traffic > 1.5 * p.unique_bytes:
        red = traffic / p.unique_bytes
        items.append(("l1", 1 - 1 / red, f"device loads and stores move {red:.1f}x the unique bytes through the caches "
                      f"(the same data re-read)" + at(lambda s: s.kind == "device_load",
                                                        lambda s: s.bytes - s.distinct_bytes)))
    for kind, what in (("threadgroup_load", "threadgroup loads"), ("threadgroup_store", "threadgroup stores")):
        x = m[kind]
        if x.instructions and x.bank_conflict > 1.05:
            tg_total = (m["threadgroup_load"].bank_cycles + m["threadgroup_store"].bank_cycles) or 1.0
            items.append(("threadgroup", (x.bank_cycles - x.bank_ideal) / tg_total,
                          f"{what} {x.bank_conflict:.1f}-way bank conflicted"
                          + at(lambda s, k=kind: s.kind == k, lambda s: s.bank_cycles - s.bank_ideal)))
    act = p.active_fraction
    if act < 0.95:
        items.append(("issue", 1 - act, f"{100 * (1 - act):.0f}% of lane slots idle (divergent branches or partial "
                                        f"simdgroups)"))
    found = []
    second = sorted(limits[k] for k in LIMITS[:4])[-2]
    binding = "issue" if bound == "mma" else bound
    for limit, waste, text in items:
        if limit == binding:        # modelled saving: the binding limit shrinks, down to the next one at most
            score = (t - max(second, limits[limit] * (1 - waste))) / t if t else 0.0
            found.append((1.0 + score, score, text))
        elif t and limits[limit] >= 0.5 * t:   # a limit close to binding: listed after, by its share of the time
            found.append((waste * limits[limit] / t, waste * limits[limit] / t, text))
    idle = 1 - min(busy, groups / chip.gpu_cores)
    cores_bind = binding != "dram" or active_cores * C.L2_BYTES_PER_CYCLE * hz < chip.memory_gbs * 1e9
    if idle > 0.1 and cores_bind:           # the time depends on how many cores work
        found.append((1.0 + idle, idle, f"{groups} threadgroups for {chip.gpu_cores} cores: {100 * idle:.0f}% of the "
                                        f"GPU idle"))
    if overhead > t:
        f = overhead / (t + overhead)
        found.append((1.0 + f, f, f"launch overhead is {100 * f:.0f}% of the time: too little work per dispatch"))
    return limits, bound, t, ideal, overhead, found, resident


def predict(profiles: Profile | Sequence[Profile], chip: C.Chip | str,
            locate: Callable[[int], str] | None = None, flops: float | None = None) -> Prediction:
    """Predict the launches (run one after another) on `chip`. `locate(line)` names a source line. `flops`:
    the useful FLOPs of the whole computation (e.g. 4 x heads x Lq x Lk x D for attention), when the case
    knows them: the ideal then ignores work the kernel wastes (split over the launches by their FLOPs)."""
    if isinstance(chip, str):
        chip = C.chip(chip)
    profiles = [profiles] if isinstance(profiles, Profile) else list(profiles)
    if not profiles:
        raise ValueError("predict: no launches")
    total = {k: 0.0 for k in LIMITS}
    time_s = ideal_s = busy_s = 0.0
    longest = (-1.0, "", 0.0, 0.0)
    found: list[tuple[float, str]] = []
    names = {p.kernel for p in profiles}
    executed = [_executed_flops(p)[0] for p in profiles]
    for i, p in enumerate(profiles):
        share = None
        if flops is not None:
            share = flops * (executed[i] / sum(executed) if sum(executed) else float(i == 0))
        limits, bound, t, ideal, overhead, f, resident = _launch(p, chip, locate, share)
        for k in LIMITS:
            total[k] += limits[k]
        time_s += t + overhead
        ideal_s += ideal
        busy_s += t
        if t > longest[0]:
            longest = (t, f"{bound} ({p.kernel})" if len(names) > 1 else bound, occupancy(p, chip), resident)
        w = (t + overhead)
        found += [(rank, score * w, (f"{p.kernel}: " if len(names) > 1 else "") + text) for rank, score, text in f]
    found = sorted(((rank, s / time_s, txt) for rank, s, txt in found), key=lambda x: -x[0])
    found = [(s, txt) for _, s, txt in found if s >= 0.02][:3]
    return Prediction(chip=chip.name, time_us=time_s * 1e6, limits_us={k: v * 1e6 for k, v in total.items()},
                      bound=longest[1], ideal_us=ideal_s * 1e6, roofline=min(1.0, ideal_s / busy_s) if busy_s else 1.0,
                      groups_per_core=longest[2], simdgroups_per_core=longest[3], inefficiencies=found)
