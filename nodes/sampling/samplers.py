"""The step loop of the Metal samplers and the plain ones: ComfyUI's euler, euler_ancestral, heun, dpmpp_2m,
dpmpp_2m_sde, dpmpp_3m_sde, lcm and res_multistep, each step (each stage for heun) one fused kernel
(`metal_kernels.sampling`), no host sync inside the step loop. The table of every sampler is functions.py.

* `sample_<name>_metal(model, x, sigmas, extra_args, callback, disable, ...)`: the k-diffusion
  signature and options of ComfyUI's `sample_<name>`, plus `noise_mode` ("auto" | "fast" | "exact").
  The schedule is read to the host once before the loop (`sigmas.tolist()`), every per-step
  coefficient is computed on the host from that list, and NaN/inf is recorded on the device per
  step and checked once after the loop.
* Noise: "exact" draws from ComfyUI's own noise sampler (BrownianTreeNoiseSampler for the SDE
  samplers, default_noise_sampler for the ancestral ones, the same seed), so results equal
  ComfyUI's. "fast" generates the noise inside the step kernel from a counter-based hash: a Brownian
  bridge (virtual Brownian tree, `sampling.BrownianBridge`) for the SDE samplers, one i.i.d. normal
  per step for the ancestral ones. "auto" (the default; env COMFY_METAL_SAMPLER_NOISE overrides it)
  is fast on MPS, where exact noise costs host syncs, and exact elsewhere (CPU, CUDA), where host
  syncs cost nothing and the hashed noise is the slower one; exact falls back to fast when ComfyUI is
  not importable. A `noise_sampler` passed by the caller is always used as given.
"""
from __future__ import annotations

import logging
import math
import os
import sys

import torch

from ...metal_kernels import sampling as K

log = logging.getLogger("comfy_metal")

NOISE_MODES = ("fast", "exact")
NOISE_CHOICES = ("auto",) + NOISE_MODES   # "auto": default_noise_mode(device)
NOISE_ENV = "COMFY_METAL_SAMPLER_NOISE"


class SamplingError(ValueError):
    """Bad input to a Metal sampler, or a NaN/inf produced while sampling."""


def default_noise_mode(device) -> str:
    """The noise mode for noise_mode "auto" on `device`: COMFY_METAL_SAMPLER_NOISE if set, else "fast"
    on MPS (in-kernel noise, no host sync) and "exact" elsewhere (ComfyUI's noise sampler: on CPU and
    CUDA host syncs cost nothing, and the hashed noise is slower there than torch's generator)."""
    value = os.environ.get(NOISE_ENV, "").strip().lower() or "auto"
    if value not in NOISE_CHOICES:
        raise SamplingError(f"{NOISE_ENV}={value!r} is not one of {', '.join(NOISE_CHOICES)}")
    if value != "auto":
        return value
    return "fast" if torch.device(device).type == "mps" else "exact"


# --------------------------------------------------------------------------------------------
# Model sampling (epsilon vs flow) as ComfyUI's samplers find it
# --------------------------------------------------------------------------------------------

def _patcher_model_sampling(model):
    inner = getattr(model, "inner_model", None)
    patcher = getattr(inner, "model_patcher", None)
    if patcher is not None and hasattr(patcher, "get_model_object"):
        try:
            return patcher.get_model_object("model_sampling")
        except Exception:  # older/odd wrappers: fall back to the model's own attribute
            pass
    return getattr(getattr(inner, "inner_model", None), "model_sampling", None)


def _inner_model_sampling(model):
    inner = getattr(model, "inner_model", None)
    ms = getattr(getattr(inner, "inner_model", None), "model_sampling", None)
    return ms if ms is not None else _patcher_model_sampling(model)


def is_flow(model_sampling) -> bool:
    """True for rectified-flow (CONST) model sampling: Flux, SD3, Wan, Qwen-Image, ..."""
    if model_sampling is None:
        return False
    cms = sys.modules.get("comfy.model_sampling")
    if cms is not None and isinstance(model_sampling, getattr(cms, "CONST", ())):
        return True
    return any(c.__name__ == "CONST" for c in type(model_sampling).__mro__)


def _noise_scale(model_sampling) -> float:
    return float(getattr(model_sampling, "noise_scale", 1.0))


