// Comfy Metal MSL emulator -- shim: makes (a practical subset of) the Metal
// Shading Language compile as C++20 with clang-19.  Force-included (-include)
// in front of the preprocessed .metal source.
#pragma once
#include "runtime.h"
#include <type_traits>
#include <limits>
#include <utility>
#include <tuple>

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

// boolN: MSL's bool vectors (1 byte an element; bool3 takes 4 bytes, as in Metal). A class rather than clang's
// bool vectors, so that a vector comparison (clang: a signed integer vector, MSL: boolN) converts to it; the strict
// front end decides what converts implicitly (only a comparison's result), this build takes any integer vector.
namespace __emu {
template <int N> struct bvec_base;
template <> struct bvec_base<2> { bool x, y; };
template <> struct bvec_base<3> { bool x, y, z; };
template <> struct bvec_base<4> { bool x, y, z, w; };
template <int N>
struct alignas(N == 2 ? 2 : 4) bvec : bvec_base<N> {
  bvec() = default;
  constexpr bvec(bool s) {
    for (int i = 0; i < N; i++) (*this)[i] = s;
  }
  // a braced list: missing elements are false (C++ aggregate rules, as for the other vectors)
  constexpr bvec(std::initializer_list<bool> l) {
    int i = 0;
    for (bool e : l) {
      if (i < N) (*this)[i] = e;
      i++;
    }
    for (; i < N; i++) (*this)[i] = false;
  }
  template <class V, std::enable_if_t<vinfo<std::remove_cv_t<V>>::n == N &&
                                          std::is_integral_v<typename vinfo<std::remove_cv_t<V>>::elem>, int> = 0>
  constexpr bvec(const V& v) {
    for (int i = 0; i < N; i++) (*this)[i] = (bool)v[i];
  }
  constexpr bool& operator[](int i) {
    switch (i) {
      case 0: return this->x;
      case 1: return this->y;
      case 2: if constexpr (N > 2) return this->z; else __builtin_trap();
      default: if constexpr (N > 3) return this->w; else __builtin_trap();
    }
  }
  constexpr const bool& operator[](int i) const { return (*const_cast<bvec*>(this))[i]; }
#define __EMU_BOP(OP)                                                          \
  friend constexpr bvec operator OP(const bvec& a, const bvec& b) {            \
    bvec r;                                                                    \
    for (int i = 0; i < N; i++) r[i] = (bool)(a[i] OP b[i]);                  \
    return r;                                                                  \
  }
  __EMU_BOP(&&) __EMU_BOP(||) __EMU_BOP(==) __EMU_BOP(!=) __EMU_BOP(&) __EMU_BOP(|) __EMU_BOP(^)
#undef __EMU_BOP
  friend constexpr bvec operator!(const bvec& a) {
    bvec r;
    for (int i = 0; i < N; i++) r[i] = !a[i];
    return r;
  }
  friend constexpr bvec operator~(const bvec& a) { return !a; }
  constexpr bvec& operator&=(const bvec& b) { return *this = *this & b; }
  constexpr bvec& operator|=(const bvec& b) { return *this = *this | b; }
  constexpr bvec& operator^=(const bvec& b) { return *this = *this ^ b; }
};
template <int N>
struct vinfo<bvec<N>> {
  static constexpr int n = N;
  using elem = bool;
};
template <class T> inline constexpr bool is_bvec = false;
template <int N> inline constexpr bool is_bvec<bvec<N>> = true;
// vec<T, N> named in a typedef/using or written as vec<bool, N> (rewrite.bool_vectors): bool -> boolN
template <class T, int N> struct vec_sel { typedef T type __attribute__((ext_vector_type(N))); };
template <int N> struct vec_sel<bool, N> { typedef bvec<N> type; };
template <int N> struct vec_sel<const bool, N> { typedef const bvec<N> type; };
template <class T, int N> using vec_sel_t = typename vec_sel<T, N>::type;
}  // namespace __emu
typedef __emu::bvec<2> bool2;
typedef __emu::bvec<3> bool3;
typedef __emu::bvec<4> bool4;

