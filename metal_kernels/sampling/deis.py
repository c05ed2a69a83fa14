"""DEIS (ComfyUI's sample_deis with its comfy/k_diffusion/deis.py coefficients): the per-step coefficients,
computed once on the host from the sigmas, and the fused step.

A step of order k is x_next = x + c_0 * d + c_1 * d_1 + ... + c_{k-1} * d_{k-1}, d = (x - denoised) / sigma
and d_j the derivative j steps back; order 1 is Euler, x + (sigma_next - sigma) * d. On the GPU it is one
launch of the fused lincomb kernel (x, denoised and up to three history tensors; the fifth in the noise slot).

The coefficients are the integrals over [sigma, sigma_next] of the Lagrange polynomials through the times of
the current and the earlier steps the step uses:
- "tab" (ComfyUI's default): in the time t of a variance-preserving SDE (ComfyUI maps sigma to t with its
  edm2t: sigma_min 0.002, sigma_max 80, epsilon_s 1e-3), weighted by the DEIS integrand, with ComfyUI's
  quadrature (10000 points from t to t_next, each weighted (t_next - t) / 10000). Computed in float64 (ComfyUI
  computes them in float32, with autograd for the integrand's d log(alpha) / dt, the closed form here): the
  coefficients agree to about 1e-4 relative, the sampled latents within a few 1e-6 (40 steps).
- "rhoab": in sigma itself, in closed form. ComfyUI v0.33's rhoab list is one step ahead of its history: from
  step max_order + 1 on it gives one coefficient more than the step uses (sample_deis raises ValueError at
  max_order 2 and 3) and at max_order 4, having no quartic formula, repeats step 4's coefficients on every
  later step (its latents diverge: 1e7 after 20 Karras steps). Here every step of order k gets the k
  coefficients of the polynomial through the k sigmas it uses: ComfyUI's own values wherever its list matches
  its history (its first max_order steps, so whole schedules of up to max_order + 1 steps, whose last step is
  Euler), and a converging solver after that.
"""
from __future__ import annotations

import math

import numpy as np

from .launch import _check_same, _f32, _finish
from .steps_more import _launch_terms

DEIS_MODES = ("tab", "rhoab")
DEIS_MAX_ORDERS = (1, 2, 3, 4)
_TAB_POINTS = 10000


def _vp_times(sigmas, sigma_min=0.002, sigma_max=80.0, epsilon_s=1e-3):
    """ComfyUI's edm2t: each sigma's time t in the VP SDE, with (beta_0, beta_1) of its linear schedule."""
    log_max = math.log(sigma_max ** 2 + 1)
    beta_d = 2 * (math.log(sigma_min ** 2 + 1) / epsilon_s - log_max) / (epsilon_s - 1)
    beta_min = log_max - 0.5 * beta_d
    times = [(math.sqrt(beta_min ** 2 + 2 * beta_d * math.log(s ** 2 + 1)) - beta_min) / beta_d for s in sigmas]
    return times, beta_min, beta_d + beta_min


def _lagrange(points, j, tau):
    """The Lagrange basis polynomial of points[j] over `points`, at tau."""
    out = np.ones_like(tau)
    for k, p in enumerate(points):
        if k != j:
            out = out * ((tau - p) / (points[j] - p))
    return out


def _tab_coefficients(times, beta_0, beta_1, i, order):
    """Host maths in numpy float64 (no torch op: nothing a sync counter could mistake for a device read)."""
    t, t_next = times[i], times[i + 1]
    tau = np.linspace(t, t_next, _TAB_POINTS, dtype=np.float64)
    alpha = np.exp(-0.5 * tau ** 2 * (beta_1 - beta_0) - tau * beta_0)
    integrand = 0.5 * (tau * (beta_1 - beta_0) + beta_0) / np.sqrt(alpha * (1 - alpha))
    points = [times[i - k] for k in range(order)]
    dtau = (t_next - t) / _TAB_POINTS
    return tuple(float(np.sum(integrand * _lagrange(points, j, tau))) * dtau for j in range(order))


