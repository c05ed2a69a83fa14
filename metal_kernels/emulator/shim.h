// Comfy Metal MSL emulator -- shim: makes (a practical subset of) the Metal
// Shading Language compile as C++20 with clang-19.  Force-included (-include)
// in front of the preprocessed .metal source.
#pragma once
#include "runtime.h"
#include <type_traits>
#include <limits>

// ------------------------------------------------------------------ scalar types
typedef _Float16 half;
typedef __bf16 bfloat;
typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
// MSL `long` is 64-bit, as is LP64 `long`: nothing to do.

namespace __emu {
template <class T>
struct vinfo {
  static constexpr int n = 1;
  using elem = T;
};
template <class T>
using elem_t = typename vinfo<std::remove_cv_t<T>>::elem;
template <class T>
inline constexpr int vlen = vinfo<std::remove_cv_t<T>>::n;
template <class T>
inline constexpr bool is_fp_elem = std::is_same_v<T, float> || std::is_same_v<T, half> || std::is_same_v<T, bfloat> ||
                                   std::is_same_v<T, double>;
template <class T>
inline constexpr bool is_fp = is_fp_elem<elem_t<T>>;
template <class T>
inline constexpr bool is_num = std::is_arithmetic_v<elem_t<T>> || is_fp_elem<elem_t<T>>;
}  // namespace __emu

#define __EMU_VEC(E, NAME)                                     \
  typedef E NAME##2 __attribute__((ext_vector_type(2)));       \
  typedef E NAME##3 __attribute__((ext_vector_type(3)));       \
  typedef E NAME##4 __attribute__((ext_vector_type(4)));       \
  namespace __emu {                                            \
  template <>                                                  \
  struct vinfo<NAME##2> {                                      \
    static constexpr int n = 2;                                \
    using elem = E;                                            \
  };                                                           \
  template <>                                                  \
  struct vinfo<NAME##3> {                                      \
    static constexpr int n = 3;                                \
    using elem = E;                                            \
  };                                                           \
  template <>                                                  \
  struct vinfo<NAME##4> {                                      \
    static constexpr int n = 4;                                \
    using elem = E;                                            \
  };                                                           \
  }

__EMU_VEC(float, float)
__EMU_VEC(half, half)
__EMU_VEC(bfloat, bfloat)
__EMU_VEC(int, int)
__EMU_VEC(uint, uint)
__EMU_VEC(short, short)
__EMU_VEC(ushort, ushort)
__EMU_VEC(char, char)
__EMU_VEC(uchar, uchar)
__EMU_VEC(long, long)
__EMU_VEC(ulong, ulong)
__EMU_VEC(bool, bool)

namespace __emu {
// Build a vector the way MSL constructors do: float4(x) splats, float4(h4)
// converts element-wise, float4(a.xy, b, c) concatenates.  The generator
// rewrites `floatN(` etc. into `__emu::vec<floatN>(`.
template <class E, class A>
inline void vput(E* out, int& k, const A& a) {
  if constexpr (vlen<A> == 1) {
    out[k++] = (E)a;
  } else {
    for (int i = 0; i < vlen<A>; i++) out[k++] = (E)a[i];
  }
}
template <class V, class... A>
inline V vec(const A&... a) {
  using E = elem_t<V>;
  constexpr int N = vlen<V>;
  if constexpr (N == 1) {
    return (V)(a, ...);
  } else if constexpr (sizeof...(A) == 0) {
    return V{};
  } else {
    constexpr int total = (vlen<A> + ...);
    if constexpr (sizeof...(A) == 1 && total == 1) {
      V r;
      E e[1];
      int k = 0;
      (vput(e, k, a), ...);
      for (int i = 0; i < N; i++) r[i] = e[0];
      return r;
    } else {
      static_assert(total == N, "wrong number of components in vector constructor");
      E e[N];
      int k = 0;
      (vput(e, k, a), ...);
      V r;
      for (int i = 0; i < N; i++) r[i] = e[i];
      return r;
    }
  }
}
// C-style vector cast `(float4)x`, rewritten to `__emu::vcast<float4>()->*x`
template <class V>
struct vcast {};
template <class V, class U>
inline V operator->*(vcast<V>, const U& u) {
  return vec<V>(u);
}
// thread-position attribute value of the declared type
template <class T>
inline T pos(uint32_t x, uint32_t y, uint32_t z) {
  using P = std::remove_cv_t<std::remove_reference_t<T>>;
  using E = elem_t<P>;
  if constexpr (vlen<P> == 1) return (P)x;
  else if constexpr (vlen<P> == 2) return P{(E)x, (E)y};
  else if constexpr (vlen<P> == 3) return P{(E)x, (E)y, (E)z};
  else return P{(E)x, (E)y, (E)z, (E)0};
}
template <class T, class F>
inline T map1(T x, F f) {
  if constexpr (vlen<T> == 1) {
    return (T)f(x);
  } else {
    T r;
    for (int i = 0; i < vlen<T>; i++) r[i] = (elem_t<T>)f(x[i]);
    return r;
  }
}
template <class T, class F>
inline T map2(T x, T y, F f) {
  if constexpr (vlen<T> == 1) {
    return (T)f(x, y);
  } else {
    T r;
    for (int i = 0; i < vlen<T>; i++) r[i] = (elem_t<T>)f(x[i], y[i]);
    return r;
  }
}
template <class T, class F>
inline T map3(T x, T y, T z, F f) {
  if constexpr (vlen<T> == 1) {
    return (T)f(x, y, z);
  } else {
    T r;
    for (int i = 0; i < vlen<T>; i++) r[i] = (elem_t<T>)f(x[i], y[i], z[i]);
    return r;
  }
}
// convert a scalar or same-length vector to T
template <class T, class U>
inline T conv(const U& u) {
  if constexpr (std::is_same_v<T, U>) return u;
  else if constexpr (vlen<U> == 1) return vec<T>(u);
  else return vec<T>(u);
}
template <class A, class B>
struct common {
  using type = std::conditional_t<(vlen<A> > 1), A, std::conditional_t<(vlen<B> > 1), B, std::common_type_t<A, B>>>;
};
template <class A, class B>
using common_t = typename common<std::remove_cv_t<A>, std::remove_cv_t<B>>::type;

template <class T>
inline bool any_nan_bits(T) { return false; }
}  // namespace __emu

