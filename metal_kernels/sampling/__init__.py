"""Fused sampler step kernels and the device-side noise they can draw.

Each public `sampler_<name>_step` function performs one step (or one stage of a two-stage method)
of the ComfyUI / k-diffusion sampler of that name, taking the latent, the denoiser outputs it
needs and the step's sigmas as host floats (read once before the sampling loop, so a step never
makes the host wait). On MPS one Metal kernel reads every input once and writes the new latent
once; elsewhere the pure-torch reference (written in the same form as ComfyUI's sampler code)
runs.

Noise arguments are a tensor (e.g. from ComfyUI's own noise sampler: "exact" mode), a
`DeviceNoise` (a weighted sum of counter-based standard normals generated inside the kernel:
"fast" mode, see `BrownianBridge` and `iid_noise`), or None when the step adds no noise.

`flags` (int32 tensor, one slot per step) and `step`: a step whose output has a NaN/inf sets
flags[step] on the device; the sampler reads the flags once after the loop.
"""
from __future__ import annotations

import inspect

from ..registry import KernelSpec, register
from ..dtypes import MSL_TYPE  # noqa: F401  (re-exported: K.MSL_TYPE)
from .cases import (_cases_churn, _cases_dpmpp_2m, _cases_dpmpp_2m_cfg_pp, _cases_dpmpp_2m_sde,
                    _cases_dpmpp_2s_ancestral_cfg_pp, _cases_dpmpp_3m_sde, _cases_euler, _cases_euler_ancestral,
                    _cases_euler_cfg_pp, _cases_heun, _cases_lcm, _cases_noise, _cases_res_multistep,
                    _cases_res_multistep_cfg_pp, _cases_uni_pc, _cases_to_d, _cases_gradient_estimation,
                    _cases_ipndm, _cases_dpmpp_sde, _cases_er_sde, _cases_deis)
from .launch import _LINCOMB_ENTRIES, _entry, device_noise_metal, device_noise_ref
from .noise import (BrownianBridge, DeviceNoise, _hash32_int, _hash32_tensor, _index_hash, device_noise_reference,
                    iid_noise, node_keys)
from .sigmas import (ancestral_step, cfg_pp_alpha, dpmpp_2s_midpoint_sigma, dpmpp_sde_h, half_log_snr,
                     res_multistep_coefficients)
from .steps import (churn_ref, churn_metal, euler_ref, euler_metal, euler_ancestral_ref, euler_ancestral_metal,
                    heun_ref, heun_metal, dpmpp_2m_ref, dpmpp_2m_metal, dpmpp_2m_sde_ref, dpmpp_2m_sde_metal,
                    dpmpp_3m_sde_ref, dpmpp_3m_sde_metal, lcm_ref, lcm_metal, res_multistep_ref,
                    res_multistep_metal, euler_cfg_pp_ref, euler_cfg_pp_metal, dpmpp_2m_cfg_pp_ref,
                    dpmpp_2m_cfg_pp_metal, res_multistep_cfg_pp_ref, res_multistep_cfg_pp_metal,
                    dpmpp_2s_ancestral_cfg_pp_ref, dpmpp_2s_ancestral_cfg_pp_metal)
from .steps_more import (dpmpp_sde_metal, dpmpp_sde_plan, dpmpp_sde_ref, er_sde_metal, er_sde_plans, er_sde_ref,
                         gradient_estimation_metal,
                         gradient_estimation_ref, ipndm_metal, ipndm_ref, to_d_metal, to_d_ref)
from .deis import DEIS_MAX_ORDERS, DEIS_MODES, deis_coefficients, deis_metal, deis_ref
from .unipc import (UniPCPlan, final_scale as unipc_final_scale, model_input_scale as unipc_model_input_scale,
                    uni_pc_metal, uni_pc_ref, unipc_plan)

# The public functions: the step kernels (each a registered kernel). The helpers the samplers share (noise,
# the host-side coefficients) are this package's attributes, not re-exported by metal_kernels.
__all__ = [
    "sampler_device_noise", "sampler_churn_step", "sampler_euler_step", "sampler_euler_ancestral_step",
    "sampler_heun_step", "sampler_dpmpp_2m_step", "sampler_dpmpp_2m_sde_step", "sampler_dpmpp_3m_sde_step",
    "sampler_lcm_step", "sampler_res_multistep_step", "sampler_euler_cfg_pp_step", "sampler_dpmpp_2m_cfg_pp_step",
    "sampler_res_multistep_cfg_pp_step", "sampler_dpmpp_2s_ancestral_cfg_pp_step", "sampler_uni_pc_step",
    "sampler_to_d_step", "sampler_gradient_estimation_step", "sampler_ipndm_step", "sampler_dpmpp_sde_step",
    "sampler_er_sde_step", "sampler_deis_step",
]


