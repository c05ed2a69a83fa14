"""The dispatch layer: backend choice, forced reference, self-check and its log line."""
import dataclasses
import functools
import json
import logging
import pathlib

import pytest
import torch

import comfy_metal
from comfy_metal import metal_kernels
from comfy_metal.metal_kernels import dispatch, dispatch_decisions, registry
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
    (make_spec(name, metal_seconds, reference_seconds), clock, calls). Each candidate call is logged in
    calls["log"] as (candidate, the x it got, the out it got)."""
    clock = FakeClock()
    calls = {"metal": 0, "reference": 0, "log": []}
    monkeypatch.setattr(dispatch, "_library_for", lambda spec, backend: object())
    monkeypatch.setattr(dispatch, "self_check", lambda spec, backend, device: None)
    monkeypatch.setattr(dispatch, "_first_device", lambda args, kwargs: torch.device("mps"))
    monkeypatch.setattr(dispatch, "_device_sync", lambda device: None)
    monkeypatch.setattr(dispatch, "_clock", clock)

    def make_spec(name, metal_seconds, reference_seconds, measured_by_caller=False):
        def reference(x, out):
            calls["reference"] += 1
            calls["log"].append(("reference", x, out))
            clock.t += reference_seconds
            if x.numel() == 0:
                raise ValueError("x: expected at least one element")
            out.add_(x[: out.numel()].float())     # accumulates into its argument, like the VAE blend
            return out

        def metal(lib, x, out):
            calls["metal"] += 1
            calls["log"].append(("metal", x, out))
            clock.t += metal_seconds
            out.add_(x[: out.numel()].float())
            return out

        spec = registry.KernelSpec(name=name, source="softmax.metal",
                                   entry_points={"softmax_rows_float": ("tensor", "tensor", "int", "float")},
                                   reference=reference, metal=metal, self_check_cases=lambda d: [],
                                   measured_by_caller=measured_by_caller, writes=("out",))
        monkeypatch.setitem(registry.REGISTRY, name, spec)
        return spec

    return make_spec, clock, calls


@pytest.mark.parametrize("metal_seconds, expect", [(5.0, "reference"), (1.0, "reference"), (0.96, "reference"),
                                                   (0.9, "metal")])
def test_metal_runs_only_where_measured_faster_than_its_reference(fake_mps_kernel, metal_seconds, expect):
    """On MPS a self-checked kernel is timed once per shape class against its reference (the torch ops it
    replaces) and runs only where more than 5% faster (a tie, or 4% faster, keeps the reference). The timing
    runs on the caller's own inputs; the argument the kernel writes is a copy, so the caller's tensor is
    written by the one real call only."""
    make_spec, clock, calls = fake_mps_kernel
    spec = make_spec("timed_add", metal_seconds, 1.0)
    x, out = torch.arange(6.0), torch.zeros(6)
    got = dispatch.call(spec, (x, out), {})
    assert got is out and torch.equal(out, x)               # accumulated once
    assert dispatch.last_backend["timed_add"] == expect
    (record,) = [r for r in dispatch.measured_records() if r["kernel"] == "timed_add"]
    assert record["choice"] == expect and set(record["times_ms"]) == {"reference", "metal"}
    assert record["times_ms"]["metal"] == pytest.approx(metal_seconds * 1e3)
    assert record["shape_class"] == [("float32", 4096), ("float32", 4096)]    # small tensors: one class
    *timing, real = calls["log"]
    assert real[0] == expect and real[2] is out
    assert all(c[1] is x and c[2] is not out for c in timing)     # x read in place; out: the scratch copy
    before = dict(calls, log=None)
    out2 = torch.zeros(5)
    dispatch.call(spec, (torch.arange(5.0), out2), {})          # same class (bucket 8): not timed again
    assert calls[expect] == before[expect] + 1 and calls["metal"] + calls["reference"] == \
        before["metal"] + before["reference"] + 1
    assert torch.equal(out2, torch.arange(5.0))


@pytest.mark.parametrize("bank_bytes", [1024, 128 * 2**20 + 4, 200 * 2**20])
def test_a_slow_kernel_is_never_chosen_at_any_size(fake_mps_kernel, bank_bytes):
    """No size escapes the measurement: a slow kernel loses at every input size, a 200 MiB expert bank
    included, and the bank (an argument the kernel only reads) is never copied for the timing."""
    make_spec, _, calls = fake_mps_kernel
    spec = make_spec("timed_bank", 0.002, 0.001)
    bank, out = torch.empty(bank_bytes, dtype=torch.uint8), torch.zeros(4)
    dispatch.call(spec, (bank, out), {})
    assert dispatch.last_backend["timed_bank"] == "reference"
    (record,) = dispatch.measured_records()
    assert record["choice"] == "reference" and record["shape_class"][0][1] >= bank_bytes
    assert calls["metal"] >= 2 + 2 * dispatch.MEASURE_CALLS       # it was timed, not skipped
    assert all(c[1] is bank for c in calls["log"])               # read in place by every call
    before = calls["metal"]
    dispatch.call(spec, (bank, out), {})
    assert calls["metal"] == before


def test_each_candidate_is_timed_over_many_calls_between_syncs():
    """After a warm-up and one call alone, each candidate runs at least MEASURE_CALLS times between two
    syncs, in two rounds of opposite order; a call of over MEASURE_SLOW_SECONDS is timed alone."""
    clock, events = FakeClock(), []

    def run(name, seconds):
        def fn():
            events.append(name)
            clock.t += seconds
        return fn

    def sync(device):
        events.append("|")

    pick = dispatch.measured_choice("k", ("x",), {"platform": run("p", 0.001), "kernel": run("k", 0.0005),
                                                  "video": run("v", 2.0)}, "mps", sync=sync, clock=clock)
    assert pick == "kernel"
    batches = [b for b in "".join(events).split("|") if b]
    assert batches[:6] == ["p", "p", "k", "k", "v", "v"]            # warm-up, then one call alone
    timed = batches[6:]
    assert [b[0] for b in timed] == ["p", "k", "k", "p"]             # the slow one is not batched
    assert all(len(b) >= dispatch.MEASURE_CALLS for b in timed)
    assert len(timed[0]) == 20 and len(timed[1]) == 40               # a batch lasts about 20 ms


def test_kernel_must_beat_the_platform_op_by_the_margin():
    clock = FakeClock()

    def cost(seconds):
        def run():
            clock.t += seconds
        return run

    def pick(shape, platform, kernel):
        return dispatch.measured_choice("k", (shape,), {"platform": cost(platform), "metal": cost(kernel)}, "mps",
                                        sync=lambda d: None, clock=clock)
    assert pick("a", 1.0, 0.96) == "platform"
    assert "not 5% faster" in dispatch.measured[("k", ("a",))]["reason"]
    assert pick("b", 1.0, 0.94) == "metal"
    assert pick("c", 1.0, 1.0) == "platform"


def test_the_argument_a_kernel_writes_starts_equal_for_every_candidate(fake_mps_kernel, monkeypatch):
    """Both candidates read the same inputs: the copy of the written argument is set back to the caller's
    values before every timed batch (an accumulating kernel would otherwise see its own sums)."""
    make_spec, _, calls = fake_mps_kernel
    spec = make_spec("timed_acc", 0.0005, 0.001)
    seen = []
    monkeypatch.setattr(dispatch, "_device_sync", lambda device: seen.append("sync"))

    def watching(fn):
        @functools.wraps(fn)                                        # keeps the parameter names
        def run(*args):
            seen.append(args[-1].clone())
            return fn(*args)
        return run

    spec = dataclasses.replace(spec, reference=watching(spec.reference), metal=watching(spec.metal))
    out = torch.full((3,), 7.0)
    dispatch.call(spec, (torch.ones(3), out), {})
    batches, batch = [], []
    for item in seen:
        if isinstance(item, str):
            if batch:
                batches.append(batch)
            batch = []
        else:
            batch.append(item)
    assert len(batches) == 8                                         # 2 candidates x (warm-up, alone, 2 rounds)
    for b in batches:
        assert torch.equal(b[0], torch.full((3,), 7.0)) and torch.equal(b[-1], torch.full((3,), 6.0 + len(b)))
    assert len({c[2].data_ptr() for c in calls["log"][:-1]}) == 1    # one scratch copy, reused
    assert torch.equal(out, torch.full((3,), 8.0))                  # the caller's: the one real call


def test_measured_kernel_bad_input_still_raises_and_is_not_remembered(fake_mps_kernel):
    make_spec, _, _ = fake_mps_kernel
    spec = make_spec("timed_bad", 0.1, 1.0)
    with pytest.raises(ValueError, match="at least one element"):
        dispatch.call(spec, (torch.ones(0), torch.ones(0)), {})
    assert not [r for r in dispatch.measured_records() if r["kernel"] == "timed_bad"]
    assert not dispatch_decisions.decisions_path().exists()


def test_caller_measured_kernels_are_not_timed_again(fake_mps_kernel):
    make_spec, _, calls = fake_mps_kernel
    caller = make_spec("timed_by_caller", 0.1, 1.0, measured_by_caller=True)
    dispatch.call(caller, (torch.ones(8), torch.zeros(8)), {})
    assert (calls["metal"], calls["reference"]) == (1, 0) and not dispatch.measured_records()
    assert {n for n, s in registry.REGISTRY.items() if s.measured_by_caller} \
        >= {"gemv", "gguf_gemv", "flash_attention"}


# ----------------------------------------------------------------------------------------------
# Writes: the timing copies only what a kernel writes, so what it writes must be declared
# ----------------------------------------------------------------------------------------------

def test_every_reference_writes_only_what_its_spec_declares():
    """Every registered kernel's reference, on its self-check inputs (CPU), changes no argument outside
    its KernelSpec's `writes` (the measured dispatch runs it on the caller's own tensors)."""
    for name, spec in sorted(registry.REGISTRY.items()):
        for args, kwargs in spec.self_check_cases(torch.device("cpu")):
            assert dispatch.undeclared_writes(spec, spec.reference, args, kwargs) == [], name


def test_a_kernel_writing_an_undeclared_argument_fails_its_self_check(monkeypatch):
    monkeypatch.setenv("COMFY_METAL_BACKEND", "emulator")
    monkeypatch.setattr(dispatch, "_library_for", lambda spec, backend: object())

    def metal(lib, x):
        x.mul_(2)                                                  # in place, and not declared
        return x

    spec = _broken_spec("sneaky_write", metal)
    monkeypatch.setitem(registry.REGISTRY, spec.name, spec)
    backend, reason = dispatch.choose(spec, torch.device("cpu"))
    assert backend == "reference" and "kernel wrote into x" in reason and "writes=()" in reason
    with pytest.raises(ValueError, match="not parameters of its reference"):
        dataclasses.replace(spec, writes=("out",))


# ----------------------------------------------------------------------------------------------
# Decisions kept on disk (metal_kernels/dispatch_decisions.py)
# ----------------------------------------------------------------------------------------------

def _measure_once(fake_mps_kernel, metal_seconds=0.2):
    make_spec, _, calls = fake_mps_kernel
    spec = make_spec("timed_saved", metal_seconds, 1.0)
    dispatch.call(spec, (torch.ones(4), torch.zeros(4)), {})
    return spec, calls


def test_a_decision_is_saved_and_read_back_by_the_next_process(fake_mps_kernel):
    spec, calls = _measure_once(fake_mps_kernel)
    path = dispatch_decisions.decisions_path()
    saved = json.loads(path.read_text())
    assert saved["format"] == 1 and saved["environment"] == dispatch_decisions.environment()
    assert set(saved["environment"]) == {"device", "os", "torch", "pack"}
    assert saved["environment"]["torch"] == torch.__version__
    (entry,) = saved["decisions"]
    assert entry["kernel"] == "timed_saved" and entry["choice"] == "metal"
    assert entry["candidates"] == ["reference", "metal"] and entry["shape_class"] == [["float32", 4096]] * 2
    dispatch.reset()                                      # a new process: nothing in memory
    timed = calls["metal"] + calls["reference"]
    dispatch.call(spec, (torch.ones(4), torch.zeros(4)), {})
    assert calls["metal"] + calls["reference"] == timed + 1        # the saved choice, no timing
    assert dispatch.last_backend["timed_saved"] == "metal"
    (record,) = dispatch.measured_records()
    assert record["source"] == "saved" and record["shape_class"] == [("float32", 4096)] * 2
    assert "Measured choices" in status_report_text()


def status_report_text():
    from comfy_metal.nodes import status

    return status.status_report(status.status_payload())


def test_a_version_change_invalidates_the_saved_decisions(fake_mps_kernel, monkeypatch, caplog):
    spec, calls = _measure_once(fake_mps_kernel)
    newer = {**dispatch_decisions.environment(), "torch": "9.9.9"}
    monkeypatch.setattr(dispatch_decisions, "environment", lambda: newer)
    dispatch.reset()
    timed = calls["metal"] + calls["reference"]
    with caplog.at_level(logging.INFO, logger="comfy_metal"):
        dispatch.call(spec, (torch.ones(4), torch.zeros(4)), {})
    assert calls["metal"] + calls["reference"] > timed + 1       # measured again
    lines = [r.getMessage() for r in caplog.records if "measured elsewhere" in r.getMessage()]
    assert len(lines) == 1 and "torch" in lines[0] and "9.9.9" in lines[0]
    saved = json.loads(dispatch_decisions.decisions_path().read_text())
    assert saved["environment"]["torch"] == "9.9.9" and len(saved["decisions"]) == 1


@pytest.mark.parametrize("content", ["{not json", json.dumps({"format": 1, "environment": {}, "decisions": [{}]}),
                                     json.dumps([1, 2]), "\xff\xfe"])
def test_a_corrupt_decisions_file_is_ignored_with_one_log_line(fake_mps_kernel, caplog, content):
    path = dispatch_decisions.decisions_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(content, encoding="latin-1")
    with caplog.at_level(logging.WARNING, logger="comfy_metal"):
        _measure_once(fake_mps_kernel)
    assert dispatch.last_backend["timed_saved"] == "metal"
    lines = [r.getMessage() for r in caplog.records if "saved dispatch decisions" in r.getMessage()]
    assert len(lines) == 1 and str(path) in lines[0], lines
    assert [e["kernel"] for e in json.loads(path.read_text())["decisions"]] == ["timed_saved"]   # rewritten


def test_decisions_are_written_atomically(fake_mps_kernel, monkeypatch, caplog, tmp_path):
    """A temporary file in the same folder renamed over the old one; a failed write leaves the old file as
    it was (and no temporary file), with one log line, and the decision still holds for this process."""
    import os

    monkeypatch.setenv("COMFY_METAL_DECISIONS", str(tmp_path / "decisions" / "measured.json"))
    spec, calls = _measure_once(fake_mps_kernel)
    path = dispatch_decisions.decisions_path()
    old = path.read_text()
    renames = []
    real_replace = os.replace

    def replace(src, dst):
        renames.append((pathlib.Path(src), pathlib.Path(dst), pathlib.Path(dst).read_text()))
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dispatch_decisions.os, "replace", replace)
    x = torch.ones(40000)
    with caplog.at_level(logging.WARNING, logger="comfy_metal"):
        dispatch.call(spec, (x, torch.zeros(4)), {})                # a new shape class: a new decision
    (src, dst, at_rename), = renames
    assert dst == path and src.parent == path.parent and at_rename == old
    assert path.read_text() == old and sorted(p.name for p in path.parent.iterdir()) == [path.name]
    assert len([r for r in caplog.records if "could not save" in r.getMessage()]) == 1
    assert len(dispatch.measured_records()) == 2
    monkeypatch.setattr(dispatch_decisions.os, "replace", real_replace)
    n = calls["metal"] + calls["reference"]
    dispatch.call(spec, (x, torch.zeros(4)), {})
    assert calls["metal"] + calls["reference"] == n + 1


def test_the_decisions_file_lives_in_comfyuis_user_directory(monkeypatch, tmp_path):
    """Inside ComfyUI: a system-user folder of its user directory (never served over HTTP); headless: the
    per-user cache folder; $COMFY_METAL_DECISIONS overrides both."""
    import sys
    import types

    monkeypatch.delenv("COMFY_METAL_DECISIONS")
    monkeypatch.setattr(dispatch_decisions.sys, "platform", "linux")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delitem(sys.modules, "folder_paths", raising=False)
    assert dispatch_decisions.decisions_path() == tmp_path / "cache" / "comfy-metal" / "measured-dispatch.json"
    folder_paths = types.ModuleType("folder_paths")
    folder_paths.get_user_directory = lambda: str(tmp_path / "user")
    monkeypatch.setitem(sys.modules, "folder_paths", folder_paths)
    assert dispatch_decisions.decisions_path() == tmp_path / "user" / "__comfy_metal" / "measured-dispatch.json"
    folder_paths.get_system_user_directory = lambda name: str(tmp_path / "user" / f"__{name}")
    assert dispatch_decisions.decisions_path() == tmp_path / "user" / "__comfy_metal" / "measured-dispatch.json"
    monkeypatch.setenv("COMFY_METAL_DECISIONS", str(tmp_path / "mine.json"))
    assert dispatch_decisions.decisions_path() == tmp_path / "mine.json"


def test_the_pack_entry_changes_with_any_kernel_source(monkeypatch, tmp_path):
    import shutil

    copy = tmp_path / "metal_kernels"
    shutil.copytree(dispatch_decisions.KERNEL_DIR, copy, ignore=shutil.ignore_patterns("__pycache__", "emulator"))
    monkeypatch.setattr(dispatch_decisions, "KERNEL_DIR", copy)
    dispatch_decisions.pack_version.cache_clear()
    try:
        first = dispatch_decisions.pack_version()
        (copy / "softmax.metal").write_text((copy / "softmax.metal").read_text() + "\n// changed\n")
        dispatch_decisions.pack_version.cache_clear()
        assert dispatch_decisions.pack_version() != first and first.startswith(comfy_metal.__version__ + "+")
    finally:
        dispatch_decisions.pack_version.cache_clear()