// packed vector types (no padding): element members .x .y .z .w, [] indexing,
// conversion to/from the aligned vector type
namespace __emu {
template <class E, int N>
struct packed_base;
template <class E>
struct packed_base<E, 2> {
  E x, y;
};
template <class E>
struct packed_base<E, 3> {
  E x, y, z;
};
template <class E>
struct packed_base<E, 4> {
  E x, y, z, w;
};
template <class E, int N>
struct packed : packed_base<E, N> {
  using vec_t = E __attribute__((ext_vector_type(N)));
  packed() = default;
  template <class... A>
  packed(const A&... a) {
    vec_t t = vec<vec_t>(a...);
    for (int i = 0; i < N; i++) (*this)[i] = t[i];
  }
  operator vec_t() const {
    vec_t t;
    for (int i = 0; i < N; i++) t[i] = (*this)[i];
    return t;
  }
  E& operator[](int i) { return (&this->x)[i]; }
  const E& operator[](int i) const { return (&this->x)[i]; }
};
template <class E, int N>
struct vinfo<packed<E, N>> {
  static constexpr int n = N;
  using elem = E;
};
}  // namespace __emu
#define __EMU_PACKED(E, NAME)                        \
  typedef __emu::packed<E, 2> packed_##NAME##2;      \
  typedef __emu::packed<E, 3> packed_##NAME##3;      \
  typedef __emu::packed<E, 4> packed_##NAME##4;
__EMU_PACKED(float, float)
__EMU_PACKED(half, half)
__EMU_PACKED(bfloat, bfloat)
__EMU_PACKED(int, int)
__EMU_PACKED(uint, uint)
__EMU_PACKED(short, short)
__EMU_PACKED(ushort, ushort)
__EMU_PACKED(char, char)
__EMU_PACKED(uchar, uchar)

// ------------------------------------------------------------------ constants
#define MAXFLOAT 3.402823466e+38F
#define HUGE_VALF __builtin_huge_valf()
#define HUGE_VALH ((half)__builtin_huge_valf())
#define INFINITY __builtin_inff()
#define NAN __builtin_nanf("")
#define FLT_MAX 3.402823466e+38F
#define FLT_MIN 1.175494351e-38F
#define FLT_EPSILON 1.192092896e-07F
#define HALF_MAX ((half)65504.0f)
#define HALF_MIN ((half)6.103515625e-05f)
#define HALF_EPSILON ((half)9.765625e-4f)
#define INT_MAX 2147483647
#define INT_MIN (-2147483647 - 1)
#define UINT_MAX 4294967295u
#define M_E_F 2.71828182845904523536028747135266250f
#define M_LOG2E_F 1.44269504088896340735992468100189214f
#define M_LOG10E_F 0.434294481903251827651128918916605082f
#define M_LN2_F 0.693147180559945309417232121458176568f
#define M_LN10_F 2.30258509299404568401799145468436421f
#define M_PI_F 3.14159265358979323846264338327950288f
#define M_PI_2_F 1.57079632679489661923132169163975144f
#define M_PI_4_F 0.785398163397448309615660845819875721f
#define M_1_PI_F 0.318309886183790671537767526745028724f
#define M_2_PI_F 0.636619772367581343075535053490057448f
#define M_2_SQRTPI_F 1.12837916709551257389615890312154517f
#define M_SQRT2_F 1.41421356237309504880168872420969808f
#define M_SQRT1_2_F 0.707106781186547524400844362104849039f
#define M_PI_H ((half)M_PI_F)
#define M_E_H ((half)M_E_F)
#define M_LN2_H ((half)M_LN2_F)
#define M_SQRT2_H ((half)M_SQRT2_F)

// ------------------------------------------------------------------ metal namespace
namespace metal {

enum class mem_flags : uint32_t {
  mem_none = 0,
  mem_device = 1,
  mem_threadgroup = 2,
  mem_texture = 4,
  mem_threadgroup_imageblock = 8,
  mem_object_data = 16
};
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return (mem_flags)((uint32_t)a | (uint32_t)b); }
constexpr mem_flags operator&(mem_flags a, mem_flags b) { return (mem_flags)((uint32_t)a & (uint32_t)b); }

template <class T>
struct numeric_limits : std::numeric_limits<T> {};
template <>
struct numeric_limits<half> {
  static constexpr bool is_specialized = true;
  static half max() { return (half)65504.0f; }
  static half min() { return (half)6.103515625e-05f; }
  static half lowest() { return (half)-65504.0f; }
  static half epsilon() { return (half)9.765625e-4f; }
  static half infinity() { return (half)__builtin_inff(); }
  static half quiet_NaN() { return (half)__builtin_nanf(""); }
  static half denorm_min() { return __builtin_bit_cast(half, (unsigned short)1); }
};
template <>
struct numeric_limits<bfloat> {
  static constexpr bool is_specialized = true;
  static bfloat max() { return __builtin_bit_cast(bfloat, (unsigned short)0x7F7F); }
  static bfloat min() { return __builtin_bit_cast(bfloat, (unsigned short)0x0080); }
  static bfloat lowest() { return __builtin_bit_cast(bfloat, (unsigned short)0xFF7F); }
  static bfloat epsilon() { return __builtin_bit_cast(bfloat, (unsigned short)0x3C00); }
  static bfloat infinity() { return __builtin_bit_cast(bfloat, (unsigned short)0x7F80); }
  static bfloat quiet_NaN() { return __builtin_bit_cast(bfloat, (unsigned short)0x7FC0); }
  static bfloat denorm_min() { return __builtin_bit_cast(bfloat, (unsigned short)1); }
};

template <class T, class U>
inline T as_type(const U& u) {
  static_assert(sizeof(T) == sizeof(U), "as_type: sizes differ");
  return __builtin_bit_cast(T, u);
}

// ---- float math, element-wise on vectors; computed in float precision
#define __EMU_F1(NAME, EXPR)                                                       \
  template <class T, std::enable_if_t<__emu::is_fp<T>, int> = 0>                   \
  inline T NAME(T x) {                                                             \
    return __emu::map1(x, [](auto e) { float v = (float)e; return (float)(EXPR); }); \
  }
