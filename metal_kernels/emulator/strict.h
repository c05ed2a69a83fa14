// Comfy Metal MSL emulator -- strict front end: MSL 3.1's standard library as *declarations only*, for a
// syntax-only clang-19 pass in C++-for-OpenCL 2021 mode (see strict.py).  The address spaces are real
// here (device/threadgroup/constant/thread -> OpenCL global/local/constant/private; strict.py rejects
// pointers written without one), exceptions and RTTI are off, and no C++ standard library is reachable.  Every function has the
// overloads MSL 3.1 has and no more: math on float/half (bfloat has no math functions in MSL 3.1: a bfloat scalar
// converts to float, and abs/min/max/clamp, which take integers too, are ambiguous for it), integer functions on
// all integer types, SIMD reductions on 32-bit-or-narrower types only.
#pragma OPENCL EXTENSION cl_khr_fp16 : enable
#pragma OPENCL EXTENSION __cl_clang_function_pointers : enable

#define kernel
#define device __global
#define threadgroup __local
#define constant const __constant  // the constant address space implies const
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
#undef __MSLV

namespace __emu {
// MSL construction and casts (strict.py rewrites them as the emulator does): defined where they can be constant
// expressions (scalars, a splat, an element-wise conversion), declared for a concatenation
template <class T> struct __vec_info { typedef T E; static constexpr constant int n = 1; };
template <class T, int N> struct __vec_info<T __attribute__((ext_vector_type(N)))> {
  typedef T E;
  static constexpr constant int n = N;
};
template <class T> struct __vec_info<const T> : __vec_info<T> {};
template <class E, int N> struct packed;
template <class T, int N> struct __vec_info<packed<T, N>> { typedef T E; static constexpr constant int n = N; };
template <bool B, class T = void> struct __enable_if {};
template <class T> struct __enable_if<true, T> { typedef T type; };
template <class T> T&& __declval();
template <class T, T... I> struct __iseq {};
template <class V, class E, class A, int... I> constexpr V __splat(A a, __iseq<int, I...>) { return V{((void)I, (E)a)...}; }
template <class A, class B> struct __same { static constexpr constant bool v = false; };
template <class A> struct __same<A, A> { static constexpr constant bool v = true; };
template <class A, class B> constexpr constant bool __hb = (__same<A, half>::v && __same<B, bfloat>::v) ||
                                                             (__same<A, bfloat>::v && __same<B, half>::v);
// a scalar or class type: constructed as written (half <-> bfloat through float, as MSL allows explicitly)
template <class V, class... A, typename __enable_if<__vec_info<V>::n == 1, int>::type = 0>
constexpr auto vec(A... a) -> decltype(V(a...)) { return V(a...); }
template <class V, class A, typename __enable_if<__vec_info<V>::n == 1 && __hb<V, A>, int>::type = 0>
constexpr V vec(A a) { return (V)(float)a; }
template <class V, typename __enable_if<(__vec_info<V>::n > 1), int>::type = 0>
constexpr V vec() { return V{}; }
template <class V, class A, typename __enable_if<(__vec_info<V>::n > 1) && __vec_info<A>::n == 1 &&
                                                 !__hb<typename __vec_info<V>::E, A>, int>::type = 0>
constexpr V vec(A a) { return __splat<V, typename __vec_info<V>::E>(a, __make_integer_seq<__iseq, int, __vec_info<V>::n>()); }
template <class V, class A, typename __enable_if<(__vec_info<V>::n > 1) && __vec_info<A>::n == 1 &&
                                                 __hb<typename __vec_info<V>::E, A>, int>::type = 0>
constexpr V vec(A a) { return __splat<V, typename __vec_info<V>::E>((float)a, __make_integer_seq<__iseq, int, __vec_info<V>::n>()); }
template <class V, class A, typename __enable_if<(__vec_info<V>::n > 1) && __vec_info<A>::n == __vec_info<V>::n,
                                                 int>::type = 0>
V vec(A a);
template <class V, class A, class B, class... C,
          typename __enable_if<(__vec_info<V>::n > 1) && 2 + sizeof...(C) == __vec_info<V>::n &&
                                   __vec_info<A>::n == 1 && __vec_info<B>::n == 1, int>::type = 0>
constexpr V vec(A a, B b, C... c) { return V{(typename __vec_info<V>::E)a, (typename __vec_info<V>::E)b, (typename __vec_info<V>::E)c...}; }
template <class... A> constexpr constant int __total = (0 + ... + __vec_info<A>::n);
template <class... A> constexpr constant bool __any_vec = (false || ... || (__vec_info<A>::n > 1));
template <class V, class A, class B, class... C,
          typename __enable_if<(__vec_info<V>::n > 1) && __total<A, B, C...> == __vec_info<V>::n &&
                                   __any_vec<A, B, C...>, int>::type = 0>
V vec(A a, B b, C... c);
// boolN (MSL's bool vectors): clang's OpenCL mode has no bool vectors, so they are a class here. What MSL allows:
// a scalar converts implicitly (splat), a braced list of N scalars, element access (.x .. .w, [i]), ! && || == != & |
// ^ giving boolN, explicit conversions to and from the other vectors (__emu::vec); the result of a vector comparison
// converts implicitly (clang gives a signed integer vector of the operands' element size, MSL a boolN): only as a
// prvalue, so a named intN variable does not convert (MSL: no implicit conversion between vector types).
template <class V, int N> struct __cmp_result { static constexpr constant bool v = false; };
#define __MSL_CMP(E) template <int N> struct __cmp_result<E __attribute__((ext_vector_type(N))), N> { \
    static constexpr constant bool v = true; };
