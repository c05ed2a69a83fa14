"""Realistic kernel bugs the emulator must catch, each next to its fixed version (a legal control).

Every case is valid MSL with one bug of a kind that ships: uninitialised threadgroup memory or a one-past-the-end
read swallowed by max/abs (caught by the poison re-runs), races across threadgroups and inside one (the race
detector, under every schedule), a half-precision overflow (no excess precision), out-of-bounds writes,
divergent barriers. "Caught" means the launch raises an EmulatorError or its output differs from the float64
reference; the fixed kernel must launch cleanly and match. Before the race detector and the poison runs, the
outside check missed 5 of these kinds (uninitialised/one-past-the-end into max, split-K and histogram races, half
overflow, a missing barrier that only shuffled schedules showed).
"""
from __future__ import annotations

import pytest
import torch

from comfy_metal.metal_kernels import emulator as emu

pytestmark = pytest.mark.skipif(not emu.available(), reason="clang-19 not installed: the MSL emulator needs it")

HDR = "#include <metal_stdlib>\nusing namespace metal;\n"

# name -> (bug body, fixed body); {K} is replaced by bug_<name> / fix_<name>
CASES = {
    # uninitialised threadgroup slot feeds a max reduction (the NaN fill is swallowed by max)
    "uninit_tg_max": ("""
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  if ((long)l < n) t[l] = x[l];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (l == 0) { float m = t[0]; for (uint k = 1; k < 64; k++) m = max(m, t[k]); out[0] = m; }
}""", """
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  t[l] = (long)l < n ? x[l] : -INFINITY;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (l == 0) { float m = t[0]; for (uint k = 1; k < 64; k++) m = max(m, t[k]); out[0] = m; }
}"""),
    # one-past-the-end read feeds max
    "oob_read_max": ("""
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint i [[thread_position_in_grid]]) {
  if (i == 0) { float m = x[0]; for (long k = 1; k <= n; k++) m = max(m, x[k]); out[0] = m; }
}""", """
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint i [[thread_position_in_grid]]) {
  if (i == 0) { float m = x[0]; for (long k = 1; k < n; k++) m = max(m, x[k]); out[0] = m; }
}"""),
    # absmax (fp8 scale) reads one element past the end: abs(NaN) swallowed by fmax
    "oob_read_absmax": ("""
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint i [[thread_position_in_grid]]) {
  if (i == 0) { float m = 0.0f; for (long k = 0; k <= n; k++) m = fmax(m, abs(x[k])); out[0] = m; }
}""", """
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint i [[thread_position_in_grid]]) {
  if (i == 0) { float m = 0.0f; for (long k = 0; k < n; k++) m = fmax(m, abs(x[k])); out[0] = m; }
}"""),
    # min over a row whose tail threads leave their slot unwritten
    "uninit_tg_min": ("""
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  if ((long)l < n) t[l] = -x[l];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (l == 0) { float m = t[0]; for (uint k = 1; k < 64; k++) m = min(m, t[k]); out[0] = -m; }
}""", """
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  t[l] = (long)l < n ? -x[l] : INFINITY;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (l == 0) { float m = t[0]; for (uint k = 1; k < 64; k++) m = min(m, t[k]); out[0] = -m; }
}"""),
    # split-K: every threadgroup adds its partial sum into out[0] non-atomically
    "splitk_race": ("""
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]], uint g [[threadgroup_position_in_grid]]) {
  if (l == 0) { float s = 0.0f; for (uint k = 0; k < 16; k++) s += x[g * 16 + k]; out[0] += s; }
}""", """
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]], uint g [[threadgroup_position_in_grid]]) {
  if (l == 0 && g == 0) { float s = 0.0f; for (long k = 0; k < n; k++) s += x[k]; out[0] = s; }
}"""),
    # non-atomic histogram
    "histogram_race": ("""
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint i [[thread_position_in_grid]]) {
  if ((long)i < n) out[uint(x[i] > 0.0f)] += 1.0f;
}""", """
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint i [[thread_position_in_grid]]) {
  if (i < 2) { float c = 0.0f; for (long k = 0; k < n; k++) c += float(uint(x[k] > 0.0f) == i); out[i] = c; }
}"""),
    # mean of squares in half: the intermediate v*v (300^2 = 90000 > 65504) overflows on a GPU, though the
    # stored terms v*v/1024 would fit (clang's default excess precision hid this)
    "half_overflow": ("""
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint i [[thread_position_in_grid]]) {
  if (i == 0) { half s = 0.0h; for (long k = 0; k < n; k++) { half v = half(x[k]); s += v * v / 1024.0h; }
                out[0] = sqrt(float(s)) / 100.0f; }
}""", """
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint i [[thread_position_in_grid]]) {
  if (i == 0) { float s = 0.0f; for (long k = 0; k < n; k++) { float v = x[k]; s += v * v / 1024.0f; }
                out[0] = sqrt(s) / 100.0f; }
}"""),
    # tree reduction without the barrier between levels (correct under forward order)
    "missing_barrier_tree": ("""
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  t[l] = (long)l < n ? x[l] : 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint s = 32; s > 0; s >>= 1) { if (l < s) t[l] += t[l + s]; }
  if (l == 0) out[0] = t[0];
}""", """
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  t[l] = (long)l < n ? x[l] : 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (uint s = 32; s > 0; s >>= 1) { if (l < s) t[l] += t[l + s]; threadgroup_barrier(mem_flags::mem_threadgroup); }
  if (l == 0) out[0] = t[0];
}"""),
    # barrier missing between the stores and the read of a neighbour's slot (right in reverse order)
    "missing_barrier_reverse_ok": ("""
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  t[l] = (long)l < n ? x[l] : 0.0f;
  float v = t[l < 63 ? l + 1 : l];
  if (l == 0) out[0] = v;
}""", """
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  t[l] = (long)l < n ? x[l] : 0.0f;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  float v = t[l < 63 ? l + 1 : l];
  if (l == 0) out[0] = v;
}"""),
    # double-buffered tile reused without the second barrier: the next load overwrites a tile still being read
    "tile_reuse_race": ("""
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  float acc = 0.0f;
  for (uint it = 0; it < 2; it++) {
    t[l] = x[it * 64 + l];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    acc += t[63 - l];
  }
  if (l == 0) out[0] = acc;
}""", """
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  float acc = 0.0f;
  for (uint it = 0; it < 2; it++) {
    t[l] = x[it * 64 + l];
    threadgroup_barrier(mem_flags::mem_threadgroup);
    acc += t[63 - l];
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  if (l == 0) out[0] = acc;
}"""),
    # two threads write the same output element (index computed with the wrong divisor)
    "duplicate_writer": ("""
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint i [[thread_position_in_grid]]) {
  if (i < 2) out[i / 2] = x[i];
}""", """
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint i [[thread_position_in_grid]]) {
  if (i < 2) out[i] = x[i];
}"""),
    # in-place stencil: reads a neighbour that another threadgroup writes
    "inplace_stencil_race": ("""
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint i [[thread_position_in_grid]]) {
  if (i == 0) out[1] = 0.0f;
  if ((long)i < n - 1) out[2 + i] = out[2 + i + 1] * 0.5f + x[i];
}""", """
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint i [[thread_position_in_grid]]) {
  if (i == 0) out[1] = 0.0f;
  if ((long)i < n - 1) out[2 + i] = x[i + 1] * 0.5f + x[i];
}"""),
    # simdgroup 1 reads what simdgroup 0 wrote to threadgroup memory, without a barrier
    "cross_simdgroup_no_barrier": ("""
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]]) {
  threadgroup float partial[2];
  float s = simd_sum(x[l]);
  if (l % 32 == 0) partial[l / 32] = s;
  if (l == 32) out[0] = partial[0] + partial[1];
}""", """
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]]) {
  threadgroup float partial[2];
  float s = simd_sum(x[l]);
  if (l % 32 == 0) partial[l / 32] = s;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (l == 32) out[0] = partial[0] + partial[1];
}"""),
    # missing bounds check: the grid is rounded up to the group size
    "oob_write_tail": ("""
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint i [[thread_position_in_grid]]) {
  out[i] = 2.0f * x[min((long)i, n - 1)];
}""", """
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint i [[thread_position_in_grid]]) {
  if ((long)i < n) out[i] = 2.0f * x[i];
}"""),
    # shift by one writes before the start
    "oob_write_before": ("""
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint i [[thread_position_in_grid]]) {
  if ((long)i < n) out[int(i) - 1] = x[i];
}""", """
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint i [[thread_position_in_grid]]) {
  if ((long)i < n && i > 0) out[i - 1] = x[i];
}"""),
    # early return before a barrier (deadlock on the GPU)
    "divergent_barrier": ("""
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  if ((long)l >= n) return;
  t[l] = x[l];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (l == 0) { float s = 0.0f; for (long k = 0; k < n; k++) s += t[k]; out[0] = s; }
}""", """
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  if ((long)l < n) t[l] = x[l];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (l == 0) { float s = 0.0f; for (long k = 0; k < n; k++) s += t[k]; out[0] = s; }
}"""),
    # a barrier inside a loop whose trip count differs per thread
    "barrier_in_uneven_loop": ("""
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  t[l] = 0.0f;
  for (uint k = 0; k < l % 3; k++) threadgroup_barrier(mem_flags::mem_threadgroup);
  if (l == 0) out[0] = x[0];
}""", """
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  t[l] = 0.0f;
  for (uint k = 0; k < 2; k++) threadgroup_barrier(mem_flags::mem_threadgroup);
  if (l == 0) out[0] = x[0];
}"""),
    # reduction over a tail group that reads past the input instead of padding with 0
    "tail_group_reads_past": ("""
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  t[l] = x[l];
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (l == 0) { float m = t[0]; for (uint k = 1; k < 64; k++) m = max(m, t[k]); out[0] = m; }
}""", """
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  t[l] = (long)l < n ? x[l] : -INFINITY;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (l == 0) { float m = t[0]; for (uint k = 1; k < 64; k++) m = max(m, t[k]); out[0] = m; }
}"""),
    # reading one slot past a threadgroup array (into memory nobody wrote)
    "tg_array_overrun": ("""
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  t[l] = (long)l < n ? x[l] : -INFINITY;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (l == 0) { float m = -INFINITY; for (uint k = 1; k <= 64; k++) m = max(m, t[k]); out[0] = max(m, t[0]); }
}""", """
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]]) {
  threadgroup float t[64];
  t[l] = (long)l < n ? x[l] : -INFINITY;
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if (l == 0) { float m = -INFINITY; for (uint k = 1; k < 64; k++) m = max(m, t[k]); out[0] = max(m, t[0]); }
}"""),
    # per-group partial sums: every group writes its slot, then group 0 adds the slots (no grid-wide sync)
    "cross_group_read_after_write": ("""
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]], uint g [[threadgroup_position_in_grid]]) {
  if (l == 0) { float s = 0.0f; for (uint k = 0; k < 16; k++) s += x[g * 16 + k]; out[1 + g] = s; }
  if (l == 0 && g == 0) out[0] = out[1] + out[2] + out[3] + out[4];
}""", """
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]], uint g [[threadgroup_position_in_grid]]) {
  if (l == 0) { float s = 0.0f; for (uint k = 0; k < 16; k++) s += x[g * 16 + k]; out[1 + g] = s; }
  if (l == 0 && g == 0) { float s = 0.0f; for (long k = 0; k < n; k++) s += x[k]; out[0] = s; }
}"""),
    # softmax: the max is read from threadgroup memory before thread 0 has written it
    "softmax_max_no_barrier": ("""
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]]) {
  threadgroup float m[1];
  if (l == 0) { float v = x[0]; for (long k = 1; k < n; k++) v = max(v, x[k]); m[0] = v; }
  if ((long)l < n) out[l] = exp(x[l] - m[0]);
}""", """
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]]) {
  threadgroup float m[1];
  if (l == 0) { float v = x[0]; for (long k = 1; k < n; k++) v = max(v, x[k]); m[0] = v; }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  if ((long)l < n) out[l] = exp(x[l] - m[0]);
}"""),
    # lane 0 publishes a value in threadgroup memory for its simdgroup without a simdgroup_barrier
    "simd_publish_no_barrier": ("""
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]]) {
  threadgroup float t[1];
  if (l == 0) t[0] = x[0] * 2.0f;
  float v = t[0];
  out[l] = v;
}""", """
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint l [[thread_position_in_threadgroup]]) {
  threadgroup float t[1];
  if (l == 0) t[0] = x[0] * 2.0f;
  simdgroup_barrier(mem_flags::mem_threadgroup);
  float v = t[0];
  out[l] = v;
}"""),
    # integer division by a zero stride
    "int_div_by_zero": ("""
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint i [[thread_position_in_grid]]) {
  long cols = n / 64;
  if ((long)i < n) out[i] = x[i] + float(i / cols);
}""", """
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint i [[thread_position_in_grid]]) {
  long cols = max(n / 64, 1L);
  if ((long)i < n) out[i] = x[i] + float(i / cols);
}"""),
    # half partial sums: exp of scores in half overflows (65504) on the GPU
    "half_exp_overflow": ("""
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint i [[thread_position_in_grid]]) {
  if (i == 0) { half s = 0.0h; for (long k = 0; k < n; k++) s += exp(half(x[k] / 30.0f)); out[0] = log(float(s)); }
}""", """
kernel void {K}(device float* out [[buffer(0)]], const device float* x [[buffer(1)]], constant long& n [[buffer(2)]],
                uint i [[thread_position_in_grid]]) {
  if (i == 0) { float s = 0.0f; for (long k = 0; k < n; k++) s += exp(x[k] / 30.0f); out[0] = log(s); }
}"""),
}


