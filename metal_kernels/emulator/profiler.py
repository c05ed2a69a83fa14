"""Profiling launches: `lib.kernel.profile(*args, threads=..., group_size=..., sample=None) -> Profile`.

The library is built a second time for profiling (cached like the first): `-D__EMU_PROFILE=1` adds the
profiler runtime (profile.h), SanitizerCoverage numbers the basic blocks, and the instruction mix of every
block is read from the same LLVM IR the .so is built from (ir_mix.py). Normal launches never load it.

A profiling launch binds the tensors in place (no guard copies: a real-shape weight is not duplicated) and
runs once (the race detector as configured, no poison re-runs). `sample=n` runs up to n threadgroups of each
shape class of the grid (full groups, and the partial edge groups of each dimension: first, middle, last) and
weighs each by the number of groups it stands for; every count is then a full-grid estimate. Unique bytes
per buffer are then the sum over the groups run of each group's own unique bytes times the groups it stands
for, capped at the buffer's size: exact for buffers the groups split among themselves or all read whole
(weights, a shared input vector), an estimate otherwise (e.g. groups that share part of a buffer).

What the numbers mean (per launch, whole grid):
  issue[class] = (SIMT instructions, scheduler cycles): a basic block executed by any lane of a simdgroup
      costs the simdgroup max(lane executions) x its instruction mix (vector operations count per element).
  active_fraction: lane executions / (32 x simdgroup executions), over all counted instructions.
  memory[kind]: SIMT memory instructions (the k-th execution of one access site by the lanes of one
      simdgroup), bytes requested, distinct bytes, 32-byte sectors and 128-byte lines (device memory), bank
      cycles (threadgroup memory: the most-hit of 32 four-byte banks, distinct words only) and the
      conflict-free ideal, and instructions by bytes per lane.
  buffers: unique bytes read / written and 32-byte sectors per bound tensor (the DRAM floor).
  mma: simdgroup_multiply_accumulate operations (8x8x8 = 512 MACs each; mma16 of them on 16-bit operands);
      collectives; barriers. flops: FLOPs of the lanes' fp32/fp16 arithmetic (flops16 of them in fp16/bf16).
"""
from __future__ import annotations

import ctypes
import dataclasses
import math
import tempfile
import threading
from pathlib import Path

import torch

from . import ir_mix
from .build import _cache_key, _clang_or_raise, cached_build, preprocess, translate
from .errors import BarrierDivergence, DataRace, EmulatorError, KernelCrash
from .launch import RACE_MAX_BYTES, SIMD_WIDTH, Library, _launch_lock, _tensor_span, checks_enabled
from .schedule import _parse_schedule, get_schedule
from .toolchain import _FLAGS, _atomic_write, _run

PROFILE_FLAGS = ["-D__EMU_PROFILE=1", "-fsanitize-coverage=trace-pc-guard", "-mllvm",
                 "-sanitizer-coverage-prune-blocks=0", "-gline-tables-only",
                 # keep 32-bit loop counters 32-bit (the CPU pipeline widens them to 64 bits for addressing)
                 "-mllvm", "-indvars-widen-indvars=false"]
# the normal build's flags, but struct copies (memcpy/memmove/memset) instrumented too: they are loads and
# stores on the GPU (profile.h counts them)
_BASE_FLAGS = [f.replace("-tsan-instrument-memintrinsics=0", "-tsan-instrument-memintrinsics=1") for f in _FLAGS
               if f != "-shared"]
KINDS = ("device_load", "device_store", "threadgroup_load", "threadgroup_store", "constant_load")
COLLECTIVES = ("simd_shuffle", "simd_reduce", "quad_shuffle", "quad_reduce", "simdgroup_barrier")
MACS_PER_MMA = 512
_SITE_FIELDS = ("instructions", "lanes", "bytes", "distinct_bytes", "sectors", "lines", "bank_cycles", "bank_ideal")
_DYN_SITE = 0x80000000