__EMU_F1(fabs, __builtin_fabsf(v))
__EMU_F1(floor, __builtin_floorf(v))
__EMU_F1(ceil, __builtin_ceilf(v))
__EMU_F1(round, __builtin_roundf(v))
__EMU_F1(rint, __builtin_rintf(v))
__EMU_F1(trunc, __builtin_truncf(v))
__EMU_F1(sqrt, __builtin_sqrtf(v))
__EMU_F1(rsqrt, 1.0f / __builtin_sqrtf(v))
__EMU_F1(exp, __builtin_expf(v))
__EMU_F1(exp2, __builtin_exp2f(v))
__EMU_F1(exp10, __builtin_powf(10.0f, v))
__EMU_F1(log, __builtin_logf(v))
__EMU_F1(log2, __builtin_log2f(v))
__EMU_F1(log10, __builtin_log10f(v))
__EMU_F1(sin, __builtin_sinf(v))
__EMU_F1(cos, __builtin_cosf(v))
__EMU_F1(tan, __builtin_tanf(v))
__EMU_F1(asin, __builtin_asinf(v))
__EMU_F1(acos, __builtin_acosf(v))
__EMU_F1(atan, __builtin_atanf(v))
__EMU_F1(sinh, __builtin_sinhf(v))
__EMU_F1(cosh, __builtin_coshf(v))
__EMU_F1(tanh, __builtin_tanhf(v))
__EMU_F1(asinh, __builtin_asinhf(v))
__EMU_F1(acosh, __builtin_acoshf(v))
__EMU_F1(atanh, __builtin_atanhf(v))
__EMU_F1(sinpi, __builtin_sinf(v * M_PI_F))
__EMU_F1(cospi, __builtin_cosf(v * M_PI_F))
__EMU_F1(fract, __builtin_fminf(v - __builtin_floorf(v), 0x1.fffffep-1f))
__EMU_F1(saturate, __builtin_fminf(__builtin_fmaxf(v, 0.0f), 1.0f))
__EMU_F1(sign, v > 0.0f ? 1.0f : (v < 0.0f ? -1.0f : (v != v ? 0.0f : v)))
#undef __EMU_F1

#define __EMU_F2(NAME, EXPR)                                                                        \
  template <class A, class B, std::enable_if_t<__emu::is_fp<A> || __emu::is_fp<B>, int> = 0>        \
  inline __emu::common_t<A, B> NAME(A a_, B b_) {                                                   \
    using T = __emu::common_t<A, B>;                                                                \
    return __emu::map2(__emu::conv<T>(a_), __emu::conv<T>(b_), [](auto ea, auto eb) {               \
      float x = (float)ea, y = (float)eb;                                                           \
      return (float)(EXPR);                                                                         \
    });                                                                                             \
  }
__EMU_F2(pow, __builtin_powf(x, y))
__EMU_F2(powr, __builtin_powf(x, y))
__EMU_F2(fmin, __builtin_fminf(x, y))
__EMU_F2(fmax, __builtin_fmaxf(x, y))
__EMU_F2(fmod, __builtin_fmodf(x, y))
__EMU_F2(atan2, __builtin_atan2f(x, y))
__EMU_F2(copysign, __builtin_copysignf(x, y))
__EMU_F2(step, y < x ? 0.0f : 1.0f)
__EMU_F2(fdim, x > y ? x - y : 0.0f)
__EMU_F2(hypot, __builtin_hypotf(x, y))
__EMU_F2(divide, x / y)
#undef __EMU_F2

template <class A, class B, class C, std::enable_if_t<__emu::is_fp<A>, int> = 0>
inline A fma(A a, B b, C c) {
  return __emu::map3(a, __emu::conv<A>(b), __emu::conv<A>(c),
                     [](auto x, auto y, auto z) { return __builtin_fmaf((float)x, (float)y, (float)z); });
}
template <class A, class B, class C, std::enable_if_t<__emu::is_fp<A>, int> = 0>
inline A mix(A x, B y, C a) {
  return __emu::map3(x, __emu::conv<A>(y), __emu::conv<A>(a),
                     [](auto x_, auto y_, auto a_) { return (float)x_ + ((float)y_ - (float)x_) * (float)a_; });
}
template <class A, class B, class C, std::enable_if_t<__emu::is_fp<C>, int> = 0>
inline C smoothstep(A e0, B e1, C x) {
  return __emu::map3(__emu::conv<C>(e0), __emu::conv<C>(e1), x, [](auto a, auto b, auto v) {
    float t = ((float)v - (float)a) / ((float)b - (float)a);
    t = __builtin_fminf(__builtin_fmaxf(t, 0.0f), 1.0f);
    return t * t * (3.0f - 2.0f * t);
  });
}
template <class T, class I, std::enable_if_t<__emu::is_fp<T>, int> = 0>
inline T ldexp(T x, I k) {
  if constexpr (__emu::vlen<T> == 1) {
    return (T)__builtin_ldexpf((float)x, (int)k);
  } else {
    T r;
    for (int i = 0; i < __emu::vlen<T>; i++) {
      if constexpr (__emu::vlen<I> == 1) r[i] = (__emu::elem_t<T>)__builtin_ldexpf((float)x[i], (int)k);
      else r[i] = (__emu::elem_t<T>)__builtin_ldexpf((float)x[i], (int)k[i]);
    }
    return r;
  }
}
template <class T, std::enable_if_t<__emu::is_fp<T> && __emu::vlen<T> == 1, int> = 0>
inline T frexp(T x, int& e) {
  return (T)__builtin_frexpf((float)x, &e);
}
template <class T, std::enable_if_t<__emu::is_fp<T> && __emu::vlen<T> == 1, int> = 0>
inline T modf(T x, T& ip) {
  float i;
  float f = __builtin_modff((float)x, &i);
  ip = (T)i;
  return (T)f;
}
template <class T, std::enable_if_t<__emu::is_fp<T>, int> = 0>
inline T sincos(T x, T& c) {
  c = cos(x);
  return sin(x);
}

// ---- predicates
#define __EMU_P1(NAME, EXPR)                                                     \
  template <class T, std::enable_if_t<__emu::is_fp<T> && __emu::vlen<T> == 1, int> = 0> \
  inline bool NAME(T x) {                                                        \
    float v = (float)x;                                                          \
    return (EXPR);                                                               \
  }
__EMU_P1(isnan, __builtin_isnan(v))
__EMU_P1(isinf, __builtin_isinf(v))
__EMU_P1(isfinite, __builtin_isfinite(v))
__EMU_P1(isnormal, __builtin_isnormal(v))
__EMU_P1(signbit, __builtin_signbit(v))
#undef __EMU_P1
#define __EMU_PV(NAME)                                                                       \
  template <class T, std::enable_if_t<__emu::is_fp<T> && (__emu::vlen<T> > 1), int> = 0>      \
  inline auto NAME(T x) {                                                                    \
    typedef bool __emu_bv __attribute__((ext_vector_type(__emu::vlen<T>)));                  \
    __emu_bv r;                                                                              \
    for (int i = 0; i < __emu::vlen<T>; i++) r[i] = NAME(x[i]);                              \
    return r;                                                                                \
  }
