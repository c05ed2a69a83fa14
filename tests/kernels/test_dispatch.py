"""The dispatch layer: backend choice, forced reference, self-check and its log line."""
import dataclasses
import logging

import pytest
import torch

from comfy_metal import metal_kernels
from comfy_metal.metal_kernels import dispatch, registry
from fake_clock import FakeClock


@pytest.fixture(autouse=True)
def fresh_dispatch(monkeypatch):
    monkeypatch.delenv("COMFY_METAL_BACKEND", raising=False)
    monkeypatch.delenv("COMFY_METAL_REFERENCE", raising=False)
    dispatch.reset()
    yield
    dispatch.reset()


def test_cpu_takes_the_reference_and_says_why():
    x = torch.randn(3, 7)
    y = metal_kernels.softmax(x)
    assert torch.allclose(y, torch.softmax(x, -1), atol=1e-6)
    backend, reason = dispatch.choose(registry.REGISTRY["softmax"], torch.device("cpu"))
    assert backend == "reference" and "only on MPS" in reason


def test_forced_reference_is_reported(monkeypatch, caplog):
    monkeypatch.setenv("COMFY_METAL_BACKEND", "emulator")
    monkeypatch.setenv("COMFY_METAL_REFERENCE", "softmax")
    with caplog.at_level(logging.INFO, logger="comfy_metal"):
        metal_kernels.softmax(torch.randn(2, 5))
        metal_kernels.softmax(torch.randn(2, 5))
    assert dispatch.last_backend["softmax"] == "reference"
    lines = [r.getMessage() for r in caplog.records if "softmax" in r.getMessage()]
    assert len(lines) == 1 and "forced" in lines[0]


def _broken_spec(name, metal):
    return registry.KernelSpec(
        name=name, source="softmax.metal", entry_points={"softmax_rows_float": ("tensor", "tensor", "int", "float")},
        reference=lambda x: x * 2, metal=metal, self_check_cases=lambda d: [((torch.ones(3, device=d),), {})])


def test_failed_self_check_falls_back_with_one_warning(monkeypatch, caplog):
    """A kernel whose Metal result disagrees with its reference is never used."""
    monkeypatch.setattr(dispatch, "_library_for", lambda spec, backend: object())
    spec = _broken_spec("broken_double", lambda lib, x: x * 3)
    monkeypatch.setitem(registry.REGISTRY, spec.name, spec)
    with caplog.at_level(logging.WARNING, logger="comfy_metal"):
        monkeypatch.setenv("COMFY_METAL_BACKEND", "emulator")
        out = dispatch.call(spec, (torch.ones(4),), {})
        dispatch.call(spec, (torch.ones(4),), {})
    assert torch.equal(out, torch.full((4,), 2.0))
    warnings = [r.getMessage() for r in caplog.records if "broken_double" in r.getMessage()]
    assert len(warnings) == 1 and "self-check case 0 failed" in warnings[0]


def test_compile_failure_falls_back(monkeypatch):
    monkeypatch.setenv("COMFY_METAL_BACKEND", "emulator")

    def no_library(backend, only=None):
        raise dispatch.MetalUnavailable("the Metal library failed to compile: line 3: expected ';'")

    monkeypatch.setattr(dispatch, "compile_library", no_library)
    x = torch.randn(2, 9)
    assert torch.allclose(metal_kernels.softmax(x), torch.softmax(x, -1), atol=1e-6)
    backend, reason = dispatch.choose(registry.REGISTRY["softmax"], torch.device("cpu"))
    assert backend == "reference" and "failed to compile" in reason


def test_raising_launch_is_a_failed_self_check(monkeypatch):
    monkeypatch.setenv("COMFY_METAL_BACKEND", "emulator")
    monkeypatch.setattr(dispatch, "_library_for", lambda spec, backend: object())

    def explode(lib, x):
        raise RuntimeError("threads must be positive")

    spec = _broken_spec("exploding", explode)
    monkeypatch.setitem(registry.REGISTRY, spec.name, spec)
    backend, reason = dispatch.choose(spec, torch.device("cpu"))
    assert backend == "reference" and "RuntimeError" in reason


def test_status_lists_every_kernel_with_backend_and_reason():
    st = metal_kernels.status("cpu")
    assert set(st["kernels"]) == set(registry.REGISTRY)
    for k in st["kernels"].values():
        assert k["backend"] in ("metal", "emulator", "reference") and k["reason"]
    caps = st["capabilities"]
    for key in ("torch", "mps_available", "native_fp8_e4m3fn_on_mps", "F.scaled_mm", "torch.mps.compile_shader"):
        assert key in caps


def test_library_source_puts_common_first_and_includes_every_file():
    names = [p.name for p in dispatch.metal_sources()]
    assert "softmax.metal" in names
    if "common.metal" in names:
        assert names[0] == "common.metal"
    src = dispatch.library_source()
    for n in names:
        assert f"---- {n} ----" in src


