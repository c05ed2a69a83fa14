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
// 4-bit values are decoded eight a 32-bit word through half bits (include/nibbles.h), 8-bit ones four a word
// (fp8.h's e4m3fn decode, int8 through half bits).
//
// quant_dequant_<fmt>_<out>: one thread per CHUNK of 16 consecutive bytes of a row (VPC = 16 or 32 values;
//   gid = n * nchunks + c), loaded as one uint4 where the rows are 16-byte aligned (else byte by byte; the
//   chunk holding the end of the row stops at row_bytes), the values in the operations and roundings of
//   comfy_kitchen's dequantize_* (the nvfp4 scales are multiplied in the output dtype, as there), so every
//   output equals it bit for bit; 16-byte stores where the output rows are whole vectors (xvec).
// quant_gemv<F, XT>: the GEMV skeleton of include/gemv.h (gemv_run: gemv_rows(M) rows a simdgroup, each lane
//   a 16-byte chunk of each row per step, x loaded once per step for all rows, fp32 sums, one simd_sum per
//   output, the row / tensor scale and the bias at the end) with the formats quant_gemv_<fmt><CB, ...> below:
//   CB bytes a lane and chunk (16; 8 where the rows are 8-byte multiples only; 1 for odd rows and unaligned
//   storage), the block scales (or s_rel) applied once per block (group) to its partial sums. x has the
//   stored row width (K padded to 16 / 32 for nvfp4 / mxfp8, zeros beyond K: quant.py pads it).

#include "nibbles.h"
#include "gemv_formats.h"

// Byte offset of block scale (row r, block column col) in cuBLAS's blocked layout: tiles of 128 rows x 4
// columns, row-major over tiles (ncb tiles a row of tiles), each tile 32 x 16 bytes holding row
// r % 32 at byte (r % 32) * 16 + (r / 32 % 4) * 4 + col % 4 (comfy_kitchen's to_blocked / from_blocked):
// the row's part and the column's part, added.
inline uint quant_swizzle_row(uint r, uint ncb) { return (r >> 7) * ncb * 512u + (r & 31u) * 16u + ((r >> 5) & 3u) * 4u; }
inline uint quant_swizzle_col(uint col) { return (col >> 2) * 512u + (col & 3u); }
inline uint quant_swizzle(uint r, uint col, uint ncb) { return quant_swizzle_row(r, ncb) + quant_swizzle_col(col); }

// e8m0 -> float as comfy_kitchen's e8m0_to_f32: 2^(e - 127); e == 0 gives 0 and e == 255 inf by themselves.
inline float quant_e8m0(uint e) { return as_type<float>(e << 23); }

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

// Stores round once from fp32 (bf16 through the explicit round-to-nearest-even helper of bf16.h).
inline void quant_store(device float* p, float v) { *p = v; }
inline void quant_store(device half* p, float v) { *p = half(v); }
inline void quant_store(device bfloat* p, float v) { *p = as_type<bfloat>(bf16_bits_from_float(v)); }

// v rounded to the output type, as a float (comfy_kitchen's nvfp4 dequantiser computes in that type).
inline float quant_round(float v, float) { return v; }
inline float quant_round(float v, half) { return float(half(v)); }
inline float quant_round(float v, bfloat) { return bf16_bits_to_float(bf16_bits_from_float(v)); }

// Eight values to 16-byte aligned memory in 16-byte stores (each rounded once to the output type).
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

inline void quant_put8(thread float* v, float4 a, float4 b) {
    v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
}

// int8 values as an element type of gemv_formats.h (gemv_vec / gemv_elem): four a word through half bits
// (v ^ 0x80 = v + 128 in the mantissa of the half 1024, less 1152, exact).
struct quant_int8_elem {
    enum { BYTES = 1 };
    static float unit() { return 1.0f; }
    static float4 decode4(uint4 raw, int g) {
        const uint u = raw[g] ^ 0x80808080u;
        const half2 e = as_type<half2>((u & 0x00FF00FFu) | 0x64006400u) - half2(1152.0h);          // bytes 0, 2
        const half2 o = as_type<half2>(((u >> 8) & 0x00FF00FFu) | 0x64006400u) - half2(1152.0h);   // bytes 1, 3
        return float4(float(e.x), float(o.x), float(e.y), float(o.y));
    }
    static float decode1(device const uchar* p) { return float(*((device const char*)p)); }
};

