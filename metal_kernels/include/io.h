// Loads and stores shared by the kernels. Included after <metal_stdlib> and bf16.h (common.metal).
//
// io_u32/u64/u128<A>(p): 4, 8 or 16 bytes at p as little-endian words, where p is known to be a multiple
//   of A (1, 2, 4, 8, 16): the widest loads that alignment allows (ushort pairs at A = 2, bytes at A = 1).
//   GGUF blocks of 34, 110 or 210 bytes leave their fields 2-aligned only.
// io_float4(p) / io_float(p): 4 values (p 4-element aligned) or 1 value of float, half or bfloat as fp32;
//   io_float8(p, a, b): 8 values (p 16-byte aligned) in one 16-byte load for half and bfloat.
// io_store / io_store4: round once from fp32 to the stored type with round-to-nearest-even (bfloat through
//   the explicit bit helper of bf16.h). io_store_kind / io_load_kind: the same with the type chosen at run
//   time (MSL_KIND_FLOAT / HALF / BFLOAT), for values touched once per output.

template <int A>
inline uint io_u32(device const uchar* p) {
    if (A >= 4) return *((device const uint*)p);
    if (A >= 2) return uint(*((device const ushort*)p)) | (uint(*((device const ushort*)(p + 2))) << 16);
    return uint(p[0]) | (uint(p[1]) << 8) | (uint(p[2]) << 16) | (uint(p[3]) << 24);
}

template <int A>
inline uint2 io_u64(device const uchar* p) {
    if (A >= 8) return *((device const uint2*)p);
    return uint2(io_u32<A>(p), io_u32<A>(p + 4));
}

template <int A>
inline uint4 io_u128(device const uchar* p) {
    if (A >= 16) return *((device const uint4*)p);
    const uint2 lo = io_u64<A>(p);
    const uint2 hi = io_u64<A>(p + 8);
    return uint4(lo.x, lo.y, hi.x, hi.y);
}

// An fp16 field at a 2-aligned address.
inline float io_half(device const uchar* p) { return float(as_type<half>(*((device const ushort*)p))); }

inline float4 io_float4(device const float* p) { return *((device const float4*)p); }
inline float4 io_float4(device const half* p) { return float4(*((device const half4*)p)); }
inline float4 io_bf16x4(uint2 u) {
    return float4(as_type<float>(u.x << 16), as_type<float>(u.x & 0xFFFF0000u), as_type<float>(u.y << 16),
                  as_type<float>(u.y & 0xFFFF0000u));
}
inline float4 io_float4(device const bfloat* p) { return io_bf16x4(*((device const uint2*)p)); }
inline void io_float8(device const float* p, thread float4& a, thread float4& b) {
    a = *((device const float4*)p);
    b = *((device const float4*)(p + 4));
}
inline void io_float8(device const half* p, thread float4& a, thread float4& b) {
    const uint4 u = *((device const uint4*)p);
    a = float4(as_type<half4>(u.xy));
    b = float4(as_type<half4>(u.zw));
}
inline void io_float8(device const bfloat* p, thread float4& a, thread float4& b) {
    const uint4 u = *((device const uint4*)p);
    a = io_bf16x4(u.xy);
    b = io_bf16x4(u.zw);
}
inline float io_float(device const float* p) { return *p; }
inline float io_float(device const half* p) { return float(*p); }
inline float io_float(device const bfloat* p) { return bf16_bits_to_float(*((device const ushort*)p)); }

inline void io_store(device float* p, float v) { *p = v; }
inline void io_store(device half* p, float v) { *p = half(v); }
inline void io_store(device bfloat* p, float v) { *((device ushort*)p) = bf16_bits_from_float(v); }
inline void io_store4(device float* p, float4 v) { *((device float4*)p) = v; }
inline void io_store4(device half* p, float4 v) { *((device half4*)p) = half4(v); }
inline void io_store4(device bfloat* p, float4 v) {
    *((device ushort4*)p) = ushort4(bf16_bits_from_float(v.x), bf16_bits_from_float(v.y),
                                    bf16_bits_from_float(v.z), bf16_bits_from_float(v.w));
}

inline void io_store_kind(device uchar* base, ulong i, float v, long kind) {
    if (kind == MSL_KIND_HALF) io_store((device half*)base + i, v);
    else if (kind == MSL_KIND_BFLOAT) io_store((device bfloat*)base + i, v);
    else io_store((device float*)base + i, v);
}

inline float io_load_kind(device const uchar* base, ulong i, long kind) {
    if (kind == MSL_KIND_HALF) return io_float((device const half*)base + i);
    if (kind == MSL_KIND_BFLOAT) return io_float((device const bfloat*)base + i);
    return io_float((device const float*)base + i);
}
