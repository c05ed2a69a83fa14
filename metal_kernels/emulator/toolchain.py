"""clang-19: where it is, its version, the flags, the preprocessing step, the cache directory."""
from __future__ import annotations

import contextlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

from .errors import EmulatorError, MSLCompileError

HERE = Path(__file__).resolve().parent
_FLAGS = ["-std=c++20", "-O1", "-Xclang", "-ffloat16-excess-precision=none", "-Xclang",
          "-fbfloat16-excess-precision=none", "-fPIC", "-shared", "-fvisibility=hidden", "-fno-strict-aliasing", "-fwrapv",
          "-Wno-unknown-attributes", "-Wno-ignored-attributes", "-Wno-deprecated-volatile",
          "-Wno-unused-value", "-Wno-c++11-narrowing", "-Wno-invalid-constexpr", "-ferror-limit=20",
          # the race detector: ThreadSanitizer's instrumentation calls __tsan_read/write, defined in runtime.h
          "-fsanitize=thread", "-mllvm", "-tsan-instrument-func-entry-exit=0", "-mllvm", "-tsan-instrument-atomics=0",
          "-mllvm", "-tsan-instrument-memintrinsics=0"]
_PP_FLAGS = ["-E", "-x", "c++", "-std=c++20", "-nostdinc", "-D__METAL__=1", "-D__METAL_VERSION__=310", "-D__HAVE_BFLOAT__=1",
             "-D__METAL_MACOS__=1", "-D__METAL_EMULATOR__=1"]
_STUB_HEADERS = ["metal_stdlib", "metal_math", "metal_simdgroup", "metal_simdgroup_matrix", "metal_atomic",
                 "metal_compute", "metal_integer", "metal_common", "metal_geometric", "metal_relational",
                 "metal_numeric", "metal_types", "metal_pack", "metal_array", "metal_limits",
                 "metal_type_traits", "metal_utility", "metal_graphics", "metal_texture", "metal_matrix",
                 "metal_uniform", "metal_stdlib.h", "simd/simd.h"]


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


def torch_include_dir() -> str | None:
    """torch's include folder: torch.mps.compile_shader embeds the headers a source includes from it
    (`#include <c10/metal/utils.h>`), so the emulator searches it too."""
    import importlib.util

    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    inc = Path(list(spec.submodule_search_locations)[0]) / "include"
    return str(inc) if (inc / "c10" / "metal").is_dir() else None


def _preprocessor_args(tmp: str, src: str, extra=()) -> list[str]:
    """Write `src` as tmp/msl_source.metal and empty stand-ins for <metal_stdlib> & co. under tmp/stub_include;
    return the `clang -E` arguments (after the compiler) that preprocess it. Shared with the lint."""
    stub = Path(tmp) / "stub_include"
    for h in _STUB_HEADERS:
        p = stub / h
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text("#pragma once\n")
    src_path = Path(tmp) / _SRC_NAME
    src_path.write_text(src)
    torch_inc = torch_include_dir()
    return [*_PP_FLAGS, "-I", str(stub), *extra, *(["-I", torch_inc] if torch_inc else []), str(src_path)]
