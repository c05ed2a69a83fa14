"""More of ComfyUI's samplers as `_metal`: ddim, dpmpp_2m_sde_gpu, res_multistep_ancestral (the samplers of
samplers.py under ComfyUI's other names and options), dpmpp_2s_ancestral, dpmpp_sde, er_sde,
gradient_estimation(_cfg_pp), ipndm and deis. Each step is one fused kernel (ipndm, deis: one more launch keeps
the step's derivative as history, as ComfyUI keeps it), no host sync inside the loop.
"""
from __future__ import annotations

import math

import torch

from ...metal_kernels import sampling as K

from .cfg_pp import _UncondCapture
from .samplers import (SamplingError, _Run, _callback, _inner_model_sampling, _noise_scale, _offset_first_sigma,
                       _patcher_model_sampling, _sde_setup,
                       _trange, is_flow,
                       sample_dpmpp_2m_sde_metal, sample_euler_metal, sample_res_multistep_metal)


@torch.no_grad()
def sample_ddim_metal(model, x, sigmas, extra_args=None, callback=None, disable=None, s_churn=0., s_tmin=0.,
                      s_tmax=float("inf"), s_noise=1., noise_mode=None):
    """ComfyUI's ddim: its euler sampler (ComfyUI adds the "random" inpaint option, which Metal Sampler Select
    passes; the KSampler list entry cannot)."""
    return sample_euler_metal(model, x, sigmas, extra_args, callback, disable, s_churn, s_tmin, s_tmax, s_noise,
                              noise_mode)


@torch.no_grad()
def sample_dpmpp_2m_sde_gpu_metal(model, x, sigmas, extra_args=None, callback=None, disable=None, eta=1., s_noise=1.,
                                  noise_sampler=None, solver_type="midpoint", noise_mode=None):
    """ComfyUI's dpmpp_2m_sde_gpu: dpmpp_2m_sde with its Brownian tree on the latent's device (exact noise)."""
    return sample_dpmpp_2m_sde_metal(model, x, sigmas, extra_args, callback, disable, eta, s_noise, noise_sampler,
                                     solver_type, noise_mode, _name="dpmpp_2m_sde_gpu", _cpu_tree=False)


@torch.no_grad()
def sample_res_multistep_ancestral_metal(model, x, sigmas, extra_args=None, callback=None, disable=None, eta=1.,
                                         s_noise=1., noise_sampler=None, noise_mode=None):
    """ComfyUI's res_multistep_ancestral."""
    return sample_res_multistep_metal(model, x, sigmas, extra_args, callback, disable, s_noise, noise_sampler,
                                      noise_mode, eta=eta)


def _rf_midpoint_sigma(sigma, sigma_down):
    """sample_dpmpp_2s_ancestral_RF's sigma_s: half way in lambda = logit(1 - sigma) (0.9999 at sigma 1)."""
    if sigma == 1.0:
        return 0.9999
    t_i, t_down = math.log((1 - sigma) / sigma), math.log((1 - sigma_down) / sigma_down)
    return 1 / (math.exp(t_i + 0.5 * (t_down - t_i)) + 1)


@torch.no_grad()
def sample_dpmpp_2s_ancestral_metal(model, x, sigmas, extra_args=None, callback=None, disable=None, eta=1.,
                                    s_noise=1., noise_sampler=None, noise_mode=None):
    """ComfyUI's dpmpp_2s_ancestral: two model calls per step; flow (CONST) models take its _RF form."""
    run = _Run("dpmpp_2s_ancestral", model, x, sigmas, extra_args, noise_mode)
    sig, extra_args = run.sig, run.extra_args
    model_sampling = _patcher_model_sampling(model)
    flow = is_flow(_inner_model_sampling(model))   # ComfyUI: model.inner_model.inner_model.model_sampling
    if flow:
        s_noise = s_noise * _noise_scale(model_sampling)
    noise = run.noise_source("iid", sigmas, noise_sampler) if run.steps else None
    s_in = x.new_ones([x.shape[0]])
    for i in _trange(run.steps, disable):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        _callback(callback, x, i, sigmas[i], sigmas[i], denoised)
        if flow:
            if sig[i + 1] == 0:
                x = K.sampler_euler_step(x, denoised, sig[i], 0.0, flags=run.flags, step=i)
                continue
            sigma_down = sig[i + 1] * (1 + (sig[i + 1] / sig[i] - 1) * eta)
            sigma_s = _rf_midpoint_sigma(sig[i], sigma_down)
            u = K.sampler_euler_step(x, denoised, sig[i], sigma_s, flags=run.flags, step=i)
            d_i = model(u, sigma_s * s_in, **extra_args)
            n = noise(i) if eta > 0 else None   # ComfyUI adds noise when sigma_next > 0 and eta > 0
            x = K.sampler_euler_ancestral_step(x, d_i, sig[i], sig[i + 1], n, eta=eta, s_noise=s_noise, flow=True,
                                               flags=run.flags, step=i)
            continue
        sigma_down, _ = K.ancestral_step(sig[i], sig[i + 1], eta)
        denoised_2 = None
        if sigma_down != 0:
            x_2 = K.sampler_dpmpp_2s_ancestral_cfg_pp_step(x, denoised, denoised, None, sig[i], sig[i + 1], eta=eta,
                                                           midpoint=True, flags=run.flags, step=i)
            sigma_s = K.dpmpp_2s_midpoint_sigma(sig[i], sigma_down)
            denoised_2 = model(x_2, sigma_s * s_in, **extra_args)
        n = noise(i) if sig[i + 1] > 0 else None   # ComfyUI draws on every step but the last (even at eta 0)
        # the CFG++ step with the denoised output as the unconditional one is the plain DPM-Solver++(2S) step
        x = K.sampler_dpmpp_2s_ancestral_cfg_pp_step(x, denoised, denoised, denoised_2, sig[i], sig[i + 1], n,
                                                     eta=eta, s_noise=s_noise, flags=run.flags, step=i)
    return run.finish(x)