# --------------------------------------------------------------------------------------------
# One sampler run: validation, schedule on the host, noise, NaN record
# --------------------------------------------------------------------------------------------

def _trange(n, disable):
    """ComfyUI's console progress bar where it exists (tqdm elsewhere); the UI's bar runs off the callback."""
    try:
        from comfy.utils import model_trange

        return model_trange(n, disable=disable)
    except Exception:
        pass
    try:
        from tqdm.auto import trange

        return trange(n, disable=disable)
    except Exception:
        return range(n)


class _Run:
    def __init__(self, name, model, x, sigmas, extra_args, noise_mode):
        self.name = f"{name}_metal"
        self.extra_args = {} if extra_args is None else extra_args
        mode = "auto" if noise_mode is None else str(noise_mode).lower()
        if mode not in NOISE_CHOICES:
            raise SamplingError(f"{self.name}: noise_mode {noise_mode!r} is not one of {', '.join(NOISE_CHOICES)}")
        if not isinstance(x, torch.Tensor) or not x.is_floating_point():
            raise SamplingError(f"{self.name}: the latent must be a floating-point tensor, got "
                                f"{type(x).__name__} {getattr(x, 'dtype', '')}")
        if x.dtype not in K.MSL_TYPE:
            raise SamplingError(f"{self.name}: latent dtype {x.dtype} is not supported (float32, float16, bfloat16)")
        if not isinstance(sigmas, torch.Tensor) or sigmas.dim() != 1:
            raise SamplingError(f"{self.name}: sigmas must be a 1-D tensor, got "
                                f"{tuple(getattr(sigmas, 'shape', ()))}")
        # The one read of the schedule to the host, and the one check of the input latent.
        self.sig = [float(s) for s in sigmas.tolist()]
        bad = [i for i, s in enumerate(self.sig) if not math.isfinite(s) or s < 0]
        if bad:
            raise SamplingError(f"{self.name}: sigma schedule has NaN/inf/negative values at index {bad[0]} "
                                f"(sigmas = {self.sig})")
        for i in range(len(self.sig) - 1):
            if not self.sig[i + 1] < self.sig[i]:
                raise SamplingError(f"{self.name}: sigma schedule must be strictly decreasing, but sigma[{i + 1}] = "
                                    f"{self.sig[i + 1]:g} >= sigma[{i}] = {self.sig[i]:g} (sigmas = {self.sig}); "
                                    "use a built-in sampler for increasing (unsampling) schedules")
        if x.numel() and not bool(torch.isfinite(x).all()):
            raise SamplingError(f"{self.name}: the input latent (shape {tuple(x.shape)}) contains NaN or inf")
        self.noise_auto = mode == "auto"
        self.noise_mode = default_noise_mode(x.device) if self.noise_auto else mode
        self.steps = max(len(self.sig) - 1, 0)
        self.flags = torch.zeros(max(self.steps, 1), dtype=torch.int32, device=x.device)
        self.x = x

    # noise -------------------------------------------------------------------------------
    def noise_source(self, kind, sigmas, noise_sampler, original_sigmas=None, cpu=True, between=False):
        """Return noise(i) for the step i (tensor or DeviceNoise). kind: "brownian" | "iid"; cpu: where
        ComfyUI's Brownian tree runs in exact mode (False for its *_gpu samplers). between=True (Brownian):
        noise(s, t) for any two sigmas (host floats) instead, as noise_sampler(s, t)."""
        x = self.x
        seed = self.extra_args.get("seed", None)
        if noise_sampler is not None:
            if between:
                return lambda a, b: noise_sampler(_as_sigma(a, sigmas), _as_sigma(b, sigmas))
            return lambda i: noise_sampler(sigmas[i], sigmas[i + 1])
        if self.noise_mode == "exact":
            try:
                import comfy.k_diffusion.sampling as kds
            except ImportError as e:
                if self.noise_auto:   # chosen, not asked for: outside ComfyUI (bench, doctor) use the hashed noise
                    log.info("comfy_metal: %s: ComfyUI is not importable, so fast noise instead of exact", self.name)
                    self.noise_mode = "fast"
                    return self.noise_source(kind, sigmas, noise_sampler, original_sigmas, cpu)
                raise SamplingError(f"{self.name}: noise_mode='exact' uses ComfyUI's noise sampler, and ComfyUI "
                                    f"is not importable ({e})") from e
            if kind == "brownian":
                src = sigmas if original_sigmas is None else original_sigmas
                sigma_min, sigma_max = src[src > 0].min(), src.max()
                ns = kds.BrownianTreeNoiseSampler(x, sigma_min, sigma_max, seed=seed, cpu=cpu)
            else:
                ns = kds.default_noise_sampler(x, seed=seed)
            if between:
                return lambda a, b: ns(_as_sigma(a, sigmas), _as_sigma(b, sigmas))
            return lambda i: ns(sigmas[i], sigmas[i + 1])
        if isinstance(seed, (list, tuple)):
            seed = hash(tuple(int(s) for s in seed)) & ((1 << 63) - 1)
        if seed is None:
            seed = int(torch.randint(0, 2 ** 62, (), device="cpu"))
        seed = int(seed)
        if kind == "brownian":
            bridge = K.BrownianBridge(seed)
            if self.sig and max(self.sig) > bridge.length:
                raise SamplingError(f"{self.name}: sigma_max {max(self.sig):g} exceeds the fast Brownian noise "
                                    f"range [0, {bridge.length:g}]; use noise_mode='exact'")
            if between:
                return bridge.increment
            return lambda i: bridge.increment(self.sig[i], self.sig[i + 1])
        return lambda i: K.iid_noise(seed, i)

    # end ---------------------------------------------------------------------------------
    def finish(self, x):
        """The one read after the loop: which steps produced NaN/inf (device-side record)."""
        if self.steps:
            flagged = self.flags.tolist()
            for i, f in enumerate(flagged[:self.steps]):
                if f:
                    raise SamplingError(
                        f"{self.name}: the latent became NaN/inf at step {i + 1} of {self.steps} (i={i}, sigma "
                        f"{self.sig[i]:g} -> {self.sig[i + 1]:g}); the model output (denoised) or the step "
                        "diverged there")
        return x


