// Fused scaled-dot-product attention:
//     out[b, h, i, :] = sum_j softmax_j(q[b,h,i,:] . k[b,hk,j,:] * scale + mask[b,h,i,j]) v[b,hk,j,:]
// with hk = h / (Hq / Hk) (grouped-query attention; Hk == Hq for plain multi-head attention).
//
// q: (B, Hq, Lq, D), k and v: (B, Hk, Lk, D), out: (B, Hq, Lq, D), all contiguous, one dtype T
// (float / half / bfloat). mask (p.has_mask = 1): fp32 additive, read at
//     b * mask_sb + h * mask_sh + i * mask_sq + j * mask_sk
// (a stride is 0 along a broadcast dimension; -inf removes a key). A query row whose every key is
// masked gives 0, not NaN. Softmax in base 2 (scores times scale * log2(e)), fp32 running max and sum.
//
// Two kernels, one params struct (attention_params, a list of int64 from the host) and the softmax
// scale times log2(e) as a float:
//
// attention_mma<T, DK>: FlashAttention-2 with simdgroup matrices, for D % 8 == 0, D <= DK (DK the
//   template head dim; a smaller D is zero-padded to DK). One threadgroup = 4 simdgroups = 32 query
//   rows of one (b, h); each simdgroup owns 8 rows. Q is staged once through threadgroup memory into
//   DK / 8 fragments in T that stay in registers (in two passes where a key block has 16 rows). Per
//   block of BK keys (attn_block_keys: 64 for D = 128 half/bfloat, 128 for D = 64, fewer where a
//   padded block would pass ATTN_KV_BYTES): the group stages K in T (rows padded by 16 bytes, so the
//   transposed fragment loads and the cooperative 16-byte stores hit 32 distinct banks; rows past Lk
//   are zeros), S = Q K^T accumulates in BK / 8 fp32 fragments, and the online softmax runs on the
//   fragments' own elements (thread_elements(): lane l holds row (q & 4) + (l / 2) % 4, columns
//   c, c + 1 with c = 2 (q & 2) + 2 (l % 2), q = l / 4, so the four lanes of a row are l ^ 1, l ^ 8):
//   scale, mask, row max and sum by two simd_shuffle_xor each, P = exp2(S - max) written back in
//   place and O's elements scaled by exp2(old max - new max) in place. Then V is staged into the same
//   buffer and O += P V (P the fp32 S fragments, V fragments in T). Output: O / l straight from the
//   fragments' elements, rows past Lq skipped. Nothing of S, P or O passes through threadgroup memory.
//
// attention_vec<T, NT>: the vector kernel, for few query rows (decode, Lq <= 8) and any D <= 32 NT.
//   One threadgroup = ATTN_VEC_SIMDS simdgroups = up to ATTN_VEC_ROWS (query row, head) pairs that
//   share one k/v head (the heads of a GQA group read K and V once). Lane l holds elements
//   d = l + 32 t of each pair's query and output; the simdgroups take keys s, s + ATTN_VEC_SIMDS, ...:
//   per key a coalesced read of K's row, one simd_sum per pair, the online softmax, and O += p V's
//   row. The simdgroups' partial (max, sum, O) are merged through threadgroup memory at the end.
//
// Offsets: each threadgroup finds its (b, h) with one 64-bit division and keeps 64-bit base pointers
// (offsets pass 2^31 for long videos); inside a head the host guarantees L * D < 2^31, so the loops
// index in 32 bits. The logical grid is p.q_blocks threadgroups per (b, head); p.group_base is added
// to [[threadgroup_position_in_grid]], so the host launches it in chunks (and a test can launch only
// the last threadgroups of a grid whose offsets pass 2^31).

