"""Measured choices reach the status route payload, the status report (MetalStatus node) and doctor."""
from __future__ import annotations

import json

import pytest

from comfy_metal.metal_kernels import dispatch
from comfy_metal.nodes import status
from fake_clock import FakeClock


def test_measured_choice_in_status_payload_and_report(monkeypatch):
    dispatch.reset()
    clock = FakeClock()

    def cost(s):
        def run():
            clock.t += s
        return run

    try:
        dispatch.measured_choice("flash_attention", ("bfloat16", 128, 4096, 4096, False, False),
                                 {"sub_quad": cost(0.019), "metal_flash": cost(0.010)}, "mps",
                                 sync=lambda d: None, clock=clock)
        payload = status.status_payload()
        json.dumps(payload, default=str)
        (record,) = payload["measured"]
        assert record["choice"] == "metal_flash" and record["kernel"] == "flash_attention"
        assert record["times_ms"]["sub_quad"] == pytest.approx(19.0) and record["shape_class"][1] == 128
        text = status.status_report(payload)
        assert "Measured choices" in text and "metal_flash" in text and "sub_quad 19" in text
    finally:
        dispatch.reset()
    assert status.status_payload()["measured"] == []


def test_measured_choice_times_slow_calls_once():
    """A call over MEASURE_SLOW_SECONDS (a long video's attention) is timed alone after its warm-up, not
    in batches; a fast one in two rounds of batches."""
    dispatch.reset()
    clock = FakeClock()
    calls = {"fast": 0, "slow": 0}

    def run(name, s):
        def fn():
            calls[name] += 1
            clock.t += s
        return fn

    try:
        pick = dispatch.measured_choice("k", ("x",), {"slow": run("slow", 2.0), "fast": run("fast", 0.01)}, "mps",
                                        sync=lambda d: None, clock=clock)
        assert pick == "fast"
        assert calls == {"slow": 2, "fast": 2 + 2 * dispatch.MEASURE_CALLS}
    finally:
        dispatch.reset()
