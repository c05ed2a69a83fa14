"""Mechanical rewrites of the preprocessed source (instantiations, threadgroup storage, vectors, literals)."""
from __future__ import annotations

import bisect
import re

from .errors import MSLCompileError
from .msl_scan import LINE_MARKER_RE, code_only, function_constants, match_close, split_top_level
from .parse import _VEC_NAMES
_TYPE = r"(?:(?:const|volatile)\s+)*(?:typename\s+)?(?:metal::)?[A-Za-z_][\w:]*(?:\s*<[^;{}()]*?>)?(?:::[\w:]+)?"
# a kernel-scope threadgroup declaration; an initialiser is accepted and ignored (threadgroup memory starts
# undefined, as on the GPU: the NaN fill and the poison re-runs report a kernel that relies on it)
TG_DECL_RE = re.compile(
    r"\bthreadgroup\s+(?P<type>" + _TYPE + r")"
    r"\s+(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\];]+\]\s*)*)(?P<init>=\s*\{[^;{}]*\}\s*)?;")
_TG_LEFTOVER_RE = re.compile(r"\bthreadgroup\s+" + _TYPE +
                             r"\s+[A-Za-z_]\w*\s*(?:\[[^\]]*\]\s*)*"
                             r"(?:=[^;]*;|,\s*[A-Za-z_]\w*\s*(?:\[[^\]]*\]\s*)*[;,])")
_HALF_LIT_RE = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)[hH]\b")
_BFLOAT_LIT_RE = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)bf\b")
_CAST_KEYWORDS = {"return", "else", "case", "do", "co_return", "co_yield", "throw", "and", "or", "not"}
_DECL_KEYWORDS = {"return", "else", "case", "do", "typedef", "using", "new", "delete", "operator", "goto", "sizeof"}


def type_names(s: str) -> set[str]:
    """Names that denote types but are not spelled as MSL's vector types: template type parameters, typedef
    and alias names. Their functional casts and C-style casts must convert like MSL (element-wise) and not
    like clang's vector bitcast, so they go through __emu::vec as well."""
    names = set()
    for m in re.finditer(r"\btemplate\s*<", s):
        i = m.end() - 1
        depth, j = 0, i
        while j < len(s):
            if s[j] == "<":
                depth += 1
            elif s[j] == ">":
                depth -= 1
                if depth == 0:
                    break
            elif s[j] in ";{}":
                break
            j += 1
        for p in re.finditer(r"(?:^|,)\s*(?:typename|class)\s*(?:\.\.\.\s*)?([A-Za-z_]\w*)", s[i + 1:j]):
            names.add(p.group(1))
    names.update(m.group(1) for m in re.finditer(r"\btypedef\b[^;{}()]*?\b([A-Za-z_]\w*)\s*;", s))
    names.update(m.group(1) for m in re.finditer(r"\busing\s+([A-Za-z_]\w*)\s*=", s))
    return names - {"namespace"}


def _prev_word_is(s: str, i: int, words: set[str]) -> bool:
    m = re.search(r"([A-Za-z_]\w*)\s*$", s[max(0, i - 40):i])
    return bool(m) and m.group(1) in words


