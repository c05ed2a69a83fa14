"""Fused sampler step kernels and the device-side noise they can draw.

Each public `sampler_<name>_step` function performs one step (or one stage of a two-stage method)
of the ComfyUI / k-diffusion sampler of that name, taking the latent, the denoiser outputs it
needs and the step's sigmas as host floats (read once before the sampling loop, so a step never
makes the host wait). On MPS one Metal kernel reads every input once and writes the new latent
once; elsewhere the pure-torch reference (written in the same form as ComfyUI's sampler code)
runs.

Noise arguments are a tensor (e.g. from ComfyUI's own noise sampler: "exact" mode), a
`DeviceNoise` (a weighted sum of counter-based standard normals generated inside the kernel:
"fast" mode, see `BrownianBridge` and `iid_noise`), or None when the step adds no noise.

`flags` (int32 tensor, one slot per step) and `step`: a step whose output has a NaN/inf sets
flags[step] on the device; the sampler reads the flags once after the loop.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Optional, Union

import torch

from .registry import KernelSpec, register

__all__ = [
    "sampler_device_noise", "sampler_churn_step", "sampler_euler_step", "sampler_euler_ancestral_step",
    "sampler_heun_step", "sampler_dpmpp_2m_step", "sampler_dpmpp_2m_sde_step", "sampler_dpmpp_3m_sde_step",
    "sampler_lcm_step", "sampler_res_multistep_step",
    "sampler_euler_cfg_pp_step", "sampler_dpmpp_2m_cfg_pp_step", "sampler_res_multistep_cfg_pp_step",
    "sampler_dpmpp_2s_ancestral_cfg_pp_step", "dpmpp_2s_midpoint_sigma",
    "DeviceNoise", "BrownianBridge", "iid_noise", "device_noise_reference", "ancestral_step",
    "half_log_snr", "res_multistep_coefficients", "cfg_pp_alpha",
]

MSL_TYPE = {torch.float32: "float", torch.float16: "half", torch.bfloat16: "bfloat"}
_M32 = 0xFFFFFFFF
_FLOAT32_MAX = 3.4028234663852886e38

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


# --------------------------------------------------------------------------------------------
# Host-side step math shared by references and launchers (Python floats, no tensors).
# --------------------------------------------------------------------------------------------


def ancestral_step(sigma_from: float, sigma_to: float, eta: float = 1.0) -> tuple[float, float]:
    """(sigma_down, sigma_up) of an ancestral step (k-diffusion's definition)."""
    if not eta:
        return sigma_to, 0.0
    sigma_up = min(sigma_to, eta * (sigma_to ** 2 * (sigma_from ** 2 - sigma_to ** 2) / sigma_from ** 2) ** 0.5)
    sigma_down = (sigma_to ** 2 - sigma_up ** 2) ** 0.5
    return sigma_down, sigma_up


def half_log_snr(sigma: float, flow: bool) -> float:
    """log(alpha/sigma): -log(sigma), or for flow (CONST) models -logit(sigma)."""
    if flow:
        return math.log((1.0 - sigma) / sigma) if sigma < 1.0 else -math.inf
    return -math.log(sigma)


def _ieee_div(a: float, b: float) -> float:
    if b == 0.0:
        if a == 0.0 or a != a:
            return math.nan
        return math.copysign(math.inf, a) * (1.0 if math.copysign(1.0, b) > 0 else -1.0)
    return a / b


def _nan_to_num32(v: float) -> float:
    if v != v:
        return 0.0
    if v == math.inf:
        return _FLOAT32_MAX
    if v == -math.inf:
        return -_FLOAT32_MAX
    return v


def res_multistep_coefficients(sigma, sigma_next, sigma_prev, old_sigma_down, sigma_down):
    """(exp(-h), h*b1, h*b2) of the second-order res_multistep update."""
    t, t_old = -math.log(sigma), -math.log(old_sigma_down)
    t_next, t_prev = -math.log(sigma_down), -math.log(sigma_prev)
    h = t_next - t
    c2 = _ieee_div(t_prev - t_old, h)
    phi1 = _ieee_div(math.expm1(-h), -h)
    phi2 = _ieee_div(phi1 - 1.0, -h)
    b1 = _nan_to_num32(phi1 - _ieee_div(phi2, c2))
    b2 = _nan_to_num32(_ieee_div(phi2, c2))
    return math.exp(-h), h * b1, h * b2


def _sde_common(sigma, sigma_next, eta, flow):
    lam_s, lam_t = half_log_snr(sigma, flow), half_log_snr(sigma_next, flow)
    h = lam_t - lam_s
    h_eta = h * (eta + 1)
    alpha_t = sigma_next * math.exp(lam_t)
    return h, h_eta, alpha_t


def dpmpp_sde_h(sigma: float, sigma_next: float, flow: bool) -> float:
    """The step h (difference of half-logSNR) of the DPM-Solver++ SDE samplers."""
    return half_log_snr(sigma_next, flow) - half_log_snr(sigma, flow)


# --------------------------------------------------------------------------------------------
# Reference helpers
# --------------------------------------------------------------------------------------------

NoiseArg = Optional[Union[torch.Tensor, DeviceNoise]]


def _f32(t: torch.Tensor) -> torch.Tensor:
    return t if t.dtype == torch.float32 else t.float()


def _noise_ref(noise: NoiseArg, like: torch.Tensor, what: str) -> torch.Tensor:
    if noise is None:
        raise ValueError(f"{what}: this step adds noise but no noise was given")
    if isinstance(noise, DeviceNoise):
        return device_noise_reference(noise, like.shape, like.device)
    if noise.shape != like.shape:
        raise ValueError(f"{what}: noise has shape {tuple(noise.shape)}, expected {tuple(like.shape)} (the latent's)")
    return _f32(noise.to(like.device))


def _record(flags: Optional[torch.Tensor], step: int, out: torch.Tensor) -> None:
    if flags is not None and step >= 0:
        bad = (~torch.isfinite(out)).any().to(flags.dtype)
        flags[step] = torch.maximum(flags[step], bad)


def _finish(out: torch.Tensor, like: torch.Tensor, flags, step) -> torch.Tensor:
    out = out.to(like.dtype)
    _record(flags, step, out)
    return out


def _check_same(what: str, x: torch.Tensor, **others) -> None:
    if x.dtype not in MSL_TYPE:
        raise TypeError(f"{what}: latent dtype {x.dtype} is not supported; expected float32, float16 or bfloat16")
    for name, t in others.items():
        if t is not None and t.shape != x.shape:
            raise ValueError(f"{what}: {name} has shape {tuple(t.shape)}, expected {tuple(x.shape)} (the latent's)")


# --------------------------------------------------------------------------------------------
# The generic fused launch
# --------------------------------------------------------------------------------------------

_MAX_THREADS = 1 << 18
_GROUP = 256


def _launch_lincomb(lib, terms, noise: NoiseArg = None, noise_coef: float = 0.0, flags=None, step: int = -1,
                    dtype=None):
    """out = sum(c * t for t, c in terms) + noise_coef * noise, one kernel; terms[0] sets the shape, `dtype`
    (default terms[0]'s) the computation's storage type."""
    if not 1 <= len(terms) <= 4:
        raise ValueError(f"sampler kernel: {len(terms)} input tensors (1 to 4 supported)")
    first = terms[0][0]
    dtype = first.dtype if dtype is None else dtype
    ins = [t.to(dtype).contiguous() for t, _ in terms]
    coef = [float(c) for _, c in terms] + [0.0] * (4 - len(terms))
    x = ins[0]
    out = torch.empty_like(x)
    numel = x.numel()
    has_noise = 0
    noise_tensor = x
    keys, weights = [0, 0], [0.0]
    nkeys = 0
    if noise_coef != 0.0:
        if noise is None:
            raise ValueError("sampler kernel: this step adds noise but no noise was given")
        if isinstance(noise, DeviceNoise):
            if len(noise):
                keys = [int(k) for k in noise.keys]
                weights = [float(w) * noise_coef for w in noise.weights]
                nkeys = len(noise)
        else:
            if noise.shape != x.shape:
                raise ValueError(f"sampler kernel: noise has shape {tuple(noise.shape)}, expected {tuple(x.shape)}")
            noise_tensor = noise.to(device=x.device, dtype=dtype).contiguous()
            has_noise = 1
    coef.append(float(noise_coef) if has_noise else 0.0)
    if flags is None or step < 0:
        flag_buf, step = torch.zeros(1, dtype=torch.int32, device=x.device), -1
    else:
        flag_buf = flags
    if numel:
        threads = min(numel, _MAX_THREADS)
        kernel = getattr(lib, f"sampler_lincomb_{MSL_TYPE[dtype]}")
        pad = ins + [x] * (4 - len(ins))
        kernel(pad[0], pad[1], pad[2], pad[3], noise_tensor, out, flag_buf, coef, keys, weights,
               len(ins) - 1, has_noise, nkeys, int(step), numel, threads,
               threads=threads, group_size=min(_GROUP, threads))
    return out


def _entry(kind):
    lincomb = ("tensor",) * 7 + ("float[]", "int[]", "float[]") + ("int",) * 6
    noise = ("tensor", "int[]", "float[]", "int", "int", "int")
    kinds = {"lincomb": lincomb, "noise": noise}[kind]
    return {f"sampler_{kind}_{t}": kinds for t in MSL_TYPE.values()}


_LINCOMB_ENTRIES = _entry("lincomb")


# --------------------------------------------------------------------------------------------
# Device noise alone
# --------------------------------------------------------------------------------------------


def device_noise_ref(like: torch.Tensor, noise: DeviceNoise) -> torch.Tensor:
    """The DeviceNoise as a tensor shaped and typed like `like`."""
    _check_same("sampler_device_noise", like)
    return device_noise_reference(noise, like.shape, like.device, like.dtype)


def device_noise_metal(lib, like: torch.Tensor, noise: DeviceNoise) -> torch.Tensor:
    _check_same("sampler_device_noise", like)
    out = torch.empty(like.shape, dtype=like.dtype, device=like.device)
    numel = out.numel()
    if numel:
        keys = [int(k) for k in noise.keys] or [0, 0]
        weights = [float(w) for w in noise.weights] or [0.0]
        threads = min(numel, _MAX_THREADS)
        getattr(lib, f"sampler_noise_{MSL_TYPE[like.dtype]}")(
            out, keys, weights, len(noise), numel, threads, threads=threads, group_size=min(_GROUP, threads))
    return out


# --------------------------------------------------------------------------------------------
# Steps. Each: reference (ComfyUI's form, float32 math) and Metal launcher (host coefficients).
# --------------------------------------------------------------------------------------------


def churn_ref(x, noise, sigma, sigma_hat, s_noise=1.0, *, flags=None, step=-1):
    """Karras churn: x + noise * s_noise * sqrt(sigma_hat^2 - sigma^2) (before the model call)."""
    _check_same("sampler_churn_step", x, noise=noise if isinstance(noise, torch.Tensor) else None)
    eps = _noise_ref(noise, x, "sampler_churn_step") * s_noise
    return _finish(_f32(x) + eps * (sigma_hat ** 2 - sigma ** 2) ** 0.5, x, flags, step)


def churn_metal(lib, x, noise, sigma, sigma_hat, s_noise=1.0, *, flags=None, step=-1):
    _check_same("sampler_churn_step", x, noise=noise if isinstance(noise, torch.Tensor) else None)
    return _launch_lincomb(lib, [(x, 1.0)], noise, s_noise * (sigma_hat ** 2 - sigma ** 2) ** 0.5, flags, step)


def euler_ref(x, denoised, sigma_hat, sigma_next, *, flags=None, step=-1):
    """Euler: d = (x - denoised) / sigma_hat; x + d * (sigma_next - sigma_hat)."""
    _check_same("sampler_euler_step", x, denoised=denoised)
    d = (_f32(x) - _f32(denoised)) / sigma_hat
    return _finish(_f32(x) + d * (sigma_next - sigma_hat), x, flags, step)


def euler_metal(lib, x, denoised, sigma_hat, sigma_next, *, flags=None, step=-1):
    _check_same("sampler_euler_step", x, denoised=denoised)
    r = (sigma_next - sigma_hat) / sigma_hat
    return _launch_lincomb(lib, [(x, 1.0 + r), (denoised, -r)], flags=flags, step=step)


def _ancestral_plan(sigma, sigma_next, eta, s_noise, flow):
    """("denoised",) | (cx, cden, noise_coef): the ancestral Euler step as coefficients."""
    if flow:
        if sigma_next == 0:
            return None
        ratio = 1 + (sigma_next / sigma - 1) * eta
        sigma_down = sigma_next * ratio
        alpha_ip1, alpha_down = 1 - sigma_next, 1 - sigma_down
        renoise = (sigma_next ** 2 - sigma_down ** 2 * alpha_ip1 ** 2 / alpha_down ** 2) ** 0.5
        q = sigma_down / sigma
        if eta > 0:
            m = alpha_ip1 / alpha_down
            return q * m, (1 - q) * m, s_noise * renoise
        return q, 1 - q, 0.0
    sigma_down, sigma_up = ancestral_step(sigma, sigma_next, eta)
    if sigma_down == 0:
        return None
    r = (sigma_down - sigma) / sigma
    return 1 + r, -r, s_noise * sigma_up


def euler_ancestral_ref(x, denoised, sigma, sigma_next, noise=None, *, eta=1.0, s_noise=1.0, flow=False,
                        flags=None, step=-1):
    """Euler ancestral (k-diffusion); flow=True: the rectified-flow variant ComfyUI uses for CONST models.
    `s_noise` already includes the model's noise_scale for flow models."""
    _check_same("sampler_euler_ancestral_step", x, denoised=denoised)
    xf, den = _f32(x), _f32(denoised)
    if flow:
        if sigma_next == 0:
            return _finish(den.clone(), x, flags, step)
        ratio = 1 + (sigma_next / sigma - 1) * eta
        sigma_down = sigma_next * ratio
        alpha_ip1, alpha_down = 1 - sigma_next, 1 - sigma_down
        renoise = (sigma_next ** 2 - sigma_down ** 2 * alpha_ip1 ** 2 / alpha_down ** 2) ** 0.5
        q = sigma_down / sigma
        out = q * xf + (1 - q) * den
        if eta > 0:
            out = (alpha_ip1 / alpha_down) * out + _noise_ref(noise, x, "sampler_euler_ancestral_step") * s_noise * renoise
        return _finish(out, x, flags, step)
    sigma_down, sigma_up = ancestral_step(sigma, sigma_next, eta)
    if sigma_down == 0:
        return _finish(den.clone(), x, flags, step)
    d = (xf - den) / sigma
    out = xf + d * (sigma_down - sigma)
    if sigma_up != 0:
        out = out + _noise_ref(noise, x, "sampler_euler_ancestral_step") * s_noise * sigma_up
    return _finish(out, x, flags, step)


def euler_ancestral_metal(lib, x, denoised, sigma, sigma_next, noise=None, *, eta=1.0, s_noise=1.0, flow=False,
                          flags=None, step=-1):
    _check_same("sampler_euler_ancestral_step", x, denoised=denoised)
    plan = _ancestral_plan(sigma, sigma_next, eta, s_noise, flow)
    if plan is None:
        return _launch_lincomb(lib, [(denoised, 1.0)], flags=flags, step=step, dtype=x.dtype)
    cx, cd, cn = plan
    return _launch_lincomb(lib, [(x, cx), (denoised, cd)], noise, cn, flags, step)


def heun_ref(x, denoised, denoised_2, sigma_hat, sigma_next, *, flags=None, step=-1):
    """Heun's second stage: x_2 = x + d*dt (the first stage), d_2 = (x_2 - denoised_2)/sigma_next,
    x + (d + d_2)/2 * dt."""
    _check_same("sampler_heun_step", x, denoised=denoised, denoised_2=denoised_2)
    xf = _f32(x)
    dt = sigma_next - sigma_hat
    d = (xf - _f32(denoised)) / sigma_hat
    x_2 = xf + d * dt
    d_2 = (x_2 - _f32(denoised_2)) / sigma_next
    return _finish(xf + (d + d_2) / 2 * dt, x, flags, step)


def heun_metal(lib, x, denoised, denoised_2, sigma_hat, sigma_next, *, flags=None, step=-1):
    _check_same("sampler_heun_step", x, denoised=denoised, denoised_2=denoised_2)
    dt = sigma_next - sigma_hat
    a = dt / sigma_hat
    p, q = dt / (2 * sigma_hat), dt / (2 * sigma_next)
    return _launch_lincomb(lib, [(x, 1 + p + q * (1 + a)), (denoised, -p - q * a), (denoised_2, -q)],
                           flags=flags, step=step)


def dpmpp_2m_ref(x, denoised, old_denoised, sigma, sigma_next, sigma_prev=None, *, flags=None, step=-1):
    """DPM-Solver++(2M); old_denoised/sigma_prev None on the first step."""
    _check_same("sampler_dpmpp_2m_step", x, denoised=denoised, old_denoised=old_denoised)
    xf, den = _f32(x), _f32(denoised)
    if sigma_next == 0:
        return _finish(0.0 * xf + den, x, flags, step)
    t, t_next = -math.log(sigma), -math.log(sigma_next)
    h = t_next - t
    ratio = math.exp(-t_next) / math.exp(-t)
    if old_denoised is None:
        return _finish(ratio * xf - math.expm1(-h) * den, x, flags, step)
    r = (t + math.log(sigma_prev)) / h
    denoised_d = (1 + 1 / (2 * r)) * den - (1 / (2 * r)) * _f32(old_denoised)
    return _finish(ratio * xf - math.expm1(-h) * denoised_d, x, flags, step)


def dpmpp_2m_metal(lib, x, denoised, old_denoised, sigma, sigma_next, sigma_prev=None, *, flags=None, step=-1):
    _check_same("sampler_dpmpp_2m_step", x, denoised=denoised, old_denoised=old_denoised)
    if sigma_next == 0:
        return _launch_lincomb(lib, [(x, 0.0), (denoised, 1.0)], flags=flags, step=step)
    t, t_next = -math.log(sigma), -math.log(sigma_next)
    h = t_next - t
    ratio = math.exp(-t_next) / math.exp(-t)
    e = math.expm1(-h)
    if old_denoised is None:
        return _launch_lincomb(lib, [(x, ratio), (denoised, -e)], flags=flags, step=step)
    r = (t + math.log(sigma_prev)) / h
    return _launch_lincomb(lib, [(x, ratio), (denoised, -e * (1 + 1 / (2 * r))), (old_denoised, e / (2 * r))],
                           flags=flags, step=step)


def dpmpp_2m_sde_ref(x, denoised, old_denoised, sigma, sigma_next, h_last=None, noise=None, *, eta=1.0, s_noise=1.0,
                     solver_type="midpoint", flow=False, flags=None, step=-1):
    """DPM-Solver++(2M) SDE in half-logSNR (flow=True for CONST models). `s_noise` includes noise_scale;
    `h_last` is the previous step's h (None on the first step)."""
    _check_same("sampler_dpmpp_2m_sde_step", x, denoised=denoised, old_denoised=old_denoised)
    if solver_type not in ("heun", "midpoint"):
        raise ValueError("solver_type must be 'heun' or 'midpoint'")
    xf, den = _f32(x), _f32(denoised)
    if sigma_next == 0:
        return _finish(den.clone(), x, flags, step)
    h, h_eta, alpha_t = _sde_common(sigma, sigma_next, eta, flow)
    out = sigma_next / sigma * math.exp(-h * eta) * xf + alpha_t * -math.expm1(-h_eta) * den
    if old_denoised is not None:
        r = h_last / h
        diff = den - _f32(old_denoised)
        if solver_type == "heun":
            out = out + alpha_t * (-math.expm1(-h_eta) / (-h_eta) + 1) * (1 / r) * diff
        else:
            out = out + 0.5 * alpha_t * -math.expm1(-h_eta) * (1 / r) * diff
    if eta > 0 and s_noise > 0:
        out = out + _noise_ref(noise, x, "sampler_dpmpp_2m_sde_step") * sigma_next * \
            math.sqrt(-math.expm1(-2 * h * eta)) * s_noise
    return _finish(out, x, flags, step)


def dpmpp_2m_sde_metal(lib, x, denoised, old_denoised, sigma, sigma_next, h_last=None, noise=None, *, eta=1.0,
                       s_noise=1.0, solver_type="midpoint", flow=False, flags=None, step=-1):
    _check_same("sampler_dpmpp_2m_sde_step", x, denoised=denoised, old_denoised=old_denoised)
    if solver_type not in ("heun", "midpoint"):
        raise ValueError("solver_type must be 'heun' or 'midpoint'")
    if sigma_next == 0:
        return _launch_lincomb(lib, [(denoised, 1.0)], flags=flags, step=step, dtype=x.dtype)
    h, h_eta, alpha_t = _sde_common(sigma, sigma_next, eta, flow)
    cx = sigma_next / sigma * math.exp(-h * eta)
    cd = alpha_t * -math.expm1(-h_eta)
    terms = [(x, cx), (denoised, cd)]
    if old_denoised is not None:
        r = h_last / h
        if solver_type == "heun":
            extra = alpha_t * (-math.expm1(-h_eta) / (-h_eta) + 1) * (1 / r)
        else:
            extra = 0.5 * alpha_t * -math.expm1(-h_eta) * (1 / r)
        terms = [(x, cx), (denoised, cd + extra), (old_denoised, -extra)]
    cn = sigma_next * math.sqrt(-math.expm1(-2 * h * eta)) * s_noise if (eta > 0 and s_noise > 0) else 0.0
    return _launch_lincomb(lib, terms, noise, cn, flags, step)


def _dpmpp_3m_weights(h, h_eta, alpha_t, h_1, h_2):
    """Weights of (denoised, denoised_1, denoised_2) in the 3M / 2M correction."""
    phi_2 = math.expm1(-h_eta) / h_eta + 1
    if h_2 is not None:
        r0, r1 = h_1 / h, h_2 / h
        d1_0 = (1 / r0, -1 / r0, 0.0)
        d1_1 = (0.0, 1 / r1, -1 / r1)
        diff = tuple(a - b for a, b in zip(d1_0, d1_1))
        d1 = tuple(a + dd * r0 / (r0 + r1) for a, dd in zip(d1_0, diff))
        d2 = tuple(dd / (r0 + r1) for dd in diff)
        phi_3 = phi_2 / h_eta - 0.5
        return tuple(alpha_t * phi_2 * a - alpha_t * phi_3 * b for a, b in zip(d1, d2))
    if h_1 is not None:
        r = h_1 / h
        return (alpha_t * phi_2 / r, -alpha_t * phi_2 / r, 0.0)
    return (0.0, 0.0, 0.0)


def dpmpp_3m_sde_ref(x, denoised, denoised_1, denoised_2, sigma, sigma_next, h_1=None, h_2=None, noise=None, *,
                     eta=1.0, s_noise=1.0, flow=False, flags=None, step=-1):
    """DPM-Solver++(3M) SDE (2M on the second step, 1st order on the first): h_1, h_2 are the
    previous steps' h (None when that history does not exist yet)."""
    _check_same("sampler_dpmpp_3m_sde_step", x, denoised=denoised, denoised_1=denoised_1, denoised_2=denoised_2)
    xf, den = _f32(x), _f32(denoised)
    if sigma_next == 0:
        return _finish(den.clone(), x, flags, step)
    h, h_eta, alpha_t = _sde_common(sigma, sigma_next, eta, flow)
    out = sigma_next / sigma * math.exp(-h * eta) * xf + alpha_t * -math.expm1(-h_eta) * den
    if h_2 is not None:
        r0, r1 = h_1 / h, h_2 / h
        d1_0 = (den - _f32(denoised_1)) / r0
        d1_1 = (_f32(denoised_1) - _f32(denoised_2)) / r1
        d1 = d1_0 + (d1_0 - d1_1) * r0 / (r0 + r1)
        d2 = (d1_0 - d1_1) / (r0 + r1)
        phi_2 = math.expm1(-h_eta) / h_eta + 1
        phi_3 = phi_2 / h_eta - 0.5
        out = out + (alpha_t * phi_2) * d1 - (alpha_t * phi_3) * d2
    elif h_1 is not None:
        r = h_1 / h
        d = (den - _f32(denoised_1)) / r
        phi_2 = math.expm1(-h_eta) / h_eta + 1
        out = out + (alpha_t * phi_2) * d
    if eta > 0 and s_noise > 0:
        out = out + _noise_ref(noise, x, "sampler_dpmpp_3m_sde_step") * sigma_next * \
            math.sqrt(-math.expm1(-2 * h * eta)) * s_noise
    return _finish(out, x, flags, step)


def dpmpp_3m_sde_metal(lib, x, denoised, denoised_1, denoised_2, sigma, sigma_next, h_1=None, h_2=None, noise=None, *,
                       eta=1.0, s_noise=1.0, flow=False, flags=None, step=-1):
    _check_same("sampler_dpmpp_3m_sde_step", x, denoised=denoised, denoised_1=denoised_1, denoised_2=denoised_2)
    if sigma_next == 0:
        return _launch_lincomb(lib, [(denoised, 1.0)], flags=flags, step=step, dtype=x.dtype)
    h, h_eta, alpha_t = _sde_common(sigma, sigma_next, eta, flow)
    cx = sigma_next / sigma * math.exp(-h * eta)
    cd = alpha_t * -math.expm1(-h_eta)
    w0, w1, w2 = _dpmpp_3m_weights(h, h_eta, alpha_t, h_1 if denoised_1 is not None else None,
                                   h_2 if denoised_2 is not None else None)
    terms = [(x, cx), (denoised, cd + w0)]
    if denoised_1 is not None and h_1 is not None:
        terms.append((denoised_1, w1))
        if denoised_2 is not None and h_2 is not None:
            terms.append((denoised_2, w2))
    cn = sigma_next * math.sqrt(-math.expm1(-2 * h * eta)) * s_noise if (eta > 0 and s_noise > 0) else 0.0
    return _launch_lincomb(lib, terms, noise, cn, flags, step)


def lcm_ref(denoised, noise, noise_coef, denoised_coef, *, flags=None, step=-1):
    """LCM re-noising: noise_coef * noise + denoised_coef * denoised (the model's noise_scaling at
    sigma_next, which is linear; coefficients from the sampler). noise_coef 0: just denoised."""
    _check_same("sampler_lcm_step", denoised)
    den = _f32(denoised)
    if noise_coef == 0.0:
        return _finish(den * denoised_coef, denoised, flags, step)
    n = _noise_ref(noise, denoised, "sampler_lcm_step")
    return _finish(n * noise_coef + den * denoised_coef, denoised, flags, step)


def lcm_metal(lib, denoised, noise, noise_coef, denoised_coef, *, flags=None, step=-1):
    _check_same("sampler_lcm_step", denoised)
    return _launch_lincomb(lib, [(denoised, denoised_coef)], noise, noise_coef, flags, step)


def res_multistep_ref(x, denoised, old_denoised, sigma, sigma_next, sigma_prev=None, old_sigma_down=None,
                      noise=None, *, eta=0.0, s_noise=1.0, flags=None, step=-1):
    """res_multistep (second-order multistep exponential integrator, optional ancestral noise)."""
    _check_same("sampler_res_multistep_step", x, denoised=denoised, old_denoised=old_denoised)
    xf, den = _f32(x), _f32(denoised)
    sigma_down, sigma_up = ancestral_step(sigma, sigma_next, eta)
    if sigma_down == 0 or old_denoised is None:
        d = (xf - den) / sigma
        out = xf + d * (sigma_down - sigma)
    else:
        ex, hb1, hb2 = res_multistep_coefficients(sigma, sigma_next, sigma_prev, old_sigma_down, sigma_down)
        out = ex * xf + (hb1 * den + hb2 * _f32(old_denoised))
    if sigma_up > 0:
        out = out + _noise_ref(noise, x, "sampler_res_multistep_step") * s_noise * sigma_up
    return _finish(out, x, flags, step)


def res_multistep_metal(lib, x, denoised, old_denoised, sigma, sigma_next, sigma_prev=None, old_sigma_down=None,
                        noise=None, *, eta=0.0, s_noise=1.0, flags=None, step=-1):
    _check_same("sampler_res_multistep_step", x, denoised=denoised, old_denoised=old_denoised)
    sigma_down, sigma_up = ancestral_step(sigma, sigma_next, eta)
    cn = s_noise * sigma_up if sigma_up > 0 else 0.0
    if sigma_down == 0 or old_denoised is None:
        r = (sigma_down - sigma) / sigma
        return _launch_lincomb(lib, [(x, 1 + r), (denoised, -r)], noise, cn, flags, step)
    ex, hb1, hb2 = res_multistep_coefficients(sigma, sigma_next, sigma_prev, old_sigma_down, sigma_down)
    return _launch_lincomb(lib, [(x, ex), (denoised, hb1), (old_denoised, hb2)], noise, cn, flags, step)


# --------------------------------------------------------------------------------------------
# CFG++ steps (ComfyUI's *_cfg_pp samplers): the same fused linear-combination kernel, with the
# unconditional denoised output (captured by the sampler through ComfyUI's post-CFG hook) as one
# more input. The sampler passes `uncond=denoised` when there is no CFG (then a launcher reads it
# once: terms on the same tensor are merged).
# --------------------------------------------------------------------------------------------


def cfg_pp_alpha(sigma: float, flow: bool) -> float:
    """alpha(sigma) = sigma * exp(half-logSNR): 1 for epsilon models, 1 - sigma for flow (0 from sigma 1 on)."""
    return sigma * math.exp(half_log_snr(sigma, flow))


def _merged(terms):
    """The terms with coefficients of the same tensor object added (a tensor passed twice is read once)."""
    out = []
    for t, c in terms:
        for k, (u, d) in enumerate(out):
            if u is t:
                out[k] = (u, d + c)
                break
        else:
            out.append((t, c))
    return out


def euler_cfg_pp_ref(x, denoised, uncond, sigma, sigma_next, noise=None, *, eta=0.0, s_noise=1.0, flow=False,
                     flags=None, step=-1):
    """Euler (ancestral for eta > 0) CFG++: the step direction from the unconditional prediction, the
    landing point from the guided one (ComfyUI's sample_euler_ancestral_cfg_pp; eta=0: sample_euler_cfg_pp).
    `s_noise` already includes the model's noise_scale; noise is added only when eta > 0 and s_noise > 0."""
    _check_same("sampler_euler_cfg_pp_step", x, denoised=denoised, uncond=uncond)
    xf, den, unc = _f32(x), _f32(denoised), _f32(uncond)
    if sigma_next == 0:
        return _finish(den.clone(), x, flags, step)
    alpha_s, alpha_t = cfg_pp_alpha(sigma, flow), cfg_pp_alpha(sigma_next, flow)
    d = (xf - alpha_s * unc) / sigma
    sigma_down, sigma_up = ancestral_step(_ieee_div(sigma, alpha_s), _ieee_div(sigma_next, alpha_t), eta)
    sigma_down = alpha_t * sigma_down
    out = alpha_t * den + sigma_down * d
    if eta > 0 and s_noise > 0:
        out = out + alpha_t * _noise_ref(noise, x, "sampler_euler_cfg_pp_step") * s_noise * sigma_up
    return _finish(out, x, flags, step)


def euler_cfg_pp_metal(lib, x, denoised, uncond, sigma, sigma_next, noise=None, *, eta=0.0, s_noise=1.0, flow=False,
                       flags=None, step=-1):
    _check_same("sampler_euler_cfg_pp_step", x, denoised=denoised, uncond=uncond)
    if sigma_next == 0:
        return _launch_lincomb(lib, [(denoised, 1.0)], flags=flags, step=step, dtype=x.dtype)
    alpha_s, alpha_t = cfg_pp_alpha(sigma, flow), cfg_pp_alpha(sigma_next, flow)
    sigma_down, sigma_up = ancestral_step(_ieee_div(sigma, alpha_s), _ieee_div(sigma_next, alpha_t), eta)
    q = alpha_t * sigma_down / sigma
    cn = alpha_t * s_noise * sigma_up if (eta > 0 and s_noise > 0) else 0.0
    terms = [(x, q), (denoised, alpha_t), (uncond, -q * alpha_s)]
    return _launch_lincomb(lib, _merged(terms), noise, cn, flags, step)


def _dpmpp_2m_cfg_pp_plan(sigma, sigma_next, sigma_prev, second_order):
    """(exp(-h), weight of (denoised - old_uncond)) of the DPM-Solver++(2M) CFG++ step."""
    if sigma_next == 0:
        return 0.0, 0.0
    t, t_next = -math.log(sigma), -math.log(sigma_next)
    h = t_next - t
    if not second_order:
        return math.exp(-h), 0.0
    r = (t + math.log(sigma_prev)) / h
    return math.exp(-h), -math.expm1(-h) * (1 / (2 * r))


def dpmpp_2m_cfg_pp_ref(x, denoised, uncond, old_uncond, sigma, sigma_next, sigma_prev=None, *, flags=None, step=-1):
    """DPM-Solver++(2M) CFG++ (ComfyUI's sample_dpmpp_2m_cfg_pp): old_uncond/sigma_prev None on the first
    step; first order on the last (sigma_next 0) step."""
    _check_same("sampler_dpmpp_2m_cfg_pp_step", x, denoised=denoised, uncond=uncond, old_uncond=old_uncond)
    xf, den, unc = _f32(x), _f32(denoised), _f32(uncond)
    second = old_uncond is not None and sigma_next != 0
    e, w = _dpmpp_2m_cfg_pp_plan(sigma, sigma_next, sigma_prev, second)
    mix = -e * unc
    if second:
        mix = mix + w * (den - _f32(old_uncond))
    return _finish(den + mix + e * xf, x, flags, step)


def dpmpp_2m_cfg_pp_metal(lib, x, denoised, uncond, old_uncond, sigma, sigma_next, sigma_prev=None, *, flags=None,
                          step=-1):
    _check_same("sampler_dpmpp_2m_cfg_pp_step", x, denoised=denoised, uncond=uncond, old_uncond=old_uncond)
    second = old_uncond is not None and sigma_next != 0
    e, w = _dpmpp_2m_cfg_pp_plan(sigma, sigma_next, sigma_prev, second)
    terms = [(x, e), (denoised, 1.0 + w), (uncond, -e)]
    if second:
        terms.append((old_uncond, -w))
    return _launch_lincomb(lib, _merged(terms), flags=flags, step=step)


def res_multistep_cfg_pp_ref(x, denoised, uncond, old_uncond, sigma, sigma_next, sigma_prev=None,
                             old_sigma_down=None, noise=None, *, eta=0.0, s_noise=1.0, flags=None, step=-1):
    """res_multistep CFG++ (ComfyUI's res_multistep(cfg_pp=True); eta > 0: its _ancestral_cfg_pp): the
    history is the unconditional prediction; `s_noise` already includes the model's noise_scale."""
    _check_same("sampler_res_multistep_cfg_pp_step", x, denoised=denoised, uncond=uncond, old_uncond=old_uncond)
    xf, den, unc = _f32(x), _f32(denoised), _f32(uncond)
    sigma_down, sigma_up = ancestral_step(sigma, sigma_next, eta)
    if sigma_down == 0 or old_uncond is None:
        d = (xf - unc) / sigma
        out = den + d * sigma_down
    else:
        ex, hb1, hb2 = res_multistep_coefficients(sigma, sigma_next, sigma_prev, old_sigma_down, sigma_down)
        out = ex * (xf + (den - unc)) + (hb1 * unc + hb2 * _f32(old_uncond))
    if sigma_up > 0:
        out = out + _noise_ref(noise, x, "sampler_res_multistep_cfg_pp_step") * s_noise * sigma_up
    return _finish(out, x, flags, step)


def res_multistep_cfg_pp_metal(lib, x, denoised, uncond, old_uncond, sigma, sigma_next, sigma_prev=None,
                               old_sigma_down=None, noise=None, *, eta=0.0, s_noise=1.0, flags=None, step=-1):
    _check_same("sampler_res_multistep_cfg_pp_step", x, denoised=denoised, uncond=uncond, old_uncond=old_uncond)
    sigma_down, sigma_up = ancestral_step(sigma, sigma_next, eta)
    cn = s_noise * sigma_up if sigma_up > 0 else 0.0
    if sigma_down == 0 or old_uncond is None:
        q = sigma_down / sigma
        terms = [(x, q), (denoised, 1.0), (uncond, -q)]
    else:
        ex, hb1, hb2 = res_multistep_coefficients(sigma, sigma_next, sigma_prev, old_sigma_down, sigma_down)
        terms = [(x, ex), (denoised, ex), (uncond, hb1 - ex), (old_uncond, hb2)]
    return _launch_lincomb(lib, _merged(terms), noise, cn, flags, step)


def dpmpp_2s_midpoint_sigma(sigma: float, sigma_down: float) -> float:
    """The sigma of DPM-Solver++(2S)'s second model call: exp(-(t + h/2)), t = -log(sigma), h = -log(sigma_down) - t."""
    t, t_next = -math.log(sigma), -math.log(sigma_down)
    return math.exp(-(t + 0.5 * (t_next - t)))


def _dpmpp_2s_plan(sigma, sigma_next, eta, midpoint):
    """(weight of (x + denoised - uncond), weight of the second denoised) of a 2S CFG++ stage;
    None when sigma_down is 0 (then the step is first order)."""
    sigma_down, _ = ancestral_step(sigma, sigma_next, eta)
    if sigma_down == 0:
        return None
    t, t_next = -math.log(sigma), -math.log(sigma_down)
    h = t_next - t
    if midpoint:
        return dpmpp_2s_midpoint_sigma(sigma, sigma_down) / math.exp(-t), -math.expm1(-h * 0.5)
    return math.exp(-t_next) / math.exp(-t), -math.expm1(-h)


def dpmpp_2s_ancestral_cfg_pp_ref(x, denoised, uncond, denoised_2=None, sigma=1.0, sigma_next=0.0, noise=None, *,
                                  eta=1.0, s_noise=1.0, midpoint=False, flags=None, step=-1):
    """DPM-Solver++(2S) ancestral CFG++ (ComfyUI's sample_dpmpp_2s_ancestral_cfg_pp). midpoint=True: the
    first stage (the latent for the second model call, at dpmpp_2s_midpoint_sigma). Otherwise the step:
    `denoised_2` is the second call's output and `uncond` the second call's unconditional output (as in
    ComfyUI, whose second stage reads the latest captured one); first order when sigma_down is 0. Noise
    (s_noise already times the model's noise_scale) is added when sigma_next > 0."""
    _check_same("sampler_dpmpp_2s_ancestral_cfg_pp_step", x, denoised=denoised, uncond=uncond, denoised_2=denoised_2)
    xf, den, unc = _f32(x), _f32(denoised), _f32(uncond)
    plan = _dpmpp_2s_plan(sigma, sigma_next, eta, midpoint)
    sigma_down, sigma_up = ancestral_step(sigma, sigma_next, eta)
    if midpoint:
        if plan is None:
            raise ValueError("sampler_dpmpp_2s_ancestral_cfg_pp_step: no midpoint stage when sigma_down is 0")
        ratio, cden = plan
        return _finish(ratio * (xf + (den - unc)) + cden * den, x, flags, step)
    if plan is None:
        out = den + (xf - unc) / sigma * sigma_down
    else:
        if denoised_2 is None:
            raise ValueError("sampler_dpmpp_2s_ancestral_cfg_pp_step: the second stage needs denoised_2")
        ratio, cden2 = plan
        out = ratio * (xf + (den - unc)) + cden2 * _f32(denoised_2)
    if sigma_next > 0 and sigma_up != 0:
        out = out + _noise_ref(noise, x, "sampler_dpmpp_2s_ancestral_cfg_pp_step") * s_noise * sigma_up
    return _finish(out, x, flags, step)


def dpmpp_2s_ancestral_cfg_pp_metal(lib, x, denoised, uncond, denoised_2=None, sigma=1.0, sigma_next=0.0, noise=None,
                                    *, eta=1.0, s_noise=1.0, midpoint=False, flags=None, step=-1):
    _check_same("sampler_dpmpp_2s_ancestral_cfg_pp_step", x, denoised=denoised, uncond=uncond, denoised_2=denoised_2)
    plan = _dpmpp_2s_plan(sigma, sigma_next, eta, midpoint)
    sigma_down, sigma_up = ancestral_step(sigma, sigma_next, eta)
    if midpoint:
        if plan is None:
            raise ValueError("sampler_dpmpp_2s_ancestral_cfg_pp_step: no midpoint stage when sigma_down is 0")
        ratio, cden = plan
        return _launch_lincomb(lib, _merged([(x, ratio), (denoised, ratio + cden), (uncond, -ratio)]),
                               flags=flags, step=step)
    if plan is None:
        q = sigma_down / sigma
        terms = [(x, q), (denoised, 1.0), (uncond, -q)]
    else:
        if denoised_2 is None:
            raise ValueError("sampler_dpmpp_2s_ancestral_cfg_pp_step: the second stage needs denoised_2")
        ratio, cden2 = plan
        terms = [(x, ratio), (denoised, ratio), (uncond, -ratio), (denoised_2, cden2)]
    cn = s_noise * sigma_up if (sigma_next > 0 and sigma_up != 0) else 0.0
    return _launch_lincomb(lib, _merged(terms), noise, cn, flags, step)


# --------------------------------------------------------------------------------------------
# Self-check cases (odd sizes, every dtype, first/middle/last steps, tensor and device noise)
# --------------------------------------------------------------------------------------------


def _tensors(device, shape, dtype, n, seed):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=gen) * 3).to(dtype).to(device) for _ in range(n)]