__MSL_CMP(char) __MSL_CMP(short) __MSL_CMP(int) __MSL_CMP(long)
#undef __MSL_CMP
template <int N> struct bvec_base;
template <> struct bvec_base<2> { bool x, y; bvec_base() = default; constexpr bvec_base(bool a, bool b) : x(a), y(b) {} };
template <> struct bvec_base<3> {
  bool x, y, z;
  bvec_base() = default;
  constexpr bvec_base(bool a, bool b, bool c) : x(a), y(b), z(c) {}
};
template <> struct bvec_base<4> {
  bool x, y, z, w;
  bvec_base() = default;
  constexpr bvec_base(bool a, bool b, bool c, bool d) : x(a), y(b), z(c), w(d) {}
};
template <int N> struct alignas(N == 2 ? 2 : 4) bvec : bvec_base<N> {
  bvec() = default;
  template <int... I> constexpr bvec(bool s, __iseq<int, I...>) : bvec_base<N>(((void)I, s)...) {}
  constexpr bvec(bool s) : bvec(s, __make_integer_seq<__iseq, int, N>()) {}
  using bvec_base<N>::bvec_base;  // a braced list of N bools ({a, b}; strict.py pads short lists)
  template <class V, typename __enable_if<__cmp_result<V, N>::v, int>::type = 0> bvec(V&& v);
  bool& operator[](int i) __private;
  __global bool& operator[](int i) __global;
  __local bool& operator[](int i) __local;
  const __constant bool& operator[](int i) const __constant;
  const bool& operator[](int i) const __private;
  const __global bool& operator[](int i) const __global;
  const __local bool& operator[](int i) const __local;
  friend bvec operator!(bvec a);
  friend bvec operator~(bvec a);
  friend bvec operator&&(bvec a, bvec b);
  friend bvec operator||(bvec a, bvec b);
  friend bvec operator==(bvec a, bvec b);
  friend bvec operator!=(bvec a, bvec b);
  friend bvec operator&(bvec a, bvec b);
  friend bvec operator|(bvec a, bvec b);
  friend bvec operator^(bvec a, bvec b);
};
template <int N> struct __vec_info<bvec<N>> { typedef bool E; static constexpr constant int n = N; };
// vec<T, N> where a declaration names it (typedef/using, rewritten by strict.py and the emulator): bool -> boolN
template <class T, int N> struct vec_sel { typedef T type __attribute__((ext_vector_type(N))); };
template <int N> struct vec_sel<bool, N> { typedef bvec<N> type; };
template <int N> struct vec_sel<const bool, N> { typedef const bvec<N> type; };
template <class T, int N> using vec_sel_t = typename vec_sel<T, N>::type;
template <class V> struct vcast {};
template <class V, class U> constexpr V operator->*(vcast<V>, U u) { return vec<V>(u); }
template <class T> constexpr T fc_unset() { return T(); }
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

typedef __emu::bvec<2> bool2;
typedef __emu::bvec<3> bool3;
typedef __emu::bvec<4> bool4;

#include "msl_constants.h"

// as_type<T>(x): an operator of the language, visible before `using namespace metal`
template <class T, class U> constexpr T as_type(U u) { return __builtin_bit_cast(T, u); }

// `p += c` / `p -= c` on a pointer with a class (or enum) operand that converts to an integer (MLX's
// integral_constant): C++'s built-in candidates take it, clang's OpenCL mode finds none for an address-space
// qualified pointer (while `p + c` works). Defined as `p = p +/- c`, so only what that accepts is accepted.
template <class P, class C, typename __emu::__enable_if<__is_pointer(P) && (__is_class(C) || __is_enum(C)), int>::type = 0,
          class = decltype(__emu::__declval<P&>() = __emu::__declval<P&>() + __emu::__declval<thread C&>())>
