"""Mechanical rewrites of the preprocessed source (instantiations, threadgroup storage, vectors, literals)."""
from __future__ import annotations

import re

from .errors import MSLCompileError
from .msl_scan import LINE_MARKER_RE
from .parse import _VEC_NAMES
TG_DECL_RE = re.compile(
    r"\bthreadgroup\s+(?P<type>(?:(?:const|volatile)\s+)*(?:metal::)?[A-Za-z_][\w:]*(?:\s*<[^;{}()]*?>)?)"
    r"\s+(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\];]+\]\s*)*);")
_TG_LEFTOVER_RE = re.compile(r"\bthreadgroup\s+(?:(?:const|volatile)\s+)*[A-Za-z_][\w:]*(?:\s*<[^;{}()]*?>)?"
                             r"\s+[A-Za-z_]\w*\s*(?:\[[^\]]*\]\s*)*"
                             r"(?:=[^;]*;|,\s*[A-Za-z_]\w*\s*(?:\[[^\]]*\]\s*)*[;,])")
_HALF_LIT_RE = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)[hH]\b")
_VEC_CTOR_RE = re.compile(r"(?<![\w.:>])(?:metal::)?(" + _VEC_NAMES + r")\s*\((?!\s*[*&]\s*\))")
_VEC_SCAST_RE = re.compile(r"\bstatic_cast\s*<\s*(?:metal::)?(" + _VEC_NAMES + r")\s*>\s*\(")
_VEC_CCAST_RE = re.compile(r"\(\s*(?:metal::)?(" + _VEC_NAMES + r")\s*\)(?=\s*[\w(\-+!~.])")


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

    s = rewrite_literals_and_vectors(s)
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
        raise MSLCompileError(f"unsupported threadgroup declaration (declare one variable per statement, "
                              f"no initialiser): {left.group(0)!r}")

    return s


def rewrite_literals_and_vectors(s: str) -> str:
    """Half literals and MSL vector constructors/casts (shared with the strict front end)."""
    # half literals
    s = _HALF_LIT_RE.sub(lambda m: f"((half){m.group(1)}f)" if ("." in m.group(1) or "e" in m.group(1).lower())
                         else f"((half){m.group(1)}.0f)", s)
    # vector constructors & casts
    s = _VEC_SCAST_RE.sub(lambda m: f"__emu::vec<{m.group(1)}>(", s)
    s = _VEC_CTOR_RE.sub(lambda m: f"__emu::vec<{m.group(1)}>(", s)

    def ccast(m):
        j = m.start() - 1
        while j >= 0 and s[j] in " \t\n":
            j -= 1
        if j >= 0 and (s[j].isalnum() or s[j] in "_)]"):
            return m.group(0)  # sizeof(float4), f(float4) ... : not a cast
        return f"__emu::vcast<{m.group(1)}>()->*"

    s = _VEC_CCAST_RE.sub(ccast, s)
    return s
