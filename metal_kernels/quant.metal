// ComfyUI's comfy_quant block formats (QUANT_ALGOS of comfy/quant_ops.py, comfy_kitchen's layouts),
// read directly from the file's bytes. A weight row n holds K values in row_bytes bytes:
//   nvfp4  e2m1 nibbles, two a byte, the FIRST value in the HIGH nibble; one e4m3fn block scale per
//          16 values in cuBLAS's swizzled 128x4 tiles (quant_swizzle); a tensor scale s2[0].
//          Rows and K are padded to 16 in storage (row_bytes = Kp / 2); the padding is never written.
//   mxfp8  e4m3fn bytes; one e8m0 block scale per 32 values, swizzled likewise (K padded to 32).
//   int8   int8 bytes; a tensor scale s2[0] (p == 1) or one per row s2[n] (p == 2).
//   w4a8   unsigned nibbles, the first value in the LOW nibble; value = clamp(rint(cb[u] * s_rel), +-127)
//          (the INT8 grid comfy_kitchen's W4A8 GEMM consumes), times the row scale s2[n]. s_rel: one per
//          p values (the group size), e4m3fn bytes (w4a8) or float32 (w4a8f).
//   w4a4   signed nibbles (-8..7), the first value in the LOW nibble, times the row scale s2[n].
// The W4 formats and rotated INT8 hold ConvRot-rotated weights: these kernels return the stored (rotated)
// basis; the host rotates the activation (x @ H per group) or the dequantised weight (quant.py).
//
// A CHUNK is 16 consecutive bytes of a row (VPC = 16 or 32 values). Every lane of the GEMV loads whole
// chunks (one uint4 where the rows are 16-byte aligned, else byte by byte) and the chunk's x in 16-byte
// loads (where x's rows are whole vectors: xvec), applies each block scale once to the block's partial sum,
// and the row scale once after the single simd_sum. The chunk holding the end of the row is read byte by
// byte, guarded by row_bytes (weights) and K (x). The dequantiser stores 16 bytes at a time where the
// output rows are whole vectors (xvec). Offsets inside a row are 32-bit.
//
// quant_dequant_<fmt>_<out>: one thread per chunk (gid = n * nchunks + c), values in the operations and
//   roundings of comfy_kitchen's dequantize_* (the nvfp4 scales are multiplied in the output dtype, as
//   there), so every output equals it bit for bit.
// quant_gemv_<fmt>_<T>: y[m, n] = sum_k x[m, k] * w[n, k] (+ bias[n]) for M <= QUANT_GEMV_MAX_M rows of x
//   in T (float / half / bfloat, converted in the kernel), y in T; fp32 accumulation; one simdgroup
//   computes QUANT_GEMV_ROWS rows. No threadgroup memory and no barriers: a partial last threadgroup is
//   harmless. Written in C++14 (Metal's dialect).

#define QUANT_GEMV_MAX_M 8
#define QUANT_GEMV_ROWS 2

// Byte offset of block scale (row r, block column col) in cuBLAS's blocked layout: tiles of 128 rows x 4
// columns, row-major over tiles (ncb tiles a row of tiles), each tile 32 x 16 bytes holding row
// r % 32 at byte (r % 32) * 16 + (r / 32 % 4) * 4 + col % 4 (comfy_kitchen's to_blocked / from_blocked).
inline uint quant_swizzle(uint r, uint col, uint ncb) {
    return ((r >> 7) * ncb + (col >> 2)) * 512u + (r & 31u) * 16u + ((r >> 5) & 3u) * 4u + (col & 3u);
}

// e2m1 nibble -> float, exact, from the bits (no subnormal float is formed): magnitude codes 1..7 are
// 0.5, 1, 1.5, 2, 3, 4, 6; code 8 is -0.
inline float quant_e2m1(uint nib) {
    const uint c = nib & 7u;
    const uint mag = c == 0u ? 0u : (c + (c == 1u ? 251u : 252u)) << 22;
    return as_type<float>(mag | ((nib & 8u) << 28));
}

