// Eight 4-bit values of a 32-bit word at once, through half bits: a few masks and shifts for the whole word,
// no per-value extraction and no integer -> float conversion (half -> float is free). Byte j of the word holds
// values 2j and 2j + 1 (which nibble comes first is the format's). Included after <metal_stdlib>.
//
// nib_e2m1_hi_first(w, a, b): FP4 E2M1 (NVFP4: the FIRST value in the HIGH nibble), values 0..3 in a and
//   4..7 in b, each divided by NIB_E2M1_UNIT (2^14; callers fold it into their scale). A nibble s.e1e0.m placed
//   at half bits 15 (sign) and 11..9 (e1 e0 m) is the half e2m1 * 2^-14 exactly, the subnormal 0.5 included
//   (half's exponent bias 15 is E2M1's 1 + 14, and both formats' subnormals share the exponent step); code 8
//   is -0. Each 16-bit lane holds four nibbles at bits 0, 4, 8, 12 of it: the high nibbles are moved down 3
//   bits and the low ones up 1 (their signs up 4) into two words with one nibble a byte at bits 1..3 and 7;
//   the odd bytes' then sit at half bits 9..11 and 15, the even bytes' after one more shift by 8.
// nib_s4_lo_first(w, a, b): signed 4-bit values -8..7 (two's complement, the first in the LOW nibble).
//   Flipping bit 3 gives v + 8 (0..15): OR-ed into the mantissa of the half 1024 it is 1024 + v + 8 (a low
//   nibble) or 1024 + 16 (v + 8) (a high nibble, in place), and one half subtraction or fma takes the
//   bias (and the 16) off, exactly.
// nib_codes_lo_first(w): the codes 0..15 (first value in the LOW nibble) as bytes: .lo those of values 0, 2,
//   4, 6 and .hi those of 1, 3, 5, 7, each read through as_type<uchar4> (codebook indices).

constant constexpr float NIB_E2M1_UNIT = 16384.0f;
constant constexpr uint NIB_E2M1_MASK = 0x8E008E00u;     // a half's sign and e1 e0 m (bits 15, 11..9), both lanes

inline void nib_e2m1_hi_first(uint w, thread float4& a, thread float4& b) {
    const uint hi = ((w >> 3) & 0x0E0E0E0Eu) | (w & 0x80808080u);            // high nibbles at bits 1..3, 7
    const uint lo = ((w << 1) & 0x0E0E0E0Eu) | ((w << 4) & 0x80808080u);     // low nibbles likewise
    const float2 v26 = float2(as_type<half2>(hi & NIB_E2M1_MASK));             // bytes 1, 3: values 2, 6
    const float2 v04 = float2(as_type<half2>((hi << 8) & NIB_E2M1_MASK));      // bytes 0, 2: values 0, 4
    const float2 v37 = float2(as_type<half2>(lo & NIB_E2M1_MASK));             // values 3, 7
    const float2 v15 = float2(as_type<half2>((lo << 8) & NIB_E2M1_MASK));      // values 1, 5
    a = float4(v04.x, v15.x, v26.x, v37.x);
    b = float4(v04.y, v15.y, v26.y, v37.y);
}

inline void nib_s4_lo_first(uint w, thread float4& a, thread float4& b) {
    const uint u = w ^ 0x88888888u;                                             // v + 8 in every nibble
    const uint u8 = u >> 8;
    const half2 v04 = as_type<half2>((u & 0x000F000Fu) | 0x64006400u) - half2(1032.0h);
    const half2 v26 = as_type<half2>((u8 & 0x000F000Fu) | 0x64006400u) - half2(1032.0h);
    const half2 v15 = fma(as_type<half2>((u & 0x00F000F0u) | 0x64006400u), half2(0.0625h), half2(-72.0h));
    const half2 v37 = fma(as_type<half2>((u8 & 0x00F000F0u) | 0x64006400u), half2(0.0625h), half2(-72.0h));
    a = float4(float(v04.x), float(v15.x), float(v26.x), float(v37.x));
    b = float4(float(v04.y), float(v15.y), float(v26.y), float(v37.y));
}

struct nib_codes {
    uchar4 lo;      // codes of values 0, 2, 4, 6
    uchar4 hi;      // codes of values 1, 3, 5, 7
};

inline nib_codes nib_codes_lo_first(uint w) {
    nib_codes c;
    c.lo = as_type<uchar4>(w & 0x0F0F0F0Fu);
    c.hi = as_type<uchar4>((w >> 4) & 0x0F0F0F0Fu);
    return c;
}
