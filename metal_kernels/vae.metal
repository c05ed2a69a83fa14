// Kernels of the tiled low-memory VAE (nodes/vae_tiled.py, nodes/vae_tiling.py).
//
// vae_pad_<T>: constant / replicate padding of the last three dims of a [P, T, H, W] tensor
//   (4-D inputs arrive as [P, 1, H, W] with no temporal pad). Grid-stride loop over output elements,
//   64-bit indices (video activations pass 2^31 elements). Replaces MPSGraph's pad, which
//   blows up memory and corrupts data at H*W >= 2^16 before torch 2.15.
// vae_blend_accumulate_<T>: acc[p, t0 + t, y0 + y, x0 + x] += wy[y] * wx[x] * tile[p, t, y, x]
//   into an fp32 accumulator, for a tile of [P, Tc, h, w] written at (t0, y0, x0) of a
//   [P, T, H, W] accumulator. The feather weights are separable per-axis ramps; each tile
//   element is handled by one thread, so no two threads touch the same accumulator element (no atomics needed).
#include <metal_stdlib>
using namespace metal;

#define VAE_PAD_KERNEL(NAME, T)                                                              \
kernel void NAME(device const T* x [[buffer(0)]],                                            \
                 device T* out [[buffer(1)]],                                                \
                 constant long& total [[buffer(2)]],                                         \
                 constant long& in_t [[buffer(3)]],                                          \
                 constant long& in_h [[buffer(4)]],                                          \
                 constant long& in_w [[buffer(5)]],                                          \
                 constant long& out_t [[buffer(6)]],                                         \
                 constant long& out_h [[buffer(7)]],                                         \
                 constant long& out_w [[buffer(8)]],                                         \
                 constant long& pad_t [[buffer(9)]],                                         \
                 constant long& pad_h [[buffer(10)]],                                        \
                 constant long& pad_w [[buffer(11)]],                                        \
                 constant long& replicate [[buffer(12)]],                                    \
                 constant float& value [[buffer(13)]],                                       \
                 constant long& stride [[buffer(14)]],                                       \
                 uint gid [[thread_position_in_grid]]) {                                     \
    for (long i = long(gid); i < total; i += stride) {                                       \
        long r = i;                                                                          \
        const long ox = r % out_w; r /= out_w;                                               \
        const long oy = r % out_h; r /= out_h;                                               \
        const long ot = r % out_t; r /= out_t;                                               \
        const long p = r;                                                                    \
        long sx = ox - pad_w, sy = oy - pad_h, st = ot - pad_t;                              \
        if (replicate != 0) {                                                                \
            sx = clamp(sx, 0L, in_w - 1);                                                    \
            sy = clamp(sy, 0L, in_h - 1);                                                    \
            st = clamp(st, 0L, in_t - 1);                                                    \
        } else if (sx < 0 || sx >= in_w || sy < 0 || sy >= in_h || st < 0 || st >= in_t) {  \
            out[i] = T(value);                                                               \
            continue;                                                                        \
        }                                                                                    \
        out[i] = x[((p * in_t + st) * in_h + sy) * in_w + sx];                               \
    }                                                                                        \
}

VAE_PAD_KERNEL(vae_pad_float, float)
VAE_PAD_KERNEL(vae_pad_half, half)
VAE_PAD_KERNEL(vae_pad_bfloat, bfloat)

#define VAE_BLEND_KERNEL(NAME, T)                                                            \
kernel void NAME(device float* acc [[buffer(0)]],                                            \
                 device const T* tile [[buffer(1)]],                                         \
                 device const float* wy [[buffer(2)]],                                       \
                 device const float* wx [[buffer(3)]],                                       \
                 constant long& total [[buffer(4)]],                                         \
                 constant long& tile_t [[buffer(5)]],                                        \
                 constant long& tile_h [[buffer(6)]],                                        \
                 constant long& tile_w [[buffer(7)]],                                        \
                 constant long& acc_t [[buffer(8)]],                                         \
                 constant long& acc_h [[buffer(9)]],                                         \
                 constant long& acc_w [[buffer(10)]],                                        \
                 constant long& t0 [[buffer(11)]],                                           \
                 constant long& y0 [[buffer(12)]],                                           \
                 constant long& x0 [[buffer(13)]],                                           \
                 constant long& stride [[buffer(14)]],                                       \
                 uint gid [[thread_position_in_grid]]) {                                     \
    for (long i = long(gid); i < total; i += stride) {                                       \
        long r = i;                                                                          \
        const long x = r % tile_w; r /= tile_w;                                              \
        const long y = r % tile_h; r /= tile_h;                                              \
        const long t = r % tile_t; r /= tile_t;                                              \
        const long p = r;                                                                    \
        const long j = ((p * acc_t + (t0 + t)) * acc_h + (y0 + y)) * acc_w + (x0 + x);       \
        acc[j] += wy[y] * wx[x] * float(tile[i]);                                            \
    }                                                                                        \
}

VAE_BLEND_KERNEL(vae_blend_accumulate_float, float)
VAE_BLEND_KERNEL(vae_blend_accumulate_half, half)
VAE_BLEND_KERNEL(vae_blend_accumulate_bfloat, bfloat)
