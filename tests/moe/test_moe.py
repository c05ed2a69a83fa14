"""MoE kernels (router, per-pair experts GEMM) and the sync-free experts forward: references against
plain loops, the real MSL in the emulator against the references on odd shapes, zero host syncs."""
from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch

from comfy_metal.nodes.common import syncs as sync_count
from comfy_metal.metal_kernels import dispatch, moe
from comfy_metal.metal_kernels.dtypes import DTYPE_OF_MSL
from comfy_metal.metal_kernels.registry import REGISTRY

F = torch.nn.functional


def _loop_experts(x, experts, weights, gate_up, down, activation="silu_glu", gate_up_bias=None, down_bias=None,
                  alpha=1.702, limit=7.0):
    """The textbook loop: every token, every chosen expert, in fp32."""
    x = x.float()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for k in range(experts.shape[1]):
            e = int(experts[t, k])
            h = gate_up[e].float() @ x[t]
            if gate_up_bias is not None:
                h = h + gate_up_bias[e]
            if activation == "silu_glu":
                g, u = h.chunk(2)
                a = F.silu(g) * u
            else:
                g, u = h[::2].clamp(max=limit), h[1::2].clamp(-limit, limit)
                glu = g * torch.sigmoid(alpha * g)
                a = (u + 1) * glu
            y = down[e].float() @ a
            if down_bias is not None:
                y = y + down_bias[e]
            out[t] += weights[t, k].float() * y
    return out


def _bank(E, N, K, gen, scale=0.2):
    return torch.randn(E, N, K, generator=gen) * scale


# ----------------------------------------------------------------------------------- references

def test_route_reference_matches_qwen_and_gpt_oss_conventions():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(9, 13, generator=gen)
    w, e = moe.moe_route(logits, 4, norm=True)
    # Qwen3: softmax over all, top-k, renormalise == GPT-OSS: softmax over the top-k logits
    top_vals, top_idx = torch.topk(logits, 4, dim=-1)
    assert torch.equal(e, top_idx)
    torch.testing.assert_close(w, torch.softmax(top_vals, dim=-1))
    w2, _ = moe.moe_route(logits, 4, norm=False)
    torch.testing.assert_close(w2, torch.softmax(logits, -1).gather(1, top_idx))
    with pytest.raises(ValueError, match="top_k"):
        moe.moe_route(logits, 14)


@pytest.mark.parametrize("T", [1, 3, 29])
@pytest.mark.parametrize("activation", ["silu_glu", "gpt_oss_glu"])
def test_experts_forward_matches_loop(T, activation):
    gen = torch.Generator().manual_seed(T)
    E, H, I, K = 5, 12, 10, 2      # odd sizes: torch._grouped_mm cannot take them, the kernel path runs
    x = torch.randn(T, H, generator=gen)
    gu, dn = _bank(E, 2 * I, H, gen), _bank(E, H, I, gen)
    gb = torch.randn(E, 2 * I, generator=gen) if activation == "gpt_oss_glu" else None
    db = torch.randn(E, H, generator=gen) if activation == "gpt_oss_glu" else None
    w, e = moe.moe_route(torch.randn(T, E, generator=gen), K)
    got = moe.moe_experts_forward(x, e, w, gu, dn, activation=activation, gate_up_bias=gb, down_bias=db)
    want = _loop_experts(x, e, w, gu, dn, activation, gb, db)
    assert (got - want).abs().max().item() < 1e-5


