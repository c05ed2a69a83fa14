"""More sampler steps on the same fused lincomb kernel: gradient_estimation (and its CFG++ form), ipndm, and
to_d (the derivative a multistep sampler keeps as history). Each: reference in ComfyUI's form (float32
maths) and Metal launcher (host coefficients). A step with five input tensors puts the fifth in the
kernel's tensor-noise slot (one more weighted input)."""
from __future__ import annotations


import torch

from .launch import _check_same, _f32, _finish, _launch_lincomb, _noise_ref
from .sigmas import ancestral_step, half_log_snr
from .steps import _merged


def _launch_terms(lib, terms, flags, step, dtype=None):
    """Up to five (tensor, coefficient) terms, merged by tensor; the fifth goes to the tensor-noise slot."""
    terms = _merged(terms)
    if len(terms) > 5:
        raise ValueError(f"sampler kernel: {len(terms)} input tensors (1 to 5 supported)")
    extra, coef = (terms[4] if len(terms) == 5 else (None, 0.0))
    return _launch_lincomb(lib, terms[:4], extra, coef, flags, step, dtype=dtype)


def to_d_ref(x, denoised, sigma, *, flags=None, step=-1):
    """k-diffusion's to_d: (x - denoised) / sigma."""
    _check_same("sampler_to_d_step", x, denoised=denoised)
    return _finish((_f32(x) - _f32(denoised)) / sigma, x, flags, step)


def to_d_metal(lib, x, denoised, sigma, *, flags=None, step=-1):
    _check_same("sampler_to_d_step", x, denoised=denoised)
    return _launch_lincomb(lib, [(x, 1.0 / sigma), (denoised, -1.0 / sigma)], flags=flags, step=step)


def _ge_terms(x, denoised, uncond, x_prev, uncond_prev, sigma, sigma_next, sigma_prev, ge_gamma, cfg_pp):
    a = 1.0 / sigma
    dt = sigma_next - sigma
    if cfg_pp:
        terms = [(x, sigma_next * a), (denoised, 1.0), (uncond, -sigma_next * a)]
    else:
        terms = [(x, 1.0 + dt * a), (uncond, -dt * a)]
    if x_prev is not None:
        g, b = (ge_gamma - 1) * dt, 1.0 / sigma_prev
        terms += [(x, g * a), (uncond, -g * a), (x_prev, -g * b), (uncond_prev, g * b)]
    return terms


def gradient_estimation_ref(x, denoised, x_prev=None, denoised_prev=None, sigma=1.0, sigma_next=0.0,
                            sigma_prev=None, uncond=None, uncond_prev=None, *, ge_gamma=2.0, cfg_pp=False,
                            flags=None, step=-1):
    """ComfyUI's gradient_estimation step (cfg_pp: its CFG++ form, the direction from `uncond`). The previous
    step's direction is recomputed from its latent and (unconditional) denoised output: x_prev / denoised_prev
    (uncond_prev for CFG++) at sigma_prev; None on the first step."""
    _check_same("sampler_gradient_estimation_step", x, denoised=denoised, x_prev=x_prev, denoised_prev=denoised_prev,
                uncond=uncond, uncond_prev=uncond_prev)
    xf, den = _f32(x), _f32(denoised)
    if sigma_next == 0:
        return _finish(den.clone(), x, flags, step)
    unc = den if uncond is None else _f32(uncond)
    d = (xf - unc) / sigma
    dt = sigma_next - sigma
    out = den + d * sigma_next if cfg_pp else xf + d * dt
    if x_prev is not None:
        unc_prev = _f32(denoised_prev if uncond_prev is None else uncond_prev)
        old_d = (_f32(x_prev) - unc_prev) / sigma_prev
        out = out + (ge_gamma - 1) * (d - old_d) * dt
    return _finish(out, x, flags, step)


def gradient_estimation_metal(lib, x, denoised, x_prev=None, denoised_prev=None, sigma=1.0, sigma_next=0.0,
                              sigma_prev=None, uncond=None, uncond_prev=None, *, ge_gamma=2.0, cfg_pp=False,
                              flags=None, step=-1):
    _check_same("sampler_gradient_estimation_step", x, denoised=denoised, x_prev=x_prev, denoised_prev=denoised_prev,
                uncond=uncond, uncond_prev=uncond_prev)
    if sigma_next == 0:
        return _launch_lincomb(lib, [(denoised, 1.0)], flags=flags, step=step, dtype=x.dtype)
    unc = denoised if uncond is None else uncond
    unc_prev = denoised_prev if uncond_prev is None else uncond_prev
    return _launch_terms(lib, _ge_terms(x, denoised, unc, x_prev, unc_prev, sigma, sigma_next, sigma_prev, ge_gamma,
                                        cfg_pp), flags, step, dtype=x.dtype)


