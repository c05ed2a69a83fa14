// GGUF (ggml) block quantisations, read directly from the file's bytes.
//
// Each type is a struct with its block size BS (values), its block bytes TS, and
//     static float deq(device const uchar* block, int i)
// returning value i (0 <= i < BS) of one block, computed in fp32 with the same operations in the
// same order as the gguf package's numpy dequantiser (products and sums in separate statements, so
// no contraction into fma changes a rounding), so the fp32 result is bit-identical to it.
// Blocks start at any byte (22-, 110-byte blocks ...): every multi-byte field is assembled from bytes.
//
// gguf_dequant_<type>_<out>: dst[e] = OUT(value e) for e < n (n = rows * K; rows are whole blocks,
//   so value e is value e % BS of block e / BS). Each thread handles 4 consecutive values per step
//   and strides by nthreads * 4 (64-bit indices, any n).
// gguf_gemv_<type>: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for M <= GGUF_GEMV_MAX_M rows,
//   fp32 accumulation; one simdgroup computes GGUF_GEMV_COLS adjacent columns, each lane 4 consecutive
//   values per step (the simdgroup 128: coalesced block reads, each block's scales decoded for 4
//   values at once), then simd_sum. No threadgroup memory, no barriers: a partial last threadgroup
//   is harmless.
// Written in C++14 (Metal's dialect).

#define GGUF_GEMV_MAX_M 8
#define GGUF_GEMV_COLS 4

constant char gguf_iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

inline float gguf_f16(device const uchar* p) {
    return float(as_type<half>(ushort(uint(p[0]) | (uint(p[1]) << 8))));
}

inline float gguf_i8(uchar b) { return float(as_type<char>(b)); }

// The low nibble of byte j for i < 16, the high nibble for i >= 16 (j = i % 16): the 32-value layout.
inline uint gguf_nibble32(device const uchar* qs, int i) {
    const uint byte = qs[i & 15];
    return i < 16 ? (byte & 15u) : (byte >> 4);
}

// The 5th bit of value i (0..31) from a little-endian 32-bit mask.
inline uint gguf_bit32(device const uchar* qh, int i) { return (uint(qh[i >> 3]) >> uint(i & 7)) & 1u; }

struct gguf_q8_0 {
    enum { BS = 32, TS = 34 };
    static float deq(device const uchar* b, int i) {
        const float d = gguf_f16(b);
        return gguf_i8(b[2 + i]) * d;
    }
};

struct gguf_q4_0 {
    enum { BS = 32, TS = 18 };
    static float deq(device const uchar* b, int i) {
        const float d = gguf_f16(b);
        return d * float(int(gguf_nibble32(b + 2, i)) - 8);
    }
};

struct gguf_q4_1 {
    enum { BS = 32, TS = 20 };
    static float deq(device const uchar* b, int i) {
        const float d = gguf_f16(b);
        const float m = gguf_f16(b + 2);
        const float t = d * float(gguf_nibble32(b + 4, i));
        return t + m;
    }
};

struct gguf_q5_0 {
    enum { BS = 32, TS = 22 };
    static float deq(device const uchar* b, int i) {
        const float d = gguf_f16(b);
        const uint q = gguf_nibble32(b + 6, i) | (gguf_bit32(b + 2, i) << 4);
        return d * float(int(q) - 16);
    }
};

struct gguf_q5_1 {
    enum { BS = 32, TS = 24 };
    static float deq(device const uchar* b, int i) {
        const float d = gguf_f16(b);
        const float m = gguf_f16(b + 2);
        const uint q = gguf_nibble32(b + 8, i) | (gguf_bit32(b + 4, i) << 4);
        const float t = d * float(q);
        return t + m;
    }
};

// K-quants: 256 values in 16 or 8 sub-blocks. Value i = h * 128 + s * 32 + l (l < 32) takes its
// 2-bit field s of byte h * 32 + l (Q2_K, Q3_K low bits); Q4_K/Q5_K: i = c * 64 + a * 32 + l takes
// nibble a of byte c * 32 + l.
struct gguf_q2_k {
    enum { BS = 256, TS = 84 };
    static float deq(device const uchar* b, int i) {
        const uint sc = b[i >> 4];
        const float d = gguf_f16(b + 80);
        const float dmin = gguf_f16(b + 82);
        const float dl = d * float(sc & 15u);
        const float ml = dmin * float(sc >> 4);
        const uint q = (uint(b[16 + (i >> 7) * 32 + (i & 31)]) >> uint(2 * ((i >> 5) & 3))) & 3u;
        const float t = dl * float(q);
        return t - ml;
    }
};

struct gguf_q3_k {
    enum { BS = 256, TS = 110 };
    static float deq(device const uchar* b, int i) {
        const int g = i >> 4;
        const uint lo = g < 8 ? (uint(b[96 + g]) & 15u) : (uint(b[96 + g - 8]) >> 4);
        const uint hi = (uint(b[104 + (g & 3)]) >> uint(2 * (g >> 2))) & 3u;
        const float d = gguf_f16(b + 108);
        const float dl = d * float(int(lo | (hi << 4)) - 32);
        const uint ql = (uint(b[32 + (i >> 7) * 32 + (i & 31)]) >> uint(2 * ((i >> 5) & 3))) & 3u;
        const uint hbit = (uint(b[i & 31]) >> uint(i >> 5)) & 1u;
        const int q = int(ql) - int((hbit ^ 1u) << 2);
        return dl * float(q);
    }
};