#define ATTN_LOG2E 1.4426950408889634f
#define ATTN_UNROLL _Pragma("clang loop unroll(full)")   // loops over fragments: compile-time trip counts
// ATTN_BQ (query rows per threadgroup of attention_mma), ATTN_SIMDS, ATTN_VEC_ROWS, ATTN_VEC_SIMDS and the
// attention_params struct come from attention.py (source.define / source.Params), like the kernels'
// template instantiations (KernelSpec.instantiate).
#define ATTN_THREADS (ATTN_SIMDS * 32)
#define ATTN_KV_BYTES 18432         // threadgroup bytes of one staged K or V block, rows padded

// Keys per block of attention_mma: the largest of 128, 64, 32, 16 whose padded block fits ATTN_KV_BYTES.
constexpr int attn_block_keys(int elem_bytes, int dk) {
    return 128 * (dk * elem_bytes + 16) <= ATTN_KV_BYTES ? 128
         : 64 * (dk * elem_bytes + 16) <= ATTN_KV_BYTES  ? 64
         : 32 * (dk * elem_bytes + 16) <= ATTN_KV_BYTES  ? 32
                                                         : 16;
}

// Rows [0, ROWS) of a (n, D) row-major block at src into dst (row stride DK + 16 bytes), in 16-byte
// chunks shared by the threadgroup; rows >= n and columns >= D become zeros.
template <typename T, int DK, int ROWS>
inline void attn_stage(threadgroup T* dst, device const T* src, int n, int D, uint tid) {
    constexpr int VEC = 16 / sizeof(T);
    constexpr int CHUNKS = DK / VEC;            // 16-byte chunks per row
    constexpr int LD = DK + VEC;
    constexpr int STEPS = (ROWS * CHUNKS + ATTN_THREADS - 1) / ATTN_THREADS;
    constexpr bool EVEN = ATTN_THREADS % CHUNKS == 0;   // a thread keeps its column, rows step evenly
    const int r0 = int(tid / uint(CHUNKS));
    const int col0 = (int(tid) - r0 * CHUNKS) * VEC;
    ATTN_UNROLL
    for (int s = 0; s < STEPS; ++s) {
        const int c = int(tid) + s * ATTN_THREADS;
        if (ROWS * CHUNKS % ATTN_THREADS != 0 && c >= ROWS * CHUNKS) break;
        const int r = EVEN ? r0 + s * (ATTN_THREADS / CHUNKS) : c / CHUNKS;
        const int col = EVEN ? col0 : (c - r * CHUNKS) * VEC;
        uint4 w = uint4(0u);
        if (r < n && col < D) w = *((device const uint4*)(src + r * D + col));
        *((threadgroup uint4*)(dst + r * LD + col)) = w;
    }
}

