"""Flash attention (attention.metal / attention.py): the pure-torch reference and the Metal kernel
(in the MSL emulator, through the real launch glue) against float64 attention, at odd lengths,
lengths that are not a multiple of the tile, every head dim ComfyUI's models use, cross-attention,
bool/additive masks of every rank with broadcast dimensions, GQA and fully masked rows."""
from __future__ import annotations

import math

import pytest
import torch

from comfy_metal.metal_kernels import attention as A
from comfy_metal.metal_kernels import dispatch

DTYPES = (torch.float32, torch.float16, torch.bfloat16)
LOW_PRECISION_REL = 2e-3        # the bar: relative to fp32 attention for fp16/bf16 inputs
FP32_REL = 2e-5


def oracle(q, k, v, mask=None, scale=None):
    """float64 attention of the (already rounded) inputs; fully masked rows -> 0."""
    q, k, v = q.double(), k.double(), v.double()
    G = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(G, 1), v.repeat_interleave(G, 1)
    s = q @ k.transpose(-1, -2) * (1 / math.sqrt(q.shape[-1]) if scale is None else scale)
    if mask is not None:
        mask = mask[:, None] if mask.dim() == 3 else mask       # ComfyUI: a 3-D mask is (batch, Lq, Lk)
        s = s.masked_fill(~mask, float("-inf")) if mask.dtype == torch.bool else s + mask.double()
    dead = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.softmax(s.masked_fill(dead, 0.0), -1).masked_fill(dead, 0.0)
    return p @ v


def rel_err(got, want):
    """Normwise relative error ||got - want|| / ||want|| (Frobenius)."""
    return ((got.double() - want).norm() / want.norm().clamp_min(1e-30)).item()


def assert_matches(got, want, dtype):
    """Normwise relative error <= 2e-3 for fp16/bf16 (2e-5 for fp32), and no element off by more than
    one unit in the last place of the output dtype at the output's largest magnitude (a bf16 output's
    own rounding is up to 2^-8 relative per element, so an elementwise 2e-3 could not hold)."""
    assert not torch.isnan(got).any(), "NaN in the output"
    bound = FP32_REL if dtype == torch.float32 else LOW_PRECISION_REL
    err = rel_err(got, want)
    assert err <= bound, f"normwise relative error {err:.3g} > {bound} ({dtype})"
    worst = ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()
    ulp = {torch.float32: 1e-5, torch.float16: 2.0 ** -10, torch.bfloat16: 2.0 ** -7}[dtype]
    assert worst <= ulp, f"max elementwise error {worst:.3g} of the largest output > {ulp:.3g} ({dtype})"


def make(B, Hq, Hk, Lq, Lk, D, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Lq, D, generator=gen).to(dtype)
    k = torch.randn(B, Hk, Lk, D, generator=gen).to(dtype)
    v = torch.randn(B, Hk, Lk, D, generator=gen).to(dtype)
    return q, k, v


def make_mask(kind, B, H, Lq, Lk, dtype, seed=1):
    """Mask forms ComfyUI's models pass; row 0 of query 1 is fully masked where the form allows it."""
    gen = torch.Generator().manual_seed(seed)
    shape = {"2d": (Lq, Lk), "3d": (B, Lq, Lk), "3d1": (1, Lq, Lk), "4d": (B, H, Lq, Lk),
             "4d_heads": (1, H, Lq, Lk), "4d_keys": (B, 1, 1, Lk)}[kind[:-5] if kind.endswith("_bool") else kind]
    if kind.endswith("_bool"):
        m = torch.rand(shape, generator=gen) > 0.3
        if shape[-2] > 1:
            m[..., 1, :] = False
        return m
    m = (torch.randn(shape, generator=gen) * 2).to(dtype)
    if shape[-2] > 1:
        m[..., 1, :] = float("-inf")
    m[..., 0] = float("-inf")
    return m


MASK_KINDS = ("2d", "3d", "3d1", "4d", "4d_heads", "4d_keys", "2d_bool", "3d_bool", "4d_bool", "4d_keys_bool")


