"""Strict front end: reject what Apple's Metal compiler (MSL 3.1) rejects, before the emulator compiles.

The emulator's own build (shim.h) is permissive C++20: address spaces are empty macros and the standard
library is reachable. This pass re-reads the same preprocessed source with clang-19 in C++-for-OpenCL 2021
mode, syntax only, where

* ``device``/``threadgroup``/``constant``/``thread`` are real address spaces (OpenCL global/local/constant/
  private; ``constant`` implies ``const``), so a device pointer passed as a thread pointer, or a threadgroup array
  assigned to a device pointer, is a type error; a pointer or reference written without an address space is
  rejected by a token rule (Metal requires one; clang would make it a generic pointer, which stays enabled so
  that a device struct copies into a thread variable through the implicit copy constructor, as in Metal);
* program-scope and static variables must be ``constant``; threadgroup variables are legal only in a kernel's
  body (only those are rewritten into kernel storage here, a helper's stays an error);
* ``double``, new/delete, ``thread_local``, ``typeid``/``dynamic_cast``, exceptions are rejected by clang's OpenCL
  rules (``-fno-exceptions -fno-rtti``, no fp64); clang's function-pointer extension is on, because Metal takes
  functions as template arguments and parameters, and token rules reject what it would let through (virtual
  functions, function-pointer variables);
* ``strict.h`` declares MSL 3.1's standard library with its overloads only: no ``std::``, no C library, math on
  float/half (a bfloat scalar converts to float; ``abs``/``min``/``max``/``clamp`` on bfloat and math on bfloat
  vectors are deleted functions), no 64-bit or bfloat SIMD reductions; an implicit float/half -> bfloat
  conversion (clang's -Wimplicit-float-conversion warning) is an error, as in Metal.

MSL forms clang's OpenCL mode gets wrong are rewritten (constructors' ``thread`` qualifier, function-pointer
template parameters, short brace lists, static constexpr redeclarations) or their diagnostics forgiven
(``_metal_accepts``: constant structs copied into values and the like).

What clang cannot see is checked on its output: recursion (cycles in clang's call graph,
``debug.DumpCallGraph``, confirmed per declaration on clang's JSON AST so overloads are told apart), lambdas
(anonymous-class call operators in that graph), ``goto``, ``long long``, and kernel parameters (a
``[[buffer(n)]]`` must be a ``device``/``constant`` pointer or reference; every level of a pointer-to-pointer
needs an address space).

``check(pp)`` returns the problems (empty list = clean); every message names the source line and the rule.
"""
from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import tempfile
from pathlib import Path

from .msl_scan import LINE_MARKER_RE, match_close, scan_kernel_signatures, split_top_level
from .rewrite import METHOD_AS_RE, TG_DECL_RE, keep_newlines, rewrite_shared
from .toolchain import clang_path

__all__ = ["check", "STRICT_FLAGS", "STRICT_HEADER"]

_HERE = Path(__file__).resolve().parent
STRICT_HEADER = _HERE / "strict.h"
STRICT_FLAGS = ["-x", "clcpp", "-cl-std=clc++2021", "-cl-no-stdinc", "-nostdinc", "-fno-exceptions", "-fno-rtti",
                "-Xclang", "-cl-ext=-__opencl_c_program_scope_global_variables,"
                "-cl_khr_fp64,-__opencl_c_fp64,-__opencl_c_pipes,-__opencl_c_device_enqueue,+cl_khr_fp16,"
                "+__cl_clang_function_pointers",
                "-Wno-unknown-attributes", "-Wno-ignored-attributes", "-Wno-unused-value", "-Wno-invalid-constexpr",
                "-Wno-duplicate-decl-specifier", "-Wimplicit-float-conversion",
                "-ferror-limit=50",
                "--analyze", "--analyzer-no-default-checks", "-Xanalyzer", "-analyzer-checker=debug.DumpCallGraph"]
_ANALYZE = {"--analyze", "--analyzer-no-default-checks", "-Xanalyzer", "-analyzer-checker=debug.DumpCallGraph"}
_SRC = "msl_source.metal"

