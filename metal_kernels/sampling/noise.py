"""Counter-based standard normals for the sampler kernels: the same bits in MSL (sampling.metal), torch and
plain Python, so "fast" device noise is reproducible on any device (`DeviceNoise`, `iid_noise`, `BrownianBridge`)."""
from __future__ import annotations

import dataclasses
import math
from typing import Optional

import torch

_M32 = 0xFFFFFFFF

# --------------------------------------------------------------------------------------------
# Counter-based normals: a stateless hash of (node key, element index), the same bits in MSL
# (sampling.metal), torch and plain Python.
# --------------------------------------------------------------------------------------------


def _hash32_int(v: int) -> int:
    v &= _M32
    v ^= v >> 16
    v = (v * 0x7FEB352D) & _M32
    v ^= v >> 15
    v = (v * 0x846CA68B) & _M32
    v ^= v >> 16
    return v


def _mul32(v: torch.Tensor, c: int) -> torch.Tensor:
    """(v * c) mod 2^32 for int64 tensors holding values < 2^32, without int64 overflow."""
    lo = v * (c & 0xFFFF)
    hi = ((v * (c >> 16)) & 0xFFFF) << 16
    return (lo + hi) & _M32


def _hash32_tensor(v: torch.Tensor) -> torch.Tensor:
    v = v ^ (v >> 16)
    v = _mul32(v, 0x7FEB352D)
    v = v ^ (v >> 15)
    v = _mul32(v, 0x846CA68B)
    return v ^ (v >> 16)


def _index_hash(idx: torch.Tensor) -> torch.Tensor:
    lo = idx & _M32
    hi = idx >> 32
    return _hash32_tensor(lo ^ _hash32_tensor(hi ^ 0x9E3779B9))


def node_keys(seed: int, node: int) -> tuple[int, int]:
    """The two 32-bit keys of the standard normal attached to `node` for `seed`."""
    s = _hash32_int((seed & _M32) ^ _hash32_int(((seed >> 32) & _M32) ^ 0x68BC21EB))
    n = _hash32_int((node & _M32) ^ _hash32_int(((node >> 32) & _M32) ^ 0x02E5BE93))
    ka = _hash32_int(s ^ _hash32_int(n ^ 0x1B873593))
    kb = _hash32_int(ka ^ 0x85EBCA6B)
    return ka, kb


@dataclasses.dataclass(frozen=True)
class DeviceNoise:
    """sum_k weights[k] * N_k, N_k a standard normal per element drawn from keys[2k], keys[2k+1]."""

    keys: tuple[int, ...]
    weights: tuple[float, ...]
    # Optional per-run store of the normals the reference path drew for the previous increment (a
    # schedule's consecutive increments share one endpoint's path); never changes the values.
    cache: Optional["NormalCache"] = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if len(self.keys) != 2 * len(self.weights):
            raise ValueError(f"DeviceNoise: {len(self.keys)} keys for {len(self.weights)} weights (need 2 per weight)")

    def scaled(self, c: float) -> "DeviceNoise":
        return DeviceNoise(self.keys, tuple(w * c for w in self.weights), self.cache)

    def __len__(self) -> int:
        return len(self.weights)


class NormalCache:
    """The node normals of the last reference-path materialisation (CPU/CUDA only; Metal draws in-kernel)."""

    MAX_BYTES = 256 << 20

    def __init__(self):
        self.key = None
        self.rows: dict = {}


def iid_noise(seed: int, step: int) -> DeviceNoise:
    """One fresh standard normal per element for step `step` (independent across steps)."""
    return DeviceNoise(node_keys(seed, (1 << 40) + step), (1.0,))


