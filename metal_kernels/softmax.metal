// Row softmax: y[r, :] = softmax(x[r, :] * inv_temperature), numerically stable, in fp32.
// One threadgroup per row; each thread keeps an online (max, sum) over its strided columns, the
// group combines them with simd reductions and a 32-slot threadgroup exchange, then writes.
// Rows of any length (tested to 262,144) and any count; indices are 64-bit.
#include <metal_stdlib>
using namespace metal;

// Combine two online-softmax states (m, s): s is the sum of exp(v - m).
inline float2 softmax_combine(float2 a, float2 b) {
    float m = max(a.x, b.x);
    float sa = (a.x == -INFINITY) ? 0.0f : a.y * exp(a.x - m);
    float sb = (b.x == -INFINITY) ? 0.0f : b.y * exp(b.x - m);
    return float2(m, sa + sb);
}

inline float2 softmax_simd_combine(float2 st) {
    float m = simd_max(st.x);
    float s = (st.x == -INFINITY) ? 0.0f : st.y * exp(st.x - m);
    return float2(m, simd_sum(s));
}

#define SOFTMAX_ROWS_KERNEL(NAME, T)                                                        \
kernel void NAME(device const T* x [[buffer(0)]],                                           \
                 device T* y [[buffer(1)]],                                                 \
                 constant long& ncols [[buffer(2)]],                                        \
                 constant float& inv_temperature [[buffer(3)]],                             \
                 uint tid [[thread_index_in_threadgroup]],                                  \
                 uint row [[threadgroup_position_in_grid]],                                 \
                 uint group_size [[threads_per_threadgroup]],                               \
                 uint lane [[thread_index_in_simdgroup]],                                   \
                 uint simd_id [[simdgroup_index_in_threadgroup]]) {                         \
    threadgroup float2 partial[32];                                                         \
    const long base = long(row) * ncols;                                                    \
    float2 st = float2(-INFINITY, 0.0f);                                                    \
    for (long c = tid; c < ncols; c += group_size) {                                        \
        float v = float(x[base + c]) * inv_temperature;                                     \
        st = softmax_combine(st, float2(v, 1.0f));                                          \
    }                                                                                       \
    st = softmax_simd_combine(st);                                                          \
    if (lane == 0) partial[simd_id] = st;                                                   \
    threadgroup_barrier(mem_flags::mem_threadgroup);                                        \
    const uint nsimd = (group_size + 31) / 32;                                              \
    if (simd_id == 0) {                                                                     \
        float2 t = lane < nsimd ? partial[lane] : float2(-INFINITY, 0.0f);                  \
        t = softmax_simd_combine(t);                                                        \
        if (lane == 0) partial[0] = t;                                                      \
    }                                                                                       \
    threadgroup_barrier(mem_flags::mem_threadgroup);                                        \
    const float m = partial[0].x;                                                           \
    const float inv_sum = 1.0f / partial[0].y;                                              \
    for (long c = tid; c < ncols; c += group_size) {                                        \
        float v = float(x[base + c]) * inv_temperature;                                     \
        y[base + c] = T(exp(v - m) * inv_sum);                                              \
    }                                                                                       \
}

SOFTMAX_ROWS_KERNEL(softmax_rows_float, float)
SOFTMAX_ROWS_KERNEL(softmax_rows_half, half)
SOFTMAX_ROWS_KERNEL(softmax_rows_bfloat, bfloat)