_SPEC = "MSL 3.1"
_RULES = [
    (r"invalid vector element type 'bool'",
     "an emulator limitation, not an MSL rule: Metal accepts metal::vec<bool, N>; here it is boolN where written "
     "as vec<bool, N> or in a typedef/using of vec<T, N>, but a vec<T, N> elsewhere (a variable, a deduced "
     "parameter) with T = bool is a clang vector, which clang's OpenCL mode forbids (see the emulator README, "
     "Known limitations)"),
    (r"(?:no viable conversion|cannot initialize|assigning to|incompatible|no known conversion) .*(?:bvec<|bool[234]\b)",
     f"{_SPEC} (Implicit Type Conversions): there is no implicit conversion between vector types (boolN "
     f"included; a vector comparison gives boolN): convert explicitly, e.g. int4(m), bool4(v), static_cast<float4>(m)"),
    (r"invalid operands to binary expression \('[^']*(?:bvec<|bool[234]\b)",
     f"{_SPEC} (Operators): boolN takes the logical (! && ||), equality (== !=) and bitwise (& | ^ ~) operators, "
     f"not arithmetic: convert explicitly, e.g. int4(m)"),
    (r"non-kernel function variable cannot be declared in local address space",
     f"{_SPEC} (Address Spaces, threadgroup): a threadgroup variable may be declared only inside a kernel "
     f"function, not in a helper function"),
    (r"program scope variable must reside in constant|static local variable must reside in constant",
     f"{_SPEC} (Program Scope Variables): variables at program scope, and static variables, must be declared "
     f"in the constant address space"),
    (r"implicit conversion loses floating-point precision: '[^']*' to '[^']*bfloat",
     f"{_SPEC} (Scalar Data Types, bfloat): float and half do not convert implicitly to bfloat, and the math "
     f"functions have no bfloat overload (a bfloat argument converts to float, so the result is float): "
     f"convert explicitly, e.g. bfloat(exp(x))"),
    (r"(?:bfloat|__bf16)'?[^']*' (?:with|from) an? (?:lvalue|rvalue)? ?of type '[^']*half|half'?[^']*' (?:with|from) an? "
     r"(?:lvalue|rvalue)? ?of type '[^']*(?:bfloat|__bf16)|(?:bfloat|__bf16).*(?:half|_Float16)|"
     r"(?:half|_Float16).*(?:bfloat|__bf16)",
     f"{_SPEC} (Scalar Data Types, bfloat): bfloat and half do not convert to each other implicitly: write "
     f"static_cast<half>(x) or bfloat(h)"),
    (r"address space|__global|__local|__constant",
     f"{_SPEC} (Address Spaces): a pointer or reference to device, constant, threadgroup or thread memory does "
     f"not convert to another address space"),
    (r"'default new'|'default delete'", f"{_SPEC} (C++ restrictions): the new and delete operators are not supported"),
    (r"virtual functions", f"{_SPEC} (C++ restrictions): virtual functions are not supported"),
    (r"thread_local", f"{_SPEC} (C++ restrictions): thread_local storage is not supported"),
    (r"pointers to functions|address of function|function pointer",
     f"{_SPEC} (C++ restrictions): function pointers are not supported (outside visible-function tables)"),
    (r"'typeid'|'dynamic_cast'|rtti", f"{_SPEC} (C++ restrictions): type identification and dynamic_cast are "
                                      f"not supported"),
    (r"exceptions disabled|'throw'|'try'", f"{_SPEC} (C++ restrictions): exception handling is not supported"),
    (r"double", f"{_SPEC} (Scalar Data Types): double is not supported; use float"),
    (r"'std'", f"{_SPEC}: the C++ standard library (std::) is not available; use the metal:: standard library"),
    (r"undeclared identifier '(?:malloc|calloc|realloc|free|printf|memcpy|memset|abort|exit)'",
     f"{_SPEC}: the C standard library (malloc, free, printf, memcpy...) is not available"),
    (r"deleted function", f"{_SPEC} (Metal Standard Library): this function has no bfloat overload in MSL 3.1 "
                          f"(the math functions take float or half, a bfloat vector does not convert, and "
                          f"abs/min/max/clamp also take integers, so a bfloat argument is ambiguous): convert "
                          f"explicitly, e.g. max(float(a), float(b))"),
    (r"no matching function for call to '(simd|quad)_",
     f"{_SPEC} (SIMD-group functions): reductions and shuffles exist for types of at most 32 bits, and "
     f"reductions not for bfloat"),
    (r"no matching function", f"{_SPEC} (Metal Standard Library): no overload of this standard-library "
                              f"function takes these argument types"),
    (r"undeclared identifier|unknown type name|no member named|no template named|no type named",
     f"{_SPEC}: the name is declared neither by the source nor by the Metal standard library"),
    (r"^(?:expected |extraneous|unexpected|unterminated|missing ')",
     f"{_SPEC} (a C++14-based language): the source does not parse"),
    (r".", f"{_SPEC} (a C++14-based language): the C++ rules Metal's compiler shares reject this"),
]
_DIAG_RE = re.compile(r"^(?P<loc>[^\s:][^:\n]*:\d+:\d+): (?P<kind>error|fatal error|warning): (?P<msg>.*)$", re.M)
# the warnings that are errors in Metal: an implicit float/half -> bfloat conversion
_ERROR_WARNINGS = re.compile(r"implicit conversion loses floating-point precision: '[^']*' to '[^']*bfloat")
_ADDRESS_SPACES = ("device", "constant", "threadgroup", "thread", "threadgroup_imageblock", "ray_data",
                   "object_data")