# ------------------------------------------------------------------ the reference (no emulator)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("mask_kind", (None,) + MASK_KINDS)
def test_reference_against_float64(dtype, mask_kind):
    B, Hq, Hk, Lq, Lk, D = 2, 4, 2, 23, 41, 40
    q, k, v = make(B, Hq, Hk, Lq, Lk, D, dtype)
    mask = None if mask_kind is None else make_mask(mask_kind, B, Hq, Lq, Lk, dtype)
    got = A.flash_attention_reference(q, k, v, mask=mask)
    assert got.dtype == dtype and got.shape == q.shape
    assert_matches(got, oracle(q, k, v, mask), dtype)


def test_reference_is_chunked_over_queries(monkeypatch):
    """With a tiny chunk budget every query row is its own chunk; the result must not change."""
    q, k, v = make(1, 2, 2, 37, 29, 64, torch.float32)
    mask = make_mask("4d_bool", 1, 2, 37, 29, torch.float32)
    whole = A.flash_attention_reference(q, k, v, mask=mask)
    monkeypatch.setattr(A, "REFERENCE_CHUNK_BYTES", 1)
    chunked = A.flash_attention_reference(q, k, v, mask=mask)
    torch.testing.assert_close(chunked, whole, atol=1e-6, rtol=1e-6)   # BLAS blocking differs by chunk
    assert_matches(chunked, oracle(q, k, v, mask), torch.float32)


def test_reference_fully_masked_row_is_zero_and_scale_is_used():
    q, k, v = make(1, 1, 1, 4, 9, 8, torch.float32)
    mask = torch.ones(4, 9, dtype=torch.bool)
    mask[2] = False
    out = A.flash_attention_reference(q, k, v, mask=mask, scale=0.3)
    assert torch.equal(out[0, 0, 2], torch.zeros(8))
    assert_matches(out, oracle(q, k, v, mask, scale=0.3), torch.float32)


@pytest.mark.parametrize("bad, message", [
    (lambda q, k, v: (q[0], k, v, None), "must be 4-D"),
    (lambda q, k, v: (q, k.half(), v, None), "share one dtype"),
    (lambda q, k, v: (q.int(), k.int(), v.int(), None), "not supported"),
    (lambda q, k, v: (q, k[:, :, :, :4], v[:, :, :, :4], None), "must both be"),
    (lambda q, k, v: (torch.cat([q, q[:, :1]], 1), k, v, None), "multiple of k/v heads"),
    (lambda q, k, v: (q, k, v, torch.zeros(5, 7)), "does not broadcast"),
    (lambda q, k, v: (q, k, v, torch.zeros(3, dtype=torch.int64)), "bool or floating point"),
])
def test_bad_input_is_a_clear_error(bad, message):
    q, k, v = make(1, 2, 2, 6, 9, 8, torch.float32)
    args = bad(q, k, v)
    with pytest.raises((TypeError, ValueError), match=message):
        A.flash_attention_reference(*args[:3], mask=args[3])


# ------------------------------------------------------------------ the Metal kernel in the emulator
@pytest.fixture(scope="module")
def lib():
    from comfy_metal.metal_kernels import emulator

    if not emulator.available():
        pytest.skip("clang-19 not found: the MSL emulator cannot run")
    return dispatch.compile_library("emulator", only="attention.metal")


