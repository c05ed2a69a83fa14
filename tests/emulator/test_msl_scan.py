"""The shared MSL kernel-signature scanner (metal_kernels/emulator/msl_scan.py), used by both the emulator
(parse_kernels -> launchers) and the lint: one tricky source, checked field by field, through both users."""
from __future__ import annotations

import pytest

from comfy_metal.metal_kernels import emulator as emu
from comfy_metal.metal_kernels.emulator import lint
from comfy_metal.metal_kernels.emulator.msl_scan import Param, scan_kernel_signatures, split_top_level

# What clang -E leaves: comments gone, line markers (also inside a parameter list), strings kept.
PP = r'''# 1 "msl_source.metal"
struct Pair { float a; float b; };
template <typename T, int N>
[[max_total_threads_per_threadgroup(128)]] kernel void tk(device T* out [[buffer(0)]],
                   constant long& n [[buffer(1)]],
# 7 "msl_source.metal"
                   uint3 pos [[thread_position_in_grid]]) {
  const char* s = "}"; (void)s;
  threadgroup T tile[N];
  if ((long)pos.x < n) { tile[0] = out[pos.x]; out[pos.x] = tile[0]; }
}
template [[host_name("tk_" "float4")]] kernel void tk<vec<float, 4>, 4>(device vec<float, 4>* out [[buffer(0)]],
                   constant long& n [[buffer(1)]], uint3 pos [[thread_position_in_grid]]);
[[kernel]] void plain(device float* const* ptrs [[buffer(0)]], constant float& eps [[buffer(1)]],
                      threadgroup float* scratch [[threadgroup(0)]], uint lid [[thread_index_in_threadgroup]])
{
  ptrs[0][lid] = eps + scratch[lid];
}
kernel [[max_total_threads_per_threadgroup(64)]] void declared_only(device float* x [[buffer(0)]]);
kernel void no_params(void) {}
'''


def test_scanner_finds_every_signature_with_its_parts():
    sigs = list(scan_kernel_signatures(PP))
    assert [s.name for s in sigs] == ["tk", "tk", "plain", "declared_only", "no_params"]
    tmpl, inst, plain, decl, empty = sigs

    # template definition: multi-line params with a line marker inside
    assert tmpl.template_args is None and tmpl.is_definition
    assert PP[tmpl.start:].startswith("kernel void tk(")
    assert [(p.type, p.name, p.attr, p.attr_arg) for p in tmpl.parameters()] == [
        ("device T*", "out", "buffer", "0"), ("constant long&", "n", "buffer", "1"),
        ("uint3", "pos", "thread_position_in_grid", "")]
    assert "#" not in tmpl.params_text
    # the body span skips the "}" inside a string literal and ends at the kernel's own brace
    body_open, body_close = tmpl.body_span
    assert PP[body_open] == "{" and PP[body_close] == "}"
    assert "tile[0] = out[pos.x]" in PP[body_open:body_close] and "template [[host_name" not in PP[body_open:body_close]

    # explicit instantiation: nested template arguments, a declaration (no body)
    assert inst.template_args == "vec<float, 4>, 4"
    assert inst.terminator == ";" and not inst.is_definition and inst.body_span is None
    assert inst.parameters()[0].type == "device vec<float, 4>*"

    # [[kernel]] form, body on the next line, pointer to pointers, a threadgroup parameter
    assert plain.is_definition and PP[plain.body_span[0]] == "{"
    ptrs, eps, scratch, lid = plain.parameters()
    assert (ptrs.type, ptrs.name) == ("device float* const*", "ptrs")
    assert (eps.type, eps.attr, eps.attr_arg) == ("constant float&", "buffer", "1")
    assert (scratch.type, scratch.name, scratch.attr, scratch.attr_arg) == ("threadgroup float*", "scratch",
                                                                           "threadgroup", "0")
    assert lid.attr == "thread_index_in_threadgroup"

    # an attribute between `kernel` and `void`; a declaration
    assert PP[decl.start:].startswith("kernel [[max_total_threads_per_threadgroup(64)]] void declared_only(")
    assert not decl.is_definition and decl.body_span is None
    assert empty.parameters() == [] and empty.is_definition


def test_unclosed_signatures_are_skipped():
    assert list(scan_kernel_signatures("kernel void broken(device float* x [[buffer(0)]] {")) == []
    assert list(scan_kernel_signatures("kernel void t<float(device float* x) {}")) == []
    sig, = scan_kernel_signatures("kernel void open(device float* x [[buffer(0)]]) { x[0] = 1.0f;")
    assert sig.is_definition and sig.body_span is None


def test_param_and_top_level_split():
    assert split_top_level("device A<int, 2>* a, constant long& n, uint3 p ,") == [
        "device A<int, 2>* a", " constant long& n", " uint3 p "]
    p = Param("  constant   long &\n n  [[ buffer( 3 ) ]] ")
    assert (p.type, p.name, p.attr, p.attr_arg) == ("constant long &", "n", "buffer", "3")
    unnamed = Param("device float* [[buffer(0)]]")
    assert (unnamed.type, unnamed.name) == ("device float*", "")
    assert Param("uint tid").attr == ""


def test_emulator_builds_its_kernels_from_the_scanned_signatures():
    kernels, remove = emu.parse_kernels(PP)
    by_host = {k.host: k for k in kernels}
    assert sorted(by_host) == ["no_params", "plain", "tk_float4"]
    inst = by_host["tk_float4"]
    assert inst.kind == "inst" and inst.targs == "vec<float, 4>, 4" and inst.max_threads == 128
    assert [p.name for p in inst.params] == ["out", "n", "pos"]   # parameters of the template definition
    assert len(remove) == 1 and PP[remove[0][0]:remove[0][1]].startswith("template [[host_name")
    assert PP[remove[0][1] - 1] == ";"
    # the threadgroup parameter gets a launcher; its table entry makes the launch refuse it (no size)
    _code, table = emu.generate_launchers([by_host["plain"]])
    assert table[0]["threadgroup_params"] == ["threadgroup float* scratch [[threadgroup(0)]]"]


def test_lint_reads_the_same_signatures(monkeypatch):
    # no clang needed: the lint's fallback preprocessor strips the comments, then both scans run on the result
    monkeypatch.setattr(lint, "clang_path", lambda: None)
    src = ("// a comment with kernel void fake(int x) {\n"
           "/* kernel void also_fake(\n  int y) {} */\n"
           "#define TILE 9000\n"
           "kernel void big(device float* x [[buffer(0)]], // per-kernel buffer\n"
           "                constant int& n [[buffer(1)]],\n"
           "                threadgroup float* t [[threadgroup(0)]],\n"
           "                uint i [[thread_position_in_grid]]) {\n"
           "  threadgroup float tile[TILE];\n"
           "  tile[i] = x[i]; x[i] = tile[0] + t[0];\n"
           "}\n")
    problems = lint.lint_source(src, {"big": ["tensor", "int"]})
    assert any("line 7" in p and "[[threadgroup(0)]]" in p for p in problems), problems
    assert any(p.startswith("kernel big (line 5)") and "36000 bytes" in p for p in problems), problems
    assert any("parameter 'n' is `constant int&`" in p for p in problems), problems
    assert not any("fake" in p for p in problems), problems