// e8m0 -> float as comfy_kitchen's e8m0_to_f32: 2^(e - 127), 0 for e == 0 (and e == 255 gives inf).
inline float quant_e8m0(uint e) { return e == 0u ? 0.0f : as_type<float>(e << 23); }

// Byte i (0..15) of a chunk.
inline uint quant_byte(uint4 q, uint i) { return (q[i >> 2] >> ((i & 3u) * 8u)) & 0xFFu; }

// The 16 bytes of chunk c: one uint4 load where aligned (vec), else bytes; the row's last chunk also
// stops at row_bytes (zeros beyond).
inline uint4 quant_chunk(device const uchar* row, uint c, uint row_bytes, bool vec, bool full) {
    const uint off = c * 16u;
    if (full && vec) return *((device const uint4*)(row + off));
    uint4 q = uint4(0u);
    for (uint i = 0; i < 16u; ++i) {
        if (!full && off + i >= row_bytes) break;
        q[i >> 2] |= uint(row[off + i]) << ((i & 3u) * 8u);
    }
    return q;
}

inline float quant_load(device const float* p) { return *p; }
inline float quant_load(device const half* p) { return float(*p); }
inline float quant_load(device const bfloat* p) { return float(*p); }

// Stores round once from fp32 (bf16 through the explicit round-to-nearest-even helper of common.metal).
inline void quant_store(device float* p, float v) { *p = v; }
inline void quant_store(device half* p, float v) { *p = half(v); }
inline void quant_store(device bfloat* p, float v) { *p = as_type<bfloat>(bf16_bits_from_float(v)); }

// v rounded to the output type, as a float (comfy_kitchen's nvfp4 dequantiser computes in that type).
inline float quant_round(float v, float) { return v; }
inline float quant_round(float v, half) { return float(half(v)); }
inline float quant_round(float v, bfloat) { return bf16_bits_to_float(bf16_bits_from_float(v)); }

// What every format reads besides the weight bytes (pointers into the bound buffers, sizes).
struct QArgs {
    device const uchar* s;     // block scale bytes (nvfp4, mxfp8), s_rel (w4a8: e4m3fn bytes or float32)
    device const float* s2;    // tensor scale (nvfp4, int8 p == 1) or row scale (int8 p == 2, w4a8, w4a4)
    device const float* cb;    // w4a8: the 16 levels of the nibble codes
    uint K;                    // values a row
    uint row_bytes;
    uint p;                    // nvfp4/mxfp8: tiles a row of scale tiles; int8: scale mode; w4a8: group size
    bool xvec;                 // rows of x (and of the dequantised output) are whole 16-byte vectors
    threadgroup const float* lut;   // GEMV: the 16 e2m1 values (nvfp4), in threadgroup memory
};

// Eight consecutive values of x from 16-byte aligned memory, in 16-byte loads, as floats.
inline void quant_load8(device const float* p, thread float* v) {
    const float4 a = *((device const float4*)p), b = *((device const float4*)(p + 4));
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}
inline void quant_load8(device const half* p, thread float* v) {
    const uint4 q = *((device const uint4*)p);
    for (uint i = 0; i < 4u; ++i) {
        const float2 f = float2(as_type<half2>(q[i]));
        v[2u * i] = f.x;
        v[2u * i + 1u] = f.y;
    }
}
inline void quant_load8(device const bfloat* p, thread float* v) {
    const uint4 q = *((device const uint4*)p);
    for (uint i = 0; i < 4u; ++i) {
        v[2u * i] = bf16_bits_to_float(ushort(q[i] & 0xFFFFu));
        v[2u * i + 1u] = bf16_bits_to_float(ushort(q[i] >> 16));
    }
}

