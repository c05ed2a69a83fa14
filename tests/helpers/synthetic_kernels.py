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
    """A tensor of n elements whose data starts on a 128-byte line."""
    es = torch.empty(0, dtype=dtype).element_size()
    buf = torch.empty(n + 256 // es, dtype=dtype)
    off = (-buf.data_ptr() % 128) // es
    t = buf[off:off + n]
    if fill is not None:
        t.copy_(fill)
    return t
