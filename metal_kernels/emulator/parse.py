"""Kernel declarations parsed from the preprocessed source (plain, template instantiations, decltype form)."""
from __future__ import annotations

import re

from .errors import MSLCompileError
from .msl_scan import leading_attributes, match_close, scan_kernel_signatures, split_top_level, strip_line_markers

MAX_THREADS_PER_GROUP = 1024
_VEC_NAMES = r"(?:float|half|bfloat|int|uint|short|ushort|char|uchar|long|ulong|bool)[234]"
_POS_ATTRS = {
    "thread_position_in_grid": "__t.gpos[0], __t.gpos[1], __t.gpos[2]",
    "thread_position_in_threadgroup": "__t.lpos[0], __t.lpos[1], __t.lpos[2]",
    "threadgroup_position_in_grid": "__L.group[0], __L.group[1], __L.group[2]",
    "threads_per_threadgroup": "__L.tpg[0], __L.tpg[1], __L.tpg[2]",
    "dispatch_threads_per_threadgroup": "__L.req_tpg[0], __L.req_tpg[1], __L.req_tpg[2]",
    "threads_per_grid": "__L.grid[0], __L.grid[1], __L.grid[2]",
    "grid_size": "__L.grid[0], __L.grid[1], __L.grid[2]",
    "grid_origin": "0u, 0u, 0u",
    "threadgroups_per_grid": "__L.ngroups[0], __L.ngroups[1], __L.ngroups[2]",
    "thread_index_in_threadgroup": "__t.lin, 0u, 0u",
    "thread_index_in_simdgroup": "__t.lin % 32u, 0u, 0u",
    "simdgroup_index_in_threadgroup": "__t.lin / 32u, 0u, 0u",
    "threads_per_simdgroup": "32u, 0u, 0u",
    "thread_execution_width": "32u, 0u, 0u",
    "simdgroups_per_threadgroup": "(__L.nthreads + 31u) / 32u, 0u, 0u",
    "dispatch_simdgroups_per_threadgroup": "(__L.req_total + 31u) / 32u, 0u, 0u",
    "thread_index_in_quadgroup": "__t.lin % 4u, 0u, 0u",
    "quadgroup_index_in_threadgroup": "__t.lin / 4u, 0u, 0u",
    "quadgroups_per_threadgroup": "(__L.nthreads + 3u) / 4u, 0u, 0u",
    "dispatch_quadgroups_per_threadgroup": "(__L.req_total + 3u) / 4u, 0u, 0u",
}
POSITION_ATTRIBUTES = frozenset(_POS_ATTRS)


class KernelDecl:
    def __init__(self, host, name, params, *, template=None, targs=None, attrs=(), kind="plain"):
        self.host = host
        self.name = name
        self.params = params
        self.template = template  # template header text "template <...>" for template definitions
        self.targs = targs        # explicit template arguments of an instantiation
        self.attrs = list(attrs)
        self.kind = kind

    @property
    def max_threads(self) -> int:
        for a in self.attrs:
            m = re.match(r"\s*max_total_threads_per_threadgroup\s*\(\s*(\d+)\s*\)", a)
            if m:
                return int(m.group(1))
        return MAX_THREADS_PER_GROUP


_DECLTYPE_INST_RE = re.compile(
    r'\btemplate\s*\[\[\s*host_name\s*\(((?:\s*"[^"]*")+)\s*\)\s*\]\]\s*(?:\[\[[^\]]*\]\]\s*)*(?:kernel\s+)?'
    r'decltype\s*\(\s*([A-Za-z_]\w*)\s*<')


# through a typedef of the function type: template [[host_name("x")]] kernel kernel_unary_t kernel_unary_impl<float>;
_TYPEDEF_INST_RE = re.compile(
    r'\btemplate\s*\[\[\s*host_name\s*\(((?:\s*"[^"]*")+)\s*\)\s*\]\]\s*(?:\[\[[^\]]*\]\]\s*)*(?:kernel\s+)?'
    r'(?!void\b|decltype\b)[A-Za-z_][\w:]*\s+([A-Za-z_]\w*)\s*<')


_NOKW_INST_RE = re.compile(
    r'\btemplate\s*\[\[\s*host_name\s*\(((?:\s*"[^"]*")+)\s*\)\s*\]\]\s*(?:\[\[[^\]]*\]\]\s*)*'
    r'void\s+([A-Za-z_]\w*)\s*<')