// sum_j x[k0 + j] * w[j] over the chunk's NV values (those < K in the row's last chunk); 16-byte loads of x
// where its rows are whole vectors (xvec).
template <typename XT, int NV, bool FULL>
inline float quant_xdot(device const XT* x, uint K, uint k0, bool xvec, thread const float* w) {
    float part = 0.0f;
    if (FULL && xvec) {
        for (int j0 = 0; j0 < NV; j0 += 8) {
            float xv[8];
            quant_load8(x + k0 + uint(j0), xv);
            for (int j = 0; j < 8; ++j) part = fma(xv[j], w[j0 + j], part);
        }
        return part;
    }
    for (int j = 0; j < NV; ++j) {
        if (!FULL && k0 + uint(j) >= K) break;
        part = fma(quant_load(x + k0 + uint(j)), w[j], part);
    }
    return part;
}

// Eight values to 16-byte aligned memory in 16-byte stores (v already rounded to the output type).
inline void quant_store8(device float* p, thread const float* v) {
    *((device float4*)p) = float4(v[0], v[1], v[2], v[3]);
    *((device float4*)(p + 4)) = float4(v[4], v[5], v[6], v[7]);
}
inline void quant_store8(device half* p, thread const float* v) {
    uint4 q;
    for (uint i = 0; i < 4u; ++i) q[i] = as_type<uint>(half2(half(v[2u * i]), half(v[2u * i + 1u])));
    *((device uint4*)p) = q;
}
inline void quant_store8(device bfloat* p, thread const float* v) {
    uint4 q;
    for (uint i = 0; i < 4u; ++i)
        q[i] = uint(bf16_bits_from_float(v[2u * i])) | (uint(bf16_bits_from_float(v[2u * i + 1u])) << 16);
    *((device uint4*)p) = q;
}

// Each format: VPC values a chunk;
//   dot<XT, MM, FULL>(a, n, c, q, x, acc): acc[m] += sum over chunk c of row n of x[m, k] * w[n, k], the
//       block scales applied once to each block's partial sum (not the row or tensor scale);
//   finish(a, n, t): the row's sum t times the row / tensor scale;
//   deq<OT>(a, n, c, q, v): the chunk's values as comfy_kitchen computes them, already rounded to OT.
struct quant_nvfp4 {
    enum { VPC = 32 };
    static void values(uint4 q, uint b, thread float* w) {       // block b (0, 1) of the chunk
        for (uint i = 0; i < 8u; ++i) {
            const uint byte = quant_byte(q, b * 8u + i);
            w[2u * i] = quant_e2m1(byte >> 4);
            w[2u * i + 1u] = quant_e2m1(byte & 15u);
        }
    }
    enum { LUT = 1 };
    template <typename XT, int MM, bool FULL>
    static void dot(thread const QArgs& a, uint n, uint c, uint4 q, device const XT* x, thread float* acc) {
        const uint sb = quant_swizzle(n, 2u * c, a.p);           // the chunk's two blocks: bytes sb, sb + 1
        for (uint b = 0; b < 2u; ++b) {
            float w[16];
            for (uint i = 0; i < 8u; ++i) {                      // one conflict-free table read a value
                const uint byte = quant_byte(q, b * 8u + i);
                w[2u * i] = a.lut[byte >> 4];
                w[2u * i + 1u] = a.lut[byte & 15u];
            }
            const float bs = fp8_e4m3fn_to_float(a.s[sb + b]);
            for (int m = 0; m < MM; ++m)
                acc[m] = fma(quant_xdot<XT, 16, FULL>(x + uint(m) * a.K, a.K, c * 32u + b * 16u, a.xvec, w), bs, acc[m]);
        }
    }
    static float finish(thread const QArgs& a, uint, float t) { return t * a.s2[0]; }
    template <typename OT>
    static void deq(thread const QArgs& a, uint n, uint c, uint4 q, thread float* v) {
        const uint sb = quant_swizzle(n, 2u * c, a.p);
        const float ts = quant_round(a.s2[0], OT(0.0f));
        for (uint b = 0; b < 2u; ++b) {
            const float bs = quant_round(fp8_e4m3fn_to_float(a.s[sb + b]), OT(0.0f));
            const float total = quant_round(ts * bs, OT(0.0f));
            float w[16];
            values(q, b, w);
            for (uint j = 0; j < 16u; ++j) v[b * 16u + j] = quant_round(w[j] * total, OT(0.0f));
        }
    }
};

