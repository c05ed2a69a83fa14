"""Node: Metal Sampler Select, and the <name>_metal entries in ComfyUI's KSampler sampler list."""
from __future__ import annotations

import logging
import sys

from .functions import SAMPLER_FUNCTIONS, SAMPLER_NAMES, SAMPLERS, sampler_definition, sampler_options
from .samplers import NOISE_CHOICES

log = logging.getLogger("comfy_metal")

# --------------------------------------------------------------------------------------------
# ComfyUI exposure
# --------------------------------------------------------------------------------------------

def register_ksampler_entries() -> list[str]:
    """Add `<name>_metal` to ComfyUI's KSampler sampler lists and `sample_<name>_metal` to
    comfy.k_diffusion.sampling (where KSampler looks samplers up). Idempotent: an entry that is
    already there (built-in or registered earlier) is left as it is.
    Does nothing unless ComfyUI's modules are already loaded (never imports ComfyUI itself)."""
    samplers = sys.modules.get("comfy.samplers")
    kds = sys.modules.get("comfy.k_diffusion.sampling")
    if samplers is None or kds is None:
        return []
    added = []
    try:
        lists = []
        for attr in ("KSAMPLER_NAMES", "SAMPLER_NAMES"):
            lst = getattr(samplers, attr, None)
            if isinstance(lst, list) and all(lst is not other for other in lists):
                lists.append(lst)
        ks_list = getattr(getattr(samplers, "KSampler", None), "SAMPLERS", None)
        if isinstance(ks_list, list) and all(ks_list is not other for other in lists):
            lists.append(ks_list)
        for name in SAMPLER_NAMES:
            full = f"{name}_metal"
            if getattr(kds, f"sample_{full}", None) is None:   # add, never replace an existing entry
                setattr(kds, f"sample_{full}", SAMPLER_FUNCTIONS[name])
            for lst in lists:
                if full not in lst:
                    lst.append(full)
                    added.append(full)
        # uni_pc(_bh2)_metal get the schedule ComfyUI's KSampler gives uni_pc(_bh2)
        discard = getattr(getattr(samplers, "KSampler", None), "DISCARD_PENULTIMATE_SIGMA_SAMPLERS", None)
        if isinstance(discard, set):
            discard.update(f"{s.name}_metal" for s in SAMPLERS if s.discard_penultimate)
    except Exception as e:  # never break ComfyUI's start over a dropdown entry
        log.warning("comfy_metal: could not add the Metal samplers to KSampler: %s: %s", type(e).__name__, e)
    return added


class MetalSamplerSelect:
    """A SAMPLER (for SamplerCustom / SamplerCustomAdvanced) running the pack's fused samplers."""

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {
            "sampler_name": (list(SAMPLER_NAMES), {"tooltip": "ComfyUI's sampler of the same name, each step one fused Metal "
                             "kernel (same maths; the KSampler list has them as <name>_metal too)"}),
            "noise_mode": (list(NOISE_CHOICES), {"default": "auto", "tooltip":
                           "auto: fast on Apple GPUs (MPS), exact on CPU/CUDA (faster there); fast: device-side "
                           "Brownian/i.i.d. noise, no host syncs; exact: ComfyUI's own noise sampler (results "
                           "identical to ComfyUI's sampler)"}),
            "eta": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 100.0, "step": 0.01,
                              "tooltip": "Ancestral / SDE samplers: how much fresh noise each step adds (1 = "
                                         "the sampler's standard amount, 0 = none: deterministic). Others ignore it."}),
            "s_noise": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 100.0, "step": 0.01,
                                  "tooltip": "Scale of the added noise (multiplies the noise eta asks for; 1 = "
                                             "unscaled, 0 = no noise). Samplers that add no noise ignore it."}),
        }}

    RETURN_TYPES = ("SAMPLER",)
    FUNCTION = "get_sampler"
    CATEGORY = "Comfy Metal/Sampling"
    DESCRIPTION = "ComfyUI's samplers with one fused Metal kernel per step and no host sync in the loop."

    def get_sampler(self, sampler_name, noise_mode="auto", eta=1.0, s_noise=1.0):
        import comfy.samplers

        register_ksampler_entries()
        sampler = sampler_definition(sampler_name)
        return (comfy.samplers.KSAMPLER(SAMPLER_FUNCTIONS[sampler.name],
                                        sampler_options(sampler_name, noise_mode, eta, s_noise),
                                        dict(sampler.inpaint_options)),)


NODE_CLASS_MAPPINGS = {"MetalSamplerSelect": MetalSamplerSelect}
NODE_DISPLAY_NAME_MAPPINGS = {"MetalSamplerSelect": "Metal Sampler Select"}

# Pack load inside ComfyUI: the sampler list gains the <name>_metal entries.
register_ksampler_entries()