__EMU_PV(isnan)
__EMU_PV(isinf)
__EMU_PV(isfinite)
__EMU_PV(signbit)
#undef __EMU_PV

// ---- integer & generic
template <class T, std::enable_if_t<__emu::is_num<T>, int> = 0>
inline T abs(T x) {
  return __emu::map1(x, [](auto e) {
    using E = decltype(e);
    if constexpr (__emu::is_fp_elem<E>) return (E)__builtin_fabsf((float)e);
    else if constexpr (std::is_signed_v<E>) return (E)(e < 0 ? -e : e);
    else return e;
  });
}
template <class A, class B, std::enable_if_t<__emu::is_num<A> && __emu::is_num<B>, int> = 0>
inline __emu::common_t<A, B> min(A a_, B b_) {
  using T = __emu::common_t<A, B>;
  return __emu::map2(__emu::conv<T>(a_), __emu::conv<T>(b_), [](auto x, auto y) {
    using E = decltype(x);
    if constexpr (__emu::is_fp_elem<E>) return (E)__builtin_fminf((float)x, (float)y);
    else return y < x ? y : x;
  });
}
template <class A, class B, std::enable_if_t<__emu::is_num<A> && __emu::is_num<B>, int> = 0>
inline __emu::common_t<A, B> max(A a_, B b_) {
  using T = __emu::common_t<A, B>;
  return __emu::map2(__emu::conv<T>(a_), __emu::conv<T>(b_), [](auto x, auto y) {
    using E = decltype(x);
    if constexpr (__emu::is_fp_elem<E>) return (E)__builtin_fmaxf((float)x, (float)y);
    else return x < y ? y : x;
  });
}
template <class T, class L, class H, std::enable_if_t<__emu::is_num<T>, int> = 0>
inline T clamp(T x, L lo, H hi) {
  return min(max(x, __emu::conv<T>(lo)), __emu::conv<T>(hi));
}
template <class A, class B, class C>
inline A select(A a, B b, C c) {
  if constexpr (__emu::vlen<A> == 1) {
    return c ? (A)b : a;
  } else {
    A bb = __emu::conv<A>(b);
    A r;
    for (int i = 0; i < __emu::vlen<A>; i++) {
      bool ci;
      if constexpr (__emu::vlen<C> == 1) ci = (bool)c;
      else ci = (bool)c[i];
      r[i] = ci ? bb[i] : a[i];
    }
    return r;
  }
}
template <class T, std::enable_if_t<std::is_integral_v<__emu::elem_t<T>>, int> = 0>
inline T popcount(T x) {
  return __emu::map1(x, [](auto e) { return (decltype(e))__builtin_popcountll((unsigned long long)(std::make_unsigned_t<decltype(e)>)e); });
}
template <class T, std::enable_if_t<std::is_integral_v<__emu::elem_t<T>>, int> = 0>
inline T clz(T x) {
  return __emu::map1(x, [](auto e) {
    using E = decltype(e);
    using U = std::make_unsigned_t<E>;
    U u = (U)e;
    int bits = 8 * sizeof(E);
    if (!u) return (E)bits;
    return (E)(__builtin_clzll((unsigned long long)u) - (64 - bits));
  });
}
template <class T, std::enable_if_t<std::is_integral_v<__emu::elem_t<T>>, int> = 0>
inline T ctz(T x) {
  return __emu::map1(x, [](auto e) {
    using E = decltype(e);
    if (!e) return (E)(8 * sizeof(E));
    return (E)__builtin_ctzll((unsigned long long)(std::make_unsigned_t<E>)e);
  });
}
template <class T, std::enable_if_t<std::is_integral_v<__emu::elem_t<T>>, int> = 0>
inline T mulhi(T a, T b) {
  return __emu::map2(a, b, [](auto x, auto y) {
    using E = decltype(x);
    return (E)(((__int128)x * (__int128)y) >> (8 * sizeof(E)));
  });
}

// ---- geometric
template <class T>
inline __emu::elem_t<T> dot(T a, T b) {
  float s = 0;
  for (int i = 0; i < __emu::vlen<T>; i++) s += (float)a[i] * (float)b[i];
  return (__emu::elem_t<T>)s;
}
template <class T>
inline __emu::elem_t<T> length(T a) {
  return (__emu::elem_t<T>)__builtin_sqrtf((float)dot(a, a));
}
template <class T>
inline __emu::elem_t<T> length_squared(T a) {
  return dot(a, a);
}
template <class T>
inline __emu::elem_t<T> distance(T a, T b) {
  return length(a - b);
}
template <class T>
inline T normalize(T a) {
  return a * (T)(__emu::elem_t<T>)(1.0f / __builtin_sqrtf((float)dot(a, a)));
}
template <class T>
inline T cross(T a, T b) {
  return T{a.y * b.z - a.z * b.y, a.z * b.x - a.x * b.z, a.x * b.y - a.y * b.x};
}
template <class T>
inline bool all(T v) {
  if constexpr (__emu::vlen<T> == 1) return (bool)v;
  else {
    for (int i = 0; i < __emu::vlen<T>; i++)
      if (!v[i]) return false;
    return true;
  }
}
template <class T>
inline bool any(T v) {
  if constexpr (__emu::vlen<T> == 1) return (bool)v;
  else {
    for (int i = 0; i < __emu::vlen<T>; i++)
      if (v[i]) return true;
    return false;
  }
}

namespace fast {
using namespace ::metal;
}
namespace precise {
using namespace ::metal;
}