// e4m3fn bytes 0, 2 (hi: 1, 3) of a word as 2^-8 times their value, through half bits: the 7 low bits at half's
// exponent / mantissa, the sign at half's (subnormal codes stay subnormal halves); the NaN code stays NaN.
inline float2 quant_e4m3_pair(uint w, bool hi) {
    const uint t = (hi ? w >> 8 : w) & 0x00FF00FFu;
    const float2 f = float2(as_type<half2>(((t & 0x007F007Fu) << 7) | ((t & 0x00800080u) << 8)));
    return select(f, float2(NAN), bool2((t & 0x7Fu) == 0x7Fu, (t & 0x007F0000u) == 0x007F0000u));
}

struct quant_mxfp8 {
    enum { VPC = 16, LUT = 0 };
    static void values(uint4 q, thread float* w) {
        for (uint i = 0; i < 16u; ++i) w[i] = fp8_e4m3fn_to_float(uchar(quant_byte(q, i)));
    }
    template <typename XT, int MM, bool FULL>
    static void dot(thread const QArgs& a, uint n, uint c, uint4 q, device const XT* x, thread float* acc) {
        float w[16];
        for (uint i = 0; i < 4u; ++i) {
            const float2 e = quant_e4m3_pair(q[i], false), o = quant_e4m3_pair(q[i], true);
            w[4u * i] = e.x; w[4u * i + 1u] = o.x; w[4u * i + 2u] = e.y; w[4u * i + 3u] = o.y;
        }
        // half of a 32-value block; 2^8 restores the half-bits decode's scale
        const float bs = quant_e8m0(a.s[quant_swizzle(n, c >> 1, a.p)]) * 256.0f;
        for (int m = 0; m < MM; ++m)
            acc[m] = fma(quant_xdot<XT, 16, FULL>(x + uint(m) * a.K, a.K, c * 16u, a.xvec, w), bs, acc[m]);
    }
    static float finish(thread const QArgs&, uint, float t) { return t; }
    template <typename OT>
    static void deq(thread const QArgs& a, uint n, uint c, uint4 q, thread float* v) {
        const float bs = quant_e8m0(a.s[quant_swizzle(n, c >> 1, a.p)]);
        values(q, v);
        for (uint i = 0; i < 16u; ++i) v[i] = v[i] * bs;
    }
};

struct quant_int8 {
    enum { VPC = 16, LUT = 0 };
    static void values(uint4 q, thread float* w) {
        for (uint i = 0; i < 4u; ++i) {
            const float4 f = float4(as_type<char4>(q[i]));
            w[4u * i] = f.x; w[4u * i + 1u] = f.y; w[4u * i + 2u] = f.z; w[4u * i + 3u] = f.w;
        }
    }
    template <typename XT, int MM, bool FULL>
    static void dot(thread const QArgs& a, uint, uint c, uint4 q, device const XT* x, thread float* acc) {
        float w[16];
        values(q, w);
        for (int m = 0; m < MM; ++m) acc[m] += quant_xdot<XT, 16, FULL>(x + uint(m) * a.K, a.K, c * 16u, a.xvec, w);
    }
    static float finish(thread const QArgs& a, uint n, float t) { return t * a.s2[a.p == 1u ? 0u : n]; }
    template <typename OT>
    static void deq(thread const QArgs& a, uint n, uint, uint4 q, thread float* v) {
        const float s = a.s2[a.p == 1u ? 0u : n];
        values(q, v);
        for (uint i = 0; i < 16u; ++i) v[i] = v[i] * s;
    }
};

