"""The one MSL source string of the shared library: the .metal files of this folder, the headers they
include, and the part generated from Python tables.

`library_source(only=None)` joins, in order:
  1. the generated prelude: every constant `define`d here (`#define NAME value`), every params struct
     (`Params`: a struct of `long` fields) and every `constexpr_table` (a constexpr function of an int);
  2. common.metal;
  3. each other .metal file (or only the named one), followed by the template instantiations of the
     kernels registered from it (`KernelSpec.instantiate`: host name -> template-id).
`#include "name.h"` lines are replaced by metal_kernels/include/name.h, each header once per library (the
first include wins; later ones become a comment), so the string is self-contained: the same text goes to
`torch.mps.compile_shader` on a Mac and to the MSL emulator.

Params structs: a kernel declares `constant gemv_params& p [[buffer(i)]]`; the launcher passes
`GEMV_PARAMS.pack(M=..., ...)`, a list of Python ints, which torch's compile_shader (and the emulator) bind
as an int64 array, the struct's exact layout. The field order lives here only.
"""
from __future__ import annotations

import pathlib
import re
from typing import Mapping

KERNEL_DIR = pathlib.Path(__file__).resolve().parent
INCLUDE_DIR = KERNEL_DIR / "include"
COMMON_SOURCE = "common.metal"

_defines: dict[str, int] = {}
_structs: dict[str, "Params"] = {}
_tables: dict[str, dict[int, int]] = {}
_INCLUDE_RE = re.compile(r'^[ \t]*#[ \t]*include[ \t]+"([^"]+)"[ \t]*$', re.M)


def define(name: str, value: int) -> int:
    """`#define name value` in the prelude; returns value (so a module can write `X = define("X", 8)`)."""
    if not re.fullmatch(r"[A-Z][A-Z0-9_]*", name):
        raise ValueError(f"MSL constant name {name!r}: use UPPER_CASE")
    value = int(value)
    if _defines.get(name, value) != value:
        raise ValueError(f"MSL constant {name} defined twice, as {_defines[name]} and {value}")
    _defines[name] = value
    return value


def constexpr_table(name: str, table: Mapping[int, int]) -> Mapping[int, int]:
    """`constexpr int name(int k)`: table[k] for the smallest key >= k (the last value past the last key)."""
    values = {int(k): int(table[k]) for k in sorted(table)}
    if _tables.get(name, values) != values:
        raise ValueError(f"MSL table {name} defined twice")
    _tables[name] = values
    return table


class Params:
    """A params struct of int64 (`long`) fields, bound from a list of Python ints."""

    def __init__(self, name: str, fields: str):
        self.name = name
        self.fields = tuple(fields.split())
        if len(set(self.fields)) != len(self.fields):
            raise ValueError(f"params struct {name}: repeated field")
        if name in _structs and _structs[name].fields != self.fields:
            raise ValueError(f"params struct {name} defined twice with different fields")
        _structs[name] = self

    def pack(self, **values) -> list[int]:
        missing = [f for f in self.fields if f not in values]
        extra = [k for k in values if k not in self.fields]
        if missing or extra:
            raise TypeError(f"{self.name}: missing fields {missing}, unknown fields {extra}")
        return [int(values[f]) for f in self.fields]

    def msl(self) -> str:
        return f"struct {self.name} {{\n" + "".join(f"    long {f};\n" for f in self.fields) + "};\n"


def prelude() -> str:
    """The generated MSL that comes first (plain C++: no Metal types)."""
    out = ["// Generated from Python tables (metal_kernels/source.py callers): constants, params structs."]
    out += [f"#define {k} {v}" for k, v in _defines.items()]
    for name, table in _tables.items():
        keys = list(table)
        expr = str(table[keys[-1]])
        for k in reversed(keys[:-1]):
            expr = f"k <= {k} ? {table[k]} : {expr}"
        out.append(f"constexpr int {name}(int k) {{ return {expr}; }}")
    out += [s.msl() for s in _structs.values()]
    return "\n".join(out) + "\n"


def instantiations(file: str) -> str:
    """`template [[host_name("h")]] [[kernel]] decltype(T) T;` for each kernel registered from `file`."""
    from .registry import REGISTRY

    lines = []
    for spec in REGISTRY.values():
        if spec.source != file:
            continue
        for host, template in spec.instantiate.items():
            lines.append(f'template [[host_name("{host}")]] [[kernel]] decltype({template}) {template};')
    return "\n".join(lines) + ("\n" if lines else "")


def metal_sources() -> list[pathlib.Path]:
    """The .metal files of the shared library, in compile order (common.metal first)."""
    files = sorted(KERNEL_DIR.glob("*.metal"))
    files.sort(key=lambda p: (p.name != COMMON_SOURCE, p.name))
    return files


def _inlined(text: str, seen: set[str], origin: str) -> list[tuple[str, str, int]]:
    """The lines of `text` (file `origin`) as (line, file, line number there), each `#include "x.h"` replaced
    by the lines of include/x.h (recursively, each header once per library)."""
    out = []
    for n, line in enumerate(text.split("\n"), 1):
        m = _INCLUDE_RE.fullmatch(line)
        if m is None:
            out.append((line, origin, n))
            continue
        name = m.group(1)
        path = INCLUDE_DIR / name
        if not path.is_file():
            raise FileNotFoundError(f"{origin}: #include \"{name}\": no such header in {INCLUDE_DIR}")
        if name in seen:
            out.append((f"// (#include \"{name}\": already included above)", origin, n))
            continue
        seen.add(name)
        out.append((f"// ---- include/{name} ----", origin, n))
        out += _inlined(path.read_text(), seen, f"include/{name}")
        out.append((f"// ---- end of include/{name} ----", origin, n))
    return out


def inline_includes(text: str, seen: set[str], origin: str) -> str:
    """`text` with each `#include "x.h"` replaced by include/x.h (recursively), each header once."""
    return "\n".join(line for line, _, _ in _inlined(text, seen, origin))


def _library_lines(only: str | None) -> list[tuple[str, str, int]]:
    seen: set[str] = set()
    lines = [(line, "generated prelude", n) for n, line in enumerate(prelude().split("\n"), 1)]
    for path in metal_sources():
        if only is not None and path.name not in (COMMON_SOURCE, only):
            continue
        lines.append((f"// ---- {path.name} ----", path.name, 0))
        lines += _inlined(path.read_text(), seen, path.name)
        if path.name != COMMON_SOURCE:
            lines += [(line, f"{path.name} instantiations", n)
                      for n, line in enumerate(instantiations(path.name).split("\n"), 1)]
    return lines


def library_lines(only: str | None = None) -> list[tuple[str, int]]:
    """(file, line) for each line of library_source(only): where it comes from (a .metal file, a header of
    include/, the generated prelude or a file's instantiations), for tools that report source lines."""
    return [(f, n) for _, f, n in _library_lines(only)]


def library_source(only: str | None = None) -> str:
    """The one MSL source string compiled for the shared library (or common + one file)."""
    return "\n".join(line for line, _, _ in _library_lines(only))