constexpr P& operator+=(P& p, C c) { return p = p + c; }
template <class P, class C, typename __emu::__enable_if<__is_pointer(P) && (__is_class(C) || __is_enum(C)), int>::type = 0,
          class = decltype(__emu::__declval<P&>() = __emu::__declval<P&>() - __emu::__declval<thread C&>())>
constexpr P& operator-=(P& p, C c) { return p = p - c; }

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
template <class T, T v> struct integral_constant {
  static constexpr constant T value = v;
  typedef T value_type;
  typedef integral_constant type;
  constexpr operator value_type() const { return value; }
  constexpr value_type operator()() const { return value; }
};
template <bool B> using bool_constant = integral_constant<bool, B>;
typedef bool_constant<true> true_type;
typedef bool_constant<false> false_type;
template <class T> struct remove_const { typedef T type; };
template <class T> struct remove_const<const T> { typedef T type; };
template <class T> using remove_const_t = typename remove_const<T>::type;
template <class T> struct remove_volatile { typedef T type; };
template <class T> struct remove_volatile<volatile T> { typedef T type; };
template <class T> using remove_volatile_t = typename remove_volatile<T>::type;
template <class T> struct remove_reference { typedef T type; };
template <class T> struct remove_reference<T&> { typedef T type; };
template <class T> struct remove_reference<T&&> { typedef T type; };
template <class T> using remove_reference_t = typename remove_reference<T>::type;
template <class T> struct remove_pointer { typedef T type; };
template <class T> struct remove_pointer<T*> { typedef T type; };
template <class T> struct remove_pointer<T* const> { typedef T type; };
template <class T> using remove_pointer_t = typename remove_pointer<T>::type;
template <class T> struct remove_addrspace { typedef T type; };
template <class T> struct remove_addrspace<__global T> { typedef T type; };
template <class T> struct remove_addrspace<__local T> { typedef T type; };
template <class T> struct remove_addrspace<__constant T> { typedef T type; };
template <class T> struct remove_addrspace<__private T> { typedef T type; };
template <class T> using remove_addrspace_t = typename remove_addrspace<T>::type;
template <class T> struct decay { typedef remove_cv_t<remove_reference_t<T>> type; };
template <class T> using decay_t = typename decay<T>::type;
template <class T> typename remove_reference<T>::type&& declval();
template <class F, class T> struct is_convertible : bool_constant<__is_convertible_to(F, T)> {};
template <class F, class T> constexpr constant bool is_convertible_v = is_convertible<F, T>::value;
template <class B, class D> struct is_base_of : bool_constant<__is_base_of(B, D)> {};
template <class B, class D> constexpr constant bool is_base_of_v = is_base_of<B, D>::value;
template <class T> struct is_class : bool_constant<__is_class(T)> {};
template <class T> constexpr constant bool is_class_v = is_class<T>::value;
template <class T> struct is_enum : bool_constant<__is_enum(T)> {};
template <class T> constexpr constant bool is_enum_v = is_enum<T>::value;
template <class T> struct is_trivially_copyable : bool_constant<__is_trivially_copyable(T)> {};
template <class T> constexpr constant bool is_trivially_copyable_v = is_trivially_copyable<T>::value;
template <class T> struct is_void : is_same<remove_cv_t<T>, void> {};
template <class T> constexpr constant bool is_void_v = is_void<T>::value;
template <class T> struct is_pointer : false_type {};
template <class T> struct is_pointer<T*> : true_type {};
template <class T> constexpr constant bool is_pointer_v = is_pointer<remove_cv_t<T>>::value;
template <class T> struct is_const : false_type {};
template <class T> struct is_const<const T> : true_type {};
template <class T> constexpr constant bool is_const_v = is_const<T>::value;
template <class T> struct is_reference : false_type {};
template <class T> struct is_reference<T&> : true_type {};
template <class T> struct is_reference<T&&> : true_type {};
template <class T> constexpr constant bool is_reference_v = is_reference<T>::value;
template <class T> struct underlying_type { typedef __underlying_type(T) type; };
template <class T> using underlying_type_t = typename underlying_type<T>::type;
template <class... B> struct conjunction : true_type {};
template <class B, class... R> struct conjunction<B, R...> : bool_constant<B::value && conjunction<R...>::value> {};
template <class... B> struct disjunction : false_type {};
template <class B, class... R> struct disjunction<B, R...> : bool_constant<B::value || disjunction<R...>::value> {};
template <class B> struct negation : bool_constant<!B::value> {};
// Apple's internal names (`#pragma METAL internals : enable`, MLX's atomic.h)
template <class... B> using _disjunction = disjunction<B...>;
template <class... B> using _conjunction = conjunction<B...>;