def _reference(name: str, x: torch.Tensor, n: int) -> torch.Tensor:
    """What the fixed kernel computes, in float64 (first output elements compared)."""
    xd, xn = x.double(), x[:n].double()
    if name in ("uninit_tg_max", "oob_read_max", "tail_group_reads_past", "tg_array_overrun"):
        return xn.max().reshape(1)
    if name == "uninit_tg_min":
        return xn.max().reshape(1)
    if name == "oob_read_absmax":
        return xn.abs().max().reshape(1)
    if name in ("splitk_race", "divergent_barrier", "missing_barrier_tree", "cross_group_read_after_write"):
        return xn.sum().reshape(1)
    if name == "histogram_race":
        pos = (xn > 0).double().sum()
        return torch.stack([n - pos, pos])
    if name == "half_overflow":
        return (xn * xn / 1024.0).sum().sqrt().reshape(1) / 100.0
    if name == "missing_barrier_reverse_ok":
        return xn[1:2]
    if name == "tile_reuse_race":
        return (xd[63] + xd[127]).reshape(1)
    if name == "duplicate_writer":
        return xd[:2]
    if name == "inplace_stencil_race":
        return torch.cat([torch.zeros(1, dtype=torch.float64), xd[1:n] * 0.5 + xd[:n - 1]])
    if name == "cross_simdgroup_no_barrier":
        return xd[:64].sum().reshape(1)
    if name in ("oob_write_tail",):
        return 2.0 * xn
    if name == "oob_write_before":
        return xn[1:]
    if name == "barrier_in_uneven_loop":
        return xd[:1]
    if name == "softmax_max_no_barrier":
        return (xn - xn.max()).exp()
    if name == "simd_publish_no_barrier":
        return (2.0 * xd[0]).repeat(n)
    if name == "int_div_by_zero":
        return xn + torch.arange(n, dtype=torch.float64) // max(n // 64, 1)
    if name == "half_exp_overflow":
        return (xn / 30.0).exp().sum().log().reshape(1)
    raise KeyError(name)