def test_experts_forward_grouped_mm_path_and_unused_experts():
    gen = torch.Generator().manual_seed(3)
    E, H, I, K, T = 9, 32, 16, 2, 40
    x = torch.randn(T, H, generator=gen)
    gu, dn = _bank(E, 2 * I, H, gen), _bank(E, H, I, gen)
    logits = torch.randn(T, E, generator=gen)
    logits[:, 4] = -30  # expert 4 never chosen: an empty group
    w, e = moe.moe_route(logits, K)
    order, sorted_e, offsets = moe.moe_group(e, E)
    assert offsets.dtype == torch.int32 and offsets[-1] == T * K
    assert int(offsets[4] - offsets[3]) == 0
    assert torch.equal(sorted_e, e.reshape(-1)[order])
    got = moe.moe_experts_forward(x, e, w, gu, dn)
    assert (got - _loop_experts(x, e, w, gu, dn)).abs().max().item() < 1e-5
    gotb = moe.moe_experts_forward(x.bfloat16(), e, w, gu.bfloat16(), dn.bfloat16())
    assert gotb.dtype == torch.bfloat16
    assert (gotb.float() - _loop_experts(x, e, w, gu, dn)).abs().max().item() < 0.05


@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
@pytest.mark.parametrize("T", [2, 37])
def test_experts_forward_fp8_banks(fmt, T):
    gen = torch.Generator().manual_seed(5)
    E, H, I, K = 6, 24, 16, 3
    f8 = torch.float8_e4m3fn if fmt == "e4m3fn" else torch.float8_e5m2
    x = torch.randn(T, H, generator=gen)
    gu_q = torch.randn(E, 2 * I, H, generator=gen).to(f8)
    dn_q = torch.randn(E, H, I, generator=gen).to(f8)
    gs, ds = torch.rand(E, generator=gen) * 0.1 + 0.05, torch.rand(E, H, generator=gen) * 0.1 + 0.05
    w, e = moe.moe_route(torch.randn(T, E, generator=gen), K)
    got = moe.moe_experts_forward(x, e, w, gu_q.view(torch.uint8), dn_q.view(torch.uint8), fmt=fmt,
                                  gate_up_scale=gs, down_scale=ds)
    want = _loop_experts(x, e, w, gu_q.float() * gs[:, None, None], dn_q.float() * ds[:, :, None])
    assert (got - want).abs().max().item() < 1e-4
    got2 = moe.moe_experts_forward(x, e, w, gu_q, dn_q, gate_up_scale=gs, down_scale=ds)  # native float8 dtype
    assert (got2 - want).abs().max().item() < 1e-4


@pytest.mark.parametrize("T", [1, 50])
def test_experts_forward_has_no_host_syncs(T):
    gen = torch.Generator().manual_seed(7)
    E, H, I, K = 8, 32, 16, 2
    x = torch.randn(T, H, generator=gen)
    gu, dn = _bank(E, 2 * I, H, gen), _bank(E, H, I, gen)
    logits = x @ torch.randn(H, E, generator=gen)
    with sync_count.SyncCounter() as c:
        w, e = moe.moe_route(logits, K)
        moe.moe_experts_forward(x, e, w, gu, dn)
        moe.moe_experts_forward(x, e, w, gu.to(torch.float8_e4m3fn).view(torch.uint8), dn.to(torch.float8_e4m3fn).view(torch.uint8),
                                fmt="e4m3fn", gate_up_scale=torch.ones(E))
    assert c.total == 0, c.counts


def test_bad_arguments():
    gen = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match="fmt"):
        moe.moe_experts_gemm(torch.randn(2, 4), torch.zeros(2, dtype=torch.long), torch.zeros(3, 5, 4, dtype=torch.uint8))
    with pytest.raises(ValueError, match=r"x must be \[rows, 4\]"):
        moe.moe_experts_gemm(torch.randn(2, 5), torch.zeros(2, dtype=torch.long), torch.randn(3, 5, 4, generator=gen))
    with pytest.raises(ValueError, match="scale"):
        moe.moe_experts_gemm(torch.randn(2, 4), torch.zeros(2, dtype=torch.long), torch.randn(3, 5, 4), torch.ones(4))


# ------------------------------------------------------------------------------------ emulator