// The 6-bit scale and min of sub-block j (0..7) packed in 12 bytes s (Q4_K, Q5_K).
inline uint2 gguf_k_scale_min(device const uchar* s, int j) {
    if (j < 4) return uint2(uint(s[j]) & 63u, uint(s[4 + j]) & 63u);
    const uint md = s[4 + j];
    return uint2((md & 15u) | ((uint(s[j - 4]) >> 2) & 48u), (md >> 4) | ((uint(s[j]) >> 2) & 48u));
}

struct gguf_q4_k {
    enum { BS = 256, TS = 144 };
    static float deq(device const uchar* b, int i) {
        const uint2 sm = gguf_k_scale_min(b + 4, i >> 5);
        const float d = gguf_f16(b);
        const float dmin = gguf_f16(b + 2);
        const float dd = d * float(sm.x);
        const float dm = dmin * float(sm.y);
        const uint q = (uint(b[16 + (i >> 6) * 32 + (i & 31)]) >> uint(4 * ((i >> 5) & 1))) & 15u;
        const float t = dd * float(q);
        return t - dm;
    }
};

struct gguf_q5_k {
    enum { BS = 256, TS = 176 };
    static float deq(device const uchar* b, int i) {
        const uint2 sm = gguf_k_scale_min(b + 4, i >> 5);
        const float d = gguf_f16(b);
        const float dmin = gguf_f16(b + 2);
        const float dd = d * float(sm.x);
        const float dm = dmin * float(sm.y);
        const uint lo = (uint(b[48 + (i >> 6) * 32 + (i & 31)]) >> uint(4 * ((i >> 5) & 1))) & 15u;
        const uint hi = (uint(b[16 + (i & 31)]) >> uint(i >> 5)) & 1u;
        const float t = dd * float(lo | (hi << 4));
        return t - dm;
    }
};

struct gguf_q6_k {
    enum { BS = 256, TS = 210 };
    static float deq(device const uchar* b, int i) {
        const float d = gguf_f16(b + 208);
        const float dd = d * gguf_i8(b[192 + (i >> 4)]);
        const uint lo = (uint(b[(i >> 7) * 64 + (i & 63)]) >> uint(4 * ((i >> 6) & 1))) & 15u;
        const uint hi = (uint(b[128 + (i >> 7) * 32 + (i & 31)]) >> uint(2 * ((i >> 5) & 3))) & 3u;
        return dd * float(int(lo | (hi << 4)) - 32);
    }
};

struct gguf_iq4_nl {
    enum { BS = 32, TS = 18 };
    static float deq(device const uchar* b, int i) {
        const float d = gguf_f16(b);
        return d * float(gguf_iq4_values[gguf_nibble32(b + 2, i)]);
    }
};

struct gguf_iq4_xs {
    enum { BS = 256, TS = 136 };
    static float deq(device const uchar* b, int i) {
        const int j = i >> 5;
        const uint lo = (uint(b[4 + (j >> 1)]) >> uint(4 * (j & 1))) & 15u;
        const uint hi = ((uint(b[2]) | (uint(b[3]) << 8)) >> uint(2 * j)) & 3u;
        const float d = gguf_f16(b);
        const float dl = d * float(int(lo | (hi << 4)) - 32);
        const uint q = (uint(b[8 + j * 16 + (i & 15)]) >> uint(4 * ((i >> 4) & 1))) & 15u;
        return dl * float(gguf_iq4_values[q]);
    }
};

// Stores round once from fp32 (bf16 through the explicit round-to-nearest-even helper of common.metal).
inline void gguf_store(device float* p, float v) { *p = v; }
inline void gguf_store(device half* p, float v) { *p = half(v); }
inline void gguf_store(device bfloat* p, float v) { *p = as_type<bfloat>(bf16_bits_from_float(v)); }

#define GGUF_DEQUANT_KERNEL(NAME, Q, OUT)                                                      \
kernel void NAME(device const uchar* src [[buffer(0)]],                                       \
                 device OUT* dst [[buffer(1)]],                                               \
                 constant long& n [[buffer(2)]],                                              \
                 constant long& nthreads [[buffer(3)]],                                       \
                 uint gid [[thread_position_in_grid]]) {                                      \
    for (long i = long(gid) * 4; i < n; i += nthreads * 4) {                                  \
        /* blocks hold a multiple of 4 values: the 4 values of a step share one block */      \
        const long blk = i / Q::BS;                                                           \
        const int j0 = int(i - blk * Q::BS);                                                  \
        device const uchar* b = src + blk * Q::TS;                                            \
        for (int j = 0; j < 4; ++j) {                                                         \
            if (i + j >= n) break;                                                            \
            gguf_store(dst + i + j, Q::deq(b, j0 + j));                                       \
        }                                                                                     \
    }                                                                                         \
}

