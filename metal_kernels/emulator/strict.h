// Comfy Metal MSL emulator -- strict front end: MSL 3.1's standard library as *declarations only*, for a
// syntax-only clang-19 pass in C++-for-OpenCL 2021 mode (see strict.py).  The address spaces are real
// here (device/threadgroup/constant/thread -> OpenCL global/local/constant/private; strict.py rejects
// pointers written without one), exceptions and RTTI are off, and no C++ standard library is reachable.  Every function has the
// overloads MSL 3.1 has and no more: math on float/half (bfloat has no math functions in MSL 3.1: they are
// deleted here), integer functions on all integer types, SIMD reductions on 32-bit-or-narrower types only.
#pragma OPENCL EXTENSION cl_khr_fp16 : enable

#define kernel
#define device __global
#define threadgroup __local
#define constant __constant
#define thread __private
#define METAL_FUNC inline
#define __METAL_STRICT__ 1

typedef unsigned char uchar;
typedef unsigned short ushort;
typedef unsigned int uint;
typedef unsigned long ulong;
typedef signed char int8_t;
typedef unsigned char uint8_t;
typedef short int16_t;
typedef unsigned short uint16_t;
typedef int int32_t;
typedef unsigned int uint32_t;
typedef long int64_t;
typedef unsigned long uint64_t;
typedef unsigned long size_t;
typedef long ptrdiff_t;
typedef long intptr_t;
typedef unsigned long uintptr_t;
typedef __bf16 bfloat;

#define __MSLV(E, NAME)                                        \
  typedef E NAME##2 __attribute__((ext_vector_type(2)));       \
  typedef E NAME##3 __attribute__((ext_vector_type(3)));       \
  typedef E NAME##4 __attribute__((ext_vector_type(4)));
__MSLV(float, float)
__MSLV(half, half)
__MSLV(bfloat, bfloat)
__MSLV(int, int)
__MSLV(uint, uint)
__MSLV(short, short)
__MSLV(ushort, ushort)
__MSLV(char, char)
__MSLV(uchar, uchar)
__MSLV(long, long)
__MSLV(ulong, ulong)
__MSLV(char, bool)  // OpenCL has no bool vectors; comparisons give int vectors here as in the emulator
#undef __MSLV

namespace __emu {
template <class V, class... A> V vec(A... a);
template <class V> struct vcast {};
template <class V, class U> V operator->*(vcast<V>, U u);
template <class E, int N> struct packed_base;
template <class E> struct packed_base<E, 2> { E x, y; };
template <class E> struct packed_base<E, 3> { E x, y, z; };
template <class E> struct packed_base<E, 4> { E x, y, z, w; };
// packed vectors live in any address space: their members are address-space qualified (as in Metal's headers)
template <class E, int N> struct packed : packed_base<E, N> {
  typedef E vec_t __attribute__((ext_vector_type(N)));
  packed() = default;
  template <class... A> packed(A... a);
  operator vec_t() const __private;
  operator vec_t() const __global;
  operator vec_t() const __local;
  operator vec_t() const __constant;
  E& operator[](int i) __private;
  __global E& operator[](int i) __global;
  __local E& operator[](int i) __local;
  const __constant E& operator[](int i) const __constant;
  const E& operator[](int i) const __private;
  const __global E& operator[](int i) const __global;
  const __local E& operator[](int i) const __local;
  __private packed& operator=(vec_t v) __private;
  __global packed& operator=(vec_t v) __global;
  __local packed& operator=(vec_t v) __local;
};
}  // namespace __emu
#define __MSLP(E, NAME) \
  typedef __emu::packed<E, 2> packed_##NAME##2; typedef __emu::packed<E, 3> packed_##NAME##3; \
  typedef __emu::packed<E, 4> packed_##NAME##4;
__MSLP(float, float)
__MSLP(half, half)
__MSLP(bfloat, bfloat)
__MSLP(int, int)
__MSLP(uint, uint)
__MSLP(short, short)
__MSLP(ushort, ushort)
__MSLP(char, char)
__MSLP(uchar, uchar)
#undef __MSLP

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