# A pointer or reference to a built-in scalar/vector type (`float* p`, `const half4& v`, `(uint*)q`).
_SCALAR_PTR_RE = re.compile(r"(?<![\w:.])(?:bool|char|uchar|short|ushort|int|uint|long|ulong|half|float|bfloat|"
                            r"u?int(?:8|16|32|64)_t)(?:2|3|4)?\s*(?:const\s*)?[*&](?![&=])")


def unqualified_pointers(text: str):
    """Pointers/references to built-in types written without an address space (Metal: "pointer type must have
    explicit address space qualifier"; clang's OpenCL mode would make them generic pointers and accept them)."""
    for m in _SCALAR_PTR_RE.finditer(text):
        words = re.findall(r"[A-Za-z_]\w*|\S", text[max(0, m.start() - 120):m.start()])
        while words and words[-1] in ("const", "volatile"):
            words.pop()
        if not words or words[-1] not in _ADDRESS_SPACES:
            yield m


def _rule(msg: str) -> str:
    for pat, rule in _RULES:
        if re.search(pat, msg, re.I):
            return rule
    return ""


def _strip_instantiation_attributes(s: str) -> str:
    # `template [[host_name("x")]] kernel void f<T>(...);` -> `template kernel void f<T>(...);` (clang instantiates)
    pat = re.compile(r"\btemplate(\s*)\[\[(?:[^\[\]]|\[[^\[\]]*\])*\]\]")
    while True:
        new = pat.sub(lambda m: "template" + m.group(1), s)
        if new == s:
            return s
        s = new


def _rewrite_kernel_threadgroup(s: str) -> str:
    """Kernel-scope `threadgroup T name[N];` -> a reference to local storage; helpers' stay as they are."""
    spans = [sig.body_span for sig in scan_kernel_signatures(s) if sig.body_span]
    for a, b in sorted(spans, reverse=True):
        body = s[a:b]

        def tg(m):
            typ, name, dims = m.group("type"), m.group("name"), re.sub(r"\s+", "", m.group("dims"))
            return (f"__local {typ} (&{name}){dims} = *(__local {typ} (*){dims})__emu::tg_storage();"
                    + keep_newlines(m.group(0)))
        s = s[:a] + TG_DECL_RE.sub(tg, body) + s[b:]
    return s