VARIANTS = ("simd", "mma")


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("D", A.ATTENTION_HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_every_head_dim(lib, D, dtype, variant):
    # mma: 37 rows = a 32-row group + 5; 45 keys = one partial key block (of 16 to 128 keys by D and dtype);
    # simd: 19 rows = pairs of two threadgroups (8 rows each) and a partial one
    lq = 19 if variant == "simd" else 37
    q, k, v = make(1, 2, 2, lq, 45 if D < 160 else 53, D, dtype, seed=D)
    got = A.flash_attention_metal(lib, q, k, v, variant=variant)
    assert got.dtype == dtype and got.shape == q.shape
    assert_matches(got, oracle(q, k, v), dtype)


@pytest.mark.parametrize("D", A.ATTENTION_HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_mma_kernel_full_key_blocks_and_a_tail(lib, D, dtype):
    """300 keys = full key blocks and a partial one whatever the block (128, 64, 32 or 16 keys); 70 query
    rows = two full query blocks and a partial one."""
    q, k, v = make(1, 1, 1, 70, 300, D, dtype, seed=D + 1)
    got = A.flash_attention_metal(lib, q, k, v, variant="mma")
    assert_matches(got, oracle(q, k, v), dtype)


@pytest.mark.parametrize("D, bucket", [(8, 40), (48, 64), (104, 128), (200, 256)])
def test_mma_kernel_zero_pads_other_head_dims(lib, D, bucket):
    """A multiple of 8 without its own instantiation runs in the next one up (columns past D are zeros)."""
    assert A.mma_bucket(D) == bucket
    q, k, v = make(1, 2, 1, 41, 70, D, torch.float16, seed=D)
    mask = make_mask("4d_keys_bool", 1, 2, 41, 70, torch.float16)
    assert_matches(A.flash_attention_metal(lib, q, k, v, mask=mask, variant="mma"), oracle(q, k, v, mask),
                   torch.float16)


@pytest.mark.parametrize("D", (1, 12, 33, 36, 100, 255))
def test_vector_kernel_any_head_dim(lib, D):
    """Head dims that are not a multiple of 8 run in the vector kernel at any Lq ("auto" picks it)."""
    q, k, v = make(1, 2, 2, 11, 29, D, torch.float16, seed=D)
    assert_matches(A.flash_attention_metal(lib, q, k, v), oracle(q, k, v), torch.float16)


@pytest.mark.parametrize("Lk, splits", [(300, 1), (1000, 3), (2049, 8)])
def test_vector_kernel_splits_long_key_ranges(lib, monkeypatch, Lk, splits):
    """A small decode grid splits the keys over more threadgroups (VEC_MIN_SPLIT_KEYS each at least); the
    merge kernel combines the splits: splits that see masked keys only, and a fully masked row (0)."""
    monkeypatch.setattr(A, "VEC_MIN_SPLIT_KEYS", 256)
    launched = []

    class Spy:
        def __getattr__(self, name):
            kernel = getattr(lib, name)

            def run(*args, **kw):
                launched.append((name, list(args[5]) if name.startswith("attention_vec") and "merge" not in name
                                 else None))
                return kernel(*args, **kw)
            return run

    q, k, v = make(1, 2, 1, 2, Lk, 64, torch.float16, seed=Lk)
    mask = make_mask("4d_bool", 1, 2, 2, Lk, torch.float16)
    mask[0, 0, 0, :Lk // 2] = False              # the first splits of one row see masked keys only
    got = A.flash_attention_metal(Spy(), q, k, v, mask=mask)
    assert_matches(got, oracle(q, k, v, mask), torch.float16)
    assert torch.equal(got[:, :, 1], torch.zeros_like(got[:, :, 1]))
    vec = [p for name, p in launched if p is not None]
    assert vec[0][A.ATTENTION_PARAMS.fields.index("splits")] == splits
    assert any("merge" in name for name, _ in launched) == (splits > 1)


@pytest.mark.parametrize("Hq, Hk, Lq", [(4, 1, 1), (8, 2, 3), (3, 3, 8), (6, 1, 2)])
def test_vector_kernel_decode_with_gqa(lib, Hq, Hk, Lq):
    """Decode shapes: the (head, query row) pairs of one k/v head share a threadgroup, 8 at a time (6 heads x
    2 rows: a full threadgroup and a partial one); an additive mask with a fully masked row."""
    q, k, v = make(2, Hq, Hk, Lq, 75, 128, torch.float16, seed=Hq + Lq)
    mask = make_mask("4d", 2, Hq, Lq, 75, torch.float16)
    got = A.flash_attention_metal(lib, q, k, v, mask=mask)
    assert_matches(got, oracle(q, k, v, mask), torch.float16)
    if Lq > 1:
        assert torch.equal(got[:, :, 1], torch.zeros_like(got[:, :, 1]))


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("mask_kind", MASK_KINDS)
def test_kernel_masks(lib, mask_kind, variant):
    B, H, Lq, Lk, D = 2, 3, 18, 75, 64
    q, k, v = make(B, H, H, Lq, Lk, D, torch.float16, seed=7)
    mask = make_mask(mask_kind, B, H, Lq, Lk, torch.float16)
    got = A.flash_attention_metal(lib, q, k, v, mask=mask, variant=variant)
    want = oracle(q, k, v, mask)
    assert_matches(got, want, torch.float16)
    if mask.shape[-2] > 1:                     # query row 1 is fully masked: zeros, not NaN
        assert torch.equal(got[:, :, 1], torch.zeros_like(got[:, :, 1]))


@pytest.mark.parametrize("variant", VARIANTS + ("auto",))
@pytest.mark.parametrize("Lq, Lk", [(1, 1), (5, 77), (77, 5), (33, 512), (16, 32), (31, 95), (70, 130)])
def test_kernel_cross_attention_and_odd_lengths(lib, Lq, Lk, variant):
    q, k, v = make(1, 2, 2, Lq, Lk, 128, torch.bfloat16, seed=Lq + Lk)
    got = A.flash_attention_metal(lib, q, k, v, variant=variant)
    assert_matches(got, oracle(q, k, v), torch.bfloat16)


@pytest.mark.parametrize("variant", VARIANTS)
@pytest.mark.parametrize("Hq, Hk", [(4, 1), (6, 2), (8, 4)])
def test_kernel_gqa(lib, Hq, Hk, variant):
    q, k, v = make(2, Hq, Hk, 9, 40, 80, torch.float32, seed=Hq * 10 + Hk)
    mask = make_mask("4d_heads", 2, Hq, 9, 40, torch.float32)
    got = A.flash_attention_metal(lib, q, k, v, mask=mask, variant=variant)
    assert_matches(got, oracle(q, k, v, mask), torch.float32)


def test_variant_choice_and_errors(lib, monkeypatch):
    """auto: the simdgroup-matrix kernel above VEC_MAX_QUERIES rows when D % 8 == 0, else the vector one."""
    launched = []
    real = A.flash_attention_metal

    class Spy:
        def __getattr__(self, name):
            launched.append(name)
            return getattr(lib, name)

    q, k, v = make(1, 1, 1, A.VEC_MAX_QUERIES + 1, 9, 64, torch.float16)
    real(Spy(), q, k, v)
    real(Spy(), q[:, :, :A.VEC_MAX_QUERIES], k, v)
    q2, k2, v2 = make(1, 1, 1, 40, 9, 36, torch.float16)
    real(Spy(), q2, k2, v2)
    q3, k3, v3 = make(1, 1, 1, 40, 9, 48, torch.bfloat16)
    real(Spy(), q3, k3, v3)
    assert launched == ["attention_mma64_half", "attention_vec2_half", "attention_vec2_half",
                        "attention_mma64_bfloat"]
    with pytest.raises(ValueError, match="multiple of 8"):
        real(lib, q2, k2, v2, variant="mma")
    with pytest.raises(ValueError, match="variant must be one of"):
        A.flash_attention_reference(q, k, v, variant="fast")


def test_kernel_scale_and_large_scores(lib):
    """Scores far outside exp's range (the online max must rescale, not overflow)."""
    q, k, v = make(1, 1, 1, 7, 70, 96, torch.float32)
    q = q * 30
    got = A.flash_attention_metal(lib, q, k, v, scale=0.5)
    assert_matches(got, oracle(q, k, v, scale=0.5), torch.float32)


def test_kernel_noncontiguous_inputs(lib):
    """ComfyUI passes transposed views ((B, L, H, D) -> (B, H, L, D)): the launcher makes them contiguous."""
    base = torch.randn(1, 21, 2, 64).half()
    q = base.transpose(1, 2)
    k = torch.randn(1, 30, 2, 64).half().transpose(1, 2)
    v = torch.randn(1, 30, 2, 64).half().transpose(1, 2)
    assert_matches(A.flash_attention_metal(lib, q, k, v), oracle(q, k, v), torch.float16)


def test_public_function_runs_the_kernel_in_the_emulator(emulator_backend):
    q, k, v = make(1, 2, 2, 11, 20, 40, torch.float16)
    out = A.flash_attention(q, k, v)
    assert dispatch.last_backend["flash_attention"] == "emulator"
    assert_matches(out, oracle(q, k, v), torch.float16)


@pytest.mark.parametrize("variant", VARIANTS)
def test_kernel_launched_in_chunks_of_groups(lib, monkeypatch, variant):
    """The host launches the logical grid in chunks (group_base): one threadgroup per launch here."""
    monkeypatch.setattr(A, "MAX_LAUNCH_GROUPS", 1)
    q, k, v = make(2, 2, 1, 35, 21, 40, torch.float16, seed=5)
    got = A.flash_attention_metal(lib, q, k, v, variant=variant)
    assert_matches(got, oracle(q, k, v), torch.float16)


def params(L, D, H, group_base, q_blocks):
    return A.ATTENTION_PARAMS.pack(Lq=L, Lk=L, D=D, Hq=H, Hk=H, has_mask=0, mask_sb=0, mask_sh=0, mask_sq=0,
                                   mask_sk=0, group_base=group_base, q_blocks=q_blocks, splits=1, split_keys=L,
                                   pairs=H * L)


def test_emulator_window_binds_a_byte_range(lib):
    """The emulator's `windows` option: only the window is bound, at the tensor's own address."""
    q, k, v = make(1, 3, 3, 16, 16, 64, torch.float32, seed=9)
    out = torch.full_like(q, 7.0)
    per_head = 16 * 64 * 4
    win = (2 * per_head, 3 * per_head)                      # head 2 only
    kernel = lib.attention_mma64_float
    kernel(q, k, v, torch.zeros(1), out, params(16, 64, 3, 2, 1), A.LOG2E / 8,
           threads=128, group_size=128, windows={0: win, 1: win, 2: win, 4: win})
    want = oracle(q, k, v)
    assert_matches(out[:, 2:], want[:, 2:], torch.float32)
    assert torch.all(out[:, :2] == 7.0)                   # outside the window: untouched
    with pytest.raises(ValueError, match="outside"):
        kernel(q, k, v, torch.zeros(1), out, params(16, 64, 3, 2, 1), 0.1,
               threads=128, group_size=128, windows={0: (0, 10 ** 9)})


@pytest.mark.parametrize("kernel", ["attention_vec2_half", "attention_mma64_half"])
def test_kernel_offsets_past_2_to_the_31(lib, kernel):
    """64-bit base offsets: q, k, v and out hold a little over 2^31 fp16 elements each (4 GiB of virtual
    memory that is never touched); only the last threadgroup runs, over windows at the end, so every offset
    it uses is >= 2^31 elements (2^32 bytes). A 32-bit offset would wrap to the start."""
    D, L = 64, (A.VEC_ROWS if kernel.startswith("attention_vec") else A.QUERY_BLOCK)
    H = (1 << 31) // (L * D) + 3
    per_head = L * D
    try:
        q, k, v, out = (torch.empty(H * per_head, dtype=torch.float16) for _ in range(4))
    except RuntimeError as e:               # an allocator that refuses 4 GiB of address space
        pytest.skip(f"cannot reserve 4 GiB of virtual memory: {e}")
    first = (H - 1) * per_head
    assert first >= 1 << 31
    small_q, small_k, small_v = make(1, 1, 1, L, L, D, torch.float16, seed=31)
    q[first:] = small_q.flatten()
    k[first:] = small_k.flatten()
    v[first:] = small_v.flatten()
    out[first:] = float("nan")
    win = (first * 2, H * per_head * 2)
    shape = (1, H, L, D)
    getattr(lib, kernel)(q.view(shape), k.view(shape), v.view(shape), torch.zeros(1), out.view(shape),
                         params(L, D, H, H - 1, 1), A.LOG2E / 8,
                         *([torch.zeros(1)] if kernel.startswith("attention_vec") else []),
                         threads=128, group_size=128, windows={0: win, 1: win, 2: win, 4: win})
    got = out[first:].view(1, 1, L, D)
    assert_matches(got, oracle(small_q, small_k, small_v), torch.float16)