inline float quant_srel(device const uchar* s, uint i, bool f32) {
    return f32 ? ((device const float*)s)[i] : fp8_e4m3fn_to_float(s[i]);
}

// The chunk's values on the INT8 grid comfy_kitchen's W4A8 GEMM consumes (its
// _dequant_int4_grouped_to_int8: the nibble's level times the group's s_rel, rounded half to even,
// clamped to +-127); values at or beyond K are 0. The group's s_rel is read once per group
// (p = group size: the chunk's 32 values span 32 / p groups, or part of one).
template <bool F32>
struct quant_w4a8_t {
    enum { VPC = 32, LUT = 0 };
    static void values(thread const QArgs& a, uint n, uint c, uint4 q, thread float* w) {
        const uint k0 = c * 32u;
        uint g = n * (a.K / a.p) + k0 / a.p;
        uint left = a.p - k0 % a.p;                            // values left in group g
        float srel = quant_srel(a.s, g, F32);
        for (uint j = 0; j < 32u; ++j) {
            if (k0 + j >= a.K) {
                w[j] = 0.0f;
                continue;
            }
            if (left == 0u) {
                srel = quant_srel(a.s, ++g, F32);
                left = a.p;
            }
            --left;
            const uint byte = quant_byte(q, j >> 1);
            const uint u = (j & 1u) ? (byte >> 4) : (byte & 15u);
            w[j] = clamp(rint(a.cb[u] * srel), -127.0f, 127.0f);
        }
    }
    template <typename XT, int MM, bool FULL>
    static void dot(thread const QArgs& a, uint n, uint c, uint4 q, device const XT* x, thread float* acc) {
        float w[32];
        values(a, n, c, q, w);
        for (int m = 0; m < MM; ++m) acc[m] += quant_xdot<XT, 32, FULL>(x + uint(m) * a.K, a.K, c * 32u, a.xvec, w);
    }
    static float finish(thread const QArgs& a, uint n, float t) { return t * a.s2[n]; }
    template <typename OT>
    static void deq(thread const QArgs& a, uint n, uint c, uint4 q, thread float* v) {
        values(a, n, c, q, v);
        const float sch = a.s2[n];
        for (uint j = 0; j < 32u; ++j) v[j] = v[j] * sch;
    }
};

struct quant_w4a4 {
    enum { VPC = 32, LUT = 0 };
    // Four bytes at a time: each nibble moved to the top of its byte, then an arithmetic shift of the char
    // sign-extends it.
    static void values(uint4 q, thread float* w) {
        for (uint i = 0; i < 4u; ++i) {
            const float4 lo = float4(as_type<char4>(q[i] << 4) >> char4(4));
            const float4 hi = float4(as_type<char4>(q[i] & 0xF0F0F0F0u) >> char4(4));
            for (uint j = 0; j < 4u; ++j) {
                w[8u * i + 2u * j] = lo[j];
                w[8u * i + 2u * j + 1u] = hi[j];
            }
        }
    }
    template <typename XT, int MM, bool FULL>
    static void dot(thread const QArgs& a, uint, uint c, uint4 q, device const XT* x, thread float* acc) {
        float w[32];
        values(q, w);
        for (int m = 0; m < MM; ++m) acc[m] += quant_xdot<XT, 32, FULL>(x + uint(m) * a.K, a.K, c * 32u, a.xvec, w);
    }
    static float finish(thread const QArgs& a, uint n, float t) { return t * a.s2[n]; }
    template <typename OT>
    static void deq(thread const QArgs& a, uint n, uint, uint4 q, thread float* v) {
        const float s = a.s2[n];
        values(q, v);
        for (uint i = 0; i < 32u; ++i) v[i] = v[i] * s;
    }
};

typedef quant_w4a8_t<false> quant_w4a8;
typedef quant_w4a8_t<true> quant_w4a8f;

#define QUANT_ARGS_FROM_BUFFERS                                                                  \
    QArgs a;                                                                                    \
    a.s = s; a.s2 = s2; a.cb = cb; a.K = uint(K); a.row_bytes = uint(row_bytes); a.p = uint(p); a.xvec = xvec != 0;  \
    a.lut = nullptr;