namespace metal {
// ---- type traits (metal_type_traits)
template <bool B, class T = void> struct enable_if {};
template <class T> struct enable_if<true, T> { typedef T type; };
template <bool B, class T = void> using enable_if_t = typename enable_if<B, T>::type;
template <bool B, class T, class F> struct conditional { typedef T type; };
template <class T, class F> struct conditional<false, T, F> { typedef F type; };
template <bool B, class T, class F> using conditional_t = typename conditional<B, T, F>::type;
template <class A, class B> struct is_same { static constexpr constant bool value = false; };
template <class A> struct is_same<A, A> { static constexpr constant bool value = true; };
template <class A, class B> constexpr constant bool is_same_v = is_same<A, B>::value;
template <class T> struct remove_cv { typedef T type; };
template <class T> struct remove_cv<const T> { typedef T type; };
template <class T> struct remove_cv<volatile T> { typedef T type; };
template <class T> struct remove_cv<const volatile T> { typedef T type; };
template <class T> using remove_cv_t = typename remove_cv<T>::type;

template <class T> struct __elem { typedef T type; static constexpr constant int n = 1; };
#define __MSLE(E, NAME) \
  template <> struct __elem<NAME##2> { typedef E type; static constexpr constant int n = 2; }; \
  template <> struct __elem<NAME##3> { typedef E type; static constexpr constant int n = 3; }; \
  template <> struct __elem<NAME##4> { typedef E type; static constexpr constant int n = 4; };
__MSLE(float, float) __MSLE(half, half) __MSLE(bfloat, bfloat) __MSLE(int, int) __MSLE(uint, uint)
__MSLE(short, short) __MSLE(ushort, ushort) __MSLE(char, char) __MSLE(uchar, uchar) __MSLE(long, long)
__MSLE(ulong, ulong)
#undef __MSLE
template <class T> using __elem_t = typename __elem<remove_cv_t<T>>::type;

template <class T> struct __is_fp_s { static constexpr constant bool v = false; };
template <> struct __is_fp_s<float> { static constexpr constant bool v = true; };
template <> struct __is_fp_s<half> { static constexpr constant bool v = true; };
template <class T> struct __is_int_s { static constexpr constant bool v = false; };
#define __MSLI(T) template <> struct __is_int_s<T> { static constexpr constant bool v = true; };
__MSLI(char) __MSLI(signed char) __MSLI(uchar) __MSLI(short) __MSLI(ushort) __MSLI(int) __MSLI(uint)
__MSLI(long) __MSLI(ulong) __MSLI(bool)
#undef __MSLI
// math operands: float or half, scalar or vector (not bfloat, not double)
template <class T> constexpr constant bool __fm = __is_fp_s<__elem_t<T>>::v;
template <class T> constexpr constant bool __in = __is_int_s<__elem_t<T>>::v;
template <class T> constexpr constant bool __bf = is_same_v<__elem_t<T>, bfloat>;
// an argument that may be mixed with a float/half/integer operand (literals, scalars)
template <class T> constexpr constant bool __num = __fm<T> || __in<T>;
template <class A, class B> struct __common { typedef decltype(A() + B()) type; };
template <class A, class B> using __common_t = typename __common<remove_cv_t<A>, remove_cv_t<B>>::type;

template <class T> struct is_floating_point { static constexpr constant bool value = __is_fp_s<remove_cv_t<T>>::v || is_same_v<remove_cv_t<T>, bfloat>; };
template <class T> constexpr constant bool is_floating_point_v = is_floating_point<T>::value;
template <class T> struct is_integral { static constexpr constant bool value = __is_int_s<remove_cv_t<T>>::v; };
template <class T> constexpr constant bool is_integral_v = is_integral<T>::value;
template <class T> struct is_arithmetic { static constexpr constant bool value = is_floating_point_v<T> || is_integral_v<T>; };
template <class T> constexpr constant bool is_arithmetic_v = is_arithmetic<T>::value;
template <class T> struct is_signed { static constexpr constant bool value = T(-1) < T(0); };
template <class T> constexpr constant bool is_signed_v = is_signed<T>::value;
template <class T> struct is_unsigned { static constexpr constant bool value = is_integral_v<T> && !(T(-1) < T(0)); };
template <class T> constexpr constant bool is_unsigned_v = is_unsigned<T>::value;

template <class T> struct numeric_limits {
  static constexpr constant bool is_specialized = true;
  static constexpr T max();
  static constexpr T min();
  static constexpr T lowest();
  static constexpr T epsilon();
  static constexpr T infinity();
  static constexpr T quiet_NaN();
  static constexpr T denorm_min();
  static constexpr constant int digits = 0;
};

template <class T, class U> T as_type(U u);

// ---- math (metal_math / metal_common): float and half, scalar and vector; none for bfloat in MSL 3.1
#define __MSL_F1(NAME)                                                          \
  template <class T, enable_if_t<__fm<T>, int> = 0> T NAME(T x);                \
  template <class T, enable_if_t<__bf<T>, int> = 0> T NAME(T x) = delete;
__MSL_F1(fabs) __MSL_F1(floor) __MSL_F1(ceil) __MSL_F1(round) __MSL_F1(rint) __MSL_F1(trunc) __MSL_F1(sqrt)
__MSL_F1(rsqrt) __MSL_F1(exp) __MSL_F1(exp2) __MSL_F1(exp10) __MSL_F1(log) __MSL_F1(log2) __MSL_F1(log10)
__MSL_F1(sin) __MSL_F1(cos) __MSL_F1(tan) __MSL_F1(asin) __MSL_F1(acos) __MSL_F1(atan) __MSL_F1(sinh)
__MSL_F1(cosh) __MSL_F1(tanh) __MSL_F1(asinh) __MSL_F1(acosh) __MSL_F1(atanh) __MSL_F1(sinpi) __MSL_F1(cospi)
__MSL_F1(tanpi) __MSL_F1(fract) __MSL_F1(saturate) __MSL_F1(sign) __MSL_F1(logb)
#undef __MSL_F1
#define __MSL_F2(NAME)                                                                           \
  template <class A, class B, enable_if_t<(__fm<A> || __fm<B>) && __num<A> && __num<B>, int> = 0> \
  __common_t<A, B> NAME(A a, B b);                                                               \
  template <class A, class B, enable_if_t<__bf<A> || __bf<B>, int> = 0> A NAME(A a, B b) = delete;
__MSL_F2(pow) __MSL_F2(powr) __MSL_F2(fmin) __MSL_F2(fmax) __MSL_F2(fmod) __MSL_F2(atan2) __MSL_F2(copysign)
__MSL_F2(step) __MSL_F2(fdim) __MSL_F2(divide) __MSL_F2(nextafter)
#undef __MSL_F2
template <class A, class B, class C, enable_if_t<__fm<A> && __num<B> && __num<C>, int> = 0> A fma(A a, B b, C c);
template <class A, class B, class C, enable_if_t<__fm<A> && __num<B> && __num<C>, int> = 0> A mix(A x, B y, C a);
template <class A, class B, class C, enable_if_t<__fm<C> && __num<A> && __num<B>, int> = 0> C smoothstep(A e0, B e1, C x);
template <class A, class B, class C, enable_if_t<__bf<A> || __bf<B> || __bf<C>, int> = 0> A fma(A, B, C) = delete;
template <class A, class B, class C, enable_if_t<__bf<A> || __bf<B> || __bf<C>, int> = 0> A mix(A, B, C) = delete;
template <class T, class I, enable_if_t<__fm<T> && __in<I>, int> = 0> T ldexp(T x, I k);
template <class T, enable_if_t<__fm<T>, int> = 0> T frexp(T x, thread int& e);
template <class T, enable_if_t<__fm<T>, int> = 0> T modf(T x, thread T& ip);
template <class T, enable_if_t<__fm<T>, int> = 0> T sincos(T x, thread T& c);
template <class T, enable_if_t<__fm<T>, int> = 0> int ilogb(T x);
#define __MSL_P(NAME)                                                              \
  template <class T, enable_if_t<__fm<T> && __elem<T>::n == 1, int> = 0> bool NAME(T x); \
  template <class T, enable_if_t<__fm<T> && (__elem<T>::n > 1), int> = 0> bool4 NAME(T x); \
  template <class T, enable_if_t<__bf<T>, int> = 0> bool NAME(T x) = delete;
__MSL_P(isnan) __MSL_P(isinf) __MSL_P(isfinite) __MSL_P(isnormal) __MSL_P(signbit)
#undef __MSL_P

// ---- abs/min/max/clamp: float, half and every integer type (long included); not bfloat
template <class T, enable_if_t<__num<T>, int> = 0> T abs(T x);
template <class T, enable_if_t<__bf<T>, int> = 0> T abs(T x) = delete;
template <class A, class B, enable_if_t<__num<A> && __num<B>, int> = 0> __common_t<A, B> min(A a, B b);
template <class A, class B, enable_if_t<__num<A> && __num<B>, int> = 0> __common_t<A, B> max(A a, B b);
template <class A, class B, enable_if_t<__bf<A> || __bf<B>, int> = 0> A min(A a, B b) = delete;
template <class A, class B, enable_if_t<__bf<A> || __bf<B>, int> = 0> A max(A a, B b) = delete;
template <class A, class B, class C, enable_if_t<__num<A> && __num<B> && __num<C>, int> = 0> A min3(A, B, C);
template <class A, class B, class C, enable_if_t<__num<A> && __num<B> && __num<C>, int> = 0> A max3(A, B, C);
template <class A, class B, class C, enable_if_t<__num<A> && __num<B> && __num<C>, int> = 0> A median3(A, B, C);
template <class T, class L, class H, enable_if_t<__num<T> && __num<L> && __num<H>, int> = 0> T clamp(T x, L lo, H hi);
template <class T, class L, class H, enable_if_t<__bf<T> || __bf<L> || __bf<H>, int> = 0> T clamp(T, L, H) = delete;
template <class A, class B, class C> A select(A a, B b, C c);
template <class T, enable_if_t<__in<T>, int> = 0> T popcount(T x);
template <class T, enable_if_t<__in<T>, int> = 0> T clz(T x);
template <class T, enable_if_t<__in<T>, int> = 0> T ctz(T x);
template <class T, enable_if_t<__in<T>, int> = 0> T mulhi(T a, T b);
template <class T, enable_if_t<__in<T>, int> = 0> T absdiff(T a, T b);
template <class T, enable_if_t<__in<T>, int> = 0> T addsat(T a, T b);
template <class T, enable_if_t<__in<T>, int> = 0> T subsat(T a, T b);
template <class T, enable_if_t<__in<T>, int> = 0> T hadd(T a, T b);
template <class T, enable_if_t<__in<T>, int> = 0> T rhadd(T a, T b);
template <class T, enable_if_t<__in<T>, int> = 0> T reverse_bits(T x);
template <class T, class S, enable_if_t<__in<T>, int> = 0> T rotate(T v, S i);
template <class T, enable_if_t<__in<T>, int> = 0> T extract_bits(T x, uint offset, uint bits);
template <class T, enable_if_t<__in<T>, int> = 0> T insert_bits(T base, T insert, uint offset, uint bits);
template <class T, enable_if_t<__fm<T> && (__elem<T>::n > 1), int> = 0> __elem_t<T> dot(T a, T b);
template <class T, enable_if_t<__fm<T> && (__elem<T>::n > 1), int> = 0> __elem_t<T> length(T a);
template <class T, enable_if_t<__fm<T> && (__elem<T>::n > 1), int> = 0> __elem_t<T> length_squared(T a);
template <class T, enable_if_t<__fm<T> && (__elem<T>::n > 1), int> = 0> __elem_t<T> distance(T a, T b);
template <class T, enable_if_t<__fm<T> && (__elem<T>::n > 1), int> = 0> T normalize(T a);
template <class T, enable_if_t<__fm<T> && __elem<T>::n == 3, int> = 0> T cross(T a, T b);
template <class T> bool all(T v);
template <class T> bool any(T v);

namespace fast { using namespace metal; }
namespace precise { using namespace metal; }

// ---- synchronisation (metal_compute)
enum class mem_flags : uint { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4,
                              mem_threadgroup_imageblock = 8, mem_object_data = 16 };
constexpr mem_flags operator|(mem_flags a, mem_flags b) { return (mem_flags)((uint)a | (uint)b); }
void threadgroup_barrier(mem_flags f);
void simdgroup_barrier(mem_flags f);

// ---- atomics (metal_atomic): on device or threadgroup memory only
enum memory_order { memory_order_relaxed = 0, memory_order_seq_cst = 5 };
template <class T> struct atomic { T __v; };
// OpenCL 2 has built-in atomic_int & co.: Metal's names are macros here
#define atomic_int metal::atomic<int>
#define atomic_uint metal::atomic<uint>
#define atomic_float metal::atomic<float>
#define atomic_bool metal::atomic<bool>
#define atomic_ulong metal::atomic<ulong>
#define atomic_long metal::atomic<long>
#define __MSL_AT(AS)                                                                                          \
  template <class T> T atomic_load_explicit(const volatile AS atomic<T>* o, memory_order m);                  \
  template <class T, class V> void atomic_store_explicit(volatile AS atomic<T>* o, V v, memory_order m);      \
  template <class T, class V> T atomic_exchange_explicit(volatile AS atomic<T>* o, V v, memory_order m);     \
  template <class T, class V> T atomic_fetch_add_explicit(volatile AS atomic<T>* o, V v, memory_order m);    \
  template <class T, class V> T atomic_fetch_sub_explicit(volatile AS atomic<T>* o, V v, memory_order m);    \
  template <class T, class V> T atomic_fetch_and_explicit(volatile AS atomic<T>* o, V v, memory_order m);    \
  template <class T, class V> T atomic_fetch_or_explicit(volatile AS atomic<T>* o, V v, memory_order m);     \
  template <class T, class V> T atomic_fetch_xor_explicit(volatile AS atomic<T>* o, V v, memory_order m);    \
  template <class T, class V> T atomic_fetch_min_explicit(volatile AS atomic<T>* o, V v, memory_order m);    \
  template <class T, class V> T atomic_fetch_max_explicit(volatile AS atomic<T>* o, V v, memory_order m);    \
  template <class T, class V> bool atomic_compare_exchange_weak_explicit(volatile AS atomic<T>* o,           \
      thread T* expected, V desired, memory_order s, memory_order f);
__MSL_AT(__global)
__MSL_AT(__local)
#undef __MSL_AT

// ---- SIMD-group functions (metal_simdgroup): reductions and scans on types of 32 bits or fewer
// (no long/ulong, no bfloat: MSL 3.1 has none); shuffles on types of 32 bits or fewer.
template <class T> constexpr constant bool __simd_arith = __num<T> && sizeof(__elem_t<T>) <= 4;
template <class T> constexpr constant bool __simd_move = (__num<T> || __bf<T>) && sizeof(__elem_t<T>) <= 4;
#define __MSL_SR(NAME) template <class T, enable_if_t<__simd_arith<T>, int> = 0> T NAME(T v);
__MSL_SR(simd_sum) __MSL_SR(simd_product) __MSL_SR(simd_min) __MSL_SR(simd_max) __MSL_SR(simd_and)
__MSL_SR(simd_or) __MSL_SR(simd_xor) __MSL_SR(simd_prefix_exclusive_sum) __MSL_SR(simd_prefix_inclusive_sum)
__MSL_SR(simd_prefix_exclusive_product) __MSL_SR(simd_prefix_inclusive_product)
__MSL_SR(quad_sum) __MSL_SR(quad_product) __MSL_SR(quad_min) __MSL_SR(quad_max) __MSL_SR(quad_and)
__MSL_SR(quad_or) __MSL_SR(quad_xor) __MSL_SR(quad_prefix_exclusive_sum) __MSL_SR(quad_prefix_inclusive_sum)
#undef __MSL_SR
#define __MSL_SM(NAME) template <class T, class I, enable_if_t<__simd_move<T> && __in<I>, int> = 0> T NAME(T v, I a);
__MSL_SM(simd_shuffle) __MSL_SM(simd_broadcast) __MSL_SM(simd_shuffle_xor) __MSL_SM(simd_shuffle_down)
__MSL_SM(simd_shuffle_up) __MSL_SM(simd_shuffle_rotate_down) __MSL_SM(simd_shuffle_rotate_up)
__MSL_SM(quad_shuffle) __MSL_SM(quad_broadcast) __MSL_SM(quad_shuffle_xor) __MSL_SM(quad_shuffle_down)
__MSL_SM(quad_shuffle_up) __MSL_SM(quad_shuffle_rotate_down) __MSL_SM(quad_shuffle_rotate_up)
#undef __MSL_SM
template <class T, class I, enable_if_t<__simd_move<T>, int> = 0> T simd_shuffle_and_fill_down(T v, T fill, I d);
template <class T, class I, enable_if_t<__simd_move<T>, int> = 0> T simd_shuffle_and_fill_up(T v, T fill, I d);
template <class T, enable_if_t<__simd_move<T>, int> = 0> T simd_broadcast_first(T v);
template <class T, enable_if_t<__simd_move<T>, int> = 0> T quad_broadcast_first(T v);
struct simd_vote {
  ulong v;
  explicit operator ulong() const;
  explicit operator bool() const;
  bool all() const;
  bool any() const;
};
bool simd_all(bool b);
bool simd_any(bool b);
simd_vote simd_ballot(bool b);
bool simd_is_first();
simd_vote simd_active_threads_mask();
bool quad_all(bool b);
bool quad_any(bool b);
bool quad_is_first();

// ---- SIMD-group matrices (metal_simdgroup_matrix)
template <class T, int Cols, int Rows> struct simdgroup_matrix {
  simdgroup_matrix();
  explicit simdgroup_matrix(T diag);
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;
template <class T, int C, int R> simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(T v);
#define __MSL_SG(AS)                                                                                          \
  template <class T, int C, int R, class U>                                                                   \
  void simdgroup_load(thread simdgroup_matrix<T, C, R>& d, const AS U* src, ulong elements_per_row = C,      \
                      ulong2 origin = 0, bool transpose = false);                                             \
  template <class T, int C, int R, class U>                                                                   \
  void simdgroup_store(const thread simdgroup_matrix<T, C, R>& a, AS U* dst, ulong elements_per_row = C,     \
                       ulong2 origin = 0, bool transpose = false);
__MSL_SG(__global)
__MSL_SG(__local)
#undef __MSL_SG
template <class T, int C, int R, class U>
void simdgroup_load(thread simdgroup_matrix<T, C, R>& d, const __constant U* src, ulong elements_per_row = C,
                    ulong2 origin = 0, bool transpose = false);
template <class TD, class TA, class TB, class TC, int N>
void simdgroup_multiply_accumulate(thread simdgroup_matrix<TD, N, N>& d, const thread simdgroup_matrix<TA, N, N>& a,
                                   const thread simdgroup_matrix<TB, N, N>& b, const thread simdgroup_matrix<TC, N, N>& c);
template <class TD, class TA, class TB, int N>
void simdgroup_multiply(thread simdgroup_matrix<TD, N, N>& d, const thread simdgroup_matrix<TA, N, N>& a,
                        const thread simdgroup_matrix<TB, N, N>& b);
}  // namespace metal

namespace __emu {
// stands in for the kernel-scope threadgroup arrays (strict.py rewrites only those inside kernel bodies)
__local void* tg_storage();
}  // namespace __emu
