"""Static checks for MSL kernels launched through torch.mps.compile_shader.

``lint_source(src, arg_kinds=None) -> list[str]`` returns human-readable problems
(empty list = clean), each naming the kernel and/or the source line:

* only known attributes: ``buffer(n)``, ``host_name("...")``, ``kernel``,
  ``max_total_threads_per_threadgroup(n)``, the thread-position attributes, and
  the harmless standard ``maybe_unused`` / ``fallthrough`` / ``likely`` / ``unlikely``;
* no ``double`` anywhere, and no unsuffixed floating literal (``0.5`` is float on Metal but a double
  in C++; write ``0.5f``);
* every pointer / reference to a built-in type has an address space (``device``, ``constant``,
  ``thread``, ``threadgroup``): the emulator defines them away, Metal rejects a pointer without one;
* kernel-scope threadgroup memory <= 32 KiB per kernel (sizes from literal /
  ``constexpr`` / ``#define`` dimensions; template kernels per instantiation);
* ``max_total_threads_per_threadgroup(n)`` and literal group-size constants
  (``#define``/``constexpr`` named like ``*GROUP*SIZE*``, ``*TG*THREADS*``...) <= 1024;
* scalars by reference (``constant T& x [[buffer(i)]]``) must be ``long``/``ulong``/
  ``int64_t``/``uint64_t`` (Python int) or ``float`` (Python float);
* with ``arg_kinds`` ({host name: ["tensor", "int", "float", "int[]", "float[]", ...]}),
  every buffer parameter must match what the Python side passes, and the counts agree; a list of ints
  may also bind a params struct (``constant S& p``) whose fields are all int64 (its exact layout);
* ``[[threadgroup(n)]]`` parameters are rejected (compile_shader cannot size them: specialise the source,
  ``metal_kernels/specialize.py``); ``[[function_constant(n)]]`` is accepted (the source is specialised
  before it is compiled);
* everything the strict MSL 3.1 front end rejects (``strict.check``: address spaces, C++ features Metal
  lacks, recursion, standard-library overloads MSL 3.1 does not have...).

The source is preprocessed with clang-19 when available (so macro-stamped
kernels are seen); otherwise a small fallback expands object-like ``#define``\\ s.
"""
from __future__ import annotations

import os
import re
import subprocess
import tempfile

from . import (POSITION_ATTRIBUTES, MSLCompileError, _preprocessor_args, _template_param_names, clang_path,
               parse_kernels)
from .msl_scan import LINE_MARKER_RE, Param, scan_kernel_signatures, split_top_level
from .strict import check as strict_check, unqualified_pointers

__all__ = ["lint_source", "TG_MEMORY_LIMIT", "MAX_GROUP_THREADS"]

TG_MEMORY_LIMIT = 32 * 1024
MAX_GROUP_THREADS = 1024
_ALLOWED_ATTRS = {"buffer", "host_name", "kernel", "max_total_threads_per_threadgroup", "function_constant",
                  "maybe_unused", "fallthrough", "likely", "unlikely"} | set(POSITION_ATTRIBUTES)
_INT64 = {"long", "ulong", "int64_t", "uint64_t", "unsigned long", "signed long", "long long", "unsigned long long"}
_SCALAR_SIZES = {
    "float": 4, "half": 2, "bfloat": 2, "int": 4, "uint": 4, "short": 2, "ushort": 2, "char": 1, "uchar": 1,
    "long": 8, "ulong": 8, "bool": 1, "int8_t": 1, "uint8_t": 1, "int16_t": 2, "uint16_t": 2, "int32_t": 4,
    "uint32_t": 4, "int64_t": 8, "uint64_t": 8, "unsigned": 4, "unsigned int": 4, "size_t": 8,
    "atomic_int": 4, "atomic_uint": 4, "atomic_float": 4, "atomic_bool": 1,
}
_KIND_TEXT = {"tensor": "a tensor (declare a pointer: device T*)", "int": "a Python int (declare constant long&)",
              "float": "a Python float (declare constant float&)",
              "int[]": "a list of ints (declare constant long*, or constant S& for a struct of long fields)",
              "float[]": "a list of floats (declare constant float*)",
              "tensor[]": "a list of tensors (declare an array of pointers)"}