def parse_kernels(pp: str) -> tuple[list[KernelDecl], list[tuple[int, int]]]:
    """Parse kernels from preprocessed text. Returns (host kernels, spans of instantiation statements)."""
    text = pp
    templates: dict[str, list[tuple[int, KernelDecl]]] = {}
    kernels: list[KernelDecl] = []
    remove: list[tuple[int, int]] = []
    for sig in scan_kernel_signatures(text):
        name, targs = sig.name, sig.template_args
        params = sig.parameters()
        attrs, before = leading_attributes(strip_line_markers(text[:sig.start]))
        attrs = [a.strip() for group in attrs for a in split_top_level(group)] + list(sig.attributes)
        host_attr = None
        for a in attrs:
            hm = re.match(r'host_name\s*\(((?:\s*"[^"]*")+)\s*\)', a)
            if hm:
                host_attr = "".join(re.findall(r'"([^"]*)"', hm.group(1)))
        if before.endswith("template") and not re.search(r"\w", before[-9:-8] or " "):
            # explicit instantiation `template [[host_name("x")]] kernel void foo<T>(...);`
            start = text.rfind("template", 0, sig.start)
            end = text.find(";", sig.params_close)
            remove.append((start, end + 1))
            host = host_attr or name
            defs = templates.get(name) or []
            if targs is not None and defs:
                d = _pick_template(defs, targs)  # parameters and attributes come from the template definition
                kernels.append(KernelDecl(host, name, d.params, template=d.template, targs=targs,
                                          attrs=d.attrs + attrs, kind="inst"))
            else:
                kernels.append(KernelDecl(host, name, params, targs=targs, attrs=attrs, kind="inst-concrete"))
            continue
        tm = re.search(r"\btemplate\s*<([^;{}]*)>$", before)
        if tm:
            if sig.is_definition:
                templates.setdefault(name, []).append(
                    (sig.start, KernelDecl(None, name, params, template=tm.group(0), attrs=attrs, kind="template")))
            continue
        if not sig.is_definition:
            continue  # a declaration
        kernels.append(KernelDecl(host_attr or name, name, params, attrs=attrs, kind="plain"))
    # decltype-form instantiations: template [[host_name("x")]] kernel decltype(foo<T>) foo<T>;
    # and instantiations without the `kernel` keyword: template [[host_name("x")]] void foo<T>(...);
    seen = {a for a, _ in remove}  # `template [[host_name("x")]] [[kernel]] void f<T>(...)` was found above
    for m in list(_DECLTYPE_INST_RE.finditer(text)) + list(_NOKW_INST_RE.finditer(text)) + \
            list(_TYPEDEF_INST_RE.finditer(text)):
        if m.start() in seen:
            continue
        host, name = "".join(re.findall(r'"([^"]*)"', m.group(1))), m.group(2)
        lt = m.end() - 1
        close = match_close(text, lt, "<", ">")
        end = text.find(";", close)
        if close < 0 or end < 0:
            continue
        targs = text[lt + 1:close].strip()
        remove.append((m.start(), end + 1))
        defs = templates.get(name)
        if not defs:
            raise MSLCompileError(f"instantiation {host!r}: no template kernel named {name!r} found")
        d = _pick_template(defs, targs)
        kernels.append(KernelDecl(host, name, d.params, template=d.template, targs=targs, attrs=d.attrs,
                                  kind="inst"))
    return kernels, remove


def _pick_template(defs: list[tuple[int, KernelDecl]], targs: str) -> KernelDecl:
    """The overload of a kernel template that an instantiation's explicit arguments name: the one whose
    template parameter list takes that many arguments (defaults and packs counted); the last one defined
    when several do."""
    n = len(split_top_level(targs)) if targs.strip() else 0
    fits = []
    for _, d in defs:
        params = split_top_level(d.template[d.template.index("<") + 1:d.template.rindex(">")])
        required = sum(1 for p in params if "=" not in p and "..." not in p)
        if required <= n and (n <= len(params) or any("..." in p for p in params)):
            fits.append(d)
    return (fits or [d for _, d in defs])[-1]


def _template_param_names(header: str) -> list[str]:
    inner = header[header.index("<") + 1:header.rindex(">")]
    names = []
    for p in split_top_level(inner):
        p = p.split("=")[0].strip()
        fp = re.search(r"\(\s*\*\s*([A-Za-z_]\w*)\s*\)", p)  # a function pointer: float2 (*f)(constant T*, uint2)
        ids = [fp.group(1)] if fp else re.findall(r"[A-Za-z_]\w*", p)
        if not ids:
            raise MSLCompileError(f"cannot parse template parameter {p!r}")
        names.append(("..." if "..." in p else "") and ids[-1] + "..." or ids[-1])
    return names