@dataclasses.dataclass
class MemoryStats:
    """SIMT memory instructions of one kind (see the module docstring)."""
    instructions: float = 0.0
    lanes: float = 0.0
    bytes: float = 0.0
    distinct_bytes: float = 0.0
    sectors: float = 0.0
    lines: float = 0.0
    bank_cycles: float = 0.0
    bank_ideal: float = 0.0
    by_width: dict = dataclasses.field(default_factory=dict)     # bytes per lane -> instructions

    def add(self, other: "MemoryStats", k: float = 1.0) -> None:
        for f in _SITE_FIELDS:
            setattr(self, f, getattr(self, f) + k * getattr(other, f))
        for w, n in other.by_width.items():
            self.by_width[w] = self.by_width.get(w, 0.0) + k * n

    @property
    def sector_efficiency(self) -> float:
        """Distinct bytes / bytes of the 32-byte sectors touched (1.0: every byte of every sector used)."""
        return self.distinct_bytes / (32.0 * self.sectors) if self.sectors else 1.0

    @property
    def bank_conflict(self) -> float:
        """Bank cycles / conflict-free cycles (1.0: no conflict; 32.0: every lane in one bank)."""
        return self.bank_cycles / self.bank_ideal if self.bank_ideal else 1.0

    @property
    def active_fraction(self) -> float:
        return self.lanes / (SIMD_WIDTH * self.instructions) if self.instructions else 1.0

    @property
    def mean_width(self) -> float:
        """Bytes per lane, averaged over instructions."""
        n = sum(self.by_width.values())
        return sum(w * c for w, c in self.by_width.items()) / n if n else 0.0


@dataclasses.dataclass
class SiteStats(MemoryStats):
    site: int = 0
    kind: str = ""
    width: int = 0
    line: int = 0                  # line in the compiled source (0: unknown, e.g. simdgroup_load/store)


@dataclasses.dataclass
class BufferStats:
    arg: int
    description: str
    size: int
    read_bytes: float
    written_bytes: float
    read_sectors: float
    written_sectors: float


@dataclasses.dataclass
class BlockStats:
    """One executed basic block: where it is, how often simdgroups and lanes ran it, its mix per run."""
    function: str
    line: int
    simdgroup_executions: float
    lane_executions: float
    mix: dict                       # class -> [SIMT instructions, scheduler cycles] per execution

    @property
    def active_fraction(self) -> float:
        return self.lane_executions / (SIMD_WIDTH * self.simdgroup_executions) if self.simdgroup_executions else 1.0


