"""Pick Metal or the pure-torch reference for each call, compile the one shared library lazily,
and self-check each kernel once against its reference before trusting it.

Backends (COMFY_METAL_BACKEND):
  auto (default)  Metal for MPS tensors once the library compiled, the kernel passed its
                  self-check and it was timed faster than its reference (the platform's torch ops) for
                  the call's shape class (`measured_backend`); the reference everywhere else (CPU, CUDA).
  reference       the reference for every kernel.
  emulator        CPU tensors run the real Metal kernels and launch code through the project's
                  MSL emulator (clang-19); MPS tensors still use Metal.
COMFY_METAL_REFERENCE=name,name (or "all") forces the reference for the named kernels.
"""
from __future__ import annotations

import contextlib
import logging
import os
import pathlib
import threading
from typing import Any

import torch

from . import source
from .registry import REGISTRY, KernelSpec

log = logging.getLogger("comfy_metal")

KERNEL_DIR = source.KERNEL_DIR
COMMON_SOURCE = source.COMMON_SOURCE

_lock = threading.RLock()
_libraries: dict[str, Any] = {}          # backend -> compiled library (or the exception that stopped it)
_decisions: dict[tuple, tuple[str, str]] = {}
_logged: set[tuple] = set()


class MetalUnavailable(RuntimeError):
    pass


def metal_sources() -> list[pathlib.Path]:
    """The .metal files of the shared library, in compile order (common.metal first)."""
    return source.metal_sources()


def library_source(only: str | None = None) -> str:
    """The one MSL source string compiled for the shared library (or common + one file): see source.py."""
    return source.library_source(only)


def _env_backend() -> str:
    value = os.environ.get("COMFY_METAL_BACKEND", "auto").strip().lower() or "auto"
    if value not in ("auto", "metal", "reference", "emulator"):
        _log_once(("bad-backend", value), logging.WARNING,
                  f"COMFY_METAL_BACKEND={value!r} is not one of auto, metal, reference, emulator; using auto")
        return "auto"
    return value


def _forced_reference() -> set[str]:
    raw = os.environ.get("COMFY_METAL_REFERENCE", "")
    return {p.strip() for p in raw.split(",") if p.strip()}


def _log_once(key, level, message):
    if key not in _logged:
        _logged.add(key)
        log.log(level, message)


def compile_library(backend: str, only: str | None = None):
    """Compile (once per process and backend) the shared library. Raises MetalUnavailable."""
    key = backend if only is None else f"{backend}:{only}"
    with _lock:
        if key in _libraries:
            lib = _libraries[key]
            if isinstance(lib, Exception):
                raise lib
            return lib
        try:
            src = library_source(only)
            if backend == "metal":
                if not (hasattr(torch, "mps") and hasattr(torch.mps, "compile_shader")):
                    raise MetalUnavailable(f"torch {torch.__version__} has no torch.mps.compile_shader (needs 2.7+)")
                try:
                    lib = torch.mps.compile_shader(src)
                except Exception as e:  # SyntaxError on compile errors, RuntimeError without a device
                    raise MetalUnavailable(f"the Metal library failed to compile: {e}") from e
            elif backend == "emulator":
                from . import emulator

                if not emulator.available():
                    raise MetalUnavailable("the MSL emulator needs clang-19, which was not found")
                try:
                    lib = emulator.compile_library(src)
                except Exception as e:
                    raise MetalUnavailable(f"the Metal library failed to compile in the emulator: {e}") from e
            else:
                raise ValueError(backend)
        except MetalUnavailable as e:
            _libraries[key] = e
            raise
        _libraries[key] = lib
        return lib


def _library_for(spec: KernelSpec, backend: str):
    """The whole library; if it does not compile, common + this kernel's own file, so one
    broken file does not take every kernel down."""
    try:
        return compile_library(backend)
    except MetalUnavailable as whole:
        try:
            return compile_library(backend, only=spec.source)
        except MetalUnavailable:
            raise whole from None


def _as_float(x):
    if isinstance(x, torch.Tensor):
        return x.detach().to("cpu", torch.float32)
    return x


# (atol, rtol) floors for outputs stored in a low-precision dtype: one or two units in the last place.
LOW_PRECISION_TOLERANCE = {torch.float16: (1e-3, 2e-3), torch.bfloat16: (8e-3, 1.6e-2)}


