// GGUF (ggml) block quantisations, read directly from the file's bytes: the dequantise kernel and the block
// formats of the GEMV skeleton (include/gemv.h).
//
// A block type Q (BS values in TS bytes: GGUF_<TYPE>_BLOCK and _BYTES, generated from gguf.GGML_QUANT_SIZES)
// is read by Q::LANES lanes, each taking one chunk of GGUF_<TYPE>_CHUNK values (gguf.py's GGUF_TYPES):
//   Q::load(block, j)  chunk j: its quant bits as little-endian words (the widest loads the alignment of the
//                      fields allows, gguf_align) and, for each of its scale groups, S and B (fp32, with the
//                      gguf package's operations in its order);
//   Q::pos(j, g)       the first of the 4 consecutive values (in the block) of group g: Q::GROUPS a chunk,
//                      Q::GPS a scale group; with Q::PAIRS, groups 2i and 2i + 1 are 8 consecutive values;
//   Q::q(chunk, g, t)  their quants as floats, the type's offset already taken off (Q4_0: q - 8), exact small
//                      integers (or IQ4 table values, from the threadgroup table t).
// Value = S * q + B (+ B only where HAS_MIN): computed in exactly that order by the dequantise kernel, so its
// fp32 result is bit-identical to the gguf package's numpy dequantiser. The GEMV instead sums x * q per scale
// group and applies S once per group, the mins folded in through the sum of x: acc += S * sum(x q) +
// B * sum(x), sum(x) shared by all rows of the simdgroup. Groups go in pairs where they can (one 16-byte load
// of 8 half or bfloat x values).
//
// gguf_dequant<Q, OUT>: one thread per chunk, striding by p.nthreads chunks; 4-value stores; 32-bit offsets
// (the host launches at most 2^31 values at a time).
// gemv<gguf_format<Q>, XT> (include/gemv.h): the lanes of a simdgroup take 32 consecutive chunks of a row.

#include "io.h"
#include "gemv.h"

constant char gguf_iq4_values[16] = {-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113};

// The alignment of a field at off + i * stride in a block at b * ts (the row 16-byte aligned): the largest
// power of two <= 16 dividing all three.
constexpr int gguf_align(int ts, int off, int stride) {
    return (ts | off | stride | 16) & -(ts | off | stride | 16);
}

inline uint gguf_lo(uint w) { return w & 0x0F0F0F0Fu; }                 // the low nibble of each byte
inline uint gguf_hi(uint w) { return (w >> 4) & 0x0F0F0F0Fu; }          // the high nibble of each byte
// Quants to floats through half bits: `mask` keeps one field of bytes 0 and 2 (and, after w >> 8, of bytes 1
// and 3) in the low 10 bits of each 16-bit half; 0x6400 | field is the half 1024 + field, exact, and the bias
// comes off in half arithmetic, exact too: no integer -> float conversion (each costs four simple ops).
// Returned in byte order. GGUF_HI keeps the high nibbles in place: 16 times their value (the low and the high
// nibbles of a word can share its w >> 8).
constant constexpr uint GGUF_BYTE = 0x00FF00FFu, GGUF_LO = 0x000F000Fu, GGUF_HI = 0x00F000F0u;
inline float4 gguf_quants(uint w, uint w8, uint mask, half bias) {           // w8 = w >> 8
    const half2 e = as_type<half2>((w & mask) | 0x64006400u) - bias;           // bytes 0, 2
    const half2 o = as_type<half2>((w8 & mask) | 0x64006400u) - bias;          // bytes 1, 3
    return float4(float(e.x), float(o.x), float(e.y), float(o.y));
}
inline float4 gguf_quants(uint w, uint mask, half bias) { return gguf_quants(w, w >> 8, mask, bias); }
inline float4 gguf_bytes(uint w) { return gguf_quants(w, GGUF_BYTE, 1024.0h); }                   // 0 .. 255
// Less an offset (Q4_0: 8, Q5_0: 16, Q6_K: 32, Q3_K: 4) in the same subtraction: q - offset, exact.
inline float4 gguf_bytes_less(uint w, int offset) { return gguf_quants(w, GGUF_BYTE, half(1024 + offset)); }
inline float4 gguf_sbytes(uint w) { return gguf_quants(w ^ 0x80808080u, GGUF_BYTE, 1152.0h); }    // int8
inline float4 gguf_table(uint w, threadgroup const float* t) {
    const uchar4 i = as_type<uchar4>(w);
    return float4(t[i.x], t[i.y], t[i.z], t[i.w]);
}
// Bits v .. v + 3 of h (the 5th bits of 4 consecutive values) at bit 4 of each byte.
inline uint gguf_bits4(uint h, uint v) { return (((h >> v) & 0xFu) * 0x00204081u & 0x01010101u) << 4; }

