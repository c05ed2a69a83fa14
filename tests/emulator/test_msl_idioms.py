"""MSL 3.1 idioms of real kernel libraries (MLX, llama.cpp/ggml, PyTorch's MPS kernels) that Apple's compiler
accepts: each one a minimal kernel written for this project that passes the strict front end, compiles in the
C++ backend and runs against a torch reference (values checked where the construct's semantics matter).
"""
from __future__ import annotations

import pytest
import torch

from comfy_metal.metal_kernels import emulator as emu
from comfy_metal.metal_kernels.emulator.lint import lint_source
from comfy_metal.metal_kernels.specialize import SpecializationError, specialize

pytestmark = pytest.mark.skipif(not emu.available(), reason="clang-19 not installed: the MSL emulator needs it")

HDR = "#include <metal_stdlib>\nusing namespace metal;\n"


def _lane_layout():
    """(row, col) of element j of lane l in an 8x8 simdgroup matrix (the fixed hardware layout)."""
    out = []
    for lane in range(32):
        q = lane // 4
        r = (q & 4) + (lane // 2) % 4
        c = 2 * (q & 2) + 2 * (lane % 2)
        out.append([(r, c), (r, c + 1)])
    return out


SIMDGROUP = HDR + """
kernel void te_read(device float* out [[buffer(0)]], const device float* a [[buffer(1)]],
                    ushort l [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 m;
  simdgroup_load(m, a, 8);
  vec<float, 2> e = m.thread_elements();
  out[2 * l] = e[0];
  out[2 * l + 1] = e[1];
}
kernel void te_write(device float* out [[buffer(0)]], ushort l [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 m;
  m.thread_elements()[0] = float(2 * l);
  m.thread_elements()[1] = float(2 * l + 1);
  simdgroup_store(m, out, 8);
}
kernel void te_mma(device float* d [[buffer(0)]], const device half* a [[buffer(1)]],
                   const device float* b [[buffer(2)]], const device float* c [[buffer(3)]],
                   uint l [[thread_index_in_simdgroup]]) {
  simdgroup_half8x8 ma;
  simdgroup_float8x8 mb, mc, md;
  simdgroup_load(ma, a, 8);
  simdgroup_load(mb, b, 8, ulong2(0, 0), true);
  simdgroup_load(mc, c, 8);
  simdgroup_multiply_accumulate(md, ma, mb, mc);
  // scale this lane's elements: d = 2 (a b^T + c)
  thread auto& e = md.thread_elements();
  e *= 2.0f;
  simdgroup_store(md, d, 8);
}
kernel void filled(device float* out [[buffer(0)]], constant float& v [[buffer(1)]], uint l [[thread_index_in_simdgroup]]) {
  simdgroup_float8x8 m = make_filled_simdgroup_matrix<float, 8>(v);   // Rows defaults to Cols
  simdgroup_store(m, out, 8);
}
"""


@pytest.fixture(scope="module")
def sg():
    return emu.compile_library(SIMDGROUP)


def test_thread_elements_layout_matches_simdgroup_load(sg):
    a = torch.arange(64, dtype=torch.float32)
    out = torch.zeros(64)
    sg.te_read(out, a, threads=32, group_size=32)
    want = torch.tensor([float(r * 8 + c) for lane in _lane_layout() for r, c in lane])
    assert torch.equal(out, want)


def test_thread_elements_writes_are_what_simdgroup_store_stores(sg):
    out = torch.full((64,), -1.0)
    sg.te_write(out, threads=32, group_size=32)
    want = torch.empty(8, 8)
    for lane, elems in enumerate(_lane_layout()):
        for j, (r, c) in enumerate(elems):
            want[r, c] = 2 * lane + j
    assert torch.equal(out.view(8, 8), want)


def test_simdgroup_multiply_accumulate_and_thread_elements_values(sg):
    g = torch.Generator().manual_seed(1)
    a = torch.randn(8, 8, generator=g).half()
    b = torch.randn(8, 8, generator=g)
    c = torch.randn(8, 8, generator=g)
    d = torch.zeros(64)
    sg.te_mma(d, a, b, c, threads=32, group_size=32)
    want = 2 * (a.double() @ b.double().T + c.double())
    torch.testing.assert_close(d.view(8, 8).double(), want, atol=1e-4, rtol=1e-4)


def test_make_filled_simdgroup_matrix_rows_default_to_cols(sg):
    out = torch.zeros(64)
    sg.filled(out, 2.5, threads=32, group_size=32)
    assert torch.equal(out, torch.full((64,), 2.5))


def test_simdgroup_product_of_a_partial_simdgroup_is_undefined():
    """Fewer than 32 lanes at a simdgroup matrix product: undefined on the GPU, NaN here (never a silent value)."""
    lib = emu.compile_library(HDR + """
kernel void part(device float* d [[buffer(0)]], const device float* a [[buffer(1)]]) {
  simdgroup_float8x8 m, r;
  simdgroup_load(m, a, 8);
  simdgroup_multiply(r, m, m);
  simdgroup_store(r, d, 8);
}""")
    d = torch.zeros(64)
    with emu.schedule("forward"):
        emu.set_checks(False)
        try:
            lib.part(d, torch.ones(64), threads=16, group_size=16)
        finally:
            emu.set_checks(None)
    assert torch.isnan(d[:16]).any()


# ---------------------------------------------------------------- function constants

FC_SRC = HDR + """
constant bool has_bias [[function_constant(0)]];
constant int scale [[function_constant(1)]];
constant float offset [[function_constant(2)]];
constant bool has_clamp [[function_constant(3)]];        // optional: asked with is_function_constant_defined
constant bool do_clamp = is_function_constant_defined(has_clamp) && has_clamp;

kernel void fc(device float* out [[buffer(0)]], const device float* x [[buffer(1)]],
               const device float* bias [[buffer(2), function_constant(has_bias)]],
               uint i [[thread_position_in_grid]]) {
  float v = x[i] * scale + offset;
  if (has_bias) v += bias[i];
  if (do_clamp) v = min(v, 1.0f);
  out[i] = v;
}
"""


def test_function_constants_specialised_values_are_used():
    x, bias = torch.arange(6, dtype=torch.float32), torch.full((6,), 0.25)
    lib = emu.compile_library(specialize(FC_SRC, {0: True, "scale": 3, 2: 0.5}))
    out = torch.zeros(6)
    lib.fc(out, x, bias)
    assert torch.equal(out, x * 3 + 0.5 + 0.25)
    lib = emu.compile_library(specialize(FC_SRC, {"has_bias": False, 1: -2, "offset": 1.0, "has_clamp": True}))
    out = torch.zeros(6)
    lib.fc(out, x, x)            # bias unused (has_bias false): any buffer, or none
    assert torch.equal(out, torch.clamp(x * -2 + 1.0, max=1.0))


def test_function_constants_without_values_compile_but_do_not_launch():
    lib = emu.compile_library(FC_SRC)   # Apple's compiler builds the library; the pipeline needs the values
    assert lib.kernel_names == ["fc"]
    with pytest.raises(emu.EmulatorError, match=r"has_bias \[\[function_constant\(0\)\]\].*specialise"):
        lib.fc(torch.zeros(2), torch.zeros(2), torch.zeros(2))


def test_specialize_rejects_what_metal_would():
    with pytest.raises(SpecializationError, match=r"without a value: scale"):
        specialize(FC_SRC, {0: True, 2: 0.5})                 # a required constant left out
    with pytest.raises(SpecializationError, match=r"no function constant 7"):
        specialize(FC_SRC, {0: True, 1: 1, 2: 0.5, 7: 1})
    with pytest.raises(SpecializationError, match=r"give True/False"):
        specialize(FC_SRC, {0: 1, 1: 1, 2: 0.5})
    with pytest.raises(SpecializationError, match=r"give an int"):
        specialize(FC_SRC, {0: True, 1: 1.5, 2: 0.5})
    assert "[[function_constant" not in specialize(FC_SRC, {0: True, 1: 1, 2: 0.5}).split("kernel void")[1]


# ---------------------------------------------------------------- [[threadgroup(n)]] sized at specialisation

TG_SRC = HDR + """
kernel void tg_sum(device float* out [[buffer(0)]], const device float* x [[buffer(1)]],
                   threadgroup float* scratch [[threadgroup(0)]],
                   uint l [[thread_position_in_threadgroup]], uint n [[threads_per_threadgroup]],
                   uint g [[threadgroup_position_in_grid]]) {
  scratch[l] = x[g * n + l];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint s = n / 2; s > 0; s /= 2) {
    if (l < s) scratch[l] += scratch[l + s];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (l == 0) out[g] = scratch[0];
}
"""


def test_threadgroup_parameter_sized_by_specialisation():
    src = specialize(TG_SRC, threadgroup_memory={"tg_sum": {0: 64 * 4}})
    assert "threadgroup float4 _tgmem0_scratch[16]; threadgroup float* scratch = " in src  # 256 bytes, 16-aligned
    assert "[[threadgroup(0)]]" not in src
    lib = emu.compile_library(src)
    x = torch.randn(3 * 64, generator=torch.Generator().manual_seed(2))
    out = torch.zeros(3)
    lib.tg_sum(out, x, threads=3 * 64, group_size=64)
    torch.testing.assert_close(out, x.view(3, 64).sum(1), atol=1e-5, rtol=1e-5)
    with pytest.raises(SpecializationError, match="multiple of 16"):
        specialize(TG_SRC, threadgroup_memory={"tg_sum": {0: 100}})
    with pytest.raises(SpecializationError, match=r"no \[\[threadgroup\(n\)\]\] pointer parameter for n = \[1\]"):
        specialize(TG_SRC, threadgroup_memory={"tg_sum": {1: 64}})


# ---------------------------------------------------------------- types, construction, casts

IDIOMS = """
// as_type is an operator: usable before `using namespace metal`
kernel void bits(device uint* o [[buffer(0)]], const device float* x [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  o[i] = as_type<uint>(x[i]);
}
#include <metal_stdlib>
using namespace metal;

#if defined(__METAL__)
constant constexpr float kMetalBranch = 1.0f;
#else
constant constexpr float kMetalBranch = -1.0f;
#endif

template <class V> V make2(float a, float b) { return V(a, b); }   // vector construction through a parameter
typedef float4 my_float4;
struct Pair { float a; float b; };
constexpr float2 twice(float2 v) { return float2(v.x * 2.0f, v.y * 2.0f); }  // vector constructor, constexpr

kernel void vectors(device float* o [[buffer(0)]], const device int* k [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  float4 brace = {o[0]};                        // fewer elements: the rest are zero
  int2 direct(3, 4);                            // direct-initialisation
  float2 viaparam = make2<float2>(5.0f, 6.0f);
  int4 iv = int4(k[0], k[1], k[2], k[3]);
  my_float4 conv = (my_float4)iv;               // a cast through a typedef converts element-wise
  metal::vec<float, 4> v4 = metal::vec<float, 4>(iv);
  metal::array<float, 3> arr = {7.0f, 8.0f, 9.0f};
  float2 ce = twice(float2(1.0f, 1.5f));
  o[0] = brace.x; o[1] = brace.y + brace.z + brace.w;
  o[2] = float(direct.x); o[3] = float(direct.y);
  o[4] = viaparam.x; o[5] = viaparam.y;
  o[6] = conv.x; o[7] = conv.w; o[8] = v4.y;
  o[9] = arr[2] + float(arr.size());
  o[10] = ce.y;
  o[11] = kMetalBranch;
}

[[kernel, max_total_threads_per_threadgroup(64)]] void attr_list(device float* o [[buffer(0)]],
                                                                  uint l [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  t[l] = float(l);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  o[l] = t[63 - l];
}
"""


@pytest.fixture(scope="module")
def idioms():
    return emu.compile_library(IDIOMS)


def test_as_type_before_using_namespace(idioms):
    x = torch.tensor([1.0, -2.5, 3.0e-3])
    o = torch.zeros(3, dtype=torch.int32)
    idioms.bits(o, x)
    assert torch.equal(o, x.view(torch.int32))


def test_vector_construction_forms(idioms):
    o = torch.zeros(12)
    o[0] = 1.5
    k = torch.tensor([1, 2, 3, 4], dtype=torch.int32)
    idioms.vectors(o, k, threads=1)
    assert o.tolist() == [1.5, 0.0, 3.0, 4.0, 5.0, 6.0, 1.0, 4.0, 2.0, 12.0, 3.0, 1.0]


def test_kernel_attribute_list(idioms):
    assert idioms.attr_list.max_threads_per_threadgroup == 64
    o = torch.zeros(64)
    idioms.attr_list(o, threads=64, group_size=64)
    assert torch.equal(o, torch.arange(63, -1, -1, dtype=torch.float32))


def test_idioms_lint_clean():
    problems = [p for p in lint_source(IDIOMS) + lint_source(SIMDGROUP) if p.startswith("msl_source.metal:")]
    assert problems == []


def test_dispatch_specialises_one_source_for_the_mac_and_the_emulator(monkeypatch):
    """torch.mps.compile_shader has no function-constant values: dispatch writes them into the source, and the
    Mac and the emulator compile the same specialised text."""
    from comfy_metal.metal_kernels import dispatch

    constants = {0: True, "scale": 2, 2: 0.0}
    compiled = {}
    monkeypatch.setattr(dispatch, "library_source", lambda only=None: FC_SRC)
    monkeypatch.setattr(dispatch, "_libraries", {})
    monkeypatch.setattr(torch, "mps", type("FakeMPS", (), {"compile_shader": staticmethod(
        lambda src: compiled.setdefault("metal", src))}), raising=False)
    real = emu.compile_library

    def emulator_compile(src):
        compiled["emulator"] = src
        return real(src)
    monkeypatch.setattr(emu, "compile_library", emulator_compile)
    dispatch.compile_library("metal", constants=constants)
    lib = dispatch.compile_library("emulator", constants=constants)
    assert compiled["metal"] == compiled["emulator"] == specialize(FC_SRC, constants)
    out = torch.zeros(3)
    lib.fc(out, torch.ones(3), torch.ones(3))
    assert out.tolist() == [3.0] * 3
    assert dispatch.compile_library("emulator", constants=constants) is lib          # cached per specialisation
    assert dispatch.compile_library("emulator", constants=dict(constants, scale=3)) is not lib



# ---------------------------------------------------------------- the standard library model and C++ forms

LIBRARY = HDR + r"""
// type traits and utility: compile-time answers
struct Tag { int x; };
static_assert(metal::is_convertible_v<int, float> && !metal::is_convertible_v<Tag, int>, "is_convertible");
static_assert(metal::bool_constant<true>::value && metal::is_same_v<metal::make_signed_t<uint>, int>, "traits");
static_assert(metal::is_same_v<metal::make_unsigned_t<short>, ushort>, "make_unsigned");
static_assert(metal::is_same_v<decltype(metal::declval<float>() + 1), float>, "declval");
static_assert(!metal::is_signed<Tag>::value && metal::is_signed_v<half> && !metal::is_signed_v<uint>, "is_signed");
static_assert(metal::is_same_v<metal::conditional_t<true, half, float>, half>, "conditional");
template <class T, metal::enable_if_t<metal::is_floating_point_v<T>, int> = 0> T twice(T x) { return x * T(2); }
constexpr constant float kBig = metal::numeric_limits<float>::max();      // constexpr members
constexpr constant half kHalfMax = metal::numeric_limits<half>::max();
static_assert(metal::numeric_limits<half>::digits == 11 && metal::numeric_limits<int>::max() == INT_MAX, "limits");

// constant implies const; a struct in constant or device memory copied into a value
constexpr constant float kTable[2] = {1.5f, -2.0f};
inline float first(constant float* t) { return t[0]; }
struct Params { float scale; int n; };
constant Params kParams = {3.0f, 2};

// members and constructors qualified with an address space
struct Acc {
  float s;
  Acc(float v) thread : s(v) {}
  Acc(float v) threadgroup : s(v) {}
  float get() const thread { return s; }
  float get() const device { return s; }
};

// function pointers as template arguments and as parameters
inline float sq(float x) { return x * x; }
template <float (*F)(float)> inline float apply(float x) { return F(x); }
inline float apply2(float (*f)(float), float x) { return f(x); }

// a user overload of a standard name next to the standard ones (MLX adds bfloat max/min)
struct Money { float v; };
inline Money max(Money a, Money b) { return a.v < b.v ? b : a; }

// ... and a user template of a standard name (c10/metal's max<T, U>): the same-type standard overload wins
namespace user { template <class T, class U> T max(T a, U b) { return a > T(b) ? a : T(b); } }
using namespace user;

// metal::fast is a namespace: a user overload added there does not hide the standard functions
namespace metal { namespace fast { inline Money exp(Money m) { return Money{m.v}; } } }

// the out-of-class redeclaration of a static constexpr member
struct W { static constexpr constant float w[2] = {0.25f, 0.75f}; };
constant constexpr const float W::w[2];

#define UNROLL_N 4
kernel void lib(device float* o [[buffer(0)]], const device float* x [[buffer(1)]],
                const device bfloat* b [[buffer(2)]], constant Params& p [[buffer(3)]],
                const device Acc* accs [[buffer(4)]], const device half* h [[buffer(5)]],
                uint i [[thread_position_in_grid]]) {
  if (i != 0) return;
  float4x4 m = float4x4(float4(1, 0, 0, 0), float4(0, 2, 0, 0), float4(0, 0, 3, 0), float4(1, 1, 1, 1));
  float4 mv = m * float4(x[0], x[1], x[2], 1.0f);                  // matrix types: column-major
  half2x2 hm = half2x2(transpose(float2x2(float2(1, 2), float2(3, 4))));
  uniform<float> u = make_uniform(x[0]);
  Params q = p;                                                    // struct from constant memory
  Params k = kParams;
  Acc a(x[1]);
  Acc from_device = accs[0];
  float s = 0.0f;
#pragma unroll(UNROLL_N)
  for (int j = 0; j < UNROLL_N; ++j) s += x[j];
  o[0] = mv.x; o[1] = mv.y; o[2] = mv.z; o[3] = mv.w;
  o[4] = float(hm[0][1]);                                          // transpose: column 0 is (1, 3)
  o[5] = float(u) + twice(1.5f);
  o[6] = kBig == FLT_MAX && float(kHalfMax) == float(MAXHALF) ? 1.0f : 0.0f;
  o[7] = first(kTable) + W::w[1];
  o[8] = q.scale * float(q.n) + k.scale;
  o[9] = a.get() + from_device.get() + accs[0].get();
  o[10] = apply<sq>(3.0f) + apply2(sq, 2.0f);
  o[11] = max(Money{1.0f}, Money{2.5f}).v + max(1.0f, 2.0f) + metal::fast::exp(0.0f) + metal::fast::exp(Money{4.0f}).v;
  o[12] = isunordered(x[0], NAN) && isordered(x[0], x[1]) ? 1.0f : 0.0f;
  o[13] = exp(b[0]) + (isfinite(b[1]) ? 1.0f : 0.0f);              // bfloat scalars: float math
  o[14] = float(static_cast<half>(b[0])) + float(static_cast<bfloat>(h[0]));
  o[15] = (0.5f * float2(x[0], x[1])).y + (h[0] * half2(2.0h, 4.0h) * 0.5f).x;  // a float scalar with a half vector
  o[16] = s;
  o[17] = float(max(long(x[1]), 5L));                             // the standard (long, long), not user::max
}
"""


def test_standard_library_model_and_cpp_forms_run_with_msl_values():
    lib = emu.compile_library(LIBRARY)
    x = torch.tensor([0.5, 2.0, 3.0, 4.0])
    b = torch.tensor([1.0, float("inf")], dtype=torch.bfloat16)
    h = torch.tensor([1.5], dtype=torch.float16)
    accs = torch.tensor([7.0])
    o = torch.full((18,), -1.0)
    params = torch.cat([torch.tensor([2.0]), torch.tensor([4], dtype=torch.int32).view(torch.float32)])  # {2.0f, 4}
    lib.lib(o, x, b, params, accs, h, threads=1)
    want = [0.5 + 1, 4.0 + 1, 9.0 + 1, 1.0, 3.0, 0.5 + 3.0, 1.0, 1.5 + 0.75, 2.0 * 4 + 3.0, 2.0 + 7.0 + 7.0,
            9.0 + 4.0, 2.5 + 2.0 + 1.0 + 4.0, 1.0, float(torch.exp(torch.tensor(1.0))) + 0.0, 1.0 + 1.5,
            1.0 + 1.5, 0.5 + 2.0 + 3.0 + 4.0, 5.0]
    torch.testing.assert_close(o, torch.tensor(want), atol=1e-3, rtol=1e-3)
    assert [p for p in lint_source(LIBRARY) if p.startswith("msl_source.metal:")] == []


def test_c10_metal_headers_are_found_as_compile_shader_embeds_them():
    """torch.mps.compile_shader embeds the headers a source includes from torch's include folder; so does the
    emulator (c10/metal's templates next to the standard library's)."""
    from comfy_metal.metal_kernels.emulator.toolchain import torch_include_dir

    if torch_include_dir() is None:
        pytest.skip("this torch has no include/c10/metal")
    lib = emu.compile_library("""#include <c10/metal/utils.h>
#include <metal_stdlib>
using namespace metal;
kernel void c10max(device float* o [[buffer(0)]], const device float* x [[buffer(1)]],
                   uint i [[thread_position_in_grid]]) {
  o[i] = c10::metal::max(x[i], 0.5f) + float(c10::metal::ceil_div(long(i) + 1, 2L));
}""")
    x = torch.tensor([0.0, 1.0, float("nan"), -3.0])
    o = torch.zeros(4)
    lib.c10max(o, x)
    assert o[[0, 1, 3]].tolist() == [1.5, 2.0, 2.5] and torch.isnan(o[2])   # c10's max propagates NaN


def test_user_simd_overload_intrinsics_and_shuffle_and_fill():
    """A user overload of a collective's name (MLX's bfloat simd_sum over Apple's __metal_simd_sum) next to the
    standard one, and simd_shuffle_and_fill_down/up (with and without modulo) against a torch reference."""
    lib = emu.compile_library(HDR + """
namespace metal {
inline bfloat simd_sum(bfloat x) { return static_cast<bfloat>(__metal_simd_sum(static_cast<float>(x))); }
}
kernel void coll(device float* o [[buffer(0)]], const device bfloat* b [[buffer(1)]],
                 ushort l [[thread_index_in_simdgroup]]) {
  o[l] = float(simd_sum(b[l]));                                  // the user's bfloat overload
  o[32 + l] = simd_sum(float(l));                                // the standard one
  o[64 + l] = simd_shuffle_and_fill_down(float(l), float(100 + l), ushort(3));
  o[96 + l] = simd_shuffle_and_fill_up(float(l), float(100 + l), ushort(2), ushort(8));
}""")
    b = torch.arange(32, dtype=torch.bfloat16)
    o = torch.zeros(128)
    lib.coll(o, b, threads=32, group_size=32)
    lanes = torch.arange(32)
    down = torch.where(lanes + 3 < 32, lanes + 3, 100 + lanes + 3 - 32).float()
    r = lanes % 8
    up = torch.where(r >= 2, lanes - 2, 100 + (lanes - r) + 8 + r - 2).float()
    assert torch.equal(o[:32], torch.full((32,), float(b.float().sum())))
    assert torch.equal(o[32:64], torch.full((32,), float(lanes.sum())))
    assert torch.equal(o[64:96], down) and torch.equal(o[96:], up)


def test_pointer_advanced_by_a_class_that_converts_to_int():
    """`p += c` / `p -= c` with a class operand that has a constexpr conversion to int (MLX's integral_constant
    strides, steel/attn/mma.h), on device and threadgroup pointers and in a template."""
    lib = emu.compile_library(HDR + """
template <typename T, T v> struct cst {
  static constexpr constant T value = v;
  constexpr operator T() const thread noexcept { return value; }
};
template <typename P, typename S> float walk(P p, S s) { p += s; p += s; p -= cst<int, 1>{}; return float(p[0]); }
kernel void advance(device float* o [[buffer(0)]], const device half* a [[buffer(1)]],
                    uint i [[thread_position_in_grid]]) {
  threadgroup float t[8];
  t[i] = float(10 * i);
  t[i + 4] = float(10 * (i + 4));
  threadgroup_barrier(mem_flags::mem_threadgroup);
  threadgroup float* tp = t + i;
  tp += cst<int, 3>{};
  const device half* p = a + i;
  p += cst<int, 2>{};
  o[3 * i] = float(p[0]);
  o[3 * i + 1] = walk(a + i, cst<short, 2>{});
  o[3 * i + 2] = tp[0];
}""")
    a = torch.arange(12, dtype=torch.float16)
    o = torch.zeros(12)
    lib.advance(o, a, threads=4, group_size=4)
    i = torch.arange(4)
    assert torch.equal(o.view(4, 3), torch.stack([i + 2.0, i + 3.0, 10.0 * (i + 3)], 1))


def test_overloaded_kernel_templates_instantiated_by_their_arguments():
    """Two kernel templates of one name (MLX's block_masked_gemm): each explicit instantiation binds the overload
    its template arguments fit, one of them through a default argument."""
    lib = emu.compile_library(HDR + """
template <typename T, typename M, int N, bool Neg>
[[kernel]] void scaled(device T* o [[buffer(0)]], const device M* m [[buffer(1)]], uint i [[thread_position_in_grid]]) {
  o[i] = T(Neg ? -N : N) * T(m[i]);
}
template <typename T, int N, bool Neg = false>
[[kernel]] void scaled(device T* o [[buffer(0)]], uint i [[thread_position_in_grid]]) {
  o[i] = T(Neg ? -N : N) * T(i);
}
#define inst(name, ...) template [[host_name(name)]] [[kernel]] decltype(scaled<__VA_ARGS__>) scaled<__VA_ARGS__>;
inst("masked_f", float, bool, 3, true)
inst("plain_f", float, 2)
inst("plain_neg_i", int, 5, true)
""")
    m = torch.tensor([True, False, True, True])
    o = torch.zeros(4)
    lib.masked_f(o, m)
    assert o.tolist() == [-3.0, 0.0, -3.0, -3.0]
    lib.plain_f(o)
    assert o.tolist() == [0.0, 2.0, 4.0, 6.0]
    oi = torch.zeros(4, dtype=torch.int32)
    lib.plain_neg_i(oi)
    assert oi.tolist() == [0, -5, -10, -15]