// The W4A8 INT8-grid value of a level: comfy_kitchen's _dequant_int4_grouped_to_int8 (level * s_rel in fp32,
// rounded half to even, clamped to +-127).
inline float4 quant_grid4(float4 level, float srel) { return clamp(rint(level * srel), -127.0f, 127.0f); }

// rint(p) (half to even) for |p| <= 511 without a rounding instruction: C = 1.5 * 2^23 + 512 plus p rounds to
// an integer in fp32 (ulp(C) = 1, to nearest even, as rint), whose low 10 bits are 512 + rint(p); OR-ed into the
// mantissa of the half 1024 two a word, they are the halves 1536 + rint(p), less 1536 exactly. Bit operations
// on the sum, so fast math cannot fold p + C - C away.
inline float4 quant_rint4(float4 p) {
    const uint4 t = as_type<uint4>(p + 12583424.0f);
    const uint lo = as_type<uint>(ushort2(ushort(t.x), ushort(t.y)));
    const uint hi = as_type<uint>(ushort2(ushort(t.z), ushort(t.w)));
    const half2 a = as_type<half2>((lo & 0x03FF03FFu) | 0x64006400u) - half2(1536.0h);
    const half2 b = as_type<half2>((hi & 0x03FF03FFu) | 0x64006400u) - half2(1536.0h);
    return float4(float(a.x), float(a.y), float(b.x), float(b.y));
}

inline float quant_srel(device const uchar* s, uint i, bool f32) {
    return f32 ? ((device const float*)s)[i] : fp8_e4m3fn_to_float(s[i]);
}

// ------------------------------------------------------------------------------------------------------
// Dequantisation: what every format reads besides the weight bytes, and each format's deq<OT>(a, n, c, q, v):
// the VPC values of chunk c of row n as comfy_kitchen computes them (v then rounded once to OT by the store).
// ------------------------------------------------------------------------------------------------------
struct QArgs {
    device const uchar* s;     // block scale bytes (nvfp4, mxfp8), s_rel (w4a8: e4m3fn bytes or float32)
    device const float* s2;    // tensor scale (nvfp4, int8 p == 1) or row scale (int8 p == 2, w4a8, w4a4)
    device const float* cb;    // w4a8: the 16 levels of the nibble codes
    uint K;                    // values a row
    uint row_bytes;
    uint p;                    // nvfp4/mxfp8: tiles a row of scale tiles; int8: scale mode; w4a8: group size
    bool xvec;                 // rows of the dequantised output are whole 16-byte vectors
};

struct quant_nvfp4 {
    enum { VPC = 32 };
    // total = ts * bs in OT, then each value e2m1 * total in OT (comfy_kitchen); e2m1 * 2^14 * total is
    // exact in fp32 before the store's one rounding (e2m1 has two significant bits).
    template <typename OT>
    static void deq(thread const QArgs& a, uint n, uint c, uint4 q, thread float* v) {
        const uint sb = quant_swizzle(n, 2u * c, a.p);
        const float ts = quant_round(a.s2[0], OT(0.0f));
        for (uint b = 0; b < 2u; ++b) {
            const float bs = quant_round(fp8_e4m3fn_to_float(a.s[sb + b]), OT(0.0f));
            const float total = quant_round(ts * bs, OT(0.0f));
            for (uint i = 0; i < 2u; ++i) {
                float4 lo, hi;
                nib_e2m1_hi_first(q[2u * b + i], lo, hi);
                quant_put8(v + 16u * b + 8u * i, (lo * NIB_E2M1_UNIT) * total, (hi * NIB_E2M1_UNIT) * total);
            }
        }
    }
};

