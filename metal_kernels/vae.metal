// Kernels of the tiled low-memory VAE (nodes/vae/engine.py, nodes/vae/pad.py), on 3-D grids: x runs over the
// columns, y over the rows, z over the planes (the N * C planes of [N, C, T, H, W], T looped in the thread).
// No division anywhere; offsets are 32-bit (the host launches at most 2^32 elements' worth of planes at once,
// on views starting at their first plane).
//
// vae_pad<T>: constant / replicate padding of the last three dims (4-D inputs arrive as T = 1 with no
//   temporal pad). Each thread reads its clamped source element (the answer of replicate padding, always in
//   bounds) and writes it, or the fill value outside the input in constant mode; it takes every grid.z-th
//   plane (the host sizes grid z to a few planes a thread). Replaces MPSGraph's pad,
//   which blows up memory and corrupts data at H*W >= 2^16 before torch 2.15.
// vae_blend_accumulate<T>: acc[p, t0 + t, y0 + y, x0 + x] += wy[y] * wx[x] * tile[p, t, y, x] into an fp32
//   accumulator, for a tile of [P, Tc, h, w] written at (t0, y0, x0) of a [P, T, H, W] accumulator. The
//   feather weights are separable per-axis ramps; each accumulator element belongs to one thread (no atomics).

#include "io.h"

template <typename T>
inline T vae_value(float v) { return T(v); }
template <>
inline bfloat vae_value<bfloat>(float v) { return as_type<bfloat>(bf16_bits_from_float(v)); }

template <typename T>
kernel void vae_pad(device const T* x [[buffer(0)]],
                    device T* out [[buffer(1)]],
                    constant float& value [[buffer(2)]],
                    constant vae_pad_params& p [[buffer(3)]],
                    uint3 gid [[thread_position_in_grid]],
                    uint3 grid [[threads_per_grid]]) {
    const int in_t = int(p.in_t), in_h = int(p.in_h), in_w = int(p.in_w), pad_t = int(p.pad_t);
    const uint out_t = uint(p.out_t), out_w = uint(p.out_w), planes = uint(p.planes);
    const bool replicate = p.replicate != 0;
    const int sx = int(gid.x) - int(p.pad_w), sy = int(gid.y) - int(p.pad_h);
    const int cx = clamp(sx, 0, in_w - 1), cy = clamp(sy, 0, in_h - 1);
    const bool keep_xy = replicate || (sx == cx && sy == cy);
    const T fill = vae_value<T>(value);
    const uint in_frame = uint(in_h * in_w), out_frame = uint(p.out_h) * out_w;
    const uint in_plane = uint(in_t) * in_frame, out_plane = out_t * out_frame;
    device const T* src = x + gid.z * in_plane + uint(cy * in_w + cx);
    device T* dst = out + gid.z * out_plane + gid.y * out_w + gid.x;
    // planes gid.z, gid.z + grid.z, ...: the set-up above is shared by them
    for (uint z = gid.z; z < planes; z += grid.z, src += grid.z * in_plane, dst += grid.z * out_plane) {
        for (uint t = 0; t < out_t; ++t) {
            const int st = int(t) - pad_t, ct = clamp(st, 0, in_t - 1);
            const T v = src[uint(ct) * in_frame];
            dst[t * out_frame] = keep_xy && (replicate || st == ct) ? v : fill;
        }
    }
}

template <typename T>
kernel void vae_blend_accumulate(device float* acc [[buffer(0)]],
                                 device const T* tile [[buffer(1)]],
                                 device const float* wy [[buffer(2)]],
                                 device const float* wx [[buffer(3)]],
                                 constant vae_blend_params& p [[buffer(4)]],
                                 uint3 gid [[thread_position_in_grid]]) {
    const uint tile_t = uint(p.tile_t), tile_h = uint(p.tile_h), tile_w = uint(p.tile_w);
    const uint acc_h = uint(p.acc_h), acc_w = uint(p.acc_w);
    const uint tile_plane = tile_h * tile_w, acc_plane = acc_h * acc_w;
    const float weight = wy[gid.y] * wx[gid.x];
    device const T* src = tile + gid.z * (tile_t * tile_plane) + gid.y * tile_w + gid.x;
    device float* dst = acc + gid.z * (uint(p.acc_t) * acc_plane) + (uint(p.t0) * acc_h + uint(p.y0) + gid.y) * acc_w
                        + uint(p.x0) + gid.x;
    for (uint t = 0; t < tile_t; ++t) dst[t * acc_plane] += weight * io_float(src + t * tile_plane);
}
