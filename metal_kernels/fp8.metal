// FP8 <-> float conversion kernels (e4m3fn, e5m2), with a tensorwise or per-row scale.
//
// decode: dst[i] = OUT(decode(src[i]) * scale)                  (fp32 product, one rounding to OUT)
// encode: dst[i] = encode_saturating(float(src[i]) / scale)    (correctly rounded fp32 division)
//
// scale_mode: 0 = no scale, 1 = tensorwise (scale[0]), 2 = per row (scale[i / row_len]).
// Each thread handles 4 consecutive elements per step (one uchar4 load or store; the host keeps the
// byte buffer 4-byte aligned), elements past n are skipped one by one (odd sizes), and it strides by
// `nthreads * 4`, so any size (past 2^31 elements, past the grid limit) is covered with 64-bit indices.
// The bit helpers fp8_*_to_float / fp8_float_to_* / bf16_bits_from_float live in common.metal.

// The scales of elements i .. i+3: one 64-bit division per step, then walk across row ends.
// Elements at or past n (the tail of the last step) get 1 and read nothing.
inline float4 fp8_scales4(device const float* scale, long scale_mode, long row_len, long i, long n) {
    if (scale_mode == 0) return float4(1.0f);
    if (scale_mode == 1) return float4(scale[0]);
    long r = i / row_len;
    long row_end = (r + 1) * row_len;
    float4 s = float4(1.0f);
    for (int j = 0; j < 4 && i + j < n; ++j) {
        while (i + j >= row_end) {          // rows shorter than 4 elements end more than once
            r += 1;
            row_end += row_len;
        }
        s[j] = scale[r];
    }
    return s;
}

// Stores round once from fp32 to the output type with round-to-nearest-even (bf16 through the
// explicit bit helper, so the result never depends on the compiler's conversion mode).
inline void fp8_store(device float* p, float v) { *p = v; }
inline void fp8_store(device half* p, float v) { *p = half(v); }
inline void fp8_store(device bfloat* p, float v) { *p = as_type<bfloat>(bf16_bits_from_float(v)); }

#define FP8_KERNEL_SIGNATURE(NAME, IN, OUT)                                                    \
kernel void NAME(device const IN* src [[buffer(0)]],                                          \
                 device OUT* dst [[buffer(1)]],                                               \
                 device const float* scale [[buffer(2)]],                                     \
                 constant long& n [[buffer(3)]],                                              \
                 constant long& row_len [[buffer(4)]],                                        \
                 constant long& scale_mode [[buffer(5)]],                                     \
                 constant long& nthreads [[buffer(6)]],                                       \
                 uint gid [[thread_position_in_grid]])

#define FP8_DECODE_KERNEL(NAME, DECODE, OUT)                                                   \
FP8_KERNEL_SIGNATURE(NAME, uchar, OUT) {                                                      \
    for (long i = long(gid) * 4; i < n; i += nthreads * 4) {                                  \
        const float4 s = fp8_scales4(scale, scale_mode, row_len, i, n);                       \
        if (i + 4 <= n) {                                                                     \
            const uchar4 b = *((device const uchar4*)(src + i));                              \
            fp8_store(dst + i + 0, DECODE(b.x) * s.x);                                        \
            fp8_store(dst + i + 1, DECODE(b.y) * s.y);                                        \
            fp8_store(dst + i + 2, DECODE(b.z) * s.z);                                        \
            fp8_store(dst + i + 3, DECODE(b.w) * s.w);                                        \
        } else {                                                                              \
            for (int j = 0; i + j < n; ++j) fp8_store(dst + i + j, DECODE(src[i + j]) * s[j]); \
        }                                                                                     \
    }                                                                                         \
}

FP8_DECODE_KERNEL(fp8_decode_e4m3fn_float, fp8_e4m3fn_to_float, float)
FP8_DECODE_KERNEL(fp8_decode_e4m3fn_half, fp8_e4m3fn_to_float, half)
FP8_DECODE_KERNEL(fp8_decode_e4m3fn_bfloat, fp8_e4m3fn_to_float, bfloat)
FP8_DECODE_KERNEL(fp8_decode_e5m2_float, fp8_e5m2_to_float, float)
FP8_DECODE_KERNEL(fp8_decode_e5m2_half, fp8_e5m2_to_float, half)
FP8_DECODE_KERNEL(fp8_decode_e5m2_bfloat, fp8_e5m2_to_float, bfloat)

// v / s, correctly rounded even under fast math (PYTORCH_MPS_FAST_MATH=1), where `/` may be 2.5 ulp off
// and move a value across an fp8 rounding boundary. A NaN input skips the division so its sign
// survives, as on the CPU.
inline float fp8_scaled(float v, float s, long scale_mode) {
    if (scale_mode == 0 || (as_type<uint>(v) & 0x7FFFFFFFu) > 0x7F800000u) return v;
    return precise::divide(v, s);
}

#define FP8_ENCODE_KERNEL(NAME, IN, ENCODE)                                                    \
FP8_KERNEL_SIGNATURE(NAME, IN, uchar) {                                                       \
    for (long i = long(gid) * 4; i < n; i += nthreads * 4) {                                  \
        const float4 s = fp8_scales4(scale, scale_mode, row_len, i, n);                       \
        if (i + 4 <= n) {                                                                     \
            uchar4 q;                                                                         \
            q.x = ENCODE(fp8_scaled(float(src[i + 0]), s.x, scale_mode));                     \
            q.y = ENCODE(fp8_scaled(float(src[i + 1]), s.y, scale_mode));                     \
            q.z = ENCODE(fp8_scaled(float(src[i + 2]), s.z, scale_mode));                     \
            q.w = ENCODE(fp8_scaled(float(src[i + 3]), s.w, scale_mode));                     \
            *((device uchar4*)(dst + i)) = q;                                                 \
        } else {                                                                              \
            for (int j = 0; i + j < n; ++j)                                                   \
                dst[i + j] = ENCODE(fp8_scaled(float(src[i + j]), s[j], scale_mode));         \
        }                                                                                     \
    }                                                                                         \
}

FP8_ENCODE_KERNEL(fp8_encode_float_e4m3fn, float, fp8_float_to_e4m3fn)
FP8_ENCODE_KERNEL(fp8_encode_half_e4m3fn, half, fp8_float_to_e4m3fn)
FP8_ENCODE_KERNEL(fp8_encode_bfloat_e4m3fn, bfloat, fp8_float_to_e4m3fn)
FP8_ENCODE_KERNEL(fp8_encode_float_e5m2, float, fp8_float_to_e5m2)
FP8_ENCODE_KERNEL(fp8_encode_half_e5m2, half, fp8_float_to_e5m2)
FP8_ENCODE_KERNEL(fp8_encode_bfloat_e5m2, bfloat, fp8_float_to_e5m2)