struct quant_mxfp8 {
    enum { VPC = 16 };
    template <typename OT>
    static void deq(thread const QArgs& a, uint n, uint c, uint4 q, thread float* v) {
        const float bs = quant_e8m0(a.s[quant_swizzle(n, c >> 1, a.p)]);
        for (uint i = 0; i < 4u; ++i) {
            const float4 f = (fp8_e4m3fn_word(q[i]) * FP8_E4M3FN_UNIT) * bs;
            v[4u * i] = f.x; v[4u * i + 1u] = f.y; v[4u * i + 2u] = f.z; v[4u * i + 3u] = f.w;
        }
    }
};

struct quant_int8 {
    enum { VPC = 16 };
    template <typename OT>
    static void deq(thread const QArgs& a, uint n, uint, uint4 q, thread float* v) {
        const float s = a.s2[a.p == 1u ? 0u : n];
        for (uint i = 0; i < 4u; ++i) {
            const float4 f = quant_int8_elem::decode4(q, int(i)) * s;
            v[4u * i] = f.x; v[4u * i + 1u] = f.y; v[4u * i + 2u] = f.z; v[4u * i + 3u] = f.w;
        }
    }
};

// The chunk's values on the INT8 grid times the row scale; values at or beyond K are 0. Groups (p values,
// a multiple of 4) are whole quads of values: s_rel is read once per group of 16 (p == 16) or per quad.
template <bool F32>
struct quant_w4a8_t {
    enum { VPC = 32 };
    template <typename OT>
    static void deq(thread const QArgs& a, uint n, uint c, uint4 q, thread float* v) {
        const uint k0 = c * 32u;
        const uint base = n * (a.K / a.p);
        const float sch = a.s2[n];
        float sq[8];                                            // s_rel of values k0 + 4h .. + 3
        if (a.p == 16u) {
            const float s0 = quant_srel(a.s, base + 2u * c, F32);
            const float s1 = k0 + 16u < a.K ? quant_srel(a.s, base + 2u * c + 1u, F32) : 0.0f;
            for (uint h = 0; h < 8u; ++h) sq[h] = h < 4u ? s0 : s1;
        } else {
            for (uint h = 0; h < 8u; ++h) {
                const uint k = k0 + 4u * h;
                sq[h] = k < a.K ? quant_srel(a.s, base + k / a.p, F32) : 0.0f;
            }
        }
        for (uint i = 0; i < 4u; ++i) {
            const nib_codes u = nib_codes_lo_first(q[i]);
            for (uint h = 0; h < 2u; ++h) {                     // values 8i + 4h .. + 3
                const uchar2 l = h ? u.lo.zw : u.lo.xy, m = h ? u.hi.zw : u.hi.xy;
                const float4 level = float4(a.cb[l.x], a.cb[m.x], a.cb[l.y], a.cb[m.y]);
                const float4 f = quant_rint4(clamp(level * sq[2u * i + h], -127.0f, 127.0f)) * sch;
                v[8u * i + 4u * h] = f.x; v[8u * i + 4u * h + 1u] = f.y;
                v[8u * i + 4u * h + 2u] = f.z; v[8u * i + 4u * h + 3u] = f.w;
            }
        }
    }
};

struct quant_w4a4 {
    enum { VPC = 32 };
    template <typename OT>
    static void deq(thread const QArgs& a, uint n, uint, uint4 q, thread float* v) {
        const float s = a.s2[n];
        for (uint i = 0; i < 4u; ++i) {
            float4 lo, hi;
            nib_s4_lo_first(q[i], lo, hi);
            quant_put8(v + 8u * i, lo * s, hi * s);
        }
    }
};

typedef quant_w4a8_t<false> quant_w4a8;
typedef quant_w4a8_t<true> quant_w4a8f;

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
    QArgs a;                                                                                    \
    a.s = s; a.s2 = s2; a.cb = cb; a.K = uint(K); a.row_bytes = uint(row_bytes); a.p = uint(p); \
    a.xvec = xvec != 0;                                                                         \
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

