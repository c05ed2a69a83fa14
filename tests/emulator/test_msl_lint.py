"""Tests of the MSL lint (metal_kernels/emulator/lint.py): each rule with a clean and a failing kernel."""
from __future__ import annotations

import pytest

from comfy_metal.metal_kernels import emulator as emu
from comfy_metal.metal_kernels.emulator.lint import lint_source

HEAD = "#include <metal_stdlib>\nusing namespace metal;\n"

CLEAN = HEAD + r"""
#define TILE 32
constant constexpr int GROUP_SIZE = 256;

kernel void good(device float* out [[buffer(0)]], const device half* x [[buffer(1)]],
                 constant long& n [[buffer(2)]], constant float& eps [[buffer(3)]],
                 constant long* sizes [[buffer(4)]], constant float* w [[buffer(5)]],
                 constant ulong& m [[buffer(6)]],
                 uint tid [[thread_position_in_grid]], uint lid [[thread_position_in_threadgroup]],
                 uint lane [[thread_index_in_simdgroup]], uint sg [[simdgroup_index_in_threadgroup]]) {
  threadgroup float tile[TILE][TILE + 1];
  threadgroup float partial[GROUP_SIZE];
  tile[lid % TILE][lid % TILE] = float(x[tid]);
  partial[lid % GROUP_SIZE] = eps;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if ((long)tid < n) out[tid] = tile[0][0] + partial[0] + w[0] + float(sizes[0] + (long)m);
}

template <typename T>
[[max_total_threads_per_threadgroup(1024)]]
kernel void tmpl(device T* y [[buffer(0)]], constant float& s [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  threadgroup T buf[1024];
  buf[i % 1024] = y[i];
  y[i] = buf[i % 1024] * T(s);
}
template [[host_name("tmpl_float")]] kernel void tmpl<float>(device float* y [[buffer(0)]],
    constant float& s [[buffer(1)]], uint i [[thread_position_in_grid]]);
template [[host_name("tmpl_half")]] kernel void tmpl<half>(device half* y [[buffer(0)]],
    constant float& s [[buffer(1)]], uint i [[thread_position_in_grid]]);
"""

CLEAN_KINDS = {"good": ["tensor", "tensor", "int", "float", "int[]", "float[]", "int"],
               "tmpl_float": ["tensor", "float"], "tmpl_half": ["tensor", "float"]}


def kernel(params: str, body: str = "", name: str = "k", pre: str = "", attrs: str = "") -> str:
    return HEAD + pre + f"{attrs}kernel void {name}({params}, uint i [[thread_position_in_grid]]) {{\n{body}\n}}\n"


def test_clean_source_has_no_problems():
    assert lint_source(CLEAN) == []
    assert lint_source(CLEAN, CLEAN_KINDS) == []


def test_unknown_attribute():
    bad = kernel("device float* x [[buffer(0)]], uint t [[thread_index_in_warp]]")
    probs = lint_source(bad)
    assert len(probs) == 1 and "thread_index_in_warp" in probs[0] and "line 3" in probs[0]
    assert lint_source(kernel("device float* x [[buffer(0)]], uint t [[thread_index_in_threadgroup]]")) == []
    assert any("texture" in p for p in lint_source(kernel("device float* x [[texture(0)]]")))


def _split(probs):
    """(the lint's own problems, the strict MSL 3.1 front end's)."""
    strict = [p for p in probs if p.startswith("msl_source.metal:")]
    return [p for p in probs if p not in strict], strict


def test_double_is_rejected():
    probs = lint_source(kernel("device float* x [[buffer(0)]]", "  double d = x[i];\n  x[i] = (float)d;"))
    own, strict = _split(probs)
    assert len(own) == 1 and "double" in own[0] and "line 4" in own[0]
    assert strict and all("msl_source.metal:4:" in p and "double is not supported" in p for p in strict), strict
    # the word inside a comment or string is not code
    assert lint_source(kernel("device float* x [[buffer(0)]]", "  // double precision is not available\n"
                                                                  "  x[i] = 2.0f;")) == []


