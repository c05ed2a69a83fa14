"""Synthetic MSL kernels whose performance counts are known by construction, for the profiler and
roofline tests (tests/emulator/test_profiler.py, tests/perf/test_roofline.py)."""
from __future__ import annotations

import torch

SRC = r"""
#include <metal_stdlib>
#include <metal_simdgroup>
#include <metal_simdgroup_matrix>
using namespace metal;

kernel void copy4(device float4* out [[buffer(0)]], const device float4* a [[buffer(1)]],
                  uint tid [[thread_position_in_grid]]) {
  out[tid] = a[tid];
}

kernel void stride8(device float* out [[buffer(0)]], const device float* a [[buffer(1)]],
                    uint tid [[thread_position_in_grid]]) {
  out[tid] = a[tid * 8];
}

kernel void tg_stride(device float* out [[buffer(0)]], constant int& stride [[buffer(1)]],
                      uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float t[32 * 32];
  t[lid * stride] = (float)lid;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[lid] = t[lid * stride];
}

kernel void half_branch(device float* out [[buffer(0)]], uint tid [[thread_position_in_grid]]) {
  if (tid % 2 == 0) {
    float v = out[tid];
    v = v * 1.5f + 0.25f;
    out[tid] = v;  // BRANCH BODY
  }
}

kernel void mma_loop(device float* out [[buffer(0)]], const device float* a [[buffer(1)]],
                     constant int& n [[buffer(2)]], uint sg [[simdgroup_index_in_threadgroup]]) {
  simdgroup_float8x8 A, B;
  simdgroup_float8x8 C = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  simdgroup_load(A, a, 8);
  simdgroup_load(B, a + 64, 8);
  for (int i = 0; i < n; i++) simdgroup_multiply_accumulate(C, A, B, C);
  simdgroup_store(C, out + sg * 64, 8);
}

kernel void div64(device long* out [[buffer(0)]], constant long& n [[buffer(1)]],
                  uint tid [[thread_position_in_grid]]) {
  long acc = 0;
  for (long i = 1; i <= n; i++) acc += ((long)tid + 1000) / i;
  out[tid] = acc;
}

kernel void div32(device int* out [[buffer(0)]], constant int& n [[buffer(1)]],
                  uint tid [[thread_position_in_grid]]) {
  int acc = 0;
  for (int i = 1; i <= n; i++) acc += ((int)tid + 1000) / i;
  out[tid] = acc;
}

kernel void reduce_loop(device float* out [[buffer(0)]], constant int& n [[buffer(1)]],
                        uint tid [[thread_position_in_grid]]) {
  float v = (float)tid;
  for (int i = 0; i < n; i++) v = simd_sum(v) * 0.5f;
  out[tid] = v;
}

kernel void tg_loop(device float* out [[buffer(0)]], constant int& stride [[buffer(1)]], constant int& n [[buffer(2)]],
                    uint lid [[thread_position_in_threadgroup]], uint gid [[thread_position_in_grid]]) {
  threadgroup float t[32 * 33];
  float acc = 0.0f;
  for (int i = 0; i < n; i++) {
    t[lid * stride + (i & 1)] = acc;
    threadgroup_barrier(mem_flags::mem_threadgroup);
    acc += t[((lid + 1) % 32) * stride + (i & 1)];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  out[gid] = acc;
}

// n simdgroup multiply-accumulates, each followed (FMAS) by 16 FMAs a lane (groups of 64 threads)
#define FMA4(y) y = fma(y, 0.999f, 0.5f); y = fma(y, 0.999f, 0.5f); y = fma(y, 0.999f, 0.5f); y = fma(y, 0.999f, 0.5f);
template <bool FMAS>
inline void mma_rounds(device float* out, const device float* a, int n, uint sg, uint lane, uint g) {
  simdgroup_float8x8 A, B;
  simdgroup_float8x8 C = make_filled_simdgroup_matrix<float, 8, 8>(0.0f);
  simdgroup_load(A, a, 8);
  simdgroup_load(B, a + 64, 8);
  float y = float(lane);
  for (int i = 0; i < n; i++) {
    simdgroup_multiply_accumulate(C, A, B, C);
    if (FMAS) {
      FMA4(y) FMA4(y) FMA4(y) FMA4(y)
    }
  }
  simdgroup_store(C, out + (2 * g + sg) * 96, 8);
  out[(2 * g + sg) * 96 + 64 + lane] = y;
}

kernel void mma_only(device float* out [[buffer(0)]], const device float* a [[buffer(1)]], constant int& n [[buffer(2)]],
                     uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                     uint g [[threadgroup_position_in_grid]]) {
  mma_rounds<false>(out, a, n, sg, lane, g);
}

kernel void mma_fma16(device float* out [[buffer(0)]], const device float* a [[buffer(1)]], constant int& n [[buffer(2)]],
                      uint sg [[simdgroup_index_in_threadgroup]], uint lane [[thread_index_in_simdgroup]],
                      uint g [[threadgroup_position_in_grid]]) {
  mma_rounds<true>(out, a, n, sg, lane, g);
}

kernel void mma_half(device half* out [[buffer(0)]], const device half* a [[buffer(1)]], constant int& n [[buffer(2)]],
                     uint sg [[simdgroup_index_in_threadgroup]]) {
  simdgroup_half8x8 A, B;
  simdgroup_half8x8 C = make_filled_simdgroup_matrix<half, 8, 8>(0.0h);
  simdgroup_load(A, a, 8);
  simdgroup_load(B, a + 64, 8);
  for (int i = 0; i < n; i++) simdgroup_multiply_accumulate(C, A, B, C);
  simdgroup_store(C, out + sg * 64, 8);
}

// n rounds of 8 fp32 FMAs, and with INTS 8 32-bit integer adds/xors, per lane (plus the loop's add and
// compare: 2 integer ops a round)
template <bool INTS>
inline float alu_rounds(uint tid, int n) {
  float x0 = float(tid), x1 = x0 + 1.0f, x2 = x0 + 2.0f, x3 = x0 + 3.0f;
  uint u0 = tid, u1 = tid + 1u, u2 = tid + 2u, u3 = tid + 3u;
  for (int i = 0; i < n; i++) {
    x0 = fma(x0, 0.999f, 0.5f); x1 = fma(x1, 0.999f, 0.5f); x2 = fma(x2, 0.999f, 0.5f); x3 = fma(x3, 0.999f, 0.5f);
    x0 = fma(x0, 0.999f, 0.5f); x1 = fma(x1, 0.999f, 0.5f); x2 = fma(x2, 0.999f, 0.5f); x3 = fma(x3, 0.999f, 0.5f);
    if (INTS) {
      u0 = (u0 + 0x9e3779b9u) ^ u1; u1 = (u1 + 0x7f4a7c15u) ^ u2;
      u2 = (u2 + 0x94d049bbu) ^ u3; u3 = (u3 + 0xbf58476du) ^ u0;
    }
  }
  return x0 + x1 + x2 + x3 + float(u0 ^ u1 ^ u2 ^ u3);
}

kernel void alu_fp(device float* out [[buffer(0)]], constant int& n [[buffer(1)]], uint tid [[thread_position_in_grid]]) {
  out[tid] = alu_rounds<false>(tid, n);
}

kernel void alu_fp_int(device float* out [[buffer(0)]], constant int& n [[buffer(1)]],
                       uint tid [[thread_position_in_grid]]) {
  out[tid] = alu_rounds<true>(tid, n);
}

// alu_fp with 32 KiB of threadgroup memory: one group per core fits
kernel void alu_fp_tg32k(device float* out [[buffer(0)]], constant int& n [[buffer(1)]],
                         uint tid [[thread_position_in_grid]], uint lid [[thread_position_in_threadgroup]]) {
  threadgroup float big[8192];
  big[lid] = alu_rounds<false>(tid, n);
  threadgroup_barrier(mem_flags::mem_threadgroup);
  out[tid] = big[lid];
}

// half arithmetic through MSL's half functions (the shim widens some of them to float internally)
kernel void half_fma(device half* out [[buffer(0)]], constant int& n [[buffer(1)]], uint tid [[thread_position_in_grid]]) {
  half a = half(tid & 7u), b = 1.0h;
  for (int i = 0; i < n; i++) {
    b = fma(a, b, 0.5h);
    a = clamp(a * 0.999h, 0.0h, 8.0h);
  }
  out[tid] = a + b;
}

// a 34-byte block copied whole into registers (clang turns the copy into memcpy)
struct block34 { half d; uchar q[32]; };
kernel void block_copy(device float* out [[buffer(0)]], const device block34* a [[buffer(1)]],
                       uint tid [[thread_position_in_grid]]) {
  block34 b = a[tid];
  float s = float(b.d);
  for (int i = 0; i < 32; i++) s += float(b.q[i]);
  out[tid] = s;
}

// y = W x, one simdgroup a row: its lanes read 4 bytes (gemv_f1) or 16 bytes (gemv_f4) of the row at a time
kernel void gemv_f1(device float* y [[buffer(0)]], const device float* w [[buffer(1)]],
                    const device float* x [[buffer(2)]], constant int& k [[buffer(3)]],
                    uint row [[threadgroup_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {
  float s = 0.0f;
  for (int i = int(lane); i < k; i += 32) s += w[row * uint(k) + uint(i)] * x[i];
  s = simd_sum(s);
  if (lane == 0) y[row] = s;
}

kernel void gemv_f4(device float* y [[buffer(0)]], const device float4* w [[buffer(1)]],
                    const device float4* x [[buffer(2)]], constant int& k4 [[buffer(3)]],
                    uint row [[threadgroup_position_in_grid]], uint lane [[thread_index_in_simdgroup]]) {
  float s = 0.0f;
  for (int i = int(lane); i < k4; i += 32) s += dot(w[row * uint(k4) + uint(i)], x[i]);
  s = simd_sum(s);
  if (lane == 0) y[row] = s;
}

// rows of a matrix times a vector every group reads whole: one thread per row
kernel void rows(device float* y [[buffer(0)]], const device float* w [[buffer(1)]],
                 const device float* x [[buffer(2)]], constant int& n [[buffer(3)]], constant int& k [[buffer(4)]],
                 uint row [[thread_position_in_grid]]) {
  if ((int)row >= n) return;
  float acc = 0.0f;
  for (int j = 0; j < k; j++) acc += w[row * k + j] * x[j];
  y[row] = acc;
}
"""


def aligned(n: int, dtype=torch.float32, fill=None) -> torch.Tensor:
    """A tensor of n elements whose data starts on a 128-byte line on the GPU: at the start of its own
    storage (an MTLBuffer starts a line; the profiler counts sectors and lines from there, not by host
    address)."""
    t = torch.empty(n, dtype=dtype)
    if fill is not None:
        t.copy_(fill)
    return t


class RecordingLibrary:
    """A compiled library that records the names of the kernels fetched from it (which entry point a
    launch took)."""

    def __init__(self, lib):
        self._lib, self.launched = lib, []

    def __getattr__(self, name):
        self.launched.append(name)
        return getattr(self._lib, name)
