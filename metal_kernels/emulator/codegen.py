"""One launcher per kernel, generated from its signature: binds buffers and thread positions."""
from __future__ import annotations

import re

from .errors import MSLCompileError
from .msl_scan import Param
from .parse import _POS_ATTRS, KernelDecl, _template_param_names
def _buffer_arg(p: Param, idx: int) -> str:
    t = p.type
    if t.endswith("&"):
        return f"*({t[:-1].strip()}*)__b[{idx}]"
    if "*" in t:
        return f"({t})__b[{idx}]"
    return f"*({t}*)__b[{idx}]"


def _check_params(k: KernelDecl) -> None:
    seen = {}
    for p in k.params:
        where = f"kernel {k.host!r}, parameter {p.name or p.text!r}"
        if not p.attr:
            raise MSLCompileError(f"{where}: missing [[...]] attribute [MSL 3.1 (Kernel Function Arguments): a "
                                  f"kernel argument is a buffer, threadgroup memory or a thread position attribute]")
        if p.attr == "buffer":
            if not p.attr_arg.isdigit():
                raise MSLCompileError(f"{where}: [[buffer({p.attr_arg})]] needs an integer literal index [MSL 3.1 "
                                  f"(Attribute Qualifiers): the index of buffer(index) is an integer constant]")
            i = int(p.attr_arg)
            if i in seen:
                raise MSLCompileError(f"{where}: buffer index {i} used twice [MSL 3.1 (Kernel Function Arguments): "
                                  f"each buffer index of a kernel is bound once]")
            seen[i] = p
        elif p.attr == "threadgroup":
            pass  # compiles; a launch refuses it (launch.py): torch cannot size it, specialise the source
        elif p.attr not in _POS_ATTRS:
            raise MSLCompileError(f"{where}: unsupported attribute [[{p.attr}]] (an emulator and "
                                  f"torch.mps.compile_shader limit: compute kernels launched by torch get buffers, "
                                  f"threadgroup memory and thread positions; no textures or samplers)")


def generate_launchers(kernels: list[KernelDecl]) -> tuple[str, list[dict]]:
    lines = ['\n# 1 "<emulator-generated launchers>"', "namespace __emu_gen {"]
    table = []
    tpl_entries: dict[int, str] = {}
    for i, k in enumerate(kernels):
        _check_params(k)
        args = []
        for p in k.params:
            if p.attr == "buffer":
                args.append(_buffer_arg(p, int(p.attr_arg)))
            elif p.attr == "threadgroup":
                args.append(f"({p.type})nullptr")
            else:
                ptype = re.sub(r"\b(const|thread)\b", "", p.type).replace("&", "").strip()
                args.append(f"__emu::pos<{ptype}>({_POS_ATTRS[p.attr]})")
        body = ("  __emu::Thread& __t = __emu::cur(); __emu::Launch& __L = __emu::launch_info();"
                " (void)__t; (void)__L;\n")
        if k.kind == "inst":
            names = _template_param_names(k.template)
            key = id(k.template)
            ename = tpl_entries.get(key)
            if ename is None:
                ename = f"entry_tpl_{len(tpl_entries)}"
                tpl_entries[key] = ename
                lines.append(f"{k.template}\nstatic void {ename}(void** __b) {{\n{body}"
                             f"  ::{k.name}<{', '.join(names)}>({', '.join(args)});\n}}")
            entry = f"{ename}<{k.targs}>"
        else:
            callee = f"::{k.name}" + (f"<{k.targs}>" if k.targs is not None else "")
            lines.append(f"static void entry_{i}(void** __b) {{\n{body}  {callee}({', '.join(args)});\n}}")
            entry = f"entry_{i}"
        sym = f"__emu_launch_{i}"
        lines.append(
            f'extern "C" __attribute__((visibility("default"))) int {sym}(void** b, const uint32_t* dims, '
            f"uint32_t sched, uint64_t seed, char* err, size_t errlen) {{\n"
            f'  return __emu::launch("{k.host}", &{entry}, b, dims, sched, seed, err, errlen);\n}}')
        buffers = {int(p.attr_arg): {"type": p.type, "name": p.name} for p in k.params if p.attr == "buffer"}
        table.append({"host": k.host, "symbol": sym, "buffers": {str(b): v for b, v in buffers.items()},
                      "max_threads": k.max_threads, "name": k.name,
                      "threadgroup_params": [f"{p.type} {p.name} [[threadgroup({p.attr_arg})]]" for p in k.params
                                             if p.attr == "threadgroup"]})
    lines.append("}  // namespace __emu_gen\n")
    return "\n".join(lines), table
