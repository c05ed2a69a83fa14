"""The one scanner of MSL kernel signatures, shared by the emulator and the lint.

Works on preprocessed MSL (clang's ``-E`` output, with ``# N "file"`` line markers) or on
comment-free source (the lint's fallback preprocessor). It finds every ``kernel void name``
(also ``[[kernel]] void name``, with attributes such as
``[[max_total_threads_per_threadgroup(n)]]`` between), the explicit template arguments
``name<T, 4>`` of an instantiation, the parameter list and, for a definition, the body::

    for sig in scan_kernel_signatures(text):
        sig.name, sig.template_args, sig.parameters(), sig.is_definition, sig.body_span

The emulator (``parse_kernels``) turns these into host kernels and launchers; the lint uses
the same signatures to locate kernel bodies and to check parameters.
It knows nothing about what is allowed; the checks stay with their users.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["LINE_MARKER_RE", "strip_line_markers", "code_only", "match_close", "split_top_level", "Param",
           "leading_attributes", "KernelSignature", "scan_kernel_signatures", "FunctionConstant",
           "function_constants"]

# a preprocessor line marker: `# 12 "file"` or `#line 12 "file"` (with optional flags)
LINE_MARKER_RE = re.compile(r'^[ \t]*#[ \t]*(?:line[ \t]+)?\d+[ \t]+"[^"\n]*"[^\n]*$', re.M)
# `kernel void name` or `[[kernel]] void name`, attributes allowed before `void`
_KERNEL_KEYWORD_RE = re.compile(r"(?:\bkernel\b|\[\[\s*kernel\s*(?:,(?P<list>(?:[^\[\]]|\[[^\[\]]*\])*))?\]\])\s*"
                                r"(?P<between>(?:\[\[(?:[^\[\]]|\[[^\[\]]*\])*\]\]\s*)*)void\s+(?P<name>[A-Za-z_]\w*)\s*")
_QUALIFIERS = {"const", "volatile", "device", "constant", "thread", "threadgroup", "restrict", "struct"}


def strip_line_markers(s: str) -> str:
    return LINE_MARKER_RE.sub("", s)


_COMMENT_OR_LITERAL_RE = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)


def code_only(text: str) -> str:
    """`text` with comments and string/character literals blanked (newlines kept): same length, same offsets."""
    return _COMMENT_OR_LITERAL_RE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)), text)


# `constant bool has_bias [[function_constant(0)]];` (a program-scope function constant declaration)
# (MLX writes `static constant constexpr const bool inv_ [[function_constant(0)]];`)
_FUNCTION_CONSTANT_RE = re.compile(
    r"(?<![\w:])(?:(?:static|constexpr|const)\s+)*constant\s+(?:(?:static|constexpr|const)\s+)*"
    r"(?P<type>(?:metal::)?[A-Za-z_]\w*)\s+(?P<name>[A-Za-z_]\w*)\s*"
    r"\[\[\s*function_constant\s*\((?P<index>[^;\]]*)\)\s*\]\]\s*;")


@dataclass(frozen=True)
class FunctionConstant:
    """A function constant declaration: its type, name, index expression (text) and span in the text scanned.
    It is optional (may be left without a value) only if the source asks is_function_constant_defined(name):
    Metal's MTLFunctionConstant.required rule."""

    type: str
    name: str
    index: str
    start: int
    end: int
    optional: bool


def function_constants(code: str) -> list[FunctionConstant]:
    """The function constant declarations of comment-free (or preprocessed) MSL."""
    out = []
    for m in _FUNCTION_CONSTANT_RE.finditer(code):
        name = m.group("name")
        optional = re.search(rf"\bis_function_constant_defined\s*\(\s*{name}\s*\)", code) is not None
        out.append(FunctionConstant(" ".join(m.group("type").split()), name, m.group("index").strip(), m.start(),
                                    m.end(), optional))
    return out


def match_close(text: str, i: int, open_ch: str, close_ch: str) -> int:
    """Index of the bracket closing text[i] (== open_ch), honouring nesting of that kind and skipping
    string literals; -1 when it is never closed."""
    depth = 0
    n = len(text)
    while i < n:
        c = text[i]
        if c == open_ch:
            depth += 1
        elif c == close_ch:
            depth -= 1
            if depth == 0:
                return i
        elif c == '"':
            j = text.find('"', i + 1)
            i = j if j >= 0 else n
        i += 1
    return -1


def split_top_level(s: str, sep: str = ",") -> list[str]:
    """Split at `sep` outside (), [], {} and <>; a blank last piece is dropped."""
    out, depth, cur = [], 0, []
    for c in s:
        if c in "([{<":
            depth += 1
        elif c in ")]}>":
            depth -= 1
        if c == sep and depth == 0:
            out.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    if "".join(cur).strip():
        out.append("".join(cur))
    return out


