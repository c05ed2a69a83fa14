"""Run the MSL emulator's strict front end and its C++ backend over a folder of public Metal kernels.

    python tests/tools/msl_corpus.py --path /tmp/corpus/mlx/mlx/backend/metal/kernels --include /tmp/corpus/mlx
    python tests/tools/msl_corpus.py --path DIR [--include DIR ...] [--define NAME[=VALUE] ...]
                                     [--variant NAME=DEFINES ...] [--exclude GLOB ...] [--syntax-only] [-v]

A *unit* is one ``.metal`` file under --path with everything it includes (headers are not units: nothing
compiles a header alone). A template-heavy file (MLX's) counts as what it is: the file with the explicit
instantiations it carries; sources the host generates at run time (MLX's JIT) are not in a folder and are not
units. ``--variant NAME=A,B=1`` compiles every unit once more with those macros defined, as a host does
(ggml: ``--variant bf16=GGML_METAL_HAS_BF16``): each variant of a file is a unit of its own.

Out of scope (listed, not counted): Metal 4 units, i.e. those that include ``<metal_tensor>`` or
``<MetalPerformancePrimitives/...>`` (MLX's NAX kernels, PyTorch's MPP attention, ggml's tensor path), Metal 3.2
units, i.e. those that use its memory-coherence model (``coherent(device|system)`` pointers, ``thread_scope``
fences: MLX's fence.metal), since the emulator models MSL 3.1, and the files matching an --exclude glob.

Every unit goes through the two steps separately: the strict MSL 3.1 front end (what Apple's compiler
rejects) and the C++ backend (translation + clang-19 build of the shared object, loaded with ctypes; with
--syntax-only a clang -fsyntax-only pass instead, quicker). A unit the strict pass rejects is still
compiled, so both figures are measured on every unit. Prints one line per unit, the reasons of each failure
(-v: all of them), the most frequent reasons, and the totals. Not run in CI; the corpora stay outside the
repository (see metal_kernels/emulator/README.md for the corpora measured and how they were assembled).
"""
from __future__ import annotations

import argparse
import collections
import ctypes
import fnmatch
import pathlib
import re
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))
import conftest  # noqa: E402,F401  (maps this checkout to the package comfy_metal)

from comfy_metal.metal_kernels.emulator import build, strict  # noqa: E402
from comfy_metal.metal_kernels.emulator.errors import EmulatorError  # noqa: E402
from comfy_metal.metal_kernels.emulator.toolchain import clang_path  # noqa: E402

_METAL4 = re.compile(r"#\s*include\s*<\s*(metal_tensor|MetalPerformancePrimitives/[^>]*)\s*>")
_METAL32 = re.compile(r"\bcoherent\s*\(\s*\w+\s*\)|\bthread_scope\w*\b")
_MISSING_HEADER = re.compile(r"'([^']+)' file not found")


def _first_lines(msg: str, n: int) -> list[str]:
    lines = [ln.strip() for ln in msg.splitlines() if "error:" in ln]
    return lines[:n] if n else lines


def _reason_key(line: str) -> str:
    """A rejection line without its location, names and numbers: what the most-frequent table groups by."""
    s = re.sub(r"^[^\s:]+:\d+:\d+:\s*", "", line)
    s = re.sub(r"^[^\s:]+:\d+:\s*", "", s)
    s = re.sub(r"'[^']*'", "'_'", s)
    s = re.sub(r"`[^`]*`", "`_`", s)
    s = re.sub(r"\b\d+\b", "N", s)
    return s[:220]


