"""MSL's bool vectors (`bool2`..`bool4`, `metal::vec<bool, N>`) in the strict front end and the C++ backend.

MSL 3.1: a vector comparison gives a boolN (Operators: relational and equality operators on vectors return a
Boolean vector); a scalar converts implicitly to a vector (replicated), a braced list of N scalars initialises
one; `all`/`any`/`select` take boolN; conversions between vector types are explicit only (Implicit Type
Conversions: none between vector types; Type Conversions: `int4(m)`, `static_cast<float4>(m)`, `(float4)m`,
`bool4(v)` convert element-wise, true -> 1, nonzero -> true). Logical `! && ||`, `== !=` and the bitwise
`& | ^` (which Apple's compiler accepts on boolN: Tint's MSL output writes `bool3(..) & bool3(..)`) give boolN.

Before these tests, `vec<bool, N>` failed in the strict front end (clang's OpenCL mode has no bool vectors),
`bool4 m = a < b;` did not compile in either front end (bool4 was a char vector in the strict pass), and an
implicit `int4` <-> `bool4` conversion was accepted by the strict pass (both were char/int vectors).
"""
from __future__ import annotations

import pytest
import torch

from comfy_metal.metal_kernels import emulator as emu
from comfy_metal.metal_kernels.emulator.lint import lint_source

pytestmark = pytest.mark.skipif(not emu.available(), reason="clang-19 not installed: the MSL emulator needs it")

HDR = "#include <metal_stdlib>\nusing namespace metal;\n"

BOOLS = HDR + """
// MLX's steel attention: a bool mask fragment through a typedef of metal::vec<T, N>
template <typename T, int N> struct Frag {
  typedef metal::vec<T, N> frag_type;
  static void load(thread frag_type& d, const device T* s) {
    for (int i = 0; i < N; i++) d[i] = static_cast<T>(s[i]);
  }
};
// MLX's fft: T deduced through metal::vec<T, 2> parameters (must stay deducible)
template <class T> METAL_FUNC metal::vec<T, 2> cmul(metal::vec<T, 2> a, metal::vec<T, 2> b) { return a * b; }
// MLX's reduction ops: a bool4 in a union
union bool4_or_uint { bool4 b; uint i; };

kernel void bools(device float* out [[buffer(0)]], const device float4* a [[buffer(1)]],
                  const device float4* b [[buffer(2)]], const device bool* mask [[buffer(3)]],
                  device bool4* bout [[buffer(4)]], uint i [[thread_position_in_grid]]) {
  float4 x = a[i], y = b[i];
  bool4 lt = x < y;                       // comparison -> boolN
  bool4 ge = !lt;
  bool4 both = lt && (x > 0.0f);          // boolN && comparison
  bool4 either = lt || ge;
  bool4 eq = (lt == both) & either;       // == and & on boolN
  half2 h = half2(x.xy);
  bool2 hm = h >= half2(y.xy);            // half comparison (a short vector in clang) -> bool2
  bool3 splat = true;                     // scalar -> vector
  bool4 lst = bool4(true, false, x.x > 0.0f, 1);
  bool2 brace = {true};                   // zero-filled
  float4 sel = select(y, x, lt);          // x where lt
  int4 asint = int4(lt);                  // explicit conversions
  float4 asf = static_cast<float4>(ge);
  float4 asf2 = (float4)both;
  bool4 fromf = bool4(x);                 // nonzero -> true
  bool4 nan_ = isnan(x);
  Frag<bool, 2>::frag_type mf;
  Frag<bool, 2>::load(mf, mask + 2 * i);
  metal::vec<bool, 4> vb = lt ^ ge;
  float2 c = cmul(float2(x.xy), float2(y.xy));
  bool4_or_uint u;
  u.b = {true, true, true, true};
  u.b[i % 4] = false;
  bout[i] = lt;
  bout[i].w = all(ge) || any(nan_);
  device float* o = out + 32 * i;
  o[0] = sel.x; o[1] = sel.y; o[2] = sel.z; o[3] = sel.w;
  o[4] = asint.x + 2 * asint.y + 4 * asint.z + 8 * asint.w;
  o[5] = asf.x + 2 * asf.y + 4 * asf.z + 8 * asf.w;
  o[6] = asf2.x + 2 * asf2.y + 4 * asf2.z + 8 * asf2.w;
  o[7] = float(eq.x) + 2 * eq.y + 4 * eq.z + 8 * eq.w;
  o[8] = float(hm.x) + 2 * hm.y;
  o[9] = float(splat.x && splat.y && splat.z);
  o[10] = float(lst[0]) + 2 * lst[1] + 4 * lst[2] + 8 * lst[3];
  o[11] = float(brace.x) + 2 * brace.y;
  o[12] = float(fromf.x) + 2 * fromf.y + 4 * fromf.z + 8 * fromf.w;
  o[13] = float(nan_.x) + 2 * nan_.y + 4 * nan_.z + 8 * nan_.w;
  o[14] = float(mf.x) + 2 * mf[1];
  o[15] = float(vb.x && vb.y && vb.z && vb.w);
  o[16] = c.x; o[17] = c.y;
  o[18] = float(u.i & 0xFFFFu); o[20] = float(u.i >> 16);
  o[19] = float(all(lt)) + 2 * any(lt);
}
"""


def _bits(v):
    return sum((1 << k) for k, e in enumerate(v) if e)