// ------------------------------------------------------------------------------------------------------
// 32-value blocks, one scale group: Q8_0 four lanes a block, 8 values (bytes) each, so that the x values of
// a simdgroup's lanes are consecutive; the 4-bit types two lanes a block, 16 values each (8 quant bytes:
// values 8j.. from the low nibbles, 16 + 8j.. from the high ones).
// ------------------------------------------------------------------------------------------------------
struct gguf_q8_0 {
    enum { BS = GGUF_Q8_0_BLOCK, TS = GGUF_Q8_0_BYTES, LANES = BS / GGUF_Q8_0_CHUNK,
           GROUPS = 2, GPS = 2, HAS_MIN = 0, TABLE = 0, PAIRS = 1 };
    struct chunk { uint2 q; float S[1]; float B[1]; };
    static chunk load(device const uchar* b, uint j) {
        chunk c;
        c.q = io_u64<gguf_align(TS, 2, 8)>(b + 2 + 8 * j);
        c.S[0] = io_half(b);
        c.B[0] = 0.0f;
        return c;
    }
    static uint pos(uint j, int g) { return 8 * j + 4 * uint(g); }
    static float4 q(thread const chunk& c, int g, threadgroup const float*) { return gguf_sbytes(c.q[g]); }
};

// Q4_0, Q4_1, IQ4_NL: the 16 quant bytes at QS hold value i < 16 in the low nibble of byte i and value
// 16 + i in its high nibble.
inline uint gguf_pos32(uint j, int g) { return g < 2 ? 8 * j + 4 * uint(g) : 16 + 8 * j + 4 * uint(g - 2); }
inline uint gguf_nibbles32(uint2 q, int g) { return g < 2 ? gguf_lo(q[g]) : gguf_hi(q[g - 2]); }

struct gguf_q4_0 {
    enum { BS = GGUF_Q4_0_BLOCK, TS = GGUF_Q4_0_BYTES, LANES = BS / GGUF_Q4_0_CHUNK,
           GROUPS = 4, GPS = 2, HAS_MIN = 0, TABLE = 0, PAIRS = 1 };
    struct chunk { uint2 q; float S[2]; float B[2]; };
    static chunk load(device const uchar* b, uint j) {
        chunk c;
        c.q = io_u64<gguf_align(TS, 2, 8)>(b + 2 + 8 * j);
        c.S[0] = io_half(b);
        c.S[1] = c.S[0] * 0.0625f;             // the high nibbles are read in place (16 q)
        c.B[0] = c.B[1] = 0.0f;
        return c;
    }
    static uint pos(uint j, int g) { return gguf_pos32(j, g); }
    static float4 q(thread const chunk& c, int g, threadgroup const float*) {
        return g < 2 ? gguf_quants(c.q[g], GGUF_LO, 1032.0h) : gguf_quants(c.q[g - 2], GGUF_HI, 1152.0h);
    }
};

struct gguf_q4_1 {
    enum { BS = GGUF_Q4_1_BLOCK, TS = GGUF_Q4_1_BYTES, LANES = BS / GGUF_Q4_1_CHUNK,
           GROUPS = 4, GPS = 2, HAS_MIN = 1, TABLE = 0, PAIRS = 1 };
    struct chunk { uint2 q; float S[2]; float B[2]; };
    static chunk load(device const uchar* b, uint j) {
        chunk c;
        c.q = io_u64<gguf_align(TS, 4, 8)>(b + 4 + 8 * j);
        c.S[0] = io_half(b);
        c.S[1] = c.S[0] * 0.0625f;             // the high nibbles are read in place (16 q)
        c.B[0] = c.B[1] = io_half(b + 2);
        return c;
    }
    static uint pos(uint j, int g) { return gguf_pos32(j, g); }
    static float4 q(thread const chunk& c, int g, threadgroup const float*) {
        return gguf_quants(c.q[g & 1], g < 2 ? GGUF_LO : GGUF_HI, 1024.0h);
    }
};

