"""One description per Metal kernel: its MSL entry points, its pure-torch reference,
the Python glue that launches it, how to make self-check inputs, and its tolerance.

Domain modules (fp8.py, linear.py, ...) describe their kernels with `KernelSpec` and
call `register(spec)`, which returns the public dispatching function.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Any, Callable, Mapping

import torch

# What the Python side passes for each [[buffer(i)]], checked by the lint against the MSL signature.
ARG_KINDS = ("tensor", "int", "float", "int[]", "float[]")


@dataclasses.dataclass(frozen=True)
class KernelSpec:
    """A public kernel function.

    name: public name, e.g. "fp8_decode" (also the name used in COMFY_METAL_REFERENCE).
    source: the .metal file (in metal_kernels/) holding the entry points.
    entry_points: MSL host name -> the kinds of the arguments the launcher passes, in buffer order.
    reference: pure torch, the public signature.
    metal: `metal(lib, *args, **kwargs)`: the same signature with the compiled library first;
        launches the entry points with exactly the arguments, casts, grid and group sizes used on MPS.
    self_check_cases: `cases(device) -> list[(args, kwargs)]`: small inputs on `device` for the
        one-time self-check (odd sizes welcome).
    atol / rtol: tolerance of the Metal result against the reference (compared in float32).
    compare: optional `compare(metal_out, reference_out) -> str | None` (None = ok) replacing the
        default tolerance check, for outputs that are not a single float tensor.
    measured_by_caller: the caller times this kernel against the platform op itself (attention against
        ComfyUI's, the GEMVs against decode + matmul), so the dispatch does not time it again against
        its reference (see dispatch.measured_backend).
    predict_cases: `predict_cases() -> list[perf.PredictCase]`, the kernel at real model shapes for
        `bench --predict` (None: its entry in metal_kernels/perf/cases.py's CASES, if any).
    writes: the parameters (the reference's names) of the tensors the kernel writes into, e.g. ("acc",)
        for an accumulation, ("flags",) for a sampler step's NaN flags. The measured dispatch times a
        kernel on the call's own inputs and copies only these; the self-check fails a kernel that writes
        into any other argument.
    instantiate: host name -> the template-id of a kernel template of `source` (e.g.
        "gemv<gemv_vec<gemv_e4m3fn>, half>"); source.library_source writes one
        `template [[host_name(...)]]` line for each after the file. Entry points not listed here are
        kernels the file defines itself.
    """

    name: str
    source: str
    entry_points: Mapping[str, tuple[str, ...]]
    reference: Callable[..., Any]
    metal: Callable[..., Any]
    self_check_cases: Callable[[torch.device], list]
    atol: float = 1e-5
    rtol: float = 1e-5
    compare: Callable[[Any, Any], str | None] | None = None
    measured_by_caller: bool = False
    predict_cases: Callable[[], list] | None = None
    writes: tuple[str, ...] = ()
    instantiate: Mapping[str, str] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        if self.writes:
            params = inspect.signature(self.reference).parameters
            unknown = [w for w in self.writes if w not in params]
            if unknown:
                raise ValueError(f"kernel {self.name}: writes names {unknown}, which are not parameters of its "
                                 f"reference {list(params)}")
        for entry, kinds in self.entry_points.items():
            bad = [k for k in kinds if k not in ARG_KINDS]
            if bad:
                raise ValueError(f"kernel {self.name}: entry point {entry} has unknown argument kinds {bad}")
        unknown = sorted(set(self.instantiate) - set(self.entry_points))
        if unknown:
            raise ValueError(f"kernel {self.name}: instantiations {unknown} are not entry points")


REGISTRY: dict[str, KernelSpec] = {}


def register(spec: KernelSpec) -> Callable[..., Any]:
    """Add `spec` to the registry and return its public function (Metal or reference by device)."""
    if spec.name in REGISTRY and REGISTRY[spec.name] is not spec:
        raise ValueError(f"kernel {spec.name!r} is registered twice")
    REGISTRY[spec.name] = spec
    from . import dispatch

    @functools.wraps(spec.reference)
    def public(*args, **kwargs):
        return dispatch.call(spec, args, kwargs)

    public.spec = spec
    public.__name__ = spec.name
    public.__qualname__ = spec.name
    return public


def entry_point_kinds() -> dict[str, tuple[str, ...]]:
    """Every MSL host name of every registered kernel -> the argument kinds its launcher passes."""
    kinds: dict[str, tuple[str, ...]] = {}
    for spec in REGISTRY.values():
        kinds.update(spec.entry_points)
    return kinds
