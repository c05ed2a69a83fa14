"""The profiling build's LLVM IR pass (in Python, on the textual IR clang emits).

The profiling variant of a library is compiled to LLVM IR once (`-S -emit-llvm`, with SanitizerCoverage's
`trace-pc-guard` and ThreadSanitizer's access hooks), rewritten here, and the .so is built from the rewritten
IR, so the numbering below is exactly the code that runs:

* every basic block's coverage call becomes `__emu_prof_block(i32 B)`: B is the block's number, and this
  pass reads the block's instruction mix (issue slots by class) from the same IR;
* every instrumented memory access `__tsan_readN(p)` / `__tsan_writeN(p)` becomes
  `__emu_prof_readN(p, i32 S)`: S is the static access site (its source line and block are known here).

Blocks and accesses of emulator machinery (runtime.h, profile.h, the generated launchers, the SIMD resolvers,
thread positions, the per-lane simdgroup-matrix emulation) get no number: the runtime counts SIMD collectives,
barriers and simdgroup-matrix operations itself, as the GPU instructions they stand for.

Instruction classes and issue cost (cycles one scheduler spends per SIMT instruction; an Apple GPU core has
four schedulers). Measured figures are from philipturner/metal-benchmarks (README, "Instruction Throughputs",
M1 Max / A15); the integer divisions have no published figure (Apple GPUs have no integer divider) and are
assumptions, as marked.
"""
from __future__ import annotations

import dataclasses
import re

# class -> (description); the order is the report's order
CLASSES = {
    "fp32": "fp32 arithmetic / compare / select",
    "fp16": "fp16 / bf16 arithmetic",
    "int32": "32-bit (and narrower) integer",
    "int64": "64-bit integer",
    "idiv32": "32-bit integer divide / modulo",
    "idiv64": "64-bit integer divide / modulo",
    "transcendental": "exp / log / sin / sqrt / reciprocal / divide",
    "conversion": "int <-> float conversion, rounding",
}

# Cycles per SIMT instruction on one scheduler (metal-benchmarks, M1 Max): FADD/FMUL/FFMA 16/32: 1;
# FMAX/FMIN/FCMPSEL: 1; IADD32/BITWISE32/ICMPSEL32: 1; IMUL32/IMAD32: 4; LSHIFT32/BITEXTRACT32/POPCOUNT32/
# CLZ32: 4; IADD64: ~4 (4.68); IMUL64: 16; IMULHI64: 22; CONVERT F<->I32, RINT32, TRUNC32: 4; CONVERT(F->I64):
# ~8 (7.11); EXP2/LOG2 and e/10-based: 4; DIV32 (RECIP32 + FMUL32): 6; RSQRT32/SQRT32: 8; SIN32/COS32: ~14
# (14.28). "Most pipelines can accept 16-bit operands or write 16-bit results, with zero additional cost":
# half <-> float conversions are free.
CYCLES = {
    "f_simple": 1, "i_simple": 1, "i_mul": 4, "i_shift": 4, "i_bits": 4, "i64_simple": 4, "i64_mul": 16,
    "i64_shift": 8,  # assumption: two 32-bit shifts plus a merge; not measured
    "i128_mul": 22,
    "idiv32": 24,    # assumption: reciprocal-based sequence (2 convert, recip, mul, convert, imul, fix-up)
    "idiv64": 80,    # assumption: software routine of 64-bit multiplies (IMUL64 = 16) and fix-ups
    "cvt32": 4, "cvt64": 8, "rint": 4, "exp": 4, "div": 6, "sqrt": 8, "sin": 14,
    "pow": 9,        # EXP2 + LOG2 + FMUL
    "tan": 34,       # sin + cos + divide
    "tanh": 14,      # assumption: an exp, a reciprocal and a few fp32 ops
    "atrig": 20,     # assumption: atan/asin/acos/sinh/cosh/... polynomial sequences
    "bf16_cvt": 4,   # assumption: float -> bfloat rounding as an integer sequence
}