def _rewrite_vectors(s: str, names: set[str]) -> str:
    """MSL vector construction and conversion: `float4(...)`, `vec<T, 4>(...)`, `static_cast<float4>(...)`,
    `(float4)x`, and the same through template parameters and typedefs, become __emu::vec / __emu::vcast;
    `float4 a(1, 2, 3, 4);` becomes `float4 a = __emu::vec<float4>(1, 2, 3, 4);`."""
    extra = "|".join(sorted((re.escape(n) for n in names), key=len, reverse=True))
    tn = rf"(?:{_VEC_NAMES}|half|bfloat|vec\s*<[^;{{}}()<>]*(?:<[^;{{}}()<>]*>[^;{{}}()<>]*)*>" + \
         (rf"|{extra}" if extra else "") + ")"
    # direct-initialisation of a vector: `int2 a(1, 2);` (not a function declaration: no parameter-like pieces)
    direct = re.compile(rf"(?<![\w.:>~])((?:metal::)?{tn})\s+([A-Za-z_]\w*)\s*\(")

    blocks = _brace_blocks(s)[0]
    bodies, body_ends = [a for a, _ in blocks], [b for _, b in blocks]

    def in_body(i: int) -> bool:
        k = bisect.bisect_right(bodies, i) - 1
        return k >= 0 and i < body_ends[k]

    def direct_init(m):
        close = match_close(s, m.end() - 1, "(", ")")
        if close < 0 or _prev_word_is(s, m.start(), _DECL_KEYWORDS):
            return m.group(0)
        after = s[close + 1:close + 40].lstrip()
        inner = s[m.end():close]
        if not after.startswith((";", ",")) or not inner.strip():
            return m.group(0)
        if in_body(m.start()):  # in a function body: a variable (a local function declaration is not MSL)
            return f"{m.group(1)} {m.group(2)} = __emu::vec<{m.group(1)}>("
        for piece in split_top_level(inner):
            p = piece.strip()
            if re.fullmatch(rf"(?:const\s+|device\s+|constant\s+|thread\s+|threadgroup\s+)*{tn}", p) or \
                    re.fullmatch(r"[\w:<>,\s]*[\w>*&]\s+[*&]*\s*[A-Za-z_]\w*(\s*\[[^\]]*\])?", p):
                return m.group(0)  # a parameter declaration: this is a function declaration
        return f"{m.group(1)} {m.group(2)} = __emu::vec<{m.group(1)}>("
    s = direct.sub(direct_init, s)
    s = re.sub(rf"\bstatic_cast\s*<\s*((?:metal::)?{tn})\s*>\s*\(", lambda m: f"__emu::vec<{m.group(1)}>(", s)
    # not a declarator: `T (*op)(T, T)` (function pointer), `T (&a)[4]`, `T (*)(T)`
    ctor = re.compile(rf"(?<![\w.:>~])((?:metal::)?{tn})\s*\((?!\s*[*&^]+\s*(?:[A-Za-z_]\w*\s*)?\)\s*[(\[,;)=]|\s*[*&^]\s*\))")
    s = ctor.sub(lambda m: m.group(0) if _prev_word_is(s, m.start(), {"operator"}) else f"__emu::vec<{m.group(1)}>(",
                 s)
    ccast = re.compile(rf"\(\s*((?:metal::)?{tn})\s*\)(?=\s*[\w(\-+!~.])")

    def cast(m):
        j = m.start() - 1
        while j >= 0 and s[j] in " \t\n":
            j -= 1
        if j >= 0 and (s[j].isalnum() or s[j] in "_)]") and not _prev_word_is(s, j + 1, _CAST_KEYWORDS):
            return m.group(0)  # sizeof(float4), f(float4) ... : not a cast
        return f"__emu::vcast<{m.group(1)}>()->*"
    return ccast.sub(cast, s)


_AS_WORD_RE = re.compile(r"\b(?:thread|device|threadgroup|constant)\b")
# an address-space qualifier of a member function or constructor: `complex_t() thread : re(0) {}`, `T get() const
# constant {...}` (not a declaration's address space: followed by a body, an initialiser list or `;`)
METHOD_AS_RE = re.compile(r"(\)\s*(?:const\s+)?)(thread|device|threadgroup|constant)\b"
                          r"(?=\s*(?:[{:;=]|const\b|noexcept\b|->))")
_SCOPE_OPEN_RE = re.compile(r"\b(?:namespace|struct|class|union|enum)\b[^;{}()]*(?:\([^;{}()]*\)[^;{}()]*)*$")


def _brace_blocks(s: str) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """(function bodies and initialisers not nested in another one, namespace/class scopes) as brace spans."""
    bodies, scopes, stack = [], [], []
    for m in re.finditer(r"[{}]", s):
        if m.group() == "{":
            head = s[max(0, m.start() - 300):m.start()]
            head = head[max(head.rfind(";"), head.rfind("{"), head.rfind("}")) + 1:]
            stack.append((m.start(), bool(_SCOPE_OPEN_RE.search(head))))
        elif stack:
            start, scope = stack.pop()
            if scope:
                scopes.append((start, m.end()))
            elif all(sc for _, sc in stack):
                bodies.append((start, m.end()))
    return sorted(bodies), scopes


def _declaration_bounds(s: str, i: int) -> tuple[int, int, int]:
    """(start, end of head, end) of the declaration around s[i]: it starts after the `;`, `{`, `}` or access
    label before it; its head ends at its body `{` (after any constructor initialiser list) or its `;`."""
    depth, j = 0, i - 1
    while j >= 0:
        c = s[j]
        if c in ")]":
            depth += 1
        elif c in "([":
            depth -= 1
        elif depth <= 0 and c in ";{}":
            break
        elif depth <= 0 and c == ":" and re.search(r"\b(?:public|private|protected)\s*$", s[max(0, j - 12):j]):
            break
        j -= 1
    start, depth, k = j + 1, 0, i
    while k < len(s):
        c = s[k]
        if c in "([":
            depth += 1
        elif c in ")]":
            depth -= 1
        elif depth <= 0 and c == ";":
            return start, k, k + 1
        elif depth <= 0 and c == "{":
            close = match_close(s, k, "{", "}")
            return start, k, (close + 1 if close >= 0 else len(s))
        k += 1
    return start, len(s), len(s)