def _gradient_estimation(name, model, x, sigmas, extra_args, callback, disable, ge_gamma, cfg_pp, noise_mode):
    run = _Run(name, model, x, sigmas, extra_args, noise_mode)
    capture = _UncondCapture(run) if cfg_pp else None
    sig, extra_args = run.sig, run.extra_args
    s_in = x.new_ones([x.shape[0]])
    prev = None   # (x, denoised, uncond) of the previous step
    for i in _trange(run.steps, disable):
        if cfg_pp:
            denoised, uncond = capture(model, x, sigmas[i] * s_in, extra_args)
        else:
            denoised, uncond = model(x, sigmas[i] * s_in, **extra_args), None
        _callback(callback, x, i, sigmas[i], sigmas[i], denoised)
        x_prev, den_prev, unc_prev = prev if prev is not None else (None, None, None)
        new = K.sampler_gradient_estimation_step(x, denoised, x_prev, den_prev, sig[i], sig[i + 1],
                                                 sig[i - 1] if i else None, uncond, unc_prev, ge_gamma=ge_gamma,
                                                 cfg_pp=cfg_pp, flags=run.flags, step=i)
        prev = (x, denoised, uncond)
        x = new
    return run.finish(x)


@torch.no_grad()
def sample_gradient_estimation_metal(model, x, sigmas, extra_args=None, callback=None, disable=None, ge_gamma=2.,
                                     noise_mode=None):
    """ComfyUI's gradient_estimation."""
    return _gradient_estimation("gradient_estimation", model, x, sigmas, extra_args, callback, disable, ge_gamma,
                                False, noise_mode)


@torch.no_grad()
def sample_gradient_estimation_cfg_pp_metal(model, x, sigmas, extra_args=None, callback=None, disable=None,
                                            ge_gamma=2., noise_mode=None):
    """ComfyUI's gradient_estimation_cfg_pp (the unconditional output through the post-CFG hook, as CFG++)."""
    return _gradient_estimation("gradient_estimation_cfg_pp", model, x, sigmas, extra_args, callback, disable,
                                ge_gamma, True, noise_mode)


@torch.no_grad()
def sample_ipndm_metal(model, x, sigmas, extra_args=None, callback=None, disable=None, max_order=4, noise_mode=None):
    """ComfyUI's ipndm (order up to max_order, 1 to 4)."""
    if not 1 <= int(max_order) <= 4:
        raise ValueError(f"ipndm_metal: max_order must be 1 to 4, got {max_order}")
    run = _Run("ipndm", model, x, sigmas, extra_args, noise_mode)
    sig, extra_args = run.sig, run.extra_args
    s_in = x.new_ones([x.shape[0]])
    history = []   # derivatives of the earlier steps, the latest first
    for i in _trange(run.steps, disable):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        _callback(callback, x, i, sigmas[i], sigmas[i], denoised)
        hist = (history[:min(max_order, i + 1) - 1] + [None] * 3)[:3]
        x_next = K.sampler_ipndm_step(x, denoised, *hist, sig[i], sig[i + 1], flags=run.flags, step=i)
        if i + 1 < run.steps and max_order > 1:   # the last step's derivative is never read
            history = [K.sampler_to_d_step(x, denoised, sig[i], flags=run.flags, step=i)] + history[:max_order - 2]
        x = x_next
    return run.finish(x)


