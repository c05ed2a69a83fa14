"""The one table of the Metal samplers, and every list derived from it.

Each `Sampler` names ComfyUI's sampler, the pack's function for it, ComfyUI's own function (the oracle of the
tests and benches) and the options ComfyUI's KSampler gives it. The sampler names (Metal Sampler Select, the
`<name>_metal` KSampler entries, the bench's rows) and the functions by name (what KSAMPLER takes, each
recording the backend of its step kernels for the node badge) all come from `SAMPLERS`.
"""
from __future__ import annotations

import dataclasses
import functools
import inspect
from typing import Callable

from ...metal_kernels.registry import REGISTRY

from .cfg_pp import (sample_dpmpp_2m_cfg_pp_metal, sample_dpmpp_2s_ancestral_cfg_pp_metal,
                     sample_euler_ancestral_cfg_pp_metal, sample_euler_cfg_pp_metal,
                     sample_res_multistep_cfg_pp_metal)
from .samplers import (NOISE_CHOICES, SamplingError, sample_dpmpp_2m_metal, sample_dpmpp_2m_sde_metal,
                       sample_dpmpp_3m_sde_metal, sample_euler_ancestral_metal, sample_euler_metal, sample_heun_metal,
                       sample_lcm_metal, sample_res_multistep_metal)
from .more import (sample_ddim_metal, sample_deis_metal, sample_dpmpp_2m_sde_gpu_metal,
                   sample_dpmpp_2s_ancestral_metal, sample_dpmpp_sde_metal, sample_er_sde_metal,
                   sample_gradient_estimation_cfg_pp_metal, sample_gradient_estimation_metal, sample_ipndm_metal,
                   sample_res_multistep_ancestral_metal)
from .unipc import sample_uni_pc_bh2_metal, sample_uni_pc_metal

_KDIFFUSION = "comfy.k_diffusion.sampling"


@dataclasses.dataclass(frozen=True)
class Sampler:
    """ComfyUI's sampler `name`, run by the pack as `<name>_metal`.

    function: the pack's sampler (the k-diffusion signature and options of ComfyUI's, plus noise_mode).
    comfy: ComfyUI's own function as (module, attribute); None: comfy.k_diffusion.sampling.sample_<name>.
    noisy: it adds noise every step, so it takes the eta option where it has one and has an exact noise mode.
    inpaint_options: the KSAMPLER inpaint_options ComfyUI gives it (comfy.samplers.sampler_object).
    discard_penultimate: KSampler runs it on a schedule without the penultimate sigma
    (KSampler.DISCARD_PENULTIMATE_SIGMA_SAMPLERS).
    """
    name: str
    function: Callable
    comfy: tuple[str, str] | None = None
    noisy: bool = False
    inpaint_options: dict = dataclasses.field(default_factory=dict)
    discard_penultimate: bool = False


