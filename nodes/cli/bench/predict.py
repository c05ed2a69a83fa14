"""`python -m comfy_metal bench --predict [CHIP]`: every registered kernel at real model shapes, profiled in
the MSL emulator and put through the roofline model (metal_kernels/perf). MODEL PREDICTIONS, not
measurements; on a Mac the measured time of the same call prints beside them, so the model can be checked
and corrected from real data.
"""
from __future__ import annotations

import logging
import time

import torch

from ...common.report import Table, median_seconds

log = logging.getLogger("comfy_metal")

HEADER = ("Predicted kernel times: MODEL PREDICTIONS from the emulator's performance model, not measurements")


def _measure_target():
    """(compiled Metal library, MPS device) to time the cases on, or None without MPS."""
    from ....metal_kernels import dispatch
    from ....metal_kernels.probe import mps_available

    if not mps_available():
        return None
    try:
        return dispatch.compile_library("metal"), torch.device("mps")
    except Exception as e:  # no measured column then, and one line saying why
        log.warning("bench --predict: no measured column: %s", e)
        return None


def _measure(case, lib, device, reps: int) -> float | str:
    """Median µs of the case's launch code on `device`, or why not."""
    try:
        return median_seconds(lambda: case.run(lib, device), device, repeat=reps) * 1e6
    except Exception as e:  # a measured cell never stops the table
        return f"error: {type(e).__name__}: {str(e)[:60]}"


def _hot_lines(profiles, locate, n: int = 3) -> str:
    """The source lines with the most issue cycles, with their share."""
    lines: dict[int, float] = {}
    for p in profiles:
        for line, cycles in p.lines.items():
            if line:
                lines[line] = lines.get(line, 0.0) + cycles
    total = sum(lines.values()) or 1.0
    top = sorted(lines.items(), key=lambda kv: -kv[1])[:n]
    return ", ".join(f"{locate(line)} {100 * c / total:.0f}%" for line, c in top)


def predict_tables(chip_name: str | None = None, quick: bool = False, only=None) -> list[Table]:
    from ....metal_kernels import dispatch, perf
    from ....metal_kernels.emulator import profiler
    from ....metal_kernels.perf import chips as C

    ref = C.chip(chip_name) if chip_name else C.chip(C.REFERENCE_CHIP)
    columns = list(C.DEFAULT_COLUMNS) + ([ref.name] if ref.name not in C.DEFAULT_COLUMNS else [])
    target = _measure_target()
    on_mps = target is not None
    src = dispatch.library_source()
    t0 = time.perf_counter()
    lib = profiler.compile_profile_library(src)
    locate = perf.source_locator(src)
    main = Table(HEADER, ["kernel", "case", *[f"{c} µs" for c in columns], f"% roofline ({ref.name})", "bound",
                          "top inefficiency"] + (["measured µs (MPS)"] if on_mps else []))
    detail = Table(f"Predicted limits on {ref.name} (µs; model predictions)",
                   ["kernel", "case", "dram", "l1", "issue", "threadgroup", "mma", "ideal", "groups/core",
                    "simdgroups/core", "hottest lines (issue cycles)", "inefficiencies"])
    for spec, cases in perf.all_cases(quick):
        if only and not any(o in spec.name for o in only):
            continue
        if not cases:
            if not quick:
                main.add(spec.name, "no predict case (add one: metal_kernels/perf/cases.py)", *[""] * (len(columns) + 3),
                         *([""] if on_mps else []))
            continue
        for case in cases:
            t_case = time.perf_counter()
            try:
                profiles = perf.profile_case(case, lib)
            except Exception as e:  # one broken case is one row, not a crashed bench
                log.warning("bench --predict: %s / %s failed: %s: %s", spec.name, case.label, type(e).__name__, e)
                main.add(spec.name, case.label, *[""] * len(columns), "", "error", f"{type(e).__name__}: {str(e)[:80]}",
                         *([""] if on_mps else []))
                continue
            log.info("bench --predict: %s / %s profiled in %.1f s", spec.name, case.label, time.perf_counter() - t_case)
            preds = {c: perf.predict(profiles, c, locate, flops=case.flops) for c in columns}
            r = preds[ref.name]
            pct = 100 * r.roofline
            row = [spec.name, case.label, *[preds[c].time_us for c in columns], f"{pct:.0f}%" if pct >= 10 else
                   f"{pct:.1f}%", r.bound,
                   r.top]
            if on_mps:
                row.append(_measure(case, *target, 3 if quick else 10))
            main.add(*row)
            lim = r.limits_us
            detail.add(spec.name, case.label, lim["dram"], lim["l1"], lim["issue"], lim["threadgroup"], lim["mma"],
                       r.ideal_us, r.groups_per_core, r.simdgroups_per_core, _hot_lines(profiles, locate),
                       "; ".join(t for _, t in r.inefficiencies) or "none above 2% of the time")
    main.note = (f"predicted = max(DRAM, L1 lines, issue slots (simdgroup_matrix included; at the issue rate the "
                 f"resident simdgroups reach), threadgroup banks) + "
                 f"{C.LAUNCH_OVERHEAD_US:g} µs launch overhead (assumed), per chip from metal_kernels/perf/chips.py "
                 f"(M3-M5 clocks unpublished: assumed); % roofline = ideal time (unique bytes, FLOPs) / predicted "
                 f"time without the overhead. Assumptions and limits: metal_kernels/emulator/README.md, "
                 f"\"Performance model\". Profiled in the emulator in {time.perf_counter() - t0:.0f} s "
                 f"(`python -m comfy_metal bench --predict{' --quick' if quick else ''}`)."
                 + ("" if on_mps else " No MPS here: no measured column."))
    return [main, detail]