def default_compare(spec: KernelSpec, got, want) -> str | None:
    if isinstance(want, (tuple, list)):
        if not isinstance(got, (tuple, list)) or len(got) != len(want):
            return f"returned {type(got).__name__} of length {len(got) if hasattr(got, '__len__') else '?'}, expected {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            problem = default_compare(spec, g, w)
            if problem:
                return f"output {i}: {problem}"
        return None
    if not isinstance(want, torch.Tensor):
        return None if got == want else f"got {got!r}, expected {want!r}"
    if not isinstance(got, torch.Tensor):
        return f"got {type(got).__name__}, expected a tensor"
    if got.shape != want.shape:
        return f"shape {tuple(got.shape)}, expected {tuple(want.shape)}"
    if not want.is_floating_point():
        bad = (got.cpu() != want.cpu())
        return None if not bad.any() else f"{int(bad.sum())} of {bad.numel()} values differ"
    g, w = _as_float(got), _as_float(want)
    same_nan = torch.isnan(g) == torch.isnan(w)
    if not bool(same_nan.all()):
        return "NaN in different places"
    atol, rtol = spec.atol, spec.rtol
    if want.dtype in LOW_PRECISION_TOLERANCE:  # the output's own rounding bounds the agreement
        atol, rtol = (max(t, floor) for t, floor in zip((atol, rtol), LOW_PRECISION_TOLERANCE[want.dtype]))
    ok = torch.isclose(g, w, atol=atol, rtol=rtol, equal_nan=True)
    if bool(ok.all()):
        return None
    err = (g - w).abs().nan_to_num(0).max().item()
    return f"max abs error {err:.3g} exceeds atol={atol} rtol={rtol}"


def _to_cpu(obj):
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu().clone()
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(o) for o in obj)
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    return obj


def self_check(spec: KernelSpec, backend: str, device: torch.device) -> str | None:
    """Run the kernel against its reference on small inputs. None if it agrees, else why not."""
    lib = _library_for(spec, backend)
    for i, (args, kwargs) in enumerate(spec.self_check_cases(device)):
        want = spec.reference(*_to_cpu(args), **_to_cpu(kwargs))
        got = _to_cpu(spec.metal(lib, *args, **kwargs))
        problem = (spec.compare or (lambda g, w: default_compare(spec, g, w)))(got, want)
        if problem:
            return f"self-check case {i} failed: {problem}"
    return None


def _first_device(args, kwargs) -> torch.device:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            return a.device
        if isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    return b.device
    return torch.device("cpu")


def _decision_key(spec: KernelSpec, device: torch.device) -> tuple:
    return (spec.name, device.type, _env_backend(), frozenset(_forced_reference()))


def choose(spec: KernelSpec, device: torch.device) -> tuple[str, str]:
    """(backend, reason) for `spec` on `device`: backend is metal, emulator or reference."""
    key = _decision_key(spec, device)
    _, _, env_backend, forced = key
    with _lock:
        if key in _decisions:
            return _decisions[key]
        if env_backend == "reference" or "all" in forced or spec.name in forced:
            decision = ("reference", "forced by COMFY_METAL_BACKEND/COMFY_METAL_REFERENCE")
            level = logging.INFO
        elif device.type == "mps" or (device.type == "cpu" and env_backend == "emulator"):
            backend = "metal" if device.type == "mps" else "emulator"
            try:
                problem = self_check(spec, backend, device)
            except MetalUnavailable as e:
                problem = str(e)
            except Exception as e:  # a launch that raises is a failed self-check, not a crash
                problem = f"self-check raised {type(e).__name__}: {e}"
            if problem is None:
                decision = (backend, "passed its self-check")
                level = logging.INFO
            else:
                decision = ("reference", problem)
                level = logging.WARNING
        else:
            decision = ("reference", f"Metal runs only on MPS tensors (this call is on {device.type})")
            level = logging.DEBUG
        _decisions[key] = decision
    backend, reason = decision
    _log_once(key, level, f"comfy_metal: {spec.name} on {device.type} uses {backend}: {reason}")
    return decision


