"""Command line: `python -m comfy_metal doctor | bench | run`."""
from __future__ import annotations

import argparse
import importlib
import json
import logging
import sys
import time

from ..common.report import Table

# Modules (in nodes/cli/bench/) that contribute bench tables: each has `bench(quick: bool) -> list[Table]`.
BENCH_MODULES = (".bench.kernels", ".bench.fp8", ".bench.quant", ".bench.gguf", ".bench.samplers", ".bench.vae",
                 ".bench.moe", ".bench.attention")
# Modules that contribute doctor stages: each has `doctor_stages() -> list[(name, callable)]`.
DOCTOR_MODULES = (".doctor", "..attention.doctor")


def _modules(names):
    for name in names:
        yield importlib.import_module(name, __package__)


def doctor(args) -> int:
    from ... import metal_kernels

    status = metal_kernels.status()
    report = {"status": status, "stages": []}
    failed = False
    for module in _modules(DOCTOR_MODULES):
        for name, stage in module.doctor_stages(args):
            t0 = time.perf_counter()
            try:
                detail = stage()
                ok = True
            except Exception as e:  # the report names the stage and the error; doctor never tracebacks
                detail, ok = f"{type(e).__name__}: {e}", False
            failed |= not ok
            report["stages"].append({"stage": name, "ok": ok, "seconds": round(time.perf_counter() - t0, 3),
                                     "detail": detail})
    for name, k in status["kernels"].items():
        if k["backend"] == "reference" and k["device"] == "mps":
            failed = True
    report["measured"] = metal_kernels.dispatch.measured_records()
    from ..status import dispatch_state, force_reference_enabled, loaded_models, memory_info, plain_summary, short_report

    state = {**dispatch_state(run_pending=True), "force_reference": force_reference_enabled(), "memory": memory_info(),
             "loaded_models": loaded_models()}
    report["summary"] = plain_summary(state)       # the Metal tab's words (verdict, saved, what to do)
    if args.json:
        json.dump(report, sys.stdout, indent=2, default=str)
        print()
        return 1 if failed else 0
    print(short_report(report["summary"], state["memory"], more="The tables below have the details.") + "\n")
    caps = Table("Capabilities", ["probe", "value"])
    for key, value in status["capabilities"].items():
        caps.add(key, value)
    print(caps.render() + "\n")
    kt = Table(f"Kernels (COMFY_METAL_BACKEND={status['backend_setting']})", ["kernel", "device", "backend", "reason"])
    for name, k in status["kernels"].items():
        kt.add(name, k["device"], k["backend"], k["reason"])
    print(kt.render() + "\n")
    if report["measured"]:
        from ..status import measured_table

        print(measured_table(report["measured"]).render() + "\n")
    if report["stages"]:
        st = Table("End-to-end pipeline on synthetic weights", ["stage", "ok", "seconds", "detail"])
        for s in report["stages"]:
            st.add(s["stage"], "yes" if s["ok"] else "NO", s["seconds"], s["detail"])
        print(st.render())
    return 1 if failed else 0


def bench(args) -> int:
    tables: list[Table] = []
    if args.predict is not None:    # the performance model's table instead of the timed sections
        from .bench import predict

        for table in predict.predict_tables(args.predict or None, quick=args.quick, only=args.only):
            print(table.render() + "\n", flush=True)
            tables.append(table)
    for module in _modules(BENCH_MODULES if args.predict is None else ()):
        name = "bench_" + module.__name__.rpartition(".")[2]    # --only matches e.g. "vae" or "bench_vae"
        wanted = [o for o in args.only or () if o.partition(":")[0] in name]
        if args.only and not wanted:
            continue
        parts = [o.partition(":")[2] for o in wanted if o.partition(":")[2]]    # "vae:encode": one part of it
        for table in (module.bench(quick=args.quick, parts=parts) if parts else module.bench(quick=args.quick)):
            print(table.render() + "\n", flush=True)
            tables.append(table)
    if args.json:
        import platform

        import torch

        with open(args.json, "w") as f:
            json.dump({"machine": platform.platform(), "torch": torch.__version__,
                       "tables": [t.to_json() for t in tables]}, f, indent=2, default=str)
        print(f"saved {len(tables)} tables to {args.json}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m comfy_metal")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("doctor", help="capability report, kernel self-checks and a tiny end-to-end pipeline")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--out", metavar="DIR", default=None,
                   help="folder for the pipeline's PNG (default: a new temporary folder; the report prints the path)")
    p.set_defaults(fn=doctor)
    p = sub.add_parser("bench", help="print benchmark tables")
    p.add_argument("--quick", action="store_true", help="small sizes only")
    p.add_argument("--only", nargs="*", help="only bench modules whose name contains one of these; MODULE:PART "
                                             "for one part of a module that has parts (vae:encode); with "
                                             "--predict: only kernels whose name contains one of these")
    p.add_argument("--json", metavar="FILE", help="also save the tables as JSON")
    p.add_argument("--predict", nargs="?", const="", default=None, metavar="CHIP",
                   help="predicted times of every kernel at real model shapes from the emulator's performance model "
                        "(model predictions, not measurements; measured times beside them on a Mac); CHIP (e.g. "
                        "'M4 Max') picks the chip of the roofline / bound / inefficiency columns")
    p.set_defaults(fn=bench)
    for module in _modules((".run_workflow",)):
        module.add_parser(sub)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.command != "doctor" or not args.json else logging.WARNING,
                        format="%(message)s", stream=sys.stderr)
    return args.fn(args)
