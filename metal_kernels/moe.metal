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
// moe_grouped_gemm<E, XT, VEC>: prefill, out[r] = scale(e) * W[e] @ x[r] + bias[e] for rows sorted by expert
//   (offsets: cumulative rows per expert, as torch._grouped_mm takes them). A threadgroup of 4 simdgroups
//   computes a tile of MOE_GEMM_BM rows of one expert x MOE_GEMM_BN output columns: each K step of
//   MOE_GEMM_BK stages x and the weight rows in threadgroup memory as fp32 (E's decode: FP8 through half
//   bits, exact), then each simdgroup multiplies a 16 x 32 block with simdgroup_matrix 8x8 fragments
//   (2 x 4 accumulators, fp32; row fragments wholly past the tile's rows skip their loads and products).
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
#define MOE_GEMM_LD (MOE_GEMM_BK + 4)        // fp32 row pitch of the staged tiles (conflict-free fragments)
#define MOE_GEMM_LDC (MOE_GEMM_BN + 4)       // fp32 row pitch of the output tile staged for the epilogue
static_assert(MOE_GEMM_THREADS == 128 && MOE_GEMM_BM == 32 && MOE_GEMM_BN == 64 && MOE_GEMM_BK == 32,
              "the staging and fragment layout below are written for 4 simdgroups on a 32 x 64 tile, K steps of 32");

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

// One K step of 16-byte loads: the weight rows n0.. as chunks of 16 bytes (E::BYTES chunks a thread), x as
// chunks of 8 values (one a thread). k0 + MOE_GEMM_BK <= K.
template <typename E, typename XT>
inline void moe_stage_vec(threadgroup float* xs, threadgroup float* ws, device const uchar* wr, device const XT* xr,
                          uint row_bytes, uint K, uint k0, uint rows, uint cols, uint tid) {
    constexpr uint CH = 16u / uint(E::BYTES);              // values of a 16-byte chunk
    constexpr uint CPR = uint(MOE_GEMM_BK) / CH;           // chunks of a row's K step
    UNROLL for (uint j = 0; j < uint(E::BYTES); ++j) {
        const uint i = tid + j * uint(MOE_GEMM_THREADS);
        const uint r = i / CPR, c = i % CPR;
        const uint4 raw = *((device const uint4*)(wr + min(r, cols - 1u) * row_bytes + (k0 + c * CH) * uint(E::BYTES)));
        UNROLL for (uint g = 0; g < CH / 4u; ++g)
            *((threadgroup float4*)(ws + r * uint(MOE_GEMM_LD) + c * CH + 4u * g)) = E::decode4(raw, int(g));
    }
    const uint r = tid / 4u, c = (tid % 4u) * 8u;
    float4 a, b;
    io_float8(xr + min(r, rows - 1u) * K + k0 + c, a, b);
    *((threadgroup float4*)(xs + r * uint(MOE_GEMM_LD) + c)) = a;
    *((threadgroup float4*)(xs + r * uint(MOE_GEMM_LD) + c + 4u)) = b;
}

// One K step element by element (any alignment, any K): zero past K.
template <typename E, typename XT>
inline void moe_stage_checked(threadgroup float* xs, threadgroup float* ws, device const uchar* wr,
                              device const XT* xr, uint row_bytes, uint K, uint k0, uint rows, uint cols, uint tid) {
    const uint k = tid % uint(MOE_GEMM_BK);                // lanes along K: coalesced
    const bool in_k = k0 + k < K;
    UNROLL for (uint j = 0; j < uint(MOE_GEMM_BN * MOE_GEMM_BK / MOE_GEMM_THREADS); ++j) {
        const uint r = tid / uint(MOE_GEMM_BK) + j * uint(MOE_GEMM_THREADS / MOE_GEMM_BK);
        ws[r * uint(MOE_GEMM_LD) + k] =
            in_k ? E::decode1(wr + min(r, cols - 1u) * row_bytes + (k0 + k) * uint(E::BYTES)) : 0.0f;
    }
    UNROLL for (uint j = 0; j < uint(MOE_GEMM_BM * MOE_GEMM_BK / MOE_GEMM_THREADS); ++j) {
        const uint r = tid / uint(MOE_GEMM_BK) + j * uint(MOE_GEMM_THREADS / MOE_GEMM_BK);
        xs[r * uint(MOE_GEMM_LD) + k] = in_k ? io_float(xr + min(r, rows - 1u) * K + k0 + k) : 0.0f;
    }
}

