"""compile_library: preprocess, parse, rewrite, generate launchers, compile to a cached shared object."""
from __future__ import annotations

import ctypes
import hashlib
import json
import tempfile
import threading
from pathlib import Path

from . import strict
from .codegen import generate_launchers
from .errors import EmulatorError, MSLCompileError
from .launch import Library
from .msl_scan import function_constants
from .parse import parse_kernels
from .rewrite import rewrite_source
from .strict import STRICT_FLAGS
from .toolchain import (_FLAGS, _PP_FLAGS, HERE, _atomic_write, _cache_dir, _clang_version, _preprocessor_args, _run,
                        clang_path, torch_include_dir)

GENERATOR_VERSION = "3"
_SHIM = HERE / "shim.h"
_GENERATOR_FILES = sorted(p for p in HERE.iterdir() if p.suffix in (".py", ".h"))  # all hashed into the cache key


def preprocess(src: str, clang: str, tmp: str, include_dirs=(), defines=()) -> str:
    """`clang -E` of `src` with the stub <metal_stdlib> & co. (and extra include folders / -D macros)."""
    extra = [f"-I{d}" for d in include_dirs] + [f"-D{d}" for d in defines]
    return _run([clang, *_preprocessor_args(tmp, src, extra)], tmp, "MSL preprocessing").stdout


def translate(pp: str) -> tuple[str, list[dict]]:
    """The C++ translation unit (rewritten source + generated launchers) and the kernel table."""
    kernels, remove = parse_kernels(pp)
    hosts = [k.host for k in kernels]
    dup = {h for h in hosts if hosts.count(h) > 1}
    if dup:
        raise MSLCompileError(f"duplicate kernel host names: {sorted(dup)} [MSL 3.1 (host_name attribute): the "
                              f"functions of a library have distinct names]")
    launchers, table = generate_launchers(kernels)
    unset = [f"{fc.name} [[function_constant({fc.index})]]" for fc in function_constants(pp) if not fc.optional]
    for entry in table:
        entry["unset_function_constants"] = unset
    return rewrite_source(pp, remove) + launchers, table


def compile_translated(cpp_text: str, clang: str, tmp: str, out_so: Path | None, extra_flags=()) -> None:
    """clang-19 -std=c++20 with shim.h force-included: the shared object the launches run (out_so None: only
    compile, e.g. with -fsyntax-only)."""
    cpp = Path(tmp) / "translated.cpp"
    cpp.write_text(cpp_text)
    tmp_so = Path(tmp) / "lib.so"
    _run([clang, "-x", "c++", *_FLAGS, *extra_flags, "-I", str(HERE), "-include", str(_SHIM), str(cpp), "-o",
          str(tmp_so)], tmp, "MSL compilation in the emulator's C++ backend (the strict MSL 3.1 front end accepts "
                             "this source: an error below is a limitation of the emulator, not an MSL error)")
    if out_so is not None:
        _atomic_write(out_so, tmp_so.read_bytes())


def _build(src: str, clang: str, out_so: Path) -> list[dict]:
    with tempfile.TemporaryDirectory(prefix="comfy_metal_emu_") as tmp:
        pp = preprocess(src, clang, tmp)
        problems = strict.check(pp, clang)
        if problems:
            raise MSLCompileError("the strict MSL front end rejects this source (Apple's Metal compiler would "
                                  "too):\n" + "\n".join(problems))
        cpp_text, table = translate(pp)
        compile_translated(cpp_text, clang, tmp, out_so)
    return table


def _torch_version() -> str:
    import torch  # the headers of torch's include folder (c10/metal) are part of what a source compiles

    return torch.__version__


_libs: dict[str, "Library"] = {}
_libs_lock = threading.Lock()


def _cache_key(clang: str, src: str, variant: str = "") -> str:
    h = hashlib.sha256()
    for part in (GENERATOR_VERSION, _clang_version(clang), " ".join(_FLAGS + _PP_FLAGS + STRICT_FLAGS),
                 str(torch_include_dir()), _torch_version(),
                 *(p.read_text() for p in _GENERATOR_FILES), src, *([variant] if variant else [])):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()[:40]


def _clang_or_raise() -> str:
    clang = clang_path()
    if clang is None:
        raise EmulatorError("clang-19 not found (apt-get install clang-19, or set COMFY_METAL_EMU_CLANG)")
    return clang


def cached_build(key: str, build) -> tuple[Path, object]:
    """The cached shared object of `key` and its JSON metadata; `build(so_path) -> metadata` makes them when
    they are missing or unreadable."""
    cache = _cache_dir()
    so, meta = cache / f"{key}.so", cache / f"{key}.json"
    info = None
    if so.exists() and meta.exists():
        try:
            info = json.loads(meta.read_text())
        except (OSError, ValueError):
            info = None
    if info is None:
        info = build(so)
        _atomic_write(meta, json.dumps(info).encode())
    return so, info


def compile_library(src: str) -> "Library":
    """Compile MSL source (several .metal files may be concatenated) like torch.mps.compile_shader."""
    if not isinstance(src, str):
        raise TypeError("compile_library expects the MSL source as a str")
    clang = _clang_or_raise()
    key = _cache_key(clang, src)
    with _libs_lock:
        lib = _libs.get(key)
    if lib is not None:
        return lib
    so, table = cached_build(key, lambda out_so: _build(src, clang, out_so))
    lib = Library(ctypes.CDLL(str(so)), table, key)
    lib.source = src                      # the profiling variant (profiler.py) is built from it on demand
    with _libs_lock:
        _libs[key] = lib
    return lib