@torch.no_grad()
def sample_deis_metal(model, x, sigmas, extra_args=None, callback=None, disable=None, max_order=3, deis_mode="tab",
                      noise_mode=None):
    """ComfyUI's deis (max_order 1 to 4, deis_mode "tab" or "rhoab"); its coefficients are computed on the host
    before the loop (K.deis_coefficients; other options are refused there, before any model call). Where
    ComfyUI v0.33's own sample_deis fails (max_order 1, rhoab beyond max_order + 1 steps) see
    metal_kernels/sampling/deis.py."""
    run = _Run("deis", model, x, sigmas, extra_args, noise_mode)
    order = int(max_order) if isinstance(max_order, float) and max_order == int(max_order) else max_order
    try:
        plans = K.deis_coefficients(run.sig, order, deis_mode)
    except ValueError as e:
        raise SamplingError(f"deis_metal: {e}") from e
    sig, extra_args = run.sig, run.extra_args
    # whether a later step reads step i's derivative (step j with k coefficients reads those of j-1 ... j-k+1)
    kept = [any(p is not None and j - i < len(p) for j, p in enumerate(plans) if j > i) for i in range(run.steps)]
    s_in = x.new_ones([x.shape[0]])
    history = []   # derivatives of the earlier steps, the latest first
    for i in _trange(run.steps, disable):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        _callback(callback, x, i, sigmas[i], sigmas[i], denoised)
        coefficients = plans[i]
        hist = history[:len(coefficients) - 1] if coefficients else []
        x_next = K.sampler_deis_step(x, denoised, *(hist + [None] * 3)[:3], sig[i], sig[i + 1],
                                     coefficients=coefficients, flags=run.flags, step=i)
        if kept[i]:
            history = [K.sampler_to_d_step(x, denoised, sig[i], flags=run.flags, step=i)] + history[:order - 2]
        x = x_next
    return run.finish(x)


@torch.no_grad()
def sample_dpmpp_sde_metal(model, x, sigmas, extra_args=None, callback=None, disable=None, eta=1., s_noise=1.,
                           noise_sampler=None, r=1 / 2, noise_mode=None):
    """ComfyUI's dpmpp_sde: two model calls per step, Brownian noise on [sigma, sigma_s_1] and [sigma, sigma_next]."""
    if len(sigmas) <= 1:
        return x
    run, flow, sigmas, noise, s_noise = _sde_setup("dpmpp_sde", model, x, sigmas, extra_args, noise_mode,
                                                  noise_sampler, s_noise, between=True)
    extra_args, sig = run.extra_args, run.sig
    noisy = eta > 0 and s_noise > 0
    s_in = x.new_ones([x.shape[0]])
    for i in _trange(run.steps, disable):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        _callback(callback, x, i, sigmas[i], sigmas[i], denoised)
        if sig[i + 1] == 0:
            x = K.sampler_dpmpp_sde_step(x, denoised, None, sig[i], 0.0, flags=run.flags, step=i)
            continue
        sigma_s_1 = K.dpmpp_sde_plan(sig[i], sig[i + 1], eta, r, flow)[0]
        n = noise(sig[i], sigma_s_1) if noisy else None
        x_2 = K.sampler_dpmpp_sde_step(x, denoised, None, sig[i], sig[i + 1], n, eta=eta, s_noise=s_noise, r=r,
                                       flow=flow, flags=run.flags, step=i)
        denoised_2 = model(x_2, sigma_s_1 * s_in, **extra_args)
        n = noise(sig[i], sig[i + 1]) if noisy else None
        x = K.sampler_dpmpp_sde_step(x, denoised, denoised_2, sig[i], sig[i + 1], n, eta=eta, s_noise=s_noise, r=r,
                                     flow=flow, flags=run.flags, step=i)
    return run.finish(x)


@torch.no_grad()
def sample_er_sde_metal(model, x, sigmas, extra_args=None, callback=None, disable=None, s_noise=1.0,
                        noise_sampler=None, noise_scaler=None, max_stage=3, noise_mode=None):
    """ComfyUI's er_sde (ER-SDE-Solver-3) with its default noise scaler; the per-step integrals are computed on
    the host before the loop."""
    if noise_scaler is not None:
        raise ValueError("er_sde_metal: a custom noise_scaler is not supported (its integrals are precomputed); "
                         "use ComfyUI's er_sde")
    if not 1 <= int(max_stage) <= 3:
        raise ValueError(f"er_sde_metal: max_stage must be 1 to 3, got {max_stage}")
    run = _Run("er_sde", model, x, sigmas, extra_args, noise_mode)
    sig, extra_args = run.sig, run.extra_args
    model_sampling = _patcher_model_sampling(model)
    flow = is_flow(model_sampling)
    sigmas = _offset_first_sigma(run, sigmas, model_sampling, flow)
    sig = run.sig
    s_noise = s_noise * _noise_scale(model_sampling)
    noise = run.noise_source("iid", sigmas, noise_sampler) if run.steps else None
    plans = K.er_sde_plans(sig, flow, int(max_stage))
    s_in = x.new_ones([x.shape[0]])
    old, old_2 = None, None
    for i in _trange(run.steps, disable):
        denoised = model(x, sigmas[i] * s_in, **extra_args)
        _callback(callback, x, i, sigmas[i], sigmas[i], denoised)
        plan = plans[i]
        n = noise(i) if (plan is not None and s_noise > 0) else None
        x = K.sampler_er_sde_step(x, denoised, old if plan and plan[0] >= 2 else None,
                                  old_2 if plan and plan[0] >= 3 else None, n, plan=plan, s_noise=s_noise,
                                  flags=run.flags, step=i)
        old, old_2 = denoised, old
    return run.finish(x)
