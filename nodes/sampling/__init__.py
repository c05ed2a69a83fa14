"""Metal samplers: ComfyUI's samplers with one fused kernel per step and no host sync in the loop.

functions.py holds the one table of the samplers (`SAMPLERS`) and every list derived from it; samplers.py the
step loop and the plain samplers, cfg_pp.py the CFG++ ones, unipc.py uni_pc(_bh2), more.py the rest;
nodes.py Metal Sampler Select and the `<name>_metal` KSampler entries. The kernels are in
metal_kernels/sampling/.
"""
from .functions import (CFG_PP_NAMES, SAMPLER_FUNCTIONS, SAMPLER_KERNELS, SAMPLER_NAMES, SAMPLERS, Sampler,
                        comfy_function, get_sampler_function, sampler_definition, sampler_options)
from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, MetalSamplerSelect, register_ksampler_entries
from .samplers import NOISE_CHOICES, NOISE_ENV, SamplingError, default_noise_mode

__all__ = ["SAMPLERS", "Sampler", "SAMPLER_NAMES", "CFG_PP_NAMES", "SAMPLER_FUNCTIONS", "SAMPLER_KERNELS",
           "comfy_function", "get_sampler_function", "sampler_definition", "sampler_options",
           "NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "MetalSamplerSelect", "register_ksampler_entries",
           "NOISE_CHOICES", "NOISE_ENV", "SamplingError", "default_noise_mode"]