def test_unsuffixed_float_literal_is_flagged():
    """0.5 is float on Metal but a double in C++: the pack writes the type."""
    probs = lint_source(kernel("device float* x [[buffer(0)]]", "  x[i] = x[i] * 0.5 + 1e-6;"))
    assert len(probs) == 2 and "0.5" in probs[0] and "1e-6" in probs[1] and "line 4" in probs[0]
    assert lint_source(kernel("device float* x [[buffer(0)]]",
                              "  x[i] = x[i] * 0.5f + 1e-6f + float(half(1.5h)); // 0.25 in a comment")) == []


def test_pointer_without_address_space_is_flagged():
    pre = "inline float first(float* p) { return p[0]; }\ninline void put(thread float& r, device const half4* q) { r = q[0].x; }\n"
    probs, strict = _split(lint_source(kernel("device float* x [[buffer(0)]]", "  const uint* u = (const uint*)x;\n  x[i] = first(x) + float(u[0] & 1u);", pre=pre)))
    # the strict front end (the rule compile_library applies too) reports the same two places
    assert {p.split(":")[1] for p in strict} == {"3", "6"}, strict
    assert all("explicit address space qualifier" in p for p in strict), strict
    assert len(probs) == 2, probs          # (the two on line 6 read the same: reported once)
    assert "line 3" in probs[0] and "float*" in probs[0] and "address space" in probs[0]
    assert "line 6" in probs[1] and "uint*" in probs[1]
    # qualified pointers, references, casts, address-of, multiplication and bitwise and are fine
    assert lint_source(kernel("device float* x [[buffer(0)]]",
                              "  device float* p = &x[0];\n  device const uint* u = (device const uint*)x;\n"
                              "  threadgroup float t[4];\n  t[0] = float(u[0] & 1u) * x[1];\n  x[i] = *p + t[0];",
                              pre="inline float g(constant float& s, const device half* h) { return s * float(h[0]); }\n")) == []


@pytest.mark.parametrize("decl,ok", [
    ("threadgroup float a[8192];", True),                      # exactly 32 KiB
    ("threadgroup float a[8193];", False),
    ("threadgroup half a[N][N];", True),                       # constexpr N = 128 -> 32 KiB
    ("threadgroup float4 a[N][N];", False),                    # 256 KiB
    ("threadgroup float a[ROWS][COLS]; threadgroup float b[ROWS];", False),  # #define'd, summed per kernel
    ("threadgroup float a[ROWS][8];", True),
])
def test_threadgroup_memory_limit(decl, ok):
    pre = "constant constexpr int N = 128;\n#define ROWS 64\n#define COLS 128\n"
    probs = lint_source(kernel("device float* x [[buffer(0)]]", "  " + decl + "\n  x[i] = 0;", pre=pre))
    assert (probs == []) is ok, probs
    if not ok:
        assert "threadgroup memory" in probs[0] and "kernel k" in probs[0]


def test_threadgroup_memory_of_template_instantiations():
    src = HEAD + """
template <typename T> kernel void t(device T* x [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  threadgroup T big[10000];
  big[i] = x[i]; x[i] = big[0];
}
template [[host_name("t_half")]] kernel void t<half>(device half* x [[buffer(0)]], uint i [[thread_position_in_grid]]);
template [[host_name("t_float")]] kernel void t<float>(device float* x [[buffer(0)]], uint i [[thread_position_in_grid]]);
"""
    probs = lint_source(src)
    assert len(probs) == 1 and "t_float" in probs[0] and "40000 bytes" in probs[0]


def test_group_size_limits():
    ok = kernel("device float* x [[buffer(0)]]", "x[i] = 1;", attrs="[[max_total_threads_per_threadgroup(1024)]] ")
    assert lint_source(ok) == []
    bad = kernel("device float* x [[buffer(0)]]", "x[i] = 1;", attrs="[[max_total_threads_per_threadgroup(2048)]] ")
    probs = lint_source(bad)
    assert len(probs) == 1 and "2048" in probs[0] and "1024" in probs[0]
    probs = lint_source(kernel("device float* x [[buffer(0)]]", "x[i] = 1;", pre="#define THREADGROUP_SIZE 2048\n"))
    assert len(probs) == 1 and "THREADGROUP_SIZE" in probs[0]
    assert lint_source(kernel("device float* x [[buffer(0)]]", "x[i] = 1;", pre="#define BLOCK_SIZE 512\n")) == []