def _method_qualifiers(s: str) -> str:
    """A constructor's `thread` qualifier is dropped (clang's unqualified constructor is generic: it also
    constructs temporaries, which Metal puts in thread memory and clang in no address space); `constant` becomes
    `__constant` (no `const`: not allowed on a constructor). Other members keep theirs."""
    def sub(m):
        if m.group(2) == "constant":
            return m.group(1) + "__constant"
        if m.group(2) != "thread":
            return m.group(0)
        # the name before the parameter list: a constructor has no return type in front of it
        depth, k = 0, m.start(1)  # group 1 starts at the parameter list's `)`
        while k >= 0:
            depth += (s[k] == ")") - (s[k] == "(")
            if depth == 0:
                break
            k -= 1
        head = s[max(0, k - 200):k]
        head = head[max(head.rfind(";"), head.rfind("{"), head.rfind("}"), head.rfind(":") if
                        re.search(r"\b(?:public|private|protected)\s*:\s*[^:]*$", head) else -1) + 1:]
        ctor = re.fullmatch(r"\s*(?:template\s*<.*>\s*)?(?:(?:constexpr|explicit|inline|METAL_FUNC)\s+)*"
                            r"~?[A-Za-z_]\w*\s*", head, re.S)
        return m.group(1) if ctor else m.group(0)
    return METHOD_AS_RE.sub(sub, s)


_BRACE_VEC_RE = re.compile(r"(?<![\w.:>])(?:metal::)?(?:float|half|bfloat|int|uint|short|ushort|char|uchar|long|ulong|"
                           r"bool)([234])\s+[A-Za-z_]\w*\s*=\s*\{")


_MEMBER_REDECL_RE = re.compile(r"(?m)^[ \t]*(?=[^;{}\n]*\bconstexpr\b)(?:(?:constant|constexpr|const|static|inline)\s+)+"
                              r"[^;{}=()]*?[A-Za-z_]\w*(?:\s*<[^;{}=()]*>)?::[A-Za-z_]\w*\s*(?:\[[^\];]*\]\s*)*;")


def _drop_member_redeclarations(s: str) -> str:
    """`constant constexpr const float W<6, 3, 8>::wt[8][8];`, the out-of-class redeclaration of a static
    constexpr member: redundant since C++17 (and accepted by Metal); clang's OpenCL mode wants an initialiser."""
    return _MEMBER_REDECL_RE.sub(lambda m: keep_newlines(m.group(0)), s)


def _pad_vector_braces(s: str) -> str:
    """`float4 a = {0.f}, b = {1.f};` -> `float4 a = {0.f, 0, 0, 0}, b = {1.f, 0, 0, 0};`: Metal zero-fills the
    missing components (C++ aggregate rules), clang's OpenCL mode rejects the short list."""
    edits = []
    for m in _BRACE_VEC_RE.finditer(s):
        width, open_at = int(m.group(1)), m.end() - 1
        while True:
            close = match_close(s, open_at, "{", "}")
            if close < 0:
                break
            n = len(split_top_level(s[open_at + 1:close]))
            if 0 < n < width:
                edits.append((close, ", 0" * (width - n)))
            more = re.match(r"\s*,\s*[A-Za-z_]\w*\s*=\s*\{", s[close + 1:close + 200])
            if not more:
                break
            open_at = close + more.end()
    for at, text in sorted(edits, reverse=True):
        s = s[:at] + text + s[at:]
    return s


def _function_reference_template_params(s: str) -> str:
    """`template <class T, float2 (*F)(constant T*, uint2)>` -> `(&F)`: clang's OpenCL mode rejects every
    argument for a function-pointer template parameter (Metal takes them: ggml, PyTorch); a function reference
    is called the same way and binds the same functions."""
    out, last = [], 0
    for m in re.finditer(r"\btemplate\s*<", s):
        close = match_close(s, m.end() - 1, "<", ">")
        if close < 0 or close < last:
            continue
        header = s[m.end():close]
        if "(*" not in header.replace(" ", ""):
            continue
        out.append(s[last:m.end()])
        out.append(re.sub(r"\(\s*\*\s*([A-Za-z_]\w*)\s*\)\s*\(", r"(&\1)(", header))
        last = close
    out.append(s[last:])
    s = "".join(out)
    # and the aliases such parameters are declared with: `using RadixFunc = void (*)(thread vec<T, 2>*, ...);`
    s = re.sub(r"(\busing\s+[A-Za-z_]\w*\s*=\s*[^;{}()]*?)\(\s*\*\s*\)(\s*\()", r"\1(&)\2", s)
    return re.sub(r"(\btypedef\s+[^;{}()]*?)\(\s*\*\s*([A-Za-z_]\w*)\s*\)(\s*\()", r"\1(&\2)\3", s)


