"""CPU emulator for Metal Shading Language compute kernels.

Mirrors ``torch.mps.compile_shader``::

    lib = compile_library(src)          # MSLCompileError (clang's message) on bad source
    lib.my_kernel(t0, t1, 17, 0.5, [1, 2, 3], threads=N, group_size=G, arg_casts=None)

The .metal source is preprocessed with clang-19 (stub ``<metal_stdlib>`` & co., ``__METAL__`` defined),
kernel signatures are parsed from the preprocessed text (``msl_scan``), a launcher is generated
per kernel, and the whole thing is compiled as C++20 with ``shim.h`` force-included
into a shared object that is cached by content hash and loaded with ctypes.

Mechanical rewrites applied to the preprocessed source (``rewrite.py``; nothing else is changed):

1. ``template [[host_name("x")]] kernel ... foo<T>(...);`` explicit instantiations
   (also the ``decltype(foo<T>) foo<T>;`` and typedef'd forms) are removed; the generated
   launcher instantiates ``foo<T>`` by calling it.
2. threadgroup variable declarations ``threadgroup T name[N][M];`` become
   references into per-threadgroup storage (``auto& name = *(T(*)[N][M])...``),
   which is filled with 0xFF (NaN) bytes at the start of every threadgroup.
3. vector construction and casts -- ``float4(...)``, ``vec<T, 4>(...)``, ``T(...)`` through a template
   parameter or typedef, ``static_cast``, ``(float4)x``, ``int2 a(1, 2);`` -- go through ``__emu::vec``
   (MSL's splat / element-wise conversion / concatenation, never clang's vector bitcast); braced
   arguments through ``__emu::ilist``.
4. half, bfloat and unsuffixed literals: ``1.5h`` -> ``((half)1.5f)``, ``0.5`` -> ``0.5f``.
5. functions overloaded on address spaces only are folded into one; function constants without a value
   get a placeholder (their kernels are refused at launch: specialise the source with
   ``metal_kernels.specialize.specialize``, the route the Mac takes too).

SIMD-group matrices hold each lane's two elements in the hardware layout (``thread_elements()``); a
product is a collective of the 32 lanes. ``[[threadgroup(n)]]`` parameters compile and are refused at
launch unless the source is specialised (torch's kernels cannot size them either).

Known limitations (what it does not handle yet, with the corpus figures): README.md, "Known limitations".

Before every compile, a strict MSL 3.1 front end (``strict.py``) rejects what Apple's compiler rejects
(``MSLCompileError`` with the spec's rule) and accepts what it accepts (MLX, ggml and PyTorch's MPS kernels:
README.md has the corpus figures). Runtime checks: guard regions around every buffer
(``OutOfBoundsWrite``), NaN filled threadgroup memory and out-of-bounds reads, barrier divergence
(``BarrierDivergence``), schedule perturbation (forward / reverse / shuffle), crashes (SIGSEGV, SIGFPE, ...)
reported as ``KernelCrash``; in checked launches (default; ``COMFY_METAL_EMU_CHECKS=0`` or
``set_checks(False)`` to skip) a shadow-memory race detector (``DataRace``) and two poison re-runs with
large finite fills (``UninitializedRead``). See README.md.
"""
from __future__ import annotations

from .build import GENERATOR_VERSION, compile_library
from .codegen import generate_launchers
from .errors import (BarrierDivergence, DataRace, EmulatorError, KernelCrash, MSLCompileError, OutOfBoundsWrite,
                     UninitializedRead)
from .launch import GUARD, SIMD_WIDTH, Kernel, Library, checks_enabled, set_checks
from .parse import MAX_THREADS_PER_GROUP, POSITION_ATTRIBUTES, KernelDecl, _template_param_names, parse_kernels
from .rewrite import rewrite_source
from .schedule import get_schedule, schedule, set_schedule
from .toolchain import _preprocessor_args, available, clang_path

__all__ = [
    "compile_library", "available", "clang_path", "set_schedule", "get_schedule", "schedule",
    "EmulatorError", "MSLCompileError", "OutOfBoundsWrite", "BarrierDivergence", "KernelCrash", "DataRace",
    "UninitializedRead", "Library", "Kernel", "GENERATOR_VERSION", "set_checks", "checks_enabled",
]
