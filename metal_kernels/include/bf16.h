// bfloat16 as raw ushort bits: exact widening, and round-to-nearest-even narrowing that never depends on
// the compiler's conversion mode (torch's float -> bfloat16). Included after <metal_stdlib> (common.metal).

inline float bf16_bits_to_float(ushort b) {
    return as_type<float>(uint(b) << 16);
}

// Round to nearest even; NaN stays a (quiet) NaN with its sign.
inline ushort bf16_bits_from_float(float x) {
    const uint u = as_type<uint>(x);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return ushort((u >> 16) | 0x0040u);
    return ushort((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
