// Mixture-of-experts kernels: the router, the expert GEMV of decode and the grouped GEMM of prefill.
//
// moe_route<T, EPL>: softmax + top-k over the E <= 32 * EPL experts of each token row. One simdgroup per row,
//   each lane holding its EPL logits in registers (expert lane + 32 j): K rounds of a simd argmax over the
//   experts not taken yet (a bit mask per lane; ties go to the lower expert index, like a stable descending
//   sort), the softmax denominator by one simd_sum. No threadgroup memory, no barrier. Lane k keeps pick k
//   and writes it at the end: fp32 weights and int64 expert ids, descending. p.norm renormalises the K
//   weights to sum to 1 (Qwen3 norm_topk_prob; equals GPT-OSS's softmax over the top-k logits).
//
// moe_gemv<F, XT>: out[pair] = scale(e) * W[e] @ x[token] + bias[e] for every (token, expert) pair of a
//   decode step in one dispatch, e = pair_expert[pair]: gemv.h's skeleton (F a format of gemv_formats.h:
//   16- or 8-byte weight loads a lane, gemv_rows(1) output rows a simdgroup, x converted in the kernel, one
//   simd_sum per output), on the expert's weight rows. The grid is 3-D: x the rows of the expert's output,
//   y the pairs sharing a token's row of x (top-k), z the rows of x. No division.
//
// moe_grouped_gemm<E, XT, S, VEC>: prefill, out[r] = scale(e) * W[e] @ x[r] + bias[e] for rows sorted by expert
//   (offsets: cumulative rows per expert, as torch._grouped_mm takes them). A threadgroup of 4 simdgroups
//   computes a tile of MOE_GEMM_BM rows of one expert x MOE_GEMM_BN output columns as out^T = W x^T: each K step
//   of MOE_GEMM_BK stages the weight rows (E's decode: FP8 through half bits, exact) and x, transposed, in
//   threadgroup memory in 8x8 blocks of the staging type S, which the host picks 16-bit (bf16 or fp16) only
//   where it holds both x and the decoded weights exactly (grouped_staging in moe.py), else fp32. Each
//   simdgroup multiplies a 32 x 32 block with simdgroup_matrix 8x8 fragments (4 x 4 fp32 accumulators; the x
//   fragments wholly past the tile's rows skip their loads and products; a simdgroup wholly past N only
//   stages) and writes its outputs straight from the accumulators. 16-bit staging keeps a group's threadgroup
//   memory near 10 KiB: 6 groups (24 simdgroups) on a core of 64 KiB.
//   Grid y runs over the row tiles: each group finds its tile (expert, first
//   row, rows) from the offsets with a threadgroup prefix sum over the experts' tile counts, so no tile
//   table is built on the host; tiles past the last one leave at once. VEC: 16-byte loads for whole K steps
//   (the host checks alignment; the K tail and unaligned data go element by element, zero-filled past K).
//   Rows past a tile's rows and columns past N read a valid row (clamped) and are not written.

#include "gemv_formats.h"

// ------------------------------------------------------------------------------------------------- router