_FLT = {"float": "fp32", "half": "fp16", "bfloat": "fp16", "double": "fp32"}
_FP_BIN = {"fadd", "fsub", "fmul"}
_INT_BIN = {"add", "sub", "and", "or", "xor"}
_SHIFTS = {"shl", "lshr", "ashr"}
_DIVS = {"udiv", "sdiv", "urem", "srem"}
_FREE = {"getelementptr", "zext", "sext", "trunc", "bitcast", "ptrtoint", "inttoptr", "addrspacecast",
         "extractelement", "insertelement", "shufflevector", "extractvalue", "insertvalue", "phi", "br",
         "switch", "ret", "unreachable", "freeze", "alloca", "load", "store", "fence", "fneg", "va_arg",
         "indirectbr", "landingpad", "resume", "atomicrmw", "cmpxchg", "invoke", "callbr"}
# libm / intrinsic name (without the llvm. prefix and type suffix) -> cost key (all transcendental)
_MATH = {
    "exp": "exp", "exp2": "exp", "exp10": "exp", "log": "exp", "log2": "exp", "log10": "exp",
    "sqrt": "sqrt", "sin": "sin", "cos": "sin", "pow": "pow", "powi": "pow", "tan": "tan", "tanh": "tanh",
    "atan": "atrig", "asin": "atrig", "acos": "atrig", "atan2": "atrig", "sinh": "atrig", "cosh": "atrig",
    "asinh": "atrig", "acosh": "atrig", "atanh": "atrig", "hypot": "atrig", "fmod": "atrig", "frexp": "rint",
    "ldexp": "rint", "modf": "rint",
}
_ROUND = {"floor", "ceil", "trunc", "rint", "round", "nearbyint", "roundeven", "lround", "llround", "lrint"}
_F_SIMPLE = {"fma", "fmuladd", "minnum", "maxnum", "minimum", "maximum", "copysign", "fabs"}
_I_SIMPLE = {"smin", "smax", "umin", "umax", "abs"}
_I_BITS = {"ctpop", "ctlz", "cttz", "bitreverse", "bswap", "fshl", "fshr", "umul.with.overflow",
           "smul.with.overflow", "uadd.with.overflow", "sadd.with.overflow", "usub.with.overflow", "uadd.sat",
           "usub.sat", "sadd.sat", "ssub.sat"}
_FREE_CALLS = {"lifetime.start", "lifetime.end", "assume", "dbg.value", "dbg.declare", "dbg.label", "expect",
               "threadlocal.address", "memset", "memcpy", "memmove", "experimental.noalias.scope.decl",
               "invariant.start", "invariant.end", "stacksave", "stackrestore", "prefetch", "va_start", "va_end"}

# shim.h functions that are emulator machinery, not MSL the kernel runs (by the plain name the debug info
# carries): the SIMD resolvers and exchange wrappers (the runtime counts the collective), thread positions,
# threadgroup storage, the lane layout and products of simdgroup matrices, and the per-lane emulation of simdgroup matrices (the runtime counts the operation)
_SHIM_MACHINERY = {"resolve", "mma_resolve", "fill_resolve", "sg_coord", "pos", "tg_storage",
                   "simdgroup_multiply_accumulate", "simdgroup_multiply",
                   "simdgroup_load", "simdgroup_store", "make_filled_simdgroup_matrix", "simdgroup_matrix"}
_SHIM_MACHINERY_PREFIXES = ("__emu_simd_", "__emu_quad_", "__emu_simdgroup_barrier", "__emu_threadgroup_barrier",
                            "simd_", "quad_")
# the same by mangled name, for functions without debug info
_MACHINERY_NAMES = re.compile(r"_ZN5__emu(7resolve|11mma_resolve|12fill_resolve|8sg_coord|3pos|10tg_storage)|simdgroup_multiply|simdgroup_load|"
                              r"simdgroup_store|make_filled_simdgroup_matrix|__emu_gen|^__emu_|^__tsan_|^__sanitizer_")