_SHAPES = [((1, 3, 5, 7), torch.float32), ((2, 1, 3, 11), torch.float16), ((37,), torch.bfloat16)]


def _bridge_noise():
    return BrownianBridge(1234).increment(3.7, 2.1)


def _cases_noise(device):
    out = []
    for shape, dtype in _SHAPES:
        (like,) = _tensors(device, shape, dtype, 1, 1)
        out.append(((like, _bridge_noise()), {}))
        out.append(((like, iid_noise(7, 3)), {}))
    return out


def _cases_churn(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, n = _tensors(device, shape, dtype, 2, 10 + i)
        out.append(((x, n, 2.0, 2.4), {"s_noise": 0.9}))
        out.append(((x, iid_noise(3, i), 2.0, 2.4), {}))
    return out


def _cases_euler(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d = _tensors(device, shape, dtype, 2, 20 + i)
        out += [((x, d, 14.6, 9.7), {}), ((x, d, 0.5, 0.0), {}), ((x, d, 0.9, 0.75), {})]
    return out


def _cases_euler_ancestral(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, n = _tensors(device, shape, dtype, 3, 30 + i)
        out += [((x, d, 14.6, 9.7, n), {}), ((x, d, 3.0, 2.0, _bridge_noise()), {"eta": 0.7, "s_noise": 1.1}),
                ((x, d, 0.5, 0.0, None), {}), ((x, d, 0.9, 0.75, n), {"flow": True}),
                ((x, d, 0.9, 0.75, iid_noise(1, 2)), {"flow": True, "eta": 0.5}),
                ((x, d, 0.3, 0.0, None), {"flow": True}), ((x, d, 2.0, 1.0, None), {"eta": 0.0})]
    return out


def _cases_heun(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, d2 = _tensors(device, shape, dtype, 3, 40 + i)
        out += [((x, d, d2, 14.6, 9.7), {}), ((x, d, d2, 0.9, 0.75), {})]
    return out


def _cases_dpmpp_2m(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, o = _tensors(device, shape, dtype, 3, 50 + i)
        out += [((x, d, None, 14.6, 9.7), {}), ((x, d, o, 9.7, 6.1, 14.6), {}), ((x, d, o, 0.4, 0.0, 0.8), {})]
    return out


def _cases_dpmpp_2m_sde(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, o, n = _tensors(device, shape, dtype, 4, 60 + i)
        out += [((x, d, None, 14.6, 9.7, None, n), {}),
                ((x, d, o, 9.7, 6.1, 0.4, _bridge_noise()), {"eta": 0.8, "s_noise": 0.9}),
                ((x, d, o, 9.7, 6.1, 0.4, n), {"solver_type": "heun"}),
                ((x, d, o, 0.8, 0.6, 0.3, n), {"flow": True}),
                ((x, d, o, 0.4, 0.0, 0.3, None), {})]
    return out


def _cases_dpmpp_3m_sde(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, d1, d2, n = _tensors(device, shape, dtype, 5, 70 + i)
        out += [((x, d, None, None, 14.6, 9.7, None, None, n), {}),
                ((x, d, d1, None, 9.7, 6.1, 0.4, None, _bridge_noise()), {}),
                ((x, d, d1, d2, 6.1, 3.9, 0.45, 0.4, n), {"eta": 0.6}),
                ((x, d, d1, d2, 0.8, 0.6, 0.3, 0.2, n), {"flow": True, "s_noise": 1.2}),
                ((x, d, d1, d2, 0.4, 0.0, 0.3, 0.2, None), {})]
    return out


def _cases_lcm(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        d, n = _tensors(device, shape, dtype, 2, 80 + i)
        out += [((d, n, 3.2, 1.0), {}), ((d, iid_noise(5, 1), 0.6, 0.4), {}), ((d, None, 0.0, 1.0), {})]
    return out


def _cases_res_multistep(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, o, n = _tensors(device, shape, dtype, 4, 90 + i)
        out += [((x, d, None, 14.6, 9.7), {}), ((x, d, o, 9.7, 6.1, 14.6, 9.7), {}),
                ((x, d, o, 9.7, 6.1, 14.6, 8.0, n), {"eta": 1.0}), ((x, d, o, 0.4, 0.0, 0.8, 0.4), {})]
    return out


def _cases_euler_cfg_pp(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, u, n = _tensors(device, shape, dtype, 4, 100 + i)
        out += [((x, d, u, 14.6, 9.7), {}), ((x, d, d, 9.7, 6.1), {}), ((x, d, u, 0.5, 0.0), {}),
                ((x, d, u, 14.6, 9.7, n), {"eta": 1.0}),
                ((x, d, u, 3.0, 2.0, iid_noise(2, 1)), {"eta": 0.7, "s_noise": 1.1}),
                ((x, d, u, 0.9, 0.75), {"flow": True}), ((x, d, u, 1.0, 0.8, n), {"flow": True, "eta": 1.0}),
                ((x, d, u, 0.9, 0.75, iid_noise(4, 2)), {"flow": True, "eta": 0.5}),
                ((x, d, u, 0.3, 0.0, None), {"flow": True, "eta": 1.0})]
    return out


def _cases_dpmpp_2m_cfg_pp(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, u, o = _tensors(device, shape, dtype, 4, 110 + i)
        out += [((x, d, u, None, 14.6, 9.7), {}), ((x, d, u, o, 9.7, 6.1, 14.6), {}),
                ((x, d, d, o, 9.7, 6.1, 14.6), {}), ((x, d, u, o, 0.4, 0.0, 0.8), {})]
    return out


def _cases_res_multistep_cfg_pp(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, u, o, n = _tensors(device, shape, dtype, 5, 120 + i)
        out += [((x, d, u, None, 14.6, 9.7), {}), ((x, d, u, o, 9.7, 6.1, 14.6, 9.7), {}),
                ((x, d, u, o, 9.7, 6.1, 14.6, 8.0, n), {"eta": 1.0, "s_noise": 0.9}),
                ((x, d, u, None, 14.6, 9.7, None, None, iid_noise(6, 0)), {"eta": 0.5}),
                ((x, d, u, o, 0.4, 0.0, 0.8, 0.4), {})]
    return out


def _cases_dpmpp_2s_ancestral_cfg_pp(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, u, d2, n = _tensors(device, shape, dtype, 5, 130 + i)
        out += [((x, d, u, None, 14.6, 9.7), {"midpoint": True}), ((x, d, u, d2, 14.6, 9.7, n), {}),
                ((x, d, u, d2, 3.0, 2.0, iid_noise(3, 1)), {"eta": 0.6, "s_noise": 1.1}),
                ((x, d, u, None, 0.9, 0.75), {"midpoint": True, "eta": 0.0}), ((x, d, u, d2, 0.9, 0.75), {"eta": 0.0}),
                ((x, d, d, d2, 3.0, 2.0, n), {}), ((x, d, u, None, 0.4, 0.0), {}),
                ((x, d, u, None, 2.0, 1.0, n), {"eta": 5.0})]  # sigma_up = sigma_next: sigma_down 0, noise
    return out


# fp32: the fused form re-associates ComfyUI's expression and the kernel's log/cos may differ in the
# last bits from torch's, so a few ulps of the largest term; fp16/bf16 get the dtype floor on top.
_ATOL, _RTOL = 2e-5, 2e-5


def _spec(name, ref, metal, cases, entries=_LINCOMB_ENTRIES):
    return register(KernelSpec(name=name, source="sampling.metal", entry_points=entries, reference=ref, metal=metal,
                               self_check_cases=cases, atol=_ATOL, rtol=_RTOL))


sampler_device_noise = _spec("sampler_device_noise", device_noise_ref, device_noise_metal, _cases_noise,
                             _entry("noise"))
sampler_churn_step = _spec("sampler_churn_step", churn_ref, churn_metal, _cases_churn)
sampler_euler_step = _spec("sampler_euler_step", euler_ref, euler_metal, _cases_euler)
sampler_euler_ancestral_step = _spec("sampler_euler_ancestral_step", euler_ancestral_ref, euler_ancestral_metal,
                                     _cases_euler_ancestral)
sampler_heun_step = _spec("sampler_heun_step", heun_ref, heun_metal, _cases_heun)
sampler_dpmpp_2m_step = _spec("sampler_dpmpp_2m_step", dpmpp_2m_ref, dpmpp_2m_metal, _cases_dpmpp_2m)
sampler_dpmpp_2m_sde_step = _spec("sampler_dpmpp_2m_sde_step", dpmpp_2m_sde_ref, dpmpp_2m_sde_metal,
                                  _cases_dpmpp_2m_sde)
sampler_dpmpp_3m_sde_step = _spec("sampler_dpmpp_3m_sde_step", dpmpp_3m_sde_ref, dpmpp_3m_sde_metal,
                                  _cases_dpmpp_3m_sde)
sampler_lcm_step = _spec("sampler_lcm_step", lcm_ref, lcm_metal, _cases_lcm)
sampler_res_multistep_step = _spec("sampler_res_multistep_step", res_multistep_ref, res_multistep_metal,
                                   _cases_res_multistep)
sampler_euler_cfg_pp_step = _spec("sampler_euler_cfg_pp_step", euler_cfg_pp_ref, euler_cfg_pp_metal,
                                  _cases_euler_cfg_pp)
sampler_dpmpp_2m_cfg_pp_step = _spec("sampler_dpmpp_2m_cfg_pp_step", dpmpp_2m_cfg_pp_ref, dpmpp_2m_cfg_pp_metal,
                                     _cases_dpmpp_2m_cfg_pp)
sampler_res_multistep_cfg_pp_step = _spec("sampler_res_multistep_cfg_pp_step", res_multistep_cfg_pp_ref,
                                          res_multistep_cfg_pp_metal, _cases_res_multistep_cfg_pp)
sampler_dpmpp_2s_ancestral_cfg_pp_step = _spec("sampler_dpmpp_2s_ancestral_cfg_pp_step", dpmpp_2s_ancestral_cfg_pp_ref,
                                               dpmpp_2s_ancestral_cfg_pp_metal, _cases_dpmpp_2s_ancestral_cfg_pp)