def _line_of(pp: str, offset: int) -> str:
    line, name = 1, _SRC
    for raw in pp[:offset].split("\n")[:-1]:
        m = LINE_MARKER_RE.match(raw)
        if m:
            mm = re.match(r'\s*#\s*(?:line\s+)?(\d+)\s+"([^"]*)"', raw)
            line, name = int(mm.group(1)), os.path.basename(mm.group(2))
        else:
            line += 1
    return f"{name}:{line}"


def _token_rules(pp: str) -> list[str]:
    """goto and `long long`: keywords clang's OpenCL mode accepts but Metal rejects."""
    out = []
    code = re.sub(r'"(?:\\.|[^"\\\n])*"', lambda m: '"' + " " * (len(m.group(0)) - 2) + '"', pp)  # same offsets
    for m in re.finditer(r"\bgoto\b", code):
        out.append(f"{_line_of(pp, m.start())}: error: goto statement [{_SPEC} (C++ restrictions): goto is "
                   f"not supported]")
    body = "\n".join(" " * len(ln) if LINE_MARKER_RE.match(ln) else ln for ln in code.split("\n"))
    for m in unqualified_pointers(body):
        out.append(f"{_line_of(pp, m.start())}: error: `{' '.join(m.group(0).split())}` has no address space "
                   f"[{_SPEC} (Address Spaces): a pointer or reference type must have an explicit address space "
                   f"qualifier (device, constant, threadgroup or thread)]")
    # function pointers are legal as parameters and template arguments (resolved at compile time), not as
    # variables: `float (*f)(float) = sq;`
    for m in re.finditer(r"(?<![\w:])(?!typedef\b|using\b)[A-Za-z_][\w:<>, ]*?\s*\(\s*\*\s*([A-Za-z_]\w*)\s*\)\s*"
                         r"\([^;{}()]*(?:\([^;{}()]*\)[^;{}()]*)*\)\s*(?:=|;)", code):
        if re.search(r"\btypedef\s*$", code[max(0, m.start() - 20):m.start()]):
            continue
        out.append(f"{_line_of(pp, m.start())}: error: function pointer variable '{m.group(1)}' [{_SPEC} (C++ "
                   f"restrictions): function pointers are not supported (outside visible-function tables); a "
                   f"function may be passed as a template argument or a parameter]")
    for m in re.finditer(r"\bvirtual\b", code):  # (clang's function-pointer extension would allow it)
        out.append(f"{_line_of(pp, m.start())}: error: virtual function [{_SPEC} (C++ restrictions): virtual "
                   f"functions are not supported]")
    for m in re.finditer(r"\blong\s+long\b", code):
        out.append(f"{_line_of(pp, m.start())}: error: 'long long' [{_SPEC} (Scalar Data Types): there is no "
                   f"long long; long is 64-bit]")
    return out


def _param_rules(pp: str) -> list[str]:
    out = []
    for sig in scan_kernel_signatures(pp):
        if not sig.is_definition:
            continue  # an explicit instantiation lists types only: its definition carries the attributes
        for p in sig.parameters():
            if p.attr != "buffer":
                continue
            t = re.sub(r"\bmetal::", "", p.type)
            where = f"{_line_of(pp, sig.start)}: error: kernel {sig.name!r}, parameter {p.name or p.text!r}"
            if "*" not in t and "&" not in t:
                continue  # by-value buffer argument (a struct or scalar), legal
            levels = re.split(r"[*&]", t)
            first = set(re.findall(r"\w+", levels[0]))
            if not first & {"device", "constant"}:
                sp = [a for a in _ADDRESS_SPACES if a in first]
                out.append(f"{where}: a [[buffer(n)]] argument in the {sp[0] if sp else 'default (thread)'} "
                           f"address space [{_SPEC} (Kernel Function Arguments): a buffer argument must be a "
                           f"device or constant pointer or reference]")
                continue
            for lvl in levels[1:-1]:
                if not set(re.findall(r"\w+", lvl)) & set(_ADDRESS_SPACES):
                    out.append(f"{where}: `{p.type}` points to a pointer without an address space "
                               f"[{_SPEC} (Address Spaces): every pointer in a kernel argument names its "
                               f"address space, e.g. device float* device*; device float** is rejected]")
                    break
    return out