def _rhoab_coefficients(sigmas, i, degree):
    """The integrals over [sigma_i, sigma_{i+1}] of the degree-`degree` Lagrange basis through sigma_i and the
    `degree` sigmas before it (degree + 1 coefficients), in closed form (float64)."""
    points = [sigmas[i - k] for k in range(degree + 1)]
    start, end = sigmas[i], sigmas[i + 1]
    out = []
    for j, p_j in enumerate(points):
        others = [p for k, p in enumerate(points) if k != j]
        poly = [1.0]   # coefficients of prod (tau - p), lowest power first
        for p in others:
            poly = [(poly[k - 1] if k else 0.0) - p * (poly[k] if k < len(poly) else 0.0) for k in range(len(poly) + 1)]
        integral = sum(c * (end ** (k + 1) - start ** (k + 1)) / (k + 1) for k, c in enumerate(poly))
        out.append(integral / math.prod(p_j - p for p in others))
    return tuple(out)


def deis_coefficients(sigmas, max_order=3, deis_mode="tab"):
    """Per step of ComfyUI's sample_deis on the schedule `sigmas` (host floats): None for an Euler step (order 1:
    the first step, max_order 1, and the step to sigma 0), else the coefficients (c_0 of the current
    derivative, c_1 of the previous one, ...), as many as the step's order min(max_order, i + 1).
    (At max_order 1 ComfyUI's own sample_deis raises IndexError in its history update after the first step;
    its step is Euler there, as here.)"""
    if deis_mode not in DEIS_MODES:
        raise ValueError(f"deis: deis_mode {deis_mode!r} is not supported; expected one of {', '.join(DEIS_MODES)}")
    if isinstance(max_order, bool) or not isinstance(max_order, int) or max_order not in DEIS_MAX_ORDERS:
        raise ValueError(f"deis: max_order must be an integer from 1 to 4, got {max_order!r}")
    sig = [float(s) for s in sigmas]
    steps = len(sig) - 1
    if deis_mode == "tab":
        times, beta_0, beta_1 = _vp_times(sig)
    out = []
    for i in range(steps):
        order = 1 if sig[i + 1] <= 0 else min(max_order, i + 1)
        if order == 1:
            out.append(None)
        elif deis_mode == "tab":
            out.append(_tab_coefficients(times, beta_0, beta_1, i, order))
        else:
            out.append(_rhoab_coefficients(sig, i, order - 1))
    return out


def deis_ref(x, denoised, d_1=None, d_2=None, d_3=None, sigma=1.0, sigma_next=0.0, *, coefficients=None, flags=None,
             step=-1):
    """ComfyUI's deis step: coefficients None is an Euler step, else (c_0, ..., c_k) of deis_coefficients with the
    k earlier derivatives d_1 (the latest) ... (each (x - denoised) / sigma of its step)."""
    hist = _check_deis("sampler_deis_step", x, denoised, d_1, d_2, d_3, coefficients)
    xf, den = _f32(x), _f32(denoised)
    d_cur = (xf - den) / sigma
    if coefficients is None:
        return _finish(xf + (sigma_next - sigma) * d_cur, x, flags, step)
    out = xf + coefficients[0] * d_cur
    for c, d in zip(coefficients[1:], hist):
        out = out + c * _f32(d)
    return _finish(out, x, flags, step)


def deis_metal(lib, x, denoised, d_1=None, d_2=None, d_3=None, sigma=1.0, sigma_next=0.0, *, coefficients=None,
               flags=None, step=-1):
    hist = _check_deis("sampler_deis_step", x, denoised, d_1, d_2, d_3, coefficients)
    if coefficients is None:
        if sigma_next == 0:
            return _launch_terms(lib, [(denoised, 1.0)], flags, step, dtype=x.dtype)
        coefficients = (sigma_next - sigma,)
    c = coefficients[0] / sigma
    terms = [(x, 1.0 + c), (denoised, -c)] + list(zip(hist, coefficients[1:]))
    return _launch_terms(lib, terms, flags, step, dtype=x.dtype)


def _check_deis(what, x, denoised, d_1, d_2, d_3, coefficients):
    _check_same(what, x, denoised=denoised, d_1=d_1, d_2=d_2, d_3=d_3)
    hist = [d for d in (d_1, d_2, d_3) if d is not None]
    wanted = 0 if coefficients is None else len(coefficients) - 1
    if len(hist) != wanted or (coefficients is not None and not 2 <= len(coefficients) <= 4):
        raise ValueError(f"{what}: {len(hist)} earlier derivatives for "
                         f"{'an Euler step' if coefficients is None else f'{len(coefficients)} coefficients'}; "
                         f"expected {wanted} (d_1, d_2, d_3 in order, 2 to 4 coefficients)")
    return hist