SOURCE_FILE = "msl_source.metal"
_COUNTED_FILES = (SOURCE_FILE, "shim.h")   # the kernel's own code and the MSL library it calls

_DEFINE = re.compile(r"^define [^@]*@(\"[^\"]+\"|[\w.$]+)\(.*?(?:!dbg !(\d+))?\s*\{\s*$")
_LABEL = re.compile(r"^([\w.$-]+):")
_DBG = re.compile(r"!dbg !(\d+)")
_VEC = re.compile(r"<(\d+) x (\w+)>")
_TSAN = re.compile(r"@__tsan_(?:unaligned_)?(read|write)(1|2|4|8|16)\(")
_GUARD = "@__sanitizer_cov_trace_pc_guard("
_ASSIGN = re.compile(r"^%[\w.$-]+ = (.*)$")


@dataclasses.dataclass
class Block:
    id: int
    function: str
    line: int                      # msl_source.metal line of its first source-attributed instruction (0: none)
    mix: dict                      # class -> [SIMT instructions, scheduler cycles] per execution
    flops: float                   # fp32/fp16 FLOPs per lane per execution (an FMA counts 2)
    lines: dict                    # source line -> scheduler cycles per execution (hot-line attribution)


@dataclasses.dataclass
class Site:
    id: int
    write: bool
    size: int
    line: int
    block: int                     # -1: in uncounted code


def _balanced(s: str, i: int) -> int:
    """Index just past the parenthesis group opening at s[i] == '('."""
    depth = 0
    for j in range(i, len(s)):
        c = s[j]
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return j + 1
    raise ValueError(f"unbalanced parentheses in IR line: {s[:200]}")


class _Meta:
    """The debug metadata this pass needs: locations, scopes, subprograms, files."""

    _LOC = re.compile(r"^!(\d+) = !DILocation\((.*)\)\s*$")
    _NODE = re.compile(r"^!(\d+) = (?:distinct )?!(DISubprogram|DILexicalBlock|DILexicalBlockFile|DIFile)\((.*)\)\s*$")
    _FIELD = re.compile(r"(\w+): (\"(?:[^\"\\]|\\.)*\"|![0-9]+|[\w-]+)")

    def __init__(self, lines: list[str]):
        self.loc: dict[int, tuple[int, int, int]] = {}       # id -> (line, scope, inlinedAt or 0)
        self.node: dict[int, tuple[str, dict]] = {}
        for ln in lines:
            if not ln.startswith("!"):
                continue
            m = self._LOC.match(ln)
            if m:
                f = dict(self._FIELD.findall(m.group(2)))
                self.loc[int(m.group(1))] = (int(f.get("line", 0)), int(f.get("scope", "!0")[1:]),
                                             int(f["inlinedAt"][1:]) if "inlinedAt" in f else 0)
                continue
            m = self._NODE.match(ln)
            if m:
                self.node[int(m.group(1))] = (m.group(2), dict(self._FIELD.findall(m.group(3))))
        self._sp_cache: dict[int, tuple[str, str]] = {}

    def file_of(self, scope: int) -> str:
        kind, f = self.node.get(scope, ("", {}))
        fid = f.get("file")
        if kind == "DIFile":
            return f.get("filename", "").strip('"')
        if fid:
            return self.node.get(int(fid[1:]), ("", {}))[1].get("filename", "").strip('"')
        return ""

    def subprogram(self, scope: int) -> tuple[str, str]:
        """(linkage or plain name, file) of the subprogram enclosing `scope`."""
        hit = self._sp_cache.get(scope)
        if hit is not None:
            return hit
        s, seen = scope, 0
        while s in self.node and seen < 64:
            kind, f = self.node[s]
            if kind == "DISubprogram":
                name = (f.get("linkageName") or f.get("name") or "").strip('"')
                hit = (name, self.file_of(s))
                break
            s, seen = int(f.get("scope", "!0")[1:]), seen + 1
        else:
            hit = ("", "")
        self._sp_cache[scope] = hit
        return hit

    def attribution(self, dbg: int) -> tuple[bool, int]:
        """(machinery?, msl_source.metal line or 0) of the instruction at location `dbg`. Machinery: the
        innermost function it was written in is emulator machinery."""
        loc = self.loc.get(dbg)
        if loc is None:
            return False, 0
        name, file = self.subprogram(loc[1])
        machinery = _is_machinery(name, file)
        line = 0
        while loc is not None:
            if self.file_of(loc[1]).endswith(SOURCE_FILE):
                line = loc[0]
                break
            loc = self.loc.get(loc[2]) if loc[2] else None
        return machinery, line