def _name_graph(dump: str) -> dict[str, set[str]]:
    """clang's call graph (debug.DumpCallGraph) by function name: overloads share a node."""
    rows = {m.group(1).strip(): m.group(2).strip()
            for m in re.finditer(r"^\s*Function: (.*?) calls: ?(.*)$", dump, re.M) if m.group(1).strip() != "< root >"}
    names = sorted(rows, key=len, reverse=True)  # lambda names contain spaces: match whole known names
    edges: dict[str, set[str]] = {}
    for caller, rest in rows.items():
        r, found = " " + rest + " ", set()
        for n in names:
            if " " + n + " " in r:
                found.add(n)
                r = r.replace(" " + n + " ", " ")
        edges[caller] = found
    return edges


def _textual_call_graph(pp: str) -> str:
    """A call graph in debug.DumpCallGraph's format from the text: each function definition's body calls the
    defined names it mentions (overloads share a name; a cycle found here is confirmed on clang's AST)."""
    code = "\n".join("" if LINE_MARKER_RE.match(ln) else ln for ln in pp.split("\n"))
    bodies: dict[str, list[str]] = {}
    for m in re.finditer(r"\b([A-Za-z_]\w*)\s*\([^;{}()]*(?:\([^;{}()]*\)[^;{}()]*)*\)\s*(?:const\s*)?"
                         r"(?:__private|__global|__local|__constant|thread|device|threadgroup|constant)?\s*\{", code):
        if m.group(1) in ("if", "for", "while", "switch", "catch", "return"):
            continue
        close = match_close(code, m.end() - 1, "{", "}")
        if close > 0:
            bodies.setdefault(m.group(1), []).append(code[m.end():close])
    lines = []
    for name, texts in bodies.items():
        called = {c for t in texts for c in re.findall(r"\b([A-Za-z_]\w*)\s*(?:<[^;{}()]*>)?\s*\(", t)
                  if c in bodies}
        lines.append(f"  Function: {name} calls: {' '.join(sorted(called))}")
    lambdas = re.findall(r"[=(,{;]\s*\[[^\[\]]*\]\s*(?:\([^()]*\))?\s*(?:mutable\s*)?(?:->\s*[\w:<> ]+?\s*)?\{", code)
    lines += [f"  Function: (anonymous class)::operator() calls: " for _ in lambdas]
    return "\n".join(lines)


def _cycles(edges: dict) -> list[list]:
    color: dict = {}
    cycles: list[list] = []

    def dfs(u, stack):
        color[u] = 1
        stack.append(u)
        for v in sorted(edges.get(u, ()), key=str):
            if color.get(v, 0) == 0:
                dfs(v, stack)
            elif color.get(v) == 1:
                cycles.append(stack[stack.index(v):] + [v])
        stack.pop()
        color[u] = 2

    for u in sorted(edges, key=str):
        if color.get(u, 0) == 0:
            dfs(u, [])
    return cycles


_FUNCTION_KINDS = {"FunctionDecl", "CXXMethodDecl", "CXXConstructorDecl", "CXXDestructorDecl", "CXXConversionDecl"}