def _out_of_memory(e: BaseException) -> bool:
    return isinstance(e, getattr(torch, "OutOfMemoryError", ())) or "out of memory" in str(e).lower()


class KernelTraffic:
    """Bytes the public kernel calls made inside `recording_traffic()` read and write: every distinct
    tensor argument once (a fused kernel reads each input once) plus the tensors returned. The same on
    every backend, since it counts the public call's tensors, not how a backend moves them."""

    def __init__(self):
        self.bytes_by_kernel: dict[str, int] = {}
        self.calls = 0

    @property
    def bytes(self) -> int:
        return sum(self.bytes_by_kernel.values())

    def add(self, name: str, args, kwargs, out) -> None:
        seen, total = set(), 0
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for t in (*args, *kwargs.values(), *outs):
            if isinstance(t, torch.Tensor) and t.numel() and (t.data_ptr(), t.numel()) not in seen:
                seen.add((t.data_ptr(), t.numel()))
                total += t.numel() * t.element_size()
        self.bytes_by_kernel[name] = self.bytes_by_kernel.get(name, 0) + total
        self.calls += 1


_traffic: KernelTraffic | None = None


@contextlib.contextmanager
def recording_traffic():
    """`with recording_traffic() as t:` -> t.bytes read and written by the public kernel calls inside."""
    global _traffic
    outer, _traffic = _traffic, KernelTraffic()
    try:
        yield _traffic
    finally:
        _traffic = outer


def call(spec: KernelSpec, args, kwargs):
    if _traffic is not None:
        out = _call(spec, args, kwargs)
        _traffic.add(spec.name, args, kwargs, out)
        return out
    return _call(spec, args, kwargs)


def _call(spec: KernelSpec, args, kwargs):
    device = _first_device(args, kwargs)
    backend, _ = choose(spec, device)
    if backend == "metal" and not spec.measured_by_caller and measuring_enabled(device):
        backend = measured_backend(spec, args, kwargs, device)
    last_backend[spec.name] = backend
    if backend == "reference":
        return spec.reference(*args, **kwargs)
    if backend == "emulator":                 # tests: a kernel error must surface, never be papered over
        return spec.metal(_library_for(spec, backend), *args, **kwargs)
    try:
        return spec.metal(_library_for(spec, backend), *args, **kwargs)
    except Exception as e:
        # Bad input (the reference would raise the same) and out-of-memory (callers such as the tiled
        # VAE retry smaller) propagate. Anything else -- a launch the self-check did not cover -- turns
        # this kernel off for the process with one warning, and this call gets the reference.
        # (Only errors raised at launch are seen here; GPU faults surface later, at a sync.)
        if isinstance(e, (TypeError, ValueError)) or _out_of_memory(e):
            raise
        key = _decision_key(spec, device)
        with _lock:
            _decisions[key] = ("reference", f"the Metal launch raised {type(e).__name__}: {e}")
        _log_once(key + ("runtime",), logging.WARNING,
                  f"comfy_metal: {spec.name} on {device.type} now uses reference: the Metal launch raised "
                  f"{type(e).__name__}: {e}")
        last_backend[spec.name] = "reference"
        return spec.reference(*args, **kwargs)


# The backend each kernel used on its last call (for node badges and run summaries).
last_backend: dict[str, str] = {}


PENDING_REASON = "not self-checked yet: runs at the kernel's first use (or run the Comfy Metal Status node)"


def kernel_status(device: torch.device | str | None = None, run_pending: bool = True) -> dict[str, dict]:
    """Each kernel's backend and reason on `device` (default: MPS if present, else CPU).
    Runs the self-checks that have not run yet; with run_pending=False, MPS kernels not decided yet
    are reported as backend "pending" instead (for callers off ComfyUI's execution thread: MPS work
    from a second thread can race the running prompt)."""
    from .probe import mps_available

    if device is None:
        device = "mps" if mps_available() else "cpu"
    device = torch.device(device)
    out = {}
    for name, spec in sorted(REGISTRY.items()):
        with _lock:
            known = _decisions.get(_decision_key(spec, device))
        if known is None and not run_pending and device.type == "mps":
            backend, reason = "pending", PENDING_REASON
        else:
            backend, reason = known or choose(spec, device)
        out[name] = {"backend": backend, "reason": reason, "device": device.type,
                     "entry_points": sorted(spec.entry_points), "source": spec.source}
    return out