def dedupe_address_space_overloads(s: str) -> str:
    """Functions overloaded on address spaces only -- `complex_t() thread` / `complex_t() threadgroup`,
    `operator+=(thread complex_t<T>& a, ...)` / `operator+=(threadgroup complex_t<T>& a, ...)` -- are one
    function in the C++ backend, where address spaces are empty: keep the first of each, drop the others."""
    bodies, scopes = _brace_blocks(s)
    starts = [a for a, _ in bodies]
    seen: set = set()
    done: set[int] = set()
    drops: list[tuple[int, int]] = []
    for m in _AS_WORD_RE.finditer(s):
        k = bisect.bisect_right(starts, m.start()) - 1
        if k >= 0 and bodies[k][0] <= m.start() < bodies[k][1]:
            continue  # inside a function body or an initialiser
        start, head_end, end = _declaration_bounds(s, m.start())
        if start in done or ("(" not in s[start:head_end] and
                             not re.search(r"\b(?:struct|class)\s+[A-Za-z_]\w*\s*<", s[start:head_end])):
            continue  # a function, or a class template specialised on an address space: pointer_element<device T*>
        done.add(start)
        head = s[start:head_end]
        scope = max((a for a, b in scopes if a < start < b), default=-1)  # the innermost enclosing scope
        key = (scope, end != head_end + 1 or s[head_end] == "{", " ".join(_AS_WORD_RE.sub(" ", head).split()))
        if key in seen:
            drops.append((start, end))
        else:
            seen.add(key)
    out, last = [], 0
    for a, b in sorted(drops):
        if a < last:
            continue
        out.append(s[last:a])
        out.append(keep_newlines(s[a:b]))
        last = b
    out.append(s[last:])
    return "".join(out)


def _braced_arguments(s: str) -> str:
    """`f({a, b, c})` in a function body -> `f(__emu::ilist{a, b, c})` (the C++ backend only; see shim.h)."""
    blocks = _brace_blocks(s)[0]
    starts = [a for a, _ in blocks]
    edits = []
    for m in re.finditer(r"[(,]\s*\{", s):
        k = bisect.bisect_right(starts, m.start()) - 1
        if k < 0 or m.start() >= blocks[k][1]:
            continue
        depth, j = 0, m.start()
        while j > blocks[k][0]:  # the innermost open bracket before the `{` must be a call's `(`
            c = s[j]
            if c in ")]}":
                depth += 1
            elif c in "([{":
                if depth == 0:
                    break
                depth -= 1
            j -= 1
        if s[j] == "(" and re.search(r"[\w>\]]\s*$", s[max(0, j - 60):j]) and \
                not _prev_word_is(s, j, {"if", "for", "while", "switch", "return", "sizeof"}):
            edits.append(m.end() - 1)
    for at in reversed(edits):
        s = s[:at] + "__emu::ilist" + s[at:]
    return s


def _rewrite_function_constants(s: str) -> str:
    """`constant T name [[function_constant(i)]];` -> a constant without a value (the launch refuses a kernel
    whose required function constants have none: specialise the source first, see metal_kernels/specialize.py)."""
    for fc in reversed(function_constants(s)):
        s = s[:fc.start] + f"constant {fc.type} {fc.name} = __emu::fc_unset<{fc.type}>();" + \
            keep_newlines(s[fc.start:fc.end]) + s[fc.end:]
    return s


def keep_newlines(s: str) -> str:
    return "\n" * s.count("\n")


def rewrite_source(pp: str, remove: list[tuple[int, int]]) -> str:
    # 1. drop explicit host_name instantiations (keep line markers and line count)
    out, last = [], 0
    for a, b in sorted(remove):
        if a < last:
            continue
        out.append(pp[last:a])
        seg = pp[a:b]
        out.append("\n".join(line if LINE_MARKER_RE.match(line) else "" for line in seg.split("\n")))
        last = b
    out.append(pp[last:])
    s = "".join(out)

    s = METHOD_AS_RE.sub(r"\1", dedupe_address_space_overloads(rewrite_shared(s)))
    s = _braced_arguments(s)
    # 2. threadgroup variables -> per-group storage
    slot = [0]

    def tg(m):
        typ, name, dims = m.group("type"), m.group("name"), re.sub(r"\s+", "", m.group("dims"))
        sid = slot[0]
        slot[0] += 1
        full = f"{typ}{dims}"
        return (f"auto& {name} = *reinterpret_cast<{typ}(*){dims}>(__emu::tg_storage({sid}u, sizeof({full}), "
                f"alignof({typ}), \"{name}\"));" + keep_newlines(m.group(0)))

    s = TG_DECL_RE.sub(tg, s)
    left = _TG_LEFTOVER_RE.search(s)
    if left:
        raise MSLCompileError(f"unsupported threadgroup declaration (an emulator limitation, not an MSL error: "
                              f"declare one variable per statement): {left.group(0)!r}")

    return s