def _is_machinery(name: str, file: str) -> bool:
    """Code that is not the kernel's: the runtime, the profiler, launchers, system headers, and the
    emulation helpers of shim.h."""
    if file.endswith(SOURCE_FILE):
        return False
    if not file.endswith(_COUNTED_FILES):
        return True
    base = name.split("<", 1)[0]
    return base in _SHIM_MACHINERY or base.startswith(_SHIM_MACHINERY_PREFIXES) or bool(_MACHINERY_NAMES.search(name))


def _elems_and_type(tok: str) -> tuple[int, str]:
    m = _VEC.match(tok)
    if m:
        return int(m.group(1)), m.group(2)
    return 1, tok.split()[0] if tok else ""


def _int_bits(t: str) -> int:
    return int(t[1:]) if t.startswith("i") and t[1:].isdigit() else (64 if t == "ptr" else 0)


def _operand_type(rest: str) -> str:
    """The first type token of an instruction's operand list (after its flags)."""
    toks = rest.split()
    while toks and toks[0] in ("nuw", "nsw", "exact", "disjoint", "nneg", "fast", "nnan", "ninf", "nsz", "arcp",
                               "contract", "afn", "reassoc", "samesign", "inbounds", "volatile", "tail"):
        toks = toks[1:]
    if not toks:
        return ""
    if toks[0].startswith("<"):
        return " ".join(toks[:3]).rstrip(",")
    return toks[0].rstrip(",")


