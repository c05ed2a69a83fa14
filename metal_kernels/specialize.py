"""Specialise MSL source text: function constants and ``[[threadgroup(n)]]`` sizes become part of the source.

Metal gives function constants their values when a pipeline is created (``MTLFunctionConstantValues``) and
sizes ``[[threadgroup(n)]]`` kernel parameters when a kernel is encoded (``setThreadgroupMemoryLength``).
``torch.mps.compile_shader`` offers neither: its library creates every pipeline with
``newFunctionWithName:`` and ``newComputePipelineStateWithFunction:`` (no constant values), and its kernel
function has no threadgroup-memory setter (``aten/src/ATen/native/mps/MetalShaderLibrary.h``, ``OperationUtils.mm``).
So the values go into the source, and the specialised source is what both the Mac (``torch.mps.compile_shader``)
and the emulator compile -- one route, see ``dispatch.compile_library(backend, constants=..., threadgroup_memory=...)``::

    src = specialize(src, {0: True, "n": 4}, threadgroup_memory={"my_kernel": {0: 4096}})

* ``constant bool has_bias [[function_constant(0)]];`` becomes ``constexpr constant bool has_bias = bool(true);``
  (a key is the constant's index or its name); ``is_function_constant_defined(has_bias)`` becomes ``true``.
  A constant left without a value must be optional -- asked by ``is_function_constant_defined`` (Metal's
  ``MTLFunctionConstant.required`` rule) -- and is then undefined: ``false`` there, ``T()`` as a value.
  ``[[buffer(5), function_constant(has_mask)]]`` on a kernel parameter keeps its buffer: a parameter whose
  constant is false is simply not bound by the caller.
* ``threadgroup T* tmp [[threadgroup(0)]]`` of kernel ``my_kernel`` leaves the parameter list and becomes a
  kernel-scope ``threadgroup`` array of that many bytes (16-byte aligned, a multiple of 16 as
  ``setThreadgroupMemoryLength`` requires) with ``threadgroup T* tmp`` pointing at it.

Works on the source as written (comments and strings are skipped; index expressions may use integer
``#define``\\ s); kernels stamped out by macros cannot have their threadgroup parameters sized this way.
"""
from __future__ import annotations

import re

from .emulator.msl_scan import code_only, function_constants, scan_kernel_signatures, split_top_level

__all__ = ["specialize", "SpecializationError"]

_INT_TYPES = {"char", "uchar", "short", "ushort", "int", "uint", "long", "ulong", "int8_t", "uint8_t", "int16_t",
              "uint16_t", "int32_t", "uint32_t", "int64_t", "uint64_t", "size_t"}
_FLOAT_TYPES = {"float", "half", "bfloat"}


class SpecializationError(ValueError):
    """A constant or threadgroup size that does not fit the source (unknown, missing, wrong type)."""