def _as_sigma(value, sigmas):
    """A host sigma as the CPU scalar tensor of the schedule's dtype ComfyUI's noise samplers are called with."""
    return torch.tensor(float(value), dtype=sigmas.dtype)


def _callback(callback, x, i, sigma, sigma_hat, denoised):
    if callback is not None:
        callback({"x": x, "i": i, "sigma": sigma, "sigma_hat": sigma_hat, "denoised": denoised})


def _churn(s_churn, s_tmin, s_tmax, steps, sigma):
    if s_churn > 0:
        return min(s_churn / steps, 2 ** 0.5 - 1) if s_tmin <= sigma <= s_tmax else 0.0
    return 0.0


# --------------------------------------------------------------------------------------------
# The samplers (ComfyUI signatures + noise_mode)
# --------------------------------------------------------------------------------------------

@torch.no_grad()
def sample_euler_metal(model, x, sigmas, extra_args=None, callback=None, disable=None, s_churn=0., s_tmin=0.,
                       s_tmax=float("inf"), s_noise=1., noise_mode=None):
    run = _Run("euler", model, x, sigmas, extra_args, noise_mode)
    sig, extra_args = run.sig, run.extra_args
    s_in = x.new_ones([x.shape[0]])
    for i in _trange(run.steps, disable):
        gamma = _churn(s_churn, s_tmin, s_tmax, run.steps, sig[i])
        sigma_hat = sigmas[i] * (gamma + 1) if s_churn > 0 else sigmas[i]
        sigma_hat_f = sig[i] * (gamma + 1)
        if gamma > 0:
            x = K.sampler_churn_step(x, torch.randn_like(x), sig[i], sigma_hat_f, s_noise, flags=run.flags, step=i)
        denoised = model(x, sigma_hat * s_in, **extra_args)
        _callback(callback, x, i, sigmas[i], sigma_hat, denoised)
        x = K.sampler_euler_step(x, denoised, sigma_hat_f, sig[i + 1], flags=run.flags, step=i)
    return run.finish(x)


