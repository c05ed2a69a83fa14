"""Pick Metal or the pure-torch reference for each call, compile the one shared library lazily,
and self-check each kernel once against its reference before trusting it.

Backends (COMFY_METAL_BACKEND):
  auto (default)  Metal for MPS tensors once the library compiled, the kernel passed its
                  self-check and it was timed faster than its reference (the platform's torch ops) for
                  the call's shape class (`measured_backend`; the decision is saved per machine and
                  version, dispatch_decisions.py); the reference everywhere else (CPU, CUDA).
  reference       the reference for every kernel.
  emulator        CPU tensors run the real Metal kernels and launch code through the project's
                  MSL emulator (clang-19); MPS tensors still use Metal.
COMFY_METAL_REFERENCE=name,name (or "all") forces the reference for the named kernels.
"""
from __future__ import annotations

import contextlib
import inspect
import logging
import math
import os
import pathlib
import threading
from typing import Any

import torch

from . import dispatch_decisions
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


def compile_library(backend: str, only: str | None = None, constants: dict | None = None,
                    threadgroup_memory: dict | None = None):
    """Compile (once per process, backend and specialisation) the shared library. Raises MetalUnavailable.

    `constants` ({index or name: value}) and `threadgroup_memory` ({kernel: {n: bytes}}) specialise the source
    (specialize.py) before either backend compiles it: torch.mps.compile_shader has no function-constant values
    and no threadgroup-memory lengths, so the Mac and the emulator compile the same specialised text."""
    key = backend if only is None else f"{backend}:{only}"
    if constants or threadgroup_memory:
        key += ":" + repr((sorted((str(k), repr(v)) for k, v in (constants or {}).items()),
                           sorted((k, sorted(v.items())) for k, v in (threadgroup_memory or {}).items())))
    with _lock:
        if key in _libraries:
            lib = _libraries[key]
            if isinstance(lib, Exception):
                raise lib
            return lib
        try:
            src = library_source(only)
            if constants or threadgroup_memory:
                from .specialize import specialize

                src = specialize(src, constants, threadgroup_memory)
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


def _tensors_in(value):
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors_in(v)


def _bound_arguments(spec: KernelSpec, args, kwargs):
    """The call's arguments by the reference's parameter names (what `KernelSpec.writes` names)."""
    return inspect.signature(spec.reference).bind(*args, **kwargs)


def undeclared_writes(spec: KernelSpec, run, args, kwargs) -> list[str]:
    """The tensor arguments (by parameter name) that `run(*args, **kwargs)` changed although `spec.writes`
    does not name them: the measured dispatch times a kernel on the caller's own tensors, copying only
    those it writes."""
    bound = _bound_arguments(spec, args, kwargs)
    before = {name: [t.clone() for t in _tensors_in(value)] for name, value in bound.arguments.items()
              if name not in spec.writes}
    run(*args, **kwargs)

    def same(a, b):
        return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))
    return [name for name, saved in before.items()
            if not all(same(t.contiguous(), s.contiguous()) for t, s in zip(_tensors_in(bound.arguments[name]), saved))]


def self_check(spec: KernelSpec, backend: str, device: torch.device) -> str | None:
    """Run the kernel against its reference on small inputs. None if it agrees (and writes no argument
    that `spec.writes` does not name), else why not."""
    lib = _library_for(spec, backend)
    for i, (args, kwargs) in enumerate(spec.self_check_cases(device)):
        outputs = []
        for who, run, a, k in (("reference", spec.reference, *_to_cpu((args, kwargs))),
                               ("kernel", lambda *a, **k: spec.metal(lib, *a, **k), args, kwargs)):
            wrote = undeclared_writes(spec, lambda *a, **k: outputs.append(run(*a, **k)), a, k)
            if wrote:
                return (f"self-check case {i}: the {who} wrote into {', '.join(wrote)}, which the KernelSpec's "
                        f"writes={tuple(spec.writes)} does not name")
        want, got = outputs[0], _to_cpu(outputs[1])
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

# (kernel, shape class) -> {"kernel", "shape_class", "candidates", "choice", "times_ms", "reason", "device",
# "measured_at", "source"}: source "measured" (timed in this process) or "saved" (read from the decisions
# file, dispatch_decisions).
measured: dict[tuple, dict] = {}
MEASURE_CALLS = 10               # calls timed between two syncs, at least (after a warm-up)
MEASURE_MAX_CALLS = 100
MEASURE_TARGET_SECONDS = 0.02    # more calls for tiny kernels: a batch lasts about this long
MEASURE_SLOW_SECONDS = 0.5       # a call longer than this (a long video's attention) is timed alone, once
MEASURE_MARGIN = 0.05            # the pack's kernel must be this much faster than the platform op
_clock = None      # None: time.perf_counter (tests put a fake timing source here)
_read_files: set[str] = set()    # decision files already read into `measured`


