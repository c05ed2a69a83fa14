// Single-row linear (GEMV) for up to 8 rows of x at once:
//     y[m, n] = (sum_k x[m, k] * w[n, k]) * scale(n) + bias[n]        (fp32 accumulation)
// x: (M, K) fp32 (the host converts the tiny activation), w: (N, K) in its stored type
// (float / half / bfloat / FP8 bytes decoded with the helpers of common.metal), y: (M, N) fp32.
// scale_mode: 0 none, 1 tensorwise scale[0], 2 per output row scale[n]. has_bias: 0 / 1.
//
// One simdgroup computes GEMV_COLS adjacent output columns for all M rows: its 32 lanes stride over K
// (each weight element is read exactly once for all M rows, each x element once per GEMV_COLS
// columns), then `simd_sum` reduces each accumulator. No threadgroup memory and no barriers, so
// the grid is ceil(N / GEMV_COLS) * 32 threads and a partial last threadgroup is harmless: a
// simdgroup is either wholly inside the grid or absent. Any K and N; 64-bit indices.
// Two variants per weight type: scalar (any K) and _k4 (K % 4 == 0 and 4-element aligned rows:
// each lane loads 4 consecutive weights at once).

#define GEMV_MAX_M 8
#define GEMV_COLS 4

#define GEMV_LOAD_SCALAR(p, k) float((p)[k])
#define GEMV_LOAD_E4M3FN(p, k) fp8_e4m3fn_to_float((p)[k])
#define GEMV_LOAD_E5M2(p, k) fp8_e5m2_to_float((p)[k])

#define GEMV_LOAD4_FLOAT(p, k) (*((device const float4*)((p) + (k))))
#define GEMV_LOAD4_HALF(p, k) float4(*((device const half4*)((p) + (k))))
#define GEMV_LOAD4_BFLOAT(p, k) float4(float((p)[(k)]), float((p)[(k) + 1]), float((p)[(k) + 2]), float((p)[(k) + 3]))
inline float4 gemv_load4_e4m3fn(device const uchar* p, long k) {
    const uchar4 b = *((device const uchar4*)(p + k));
    return float4(fp8_e4m3fn_to_float(b.x), fp8_e4m3fn_to_float(b.y), fp8_e4m3fn_to_float(b.z), fp8_e4m3fn_to_float(b.w));
}
inline float4 gemv_load4_e5m2(device const uchar* p, long k) {
    const uchar4 b = *((device const uchar4*)(p + k));
    return float4(fp8_e5m2_to_float(b.x), fp8_e5m2_to_float(b.y), fp8_e5m2_to_float(b.z), fp8_e5m2_to_float(b.w));
}
#define GEMV_LOAD4_E4M3FN(p, k) gemv_load4_e4m3fn((p), (k))
#define GEMV_LOAD4_E5M2(p, k) gemv_load4_e5m2((p), (k))

#define GEMV_SIGNATURE(NAME, WT)                                                              \
kernel void NAME(device const float* x [[buffer(0)]],                                        \
                 device const WT* w [[buffer(1)]],                                           \
                 device const float* scale [[buffer(2)]],                                    \
                 device const float* bias [[buffer(3)]],                                     \
                 device float* y [[buffer(4)]],                                              \
                 constant long& M [[buffer(5)]],                                             \
                 constant long& K [[buffer(6)]],                                             \
                 constant long& N [[buffer(7)]],                                             \
                 constant long& scale_mode [[buffer(8)]],                                    \
                 constant long& has_bias [[buffer(9)]],                                      \
                 uint gid [[thread_position_in_grid]],                                       \
                 uint lane [[thread_index_in_simdgroup]])

// Reduce acc[c][m] across the simdgroup and write y. M and the column count are uniform within the
// simdgroup, so every lane reaches each simd_sum.
#define GEMV_EPILOGUE                                                                         \
    for (int c = 0; c < GEMV_COLS; ++c) {                                                    \
        const long n = n0 + c;                                                               \
        if (n >= N) break;                                                                   \
        const float s = scale_mode == 0 ? 1.0f : scale[scale_mode == 1 ? 0 : n];             \
        const float b = has_bias != 0 ? bias[n] : 0.0f;                                      \
        for (int m = 0; m < GEMV_MAX_M; ++m) {                                               \
            if (m >= M) break;                                                               \
            const float t = simd_sum(acc[c][m]);                                             \
            if (lane == 0) y[long(m) * N + n] = fma(t, s, b);                                \
        }                                                                                    \
    }