def test_metal_launch_that_raises_later_falls_back_once(monkeypatch, caplog):
    """On MPS a kernel whose launch raises after a passed self-check turns itself off (one warning) and
    the call gets the reference; bad input still raises."""
    monkeypatch.setattr(dispatch, "measuring_enabled", lambda device: False)   # the launch path itself
    monkeypatch.setattr(dispatch, "_library_for", lambda spec, backend: object())
    monkeypatch.setattr(dispatch, "self_check", lambda spec, backend, device: None)
    monkeypatch.setattr(dispatch, "_first_device", lambda args, kwargs: torch.device("mps"))
    calls = []

    def launch(lib, x):
        calls.append(x)
        if x.numel() == 0:
            raise ValueError("x: empty")
        raise RuntimeError("Metal: no function named softmax_rows_double")

    spec = _broken_spec("late_failure", launch)
    monkeypatch.setitem(registry.REGISTRY, spec.name, spec)
    with pytest.raises(ValueError, match="empty"):
        dispatch.call(spec, (torch.ones(0),), {})
    assert dispatch.choose(spec, torch.device("mps"))[0] == "metal"
    with caplog.at_level(logging.WARNING, logger="comfy_metal"):
        out = dispatch.call(spec, (torch.ones(4),), {})
        again = dispatch.call(spec, (torch.ones(4),), {})
    assert torch.equal(out, torch.full((4,), 2.0)) and torch.equal(again, out)
    assert len(calls) == 2                                  # the second call went straight to the reference
    assert dispatch.last_backend["late_failure"] == "reference"
    backend, reason = dispatch.choose(spec, torch.device("mps"))
    assert backend == "reference" and "RuntimeError" in reason
    warnings = [r.getMessage() for r in caplog.records if "late_failure" in r.getMessage()]
    assert len(warnings) == 1


def test_out_of_memory_in_a_metal_launch_propagates(monkeypatch):
    monkeypatch.setattr(dispatch, "measuring_enabled", lambda device: False)   # the launch path itself
    monkeypatch.setattr(dispatch, "_library_for", lambda spec, backend: object())
    monkeypatch.setattr(dispatch, "self_check", lambda spec, backend, device: None)
    monkeypatch.setattr(dispatch, "_first_device", lambda args, kwargs: torch.device("mps"))

    def launch(lib, x):
        raise RuntimeError("MPS backend out of memory (MPS allocated: 20 GB)")

    spec = _broken_spec("oom_kernel", launch)
    monkeypatch.setitem(registry.REGISTRY, spec.name, spec)
    with pytest.raises(RuntimeError, match="out of memory"):
        dispatch.call(spec, (torch.ones(4),), {})
    assert dispatch.choose(spec, torch.device("mps"))[0] == "metal"


def test_status_without_running_pending_mps_self_checks(monkeypatch):
    """The status route's worker thread must not start MPS work next to a running prompt: undecided MPS
    kernels are reported as pending, decided ones with their decision."""
    def no_self_check(spec, backend, device):
        raise AssertionError("a self-check ran")

    monkeypatch.setattr(dispatch, "self_check", no_self_check)
    mps = torch.device("mps")
    with dispatch._lock:
        dispatch._decisions[dispatch._decision_key(registry.REGISTRY["softmax"], mps)] = ("metal", "passed its self-check")
    kernels = dispatch.kernel_status(mps, run_pending=False)
    assert kernels["softmax"]["backend"] == "metal"
    assert kernels["fp8_decode"]["backend"] == "pending" and "first use" in kernels["fp8_decode"]["reason"]
    assert set(kernels) == set(registry.REGISTRY)
    # CPU decisions need no self-check: reported as usual
    assert dispatch.kernel_status("cpu", run_pending=False)["fp8_decode"]["backend"] == "reference"


@pytest.fixture
def fake_mps_kernel(monkeypatch):
    """A self-checked 'Metal' kernel on faked MPS (CPU tensors, a fake clock, no device syncs): returns
    (make_spec(metal_seconds, reference_seconds), clock, calls)."""
    clock = FakeClock()
    calls = {"metal": 0, "reference": 0}
    monkeypatch.setattr(dispatch, "_library_for", lambda spec, backend: object())
    monkeypatch.setattr(dispatch, "self_check", lambda spec, backend, device: None)
    monkeypatch.setattr(dispatch, "_first_device", lambda args, kwargs: torch.device("mps"))
    monkeypatch.setattr(dispatch, "_device_sync", lambda device: None)
    monkeypatch.setattr(dispatch, "_clock", clock)

    def make_spec(name, metal_seconds, reference_seconds, measured_by_caller=False):
        def reference(x, out):
            calls["reference"] += 1
            clock.t += reference_seconds
            if x.numel() == 0:
                raise ValueError("x: expected at least one element")
            out.copy_(x * 2)                 # writes into its argument, like the fused in-place steps
            return out

        def metal(lib, x, out):
            calls["metal"] += 1
            clock.t += metal_seconds
            out.copy_(x * 2)
            return out

        spec = registry.KernelSpec(name=name, source="softmax.metal",
                                   entry_points={"softmax_rows_float": ("tensor", "tensor", "int", "float")},
                                   reference=reference, metal=metal, self_check_cases=lambda d: [],
                                   measured_by_caller=measured_by_caller)
        monkeypatch.setitem(registry.REGISTRY, name, spec)
        return spec

    return make_spec, clock, calls