template <class T> struct __elem { typedef T type; static constexpr constant int n = 1; };
#define __MSLE(E, NAME) \
  template <> struct __elem<NAME##2> { typedef E type; static constexpr constant int n = 2; }; \
  template <> struct __elem<NAME##3> { typedef E type; static constexpr constant int n = 3; }; \
  template <> struct __elem<NAME##4> { typedef E type; static constexpr constant int n = 4; };
__MSLE(float, float) __MSLE(half, half) __MSLE(bfloat, bfloat) __MSLE(int, int) __MSLE(uint, uint)
__MSLE(short, short) __MSLE(ushort, ushort) __MSLE(char, char) __MSLE(uchar, uchar) __MSLE(long, long)
__MSLE(ulong, ulong)
#undef __MSLE
template <int N> struct __elem<__emu::bvec<N>> { typedef bool type; static constexpr constant int n = N; };
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
template <class T> struct __signed_s { static constexpr constant bool v = false; };
#define __MSLS(T) template <> struct __signed_s<T> { static constexpr constant bool v = true; };
__MSLS(char) __MSLS(signed char) __MSLS(short) __MSLS(int) __MSLS(long) __MSLS(float) __MSLS(half) __MSLS(bfloat)
#undef __MSLS
// on a class type is_signed is false, not an error
template <class T> struct is_signed { static constexpr constant bool value = __signed_s<remove_cv_t<T>>::v; };
template <class T> constexpr constant bool is_signed_v = is_signed<T>::value;
template <class T> struct is_unsigned { static constexpr constant bool value = is_integral_v<T> && !is_signed<T>::value; };
template <class T> struct is_scalar { static constexpr constant bool value = is_arithmetic_v<T> || is_pointer_v<T> || is_enum_v<T>; };
template <class T> constexpr constant bool is_scalar_v = is_scalar<T>::value;
template <class T> struct is_vector { static constexpr constant bool value = (__elem<remove_cv_t<T>>::n > 1); };
template <class T> constexpr constant bool is_vector_v = is_vector<T>::value;
template <class T> struct vec_elements { static constexpr constant int value = __elem<remove_cv_t<T>>::n; };
template <class T> constexpr constant int vec_elements_v = vec_elements<T>::value;
template <class T> struct make_scalar { typedef __elem_t<T> type; };
template <class T> using make_scalar_t = typename make_scalar<T>::type;
template <class T> struct make_signed { typedef T type; };
template <class T> struct make_unsigned { typedef T type; };
#define __MSLSU(S, U)                                                                              \
  template <> struct make_signed<S> { typedef S type; };                                           \
  template <> struct make_signed<U> { typedef S type; };                                           \
  template <> struct make_unsigned<S> { typedef U type; };                                         \
  template <> struct make_unsigned<U> { typedef U type; };
__MSLSU(char, uchar) __MSLSU(short, ushort) __MSLSU(int, uint) __MSLSU(long, ulong)
#undef __MSLSU
template <> struct make_unsigned<signed char> { typedef uchar type; };
template <> struct make_signed<signed char> { typedef signed char type; };
template <class T> using make_signed_t = typename make_signed<remove_cv_t<T>>::type;
template <class T> using make_unsigned_t = typename make_unsigned<remove_cv_t<T>>::type;
template <class... T> struct common_type;
template <class T> struct common_type<T> { typedef decay_t<T> type; };
template <class A, class B> struct common_type<A, B> { typedef decay_t<decltype(true ? declval<A>() : declval<B>())> type; };
template <class... T> using common_type_t = typename common_type<T...>::type;
template <class T> constexpr constant bool is_unsigned_v = is_unsigned<T>::value;

// numeric_limits: constexpr members, as MSL's (usable in constant expressions)
template <class T> struct numeric_limits { static constexpr constant bool is_specialized = false; };
#define __MSL_NL_INT(T, LO, HI, SIGNED, DIGITS)                                                        \
  template <> struct numeric_limits<T> {                                                             \
    static constexpr constant bool is_specialized = true, is_signed = SIGNED, is_integer = true,      \
                                   is_exact = true, has_infinity = false, has_quiet_NaN = false;       \
    static constexpr constant int digits = DIGITS, radix = 2;                                        \
    static constexpr T min() { return LO; }                                                          \
    static constexpr T lowest() { return LO; }                                                       \
    static constexpr T max() { return HI; }                                                          \
    static constexpr T epsilon() { return 0; }                                                       \
  };