@torch.no_grad()
def sample_euler_ancestral_metal(model, x, sigmas, extra_args=None, callback=None, disable=None, eta=1., s_noise=1.,
                                 noise_sampler=None, noise_mode=None):
    run = _Run("euler_ancestral", model, x, sigmas, extra_args, noise_mode)
    sig, extra_args = run.sig, run.extra_args
    flow = is_flow(_inner_model_sampling(model))
    if flow:
        s_noise = s_noise * _noise_scale(_patcher_model_sampling(model))
    noise = run.noise_source("iid", sigmas, noise_sampler) if run.steps else None
    s_in = x.new_ones([x.shape[0]])
    for i in _trange(run.steps, disable):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        _callback(callback, x, i, sigmas[i], sigmas[i], denoised)
        if flow:
            draws = sig[i + 1] != 0 and eta > 0
        else:
            draws = K.ancestral_step(sig[i], sig[i + 1], eta)[0] != 0  # ComfyUI draws even when sigma_up == 0
        n = noise(i) if draws else None
        x = K.sampler_euler_ancestral_step(x, denoised, sig[i], sig[i + 1], n, eta=eta, s_noise=s_noise, flow=flow,
                                           flags=run.flags, step=i)
    return run.finish(x)


@torch.no_grad()
def sample_heun_metal(model, x, sigmas, extra_args=None, callback=None, disable=None, s_churn=0., s_tmin=0.,
                      s_tmax=float("inf"), s_noise=1., noise_mode=None):
    run = _Run("heun", model, x, sigmas, extra_args, noise_mode)
    sig, extra_args = run.sig, run.extra_args
    s_in = x.new_ones([x.shape[0]])
    for i in _trange(run.steps, disable):
        gamma = _churn(s_churn, s_tmin, s_tmax, run.steps, sig[i])
        sigma_hat = sigmas[i] * (gamma + 1)
        sigma_hat_f = sig[i] * (gamma + 1)
        if gamma > 0:
            x = K.sampler_churn_step(x, torch.randn_like(x), sig[i], sigma_hat_f, s_noise, flags=run.flags, step=i)
        denoised = model(x, sigma_hat * s_in, **extra_args)
        _callback(callback, x, i, sigmas[i], sigma_hat, denoised)
        if sig[i + 1] == 0:
            x = K.sampler_euler_step(x, denoised, sigma_hat_f, 0.0, flags=run.flags, step=i)
        else:
            x_2 = K.sampler_euler_step(x, denoised, sigma_hat_f, sig[i + 1], flags=run.flags, step=i)
            denoised_2 = model(x_2, sigmas[i + 1] * s_in, **extra_args)
            x = K.sampler_heun_step(x, denoised, denoised_2, sigma_hat_f, sig[i + 1], flags=run.flags, step=i)
    return run.finish(x)


@torch.no_grad()
def sample_dpmpp_2m_metal(model, x, sigmas, extra_args=None, callback=None, disable=None, noise_mode=None):
    run = _Run("dpmpp_2m", model, x, sigmas, extra_args, noise_mode)
    sig, extra_args = run.sig, run.extra_args
    s_in = x.new_ones([x.shape[0]])
    old_denoised = None
    for i in _trange(run.steps, disable):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        _callback(callback, x, i, sigmas[i], sigmas[i], denoised)
        x = K.sampler_dpmpp_2m_step(x, denoised, old_denoised, sig[i], sig[i + 1], sig[i - 1] if i else None,
                                    flags=run.flags, step=i)
        old_denoised = denoised
    return run.finish(x)


def _offset_first_sigma(run, sigmas, model_sampling, flow, percent_offset=1e-4):
    """ComfyUI's offset_first_sigma_for_snr: a flow schedule starting at sigma >= 1 starts just below 1."""
    if len(run.sig) <= 1 or not flow or run.sig[0] < 1:
        return sigmas
    value = model_sampling.percent_to_sigma(percent_offset)
    sigmas = sigmas.clone()
    sigmas[0] = value
    run.sig = list(run.sig)
    run.sig[0] = float(torch.tensor(float(value), dtype=sigmas.dtype))
    return sigmas