struct gguf_iq4_nl {
    enum { BS = GGUF_IQ4_NL_BLOCK, TS = GGUF_IQ4_NL_BYTES, LANES = BS / GGUF_IQ4_NL_CHUNK,
           GROUPS = 4, GPS = 4, HAS_MIN = 0, TABLE = 1, PAIRS = 1 };
    struct chunk { uint2 q; float S[1]; float B[1]; };
    static chunk load(device const uchar* b, uint j) {
        chunk c;
        c.q = io_u64<gguf_align(TS, 2, 8)>(b + 2 + 8 * j);
        c.S[0] = io_half(b);
        c.B[0] = 0.0f;
        return c;
    }
    static uint pos(uint j, int g) { return gguf_pos32(j, g); }
    static float4 q(thread const chunk& c, int g, threadgroup const float* t) {
        return gguf_table(gguf_nibbles32(c.q, g), t);
    }
};

// Q5_0, Q5_1: the 5th bit of value i is bit i of the 32-bit mask h (kept shifted by 8j: bit v of lane j's
// word is value 8j + v, so group g's bits start at gguf_pos32(0, g)).
struct gguf_q5_0 {
    enum { BS = GGUF_Q5_0_BLOCK, TS = GGUF_Q5_0_BYTES, LANES = BS / GGUF_Q5_0_CHUNK,
           GROUPS = 4, GPS = 4, HAS_MIN = 0, TABLE = 0, PAIRS = 1 };
    struct chunk { uint2 q; uint h; float S[1]; float B[1]; };
    static chunk load(device const uchar* b, uint j) {
        chunk c;
        c.q = io_u64<gguf_align(TS, 6, 8)>(b + 6 + 8 * j);
        c.h = io_u32<gguf_align(TS, 2, 0)>(b + 2) >> (8 * j);        // bit v: value 8j + v
        c.S[0] = io_half(b);
        c.B[0] = 0.0f;
        return c;
    }
    static uint pos(uint j, int g) { return gguf_pos32(j, g); }
    static float4 q(thread const chunk& c, int g, threadgroup const float*) {
        return gguf_bytes_less(gguf_nibbles32(c.q, g) | gguf_bits4(c.h, gguf_pos32(0, g)), 16);
    }
};

struct gguf_q5_1 {
    enum { BS = GGUF_Q5_1_BLOCK, TS = GGUF_Q5_1_BYTES, LANES = BS / GGUF_Q5_1_CHUNK,
           GROUPS = 4, GPS = 4, HAS_MIN = 1, TABLE = 0, PAIRS = 1 };
    struct chunk { uint2 q; uint h; float S[1]; float B[1]; };
    static chunk load(device const uchar* b, uint j) {
        chunk c;
        c.q = io_u64<gguf_align(TS, 8, 8)>(b + 8 + 8 * j);
        c.h = io_u32<gguf_align(TS, 4, 0)>(b + 4) >> (8 * j);
        c.S[0] = io_half(b);
        c.B[0] = io_half(b + 2);
        return c;
    }
    static uint pos(uint j, int g) { return gguf_pos32(j, g); }
    static float4 q(thread const chunk& c, int g, threadgroup const float*) {
        return gguf_bytes(gguf_nibbles32(c.q, g) | gguf_bits4(c.h, gguf_pos32(0, g)));
    }
};

// ------------------------------------------------------------------------------------------------------
// K-quants and IQ4_XS: 256-value blocks, eight lanes a block, 32 values each.
// ------------------------------------------------------------------------------------------------------