class Param:
    """One kernel parameter, e.g. ``constant long& n [[buffer(3)]]``: type ``constant long&``, name ``n``,
    attr ``buffer``, attr_arg ``3``. An unnamed parameter has name ""; no attribute gives attr "" (a kernel's
    KernelSignature.parameters() numbers those as buffers, like Metal: ``implicit`` is then True). With several
    attributes (``[[buffer(5), function_constant(has_mask)]]``) attr is the binding one and ``function_constant``
    names the constant the parameter depends on (else "")."""

    __slots__ = ("text", "type", "name", "attr", "attr_arg", "implicit", "function_constant")

    def __init__(self, text: str):
        self.text = " ".join(text.split())
        m = re.match(r"^(.*?)\s*((?:\[\[(?:[^\[\]]|\[[^\[\]]*\])*\]\]\s*)+)$", self.text)
        decl = m.group(1) if m else self.text
        attrs = []
        for group in re.findall(r"\[\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\]", m.group(2) if m else ""):
            for a in split_top_level(group):
                am = re.match(r"^\s*(\w+)\s*(?:\((.*)\))?\s*$", a)
                if am:
                    attrs.append((am.group(1), (am.group(2) or "").strip()))
        self.function_constant = next((arg for a, arg in attrs if a == "function_constant"), "")
        binding = [(a, arg) for a, arg in attrs if a != "function_constant"]
        self.attr, self.attr_arg = binding[0] if binding else ("", "")
        self.implicit = False
        decl = decl.strip()
        arr = re.match(r"^(.*?\S)\s*([A-Za-z_]\w*)\s*\[[^\]]*\]$", decl)
        if arr:  # an array parameter is a pointer: `constant const int64_t strides[2]`
            decl = f"{arr.group(1)}* {arr.group(2)}"
        nm = re.match(r"^(.*?[\s*&>])\s*([A-Za-z_]\w*)$", decl)
        if nm and nm.group(1).strip() and not all(w in _QUALIFIERS for w in re.findall(r"\w+", nm.group(1))) \
                and not nm.group(1).rstrip().endswith("::"):
            self.type, self.name = nm.group(1).strip(), nm.group(2)
        else:
            self.type, self.name = decl, ""

    def __repr__(self):
        return f"Param({self.type!r}, {self.name!r}, [[{self.attr}({self.attr_arg})]])"


def leading_attributes(before: str) -> tuple[list[str], str]:
    """The ``[[...]]`` attributes ending `before` (in source order) and the text in front of them."""
    attrs = []
    b = before.rstrip()
    while b.endswith("]]"):
        i = b.rfind("[[")
        if i < 0:
            break
        attrs.insert(0, b[i + 2:-2].strip())
        b = b[:i].rstrip()
    return attrs, b


@dataclass(frozen=True)
class KernelSignature:
    """One ``kernel void name<targs>(params)`` found in a text; offsets index that text."""

    name: str
    start: int                  # offset of `kernel` / `[[kernel]]`
    template_args: str | None   # text inside `<...>` after the name (an instantiation), else None
    params_open: int            # offset of `(`
    params_close: int           # offset of the matching `)`
    params_text: str            # text between the parentheses, line markers removed
    terminator: str             # first non-blank character after `)`: "{" definition, ";" declaration...
    body_open: int = -1         # offset of the body's `{` (definitions only), else -1
    body_close: int = -1        # offset of the matching `}`, -1 when there is no (closed) body
    attributes: tuple = ()      # attributes written with the keyword: [[kernel, a(1)]] or kernel [[a(1)]] void

    @property
    def is_definition(self) -> bool:
        return self.terminator == "{"

    @property
    def body_span(self) -> tuple[int, int] | None:
        """(offset of `{`, offset of `}`) of a definition's closed body, else None."""
        return (self.body_open, self.body_close) if self.body_close > 0 else None

    def parameters(self) -> list[Param]:
        """The parameters; those without any ``[[...]]`` attribute are buffers numbered in order, as Metal
        does it (torch's compile_shader documentation writes kernels that way): each takes the lowest buffer
        index that no explicit ``[[buffer(n)]]`` of the kernel uses."""
        p = self.params_text.strip()
        params = [Param(x) for x in split_top_level(self.params_text)] if p and p != "void" else []
        used = {int(q.attr_arg) for q in params if q.attr == "buffer" and q.attr_arg.isdigit()}
        nxt = 0
        for q in params:
            if not q.attr:
                while nxt in used:
                    nxt += 1
                q.attr, q.attr_arg, q.implicit = "buffer", str(nxt), True
                used.add(nxt)
        return params


def scan_kernel_signatures(text: str):
    """Yield a KernelSignature for every kernel entry point in `text` (definitions, declarations and
    explicit instantiations written with a parameter list), in order. Template definitions are yielded
    too; the text before ``sig.start`` tells a template or an instantiation apart (see leading_attributes).
    Matches whose `<...>` or `(...)` never closes are skipped."""
    n = len(text)
    for m in _KERNEL_KEYWORD_RE.finditer(text):
        pos = m.end()
        template_args = None
        if pos < n and text[pos] == "<":
            close = match_close(text, pos, "<", ">")
            if close < 0:
                continue
            template_args = text[pos + 1:close].strip()
            pos = close + 1
            while pos < n and text[pos].isspace():
                pos += 1
        if pos >= n or text[pos] != "(":
            continue
        close = match_close(text, pos, "(", ")")
        if close < 0:
            continue
        after = close + 1
        while after < n and text[after].isspace():
            after += 1
        terminator = text[after:after + 1]
        body_open = body_close = -1
        if terminator == "{":
            body_open = after
            body_close = match_close(text, after, "{", "}")
        attributes = [a.strip() for a in split_top_level(m.group("list") or "")]
        for group in re.findall(r"\[\[((?:[^\[\]]|\[[^\[\]]*\])*)\]\]", m.group("between") or ""):
            attributes += [a.strip() for a in split_top_level(group)]
        yield KernelSignature(m.group("name"), m.start(), template_args, pos, close,
                              strip_line_markers(text[pos + 1:close]), terminator, body_open, body_close,
                              tuple(a for a in attributes if a))