class SyncsOutsideEmulator(sync_count.SyncCounter):
    """Host syncs made by our code, not by the emulator's own launch checks (its guard-region scan uses
    nonzero; on Metal there is no emulator)."""

    _EMU = os.sep + os.path.join("metal_kernels", "emulator") + os.sep

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        f = sys._getframe(1)
        while f is not None:
            if self._EMU in f.f_code.co_filename:
                return func(*args, **(kwargs or {}))
            f = f.f_back
        return super().__torch_dispatch__(func, types, args, kwargs)


needs_clang = pytest.mark.skipif(shutil.which("clang-19") is None and shutil.which("clang") is None,
                                 reason="the MSL emulator needs clang-19, which is not installed")


@pytest.fixture(scope="module")
def emu_lib():
    from comfy_metal.metal_kernels import emulator

    if not emulator.available():
        pytest.skip("the MSL emulator needs clang-19, which is not installed")
    return emulator.compile_library(dispatch.library_source("moe.metal"))


@needs_clang
@pytest.mark.parametrize("rows,E,K,dtype,norm", [(1, 1, 1, torch.float32, True), (3, 5, 2, torch.float32, True),
                                                 (7, 33, 3, torch.float16, False), (2, 129, 8, torch.bfloat16, True),
                                                 (5, 60, 6, torch.float32, False)])
def test_route_kernel_in_emulator(emu_lib, rows, E, K, dtype, norm):
    gen = torch.Generator().manual_seed(rows * 100 + E)
    x = torch.stack([torch.randperm(E, generator=gen).float() * 0.37 - 3 for _ in range(rows)]).to(dtype)
    got = moe.moe_route_metal(emu_lib, x, K, norm=norm)
    want = moe.moe_route_reference(x, K, norm=norm)
    assert moe._route_compare(got, want) is None
    assert got[1].dtype == torch.int64 and got[0].dtype == torch.float32