_FLOAT_LITERAL_RE = re.compile(r"(?<![\w.])(?:\d+\.\d*(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?|\d+[eE][-+]?\d+)(?![\w.])")


def _type_size(t: str) -> int | None:
    t = " ".join(re.sub(r"\b(const|volatile|metal::)\b", "", t).replace("metal::", "").split())
    if t in _SCALAR_SIZES:
        return _SCALAR_SIZES[t]
    m = re.fullmatch(r"(packed_)?(float|half|bfloat|int|uint|short|ushort|char|uchar|long|ulong|bool)([234])", t)
    if m:
        n = int(m.group(3))
        base = _SCALAR_SIZES[m.group(2)]
        return base * n if m.group(1) else base * (4 if n == 3 else n)
    m = re.fullmatch(r"(?:metal::)?atomic\s*<\s*(\w+)\s*>", t)
    if m and m.group(1) in _SCALAR_SIZES:
        return _SCALAR_SIZES[m.group(1)]
    return None


# ----------------------------------------------------------------------------- preprocessing
def _preprocess(src: str) -> tuple[str, bool]:
    clang = clang_path()
    if clang:
        with tempfile.TemporaryDirectory(prefix="comfy_metal_lint_") as tmp:
            r = subprocess.run([clang, *_preprocessor_args(tmp, src)], capture_output=True, text=True, timeout=300)
            if r.returncode == 0:
                return r.stdout, True
            raise MSLCompileError("preprocessing failed:\n" + r.stderr.replace(tmp + os.sep, "").strip())
    return _fallback_preprocess(src), False


def _fallback_preprocess(src: str) -> str:
    # strip comments, keeping newlines
    def blank(m):
        return re.sub(r"[^\n]", " ", m.group(0))
    s = re.sub(r"/\*.*?\*/|//[^\n]*", blank, src, flags=re.S)
    # join continuation lines, keeping the line count
    lines = s.split("\n")
    joined = []
    i = 0
    while i < len(lines):
        cur, extra = lines[i], 0
        while cur.endswith("\\") and i + 1 < len(lines):
            i += 1
            extra += 1
            cur = cur[:-1] + " " + lines[i]
        joined.append(cur)
        joined.extend([""] * extra)
        i += 1
    defines: dict[str, str] = {}
    out = []
    for line in joined:
        m = re.match(r"\s*#\s*define\s+([A-Za-z_]\w*)(?!\()\s*(.*)$", line)
        if m:
            defines[m.group(1)] = m.group(2).strip()
            out.append("")
        elif re.match(r"\s*#", line):
            out.append("")
        else:
            out.append(line)
    text = "\n".join(out)
    for _ in range(8):
        changed = False
        for k, v in defines.items():
            new = re.sub(rf"\b{re.escape(k)}\b", lambda _m, v=v: v, text)
            if new != text:
                text, changed = new, True
        if not changed:
            break
    return text


class _Lines:
    """Maps offsets of preprocessed text (with line markers) to original source lines."""

    def __init__(self, pp: str):
        self.starts = []
        self.lines = []
        line = 1
        orig_file_ok = True
        off = 0
        for raw in pp.split("\n"):
            m = LINE_MARKER_RE.match(raw)
            if m:
                mm = re.match(r'\s*#\s*(?:line\s+)?(\d+)\s+"([^"]*)"', raw)
                line = int(mm.group(1))
                orig_file_ok = mm.group(2).endswith("msl_source.metal") or "<" not in mm.group(2)
            else:
                self.starts.append(off)
                self.lines.append(line if orig_file_ok else 0)
                line += 1
            off += len(raw) + 1

    def line(self, offset: int) -> int:
        import bisect
        i = bisect.bisect_right(self.starts, offset) - 1
        return self.lines[i] if i >= 0 else 0