_DOUBLE_LIT_RE = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+)(?:[eE][+-]?\d+)?|\d+[eE][+-]?\d+)(?![\w.])")


def _float_literals(s: str) -> str:
    """`0.5` -> `0.5f`: an unsuffixed floating literal is a float in Metal (there is no double), a double in C++."""
    code = code_only(s)
    out, last = [], 0
    for m in _DOUBLE_LIT_RE.finditer(code):
        out.append(s[last:m.end()])
        out.append("f")
        last = m.end()
    out.append(s[last:])
    return "".join(out)


_VEC_ARGS = r"<(?P<args>[^;{}()<>]*(?:<[^;{}()<>]*>[^;{}()<>]*)*)>"
_VEC_TYPEDEF_RE = re.compile(r"(?P<head>\btypedef\s+(?:const\s+)?)(?:metal\s*::\s*)?vec\s*" + _VEC_ARGS)
_VEC_USING_RE = re.compile(r"(?P<head>\busing\s+[A-Za-z_]\w*\s*=\s*(?:const\s+)?)(?:metal\s*::\s*)?vec\s*" + _VEC_ARGS)
_VEC_BOOL_RE = re.compile(r"(?<![\w.])(?:metal\s*::\s*)?vec\s*<\s*(?P<args>bool\s*,[^;{}()<>]*)>")


def bool_vectors(s: str) -> str:
    """`metal::vec<T, N>` where `T` may be bool: MSL's bool vectors are a class here (clang has no bool vectors in
    the strict front end's OpenCL mode, and its comparisons give integer vectors), so `vec<bool, N>` written out
    and the typedefs/aliases of `vec<T, N>` (`typedef metal::vec<T, 2> frag_type;`, MLX's bool mask fragment) name
    `__emu::vec_sel_t<T, N>`, which is boolN for bool and `T` with `ext_vector_type(N)` otherwise. `vec<T, N>`
    elsewhere stays the plain alias, so a function template still deduces `T` and `N` from a parameter of that
    type (MLX's `complex_mul(metal::vec<T, 2> a, ...)`); alias templates (`template <class T> using V = vec<T, 2>;`)
    stay plain for the same reason."""
    def alias(m):
        head = s[max(0, m.start() - 300):m.start()]
        if re.search(r"\btemplate\s*<[^;{}]*>\s*$", head):  # an alias template: T deduces through it
            return m.group(0)
        return f"{m.group('head')}::__emu::vec_sel_t<{m.group('args')}>"
    s = _VEC_TYPEDEF_RE.sub(lambda m: f"{m.group('head')}::__emu::vec_sel_t<{m.group('args')}>", s)
    s = _VEC_USING_RE.sub(alias, s)
    return _VEC_BOOL_RE.sub(lambda m: f"::__emu::vec_sel_t<{m.group('args')}>", s)


def rewrite_shared(s: str) -> str:
    """The rewrites the strict front end shares: function constants, vector construction and casts, half and
    bfloat literals (after the casts: `((half)1.5f)` stays a plain scalar cast)."""
    # `#pragma unroll(MIN(DK8/2, 4*NSG))`: clang -E leaves the macros of the count unexpanded; the count does
    # not change what a kernel computes
    s = re.sub(r"(?m)^([ \t]*#[ \t]*pragma[ \t]+unroll)[ \t]*\(.*\)[ \t]*$", r"\1", s)
    s = _float_literals(_rewrite_function_constants(s))
    s = re.sub(r"\[\[\s*threadgroup\s*\([^()\]]*\)\s*\]\]", "", s)  # the keyword is a macro: `[[(0)]]`
    s = _rewrite_vectors(s, type_names(s))
    s = bool_vectors(s)
    s = _HALF_LIT_RE.sub(lambda m: f"((half){m.group(1)}f)" if ("." in m.group(1) or "e" in m.group(1).lower())
                         else f"((half){m.group(1)}.0f)", s)
    s = _BFLOAT_LIT_RE.sub(lambda m: f"((bfloat){m.group(1)}f)" if ("." in m.group(1) or "e" in m.group(1).lower())
                           else f"((bfloat){m.group(1)}.0f)", s)
    return s