def _declaration_cycles(ast: dict) -> list[list[str]]:
    """Recursion in the call graph of declarations (clang's JSON AST): overloads and template
    specialisations are distinct nodes, redeclarations one node."""
    prev: dict[str, str] = {}
    names: dict[str, str] = {}
    edges: dict[str, set[str]] = {}
    stack = [(ast, None)]
    while stack:
        node, fn = stack.pop()
        kind = node.get("kind")
        if kind in _FUNCTION_KINDS:
            names[node["id"]] = node.get("name", "?")
            if node.get("previousDecl"):
                prev[node["id"]] = node["previousDecl"]
            if any(c.get("kind") == "CompoundStmt" for c in node.get("inner", ())):
                fn = node["id"]
        elif fn is not None:
            ref = node.get("referencedDecl") if kind == "DeclRefExpr" else \
                node.get("referencedMemberDecl") and {"id": node["referencedMemberDecl"], "kind": "CXXMethodDecl"}
            if ref and ref.get("kind") in _FUNCTION_KINDS:
                edges.setdefault(fn, set()).add(ref["id"])
        for c in node.get("inner", ()):
            stack.append((c, fn))

    def canon(i):
        seen = set()
        while i in prev and i not in seen:
            seen.add(i)
            i = prev[i]
        return i
    graph: dict[str, set[str]] = {}
    for f, callees in edges.items():
        graph.setdefault(canon(f), set()).update(canon(c) for c in callees)
    return [[names.get(i, "?") for i in c] for c in _cycles(graph)]


def _callgraph_rules(dump: str, pp: str, precise) -> list[str]:
    edges = _name_graph(dump)
    out = []
    lambdas = [n for n in edges if "(anonymous class)::operator()" in n or "(lambda" in n]
    lam = [m.start() for m in re.finditer(r"[=(,{;]\s*\[[^\[\]]*\]\s*(?:\([^()]*\))?\s*(?:mutable\s*)?"
                                            r"(?:->\s*[\w:<> ]+?\s*)?\{", pp)]
    for j, n in enumerate(lambdas):
        owner = n.split("(", 1)[0]
        loc = _line_of(pp, lam[j] + 1) if j < len(lam) else _SRC
        out.append(f"{loc}: error: a lambda expression in {owner!r} [{_SPEC} (C++ restrictions): lambda "
                   f"expressions are not supported]")
    if _cycles(edges):  # a cycle of names may be overloads calling each other: check declarations
        for c in precise():
            m = re.search(rf"\b{re.escape(c[0])}\s*\(", pp)
            loc = _line_of(pp, m.start()) if m else _SRC
            out.append(f"{loc}: error: recursive call {' -> '.join(c)} [{_SPEC} (C++ restrictions): recursive "
                       f"function calls are not supported]")
    return out


# clang's OpenCL C++ rejects these, Metal does not: a struct in constant (or device/threadgroup) memory copied into
# a value (the implicit copy/move members bind only generic references, and no constant object converts to
# generic), a scalar of higher rank mixed with a vector (`half2 * float`), a conditional of a struct in memory and a
# value of the same type
_IMPLICIT_MEMBER_AS_NOTE = re.compile(r"^candidate (?:function|constructor) \(the implicit (?:copy|move) "
                                      r"(?:assignment operator|constructor)\) not viable: cannot bind reference in "
                                      r"address space")
_AS_WORDS = re.compile(r"\b(?:__global|__local|__constant|__private|__generic|const)\b\s*")


def _metal_accepts(msg: str, notes: list[str]) -> bool:
    if "scalar operand type has greater rank than the type of the vector element" in msg:
        return True
    if any("cannot convert initializer list argument to" in n and "(vector of" in n for n in notes):
        return True  # f({a, b, c}) for a vector parameter
    candidates = [n for n in notes if n.startswith("candidate")]
    if re.match(r"no viable overloaded '='|no matching constructor for initialization of ", msg) and \
            any(_IMPLICIT_MEMBER_AS_NOTE.match(n) for n in candidates) and \
            all(re.match(r"candidate (?:function|constructor) \(the implicit ", n) for n in candidates):
        return True
    if re.match(r"reference of type 'const __private [^']*' cannot bind to a temporary object because of address "
                r"space mismatch", msg):
        return True  # a temporary is in thread memory in Metal
    m = re.match(r"(?:conditional expression is ambiguous; |incompatible operand types \()'([^']*)' and '([^']*)'", msg)
    if m and _AS_WORDS.sub("", m.group(1)).strip() == _AS_WORDS.sub("", m.group(2)).strip():
        return True
    return bool(re.match(r"constexpr variable '\w+' must be initialized by a constant expression", msg)) and \
        any("static data member" in n for n in notes)


