"""Host-side coefficient maths of the samplers (float64 on the host, read once per step), in ComfyUI's form."""
from __future__ import annotations

import math

_FLOAT32_MAX = 3.4028234663852886e38

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


def cfg_pp_alpha(sigma: float, flow: bool) -> float:
    """alpha(sigma) = sigma * exp(half-logSNR): 1 for epsilon models, 1 - sigma for flow (0 from sigma 1 on)."""
    return sigma * math.exp(half_log_snr(sigma, flow))


def dpmpp_2s_midpoint_sigma(sigma: float, sigma_down: float) -> float:
    """The sigma of DPM-Solver++(2S)'s second model call: exp(-(t + h/2)), t = -log(sigma), h = -log(sigma_down) - t."""
    t, t_next = -math.log(sigma), -math.log(sigma_down)
    return math.exp(-(t + 0.5 * (t_next - t)))


