"""The fast device noise of the Metal samplers: statistics of the Brownian bridge (virtual Brownian
tree) increments and of the counter-based normals, split invariance, determinism, and the kernel
in the MSL emulator. Runs without ComfyUI."""
from __future__ import annotations

import math
import random

import pytest
import torch

from comfy_metal.metal_kernels import dispatch, sampling as K

N = 1 << 17  # elements per sampled increment: statistics within ~5/sqrt(N) = 0.014


def _noise(bridge, s, t, n=N):
    return K.device_noise_reference(bridge.increment(s, t), (n,), "cpu")


def test_weights_give_exact_brownian_variances():
    """No sampling error: W(t) = sum w_k N_k has Var = sum w_k^2 = t (up to the 2^-20 resolution),
    and every increment's weights have sum of squares 1 (unit variance after normalisation)."""
    bridge = K.BrownianBridge(0)
    rng = random.Random(1)
    res = 2.0 ** -bridge.FINE
    for t in [0.0, 1.0, 0.5, 14.614641, 0.0291675, 1.0 - 1e-4, 80.0, 4096.0] + [rng.uniform(0, 20) for _ in range(20)]:
        w = bridge.weights_at(t)
        var = sum(v * v for v in w.values())
        assert abs(var - t) <= res / 4 + 1e-12 * max(t, 1), (t, var)
    for _ in range(30):
        s, t = sorted(rng.uniform(0.01, 15) for _ in range(2))
        inc = bridge.increment(t, s)
        assert abs(sum(v * v for v in inc.weights) - 1.0) < 2 * res / (t - s) + 1e-9
    with pytest.raises(ValueError, match="outside"):
        bridge.weights_at(5000.0)
    with pytest.raises(ValueError, match="empty interval"):
        bridge.increment(1.0, 1.0)


def test_covariance_of_two_points_matches_min_s_t():
    """Cov(W(s), W(t)) = min(s, t) from the weights (exact, no sampling)."""
    bridge = K.BrownianBridge(3)
    rng = random.Random(2)
    for _ in range(40):
        s, t = rng.uniform(0, 16), rng.uniform(0, 16)
        ws, wt = bridge.weights_at(s), bridge.weights_at(t)
        cov = sum(v * wt.get(k, 0.0) for k, v in ws.items())
        assert abs(cov - min(s, t)) < 2.0 ** -bridge.FINE, (s, t, cov)


def test_counter_normals_are_standard_normal_and_independent():
    like = torch.zeros(N)
    z = K.device_noise_reference(K.iid_noise(123, 0), like.shape, "cpu")
    z2 = K.device_noise_reference(K.iid_noise(123, 1), like.shape, "cpu")
    tol = 5 / math.sqrt(N)
    assert abs(z.mean().item()) < tol
    assert abs(z.var().item() - 1) < 5 * math.sqrt(2 / N)
    kurt = ((z - z.mean()) ** 4).mean().item() / z.var().item() ** 2
    assert abs(kurt - 3) < 0.1
    tail = (z.abs() > 3).float().mean().item()
    assert abs(tail - 0.0027) < 0.0012
    for q, expect in [(0.1, -1.2816), (0.5, 0.0), (0.9, 1.2816)]:
        assert abs(torch.quantile(z[:50000], q).item() - expect) < 0.03
    assert abs(torch.corrcoef(torch.stack([z[:-1], z[1:]]))[0, 1].item()) < tol  # neighbours
    assert abs(torch.corrcoef(torch.stack([z, z2]))[0, 1].item()) < tol          # steps
    z_other_seed = K.device_noise_reference(K.iid_noise(124, 0), like.shape, "cpu")
    assert abs(torch.corrcoef(torch.stack([z, z_other_seed]))[0, 1].item()) < tol


@pytest.mark.parametrize("sigma_max,seed", [(14.614641, 7), (1.0, 11), (80.0, 5)])
def test_increments_over_random_splits(sigma_max, seed):
    """A random schedule: each normalised increment ~ N(0, 1); disjoint increments uncorrelated;
    an interval's noise correlates with a sub-interval's as sqrt(len(sub)/len)."""
    rng = random.Random(seed)
    pts = sorted({rng.uniform(0.02 * sigma_max, sigma_max) for _ in range(5)} | {sigma_max}, reverse=True)
    bridge = K.BrownianBridge(seed)
    incs = [_noise(bridge, a, b) for a, b in zip(pts, pts[1:])]
    tol = 5 / math.sqrt(N)
    for z in incs:
        assert abs(z.mean().item()) < tol
        assert abs(z.var().item() - 1) < 5 * math.sqrt(2 / N)
    corr = torch.corrcoef(torch.stack(incs))
    off = corr - torch.eye(len(incs))
    assert off.abs().max().item() < tol, corr
    a, b, c = pts[0], pts[1], pts[-1]
    whole, part = _noise(bridge, a, c), incs[0]
    expect = math.sqrt((a - b) / (a - c))
    got = torch.corrcoef(torch.stack([whole, part]))[0, 1].item()
    assert abs(got - expect) < tol, (got, expect)