@dataclasses.dataclass
class Profile:
    kernel: str
    grid: tuple
    group: tuple
    groups: int                     # threadgroups in the grid
    groups_run: int                 # threadgroups executed (== groups unless sampled)
    threadgroup_bytes: int          # threadgroup memory per group
    issue: dict                     # class -> [SIMT instructions, scheduler cycles]
    lane_instructions: dict         # class -> lane executions x instructions
    flops: float                    # fp32/fp16 FLOPs executed by lanes (FMA = 2), outside simdgroup matrices
    mma: float                      # simdgroup_multiply_accumulate operations (8x8x8)
    collectives: dict               # COLLECTIVES -> simdgroup instructions
    barriers: float                 # threadgroup_barrier, per simdgroup
    memory: dict                    # KINDS -> MemoryStats
    sites: list                     # SiteStats per access site
    buffers: list                   # BufferStats per bound tensor
    lines: dict                     # source line -> issue cycles
    blocks: list                    # BlockStats of every executed block
    repeat: int = 1                 # the launch stands for this many identical launches side by side
    flops16: float = 0.0            # the part of `flops` in fp16/bf16 arithmetic
    mma16: float = 0.0              # the part of `mma` on 16-bit operands (half, bfloat)

    @property
    def threads_per_group(self) -> int:
        return math.prod(self.group)

    @property
    def simdgroups_per_group(self) -> int:
        return -(-self.threads_per_group // SIMD_WIDTH)

    @property
    def issue_instructions(self) -> float:
        return sum(v[0] for v in self.issue.values())

    @property
    def issue_cycles(self) -> float:
        return sum(v[1] for v in self.issue.values())

    @property
    def active_fraction(self) -> float:
        n = self.issue_instructions
        return sum(self.lane_instructions.values()) / (SIMD_WIDTH * n) if n else 1.0

    @property
    def mma_flops(self) -> float:
        return 2.0 * MACS_PER_MMA * self.mma

    @property
    def unique_bytes(self) -> float:
        return sum(b.read_bytes + b.written_bytes for b in self.buffers)

    @property
    def unique_sector_bytes(self) -> float:
        return 32.0 * sum(b.read_sectors + b.written_sectors for b in self.buffers)

    def scaled(self, k: int) -> "Profile":
        """This launch repeated k times over independent data (e.g. more heads of the same attention):
        every count and every buffer times k."""
        def mul(d):
            return {c: [x * k for x in v] if isinstance(v, list) else v * k for c, v in d.items()}

        def stats(m):
            return dataclasses.replace(m, **{f: getattr(m, f) * k for f in _SITE_FIELDS},
                                       by_width={w: n * k for w, n in m.by_width.items()})
        bufs = [dataclasses.replace(b, size=b.size * k, read_bytes=b.read_bytes * k, written_bytes=b.written_bytes * k,
                                    read_sectors=b.read_sectors * k, written_sectors=b.written_sectors * k)
                for b in self.buffers]
        blocks = [dataclasses.replace(b, simdgroup_executions=b.simdgroup_executions * k,
                                      lane_executions=b.lane_executions * k) for b in self.blocks]
        return dataclasses.replace(self, groups=self.groups * k, issue=mul(self.issue), blocks=blocks,
                                   lane_instructions=mul(self.lane_instructions), flops=self.flops * k,
                                   flops16=self.flops16 * k, mma=self.mma * k, mma16=self.mma16 * k,
                                   collectives=mul(self.collectives), barriers=self.barriers * k,
                                   memory={kind: stats(m) for kind, m in self.memory.items()},
                                   sites=[stats(s) for s in self.sites], buffers=bufs, lines=mul(self.lines),
                                   repeat=self.repeat * k)

    def summary(self) -> str:
        """A few lines of plain text: the counts a reviewer looks at first."""
        out = [f"{self.kernel}: grid {self.grid} group {self.group}, {self.groups} groups"
               + (f" ({self.groups_run} run, scaled)" if self.groups_run != self.groups else "")
               + f", {self.threadgroup_bytes} B threadgroup memory"]
        out.append("issue slots: " + ", ".join(f"{c} {v[0]:.4g} ({v[1]:.4g} cycles)" for c, v in self.issue.items()
                                                if v[0]) + f"; active lanes {self.active_fraction:.2f}")
        for kind, m in self.memory.items():
            if m.instructions:
                extra = (f", bank conflict {m.bank_conflict:.2f}x" if kind.startswith("threadgroup")
                         else f", sector efficiency {m.sector_efficiency:.3f}, {m.lines:.4g} lines")
                out.append(f"{kind}: {m.instructions:.4g} instructions, {m.mean_width:.3g} B/lane, "
                           f"active {m.active_fraction:.2f}{extra}")
        if self.mma:
            out.append(f"simdgroup_matrix: {self.mma:.4g} multiply-accumulates ({self.mma * MACS_PER_MMA:.4g} MACs)")
        col = {k: v for k, v in self.collectives.items() if v}
        if col or self.barriers:
            out.append("collectives: " + ", ".join(f"{k} {v:.4g}" for k, v in col.items())
                       + f"; threadgroup barriers {self.barriers:.4g} (per simdgroup)")
        out.append("unique bytes: " + ", ".join(f"arg {b.arg} read {b.read_bytes:.4g} written {b.written_bytes:.4g}"
                                                for b in self.buffers if b.read_bytes or b.written_bytes))
        return "\n".join(out)


# ---------------------------------------------------------------------------------------------- the build

class ProfileBuild:
    """The profiling variant of a compiled library: its .so, launcher table, numbered blocks and sites."""

    def __init__(self, dll, table: list[dict], blocks: list[ir_mix.Block], sites: list[ir_mix.Site]):
        self.dll = dll
        self.table = table
        self.symbols = {e["host"]: e["symbol"] for e in table}
        self.blocks = blocks
        self.sites = sites
        for name, args in (("__emu_prof_begin", [ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                                                 ctypes.c_uint64, ctypes.c_void_p, ctypes.c_void_p]),
                           ("__emu_prof_sizes", [ctypes.c_void_p]),
                           ("__emu_prof_read", [ctypes.c_void_p] * 7), ("__emu_prof_end", [])):
            f = getattr(dll, name)
            f.argtypes = args
            f.restype = ctypes.c_int if name == "__emu_prof_begin" else None
        self.configure = getattr(dll, "__emu_configure")
        self.configure.restype = None
        self.configure.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p, ctypes.c_void_p]

    def launcher(self, host: str):
        fn = getattr(self.dll, self.symbols[host])
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_uint32), ctypes.c_uint32, ctypes.c_uint64,
                       ctypes.c_char_p, ctypes.c_size_t]
        return fn


