"""The CFG++ samplers (ComfyUI's *_cfg_pp): the step direction from the unconditional prediction,
captured through ComfyUI's post-CFG hook, the landing point from the guided one.

Like ComfyUI, the sampler adds a post-CFG function to extra_args["model_options"]
(comfy.model_patcher.set_model_options_post_cfg_function, with the cfg=1 shortcut disabled) to capture each
call's unconditional denoised output. Without ComfyUI loaded, or with a model function that runs no CFG (the
hook is never called), the unconditional output is taken to be the denoised output itself: then euler_cfg_pp /
dpmpp_2m_cfg_pp / res_multistep_cfg_pp give exactly euler / dpmpp_2m / res_multistep (ComfyUI's own would
fail). The step's unconditional output is one more input of the same fused kernel.
"""
from __future__ import annotations

import sys

import torch

from ...metal_kernels import sampling as K

from .samplers import _Run, _callback, _noise_scale, _patcher_model_sampling, _trange, is_flow

# --------------------------------------------------------------------------------------------
# CFG++: the unconditional denoised output of each model call
# --------------------------------------------------------------------------------------------

class _UncondCapture:
    """Captures the unconditional denoised output of each model call through ComfyUI's post-CFG hook
    (the mechanism of ComfyUI's own CFG++ samplers). Installs the hook on a copy of the run's
    extra_args / model_options (the caller's dicts are left as they are), only when ComfyUI is loaded
    in this process (comfy.model_patcher in sys.modules; the pack never imports ComfyUI itself)."""

    def __init__(self, run):
        self.value = None
        model_patcher = sys.modules.get("comfy.model_patcher")
        set_post_cfg = getattr(model_patcher, "set_model_options_post_cfg_function", None)
        if set_post_cfg is None:
            return
        extra_args = dict(run.extra_args)
        model_options = dict(extra_args.get("model_options", None) or {})
        extra_args["model_options"] = set_post_cfg(model_options, self._post_cfg, disable_cfg1_optimization=True)
        run.extra_args = extra_args

    def _post_cfg(self, args):
        self.value = args.get("uncond_denoised")
        return args["denoised"]

    def __call__(self, model, x, sigma, extra_args):
        """(denoised, uncond denoised) of one model call; uncond is `denoised` itself when no CFG ran."""
        self.value = None
        denoised = model(x, sigma, **extra_args)
        uncond, self.value = self.value, None
        return denoised, (denoised if uncond is None else uncond)


def _cfg_pp_euler(name, model, x, sigmas, extra_args, callback, disable, eta, s_noise, noise_sampler, noise_mode):
    run = _Run(name, model, x, sigmas, extra_args, noise_mode)
    capture = _UncondCapture(run)
    sig, extra_args = run.sig, run.extra_args
    model_sampling = _patcher_model_sampling(model)
    flow = is_flow(model_sampling)
    s_noise = s_noise * _noise_scale(model_sampling)
    noisy = eta > 0 and s_noise > 0
    noise = run.noise_source("iid", sigmas, noise_sampler) if (run.steps and noisy) else None
    s_in = x.new_ones([x.shape[0]])
    for i in _trange(run.steps, disable):
        denoised, uncond = capture(model, x, sigmas[i] * s_in, extra_args)
        _callback(callback, x, i, sigmas[i], sigmas[i], denoised)
        n = noise(i) if (noisy and sig[i + 1] != 0) else None  # ComfyUI draws on every step but the last
        x = K.sampler_euler_cfg_pp_step(x, denoised, uncond, sig[i], sig[i + 1], n, eta=eta, s_noise=s_noise,
                                        flow=flow, flags=run.flags, step=i)
    return run.finish(x)


@torch.no_grad()
def sample_euler_cfg_pp_metal(model, x, sigmas, extra_args=None, callback=None, disable=None, noise_mode=None):
    """ComfyUI's euler_cfg_pp (flow models: in alpha-scaled form, as ComfyUI)."""
    return _cfg_pp_euler("euler_cfg_pp", model, x, sigmas, extra_args, callback, disable, 0.0, 0.0, None,
                         noise_mode)


@torch.no_grad()
def sample_euler_ancestral_cfg_pp_metal(model, x, sigmas, extra_args=None, callback=None, disable=None, eta=1.,
                                        s_noise=1., noise_sampler=None, noise_mode=None):
    """ComfyUI's euler_ancestral_cfg_pp."""
    return _cfg_pp_euler("euler_ancestral_cfg_pp", model, x, sigmas, extra_args, callback, disable, eta, s_noise,
                         noise_sampler, noise_mode)