def classify(line: str) -> list[tuple[str, str, int, float]]:
    """[(class, cost key, element count, FLOPs per element)] for one IR instruction ([] = free)."""
    body = line.strip()
    m = _ASSIGN.match(body)
    if m:
        body = m.group(1)
    for pre in ("tail ", "musttail ", "notail "):
        if body.startswith(pre):
            body = body[len(pre):]
    op, _, rest = body.partition(" ")
    if op in _FREE or not op:
        return []
    if op in _FP_BIN or op == "fdiv" or op == "frem":
        n, t = _elems_and_type(_operand_type(rest))
        cls = _FLT.get(t, "fp32")
        if op == "fdiv":
            return [("transcendental", "div", n, 1.0)]
        if op == "frem":
            return [("transcendental", "atrig", n, 0.0)]
        return [(cls, "f_simple", n, 1.0)]
    if op == "fcmp":
        pred_rest = rest.split(" ", 1)[1] if " " in rest else ""
        n, t = _elems_and_type(_operand_type(pred_rest))
        return [(_FLT.get(t, "fp32"), "f_simple", n, 0.0)]
    if op == "icmp":
        pred_rest = rest.split(" ", 1)[1] if " " in rest else ""
        n, t = _elems_and_type(_operand_type(pred_rest))
        return [("int64", "i64_simple", n, 0.0)] if _int_bits(t) >= 64 else [("int32", "i_simple", n, 0.0)]
    if op in _INT_BIN or op == "mul" or op in _SHIFTS or op in _DIVS:
        n, t = _elems_and_type(_operand_type(rest))
        bits = _int_bits(t)
        if op in _DIVS:
            return [("idiv64", "idiv64", n, 0.0)] if bits > 32 else [("idiv32", "idiv32", n, 0.0)]
        if bits > 64:
            return [("int64", "i128_mul" if op == "mul" else "i64_simple", 2 * n, 0.0)]
        if bits == 64:
            key = "i64_mul" if op == "mul" else "i64_shift" if op in _SHIFTS else "i64_simple"
            return [("int64", key, n, 0.0)]
        key = "i_mul" if op == "mul" else "i_shift" if op in _SHIFTS else "i_simple"
        return [("int32", key, n, 0.0)]
    if op == "select":
        # select i1 %c, <type> %a, <type> %b
        after = rest.split(",", 1)[1] if "," in rest else ""
        n, t = _elems_and_type(_operand_type(after))
        if t in _FLT:
            return [(_FLT[t], "f_simple", n, 0.0)]
        return [("int64", "i64_simple", n, 0.0)] if _int_bits(t) >= 64 else [("int32", "i_simple", n, 0.0)]
    if op in ("fptosi", "fptoui", "sitofp", "uitofp"):
        n, src = _elems_and_type(_operand_type(rest))
        dst = rest.rsplit(" to ", 1)[-1].strip()
        dn, dst_t = _elems_and_type(dst)
        wide = _int_bits(src) > 32 or _int_bits(dst_t) > 32
        return [("conversion", "cvt64" if wide else "cvt32", n, 0.0)]
    if op in ("fpext", "fptrunc"):
        n, src = _elems_and_type(_operand_type(rest))
        dst = _elems_and_type(rest.rsplit(" to ", 1)[-1].strip())[1]
        if "bfloat" in (src, dst):
            return [("conversion", "bf16_cvt", n, 0.0)] if op == "fptrunc" else [("int32", "i_simple", n, 0.0)]
        return []                                             # half <-> float: free source/destination modifier
    if op == "call":
        m = re.search(r"@([\w.$]+)\(", rest)
        if not m:
            return []
        name = m.group(1)
        n = 1
        vm = _VEC.search(rest.split("@", 1)[0])
        if vm:
            n = int(vm.group(1))
        if name.startswith("llvm."):
            base = re.sub(r"\.(v\d+)?(f16|bf16|f32|f64|f80|f128|i\d+|p0)(\.(v\d+)?(f16|bf16|f32|f64|i\d+|p0))*$",
                          "", name[5:])
            if base in _FREE_CALLS:
                return []
            tm = re.search(r"\.(?:v\d+)?(f16|bf16|f32|f64|i\d+)$", name)
            ty = tm.group(1) if tm else "f32"
            fcls = "fp16" if ty in ("f16", "bf16") else "fp32"
            if base in ("fma", "fmuladd"):
                return [(fcls, "f_simple", n, 2.0)]
            if base in _F_SIMPLE:
                return [(fcls, "f_simple", n, 0.0)]
            if base in _ROUND:
                return [("conversion", "rint", n, 0.0)]
            if base in _MATH:
                return [("transcendental", _MATH[base], n, 0.0)]
            if base in _I_SIMPLE:
                bits = int(ty[1:]) if ty.startswith("i") else 32
                return [("int64", "i64_simple", n, 0.0)] if bits >= 64 else [("int32", "i_simple", n, 0.0)]
            if base in _I_BITS:
                bits = int(ty[1:]) if ty.startswith("i") else 32
                return [("int64", "i64_shift", n, 0.0)] if bits >= 64 else [("int32", "i_bits", n, 0.0)]
            return []
        plain = name[:-1] if name.endswith("f") and name[:-1] in _MATH else name
        if plain in _MATH:
            return [("transcendental", _MATH[plain], n, 0.0)]
        if plain in _ROUND or (name.endswith("f") and name[:-1] in _ROUND):
            return [("conversion", "rint", n, 0.0)]
        if name in ("fmaf", "fma"):
            return [("fp32", "f_simple", n, 2.0)]
        if name in ("fminf", "fmaxf", "fabsf", "copysignf"):
            return [("fp32", "f_simple", n, 0.0)]
        return []                                             # a call to another function: counted in its blocks
    return []


@dataclasses.dataclass
class Rewritten:
    ir: str
    blocks: list[Block]
    sites: list[Site]