def test_bool_vectors_compile_and_run_with_msl_values():
    assert [p for p in lint_source(BOOLS) if p.startswith("msl_source.metal:")] == []
    lib = emu.compile_library(BOOLS)
    a = torch.tensor([[1.0, -2.0, 3.0, float("nan")], [0.0, 5.0, -1.0, 2.0]])
    b = torch.tensor([[2.0, -3.0, 3.0, 1.0], [1.0, 1.0, 1.0, 1.0]])
    mask = torch.tensor([True, False, False, True])
    out = torch.zeros(64)
    bout = torch.zeros(8, dtype=torch.uint8)
    lib.bools(out, a, b, mask, bout, threads=2, group_size=2)
    o = out.view(2, 32)
    for i in range(2):
        x, y = a[i].tolist(), b[i].tolist()
        lt = [p < q for p, q in zip(x, y)]
        ge = [not e for e in lt]
        both = [l and p > 0 for l, p in zip(lt, x)]
        eq = [(l == bo) and (l or g) for l, bo, g in zip(lt, both, ge)]
        nan_ = [p != p for p in x]
        sel = [p if l else q for p, q, l in zip(x, y, lt)]
        assert o[i, :4].tolist() == sel
        assert o[i, 4].item() == _bits(lt)  # int(true) is 1, not clang's -1 of a comparison
        assert o[i, 5].item() == _bits(ge)
        assert o[i, 6].item() == _bits(both)
        assert o[i, 7].item() == _bits(eq)
        assert o[i, 8].item() == _bits([p >= q for p, q in zip(x[:2], y[:2])])
        assert o[i, 9].item() == 1
        assert o[i, 10].item() == _bits([True, False, x[0] > 0, True])
        assert o[i, 11].item() == 1  # {true} -> (true, false)
        assert o[i, 12].item() == _bits([p != 0 for p in x])  # NaN != 0: true
        assert o[i, 13].item() == _bits(nan_)
        assert o[i, 14].item() == _bits(mask[2 * i:2 * i + 2].tolist())
        assert o[i, 15].item() == 1  # lt ^ !lt
        assert o[i, 16:18].tolist() == [x[0] * y[0], x[1] * y[1]]
        word = 0x01010101 & ~(0xFF << (8 * (i % 4)))  # one byte a bool, element i cleared
        assert (o[i, 18].item(), o[i, 20].item()) == (word & 0xFFFF, word >> 16)
        assert o[i, 19].item() == int(all(lt)) + 2 * int(any(lt))
        # a bool4 in device memory: 4 bytes, lt with .w replaced
        assert bout[4 * i:4 * i + 4].tolist() == [int(e) for e in lt[:3]] + [int(all(ge) or any(nan_))]


K = lambda body: ("kernel void k(device float* o [[buffer(0)]], uint i [[thread_position_in_grid]]) {\n"
                  f"  float4 a = float4(o[i]); int4 iv = int4(1); char4 cv = char4(1);\n  {body}\n  o[i] = 0.0f;\n}}\n")
CONV = "MSL 3.1 (Implicit Type Conversions)"
# what MSL rejects, with the rule each rejection must name (the char4 and arithmetic cases were accepted before:
# bool4 was char4 in the strict front end)
ILLEGAL = {
    "int_vector_variable_to_bool4": (K("bool4 m = iv;"), CONV),
    "char_vector_variable_to_bool4": (K("bool4 m = cv;"), CONV),
    "float_vector_to_bool4": (K("bool4 m = a;"), CONV),
    "bool4_to_int4": (K("bool4 m = a < a; int4 n = m;"), CONV),
    "bool4_to_float4": (K("bool4 m = true; float4 f = m;"), CONV),
    "bool4_to_bool2": (K("bool4 m = true; bool2 n = m;"), CONV),
    "bool4_from_a_float2_comparison": (K("float2 b = float2(1.0f); bool4 m = b < b;"), CONV),
    "bool4_arithmetic": (K("bool4 m = a < a; bool4 n = m + m;"), "MSL 3.1 (Operators)"),
}


@pytest.mark.parametrize("name", sorted(ILLEGAL))
def test_bool_vector_misuse_is_rejected_with_the_rule(name):
    src, why = ILLEGAL[name]
    with pytest.raises(emu.MSLCompileError) as e:
        emu.compile_library(HDR + src)
    msg = str(e.value)
    assert "strict MSL front end" in msg and why in msg, msg
    assert any(why in p for p in lint_source(HDR + src))


def test_vec_bool_written_out_and_in_aliases():
    """`metal::vec<bool, N>` written out, in `using` and `typedef` (in a class template instantiated with bool) is
    boolN; an alias template of vec<T, N> still deduces T."""
    src = HDR + """
template <class T> using v2 = vec<T, 2>;
template <class T> T first(v2<T> v) { return v.x; }
template <class T> struct S { using V = metal::vec<T, 3>; V v; };
kernel void k(device float* o [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  metal::vec<bool, 2> a = float2(o[i], 1.0f) > 0.5f;
  S<bool> s;
  s.v = bool3(a.x, a.y, true);
  o[i] = first(float2(2.0f, 3.0f)) + float(s.v.x) + 2 * s.v.y + 4 * s.v.z;
}
"""
    assert [p for p in lint_source(src) if p.startswith("msl_source.metal:")] == []
    lib = emu.compile_library(src)
    out = torch.tensor([0.0, 1.0])
    lib.k(out, threads=2)
    assert out.tolist() == [2.0 + 0 + 2 + 4, 2.0 + 1 + 2 + 4]
