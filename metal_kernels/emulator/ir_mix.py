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
# CLZ32: 4; RSHIFT32 by a run-time amount: ~8 (7.89); IMULHI32: 8; IADD64: ~4 (4.68); IMUL64: 16; IMULHI64: 22;
# CONVERT F<->I32, RINT32, TRUNC32: 4; CONVERT(F->I64): ~8 (7.11); EXP2/LOG2 and e/10-based: 4; DIV32
# (RECIP32 + FMUL32): 6; RSQRT32/SQRT32: 8; SIN32/COS32: ~14 (14.28). "Most pipelines can accept 16-bit
# operands or write 16-bit results, with zero additional cost": half <-> float conversions are free.
CYCLES = {
    "f_simple": 1, "i_simple": 1, "i_mul": 4, "i_shift": 4, "i_bits": 4, "i64_simple": 4, "i64_mul": 16,
    "i_rshift_var": 8,
    "i64_shift": 8,  # assumption: two 32-bit shifts plus a merge; not measured
    "i128_mul": 22,
    "idiv32": 24,    # assumption: reciprocal-based sequence (2 convert, recip, mul, convert, imul, fix-up)
    "idiv64": 80,    # assumption: software routine of 64-bit multiplies (IMUL64 = 16) and fix-ups
    # division by a constant: the GPU compiler multiplies by the reciprocal instead (IMULHI + shift; a
    # remainder adds IMUL + subtract), as every compiler does; LLVM leaves that to its back end, so the IR
    # still shows udiv/urem. From the measured costs above: 32-bit 8 + 4 (+ 4 + 1), 64-bit 22 + 8 (+ 16 + 4)
    "idiv32_const": 12, "irem32_const": 17, "idiv64_const": 30, "irem64_const": 50,
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
# accesses of other sizes and struct copies (the profiling build instruments memcpy/memmove/memset): the
# runtime splits them into accesses of at most 16 bytes
_TSAN_RANGE = re.compile(r"@__tsan_(read_range|write_range|memcpy|memmove|memset)\(")
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
    flops16: float = 0.0           # the part of `flops` in fp16/bf16 arithmetic


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


def _constant_operand(rest: str) -> bool:
    """Whether the second operand of a binary instruction ("i32 %a, 24", "<4 x i32> %a, splat (i32 3)") is a
    constant."""
    depth = 0
    for i, c in enumerate(rest):
        depth += (c in "<(") - (c in ">)")
        if c == "," and depth == 0:
            second = rest[i + 1:].split(", !", 1)[0].strip()
            if second.startswith(("splat", "<")):
                return "%" not in second
            return second.lstrip("-").isdigit()
    return False


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
        const_rhs = _constant_operand(rest)
        if op in _DIVS:
            cls = "idiv64" if bits > 32 else "idiv32"
            if const_rhs:
                return [(cls, cls.replace("div", "rem" if op in ("urem", "srem") else "div") + "_const", n, 0.0)]
            return [(cls, cls, n, 0.0)]
        if bits > 64:
            return [("int64", "i128_mul" if op == "mul" else "i64_simple", 2 * n, 0.0)]
        if bits == 64:
            key = "i64_mul" if op == "mul" else "i64_shift" if op in _SHIFTS else "i64_simple"
            return [("int64", key, n, 0.0)]
        key = "i_mul" if op == "mul" else "i_simple"
        if op in _SHIFTS:
            key = "i_rshift_var" if op != "shl" and not const_rhs else "i_shift"
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


_SSA = re.compile(r"%[\w.$-]+")
_EXT16 = re.compile(r"^fpext (?:<\d+ x )?(?:half|bfloat)>? ")
_TRUNC16 = re.compile(r"^fptrunc .* to (?:<\d+ x )?(?:half|bfloat)>?\s*(?:,|$)")
_NARROWABLE = re.compile(r"^(?:fadd|fsub|fmul|fneg|select|(?:tail )?call .*@llvm\.(?:fma|fmuladd|minnum|maxnum|minimum|"
                         r"maximum|fabs|copysign)\.(?:v\d+)?f32\()")


def _narrow_lines(lines: list[str]) -> set[int]:
    """Indices of fp32 instructions that are fp16 arithmetic on the GPU: every value they read is a half
    (or bfloat) widened to float, a constant or another such instruction, and every use of their result is
    such an instruction or a narrowing back to 16 bits. The shim writes some MSL half functions (fma, mix,
    clamp, ...) this way through float; Apple's compiler runs them as the 16-bit instructions they are."""
    out: set[int] = set()
    defs: dict[str, tuple[int, str]] = {}          # SSA name -> (line index, instruction text)
    uses: dict[str, list[tuple[str, str]]] = {}    # SSA name -> [(user's SSA name or "", user's text)]

    def operands(text: str) -> list[str]:
        text = text.split(", !dbg", 1)[0]
        if text.startswith("select "):              # the i1 condition is not a value read
            text = text.split(",", 1)[1] if "," in text else ""
        return [o for o in _SSA.findall(text) if not o.startswith("%struct.")]

    for i, ln in enumerate(lines):
        if ln.startswith("define "):
            defs, uses = {}, {}
            continue
        if ln.startswith("}"):
            cand = {n for n, (_, t) in defs.items() if _NARROWABLE.match(t) and " float" in t.split("(", 1)[0] + " "}
            cand = {n for n in cand if "float" in defs[n][1]}
            changed = True
            while changed:
                changed = False
                for n in list(cand):
                    reads = all(o in cand or _EXT16.match(defs.get(o, (0, ""))[1]) for o in operands(defs[n][1]))
                    used = uses.get(n, [])
                    if not (reads and used and all(u in cand or _TRUNC16.match(t) for u, t in used)):
                        cand.discard(n)
                        changed = True
            out.update(defs[n][0] for n in cand)
            defs, uses = {}, {}
            continue
        text = ln.strip()
        m = _ASSIGN.match(text)
        name = text.split(" =", 1)[0] if m else ""
        body = m.group(1) if m else text
        for pre in ("tail ", "musttail ", "notail "):
            body = body[len(pre):] if body.startswith(pre) else body
        if name:
            defs[name] = (i, body)
        for o in set(operands(body)):
            uses.setdefault(o, []).append((name, body))
    return out


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
    body_idx: list[int] = []         # their indices in `lines`
    narrow = _narrow_lines(lines)

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
        nonlocal body, body_idx
        guard = next((i for i, ln in enumerate(body) if _GUARD in ln), -1)
        mix: dict[str, list[float]] = {}
        by_line: dict[int, float] = {}
        flops, flops16, first_line = 0.0, 0.0, 0
        located = [where(ln) for ln in body if _DBG.search(ln)]
        # the block is the kernel's if one of its located instructions is (phis and the like carry no
        # location: an inlined emulation loop, e.g. simdgroup_multiply_accumulate's, stays uncounted)
        counted = any(not m for m, _ in located) if located else not fn_machinery
        for i, ln in enumerate(body):
            if not counted or i == guard or _TSAN.search(ln) or _TSAN_RANGE.search(ln) or not ln.startswith("  ") \
                    or ln.startswith("    "):
                continue
            machinery, line = where(ln)
            if machinery:
                continue
            first_line = first_line or line
            for cls, key, n, fl in classify(ln.split(", !dbg", 1)[0]):
                if cls == "fp32" and body_idx[i] in narrow:
                    cls = "fp16"
                ent = mix.setdefault(cls, [0.0, 0.0])
                ent[0] += n
                ent[1] += n * CYCLES[key]
                flops += n * fl
                flops16 += n * fl if cls == "fp16" else 0.0
                by_line[line] = by_line.get(line, 0.0) + n * CYCLES[key]
        if 0 in by_line and (first_line or fn_line):          # compiler-made "line 0" locations: the block's line
            by_line[first_line or fn_line] = by_line.get(first_line or fn_line, 0.0) + by_line.pop(0)
        block_id = -1
        if guard >= 0 and counted:
            block_id = len(blocks)
            blocks.append(Block(block_id, fn, first_line, mix, flops, by_line, flops16))
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
            rm = _TSAN_RANGE.search(ln)
            if rm and not where(ln)[0]:
                start = rm.end() - 1
                end = _balanced(ln, start)
                sid, kind = len(sites), rm.group(1)
                for write in ((False, True) if kind in ("memcpy", "memmove") else (kind != "read_range",)):
                    sites.append(Site(len(sites), write, 16, where(ln)[1], block_id))
                ln = ln[:rm.start()] + f"@__emu_prof_{kind}({ln[start + 1:end - 1]}, i32 {sid})" + ln[end:]
            out.append(ln)
        body, body_idx = [], []

    for idx, ln in enumerate(lines):
        if fn is None:
            m = _DEFINE.match(ln)
            if m:
                fn = m.group(1).strip('"')
                sp = int(m.group(2)) if m.group(2) else 0
                spname, spfile = meta.subprogram(sp) if sp else ("", "")
                fn_machinery = _is_machinery(spname, spfile) if sp else True
                fn_line = int(meta.node.get(sp, ("", {}))[1].get("line", 0)) if spfile.endswith(SOURCE_FILE) else 0
                body, body_idx = [], []
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
        body_idx.append(idx)
    return Rewritten("\n".join(out), blocks, sites)