@torch.no_grad()
def sample_dpmpp_2m_cfg_pp_metal(model, x, sigmas, extra_args=None, callback=None, disable=None, noise_mode=None):
    """ComfyUI's dpmpp_2m_cfg_pp."""
    run = _Run("dpmpp_2m_cfg_pp", model, x, sigmas, extra_args, noise_mode)
    capture = _UncondCapture(run)
    sig, extra_args = run.sig, run.extra_args
    s_in = x.new_ones([x.shape[0]])
    old_uncond = None
    for i in _trange(run.steps, disable):
        denoised, uncond = capture(model, x, sigmas[i] * s_in, extra_args)
        _callback(callback, x, i, sigmas[i], sigmas[i], denoised)
        x = K.sampler_dpmpp_2m_cfg_pp_step(x, denoised, uncond, old_uncond, sig[i], sig[i + 1],
                                           sig[i - 1] if i else None, flags=run.flags, step=i)
        old_uncond = uncond
    return run.finish(x)


@torch.no_grad()
def sample_dpmpp_2s_ancestral_cfg_pp_metal(model, x, sigmas, extra_args=None, callback=None, disable=None, eta=1.,
                                           s_noise=1., noise_sampler=None, noise_mode=None):
    """ComfyUI's dpmpp_2s_ancestral_cfg_pp: two model calls per step (the second at the midpoint sigma);
    like ComfyUI's, the second stage uses the second call's unconditional output."""
    run = _Run("dpmpp_2s_ancestral_cfg_pp", model, x, sigmas, extra_args, noise_mode)
    capture = _UncondCapture(run)
    sig, extra_args = run.sig, run.extra_args
    s_noise = s_noise * _noise_scale(_patcher_model_sampling(model))
    noise = run.noise_source("iid", sigmas, noise_sampler) if run.steps else None
    s_in = x.new_ones([x.shape[0]])
    for i in _trange(run.steps, disable):
        denoised, uncond = capture(model, x, sigmas[i] * s_in, extra_args)
        sigma_down, _ = K.ancestral_step(sig[i], sig[i + 1], eta)
        _callback(callback, x, i, sigmas[i], sigmas[i], denoised)
        denoised_2 = None
        if sigma_down != 0:
            x_2 = K.sampler_dpmpp_2s_ancestral_cfg_pp_step(x, denoised, uncond, None, sig[i], sig[i + 1], eta=eta,
                                                           midpoint=True, flags=run.flags, step=i)
            sigma_s = K.dpmpp_2s_midpoint_sigma(sig[i], sigma_down)
            denoised_2, uncond = capture(model, x_2, sigmas[i] * (sigma_s / sig[i]) * s_in, extra_args)
        n = noise(i) if sig[i + 1] > 0 else None  # ComfyUI draws on every step but the last (even at eta 0)
        x = K.sampler_dpmpp_2s_ancestral_cfg_pp_step(x, denoised, uncond, denoised_2, sig[i], sig[i + 1], n, eta=eta,
                                                     s_noise=s_noise, flags=run.flags, step=i)
    return run.finish(x)


@torch.no_grad()
def sample_res_multistep_cfg_pp_metal(model, x, sigmas, extra_args=None, callback=None, disable=None, s_noise=1.,
                                      noise_sampler=None, noise_mode=None, eta=0.):
    """ComfyUI's res_multistep_cfg_pp (eta=0). eta > 0 gives its res_multistep_ancestral_cfg_pp."""
    run = _Run("res_multistep_cfg_pp", model, x, sigmas, extra_args, noise_mode)
    capture = _UncondCapture(run)
    sig, extra_args = run.sig, run.extra_args
    s_noise = s_noise * _noise_scale(_patcher_model_sampling(model))
    noise = run.noise_source("iid", sigmas, noise_sampler) if (run.steps and eta > 0) else None
    s_in = x.new_ones([x.shape[0]])
    old_uncond, old_sigma_down = None, None
    for i in _trange(run.steps, disable):
        denoised, uncond = capture(model, x, sigmas[i] * s_in, extra_args)
        sigma_down, sigma_up = K.ancestral_step(sig[i], sig[i + 1], eta)
        _callback(callback, x, i, sigmas[i], sigmas[i], denoised)
        n = noise(i) if sigma_up > 0 else None
        x = K.sampler_res_multistep_cfg_pp_step(x, denoised, uncond, old_uncond, sig[i], sig[i + 1],
                                                sig[i - 1] if i else None, old_sigma_down, n, eta=eta,
                                                s_noise=s_noise, flags=run.flags, step=i)
        old_uncond = uncond
        old_sigma_down = sigma_down
    return run.finish(x)