template <typename T, int DK>
kernel void attention_mma(device const T* q [[buffer(0)]],
                          device const T* k [[buffer(1)]],
                          device const T* v [[buffer(2)]],
                          device const float* mask [[buffer(3)]],
                          device T* out [[buffer(4)]],
                          constant attention_params& p [[buffer(5)]],
                          constant float& scale_log2 [[buffer(6)]],
                          uint tgid [[threadgroup_position_in_grid]],
                          uint tid [[thread_index_in_threadgroup]],
                          ushort lane [[thread_index_in_simdgroup]],
                          ushort sg [[simdgroup_index_in_threadgroup]]) {
    constexpr int BK = attn_block_keys(sizeof(T), DK);
    constexpr int LD = DK + 16 / sizeof(T);                 // threadgroup row stride (elements)
    constexpr int QP = BK < ATTN_BQ ? BK : ATTN_BQ;         // query rows staged at a time (same buffer)
    threadgroup uint4 kv_words[BK * LD * sizeof(T) / 16];
    threadgroup T* kv = (threadgroup T*)kv_words;

    const ulong g = ulong(p.group_base) + tgid;
    const ulong bh = g / ulong(p.q_blocks);                 // b * Hq + h
    const int row0 = int(g - bh * ulong(p.q_blocks)) * ATTN_BQ;
    const ulong b = bh / ulong(p.Hq);
    const ulong h = bh - b * ulong(p.Hq);
    const ulong hk = h / ulong(p.Hq / p.Hk);
    const int Lq = int(p.Lq), Lk = int(p.Lk), D = int(p.D);
    device const T* qh = q + bh * ulong(p.Lq * p.D);
    device const T* kh = k + (b * ulong(p.Hk) + hk) * ulong(p.Lk * p.D);
    device const T* vh = v + (b * ulong(p.Hk) + hk) * ulong(p.Lk * p.D);

    // this lane's place in every 8x8 fragment (thread_elements): row fr, columns fc and fc + 1
    const int quad = lane / 4;
    const int fr = (quad & 4) + (lane / 2) % 4;
    const int fc = 2 * (quad & 2) + 2 * (lane % 2);
    const int i = row0 + sg * 8 + fr;                       // this lane's query row
    const bool has_mask = p.has_mask != 0;
    device const float* mrow = mask;
    if (has_mask) {
        mrow = mask + b * ulong(p.mask_sb) + h * ulong(p.mask_sh) + ulong(min(i, Lq - 1)) * ulong(p.mask_sq);
    }
    const int msk = int(p.mask_sk);

    simdgroup_matrix<T, 8, 8> qm[DK / 8];
    for (int r0 = 0; r0 < ATTN_BQ; r0 += QP) {
        if (r0 > 0) threadgroup_barrier(mem_flags::mem_threadgroup);
        attn_stage<T, DK, QP>(kv, qh + (row0 + r0) * D, Lq - row0 - r0, D, tid);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (sg * 8 >= r0 && sg * 8 < r0 + QP) {
            ATTN_UNROLL
            for (int d8 = 0; d8 < DK / 8; ++d8) simdgroup_load(qm[d8], kv + (sg * 8 - r0) * LD + d8 * 8, LD);
        }
    }

    simdgroup_matrix<float, 8, 8> om[DK / 8];
    ATTN_UNROLL
    for (int d8 = 0; d8 < DK / 8; ++d8) om[d8] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    float m_run = -INFINITY;                                // running max of this lane's row (base 2)
    float l_run = 0.0f;                                     // running sum of exp2(score - m_run)

    for (int k0 = 0; k0 < Lk; k0 += BK) {
        const int nk = min(BK, Lk - k0);
        threadgroup_barrier(mem_flags::mem_threadgroup);    // every simdgroup is done with Q / the last V
        attn_stage<T, DK, BK>(kv, kh + k0 * D, nk, D, tid);
        threadgroup_barrier(mem_flags::mem_threadgroup);

        simdgroup_matrix<float, 8, 8> sm[BK / 8];
        ATTN_UNROLL
        for (int j8 = 0; j8 < BK / 8; ++j8) {
            sm[j8] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
            if (j8 * 8 >= nk) continue;                     // uniform: past the last key
            ATTN_UNROLL
            for (int d8 = 0; d8 < DK / 8; ++d8) {
                simdgroup_matrix<T, 8, 8> kt;
                simdgroup_load(kt, kv + (j8 * 8) * LD + d8 * 8, LD, ulong2(0, 0), true);
                simdgroup_multiply_accumulate(sm[j8], qm[d8], kt, sm[j8]);
            }
        }

        // online softmax on this lane's elements of its row
        float mx = -INFINITY;
        ATTN_UNROLL
        for (int j8 = 0; j8 < BK / 8; ++j8) {
            thread vec<float, 2>& e = sm[j8].thread_elements();
            const int j = j8 * 8 + fc;                      // key of e[0], within the block
            float s0 = e[0] * scale_log2;
            float s1 = e[1] * scale_log2;
            if (has_mask) {
                if (j < nk) s0 += mrow[(k0 + j) * msk] * ATTN_LOG2E;
                if (j + 1 < nk) s1 += mrow[(k0 + j + 1) * msk] * ATTN_LOG2E;
            }
            if (j >= nk) s0 = -INFINITY;
            if (j + 1 >= nk) s1 = -INFINITY;
            e[0] = s0;
            e[1] = s1;
            mx = max(mx, max(s0, s1));
        }
        mx = max(mx, simd_shuffle_xor(mx, ushort(1)));
        mx = max(mx, simd_shuffle_xor(mx, ushort(8)));
        const float m_new = max(m_run, mx);
        const float m_use = m_new == -INFINITY ? 0.0f : m_new;     // a row masked so far: exp2(-inf) = 0
        const float alpha = exp2(m_run - m_use);
        float sum = 0.0f;
        ATTN_UNROLL
        for (int j8 = 0; j8 < BK / 8; ++j8) {
            thread vec<float, 2>& e = sm[j8].thread_elements();
            e[0] = exp2(e[0] - m_use);
            e[1] = exp2(e[1] - m_use);
            sum += e[0] + e[1];
        }
        sum += simd_shuffle_xor(sum, ushort(1));
        sum += simd_shuffle_xor(sum, ushort(8));
        l_run = l_run * alpha + sum;
        m_run = m_new;
        ATTN_UNROLL
        for (int d8 = 0; d8 < DK / 8; ++d8) om[d8].thread_elements() *= alpha;

        threadgroup_barrier(mem_flags::mem_threadgroup);    // every simdgroup is done with K
        attn_stage<T, DK, BK>(kv, vh + k0 * D, nk, D, tid);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        ATTN_UNROLL
        for (int j8 = 0; j8 < BK / 8; ++j8) {
            if (j8 * 8 >= nk) continue;
            ATTN_UNROLL
            for (int d8 = 0; d8 < DK / 8; ++d8) {
                simdgroup_matrix<T, 8, 8> vm;
                simdgroup_load(vm, kv + (j8 * 8) * LD + d8 * 8, LD);
                simdgroup_multiply_accumulate(om[d8], sm[j8], vm, om[d8]);
            }
        }
    }

    if (i >= Lq) return;
    const float inv = l_run > 0.0f ? 1.0f / l_run : 0.0f;  // every key masked: 0, not NaN
    device T* orow = out + bh * ulong(p.Lq * p.D) + ulong(i * D);
    ATTN_UNROLL
    for (int d8 = 0; d8 < DK / 8; ++d8) {
        const int col = d8 * 8 + fc;
        if (col >= D) break;
        const vec<float, 2> e = om[d8].thread_elements();
        *((device vec<T, 2>*)(orow + col)) = vec<T, 2>(T(e[0] * inv), T(e[1] * inv));
    }
}