class BrownianBridge:
    """A seeded Brownian motion W on [0, 2^TOP], evaluated without state (a virtual Brownian tree).

    W is the Levy-Ciesielski construction truncated at cells of width 2^-FINE: the root value
    W(2^TOP) and the bridge midpoint displacement of every dyadic cell are standard normals keyed
    by (seed, node id), so W(t) is a fixed linear combination of at most TOP+FINE+1 of them (the
    path from the root to t). An increment W(t)-W(s) is therefore exact Brownian (N(0, |t-s|),
    independent over disjoint intervals) at dyadic resolution 2^-FINE (below it W is linear), and
    it does not depend on how [s, t] is split or which schedule asked for it. The host computes
    the weights (pure Python, no tensors); the normals are drawn on the device.
    """

    TOP = 12
    FINE = 20

    def __init__(self, seed: int):
        self.seed = int(seed)
        self._keys: dict[int, tuple[int, int]] = {}
        self.normal_cache = NormalCache()

    @property
    def length(self) -> float:
        return float(2 ** self.TOP)

    def weights_at(self, t: float) -> dict[int, float]:
        """W(t) = sum(w * N_node): {node id: w}."""
        length = self.length
        if not (0.0 <= t <= length) or t != t:
            raise ValueError(f"BrownianBridge: time {t} is outside [0, {length:g}] (sigma too large for fast noise; "
                             "use noise_mode='exact')")
        out = {0: t / math.sqrt(length)} if t > 0 else {}
        for level in range(self.TOP + self.FINE):
            size = length / (1 << level)
            j = min(int(t // size), (1 << level) - 1)
            half = size / 2
            hat = 1.0 - abs(t - (j * size + half)) / half
            if hat > 0:
                out[(1 << level) + j] = math.sqrt(size) / 2 * hat
        return out

    def _node_keys(self, node: int) -> tuple[int, int]:
        keys = self._keys.get(node)
        if keys is None:
            keys = self._keys[node] = node_keys(self.seed, node)
        return keys

    def increment(self, s: float, t: float) -> DeviceNoise:
        """(W(t) - W(s)) / sqrt(|t - s|): a standard normal per element (ComfyUI's BrownianTreeNoiseSampler
        convention for noise_sampler(sigma, sigma_next))."""
        if s == t:
            raise ValueError(f"BrownianBridge: empty interval [{s}, {t}]")
        ws, wt = self.weights_at(s), self.weights_at(t)
        scale = 1.0 / math.sqrt(abs(t - s))
        keys: list[int] = []
        weights: list[float] = []
        for node in sorted(set(ws) | set(wt)):
            w = (wt.get(node, 0.0) - ws.get(node, 0.0)) * scale
            if w != 0.0:
                keys.extend(self._node_keys(node))
                weights.append(w)
        return DeviceNoise(tuple(keys), tuple(weights), self.normal_cache)


def _i32(v: int) -> int:
    """A uint32 value as the int32 with the same bits."""
    v &= _M32
    return v - (1 << 32) if v >= (1 << 31) else v


def _hash32_i32_(v: torch.Tensor) -> torch.Tensor:
    """lowbias32 in place on an int32 tensor holding uint32 bits (int32 multiply wraps like uint32;
    right shifts are made logical by masking)."""
    v.bitwise_xor_(v.bitwise_right_shift(16).bitwise_and_(0xFFFF))
    v.mul_(_i32(0x7FEB352D))
    v.bitwise_xor_(v.bitwise_right_shift(15).bitwise_and_(0x1FFFF))
    v.mul_(_i32(0x846CA68B))
    v.bitwise_xor_(v.bitwise_right_shift(16).bitwise_and_(0xFFFF))
    return v


_HIDX_CACHE: dict = {}


def _element_hashes(start: int, count: int, device) -> torch.Tensor:
    """int32 tensor of _index_hash(start .. start+count-1) (uint32 bits)."""
    key = (start, count, str(device))
    cached = _HIDX_CACHE.get(key)
    if cached is None:
        idx = torch.arange(start, start + count, dtype=torch.int64, device=device)
        h = _index_hash(idx)
        cached = torch.where(h >= (1 << 31), h - (1 << 32), h).to(torch.int32)
        if len(_HIDX_CACHE) > 8:
            _HIDX_CACHE.clear()
        _HIDX_CACHE[key] = cached
    return cached


_BATCH_ELEMENTS = 1 << 23  # (nodes x elements) per vectorised batch: 32 MiB of int32


def _normals(hidx: torch.Tensor, keys: list) -> torch.Tensor:
    """(K, n) standard normals for K key pairs (keys: 2K uint32 values) at the hashed elements."""
    k = len(keys) // 2
    kt = torch.tensor([_i32(v) for v in keys], dtype=torch.int32, device=hidx.device).view(k, 2).t()
    h = _hash32_i32_(hidx.unsqueeze(0) ^ kt.reshape(2 * k, 1))  # rows 0..k-1: first keys, k..: second
    h = h.bitwise_right_shift_(8).bitwise_and_(0xFFFFFF).to(torch.float32)
    u1, u2 = h[:k], h[k:]
    z = u1.add_(0.5).mul_(1.0 / 16777216.0).log_().mul_(-2.0).sqrt_()
    return z.mul_(u2.mul_(6.2831853071795864 / 16777216.0).cos_())


def device_noise_reference(noise: DeviceNoise, shape, device, dtype=torch.float32) -> torch.Tensor:
    """The DeviceNoise materialised with torch ops (same bits as the kernel), float32 math. All nodes
    are hashed in one (2K, chunk) pass and combined with one matrix-vector product; with a cache
    (BrownianBridge increments), normals of nodes shared with the previous increment are reused."""
    numel = math.prod(shape)
    k = len(noise.weights)
    if k == 0 or numel == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    weights = torch.tensor(noise.weights, dtype=torch.float32, device=device)
    cache = noise.cache
    if cache is not None and numel * k * 4 <= NormalCache.MAX_BYTES and numel * 2 * k <= 4 * _BATCH_ELEMENTS:
        key = (numel, str(device))
        if cache.key != key:
            cache.key, cache.rows = key, {}
        pairs = [(noise.keys[2 * i], noise.keys[2 * i + 1]) for i in range(k)]
        missing = [p for p in pairs if p not in cache.rows]
        fresh = {}
        if missing:
            z = _normals(_element_hashes(0, numel, device), [v for p in missing for v in p])
            fresh = dict(zip(missing, z))
        rows = [cache.rows[p] if p in cache.rows else fresh[p] for p in pairs]
        cache.rows = dict(zip(pairs, rows))
        out = torch.mv(torch.stack(rows).t(), weights)
        return out.view(shape).to(dtype)
    out = torch.empty(numel, dtype=torch.float32, device=device)
    chunk = max(1, _BATCH_ELEMENTS // (2 * k))
    for start in range(0, numel, chunk):
        count = min(chunk, numel - start)
        z = _normals(_element_hashes(start, count, device), list(noise.keys))
        torch.mv(z.t(), weights, out=out[start:start + count])
    return out.view(shape).to(dtype)