template <typename T, int EPL>
kernel void moe_route(device const T* logits [[buffer(0)]],
                      device float* weights [[buffer(1)]],
                      device long* experts [[buffer(2)]],
                      constant moe_route_params& p [[buffer(3)]],
                      uint gid [[thread_position_in_grid]],
                      uint lane [[thread_index_in_simdgroup]]) {
    const uint row = gid / 32u;
    if (row >= uint(p.rows)) return;                       // the whole simdgroup
    const uint E = uint(p.experts), K = uint(p.top_k);
    device const T* lg = logits + row * E;
    float v[EPL];
    UNROLL for (int j = 0; j < EPL; ++j) {
        const uint c = lane + 32u * uint(j);
        v[j] = c < E ? io_float(lg + c) : -INFINITY;
    }
    uint taken = 0u;                                       // bit j: expert lane + 32 j is picked
    float m = 0.0f, s = 1.0f, picked = 0.0f, mine_w = 0.0f;
    uint mine_e = 0u;
    for (uint k = 0; k < K; ++k) {
        float best = -INFINITY;
        uint best_c = E;                                   // E: none left in this lane
        UNROLL for (int j = 0; j < EPL; ++j) {
            const uint c = lane + 32u * uint(j);
            if (c < E && (taken & (1u << j)) == 0u && (best_c == E || v[j] > best)) {
                best = v[j];
                best_c = c;
            }
        }
        const float top = simd_max(best_c < E ? best : -INFINITY);
        const uint e = simd_min(best_c < E && best == top ? best_c : 0xFFFFFFFFu);
        if (k == 0u) {                                     // the row max is the first pick
            m = top;
            float acc = 0.0f;
            UNROLL for (int j = 0; j < EPL; ++j) acc += lane + 32u * uint(j) < E ? exp(v[j] - m) : 0.0f;
            s = simd_sum(acc);
        }
        const float pk = exp(top - m) / s;
        picked += pk;
        if ((e & 31u) == lane) taken |= 1u << (e >> 5);
        if (k == lane) {
            mine_w = pk;
            mine_e = e;
        }
    }
    if (lane < K) {
        weights[row * K + lane] = p.norm != 0 ? mine_w / picked : mine_w;
        experts[row * K + lane] = long(mine_e);
    }
}

// --------------------------------------------------------------------------------------- expert GEMV

template <typename F, typename XT>
kernel void moe_gemv(device const XT* x [[buffer(0)]],
                     device const long* pair_expert [[buffer(1)]],
                     device const uchar* w [[buffer(2)]],
                     device const float* scale [[buffer(3)]],
                     device const uchar* bias [[buffer(4)]],
                     device uchar* y [[buffer(5)]],
                     constant gemv_params& p [[buffer(6)]],
                     constant moe_gemv_params& mp [[buffer(7)]],
                     uint3 gid [[thread_position_in_grid]],
                     uint3 grid [[threads_per_grid]],
                     uint tid [[thread_index_in_threadgroup]],
                     uint group_size [[threads_per_threadgroup]],
                     uint lane [[thread_index_in_simdgroup]]) {
    threadgroup float table[GEMV_TABLE_SIZE];
    gemv_fill_table<F>(table, tid, group_size);
    const uint pair = gid.z * grid.y + gid.y;
    const ulong e = ulong(pair_expert[pair]);
    const typename F::args fa{};
    gemv_body<F, XT, 1>(x + ulong(gid.z) * ulong(p.K), w + e * ulong(mp.expert_bytes),
                        scale + e * ulong(mp.scale_stride), bias + e * ulong(mp.bias_stride),
                        y + ulong(pair) * ulong(mp.y_stride), p, gid.x, lane, table, fa);
}

// -------------------------------------------------------------------------------------- grouped GEMM

#define MOE_GEMM_SIMDS (MOE_GEMM_THREADS / 32)
#define MOE_GEMM_KB (MOE_GEMM_BK / 8)         // 8x8 blocks along K of a staged K step
#define MOE_GEMM_MB (MOE_GEMM_BM / 8)         // 8x8 blocks along the tile's rows
static_assert(MOE_GEMM_THREADS == 128 && MOE_GEMM_BM == 32 && MOE_GEMM_BN == 128 && MOE_GEMM_BK == 32,
              "the staging and fragment layout below are written for 4 simdgroups on a 32 x 128 tile, K steps of 32");