# ----------------------------------------------------------------------------- helpers
def _eval_int(expr: str, consts: dict[str, int]) -> int | None:
    e = expr
    for _ in range(4):
        e = re.sub(r"\b([A-Za-z_]\w*)\b", lambda m: str(consts[m.group(1)]) if m.group(1) in consts else m.group(0), e)
    e = re.sub(r"(?<=\d)[uUlL]+\b", "", e)
    if not re.fullmatch(r"[\d\s()+\-*/%<>]*", e) or not e.strip():
        return None
    e = e.replace("/", "//")
    try:
        v = eval(e, {"__builtins__": {}}, {})  # only digits and arithmetic operators
    except Exception:
        return None
    return int(v) if isinstance(v, int) else None


def _constants(pp: str, raw: str) -> tuple[dict[str, int], list[tuple[str, int]]]:
    consts: dict[str, int] = {}
    named: list[tuple[str, int]] = []
    decl = re.compile(r"\b(?:(?:constant|static|constexpr|const)\s+)+(?:unsigned\s+)?"
                      r"(?:int|uint|long|ulong|short|ushort|size_t|uint32_t|int32_t|uint64_t|int64_t|unsigned)\s+"
                      r"([A-Za-z_]\w*)\s*=\s*([^;{}]+);")
    for _ in range(3):
        for m in decl.finditer(pp):
            v = _eval_int(m.group(2), consts)
            if v is not None:
                consts[m.group(1)] = v
    for m in re.finditer(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)[ \t]+([^\n]+)$", raw, re.M):
        v = _eval_int(re.sub(r"//.*|/\*.*?\*/", "", m.group(2)), consts)
        if v is not None:
            consts.setdefault(m.group(1), v)
            named.append((m.group(1), v))
    for m in decl.finditer(pp):
        if m.group(1) in consts:
            named.append((m.group(1), consts[m.group(1)]))
    return consts, named


_STRUCT_RE = re.compile(r"\bstruct\s+([A-Za-z_]\w*)\s*\{([^{}]*)\}\s*;")


def _int64_structs(text: str) -> set[str]:
    """Names of the structs in `text` whose fields (one or more) are all int64: what a list of Python ints
    binds exactly."""
    out = set()
    for m in _STRUCT_RE.finditer(text):
        fields = [f.strip() for f in m.group(2).split(";") if f.strip()]
        types = [" ".join(f.split()[:-1]) for f in fields]
        if fields and all(t in _INT64 for t in types):
            out.add(m.group(1))
    return out


_TG_RE = re.compile(r"\bthreadgroup\s+((?:(?:const|volatile)\s+)*(?:metal::)?[A-Za-z_][\w:]*(?:\s*<[^;{}()]*?>)?)"
                    r"\s+([A-Za-z_]\w*)\s*((?:\[[^\];]+\]\s*)*);")


def _subst(text: str, mapping: dict[str, str]) -> str:
    for k, v in mapping.items():
        text = re.sub(rf"\b{re.escape(k)}\b", lambda _m, v=v: v, text)
    return text