def run_unit(path: pathlib.Path, includes: list[str], defines: list[str], syntax_only: bool, clang: str):
    """-> (status, strict problems, compile error): status "out of scope: ..." or "ok"."""
    src = path.read_text(errors="replace")
    with tempfile.TemporaryDirectory(prefix="msl_corpus_") as tmp:
        try:
            pp = build.preprocess(src, clang, tmp, [str(path.parent), *includes], defines)
        except EmulatorError as e:
            m = _MISSING_HEADER.search(str(e))
            if m and _METAL4.search(f"#include <{m.group(1)}>"):
                return f"out of scope: Metal 4 ({m.group(1)})", [], None
            return "ok", [f"preprocessing: {_first_lines(str(e), 1)}"], f"preprocessing failed: {str(e)[:300]}"
        if _METAL4.search(pp):
            return "out of scope: Metal 4 (metal_tensor / MetalPerformancePrimitives)", [], None
        m32 = _METAL32.search(pp)
        if m32:
            return f"out of scope: Metal 3.2 ({m32.group(0)})", [], None
        problems = strict.check(pp, clang)
        err = None
        try:
            cpp, _table = build.translate(pp)
            so = pathlib.Path(tmp) / "unit.so"
            build.compile_translated(cpp, clang, tmp, None if syntax_only else so,
                                     ["-fsyntax-only"] if syntax_only else [])
            if not syntax_only:
                ctypes.CDLL(str(so))  # undefined symbols fail here
        except (EmulatorError, OSError) as e:
            err = str(e)
    return "ok", problems, err


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", required=True, help="folder whose .metal files (recursively) are the units")
    ap.add_argument("--include", action="append", default=[], help="include folder (-I), repeatable")
    ap.add_argument("--define", action="append", default=[], help="macro NAME or NAME=VALUE for every unit")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=MACRO[,MACRO=V...]: also compile every unit with these macros (a unit of its own)")
    ap.add_argument("--exclude", action="append", default=[], help="glob of files out of scope (relative path)")
    ap.add_argument("--syntax-only", action="store_true", help="C++ backend: clang -fsyntax-only, no .so")
    ap.add_argument("-v", "--verbose", action="store_true", help="print every reason, not the first three")
    args = ap.parse_args(argv)
    clang = clang_path()
    if clang is None:
        print("clang-19 not found", file=sys.stderr)
        return 2
    root = pathlib.Path(args.path).resolve()
    files = sorted(root.rglob("*.metal"))
    variants = [("", [])] + [(v.split("=", 1)[0], v.split("=", 1)[1].split(",")) for v in args.variant]
    reasons = collections.Counter()
    counted = strict_ok = compiled = both = 0
    out_of_scope = []
    t0 = time.time()
    for f in files:
        rel = str(f.relative_to(root))
        if any(fnmatch.fnmatch(rel, g) for g in args.exclude):
            out_of_scope.append((rel, "excluded"))
            continue
        for vname, vdefs in variants:
            name = rel + (f" [{vname}]" if vname else "")
            t = time.time()
            status, problems, err = run_unit(f, [str(pathlib.Path(i).resolve()) for i in args.include],
                                             args.define + vdefs, args.syntax_only, clang)
            if status != "ok":
                out_of_scope.append((name, status))
                print(f"  ----  {name}: {status}")
                break
            counted += 1
            strict_ok += not problems
            compiled += err is None
            both += not problems and err is None
            print(f"  {'ACCEPT' if not problems else 'REJECT'} {'COMPILES' if err is None else 'FAILS   '} "
                  f"{name} ({time.time() - t:.1f} s)")
            n = 0 if args.verbose else 3
            for p in (problems if args.verbose else problems[:n]):
                print(f"        strict: {p[:400]}")
            if len(problems) > n > 0:
                print(f"        strict: ... {len(problems) - n} more")
            for p in problems:
                reasons["strict: " + _reason_key(p)] += 1
            if err is not None:
                lines = _first_lines(err, n)
                for p in lines:
                    print(f"        compile: {p[:400]}")
                for p in _first_lines(err, 0)[:1]:
                    reasons["compile: " + _reason_key(p)] += 1
    print("\nmost frequent reasons (strict: every problem; compile: the first error of each unit):")
    for r, c in reasons.most_common(25):
        print(f"  {c:4d}  {r}")
    if out_of_scope:
        print(f"\nout of scope ({len(out_of_scope)}): " + ", ".join(f"{n} ({s})" for n, s in out_of_scope))
    pct = lambda k: f"{k}/{counted} ({100.0 * k / counted:.0f}%)" if counted else "0/0"
    print(f"\nin-scope units: {counted}; strict front end accepts {pct(strict_ok)}; C++ backend "
          f"{'syntax-checks' if args.syntax_only else 'compiles'} {pct(compiled)}; both {pct(both)} "
          f"({time.time() - t0:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