// The 6-bit scales and mins of sub-blocks s and s + 1 (s even) packed in 12 bytes (Q4_K, Q5_K), given as
// three words, as floats (scale s, scale s + 1, min s, min s + 1). Both packings are worked out on the two
// bytes at once and one is selected: no branch (the lanes of one block take both).
inline float4 gguf_k_scales_mins(uint w0, uint w1, uint w2, uint s) {
    const uint sh = 8 * (s & 3);                                  // bytes s % 4, s % 4 + 1 of each word
    const uint a = w0 >> sh, m = w1 >> sh, md = w2 >> sh;
    const bool high = s >= 4;
    const uint sc = high ? (md & 0x0F0Fu) | ((a >> 2) & 0x3030u) : a & 0x3F3Fu;
    const uint mn = high ? ((md >> 4) & 0x0F0Fu) | ((m >> 2) & 0x3030u) : m & 0x3F3Fu;
    return gguf_bytes(sc | (mn << 16));
}

// Q4_K, Q5_K: value 64c + 32a + l (sub-block 2c + a) is nibble a of quant byte 32c + l. Lane j takes bytes
// 16j .. 16j + 15: values 64c + 16h + (0..15) from the low nibbles and 64c + 32 + 16h + (0..15) from the high
// ones (c = j / 2, h = j % 2), two scale groups.
inline uint gguf_pos_k4(uint j, int g) { return 64 * (j >> 1) + 16 * (j & 1) + (g < 4 ? 0u : 32u) + 4 * uint(g & 3); }

struct gguf_q4_k {
    enum { BS = GGUF_Q4_K_BLOCK, TS = GGUF_Q4_K_BYTES, LANES = BS / GGUF_Q4_K_CHUNK,
           GROUPS = 8, GPS = 4, HAS_MIN = 1, TABLE = 0, PAIRS = 1 };
    struct chunk { uint4 q; uint4 q8; float S[2]; float B[2]; };
    static chunk load(device const uchar* b, uint j) {
        chunk c;
        c.q = io_u128<gguf_align(TS, 16, 16)>(b + 16 + 16 * j);
        c.q8 = c.q >> 8u;                      // shared by the low and the high nibbles
        const uint4 head = io_u128<gguf_align(TS, 0, 16)>(b);           // d, dmin, the 12 scale bytes
        const float2 d = float2(as_type<half2>(head.x));
        const float4 sm = gguf_k_scales_mins(head.y, head.z, head.w, 2 * (j >> 1));
        UNROLL for (int s = 0; s < 2; ++s) {
            c.S[s] = d.x * sm[s];
            const float dm = d.y * sm[2 + s];
            c.B[s] = -dm;
        }
        c.S[1] *= 0.0625f;                     // the high nibbles are read in place (16 q): S / 16, exact
        return c;
    }
    static uint pos(uint j, int g) { return gguf_pos_k4(j, g); }
    static float4 q(thread const chunk& c, int g, threadgroup const float*) {
        return gguf_quants(c.q[g & 3], c.q8[g & 3], g < 4 ? GGUF_LO : GGUF_HI, 1024.0h);
    }
};

// Q5_K: the 5th bit of value 64c + 32a + l is bit 2c + a of byte l of the 32-byte mask.
struct gguf_q5_k {
    enum { BS = GGUF_Q5_K_BLOCK, TS = GGUF_Q5_K_BYTES, LANES = BS / GGUF_Q5_K_CHUNK,
           GROUPS = 8, GPS = 4, HAS_MIN = 1, TABLE = 0, PAIRS = 1 };
    struct chunk { uint4 q; uint4 h; uint sub; float S[2]; float B[2]; };
    static chunk load(device const uchar* b, uint j) {
        chunk c;
        c.q = io_u128<gguf_align(TS, 48, 16)>(b + 48 + 16 * j);
        c.h = io_u128<gguf_align(TS, 16, 16)>(b + 16 + 16 * (j & 1));
        c.sub = 2 * (j >> 1);
        const uint4 head = io_u128<gguf_align(TS, 0, 16)>(b);           // d, dmin, the 12 scale bytes
        const float2 d = float2(as_type<half2>(head.x));
        const float4 sm = gguf_k_scales_mins(head.y, head.z, head.w, c.sub);
        UNROLL for (int s = 0; s < 2; ++s) {
            c.S[s] = d.x * sm[s];
            const float dm = d.y * sm[2 + s];
            c.B[s] = -dm;
        }
        return c;
    }
    static uint pos(uint j, int g) { return gguf_pos_k4(j, g); }
    static float4 q(thread const chunk& c, int g, threadgroup const float*) {
        const uint lo = g < 4 ? gguf_lo(c.q[g]) : gguf_hi(c.q[g - 4]);
        const uint hi = ((c.h[g & 3] >> (c.sub + uint(g >> 2))) & 0x01010101u) << 4;
        return gguf_bytes(lo | hi);
    }
};