namespace __emu {
template <class T> struct ext_vec : std::false_type {};
template <class T, int N> struct ext_vec<T __attribute__((ext_vector_type(N)))> : std::true_type {};
template <int N> struct ext_vec<bvec<N>> : std::true_type {};  // boolN constructs and converts as a vector
template <class A, class B>
inline constexpr bool half_bfloat_pair = (std::is_same_v<std::remove_cv_t<A>, half> && std::is_same_v<std::remove_cv_t<B>, bfloat>) ||
                                         (std::is_same_v<std::remove_cv_t<A>, bfloat> && std::is_same_v<std::remove_cv_t<B>, half>);
// Build a value the way MSL constructors and casts do: float4(x) splats, float4(h4) converts element-wise,
// float4(a.xy, b, c) concatenates; a scalar or class type is constructed as written (half <-> bfloat through
// float, which MSL allows explicitly and clang does not).  The generator rewrites `float4(`, `T(` (a template
// type parameter or typedef), `static_cast<float4>(` and `(float4)x` into __emu::vec / __emu::vcast.
template <class E, class A>
inline void vput(E* out, int& k, const A& a) {
  if constexpr (vlen<A> == 1) {
    out[k++] = (E)a;
  } else {
    for (int i = 0; i < vlen<A>; i++) out[k++] = (E)a[i];
  }
}
template <class V, class E, class A, size_t... I>
constexpr V splat(const A& a, std::index_sequence<I...>) {
  return V{((void)I, (E)a)...};
}
template <class V, class... A>
constexpr V vec_of(const A&... a);
// an argument as written: an array decays to a pointer to its (non-const) elements, an object is a non-const
// lvalue (its non-const conversion operators and a constructor's reference parameters apply, as in a direct call)
template <class A>
constexpr decltype(auto) arg(const A& a) {
  if constexpr (std::is_array_v<A>) return const_cast<std::remove_const_t<std::remove_extent_t<A>>*>(a);
  else return const_cast<A&>(a);
}
template <class V, class... A>
constexpr V vec(const A&... a) {
  if constexpr (!ext_vec<std::remove_cv_t<V>>::value) {
    if constexpr (sizeof...(A) == 1 && (half_bfloat_pair<V, A> && ...)) return (V)(float)(a, ...);
    else return V(arg(a)...);  // a scalar or a class: its constructor
  } else {
    return vec_of<V>(a...);
  }
}
template <class V, class... A>
constexpr V vec_of(const A&... a) {
  using E = elem_t<V>;
  constexpr int N = vlen<V>;
  if constexpr (sizeof...(A) == 0) {
    return V{};
  } else {
    constexpr int total = (vlen<A> + ...);
    if constexpr (sizeof...(A) == 1 && total == 1) {
      if constexpr ((half_bfloat_pair<E, A> && ...)) return splat<V, E>((float)(a, ...), std::make_index_sequence<N>());
      else return splat<V, E>((a, ...), std::make_index_sequence<N>());
    } else if constexpr (sizeof...(A) == N && total == N) {
      if constexpr ((half_bfloat_pair<E, A> || ...)) return V{(E)(float)a...};
      else return V{(E)a...};
    } else if constexpr (sizeof...(A) == 1 && !is_bvec<std::remove_cv_t<V>> &&
                         ((ext_vec<std::remove_cv_t<A>>::value && !is_bvec<std::remove_cv_t<A>>) && ...) &&
                         !(half_bfloat_pair<E, elem_t<A>> && ...)) {
      static_assert(total == N, "wrong number of components in vector constructor");
      return __builtin_convertvector((a, ...), V);
    } else {
      static_assert(total == N, "wrong number of components in vector constructor");
      E e[N];
      int k = 0;
      if constexpr ((half_bfloat_pair<E, elem_t<A>> || ...)) {
        float f[N];
        (vput(f, k, a), ...);
        for (int i = 0; i < N; i++) e[i] = (E)f[i];
      } else {
        (vput(e, k, a), ...);
      }
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
constexpr V operator->*(vcast<V>, const U& u) {
  return vec<V>(u);
}
// a braced list passed as an argument, `f({a, b, c})` (rewritten to `f(__emu::ilist{a, b, c})`): it converts to
// a vector parameter (C++ does not list-initialise clang's vectors in a call) or to an aggregate, never to a scalar
template <class... A>
struct ilist {
  std::tuple<A...> v;
  constexpr ilist(const A&... a) : v(a...) {}
  template <class V, class = std::enable_if_t<ext_vec<V>::value>>
  constexpr operator V() const { return std::apply([](const A&... a) { return vec<V>(a...); }, v); }
  template <class V, class = std::enable_if_t<!ext_vec<V>::value && std::is_aggregate_v<V>>, class = void>
  constexpr operator V() const { return std::apply([](const A&... a) { return V{a...}; }, v); }
};
template <class... A> ilist(A...) -> ilist<A...>;
// a function constant compiled without a value (the launch refuses the kernel: specialise the source first)
template <class T>
constexpr T fc_unset() { return T(); }
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
constexpr T conv(const U& u) {
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
#include "msl_constants.h"

// as_type<T>(x): an operator of the language, visible before `using namespace metal`
template <class T, class U>
constexpr T as_type(const U& u) {
  static_assert(sizeof(T) == sizeof(U), "as_type: sizes differ");
  return __builtin_bit_cast(T, u);
}

// ------------------------------------------------------------------ metal namespace
namespace metal {
using ::as_type;
__MSL_VECTOR_TYPES;  // the vector types are metal:: names too (metal::float4)

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

// ---- <metal_type_traits>, <metal_utility>: the std traits, with half and bfloat floating-point types
template <bool B, class T = void> using enable_if = std::enable_if<B, T>;
using std::bool_constant, std::conditional, std::conditional_t, std::decay, std::decay_t, std::declval,
    std::enable_if_t, std::false_type, std::integral_constant, std::is_class, std::is_class_v,
    std::is_const, std::is_const_v, std::is_convertible, std::is_convertible_v,
    std::is_enum, std::is_enum_v, std::is_pointer, std::is_pointer_v, std::is_reference, std::is_reference_v,
    std::is_same, std::is_same_v, std::is_void, std::is_void_v, std::make_signed, std::make_signed_t,
    std::make_unsigned, std::make_unsigned_t, std::remove_const, std::remove_const_t, std::remove_cv,
    std::remove_cv_t, std::remove_pointer, std::remove_pointer_t, std::remove_reference, std::remove_reference_t,
    std::remove_volatile, std::remove_volatile_t, std::true_type, std::underlying_type, std::underlying_type_t,
    std::conjunction, std::disjunction, std::negation, std::is_trivially_copyable,
    std::is_trivially_copyable_v, std::common_type, std::common_type_t, std::is_base_of, std::is_base_of_v;
// Apple's internal names (`#pragma METAL internals : enable`, MLX's atomic.h)
template <class... B> using _disjunction = std::disjunction<B...>;
template <class... B> using _conjunction = std::conjunction<B...>;
template <class T> struct is_floating_point : bool_constant<__emu::is_fp_elem<remove_cv_t<T>>> {};
template <class T> inline constexpr bool is_floating_point_v = is_floating_point<T>::value;
template <class T> struct is_integral : std::is_integral<T> {};
template <class T> inline constexpr bool is_integral_v = is_integral<T>::value;
template <class T> struct is_arithmetic : bool_constant<is_integral_v<T> || is_floating_point_v<T>> {};
template <class T> inline constexpr bool is_arithmetic_v = is_arithmetic<T>::value;
template <class T> struct is_scalar : bool_constant<is_arithmetic_v<T> || std::is_scalar_v<T>> {};
template <class T> inline constexpr bool is_scalar_v = is_scalar<T>::value;
template <class T> struct is_signed : bool_constant<is_floating_point_v<T> || std::is_signed_v<T>> {};
template <class T> inline constexpr bool is_signed_v = is_signed<T>::value;
template <class T> struct is_unsigned : std::is_unsigned<T> {};
template <class T> inline constexpr bool is_unsigned_v = is_unsigned<T>::value;
template <class T> struct is_vector : bool_constant<(__emu::vinfo<remove_cv_t<T>>::n > 1)> {};
template <class T> inline constexpr bool is_vector_v = is_vector<T>::value;
template <class T> struct vec_elements : integral_constant<int, __emu::vinfo<remove_cv_t<T>>::n> {};
template <class T> inline constexpr int vec_elements_v = vec_elements<T>::value;
template <class T> struct make_scalar { typedef __emu::elem_t<T> type; };
template <class T> using make_scalar_t = typename make_scalar<T>::type;
// address spaces are empty here: removing one is the identity
template <class T> struct remove_addrspace { typedef T type; };
template <class T> using remove_addrspace_t = typename remove_addrspace<T>::type;

template <class T>
struct numeric_limits : std::numeric_limits<T> {};
template <>
struct numeric_limits<half> {
  static constexpr bool is_specialized = true, is_signed = true, is_integer = false, is_exact = false,
                        has_infinity = true, has_quiet_NaN = true;
  static constexpr int digits = 11, digits10 = 3, radix = 2, min_exponent = -13, max_exponent = 16;
  static constexpr half max() { return (half)65504.0f; }
  static constexpr half min() { return (half)6.103515625e-05f; }
  static constexpr half lowest() { return (half)-65504.0f; }
  static constexpr half epsilon() { return (half)9.765625e-4f; }
  static constexpr half infinity() { return (half)__builtin_inff(); }
  static constexpr half quiet_NaN() { return (half)__builtin_nanf(""); }
  static constexpr half denorm_min() { return __builtin_bit_cast(half, (unsigned short)1); }
};
template <>
struct numeric_limits<bfloat> {
  static constexpr bool is_specialized = true, is_signed = true, is_integer = false, is_exact = false,
                        has_infinity = true, has_quiet_NaN = true;
  static constexpr int digits = 8, digits10 = 2, radix = 2, min_exponent = -125, max_exponent = 128;
  static constexpr bfloat max() { return __builtin_bit_cast(bfloat, (unsigned short)0x7F7F); }
  static constexpr bfloat min() { return __builtin_bit_cast(bfloat, (unsigned short)0x0080); }
  static constexpr bfloat lowest() { return __builtin_bit_cast(bfloat, (unsigned short)0xFF7F); }
  static constexpr bfloat epsilon() { return __builtin_bit_cast(bfloat, (unsigned short)0x3C00); }
  static constexpr bfloat infinity() { return __builtin_bit_cast(bfloat, (unsigned short)0x7F80); }
  static constexpr bfloat quiet_NaN() { return __builtin_bit_cast(bfloat, (unsigned short)0x7FC0); }
  static constexpr bfloat denorm_min() { return __builtin_bit_cast(bfloat, (unsigned short)1); }
};

// ---- vec<T, N>, <metal_array>, <metal_uniform>
template <class T, int N> using vec = T __attribute__((ext_vector_type(N)));
template <class T, size_t N>
struct array {
  T __elems[N ? N : 1];
  constexpr T& operator[](size_t i) { return __elems[i]; }
  constexpr const T& operator[](size_t i) const { return __elems[i]; }
  static constexpr size_t size() { return N; }
  static constexpr bool empty() { return N == 0; }
  constexpr T* data() { return __elems; }
  constexpr const T* data() const { return __elems; }
  constexpr T* begin() { return __elems; }
  constexpr const T* begin() const { return __elems; }
  constexpr T* end() { return __elems + N; }
  constexpr const T* end() const { return __elems + N; }
  constexpr T& front() { return __elems[0]; }
  constexpr const T& front() const { return __elems[0]; }
  constexpr T& back() { return __elems[N - 1]; }
  constexpr const T& back() const { return __elems[N - 1]; }
};
// uniform<T>: a value the same in every thread (a compiler hint); behaves like T
template <class T>
struct uniform {
  T __v;
  uniform() = default;
  constexpr uniform(T v) : __v(v) {}
  constexpr operator T() const { return __v; }
};
template <class T> constexpr uniform<T> make_uniform(T v) { return uniform<T>(v); }

// ---- <metal_matrix>: C columns of vec<T, R> (column-major, as in MSL)
template <class T, int C, int R>
struct matrix {
  static_assert(C >= 2 && C <= 4 && R >= 2 && R <= 4, "MSL matrices have 2 to 4 columns and rows");
  vec<T, R> columns[C];
  matrix() = default;
  explicit matrix(T diag) {
    for (int c = 0; c < C; c++)
      for (int r = 0; r < R; r++) columns[c][r] = c == r ? diag : (T)0;
  }
  template <class... V, std::enable_if_t<sizeof...(V) == C && (std::is_same_v<std::remove_cv_t<V>, vec<T, R>> && ...),
                                         int> = 0>
  matrix(const V&... cols) : columns{cols...} {}
  template <class... S, std::enable_if_t<sizeof...(S) == C * R && (std::is_arithmetic_v<S> && ...), int> = 0>
  matrix(S... s) {
    const T e[C * R] = {(T)s...};
    for (int c = 0; c < C; c++)
      for (int r = 0; r < R; r++) columns[c][r] = e[c * R + r];
  }
  template <class U>
  explicit matrix(const matrix<U, C, R>& m) {
    for (int c = 0; c < C; c++)
      for (int r = 0; r < R; r++) columns[c][r] = (T)(float)m.columns[c][r];  // (bfloat <-> half through float)
  }
  vec<T, R>& operator[](int c) { return columns[c]; }
  const vec<T, R>& operator[](int c) const { return columns[c]; }
};
template <class T, int C, int R>
inline vec<T, R> operator*(const matrix<T, C, R>& m, const vec<T, C>& v) {
  vec<T, R> r = m.columns[0] * v[0];
  for (int c = 1; c < C; c++) r += m.columns[c] * v[c];
  return r;
}
template <class T, int C, int R>
inline vec<T, C> operator*(const vec<T, R>& v, const matrix<T, C, R>& m) {
  vec<T, C> r;
  for (int c = 0; c < C; c++) {
    T s = (T)0;
    for (int k = 0; k < R; k++) s += v[k] * m.columns[c][k];
    r[c] = s;
  }
  return r;
}
template <class T, int K, int R, int C>
inline matrix<T, C, R> operator*(const matrix<T, K, R>& a, const matrix<T, C, K>& b) {
  matrix<T, C, R> r;
  for (int c = 0; c < C; c++) r.columns[c] = a * b.columns[c];
  return r;
}
#define __EMU_MAT_ELEMENTWISE(OP)                                                                \
  template <class T, int C, int R>                                                               \
  inline matrix<T, C, R> operator OP(const matrix<T, C, R>& a, const matrix<T, C, R>& b) {       \
    matrix<T, C, R> r;                                                                           \
    for (int c = 0; c < C; c++) r.columns[c] = a.columns[c] OP b.columns[c];                     \
    return r;                                                                                    \
  }
__EMU_MAT_ELEMENTWISE(+)
__EMU_MAT_ELEMENTWISE(-)
#undef __EMU_MAT_ELEMENTWISE
template <class T, int C, int R, class S, std::enable_if_t<std::is_arithmetic_v<S>, int> = 0>
inline matrix<T, C, R> operator*(const matrix<T, C, R>& a, S s) {
  matrix<T, C, R> r;
  for (int c = 0; c < C; c++) r.columns[c] = a.columns[c] * (T)s;
  return r;
}
template <class T, int C, int R, class S, std::enable_if_t<std::is_arithmetic_v<S>, int> = 0>
inline matrix<T, C, R> operator*(S s, const matrix<T, C, R>& a) { return a * s; }
template <class T, int C, int R>
inline matrix<T, R, C> transpose(const matrix<T, C, R>& m) {
  matrix<T, R, C> t;
  for (int c = 0; c < C; c++)
    for (int r = 0; r < R; r++) t.columns[r][c] = m.columns[c][r];
  return t;
}
__MSL_MATRIX_TYPES(float)
__MSL_MATRIX_TYPES(half)

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
__EMU_F1(tanpi, __builtin_tanf(v * M_PI_F))
__EMU_F1(logb, __builtin_logbf(v))
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
__EMU_F2(nextafter, __builtin_nextafterf(x, y))
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
#pragma clang loop unroll(full)
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
inline T frexp(T x, int* e) {
  return (T)__builtin_frexpf((float)x, e);
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
    typedef __emu::bvec<__emu::vlen<T>> __emu_bv;                                              \
    __emu_bv r;                                                                              \
    _Pragma("clang loop unroll(full)")                                                       \
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
// the same-type overloads are plain functions (as in Metal's headers): they beat any user template of the same
// name (c10/metal's max<T, U>) on an exact match
#define __EMU_MM(T) \
  inline T min(T a, T b) { return min<T, T>(a, b); } inline T max(T a, T b) { return max<T, T>(a, b); }
#define __EMU_MMV(E) __EMU_MM(E) __EMU_MM(E##2) __EMU_MM(E##3) __EMU_MM(E##4)
__EMU_MMV(float) __EMU_MMV(half) __EMU_MMV(char) __EMU_MMV(uchar) __EMU_MMV(short) __EMU_MMV(ushort) __EMU_MMV(int)
__EMU_MMV(uint) __EMU_MMV(long) __EMU_MMV(ulong)
#undef __EMU_MMV
#undef __EMU_MM
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
#pragma clang loop unroll(full)
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
  // the loops over a vector's lanes are unrolled, as on the GPU: a profiled loop would count its counter and
  // compare as kernel work
#pragma clang loop unroll(full)
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
#pragma clang loop unroll(full)
    for (int i = 0; i < __emu::vlen<T>; i++)
      if (!v[i]) return false;
    return true;
  }
}
template <class T>
inline bool any(T v) {
  if constexpr (__emu::vlen<T> == 1) return (bool)v;
  else {
#pragma clang loop unroll(full)
    for (int i = 0; i < __emu::vlen<T>; i++)
      if (v[i]) return true;
    return false;
  }
}

// ---- three-operand and integer functions
#define __EMU_THREE(P, MIN, MAX)                                                                           \
  template <class A, class B, class C>                                                                       \
  inline A P##min3(A a, B b, C c) { return MIN(MIN(a, __emu::conv<A>(b)), __emu::conv<A>(c)); }             \
  template <class A, class B, class C>                                                                       \
  inline A P##max3(A a, B b, C c) { return MAX(MAX(a, __emu::conv<A>(b)), __emu::conv<A>(c)); }             \
  template <class A, class B, class C>                                                                       \
  inline A P##median3(A a, B b, C c) {                                                                       \
    const A bb = __emu::conv<A>(b), cc = __emu::conv<A>(c);                                                  \
    return MAX(MIN(a, bb), MIN(MAX(a, bb), cc));                                                             \
  }
__EMU_THREE(, min, max)
__EMU_THREE(f, fmin, fmax)
#undef __EMU_THREE
template <class T, std::enable_if_t<__emu::is_fp<T> && __emu::vlen<T> == 1, int> = 0>
inline bool isordered(T x, T y) { return !__builtin_isnan((float)x) && !__builtin_isnan((float)y); }
template <class T, std::enable_if_t<__emu::is_fp<T> && __emu::vlen<T> == 1, int> = 0>
inline bool isunordered(T x, T y) { return !isordered(x, y); }
template <class T, std::enable_if_t<__emu::is_fp<T> && __emu::vlen<T> == 1, int> = 0>
inline int ilogb(T x) { return __builtin_ilogbf((float)x); }
#define __EMU_I2(NAME, EXPR)                                                                      \
  template <class T, std::enable_if_t<std::is_integral_v<__emu::elem_t<T>>, int> = 0>             \
  inline T NAME(T a_, T b_) {                                                                     \
    return __emu::map2(a_, b_, [](auto x, auto y) {                                               \
      using E = decltype(x);                                                                      \
      using W = std::conditional_t<std::is_signed_v<E>, __int128, unsigned __int128>;             \
      constexpr W lo = (W)std::numeric_limits<E>::min(), hi = (W)std::numeric_limits<E>::max();   \
      (void)lo; (void)hi;                                                                         \
      return (E)(EXPR);                                                                           \
    });                                                                                           \
  }
__EMU_I2(absdiff, x > y ? (W)x - (W)y : (W)y - (W)x)
__EMU_I2(addsat, (W)x + (W)y > hi ? hi : ((W)x + (W)y < lo ? lo : (W)x + (W)y))
__EMU_I2(subsat, (W)x - (W)y > hi ? hi : ((W)x - (W)y < lo ? lo : (W)x - (W)y))
__EMU_I2(hadd, ((W)x + (W)y) >> 1)
__EMU_I2(rhadd, ((W)x + (W)y + 1) >> 1)
#undef __EMU_I2
template <class T, std::enable_if_t<std::is_integral_v<__emu::elem_t<T>>, int> = 0>
inline T reverse_bits(T x) {
  return __emu::map1(x, [](auto e) {
    using E = decltype(e);
    using U = std::make_unsigned_t<E>;
    U u = (U)e, r = 0;
    for (unsigned i = 0; i < 8 * sizeof(E); i++) r |= (U)((u >> i) & 1u) << (8 * sizeof(E) - 1 - i);
    return (E)r;
  });
}
template <class T, class S, std::enable_if_t<std::is_integral_v<__emu::elem_t<T>>, int> = 0>
inline T rotate(T v, S i) {
  return __emu::map2(v, __emu::conv<T>(i), [](auto e, auto k) {
    using E = decltype(e);
    using U = std::make_unsigned_t<E>;
    constexpr unsigned bits = 8 * sizeof(E);
    const unsigned n = (unsigned)((U)k % bits);
    return (E)(n ? (U)((U)e << n | (U)e >> (bits - n)) : (U)e);
  });
}
template <class T, std::enable_if_t<std::is_integral_v<__emu::elem_t<T>>, int> = 0>
inline T extract_bits(T x, uint offset, uint bits) {
  return __emu::map1(x, [=](auto e) {
    using E = decltype(e);
    using U = std::make_unsigned_t<E>;
    if (!bits) return (E)0;
    U v = (U)((U)e >> offset);
    if (bits < 8 * sizeof(E)) v &= (U)(((U)1 << bits) - 1);
    if constexpr (std::is_signed_v<E>)
      if (bits < 8 * sizeof(E) && (v >> (bits - 1) & 1)) v |= (U)~(U)(((U)1 << bits) - 1);
    return (E)v;
  });
}
template <class T, std::enable_if_t<std::is_integral_v<__emu::elem_t<T>>, int> = 0>
inline T insert_bits(T base, T insert, uint offset, uint bits) {
  return __emu::map2(base, insert, [=](auto b, auto i) {
    using E = decltype(b);
    using U = std::make_unsigned_t<E>;
    if (!bits) return b;
    const U m = (U)((bits < 8 * sizeof(E) ? (U)(((U)1 << bits) - 1) : (U)~(U)0) << offset);
    return (E)(((U)b & (U)~m) | (((U)i << offset) & m));
  });
}

// metal::fast and metal::precise declare the math functions themselves (a user overload added to either does
// not hide the standard ones)
namespace fast {
__MSL_MATH_FUNCTIONS;
}
namespace precise {
__MSL_MATH_FUNCTIONS;
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
  else if constexpr ((OP == OP_AND || OP == OP_OR || OP == OP_XOR) && is_fp<T>) {  // on the bits (Apple's
    using U = std::conditional_t<sizeof(T) == 2, uint16_t, std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>>;
    const U x = __builtin_bit_cast(U, a), y = __builtin_bit_cast(U, b);  // __metal_simd_xor takes float)
    return __builtin_bit_cast(T, (U)(OP == OP_AND ? x & y : OP == OP_OR ? x | y : x ^ y));
  } else if constexpr (OP == OP_AND) return a & b;
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
// The call site of a collective or barrier: a defaulted last parameter evaluated where the call is written
// (file, line, column), so that no optimisation can merge two sites and a user function may share the name of
// a standard one (MLX defines its own bfloat simd_sum).  Sites of one file increase in source order.
#define __EMU_SITE                                                                                          \
  uintptr_t __emu_site = ((uintptr_t)__builtin_FILE() & 0xFFFFFull) << 40 | (uintptr_t)__builtin_LINE() << 12 | \
                         (uintptr_t)__builtin_COLUMN()
}  // namespace __emu

namespace metal {
struct simd_vote {
  typedef ulong vote_t;
  vote_t __v;
  explicit constexpr operator vote_t() const { return __v; }
  explicit constexpr operator bool() const { return __v != 0; }
  bool all() const { return __v == 0xFFFFFFFFull; }
  bool any() const { return __v != 0; }
};

#define __EMU_SIMD1(NAME, OP, G)                                                                     \
  template <class T>                                                                                 \
  inline T NAME(T v, __EMU_SITE) {                                                                   \
    return __emu::simd_exchange<T>(v, 0, __emu_site, &__emu::resolve<T, __emu::OP, G>);              \
  }
#define __EMU_SIMD2(NAME, OP, G)                                                                     \
  template <class T, class I>                                                                        \
  inline T NAME(T v, I a, __EMU_SITE) {                                                              \
    return __emu::simd_exchange<T>(v, (uint32_t)a, __emu_site, &__emu::resolve<T, __emu::OP, G>);    \
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
}  // namespace metal
namespace __emu {
// simd_shuffle_and_fill_down/up: lane r of a segment of `modulo` lanes takes data from lane r + delta (down) or
// r - delta (up) of its segment, and filling_data from the lane that many places past the segment's other end
template <class T, bool DOWN>
void fill_resolve(SimdGroup& g, uint32_t mask, uint32_t width) {
  for (uint32_t l = 0; l < width; l++) {
    if (!(mask >> l & 1)) continue;
    const uint32_t delta = g.arg[l] & 0xFFFFu, m = g.arg[l] >> 16 ? g.arg[l] >> 16 : kSimdWidth;
    const uint32_t base = l - l % m, r = l % m;
    int64_t src;
    bool fill;
    if (DOWN) { fill = r + delta >= m; src = base + (fill ? r + delta - m : r + delta); }
    else { fill = r < delta; src = base + (fill ? m + r - delta : r - delta); }
    if (src >= (int64_t)width || !(mask >> src & 1)) memset(g.out[l], 0xFF, sizeof(T));
    else memcpy(g.out[l], g.in[src] + (fill ? sizeof(T) : 0), sizeof(T));
  }
}
template <class T, bool DOWN>
inline T shuffle_fill(T v, T fill, uint32_t delta, uint32_t modulo, uintptr_t site) {
  struct Pair { T v, f; };
  Pair out = simd_exchange(Pair{v, fill}, (delta & 0xFFFFu) | (modulo & 0xFFFFu) << 16, site, &fill_resolve<T, DOWN>);
  return out.v;
}
}  // namespace __emu
namespace metal {
#define __EMU_FILL(NAME, DOWN)                                                                          \
  template <class T, class D>                                                                             \
  inline T NAME(T v, T fill, D delta, __EMU_SITE) {                                                       \
    return __emu::shuffle_fill<T, DOWN>(v, fill, (uint32_t)delta, 32, __emu_site);                        \
  }                                                                                                       \
  template <class T, class D, class M>                                                                    \
  inline T NAME(T v, T fill, D delta, M modulo, __EMU_SITE) {                                             \
    return __emu::shuffle_fill<T, DOWN>(v, fill, (uint32_t)delta, (uint32_t)modulo, __emu_site);          \
  }
__EMU_FILL(simd_shuffle_and_fill_down, true)
__EMU_FILL(simd_shuffle_and_fill_up, false)
#undef __EMU_FILL

#define __EMU_VOTE(OP, V, G) __emu::simd_exchange<uint64_t>((V), 0, __emu_site, &__emu::resolve<uint64_t, __emu::OP, G>)
inline bool quad_all(bool b, __EMU_SITE) { return (bool)__EMU_VOTE(OP_ALL, b, 4); }
inline bool quad_any(bool b, __EMU_SITE) { return (bool)__EMU_VOTE(OP_ANY, b, 4); }
inline bool quad_is_first(__EMU_SITE) { return (bool)__EMU_VOTE(OP_IS_FIRST, 1, 4); }
inline bool simd_all(bool b, __EMU_SITE) { return (bool)__EMU_VOTE(OP_ALL, b, 32); }
inline bool simd_any(bool b, __EMU_SITE) { return (bool)__EMU_VOTE(OP_ANY, b, 32); }
inline simd_vote simd_ballot(bool b, __EMU_SITE) { return simd_vote{__EMU_VOTE(OP_BALLOT, b, 32)}; }
inline bool simd_is_first(__EMU_SITE) { return (bool)__EMU_VOTE(OP_IS_FIRST, 1, 32); }
inline simd_vote simd_active_threads_mask(__EMU_SITE) { return simd_vote{__EMU_VOTE(OP_BARRIER, 1, 32)}; }
#undef __EMU_VOTE
inline void simdgroup_barrier(mem_flags, __EMU_SITE) {
  (void)__emu::simd_exchange<uint64_t>(1, 0, __emu_site, &__emu::resolve<uint64_t, __emu::OP_BARRIER>);
  __emu::cur().sepoch++;  // orders this lane's accesses after its simdgroup's earlier ones (race detector)
}
inline void threadgroup_barrier(mem_flags, __EMU_SITE) { __emu::barrier(__emu_site); }
}  // namespace metal

// ------------------------------------------------------------------ simdgroup matrices
// Each lane holds the two elements the hardware gives it (thread_elements()): lane l of the simdgroup holds row
// (q & 4) + (l / 2) % 4, columns c and c + 1, with q = l / 4 and c = 2 (q & 2) + 2 (l % 2).  simdgroup_load/store
// move each lane's own elements (race-checked like any access); a product is a collective of the 32 lanes.
namespace __emu {
inline void sg_coord(int& r, int& c) {
  const uint32_t l = cur().lin % kSimdWidth, q = l / 4;
  r = (int)((q & 4) + (l / 2) % 4);
  c = (int)(2 * (q & 2) + 2 * (l % 2));
}
template <class TA, class TB, class TC>
struct MmaSlot {
  TA a[2];
  TB b[2];
  TC c[2];
};
// d = a * b + c for the lanes of one simdgroup; without all 32 lanes the product is undefined (NaN bytes)
template <class TD, class TA, class TB, class TC, uint32_t G = kSimdWidth>
void mma_resolve(SimdGroup& g, uint32_t mask, uint32_t width) {
  if (width != kSimdWidth || mask != 0xFFFFFFFFu) {
    for (uint32_t l = 0; l < width; l++)
      if (mask >> l & 1) memset(g.out[l], 0xFF, sizeof(MmaSlot<TA, TB, TC>));
    return;
  }
  float A[8][8], B[8][8], C[8][8];
  for (uint32_t l = 0; l < kSimdWidth; l++) {
    const uint32_t q = l / 4, r = (q & 4) + (l / 2) % 4, c = 2 * (q & 2) + 2 * (l % 2);
    MmaSlot<TA, TB, TC> v;
    memcpy(&v, g.in[l], sizeof v);
    for (int j = 0; j < 2; j++) {
      A[r][c + j] = (float)v.a[j];
      B[r][c + j] = (float)v.b[j];
      C[r][c + j] = (float)v.c[j];
    }
  }
  for (uint32_t l = 0; l < kSimdWidth; l++) {
    const uint32_t q = l / 4, r = (q & 4) + (l / 2) % 4, c = 2 * (q & 2) + 2 * (l % 2);
    TD d[2];
    for (int j = 0; j < 2; j++) {
      float acc = C[r][c + j];
      for (int k = 0; k < 8; k++) acc += A[r][k] * B[k][c + j];
      d[j] = (TD)acc;
    }
    memcpy(g.out[l], d, sizeof d);
  }
}
}  // namespace __emu

namespace metal {
template <class T, int Cols, int Rows = Cols>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "MSL simdgroup matrices are 8x8");
  vec<T, 2> __e;
  simdgroup_matrix() = default;
  explicit simdgroup_matrix(T diag) {
    int r, c;
    __emu::sg_coord(r, c);
    __e[0] = r == c ? diag : (T)0;
    __e[1] = r == c + 1 ? diag : (T)0;
  }
  vec<T, 2>& thread_elements() { return __e; }
  const vec<T, 2>& thread_elements() const { return __e; }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;
template <class T, int C, int R = C>
inline simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(T v) {
  simdgroup_matrix<T, C, R> m;
  m.__e[0] = m.__e[1] = v;
  return m;
}
template <class T, int C, int R, class U, class O = ulong2>
__attribute__((no_sanitize("thread"), noinline)) inline void simdgroup_load(simdgroup_matrix<T, C, R>& d, const U* src,
                                                                            ulong elements_per_row = C, O origin = O(0),
                                                                            bool transpose = false) {
  const ulong2 o = __emu::vec<ulong2>(origin);  // an ulong2, or a scalar written for it (`0`)
  const ulong ox = o[0], oy = o[1];
  int r, c;
  __emu::sg_coord(r, c);
  __EMU_PROF(__emu::prof_matrix(src, elements_per_row, ox, oy, r, c, transpose, false, (uintptr_t)__builtin_return_address(0));)
  for (int j = 0; j < 2; j++)
    d.__e[j] = (T)(transpose ? src[(oy + c + j) * elements_per_row + ox + r] : src[(oy + r) * elements_per_row + ox + c + j]);
}
template <class T, int C, int R, class U, class O = ulong2>
__attribute__((no_sanitize("thread"), noinline)) inline void simdgroup_store(const simdgroup_matrix<T, C, R>& a, U* dst,
                                                                             ulong elements_per_row = C, O origin = O(0),
                                                                             bool transpose = false) {
  const ulong2 o = __emu::vec<ulong2>(origin);  // an ulong2, or a scalar written for it (`0`)
  const ulong ox = o[0], oy = o[1];
  int r, c;
  __emu::sg_coord(r, c);
  __EMU_PROF(__emu::prof_matrix(dst, elements_per_row, ox, oy, r, c, transpose, true, (uintptr_t)__builtin_return_address(0));)
  for (int j = 0; j < 2; j++) {
    if (transpose) dst[(oy + c + j) * elements_per_row + ox + r] = (U)a.__e[j];
    else dst[(oy + r) * elements_per_row + ox + c + j] = (U)a.__e[j];
  }
}
template <class TD, class TA, class TB, class TC, int N>
inline void simdgroup_multiply_accumulate(simdgroup_matrix<TD, N, N>& d, const simdgroup_matrix<TA, N, N>& a,
                                          const simdgroup_matrix<TB, N, N>& b, const simdgroup_matrix<TC, N, N>& c,
                                          __EMU_SITE) {
  // one 8x8x8 multiply-accumulate of the simdgroup: 512 MACs (on 16-bit operands: the FP16 pipeline)
  __EMU_PROF(__emu::prof_mma(sizeof(TA) == 2 && sizeof(TB) == 2);)
  __emu::MmaSlot<TA, TB, TC> in{{a.__e[0], a.__e[1]}, {b.__e[0], b.__e[1]}, {c.__e[0], c.__e[1]}};
  auto out = __emu::simd_exchange(in, 0, __emu_site, &__emu::mma_resolve<TD, TA, TB, TC>);
  TD res[2];
  memcpy(res, &out, sizeof res);
  d.__e[0] = res[0];
  d.__e[1] = res[1];
}
template <class TD, class TA, class TB, int N>
inline void simdgroup_multiply(simdgroup_matrix<TD, N, N>& d, const simdgroup_matrix<TA, N, N>& a,
                               const simdgroup_matrix<TB, N, N>& b, __EMU_SITE) {
  simdgroup_multiply_accumulate(d, a, b, make_filled_simdgroup_matrix<TD, N, N>((TD)0), __emu_site);
}
// a * b (a product: the collective, its site the caller's return address -- an operator has no defaulted
// parameter), a + b and a - b (element-wise, each lane its own elements)
template <class T, int N>
__attribute__((noinline)) simdgroup_matrix<T, N, N> operator*(const simdgroup_matrix<T, N, N>& a,
                                                             const simdgroup_matrix<T, N, N>& b) {
  simdgroup_matrix<T, N, N> d;
  simdgroup_multiply(d, a, b, (uintptr_t)__builtin_return_address(0));
  return d;
}
template <class T, int N>
inline simdgroup_matrix<T, N, N> operator+(const simdgroup_matrix<T, N, N>& a, const simdgroup_matrix<T, N, N>& b) {
  simdgroup_matrix<T, N, N> d;
  d.__e = a.__e + b.__e;
  return d;
}
template <class T, int N>
inline simdgroup_matrix<T, N, N> operator-(const simdgroup_matrix<T, N, N>& a, const simdgroup_matrix<T, N, N>& b) {
  simdgroup_matrix<T, N, N> d;
  d.__e = a.__e - b.__e;
  return d;
}
}  // namespace metal

// Apple's standard-library intrinsics, which real kernels call directly (MLX's bf16_math.h):
// __metal_exp(x, __METAL_MAYBE_FAST_MATH__) & co.; the math-mode argument changes nothing here.
#define __EMU_INTRIN1(NAME, FN) \
  template <class T, class... M> inline T __metal_##NAME(T x, M...) { return metal::FN(x); }
#define __EMU_INTRIN2(NAME, FN) \
  template <class T, class U, class... M> inline T __metal_##NAME(T x, U y, M...) { return metal::FN(x, y); }
#define __EMU_INTRIN3(NAME, FN) \
  template <class T, class U, class V, class... M> inline T __metal_##NAME(T x, U y, V z, M...) { return metal::FN(x, y, z); }
__EMU_INTRIN1(fabs, fabs) __EMU_INTRIN1(acos, acos) __EMU_INTRIN1(acosh, acosh) __EMU_INTRIN1(asin, asin)
__EMU_INTRIN1(asinh, asinh) __EMU_INTRIN1(atan, atan) __EMU_INTRIN1(atanh, atanh) __EMU_INTRIN1(ceil, ceil)
__EMU_INTRIN1(cos, cos) __EMU_INTRIN1(cosh, cosh) __EMU_INTRIN1(cospi, cospi) __EMU_INTRIN1(exp, exp)
__EMU_INTRIN1(exp10, exp10) __EMU_INTRIN1(exp2, exp2) __EMU_INTRIN1(floor, floor) __EMU_INTRIN1(fract, fract)
__EMU_INTRIN1(log, log) __EMU_INTRIN1(log10, log10) __EMU_INTRIN1(log2, log2) __EMU_INTRIN1(rint, rint)
__EMU_INTRIN1(round, round) __EMU_INTRIN1(rsqrt, rsqrt) __EMU_INTRIN1(sin, sin) __EMU_INTRIN1(sinh, sinh)
__EMU_INTRIN1(sinpi, sinpi) __EMU_INTRIN1(sqrt, sqrt) __EMU_INTRIN1(tan, tan) __EMU_INTRIN1(tanh, tanh)
__EMU_INTRIN1(tanpi, tanpi) __EMU_INTRIN1(trunc, trunc)
__EMU_INTRIN2(atan2, atan2) __EMU_INTRIN2(divide, divide) __EMU_INTRIN2(fmax, fmax) __EMU_INTRIN2(fmin, fmin)
__EMU_INTRIN2(fmod, fmod) __EMU_INTRIN2(nextafter, nextafter) __EMU_INTRIN2(pow, pow) __EMU_INTRIN2(powr, powr)
__EMU_INTRIN2(ldexp, ldexp)
__EMU_INTRIN3(fma, fma) __EMU_INTRIN3(fmax3, fmax3) __EMU_INTRIN3(fmin3, fmin3) __EMU_INTRIN3(fmedian3, fmedian3)
#undef __EMU_INTRIN1
#undef __EMU_INTRIN2
#undef __EMU_INTRIN3
template <class T> inline T __metal_frexp(T x, int* e) { return metal::frexp(x, *e); }
#define __EMU_SIMD_INTRIN(NAME) \
  template <class T, class... A> inline T __metal_##NAME(T v, A... a) { return metal::NAME(v, a...); }
__EMU_SIMD_INTRIN(simd_sum) __EMU_SIMD_INTRIN(simd_product) __EMU_SIMD_INTRIN(simd_min) __EMU_SIMD_INTRIN(simd_max)
__EMU_SIMD_INTRIN(simd_and) __EMU_SIMD_INTRIN(simd_or) __EMU_SIMD_INTRIN(simd_xor)
__EMU_SIMD_INTRIN(simd_prefix_exclusive_sum) __EMU_SIMD_INTRIN(simd_prefix_inclusive_sum)
__EMU_SIMD_INTRIN(simd_prefix_exclusive_product) __EMU_SIMD_INTRIN(simd_prefix_inclusive_product)
__EMU_SIMD_INTRIN(simd_broadcast) __EMU_SIMD_INTRIN(simd_shuffle) __EMU_SIMD_INTRIN(simd_shuffle_xor)
__EMU_SIMD_INTRIN(simd_shuffle_up) __EMU_SIMD_INTRIN(simd_shuffle_down) __EMU_SIMD_INTRIN(simd_shuffle_rotate_up)
__EMU_SIMD_INTRIN(simd_shuffle_rotate_down) __EMU_SIMD_INTRIN(simd_broadcast_first)
#undef __EMU_SIMD_INTRIN
template <class T, class D, class M>
inline T __metal_simd_shuffle_and_fill_down(T v, T fill, D delta, M modulo) {
  return metal::simd_shuffle_and_fill_down(v, fill, delta, modulo);
}
template <class T, class D, class M>
inline T __metal_simd_shuffle_and_fill_up(T v, T fill, D delta, M modulo) {
  return metal::simd_shuffle_and_fill_up(v, fill, delta, modulo);
}
template <class T> inline T __metal_get_simdgroup_size(T) { return (T)__emu::kSimdWidth; }
template <class T> inline T __metal_get_thread_index_in_simdgroup(T) { return (T)(__emu::cur().lin % __emu::kSimdWidth); }

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