def test_split_invariance_exact():
    """sqrt(c-a) n(a->c) == sqrt(b-a) n(a->b) + sqrt(c-b) n(b->c) elementwise, for any split,
    any schedule and any bridge object with the same seed."""
    rng = random.Random(9)
    n = 4099
    for _ in range(6):
        a = rng.uniform(1, 14)
        pts = sorted({a} | {rng.uniform(0.01, a) for _ in range(rng.randint(1, 4))}, reverse=True)
        whole = _noise(K.BrownianBridge(42), pts[0], pts[-1], n) * math.sqrt(pts[0] - pts[-1])
        fresh = K.BrownianBridge(42)  # a new object: no shared state
        parts = sum(_noise(fresh, s, t, n) * math.sqrt(s - t) for s, t in zip(pts, pts[1:]))
        torch.testing.assert_close(parts, whole, atol=2e-5 * math.sqrt(a), rtol=1e-5)
    # a different seed is a different path
    other = _noise(K.BrownianBridge(43), 3.0, 2.0, n)
    assert torch.corrcoef(torch.stack([other, _noise(K.BrownianBridge(42), 3.0, 2.0, n)]))[0, 1].abs() < 0.1


def test_direction_and_determinism():
    bridge = K.BrownianBridge(5)
    up = _noise(bridge, 2.0, 3.0, 999)
    down = _noise(bridge, 3.0, 2.0, 999)
    torch.testing.assert_close(up, -down)
    torch.testing.assert_close(_noise(K.BrownianBridge(5), 3.0, 2.0, 999), down, rtol=0, atol=0)
    # element i does not depend on the tensor's size (counter-based)
    torch.testing.assert_close(_noise(bridge, 3.0, 2.0, 5000)[:999], down, rtol=0, atol=0)


def test_python_and_torch_hashes_agree():
    vals = [0, 1, 2, 12345, 2 ** 31, 2 ** 32 - 1, 0x9E3779B9]
    got = K._hash32_tensor(torch.tensor(vals, dtype=torch.int64)).tolist()
    assert got == [K._hash32_int(v) for v in vals]
    idx = torch.tensor([0, 1, 2 ** 32 + 5, 2 ** 40 + 3], dtype=torch.int64)
    h = K._index_hash(idx).tolist()
    want = [K._hash32_int((i & 0xFFFFFFFF) ^ K._hash32_int((i >> 32) ^ 0x9E3779B9)) for i in idx.tolist()]
    assert h == want


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_device_noise_kernel_in_emulator(emulator_backend, dtype):
    like = torch.zeros(3, 7, 11, dtype=dtype)  # odd size, 231 elements
    bridge = K.BrownianBridge(77)
    for spec_noise in (bridge.increment(9.3, 0.0292), bridge.increment(0.9999, 0.95), K.iid_noise(77, 4)):
        got = K.sampler_device_noise(like, spec_noise)
        assert dispatch.last_backend["sampler_device_noise"] == "emulator"
        want = K.device_noise_reference(spec_noise, like.shape, "cpu", dtype)
        tol = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}[dtype]
        torch.testing.assert_close(got.float(), want.float(), atol=tol * 4, rtol=tol)


def test_reference_normal_cache_changes_nothing():
    """Consecutive increments reuse the previous increment's node normals on the reference path:
    bit-identical to drawing every node afresh, also after a shape change."""
    sig = [14.6, 9.1, 5.5, 3.1, 1.6, 0.7, 0.2, 0.03]
    bridge = K.BrownianBridge(3)
    for shape in [(2, 4, 9, 7), (3, 5)]:
        for s, t in zip(sig, sig[1:]):
            inc = bridge.increment(s, t)
            assert inc.cache is bridge.normal_cache
            cached = K.device_noise_reference(inc, shape, "cpu")
            fresh = K.device_noise_reference(K.DeviceNoise(inc.keys, inc.weights), shape, "cpu")
            assert torch.equal(cached, fresh)
        assert 0 < len(bridge.normal_cache.rows) <= 70
