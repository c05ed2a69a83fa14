// FP8 <-> float conversion kernels (e4m3fn, e5m2), with a tensorwise or per-row scale.
//
// decode: dst[i] = OUT(decode(src[i]) * scale)           (fp32 product, one rounding to OUT)
// encode: dst[i] = encode_saturating(float(src[i]) / scale)   (correctly rounded fp32 division)
//
// scale_mode: 0 = no scale, 1 = tensorwise (scale[0]), 2 = per row (scale[i / row_len]).
// Each thread handles 4 consecutive elements (one uchar4 load or store; the host keeps the byte
// buffer 4-byte aligned), with a scalar tail for sizes that are not a multiple of 4, and strides by
// `nthreads * 4` so any size (past 2^31, past the grid limit) is covered with 64-bit indices.
// The helpers fp8_*_to_float / fp8_float_to_* live in common.metal.

#define FP8_SCALE_AT(i) (scale_mode == 0 ? 1.0f : scale[scale_mode == 1 ? 0 : (i) / row_len])

// Stores round once from fp32 to the output type with round-to-nearest-even (bf16 through the
// explicit bit helper of common.metal, so the result never depends on the compiler's conversion mode).
inline void fp8_store(device float* p, float v) { *p = v; }
inline void fp8_store(device half* p, float v) { *p = half(v); }
inline void fp8_store(device bfloat* p, float v) { *p = as_type<bfloat>(bf16_bits_from_float(v)); }

#define FP8_DECODE_KERNEL(NAME, DECODE, OUT)                                                  \
kernel void NAME(device const uchar* src [[buffer(0)]],                                      \
                 device OUT* dst [[buffer(1)]],                                              \
                 device const float* scale [[buffer(2)]],                                    \
                 constant long& n [[buffer(3)]],                                             \
                 constant long& row_len [[buffer(4)]],                                       \
                 constant long& scale_mode [[buffer(5)]],                                    \
                 constant long& nthreads [[buffer(6)]],                                      \
                 uint gid [[thread_position_in_grid]]) {                                     \
    for (long i = long(gid) * 4; i < n; i += nthreads * 4) {                                 \
        if (i + 4 <= n) {                                                                    \
            const uchar4 b = *((device const uchar4*)(src + i));                             \
            fp8_store(dst + i + 0, DECODE(b.x) * FP8_SCALE_AT(i + 0));                             \
            fp8_store(dst + i + 1, DECODE(b.y) * FP8_SCALE_AT(i + 1));                             \
            fp8_store(dst + i + 2, DECODE(b.z) * FP8_SCALE_AT(i + 2));                             \
            fp8_store(dst + i + 3, DECODE(b.w) * FP8_SCALE_AT(i + 3));                             \
        } else {                                                                             \
            for (long j = i; j < n; ++j) {                                                   \
                fp8_store(dst + j, DECODE(src[j]) * FP8_SCALE_AT(j));                              \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
}

FP8_DECODE_KERNEL(fp8_decode_e4m3fn_float, fp8_e4m3fn_to_float, float)
FP8_DECODE_KERNEL(fp8_decode_e4m3fn_half, fp8_e4m3fn_to_float, half)
FP8_DECODE_KERNEL(fp8_decode_e4m3fn_bfloat, fp8_e4m3fn_to_float, bfloat)
FP8_DECODE_KERNEL(fp8_decode_e5m2_float, fp8_e5m2_to_float, float)
FP8_DECODE_KERNEL(fp8_decode_e5m2_half, fp8_e5m2_to_float, half)
FP8_DECODE_KERNEL(fp8_decode_e5m2_bfloat, fp8_e5m2_to_float, bfloat)

// x / s, correctly rounded (fast math would allow a 2.5-ulp division, which can move a value across
// an fp8 rounding boundary). A NaN input skips the division so its sign survives, as on the CPU.
inline float fp8_scaled(float v, float s, long scale_mode) {
    if (scale_mode == 0 || (as_type<uint>(v) & 0x7FFFFFFFu) > 0x7F800000u) return v;
    return precise::divide(v, s);
}

#define FP8_ENCODE_KERNEL(NAME, IN, ENCODE)                                                   \
kernel void NAME(device const IN* src [[buffer(0)]],                                         \
                 device uchar* dst [[buffer(1)]],                                            \
                 device const float* scale [[buffer(2)]],                                    \
                 constant long& n [[buffer(3)]],                                             \
                 constant long& row_len [[buffer(4)]],                                       \
                 constant long& scale_mode [[buffer(5)]],                                    \
                 constant long& nthreads [[buffer(6)]],                                      \
                 uint gid [[thread_position_in_grid]]) {                                     \
    for (long i = long(gid) * 4; i < n; i += nthreads * 4) {                                 \
        if (i + 4 <= n) {                                                                    \
            uchar4 q;                                                                        \
            q.x = ENCODE(fp8_scaled(float(src[i + 0]), FP8_SCALE_AT(i + 0), scale_mode));    \
            q.y = ENCODE(fp8_scaled(float(src[i + 1]), FP8_SCALE_AT(i + 1), scale_mode));    \
            q.z = ENCODE(fp8_scaled(float(src[i + 2]), FP8_SCALE_AT(i + 2), scale_mode));    \
            q.w = ENCODE(fp8_scaled(float(src[i + 3]), FP8_SCALE_AT(i + 3), scale_mode));    \
            *((device uchar4*)(dst + i)) = q;                                                \
        } else {                                                                             \
            for (long j = i; j < n; ++j) {                                                   \
                dst[j] = ENCODE(fp8_scaled(float(src[j]), FP8_SCALE_AT(j), scale_mode));     \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
}

FP8_ENCODE_KERNEL(fp8_encode_float_e4m3fn, float, fp8_float_to_e4m3fn)
FP8_ENCODE_KERNEL(fp8_encode_half_e4m3fn, half, fp8_float_to_e4m3fn)
FP8_ENCODE_KERNEL(fp8_encode_bfloat_e4m3fn, bfloat, fp8_float_to_e4m3fn)
FP8_ENCODE_KERNEL(fp8_encode_float_e5m2, float, fp8_float_to_e5m2)
FP8_ENCODE_KERNEL(fp8_encode_half_e5m2, half, fp8_float_to_e5m2)
FP8_ENCODE_KERNEL(fp8_encode_bfloat_e5m2, bfloat, fp8_float_to_e5m2)