_IPNDM = {1: (1.0,), 2: (3 / 2, -1 / 2), 3: (23 / 12, -16 / 12, 5 / 12), 4: (55 / 24, -59 / 24, 37 / 24, -9 / 24)}


def ipndm_ref(x, denoised, d_1=None, d_2=None, d_3=None, sigma=1.0, sigma_next=0.0, *, flags=None, step=-1):
    """ComfyUI's ipndm step: the order is 1 + the number of earlier derivatives given (d_1 the latest, each
    (x - denoised) / sigma of its step); sigma_next 0 gives denoised."""
    _check_same("sampler_ipndm_step", x, denoised=denoised, d_1=d_1, d_2=d_2, d_3=d_3)
    xf, den = _f32(x), _f32(denoised)
    if sigma_next == 0:
        return _finish(den.clone(), x, flags, step)
    d_cur = (xf - den) / sigma
    hist = [_f32(d) for d in (d_1, d_2, d_3) if d is not None]
    dt = sigma_next - sigma
    if not hist:
        out = xf + dt * d_cur
    elif len(hist) == 1:
        out = xf + dt * (3 * d_cur - hist[0]) / 2
    elif len(hist) == 2:
        out = xf + dt * (23 * d_cur - 16 * hist[0] + 5 * hist[1]) / 12
    else:
        out = xf + dt * (55 * d_cur - 59 * hist[0] + 37 * hist[1] - 9 * hist[2]) / 24
    return _finish(out, x, flags, step)


def ipndm_metal(lib, x, denoised, d_1=None, d_2=None, d_3=None, sigma=1.0, sigma_next=0.0, *, flags=None, step=-1):
    _check_same("sampler_ipndm_step", x, denoised=denoised, d_1=d_1, d_2=d_2, d_3=d_3)
    if sigma_next == 0:
        return _launch_lincomb(lib, [(denoised, 1.0)], flags=flags, step=step, dtype=x.dtype)
    hist = [d for d in (d_1, d_2, d_3) if d is not None]
    w = _IPNDM[len(hist) + 1]
    dt = sigma_next - sigma
    c = dt * w[0] / sigma
    terms = [(x, 1.0 + c), (denoised, -c)] + [(d, dt * wk) for d, wk in zip(hist, w[1:])]
    return _launch_terms(lib, terms, flags, step, dtype=x.dtype)


def dpmpp_sde_plan(sigma, sigma_next, eta=1.0, r=0.5, flow=False):
    """The coefficients of ComfyUI's sample_dpmpp_sde step from sigma to sigma_next (> 0): sigma_s_1 (the
    second model call's sigma), stage 1 (cx, cden, cnoise) and stage 2 (cx, cden, cden_2, cnoise), the noise
    coefficients without s_noise.

    Computed as ComfyUI computes them: float32 scalar tensors, its operations in its order, on the CPU (host
    maths: no device work, read back with tolist). Near sigma 1 on flow models get_ancestral_step's
    sigma_to^2 - sigma_up^2 keeps few digits, so the result depends on float32 rounding bit for bit, and the
    Brownian tree is queried at sigma_s_1."""
    def t32(v):
        return torch.tensor(float(v), dtype=torch.float32)

    def lam(v):   # sigma_to_half_log_snr
        return v.logit().neg() if flow else v.log().neg()

    def sigma_fn(v):   # half_log_snr_to_sigma
        return v.neg().sigmoid() if flow else v.neg().exp()

    def ancestral(sigma_from, sigma_to):   # get_ancestral_step
        if not eta:
            return sigma_to, t32(0.0)
        sigma_up = torch.minimum(sigma_to, eta * (sigma_to ** 2 * (sigma_from ** 2 - sigma_to ** 2) / sigma_from ** 2)
                                 ** 0.5)
        return (sigma_to ** 2 - sigma_up ** 2) ** 0.5, sigma_up

    s, t = t32(sigma), t32(sigma_next)
    lambda_s, lambda_t = lam(s), lam(t)
    h = lambda_t - lambda_s
    lambda_s_1 = lambda_s + r * h
    fac = 1 / (2 * r)
    sigma_s_1 = sigma_fn(lambda_s_1)
    alpha_s = s * lambda_s.exp()
    alpha_s_1 = sigma_s_1 * lambda_s_1.exp()
    alpha_t = t * lambda_t.exp()

    def stage(lambda_to, alpha_to):
        sd, su = ancestral(lambda_s.neg().exp(), lambda_to.neg().exp())
        h_ = sd.log().neg() - lambda_s
        return [(alpha_to / alpha_s) * (-h_).exp(), -alpha_to * (-h_).expm1(), alpha_to * su]

    values = torch.stack([sigma_s_1] + stage(lambda_s_1, alpha_s_1) + stage(lambda_t, alpha_t)).tolist()
    sigma_s_1, cx1, cd1, cn1, cx2, cd2, cn2 = values
    return sigma_s_1, (cx1, cd1, cn1), (cx2, cd2 * (1 - fac), cd2 * fac, cn2)


