// Shared inline helpers of the Comfy Metal library. This file is compiled FIRST, before every other
// .metal file, into one library: every symbol here must be unique and prefixed (fp8_, bf16_, ...).
// Other domains append their helpers below the marked sections.
//
// Everything here is pure integer bit manipulation on purpose: torch.mps.compile_shader uses safe math
// by default, but PYTORCH_MPS_FAST_MATH=1 (and Metal's own default) turn on fast math, where
// isnan()/isinf() may be folded away and float denormals may be flushed; integer code is exact in both.
#include <metal_stdlib>
using namespace metal;

// ---------------------------------------------------------------------------------------------
// FP8 decode: byte -> float, exact for all 256 codes of each format.
//
// e4m3fn: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits. No infinities; S.1111.111 is NaN.
//         Max finite 448 (0x7E). Subnormals (exponent 0) are m * 2^-9.
// e5m2:   1 sign, 5 exponent bits (bias 15), 2 mantissa bits (IEEE-like: the top byte of an fp16).
//         S.11111.00 is +-inf, S.11111.{01,10,11} are NaN. Max finite 57344 (0x7B). Subnormals m * 2^-16.
// Normals are rebuilt directly as fp32 bits; subnormals as an exact small-integer product, so no fp32
// denormal is ever produced (Apple GPUs may flush those).
// ---------------------------------------------------------------------------------------------
constant constexpr uint FP8_F32_NAN = 0x7FC00000u;
constant constexpr uint FP8_F32_INF = 0x7F800000u;

inline float fp8_e4m3fn_to_float(uchar byte) {
    const uint b = uint(byte);
    const uint sign = (b & 0x80u) << 24;
    const uint e = (b >> 3) & 0xFu;
    const uint m = b & 0x7u;
    uint mag;
    if ((b & 0x7Fu) == 0x7Fu) {
        mag = FP8_F32_NAN;
    } else if (e == 0u) {
        mag = as_type<uint>(float(m) * 0.001953125f);           // m * 2^-9 (exact; 0 for m == 0)
    } else {
        mag = ((e + (127u - 7u)) << 23) | (m << 20);
    }
    return as_type<float>(sign | mag);
}

inline float fp8_e5m2_to_float(uchar byte) {
    const uint b = uint(byte);
    const uint sign = (b & 0x80u) << 24;
    const uint e = (b >> 2) & 0x1Fu;
    const uint m = b & 0x3u;
    uint mag;
    if (e == 31u) {
        mag = (m == 0u) ? FP8_F32_INF : FP8_F32_NAN;
    } else if (e == 0u) {
        mag = as_type<uint>(float(m) * 0.0000152587890625f);    // m * 2^-16
    } else {
        mag = ((e + (127u - 15u)) << 23) | (m << 21);
    }
    return as_type<float>(sign | mag);
}

// ---------------------------------------------------------------------------------------------
// FP8 encode: float -> byte, round to nearest even, SATURATING (|x| beyond the max finite value,
// including +-inf, gives +-max), NaN -> sign | 0x7F. Bit-identical to torch's CPU cast of
// x.clamp(-max, max). Works on the fp32 bit pattern only: an fp32 denormal input gives +-0, which is
// what RNE gives anyway (fp8's smallest subnormal is far above fp32's normal range).
//
// Generic over the format: MBITS mantissa bits, BIAS exponent bias, MAXBITS the fp32 bits of the
// max finite value, MAXCODE its byte.
// ---------------------------------------------------------------------------------------------
inline uchar fp8_encode_bits(uint u, uint MBITS, uint BIAS, uint MAXBITS, uint MAXCODE) {
    const uint sign = (u >> 24) & 0x80u;
    const uint a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return uchar(sign | 0x7Fu);           // NaN keeps its sign
    if (a >= MAXBITS) return uchar(sign | MAXCODE);             // saturate (also +-inf)
    const uint min_normal_bits = (127u + 1u - BIAS) << 23;      // 2^(1 - BIAS)
    uint code;
    if (a >= min_normal_bits) {
        // Normal: drop 23 - MBITS mantissa bits with RNE, then rebias the exponent.
        // A carry out of the mantissa correctly bumps the exponent; a < MAXBITS bounds the result.
        const uint drop = 23u - MBITS;
        const uint r = a + ((1u << (drop - 1u)) - 1u) + ((a >> drop) & 1u);
        code = (r >> drop) - ((127u - BIAS) << MBITS);
    } else {
        // Subnormal (or zero): the result is round(|x| / 2^(1 - BIAS - MBITS)) as an integer,
        // 0 .. 2^MBITS (2^MBITS is the smallest normal, whose code is exactly 2^MBITS).
        const int e = int(a >> 23) - 127;                       // unbiased fp32 exponent
        const uint mant = (a & 0x7FFFFFu) | ((a >> 23) != 0u ? 0x800000u : 0u);
        // |x| = mant * 2^(e - 23) (fp32 denormals: e = -127 and no hidden bit; close enough, -> 0)
        // |x| / unit = mant * 2^(e - 23 - (1 - BIAS - MBITS)) = mant >> shift
        const int shift = 23 + (1 - int(BIAS) - int(MBITS)) - e;
        if (shift >= 26) {
            code = 0u;                                          // mant < 2^24 <= half of 2^shift
        } else {
            const uint q = mant >> uint(shift);
            const uint rem = mant & ((1u << uint(shift)) - 1u);
            const uint half_unit = 1u << uint(shift - 1);
            code = q + ((rem > half_unit || (rem == half_unit && (q & 1u))) ? 1u : 0u);
        }
    }
    return uchar(sign | code);
}

inline uchar fp8_float_to_e4m3fn(float x) {
    return fp8_encode_bits(as_type<uint>(x), 3u, 7u, 0x43E00000u /* 448 */, 0x7Eu);
}

inline uchar fp8_float_to_e5m2(float x) {
    return fp8_encode_bits(as_type<uint>(x), 2u, 15u, 0x47600000u /* 57344 */, 0x7Bu);
}

// ---------------------------------------------------------------------------------------------
// bf16 as raw ushort bits (for buffers bound as uint16 / kernels that avoid the bfloat type).
// ---------------------------------------------------------------------------------------------
inline float bf16_bits_to_float(ushort b) {
    return as_type<float>(uint(b) << 16);
}

// Round to nearest even; NaN stays a (quiet) NaN with its sign. Same as torch's float -> bfloat16.
inline ushort bf16_bits_from_float(float x) {
    const uint u = as_type<uint>(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return ushort((u >> 16) | 0x0040u);
    return ushort((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
