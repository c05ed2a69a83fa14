"""Profile a predict case in the emulator: the kernel launch code runs against a proxy library whose kernels
profile each launch instead of running it plainly."""
from __future__ import annotations

import bisect
import re
from typing import Callable

import torch

from ..emulator.profiler import Profile
from .cases import PredictCase


class _ProfiledKernel:
    def __init__(self, owner: "ProfilingLibrary", kernel):
        self._owner, self._kernel = owner, kernel

    def __getattr__(self, name):                      # max_threads_per_threadgroup, thread_execution_width, ...
        return getattr(self._kernel, name)

    def __call__(self, *args, threads=None, group_size=None, arg_casts=None):
        self._owner.profiles.append(self._kernel.profile(*args, threads=threads, group_size=group_size,
                                                         arg_casts=arg_casts, sample=self._owner.sample))


class ProfilingLibrary:
    """Stands in for a compiled emulator library: `lib.k(...)` records `lib._lib.k.profile(...)` in
    `profiles`. Outputs of sampled launches hold results for the sampled threadgroups only."""

    def __init__(self, lib, sample: int | None = 3):
        self._lib, self.sample, self.profiles = lib, sample, []

    def __getattr__(self, name):
        if name.startswith("_"):
            raise AttributeError(name)
        return _ProfiledKernel(self, getattr(self._lib, name))


def profile_case(case: PredictCase, lib) -> list[Profile]:
    """The profiles of the launches `case.run` makes (each scaled by `case.repeat`)."""
    proxy = ProfilingLibrary(lib, case.sample)
    with torch.no_grad():
        case.run(proxy, torch.device("cpu"))
    if not proxy.profiles:
        raise RuntimeError(f"predict case {case.label!r} launched no kernel")
    return [p.scaled(case.repeat) if case.repeat > 1 else p for p in proxy.profiles]


_MARK = re.compile(r"^// ---- (end of )?(\S+) ----$")


def source_locator(src: str) -> Callable[[int], str]:
    """line of the concatenated library source (dispatch.library_source) -> "file.metal:line" or
    "include/x.h:line": source.py marks each file's start and each inlined header's start and end, and the
    lines after a header's end are the including file's again (its include line counts as one)."""
    where: list[str] = [""]                     # where[i]: line i + 1 of src
    stack: list[list] = []                      # [file, its last line so far]
    for ln in src.splitlines():
        m = _MARK.match(ln)
        if m and m.group(1):                    # end of a header: back to the file that included it
            if len(stack) > 1:
                stack.pop()
            where.append(f"{stack[-1][0]}:{stack[-1][1]}" if stack else "")
            continue
        if m and m.group(2).startswith("include/") and stack:
            stack[-1][1] += 1                   # the include line
            where.append(f"{stack[-1][0]}:{stack[-1][1]}")
            stack.append([m.group(2), 0])
            continue
        if m:                                   # a .metal file (the marker is its line 0)
            stack = [[m.group(2), 0]]
            where.append(f"{m.group(2)}:0")
            continue
        if stack:
            stack[-1][1] += 1
            where.append(f"{stack[-1][0]}:{stack[-1][1]}")
        else:
            where.append("")

    def locate(line: int) -> str:
        return where[line] if 0 < line < len(where) and where[line] else f"line {line}"
    return locate
