// Mixture-of-experts kernels.
//
// moe_route_<T>: router softmax + top-k over the experts of each token. One simdgroup (32 threads)
//   per token row: the row max and softmax denominator by simd reductions, then K rounds of a
//   simd argmax over the experts not taken yet (ties go to the lower expert index, like a stable
//   descending sort). Writes fp32 weights and int64 expert ids, each row in descending order.
//   norm != 0 renormalises the K weights to sum to 1 (Qwen3 norm_topk_prob; equals GPT-OSS's
//   softmax over the top-k logits).
//
// moe_experts_gemm_<W>_<X>: out[p, n] = scale[e, n] * sum_h W[e, n, h] * x[p / x_div, h] + bias[e, n]
//   with e = row_expert[p]. One dispatch runs every (token, expert) pair: at decode time the K
//   experts of one token (x_div = K shares the token's row between its K pairs); in prefill the
//   pairs sorted by expert, so consecutive rows read the same expert's weight rows from cache.
//   W is fp32/fp16/bf16 or FP8 bytes (e4m3fn / e5m2, decoded in-register with common.metal's exact
//   integer decoders). One simdgroup per output
//   column and block of MOE_ROWS rows, each lane reading 4 consecutive weights per step (then a scalar
//   tail); the scale is global, per expert or per expert row (strides); lanes stride the reduction dimension (coalesced weight
//   reads); all indices are 64-bit.
#include <metal_stdlib>
using namespace metal;

#define MOE_MAX_EXPERTS 1024
#define MOE_ROWS 8

#define MOE_LOAD_PLAIN(w, i) float(w[i])
#define MOE_LOAD_E4M3(w, i) fp8_e4m3fn_to_float(w[i])
#define MOE_LOAD_E5M2(w, i) fp8_e5m2_to_float(w[i])

#define MOE_ROUTE_KERNEL(NAME, T)                                                               \
kernel void NAME(device const T* logits [[buffer(0)]],                                          \
                 device float* weights [[buffer(1)]],                                           \
                 device long* experts [[buffer(2)]],                                            \
                 constant long& num_experts [[buffer(3)]],                                      \
                 constant long& top_k [[buffer(4)]],                                            \
                 constant long& norm [[buffer(5)]],                                             \
                 uint lane [[thread_index_in_threadgroup]],                                     \
                 uint row [[threadgroup_position_in_grid]]) {                                   \
    threadgroup uchar taken[MOE_MAX_EXPERTS];                                                   \
    const long E = num_experts;                                                                 \
    const long base = long(row) * E;                                                            \
    float m = -INFINITY;                                                                        \
    for (long c = lane; c < E; c += 32) {                                                       \
        taken[c] = 0;                                                                           \
        m = max(m, float(logits[base + c]));                                                    \
    }                                                                                           \
    m = simd_max(m);                                                                            \
    float s = 0.0f;                                                                             \
    for (long c = lane; c < E; c += 32) s += exp(float(logits[base + c]) - m);                  \
    s = simd_sum(s);                                                                            \
    threadgroup_barrier(mem_flags::mem_threadgroup);                                            \
    float picked_sum = 0.0f;                                                                    \
    for (long k = 0; k < top_k; ++k) {                                                          \
        float best = -INFINITY;                                                                 \
        long best_c = E;                                                                        \
        for (long c = lane; c < E; c += 32) {                                                   \
            const float v = float(logits[base + c]);                                            \
            if (!taken[c] && (v > best || best_c == E)) { best = v; best_c = c; }               \
        }                                                                                       \
        const float top = simd_max(best_c < E ? best : -INFINITY);                              \
        const bool mine = best_c < E && best == top;                                            \
        const uint c_min = simd_min(mine ? uint(best_c) : uint(0xFFFFFFFF));                    \
        threadgroup_barrier(mem_flags::mem_threadgroup);                                        \
        if (lane == 0) {                                                                        \
            const float p = exp(top - m) / s;                                                   \
            weights[long(row) * top_k + k] = p;                                                 \
            experts[long(row) * top_k + k] = long(c_min);                                       \
            taken[c_min] = 1;                                                                   \
            picked_sum += p;                                                                    \
        }                                                                                       \
        threadgroup_barrier(mem_flags::mem_threadgroup);                                        \
    }                                                                                           \
    if (norm != 0 && lane == 0) {                                                               \
        const float inv = 1.0f / picked_sum;                                                    \
        for (long k = 0; k < top_k; ++k) weights[long(row) * top_k + k] *= inv;                 \
    }                                                                                           \
}

MOE_ROUTE_KERNEL(moe_route_float, float)
MOE_ROUTE_KERNEL(moe_route_half, half)
MOE_ROUTE_KERNEL(moe_route_bfloat, bfloat)