// The staging types: how a K step's values are kept in threadgroup memory. Values are only ever stored
// there exactly (the host picks a 16-bit type only where it holds both x and the decoded weights exactly).
// put(p, v) stores one value, put4(p, v) four consecutive ones, P the element pitch of an x block (64 values
// and a pad: a block's start moves 8 banks on from the previous one, so the transposed x stores of a
// simdgroup hit distinct banks).
struct moe_stage_float {
    typedef float T;
    enum { P = 66 };
    static void put(threadgroup T* p, float v) { *p = v; }
    static void put4(threadgroup T* p, float4 v) { *((threadgroup float4*)p) = v; }
};
struct moe_stage_half {
    typedef half T;
    enum { P = 68 };
    static ushort bits(float v) { return as_type<ushort>(half(v)); }
    static uint pack(float a, float b) { return as_type<uint>(half2(a, b)); }
    static void put(threadgroup T* p, float v) { *((threadgroup ushort*)p) = bits(v); }
    static void put4(threadgroup T* p, float4 v) { *((threadgroup uint2*)p) = as_type<uint2>(half4(v)); }
};
struct moe_stage_bfloat {                  // exact values: the top half of the fp32 bits
    typedef bfloat T;
    enum { P = 68 };
    static ushort bits(float v) { return ushort(as_type<uint>(v) >> 16); }
    static uint pack(float a, float b) { return (as_type<uint>(a) >> 16) | (as_type<uint>(b) & 0xFFFF0000u); }
    static void put(threadgroup T* p, float v) { *((threadgroup ushort*)p) = bits(v); }
    static void put4(threadgroup T* p, float4 v) {
        *((threadgroup uint2*)p) = uint2(pack(v.x, v.y), pack(v.z, v.w));
    }
};

// Values 8h .. 8h + 7 of a 16-byte weight chunk as the 16-bit words of a 16-bit staging type S: decoded and
// packed, or the raw chunk where the weights already are S.
template <typename S, typename E>
inline uint4 moe_bits8(uint4 raw, int h) {
    const float4 a = E::decode4(raw, 2 * h), b = E::decode4(raw, 2 * h + 1);
    return uint4(S::pack(a.x, a.y), S::pack(a.z, a.w), S::pack(b.x, b.y), S::pack(b.z, b.w));
}
template <>
inline uint4 moe_bits8<moe_stage_bfloat, gemv_bfloat>(uint4 raw, int h) { return raw; }
template <>
inline uint4 moe_bits8<moe_stage_half, gemv_half>(uint4 raw, int h) { return raw; }

// The layouts of a staged K step, both in 8x8 blocks that simdgroup_load reads with a row pitch of 8:
// ws (the weight rows: A of out^T = W x^T) block (n / 8, k / 8) at (n / 8 * KB + k / 8) * 64, row n % 8;
// xs (x transposed: B) block (k / 8, m / 8) at (k / 8 * MB + m / 8) * P, row k % 8, column m % 8.
inline uint moe_ws_at(uint n, uint k) {
    return ((n / 8u) * uint(MOE_GEMM_KB) + k / 8u) * 64u + (n % 8u) * 8u + k % 8u;
}
template <typename S>
inline uint moe_xs_at(uint m, uint k) {
    return ((k / 8u) * uint(MOE_GEMM_MB) + m / 8u) * uint(S::P) + (k % 8u) * 8u + m % 8u;
}

struct moe_tile {
    uint expert, row0, rows;
};