// ---- atomics (the emulator runs one OS thread: plain operations are atomic)
enum memory_order { memory_order_relaxed, memory_order_acquire, memory_order_release, memory_order_acq_rel, memory_order_seq_cst };
template <class T>
struct atomic {
  T __v;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
typedef atomic<bool> atomic_bool;
typedef atomic<ulong> atomic_ulong;
typedef atomic<long> atomic_long;

#define __EMU_AT(T) auto* p_ = const_cast<atomic<T>*>(o)
// atomics are excluded from the race detector (no instrumentation inside them)
#define __EMU_NORACE __attribute__((no_sanitize("thread")))
template <class T, class U>
__EMU_NORACE inline T atomic_load_explicit(const volatile atomic<T>* o, U) {
  return const_cast<atomic<T>*>(o)->__v;
}
template <class T, class V, class U>
__EMU_NORACE inline void atomic_store_explicit(volatile atomic<T>* o, V v, U) {
  __EMU_AT(T);
  p_->__v = (T)v;
}
template <class T, class V, class U>
__EMU_NORACE inline T atomic_exchange_explicit(volatile atomic<T>* o, V v, U) {
  __EMU_AT(T);
  T old = p_->__v;
  p_->__v = (T)v;
  return old;
}
#define __EMU_ATOP(NAME, EXPR)                                 \
  template <class T, class V, class U>                         \
  __EMU_NORACE inline T NAME(volatile atomic<T>* o, V v_, U) { \
    __EMU_AT(T);                                               \
    T old = p_->__v;                                           \
    T v = (T)v_;                                               \
    p_->__v = (EXPR);                                          \
    return old;                                                \
  }
__EMU_ATOP(atomic_fetch_add_explicit, (T)(old + v))
__EMU_ATOP(atomic_fetch_sub_explicit, (T)(old - v))
__EMU_ATOP(atomic_fetch_and_explicit, (T)(old & v))
__EMU_ATOP(atomic_fetch_or_explicit, (T)(old | v))
__EMU_ATOP(atomic_fetch_xor_explicit, (T)(old ^ v))
__EMU_ATOP(atomic_fetch_min_explicit, (T)(v < old ? v : old))
__EMU_ATOP(atomic_fetch_max_explicit, (T)(old < v ? v : old))
#undef __EMU_ATOP
template <class T, class V, class U1, class U2>
__EMU_NORACE inline bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* o, T* expected, V desired, U1, U2) {
  __EMU_AT(T);
  if (p_->__v == *expected) {
    p_->__v = (T)desired;
    return true;
  }
  *expected = p_->__v;
  return false;
}
template <class T, class V, class U1, class U2>
inline bool atomic_compare_exchange_strong_explicit(volatile atomic<T>* o, T* expected, V desired, U1 a, U2 b) {
  return atomic_compare_exchange_weak_explicit(o, expected, desired, a, b);
}
#undef __EMU_AT

// ---- synchronisation
__attribute__((noinline)) inline void threadgroup_barrier(mem_flags) {
  __emu::barrier((uintptr_t)__builtin_return_address(0));
}

}  // namespace metal

// ------------------------------------------------------------------ SIMD collectives
namespace __emu {
enum : int {
  OP_SUM, OP_PROD, OP_MIN, OP_MAX, OP_AND, OP_OR, OP_XOR,
  OP_SHUFFLE, OP_SHUFFLE_XOR, OP_SHUFFLE_DOWN, OP_SHUFFLE_UP, OP_ROT_DOWN, OP_ROT_UP, OP_FIRST,
  OP_PREFIX_EXCL_SUM, OP_PREFIX_INCL_SUM, OP_PREFIX_EXCL_PROD, OP_PREFIX_INCL_PROD,
  OP_ALL, OP_ANY, OP_BALLOT, OP_IS_FIRST, OP_BARRIER
};
template <class T>
inline T ld(const unsigned char* p) {
  T v;
  memcpy(&v, p, sizeof(T));
  return v;
}
template <class T>
inline void st(unsigned char* p, const T& v) {
  memcpy(p, &v, sizeof(T));
}
template <class T, int OP>
inline T combine(T a, T b) {
  if constexpr (OP == OP_SUM || OP == OP_PREFIX_EXCL_SUM || OP == OP_PREFIX_INCL_SUM) return a + b;
  else if constexpr (OP == OP_PROD || OP == OP_PREFIX_EXCL_PROD || OP == OP_PREFIX_INCL_PROD) return a * b;
  else if constexpr (OP == OP_MIN) return metal::min(a, b);
  else if constexpr (OP == OP_MAX) return metal::max(a, b);
  else if constexpr (OP == OP_AND) return a & b;
  else if constexpr (OP == OP_OR) return a | b;
  else if constexpr (OP == OP_XOR) return a ^ b;
  else return a;
}
// Resolve one collective for the lanes in `mask` (all waiting at the same call
// site).  G is the segment width: 32 for simd_*, 4 for quad_*.
template <class T, int OP, uint32_t G = kSimdWidth>
void resolve(SimdGroup& g, uint32_t mask, uint32_t width) {
  __EMU_PROF(prof_collective(OP == OP_BARRIER ? 2 : (OP <= OP_XOR || (OP >= OP_PREFIX_EXCL_SUM && OP <= OP_PREFIX_INCL_PROD)),
                             G, mask);)
  for (uint32_t b = 0; b < width; b += G) {
    const uint32_t e = b + G < width ? b + G : width;
    const uint32_t w = e - b;
    const uint32_t segbits = (uint32_t)(((1ull << w) - 1) << b);
    const uint32_t smask = mask & segbits;
    if (!smask) continue;
    const uint32_t first_lane = (uint32_t)__builtin_ctz(smask);
    if constexpr (OP <= OP_XOR) {
      T acc{};
      bool first = true;
      for (uint32_t l = b; l < e; l++) {
        if (!(smask >> l & 1)) continue;
        T v = ld<T>(g.in[l]);
        acc = first ? v : combine<T, OP>(acc, v);
        first = false;
      }
      for (uint32_t l = b; l < e; l++)
        if (smask >> l & 1) st(g.out[l], acc);
    } else if constexpr (OP >= OP_SHUFFLE && OP <= OP_FIRST) {
      for (uint32_t l = b; l < e; l++) {
        if (!(smask >> l & 1)) continue;
        const uint32_t a = g.arg[l];
        const uint32_t r = l - b;  // lane within the segment
        int64_t src;
        bool keep = false;
        if constexpr (OP == OP_SHUFFLE) src = a < G ? (int64_t)(b + a) : -1;
        else if constexpr (OP == OP_SHUFFLE_XOR) src = a < G ? (int64_t)(l ^ a) : -1;
        else if constexpr (OP == OP_SHUFFLE_DOWN) { src = (int64_t)l + a; keep = (uint64_t)r + a >= G; }
        else if constexpr (OP == OP_SHUFFLE_UP) { src = (int64_t)l - a; keep = r < a; }
        else if constexpr (OP == OP_ROT_DOWN) src = b + (r + a % w) % w;
        else if constexpr (OP == OP_ROT_UP) src = b + (r + w - a % w) % w;
        else src = first_lane;
        if (keep) {
          memcpy(g.out[l], g.in[l], sizeof(T));
        } else if (src < (int64_t)b || src >= (int64_t)e || !(smask >> src & 1)) {
          memset(g.out[l], 0xFF, sizeof(T));  // inactive / nonexistent lane: undefined -> NaN bytes
        } else {
          memcpy(g.out[l], g.in[src], sizeof(T));
        }
      }
    } else if constexpr (OP >= OP_PREFIX_EXCL_SUM && OP <= OP_PREFIX_INCL_PROD) {
      constexpr bool incl = OP == OP_PREFIX_INCL_SUM || OP == OP_PREFIX_INCL_PROD;
      constexpr bool prod = OP == OP_PREFIX_EXCL_PROD || OP == OP_PREFIX_INCL_PROD;
      T acc = prod ? (T)1 : (T)0;
      for (uint32_t l = b; l < e; l++) {
        if (!(smask >> l & 1)) continue;
        T v = ld<T>(g.in[l]);
        if (incl) acc = combine<T, OP>(acc, v);
        st(g.out[l], acc);
        if (!incl) acc = combine<T, OP>(acc, v);
      }
    } else {
      // ALL / ANY / BALLOT / IS_FIRST / BARRIER on bool-ish lane values; bits relative to the segment
      uint64_t ballot = 0;
      for (uint32_t l = b; l < e; l++)
        if ((smask >> l & 1) && g.in[l][0]) ballot |= 1ull << (l - b);
      const uint64_t active = smask >> b;
      for (uint32_t l = b; l < e; l++) {
        if (!(smask >> l & 1)) continue;
        uint64_t r = 0;
        if constexpr (OP == OP_ALL) r = ballot == active;
        else if constexpr (OP == OP_ANY) r = ballot != 0;
        else if constexpr (OP == OP_BALLOT) r = ballot;
        else if constexpr (OP == OP_IS_FIRST) r = l == first_lane;
        else r = active;
        memcpy(g.out[l], &r, sizeof r);
      }
    }
  }
}
#define __EMU_RA ((uintptr_t)__builtin_return_address(0))
}  // namespace __emu

