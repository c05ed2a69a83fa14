// Fused scaled-dot-product attention, FlashAttention-2 style:
//     out[b, h, i, :] = sum_j softmax_j(q[b,h,i,:] . k[b,hk,j,:] * scale + mask[b,h,i,j]) v[b,hk,j,:]
// with hk = h / (Hq / Hk) (grouped-query attention; Hk == Hq for plain multi-head attention).
//
// q: (B, Hq, Lq, D), k and v: (B, Hk, Lk, D), out: (B, Hq, Lq, D), all contiguous, one dtype T
// (float / half / bfloat). mask (has_mask = 1): fp32 additive, read at
//     b * mask_sb + h * mask_sh + i * mask_sq + j * mask_sk
// (a stride is 0 along a broadcast dimension; -inf removes a key). D <= ATTN_DMAX, any Lq, Lk.
//
// One threadgroup = ATTN_SIMDS simdgroups = ATTN_ROWS consecutive query rows of one (b, h); each
// simdgroup owns ATTN_ROWS_PER_SIMD rows. The group stages its query rows once in threadgroup
// memory (fp32, pre-multiplied by scale * log2(e), so the softmax works in base 2), then streams
// K/V in blocks of 32 keys: lane j computes the scores of key j against the simdgroup's rows, the
// block's max and sum come from simd_max / simd_sum, and each lane accumulates its own output
// columns (d = lane + 32 t) in fp32 registers, rescaled whenever the running max grows (online
// softmax with fp32 running max and sum). Memory O(L * D): no score matrix exists, and each output
// element is written once. A row whose every key is masked (-inf) gives 0, not NaN.
//
// All offsets are 64-bit (`long`). The logical grid is B * Hq * ceil(Lq / ATTN_ROWS) threadgroups;
// `group_base` is added to [[threadgroup_position_in_grid]], so the host launches it in chunks (and a
// test can launch only the last threadgroups of a grid whose offsets pass 2^31).

#define ATTN_DMAX 256
#define ATTN_DCHUNKS (ATTN_DMAX / 32)
#define ATTN_SIMDS 4
#define ATTN_ROWS_PER_SIMD 4
#define ATTN_ROWS (ATTN_SIMDS * ATTN_ROWS_PER_SIMD)
#define ATTN_THREADS (ATTN_SIMDS * 32)
#define ATTN_LOG2E 1.4426950408889634f