# In the order of the sampler lists (KSampler, Metal Sampler Select).
SAMPLERS = (
    Sampler("euler", sample_euler_metal),
    Sampler("euler_ancestral", sample_euler_ancestral_metal, noisy=True),
    Sampler("heun", sample_heun_metal),
    Sampler("dpmpp_2m", sample_dpmpp_2m_metal),
    Sampler("dpmpp_2m_sde", sample_dpmpp_2m_sde_metal, noisy=True),
    Sampler("dpmpp_3m_sde", sample_dpmpp_3m_sde_metal, noisy=True),
    Sampler("lcm", sample_lcm_metal, noisy=True),
    # ComfyUI's res_multistep(_cfg_pp) run with eta 0 (eta > 0 is its separate _ancestral sampler)
    Sampler("res_multistep", sample_res_multistep_metal),
    Sampler("euler_cfg_pp", sample_euler_cfg_pp_metal),
    Sampler("euler_ancestral_cfg_pp", sample_euler_ancestral_cfg_pp_metal, noisy=True),
    Sampler("dpmpp_2m_cfg_pp", sample_dpmpp_2m_cfg_pp_metal),
    Sampler("dpmpp_2s_ancestral_cfg_pp", sample_dpmpp_2s_ancestral_cfg_pp_metal, noisy=True),
    Sampler("res_multistep_cfg_pp", sample_res_multistep_cfg_pp_metal),
    Sampler("uni_pc", sample_uni_pc_metal, comfy=("comfy.extra_samplers.uni_pc", "sample_unipc"),
            discard_penultimate=True),
    Sampler("uni_pc_bh2", sample_uni_pc_bh2_metal, comfy=("comfy.extra_samplers.uni_pc", "sample_unipc_bh2"),
            discard_penultimate=True),
    Sampler("ddim", sample_ddim_metal, comfy=(_KDIFFUSION, "sample_euler"), inpaint_options={"random": True}),
    Sampler("dpmpp_2m_sde_gpu", sample_dpmpp_2m_sde_gpu_metal, noisy=True),
    Sampler("res_multistep_ancestral", sample_res_multistep_ancestral_metal, noisy=True),
    Sampler("dpmpp_2s_ancestral", sample_dpmpp_2s_ancestral_metal, noisy=True),
    Sampler("gradient_estimation", sample_gradient_estimation_metal),
    Sampler("gradient_estimation_cfg_pp", sample_gradient_estimation_cfg_pp_metal),
    Sampler("ipndm", sample_ipndm_metal),
    Sampler("dpmpp_sde", sample_dpmpp_sde_metal, noisy=True),
    Sampler("er_sde", sample_er_sde_metal, noisy=True),
    Sampler("deis", sample_deis_metal),
)
_BY_NAME = {s.name: s for s in SAMPLERS}

SAMPLER_NAMES = tuple(_BY_NAME)
CFG_PP_NAMES = tuple(n for n in SAMPLER_NAMES if n.endswith("_cfg_pp"))
SAMPLER_KERNELS = tuple(name for name in REGISTRY if name.startswith("sampler_"))


def comfy_function(name: str):
    """ComfyUI's own sampler function of that name (imports ComfyUI: benches and tests only)."""
    import importlib

    module, attr = _BY_NAME[name].comfy or (_KDIFFUSION, f"sample_{name}")
    return getattr(importlib.import_module(module), attr)


def _recorded(fn):
    """The sampler function, recording (for the node badge) which backend its step kernels used.
    The record goes to the executing node (KSampler, SamplerCustom...)."""
    @functools.wraps(fn)
    def sampler(*args, **kwargs):
        from ..status import recording_kernels

        with recording_kernels(None, SAMPLER_KERNELS):
            return fn(*args, **kwargs)

    return sampler


SAMPLER_FUNCTIONS = {s.name: _recorded(s.function) for s in SAMPLERS}


def sampler_definition(name: str) -> Sampler:
    """The table entry for "euler" or "euler_metal" etc.; a clear error for anything else."""
    key = name[:-len("_metal")] if isinstance(name, str) and name.endswith("_metal") else name
    found = _BY_NAME.get(key)
    if found is None:
        raise SamplingError(f"unknown Metal sampler {name!r}; available: "
                            f"{', '.join(SAMPLER_NAMES)} (or the same with _metal)")
    return found


def get_sampler_function(name: str):
    """The sampler function for "euler" or "euler_metal" etc.; a clear error for anything else."""
    return SAMPLER_FUNCTIONS[sampler_definition(name).name]


def sampler_options(name: str, noise_mode: str = "auto", eta: float = 1.0, s_noise: float = 1.0) -> dict:
    """The KSAMPLER extra_options for a sampler: noise_mode, and eta / s_noise where it takes them."""
    sampler = sampler_definition(name)
    if noise_mode not in NOISE_CHOICES:
        raise SamplingError(f"noise_mode {noise_mode!r} is not one of {', '.join(NOISE_CHOICES)}")
    params = inspect.signature(sampler.function).parameters
    options = {"noise_mode": noise_mode}
    if "eta" in params and sampler.noisy:
        options["eta"] = float(eta)
    if "s_noise" in params:
        options["s_noise"] = float(s_noise)
    return options