__MSL_NL_INT(bool, false, true, false, 1)
__MSL_NL_INT(char, (char)-128, (char)127, true, 7)
__MSL_NL_INT(signed char, (signed char)-128, (signed char)127, true, 7)
__MSL_NL_INT(uchar, (uchar)0, (uchar)255, false, 8)
__MSL_NL_INT(short, (short)-32768, (short)32767, true, 15)
__MSL_NL_INT(ushort, (ushort)0, (ushort)65535, false, 16)
__MSL_NL_INT(int, INT_MIN, INT_MAX, true, 31)
__MSL_NL_INT(uint, 0u, UINT_MAX, false, 32)
__MSL_NL_INT(long, LONG_MIN, LONG_MAX, true, 63)
__MSL_NL_INT(ulong, 0ul, ULONG_MAX, false, 64)
#undef __MSL_NL_INT
#define __MSL_NL_FP(T, MIN, MAX, EPS, DENORM, DIGITS)                                                  \
  template <> struct numeric_limits<T> {                                                             \
    static constexpr constant bool is_specialized = true, is_signed = true, is_integer = false,       \
                                   is_exact = false, has_infinity = true, has_quiet_NaN = true;        \
    static constexpr constant int digits = DIGITS, radix = 2;                                        \
    static constexpr T min() { return __builtin_bit_cast(T, MIN); }                                  \
    static constexpr T max() { return __builtin_bit_cast(T, MAX); }                                  \
    static constexpr T lowest() { return -max(); }                                                   \
    static constexpr T epsilon() { return __builtin_bit_cast(T, EPS); }                              \
    static constexpr T denorm_min() { return __builtin_bit_cast(T, DENORM); }                        \
    static constexpr T infinity() { return (T)__builtin_inff(); }                                    \
    static constexpr T quiet_NaN() { return (T)__builtin_nanf(""); }                                 \
  };
__MSL_NL_FP(float, 0x00800000u, 0x7F7FFFFFu, 0x34000000u, 1u, 24)
__MSL_NL_FP(half, (ushort)0x0400, (ushort)0x7BFF, (ushort)0x1400, (ushort)1, 11)
__MSL_NL_FP(bfloat, (ushort)0x0080, (ushort)0x7F7F, (ushort)0x3C00, (ushort)1, 8)
#undef __MSL_NL_FP
using ::as_type;
__MSL_VECTOR_TYPES;  // the vector types are metal:: names too (metal::float4)

// ---- vec<T, N>, <metal_array>, <metal_uniform>, <metal_matrix>; members for objects in every address space
template <class T, int N> using vec = T __attribute__((ext_vector_type(N)));
#define COMMA ,
#define __MSL_AS_MEMBERS(RET, NAME, ARGS, BODY)                                                     \
  constexpr RET NAME ARGS __private BODY                                                            \
  constexpr __global RET NAME ARGS __global BODY                                                    \
  constexpr __local RET NAME ARGS __local BODY                                                      \
  constexpr const RET NAME ARGS const __private BODY                                                \
  constexpr const __global RET NAME ARGS const __global BODY                                        \
  constexpr const __local RET NAME ARGS const __local BODY                                          \
  constexpr const __constant RET NAME ARGS const __constant BODY
template <class T, __SIZE_TYPE__ N> struct array {
  T __elems[N ? N : 1];
  __MSL_AS_MEMBERS(T&, operator[], (__SIZE_TYPE__ i), { return __elems[i]; })
  __MSL_AS_MEMBERS(T*, data, (), { return __elems; })
  __MSL_AS_MEMBERS(T*, begin, (), { return __elems; })
  __MSL_AS_MEMBERS(T*, end, (), { return __elems + N; })
  __MSL_AS_MEMBERS(T&, front, (), { return __elems[0]; })
  __MSL_AS_MEMBERS(T&, back, (), { return __elems[N - 1]; })
  static constexpr __SIZE_TYPE__ size() { return N; }
  static constexpr bool empty() { return N == 0; }
};
template <class T> struct uniform {
  T __v;
  uniform() = default;
  constexpr uniform(T v) : __v(v) {}
  constexpr operator T() const { return __v; }
};
template <class T> constexpr uniform<T> make_uniform(T v) { return uniform<T>(v); }
template <class T, int C, int R> struct matrix {
  vec<T, R> columns[C];
  matrix() = default;
  explicit matrix(T diag);
  template <class... V, enable_if_t<sizeof...(V) == C && (is_same_v<V, vec<T, R>> && ...), int> = 0> matrix(V... cols);
  template <class... S, enable_if_t<sizeof...(S) == C * R && (is_arithmetic_v<S> && ...), int> = 0> matrix(S... s);
  template <class U> explicit matrix(matrix<U, C, R> m);
  __MSL_AS_MEMBERS(vec<T COMMA R>&, operator[], (int c), { return columns[c]; })
};
template <class T, int C, int R> vec<T, R> operator*(matrix<T, C, R> m, vec<T, C> v);
template <class T, int C, int R> vec<T, C> operator*(vec<T, R> v, matrix<T, C, R> m);
template <class T, int K, int R, int C> matrix<T, C, R> operator*(matrix<T, K, R> a, matrix<T, C, K> b);
template <class T, int C, int R> matrix<T, C, R> operator+(matrix<T, C, R> a, matrix<T, C, R> b);
template <class T, int C, int R> matrix<T, C, R> operator-(matrix<T, C, R> a, matrix<T, C, R> b);
template <class T, int C, int R, class S, enable_if_t<is_arithmetic_v<S>, int> = 0> matrix<T, C, R> operator*(matrix<T, C, R> a, S s);
template <class T, int C, int R, class S, enable_if_t<is_arithmetic_v<S>, int> = 0> matrix<T, C, R> operator*(S s, matrix<T, C, R> a);
template <class T, int C, int R> matrix<T, R, C> transpose(matrix<T, C, R> m);
__MSL_MATRIX_TYPES(float)
__MSL_MATRIX_TYPES(half)
#undef __MSL_AS_MEMBERS
#undef COMMA