def _sde_setup(name, model, x, sigmas, extra_args, noise_mode, noise_sampler, s_noise, cpu=True, between=False):
    """What the SDE samplers share: the run, flow or not, the schedule with ComfyUI's first-sigma offset,
    the Brownian noise source, and s_noise times the model's noise scale."""
    run = _Run(name, model, x, sigmas, extra_args, noise_mode)
    model_sampling = _patcher_model_sampling(model)
    flow = is_flow(model_sampling)
    offset = _offset_first_sigma(run, sigmas, model_sampling, flow)
    # ComfyUI sizes its Brownian tree on the original schedule and queries it with the offset one.
    noise = run.noise_source("brownian", offset, noise_sampler, original_sigmas=sigmas, cpu=cpu, between=between)
    return run, flow, offset, noise, s_noise * _noise_scale(model_sampling)


@torch.no_grad()
def sample_dpmpp_2m_sde_metal(model, x, sigmas, extra_args=None, callback=None, disable=None, eta=1., s_noise=1.,
                              noise_sampler=None, solver_type="midpoint", noise_mode=None, _name="dpmpp_2m_sde",
                              _cpu_tree=True):
    if len(sigmas) <= 1:
        return x
    if solver_type not in {"heun", "midpoint"}:
        raise SamplingError("dpmpp_2m_sde_metal: solver_type must be 'heun' or 'midpoint'")
    run, flow, sigmas, noise, s_noise = _sde_setup(_name, model, x, sigmas, extra_args, noise_mode,
                                                  noise_sampler, s_noise, cpu=_cpu_tree)
    extra_args, sig = run.extra_args, run.sig
    s_in = x.new_ones([x.shape[0]])
    old_denoised, h, h_last = None, None, None
    for i in _trange(run.steps, disable):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        _callback(callback, x, i, sigmas[i], sigmas[i], denoised)
        if sig[i + 1] == 0:
            x = K.sampler_dpmpp_2m_sde_step(x, denoised, None, sig[i], 0.0, flags=run.flags, step=i)
        else:
            h = K.dpmpp_sde_h(sig[i], sig[i + 1], flow)
            n = noise(i) if (eta > 0 and s_noise > 0) else None
            x = K.sampler_dpmpp_2m_sde_step(x, denoised, old_denoised, sig[i], sig[i + 1], h_last, n, eta=eta,
                                            s_noise=s_noise, solver_type=solver_type, flow=flow,
                                            flags=run.flags, step=i)
        old_denoised = denoised
        h_last = h
    return run.finish(x)


@torch.no_grad()
def sample_dpmpp_3m_sde_metal(model, x, sigmas, extra_args=None, callback=None, disable=None, eta=1., s_noise=1.,
                              noise_sampler=None, noise_mode=None):
    if len(sigmas) <= 1:
        return x
    run, flow, sigmas, noise, s_noise = _sde_setup("dpmpp_3m_sde", model, x, sigmas, extra_args, noise_mode,
                                                  noise_sampler, s_noise)
    extra_args, sig = run.extra_args, run.sig
    s_in = x.new_ones([x.shape[0]])
    denoised_1, denoised_2 = None, None
    h, h_1, h_2 = None, None, None
    for i in _trange(run.steps, disable):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        _callback(callback, x, i, sigmas[i], sigmas[i], denoised)
        if sig[i + 1] == 0:
            x = K.sampler_dpmpp_3m_sde_step(x, denoised, None, None, sig[i], 0.0, flags=run.flags, step=i)
        else:
            h = K.dpmpp_sde_h(sig[i], sig[i + 1], flow)
            n = noise(i) if (eta > 0 and s_noise > 0) else None
            x = K.sampler_dpmpp_3m_sde_step(x, denoised, denoised_1 if h_1 is not None else None,
                                            denoised_2 if h_2 is not None else None, sig[i], sig[i + 1], h_1, h_2, n,
                                            eta=eta, s_noise=s_noise, flow=flow, flags=run.flags, step=i)
        denoised_1, denoised_2 = denoised, denoised_1
        h_1, h_2 = h, h_1
    return run.finish(x)