@needs_clang
@pytest.mark.parametrize("E,N,K,P,x_div,wkind,xdt,scale,bias", [
    (1, 1, 1, 1, 1, "float", torch.float32, None, False),
    (5, 7, 33, 9, 3, "float", torch.float32, "expert", True),
    (3, 13, 40, 11, 1, "bfloat", torch.bfloat16, None, False),
    (7, 9, 65, 4, 2, "e4m3fn", torch.float32, "row", True),
    (2, 5, 31, 19, 1, "e5m2", torch.float16, "scalar", False),
    (4, 17, 20, 6, 1, "half", torch.float32, "expert", True),
    (3, 5, 300, 10, 2, "bfloat", torch.float32, "row", False),     # 2 full 128-wide steps + a 44 tail
    (6, 3, 256, 3, 1, "e4m3fn", torch.bfloat16, "expert", True),   # exactly 2 steps, no tail
])
def test_experts_gemm_kernel_in_emulator(emu_lib, E, N, K, P, x_div, wkind, xdt, scale, bias):
    gen = torch.Generator().manual_seed(E * 1000 + N * 10 + K)
    src = torch.randn(E, N, K, generator=gen)
    fmt = None
    if wkind in ("e4m3fn", "e5m2"):
        fmt = wkind
        w = src.to(torch.float8_e4m3fn if fmt == "e4m3fn" else torch.float8_e5m2).view(torch.uint8)
    else:
        w = (src * 0.3).to(DTYPE_OF_MSL[wkind])
    x = torch.randn(P // x_div, K, generator=gen).to(xdt)
    row_e = torch.randint(0, E, (P,), generator=gen)
    s = {None: None, "scalar": torch.tensor(0.75), "expert": torch.rand(E, generator=gen) + 0.5,
         "row": torch.rand(E, N, generator=gen) + 0.5}[scale]
    b = torch.randn(E, N, generator=gen) if bias else None
    got = moe.moe_experts_gemm_metal(emu_lib, x, row_e, w, s, b, x_div=x_div, fmt=fmt)
    want = moe.moe_experts_gemm_reference(x, row_e, w, s, b, x_div=x_div, fmt=fmt)
    assert got.shape == want.shape == (P, N)
    assert (got - want).abs().max().item() <= 1e-4 * (1 + want.abs().max().item())


@needs_clang
@pytest.mark.parametrize("E,N,K,counts,wkind,xdt,scale,bias", [
    (1, 1, 1, [1], "float", torch.float32, None, False),
    (3, 33, 40, [5, 0, 37], "float", torch.float32, "expert", True),
    (4, 7, 65, [1, 2, 3, 70], "e4m3fn", torch.bfloat16, "row", False),
    (2, 40, 31, [33, 31], "bfloat", torch.float16, None, True),
    (5, 17, 100, [0, 9, 0, 64, 2], "e5m2", torch.float32, "scalar", True),
    (3, 5, 16, [0, 0, 0], "half", torch.float32, None, False),
    # the 16-bit staging: bf16 / fp16 banks copied as they are, FP8 decoded into bf16 / fp16; two column tiles
    # (the second with simdgroups wholly past N), 16-byte K steps with and without an element-wise tail
    (3, 150, 96, [40, 0, 9], "bfloat", torch.bfloat16, "row", True),
    (2, 130, 48, [33, 7], "half", torch.float16, "expert", False),
    (2, 64, 80, [3, 31], "e5m2", torch.float16, None, True),
    (2, 129, 64, [32, 1], "e4m3fn", torch.bfloat16, "row", True),
])
def test_grouped_gemm_kernel_in_emulator(emu_lib, E, N, K, counts, wkind, xdt, scale, bias):
    gen = torch.Generator().manual_seed(E * 100 + N + K)
    src = torch.randn(E, N, K, generator=gen)
    fmt = None
    if wkind in ("e4m3fn", "e5m2"):
        fmt = wkind
        w = src.to(torch.float8_e4m3fn if fmt == "e4m3fn" else torch.float8_e5m2).view(torch.uint8)
    else:
        w = (src * 0.3).to(DTYPE_OF_MSL[wkind])
    P = sum(counts)
    xs = torch.randn(P, K, generator=gen).to(xdt)
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    s = {None: None, "scalar": torch.tensor(0.75), "expert": torch.rand(E, generator=gen) + 0.5,
         "row": torch.rand(E, N, generator=gen) + 0.5}[scale]
    b = torch.randn(E, N, generator=gen) if bias else None
    got = moe.moe_grouped_gemm_metal(emu_lib, xs, offsets, w, s, b, fmt=fmt)
    want = moe.moe_grouped_gemm_reference(xs, offsets, w, s, b, fmt=fmt)
    assert got.shape == want.shape == (P, N)
    if P:
        assert (got - want).abs().max().item() <= 1e-4 * (1 + want.abs().max().item())


@needs_clang
@pytest.mark.parametrize("K", [3, 16, 512])
@pytest.mark.parametrize("fmt", ["e4m3fn", "e5m2"])
def test_fp8_banks_decode_every_code_exactly_in_emulator(emu_lib, fmt, K):
    """All 256 byte codes as weights, x one-hot: both kernels output each code's value exactly (fp8.h's
    decode through half bits): subnormals, max finite, e5m2 infinities and NaNs, the grouped GEMM with x in fp32,
    bf16 and fp16 (weights staged in fp32, bf16 and fp16). K = 3 takes the element-wise kernels, K = 16 the
    expert GEMV's 8-byte loads, K = 512 the grouped GEMM's 16-byte staging and the expert GEMV's 16-byte loads
    (the code inside a chunk, not at its start)."""
    codes = torch.arange(256, dtype=torch.uint8)
    w = torch.zeros(1, 256, K, dtype=torch.uint8)
    w[0, :, K // 3] = codes
    x = torch.zeros(2, K)
    x[:, K // 3] = 1.0
    want = codes.view(torch.float8_e4m3fn if fmt == "e4m3fn" else torch.float8_e5m2).float()
    one = torch.tensor([2], dtype=torch.int32)
    for got in (moe.moe_experts_gemm_metal(emu_lib, x, torch.zeros(2, dtype=torch.int64), w, fmt=fmt),
                moe.moe_grouped_gemm_metal(emu_lib, x, one, w, fmt=fmt),            # staged in fp32
                moe.moe_grouped_gemm_metal(emu_lib, x.bfloat16(), one, w, fmt=fmt),  # in bf16
                moe.moe_grouped_gemm_metal(emu_lib, x.half(), one, w, fmt=fmt)):     # in fp16
        for row in got:
            assert torch.equal(row.isnan(), want.isnan())
            finite = ~want.isnan()
            assert torch.equal(row[finite], want[finite]), (row[finite] - want[finite]).abs().max()


@needs_clang
@pytest.mark.parametrize("T", [1, 23])
def test_experts_forward_through_dispatch_in_emulator(emulator_backend, T):
    """The whole layer with COMFY_METAL_BACKEND=emulator: self-checks pass, the kernels run (decode
    path and the grouped path over sorted pairs), the result matches the loop."""
    gen = torch.Generator().manual_seed(11 + T)
    E, H, I, K = 5, 24, 8, 3
    x = torch.randn(T, H, generator=gen)
    gu_q = torch.randn(E, 2 * I, H, generator=gen).to(torch.float8_e4m3fn)
    dn = _bank(E, H, I, gen)
    gs = torch.rand(E, generator=gen) * 0.1 + 0.05
    w, e = moe.moe_route(torch.randn(T, E, generator=gen), K)
    assert dispatch.last_backend["moe_route"] == "emulator"
    moe.moe_experts_forward(x, e, w, gu_q.view(torch.uint8), dn, fmt="e4m3fn", gate_up_scale=gs)  # self-checks
    with SyncsOutsideEmulator() as c:
        got = moe.moe_experts_forward(x, e, w, gu_q.view(torch.uint8), dn, fmt="e4m3fn", gate_up_scale=gs)
    assert c.total == 0, c.counts
    assert dispatch.last_backend["moe_experts_gemm" if T == 1 else "moe_grouped_gemm"] == "emulator"
    want = _loop_experts(x, e, w, gu_q.float() * gs[:, None, None], dn)
    assert (got - want).abs().max().item() < 1e-4


@needs_clang
def test_self_checks_pass_in_emulator(emulator_backend):
    for name in ("moe_route", "moe_experts_gemm", "moe_grouped_gemm"):
        backend, reason = dispatch.choose(REGISTRY[name], torch.device("cpu"))
        assert backend == "emulator", reason


# ------------------------------------------------------------------------- tail paths of the kernels

def _fp8_bank(E, N, K, fmt, gen):
    f8 = torch.float8_e4m3fn if fmt == "e4m3fn" else torch.float8_e5m2
    return torch.randn(E, N, K, generator=gen).to(f8).view(torch.uint8)


def _close(got, want):
    assert got.shape == want.shape
    assert (got - want).abs().max().item() <= 1e-4 * (1 + want.abs().max().item())


@needs_clang
def test_grouped_gemm_finds_tiles_over_several_passes_of_experts(emu_lib):
    """More experts than the 128 threads that search the tile table in one pass (300: three passes), most
    of them empty, the used ones of 1 to 40 rows; the 16-byte path with a K tail (K = 48) and N over two
    column tiles."""
    gen = torch.Generator().manual_seed(21)
    E, N, K = 300, 150, 48
    counts = torch.zeros(E, dtype=torch.int64)
    used = torch.tensor([0, 1, 127, 128, 129, 200, 255, 256, 299])
    counts[used] = torch.tensor([3, 1, 40, 2, 33, 1, 7, 32, 5])
    offsets = torch.cumsum(counts, 0).to(torch.int32)
    w = _fp8_bank(E, N, K, "e4m3fn", gen)
    xs = torch.randn(int(counts.sum()), K, generator=gen).to(torch.bfloat16)
    scale = torch.rand(E, N, generator=gen) + 0.5
    got = moe.moe_grouped_gemm_metal(emu_lib, xs, offsets, w, scale, fmt="e4m3fn")
    _close(got, moe.moe_grouped_gemm_reference(xs, offsets, w, scale, fmt="e4m3fn"))


def test_grouped_gemm_stages_in_16_bits_only_where_that_is_exact():
    """bf16 x with bf16 or FP8 weights is staged in bf16, fp16 x with fp16 or FP8 weights in fp16 (e4m3fn / 256,
    e5m2 and both 16-bit types hold each other's values only where the types agree); everything else in fp32."""
    want = {("bfloat", "bfloat"): "bfloat", ("e4m3", "bfloat"): "bfloat", ("e5m2", "bfloat"): "bfloat",
            ("half", "half"): "half", ("e4m3", "half"): "half", ("e5m2", "half"): "half"}
    for w in moe.WEIGHT_ELEMENTS:
        for x in ("float", "half", "bfloat"):
            assert moe.grouped_staging(w, x) == f"moe_stage_{want.get((w, x), 'float')}", (w, x)


@needs_clang
@pytest.mark.parametrize("xdt,staged_bytes,sixteen_bit", [(torch.bfloat16, 2, True), (torch.float16, 2, True),
                                                          (torch.float32, 4, False)])
def test_grouped_gemm_profile_counts(emu_lib, xdt, staged_bytes, sixteen_bit):
    """The grouped GEMM's exact counts in the emulator's profiler (every threadgroup run): the products skip the
    x fragments past a tile's rows and the simdgroups past N, run on 16-bit fragments where x is bf16 / fp16
    (FP8 weights), and the staged K step (x in padded 8x8 blocks, the weights in 8x8 blocks) leaves room for
    6 threadgroups (24 simdgroups) a core on M4 Max when it is 16-bit."""
    from comfy_metal.metal_kernels.perf import roofline
    from comfy_metal.metal_kernels.perf.chips import chip
    from comfy_metal.metal_kernels.perf.run import ProfilingLibrary

    gen = torch.Generator().manual_seed(5)
    counts, N, K = [32, 9], 200, 64          # tiles of 32 and 9 rows; column tiles of 128 and 72 (3 simdgroups)
    w = _fp8_bank(2, N, K, "e4m3fn", gen)
    xs = torch.randn(sum(counts), K, generator=gen).to(xdt)
    offsets = torch.cumsum(torch.tensor(counts), 0).to(torch.int32)
    proxy = ProfilingLibrary(emu_lib, sample=None)
    moe.moe_grouped_gemm_metal(proxy, xs, offsets, w, fmt="e4m3fn")
    (p,) = proxy.profiles
    # K steps x 8-wide K blocks x (x fragments: 4 + 2) x (busy simdgroups: 4 + 3) x 4 weight fragments
    mma = (K // moe.GEMM_BK) * (moe.GEMM_BK // 8) * (4 + 2) * (4 + 3) * 4
    assert p.mma == mma
    assert p.mma16 == (mma if sixteen_bit else 0)
    blocks = (moe.GEMM_BK // 8) * (moe.GEMM_BM // 8)
    pad = 8 // staged_bytes                  # an x block's pad: 8 bytes
    assert p.threadgroup_bytes == (blocks * (64 + pad) + moe.GEMM_BN * moe.GEMM_BK) * staged_bytes + 4 * (4 + 3)
    assert roofline.occupancy(p, chip("M4 Max")) == (6 if sixteen_bit else 3)


@needs_clang
@pytest.mark.parametrize("kernel", ["pairs", "grouped"])
def test_unaligned_banks_and_rows_take_the_elementwise_kernels(emu_lib, kernel):
    """A bank memory-mapped at an odd byte offset and activation rows at an odd element offset (K a
    multiple of 16, so only the alignment rules the 16-byte kernels out): same results as aligned data."""
    gen = torch.Generator().manual_seed(22)
    E, N, K, P = 3, 9, 64, 6
    store = torch.randint(0, 256, (E * N * K + 1,), generator=gen, dtype=torch.uint8) & 0xBF
    w = store[1:].view(E, N, K)
    assert w.data_ptr() % 16
    xstore = torch.randn(P * K + 1, generator=gen).half()
    x = xstore[1:].view(P, K)
    experts = torch.tensor([2, 0, 0, 1, 1, 1])
    if kernel == "pairs":
        got = moe.moe_experts_gemm_metal(emu_lib, x, experts, w, fmt="e5m2")
        want = moe.moe_experts_gemm_reference(x, experts, w, fmt="e5m2")
        aligned = moe.moe_experts_gemm_metal(emu_lib, x.clone(), experts, w.clone(), fmt="e5m2")
    else:
        offsets = torch.tensor([2, 5, 6], dtype=torch.int32)
        got = moe.moe_grouped_gemm_metal(emu_lib, x, offsets, w, fmt="e5m2")
        want = moe.moe_grouped_gemm_reference(x, offsets, w, fmt="e5m2")
        aligned = moe.moe_grouped_gemm_metal(emu_lib, x.clone(), offsets, w.clone(), fmt="e5m2")
    _close(got, want)
    torch.testing.assert_close(got, aligned, atol=1e-5, rtol=1e-5)


@needs_clang
@pytest.mark.parametrize("rows,E,K", [(3, 1000, 32), (2, 64, 1), (5, 33, 32), (4, 31, 31)])
def test_route_kernel_lane_slots_and_top_k_limits(emu_lib, rows, E, K):
    """Every expert a lane holds up to 32 (E = 1000), a pick per lane up to 32, E one past a lane slot."""
    gen = torch.Generator().manual_seed(rows + E + K)
    x = torch.stack([torch.randperm(E, generator=gen).float() * 0.01 - 2 for _ in range(rows)])
    assert moe._route_compare(moe.moe_route_metal(emu_lib, x, K), moe.moe_route_reference(x, K)) is None


def test_grouped_linear_times_the_kernel_against_the_platform_path(monkeypatch):
    """On MPS moe_grouped_linear asks measured_choice between the platform path (listed first: it wins ties)
    and the grouped kernel, and runs the platform path when that was faster."""
    gen = torch.Generator().manual_seed(23)
    E, N, K = 4, 16, 32
    w = _bank(E, N, K, gen)
    e = torch.randint(0, E, (10, 2), generator=gen)
    order, sorted_e, offsets = moe.moe_group(e, E)
    xs = torch.randn(20, K, generator=gen)[order // 2]
    asked = []

    def fake_choice(kernel, shape_class, candidates, device, **kw):
        asked.append((kernel, shape_class, list(candidates)))
        return "platform"
    monkeypatch.setattr(dispatch, "choose", lambda spec, device: ("metal", "test"))
    monkeypatch.setattr(dispatch, "measuring_enabled", lambda device: True)
    monkeypatch.setattr(dispatch, "measured_choice", fake_choice)
    got = moe.moe_grouped_linear(xs, sorted_e, offsets, w)
    assert asked == [("moe_grouped_gemm", ("linear", "torch.float32", (E, N, K), "torch.float32", 32),
                      ["platform", "metal"])]
    _close(got.float(), moe.moe_grouped_gemm_reference(xs, offsets, w))


def test_expert_gemv_load_layout_keeps_the_lanes_busy():
    """FP8 rows of 768 bytes (Qwen3-30B-A3B's down projection) take 8-byte loads (96 chunks: three whole lane
    steps, not 1.5 of 16-byte chunks); 2048-byte rows and 16-bit rows keep 16-byte loads; unaligned banks and
    x rows not of whole 16-byte pieces go element by element."""
    assert moe.pair_layout(768, 1, 2, True) == "_vec8"
    assert moe.pair_layout(24, 1, 2, True) == "_vec8"
    assert moe.pair_layout(2048, 1, 2, True) == ""
    assert moe.pair_layout(768, 2, 2, True) == ""
    assert moe.pair_layout(768, 1, 2, False) == "_scalar"
    assert moe.pair_layout(20, 1, 2, True) == "_scalar"
