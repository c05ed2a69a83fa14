// The GEMV skeleton shared by the dense and FP8 weights (linear.metal) and the GGUF blocks (gguf.metal):
//
//     y[m, n] = (sum_k x[m, k] * w[n, k]) * scale(n) + bias[n]      for m < M <= GEMV_MAX_M, fp32 sums
//
// gemv<F, XT>: x (M, K) of type XT (float, half, bfloat) read and converted in the kernel; w the weight
// bytes, row n at n * p.row_bytes; scale fp32, p.scale_mode 0 none, 1 scale[0], 2 scale[n]; bias (when
// p.has_bias) and y of the types p.bias_kind / p.out_kind (MSL_KIND_*), so no conversion runs around it.
//
// One simdgroup computes gemv_rows(MM) adjacent output rows n0.. for all M rows of x. A row of K values is
// cut into chunks of F::CHUNK values; lane l takes chunks l, l + 32, ... (the 32 chunks of one step are
// consecutive bytes), loads its chunk of each of the rows once, loads the matching x values once per step
// and uses them for every row, and keeps one fp32 sum per (row, m) in registers; one simd_sum per output at
// the end. Offsets inside a row are 32-bit. Rows past N read row N - 1 and are not written; x rows past M
// read row M - 1 (M runs the body compiled for the power of two at or above it). No threadgroup memory but
// F's 16-entry table (IQ4 types), so a partial last threadgroup is harmless.
//
// gemv_run<F, XT>(..., fa): the body for the M bucket of p.M; the kernels (gemv below, moe.metal's moe_gemv,
// quant.metal's quant_gemv) call it or gemv_body after filling F's table.
//
// A weight format F provides (gemv_format gives the defaults):
//   enum CHUNK          values per chunk (K is a multiple of it);
//   enum TABLE          1 if dot() reads the threadgroup table, filled with table_value(0..15);
//   enum ROWS           1 if dot() reads w.row(r), the index of row r (quant.metal's block scales);
//   unit()              a factor every decoded value carries (FP8_E4M3FN_UNIT), folded into the scale;
//   args                what dot() reads besides the weight bytes (the block scales of quant.metal's
//                       formats; empty by default), built by the kernel and passed through unchanged;
//   dot<R, MM, XT>(w, c, x, acc, table, fa): acc.v[r][m] += the products of chunk c of row r (its index
//                       w.row(r)) with x row m.

#define GEMV_TABLE_SIZE 16

struct gemv_format {
    enum { TABLE = 0, ROWS = 0 };
    struct args {};
    static float unit() { return 1.0f; }
    static float table_value(uint i) { return 0.0f; }
};

// MM rows of x: row m at p + off[m] (rows past M repeat row M - 1). load8 needs k % 8 == 0 and x 16-byte
// aligned rows (one 16-byte load of half or bfloat values).
template <typename XT, int MM>
struct gemv_x {
    device const XT* p;
    uint off[MM];
    float4 load4(int m, uint k) const { return io_float4(p + off[m] + k); }
    void load8(int m, uint k, thread float4& a, thread float4& b) const { io_float8(p + off[m] + k, a, b); }
    float load1(int m, uint k) const { return io_float(p + off[m] + k); }
};

// R weight rows: row r (the weight's row row(r)) at p + off[r].
template <int R>
struct gemv_w {
    device const uchar* p;
    uint off[R];
    uint n0, last;
    uint row(int r) const { return min(n0 + uint(r), last); }
};

template <int R, int MM>
struct gemv_acc {
    float v[R][MM];
};

inline float gemv_fma4(float4 x, float4 w, float acc) {
    return fma(x.w, w.w, fma(x.z, w.z, fma(x.y, w.y, fma(x.x, w.x, acc))));
}

