"""The sampler functions by name (what KSAMPLER and ComfyUI's sampler list take), each recording the
backend of its step kernels for the node badge."""
from __future__ import annotations

import functools
import inspect

from ...metal_kernels.registry import REGISTRY

from .cfg_pp import (sample_dpmpp_2m_cfg_pp_metal, sample_dpmpp_2s_ancestral_cfg_pp_metal,
                     sample_euler_ancestral_cfg_pp_metal, sample_euler_cfg_pp_metal,
                     sample_res_multistep_cfg_pp_metal)
from .samplers import (NOISE_CHOICES, SAMPLER_NAMES, SamplingError, sample_dpmpp_2m_metal,
                       sample_dpmpp_2m_sde_metal, sample_dpmpp_3m_sde_metal, sample_euler_ancestral_metal,
                       sample_euler_metal, sample_heun_metal, sample_lcm_metal, sample_res_multistep_metal)
from .more import (sample_ddim_metal, sample_deis_metal, sample_dpmpp_2m_sde_gpu_metal,
                   sample_dpmpp_2s_ancestral_metal, sample_dpmpp_sde_metal, sample_er_sde_metal,
                   sample_gradient_estimation_cfg_pp_metal, sample_gradient_estimation_metal, sample_ipndm_metal,
                   sample_res_multistep_ancestral_metal)
from .unipc import sample_uni_pc_bh2_metal, sample_uni_pc_metal

SAMPLER_FUNCTIONS = {
    "euler": sample_euler_metal,
    "euler_ancestral": sample_euler_ancestral_metal,
    "heun": sample_heun_metal,
    "dpmpp_2m": sample_dpmpp_2m_metal,
    "dpmpp_2m_sde": sample_dpmpp_2m_sde_metal,
    "dpmpp_3m_sde": sample_dpmpp_3m_sde_metal,
    "lcm": sample_lcm_metal,
    "res_multistep": sample_res_multistep_metal,
    "euler_cfg_pp": sample_euler_cfg_pp_metal,
    "euler_ancestral_cfg_pp": sample_euler_ancestral_cfg_pp_metal,
    "dpmpp_2m_cfg_pp": sample_dpmpp_2m_cfg_pp_metal,
    "dpmpp_2s_ancestral_cfg_pp": sample_dpmpp_2s_ancestral_cfg_pp_metal,
    "res_multistep_cfg_pp": sample_res_multistep_cfg_pp_metal,
    "uni_pc": sample_uni_pc_metal,
    "uni_pc_bh2": sample_uni_pc_bh2_metal,
    "ddim": sample_ddim_metal,
    "dpmpp_2m_sde_gpu": sample_dpmpp_2m_sde_gpu_metal,
    "res_multistep_ancestral": sample_res_multistep_ancestral_metal,
    "dpmpp_2s_ancestral": sample_dpmpp_2s_ancestral_metal,
    "gradient_estimation": sample_gradient_estimation_metal,
    "gradient_estimation_cfg_pp": sample_gradient_estimation_cfg_pp_metal,
    "ipndm": sample_ipndm_metal,
    "dpmpp_sde": sample_dpmpp_sde_metal,
    "er_sde": sample_er_sde_metal,
    "deis": sample_deis_metal,
}

# ComfyUI's sampler of each name where it is not comfy.k_diffusion.sampling.sample_<name> (module, function).
COMFY_FUNCTIONS = {"ddim": ("comfy.k_diffusion.sampling", "sample_euler"),
                   "uni_pc": ("comfy.extra_samplers.uni_pc", "sample_unipc"),
                   "uni_pc_bh2": ("comfy.extra_samplers.uni_pc", "sample_unipc_bh2")}
# ComfyUI's KSAMPLER inpaint_options of the samplers that set them (comfy.samplers.sampler_object).
INPAINT_OPTIONS = {"ddim": {"random": True}}
# Samplers ComfyUI's KSampler runs on a schedule without its penultimate sigma (KSampler.DISCARD_PENULTIMATE_...).
DISCARD_PENULTIMATE = ("uni_pc", "uni_pc_bh2")


def comfy_function(name: str):
    """ComfyUI's own sampler function of that name (imports ComfyUI: benches and tests only)."""
    import importlib

    module, attr = COMFY_FUNCTIONS.get(name, ("comfy.k_diffusion.sampling", f"sample_{name}"))
    return getattr(importlib.import_module(module), attr)


SAMPLER_KERNELS = tuple(name for name in REGISTRY if name.startswith("sampler_"))


def _recorded(fn):
    """The sampler function, recording (for the node badge) which backend its step kernels used.
    The record goes to the executing node (KSampler, SamplerCustom...)."""
    @functools.wraps(fn)
    def sampler(*args, **kwargs):
        from ..status import recording_kernels

        with recording_kernels(None, SAMPLER_KERNELS):
            return fn(*args, **kwargs)

    return sampler


SAMPLER_FUNCTIONS = {name: _recorded(fn) for name, fn in SAMPLER_FUNCTIONS.items()}


def get_sampler_function(name: str):
    """The sampler function for "euler" or "euler_metal" etc.; a clear error for anything else."""
    key = name[:-len("_metal")] if isinstance(name, str) and name.endswith("_metal") else name
    fn = SAMPLER_FUNCTIONS.get(key)
    if fn is None:
        raise SamplingError(f"unknown Metal sampler {name!r}; available: "
                            f"{', '.join(SAMPLER_NAMES)} (or the same with _metal)")
    return fn


def sampler_options(name: str, noise_mode: str = "auto", eta: float = 1.0, s_noise: float = 1.0) -> dict:
    """The KSAMPLER extra_options for a sampler: noise_mode, and eta / s_noise where it takes them."""
    fn = get_sampler_function(name)
    if noise_mode not in NOISE_CHOICES:
        raise SamplingError(f"noise_mode {noise_mode!r} is not one of {', '.join(NOISE_CHOICES)}")
    params = inspect.signature(fn).parameters
    options = {"noise_mode": noise_mode}
    # ComfyUI's res_multistep(_cfg_pp) run with eta 0 (eta > 0 is its separate _ancestral sampler)
    if "eta" in params and name.replace("_metal", "") not in ("res_multistep", "res_multistep_cfg_pp"):
        options["eta"] = float(eta)
    if "s_noise" in params:
        options["s_noise"] = float(s_noise)
    return options