// Q6_K, Q2_K, Q3_K: value 128h + 32s + l (h = 0, 1; s = 0..3; l < 32), scale group (value >> 4). Lane j takes
// l = l0 .. l0 + 7 (l0 = 8 (j % 4)) of the four s of half h = j / 4: group g = 2s + t holds values
// 128h + 32s + l0 + 4t .. + 3, one scale group per s.
inline uint gguf_pos_k2(uint j, int g) { return 128 * (j >> 2) + 32 * uint(g >> 1) + 8 * (j & 3) + 4 * uint(g & 1); }

// Q6_K: low 4 bits: nibble s / 2 of byte 64h + 32 (s % 2) + l of ql; high 2 bits: bits 2s of byte 32h + l of qh.
// Its 210-byte blocks leave every field 2-aligned only, so the 32 lanes of a simdgroup share one block (each
// 2-byte load instruction then touches one or two cache lines, not the 7 of four blocks): lane j takes
// l = l0 .. l0 + 3 (l0 = 4 (j % 8)) of s = p and p + 2 (p = j / 8 % 2) in half h = j / 16: the same 4 bytes of
// ql (low and high nibbles) and of qh, two scale groups of 4 values.
struct gguf_q6_k {
    enum { BS = GGUF_Q6_K_BLOCK, TS = GGUF_Q6_K_BYTES, LANES = BS / GGUF_Q6_K_CHUNK,
           GROUPS = 2, GPS = 1, HAS_MIN = 0, TABLE = 0, PAIRS = 0 };
    struct chunk { uint l; uint h; float S[2]; float B[2]; };
    static chunk load(device const uchar* b, uint j) {
        const uint hh = j >> 4, p = (j >> 3) & 1, l0 = 4 * (j & 7);
        constexpr int A = gguf_align(TS, 0, 4);
        chunk c;
        c.l = io_u32<A>(b + 64 * hh + 32 * p + l0);
        c.h = io_u32<A>(b + 128 + 32 * hh + l0) >> (2 * p);           // bits 2s - 2p: s = p at 0, p + 2 at 4
        const float d = io_half(b + 208);
        UNROLL for (int g = 0; g < 2; ++g) {
            c.S[g] = d * float(as_type<char>(b[192 + 8 * hh + 2 * (p + 2 * uint(g)) + (l0 >> 4)]));
            c.B[g] = 0.0f;
        }
        return c;
    }
    static uint pos(uint j, int g) { return 128 * (j >> 4) + 32 * (((j >> 3) & 1) + 2 * uint(g)) + 4 * (j & 7); }
    static float4 q(thread const chunk& c, int g, threadgroup const float*) {
        const uint lo = g ? gguf_hi(c.l) : gguf_lo(c.l);
        const uint hi = ((c.h >> uint(4 * g)) & 0x03030303u) << 4;
        return gguf_bytes_less(lo | hi, 32);
    }
};

// Q2_K: bits 2s of byte 32h + l of qs; scale byte (value >> 4): low nibble scale, high nibble min.
struct gguf_q2_k {
    enum { BS = GGUF_Q2_K_BLOCK, TS = GGUF_Q2_K_BYTES, LANES = BS / GGUF_Q2_K_CHUNK,
           GROUPS = 8, GPS = 2, HAS_MIN = 1, TABLE = 0, PAIRS = 1 };
    struct chunk { uint2 q; float S[4]; float B[4]; };
    static chunk load(device const uchar* b, uint j) {
        const uint hh = j >> 2, l0 = 8 * (j & 3);
        chunk c;
        c.q = io_u64<gguf_align(TS, 16, 8)>(b + 16 + 32 * hh + l0);
        const float d = io_half(b + 80);
        const float dmin = io_half(b + 82);
        UNROLL for (int s = 0; s < 4; ++s) {
            const uint sc = b[8 * hh + 2 * uint(s) + (l0 >> 4)];
            c.S[s] = d * float(sc & 15u);
            const float ml = dmin * float(sc >> 4);
            c.B[s] = -ml;
        }
        return c;
    }
    static uint pos(uint j, int g) { return gguf_pos_k2(j, g); }
    static float4 q(thread const chunk& c, int g, threadgroup const float*) {
        return gguf_bytes((c.q[g & 1] >> uint(2 * (g >> 1))) & 0x03030303u);
    }
};