#define MOE_GEMM_KERNEL(NAME, WT, XT, LOAD)                                                           \
kernel void NAME(device const XT* x [[buffer(0)]],                                              \
                 device const long* row_expert [[buffer(1)]],                                   \
                 device const WT* w [[buffer(2)]],                                              \
                 device const float* scale [[buffer(3)]],                                       \
                 device const float* bias [[buffer(4)]],                                        \
                 device float* out [[buffer(5)]],                                               \
                 constant long& rows [[buffer(6)]],                                             \
                 constant long& ncols [[buffer(7)]],                                            \
                 constant long& kdim [[buffer(8)]],                                             \
                 constant long& x_div [[buffer(9)]],                                            \
                 constant long& scale_stride_e [[buffer(10)]],                                  \
                 constant long& scale_stride_n [[buffer(11)]],                                  \
                 constant long& has_bias [[buffer(12)]],                                        \
                 uint lane [[thread_index_in_simdgroup]],                                       \
                 uint simd_id [[simdgroup_index_in_threadgroup]],                               \
                 uint group_size [[threads_per_threadgroup]],                                   \
                 uint group [[threadgroup_position_in_grid]]) {                                 \
    const long simds = long(group_size) / 32;                                                   \
    const long col_blocks = (ncols + simds - 1) / simds;                                        \
    const long n = (long(group) % col_blocks) * simds + simd_id;                                \
    const long r0 = (long(group) / col_blocks) * MOE_ROWS;                                      \
    if (n >= ncols) return;                                                                     \
    const long r1 = (r0 + MOE_ROWS < rows) ? r0 + MOE_ROWS : rows;  /* ternary: min(long, long) is not in every MSL */ \
    /* runs of consecutive rows with the same expert share every weight load (sorted prefill) */    \
    long r = r0;                                                                                    \
    while (r < r1) {                                                                                \
        const long e = row_expert[r];                                                               \
        long rb = r + 1;                                                                            \
        while (rb < r1 && row_expert[rb] == e) ++rb;                                                \
        const long nr = rb - r;                                                                     \
        const long wbase = (e * ncols + n) * kdim;                                                  \
        float acc[MOE_ROWS];                                                                        \
        for (long i = 0; i < nr; ++i) acc[i] = 0.0f;                                                \
        /* 4 consecutive weights per lane (128 per simdgroup step), then a scalar tail */           \
        const long main_end = (kdim / 128) * 128;                                                   \
        for (long h = long(lane) * 4; h < main_end; h += 128) {                                     \
            const float w0 = LOAD(w, wbase + h), w1 = LOAD(w, wbase + h + 1);                       \
            const float w2 = LOAD(w, wbase + h + 2), w3 = LOAD(w, wbase + h + 3);                   \
            for (long i = 0; i < nr; ++i) {                                                         \
                const long xb = ((r + i) / x_div) * kdim + h;                                       \
                acc[i] += w0 * float(x[xb]) + w1 * float(x[xb + 1]) + w2 * float(x[xb + 2]) + w3 * float(x[xb + 3]);\
            }                                                                                       \
        }                                                                                           \
        for (long h = main_end + lane; h < kdim; h += 32) {                                         \
            const float w0 = LOAD(w, wbase + h);                                                    \
            for (long i = 0; i < nr; ++i) acc[i] += w0 * float(x[((r + i) / x_div) * kdim + h]);    \
        }                                                                                           \
        const float sc = scale[e * scale_stride_e + n * scale_stride_n];                            \
        const float bi = has_bias != 0 ? bias[e * ncols + n] : 0.0f;                                \
        for (long i = 0; i < nr; ++i) {                                                             \
            const float v = simd_sum(acc[i]);                                                       \
            if (lane == 0) out[(r + i) * ncols + n] = v * sc + bi;                                  \
        }                                                                                           \
        r = rb;                                                                                     \
    }                                                                                               \
}