#define GEMV_PROLOGUE                                                                         \
    const long n0 = long(gid / 32u) * GEMV_COLS;                                             \
    if (n0 >= N) return;                                                                     \
    const int ncols = int(min(long(GEMV_COLS), N - n0));                                     \
    float acc[GEMV_COLS][GEMV_MAX_M];                                                        \
    for (int c = 0; c < GEMV_COLS; ++c)                                                      \
        for (int m = 0; m < GEMV_MAX_M; ++m) acc[c][m] = 0.0f;

#define GEMV_KERNEL(NAME, WT, LOAD)                                                           \
GEMV_SIGNATURE(NAME, WT) {                                                                   \
    GEMV_PROLOGUE                                                                            \
    for (long k = long(lane); k < K; k += 32) {                                              \
        float xv[GEMV_MAX_M];                                                                \
        for (int m = 0; m < GEMV_MAX_M; ++m) xv[m] = m < M ? x[long(m) * K + k] : 0.0f;      \
        for (int c = 0; c < GEMV_COLS; ++c) {                                                \
            if (c >= ncols) break;                                                           \
            const float wv = LOAD(w + (n0 + c) * K, k);                                      \
            for (int m = 0; m < GEMV_MAX_M; ++m) acc[c][m] = fma(xv[m], wv, acc[c][m]);      \
        }                                                                                    \
    }                                                                                        \
    GEMV_EPILOGUE                                                                            \
}

#define GEMV_KERNEL_K4(NAME, WT, LOAD4)                                                       \
GEMV_SIGNATURE(NAME, WT) {                                                                   \
    GEMV_PROLOGUE                                                                            \
    for (long k = long(lane) * 4; k < K; k += 128) {                                         \
        float4 xv[GEMV_MAX_M];                                                               \
        for (int m = 0; m < GEMV_MAX_M; ++m)                                                 \
            xv[m] = m < M ? *((device const float4*)(x + long(m) * K + k)) : float4(0.0f);   \
        for (int c = 0; c < GEMV_COLS; ++c) {                                                \
            if (c >= ncols) break;                                                           \
            const float4 wv = LOAD4(w + (n0 + c) * K, k);                                    \
            for (int m = 0; m < GEMV_MAX_M; ++m) {                                           \
                float a = acc[c][m];                                                         \
                a = fma(xv[m].x, wv.x, a);                                                   \
                a = fma(xv[m].y, wv.y, a);                                                   \
                a = fma(xv[m].z, wv.z, a);                                                   \
                a = fma(xv[m].w, wv.w, a);                                                   \
                acc[c][m] = a;                                                               \
            }                                                                                \
        }                                                                                    \
    }                                                                                        \
    GEMV_EPILOGUE                                                                            \
}

GEMV_KERNEL(gemv_float, float, GEMV_LOAD_SCALAR)
GEMV_KERNEL(gemv_half, half, GEMV_LOAD_SCALAR)
GEMV_KERNEL(gemv_bfloat, bfloat, GEMV_LOAD_SCALAR)
GEMV_KERNEL(gemv_e4m3fn, uchar, GEMV_LOAD_E4M3FN)
GEMV_KERNEL(gemv_e5m2, uchar, GEMV_LOAD_E5M2)
GEMV_KERNEL_K4(gemv_float_k4, float, GEMV_LOAD4_FLOAT)
GEMV_KERNEL_K4(gemv_half_k4, half, GEMV_LOAD4_HALF)
GEMV_KERNEL_K4(gemv_bfloat_k4, bfloat, GEMV_LOAD4_BFLOAT)
GEMV_KERNEL_K4(gemv_e4m3fn_k4, uchar, GEMV_LOAD4_E4M3FN)
GEMV_KERNEL_K4(gemv_e5m2_k4, uchar, GEMV_LOAD4_E5M2)
