// Comfy Metal MSL emulator -- what the strict front end (strict.h) and the C++ backend (shim.h) share: the
// constants of MSL 3.1's <metal_math> and <metal_limits> (MAXFLOAT, HALF_MAX, M_PI_F, INT_MAX...), the math-mode
// selectors of Apple's headers (__METAL_FAST_MATH__ & co.), is_function_constant_defined and two name lists.
#pragma once
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
#define M_PI_2_H ((half)M_PI_2_F)
#define M_PI_4_H ((half)M_PI_4_F)
#define M_1_PI_H ((half)M_1_PI_F)
#define M_2_PI_H ((half)M_2_PI_F)
#define M_2_SQRTPI_H ((half)M_2_SQRTPI_F)
#define M_SQRT1_2_H ((half)M_SQRT1_2_F)
#define M_LOG2E_H ((half)M_LOG2E_F)
#define M_LOG10E_H ((half)M_LOG10E_F)
#define M_LN10_H ((half)M_LN10_F)
#define MAXHALF ((half)65504.0f)
#define FLT_DIG 6
#define FLT_MANT_DIG 24
#define FLT_MAX_10_EXP 38
#define FLT_MAX_EXP 128
#define FLT_MIN_10_EXP (-37)
#define FLT_MIN_EXP (-125)
#define FLT_RADIX 2
#define HALF_DIG 2
#define HALF_MANT_DIG 11
#define HALF_MAX_10_EXP 4
#define HALF_MAX_EXP 16
#define HALF_MIN_10_EXP (-4)
#define HALF_MIN_EXP (-13)
#define HALF_RADIX 2
#define HUGE_VAL __builtin_huge_valf()
#define CHAR_BIT 8
#define SCHAR_MAX 127
#define SCHAR_MIN (-128)
#define UCHAR_MAX 255
#define CHAR_MAX SCHAR_MAX
#define CHAR_MIN SCHAR_MIN
#define SHRT_MAX 32767
#define SHRT_MIN (-32768)
#define USHRT_MAX 65535
#define LONG_MAX 0x7fffffffffffffffL
#define LONG_MIN (-0x7fffffffffffffffL - 1)
#define ULONG_MAX 0xffffffffffffffffUL
// math modes of Apple's standard-library intrinsics (__metal_exp(x, __METAL_MAYBE_FAST_MATH__)...)
#define __METAL_FAST_MATH__ true
#define __METAL_PRECISE_MATH__ false
#define __METAL_MAYBE_FAST_MATH__ __METAL_PRECISE_MATH__
// a function constant compiled without a value is undefined (specialised sources have no function constants left)
#define is_function_constant_defined(name) (sizeof(name) == 0)
// the math functions metal::fast and metal::precise declare (using-declarations of the metal:: ones)
#define __MSL_MATH_FUNCTIONS                                                                               \
  using metal::fabs, metal::floor, metal::ceil, metal::round, metal::rint, metal::trunc, metal::sqrt,         \
      metal::rsqrt, metal::exp, metal::exp2, metal::exp10, metal::log, metal::log2, metal::log10, metal::sin, \
      metal::cos, metal::tan, metal::asin, metal::acos, metal::atan, metal::sinh, metal::cosh, metal::tanh,    \
      metal::asinh, metal::acosh, metal::atanh, metal::sinpi, metal::cospi, metal::tanpi, metal::fract,        \
      metal::saturate, metal::sign, metal::pow, metal::powr, metal::fmin, metal::fmax, metal::fmod,           \
      metal::atan2, metal::copysign, metal::step, metal::fdim, metal::divide, metal::fma, metal::mix,        \
      metal::smoothstep, metal::ldexp, metal::frexp, metal::modf, metal::sincos, metal::abs, metal::min,      \
      metal::max, metal::clamp, metal::isnan, metal::isinf, metal::isfinite, metal::signbit, metal::length,   \
      metal::normalize, metal::distance, metal::dot, metal::fmin3, metal::fmax3, metal::fmedian3,           \
      metal::nextafter, metal::logb
// the vector and packed vector types, declared at global scope, as metal:: names
#define __MSL_VECTOR_TYPES \
  using ::float2, ::float3, ::float4, ::half2, ::half3, ::half4, ::bfloat2, ::bfloat3, ::bfloat4, ::int2, \
      ::int3, ::int4, ::uint2, ::uint3, ::uint4, ::short2, ::short3, ::short4, ::ushort2, ::ushort3, ::ushort4, \
      ::char2, ::char3, ::char4, ::uchar2, ::uchar3, ::uchar4, ::long2, ::long3, ::long4, ::ulong2, ::ulong3, \
      ::ulong4, ::bool2, ::bool3, ::bool4, ::packed_float2, ::packed_float3, ::packed_float4, ::packed_half2, \
      ::packed_half3, ::packed_half4, ::packed_bfloat2, ::packed_bfloat3, ::packed_bfloat4, ::packed_int2, \
      ::packed_int3, ::packed_int4, ::packed_uint2, ::packed_uint3, ::packed_uint4, ::packed_short2, \
      ::packed_short3, ::packed_short4, ::packed_ushort2, ::packed_ushort3, ::packed_ushort4, ::packed_char2, \
      ::packed_char3, ::packed_char4, ::packed_uchar2, ::packed_uchar3, ::packed_uchar4
// float4x4 & co. (in namespace metal, after its matrix<T, C, R>)
#define __MSL_MATRIX_TYPES(E)                                                                         \
  typedef matrix<E, 2, 2> E##2x2; typedef matrix<E, 2, 3> E##2x3; typedef matrix<E, 2, 4> E##2x4;       \
  typedef matrix<E, 3, 2> E##3x2; typedef matrix<E, 3, 3> E##3x3; typedef matrix<E, 3, 4> E##3x4;       \
  typedef matrix<E, 4, 2> E##4x2; typedef matrix<E, 4, 3> E##4x3; typedef matrix<E, 4, 4> E##4x4;