// Columns n0 .. n0 + GGUF_GEMV_COLS - 1 (those < N) for exactly MM rows of x.
template <typename Q, int MM>
inline void gguf_gemv_columns(device const float* x, device const uchar* w, device const float* bias,
                              device float* y, long K, long N, long has_bias, long n0, uint lane) {
    const int ncols = N - n0 < GGUF_GEMV_COLS ? int(N - n0) : GGUF_GEMV_COLS;
    const long row_bytes = (K / Q::BS) * Q::TS;
    float acc[GGUF_GEMV_COLS][MM];
    for (int c = 0; c < GGUF_GEMV_COLS; ++c)
        for (int m = 0; m < MM; ++m) acc[c][m] = 0.0f;
    // Each lane takes 4 consecutive values per step (K is whole blocks, a multiple of 32, so the 4
    // share one block and its scales), the simdgroup 128 consecutive values.
    for (long k = long(lane) * 4; k < K; k += 128) {
        float4 xv[MM];
        for (int m = 0; m < MM; ++m) {
            device const float* xr = x + long(m) * K + k;
            xv[m] = float4(xr[0], xr[1], xr[2], xr[3]);
        }
        const long blk = k / Q::BS;
        const int i = int(k - blk * Q::BS);
        for (int c = 0; c < GGUF_GEMV_COLS; ++c) {
            if (c >= ncols) break;
            device const uchar* b = w + (n0 + c) * row_bytes + blk * Q::TS;
            const float4 wv = float4(Q::deq(b, i), Q::deq(b, i + 1), Q::deq(b, i + 2), Q::deq(b, i + 3));
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
    // ncols and MM are uniform within the simdgroup: every lane reaches each simd_sum.
    for (int c = 0; c < GGUF_GEMV_COLS; ++c) {
        if (c >= ncols) break;
        const long n = n0 + c;
        const float b = has_bias != 0 ? bias[n] : 0.0f;
        for (int m = 0; m < MM; ++m) {
            const float t = simd_sum(acc[c][m]);
            if (lane == 0) y[long(m) * N + n] = t + b;
        }
    }
}

#define GGUF_GEMV_CASE(Q, MM)                                                                  \
    case MM:                                                                                  \
        gguf_gemv_columns<Q, MM>(x, w, bias, y, K, N, has_bias, n0, lane);                    \
        break;

#define GGUF_GEMV_KERNEL(NAME, Q)                                                              \
kernel void NAME(device const float* x [[buffer(0)]],                                        \
                 device const uchar* w [[buffer(1)]],                                         \
                 device const float* bias [[buffer(2)]],                                      \
                 device float* y [[buffer(3)]],                                               \
                 constant long& M [[buffer(4)]],                                              \
                 constant long& K [[buffer(5)]],                                              \
                 constant long& N [[buffer(6)]],                                              \
                 constant long& has_bias [[buffer(7)]],                                       \
                 uint gid [[thread_position_in_grid]],                                        \
                 uint lane [[thread_index_in_simdgroup]]) {                                   \
    const long n0 = long(gid / 32u) * GGUF_GEMV_COLS;                                         \
    if (n0 >= N) return;                                                                      \
    switch (M) {                                                                              \
        GGUF_GEMV_CASE(Q, 1) GGUF_GEMV_CASE(Q, 2) GGUF_GEMV_CASE(Q, 3) GGUF_GEMV_CASE(Q, 4)   \
        GGUF_GEMV_CASE(Q, 5) GGUF_GEMV_CASE(Q, 6) GGUF_GEMV_CASE(Q, 7) GGUF_GEMV_CASE(Q, 8)   \
        default: break;               /* the host never passes M outside 1..GGUF_GEMV_MAX_M */ \
    }                                                                                         \
}

#define GGUF_TYPE_KERNELS(q)                                                                   \
    GGUF_DEQUANT_KERNEL(gguf_dequant_##q##_float, gguf_##q, float)                            \
    GGUF_DEQUANT_KERNEL(gguf_dequant_##q##_half, gguf_##q, half)                              \
    GGUF_DEQUANT_KERNEL(gguf_dequant_##q##_bfloat, gguf_##q, bfloat)                          \
    GGUF_GEMV_KERNEL(gguf_gemv_##q, gguf_##q)

GGUF_TYPE_KERNELS(q8_0)
GGUF_TYPE_KERNELS(q4_0)
GGUF_TYPE_KERNELS(q4_1)
GGUF_TYPE_KERNELS(q5_0)
GGUF_TYPE_KERNELS(q5_1)
GGUF_TYPE_KERNELS(q2_k)
GGUF_TYPE_KERNELS(q3_k)
GGUF_TYPE_KERNELS(q4_k)
GGUF_TYPE_KERNELS(q5_k)
GGUF_TYPE_KERNELS(q6_k)
GGUF_TYPE_KERNELS(iq4_nl)
GGUF_TYPE_KERNELS(iq4_xs)