_cc1: dict[str, list[str]] = {}


def _analyzer_command(clang: str, src: str) -> list[str]:
    """The front-end (cc1) command the driver runs for `clang --analyze`, without the `-w` the driver adds in
    analyzer mode: one pass gives the errors, the warnings Metal makes errors, and the call graph."""
    args = _cc1.get(clang)
    if args is None:
        driver = [clang, *STRICT_FLAGS, "-include", str(STRICT_HEADER), src, "-o", os.devnull]
        r = subprocess.run([driver[0], "-###", *driver[1:]], capture_output=True, text=True, timeout=60)
        line = next((ln for ln in r.stderr.splitlines() if '"-cc1"' in ln), None)
        if line is None:  # pragma: no cover - a driver that prints no cc1 line: warnings stay hidden
            return driver
        args = _cc1[clang] = ["\0src" if a == src else a for a in shlex.split(line) if a != "-w"]
    return [src if a == "\0src" else a for a in args]


def check(pp: str, clang: str | None = None) -> list[str]:
    """Problems Apple's compiler would report for the preprocessed MSL `pp` (empty list = clean)."""
    clang = clang or clang_path()
    if clang is None:
        return []
    problems = _token_rules(pp) + _param_rules(pp)
    s = _strip_instantiation_attributes(pp)
    s = _pad_vector_braces(_method_qualifiers(_function_reference_template_params(rewrite_shared(s))))
    s = _drop_member_redeclarations(s)
    s = _rewrite_kernel_threadgroup(s)
    with tempfile.TemporaryDirectory(prefix="comfy_metal_strict_") as tmp:
        path = Path(tmp) / "strict_input.metal"
        path.write_text(s)
        try:
            r = subprocess.run(_analyzer_command(clang, str(path)), capture_output=True, text=True, timeout=600,
                               cwd=tmp)
        except OSError as e:  # pragma: no cover
            return [f"cannot run {clang}: {e}"]
        err = r.stderr.replace(tmp + os.sep, "").replace(str(_HERE) + os.sep, "")
    diags = [m for m in _DIAG_RE.finditer(err) if m.group("kind") != "warning" or _ERROR_WARNINGS.search(m.group("msg"))]
    accepted = 0
    for k, m in enumerate(diags):
        tail = err[m.end():diags[k + 1].start() if k + 1 < len(diags) else len(err)]
        notes = [n.strip() for n in re.findall(r": note: (.*)", tail)]
        if _metal_accepts(m.group("msg"), notes):
            accepted += 1
            continue
        note = next((n for n in notes if "address space" in n or "deleted" in n or "not viable" in n), "")
        rule = _rule(m.group("msg") + " " + note)
        problems.append(f"{m.group('loc')}: error: {m.group('msg')}" + (f" ({note})" if note else "")
                        + (f" [{rule}]" if rule else ""))
    if r.returncode != 0 and not diags:
        problems.append("strict MSL front end failed:\n" + err.strip())
    clean = len(diags) == accepted

    def precise():
        with tempfile.TemporaryDirectory(prefix="comfy_metal_strict_") as tmp2:
            src = Path(tmp2) / "strict_input.metal"
            src.write_text(s)
            flags = [f for f in STRICT_FLAGS if f not in _ANALYZE]
            a = subprocess.run([clang, *flags, "-fsyntax-only", "-Xclang", "-ast-dump=json", "-include",
                                str(STRICT_HEADER), str(src)], capture_output=True, text=True, timeout=600)
        return _declaration_cycles(json.loads(a.stdout)) if a.stdout.startswith("{") else []
    if clean and r.returncode == 0:
        problems += _callgraph_rules(r.stdout + "\n" + err, pp, precise)
    elif clean:
        # the analyzer does not run after errors, even ones Metal accepts: a cheaper textual look for lambdas and
        # for cycles of names, confirmed on clang's AST
        problems += _callgraph_rules(_textual_call_graph(pp), pp, precise)
    return [re.sub(r"[^\s:\[\]]*/(msl_source\.metal)", r"\1", p) for p in problems]