def _device_sync(device: torch.device) -> None:
    if device.type == "mps":
        torch.mps.synchronize()
    elif device.type == "cuda":
        torch.cuda.synchronize(device)


def measuring_enabled(device: torch.device) -> bool:
    """Whether measured_choice times candidates on `device` (MPS only: elsewhere the platform op is
    the normal path and the pack's kernels run only when asked for)."""
    return torch.device(device).type == "mps"


def _known(key: tuple, names: list[str]) -> dict | None:
    """The decision for `key` among the candidates `names`: measured in this process, else saved in the
    decisions file for this environment (read once per file). A decision between other candidates (say,
    ComfyUI's attention was another function then) does not count."""
    with _lock:
        record = measured.get(key)
        if record is None:
            path = str(dispatch_decisions.decisions_path())
            if path not in _read_files:
                _read_files.add(path)
                for saved in dispatch_decisions.load(pathlib.Path(path)):
                    measured.setdefault((saved["kernel"], saved["shape_class"]), {**saved, "source": "saved"})
                record = measured.get(key)
    return record if record is not None and list(record["candidates"]) == names else None


def _time_candidates(candidates: dict, device, sync, clock, before) -> tuple[dict, dict]:
    """({name: ms per call}, {name: error}). Each candidate runs once to warm up (compiles, caches,
    allocations) and once alone, which sizes its batches: MEASURE_CALLS or more calls between two syncs
    (up to MEASURE_MAX_CALLS, for a batch of about MEASURE_TARGET_SECONDS), in two rounds of opposite order
    (neither candidate gains from the GPU clocking up), the faster round counting. A call over
    MEASURE_SLOW_SECONDS is timed alone (the sync is then a negligible part of it). `before(name)` runs
    before every batch, outside the timing."""
    def batch(name, calls):
        if before is not None:
            before(name)
        sync(device)
        t0 = clock()
        for _ in range(calls):
            candidates[name]()
        sync(device)
        return (clock() - t0) / calls

    def guarded(name, calls):
        try:
            return batch(name, calls)
        except Exception as e:                     # noqa: BLE001 - a failing candidate just loses
            if _out_of_memory(e):
                raise
            failed[name] = f"{type(e).__name__}: {e}"
            return None

    failed: dict[str, str] = {}
    alone: dict[str, float] = {}
    for name in candidates:
        if guarded(name, 1) is None:                # the warm-up
            continue
        t = guarded(name, 1)                        # one call alone
        if t is not None:
            alone[name] = t
    rounds: dict[str, list[float]] = {name: [] for name in alone}
    for order in (list(alone), list(reversed(alone))):
        for name in order:
            if name in failed or alone[name] > MEASURE_SLOW_SECONDS:
                continue
            calls = math.ceil(MEASURE_TARGET_SECONDS / max(alone[name], 1e-9))
            t = guarded(name, min(MEASURE_MAX_CALLS, max(MEASURE_CALLS, calls)))
            if t is not None:
                rounds[name].append(t)
    return {n: min(rounds[n] or [alone[n]]) * 1e3 for n in alone if n not in failed}, failed


