"""`python -m comfy_metal bench --predict --quick`: the predicted-time table, labelled as model predictions,
with a row per kernel that has a quick case, predicted on the four Max chips (the CI run of the command)."""
from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from comfy_metal.metal_kernels import emulator as emu

pytestmark = pytest.mark.skipif(not emu.available(), reason="clang-19 not installed: the MSL emulator needs it")


def test_bench_predict_quick_prints_predictions_for_every_quick_case(tmp_path, capsys):
    from comfy_metal.metal_kernels.perf import all_cases
    from comfy_metal.nodes.cli.main import main

    out_json = tmp_path / "predict.json"
    assert main(["bench", "--predict", "--quick", "--json", str(out_json)]) == 0
    text = capsys.readouterr().out
    assert "MODEL PREDICTIONS" in text and "not measurements" in text
    main_table, detail = json.loads(out_json.read_text())["tables"]
    assert main_table["columns"][2:6] == ["M2 Max µs", "M3 Max µs", "M4 Max µs", "M5 Max µs"]
    want = [(spec.name, c.label) for spec, cases in all_cases(quick=True) for c in cases]
    assert [(r[0], r[1]) for r in main_table["rows"]] == want
    for row in main_table["rows"]:
        assert row[7] in ("dram", "l1", "issue", "threadgroup", "mma"), row      # no failed case
        assert all(isinstance(v, float) and v > 0 for v in row[2:6]), row
        assert 0 <= float(row[6].rstrip("%")) <= 100, row
    assert [r[:2] for r in detail["rows"]] == [list(w) for w in want]


def test_bench_predict_takes_a_chip(capsys):
    from comfy_metal.nodes.cli.main import main

    assert main(["bench", "--predict", "M1", "--quick", "--only", "sampler_euler"]) == 0
    text = capsys.readouterr().out
    assert "M1 µs" in text and "% roofline (M1)" in text and "sampler_euler_step" in text
    assert "Kernels: Metal vs reference" not in text          # --predict replaces the timed sections


def test_measured_times_print_beside_the_predictions(monkeypatch, capsys):
    """On a Mac the same call is timed on MPS; here the emulator stands in for the Metal library."""
    from comfy_metal.metal_kernels import dispatch
    from comfy_metal.metal_kernels.emulator import compile_library
    from comfy_metal.nodes.cli.bench import predict

    lib = compile_library(dispatch.library_source())
    monkeypatch.setattr(predict, "_measure_target", lambda: (lib, torch.device("cpu")))
    main_table, _ = predict.predict_tables(quick=True, only=["sampler_euler_step"])
    assert main_table.columns[-1] == "measured µs (MPS)"
    (row,) = main_table.rows
    assert isinstance(row[-1], float) and row[-1] > 0
    assert "No MPS here" not in main_table.note


def test_a_case_that_knows_its_useful_flops_sets_the_ideal_by_them(monkeypatch):
    """`PredictCase.flops` (attention's 4 H L^2 D) reaches the predictor: the ideal is those FLOPs at the ALU peak."""
    from comfy_metal.metal_kernels import perf
    from comfy_metal.nodes.cli.bench import predict

    ((spec, cases),) = [(s, c) for s, c in perf.all_cases(quick=True) if s.name == "sampler_euler_step"]
    useful = 1e12
    monkeypatch.setattr(perf, "all_cases", lambda quick: [(spec, [dataclasses.replace(cases[0], flops=useful)])])
    _, detail = predict.predict_tables(quick=True, only=["sampler_euler_step"])
    (row,) = detail.rows
    assert row[detail.columns.index("ideal")] == pytest.approx(useful / (perf.chip("M4 Max").fp32_tflops * 1e12) * 1e6)