// ---- math (metal_math / metal_common): float and half, scalar and vector; none for bfloat in MSL 3.1
// a bfloat scalar converts to float (the result is float); a bfloat vector does not convert
template <class T> constexpr constant bool __bfs = __bf<T> && __elem<T>::n == 1;
template <class T> constexpr constant bool __bfv = __bf<T> && (__elem<T>::n > 1);
#define __MSL_F1(NAME)                                                          \
  template <class T, enable_if_t<__fm<T>, int> = 0> T NAME(T x);                \
  template <class T, enable_if_t<__bfs<T>, int> = 0> float NAME(T x);           \
  template <class T, enable_if_t<__bfv<T>, int> = 0> T NAME(T x) = delete;
__MSL_F1(fabs) __MSL_F1(floor) __MSL_F1(ceil) __MSL_F1(round) __MSL_F1(rint) __MSL_F1(trunc) __MSL_F1(sqrt)
__MSL_F1(rsqrt) __MSL_F1(exp) __MSL_F1(exp2) __MSL_F1(exp10) __MSL_F1(log) __MSL_F1(log2) __MSL_F1(log10)
__MSL_F1(sin) __MSL_F1(cos) __MSL_F1(tan) __MSL_F1(asin) __MSL_F1(acos) __MSL_F1(atan) __MSL_F1(sinh)
__MSL_F1(cosh) __MSL_F1(tanh) __MSL_F1(asinh) __MSL_F1(acosh) __MSL_F1(atanh) __MSL_F1(sinpi) __MSL_F1(cospi)
__MSL_F1(tanpi) __MSL_F1(fract) __MSL_F1(saturate) __MSL_F1(sign) __MSL_F1(logb)
#undef __MSL_F1
#define __MSL_F2(NAME)                                                                           \
  template <class A, class B, enable_if_t<(__fm<A> || __fm<B>) && __num<A> && __num<B>, int> = 0> \
  __common_t<A, B> NAME(A a, B b);                                                               \
  template <class A, class B, enable_if_t<(__bfs<A> || __bfs<B>) && !__bfv<A> && !__bfv<B> &&          \
                                          (__num<A> || __bfs<A>) && (__num<B> || __bfs<B>), int> = 0>  \
  __common_t<decltype(float() + A()), B> NAME(A a, B b);                                          \
  template <class A, class B, enable_if_t<__bfv<A> || __bfv<B>, int> = 0> A NAME(A a, B b) = delete;