// Tile t of the row tiles: the experts' rows cut into tiles of MOE_GEMM_BM, expert after expert. Every thread
// of the group calls it; rows == 0 past the last tile. Each pass takes MOE_GEMM_THREADS experts: a simd
// prefix sum of their tile counts, the simdgroups' totals through threadgroup memory, and the thread whose
// expert holds tile t writes it.
inline moe_tile moe_find_tile(device const int* offsets, uint experts, uint rows, uint t, uint tid, uint lane,
                              uint sg, threadgroup uint* scratch) {
    if (tid == 0u) scratch[MOE_GEMM_SIMDS + 2] = 0u;
    uint before = 0u;                                      // tiles of the experts of earlier passes
    for (uint e0 = 0; e0 < experts; e0 += MOE_GEMM_THREADS) {
        const uint e = e0 + tid;
        const uint end = e < experts ? uint(clamp(offsets[e], 0, int(rows))) : 0u;
        const uint start = e < experts && e > 0u ? uint(clamp(offsets[e - 1u], 0, int(rows))) : 0u;
        const uint count = end > start ? end - start : 0u;
        const uint tiles = (count + uint(MOE_GEMM_BM - 1)) / uint(MOE_GEMM_BM);
        const uint incl = simd_prefix_inclusive_sum(tiles);
        if (lane == 31u) scratch[sg] = incl;
        threadgroup_barrier(mem_flags::mem_threadgroup);
        uint first = before + incl - tiles, pass = 0u;
        UNROLL for (uint s = 0; s < uint(MOE_GEMM_SIMDS); ++s) {
            first += s < sg ? scratch[s] : 0u;
            pass += scratch[s];
        }
        if (t >= first && t < first + tiles) {
            const uint row0 = start + (t - first) * uint(MOE_GEMM_BM);
            scratch[MOE_GEMM_SIMDS] = e;
            scratch[MOE_GEMM_SIMDS + 1] = row0;
            scratch[MOE_GEMM_SIMDS + 2] = min(uint(MOE_GEMM_BM), end - row0);
        }
        before += pass;
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    moe_tile tile;
    tile.expert = scratch[MOE_GEMM_SIMDS];
    tile.row0 = scratch[MOE_GEMM_SIMDS + 1];
    tile.rows = scratch[MOE_GEMM_SIMDS + 2];
    return tile;
}

// A 16-byte weight chunk (values k .. k + 16 / E::BYTES - 1 of row r) into ws: 16-bit staging stores each 8
// values as one 16-byte row of a block, fp32 staging 4 values at a time.
template <typename E, typename T, typename S>
inline void moe_put_w16(threadgroup T* ws, uint r, uint k, uint4 raw) {
    static_assert(E::BYTES <= 2, "16-bit staging holds 16-bit or FP8 weights only");
    UNROLL for (uint h = 0; h < 2u / uint(E::BYTES); ++h)
        *((threadgroup uint4*)(ws + moe_ws_at(r, k + 8u * h))) = moe_bits8<S, E>(raw, int(h));
}
template <typename E>
inline void moe_put_w(threadgroup half* ws, uint r, uint k, uint4 raw) { moe_put_w16<E, half, moe_stage_half>(ws, r, k, raw); }
template <typename E>
inline void moe_put_w(threadgroup bfloat* ws, uint r, uint k, uint4 raw) {
    moe_put_w16<E, bfloat, moe_stage_bfloat>(ws, r, k, raw);
}
template <typename E>
inline void moe_put_w(threadgroup float* ws, uint r, uint k, uint4 raw) {
    UNROLL for (uint g = 0; g < 4u / uint(E::BYTES); ++g)
        moe_stage_float::put4(ws + moe_ws_at(r, k + 4u * g), E::decode4(raw, int(g)));
}

// One K step of 16-byte loads (k0 + MOE_GEMM_BK <= K). The weight rows n0.. as chunks of 16 bytes (2 E::BYTES
// chunks a thread): a 16-bit S stores each 8 values of a chunk as one 16-byte row of a block, fp32 4 at a
// time. x as chunks of 8 values, stored transposed.
template <typename S, typename E>
inline void moe_stage_w_vec(threadgroup typename S::T* ws, device const uchar* wr, uint row_bytes, uint k0,
                            uint cols, uint tid) {
    constexpr uint CH = 16u / uint(E::BYTES);              // values of a 16-byte chunk
    constexpr uint CPR = uint(MOE_GEMM_BK) / CH;           // chunks of a row's K step
    UNROLL for (uint j = 0; j < uint(MOE_GEMM_BN) * CPR / uint(MOE_GEMM_THREADS); ++j) {
        const uint i = tid + j * uint(MOE_GEMM_THREADS);
        const uint r = i / CPR, c = i % CPR;
        moe_put_w<E>(ws, r, c * CH, *((device const uint4*)(wr + min(r, cols - 1u) * row_bytes + (k0 + c * CH) * uint(E::BYTES))));
    }
}

template <typename S, typename XT>
inline void moe_stage_x_vec(threadgroup typename S::T* xs, device const XT* xr, uint K, uint k0, uint rows, uint tid) {
    if (sizeof(typename S::T) == 2) {
        // x already in S (the host's choice): its bits, rows m and m + 1 a thread (64 threads: two simdgroups),
        // so that each store writes the word of both rows at one k
        if (tid >= uint(MOE_GEMM_BM * MOE_GEMM_BK / 16)) return;
        const uint m = (tid / 4u) * 2u, c = (tid % 4u) * 8u;
        const uint4 u0 = *((device const uint4*)(xr + min(m, rows - 1u) * K + k0 + c));
        const uint4 u1 = *((device const uint4*)(xr + min(m + 1u, rows - 1u) * K + k0 + c));
        threadgroup uint* d = (threadgroup uint*)(xs + moe_xs_at<S>(m, c));   // k = c + j: word 4 j
        UNROLL for (uint i = 0; i < 4u; ++i) {
            d[8u * i] = (u0[i] & 0xFFFFu) | (u1[i] << 16);
            d[8u * i + 4u] = (u0[i] >> 16) | (u1[i] & 0xFFFF0000u);
        }
    } else {                                                // fp32: 8 values of row m a thread, one by one
        const uint m = tid / 4u, c = (tid % 4u) * 8u;
        threadgroup typename S::T* d = xs + moe_xs_at<S>(m, c);
        float4 a, b;
        io_float8(xr + min(m, rows - 1u) * K + k0 + c, a, b);
        UNROLL for (uint i = 0; i < 4u; ++i) {
            S::put(d + 8u * i, a[i]);
            S::put(d + 8u * (i + 4u), b[i]);
        }
    }
}

// One K step element by element (any alignment, any K): zero past K.
template <typename S, typename E, typename XT>
inline void moe_stage_checked(threadgroup typename S::T* xs, threadgroup typename S::T* ws, device const uchar* wr,
                              device const XT* xr, uint row_bytes, uint K, uint k0, uint rows, uint cols, uint tid) {
    const uint k = tid % uint(MOE_GEMM_BK);                // lanes along K: coalesced
    const bool in_k = k0 + k < K;
    UNROLL for (uint j = 0; j < uint(MOE_GEMM_BN * MOE_GEMM_BK / MOE_GEMM_THREADS); ++j) {
        const uint r = tid / uint(MOE_GEMM_BK) + j * uint(MOE_GEMM_THREADS / MOE_GEMM_BK);
        S::put(ws + moe_ws_at(r, k), in_k ? E::decode1(wr + min(r, cols - 1u) * row_bytes + (k0 + k) * uint(E::BYTES)) : 0.0f);
    }
    UNROLL for (uint j = 0; j < uint(MOE_GEMM_BM * MOE_GEMM_BK / MOE_GEMM_THREADS); ++j) {
        const uint m = tid / uint(MOE_GEMM_BK) + j * uint(MOE_GEMM_THREADS / MOE_GEMM_BK);
        S::put(xs + moe_xs_at<S>(m, k), in_k ? io_float(xr + min(m, rows - 1u) * K + k0 + k) : 0.0f);
    }
}

// One K step of a simdgroup's 32 x 32 block of out^T (its 32 weight rows, from wa = their first block, x the
// tile's rows): 4 row fragments of W x the first MJ column fragments of x^T (fragments wholly past the tile's
// rows are skipped).
template <int MJ, typename S>
inline void moe_mma_step(thread simdgroup_matrix<float, 8, 8> (&acc)[4][4], threadgroup const typename S::T* wa,
                         threadgroup const typename S::T* xs) {
    typedef typename S::T T;
    UNROLL for (uint kb = 0; kb < uint(MOE_GEMM_KB); ++kb) {
        simdgroup_matrix<T, 8, 8> a[4], b[MJ];
        UNROLL for (uint i = 0; i < 4u; ++i) simdgroup_load(a[i], wa + (i * uint(MOE_GEMM_KB) + kb) * 64u, 8ul);
        UNROLL for (int j = 0; j < MJ; ++j) simdgroup_load(b[j], xs + (kb * uint(MOE_GEMM_MB) + uint(j)) * uint(S::P), 8ul);
        UNROLL for (uint i = 0; i < 4u; ++i)
            UNROLL for (int j = 0; j < MJ; ++j) simdgroup_multiply_accumulate(acc[i][j], a[i], b[j], acc[i][j]);
    }
}

template <typename E, typename XT, typename S, bool VEC>
kernel void moe_grouped_gemm(device const XT* x [[buffer(0)]],
                             device const int* offsets [[buffer(1)]],
                             device const uchar* w [[buffer(2)]],
                             device const float* scale [[buffer(3)]],
                             device const float* bias [[buffer(4)]],
                             device float* out [[buffer(5)]],
                             constant moe_gemm_params& p [[buffer(6)]],
                             uint2 group [[threadgroup_position_in_grid]],
                             uint tid [[thread_index_in_threadgroup]],
                             uint lane [[thread_index_in_simdgroup]],
                             uint sg [[simdgroup_index_in_threadgroup]]) {
    typedef typename S::T T;
    threadgroup T xs[MOE_GEMM_KB * MOE_GEMM_MB * S::P];
    threadgroup T ws[MOE_GEMM_BN * MOE_GEMM_BK];
    threadgroup uint scratch[MOE_GEMM_SIMDS + 3];
    const moe_tile tile = moe_find_tile(offsets, uint(p.experts), uint(p.rows), group.y, tid, lane, sg, scratch);
    if (tile.rows == 0u) return;                          // the whole group: past the last tile
    const uint N = uint(p.N), K = uint(p.K), row_bytes = uint(p.row_bytes);
    const uint n0 = group.x * uint(MOE_GEMM_BN);
    const uint cols = min(uint(MOE_GEMM_BN), N - n0);
    device const uchar* wr = w + (ulong(tile.expert) * ulong(N) + n0) * ulong(row_bytes);
    device const XT* xr = x + ulong(tile.row0) * ulong(K);

    simdgroup_matrix<float, 8, 8> acc[4][4];
    UNROLL for (int i = 0; i < 4; ++i)
        UNROLL for (int j = 0; j < 4; ++j) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    const uint sn = sg * 32u;                             // this simdgroup's 32 columns of the tile
    const uint mj = (tile.rows + 7u) / 8u;                // x^T fragments holding the tile's rows
    const bool busy = sn < cols;                          // a simdgroup wholly past N only stages
    threadgroup const T* wa = ws + sn * uint(MOE_GEMM_KB * 8);  // its first block: (sn / 8) * KB * 64
    const uint k_vec = VEC ? (K / uint(MOE_GEMM_BK)) * uint(MOE_GEMM_BK) : 0u;

    for (uint k0 = 0; k0 < K; k0 += uint(MOE_GEMM_BK)) {
        if (k0 < k_vec) {
            moe_stage_w_vec<S, E>(ws, wr, row_bytes, k0, cols, tid);
            moe_stage_x_vec<S, XT>(xs, xr, K, k0, tile.rows, tid);
        } else {
            moe_stage_checked<S, E, XT>(xs, ws, wr, xr, row_bytes, K, k0, tile.rows, cols, tid);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (busy) {
            if (mj == 4u) moe_mma_step<4, S>(acc, wa, xs);
            else if (mj == 3u) moe_mma_step<3, S>(acc, wa, xs);
            else if (mj == 2u) moe_mma_step<2, S>(acc, wa, xs);
            else moe_mma_step<1, S>(acc, wa, xs);
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    // The epilogue straight from the accumulators: lane holds out^T[n][m], out^T[n][m + 1] of each fragment
    // (row n = its fragment row, m its two columns), so it reads the scale and bias of its 4 columns n once.
    if (!busy) return;
    const uint2 rc = uint2((lane / 2u) % 4u + ((lane / 4u) & 4u), 2u * ((lane / 4u) & 2u) + 2u * (lane % 2u));
    device float* o = out + ulong(tile.row0) * ulong(N) + n0;
    UNROLL for (uint i = 0; i < 4u; ++i) {
        const uint n = sn + 8u * i + rc.x;
        if (n >= cols) continue;
        const float s = E::unit() * scale[ulong(tile.expert) * ulong(p.scale_stride_e) + ulong(n0 + n) * ulong(p.scale_stride_n)];
        const float b = p.has_bias != 0 ? bias[ulong(tile.expert) * ulong(N) + n0 + n] : 0.0f;
        UNROLL for (uint j = 0; j < 4u; ++j) {
            const uint m = 8u * j + rc.y;
            const thread vec<float, 2>& v = acc[i][j].thread_elements();
            if (m < tile.rows) o[ulong(m) * N + n] = fma(v[0], s, b);
            if (m + 1u < tile.rows) o[ulong(m + 1u) * N + n] = fma(v[1], s, b);
        }
    }
}