SHAPES = {  # name -> (n, threads, group)
    "uninit_tg_max": (50, 64, 64), "uninit_tg_min": (50, 64, 64), "oob_read_max": (37, 1, 1),
    "oob_read_absmax": (37, 1, 1), "splitk_race": (64, 128, 32), "histogram_race": (100, 100, 32),
    "half_overflow": (64, 1, 1), "missing_barrier_tree": (64, 64, 64), "missing_barrier_reverse_ok": (64, 64, 64),
    "tile_reuse_race": (128, 64, 64), "duplicate_writer": (2, 2, 2), "inplace_stencil_race": (40, 40, 8),
    "cross_simdgroup_no_barrier": (64, 64, 64), "oob_write_tail": (50, 64, 32), "oob_write_before": (20, 20, 20),
    "divergent_barrier": (50, 64, 64), "barrier_in_uneven_loop": (64, 64, 64), "tail_group_reads_past": (50, 64, 64),
    "tg_array_overrun": (64, 64, 64), "cross_group_read_after_write": (64, 128, 32),
    "softmax_max_no_barrier": (64, 64, 64), "simd_publish_no_barrier": (32, 32, 32), "int_div_by_zero": (40, 40, 40), "half_exp_overflow": (64, 1, 1),
}


def _inputs(name: str, n: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    x = torch.randn(max(n, 128), generator=g)
    if name in ("uninit_tg_max", "oob_read_max", "tail_group_reads_past", "tg_array_overrun", "uninit_tg_min"):
        x = -x.abs() - 1.0  # all negative: the true max is below the NaN/0 that a bug would see
    if name == "half_overflow":
        x = torch.full_like(x, 300.0) + torch.rand(x.shape, generator=g)
    if name == "half_exp_overflow":
        x = 200.0 + 100.0 * torch.rand(x.shape, generator=g)  # exp(200/30..300/30) = 780..22026, 64 of them
    return x[:n].contiguous() if name.startswith("oob_read") or name == "tail_group_reads_past" else x


@pytest.fixture(scope="module")
def libs():
    bug = HDR + "\n".join(b.replace("{K}", f"bug_{k}") for k, (b, _) in CASES.items())
    fix = HDR + "\n".join(f.replace("{K}", f"fix_{k}") for k, (_, f) in CASES.items())
    return emu.compile_library(bug), emu.compile_library(fix)


def _run(lib, kind: str, name: str):
    n, threads, group = SHAPES[name]
    x = _inputs(name, n)
    out = torch.zeros(max(n, 8) + 2)
    getattr(lib, f"{kind}_{name}")(out, x, n, threads=threads, group_size=group)
    ref = _reference(name, x, n)
    if name == "inplace_stencil_race":
        got = out[1:1 + n]
    elif name in ("oob_write_before",):
        got = out[:n - 1]
    else:
        got = out[:ref.numel()]
    return got.double(), ref


def test_every_kind_is_covered():
    assert set(CASES) == set(SHAPES) and len(CASES) >= 23


@pytest.mark.parametrize("name", sorted(CASES))
@pytest.mark.parametrize("sched", ["forward", "shuffle"])
def test_bug_is_caught(libs, name, sched):
    """Under program order too: the race detector and the poison runs do not depend on the schedule."""
    with emu.schedule(sched):
        try:
            got, ref = _run(libs[0], "bug", name)
        except emu.EmulatorError:
            return
    assert not torch.allclose(got, ref, rtol=1e-3, atol=1e-3, equal_nan=False), (name, got, ref)


@pytest.mark.parametrize("name", sorted(CASES))
def test_fixed_kernel_passes(libs, name):
    got, ref = _run(libs[1], "fix", name)
    torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3)


def test_race_detector_skips_launches_over_the_shadow_budget(libs, monkeypatch):
    """The shadow takes 16 bytes per buffer byte: above COMFY_METAL_EMU_RACE_MAX_MB the launch runs unchecked
    for races (the poison runs still happen)."""
    from comfy_metal.metal_kernels.emulator import launch

    monkeypatch.setattr(launch, "RACE_MAX_BYTES", 16)
    with emu.schedule("forward"):
        got, ref = _run(libs[0], "bug", "splitk_race")  # no DataRace; in program order the sum is even right
    torch.testing.assert_close(got, ref, rtol=1e-4, atol=1e-4)
    monkeypatch.setattr(launch, "RACE_MAX_BYTES", 2**20)
    with pytest.raises(emu.DataRace):
        _run(libs[0], "bug", "splitk_race")