@pytest.mark.parametrize("metal_seconds, expect", [(5.0, "reference"), (1.0, "reference"), (0.2, "metal")])
def test_metal_runs_only_where_measured_faster_than_its_reference(fake_mps_kernel, metal_seconds, expect):
    """On MPS a self-checked kernel is timed once per shape class against its reference (the torch ops it
    replaces) and runs only where strictly faster (a tie keeps the reference); the timing works on copies,
    so a kernel writing into its arguments leaves the caller's tensors to the one real call."""
    make_spec, clock, calls = fake_mps_kernel
    spec = make_spec("timed_double", metal_seconds, 1.0)
    x, out = torch.arange(6.0), torch.zeros(6)
    got = dispatch.call(spec, (x, out), {})
    assert got is out and torch.equal(out, x * 2)
    assert dispatch.last_backend["timed_double"] == expect
    (record,) = [r for r in dispatch.measured_records() if r["kernel"] == "timed_double"]
    assert record["choice"] == expect and set(record["times_ms"]) == {"reference", "metal"}
    assert record["shape_class"] == [("float32", 4096), ("float32", 4096)]    # small tensors: one class
    n = dict(calls)
    out2 = torch.zeros(5)
    dispatch.call(spec, (torch.arange(5.0), out2), {})          # same class (bucket 8): not timed again
    assert calls[expect] == n[expect] + 1 and sum(calls.values()) == sum(n.values()) + 1
    assert torch.equal(out2, torch.arange(5.0) * 2)


def test_measured_kernel_bad_input_still_raises_and_is_not_remembered(fake_mps_kernel):
    make_spec, _, _ = fake_mps_kernel
    spec = make_spec("timed_bad", 0.1, 1.0)
    with pytest.raises(ValueError, match="at least one element"):
        dispatch.call(spec, (torch.ones(0), torch.ones(0)), {})
    assert not [r for r in dispatch.measured_records() if r["kernel"] == "timed_bad"]


def test_large_calls_and_caller_measured_kernels_are_not_timed(fake_mps_kernel, monkeypatch):
    make_spec, _, calls = fake_mps_kernel
    spec = make_spec("timed_large", 0.1, 1.0)
    monkeypatch.setattr(dispatch, "MEASURE_MAX_BYTES", 16)
    dispatch.call(spec, (torch.ones(8), torch.zeros(8)), {})
    assert calls == {"metal": 1, "reference": 0} and not dispatch.measured_records()
    monkeypatch.setattr(dispatch, "MEASURE_MAX_BYTES", 2**20)
    caller = make_spec("timed_by_caller", 0.1, 1.0, measured_by_caller=True)
    dispatch.call(caller, (torch.ones(8), torch.zeros(8)), {})
    assert calls == {"metal": 2, "reference": 0} and not dispatch.measured_records()
    assert {n for n, s in registry.REGISTRY.items() if s.measured_by_caller} \
        >= {"gemv", "gguf_gemv", "flash_attention"}


def test_measuring_holds_one_candidates_copies_at_a_time(fake_mps_kernel):
    """The timing works on copies of the arguments: the reference's are dropped before the kernel's are
    made (at most one extra copy of the inputs alive), and none stays after the decision."""
    import gc
    import weakref

    make_spec, _, _ = fake_mps_kernel
    spec = make_spec("timed_copies", 0.2, 1.0)
    seen = {"reference": [], "metal": []}
    reference, metal = spec.reference, spec.metal

    def ref(x, out):
        seen["reference"].append(weakref.ref(x))
        return reference(x, out)

    def met(lib, x, out):
        gc.collect()
        seen["metal"].append(weakref.ref(x))
        assert all(r() is None for r in seen["reference"]), "the reference's copies are still alive"
        return metal(lib, x, out)

    spec = dataclasses.replace(spec, reference=ref, metal=met)
    x, out = torch.arange(6.0), torch.zeros(6)
    dispatch.call(spec, (x, out), {})
    gc.collect()
    copies = {id(r()) for r in seen["reference"] + seen["metal"][:-1] if r() is not None}
    assert not copies and len({id(r) for r in seen["reference"]}) >= 1
    assert torch.equal(out, x * 2)