_builds: dict[str, ProfileBuild] = {}
_builds_lock = threading.Lock()


def _build_profile(src: str, clang: str, out_so: Path) -> dict:
    """Compile the profiling variant to LLVM IR, number its blocks and sites (ir_mix), build the .so from
    that IR; returns the metadata (launcher table, blocks, sites)."""
    here = Path(__file__).parent
    with tempfile.TemporaryDirectory(prefix="comfy_metal_emu_prof_") as tmp:
        cpp_text, table = translate(preprocess(src, clang, tmp))
        cpp = Path(tmp) / "translated.cpp"
        cpp.write_text(cpp_text)
        ll, ll2, tmp_so = Path(tmp) / "translated.ll", Path(tmp) / "profiled.ll", Path(tmp) / "lib.so"
        what = "MSL compilation (emulator profiling build, clang-19)"
        _run([clang, "-x", "c++", *_BASE_FLAGS, *PROFILE_FLAGS, "-I", str(here),
              "-include", str(here / "shim.h"), str(cpp), "-S", "-emit-llvm", "-o", str(ll)], tmp, what)
        rw = ir_mix.rewrite(ll.read_text())
        ll2.write_text(rw.ir)
        _run([clang, "-x", "ir", str(ll2), "-O1", "-fPIC", "-shared", "-Xclang", "-disable-llvm-passes",
              "-o", str(tmp_so)], tmp, what)
        _atomic_write(out_so, tmp_so.read_bytes())
    return {"table": table, "blocks": [dataclasses.asdict(b) for b in rw.blocks],
            "sites": [dataclasses.asdict(s) for s in rw.sites]}


def _profile_key(clang: str, src: str) -> str:
    return _cache_key(clang, src, "profile " + " ".join(PROFILE_FLAGS))


def profile_build(lib) -> ProfileBuild:
    """The profiling variant of `lib` (built once per source, cached on disk next to the normal build)."""
    src = getattr(lib, "source", None)
    if src is None:
        raise EmulatorError("this library was not made by compile_library: no source to build a profile from")
    clang = _clang_or_raise()
    key = _profile_key(clang, src)
    with _builds_lock:
        hit = _builds.get(key)
        if hit is not None:
            return hit
        so, info = cached_build(key, lambda out_so: _build_profile(src, clang, out_so))
        blocks = [ir_mix.Block(**{**b, "lines": {int(k): v for k, v in b["lines"].items()}}) for b in info["blocks"]]
        build = ProfileBuild(ctypes.CDLL(str(so)), info["table"], blocks, [ir_mix.Site(**s) for s in info["sites"]])
        _builds[key] = build
        return build


def compile_profile_library(src: str):
    """A Library over the profiling build alone (no normal build needed): its kernels profile with
    `kernel.profile(...)`; a plain call runs them unprofiled."""
    build = profile_build(type("_Source", (), {"source": src})())
    lib = Library(build.dll, build.table, _profile_key(_clang_or_raise(), src))
    lib.source = src
    return lib


# ---------------------------------------------------------------------------------------------- sampling