// F's table in threadgroup memory (the threadgroup's `size` threads fill it); every thread must call it.
template <typename F>
inline void gemv_fill_table(threadgroup float* table, uint tid, uint size) {
    if (F::TABLE) {
        for (uint i = tid; i < GEMV_TABLE_SIZE; i += size) table[i] = F::table_value(i);
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
}

template <typename F, typename XT, int MM>
inline void gemv_body(device const XT* x, device const uchar* w, device const float* scale,
                      device const uchar* bias, device uchar* y, constant gemv_params& p, uint gid, uint lane,
                      threadgroup const float* table, thread const typename F::args& fa) {
    constexpr int R = gemv_rows(MM);
    const uint N = uint(p.N);
    const uint M = uint(p.M);
    const uint n0 = (gid / 32u) * uint(R);
    if (n0 >= N) return;                                   // the whole simdgroup
    const uint row_bytes = uint(p.row_bytes);
    gemv_x<XT, MM> xs;
    xs.p = x;
    UNROLL for (int m = 0; m < MM; ++m) xs.off[m] = min(uint(m), M - 1u) * uint(p.K);
    gemv_w<R> ws;
    ws.p = w + ulong(n0) * ulong(row_bytes);
    ws.n0 = n0;
    ws.last = F::ROWS ? N - 1u : 0u;           // row(r) only for the formats that ask (ROWS)
    UNROLL for (int r = 0; r < R; ++r) ws.off[r] = (min(n0 + uint(r), N - 1u) - n0) * row_bytes;
    gemv_acc<R, MM> acc;
    UNROLL for (int r = 0; r < R; ++r)
        UNROLL for (int m = 0; m < MM; ++m) acc.v[r][m] = 0.0f;

    const uint chunks = uint(p.K) / uint(F::CHUNK);
    for (uint c = lane; c < chunks; c += 32u) F::template dot<R, MM, XT>(ws, c, xs, acc, table, fa);

    // n < N and m < M are the same for every lane: each lane reaches each simd_sum.
    UNROLL for (int r = 0; r < R; ++r) {
        const uint n = n0 + uint(r);
        if (n >= N) break;
        const float s = F::unit() * (p.scale_mode == 0 ? 1.0f : scale[p.scale_mode == 1 ? 0u : n]);
        const float b = p.has_bias != 0 ? io_load_kind(bias, n, p.bias_kind) : 0.0f;
        UNROLL for (int m = 0; m < MM; ++m) {
            if (uint(m) >= M) break;
            const float t = simd_sum(acc.v[r][m]);
            if (lane == 0u) io_store_kind(y, ulong(m) * N + n, fma(t, s, b), p.out_kind);
        }
    }
}

template <typename F, typename XT>
inline void gemv_run(device const XT* x, device const uchar* w, device const float* scale, device const uchar* bias,
                     device uchar* y, constant gemv_params& p, uint gid, uint lane, threadgroup const float* table,
                     thread const typename F::args& fa) {
    static_assert(GEMV_MAX_M == 8, "the M buckets below are 1, 2, 4, 8");
    if (p.M <= 1) gemv_body<F, XT, 1>(x, w, scale, bias, y, p, gid, lane, table, fa);
    else if (p.M <= 2) gemv_body<F, XT, 2>(x, w, scale, bias, y, p, gid, lane, table, fa);
    else if (p.M <= 4) gemv_body<F, XT, 4>(x, w, scale, bias, y, p, gid, lane, table, fa);
    else gemv_body<F, XT, 8>(x, w, scale, bias, y, p, gid, lane, table, fa);
}

template <typename F, typename XT>
kernel void gemv(device const XT* x [[buffer(0)]],
                 device const uchar* w [[buffer(1)]],
                 device const float* scale [[buffer(2)]],
                 device const uchar* bias [[buffer(3)]],
                 device uchar* y [[buffer(4)]],
                 constant gemv_params& p [[buffer(5)]],
                 uint gid [[thread_position_in_grid]],
                 uint tid [[thread_index_in_threadgroup]],
                 uint group_size [[threads_per_threadgroup]],
                 uint lane [[thread_index_in_simdgroup]]) {
    threadgroup float table[GEMV_TABLE_SIZE];
    gemv_fill_table<F>(table, tid, group_size);
    const typename F::args fa{};
    gemv_run<F, XT>(x, w, scale, bias, y, p, gid, lane, table, fa);
}