# ----------------------------------------------------------------------------- lint
def lint_source(src: str, arg_kinds: dict[str, list[str]] | None = None) -> list[str]:
    problems: list[str] = []
    try:
        pp, by_clang = _preprocess(src)
    except MSLCompileError as e:
        return [str(e)]
    if by_clang:  # what Apple's compiler rejects (the same pass runs before every emulated compile)
        problems.extend(strict_check(pp))
    lines = _Lines(pp)
    body_text = re.sub(r'"(?:\\.|[^"\\])*"', lambda m: " " * len(m.group(0)), pp)  # strings blanked
    body_text = "\n".join(" " * len(ln) if LINE_MARKER_RE.match(ln) else ln for ln in body_text.split("\n"))

    def at(off: int) -> str:
        n = lines.line(off)
        return f"line {n}" if n else "generated code"

    # --- attributes
    for m in re.finditer(r"\[\[(.*?)\]\]", body_text, re.S):
        for a in split_top_level(m.group(1)):
            a = a.strip()
            am = re.match(r"([A-Za-z_][\w:]*)\s*(?:\((.*)\))?$", a, re.S)
            name = am.group(1) if am else a
            arg = (am.group(2) or "").strip() if am else ""
            if name == "threadgroup":
                problems.append(f"{at(m.start())}: [[threadgroup({arg})]] parameter: torch.mps.compile_shader "
                                f"cannot size dynamic threadgroup memory; declare a kernel-scope "
                                f"`threadgroup T name[N];` array, or size it in the source with "
                                f"metal_kernels.specialize (threadgroup_memory=...)")
            elif name not in _ALLOWED_ATTRS:
                problems.append(f"{at(m.start())}: unknown or unsupported attribute [[{a}]]")
            elif name == "max_total_threads_per_threadgroup":
                v = _eval_int(arg, {})
                if v is None or v > MAX_GROUP_THREADS or v < 1:
                    problems.append(f"{at(m.start())}: max_total_threads_per_threadgroup({arg}) must be an integer "
                                    f"in 1..{MAX_GROUP_THREADS}")
            elif name == "buffer" and _eval_int(arg, {}) is None:
                problems.append(f"{at(m.start())}: [[buffer({arg})]] needs an integer index")

    # --- double
    for m in re.finditer(r"\bdouble\b", body_text):
        problems.append(f"{at(m.start())}: `double` is not supported by Metal (use float)")

    # --- unsuffixed floating literals: Metal has no double and makes them float (the emulator does too), C++
    # would make them double: the pack writes the type (0.5f / 0.5h).
    for m in _FLOAT_LITERAL_RE.finditer(body_text):
        problems.append(f"{at(m.start())}: floating literal {m.group(0)} has no f/h suffix (float on Metal, a "
                        f"double in C++); write {m.group(0)}f")

    # --- pointers / references without an address space: Metal rejects them ("pointer type must have
    # explicit address space qualifier"); the emulator's shim defines address spaces away.
    for m in unqualified_pointers(body_text):
        problems.append(f"{at(m.start())}: `{' '.join(m.group(0).split())}` has no address space: Metal needs "
                        f"device / constant / thread / threadgroup on every pointer and reference")

    consts, named = _constants(body_text, src)
    # --- literal group sizes
    for name, v in named:
        if re.search(r"(?i)(group|tg|block)", name) and re.search(r"(?i)(size|threads)", name) \
                and v > MAX_GROUP_THREADS:
            problems.append(f"constant {name} = {v}: a threadgroup holds at most {MAX_GROUP_THREADS} threads")

    # --- kernels
    try:
        kernels, _ = parse_kernels(pp)
    except MSLCompileError as e:
        return problems + [str(e)]
    # the last definition of each kernel name (the scanner the emulator parses signatures with)
    definitions = {sig.name: sig for sig in scan_kernel_signatures(body_text) if sig.body_span}
    int64_structs = _int64_structs(body_text)

    for k in kernels:
        mapping = {}
        if k.kind == "inst" and k.template:
            try:
                names = [n.rstrip(".") for n in _template_param_names(k.template)]
                vals = [v.strip() for v in split_top_level(k.targs or "")]
                mapping = dict(zip(names, vals))
            except MSLCompileError:
                mapping = {}
        where = f"kernel {k.host}"
        definition = definitions.get(k.name)
        if definition:
            where += f" ({at(definition.start)})"
        params = [Param(_subst(p.text, mapping)) for p in k.params] if mapping else k.params
        _check_scalars(where, params, problems)
        # threadgroup memory
        if definition:
            body = body_text[definition.body_open:definition.body_close]
            if mapping:
                body = _subst(body, mapping)
            total = 0
            for tm in _TG_RE.finditer(body):
                size = _type_size(tm.group(1))
                if size is None:
                    continue
                count = 1
                ok = True
                for d in re.findall(r"\[([^\]]+)\]", tm.group(3)):
                    v = _eval_int(d, consts)
                    if v is None:
                        ok = False
                        break
                    count *= v
                if ok:
                    total += size * count
            if total > TG_MEMORY_LIMIT:
                problems.append(f"{where}: kernel-scope threadgroup memory is {total} bytes, over the "
                                f"{TG_MEMORY_LIMIT} byte (32 KiB) limit")
        # arg kinds
        if arg_kinds is not None and k.host in arg_kinds:
            _check_kinds(where, params, list(arg_kinds[k.host]), problems, int64_structs)
    if arg_kinds is not None:
        hosts = {k.host for k in kernels}
        for h in arg_kinds:
            if h not in hosts:
                problems.append(f"arg_kinds names kernel {h!r}, which the source does not define "
                                f"(kernels: {', '.join(sorted(hosts))})")
    # de-duplicate, keep order
    seen = set()
    out = []
    for p in problems:
        if p not in seen:
            seen.add(p)
            out.append(p)
    return out


