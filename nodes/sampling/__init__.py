"""Metal samplers: ComfyUI's samplers with one fused kernel per step and no host sync in the loop.

samplers.py (the step loop and the plain samplers), cfg_pp.py (CFG++), unipc.py (uni_pc, uni_pc_bh2), more.py
(ddim, dpmpp_2m_sde_gpu, res_multistep_ancestral, dpmpp_2s_ancestral, dpmpp_sde, er_sde,
gradient_estimation(_cfg_pp), ipndm, deis), functions.py (by name, for KSAMPLER), nodes.py (Metal Sampler Select
and the KSampler list entries). The kernels are in
metal_kernels/sampling/.
"""
from .cfg_pp import (sample_dpmpp_2m_cfg_pp_metal, sample_dpmpp_2s_ancestral_cfg_pp_metal,
                     sample_euler_ancestral_cfg_pp_metal, sample_euler_cfg_pp_metal, sample_res_multistep_cfg_pp_metal)
from .functions import SAMPLER_FUNCTIONS, SAMPLER_KERNELS, comfy_function, get_sampler_function, sampler_options
from .more import (sample_ddim_metal, sample_deis_metal, sample_dpmpp_2m_sde_gpu_metal,
                   sample_dpmpp_2s_ancestral_metal, sample_dpmpp_sde_metal, sample_er_sde_metal,
                   sample_gradient_estimation_cfg_pp_metal, sample_gradient_estimation_metal, sample_ipndm_metal,
                   sample_res_multistep_ancestral_metal)
from .unipc import sample_uni_pc_bh2_metal, sample_uni_pc_metal
from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, MetalSamplerSelect, register_ksampler_entries
from .samplers import (CFG_PP_NAMES, NOISE_ENV, NOISE_MODES, SAMPLER_NAMES, SamplingError, default_noise_mode, is_flow,
                       sample_dpmpp_2m_metal, sample_dpmpp_2m_sde_metal, sample_dpmpp_3m_sde_metal, sample_euler_ancestral_metal,
                       sample_euler_metal, sample_heun_metal, sample_lcm_metal, sample_res_multistep_metal)

__all__ = ["comfy_function", "SAMPLER_FUNCTIONS", "SAMPLER_KERNELS", "get_sampler_function", "sampler_options",
           "NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "MetalSamplerSelect", "register_ksampler_entries",
           "CFG_PP_NAMES", "NOISE_ENV",
           "NOISE_MODES", "SAMPLER_NAMES", "SamplingError", "default_noise_mode", "is_flow",
           "sample_dpmpp_2m_cfg_pp_metal", "sample_dpmpp_2s_ancestral_cfg_pp_metal",
           "sample_euler_ancestral_cfg_pp_metal", "sample_euler_cfg_pp_metal", "sample_res_multistep_cfg_pp_metal",
           "sample_dpmpp_2m_metal", "sample_dpmpp_2m_sde_metal", "sample_dpmpp_3m_sde_metal",
           "sample_euler_ancestral_metal", "sample_euler_metal", "sample_heun_metal", "sample_lcm_metal",
           "sample_res_multistep_metal", "sample_ddim_metal", "sample_dpmpp_2m_sde_gpu_metal",
           "sample_dpmpp_2s_ancestral_metal", "sample_deis_metal", "sample_dpmpp_sde_metal", "sample_er_sde_metal",
           "sample_gradient_estimation_cfg_pp_metal",
           "sample_gradient_estimation_metal", "sample_ipndm_metal", "sample_res_multistep_ancestral_metal",
           "sample_uni_pc_bh2_metal", "sample_uni_pc_metal"]