// Q3_K: low 2 bits as Q2_K (qs at 32); the third is bit 4h + s of byte l of hmask (set: +4); q - 4.
struct gguf_q3_k {
    enum { BS = GGUF_Q3_K_BLOCK, TS = GGUF_Q3_K_BYTES, LANES = BS / GGUF_Q3_K_CHUNK,
           GROUPS = 8, GPS = 2, HAS_MIN = 0, TABLE = 0, PAIRS = 1 };
    struct chunk { uint2 q; uint2 m; uint shift; float S[4]; float B[4]; };
    static chunk load(device const uchar* b, uint j) {
        const uint hh = j >> 2, l0 = 8 * (j & 3);
        constexpr int A = gguf_align(TS, 0, 8);
        chunk c;
        c.q = io_u64<A>(b + 32 + 32 * hh + l0);
        c.m = io_u64<A>(b + l0);
        c.shift = 4 * hh;
        const float d = io_half(b + 108);
        UNROLL for (int s = 0; s < 4; ++s) {
            const uint g16 = 8 * hh + 2 * uint(s) + (l0 >> 4);
            const uint lo = g16 < 8 ? (uint(b[96 + g16]) & 15u) : (uint(b[96 + g16 - 8]) >> 4);
            const uint hi = (uint(b[104 + (g16 & 3)]) >> (2 * (g16 >> 2))) & 3u;
            c.S[s] = d * float(int(lo | (hi << 4)) - 32);
            c.B[s] = 0.0f;
        }
        return c;
    }
    static uint pos(uint j, int g) { return gguf_pos_k2(j, g); }
    static float4 q(thread const chunk& c, int g, threadgroup const float*) {
        const uint s = uint(g >> 1), t = uint(g & 1);
        const uint lo = (c.q[t] >> (2 * s)) & 0x03030303u;
        const uint hi = ((c.m[t] >> (c.shift + s)) & 0x01010101u) << 2;
        return gguf_bytes_less(lo | hi, 4);
    }
};

// IQ4_XS: sub-block j (32 values: value i < 16 the low nibble of quant byte 16j + i, 16 + i its high nibble),
// one lane each, one 6-bit scale (4 bits in scales_l, 2 in scales_h).
struct gguf_iq4_xs {
    enum { BS = GGUF_IQ4_XS_BLOCK, TS = GGUF_IQ4_XS_BYTES, LANES = BS / GGUF_IQ4_XS_CHUNK,
           GROUPS = 8, GPS = 8, HAS_MIN = 0, TABLE = 1, PAIRS = 1 };
    struct chunk { uint4 q; float S[1]; float B[1]; };
    static chunk load(device const uchar* b, uint j) {
        chunk c;
        c.q = io_u128<gguf_align(TS, 8, 16)>(b + 8 + 16 * j);
        const uint2 head = io_u64<gguf_align(TS, 0, 8)>(b);          // d, scales_h, scales_l
        const uint lo = (head.y >> (4 * j)) & 15u;
        const uint hi = (head.x >> (16 + 2 * j)) & 3u;
        const float d = float(as_type<half2>(head.x).x);
        c.S[0] = d * float(int(lo | (hi << 4)) - 32);
        c.B[0] = 0.0f;
        return c;
    }
    static uint pos(uint j, int g) { return 32 * j + (g < 4 ? 0u : 16u) + 4 * uint(g & 3); }
    static float4 q(thread const chunk& c, int g, threadgroup const float* t) {
        return gguf_table(g < 4 ? gguf_lo(c.q[g]) : gguf_hi(c.q[g - 4]), t);
    }
};

