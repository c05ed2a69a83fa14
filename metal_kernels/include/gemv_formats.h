// The weight formats of dense and FP8 weights for the GEMV skeleton of gemv.h (used by linear.metal's GEMV and
// moe.metal's expert GEMV; the element types also feed moe.metal's grouped GEMM staging).
//
// gemv_vec<E, CB = 16>: each lane loads CB consecutive weight bytes of a row per chunk (CB 16: one uint4 of
//   16 FP8, 8 half or bfloat, 4 float values; CB 8: one uint2, for rows whose 16-byte chunks would leave
//   lanes of the last step idle, e.g. 48 chunks for 32 lanes) and decodes them 4 at a time; needs
//   K * E::BYTES % CB == 0 and a CB-byte aligned weight (every row then starts aligned), x 4-element aligned.
// gemv_elem<E>: one element per lane and chunk, for any K and any element-aligned weight (a weight mapped
//   from a file at an odd offset, K = 33).
// E, an element type: BYTES, unit(), decode4(uint4 raw, g) -> weights 4g .. 4g + 3 of the 16 bytes,
//   decode1(p) -> the weight at p: gemv_float / gemv_half / gemv_bfloat below, fp8_e4m3fn / fp8_e5m2 of
//   fp8.h, whose values come out divided by unit(), multiplied back in the output scale.

#include "fp8.h"
#include "io.h"
#include "gemv.h"

struct gemv_float {
    enum { BYTES = 4 };
    static float unit() { return 1.0f; }
    static float4 decode4(uint4 raw, int g) { return as_type<float4>(raw); }
    static float decode1(device const uchar* p) { return *((device const float*)p); }
};

struct gemv_half {
    enum { BYTES = 2 };
    static float unit() { return 1.0f; }
    static float4 decode4(uint4 raw, int g) { return float4(as_type<half4>(g == 0 ? raw.xy : raw.zw)); }
    static float decode1(device const uchar* p) { return float(*((device const half*)p)); }
};

struct gemv_bfloat {
    enum { BYTES = 2 };
    static float unit() { return 1.0f; }
    static float4 decode4(uint4 raw, int g) {
        const uint a = raw[2 * g], b = raw[2 * g + 1];
        return float4(as_type<float>(a << 16), as_type<float>(a & 0xFFFF0000u), as_type<float>(b << 16),
                      as_type<float>(b & 0xFFFF0000u));
    }
    static float decode1(device const uchar* p) { return bf16_bits_to_float(*((device const ushort*)p)); }
};

template <typename E, int CB = 16>
struct gemv_vec : gemv_format {
    enum { CHUNK = CB / E::BYTES, GROUPS = CHUNK / 4 };
    static_assert((CB == 16 || CB == 8) && CHUNK >= 4, "chunks of 16 or 8 bytes, 4 values at least");
    static float unit() { return E::unit(); }

    template <int R, int MM, typename XT>
    static void dot(thread const gemv_w<R>& w, uint c, thread const gemv_x<XT, MM>& x, thread gemv_acc<R, MM>& acc,
                    threadgroup const float* table, thread const gemv_format::args&) {
        uint4 raw[R];
        UNROLL for (int r = 0; r < R; ++r) {
            device const uchar* p = w.p + w.off[r] + c * uint(CB);
            raw[r] = CB == 16 ? *((device const uint4*)p) : uint4(*((device const uint2*)p), 0u, 0u);
        }
        // x in 8-value pieces (one 16-byte load of half / bfloat), used for every row; float weights: 4 values
        UNROLL for (int g = 0; g < GROUPS; g += 2) {
            float4 xa[MM], xb[MM];
            UNROLL for (int m = 0; m < MM; ++m) {
                if (GROUPS > 1) x.load8(m, c * uint(CHUNK) + uint(4 * g), xa[m], xb[m]);
                else xa[m] = x.load4(m, c * uint(CHUNK));
            }
            UNROLL for (int r = 0; r < R; ++r) {
                const float4 wa = E::decode4(raw[r], g);
                UNROLL for (int m = 0; m < MM; ++m) acc.v[r][m] = gemv_fma4(xa[m], wa, acc.v[r][m]);
                if (GROUPS > 1) {
                    const float4 wb = E::decode4(raw[r], g + 1);
                    UNROLL for (int m = 0; m < MM; ++m) acc.v[r][m] = gemv_fma4(xb[m], wb, acc.v[r][m]);
                }
            }
        }
    }
};

template <typename E>
struct gemv_elem : gemv_format {
    enum { CHUNK = 1 };
    static float unit() { return E::unit(); }

    template <int R, int MM, typename XT>
    static void dot(thread const gemv_w<R>& w, uint c, thread const gemv_x<XT, MM>& x, thread gemv_acc<R, MM>& acc,
                    threadgroup const float* table, thread const gemv_format::args&) {
        float xv[MM];
        UNROLL for (int m = 0; m < MM; ++m) xv[m] = x.load1(m, c);
        UNROLL for (int r = 0; r < R; ++r) {
            const float wv = E::decode1(w.p + w.off[r] + c * uint(E::BYTES));
            UNROLL for (int m = 0; m < MM; ++m) acc.v[r][m] = fma(xv[m], wv, acc.v[r][m]);
        }
    }
};