def sample_groups(grid3, group3, n: int | None) -> tuple[list[int], list[float], int]:
    """(linear group indices to run, their weights, groups in the grid). n=None: every group, weight 1."""
    ng = [-(-g // t) for g, t in zip(grid3, group3)]
    total = math.prod(ng)
    if n is None or n <= 0 or total <= n:
        return list(range(total)), [1.0] * total, total
    segs = []
    for g, t, m in zip(grid3, group3, ng):
        segs.append([(0, m)] if g % t == 0 else [s for s in ((0, m - 1), (m - 1, m)) if s[1] > s[0]])
    groups, weights = [], []
    for sx in segs[0]:
        for sy in segs[1]:
            for sz in segs[2]:
                dims = (sx[1] - sx[0], sy[1] - sy[0], sz[1] - sz[0])
                count = math.prod(dims)
                picks = list(range(count)) if count <= n else \
                    sorted({round(j * (count - 1) / (n - 1)) for j in range(n)}) if n > 1 else [count // 2]
                for p in picks:
                    x, y, z = p % dims[0], (p // dims[0]) % dims[1], p // (dims[0] * dims[1])
                    groups.append((sx[0] + x) + ng[0] * ((sy[0] + y) + ng[1] * (sz[0] + z)))
                    weights.append(count / len(picks))
    return groups, weights, total


# ---------------------------------------------------------------------------------------------- the launch

def _describe(t: torch.Tensor) -> str:
    return f"tensor {tuple(t.shape)} {str(t.dtype).replace('torch.', '')}"


def _origin(t: torch.Tensor) -> int:
    """Host address of the start of `t`'s storage: on the GPU that is the start of its MTLBuffer (a line
    boundary), and `t` starts its storage offset after it. Sectors and lines count from there, so a count
    never depends on where the CPU allocator put the storage (64-byte aligned only: host lines would split
    differently from run to run, with whatever was allocated before)."""
    return t.untyped_storage().data_ptr()


def profile_launch(kernel, args, threads=None, group_size=None, arg_casts=None, sample=None) -> Profile:
    build = profile_build(kernel._lib)
    if kernel.name not in build.symbols:
        raise EmulatorError(f"kernel {kernel.name!r} is missing from the profiling build")
    tensors, bound, grid3, group3 = kernel._collect(args, threads, group_size, arg_casts)
    if any(x == 0 for x in grid3):
        raise ValueError(f"kernel {kernel.name!r}: nothing to profile (empty grid {grid3})")
    keep = []
    nbuf = max([len(args)] + [b + 1 for b in kernel.buffers])
    addrs = [0] * nbuf
    regions = []                       # (lo, hi, constant, arg, description, origin: see _origin)
    for i, b in bound.items():
        if b[0] == "tensor":
            lo, hi = _tensor_span(b[1])
            addrs[i] = lo
            regions.append((lo, hi, 0, i, _describe(b[1]), _origin(b[1])))
        elif b[0] == "tensors":
            for t in b[1]:
                lo, hi = _tensor_span(t)
                regions.append((lo, hi, 0, i, _describe(t), _origin(t)))
            arr = (ctypes.c_uint64 * len(b[1]))(*[_tensor_span(t)[0] for t in b[1]])
            keep.append(arr)
            addrs[i] = ctypes.addressof(arr)
            regions.append((addrs[i], addrs[i] + 8 * len(b[1]), 1, i, f"tensor list[{len(b[1])}]", addrs[i]))
        else:
            buf = ctypes.create_string_buffer(b[1], max(16, len(b[1])))
            keep.append(buf)
            addrs[i] = ctypes.addressof(buf)
            regions.append((addrs[i], addrs[i] + len(b[1]), 1, i, b[2], addrs[i]))
    for j in range(nbuf):
        if not addrs[j]:
            buf = ctypes.create_string_buffer(64)
            keep.append(buf)
            addrs[j] = ctypes.addressof(buf)
    groups, weights, total = sample_groups(grid3, group3, sample)
    bufs = (ctypes.c_void_p * max(1, nbuf))(*addrs)
    dims = (ctypes.c_uint32 * 6)(*grid3, *group3)
    kind, seed = _parse_schedule(get_schedule())
    err = ctypes.create_string_buffer(4096)
    lohi = (ctypes.c_uint64 * max(1, 2 * len(regions)))(*[x for r in regions for x in r[:2]])
    origin = (ctypes.c_uint64 * max(1, len(regions)))(*[r[5] for r in regions])
    const = (ctypes.c_uint32 * max(1, len(regions)))(*[r[2] for r in regions])
    gbuf = (ctypes.c_uint64 * len(groups))(*groups)
    wbuf = (ctypes.c_double * len(weights))(*weights)
    names = [ctypes.c_char_p(f"argument {r[3]} ({r[4]})".encode()) for r in regions]
    cnames = (ctypes.c_char_p * max(1, len(regions)))(*names)
    sampled = len(groups) < total
    fn = build.launcher(kernel.name)
    with _launch_lock:
        race = checks_enabled() and sum(r[1] - r[0] for r in regions) <= RACE_MAX_BYTES
        build.configure(1 if race else 0, 0, len(regions), lohi, cnames)
        if build.dll.__emu_prof_begin(len(regions), lohi, origin, const, len(groups) if sampled else 0, gbuf, wbuf):
            raise EmulatorError("profiler: out of memory for the unique-byte bitmaps")
        try:
            rc = fn(bufs, dims, kind, seed, err, len(err))
            sizes = (ctypes.c_uint32 * 4)()
            build.dll.__emu_prof_sizes(sizes)
            nb, ns, nsf, nev = sizes
            bid = (ctypes.c_uint32 * max(1, nb))()
            bdat = (ctypes.c_double * max(1, 2 * nb))()
            sid = (ctypes.c_uint32 * max(1, ns))()
            sinfo = (ctypes.c_uint32 * max(1, 3 * ns))()
            sdat = (ctypes.c_double * max(1, nsf * ns))()
            rdat = (ctypes.c_double * max(1, 8 * len(regions)))()
            ev = (ctypes.c_double * nev)()
            build.dll.__emu_prof_read(bid, bdat, sid, sinfo, sdat, rdat, ev)
        finally:
            build.dll.__emu_prof_end()
    msg = err.value.decode(errors="replace")
    if rc == 1:
        raise BarrierDivergence(msg)
    if rc == 2:
        raise KernelCrash(msg)
    if rc == 4:
        raise DataRace(msg)
    if rc != 0:
        raise EmulatorError(msg or f"emulator launch failed (code {rc})")
    return _assemble(kernel.name, build, grid3, group3, total, len(groups), regions,
                     [(bid[i], bdat[2 * i], bdat[2 * i + 1]) for i in range(nb)],
                     [(sid[i], sinfo[3 * i:3 * i + 3], sdat[nsf * i:nsf * i + nsf]) for i in range(ns)],
                     list(rdat), list(ev))


def _assemble(name, build, grid3, group3, total, run, regions, blocks, sites, rdat, ev) -> Profile:
    issue = {c: [0.0, 0.0] for c in ir_mix.CLASSES}
    lane_instr = {c: 0.0 for c in ir_mix.CLASSES}
    lines: dict[int, float] = {}
    flops = flops16 = 0.0
    executed = []
    for bid, slots, lanes in blocks:
        b = build.blocks[bid]
        executed.append(BlockStats(b.function, b.line, slots, lanes, b.mix))
        for cls, (n, cyc) in b.mix.items():
            issue[cls][0] += slots * n
            issue[cls][1] += slots * cyc
            lane_instr[cls] += lanes * n
        flops += lanes * b.flops
        flops16 += lanes * b.flops16
        for line, cyc in b.lines.items():
            lines[line] = lines.get(line, 0.0) + slots * cyc
    memory = {k: MemoryStats() for k in KINDS}
    out_sites = []
    for sid, (kind, write, size), data in sites:
        kname = ("threadgroup" if kind == 2 else "constant" if kind == 1 else "device")
        kname += "_store" if write else "_load"
        if kname == "constant_store":
            kname = "device_store"
        line = build.sites[sid].line if sid < _DYN_SITE and sid < len(build.sites) else 0
        st = SiteStats(**dict(zip(_SITE_FIELDS, data)), site=sid, kind=kname, width=size, line=line)
        st.by_width = {size: st.instructions}
        memory[kname].add(st)
        out_sites.append(st)
    buffers = []
    for i, (lo, hi, constant, arg, desc, origin) in enumerate(regions):
        if constant:
            continue
        size = hi - lo
        spanned = ((lo - origin) % 32 + size + 31) // 32      # sectors the buffer spans on the GPU
        rb, wb, rs, ws = rdat[8 * i:8 * i + 4]
        if run < total:                # each group's own bytes times the groups it stands for, at most the buffer
            grb, gwb, grs, gws = rdat[8 * i + 4:8 * i + 8]
            rb, wb = min(size, grb), min(size, gwb)
            rs, ws = min(spanned, grs), min(spanned, gws)
        buffers.append(BufferStats(arg, desc, size, float(rb), float(wb), float(rs), float(ws)))
    collectives = dict(zip(COLLECTIVES, ev[:5]))
    return Profile(kernel=name, grid=tuple(grid3), group=tuple(group3), groups=total, groups_run=run,
                   threadgroup_bytes=int(ev[8]), issue=issue, lane_instructions=lane_instr, flops=flops, mma=ev[6],
                   flops16=flops16, mma16=ev[10],
                   collectives=collectives, barriers=ev[5], memory=memory, sites=out_sites, buffers=buffers,
                   lines=lines, blocks=executed)
