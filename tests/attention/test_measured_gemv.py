"""The measured choice applied to FP8 Linear layers with <= 8 rows: on MPS (faked here: CPU tensors, a
fake timing source) the GEMV kernel is used only where it was timed faster than decode + matmul, per
shape; a slow GEMV is never chosen, and off MPS nothing is measured (the GEMV path as before)."""
from __future__ import annotations

import pytest
import torch

import fp8_models as fm
from comfy_metal.metal_kernels import dispatch
from comfy_metal.nodes.fp8 import ops as fp8_ops
from fake_clock import FakeClock


def _linear(n=24, k=40, seed=0):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=g) * 0.1
    q, scale = fm.quantize_ref(w, "e4m3fn", True)
    lin = fp8_ops.make_fp8_ops(standalone=True).Linear(k, n, bias=False)
    lin.load_state_dict({"weight": q, "weight_scale": scale}, strict=False)
    return lin, fm.dequant_ref(q, scale)


@pytest.fixture
def fake_mps(monkeypatch):
    dispatch.reset()
    clock = FakeClock()
    monkeypatch.setattr(dispatch, "measuring_enabled", lambda device: True)
    monkeypatch.setattr(dispatch, "_clock", clock)
    yield clock
    dispatch.reset()


@pytest.mark.parametrize("gemv_cost, expect", [(5.0, "decode+matmul"), (0.1, "gemv")])
def test_gemv_used_only_where_measured_faster(fake_mps, monkeypatch, gemv_cost, expect):
    clock = fake_mps
    decode, gemv = fp8_ops._kernels()
    calls = {"gemv": 0}

    def timed_gemv(*a, **k):
        calls["gemv"] += 1
        clock.t += gemv_cost
        return gemv(*a, **k)

    real_linear = torch.nn.functional.linear

    def timed_linear(*a, **k):
        clock.t += 1.0
        return real_linear(*a, **k)

    monkeypatch.setattr(fp8_ops, "_kernels", lambda: (decode, timed_gemv))
    monkeypatch.setattr(torch.nn.functional, "linear", timed_linear)
    lin, wd = _linear()
    x = torch.randn(3, 40)
    y = lin(x)
    torch.testing.assert_close(y, real_linear(x, wd), rtol=1e-5, atol=1e-6)
    (record,) = dispatch.measured_records()
    assert record["kernel"] == "gemv" and record["choice"] == expect
    assert record["shape_class"] == [3, 24, 40, "e4m3fn", "float32"]
    n = calls["gemv"]
    lin(x)
    assert calls["gemv"] == n + (1 if expect == "gemv" else 0)     # the slow GEMV never runs again


def test_no_measuring_off_mps():
    dispatch.reset()
    lin, wd = _linear()
    dispatch.last_backend.pop("gemv", None)
    lin(torch.randn(2, 40))
    assert "gemv" in dispatch.last_backend and dispatch.measured_records() == []