template <typename T>
inline void attention_rows(device const T* q, device const T* k, device const T* v, device const float* mask,
                           device T* out, long Lq, long Lk, long D, long Hq, long Hk, float scale_log2,
                           long has_mask, long mask_sb, long mask_sh, long mask_sq, long mask_sk,
                           long group_base, long q_blocks, threadgroup float* qs, uint tgid, uint tid,
                           uint lane, uint simd_id) {
    const long g = group_base + long(tgid);
    const long bh = g / q_blocks;             // b * Hq + h
    const long row0 = (g - bh * q_blocks) * ATTN_ROWS;
    const long b = bh / Hq;
    const long h = bh - b * Hq;
    const long hk = h / (Hq / Hk);
    const long q_base = bh * Lq * D;
    const long kv_base = (b * Hk + hk) * Lk * D;
    const long mask_base = b * mask_sb + h * mask_sh;

    // Stage the group's query rows (rows past Lq are zeros and are never written out).
    for (long t = tid; t < ATTN_ROWS * D; t += ATTN_THREADS) {
        const long r = t / D;
        const long i = row0 + r;
        qs[t] = i < Lq ? float(q[q_base + i * D + (t - r * D)]) * scale_log2 : 0.0f;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);

    const long my_row0 = row0 + long(simd_id) * ATTN_ROWS_PER_SIMD;
    threadgroup const float* my_q = qs + long(simd_id) * ATTN_ROWS_PER_SIMD * D;

    float m[ATTN_ROWS_PER_SIMD];              // running max (base 2)
    float l[ATTN_ROWS_PER_SIMD];              // running sum of exp2(score - m)
    float acc[ATTN_ROWS_PER_SIMD][ATTN_DCHUNKS];
    for (int r = 0; r < ATTN_ROWS_PER_SIMD; ++r) {
        m[r] = -INFINITY;
        l[r] = 0.0f;
        for (int c = 0; c < ATTN_DCHUNKS; ++c) acc[r][c] = 0.0f;
    }

    for (long kb = 0; kb < Lk; kb += 32) {
        const long j = kb + long(lane);       // this lane's key
        float s[ATTN_ROWS_PER_SIMD];
        if (j < Lk) {
            device const T* krow = k + kv_base + j * D;
            for (int r = 0; r < ATTN_ROWS_PER_SIMD; ++r) s[r] = 0.0f;
            for (long d = 0; d < D; ++d) {
                const float kd = float(krow[d]);
                for (int r = 0; r < ATTN_ROWS_PER_SIMD; ++r) s[r] = fma(my_q[long(r) * D + d], kd, s[r]);
            }
            if (has_mask != 0) {
                for (int r = 0; r < ATTN_ROWS_PER_SIMD; ++r) {
                    const long i = my_row0 + r;
                    if (i < Lq) s[r] += mask[mask_base + i * mask_sq + j * mask_sk] * ATTN_LOG2E;
                }
            }
        } else {
            for (int r = 0; r < ATTN_ROWS_PER_SIMD; ++r) s[r] = -INFINITY;
        }
        const int nkeys = Lk - kb < 32 ? int(Lk - kb) : 32;
        float p[ATTN_ROWS_PER_SIMD];
        for (int r = 0; r < ATTN_ROWS_PER_SIMD; ++r) {
            const float m_new = max(m[r], simd_max(s[r]));
            float alpha = 1.0f;
            p[r] = 0.0f;
            if (m_new != -INFINITY) {          // uniform across the simdgroup
                alpha = exp2(m[r] - m_new);   // exp2(-inf) = 0 on the first unmasked block
                p[r] = exp2(s[r] - m_new);
            }
            l[r] = l[r] * alpha + simd_sum(p[r]);
            m[r] = m_new;
            for (int c = 0; c < ATTN_DCHUNKS; ++c) acc[r][c] *= alpha;
        }
        device const T* vblock = v + kv_base + kb * D;
        for (int jj = 0; jj < nkeys; ++jj) {
            float pj[ATTN_ROWS_PER_SIMD];
            for (int r = 0; r < ATTN_ROWS_PER_SIMD; ++r) pj[r] = simd_shuffle(p[r], ushort(jj));
            device const T* vrow = vblock + long(jj) * D;
            for (int c = 0; c < ATTN_DCHUNKS; ++c) {
                const long d = long(lane) + 32 * c;
                if (d >= D) break;
                const float vd = float(vrow[d]);
                for (int r = 0; r < ATTN_ROWS_PER_SIMD; ++r) acc[r][c] = fma(pj[r], vd, acc[r][c]);
            }
        }
    }

    for (int r = 0; r < ATTN_ROWS_PER_SIMD; ++r) {
        const long i = my_row0 + r;
        if (i >= Lq) break;
        const float inv = l[r] > 0.0f ? 1.0f / l[r] : 0.0f;   // every key masked: 0, not NaN
        device T* orow = out + q_base + i * D;
        for (int c = 0; c < ATTN_DCHUNKS; ++c) {
            const long d = long(lane) + 32 * c;
            if (d >= D) break;
            orow[d] = T(acc[r][c] * inv);
        }
    }
}

#define ATTENTION_KERNEL(NAME, T)                                                                  \
kernel void NAME(device const T* q [[buffer(0)]],                                                  \
                 device const T* k [[buffer(1)]],                                                  \
                 device const T* v [[buffer(2)]],                                                  \
                 device const float* mask [[buffer(3)]],                                           \
                 device T* out [[buffer(4)]],                                                      \
                 constant long& Lq [[buffer(5)]],                                                  \
                 constant long& Lk [[buffer(6)]],                                                  \
                 constant long& D [[buffer(7)]],                                                   \
                 constant long& Hq [[buffer(8)]],                                                  \
                 constant long& Hk [[buffer(9)]],                                                  \
                 constant float& scale_log2 [[buffer(10)]],                                        \
                 constant long& has_mask [[buffer(11)]],                                           \
                 constant long& mask_sb [[buffer(12)]],                                            \
                 constant long& mask_sh [[buffer(13)]],                                            \
                 constant long& mask_sq [[buffer(14)]],                                            \
                 constant long& mask_sk [[buffer(15)]],                                            \
                 constant long& group_base [[buffer(16)]],                                         \
                 constant long& q_blocks [[buffer(17)]],                                           \
                 uint tgid [[threadgroup_position_in_grid]],                                       \
                 uint tid [[thread_index_in_threadgroup]],                                         \
                 uint lane [[thread_index_in_simdgroup]],                                          \
                 uint simd_id [[simdgroup_index_in_threadgroup]]) {                                \
    threadgroup float qs[ATTN_ROWS * ATTN_DMAX];                                                   \
    attention_rows<T>(q, k, v, mask, out, Lq, Lk, D, Hq, Hk, scale_log2, has_mask, mask_sb,        \
                      mask_sh, mask_sq, mask_sk, group_base, q_blocks, qs, tgid, tid, lane,        \
                      simd_id);                                                                    \
}

ATTENTION_KERNEL(attention_float, float)
ATTENTION_KERNEL(attention_half, half)
ATTENTION_KERNEL(attention_bfloat, bfloat)