def rewrite(ir: str) -> Rewritten:
    """Number the blocks and access sites of a coverage + TSan instrumented module and read the blocks' mix."""
    lines = ir.split("\n")
    meta = _Meta(lines)
    blocks: list[Block] = []
    sites: list[Site] = []
    out: list[str] = []
    fn = None
    fn_machinery = False
    fn_line = 0
    body: list[str] = []             # the current basic block's lines

    def where(ln: str) -> tuple[bool, int]:
        """(emulator code?, source line) of one instruction: by the innermost function it was written in
        (kernels are inlined into their generated launchers), else by the function it is in."""
        dm = _DBG.search(ln)
        if dm and int(dm.group(1)) in meta.loc:
            return meta.attribution(int(dm.group(1)))
        return fn_machinery, fn_line

    def flush():
        """Emit the buffered block: its coverage call numbered (or dropped: emulator code), its accesses
        numbered, its instruction mix recorded."""
        nonlocal body
        guard = next((i for i, ln in enumerate(body) if _GUARD in ln), -1)
        mix: dict[str, list[float]] = {}
        by_line: dict[int, float] = {}
        flops, first_line = 0.0, 0
        located = [where(ln) for ln in body if _DBG.search(ln)]
        # the block is the kernel's if one of its located instructions is (phis and the like carry no
        # location: an inlined emulation loop, e.g. simdgroup_multiply_accumulate's, stays uncounted)
        counted = any(not m for m, _ in located) if located else not fn_machinery
        for i, ln in enumerate(body):
            if not counted or i == guard or _TSAN.search(ln) or not ln.startswith("  ") or ln.startswith("    "):
                continue
            machinery, line = where(ln)
            if machinery:
                continue
            first_line = first_line or line
            for cls, key, n, fl in classify(ln.split(", !dbg", 1)[0]):
                ent = mix.setdefault(cls, [0.0, 0.0])
                ent[0] += n
                ent[1] += n * CYCLES[key]
                flops += n * fl
                by_line[line] = by_line.get(line, 0.0) + n * CYCLES[key]
        if 0 in by_line and (first_line or fn_line):          # compiler-made "line 0" locations: the block's line
            by_line[first_line or fn_line] = by_line.get(first_line or fn_line, 0.0) + by_line.pop(0)
        block_id = -1
        if guard >= 0 and counted:
            block_id = len(blocks)
            blocks.append(Block(block_id, fn, first_line, mix, flops, by_line))
        for i, ln in enumerate(body):
            if i == guard:
                if block_id >= 0:
                    gi = ln.find(_GUARD)
                    end = _balanced(ln, gi + len(_GUARD) - 1)
                    out.append(ln[:gi] + f"@__emu_prof_block(i32 {block_id})" + ln[end:])
                continue                                      # emulator code: the coverage call goes
            tm = _TSAN.search(ln)
            if tm and not where(ln)[0]:
                start = tm.end() - 1
                end = _balanced(ln, start)
                sid = len(sites)
                sites.append(Site(sid, tm.group(1) == "write", int(tm.group(2)), where(ln)[1], block_id))
                ln = ln[:tm.start()] + f"@__emu_prof_{tm.group(1)}{tm.group(2)}({ln[start + 1:end - 1]}, i32 {sid})" \
                    + ln[end:]
            out.append(ln)
        body = []

    for ln in lines:
        if fn is None:
            m = _DEFINE.match(ln)
            if m:
                fn = m.group(1).strip('"')
                sp = int(m.group(2)) if m.group(2) else 0
                spname, spfile = meta.subprogram(sp) if sp else ("", "")
                fn_machinery = _is_machinery(spname, spfile) if sp else True
                fn_line = int(meta.node.get(sp, ("", {}))[1].get("line", 0)) if spfile.endswith(SOURCE_FILE) else 0
                body = []
            out.append(ln)
            continue
        if ln.startswith("}"):
            flush()
            fn = None
            out.append(ln)
            continue
        if _LABEL.match(ln):
            flush()
        body.append(ln)
    return Rewritten("\n".join(out), blocks, sites)