// One K step of a simdgroup's block: its first MI row fragments (of 2; fragments wholly past the tile's rows
// are skipped) x 4 column fragments.
template <int MI>
inline void moe_mma_step(thread simdgroup_matrix<float, 8, 8> (&acc)[2][4], threadgroup const float* xs,
                         threadgroup const float* ws, uint sm, uint sn) {
    UNROLL for (uint kk = 0; kk < uint(MOE_GEMM_BK); kk += 8u) {
        simdgroup_matrix<float, 8, 8> a[MI], b[4];
        UNROLL for (int i = 0; i < MI; ++i)
            simdgroup_load(a[i], xs + (sm + 8u * uint(i)) * uint(MOE_GEMM_LD) + kk, ulong(MOE_GEMM_LD));
        UNROLL for (uint j = 0; j < 4u; ++j)          // b = the weight rows transposed: b[k][n] = ws[n][k]
            simdgroup_load(b[j], ws + (sn + 8u * j) * uint(MOE_GEMM_LD) + kk, ulong(MOE_GEMM_LD), ulong2(0, 0), true);
        UNROLL for (int i = 0; i < MI; ++i)
            UNROLL for (uint j = 0; j < 4u; ++j) simdgroup_multiply_accumulate(acc[i][j], a[i], b[j], acc[i][j]);
    }
}

template <typename E, typename XT, bool VEC>
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
    threadgroup float xs[MOE_GEMM_BM * MOE_GEMM_LD];
    threadgroup float ws[MOE_GEMM_BN * MOE_GEMM_LD];
    threadgroup uint scratch[MOE_GEMM_SIMDS + 3];
    const moe_tile tile = moe_find_tile(offsets, uint(p.experts), uint(p.rows), group.y, tid, lane, sg, scratch);
    if (tile.rows == 0u) return;                          // the whole group: past the last tile
    const uint N = uint(p.N), K = uint(p.K), row_bytes = uint(p.row_bytes);
    const uint n0 = group.x * uint(MOE_GEMM_BN);
    const uint cols = min(uint(MOE_GEMM_BN), N - n0);
    device const uchar* wr = w + (ulong(tile.expert) * ulong(N) + n0) * ulong(row_bytes);
    device const XT* xr = x + ulong(tile.row0) * ulong(K);

    simdgroup_matrix<float, 8, 8> acc[2][4];
    UNROLL for (int i = 0; i < 2; ++i)
        UNROLL for (int j = 0; j < 4; ++j) acc[i][j] = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
    const uint sm = (sg / 2u) * 16u, sn = (sg % 2u) * 32u;     // this simdgroup's 16 x 32 block
    const uint k_vec = VEC ? (K / uint(MOE_GEMM_BK)) * uint(MOE_GEMM_BK) : 0u;

    for (uint k0 = 0; k0 < K; k0 += uint(MOE_GEMM_BK)) {
        if (k0 < k_vec) moe_stage_vec<E, XT>(xs, ws, wr, xr, row_bytes, K, k0, tile.rows, cols, tid);
        else moe_stage_checked<E, XT>(xs, ws, wr, xr, row_bytes, K, k0, tile.rows, cols, tid);
        threadgroup_barrier(mem_flags::mem_threadgroup);
        if (sm + 8u < tile.rows) moe_mma_step<2>(acc, xs, ws, sm, sn);
        else if (sm < tile.rows) moe_mma_step<1>(acc, xs, ws, sm, sn);
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }

    // The output tile through threadgroup memory (ws is free now), then row by row: each thread keeps one
    // column, so it reads that column's scale and bias once.
    threadgroup float* cs = ws;
    UNROLL for (uint i = 0; i < 2u; ++i)
        UNROLL for (uint j = 0; j < 4u; ++j)
            simdgroup_store(acc[i][j], cs + (sm + 8u * i) * uint(MOE_GEMM_LDC) + sn + 8u * j, ulong(MOE_GEMM_LDC));
    threadgroup_barrier(mem_flags::mem_threadgroup);
    const uint c = tid % uint(MOE_GEMM_BN);
    if (c < cols) {
        const uint n = n0 + c;
        const float s = E::unit() * scale[ulong(tile.expert) * ulong(p.scale_stride_e) + ulong(n) * ulong(p.scale_stride_n)];
        const float b = p.has_bias != 0 ? bias[ulong(tile.expert) * ulong(N) + n] : 0.0f;
        device float* o = out + ulong(tile.row0) * ulong(N) + n;
        for (uint r = tid / uint(MOE_GEMM_BN); r < tile.rows; r += uint(MOE_GEMM_THREADS / MOE_GEMM_BN))
            o[r * N] = fma(cs[r * uint(MOE_GEMM_LDC) + c], s, b);
    }
}