namespace metal {
struct simd_vote {
  typedef ulong vote_t;
  vote_t __v;
  explicit constexpr operator vote_t() const { return __v; }
  bool all() const { return __v == 0xFFFFFFFFull; }
  bool any() const { return __v != 0; }
};

// Every collective / barrier has a call-site id: the generated macros below pass
// __COUNTER__ (unique per source location, increasing in source order) so that the
// optimiser merging identical calls cannot merge sites; a direct call such as
// simd_sum<float>(x) falls back to the return address.
#define __EMU_SIMD1(NAME, OP, G)                                                                     \
  template <class T>                                                                                 \
  inline T __emu_##NAME(uintptr_t site, T v) {                                                       \
    return __emu::simd_exchange<T>(v, 0, site, &__emu::resolve<T, __emu::OP, G>);                    \
  }                                                                                                  \
  template <class T>                                                                                 \
  __attribute__((noinline)) T NAME(T v) {                                                            \
    return __emu_##NAME(__EMU_RA, v);                                                                \
  }
#define __EMU_SIMD2(NAME, OP, G)                                                                     \
  template <class T, class I>                                                                        \
  inline T __emu_##NAME(uintptr_t site, T v, I a) {                                                  \
    return __emu::simd_exchange<T>(v, (uint32_t)a, site, &__emu::resolve<T, __emu::OP, G>);          \
  }                                                                                                  \
  template <class T, class I>                                                                        \
  __attribute__((noinline)) T NAME(T v, I a) {                                                       \
    return __emu_##NAME(__EMU_RA, v, a);                                                             \
  }