__MSL_F2(pow) __MSL_F2(powr) __MSL_F2(fmin) __MSL_F2(fmax) __MSL_F2(fmod) __MSL_F2(atan2) __MSL_F2(copysign)
__MSL_F2(step) __MSL_F2(fdim) __MSL_F2(divide) __MSL_F2(nextafter)
#undef __MSL_F2
template <class A, class B, class C, enable_if_t<__fm<A> && __num<B> && __num<C>, int> = 0> A fma(A a, B b, C c);
template <class A, class B, class C, enable_if_t<__fm<A> && __num<B> && __num<C>, int> = 0> A mix(A x, B y, C a);
template <class A, class B, class C, enable_if_t<__fm<C> && __num<A> && __num<B>, int> = 0> C smoothstep(A e0, B e1, C x);
template <class A, class B, class C, enable_if_t<__bfs<A> && !__bfv<B> && !__bfv<C>, int> = 0> float fma(A, B, C);
template <class A, class B, class C, enable_if_t<__bfs<A> && !__bfv<B> && !__bfv<C>, int> = 0> float mix(A, B, C);
template <class A, class B, class C, enable_if_t<__bfv<A> || __bfv<B> || __bfv<C>, int> = 0> A fma(A, B, C) = delete;
template <class A, class B, class C, enable_if_t<__bfv<A> || __bfv<B> || __bfv<C>, int> = 0> A mix(A, B, C) = delete;
template <class A, class B, class C, enable_if_t<__fm<A> && __num<B> && __num<C>, int> = 0> A fmin3(A, B, C);
template <class A, class B, class C, enable_if_t<__fm<A> && __num<B> && __num<C>, int> = 0> A fmax3(A, B, C);
template <class A, class B, class C, enable_if_t<__fm<A> && __num<B> && __num<C>, int> = 0> A fmedian3(A, B, C);
template <class T, class I, enable_if_t<__fm<T> && __in<I>, int> = 0> T ldexp(T x, I k);
template <class T, enable_if_t<__fm<T>, int> = 0> T frexp(T x, thread int& e);
template <class T, enable_if_t<__fm<T>, int> = 0> T frexp(T x, thread int* e);
template <class T, enable_if_t<__fm<T>, int> = 0> T modf(T x, thread T& ip);
template <class T, enable_if_t<__fm<T>, int> = 0> T sincos(T x, thread T& c);
template <class T, enable_if_t<__fm<T>, int> = 0> int ilogb(T x);
#define __MSL_P(NAME)                                                              \
  template <class T, enable_if_t<__fm<T> && __elem<T>::n == 1, int> = 0> bool NAME(T x); \
  template <class T, enable_if_t<__fm<T> && (__elem<T>::n > 1), int> = 0> __emu::bvec<__elem<T>::n> NAME(T x); \
  template <class T, enable_if_t<__bfs<T>, int> = 0> bool NAME(T x);                    \
  template <class T, enable_if_t<__bfv<T>, int> = 0> bool NAME(T x) = delete;
__MSL_P(isnan) __MSL_P(isinf) __MSL_P(isfinite) __MSL_P(isnormal) __MSL_P(signbit)
#undef __MSL_P
template <class T, enable_if_t<__fm<T> || __bfs<T>, int> = 0> bool isordered(T x, T y);
template <class T, enable_if_t<__fm<T> || __bfs<T>, int> = 0> bool isunordered(T x, T y);

// ---- abs/min/max/clamp: float, half and every integer type (long included); not bfloat (with the integer
// overloads competing, a bfloat argument is ambiguous)
template <class T, enable_if_t<__num<T>, int> = 0> T abs(T x);
template <class T, enable_if_t<__bf<T>, int> = 0> T abs(T x) = delete;
template <class A, class B, enable_if_t<__num<A> && __num<B>, int> = 0> __common_t<A, B> min(A a, B b);
template <class A, class B, enable_if_t<__num<A> && __num<B>, int> = 0> __common_t<A, B> max(A a, B b);
template <class A, class B, enable_if_t<__bf<A> || __bf<B>, int> = 0> A min(A a, B b) = delete;
// the same-type overloads are plain functions (as in Metal's headers): they beat any user template of the same
// name (c10/metal's max<T, U>) on an exact match
#define __MSL_MM(T) T min(T a, T b); T max(T a, T b);
#define __MSL_MMV(E) __MSL_MM(E) __MSL_MM(E##2) __MSL_MM(E##3) __MSL_MM(E##4)
__MSL_MMV(float) __MSL_MMV(half) __MSL_MMV(char) __MSL_MMV(uchar) __MSL_MMV(short) __MSL_MMV(ushort) __MSL_MMV(int)
__MSL_MMV(uint) __MSL_MMV(long) __MSL_MMV(ulong)
#undef __MSL_MMV
#undef __MSL_MM

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