def dpmpp_sde_ref(x, denoised, denoised_2=None, sigma=1.0, sigma_next=0.0, noise=None, *, eta=1.0, s_noise=1.0, r=0.5,
                  flow=False, flags=None, step=-1):
    """ComfyUI's DPM-Solver++ (stochastic) step: denoised_2 None gives stage 1 (the latent for the second
    model call, at dpmpp_sde_plan's sigma_s_1, noise = noise_sampler(sigma, sigma_s_1)); otherwise stage 2
    (noise = noise_sampler(sigma, sigma_next)). sigma_next 0: denoised. s_noise already includes the model's
    noise_scale; noise is added when eta > 0 and s_noise > 0."""
    _check_same("sampler_dpmpp_sde_step", x, denoised=denoised, denoised_2=denoised_2)
    xf, den = _f32(x), _f32(denoised)
    if sigma_next == 0:
        return _finish(den.clone(), x, flags, step)
    _, (cx1, cd1, cn1), (cx2, cd2a, cd2b, cn2) = dpmpp_sde_plan(sigma, sigma_next, eta, r, flow)
    if denoised_2 is None:
        out, cn = cx1 * xf + cd1 * den, cn1
    else:
        out, cn = cx2 * xf + (cd2a * den + cd2b * _f32(denoised_2)), cn2
    if eta > 0 and s_noise > 0:
        out = out + _noise_ref(noise, x, "sampler_dpmpp_sde_step") * (cn * s_noise)
    return _finish(out, x, flags, step)


def dpmpp_sde_metal(lib, x, denoised, denoised_2=None, sigma=1.0, sigma_next=0.0, noise=None, *, eta=1.0, s_noise=1.0,
                    r=0.5, flow=False, flags=None, step=-1):
    _check_same("sampler_dpmpp_sde_step", x, denoised=denoised, denoised_2=denoised_2)
    if sigma_next == 0:
        return _launch_lincomb(lib, [(denoised, 1.0)], flags=flags, step=step, dtype=x.dtype)
    _, (cx1, cd1, cn1), (cx2, cd2a, cd2b, cn2) = dpmpp_sde_plan(sigma, sigma_next, eta, r, flow)
    if denoised_2 is None:
        terms, cn = [(x, cx1), (denoised, cd1)], cn1
    else:
        terms, cn = [(x, cx2), (denoised, cd2a), (denoised_2, cd2b)], cn2
    cn = cn * s_noise if (eta > 0 and s_noise > 0) else 0.0
    return _launch_lincomb(lib, _merged(terms), noise, cn, flags, step, dtype=x.dtype)


def _er_sde_noise_scaler(v):   # ComfyUI's default_er_sde_noise_scaler
    return v * ((v ** 0.3).exp() + 10.0)


