"""More sampler steps on the same fused lincomb kernel: gradient_estimation (and its CFG++ form), ipndm, and
to_d (the derivative a multistep sampler keeps as history). Each: reference in ComfyUI's form (float32
maths) and Metal launcher (host coefficients). A step with five input tensors puts the fifth in the
kernel's tensor-noise slot (one more weighted input)."""
from __future__ import annotations

from .launch import _check_same, _f32, _finish, _launch_lincomb
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