// metal::fast and metal::precise declare the math functions themselves (a user overload added to either does
// not hide the standard ones)
namespace fast { __MSL_MATH_FUNCTIONS; }
namespace precise { __MSL_MATH_FUNCTIONS; }

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
template <class T, class I, class M, enable_if_t<__simd_move<T>, int> = 0>
T simd_shuffle_and_fill_down(T v, T fill, I d, M modulo);
template <class T, class I, class M, enable_if_t<__simd_move<T>, int> = 0>
T simd_shuffle_and_fill_up(T v, T fill, I d, M modulo);
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
template <class T, int Cols, int Rows = Cols> struct simdgroup_matrix {
  simdgroup_matrix();
  explicit simdgroup_matrix(T diag);
  // this lane's two elements (the hardware layout; see shim.h)
  thread vec<T, 2>& thread_elements() __private;
  const thread vec<T, 2>& thread_elements() const __private;
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;
template <class T, int C, int R = C> simdgroup_matrix<T, C, R> make_filled_simdgroup_matrix(T v);
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
template <class T, int N> simdgroup_matrix<T, N, N> operator*(simdgroup_matrix<T, N, N> a, simdgroup_matrix<T, N, N> b);
template <class T, int N> simdgroup_matrix<T, N, N> operator+(simdgroup_matrix<T, N, N> a, simdgroup_matrix<T, N, N> b);
template <class T, int N> simdgroup_matrix<T, N, N> operator-(simdgroup_matrix<T, N, N> a, simdgroup_matrix<T, N, N> b);
}  // namespace metal

// Apple's standard-library intrinsics, which real kernels call directly (MLX's bf16_math.h)
#define __MSL_INTRIN1(NAME) template <class T, class... M> T __metal_##NAME(T x, M...);
#define __MSL_INTRIN2(NAME) template <class T, class U, class... M> T __metal_##NAME(T x, U y, M...);
#define __MSL_INTRIN3(NAME) template <class T, class U, class V, class... M> T __metal_##NAME(T x, U y, V z, M...);
__MSL_INTRIN1(fabs) __MSL_INTRIN1(acos) __MSL_INTRIN1(acosh) __MSL_INTRIN1(asin) __MSL_INTRIN1(asinh) __MSL_INTRIN1(atan)
__MSL_INTRIN1(atanh) __MSL_INTRIN1(ceil) __MSL_INTRIN1(cos) __MSL_INTRIN1(cosh) __MSL_INTRIN1(cospi) __MSL_INTRIN1(exp)
__MSL_INTRIN1(exp10) __MSL_INTRIN1(exp2) __MSL_INTRIN1(floor) __MSL_INTRIN1(fract) __MSL_INTRIN1(log) __MSL_INTRIN1(log10)
__MSL_INTRIN1(log2) __MSL_INTRIN1(rint) __MSL_INTRIN1(round) __MSL_INTRIN1(rsqrt) __MSL_INTRIN1(sin) __MSL_INTRIN1(sinh)
__MSL_INTRIN1(sinpi) __MSL_INTRIN1(sqrt) __MSL_INTRIN1(tan) __MSL_INTRIN1(tanh) __MSL_INTRIN1(tanpi) __MSL_INTRIN1(trunc)
__MSL_INTRIN1(simd_sum) __MSL_INTRIN1(simd_product) __MSL_INTRIN1(simd_min) __MSL_INTRIN1(simd_max) __MSL_INTRIN1(simd_and)
__MSL_INTRIN1(simd_or) __MSL_INTRIN1(simd_xor) __MSL_INTRIN1(simd_prefix_exclusive_sum)
__MSL_INTRIN1(simd_prefix_inclusive_sum) __MSL_INTRIN1(simd_prefix_exclusive_product)
__MSL_INTRIN1(simd_prefix_inclusive_product) __MSL_INTRIN1(simd_broadcast_first) __MSL_INTRIN1(simd_broadcast)
__MSL_INTRIN1(simd_shuffle) __MSL_INTRIN1(simd_shuffle_xor) __MSL_INTRIN1(simd_shuffle_up) __MSL_INTRIN1(simd_shuffle_down)
__MSL_INTRIN1(simd_shuffle_rotate_up) __MSL_INTRIN1(simd_shuffle_rotate_down)
__MSL_INTRIN2(atan2) __MSL_INTRIN2(divide) __MSL_INTRIN2(fmax) __MSL_INTRIN2(fmin) __MSL_INTRIN2(fmod)
__MSL_INTRIN2(nextafter) __MSL_INTRIN2(pow) __MSL_INTRIN2(powr) __MSL_INTRIN2(ldexp)
__MSL_INTRIN3(fma) __MSL_INTRIN3(fmax3) __MSL_INTRIN3(fmin3) __MSL_INTRIN3(fmedian3)
__MSL_INTRIN3(simd_shuffle_and_fill_down) __MSL_INTRIN3(simd_shuffle_and_fill_up)
#undef __MSL_INTRIN1
#undef __MSL_INTRIN2
#undef __MSL_INTRIN3
template <class T> T __metal_frexp(T x, thread int* e);
template <class T> T __metal_get_simdgroup_size(T);
template <class T> T __metal_get_thread_index_in_simdgroup(T);

namespace __emu {
// stands in for the kernel-scope threadgroup arrays (strict.py rewrites only those inside kernel bodies)
__local void* tg_storage();
}  // namespace __emu