#define MOE_GEMM_FOR_X(WNAME, WT, LOAD)                                                         \
MOE_GEMM_KERNEL(moe_experts_gemm_##WNAME##_float, WT, float, LOAD)                              \
MOE_GEMM_KERNEL(moe_experts_gemm_##WNAME##_half, WT, half, LOAD)                                \
MOE_GEMM_KERNEL(moe_experts_gemm_##WNAME##_bfloat, WT, bfloat, LOAD)

MOE_GEMM_FOR_X(float, float, MOE_LOAD_PLAIN)
MOE_GEMM_FOR_X(half, half, MOE_LOAD_PLAIN)
MOE_GEMM_FOR_X(bfloat, bfloat, MOE_LOAD_PLAIN)
MOE_GEMM_FOR_X(e4m3, uchar, MOE_LOAD_E4M3)
MOE_GEMM_FOR_X(e5m2, uchar, MOE_LOAD_E5M2)

// moe_grouped_gemm_<W>_<X>: tiled grouped GEMM for prefill over pairs sorted by expert.
//   out[r, n] = scale[e, n] * sum_h W[e, n, h] * x[r, h] + bias[e, n] for the rows r of each tile.
//   The tile table (built on the device by the launcher, fixed size ceil(P/32) + E) gives each row
//   tile its expert, first row and row count (<= 32, one expert per tile; 0 rows = an unused tile).
//   A threadgroup of 256 threads computes 32 rows x 32 columns: 32-wide K steps staged in
//   threadgroup memory, each weight element read once per tile instead of once per row.
#define MOE_TM 32
#define MOE_TN 32
#define MOE_TK 32

#define MOE_GROUPED_KERNEL(NAME, WT, XT, LOAD)                                                      \
kernel void NAME(device const XT* x [[buffer(0)]],                                                  \
                 device const long* tile_expert [[buffer(1)]],                                      \
                 device const long* tile_row0 [[buffer(2)]],                                        \
                 device const long* tile_rows [[buffer(3)]],                                        \
                 device const WT* w [[buffer(4)]],                                                  \
                 device const float* scale [[buffer(5)]],                                           \
                 device const float* bias [[buffer(6)]],                                            \
                 device float* out [[buffer(7)]],                                                   \
                 constant long& ncols [[buffer(8)]],                                                \
                 constant long& kdim [[buffer(9)]],                                                 \
                 constant long& scale_stride_e [[buffer(10)]],                                      \
                 constant long& scale_stride_n [[buffer(11)]],                                      \
                 constant long& has_bias [[buffer(12)]],                                            \
                 uint tid [[thread_index_in_threadgroup]],                                          \
                 uint group [[threadgroup_position_in_grid]]) {                                     \
    threadgroup float xs[MOE_TM][MOE_TK + 1];                                                       \
    threadgroup float ws[MOE_TN][MOE_TK + 1];                                                       \
    const long col_tiles = (ncols + MOE_TN - 1) / MOE_TN;                                           \
    const long t = long(group) / col_tiles;                                                         \
    const long n0 = (long(group) % col_tiles) * MOE_TN;                                             \
    const long rows = tile_rows[t];                                                                 \
    if (rows <= 0) return;                  /* whole group leaves together: no barrier divergence */ \
    const long e = tile_expert[t];                                                                  \
    const long r0 = tile_row0[t];                                                                   \
    const long my_row = long(tid) / 8;                                                              \
    const long my_col = (long(tid) % 8) * 4;                                                        \
    float acc0 = 0.0f, acc1 = 0.0f, acc2 = 0.0f, acc3 = 0.0f;                                       \
    for (long k0 = 0; k0 < kdim; k0 += MOE_TK) {                                                    \
        for (long i = tid; i < MOE_TM * MOE_TK; i += 256) {                                         \
            const long r = i / MOE_TK, c = i % MOE_TK;                                              \
            xs[r][c] = (r < rows && k0 + c < kdim) ? float(x[(r0 + r) * kdim + k0 + c]) : 0.0f;     \
            ws[r][c] = (n0 + r < ncols && k0 + c < kdim) ? LOAD(w, (e * ncols + n0 + r) * kdim + k0 + c) : 0.0f; \
        }                                                                                           \
        threadgroup_barrier(mem_flags::mem_threadgroup);                                            \
        for (long c = 0; c < MOE_TK; ++c) {                                                         \
            const float xv = xs[my_row][c];                                                         \
            acc0 += xv * ws[my_col][c];                                                             \
            acc1 += xv * ws[my_col + 1][c];                                                         \
            acc2 += xv * ws[my_col + 2][c];                                                         \
            acc3 += xv * ws[my_col + 3][c];                                                         \
        }                                                                                           \
        threadgroup_barrier(mem_flags::mem_threadgroup);                                            \
    }                                                                                               \
    if (my_row < rows) {                                                                            \
        const float accs[4] = {acc0, acc1, acc2, acc3};                                             \
        for (long j = 0; j < 4; ++j) {                                                              \
            const long n = n0 + my_col + j;                                                         \
            if (n < ncols) {                                                                        \
                float v = accs[j] * scale[e * scale_stride_e + n * scale_stride_n];                 \
                if (has_bias != 0) v += bias[e * ncols + n];                                        \
                out[(r0 + my_row) * ncols + n] = v;                                                 \
            }                                                                                       \
        }                                                                                           \
    }                                                                                               \
}

#define MOE_GROUPED_FOR_X(WNAME, WT, LOAD)                                                          \
MOE_GROUPED_KERNEL(moe_grouped_gemm_##WNAME##_float, WT, float, LOAD)                               \
MOE_GROUPED_KERNEL(moe_grouped_gemm_##WNAME##_half, WT, half, LOAD)                                 \
MOE_GROUPED_KERNEL(moe_grouped_gemm_##WNAME##_bfloat, WT, bfloat, LOAD)

MOE_GROUPED_FOR_X(float, float, MOE_LOAD_PLAIN)
MOE_GROUPED_FOR_X(half, half, MOE_LOAD_PLAIN)
MOE_GROUPED_FOR_X(bfloat, bfloat, MOE_LOAD_PLAIN)
MOE_GROUPED_FOR_X(e4m3, uchar, MOE_LOAD_E4M3)
MOE_GROUPED_FOR_X(e5m2, uchar, MOE_LOAD_E5M2)
