// FP8 <-> float conversion kernels (e4m3fn, e5m2: the element types of include/fp8.h), with a tensorwise
// or per-row scale.
//
// fp8_decode<E, OUT>: dst[i] = OUT(decode(src[i]) * scale)     (fp32 product, one rounding to OUT)
// fp8_encode<IN, E>:  dst[i] = encode_saturating(float(src[i]) / scale)   (correctly rounded division)
//
// The data are p.rows rows of p.row_len elements (one row for scale modes 0 and 1: no scale, scale[0];
// mode 2: scale[row]). The grid is 2-D: x runs over the chunks of 16 elements of a row, y over the rows,
// each striding by the grid size. No division anywhere; offsets in a row are 32-bit (the host launches rows
// of fewer than 2^31 elements). With p.vec (the
// buffers 16-byte aligned and, for per-row scales, row_len % 16 == 0) a full chunk moves as 16-byte
// loads or stores (4 x 4 values); the last chunk of a row and unaligned buffers go element by element.

#include "io.h"

template <typename E, typename OUT>
kernel void fp8_decode(device const uchar* src [[buffer(0)]],
                       device OUT* dst [[buffer(1)]],
                       device const float* scale [[buffer(2)]],
                       constant fp8_params& p [[buffer(3)]],
                       uint2 gid [[thread_position_in_grid]],
                       uint2 grid [[threads_per_grid]]) {
    const uint row_len = uint(p.row_len);
    for (uint r = gid.y; r < uint(p.rows); r += grid.y) {
        const float s = E::unit() * (p.scale_mode == 0 ? 1.0f : scale[p.scale_mode == 1 ? 0u : r]);
        device const uchar* in = src + ulong(r) * row_len;
        device OUT* out = dst + ulong(r) * row_len;
        for (uint i = gid.x * 16u; i < row_len; i += grid.x * 16u) {
            if (p.vec != 0 && i + 16u <= row_len) {
                const uint4 raw = *((device const uint4*)(in + i));
                UNROLL for (int g = 0; g < 4; ++g) io_store4(out + i + uint(4 * g), E::decode4(raw, g) * s);
            } else {
                const uint end = min(i + 16u, row_len);
                for (uint k = i; k < end; ++k) io_store(out + k, E::decode1(in + k) * s);
            }
        }
    }
}

// v / s, correctly rounded even under fast math (PYTORCH_MPS_FAST_MATH=1), where `/` may be 2.5 ulp off
// and move a value across an fp8 rounding boundary. A NaN input skips the division so its sign
// survives, as on the CPU.
inline float fp8_scaled(float v, float s, long scale_mode) {
    if (scale_mode == 0 || (as_type<uint>(v) & 0x7FFFFFFFu) > 0x7F800000u) return v;
    return precise::divide(v, s);
}

template <typename IN, typename E>
kernel void fp8_encode(device const IN* src [[buffer(0)]],
                       device uchar* dst [[buffer(1)]],
                       device const float* scale [[buffer(2)]],
                       constant fp8_params& p [[buffer(3)]],
                       uint2 gid [[thread_position_in_grid]],
                       uint2 grid [[threads_per_grid]]) {
    const uint row_len = uint(p.row_len);
    for (uint r = gid.y; r < uint(p.rows); r += grid.y) {
        const float s = p.scale_mode == 0 ? 1.0f : scale[p.scale_mode == 1 ? 0u : r];
        device const IN* in = src + ulong(r) * row_len;
        device uchar* out = dst + ulong(r) * row_len;
        for (uint i = gid.x * 16u; i < row_len; i += grid.x * 16u) {
            if (p.vec != 0 && i + 16u <= row_len) {
                uint4 q;
                UNROLL for (int g = 0; g < 4; ++g) {
                    const float4 v = io_float4(in + i + uint(4 * g));
                    q[g] = uint(E::encode(fp8_scaled(v.x, s, p.scale_mode))) |
                           (uint(E::encode(fp8_scaled(v.y, s, p.scale_mode))) << 8) |
                           (uint(E::encode(fp8_scaled(v.z, s, p.scale_mode))) << 16) |
                           (uint(E::encode(fp8_scaled(v.w, s, p.scale_mode))) << 24);
                }
                *((device uint4*)(out + i)) = q;
            } else {
                const uint end = min(i + 16u, row_len);
                for (uint k = i; k < end; ++k) out[k] = E::encode(fp8_scaled(io_float(in + k), s, p.scale_mode));
            }
        }
    }
}