def measured_choice(kernel: str, shape_class, candidates: dict, device, *, sync=None, clock=None,
                    before=None) -> str:
    """The name of the candidate to run for (kernel, shape_class): `candidates` maps names to zero-argument
    callables doing the same work, the platform op first. Decided once per environment: timed at the
    first call (`_time_candidates`; `before(name)` runs before each timed batch, outside the timing), kept
    in `measured` and in the decisions file (dispatch_decisions), read back by later processes.

    Another candidate is chosen only if it is more than MEASURE_MARGIN faster than the first one, so the
    pack's kernel must clearly beat the platform op. A candidate that raises is never chosen (its error
    is in the record's reason). A decision where the platform op raised is not kept (the inputs are most
    likely bad: the caller's real call reports it). `sync(device)` and `clock()` default to the device
    synchronise and time.perf_counter; tests pass fakes. The records are what the status route,
    `doctor` and the badges show (`measured_records`)."""
    import time

    key = (kernel, shape_class)
    names = list(candidates)
    known = _known(key, names)
    if known is not None:
        return known["choice"]
    device = torch.device(device)
    times, failed = _time_candidates(candidates, device, sync or _device_sync, clock or _clock or time.perf_counter,
                                     before)
    if not times:
        raise RuntimeError(f"{kernel}: every candidate failed for {shape_class}: {failed}")
    platform_op = names[0]
    rivals = [n for n in names[1:] if n in times]
    best = min(rivals, key=lambda n: times[n]) if rivals else None
    if platform_op not in times:
        choice = best
    elif best is not None and times[best] * (1 + MEASURE_MARGIN) < times[platform_op]:
        choice = best
    else:
        choice = platform_op
    others = ", ".join(f"{n} {t:.3g} ms" for n, t in times.items() if n != choice)
    reason = f"measured {choice} {times[choice]:.3g} ms" + (f" vs {others}" if others else "")
    if choice == platform_op and best is not None and times[best] < times[platform_op]:
        reason += f" ({best} not {MEASURE_MARGIN:.0%} faster)"
    if failed:
        reason += "; failed: " + "; ".join(f"{n}: {m}" for n, m in failed.items())
    if platform_op in failed:
        _log_once(("measured",) + key, logging.INFO, f"comfy_metal: {kernel} {shape_class}: {reason} (not kept)")
        return choice
    record = {"kernel": kernel, "shape_class": shape_class, "candidates": names, "choice": choice,
              "times_ms": times, "reason": reason, "device": device.type,
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "source": "measured"}
    with _lock:
        record = measured.setdefault(key, record)
        to_save = list(measured.values())
    dispatch_decisions.save(to_save)
    _log_once(("measured",) + key, logging.INFO, f"comfy_metal: {kernel} {shape_class}: {record['reason']}")
    return record["choice"]


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


def _scratch_for_writes(spec: KernelSpec, args, kwargs):
    """(args, kwargs, reset) for timing: the call's own arguments, except those the kernel writes
    (`spec.writes`), which are copies; `reset()` sets the copies back to the caller's values, so every
    candidate starts from the same inputs. Nothing else is copied (a weight bank is read in place)."""
    if not spec.writes:
        return args, kwargs, None
    bound = _bound_arguments(spec, args, kwargs)
    pairs = []

    def scratch(value):
        if isinstance(value, torch.Tensor):
            pairs.append((value.clone(), value))
            return pairs[-1][0]
        if isinstance(value, (tuple, list)):
            return type(value)(scratch(v) for v in value)
        return value

    for name in spec.writes:
        if name in bound.arguments:
            bound.arguments[name] = scratch(bound.arguments[name])

    def reset():
        for copy, original in pairs:
            copy.copy_(original)
    return bound.args, bound.kwargs, reset


def measured_backend(spec: KernelSpec, args, kwargs, device) -> str:
    """"metal" or "reference" for a self-checked kernel on MPS: the Metal kernel and its reference (the
    platform's own torch ops) are timed with `measured_choice` once per shape class (`call_shape_class`)
    and environment, on the call's own inputs whatever their size (only the arguments the kernel writes
    are copied), and the Metal kernel runs only where it was clearly faster, so no kernel makes a Mac
    slower than the torch ops it replaces."""
    shape_class = call_shape_class(args, kwargs)
    known = _known((spec.name, shape_class), ["reference", "metal"])
    if known is not None:
        return known["choice"]
    lib = _library_for(spec, "metal")
    try:
        a, k, reset = _scratch_for_writes(spec, args, kwargs)
    except Exception as e:
        if not _out_of_memory(e):
            raise
        _log_once((spec.name, "no-scratch", shape_class), logging.WARNING,
                  f"comfy_metal: {spec.name}: no memory for a copy of the arguments it writes, to time it; "
                  "the reference runs for this call")
        return "reference"
    candidates = {"reference": lambda: spec.reference(*a, **k),   # the platform op first
                  "metal": lambda: spec.metal(lib, *a, **k)}
    try:
        choice = measured_choice(spec.name, shape_class, candidates, device,
                                 before=None if reset is None else lambda name: reset())
    except RuntimeError as e:
        if _out_of_memory(e):
            raise
        return "reference"               # both failed: the reference raises its own clear error
    if _known((spec.name, shape_class), ["reference", "metal"]) is None:
        return "reference"               # the reference refused this call (bad input): it reports it
    return choice


def measured_records() -> list[dict]:
    """Every measured choice known to this process (JSON-friendly), for the status route and doctor:
    those timed here and those read from the decisions file."""
    with _lock:
        records = list(measured.values())
    return [{**r, "shape_class": list(r["shape_class"]) if isinstance(r["shape_class"], tuple)
             else r["shape_class"]} for r in records]


def reset():
    """Forget compiled libraries, decisions and measured choices (tests); the decisions file is read
    again at the next measured choice."""
    with _lock:
        _libraries.clear()
        _decisions.clear()
        _logged.clear()
        last_backend.clear()
        measured.clear()
        _read_files.clear()
    dispatch_decisions.forget_logged()