def _noise_scaling_coefficients(model_sampling, sigmas: list, ndim: int):
    """[(a, b)] per sigma with model_sampling.noise_scaling(sigma, noise, latent) == a*noise + b*latent,
    probed once on small CPU tensors before the loop (one call per probe for all sigmas); None for a
    sigma where it is not linear (then the sampler calls it directly)."""
    if not sigmas:
        return []
    if model_sampling is None:
        return [(s, 1.0) for s in sigmas]
    n = len(sigmas)
    s = torch.tensor(sigmas, dtype=torch.float32)
    shape = (n,) + (1,) * (ndim - 1)

    def probe(noise, latent):
        out = model_sampling.noise_scaling(s, torch.full(shape, float(noise)), torch.full(shape, float(latent)))
        return torch.as_tensor(out, dtype=torch.float32).reshape(n, -1)[:, 0].tolist()

    try:
        a, b, c = probe(1, 0), probe(0, 1), probe(2, 3)
    except Exception:
        return [None] * n
    return [(ai, bi) if math.isclose(ci, 2 * ai + 3 * bi, rel_tol=1e-5, abs_tol=1e-6) else None
            for ai, bi, ci in zip(a, b, c)]


@torch.no_grad()
def sample_lcm_metal(model, x, sigmas, extra_args=None, callback=None, disable=None, noise_sampler=None, s_noise=1.0,
                     s_noise_end=None, noise_clip_std=0.0, noise_mode=None):
    run = _Run("lcm", model, x, sigmas, extra_args, noise_mode)
    sig, extra_args = run.sig, run.extra_args
    if run.steps == 0:
        return x
    noise = run.noise_source("iid", sigmas, noise_sampler)
    model_sampling = _patcher_model_sampling(model)
    n_steps = run.steps
    s_start = float(s_noise)
    s_end = s_start if s_noise_end is None else float(s_noise_end)
    coeffs = _noise_scaling_coefficients(model_sampling, sig[1:], x.ndim)
    s_in = x.new_ones([x.shape[0]])
    for i in _trange(n_steps, disable):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        _callback(callback, x, i, sigmas[i], sigmas[i], denoised)
        if sig[i + 1] > 0:
            n = noise(i)
            t = (i / (n_steps - 1)) if n_steps > 1 else 0.0
            s_noise_i = s_start + (s_end - s_start) * t
            if noise_clip_std > 0:
                if isinstance(n, K.DeviceNoise):
                    n = K.sampler_device_noise(x, n)
                clip_val = noise_clip_std * n.std()
                n = n.clamp(min=-clip_val, max=clip_val)
            if coeffs[i] is None:  # non-linear noise_scaling: ComfyUI's own call (unfused)
                if isinstance(n, K.DeviceNoise):
                    n = K.sampler_device_noise(x, n)
                if s_noise_i != 1.0:
                    n = n * s_noise_i
                x = model_sampling.noise_scaling(sigmas[i + 1], n, denoised)
            else:
                a, b = coeffs[i]
                x = K.sampler_lcm_step(denoised, n, a * s_noise_i, b, flags=run.flags, step=i)
        else:
            x = K.sampler_lcm_step(denoised, None, 0.0, 1.0, flags=run.flags, step=i)
    return run.finish(x)


@torch.no_grad()
def sample_res_multistep_metal(model, x, sigmas, extra_args=None, callback=None, disable=None, s_noise=1.,
                               noise_sampler=None, noise_mode=None, eta=0.):
    """ComfyUI's res_multistep (eta=0). eta > 0 gives its res_multistep_ancestral."""
    run = _Run("res_multistep", model, x, sigmas, extra_args, noise_mode)
    sig, extra_args = run.sig, run.extra_args
    s_noise = s_noise * _noise_scale(_patcher_model_sampling(model))
    noise = run.noise_source("iid", sigmas, noise_sampler) if (run.steps and eta > 0) else None
    s_in = x.new_ones([x.shape[0]])
    old_denoised, old_sigma_down = None, None
    for i in _trange(run.steps, disable):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        sigma_down, sigma_up = K.ancestral_step(sig[i], sig[i + 1], eta)
        _callback(callback, x, i, sigmas[i], sigmas[i], denoised)
        n = noise(i) if sigma_up > 0 else None
        x = K.sampler_res_multistep_step(x, denoised, old_denoised, sig[i], sig[i + 1], sig[i - 1] if i else None,
                                         old_sigma_down, n, eta=eta, s_noise=s_noise, flags=run.flags, step=i)
        old_denoised = denoised
        old_sigma_down = sigma_down
    return run.finish(x)
