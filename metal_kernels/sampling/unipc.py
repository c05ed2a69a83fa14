"""UniPC (ComfyUI's comfy/extra_samplers/uni_pc.py, bh1 / bh2, multistep, data prediction): the host plan of
one predictor or corrector update and the fused step.

ComfyUI runs UniPC in the variance-preserving space of `SigmaConvert` (x_vp = x / sqrt(1 + sigma^2)) and
computes its coefficients in float32 from the sigma tensor, where `marginal_std` / `marginal_lambda` lose
digits at small sigma (1 - exp(2 log alpha)). The plan repeats those float32 steps (numpy float32 on the
host, no tensor, no host sync) so the step equals ComfyUI's. The sampler keeps the latent the model sees
(x_vp * sqrt(1 + t^2), ComfyUI's model input); `in_scale` / `out_scale` move it to and from x_vp.

One update: x_t = out_scale * (ratio * x / in_scale - ahp * m0 - aB * (sum_k rho_k * D1_k + rho_t * D1_t)),
D1_k = (m_k - m0) / rk_k (the history), D1_t = model_t - m0 (the corrector only). On the GPU it is one launch
of the fused lincomb kernel: x, m0, m1, m2 as the four terms and model_t in the fifth (tensor-noise) slot.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .launch import _check_same, _f32, _finish, _launch_lincomb

_F = np.float32


def _a(v) -> np.ndarray:
    return np.asarray([v], dtype=_F)


def _lmc(t):   # SigmaConvert.marginal_log_mean_coeff
    return _F(0.5) * np.log(_F(1) / ((t * t) + _F(1)))


def _std(t):   # SigmaConvert.marginal_std
    return np.sqrt(_F(1.0) - np.exp(_F(2.0) * _lmc(t)))


def _lambda(t):   # SigmaConvert.marginal_lambda
    lmc = _lmc(t)
    return lmc - _F(0.5) * np.log(_F(1.0) - np.exp(_F(2.0) * lmc))


def model_input_scale(t: float) -> float:
    """sqrt(t^2 + 1) in float32 (predict_eps_sigma's input scale)."""
    return float(((_a(t) ** 2 + _F(1.0)) ** _F(0.5))[0])


def final_scale(t: float) -> float:
    """1 / marginal_alpha(t) in float32 (the division at the end of ComfyUI's sample_unipc)."""
    return float((_F(1.0) / np.exp(_lmc(_a(t))))[0])


@dataclass(frozen=True)
class UniPCPlan:
    in_scale: float
    out_scale: float
    ratio: float
    ahp: float
    aB: float
    rks: tuple       # rk of m1, m2 (the history after m0)
    rhos: tuple      # rho of D1 of m1, m2
    rho_t: float     # rho of D1_t (corrector), 0 for the predictor
    corrector: bool


def unipc_plan(t_prev, t, order, variant="bh1", corrector=False, in_scale=1.0, out_scale=1.0) -> UniPCPlan:
    """The coefficients of ComfyUI's multistep_uni_pc_bh_update (predict_x0) from the previous times `t_prev`
    (oldest first, the last is m0's) to `t`; corrector=True: the corrector with model_t, else the predictor."""
    if variant not in ("bh1", "bh2"):
        raise ValueError(f"uni_pc: variant {variant!r} is not 'bh1' or 'bh2'")
    if not 1 <= order <= len(t_prev) or order > 3:
        raise ValueError(f"uni_pc: order {order} needs 1 to 3 previous model outputs, got {len(t_prev)}")
    tp = [_a(v) for v in t_prev]
    tt = _a(t)
    lambda_prev_0, lambda_t = _lambda(tp[-1]), _lambda(tt)
    sigma_prev_0, sigma_t = _std(tp[-1]), _std(tt)
    alpha_t = np.exp(_lmc(tt))
    h = lambda_t - lambda_prev_0
    rks = [((_lambda(tp[-(i + 1)]) - lambda_prev_0) / h)[0] for i in range(1, order)]
    rk_all = np.asarray(rks + [_F(1.0)], dtype=_F)
    hh = -h[0]
    h_phi_1 = np.expm1(hh)
    h_phi_k = h_phi_1 / hh - _F(1)
    factorial_i = 1
    B_h = hh if variant == "bh1" else np.expm1(hh)
    R, b = [], []
    for i in range(1, order + 1):
        R.append(rk_all ** _F(i - 1))
        b.append(_F(h_phi_k * _F(factorial_i) / B_h))
        factorial_i *= i + 1
        h_phi_k = _F(h_phi_k / hh - _F(1) / _F(factorial_i))
    R, b = np.stack(R).astype(_F), np.asarray(b, dtype=_F)
    rho_t = 0.0
    if corrector:
        rhos_c = np.asarray([0.5], dtype=_F) if order == 1 else np.linalg.solve(R, b).astype(_F)
        rhos, rho_t = [float(r) for r in rhos_c[:-1]], float(rhos_c[-1])
    elif order == 1:
        rhos = []
    elif order == 2:
        rhos = [0.5]
    else:
        rhos = [float(r) for r in np.linalg.solve(R[:-1, :-1], b[:-1]).astype(_F)]
    return UniPCPlan(float(in_scale), float(out_scale), float((sigma_t / sigma_prev_0)[0]),
                     float((alpha_t * h_phi_1)[0]), float((alpha_t * B_h)[0]), tuple(float(r) for r in rks),
                     tuple(rhos), rho_t, bool(corrector))


def _history(plan, model_prev_1, model_prev_2):
    prev = [m for m in (model_prev_1, model_prev_2) if m is not None]
    if len(prev) != len(plan.rks):
        raise ValueError(f"sampler_uni_pc_step: the plan is of order {len(plan.rks) + 1} and needs "
                         f"{len(plan.rks)} earlier model outputs, got {len(prev)}")
    return prev


def uni_pc_ref(x, model_prev_0, model_prev_1=None, model_prev_2=None, model_t=None, *, plan: UniPCPlan, flags=None,
               step=-1):
    """One UniPC update in ComfyUI's form: predictor (plan.corrector False) or corrector with `model_t`.
    model_prev_0 is the latest model output, model_prev_1 / _2 the earlier ones (None below order 2 / 3)."""
    _check_same("sampler_uni_pc_step", x, model_prev_0=model_prev_0, model_prev_1=model_prev_1,
                model_prev_2=model_prev_2, model_t=model_t)
    prev = _history(plan, model_prev_1, model_prev_2)
    if plan.corrector and model_t is None:
        raise ValueError("sampler_uni_pc_step: the corrector needs model_t")
    m0 = _f32(model_prev_0)
    x_t_ = plan.ratio * (_f32(x) / plan.in_scale) - plan.ahp * m0
    res = 0
    for m, rk, rho in zip(prev, plan.rks, plan.rhos):
        res = res + ((_f32(m) - m0) / rk) * rho
    if plan.corrector:
        res = res + plan.rho_t * (_f32(model_t) - m0)
    out = (x_t_ - plan.aB * res) * plan.out_scale
    return _finish(out, x, flags, step)


def uni_pc_metal(lib, x, model_prev_0, model_prev_1=None, model_prev_2=None, model_t=None, *, plan: UniPCPlan,
                 flags=None, step=-1):
    _check_same("sampler_uni_pc_step", x, model_prev_0=model_prev_0, model_prev_1=model_prev_1,
                model_prev_2=model_prev_2, model_t=model_t)
    prev = _history(plan, model_prev_1, model_prev_2)
    if plan.corrector and model_t is None:
        raise ValueError("sampler_uni_pc_step: the corrector needs model_t")
    s = plan.out_scale
    c0 = -plan.ahp
    terms = []
    for m, rk, rho in zip(prev, plan.rks, plan.rhos):
        w = -plan.aB * rho / rk
        terms.append((m, s * w))
        c0 -= w
    ct = 0.0
    if plan.corrector:
        ct = -plan.aB * plan.rho_t
        c0 -= ct
    terms = [(x, s * plan.ratio / plan.in_scale), (model_prev_0, s * c0)] + terms
    return _launch_lincomb(lib, terms, model_t if plan.corrector else None, s * ct, flags, step, dtype=x.dtype)