#define __EMU_GROUP_OPS(P, G)                                                \
  __EMU_SIMD1(P##_sum, OP_SUM, G)                                            \
  __EMU_SIMD1(P##_product, OP_PROD, G)                                       \
  __EMU_SIMD1(P##_min, OP_MIN, G)                                            \
  __EMU_SIMD1(P##_max, OP_MAX, G)                                            \
  __EMU_SIMD1(P##_and, OP_AND, G)                                            \
  __EMU_SIMD1(P##_or, OP_OR, G)                                              \
  __EMU_SIMD1(P##_xor, OP_XOR, G)                                            \
  __EMU_SIMD1(P##_broadcast_first, OP_FIRST, G)                              \
  __EMU_SIMD1(P##_prefix_exclusive_sum, OP_PREFIX_EXCL_SUM, G)               \
  __EMU_SIMD1(P##_prefix_inclusive_sum, OP_PREFIX_INCL_SUM, G)               \
  __EMU_SIMD1(P##_prefix_exclusive_product, OP_PREFIX_EXCL_PROD, G)          \
  __EMU_SIMD1(P##_prefix_inclusive_product, OP_PREFIX_INCL_PROD, G)          \
  __EMU_SIMD2(P##_shuffle, OP_SHUFFLE, G)                                    \
  __EMU_SIMD2(P##_broadcast, OP_SHUFFLE, G)                                  \
  __EMU_SIMD2(P##_shuffle_xor, OP_SHUFFLE_XOR, G)                            \
  __EMU_SIMD2(P##_shuffle_down, OP_SHUFFLE_DOWN, G)                          \
  __EMU_SIMD2(P##_shuffle_up, OP_SHUFFLE_UP, G)                              \
  __EMU_SIMD2(P##_shuffle_rotate_down, OP_ROT_DOWN, G)                       \
  __EMU_SIMD2(P##_shuffle_rotate_up, OP_ROT_UP, G)
__EMU_GROUP_OPS(simd, 32)
__EMU_GROUP_OPS(quad, 4)
#undef __EMU_GROUP_OPS
#undef __EMU_SIMD1
#undef __EMU_SIMD2
template <class T>
T simd_prod(T v) = delete;  // not an MSL function (it is simd_product)

#define __EMU_VOTE(OP, V, SITE) __emu::simd_exchange<uint64_t>((V), 0, (SITE), &__emu::resolve<uint64_t, __emu::OP>)
#define __EMU_QVOTE(OP, V, SITE) __emu::simd_exchange<uint64_t>((V), 0, (SITE), &__emu::resolve<uint64_t, __emu::OP, 4>)
inline bool __emu_quad_all(uintptr_t site, bool b) { return (bool)__EMU_QVOTE(OP_ALL, b, site); }
inline bool __emu_quad_any(uintptr_t site, bool b) { return (bool)__EMU_QVOTE(OP_ANY, b, site); }
inline bool __emu_quad_is_first(uintptr_t site) { return (bool)__EMU_QVOTE(OP_IS_FIRST, 1, site); }
__attribute__((noinline)) inline bool quad_all(bool b) { return __emu_quad_all(__EMU_RA, b); }
__attribute__((noinline)) inline bool quad_any(bool b) { return __emu_quad_any(__EMU_RA, b); }
__attribute__((noinline)) inline bool quad_is_first() { return __emu_quad_is_first(__EMU_RA); }
#undef __EMU_QVOTE
inline bool __emu_simd_all(uintptr_t site, bool b) { return (bool)__EMU_VOTE(OP_ALL, b, site); }
inline bool __emu_simd_any(uintptr_t site, bool b) { return (bool)__EMU_VOTE(OP_ANY, b, site); }
inline simd_vote __emu_simd_ballot(uintptr_t site, bool b) { return simd_vote{__EMU_VOTE(OP_BALLOT, b, site)}; }
inline bool __emu_simd_is_first(uintptr_t site) { return (bool)__EMU_VOTE(OP_IS_FIRST, 1, site); }
inline simd_vote __emu_simd_active_threads_mask(uintptr_t site) { return simd_vote{__EMU_VOTE(OP_BARRIER, 1, site)}; }
__attribute__((noinline)) inline bool simd_all(bool b) { return __emu_simd_all(__EMU_RA, b); }
__attribute__((noinline)) inline bool simd_any(bool b) { return __emu_simd_any(__EMU_RA, b); }
__attribute__((noinline)) inline simd_vote simd_ballot(bool b) { return __emu_simd_ballot(__EMU_RA, b); }
__attribute__((noinline)) inline bool simd_is_first() { return __emu_simd_is_first(__EMU_RA); }
__attribute__((noinline)) inline simd_vote simd_active_threads_mask() { return __emu_simd_active_threads_mask(__EMU_RA); }
#undef __EMU_VOTE
inline void __emu_simdgroup_barrier(uintptr_t site, mem_flags) {
  (void)__emu::simd_exchange<uint64_t>(1, 0, site, &__emu::resolve<uint64_t, __emu::OP_BARRIER>);
  __emu::cur().sepoch++;  // orders this lane's accesses after its simdgroup's earlier ones (race detector)
}
__attribute__((noinline)) inline void simdgroup_barrier(mem_flags f) { __emu_simdgroup_barrier(__EMU_RA, f); }
inline void __emu_threadgroup_barrier(uintptr_t site, mem_flags) { __emu::barrier(site); }
}  // namespace metal

// ------------------------------------------------------------------ simdgroup matrices
// Emulated per lane: every lane holds the whole 8x8 matrix.  The MSL rules
// (uniform operands across the simdgroup) make that equivalent; thread_elements()
// (the hardware's lane layout) is not provided.
namespace metal {
template <class T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "the emulator supports 8x8 simdgroup matrices");
  T e[Rows][Cols];
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T diag) {
    for (int r = 0; r < Rows; r++)
      for (int c = 0; c < Cols; c++) e[r][c] = r == c ? diag : (T)0;
  }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;
template <class T, int C, int R>
inline simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(T v) {
  simdgroup_matrix<T, C, R> m;
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) m.e[r][c] = v;
  return m;
}
// every lane loads/stores the whole matrix here (on the GPU the simdgroup shares the work): not race-checked
template <class T, int C, int R, class U, class O = ulong2>
__attribute__((no_sanitize("thread"), noinline)) inline void simdgroup_load(simdgroup_matrix<T, C, R>& d, const U* src, ulong elements_per_row = C,
                           O origin = O(0), bool transpose = false) {
  const ulong ox = (ulong)origin[0], oy = (ulong)origin[1];
  __EMU_PROF(__emu::prof_matrix(src, elements_per_row, ox, oy, transpose, false, (uintptr_t)__builtin_return_address(0));)
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++)
      d.e[r][c] = (T)(transpose ? src[(oy + c) * elements_per_row + ox + r] : src[(oy + r) * elements_per_row + ox + c]);
}
template <class T, int C, int R, class U, class O = ulong2>
__attribute__((no_sanitize("thread"), noinline)) inline void simdgroup_store(const simdgroup_matrix<T, C, R>& a, U* dst, ulong elements_per_row = C,
                            O origin = O(0), bool transpose = false) {
  const ulong ox = (ulong)origin[0], oy = (ulong)origin[1];
  __EMU_PROF(__emu::prof_matrix(dst, elements_per_row, ox, oy, transpose, true, (uintptr_t)__builtin_return_address(0));)
  for (int r = 0; r < R; r++)
    for (int c = 0; c < C; c++) {
      if (transpose) dst[(oy + c) * elements_per_row + ox + r] = (U)a.e[r][c];
      else dst[(oy + r) * elements_per_row + ox + c] = (U)a.e[r][c];
    }
}
template <class TD, class TA, class TB, class TC, int N>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<TD, N, N>& d, const simdgroup_matrix<TA, N, N>& a,
                                          const simdgroup_matrix<TB, N, N>& b, const simdgroup_matrix<TC, N, N>& c) {
  // one 8x8x8 multiply-accumulate of the simdgroup: 512 MACs (on 16-bit operands: the FP16 pipeline)
  __EMU_PROF(__emu::prof_mma(sizeof(TA) == 2 && sizeof(TB) == 2);)
  float t[N][N];
  for (int r = 0; r < N; r++)
    for (int k = 0; k < N; k++) {
      float s = (float)c.e[r][k];
      for (int j = 0; j < N; j++) s += (float)a.e[r][j] * (float)b.e[j][k];
      t[r][k] = s;
    }
  for (int r = 0; r < N; r++)
    for (int k = 0; k < N; k++) d.e[r][k] = (TD)t[r][k];
}
template <class TD, class TA, class TB, int N>
inline void simdgroup_multiply(simdgroup_matrix<TD, N, N>& d, const simdgroup_matrix<TA, N, N>& a,
                               const simdgroup_matrix<TB, N, N>& b) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<TD, N, N>((TD)0));
}
}  // namespace metal

// threadgroup memory: per-group storage, filled with 0xFF at the start of every group
namespace __emu {
inline void* tg_storage(uint32_t slot, size_t size, size_t align, const char* name) {
  return tg_alloc(slot, size, align, name);
}
}  // namespace __emu

// ------------------------------------------------------------------ MSL keywords
#define kernel
#define device
#define thread
#define constant const
#define threadgroup
#define threadgroup_imageblock
#define ray_data
#define object_data
#define METAL_FUNC inline
#define __METAL_EMULATOR__ 1
#define threadgroup_barrier(...) __emu_threadgroup_barrier(__COUNTER__ + 1 __VA_OPT__(, ) __VA_ARGS__)
#define simdgroup_barrier(...) __emu_simdgroup_barrier(__COUNTER__ + 1 __VA_OPT__(, ) __VA_ARGS__)
#define quad_sum(...) __emu_quad_sum(__COUNTER__ + 1, __VA_ARGS__)
#define quad_product(...) __emu_quad_product(__COUNTER__ + 1, __VA_ARGS__)
#define quad_min(...) __emu_quad_min(__COUNTER__ + 1, __VA_ARGS__)
#define quad_max(...) __emu_quad_max(__COUNTER__ + 1, __VA_ARGS__)
#define quad_and(...) __emu_quad_and(__COUNTER__ + 1, __VA_ARGS__)
#define quad_or(...) __emu_quad_or(__COUNTER__ + 1, __VA_ARGS__)
#define quad_xor(...) __emu_quad_xor(__COUNTER__ + 1, __VA_ARGS__)
#define quad_broadcast_first(...) __emu_quad_broadcast_first(__COUNTER__ + 1, __VA_ARGS__)
#define quad_prefix_exclusive_sum(...) __emu_quad_prefix_exclusive_sum(__COUNTER__ + 1, __VA_ARGS__)
#define quad_prefix_inclusive_sum(...) __emu_quad_prefix_inclusive_sum(__COUNTER__ + 1, __VA_ARGS__)
#define quad_prefix_exclusive_product(...) __emu_quad_prefix_exclusive_product(__COUNTER__ + 1, __VA_ARGS__)
#define quad_prefix_inclusive_product(...) __emu_quad_prefix_inclusive_product(__COUNTER__ + 1, __VA_ARGS__)
#define quad_shuffle(...) __emu_quad_shuffle(__COUNTER__ + 1, __VA_ARGS__)
#define quad_broadcast(...) __emu_quad_broadcast(__COUNTER__ + 1, __VA_ARGS__)
#define quad_shuffle_xor(...) __emu_quad_shuffle_xor(__COUNTER__ + 1, __VA_ARGS__)
#define quad_shuffle_down(...) __emu_quad_shuffle_down(__COUNTER__ + 1, __VA_ARGS__)
#define quad_shuffle_up(...) __emu_quad_shuffle_up(__COUNTER__ + 1, __VA_ARGS__)
#define quad_shuffle_rotate_down(...) __emu_quad_shuffle_rotate_down(__COUNTER__ + 1, __VA_ARGS__)
#define quad_shuffle_rotate_up(...) __emu_quad_shuffle_rotate_up(__COUNTER__ + 1, __VA_ARGS__)
#define quad_all(...) __emu_quad_all(__COUNTER__ + 1, __VA_ARGS__)
#define quad_any(...) __emu_quad_any(__COUNTER__ + 1, __VA_ARGS__)
#define quad_is_first() __emu_quad_is_first(__COUNTER__ + 1)
#define simd_sum(...) __emu_simd_sum(__COUNTER__ + 1, __VA_ARGS__)
#define simd_product(...) __emu_simd_product(__COUNTER__ + 1, __VA_ARGS__)
#define simd_min(...) __emu_simd_min(__COUNTER__ + 1, __VA_ARGS__)
#define simd_max(...) __emu_simd_max(__COUNTER__ + 1, __VA_ARGS__)
#define simd_and(...) __emu_simd_and(__COUNTER__ + 1, __VA_ARGS__)
#define simd_or(...) __emu_simd_or(__COUNTER__ + 1, __VA_ARGS__)
#define simd_xor(...) __emu_simd_xor(__COUNTER__ + 1, __VA_ARGS__)
#define simd_broadcast_first(...) __emu_simd_broadcast_first(__COUNTER__ + 1, __VA_ARGS__)
#define simd_prefix_exclusive_sum(...) __emu_simd_prefix_exclusive_sum(__COUNTER__ + 1, __VA_ARGS__)
#define simd_prefix_inclusive_sum(...) __emu_simd_prefix_inclusive_sum(__COUNTER__ + 1, __VA_ARGS__)
#define simd_prefix_exclusive_product(...) __emu_simd_prefix_exclusive_product(__COUNTER__ + 1, __VA_ARGS__)
#define simd_prefix_inclusive_product(...) __emu_simd_prefix_inclusive_product(__COUNTER__ + 1, __VA_ARGS__)
#define simd_shuffle(...) __emu_simd_shuffle(__COUNTER__ + 1, __VA_ARGS__)
#define simd_broadcast(...) __emu_simd_broadcast(__COUNTER__ + 1, __VA_ARGS__)
#define simd_shuffle_xor(...) __emu_simd_shuffle_xor(__COUNTER__ + 1, __VA_ARGS__)
#define simd_shuffle_down(...) __emu_simd_shuffle_down(__COUNTER__ + 1, __VA_ARGS__)
#define simd_shuffle_up(...) __emu_simd_shuffle_up(__COUNTER__ + 1, __VA_ARGS__)
#define simd_shuffle_rotate_down(...) __emu_simd_shuffle_rotate_down(__COUNTER__ + 1, __VA_ARGS__)
#define simd_shuffle_rotate_up(...) __emu_simd_shuffle_rotate_up(__COUNTER__ + 1, __VA_ARGS__)
#define simd_all(...) __emu_simd_all(__COUNTER__ + 1, __VA_ARGS__)
#define simd_any(...) __emu_simd_any(__COUNTER__ + 1, __VA_ARGS__)
#define simd_ballot(...) __emu_simd_ballot(__COUNTER__ + 1, __VA_ARGS__)
#define simd_is_first() __emu_simd_is_first(__COUNTER__ + 1)
#define simd_active_threads_mask() __emu_simd_active_threads_mask(__COUNTER__ + 1)
