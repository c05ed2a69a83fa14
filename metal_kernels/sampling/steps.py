"""The sampler steps. Each: reference (ComfyUI's form, float32 maths) and Metal launcher (host coefficients
into the one fused lincomb kernel)."""
from __future__ import annotations

import math

import torch

from .launch import _check_same, _f32, _finish, _launch_lincomb, _noise_ref
from .sigmas import (_ieee_div, _sde_common, ancestral_step, cfg_pp_alpha, dpmpp_2s_midpoint_sigma,
                     res_multistep_coefficients)

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