// Chunk c of row n (gid = n * nchunks + c), written as the values < K of out row n.
#define QUANT_DEQUANT_KERNEL(NAME, F, OT)                                                        \
kernel void NAME(device const uchar* w [[buffer(0)]],                                           \
                 device const uchar* s [[buffer(1)]],                                           \
                 device const float* s2 [[buffer(2)]],                                          \
                 device const float* cb [[buffer(3)]],                                          \
                 device OT* out [[buffer(4)]],                                                  \
                 constant long& N [[buffer(5)]],                                                \
                 constant long& K [[buffer(6)]],                                                \
                 constant long& row_bytes [[buffer(7)]],                                        \
                 constant long& p [[buffer(8)]],                                                \
                 constant long& vec [[buffer(9)]],                                              \
                 constant long& xvec [[buffer(10)]],                                            \
                 uint gid [[thread_position_in_grid]]) {                                        \
    QUANT_ARGS_FROM_BUFFERS                                                                     \
    const uint nchunks = (a.K + F::VPC - 1u) / F::VPC;                                          \
    const uint n = gid / nchunks, c = gid - n * nchunks;                                        \
    if (n >= uint(N)) return;                                                                   \
    const bool full = (c + 1u) * F::VPC <= a.K;                                                 \
    const uint4 q = quant_chunk(w + ulong(n) * a.row_bytes, c, a.row_bytes, vec != 0, full);    \
    float v[F::VPC];                                                                            \
    F::template deq<OT>(a, n, c, q, v);                                                         \
    device OT* dst = out + ulong(n) * a.K + c * F::VPC;                                         \
    if (full && a.xvec) {                                                                       \
        for (uint j = 0; j < uint(F::VPC); j += 8u) quant_store8(dst + j, v + j);                \
        return;                                                                                 \
    }                                                                                           \
    const uint count = full ? uint(F::VPC) : a.K - c * F::VPC;                                  \
    for (uint j = 0; j < count; ++j) quant_store(dst + j, v[j]);                                \
}

// Rows n0 .. n0 + QUANT_GEMV_ROWS - 1 (those < N) for exactly MM rows of x.
template <typename F, typename XT, int MM>
inline void quant_gemv_rows(thread const QArgs& a, device const uchar* w, device const XT* x,
                            device const XT* bias, device XT* y, uint N, bool has_bias, bool vec, uint n0,
                            uint lane) {
    const uint nchunks = (a.K + F::VPC - 1u) / F::VPC;
    const uint nfull = a.K / F::VPC;
    float acc[QUANT_GEMV_ROWS][MM];
    for (int r = 0; r < QUANT_GEMV_ROWS; ++r)
        for (int m = 0; m < MM; ++m) acc[r][m] = 0.0f;
    for (int r = 0; r < QUANT_GEMV_ROWS; ++r) {
        const uint n = n0 + uint(r);
        if (n >= N) break;                                   // uniform within the simdgroup
        device const uchar* row = w + ulong(n) * a.row_bytes;
        for (uint c = lane; c < nchunks; c += 32u) {
            if (c < nfull) {
                F::template dot<XT, MM, true>(a, n, c, quant_chunk(row, c, a.row_bytes, vec, true), x, acc[r]);
            } else {
                F::template dot<XT, MM, false>(a, n, c, quant_chunk(row, c, a.row_bytes, vec, false), x, acc[r]);
            }
        }
    }
    // Every lane reaches each simd_sum (n < N and MM are uniform within the simdgroup).
    for (int r = 0; r < QUANT_GEMV_ROWS; ++r) {
        const uint n = n0 + uint(r);
        if (n >= N) break;
        const float b = has_bias ? quant_load(bias + n) : 0.0f;
        for (int m = 0; m < MM; ++m) {
            const float t = simd_sum(acc[r][m]);
            if (lane == 0u) quant_store(y + uint(m) * N + n, F::finish(a, n, t) + b);
        }
    }
}