# ----------------------------------------------------------------------------------------------
# Measured choice: "never slower than the platform op", by timing both on the user's machine.
# ----------------------------------------------------------------------------------------------

# (kernel, shape class) -> {"choice": name, "times_ms": {name: ms}, "reason": str}
measured: dict[tuple, dict] = {}
MEASURE_REPS = 3
MEASURE_SLOW_SECONDS = 0.5
_clock = None      # None: time.perf_counter (tests put a fake timing source here)


def _device_sync(device: torch.device) -> None:
    if device.type == "mps":
        torch.mps.synchronize()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)


def measuring_enabled(device: torch.device) -> bool:
    """Whether measured_choice times candidates on `device` (MPS only: elsewhere the platform op is
    the normal path and the pack's kernels run only when asked for)."""
    return torch.device(device).type == "mps"


def measured_choice(kernel: str, shape_class, candidates: dict, device, *, reps: int | None = None,
                    sync=None, clock=None) -> str:
    """The name of the fastest of `candidates` (name -> zero-argument callable running the same
    work) for (kernel, shape_class), timed once per process and then remembered.

    At the first call for a key every candidate runs once to warm up (compiles, self-checks,
    allocations), then `reps` times between device synchronisations (once if its warm-up took over
    MEASURE_SLOW_SECONDS); the median decides. A
    candidate that raises is never chosen (its error is in the record's reason). Ties keep the
    candidate listed first, so list the platform op first: a kernel must be strictly faster to be
    chosen. `sync(device)` and `clock()` default to the device synchronise and time.perf_counter;
    tests pass fakes. The record (choice, each time in ms) is in `measured` for the status route,
    `doctor` and the badges."""
    import statistics
    import time

    key = (kernel, shape_class)
    with _lock:
        known = measured.get(key)
    if known is not None:
        return known["choice"]
    device = torch.device(device)
    sync = sync or _device_sync
    clock = clock or _clock or time.perf_counter
    reps = reps or MEASURE_REPS
    times: dict[str, float] = {}
    failed: dict[str, str] = {}
    for name, fn in candidates.items():
        try:
            sync(device)
            t0 = clock()
            fn()                                   # warm-up
            sync(device)
            slow = clock() - t0 > MEASURE_SLOW_SECONDS
            samples = []
            for _ in range(1 if slow else reps):   # a call of seconds (long videos) is timed once
                t0 = clock()
                fn()
                sync(device)
                samples.append(clock() - t0)
            times[name] = statistics.median(samples) * 1e3
        except Exception as e:                     # noqa: BLE001 - a failing candidate just loses
            if _out_of_memory(e):
                raise
            failed[name] = f"{type(e).__name__}: {e}"
    if not times:
        raise RuntimeError(f"{kernel}: every candidate failed for {shape_class}: {failed}")
    first = next(n for n in candidates if n in times)
    choice = min(times, key=lambda n: (times[n], n != first))
    others = ", ".join(f"{n} {t:.3g} ms" for n, t in times.items() if n != choice)
    reason = f"measured {choice} {times[choice]:.3g} ms" + (f" vs {others}" if others else "")
    if failed:
        reason += "; failed: " + "; ".join(f"{n}: {m}" for n, m in failed.items())
    record = {"choice": choice, "times_ms": times, "reason": reason, "kernel": kernel,
              "shape_class": shape_class, "device": device.type}
    with _lock:
        measured.setdefault(key, record)
        record = measured[key]
    _log_once(("measured",) + key, logging.INFO, f"comfy_metal: {kernel} {shape_class}: {record['reason']}")
    return record["choice"]


# Calls whose tensor arguments hold more than this are not timed (timing works on a copy of them, one
# candidate at a time: at most this much memory more, once per kernel and shape class, outside any VAE
# budget); the self-checked kernel runs, as decided by a smaller call of its shape class if there was one.
MEASURE_MAX_BYTES = 128 * 2**20
SMALL_TENSOR_ELEMENTS = 4096


