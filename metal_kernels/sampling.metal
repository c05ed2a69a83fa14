// Fused sampler steps: every k-diffusion step of the pack's samplers is one linear combination
//   out = cx*x + ca*a + cb*b + cc*c + cn*noise + sum_k w_k * N_k(seed, node_k, element)
// of the latent x, up to three more full-size tensors (denoised, older denoised values), an
// optional noise tensor and an optional counter-based device noise (a weighted sum of standard
// normals drawn from a stateless hash of (node key, element index): the Brownian-bridge noise of
// sampling.py, or one i.i.d. normal per step). The host computes the coefficients once per step
// from the sigma schedule it read before the loop, so the step reads each input once, writes the
// new x once and never makes the host wait. A non-finite output sets flags[step] (a device-side
// record the sampler reads once after the loop). Indices are 64-bit; threads stride the elements.
#include <metal_stdlib>
using namespace metal;

// "lowbias32" integer hash (Wellons): a bijection on 32 bits with good avalanche.
inline uint sampler_hash32(uint v) {
    v ^= v >> 16;
    v *= 0x7feb352du;
    v ^= v >> 15;
    v *= 0x846ca68bu;
    v ^= v >> 16;
    return v;
}

// Hash of a 64-bit element index (identical to sampling.py's _index_hash).
inline uint sampler_index_hash(long i) {
    ulong u = ulong(i);
    uint lo = uint(u & 0xffffffffUL);
    uint hi = uint(u >> 32);
    return sampler_hash32(lo ^ sampler_hash32(hi ^ 0x9e3779b9u));
}

// A standard normal for one (node key pair, element): Box-Muller on two hashed uniforms.
inline float sampler_normal(uint hidx, uint key_a, uint key_b) {
    uint h1 = sampler_hash32(hidx ^ key_a);
    uint h2 = sampler_hash32(hidx ^ key_b);
    float u1 = (float(h1 >> 8) + 0.5f) * (1.0f / 16777216.0f);
    float u2 = float(h2 >> 8) * (1.0f / 16777216.0f);
    // precise:: -- fast-math cos is only good to 2^-13 on [-pi, pi] and the angle spans [0, 2pi).
    return precise::sqrt(-2.0f * precise::log(u1)) * precise::cos(6.2831853071795864f * u2);
}

// sum_k w_k * N(node k) for element i; keys holds two 32-bit keys per node.
inline float sampler_device_noise_at(long i, constant long* keys, constant float* weights, long nkeys) {
    float acc = 0.0f;
    if (nkeys > 0) {
        const uint hidx = sampler_index_hash(i);
        for (long k = 0; k < nkeys; ++k) {
            acc += weights[k] * sampler_normal(hidx, uint(keys[2 * k]), uint(keys[2 * k + 1]));
        }
    }
    return acc;
}

// coef = [cx, ca, cb, cc, cn]; nin = how many of a, b, c are read (0..3; unused ones are never read);
// has_noise = 1 if the noise tensor is read; step >= 0 records a non-finite output in flags[step].
#define SAMPLER_LINCOMB_KERNEL(NAME, T)                                                       \
kernel void NAME(device const T* x [[buffer(0)]],                                             \
                 device const T* a [[buffer(1)]],                                             \
                 device const T* b [[buffer(2)]],                                             \
                 device const T* c [[buffer(3)]],                                             \
                 device const T* noise [[buffer(4)]],                                         \
                 device T* out [[buffer(5)]],                                                 \
                 device int* flags [[buffer(6)]],                                             \
                 constant float* coef [[buffer(7)]],                                          \
                 constant long* keys [[buffer(8)]],                                           \
                 constant float* weights [[buffer(9)]],                                       \
                 constant long& nin [[buffer(10)]],                                           \
                 constant long& has_noise [[buffer(11)]],                                     \
                 constant long& nkeys [[buffer(12)]],                                         \
                 constant long& step [[buffer(13)]],                                          \
                 constant long& numel [[buffer(14)]],                                         \
                 constant long& nthreads [[buffer(15)]],                                      \
                 uint tid [[thread_position_in_grid]]) {                                      \
    const float cx = coef[0], ca = coef[1], cb = coef[2], cc = coef[3], cn = coef[4];          \
    bool bad = false;                                                                         \
    for (long i = long(tid); i < numel; i += nthreads) {                                      \
        float acc = cx * float(x[i]);                                                         \
        if (nin > 0) acc += ca * float(a[i]);                                                 \
        if (nin > 1) acc += cb * float(b[i]);                                                 \
        if (nin > 2) acc += cc * float(c[i]);                                                 \
        if (has_noise != 0) acc += cn * float(noise[i]);                                      \
        acc += sampler_device_noise_at(i, keys, weights, nkeys);                              \
        const T v = T(acc);                                                                   \
        out[i] = v;                                                                           \
        bad = bad || !isfinite(float(v));                                                     \
    }                                                                                         \
    if (bad && step >= 0) flags[step] = 1;                                                    \
}

SAMPLER_LINCOMB_KERNEL(sampler_lincomb_float, float)
SAMPLER_LINCOMB_KERNEL(sampler_lincomb_half, half)
SAMPLER_LINCOMB_KERNEL(sampler_lincomb_bfloat, bfloat)

// The device noise alone: out[i] = sum_k w_k * N(node k, i).
#define SAMPLER_NOISE_KERNEL(NAME, T)                                                         \
kernel void NAME(device T* out [[buffer(0)]],                                                 \
                 constant long* keys [[buffer(1)]],                                           \
                 constant float* weights [[buffer(2)]],                                       \
                 constant long& nkeys [[buffer(3)]],                                          \
                 constant long& numel [[buffer(4)]],                                          \
                 constant long& nthreads [[buffer(5)]],                                       \
                 uint tid [[thread_position_in_grid]]) {                                      \
    for (long i = long(tid); i < numel; i += nthreads) {                                      \
        out[i] = T(sampler_device_noise_at(i, keys, weights, nkeys));                         \
    }                                                                                         \
}

SAMPLER_NOISE_KERNEL(sampler_noise_float, float)
SAMPLER_NOISE_KERNEL(sampler_noise_half, half)
SAMPLER_NOISE_KERNEL(sampler_noise_bfloat, bfloat)
