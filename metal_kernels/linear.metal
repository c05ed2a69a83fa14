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
// M is dispatched at run time to a body compiled for exactly that many rows (no wasted FMAs at M = 1).
// Two kernels per weight type: scalar (any K) and _k4 (K % 4 == 0 and 4-element aligned rows:
// each lane loads 4 consecutive weights at once).
// Written in C++14 (Metal's dialect): tag structs and template arguments, no `if constexpr`.

#define GEMV_MAX_M 8
#define GEMV_COLS 4

// Weight loaders: T is the stored element type; load() one weight, load4() four consecutive ones.
struct gemv_w_float {
    typedef float T;
    static float load(device const float* p, long k) { return p[k]; }
    static float4 load4(device const float* p, long k) { return *((device const float4*)(p + k)); }
};
struct gemv_w_half {
    typedef half T;
    static float load(device const half* p, long k) { return float(p[k]); }
    static float4 load4(device const half* p, long k) { return float4(*((device const half4*)(p + k))); }
};
struct gemv_w_bfloat {
    typedef bfloat T;
    static float load(device const bfloat* p, long k) { return float(p[k]); }
    static float4 load4(device const bfloat* p, long k) {
        return float4(float(p[k]), float(p[k + 1]), float(p[k + 2]), float(p[k + 3]));
    }
};
struct gemv_w_e4m3fn {
    typedef uchar T;
    static float load(device const uchar* p, long k) { return fp8_e4m3fn_to_float(p[k]); }
    static float4 load4(device const uchar* p, long k) {
        const uchar4 b = *((device const uchar4*)(p + k));
        return float4(fp8_e4m3fn_to_float(b.x), fp8_e4m3fn_to_float(b.y), fp8_e4m3fn_to_float(b.z),
                      fp8_e4m3fn_to_float(b.w));
    }
};
struct gemv_w_e5m2 {
    typedef uchar T;
    static float load(device const uchar* p, long k) { return fp8_e5m2_to_float(p[k]); }
    static float4 load4(device const uchar* p, long k) {
        const uchar4 b = *((device const uchar4*)(p + k));
        return float4(fp8_e5m2_to_float(b.x), fp8_e5m2_to_float(b.y), fp8_e5m2_to_float(b.z),
                      fp8_e5m2_to_float(b.w));
    }
};

// The columns n0 .. n0 + GEMV_COLS - 1 (those < N) for exactly MM rows of x.
template <typename W, int MM, bool K4>
inline void gemv_columns(device const float* x, device const typename W::T* w, device const float* scale,
                         device const float* bias, device float* y, long K, long N, long scale_mode,
                         long has_bias, long n0, uint lane) {
    const int ncols = N - n0 < GEMV_COLS ? int(N - n0) : GEMV_COLS;
    float acc[GEMV_COLS][MM];
    for (int c = 0; c < GEMV_COLS; ++c)
        for (int m = 0; m < MM; ++m) acc[c][m] = 0.0f;
    if (K4) {
        for (long k = long(lane) * 4; k < K; k += 128) {
            float4 xv[MM];
            for (int m = 0; m < MM; ++m) xv[m] = *((device const float4*)(x + long(m) * K + k));
            for (int c = 0; c < GEMV_COLS; ++c) {
                if (c >= ncols) break;
                const float4 wv = W::load4(w + (n0 + c) * K, k);
                for (int m = 0; m < MM; ++m) {
                    float a = acc[c][m];
                    a = fma(xv[m].x, wv.x, a);
                    a = fma(xv[m].y, wv.y, a);
                    a = fma(xv[m].z, wv.z, a);
                    a = fma(xv[m].w, wv.w, a);
                    acc[c][m] = a;
                }
            }
        }
    } else {
        for (long k = long(lane); k < K; k += 32) {
            float xv[MM];
            for (int m = 0; m < MM; ++m) xv[m] = x[long(m) * K + k];
            for (int c = 0; c < GEMV_COLS; ++c) {
                if (c >= ncols) break;
                const float wv = W::load(w + (n0 + c) * K, k);
                for (int m = 0; m < MM; ++m) acc[c][m] = fma(xv[m], wv, acc[c][m]);
            }
        }
    }
    // Reduce across the simdgroup and write. ncols and MM are uniform within the simdgroup, so every
    // lane reaches each simd_sum.
    for (int c = 0; c < GEMV_COLS; ++c) {
        if (c >= ncols) break;
        const long n = n0 + c;
        const float s = scale_mode == 0 ? 1.0f : scale[scale_mode == 1 ? 0 : n];
        const float b = has_bias != 0 ? bias[n] : 0.0f;
        for (int m = 0; m < MM; ++m) {
            const float t = simd_sum(acc[c][m]);
            if (lane == 0) y[long(m) * N + n] = fma(t, s, b);
        }
    }
}

#define GEMV_CASE(W, MM, K4)                                                                     \
    case MM:                                                                                    \
        gemv_columns<W, MM, K4>(x, w, scale, bias, y, K, N, scale_mode, has_bias, n0, lane);    \
        break;

#define GEMV_KERNEL(NAME, W, K4)                                                                 \
kernel void NAME(device const float* x [[buffer(0)]],                                           \
                 device const W::T* w [[buffer(1)]],                                            \
                 device const float* scale [[buffer(2)]],                                       \
                 device const float* bias [[buffer(3)]],                                        \
                 device float* y [[buffer(4)]],                                                 \
                 constant long& M [[buffer(5)]],                                                \
                 constant long& K [[buffer(6)]],                                                \
                 constant long& N [[buffer(7)]],                                                \
                 constant long& scale_mode [[buffer(8)]],                                       \
                 constant long& has_bias [[buffer(9)]],                                         \
                 uint gid [[thread_position_in_grid]],                                          \
                 uint lane [[thread_index_in_simdgroup]]) {                                     \
    const long n0 = long(gid / 32u) * GEMV_COLS;                                                \
    if (n0 >= N) return;                                                                        \
    switch (M) {                                                                                \
        GEMV_CASE(W, 1, K4) GEMV_CASE(W, 2, K4) GEMV_CASE(W, 3, K4) GEMV_CASE(W, 4, K4)         \
        GEMV_CASE(W, 5, K4) GEMV_CASE(W, 6, K4) GEMV_CASE(W, 7, K4) GEMV_CASE(W, 8, K4)         \
        default: break;                 /* the host never passes M outside 1..GEMV_MAX_M */     \
    }                                                                                           \
}

GEMV_KERNEL(gemv_float, gemv_w_float, false)
GEMV_KERNEL(gemv_half, gemv_w_half, false)
GEMV_KERNEL(gemv_bfloat, gemv_w_bfloat, false)
GEMV_KERNEL(gemv_e4m3fn, gemv_w_e4m3fn, false)
GEMV_KERNEL(gemv_e5m2, gemv_w_e5m2, false)
GEMV_KERNEL(gemv_float_k4, gemv_w_float, true)
GEMV_KERNEL(gemv_half_k4, gemv_w_half, true)
GEMV_KERNEL(gemv_bfloat_k4, gemv_w_bfloat, true)
GEMV_KERNEL(gemv_e4m3fn_k4, gemv_w_e4m3fn, true)
GEMV_KERNEL(gemv_e5m2_k4, gemv_w_e5m2, true)