def _base_type(t: str) -> str:
    t = re.sub(r"\b(const|constant|device|thread|threadgroup|volatile|restrict)\b", " ", t)
    return " ".join(t.replace("&", " ").replace("*", " ").split()).replace("metal::", "")


def _check_scalars(where: str, params: list[Param], problems: list[str]) -> None:
    for p in params:
        if p.attr != "buffer" or "&" not in p.type or "*" in p.type:
            continue
        base = _base_type(p.type)
        pname = p.name or p.text
        if base in _INT64 or base == "float":
            continue
        if base in ("int", "uint", "short", "ushort", "char", "uchar", "bool", "int32_t", "uint32_t", "int16_t",
                    "uint16_t", "int8_t", "uint8_t", "unsigned", "unsigned int", "size_t"):
            problems.append(f"{where}: parameter {pname!r} is `{p.type}` but torch passes Python ints as int64; "
                            f"declare constant long& (or ulong&)")
        elif base in ("half", "bfloat"):
            problems.append(f"{where}: parameter {pname!r} is `{p.type}` but torch passes Python floats as "
                            f"float32; declare constant float&")
        elif _type_size(base) is not None:
            problems.append(f"{where}: parameter {pname!r} is `{p.type}`: torch can only pass int64 or float32 "
                            f"scalars by value; pass vectors as a tensor or a list (constant T*)")


def _check_kinds(where: str, params: list[Param], kinds: list[str], problems: list[str],
                 int64_structs: set[str] = frozenset()) -> None:
    bufs = {int(p.attr_arg): p for p in params if p.attr == "buffer" and p.attr_arg.isdigit()}
    if len(bufs) != len(kinds):
        problems.append(f"{where}: the kernel has {len(bufs)} buffer parameters but the Python side passes "
                        f"{len(kinds)} arguments")
    for i, kind in enumerate(kinds):
        p = bufs.get(i)
        if p is None:
            problems.append(f"{where}: argument {i} ({kind}) has no [[buffer({i})]] parameter")
            continue
        t = p.type
        base = _base_type(t)
        pname = p.name or p.text
        ok = True
        if kind in ("tensor",):
            ok = "*" in t
        elif kind == "int":
            ok = "&" in t and "*" not in t and base in _INT64
        elif kind == "float":
            ok = "&" in t and "*" not in t and base == "float"
        elif kind == "int[]":
            ok = re.search(r"\bconstant\b|\bconst\b", t) is not None and (
                ("*" in t and base in _INT64) or (("&" in t or "*" in t) and base in int64_structs))
        elif kind == "float[]":
            ok = "*" in t and base == "float" and re.search(r"\bconstant\b|\bconst\b", t) is not None
        elif kind == "tensor[]":
            ok = t.count("*") >= 2 or "void" in t
        else:
            problems.append(f"{where}: unknown argument kind {kind!r} for argument {i}")
            continue
        if not ok:
            problems.append(f"{where}: argument {i} is {_KIND_TEXT[kind]} but parameter {pname!r} [[buffer({i})]] "
                            f"is declared `{t}`")
    for i in sorted(bufs):
        if i >= len(kinds):
            problems.append(f"{where}: parameter {bufs[i].name or bufs[i].text!r} [[buffer({i})]] gets no argument")