def er_sde_plans(sigmas, flow=False, max_stage=3, num_integration_points=200.0):
    """Per step of ComfyUI's sample_er_sde (default noise scaler) on the schedule `sigmas` (host floats, the first
    already offset as ComfyUI's offset_first_sigma_for_snr does): None where sigma_next is 0, else (stage,
    c_x, c_den, c_d (times den_d), d1 (its divisor), c_u (times den_u), d2, du (divisors), c_noise without
    s_noise). Computed as ComfyUI computes them (float32 CPU tensors, its operations in its order; host maths,
    read back once with tolist)."""
    sig = torch.tensor([float(s) for s in sigmas], dtype=torch.float32)
    half_log_snrs = sig.logit().neg() if flow else sig.log().neg()
    er_lambdas = half_log_snrs.neg().exp()
    point_indice = torch.arange(0, num_integration_points, dtype=torch.float32)
    rows = []
    for i in range(len(sigmas) - 1):
        stage = min(max_stage, i + 1)
        zero = torch.zeros((), dtype=torch.float32)
        er_lambda_s, er_lambda_t = er_lambdas[i], er_lambdas[i + 1]
        alpha_s = sig[i] / er_lambda_s
        alpha_t = sig[i + 1] / er_lambda_t
        r_alpha = alpha_t / alpha_s
        r = _er_sde_noise_scaler(er_lambda_t) / _er_sde_noise_scaler(er_lambda_s)
        c_d = d1 = c_u = d2 = du = zero
        if stage >= 2:
            dt = er_lambda_t - er_lambda_s
            lambda_step_size = -dt / num_integration_points
            lambda_pos = er_lambda_t + point_indice * lambda_step_size
            scaled_pos = _er_sde_noise_scaler(lambda_pos)
            s = torch.sum(1 / scaled_pos) * lambda_step_size
            c_d = alpha_t * (dt + s * _er_sde_noise_scaler(er_lambda_t))
            d1 = er_lambda_s - er_lambdas[i - 1]
            if stage >= 3:
                s_u = torch.sum((lambda_pos - er_lambda_s) / scaled_pos) * lambda_step_size
                c_u = alpha_t * ((dt ** 2) / 2 + s_u * _er_sde_noise_scaler(er_lambda_t))
                d2 = er_lambdas[i - 1] - er_lambdas[i - 2]
                du = (er_lambda_s - er_lambdas[i - 2]) / 2
        c_noise = alpha_t * (er_lambda_t ** 2 - er_lambda_s ** 2 * r ** 2).sqrt().nan_to_num(nan=0.0)
        rows.append(torch.stack([r_alpha * r, alpha_t * (1 - r), c_d, d1, c_u, d2, du, c_noise]))
    values = torch.stack(rows).tolist() if rows else []
    return [None if float(sigmas[i + 1]) == 0 else (min(max_stage, i + 1), *v) for i, v in enumerate(values)]


def er_sde_ref(x, denoised, old_denoised=None, old_denoised_2=None, noise=None, *, plan, s_noise=1.0, flags=None,
               step=-1):
    """One step of ComfyUI's er_sde with its er_sde_plans row `plan` (None: sigma_next 0, denoised):
    old_denoised / old_denoised_2 the previous steps' outputs (stage 2 / 3). s_noise already includes the
    model's noise_scale; noise is added when s_noise > 0."""
    _check_same("sampler_er_sde_step", x, denoised=denoised, old_denoised=old_denoised, old_denoised_2=old_denoised_2)
    xf, den = _f32(x), _f32(denoised)
    if plan is None:
        return _finish(den.clone(), x, flags, step)
    stage, cx, cden, c_d, d1, c_u, d2, du, cn = plan
    out = cx * xf + cden * den
    if stage >= 2:
        old = _f32(old_denoised)
        den_d = (den - old) / d1
        out = out + c_d * den_d
        if stage >= 3:
            den_u = (den_d - (old - _f32(old_denoised_2)) / d2) / du
            out = out + c_u * den_u
    if s_noise > 0:
        out = out + _noise_ref(noise, x, "sampler_er_sde_step") * (cn * s_noise)
    return _finish(out, x, flags, step)


def er_sde_metal(lib, x, denoised, old_denoised=None, old_denoised_2=None, noise=None, *, plan, s_noise=1.0,
                 flags=None, step=-1):
    _check_same("sampler_er_sde_step", x, denoised=denoised, old_denoised=old_denoised, old_denoised_2=old_denoised_2)
    if plan is None:
        return _launch_lincomb(lib, [(denoised, 1.0)], flags=flags, step=step, dtype=x.dtype)
    stage, cx, cden, c_d, d1, c_u, d2, du, cn = plan
    terms = [(x, cx), (denoised, cden)]
    if stage >= 2:
        a = c_d / d1
        terms += [(denoised, a), (old_denoised, -a)]
        if stage >= 3:
            u, b = c_u / du, 1.0 / d2
            terms += [(denoised, u / d1), (old_denoised, -u / d1 - u * b), (old_denoised_2, u * b)]
    return _launch_lincomb(lib, _merged(terms), noise, cn * s_noise if s_noise > 0 else 0.0, flags, step,
                           dtype=x.dtype)