// ---------------------------------------------------------------------------------------------
// The vector kernel. Threadgroup g covers key split g % p.splits of pairs [chunk * ATTN_VEC_ROWS, ...)
// of the G * Lq (head in the GQA group, query row) pairs of one (b, hk), chunk = g / p.splits % p.q_blocks:
// pair n is head hk * G + n / Lq, row n % Lq. With one split it writes out; with more, each split writes
// its unnormalised O, max and sum to `part` (fp32, pair-major: O at (pair * splits + split) * D, then
// (max, sum) at 2 * (pair * splits + split) after all O) and attention_vec_merge combines them.

template <typename T, int NT>
kernel void attention_vec(device const T* q [[buffer(0)]],
                          device const T* k [[buffer(1)]],
                          device const T* v [[buffer(2)]],
                          device const float* mask [[buffer(3)]],
                          device T* out [[buffer(4)]],
                          constant attention_params& p [[buffer(5)]],
                          constant float& scale_log2 [[buffer(6)]],
                          device float* part [[buffer(7)]],
                          uint tgid [[threadgroup_position_in_grid]],
                          ushort lane [[thread_index_in_simdgroup]],
                          ushort sg [[simdgroup_index_in_threadgroup]]) {
    constexpr int R = ATTN_VEC_ROWS;
    threadgroup float part_o[R * NT * 32];
    threadgroup float part_ml[2 * R];

    const ulong g = ulong(p.group_base) + tgid;
    const ulong gs = g / ulong(p.splits);
    const int split = int(g - gs * ulong(p.splits));
    const ulong bhk = gs / ulong(p.q_blocks);               // b * Hk + hk
    const int n0 = int(gs - bhk * ulong(p.q_blocks)) * R;
    const ulong b = bhk / ulong(p.Hk);
    const int G = int(p.Hq / p.Hk);
    const int Lq = int(p.Lq), D = int(p.D);
    const int pairs = min(R, G * Lq - n0);
    const int j_end = min(int(p.Lk), (split + 1) * int(p.split_keys));
    device const T* kh = k + bhk * ulong(p.Lk * p.D);
    device const T* vh = v + bhk * ulong(p.Lk * p.D);
    const bool has_mask = p.has_mask != 0;
    const int msk = int(p.mask_sk);

    float qv[R][NT];
    float acc[R][NT];
    float m_run[R];
    float l_run[R];
    device const float* mrow[R];
    ulong prow[R];                                          // the pair's index in (B, Hq, Lq)
    for (int r = 0; r < R; ++r) {
        const int n = min(n0 + r, G * Lq - 1);              // pairs past the end repeat the last one, unwritten
        const ulong h = (bhk - b * ulong(p.Hk)) * ulong(G) + ulong(n / Lq);
        const int i = n - (n / Lq) * Lq;
        prow[r] = (b * ulong(p.Hq) + h) * ulong(p.Lq) + ulong(i);
        mrow[r] = has_mask ? mask + b * ulong(p.mask_sb) + h * ulong(p.mask_sh) + ulong(i) * ulong(p.mask_sq) : mask;
        ATTN_UNROLL
        for (int t = 0; t < NT; ++t) {
            const int d = lane + 32 * t;
            qv[r][t] = d < D ? float(q[prow[r] * ulong(p.D) + ulong(d)]) * scale_log2 : 0.0f;
            acc[r][t] = 0.0f;
        }
        m_run[r] = -INFINITY;
        l_run[r] = 0.0f;
    }

    for (int j = split * int(p.split_keys) + sg; j < j_end; j += ATTN_VEC_SIMDS) {
        float kd[NT];
        float vd[NT];
        ATTN_UNROLL
        for (int t = 0; t < NT; ++t) {
            const int d = lane + 32 * t;
            kd[t] = d < D ? float(kh[j * D + d]) : 0.0f;
            vd[t] = d < D ? float(vh[j * D + d]) : 0.0f;
        }
        ATTN_UNROLL
        for (int r = 0; r < R; ++r) {
            if (r >= pairs) break;                          // uniform
            float s = 0.0f;
            ATTN_UNROLL
            for (int t = 0; t < NT; ++t) s = fma(qv[r][t], kd[t], s);
            s = simd_sum(s);
            if (has_mask) s += mrow[r][j * msk] * ATTN_LOG2E;
            if (s == -INFINITY) continue;                   // uniform (s is the simdgroup's): a masked key
            if (s > m_run[r]) {                             // uniform: a new max rescales the row
                const float alpha = exp2(m_run[r] - s);     // 0 for the first key
                l_run[r] *= alpha;
                ATTN_UNROLL
                for (int t = 0; t < NT; ++t) acc[r][t] *= alpha;
                m_run[r] = s;
            }
            const float e = exp2(s - m_run[r]);
            l_run[r] += e;
            ATTN_UNROLL
            for (int t = 0; t < NT; ++t) acc[r][t] = fma(e, vd[t], acc[r][t]);
        }
    }

    // merge the simdgroups' partial results into simdgroup 0's, one simdgroup at a time
    for (int s = 1; s < ATTN_VEC_SIMDS; ++s) {
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (sg == s) {
            for (int r = 0; r < pairs; ++r) {
                ATTN_UNROLL
                for (int t = 0; t < NT; ++t) part_o[(r * NT + t) * 32 + lane] = acc[r][t];
                if (lane == 0) {
                    part_ml[2 * r] = m_run[r];
                    part_ml[2 * r + 1] = l_run[r];
                }
            }
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (sg == 0) {
            for (int r = 0; r < pairs; ++r) {
                const float m2 = part_ml[2 * r];
                const float m_new = max(m_run[r], m2);
                if (m_new == -INFINITY) continue;
                const float a1 = exp2(m_run[r] - m_new);
                const float a2 = exp2(m2 - m_new);
                l_run[r] = l_run[r] * a1 + part_ml[2 * r + 1] * a2;
                m_run[r] = m_new;
                ATTN_UNROLL
                for (int t = 0; t < NT; ++t) acc[r][t] = acc[r][t] * a1 + part_o[(r * NT + t) * 32 + lane] * a2;
            }
        }
    }
    if (sg != 0) return;
    const ulong S = ulong(p.splits);
    for (int r = 0; r < pairs; ++r) {
        if (S > 1) {                                        // unnormalised, for attention_vec_merge
            device float* po = part + (prow[r] * S + ulong(split)) * ulong(p.D);
            ATTN_UNROLL
            for (int t = 0; t < NT; ++t) {
                const int d = lane + 32 * t;
                if (d < D) po[d] = acc[r][t];
            }
            if (lane == 0) {
                device float* pml = part + ulong(p.pairs) * S * ulong(p.D);
                pml[2 * (prow[r] * S + ulong(split))] = m_run[r];
                pml[2 * (prow[r] * S + ulong(split)) + 1] = l_run[r];
            }
            continue;
        }
        const float inv = l_run[r] > 0.0f ? 1.0f / l_run[r] : 0.0f;
        device T* orow = out + prow[r] * ulong(p.D);
        ATTN_UNROLL
        for (int t = 0; t < NT; ++t) {
            const int d = lane + 32 * t;
            if (d < D) orow[d] = T(acc[r][t] * inv);
        }
    }
}

// out = the splits of attention_vec combined: one simdgroup per (b, h, query row) pair, lane l holds
// d = l + 32 t. The splits' maxima are rebased on their common max; a pair with every key masked gives 0.
template <typename T>
kernel void attention_vec_merge(device const float* part [[buffer(0)]],
                                device T* out [[buffer(1)]],
                                constant attention_params& p [[buffer(2)]],
                                uint gid [[threadgroup_position_in_grid]],
                                ushort lane [[thread_index_in_simdgroup]],
                                ushort sg [[simdgroup_index_in_threadgroup]]) {
    const ulong pair = ulong(p.group_base) + ulong(gid) * ATTN_VEC_SIMDS + sg;
    if (pair >= ulong(p.pairs)) return;
    const int S = int(p.splits), D = int(p.D);
    device const float* pml = part + ulong(p.pairs) * ulong(S) * ulong(p.D) + 2 * pair * ulong(S);
    float m = -INFINITY;
    for (int s = 0; s < S; ++s) m = max(m, pml[2 * s]);
    float l = 0.0f;
    if (m != -INFINITY) {
        for (int s = 0; s < S; ++s) l += pml[2 * s + 1] * exp2(pml[2 * s] - m);
    }
    const float inv = l > 0.0f ? 1.0f / l : 0.0f;
    device const float* po = part + pair * ulong(S) * ulong(p.D);
    for (int d = lane; d < D; d += 32) {
        float o = 0.0f;
        if (m != -INFINITY) {
            for (int s = 0; s < S; ++s) o += po[s * D + d] * exp2(pml[2 * s] - m);
        }
        out[pair * ulong(p.D) + ulong(d)] = T(o * inv);
    }
}

