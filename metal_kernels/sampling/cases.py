"""Self-check cases of the sampler kernels (odd sizes, every dtype, first/middle/last steps, tensor and
device noise)."""
from __future__ import annotations

import torch

from .noise import BrownianBridge, iid_noise

# --------------------------------------------------------------------------------------------
# Self-check cases (odd sizes, every dtype, first/middle/last steps, tensor and device noise)
# --------------------------------------------------------------------------------------------


def _tensors(device, shape, dtype, n, seed):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=gen) * 3).to(dtype).to(device) for _ in range(n)]


_SHAPES = [((1, 3, 5, 7), torch.float32), ((2, 1, 3, 11), torch.float16), ((37,), torch.bfloat16)]


def _bridge_noise():
    return BrownianBridge(1234).increment(3.7, 2.1)


def _cases_noise(device):
    out = []
    for shape, dtype in _SHAPES:
        (like,) = _tensors(device, shape, dtype, 1, 1)
        out.append(((like, _bridge_noise()), {}))
        out.append(((like, iid_noise(7, 3)), {}))
    return out


def _cases_churn(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, n = _tensors(device, shape, dtype, 2, 10 + i)
        out.append(((x, n, 2.0, 2.4), {"s_noise": 0.9}))
        out.append(((x, iid_noise(3, i), 2.0, 2.4), {}))
    return out


def _cases_euler(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d = _tensors(device, shape, dtype, 2, 20 + i)
        out += [((x, d, 14.6, 9.7), {}), ((x, d, 0.5, 0.0), {}), ((x, d, 0.9, 0.75), {})]
    return out


def _cases_euler_ancestral(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, n = _tensors(device, shape, dtype, 3, 30 + i)
        out += [((x, d, 14.6, 9.7, n), {}), ((x, d, 3.0, 2.0, _bridge_noise()), {"eta": 0.7, "s_noise": 1.1}),
                ((x, d, 0.5, 0.0, None), {}), ((x, d, 0.9, 0.75, n), {"flow": True}),
                ((x, d, 0.9, 0.75, iid_noise(1, 2)), {"flow": True, "eta": 0.5}),
                ((x, d, 0.3, 0.0, None), {"flow": True}), ((x, d, 2.0, 1.0, None), {"eta": 0.0})]
    return out


def _cases_heun(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, d2 = _tensors(device, shape, dtype, 3, 40 + i)
        out += [((x, d, d2, 14.6, 9.7), {}), ((x, d, d2, 0.9, 0.75), {})]
    return out


def _cases_dpmpp_2m(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, o = _tensors(device, shape, dtype, 3, 50 + i)
        out += [((x, d, None, 14.6, 9.7), {}), ((x, d, o, 9.7, 6.1, 14.6), {}), ((x, d, o, 0.4, 0.0, 0.8), {})]
    return out


def _cases_dpmpp_2m_sde(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, o, n = _tensors(device, shape, dtype, 4, 60 + i)
        out += [((x, d, None, 14.6, 9.7, None, n), {}),
                ((x, d, o, 9.7, 6.1, 0.4, _bridge_noise()), {"eta": 0.8, "s_noise": 0.9}),
                ((x, d, o, 9.7, 6.1, 0.4, n), {"solver_type": "heun"}),
                ((x, d, o, 0.8, 0.6, 0.3, n), {"flow": True}),
                ((x, d, o, 0.4, 0.0, 0.3, None), {})]
    return out


def _cases_dpmpp_3m_sde(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, d1, d2, n = _tensors(device, shape, dtype, 5, 70 + i)
        out += [((x, d, None, None, 14.6, 9.7, None, None, n), {}),
                ((x, d, d1, None, 9.7, 6.1, 0.4, None, _bridge_noise()), {}),
                ((x, d, d1, d2, 6.1, 3.9, 0.45, 0.4, n), {"eta": 0.6}),
                ((x, d, d1, d2, 0.8, 0.6, 0.3, 0.2, n), {"flow": True, "s_noise": 1.2}),
                ((x, d, d1, d2, 0.4, 0.0, 0.3, 0.2, None), {})]
    return out


def _cases_lcm(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        d, n = _tensors(device, shape, dtype, 2, 80 + i)
        out += [((d, n, 3.2, 1.0), {}), ((d, iid_noise(5, 1), 0.6, 0.4), {}), ((d, None, 0.0, 1.0), {})]
    return out


def _cases_res_multistep(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, o, n = _tensors(device, shape, dtype, 4, 90 + i)
        out += [((x, d, None, 14.6, 9.7), {}), ((x, d, o, 9.7, 6.1, 14.6, 9.7), {}),
                ((x, d, o, 9.7, 6.1, 14.6, 8.0, n), {"eta": 1.0}), ((x, d, o, 0.4, 0.0, 0.8, 0.4), {})]
    return out


def _cases_euler_cfg_pp(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, u, n = _tensors(device, shape, dtype, 4, 100 + i)
        out += [((x, d, u, 14.6, 9.7), {}), ((x, d, d, 9.7, 6.1), {}), ((x, d, u, 0.5, 0.0), {}),
                ((x, d, u, 14.6, 9.7, n), {"eta": 1.0}),
                ((x, d, u, 3.0, 2.0, iid_noise(2, 1)), {"eta": 0.7, "s_noise": 1.1}),
                ((x, d, u, 0.9, 0.75), {"flow": True}), ((x, d, u, 1.0, 0.8, n), {"flow": True, "eta": 1.0}),
                ((x, d, u, 0.9, 0.75, iid_noise(4, 2)), {"flow": True, "eta": 0.5}),
                ((x, d, u, 0.3, 0.0, None), {"flow": True, "eta": 1.0})]
    return out


def _cases_dpmpp_2m_cfg_pp(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, u, o = _tensors(device, shape, dtype, 4, 110 + i)
        out += [((x, d, u, None, 14.6, 9.7), {}), ((x, d, u, o, 9.7, 6.1, 14.6), {}),
                ((x, d, d, o, 9.7, 6.1, 14.6), {}), ((x, d, u, o, 0.4, 0.0, 0.8), {})]
    return out


def _cases_res_multistep_cfg_pp(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, u, o, n = _tensors(device, shape, dtype, 5, 120 + i)
        out += [((x, d, u, None, 14.6, 9.7), {}), ((x, d, u, o, 9.7, 6.1, 14.6, 9.7), {}),
                ((x, d, u, o, 9.7, 6.1, 14.6, 8.0, n), {"eta": 1.0, "s_noise": 0.9}),
                ((x, d, u, None, 14.6, 9.7, None, None, iid_noise(6, 0)), {"eta": 0.5}),
                ((x, d, u, o, 0.4, 0.0, 0.8, 0.4), {})]
    return out


def _cases_dpmpp_2s_ancestral_cfg_pp(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, u, d2, n = _tensors(device, shape, dtype, 5, 130 + i)
        out += [((x, d, u, None, 14.6, 9.7), {"midpoint": True}), ((x, d, u, d2, 14.6, 9.7, n), {}),
                ((x, d, u, d2, 3.0, 2.0, iid_noise(3, 1)), {"eta": 0.6, "s_noise": 1.1}),
                ((x, d, u, None, 0.9, 0.75), {"midpoint": True, "eta": 0.0}), ((x, d, u, d2, 0.9, 0.75), {"eta": 0.0}),
                ((x, d, d, d2, 3.0, 2.0, n), {}), ((x, d, u, None, 0.4, 0.0), {}),
                ((x, d, u, None, 2.0, 1.0, n), {"eta": 5.0})]  # sigma_up = sigma_next: sigma_down 0, noise
    return out




def _cases_uni_pc(device):
    from .unipc import unipc_plan

    t = [14.6, 9.7, 6.1, 3.9]
    plans = [unipc_plan(t[:1], t[1], 1, "bh1", False, 3.1, 2.2), unipc_plan(t[:1], t[1], 1, "bh2", True, 3.1, 2.2),
             unipc_plan(t[:2], t[2], 2, "bh1", False, 2.2, 1.4), unipc_plan(t[:2], t[2], 2, "bh2", True, 2.2, 1.4),
             unipc_plan(t[:3], t[3], 3, "bh1", True, 1.4, 1.0), unipc_plan(t[:3], t[3], 3, "bh2", False),
             unipc_plan([0.9, 0.6, 0.3], 0.001, 3, "bh1", False, 1.04, 1.0)]
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, m0, m1, m2, mt = _tensors(device, shape, dtype, 5, 140 + i)
        for p in plans:
            hist = [m1, m2][:len(p.rks)]
            hist += [None] * (2 - len(hist))
            out.append(((x, m0, *hist, mt if p.corrector else None), {"plan": p}))
    return out


def _cases_to_d(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d = _tensors(device, shape, dtype, 2, 150 + i)
        out += [((x, d, 14.6), {}), ((x, d, 0.3), {})]
    return out


def _cases_gradient_estimation(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, xp, dp, u, up = _tensors(device, shape, dtype, 6, 160 + i)
        out += [((x, d, None, None, 14.6, 9.7), {}), ((x, d, xp, dp, 9.7, 6.1, 14.6), {"ge_gamma": 2.5}),
                ((x, d, xp, dp, 0.4, 0.0, 0.8), {}),
                ((x, d, None, None, 14.6, 9.7, None, u), {"cfg_pp": True}),
                ((x, d, xp, None, 0.9, 0.7, 1.0, u, up), {"cfg_pp": True}),
                ((x, d, xp, None, 0.9, 0.7, 1.0, d, up), {"cfg_pp": True})]
    return out


def _cases_ipndm(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, d1, d2, d3 = _tensors(device, shape, dtype, 5, 170 + i)
        out += [((x, d, None, None, None, 14.6, 9.7), {}), ((x, d, d1, None, None, 9.7, 6.1), {}),
                ((x, d, d1, d2, None, 6.1, 3.9), {}), ((x, d, d1, d2, d3, 3.9, 2.0), {}),
                ((x, d, d1, d2, d3, 0.4, 0.0), {})]
    return out


def _cases_dpmpp_sde(device):
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, d2, n = _tensors(device, shape, dtype, 4, 180 + i)
        out += [((x, d, None, 14.6, 9.7, n), {}), ((x, d, d2, 14.6, 9.7, _bridge_noise()), {}),
                ((x, d, d2, 6.1, 3.9, n), {"eta": 0.5, "s_noise": 1.1, "r": 0.4}),
                ((x, d, None, 0.9, 0.7, n), {"flow": True}), ((x, d, d2, 0.9, 0.7, iid_noise(2, 3)), {"flow": True}),
                ((x, d, d2, 0.9, 0.7), {"eta": 0.0}), ((x, d, None, 0.4, 0.0), {})]
    return out


def _cases_er_sde(device):
    from .steps_more import er_sde_plans

    eps = er_sde_plans([14.6, 9.7, 6.1, 3.9, 0.0])
    flow = er_sde_plans([0.9999, 0.8, 0.6, 0.4], flow=True)
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, o, o2, n = _tensors(device, shape, dtype, 5, 190 + i)
        out += [((x, d, None, None, n), {"plan": eps[0]}), ((x, d, o, None, iid_noise(4, 1)), {"plan": eps[1]}),
                ((x, d, o, o2, n), {"plan": eps[2], "s_noise": 0.8}), ((x, d, o, o2, None), {"plan": eps[3]}),
                ((x, d, o, o2, n), {"plan": flow[2]}), ((x, d, o, None, None), {"plan": flow[1], "s_noise": 0.0})]
    return out


def _cases_deis(device):
    from .deis import deis_coefficients

    tab = deis_coefficients([14.6, 9.7, 6.1, 3.9, 2.0, 0.0], 4)
    rhoab = deis_coefficients([0.9999, 0.8, 0.6, 0.4, 0.2, 0.1], 4, "rhoab")
    out = []
    for i, (shape, dtype) in enumerate(_SHAPES):
        x, d, d1, d2, d3 = _tensors(device, shape, dtype, 5, 200 + i)
        out += [((x, d, None, None, None, 14.6, 9.7), {}), ((x, d, d1, None, None, 9.7, 6.1), {"coefficients": tab[1]}),
                ((x, d, d1, d2, None, 6.1, 3.9), {"coefficients": tab[2]}),
                ((x, d, d1, d2, d3, 3.9, 2.0), {"coefficients": tab[3]}),
                ((x, d, d1, d2, d3, 0.2, 0.1), {"coefficients": rhoab[4]}), ((x, d, None, None, None, 2.0, 0.0), {})]
    return out
