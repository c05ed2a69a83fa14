"""CPU emulator for Metal Shading Language compute kernels.

Mirrors ``torch.mps.compile_shader``::

    lib = compile_library(src)          # MSLCompileError (clang's message) on bad source
    lib.my_kernel(t0, t1, 17, 0.5, [1, 2, 3], threads=N, group_size=G, arg_casts=None)

The .metal source is preprocessed with clang-19 (stub ``<metal_stdlib>`` & co.),
kernel signatures are parsed from the preprocessed text (``msl_scan``), a launcher is generated
per kernel, and the whole thing is compiled as C++20 with ``shim.h`` force-included
into a shared object that is cached by content hash and loaded with ctypes.

Mechanical rewrites applied to the preprocessed source (nothing else is changed):

1. ``template [[host_name("x")]] kernel ... foo<T>(...);`` explicit instantiations
   (also the ``decltype(foo<T>) foo<T>;`` form) are removed; the generated
   launcher instantiates ``foo<T>`` by calling it.
2. threadgroup variable declarations ``threadgroup T name[N][M];`` become
   references into per-threadgroup storage (``auto& name = *(T(*)[N][M])...``),
   which is filled with 0xFF (NaN) bytes at the start of every threadgroup.
3. vector constructors ``float4(...)`` / ``half2(...)`` / ``static_cast<float4>(..)``
   become ``__emu::vec<float4>(...)`` (splat, element-wise convert, concatenate
   like MSL); C-style vector casts ``(float4)x`` become ``__emu::vcast<float4>()->*x``.
4. half literals ``1.5h`` become ``((half)1.5f)``.

Known limitations (MSL the emulator does not handle):

* textures, samplers, ``simdgroup_matrix::thread_elements()`` (8x8 simdgroup
  matrices are emulated with a full copy per lane), ``quad_ballot``, function
  constants, ``[[threadgroup(n)]]`` parameters, kernels inside namespaces,
  ``<c10/metal/...>`` includes (kernels must be self-contained);
* vector comparisons yield clang's int vectors, not ``boolN`` (``bool4 m = a < b``
  does not compile; ``all``/``any``/``select`` accept them); ``packed_*`` types
  have ``.xyzw`` members and convert to/from vectors, but no arithmetic operators;
* math is computed in float (half/bfloat rounded afterwards) and without fast-math;
  compare with tolerances;
* one OS thread: spin-waiting on another thread's device-memory write never ends
  (a watchdog raises ``KernelCrash`` after $COMFY_METAL_EMU_TIMEOUT CPU seconds,
  default 600); an integer division by zero is reported (``KernelCrash``) instead of giving garbage;
* a threadgroup_barrier inside a helper function called from two places counts as
  one call site.

Runtime checks: guard regions around every buffer (``OutOfBoundsWrite``), NaN
filled threadgroup memory and out-of-bounds reads, barrier divergence
(``BarrierDivergence``), schedule perturbation (forward / reverse / shuffle),
crashes (SIGSEGV, SIGFPE, ...) reported as ``KernelCrash``.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import json
import os
import re
import shutil
import struct
import subprocess
import tempfile
import threading
from pathlib import Path

import torch

from .msl_scan import (LINE_MARKER_RE, Param, leading_attributes, match_close, scan_kernel_signatures,
                       split_top_level, strip_line_markers)

__all__ = [
    "compile_library", "available", "clang_path", "set_schedule", "get_schedule", "schedule",
    "EmulatorError", "MSLCompileError", "OutOfBoundsWrite", "BarrierDivergence", "KernelCrash",
    "Library", "Kernel", "GENERATOR_VERSION",
]

GENERATOR_VERSION = "1"
_HERE = Path(__file__).resolve().parent
_SHIM = _HERE / "shim.h"
_RUNTIME = _HERE / "runtime.h"
_SCANNER = _HERE / "msl_scan.py"  # part of the generator: hashed into the cache key
GUARD = 256  # bytes of 0xFF before and after every bound buffer
SIMD_WIDTH = 32
MAX_THREADS_PER_GROUP = 1024
_FLAGS = ["-std=c++20", "-O1", "-fPIC", "-shared", "-fvisibility=hidden", "-fno-strict-aliasing", "-fwrapv",
          "-Wno-unknown-attributes", "-Wno-ignored-attributes", "-Wno-deprecated-volatile",
          "-Wno-unused-value", "-Wno-c++11-narrowing", "-ferror-limit=20"]
_PP_FLAGS = ["-E", "-x", "c++", "-std=c++20", "-nostdinc", "-D__METAL_VERSION__=310", "-D__HAVE_BFLOAT__=1",
             "-D__METAL_MACOS__=1", "-D__METAL_EMULATOR__=1"]
_STUB_HEADERS = ["metal_stdlib", "metal_math", "metal_simdgroup", "metal_simdgroup_matrix", "metal_atomic",
                 "metal_compute", "metal_integer", "metal_common", "metal_geometric", "metal_relational",
                 "metal_numeric", "metal_types", "metal_pack", "metal_array", "metal_limits",
                 "metal_type_traits", "metal_utility", "metal_graphics", "metal_texture", "metal_matrix",
                 "metal_uniform", "metal_stdlib.h", "simd/simd.h"]


class EmulatorError(RuntimeError):
    """Base class of every emulator error."""


class MSLCompileError(EmulatorError):
    """The MSL source failed to preprocess/compile, or uses something the emulator rejects."""


class OutOfBoundsWrite(EmulatorError):
    """A kernel wrote outside the memory of one of its arguments."""


class BarrierDivergence(EmulatorError):
    """threadgroup_barrier reached in divergent control flow (a deadlock on a GPU)."""


class KernelCrash(EmulatorError):
    """The kernel crashed (invalid memory access, integer division by zero, stack overflow...)."""


# ----------------------------------------------------------------------------- toolchain
def clang_path() -> str | None:
    env = os.environ.get("COMFY_METAL_EMU_CLANG")
    if env:
        return env if (os.path.exists(env) or shutil.which(env)) else None
    for name in ("clang-19", "clang++-19"):
        p = shutil.which(name)
        if p:
            return p
    for p in ("/usr/bin/clang-19", "/usr/lib/llvm-19/bin/clang"):
        if os.path.exists(p):
            return p
    return None


def available() -> bool:
    """True when the emulator can compile kernels (clang-19 present, supported CPU)."""
    import platform
    return clang_path() is not None and platform.machine().lower() in ("x86_64", "amd64", "aarch64", "arm64") \
        and os.name == "posix"


_clang_version_cache: dict[str, str] = {}


def _clang_version(clang: str) -> str:
    v = _clang_version_cache.get(clang)
    if v is None:
        try:
            v = subprocess.run([clang, "--version"], capture_output=True, text=True, timeout=60).stdout
        except OSError as e:  # pragma: no cover
            raise EmulatorError(f"cannot run {clang}: {e}") from None
        _clang_version_cache[clang] = v
    return v


def _cache_dir() -> Path:
    d = os.environ.get("COMFY_METAL_EMU_CACHE")
    p = Path(d) if d else Path.home() / ".cache" / "comfy_metal" / "emulator"
    p.mkdir(parents=True, exist_ok=True)
    return p


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


# ----------------------------------------------------------------------------- schedule
_SCHED_KINDS = {"forward": 0, "reverse": 1, "shuffle": 2}
_DEFAULT_SCHEDULE = "shuffle:24301"
_schedule_override: str | None = None
_schedule_lock = threading.Lock()


def _parse_schedule(spec: str) -> tuple[int, int]:
    spec = spec.strip().lower()
    kind, _, seed = spec.partition(":")
    if kind not in _SCHED_KINDS:
        raise ValueError(f"unknown emulator schedule {spec!r}; use forward, reverse or shuffle[:seed]")
    try:
        s = int(seed, 0) if seed else 24301
    except ValueError:
        raise ValueError(f"bad seed in emulator schedule {spec!r}") from None
    return _SCHED_KINDS[kind], s & 0xFFFFFFFFFFFFFFFF


def get_schedule() -> str:
    """The schedule the next launch uses: set_schedule() value, else $COMFY_METAL_EMU_SCHEDULE, else shuffle."""
    if _schedule_override is not None:
        return _schedule_override
    return os.environ.get("COMFY_METAL_EMU_SCHEDULE") or _DEFAULT_SCHEDULE


def set_schedule(spec: str | None) -> None:
    """Set the thread schedule: "forward", "reverse", "shuffle" or "shuffle:<seed>"; None = env/default."""
    global _schedule_override
    if spec is not None:
        _parse_schedule(spec)
    _schedule_override = spec


@contextlib.contextmanager
def schedule(spec: str):
    """Context manager running the enclosed launches under `spec` (see set_schedule)."""
    global _schedule_override
    _parse_schedule(spec)
    with _schedule_lock:
        prev = _schedule_override
        _schedule_override = spec
    try:
        yield
    finally:
        _schedule_override = prev


# ----------------------------------------------------------------------------- parsing helpers
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
                d = defs[-1][1]  # parameters and attributes come from the template definition
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
    for m in list(_DECLTYPE_INST_RE.finditer(text)) + list(_NOKW_INST_RE.finditer(text)):
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
        d = defs[-1][1]
        kernels.append(KernelDecl(host, name, d.params, template=d.template, targs=targs, attrs=d.attrs,
                                  kind="inst"))
    return kernels, remove


def _template_param_names(header: str) -> list[str]:
    inner = header[header.index("<") + 1:header.rindex(">")]
    names = []
    for p in split_top_level(inner):
        p = p.split("=")[0].strip()
        ids = re.findall(r"[A-Za-z_]\w*", p)
        if not ids:
            raise MSLCompileError(f"cannot parse template parameter {p!r}")
        names.append(("..." if "..." in p else "") and ids[-1] + "..." or ids[-1])
    return names


# ----------------------------------------------------------------------------- rewrites
_TG_DECL_RE = re.compile(
    r"\bthreadgroup\s+(?P<type>(?:(?:const|volatile)\s+)*(?:metal::)?[A-Za-z_][\w:]*(?:\s*<[^;{}()]*?>)?)"
    r"\s+(?P<name>[A-Za-z_]\w*)\s*(?P<dims>(?:\[[^\];]+\]\s*)*);")
_TG_LEFTOVER_RE = re.compile(r"\bthreadgroup\s+(?:(?:const|volatile)\s+)*[A-Za-z_][\w:]*(?:\s*<[^;{}()]*?>)?"
                             r"\s+[A-Za-z_]\w*\s*(?:\[[^\]]*\]\s*)*"
                             r"(?:=[^;]*;|,\s*[A-Za-z_]\w*\s*(?:\[[^\]]*\]\s*)*[;,])")
_HALF_LIT_RE = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)[hH]\b")
_VEC_CTOR_RE = re.compile(r"(?<![\w.:>])(?:metal::)?(" + _VEC_NAMES + r")\s*\((?!\s*[*&]\s*\))")
_VEC_SCAST_RE = re.compile(r"\bstatic_cast\s*<\s*(?:metal::)?(" + _VEC_NAMES + r")\s*>\s*\(")
_VEC_CCAST_RE = re.compile(r"\(\s*(?:metal::)?(" + _VEC_NAMES + r")\s*\)(?=\s*[\w(\-+!~.])")


def _keep_newlines(s: str) -> str:
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

    # 2. half literals
    s = _HALF_LIT_RE.sub(lambda m: f"((half){m.group(1)}f)" if ("." in m.group(1) or "e" in m.group(1).lower())
                         else f"((half){m.group(1)}.0f)", s)
    # 3. vector constructors & casts
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
    # 4. threadgroup variables -> per-group storage
    slot = [0]

    def tg(m):
        typ, name, dims = m.group("type"), m.group("name"), re.sub(r"\s+", "", m.group("dims"))
        sid = slot[0]
        slot[0] += 1
        full = f"{typ}{dims}"
        return (f"auto& {name} = *reinterpret_cast<{typ}(*){dims}>(__emu::tg_storage({sid}u, sizeof({full}), "
                f"alignof({typ})));" + _keep_newlines(m.group(0)))

    s = _TG_DECL_RE.sub(tg, s)
    left = _TG_LEFTOVER_RE.search(s)
    if left:
        raise MSLCompileError(f"unsupported threadgroup declaration (declare one variable per statement, "
                              f"no initialiser): {left.group(0)!r}")

    return s


# ----------------------------------------------------------------------------- launcher generation
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
            raise MSLCompileError(f"{where}: missing [[...]] attribute (buffer(n) or a thread position attribute)")
        if p.attr == "buffer":
            if not p.attr_arg.isdigit():
                raise MSLCompileError(f"{where}: [[buffer({p.attr_arg})]] needs an integer literal index")
            i = int(p.attr_arg)
            if i in seen:
                raise MSLCompileError(f"{where}: buffer index {i} used twice")
            seen[i] = p
        elif p.attr == "threadgroup":
            raise MSLCompileError(f"{where}: [[threadgroup({p.attr_arg})]] parameters are not supported "
                                  f"(torch.mps.compile_shader cannot size dynamic threadgroup memory); "
                                  f"declare a kernel-scope `threadgroup T name[N];` array instead")
        elif p.attr not in _POS_ATTRS:
            raise MSLCompileError(f"{where}: unsupported attribute [[{p.attr}]] (compute kernels launched by "
                                  f"torch.mps.compile_shader only get buffers and thread positions)")


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
                      "max_threads": k.max_threads, "name": k.name})
    lines.append("}  // namespace __emu_gen\n")
    return "\n".join(lines), table


# ----------------------------------------------------------------------------- compile
_SRC_NAME = "msl_source.metal"


def _clean_msg(msg: str, tmpdir: str) -> str:
    msg = msg.replace(tmpdir + os.sep, "").replace(tmpdir, "")
    return msg.strip()


def _run(cmd: list[str], tmpdir: str, what: str) -> subprocess.CompletedProcess:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    except OSError as e:
        raise EmulatorError(f"cannot run {cmd[0]}: {e}") from None
    if r.returncode != 0:
        raise MSLCompileError(f"{what} failed:\n{_clean_msg(r.stderr, tmpdir)}")
    return r


def _preprocessor_args(tmp: str, src: str) -> list[str]:
    """Write `src` as tmp/msl_source.metal and empty stand-ins for <metal_stdlib> & co. under tmp/stub_include;
    return the `clang -E` arguments (after the compiler) that preprocess it. Shared with the lint."""
    stub = Path(tmp) / "stub_include"
    for h in _STUB_HEADERS:
        p = stub / h
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("#pragma once\n")
    src_path = Path(tmp) / _SRC_NAME
    src_path.write_text(src)
    return [*_PP_FLAGS, "-I", str(stub), str(src_path)]


def _build(src: str, clang: str, out_so: Path) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="comfy_metal_emu_") as tmp:
        pp = _run([clang, *_preprocessor_args(tmp, src)], tmp, "MSL preprocessing").stdout
        kernels, remove = parse_kernels(pp)
        hosts = [k.host for k in kernels]
        dup = {h for h in hosts if hosts.count(h) > 1}
        if dup:
            raise MSLCompileError(f"duplicate kernel host names: {sorted(dup)}")
        body = rewrite_source(pp, remove)
        launchers, table = generate_launchers(kernels)
        cpp = Path(tmp) / "translated.cpp"
        cpp.write_text(body + launchers)
        tmp_so = Path(tmp) / "lib.so"
        _run([clang, "-x", "c++", *_FLAGS, "-I", str(_HERE), "-include", str(_SHIM), str(cpp), "-o", str(tmp_so)],
             tmp, "MSL compilation (emulator, clang-19)")
        _atomic_write(out_so, tmp_so.read_bytes())
    return table


_launch_lock = threading.Lock()
_libs: dict[str, "Library"] = {}
_libs_lock = threading.Lock()


def compile_library(src: str) -> "Library":
    """Compile MSL source (several .metal files may be concatenated) like torch.mps.compile_shader."""
    if not isinstance(src, str):
        raise TypeError("compile_library expects the MSL source as a str")
    clang = clang_path()
    if clang is None:
        raise EmulatorError("clang-19 not found (apt-get install clang-19, or set COMFY_METAL_EMU_CLANG)")
    h = hashlib.sha256()
    for part in (GENERATOR_VERSION, _clang_version(clang), " ".join(_FLAGS + _PP_FLAGS), _SHIM.read_text(),
                 _RUNTIME.read_text(), Path(__file__).read_text(), _SCANNER.read_text(), src):
        h.update(part.encode())
        h.update(b"\0")
    key = h.hexdigest()[:40]
    with _libs_lock:
        lib = _libs.get(key)
    if lib is not None:
        return lib
    cache = _cache_dir()
    so, meta = cache / f"{key}.so", cache / f"{key}.json"
    table = None
    if so.exists() and meta.exists():
        try:
            table = json.loads(meta.read_text())
        except (OSError, ValueError):
            table = None
    if table is None:
        table = _build(src, clang, so)
        _atomic_write(meta, json.dumps(table).encode())
    lib = Library(ctypes.CDLL(str(so)), table, key)
    with _libs_lock:
        _libs[key] = lib
    return lib


# ----------------------------------------------------------------------------- launching
_CASTS = {
    "fp16": ("e", torch.float16), "bf16": (None, torch.bfloat16), "int32": ("i", None), "int16": ("h", None),
    "int8": ("b", None), "uint8": ("B", None),
}


def _pack_scalar(v, cast: str | None) -> bytes:
    is_float = isinstance(v, float)
    if is_float:
        v = struct.unpack("<f", struct.pack("<f", v))[0]  # torch: arg.cast<float>()
    if not cast:
        return struct.pack("<f", v) if is_float else struct.pack("<q", v)
    if cast not in _CASTS:
        raise ValueError(f"Unsupported cast instruction {cast}")
    fmt, dt = _CASTS[cast]
    if cast == "fp16":
        return struct.pack("<e", float(v)) if abs(float(v)) <= 65504 or v != v else \
            torch.tensor(float(v), dtype=torch.float16).view(torch.int16).numpy().tobytes()
    if cast == "bf16":
        return torch.tensor(float(v), dtype=torch.bfloat16).view(torch.int16).numpy().tobytes()
    iv = int(v)  # static_cast<intN_t>(float) truncates; integer casts wrap
    bits = struct.calcsize(fmt) * 8
    iv &= (1 << bits) - 1
    if fmt.islower() and iv >= 1 << (bits - 1):
        iv -= 1 << bits
    return struct.pack("<" + fmt, iv)


class _Region:
    """A guarded copy of host memory [start, end): GUARD bytes of 0xFF on both sides.

    The copy keeps the host address modulo 64, so misaligned vector loads behave
    as misaligned as they would on the GPU (on x86 they fault: KernelCrash)."""

    ALIGN = 64

    def __init__(self, start: int, end: int, copy_from_host: bool = True, data: bytes | None = None):
        self.start, self.end = start, end
        self.n = end - start if data is None else len(data)
        self.buf = torch.empty(self.n + 2 * GUARD + self.ALIGN, dtype=torch.uint8)
        self.buf.fill_(0xFF)
        p = self.buf.data_ptr()
        want = (start % self.ALIGN) if data is None else 0
        self.pad = GUARD + ((want - (p + GUARD)) % self.ALIGN)
        self.base = p + self.pad
        if data is not None and self.n:
            self.buf[self.pad:self.pad + self.n] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        elif copy_from_host and self.n:
            ctypes.memmove(self.base, start, self.n)
        self.members: list[tuple[int, int, int, str]] = []  # (arg index, start, end, description)

    def addr(self, host_addr: int) -> int:
        return self.base + (host_addr - self.start)

    def bad_guard_bytes(self):
        lo = self.buf[self.pad - GUARD:self.pad]
        hi = self.buf[self.pad + self.n:self.pad + self.n + GUARD]
        out = [i - GUARD for i in torch.nonzero(lo != 0xFF).flatten().tolist()]
        out += [self.n + i for i in torch.nonzero(hi != 0xFF).flatten().tolist()]
        return out


def _tensor_span(t: torch.Tensor) -> tuple[int, int]:
    if t.device.type != "cpu":
        raise EmulatorError(f"the emulator runs on CPU tensors, got a tensor on {t.device}")
    es = t.element_size()
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    if any(s < 0 for s in t.stride()):
        raise EmulatorError("negative strides are not supported")
    extent = sum((n - 1) * s for n, s in zip(t.shape, t.stride())) + 1
    return t.data_ptr(), t.data_ptr() + extent * es


def _describe(t: torch.Tensor) -> str:
    return f"tensor {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


class Kernel:
    def __init__(self, lib: "Library", entry: dict):
        self._lib = lib
        self.name = entry["host"]
        self._entry = entry
        self._fn = getattr(lib._dll, entry["symbol"])
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32), ctypes.c_uint32, ctypes.c_uint64,
                             ctypes.c_char_p, ctypes.c_size_t]
        self.buffers = {int(k): v for k, v in entry["buffers"].items()}

    @property
    def max_threads_per_threadgroup(self) -> int:
        return int(self._entry["max_threads"])

    @property
    def thread_execution_width(self) -> int:
        return SIMD_WIDTH

    def __repr__(self):
        return f"<emulated MSL kernel {self.name}>"

    def __call__(self, *args, threads=None, group_size=None, arg_casts=None, error_buf_idx=None):
        casts: dict[int, str] = {}
        default_cast = None
        if arg_casts is None:
            pass
        elif isinstance(arg_casts, str):
            default_cast = arg_casts
        elif isinstance(arg_casts, dict):
            casts = {int(k): v for k, v in arg_casts.items()}
        else:
            raise TypeError(f"Unexpected caster arg type {type(arg_casts).__name__}")

        def vec(v, what):
            if v is None:
                return None
            if isinstance(v, int):
                v = [v]
            v = [int(x) for x in v]
            if not 0 < len(v) < 4:
                raise ValueError(f"{what} must have 1 to 3 dimensions, got {v}")
            if any(x < 0 or x >= 1 << 32 for x in v):
                raise ValueError(f"{what} must be in [0, 2**32), got {v}")
            return v

        threads = vec(threads, "threads")
        group = vec(group_size, "group_size")

        # ---- collect memory to bind
        tensors: list[tuple[int, torch.Tensor]] = []  # (arg index, tensor) incl. tensor-list members
        bound: dict[int, tuple] = {}
        for i, a in enumerate(args):
            if isinstance(a, torch.Tensor):
                tensors.append((i, a))
                bound[i] = ("tensor", a)
                if threads is None:
                    threads = [a.numel()]
            elif isinstance(a, (list, tuple)):
                if not a:
                    raise ValueError("Empty list/tuple can not be an argument to metal kernel")
                first = a[0]
                cast = casts.get(i, default_cast)
                if isinstance(first, torch.Tensor):
                    if not all(isinstance(x, torch.Tensor) for x in a):
                        raise TypeError(f"argument {i}: mixed list")
                    for x in a:
                        tensors.append((i, x))
                    bound[i] = ("tensors", list(a))
                elif isinstance(first, (int, float)):
                    kind = float if isinstance(first, float) else int
                    vals = []
                    for x in a:
                        if kind is int and not isinstance(x, int) or kind is float and not isinstance(x, (int, float)):
                            raise TypeError(f"argument {i}: list elements must all be ints or all floats")
                        vals.append(kind(x))
                    bound[i] = ("bytes", b"".join(_pack_scalar(x, cast) for x in vals),
                                f"{kind.__name__}[{len(vals)}]")
                else:
                    raise TypeError("Unexpected argument types")
            elif isinstance(a, (bool, int, float)):
                v = int(a) if isinstance(a, bool) else a
                bound[i] = ("bytes", _pack_scalar(v, casts.get(i, default_cast)), type(v).__name__)
            else:
                raise TypeError(f"Unsupported argument type {type(a).__name__} (argument {i})")
        if threads is None:
            raise ValueError("Number of threads is undefined or has wrong dimension")
        if group is not None and len(group) != len(threads):
            raise ValueError("size and group_size must have same number of dimensions")
        max_tg = self.max_threads_per_threadgroup
        if group is None:
            group = [min(threads[0], max_tg)] if len(threads) == 1 else [max_tg] + [1] * (len(threads) - 1)
        total = 1
        for g in group:
            total *= g
        if total > max_tg:
            raise ValueError(f"Threadgroup size exceeds {max_tg} limit")
        grid3 = threads + [1] * (3 - len(threads))
        group3 = group + [1] * (3 - len(group))
        if any(x == 0 for x in grid3):
            return
        if any(x == 0 for x in group3):
            raise ValueError("group_size must be positive")

        # ---- guarded regions, merging aliasing tensors of one storage
        spans = []
        for i, t in tensors:
            s, e = _tensor_span(t)
            spans.append((t.untyped_storage().data_ptr() if t.numel() else -1 - len(spans), s, e, i, t))
        spans.sort(key=lambda x: (x[0], x[1]))
        regions: list[_Region] = []
        tensor_addr: dict[int, int] = {}  # id(tensor obj) -> bound address
        cur = None
        for store, s, e, i, t in spans:
            if cur is not None and cur[0] == store and s < cur[2]:
                cur[2] = max(cur[2], e)
                cur[3].append((i, s, e, t))
            else:
                if cur is not None:
                    regions.append(cur)
                cur = [store, s, e, [(i, s, e, t)]]
        if cur is not None:
            regions.append(cur)
        rlist = []
        for store, s, e, members in regions:
            r = _Region(s, e)
            for i, ms, me, t in members:
                r.members.append((i, ms, me, _describe(t)))
                tensor_addr[id(t)] = r.addr(ms)
            rlist.append(r)
        byte_regions = []  # (arg index, region, description)
        nbuf = max([len(args)] + [b + 1 for b in self.buffers])
        addrs = [0] * nbuf
        keep = []
        for i, b in bound.items():
            if b[0] == "tensor":
                addrs[i] = tensor_addr[id(b[1])]
            elif b[0] == "tensors":
                ptrs = struct.pack(f"<{len(b[1])}Q", *[tensor_addr[id(t)] for t in b[1]])
                r = _byte_region(ptrs)
                keep.append(r)
                byte_regions.append((i, r, f"tensor list[{len(b[1])}]"))
                addrs[i] = r.base
            else:
                r = _byte_region(b[1])
                byte_regions.append((i, r, b[2]))
                addrs[i] = r.base
        if error_buf_idx is not None:
            r = _byte_region(bytes(4096))
            byte_regions.append((int(error_buf_idx), r, "error buffer"))
            if int(error_buf_idx) >= len(addrs):
                addrs += [0] * (int(error_buf_idx) + 1 - len(addrs))
            addrs[int(error_buf_idx)] = r.base
        for j in range(len(addrs)):
            if not addrs[j]:
                r = _Region(0, 0, copy_from_host=False)
                byte_regions.append((j, r, "unbound buffer slot"))
                addrs[j] = r.base

        bufs = (ctypes.c_void_p * max(1, len(addrs)))(*addrs)
        dims = (ctypes.c_uint32 * 6)(*grid3, *group3)
        kind, seed = _parse_schedule(get_schedule())
        err = ctypes.create_string_buffer(4096)
        with _launch_lock:  # one launch at a time: the crash handlers are process-wide
            rc = self._fn(bufs, dims, kind, seed, err, len(err))

        # ---- copy back and check guards
        problems = []
        for r in rlist:
            if r.n:
                ctypes.memmove(r.start, r.base, r.n)
            bad = r.bad_guard_bytes()
            if bad:
                problems.append(_oob_message(self.name, r, bad))
        for i, r, desc in byte_regions:
            bad = r.bad_guard_bytes()
            if bad:
                problems.append(f"kernel {self.name!r}: out-of-bounds write to argument {i} ({desc}, {r.n} bytes) "
                                f"at byte offset {bad[0]} ({len(bad)} guard bytes changed)")
        if rc == 1:
            raise BarrierDivergence(err.value.decode(errors="replace"))
        if rc == 2:
            raise KernelCrash(err.value.decode(errors="replace"))
        if rc != 0:
            raise EmulatorError(err.value.decode(errors="replace") or f"emulator launch failed (code {rc})")
        if problems:
            raise OutOfBoundsWrite("\n".join(problems))


def _byte_region(data: bytes) -> _Region:
    return _Region(0, 0, copy_from_host=False, data=data)


def _oob_message(kernel: str, r: _Region, bad: list[int]) -> str:
    # attribute to the member argument whose span is nearest to the first bad byte
    off = bad[0]
    addr = r.start + off
    best = None
    for i, s, e, desc in r.members:
        dist = s - addr if addr < s else (addr - e + 1 if addr >= e else 0)
        if best is None or dist < best[0]:
            best = (dist, i, s, e, desc)
    _, i, s, e, desc = best
    rel = addr - s
    side = "before the start" if rel < 0 else "past the end"
    return (f"kernel {kernel!r}: out-of-bounds write to argument {i} ({desc}, {e - s} bytes): "
            f"byte offset {rel} ({side}; {len(bad)} guard bytes changed)")


class Library:
    """Compiled MSL library; kernels are attributes, as with torch.mps.compile_shader."""

    def __init__(self, dll, table: list[dict], key: str):
        self._dll = dll
        self._table = {e["host"]: e for e in table}
        self._kernels: dict[str, Kernel] = {}
        self.key = key

    @property
    def kernel_names(self) -> list[str]:
        return sorted(self._table)

    def __dir__(self):
        return self.kernel_names

    def __getattr__(self, name: str) -> Kernel:
        if name.startswith("__") or name in ("_dll", "_table", "_kernels", "key"):
            raise AttributeError(name)
        k = self._kernels.get(name)
        if k is None:
            e = self._table.get(name)
            if e is None:
                raise AttributeError(f"no kernel named {name!r} in this MSL library; available kernels: "
                                     f"{', '.join(self.kernel_names)}")
            k = self._kernels[name] = Kernel(self, e)
        return k

    def __repr__(self):
        return f"<emulated MSL library {self.key[:12]}: {', '.join(self.kernel_names)}>"
