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

// ---------------------------------------------------------------------------------------------
// The same attention with simdgroup_matrix 8x8 products ("mma": matrix multiply-accumulate; D % 8 == 0;
// D <= ND8 * 8 of the instantiation: 64, 128 or 256). One threadgroup = ATTN_MMA_SIMDS simdgroups =
// ATTN_MMA_ROWS query rows of one (b, h); each simdgroup owns 8 rows and keeps them (pre-scaled by
// scale * log2(e)) and its 8 x D fp32 output as 8x8 matrices. Per block of `bk` keys
// (bk * D <= ATTN_MMA_KV_FLOATS, at most ATTN_MMA_BK_MAX): the group stages K (fp32, zero rows past Lk) in
// threadgroup memory; S = Q K^T by 8x8 products (K loaded transposed); the online softmax runs on S in a
// per-simdgroup scratch (4 lanes per row, fp32 running max and sum, base 2; keys past Lk and masked keys
// are -inf); O is rescaled by diag(alpha) (an 8x8 product); then V is staged and O += P V. Output: O / l,
// one write, rows past Lq skipped; a fully masked row (l == 0) gives 0. All offsets 64-bit; group_base as
// above.

#define ATTN_MMA_SIMDS 4
#define ATTN_MMA_ROWS (ATTN_MMA_SIMDS * 8)
#define ATTN_MMA_THREADS (ATTN_MMA_SIMDS * 32)
#define ATTN_MMA_KV_FLOATS 4096
#define ATTN_MMA_BK_MAX 64