def _defines(code: str) -> dict[str, str]:
    return {m.group(1): m.group(2).strip()
            for m in re.finditer(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)[ \t]+([^\n]+)$", code, re.M)}


def _eval_index(expr: str, defines: dict[str, str]) -> int | None:
    for _ in range(8):
        new = re.sub(r"\b[A-Za-z_]\w*\b", lambda m: f"({defines[m.group(0)]})" if m.group(0) in defines else m.group(0),
                     expr)
        if new == expr:
            break
        expr = new
    expr = re.sub(r"(?<=\d)[uUlL]+\b", "", expr)
    if not re.fullmatch(r"[\d\s()+\-*%<>|&^~]*", expr) or not expr.strip():
        return None
    try:
        v = eval(expr, {"__builtins__": {}}, {})  # digits and integer operators only
    except Exception:
        return None
    return v if isinstance(v, int) else None


def _literal(ctype: str, name: str, value) -> str:
    base = re.sub(r"\b(const|metal::)\b|metal::", "", ctype).strip()
    m = re.fullmatch(r"([a-z_0-9]+?)([234])?", base)
    scalar, n = (m.group(1), int(m.group(2) or 1)) if m else (base, 1)
    values = list(value) if isinstance(value, (list, tuple)) else [value]
    if len(values) != n:
        raise SpecializationError(f"function constant {name!r} is a {ctype}: give {n} value(s), got {value!r}")
    out = []
    for v in values:
        if scalar == "bool":
            if not isinstance(v, bool):
                raise SpecializationError(f"function constant {name!r} is a {ctype}: give True/False, got {v!r}")
            out.append("true" if v else "false")
        elif scalar in _INT_TYPES:
            if isinstance(v, bool) or not isinstance(v, int):
                raise SpecializationError(f"function constant {name!r} is a {ctype}: give an int, got {v!r}")
            out.append(str(v))
        elif scalar in _FLOAT_TYPES:
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v != v or abs(v) == float("inf"):
                raise SpecializationError(f"function constant {name!r} is a {ctype}: give a finite number, "
                                          f"got {v!r}")
            out.append(repr(float(v)) + "f")
        else:
            raise SpecializationError(f"function constant {name!r}: type {ctype} is not a scalar or vector type")
    return f"{base}({', '.join(out)})"


def specialize(src: str, constants: dict | None = None, threadgroup_memory: dict | None = None) -> str:
    """`src` with the given function constant values ({index or name: value}) and [[threadgroup(n)]] sizes
    ({kernel name: {n: bytes}}) written into it. Raises SpecializationError naming what does not fit."""
    constants = dict(constants or {})
    threadgroup_memory = {k: dict(v) for k, v in (threadgroup_memory or {}).items()}
    code = code_only(src)
    defines = _defines(code)
    edits: list[tuple[int, int, str]] = []

    declared = function_constants(code)
    by_key: dict = {}
    for fc in declared:
        by_key[fc.name] = fc
        idx = _eval_index(fc.index, defines)
        if idx is not None:
            by_key.setdefault(idx, fc)
    values: dict[str, object] = {}
    for key, value in constants.items():
        fc = by_key.get(key)
        if fc is None:
            known = ", ".join(f"{f.name} (index {f.index})" for f in declared) or "none"
            raise SpecializationError(f"no function constant {key!r} in this source (declared: {known})")
        if fc.name in values:
            raise SpecializationError(f"function constant {fc.name!r} is given twice (by index and by name)")
        values[fc.name] = value
    missing = [f"{fc.name} (index {fc.index}, {fc.type})" for fc in declared
               if fc.name not in values and not fc.optional]
    if missing:
        raise SpecializationError(
            "function constants without a value: " + ", ".join(missing) + " (a constant the source never asks "
            "is_function_constant_defined() about is required, as Metal's MTLFunctionConstant.required)")
    for fc in declared:
        init = _literal(fc.type, fc.name, values[fc.name]) if fc.name in values else f"{fc.type}()"
        edits.append((fc.start, fc.end, f"constexpr constant {fc.type} {fc.name} = {init};"))
        for m in re.finditer(rf"\bis_function_constant_defined\s*\(\s*{fc.name}\s*\)", code):
            edits.append((m.start(), m.end(), "true" if fc.name in values else "false"))
    # [[buffer(5), function_constant(has_mask)]] -> [[buffer(5)]]
    for m in re.finditer(r"\[\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\]", code):
        if "function_constant" not in m.group(1) or any(fc.start <= m.start() < fc.end for fc in declared):
            continue
        attrs = split_top_level(src[m.start(1):m.end(1)])
        keep = [a.strip() for a in attrs if not re.match(r"\s*function_constant\s*\(", a)]
        if len(keep) != len(attrs):
            edits.append((m.start(), m.end(), f"[[{', '.join(keep)}]]" if keep else ""))

    for kernel, sizes in threadgroup_memory.items():
        sigs = [s for s in scan_kernel_signatures(code) if s.name == kernel and s.body_span]
        if not sigs:
            raise SpecializationError(f"threadgroup_memory: no kernel definition named {kernel!r} in the source "
                                      f"(kernels stamped out by macros cannot be sized here)")
        for sig in sigs:
            pieces = split_top_level(code[sig.params_open + 1:sig.params_close])
            offsets, pos = [], sig.params_open + 1
            for piece in pieces:
                offsets.append((pos, pos + len(piece)))
                pos += len(piece) + 1
            found = set()
            decls = []
            for k, ((a, b), p) in enumerate(zip(offsets, sig.parameters())):
                if p.attr != "threadgroup" or _eval_index(p.attr_arg, defines) not in sizes:
                    continue
                n = _eval_index(p.attr_arg, defines)
                nbytes = sizes[n]
                if not isinstance(nbytes, int) or nbytes <= 0 or nbytes % 16:
                    raise SpecializationError(f"kernel {kernel!r}, [[threadgroup({n})]]: {nbytes!r} bytes; Metal needs "
                                              f"a positive multiple of 16 (setThreadgroupMemoryLength)")
                if "*" not in p.type:
                    raise SpecializationError(f"kernel {kernel!r}, [[threadgroup({n})]] parameter {p.name!r} is "
                                              f"`{p.type}`: only pointer parameters can be sized")
                found.add(n)
                # drop the parameter with one neighbouring comma
                if k + 1 < len(offsets):
                    edits.append((a, offsets[k + 1][0], ""))
                elif k > 0:
                    edits.append((offsets[k - 1][1], b, ""))
                else:
                    edits.append((a, b, ""))
                store = f"_tgmem{n}_{p.name}"
                decls.append(f" threadgroup float4 {store}[{nbytes // 16}]; {p.type} {p.name} = "
                             f"reinterpret_cast<{p.type}>({store});")
            if set(sizes) - found:
                raise SpecializationError(f"kernel {kernel!r} has no [[threadgroup(n)]] pointer parameter for "
                                          f"n = {sorted(set(sizes) - found)}")
            edits.append((sig.body_open + 1, sig.body_open + 1, "".join(decls)))

    out, last = [], 0
    for a, b, text in sorted(edits, key=lambda e: (e[0], e[1])):
        if a < last:
            raise SpecializationError("overlapping specialisation edits (a function constant used in a kernel "
                                      "parameter list being sized?)")
        out.append(src[last:a])
        out.append(text)
        last = b
    out.append(src[last:])
    return "".join(out)