def call_shape_class(args, kwargs) -> tuple:
    """What a kernel's measured choice is remembered under: for each tensor argument its dtype and the
    power of two at or above its element count (at least SMALL_TENSOR_ELEMENTS: a sampler's per-step
    flags or a small table do not decide a kernel's speed); strings, bools, dtypes and None by value (the
    options that pick a kernel variant); numbers by type only (a sampler passes each step's sigmas and
    index: by value every step would be a new class, timed with syncs inside the loop)."""
    def one(a):
        if isinstance(a, torch.Tensor):
            size = max(SMALL_TENSOR_ELEMENTS, a.numel())
            return (str(a.dtype).replace("torch.", ""), 1 << (size - 1).bit_length())
        if isinstance(a, (bool, str)) or a is None:
            return a
        if isinstance(a, torch.dtype):                  # an output dtype picks a kernel variant
            return str(a).replace("torch.", "")
        if isinstance(a, (int, float)):
            return type(a).__name__
        if isinstance(a, (tuple, list)):
            return tuple(one(x) for x in a)
        return type(a).__name__
    return tuple(one(a) for a in args) + tuple((k, one(v)) for k, v in sorted(kwargs.items()))


def _copies(args, kwargs):
    """The arguments with every tensor copied (a candidate may write into its arguments)."""
    def one(a):
        if isinstance(a, torch.Tensor):
            return a.clone()
        if isinstance(a, (tuple, list)):
            return type(a)(one(x) for x in a)
        return a
    return [one(a) for a in args], {k: one(v) for k, v in kwargs.items()}


def measured_backend(spec: KernelSpec, args, kwargs, device) -> str:
    """"metal" or "reference" for a self-checked kernel on MPS: the Metal kernel and its reference (the
    platform's own torch ops) are timed once per shape class (`call_shape_class`) with
    `measured_choice`, on a copy of the arguments (one candidate's at a time), and the Metal kernel runs
    only where it was strictly faster, so no kernel makes a Mac slower than the torch ops it replaces. The timing
    synchronises the device, once per kernel and shape class per process. Calls too large to copy
    (MEASURE_MAX_BYTES) follow the choice made for their class, or run the kernel (logged once)."""
    shape_class = call_shape_class(args, kwargs)
    with _lock:
        known = measured.get((spec.name, shape_class))
    if known is not None:
        return known["choice"]
    tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    if nbytes > MEASURE_MAX_BYTES:
        _log_once((spec.name, "unmeasured", shape_class), logging.INFO,
                  f"comfy_metal: {spec.name}: a call with {nbytes / 2**20:.0f} MiB of inputs is not timed "
                  f"(over {MEASURE_MAX_BYTES >> 20} MiB to copy); the self-checked Metal kernel runs")
        return "metal"
    lib = _library_for(spec, "metal")
    held: dict = {}      # one candidate's copies at a time: made at its first run, dropped at the next's

    def on_copies(name, fn):
        def run():
            if held.get("name") != name:
                held.clear()
                held["name"], held["args"] = name, _copies(args, kwargs)
            a, k = held["args"]
            return fn(*a, **k)
        return run

    candidates = {"reference": on_copies("reference", spec.reference),   # the platform op first: ties keep it
                  "metal": on_copies("metal", lambda *a, **k: spec.metal(lib, *a, **k))}
    try:
        choice = measured_choice(spec.name, shape_class, candidates, device)
        held.clear()
    except RuntimeError as e:
        held.clear()
        if _out_of_memory(e):
            raise
        return "reference"               # both failed: the reference raises its own clear error
    with _lock:
        record = measured.get((spec.name, shape_class))
        if record is not None and "reference" not in record["times_ms"]:
            measured.pop((spec.name, shape_class))      # the reference refused this call: bad input,
            choice = "reference"                        # which it reports; nothing is remembered
    return choice


def measured_records() -> list[dict]:
    """Every measured choice so far (JSON-friendly), for the status route and doctor."""
    with _lock:
        records = list(measured.values())
    return [{**r, "shape_class": list(r["shape_class"]) if isinstance(r["shape_class"], tuple)
             else r["shape_class"]} for r in records]


def reset():
    """Forget compiled libraries, decisions and measured choices (tests)."""
    with _lock:
        _libraries.clear()
        _decisions.clear()
        _logged.clear()
        last_backend.clear()
        measured.clear()