# fp32: the fused form re-associates ComfyUI's expression and the kernel's log/cos may differ in the
# last bits from torch's, so a few ulps of the largest term; fp16/bf16 get the dtype floor on top.
_ATOL, _RTOL = 2e-5, 2e-5


def _spec(name, ref, metal, cases, entries=_LINCOMB_ENTRIES):
    # a step with a non-finite output sets flags[step]
    writes = ("flags",) if "flags" in inspect.signature(ref).parameters else ()
    return register(KernelSpec(name=name, source="sampling.metal", entry_points=entries, reference=ref, metal=metal,
                               self_check_cases=cases, atol=_ATOL, rtol=_RTOL, writes=writes))


sampler_device_noise = _spec("sampler_device_noise", device_noise_ref, device_noise_metal, _cases_noise,
                             _entry("noise"))
sampler_churn_step = _spec("sampler_churn_step", churn_ref, churn_metal, _cases_churn)
sampler_euler_step = _spec("sampler_euler_step", euler_ref, euler_metal, _cases_euler)
sampler_euler_ancestral_step = _spec("sampler_euler_ancestral_step", euler_ancestral_ref, euler_ancestral_metal,
                                     _cases_euler_ancestral)
sampler_heun_step = _spec("sampler_heun_step", heun_ref, heun_metal, _cases_heun)
sampler_dpmpp_2m_step = _spec("sampler_dpmpp_2m_step", dpmpp_2m_ref, dpmpp_2m_metal, _cases_dpmpp_2m)
sampler_dpmpp_2m_sde_step = _spec("sampler_dpmpp_2m_sde_step", dpmpp_2m_sde_ref, dpmpp_2m_sde_metal,
                                  _cases_dpmpp_2m_sde)
sampler_dpmpp_3m_sde_step = _spec("sampler_dpmpp_3m_sde_step", dpmpp_3m_sde_ref, dpmpp_3m_sde_metal,
                                  _cases_dpmpp_3m_sde)
sampler_lcm_step = _spec("sampler_lcm_step", lcm_ref, lcm_metal, _cases_lcm)
sampler_res_multistep_step = _spec("sampler_res_multistep_step", res_multistep_ref, res_multistep_metal,
                                   _cases_res_multistep)
sampler_euler_cfg_pp_step = _spec("sampler_euler_cfg_pp_step", euler_cfg_pp_ref, euler_cfg_pp_metal,
                                  _cases_euler_cfg_pp)
sampler_dpmpp_2m_cfg_pp_step = _spec("sampler_dpmpp_2m_cfg_pp_step", dpmpp_2m_cfg_pp_ref, dpmpp_2m_cfg_pp_metal,
                                     _cases_dpmpp_2m_cfg_pp)
sampler_res_multistep_cfg_pp_step = _spec("sampler_res_multistep_cfg_pp_step", res_multistep_cfg_pp_ref,
                                          res_multistep_cfg_pp_metal, _cases_res_multistep_cfg_pp)
sampler_dpmpp_2s_ancestral_cfg_pp_step = _spec("sampler_dpmpp_2s_ancestral_cfg_pp_step", dpmpp_2s_ancestral_cfg_pp_ref,
                                               dpmpp_2s_ancestral_cfg_pp_metal, _cases_dpmpp_2s_ancestral_cfg_pp)

sampler_uni_pc_step = _spec("sampler_uni_pc_step", uni_pc_ref, uni_pc_metal, _cases_uni_pc)
sampler_to_d_step = _spec("sampler_to_d_step", to_d_ref, to_d_metal, _cases_to_d)
sampler_gradient_estimation_step = _spec("sampler_gradient_estimation_step", gradient_estimation_ref,
                                         gradient_estimation_metal, _cases_gradient_estimation)
sampler_ipndm_step = _spec("sampler_ipndm_step", ipndm_ref, ipndm_metal, _cases_ipndm)
sampler_dpmpp_sde_step = _spec("sampler_dpmpp_sde_step", dpmpp_sde_ref, dpmpp_sde_metal, _cases_dpmpp_sde)
sampler_er_sde_step = _spec("sampler_er_sde_step", er_sde_ref, er_sde_metal, _cases_er_sde)
sampler_deis_step = _spec("sampler_deis_step", deis_ref, deis_metal, _cases_deis)
