// FP8 (e4m3fn, e5m2) <-> float, exact for all 256 codes of each format.
//
// e4m3fn: 1 sign, 4 exponent bits (bias 7), 3 mantissa bits. No infinities; S.1111.111 is NaN.
//         Max finite 448 (0x7E). Subnormals (exponent 0) are m * 2^-9.
// e5m2:   1 sign, 5 exponent bits (bias 15), 2 mantissa bits: the top byte of an fp16, infinities
//         (S.11111.00) and NaNs (S.11111.{01,10,11}) included. Max finite 57344 (0x7B).
//
// Decode goes through half bits (13 integer ops for 4 values, then one half -> float conversion each):
// * e4m3fn: the 7 low bits placed at half bits 13..7 are the value / 2^8 exactly, normals and subnormals
//   alike (half's exponent bias 15 is 7 + 8, and both formats' subnormals share the exponent step). The
//   sign goes to bit 15. The NaN code would read +-1.875, so its marker bit (the carry of low7 + 1) is
//   moved to half bit 14, which makes the half a NaN. Callers fold FP8_E4M3FN_UNIT (2^8) into their scale.
// * e5m2: the byte shifted to the top of a half.
// Only integer ops and conversions: exact under fast math too (no isnan() that could be folded away).

constant constexpr float FP8_E4M3FN_UNIT = 256.0f;

// The four bytes of w (byte 0 = bits 0..7) as e4m3fn values / FP8_E4M3FN_UNIT, in byte order.
inline float4 fp8_e4m3fn_word(uint w) {
    const uint m = w & 0x7F7F7F7Fu;
    const uint mn = m | ((m + 0x01010101u) & 0x80808080u);        // low 7 bits + NaN marker (bit 7)
    const uint even = ((mn << 7) & 0x7F807F80u) | ((w << 8) & 0x80008000u);     // bytes 0, 2
    const uint odd = ((mn >> 1) & 0x7F807F80u) | (w & 0x80008000u);            // bytes 1, 3
    const float2 e = float2(as_type<half2>(even));
    const float2 o = float2(as_type<half2>(odd));
    return float4(e.x, o.x, e.y, o.y);
}

// The four bytes of w as e5m2 values, in byte order.
inline float4 fp8_e5m2_word(uint w) {
    const float2 e = float2(as_type<half2>((w << 8) & 0xFF00FF00u));
    const float2 o = float2(as_type<half2>(w & 0xFF00FF00u));
    return float4(e.x, o.x, e.y, o.y);
}

// One byte: e4m3fn / FP8_E4M3FN_UNIT, and the e5m2 value.
inline float fp8_e4m3fn_unscaled(uint b) {
    const uint m = b & 0x7Fu;
    const uint mn = m | ((m + 1u) & 0x80u);
    return float(as_type<half>(ushort((mn << 7) | ((b & 0x80u) << 8))));
}

inline float fp8_e5m2_unscaled(uint b) {
    return float(as_type<half>(ushort(b << 8)));
}

inline float fp8_e4m3fn_to_float(uchar byte) { return fp8_e4m3fn_unscaled(uint(byte)) * FP8_E4M3FN_UNIT; }
inline float fp8_e5m2_to_float(uchar byte) { return fp8_e5m2_unscaled(uint(byte)); }

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

// The two formats as element types of the FP8 kernels and the GEMV (include/gemv.h, linear.metal):
// BYTES per value, unit() the factor decoded values carry, decode4(raw, g) values 4g .. 4g + 3 of 16 bytes,
// decode1(p) the value at p, encode(x) the saturating RNE byte.
struct fp8_e4m3fn {
    enum { BYTES = 1 };
    static float unit() { return FP8_E4M3FN_UNIT; }
    static float4 decode4(uint4 raw, int g) { return fp8_e4m3fn_word(raw[g]); }
    static float decode1(device const uchar* p) { return fp8_e4m3fn_unscaled(*p); }
    static uchar encode(float x) { return fp8_float_to_e4m3fn(x); }
};

struct fp8_e5m2 {
    enum { BYTES = 1 };
    static float unit() { return 1.0f; }
    static float4 decode4(uint4 raw, int g) { return fp8_e5m2_word(raw[g]); }
    static float decode1(device const uchar* p) { return fp8_e5m2_unscaled(*p); }
    static uchar encode(float x) { return fp8_float_to_e5m2(x); }
};