@pytest.mark.parametrize("ptype,ok", [
    ("constant long&", True), ("constant ulong&", True), ("constant int64_t&", True), ("constant uint64_t&", True),
    ("constant float&", True), ("constant int&", False), ("constant uint&", False), ("constant short&", False),
    ("constant half&", False), ("constant bool&", False), ("constant float4&", False),
    ("device float*", True), ("constant long*", True),
])
def test_scalar_widths(ptype, ok):
    probs = lint_source(kernel(f"device float* x [[buffer(0)]], {ptype} n [[buffer(1)]]", "x[i] = 0;"))
    assert (probs == []) is ok, probs
    if not ok:
        assert "parameter 'n'" in probs[0] and "kernel k" in probs[0]
        if "int&" in ptype:
            assert "long&" in probs[0]


def test_arg_kinds_agree():
    src = kernel("device float* x [[buffer(0)]], constant long& n [[buffer(1)]], constant float& f [[buffer(2)]], "
                 "constant long* dims [[buffer(3)]], constant float* ws [[buffer(4)]]", "x[i] = 0;")
    assert lint_source(src, {"k": ["tensor", "int", "float", "int[]", "float[]"]}) == []
    # swapped int/float
    probs = lint_source(src, {"k": ["tensor", "float", "int", "int[]", "float[]"]})
    assert len(probs) == 2 and "argument 1" in probs[0] and "argument 2" in probs[1]
    # a tensor where the kernel expects a scalar, and a list where it expects a tensor
    probs = lint_source(src, {"k": ["int[]", "tensor", "float", "int[]", "float[]"]})
    assert any("argument 0" in p for p in probs) and any("argument 1" in p for p in probs)
    # count mismatch
    probs = lint_source(src, {"k": ["tensor", "int", "float", "int[]"]})
    assert any("4 arguments" in p for p in probs) and any("buffer(4)" in p for p in probs)
    # unknown kernel in arg_kinds
    assert any("'nope'" in p for p in lint_source(src, {"nope": ["tensor"]}))


def test_threadgroup_parameter_is_rejected():
    probs = lint_source(kernel("device float* x [[buffer(0)]], threadgroup float* tg [[threadgroup(0)]]",
                               "x[i] = tg[0];"))
    assert len(probs) == 1 and "threadgroup(0)" in probs[0] and "line 3" in probs[0]


@pytest.mark.skipif(not emu.available(), reason="clang-19 not installed: function-like macros need its preprocessor")
def test_macro_stamped_kernels_are_linted():
    src = HEAD + """
#define UNARY(NAME) kernel void NAME(device float* y [[buffer(0)]], constant int& n [[buffer(1)]], \\
                                     uint i [[thread_position_in_grid]]) { y[i] = n; }
UNARY(one)
UNARY(two)
"""
    probs = lint_source(src)
    assert len(probs) == 2 and any("kernel one" in p for p in probs) and any("kernel two" in p for p in probs)


@pytest.mark.skipif(not emu.available(), reason="clang-19 not installed: cannot compile the lint's clean example")
def test_clean_example_also_compiles_in_the_emulator():
    lib = emu.compile_library(CLEAN)
    assert {"good", "tmpl_float", "tmpl_half"} <= set(lib.kernel_names)


def test_fallback_preprocessor_without_clang(monkeypatch):
    from comfy_metal.metal_kernels.emulator import lint
    monkeypatch.setattr(lint, "clang_path", lambda: None)
    src = HEAD + "#define N 9000\n" + """
kernel void k(device float* x [[buffer(0)]], constant int& n [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  threadgroup float big[N];  /* 36000 bytes */
  big[i] = x[i]; x[i] = big[0];
}
"""
    probs = lint.lint_source(src)
    assert len(probs) == 2 and any("36000" in p for p in probs) and any("long&" in p for p in probs)
    assert lint.lint_source(src.replace("9000", "900").replace("int&", "long&")) == []