#define QUANT_GEMV_CASE(F, XT, MM)                                                               \
    case MM:                                                                                    \
        quant_gemv_rows<F, XT, MM>(a, w, x, bias, y, uint(N), has_bias != 0, vec != 0, n0, lane);  \
        break;

#define QUANT_GEMV_KERNEL(NAME, F, XT)                                                           \
kernel void NAME(device const XT* x [[buffer(0)]],                                              \
                 device const uchar* w [[buffer(1)]],                                           \
                 device const uchar* s [[buffer(2)]],                                           \
                 device const float* s2 [[buffer(3)]],                                          \
                 device const float* cb [[buffer(4)]],                                          \
                 device const XT* bias [[buffer(5)]],                                           \
                 device XT* y [[buffer(6)]],                                                    \
                 constant long& M [[buffer(7)]],                                                \
                 constant long& K [[buffer(8)]],                                                \
                 constant long& N [[buffer(9)]],                                                \
                 constant long& row_bytes [[buffer(10)]],                                       \
                 constant long& p [[buffer(11)]],                                               \
                 constant long& has_bias [[buffer(12)]],                                        \
                 constant long& vec [[buffer(13)]],                                             \
                 constant long& xvec [[buffer(14)]],                                            \
                 uint gid [[thread_position_in_grid]],                                          \
                 uint lid [[thread_index_in_threadgroup]],                                      \
                 uint lane [[thread_index_in_simdgroup]]) {                                     \
    QUANT_ARGS_FROM_BUFFERS                                                                     \
    threadgroup float lut[16];                                                                  \
    if (F::LUT) {        /* every threadgroup has >= 32 threads: the host launches whole simdgroups */ \
        if (lid < 16u) lut[lid] = quant_e2m1(lid);                                              \
        threadgroup_barrier(mem_flags::mem_threadgroup);                                        \
    }                                                                                           \
    a.lut = lut;                                                                                \
    const uint n0 = (gid / 32u) * QUANT_GEMV_ROWS;                                              \
    if (n0 >= uint(N)) return;                                                                  \
    switch (M) {                                                                                \
        QUANT_GEMV_CASE(F, XT, 1) QUANT_GEMV_CASE(F, XT, 2) QUANT_GEMV_CASE(F, XT, 3)           \
        QUANT_GEMV_CASE(F, XT, 4) QUANT_GEMV_CASE(F, XT, 5) QUANT_GEMV_CASE(F, XT, 6)           \
        QUANT_GEMV_CASE(F, XT, 7) QUANT_GEMV_CASE(F, XT, 8)                                     \
        default: break;              /* the host never passes M outside 1..QUANT_GEMV_MAX_M */  \
    }                                                                                           \
}

#define QUANT_FORMAT_KERNELS(f)                                                                  \
    QUANT_DEQUANT_KERNEL(quant_dequant_##f##_float, quant_##f, float)                           \
    QUANT_DEQUANT_KERNEL(quant_dequant_##f##_half, quant_##f, half)                             \
    QUANT_DEQUANT_KERNEL(quant_dequant_##f##_bfloat, quant_##f, bfloat)                         \
    QUANT_GEMV_KERNEL(quant_gemv_##f##_float, quant_##f, float)                                 \
    QUANT_GEMV_KERNEL(quant_gemv_##f##_half, quant_##f, half)                                   \
    QUANT_GEMV_KERNEL(quant_gemv_##f##_bfloat, quant_##f, bfloat)

QUANT_FORMAT_KERNELS(nvfp4)
QUANT_FORMAT_KERNELS(mxfp8)
QUANT_FORMAT_KERNELS(int8)
QUANT_FORMAT_KERNELS(w4a8)
QUANT_FORMAT_KERNELS(w4a8f)
QUANT_FORMAT_KERNELS(w4a4)
