"""Launching a compiled kernel: torch's argument binding, guarded buffer copies, the runtime call, checks."""
from __future__ import annotations

import ctypes
import os
import struct
import threading

import torch

from .errors import BarrierDivergence, DataRace, EmulatorError, KernelCrash, OutOfBoundsWrite, UninitializedRead
from .schedule import _parse_schedule, get_schedule

GUARD = 256  # bytes of 0xFF before and after every bound buffer
SIMD_WIDTH = 32
_launch_lock = threading.Lock()  # one launch at a time: the crash handlers are process-wide
RACE_MAX_BYTES = int(float(os.environ.get("COMFY_METAL_EMU_RACE_MAX_MB", "64")) * 2**20)
POISON_BYTES = (0x7B, 0xFB)  # the poison runs' fill: + and - large finite values in every float type


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

    def data(self) -> torch.Tensor:
        return self.buf[self.pad:self.pad + self.n]

    def _guards(self):
        return self.buf[self.pad - GUARD:self.pad], self.buf[self.pad + self.n:self.pad + self.n + GUARD]

    def fill_guards(self, byte: int = 0xFF) -> None:
        """0xFF (NaN, -1) or a poison byte (0x7B / 0xFB: large finite values, see runtime.h)."""
        for g in self._guards():
            g.fill_(byte)
        self.guard_byte = byte

    def bad_guard_bytes(self):
        lo, hi = self._guards()
        byte = getattr(self, "guard_byte", 0xFF)
        out = [i - GUARD for i in torch.nonzero(lo != byte).flatten().tolist()]
        out += [self.n + i for i in torch.nonzero(hi != byte).flatten().tolist()]
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

    def _collect(self, args, threads, group_size, arg_casts):
        """torch's binding rules: (tensors [(arg index, tensor)], bound {arg index: what}, grid, group)."""
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
        if any(x == 0 for x in group3) and not any(x == 0 for x in grid3):
            raise ValueError("group_size must be positive")
        return tensors, bound, grid3, group3

    def profile(self, *args, threads=None, group_size=None, arg_casts=None, sample=None):
        """Run the launch in the profiling build and return its `Profile` (profiler.py): memory transactions,
        bank conflicts, issue slots by class, divergence, collectives. `sample=n` runs up to n threadgroups
        of each shape (first, middle, last) and scales; None runs every threadgroup."""
        from .profiler import profile_launch

        return profile_launch(self, args, threads=threads, group_size=group_size, arg_casts=arg_casts, sample=sample)

    def __call__(self, *args, threads=None, group_size=None, arg_casts=None, error_buf_idx=None, windows=None):
        """Launch like torch's compiled kernels. Emulator only: `windows={arg index: (byte_start, byte_end)}`
        binds just that byte range of a tensor argument (guarded, copied in and back), at the address
        the whole tensor would have. With a few threadgroups launched, a test can reach offsets past
        2^31 in a tensor whose untouched pages are never allocated (torch.empty is lazy on Linux);
        a kernel that reads outside the window reads the guard (NaN) or crashes (KernelCrash)."""
        windows = {int(i): (int(a), int(b)) for i, (a, b) in (windows or {}).items()}
        tensors, bound, grid3, group3 = self._collect(args, threads, group_size, arg_casts)
        if any(x == 0 for x in grid3):
            return

        # ---- guarded regions, merging aliasing tensors of one storage
        spans = []
        for i, t in tensors:
            s, e = _tensor_span(t)
            if i in windows:
                ws, we = windows[i]
                if not 0 <= ws < we <= e - s:
                    raise ValueError(f"window {windows[i]} of argument {i} is outside its {e - s} bytes")
                s, e = s + ws, s + we
                spans.append((-1 - len(spans), s, e, i, t))     # its own region, never merged
                continue
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
                tensor_addr[id(t)] = r.addr(t.data_ptr() if i in windows else ms)
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
        checked = checks_enabled()
        # every region the kernel can reach, with a name for the race detector's and poison run's messages
        regions = [(r, "; ".join(f"argument {i} ({d})" for i, _s, _e, d in r.members)) for r in rlist if r.n]
        regions += [(r, f"argument {i} ({desc})") for i, r, desc in byte_regions if r.n]
        names = [ctypes.c_char_p(d.encode()) for _, d in regions]
        lohi = (ctypes.c_uint64 * max(1, 2 * len(regions)))(*[x for r, _ in regions for x in (r.base, r.base + r.n)])
        cnames = (ctypes.c_char_p * max(1, len(regions)))(*names)
        configure = self._lib._configure
        poison_problems, differs = [], None
        with _launch_lock:  # one launch at a time: the crash handlers are process-wide
            snapshot = [r.data().clone() for r, _ in regions] if checked else None
            # shadow memory costs 16 bytes per byte of buffer: very large launches run without the race detector
            race = checked and sum(r.n for r, _ in regions) <= RACE_MAX_BYTES
            configure(1 if race else 0, 0, len(regions), lohi, cnames)
            rc = self._fn(bufs, dims, kind, seed, err, len(err))
            if checked and rc == 0:
                # the poison run: the same launch again from the same inputs, with threadgroup memory and the
                # guard regions holding large finite values instead of NaN; any difference in any output byte
                # means the kernel read memory it never wrote
                first = [r.data().clone() for r, _ in regions]
                for byte in POISON_BYTES:
                    for (r, _), snap in zip(regions, snapshot):
                        r.data().copy_(snap)
                        r.fill_guards(byte)
                    configure(0, byte, 0, None, None)
                    err2 = ctypes.create_string_buffer(4096)
                    rc2 = self._fn(bufs, dims, kind, seed, err2, len(err2))
                    for r, _ in regions:
                        bad = r.bad_guard_bytes()
                        if bad:
                            poison_problems.append(_oob_message(self.name, r, bad) if r.members else
                                                   f"kernel {self.name!r}: out-of-bounds write in the poison run")
                    if rc2 == 2:
                        raise KernelCrash(err2.value.decode(errors="replace") + f" -- in the poison run "
                                          f"(threadgroup memory and guard regions filled with 0x{byte:X} bytes, large "
                                          f"finite values, instead of NaN): the kernel uses memory it never wrote, "
                                          f"e.g. as an index")
                    if rc2 == 0 and differs is None:
                        differs = _first_difference(self.name, regions, first, byte)
                for (r, _), res in zip(regions, first):
                    r.data().copy_(res)
                    r.fill_guards(0xFF)

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
        if rc == 4:
            raise DataRace(err.value.decode(errors="replace"))
        if rc != 0:
            raise EmulatorError(err.value.decode(errors="replace") or f"emulator launch failed (code {rc})")
        if problems or poison_problems:
            raise OutOfBoundsWrite("\n".join(problems or poison_problems))
        if differs:
            raise UninitializedRead(differs)


