"""uni_pc / uni_pc_bh2 (ComfyUI's comfy/extra_samplers/uni_pc.py: multistep UniPC, data prediction, order
min(3, steps - 1), lower order at the start and the end, the corrector on every step but the extra final one).

Each update (predictor, and after the model call the corrector) is one fused step kernel with the history
(up to three earlier model outputs and the new one) as its inputs; the float32 coefficients come from the host
plan (metal_kernels/sampling/unipc.py), computed from the schedule read once before the loop.

Differences from ComfyUI's function that do not change the result: the latent is kept as the model sees it
(ComfyUI keeps x / sqrt(1 + sigma^2) and scales it for each model call), so the callback's "x" is that latent;
and the model output is used as the data prediction directly (ComfyUI converts it to noise and back, which is
the identity up to rounding).

Like ComfyUI's, it writes 0.001 into the last element of the caller's `sigmas` when that is 0 (ComfyUI's
`timesteps = sigmas[:]` is a view). KSAMPLER then un-scales the latent of a flow model at sigma 0.001
(x / 0.999), and uni_pc_metal gives the same latent as uni_pc there too.
"""
from __future__ import annotations

import torch

from ...metal_kernels import sampling as K

from .samplers import _Run, _trange

_FINAL_T = 0.001   # ComfyUI's stand-in for a last sigma of 0


def _unipc(name, variant, model, x, sigmas, extra_args, callback, disable, noise_mode):
    run = _Run(name, model, x, sigmas, extra_args, noise_mode)
    extra_args = run.extra_args
    ts = list(run.sig)
    if ts and ts[-1] == 0:
        ts[-1] = _FINAL_T
        sigmas[-1] = _FINAL_T   # as ComfyUI's sample_unipc does (a device-side write, no host sync)
    steps = len(ts) - 1
    if steps <= 0:
        return x
    order = min(3, len(ts) - 2)
    if order < 1:   # one step: ComfyUI evaluates the model once and returns its scaled input
        model(x, sigmas[0] * x.new_ones([x.shape[0]]), **extra_args)
        scale = K.unipc_final_scale(ts[-1]) / K.unipc_model_input_scale(ts[0])
        return run.finish(K.sampler_lcm_step(x, None, 0.0, scale, flags=run.flags, step=0))
    s_in = x.new_ones([x.shape[0]])
    flags = run.flags

    def update(x, m_list, t_list, t, k, step_order, corrector, step):
        out_scale = K.unipc_final_scale(t) if k == steps else K.unipc_model_input_scale(t)
        kw = dict(in_scale=K.unipc_model_input_scale(t_list[-1]), out_scale=out_scale)
        t_prev = t_list[-step_order:]
        m0 = m_list[-1]
        m1 = m_list[-2] if step_order >= 2 else None
        m2 = m_list[-3] if step_order >= 3 else None
        x_t = K.sampler_uni_pc_step(x, m0, m1, m2, plan=K.unipc_plan(t_prev, t, step_order, variant, False, **kw),
                                    flags=flags, step=step)
        if not corrector:
            return x_t, None
        model_t = model(x_t, sigmas[k] * s_in, **extra_args)
        x_t = K.sampler_uni_pc_step(x, m0, m1, m2, model_t,
                                    plan=K.unipc_plan(t_prev, t, step_order, variant, True, **kw),
                                    flags=flags, step=step)
        return x_t, model_t

    m_list, t_list = [], []
    for step_index in _trange(steps, disable):
        if step_index == 0:
            m_list, t_list = [model(x, sigmas[0] * s_in, **extra_args)], [ts[0]]
        elif step_index < order:
            x, m = update(x, m_list, t_list, ts[step_index], step_index, step_index, True, step_index)
            m_list.append(m)
            t_list.append(ts[step_index])
        else:
            last = step_index + (2 if step_index == steps - 1 else 1)
            for k in range(step_index, last):
                step_order = min(order, steps + 1 - k)
                x, m = update(x, m_list, t_list, ts[k], k, step_order, k != steps, step_index)
                m_list = m_list[1:] + m_list[-1:]   # ComfyUI's shift: the newest slot keeps its value
                t_list = t_list[1:] + [ts[k]]
                if k < steps:
                    m_list[-1] = m
        if callback is not None:
            callback({"x": x, "i": step_index, "denoised": m_list[-1]})
    return run.finish(x)


@torch.no_grad()
def sample_uni_pc_metal(model, x, sigmas, extra_args=None, callback=None, disable=None, noise_mode=None):
    """ComfyUI's uni_pc (UniPC bh1)."""
    return _unipc("uni_pc", "bh1", model, x, sigmas, extra_args, callback, disable, noise_mode)


@torch.no_grad()
def sample_uni_pc_bh2_metal(model, x, sigmas, extra_args=None, callback=None, disable=None, noise_mode=None):
    """ComfyUI's uni_pc_bh2 (UniPC bh2)."""
    return _unipc("uni_pc_bh2", "bh2", model, x, sigmas, extra_args, callback, disable, noise_mode)