template <typename T, int ND8>
inline void attention_mma_rows(device const T* q, device const T* k, device const T* v, device const float* mask,
                               device T* out, long Lq, long Lk, long D, long Hq, long Hk, float scale_log2,
                               long has_mask, long mask_sb, long mask_sh, long mask_sq, long mask_sk,
                               long group_base, long q_blocks, threadgroup float* kv, threadgroup float* ps,
                               threadgroup float* sq, uint tgid, uint tid, uint lane, uint simd_id) {
    const long g = group_base + long(tgid);
    const long bh = g / q_blocks;
    const long row0 = (g - bh * q_blocks) * ATTN_MMA_ROWS;
    const long b = bh / Hq;
    const long h = bh - b * Hq;
    const long hk = h / (Hq / Hk);
    const long q_base = bh * Lq * D;
    const long kv_base = (b * Hk + hk) * Lk * D;
    const long mask_base = b * mask_sb + h * mask_sh;
    const int nd8 = int(D / 8);
    long bk = (ATTN_MMA_KV_FLOATS / D) / 8 * 8;
    if (bk > ATTN_MMA_BK_MAX) bk = ATTN_MMA_BK_MAX;
    const int nj8 = int(bk / 8);

    const long r0 = row0 + long(simd_id) * 8;             // this simdgroup's first query row
    threadgroup float* my_p = ps + long(simd_id) * (8 * ATTN_MMA_BK_MAX);
    threadgroup float* my_s = sq + long(simd_id) * 64;
    const int prow = int(lane / 4);                       // softmax: lanes 4r .. 4r+3 own row r
    const int pcol0 = int(lane % 4);
    const long pi = r0 + prow;

    // Q (8 rows x D) into 8x8 matrices, through the simdgroup's 64-float scratch
    simdgroup_float8x8 qm[ND8];
    for (int d8 = 0; d8 < ND8; ++d8) {
        if (d8 >= nd8) break;
        for (uint e = lane; e < 64; e += 32) {
            const long i = r0 + long(e / 8);
            my_s[e] = i < Lq ? float(q[q_base + i * D + d8 * 8 + long(e % 8)]) * scale_log2 : 0.0f;
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);
        simdgroup_load(qm[d8], my_s, 8);
        simdgroup_barrier(mem_flags::mem_threadgroup);
    }
    // O = 0, written through the reference (as every other update of O: no matrix assignment)
    const simdgroup_float8x8 zero = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    simdgroup_float8x8 om[ND8];
    for (int d8 = 0; d8 < ND8; ++d8) simdgroup_multiply(om[d8], zero, zero);

    float m_run = -INFINITY;
    float l_run = 0.0f;
    for (long kb = 0; kb < Lk; kb += bk) {
        const long nk = Lk - kb < bk ? Lk - kb : bk;
        for (long t = tid; t < bk * D; t += ATTN_MMA_THREADS) {
            const long j = t / D;
            kv[t] = j < nk ? float(k[kv_base + (kb + j) * D + (t - j * D)]) : 0.0f;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (int j8 = 0; j8 < nj8; ++j8) {
            simdgroup_float8x8 s = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
            for (int d8 = 0; d8 < ND8; ++d8) {
                if (d8 >= nd8) break;
                simdgroup_float8x8 kt;
                simdgroup_load(kt, kv + long(j8) * 8 * D + d8 * 8, D, ulong2(0, 0), true);
                simdgroup_multiply_accumulate(s, qm[d8], kt, s);
            }
            simdgroup_store(s, my_p + j8 * 8, bk);
        }
        simdgroup_barrier(mem_flags::mem_threadgroup);

        float mx = -INFINITY;
        for (long c = pcol0; c < bk; c += 4) {
            float sv = my_p[prow * bk + c];
            if (c >= nk) {
                sv = -INFINITY;
            } else if (has_mask != 0 && pi < Lq) {
                sv += mask[mask_base + pi * mask_sq + (kb + c) * mask_sk] * ATTN_LOG2E;
            }
            my_p[prow * bk + c] = sv;
            mx = max(mx, sv);
        }
        mx = max(mx, simd_shuffle_xor(mx, ushort(1)));
        mx = max(mx, simd_shuffle_xor(mx, ushort(2)));
        const float m_new = max(m_run, mx);
        const float alpha = m_new == -INFINITY ? 1.0f : exp2(m_run - m_new);
        float sum = 0.0f;
        for (long c = pcol0; c < bk; c += 4) {
            const float pv = m_new == -INFINITY ? 0.0f : exp2(my_p[prow * bk + c] - m_new);
            my_p[prow * bk + c] = pv;
            sum += pv;
        }
        sum += simd_shuffle_xor(sum, ushort(1));
        sum += simd_shuffle_xor(sum, ushort(2));
        l_run = l_run * alpha + sum;
        m_run = m_new;

        // O = diag(alpha) O
        const float alpha_lo = simd_shuffle(alpha, ushort((lane / 8) * 4));       // row lane / 8
        const float alpha_hi = simd_shuffle(alpha, ushort((lane / 8 + 4) * 4));   // row lane / 8 + 4
        my_s[lane] = (lane / 8 == lane % 8) ? alpha_lo : 0.0f;
        my_s[lane + 32] = ((lane + 32) / 8 == lane % 8) ? alpha_hi : 0.0f;
        simdgroup_barrier(mem_flags::mem_threadgroup);
        simdgroup_float8x8 dm;
        simdgroup_load(dm, my_s, 8);
        for (int d8 = 0; d8 < ND8; ++d8) {
            if (d8 >= nd8) break;
            simdgroup_multiply(om[d8], dm, om[d8]);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);     // every simdgroup is done with K (and my_s)

        for (long t = tid; t < bk * D; t += ATTN_MMA_THREADS) {
            const long j = t / D;
            kv[t] = j < nk ? float(v[kv_base + (kb + j) * D + (t - j * D)]) : 0.0f;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        for (int j8 = 0; j8 < nj8; ++j8) {
            simdgroup_float8x8 pm;
            simdgroup_load(pm, my_p + j8 * 8, bk);
            for (int d8 = 0; d8 < ND8; ++d8) {
                if (d8 >= nd8) break;
                simdgroup_float8x8 vm;
                simdgroup_load(vm, kv + long(j8) * 8 * D + d8 * 8, D);
                simdgroup_multiply_accumulate(om[d8], pm, vm, om[d8]);
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);     // V and P read before the next block
    }

    const float inv = l_run > 0.0f ? 1.0f / l_run : 0.0f;    // every key masked: 0, not NaN
    const float inv_lo = simd_shuffle(inv, ushort((lane / 8) * 4));
    const float inv_hi = simd_shuffle(inv, ushort((lane / 8 + 4) * 4));
    const long i_lo = r0 + long(lane / 8);
    const long i_hi = i_lo + 4;
    const long col = long(lane % 8);
    for (int d8 = 0; d8 < ND8; ++d8) {
        if (d8 >= nd8) break;
        simdgroup_store(om[d8], my_s, 8);
        simdgroup_barrier(mem_flags::mem_threadgroup);
        if (i_lo < Lq) out[q_base + i_lo * D + d8 * 8 + col] = T(my_s[lane] * inv_lo);
        if (i_hi < Lq) out[q_base + i_hi * D + d8 * 8 + col] = T(my_s[lane + 32] * inv_hi);
        simdgroup_barrier(mem_flags::mem_threadgroup);
    }
}

#define ATTENTION_MMA_KERNEL(NAME, T, ND8)                                                         \
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
    threadgroup float kv[ATTN_MMA_KV_FLOATS];                                                      \
    threadgroup float ps[ATTN_MMA_SIMDS * 8 * ATTN_MMA_BK_MAX];                                    \
    threadgroup float sq[ATTN_MMA_SIMDS * 64];                                                     \
    attention_mma_rows<T, ND8>(q, k, v, mask, out, Lq, Lk, D, Hq, Hk, scale_log2, has_mask,        \
                               mask_sb, mask_sh, mask_sq, mask_sk, group_base, q_blocks, kv, ps,   \
                               sq, tgid, tid, lane, simd_id);                                      \
}

ATTENTION_MMA_KERNEL(attention_mma64_float, float, 8)
ATTENTION_MMA_KERNEL(attention_mma64_half, half, 8)
ATTENTION_MMA_KERNEL(attention_mma64_bfloat, bfloat, 8)
ATTENTION_MMA_KERNEL(attention_mma128_float, float, 16)
ATTENTION_MMA_KERNEL(attention_mma128_half, half, 16)
ATTENTION_MMA_KERNEL(attention_mma128_bfloat, bfloat, 16)
ATTENTION_MMA_KERNEL(attention_mma256_float, float, 32)
ATTENTION_MMA_KERNEL(attention_mma256_half, half, 32)
ATTENTION_MMA_KERNEL(attention_mma256_bfloat, bfloat, 32)