#define QUANT_DEQUANT_KERNELS(f)                                                                 \
    QUANT_DEQUANT_KERNEL(quant_dequant_##f##_float, quant_##f, float)                           \
    QUANT_DEQUANT_KERNEL(quant_dequant_##f##_half, quant_##f, half)                             \
    QUANT_DEQUANT_KERNEL(quant_dequant_##f##_bfloat, quant_##f, bfloat)

QUANT_DEQUANT_KERNELS(nvfp4)
QUANT_DEQUANT_KERNELS(mxfp8)
QUANT_DEQUANT_KERNELS(int8)
QUANT_DEQUANT_KERNELS(w4a8)
QUANT_DEQUANT_KERNELS(w4a8f)
QUANT_DEQUANT_KERNELS(w4a4)

// ------------------------------------------------------------------------------------------------------
// The GEMV formats of include/gemv.h. A lane's chunk c of a row is CB bytes (CHUNK values) at c * CB.
// ------------------------------------------------------------------------------------------------------
struct quant_gemv_args {
    device const uchar* s;     // nvfp4 / mxfp8: the block scale bytes; w4a8: s_rel (e4m3fn bytes or float32)
    uint ncb;                  // nvfp4 / mxfp8: tiles a row of scale tiles
    uint group;                // w4a8: the group size
    uint groups;               // w4a8: groups a row
    uint K;                    // the logical values a row (mxfp8: its storage padding is masked)
};

// The CB bytes of chunk c of each row (CB 16 or 8: aligned vector loads; 1: a byte).
template <int CB, int R>
inline void quant_load_chunk(thread const gemv_w<R>& w, uint c, thread uint4* raw) {
    UNROLL for (int r = 0; r < R; ++r) {
        device const uchar* p = w.p + w.off[r] + c * uint(CB);
        if (CB == 16) raw[r] = *((device const uint4*)p);
        else if (CB == 8) raw[r] = uint4(*((device const uint2*)p), 0u, 0u);
        else raw[r] = uint4(uint(*p), 0u, 0u, 0u);
    }
}

// NVFP4: CB 16 (two 16-value blocks), 8 (one) or 1 (two values of block c / 8). Decoded values carry 2^-14
// (nibbles.h) and the block scales 2^-8 (fp8.h): unit() gives both back with the tensor scale.
template <int CB>
struct quant_gemv_nvfp4 : gemv_format {
    enum { CHUNK = 2 * CB, BLOCKS = CB / 8, ROWS = 1 };
    typedef quant_gemv_args args;
    static float unit() { return NIB_E2M1_UNIT * FP8_E4M3FN_UNIT; }

    template <int R, int MM, typename XT>
    static void dot(thread const gemv_w<R>& w, uint c, thread const gemv_x<XT, MM>& x, thread gemv_acc<R, MM>& acc,
                    threadgroup const float*, thread const args& fa) {
        uint4 raw[R];
        quant_load_chunk<CB, R>(w, c, raw);
        if (CB == 1) {
            const uint col = quant_swizzle_col(c >> 3);
            float x0[MM], x1[MM];
            UNROLL for (int m = 0; m < MM; ++m) {
                x0[m] = x.load1(m, 2u * c);
                x1[m] = x.load1(m, 2u * c + 1u);
            }
            UNROLL for (int r = 0; r < R; ++r) {
                float4 a, b;
                nib_e2m1_hi_first(raw[r].x, a, b);
                const float bs = fp8_e4m3fn_unscaled(fa.s[quant_swizzle_row(w.row(r), fa.ncb) + col]);
                UNROLL for (int m = 0; m < MM; ++m) acc.v[r][m] = fma(fma(x1[m], a.y, x0[m] * a.x), bs, acc.v[r][m]);
            }
            return;
        }
        // the chunk's block scales: bytes 2c, 2c + 1 (CB 16: adjacent in the tile) or byte c (CB 8) of the row
        const uint col = quant_swizzle_col(BLOCKS * c);
        float2 bs[R];
        UNROLL for (int r = 0; r < R; ++r) {
            device const uchar* sp = fa.s + quant_swizzle_row(w.row(r), fa.ncb) + col;
            const float4 d = fp8_e4m3fn_word(BLOCKS == 2 ? uint(*((device const ushort*)sp)) : uint(*sp));
            bs[r] = d.xy;
        }
        UNROLL for (int blk = 0; blk < BLOCKS; ++blk) {
            float part[R][MM];
            UNROLL for (int r = 0; r < R; ++r)
                UNROLL for (int m = 0; m < MM; ++m) part[r][m] = 0.0f;
            UNROLL for (int i = 0; i < 2; ++i) {                       // 8 values a word
                const int wd = 2 * blk + i;
                float4 xa[MM], xb[MM];
                UNROLL for (int m = 0; m < MM; ++m) x.load8(m, c * uint(CHUNK) + uint(8 * wd), xa[m], xb[m]);
                UNROLL for (int r = 0; r < R; ++r) {
                    float4 a, b;
                    nib_e2m1_hi_first(raw[r][wd], a, b);
                    UNROLL for (int m = 0; m < MM; ++m) part[r][m] = gemv_fma4(xb[m], b, gemv_fma4(xa[m], a, part[r][m]));
                }
            }
            UNROLL for (int r = 0; r < R; ++r)
                UNROLL for (int m = 0; m < MM; ++m) acc.v[r][m] = fma(part[r][m], bs[r][blk], acc.v[r][m]);
        }
    }
};

// MXFP8: CB 16 (half a 32-value block) or 1 (one value). The bytes at or beyond K (the storage padding, which
// may hold NaN codes) are masked to zero; x is zero there too.
template <int CB>
struct quant_gemv_mxfp8 : gemv_format {
    enum { CHUNK = CB, ROWS = 1 };
    typedef quant_gemv_args args;
    static float unit() { return FP8_E4M3FN_UNIT; }

    template <int R, int MM, typename XT>
    static void dot(thread const gemv_w<R>& w, uint c, thread const gemv_x<XT, MM>& x, thread gemv_acc<R, MM>& acc,
                    threadgroup const float*, thread const args& fa) {
        if (CB == 1 && c >= fa.K) return;
        uint4 raw[R];
        quant_load_chunk<CB, R>(w, c, raw);
        const uint col = quant_swizzle_col(c / (32u / uint(CB)));
        float bs[R];
        UNROLL for (int r = 0; r < R; ++r) bs[r] = quant_e8m0(fa.s[quant_swizzle_row(w.row(r), fa.ncb) + col]);
        if (CB == 1) {
            float xv[MM];
            UNROLL for (int m = 0; m < MM; ++m) xv[m] = x.load1(m, c);
            UNROLL for (int r = 0; r < R; ++r) {
                const float v = fp8_e4m3fn_unscaled(raw[r].x) * bs[r];
                UNROLL for (int m = 0; m < MM; ++m) acc.v[r][m] = fma(xv[m], v, acc.v[r][m]);
            }
            return;
        }
        if ((c + 1u) * 16u > fa.K) {                                  // the row's last, partial chunk
            const uint keep = fa.K - c * 16u;
            UNROLL for (int r = 0; r < R; ++r)
                UNROLL for (int g = 0; g < 4; ++g) {
                    const uint k = keep > uint(4 * g) ? keep - uint(4 * g) : 0u;
                    raw[r][g] = k >= 4u ? raw[r][g] : raw[r][g] & ((1u << (8u * k)) - 1u);
                }
        }
        float part[R][MM];
        UNROLL for (int r = 0; r < R; ++r)
            UNROLL for (int m = 0; m < MM; ++m) part[r][m] = 0.0f;
        UNROLL for (int g = 0; g < 4; g += 2) {
            float4 xa[MM], xb[MM];
            UNROLL for (int m = 0; m < MM; ++m) x.load8(m, c * 16u + uint(4 * g), xa[m], xb[m]);
            UNROLL for (int r = 0; r < R; ++r) {
                const float4 a = fp8_e4m3fn_word(raw[r][g]), b = fp8_e4m3fn_word(raw[r][g + 1]);
                UNROLL for (int m = 0; m < MM; ++m) part[r][m] = gemv_fma4(xb[m], b, gemv_fma4(xa[m], a, part[r][m]));
            }
        }
        UNROLL for (int r = 0; r < R; ++r)
            UNROLL for (int m = 0; m < MM; ++m) acc.v[r][m] = fma(part[r][m], bs[r], acc.v[r][m]);
    }
};

// W4A4: signed nibbles, CB 16, 8 or 1; the row scale is the skeleton's (scale_mode 2).
template <int CB>
struct quant_gemv_w4a4 : gemv_format {
    enum { CHUNK = 2 * CB, WORDS = CB / 4 };

    template <int R, int MM, typename XT>
    static void dot(thread const gemv_w<R>& w, uint c, thread const gemv_x<XT, MM>& x, thread gemv_acc<R, MM>& acc,
                    threadgroup const float*, thread const gemv_format::args&) {
        uint4 raw[R];
        quant_load_chunk<CB, R>(w, c, raw);
        if (CB == 1) {
            float x0[MM], x1[MM];
            UNROLL for (int m = 0; m < MM; ++m) {
                x0[m] = x.load1(m, 2u * c);
                x1[m] = x.load1(m, 2u * c + 1u);
            }
            UNROLL for (int r = 0; r < R; ++r) {
                float4 a, b;
                nib_s4_lo_first(raw[r].x, a, b);
                UNROLL for (int m = 0; m < MM; ++m) acc.v[r][m] = fma(x1[m], a.y, fma(x0[m], a.x, acc.v[r][m]));
            }
            return;
        }
        UNROLL for (int wd = 0; wd < WORDS; ++wd) {
            float4 xa[MM], xb[MM];
            UNROLL for (int m = 0; m < MM; ++m) x.load8(m, c * uint(CHUNK) + uint(8 * wd), xa[m], xb[m]);
            UNROLL for (int r = 0; r < R; ++r) {
                float4 a, b;
                nib_s4_lo_first(raw[r][wd], a, b);
                UNROLL for (int m = 0; m < MM; ++m) acc.v[r][m] = gemv_fma4(xb[m], b, gemv_fma4(xa[m], a, acc.v[r][m]));
            }
        }
    }
};

// W4A8: nibble codes -> the codebook's levels (the threadgroup table, filled by quant_gemv from cb) -> the
// INT8 grid with the group's s_rel; the row scale is the skeleton's. G16: groups of 16 (CB 16: two a chunk,
// CB 8: one), s_rel read once per group; else any group size (CB 16 or 1), s_rel read once per 4 values.
template <int CB, bool F32, bool G16>
struct quant_gemv_w4a8 : gemv_format {
    enum { CHUNK = 2 * CB, WORDS = CB / 4, TABLE = 1, ROWS = 1 };
    typedef quant_gemv_args args;

    static float srel(thread const args& fa, uint i) { return quant_srel(fa.s, i, F32); }

    template <int R, int MM, typename XT>
    static void dot(thread const gemv_w<R>& w, uint c, thread const gemv_x<XT, MM>& x, thread gemv_acc<R, MM>& acc,
                    threadgroup const float* table, thread const args& fa) {
        uint4 raw[R];
        quant_load_chunk<CB, R>(w, c, raw);
        if (CB == 1) {
            float x0[MM], x1[MM];
            UNROLL for (int m = 0; m < MM; ++m) {
                x0[m] = x.load1(m, 2u * c);
                x1[m] = x.load1(m, 2u * c + 1u);
            }
            const uint g = (2u * c) / fa.group;
            UNROLL for (int r = 0; r < R; ++r) {
                const float s = srel(fa, w.row(r) * fa.groups + g);
                const float v0 = clamp(rint(table[raw[r].x & 15u] * s), -127.0f, 127.0f);
                const float v1 = clamp(rint(table[raw[r].x >> 4] * s), -127.0f, 127.0f);
                UNROLL for (int m = 0; m < MM; ++m) acc.v[r][m] = fma(x1[m], v1, fma(x0[m], v0, acc.v[r][m]));
            }
            return;
        }
        // s_rel of values k .. k + 3 and k + 4 .. k + 7 of word wd of each row
        float sr[R][WORDS][2];
        float smax = 0.0f;
        UNROLL for (int r = 0; r < R; ++r)
            UNROLL for (int wd = 0; wd < WORDS; ++wd) {
                const uint k = c * uint(CHUNK) + uint(8 * wd);
                if (G16) {
                    sr[r][wd][0] = sr[r][wd][1] = (wd & 1) ? sr[r][wd - 1][0] : srel(fa, w.row(r) * fa.groups + k / 16u);
                } else {
                    sr[r][wd][0] = srel(fa, w.row(r) * fa.groups + k / fa.group);
                    sr[r][wd][1] = srel(fa, w.row(r) * fa.groups + (k + 4u) / fa.group);
                }
                smax = max(smax, max(abs(sr[r][wd][0]), abs(sr[r][wd][1])));
            }
        // the clamp to +-127 changes nothing where every level * s_rel is within it (table[16]: max |level|)
        if (smax * table[16] <= 127.0f) grid_dot<R, MM, XT, false>(raw, c, sr, x, acc, table);
        else grid_dot<R, MM, XT, true>(raw, c, sr, x, acc, table);
    }

    template <int R, int MM, typename XT, bool CLAMP>
    static void grid_dot(thread const uint4* raw, uint c, thread const float (*sr)[WORDS][2],
                         thread const gemv_x<XT, MM>& x, thread gemv_acc<R, MM>& acc, threadgroup const float* table) {
        UNROLL for (int wd = 0; wd < WORDS; ++wd) {
            float4 xa[MM], xb[MM];
            UNROLL for (int m = 0; m < MM; ++m) x.load8(m, c * uint(CHUNK) + uint(8 * wd), xa[m], xb[m]);
            UNROLL for (int r = 0; r < R; ++r) {
                const nib_codes u = nib_codes_lo_first(raw[r][wd]);
                // level * s_rel in fp32, (clamped,) rounded: the clamp commutes with rint (+-127 are integers)
                float4 a = float4(table[u.lo.x], table[u.hi.x], table[u.lo.y], table[u.hi.y]) * sr[r][wd][0];
                float4 b = float4(table[u.lo.z], table[u.hi.z], table[u.lo.w], table[u.hi.w]) * sr[r][wd][1];
                if (CLAMP) {
                    a = clamp(a, -127.0f, 127.0f);
                    b = clamp(b, -127.0f, 127.0f);
                }
                a = quant_rint4(a);
                b = quant_rint4(b);
                UNROLL for (int m = 0; m < MM; ++m) acc.v[r][m] = gemv_fma4(xb[m], b, gemv_fma4(xa[m], a, acc.v[r][m]));
            }
        }
    }
};

inline void quant_gemv_set_args(thread gemv_format::args&, device const uchar*, constant quant_gemv_params&) {}
inline void quant_gemv_set_args(thread quant_gemv_args& fa, device const uchar* s, constant quant_gemv_params& qp) {
    fa.s = s;
    fa.ncb = uint(qp.ncb);
    fa.group = uint(qp.group);
    fa.groups = uint(qp.groups);
    fa.K = uint(qp.K);
}

template <typename F, typename XT>
kernel void quant_gemv(device const XT* x [[buffer(0)]],
                       device const uchar* w [[buffer(1)]],
                       device const float* scale [[buffer(2)]],
                       device const uchar* bias [[buffer(3)]],
                       device uchar* y [[buffer(4)]],
                       constant gemv_params& p [[buffer(5)]],
                       device const uchar* s [[buffer(6)]],
                       device const float* cb [[buffer(7)]],
                       constant quant_gemv_params& qp [[buffer(8)]],
                       uint gid [[thread_position_in_grid]],
                       uint tid [[thread_index_in_threadgroup]],
                       uint group_size [[threads_per_threadgroup]],
                       uint lane [[thread_index_in_simdgroup]]) {
    threadgroup float table[GEMV_TABLE_SIZE + 1];
    if (F::TABLE) {                                          // the w4a8 codebook and its largest magnitude
        for (uint i = tid; i < GEMV_TABLE_SIZE; i += group_size) table[i] = cb[i];
        if (tid == 0u) {
            float m = 0.0f;
            for (uint i = 0; i < GEMV_TABLE_SIZE; ++i) m = max(m, abs(cb[i]));
            table[GEMV_TABLE_SIZE] = m;
        }
        threadgroup_barrier(mem_flags::mem_threadgroup);
    }
    typename F::args fa;
    quant_gemv_set_args(fa, s, qp);
    gemv_run<F, XT>(x, w, scale, bias, y, p, gid, lane, table, fa);
}