// ------------------------------------------------------------------------------------------------------
// The GEMV format and the dequantise kernel of a block type.
// ------------------------------------------------------------------------------------------------------
template <typename Q>
struct gguf_format : gemv_format {
    enum { CHUNK = Q::BS / Q::LANES, TABLE = Q::TABLE };
    static_assert(Q::GROUPS * 4 == CHUNK && Q::GROUPS % Q::GPS == 0 && (!Q::PAIRS || Q::GPS % 2 == 0),
                  "a chunk (GGUF_<TYPE>_CHUNK values) is GROUPS groups of 4 values, in scale groups of GPS");
    static float table_value(uint i) { return float(gguf_iq4_values[i]); }

    template <int R, int MM, typename XT>
    static void dot(thread const gemv_w<R>& w, uint c, thread const gemv_x<XT, MM>& x, thread gemv_acc<R, MM>& acc,
                    threadgroup const float* table, thread const gemv_format::args&) {
        const uint blk = c / uint(Q::LANES), j = c % uint(Q::LANES);
        typename Q::chunk ch[R];
        UNROLL for (int r = 0; r < R; ++r) ch[r] = Q::load(w.p + w.off[r] + blk * uint(Q::TS), j);
        const uint k0 = blk * uint(Q::BS);
        UNROLL for (int s = 0; s < Q::GROUPS / Q::GPS; ++s) {
            float part[R][MM];
            float sx[MM];
            UNROLL for (int m = 0; m < MM; ++m) {
                sx[m] = 0.0f;
                UNROLL for (int r = 0; r < R; ++r) part[r][m] = 0.0f;
            }
            UNROLL for (int i = 0; i < Q::GPS; i += Q::PAIRS ? 2 : 1) {
                const int g = s * Q::GPS + i;
                float4 xa[MM], xb[MM];
                UNROLL for (int m = 0; m < MM; ++m) {
                    if (Q::PAIRS) x.load8(m, k0 + Q::pos(j, g), xa[m], xb[m]);   // 8 values, one load
                    else xa[m] = x.load4(m, k0 + Q::pos(j, g));
                    if (Q::HAS_MIN) sx[m] += (xa[m].x + xa[m].y) + (xa[m].z + xa[m].w);
                    if (Q::HAS_MIN && Q::PAIRS) sx[m] += (xb[m].x + xb[m].y) + (xb[m].z + xb[m].w);
                }
                UNROLL for (int r = 0; r < R; ++r) {
                    const float4 qa = Q::q(ch[r], g, table);
                    UNROLL for (int m = 0; m < MM; ++m) part[r][m] = gemv_fma4(xa[m], qa, part[r][m]);
                    if (Q::PAIRS) {
                        const float4 qb = Q::q(ch[r], g + 1, table);
                        UNROLL for (int m = 0; m < MM; ++m) part[r][m] = gemv_fma4(xb[m], qb, part[r][m]);
                    }
                }
            }
            UNROLL for (int r = 0; r < R; ++r) {
                const float S = ch[r].S[s];
                UNROLL for (int m = 0; m < MM; ++m) {
                    float a = fma(S, part[r][m], acc.v[r][m]);
                    if (Q::HAS_MIN) a = fma(ch[r].B[s], sx[m], a);
                    acc.v[r][m] = a;
                }
            }
        }
    }
};

template <typename Q, typename OUT>
kernel void gguf_dequant(device const uchar* src [[buffer(0)]],
                         device OUT* dst [[buffer(1)]],
                         constant gguf_dequant_params& p [[buffer(2)]],
                         uint gid [[thread_position_in_grid]],
                         uint tid [[thread_index_in_threadgroup]],
                         uint group_size [[threads_per_threadgroup]]) {
    threadgroup float table[GEMV_TABLE_SIZE];
    gemv_fill_table<gguf_format<Q>>(table, tid, group_size);
    for (uint c = gid; c < uint(p.chunks); c += uint(p.nthreads)) {
        const uint blk = c / uint(Q::LANES), j = c % uint(Q::LANES);
        const typename Q::chunk ch = Q::load(src + blk * uint(Q::TS), j);
        device OUT* out = dst + blk * uint(Q::BS);
        UNROLL for (int g = 0; g < Q::GROUPS; ++g) {
            const int s = g / Q::GPS;
            const float4 t = ch.S[s] * Q::q(ch, g, table);
            io_store4(out + Q::pos(j, g), Q::HAS_MIN ? t + ch.B[s] : t);
        }
    }
}