def checks_enabled() -> bool:
    """Race detector and poison run: on unless $COMFY_METAL_EMU_CHECKS is "0"/"off" (or set_checks(False))."""
    if _checks_override is not None:
        return _checks_override
    return os.environ.get("COMFY_METAL_EMU_CHECKS", "1").strip().lower() not in ("0", "off", "false", "no")


_checks_override: bool | None = None


def set_checks(on: bool | None) -> None:
    """Turn the race detector and the poison run on/off for later launches (None: back to the environment)."""
    global _checks_override
    _checks_override = on


def _first_difference(kernel: str, regions, first, byte: int) -> str | None:
    for (r, desc), res in zip(regions, first):
        diff = torch.nonzero(r.data() != res).flatten()
        if diff.numel():
            off = int(diff[0])
            return (f"kernel {kernel!r}: the result depends on memory the kernel never wrote (uninitialised "
                    f"threadgroup memory or an out-of-bounds read): {desc} differs at byte offset {off} "
                    f"({diff.numel()} bytes in all) between a run with NaN-filled (0xFF) and a run with "
                    f"0x{byte:X}-filled (large finite values) threadgroup memory and guard regions")
    return None


def _refuse_unspecialised(entry: dict) -> None:
    """What torch.mps.compile_shader cannot launch: a kernel of a library with required function constants (its
    pipeline is created without constant values) or with [[threadgroup(n)]] parameters (its kernel cannot set
    threadgroup memory lengths). Both need the source specialised: metal_kernels/specialize.py."""
    if entry.get("unset_function_constants"):
        raise EmulatorError(f"kernel {entry['host']!r}: function constants without a value: "
                            f"{', '.join(entry['unset_function_constants'])}. torch.mps.compile_shader creates "
                            f"pipelines without MTLFunctionConstantValues; specialise the source first "
                            f"(comfy_metal.metal_kernels.specialize.specialize(src, {{index or name: value}}))")
    if entry.get("threadgroup_params"):
        raise EmulatorError(f"kernel {entry['host']!r}: {', '.join(entry['threadgroup_params'])} has no size: "
                            f"torch.mps.compile_shader's kernels cannot set threadgroup memory lengths; specialise "
                            f"the source first (specialize(src, threadgroup_memory={{{entry['name']!r}: {{n: bytes}}}}))")


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
        self._configure = getattr(dll, "__emu_configure")  # (getattr: no name mangling)
        self._configure.restype = None
        self._configure.argtypes = [ctypes.c_uint32, ctypes.c_uint32, ctypes.c_uint32, ctypes.c_void_p,
                                    ctypes.c_void_p]

    @property
    def kernel_names(self) -> list[str]:
        return sorted(self._table)

    def __dir__(self):
        return self.kernel_names

    def __getattr__(self, name: str) -> Kernel:
        if name.startswith("__") or name in ("_dll", "_table", "_kernels", "key", "_configure"):
            raise AttributeError(name)
        k = self._kernels.get(name)
        if k is None:
            e = self._table.get(name)
            if e is None:
                raise AttributeError(f"no kernel named {name!r} in this MSL library; available kernels: "
                                     f"{', '.join(self.kernel_names)}")
            _refuse_unspecialised(e)
            k = self._kernels[name] = Kernel(self, e)
        return k

    def __repr__(self):
        return f"<emulated MSL library {self.key[:12]}: {', '.join(self.kernel_names)}>"
