"""The library source (metal_kernels/source.py): headers of include/ inlined once per library, the prelude
generated from Python tables (constants, params structs, constexpr tables), and one template instantiation
line per registered entry point that names one; the values the kernels and the launchers share come from
one place."""
from __future__ import annotations

import re

import pytest

from comfy_metal import metal_kernels  # noqa: F401  (fills the registry)
from comfy_metal.metal_kernels import gguf, linear, registry, source


def test_each_header_is_inlined_once_and_no_include_is_left():
    src = source.library_source()
    for header in sorted(p.name for p in source.INCLUDE_DIR.glob("*.h")):
        assert src.count(f"// ---- include/{header} ----") == 1, header
    assert not re.search(r'^\s*#\s*include\s+"', src, re.M)
    # a file compiled alone with common.metal still gets every header it includes
    alone = source.library_source(only="gguf.metal")
    for header in ("io.h", "gemv.h", "fp8.h", "bf16.h"):
        assert alone.count(f"// ---- include/{header} ----") == 1, header


def test_an_unknown_header_is_a_clear_error():
    with pytest.raises(FileNotFoundError, match=r'x.metal: #include "nope.h": no such header'):
        source.inline_includes('#include "nope.h"\n', set(), "x.metal")


def test_prelude_holds_the_python_tables():
    pre = source.prelude()
    assert f"#define GEMV_MAX_M {linear.GEMV_MAX_M}" in pre
    for q, (bs, ts) in gguf.GGUF_QUANTS.items():
        assert f"#define GGUF_{q}_BLOCK {bs}\n" in pre and f"#define GGUF_{q}_BYTES {ts}\n" in pre
    fields = re.search(r"struct gemv_params \{(.*?)\};", pre, re.S).group(1).split()
    assert fields[1::2] == [f + ";" for f in linear.GEMV_PARAMS.fields] and set(fields[::2]) == {"long"}
    expr = re.search(r"constexpr int gemv_rows\(int k\) \{ return (.*?); \}", pre).group(1)
    steps = [(int(b), int(v)) for b, v in re.findall(r"k <= (\d+) \? (\d+) :", expr)]
    last = int(expr.rsplit(":", 1)[1])

    def gemv_rows(k):                                    # the C expression, evaluated
        return next((v for b, v in steps if k <= b), last)
    for m in range(1, linear.GEMV_MAX_M + 1):            # agrees with the host's grid for every M
        assert gemv_rows(linear.gemv_bucket(m)) == linear.GEMV_ROWS[linear.gemv_bucket(m)]


def test_instantiations_follow_the_registry():
    src = source.library_source()
    for spec in registry.REGISTRY.values():
        for host, template in spec.instantiate.items():
            line = f'template [[host_name("{host}")]] [[kernel]] decltype({template}) {template};'
            assert src.count(line) == 1, line


def test_params_pack_in_field_order_and_refuse_a_wrong_set():
    assert linear.GEMV_PARAMS.pack(**{f: i for i, f in enumerate(linear.GEMV_PARAMS.fields)}) == \
        list(range(len(linear.GEMV_PARAMS.fields)))
    with pytest.raises(TypeError, match=r"missing fields \['out_kind'\]"):
        linear.GEMV_PARAMS.pack(**{f: 0 for f in linear.GEMV_PARAMS.fields[:-1]})
    with pytest.raises(ValueError, match="defined twice"):
        source.define("GEMV_MAX_M", linear.GEMV_MAX_M + 1)


def test_library_lines_name_each_line_s_file_and_line():
    src = source.library_source().split("\n")
    origins = source.library_lines()
    assert len(origins) == len(src)
    files = {p.name: p.read_text().split("\n") for p in source.metal_sources()}
    files.update({f"include/{p.name}": p.read_text().split("\n") for p in source.INCLUDE_DIR.glob("*.h")})
    checked = 0
    for line, (f, n) in zip(src, origins):
        if f in files and n and "#include" not in files[f][n - 1]:
            assert files[f][n - 1] == line, (f, n)
            checked += 1
    assert checked > 1000 and {f for f, _ in origins} >= set(files)


def test_bench_predict_names_the_line_of_the_file_it_came_from():
    """`bench --predict`'s hot lines (perf.source_locator): a line after an inlined header is the including
    file's again, e.g. quant.metal's formats after its #include lines, not the header's line 300."""
    from comfy_metal.metal_kernels import perf

    src = source.library_source()
    locate = perf.source_locator(src)
    checked = 0
    for i, (f, n) in enumerate(source.library_lines(), 1):
        if (f.endswith(".metal") or f.startswith("include/")) and n:
            assert locate(i) == f"{f}:{n}", (i, f, n)
            checked += 1
    assert checked > 1000
