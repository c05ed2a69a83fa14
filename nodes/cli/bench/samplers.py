"""`python -m comfy_metal bench --only samplers`: per-step cost of the pack's samplers against ComfyUI's.

For each latent size (SDXL 1024x1024: 4x128x128; Wan 2.2 720p, 21 latent frames: 48x21x44x80) and
each sampler: milliseconds per step of the pack's sampler with fast noise (device Brownian bridge /
counter-based normals) and exact noise (ComfyUI's own noise sampler), and of ComfyUI's sampler of
the same name; on the CPU the pack runs its reference path, on a Mac (MPS) its Metal kernels.
The denoiser is a trivial `0.5 * x` so the sampler's own work is what is timed (the model's pass is
the same for both). Bytes per step: what the fused Metal kernels move (each input read once, the new
latent written once; the minimum for the step), against the aten-level traffic of ComfyUI's step
(every tensor read and written by every op of the step, the model excluded) and host syncs per
step. ComfyUI is found through an already-loaded ComfyUI or $COMFYUI_PATH; without it the
comparison column says "ComfyUI not found".
"""
from __future__ import annotations

import math
import time
import types

from ...common.comfyui import import_comfy
from ...common.report import Table, human_bytes, synchronize
from ...common.syncs import SyncCounter

LATENTS = [
    ("SDXL 1024x1024 (4x128x128)", (1, 4, 128, 128)),
    ("Wan 2.2 720p 21f (48x21x44x80)", (1, 48, 21, 44, 80)),
]


def _comfy_sampling():
    """ComfyUI's k-diffusion sampling module, or (None, why not)."""
    return import_comfy("comfy.k_diffusion.sampling")


class _Denoiser:
    """denoised = 0.5 * x, with the attributes ComfyUI's samplers read; epsilon model sampling. The
    post-CFG functions of model_options (ComfyUI's CFG++ samplers install one) run as after a CFG whose
    conditional and unconditional outputs are both 0.5 * x."""

    def __init__(self, traffic=None):
        ms = _EpsSampling()
        self.inner_model = types.SimpleNamespace(inner_model=types.SimpleNamespace(model_sampling=ms),
                                                 model_patcher=types.SimpleNamespace(get_model_object=lambda n: ms))
        self.traffic = traffic

    def __call__(self, x, sigma, **kwargs):
        if self.traffic is not None:
            self.traffic.paused = True
        try:
            out = x * 0.5
            for fn in kwargs.get("model_options", {}).get("sampler_post_cfg_function", []):
                out = fn({"denoised": out, "cond_denoised": out, "uncond_denoised": out, "sigma": sigma, "input": x})
            return out
        finally:
            if self.traffic is not None:
                self.traffic.paused = False


class _EpsSampling:
    def noise_scaling(self, sigma, noise, latent_image, max_denoise=False):
        sigma = sigma.view(()) if sigma.numel() == 1 else sigma.view(sigma.shape[:1] + (1,) * (noise.ndim - 1))
        return noise * sigma + latent_image


def _traffic_mode():
    import torch

    class Traffic(SyncCounter):
        """Bytes of every tensor each aten op reads and writes, and host syncs (model excluded)."""

        def __init__(self):
            super().__init__()
            self.bytes = 0
            self.paused = False

        @property
        def syncs(self) -> int:
            return self.total

        def __torch_dispatch__(self, func, types_, args=(), kwargs=None):
            kwargs = kwargs or {}
            out = func(*args, **kwargs)
            if not self.paused:
                self.note(func, args, kwargs)
                seen = set()
                for t in list(args) + list(kwargs.values()) + (list(out) if isinstance(out, (tuple, list)) else [out]):
                    if isinstance(t, torch.Tensor) and id(t) not in seen:
                        seen.add(id(t))
                        self.bytes += t.numel() * t.element_size()
            return out

    return Traffic()


def _sigmas(steps):
    import torch

    ramp = torch.linspace(0, 1, steps)
    lo, hi = 0.0292 ** (1 / 7), 14.6146 ** (1 / 7)
    return torch.cat([(hi + ramp * (lo - hi)) ** 7, torch.zeros(1)])


def _time_per_step(fn, steps, device, repeats=3):
    """Best of `repeats` runs (shared machines are noisy), in ms per step."""
    best = math.inf
    for _ in range(repeats):
        synchronize(device)
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        best = min(best, time.perf_counter() - t0)
    return best * 1000 / steps


def bench(quick: bool = False) -> list[Table]:
    import torch

    from ....metal_kernels import dispatch, probe
    from ... import sampling as S

    kds, why_not = _comfy_sampling()
    devices = ["cpu"] + (["mps"] if probe.mps_available() else [])
    latents = LATENTS[:1] if quick else LATENTS
    time_table = Table(
        "Samplers: ms per step, best of 3 (6 steps; 3 steps once for latents over 1M elements; "
        "pack: reference path on cpu, Metal kernels on mps)",
        ["latent", "sampler", "device", "pack fast", "pack exact", "ComfyUI", "ComfyUI / pack fast"])
    bytes_table = Table(
        "Samplers: bytes moved per step (model excluded) and host syncs per step",
        ["latent", "sampler", "fused kernel (= minimum)", "exact noise fused", "ComfyUI aten traffic",
         "ComfyUI / fused", "ComfyUI syncs/step", "pack syncs/step"])
    for label, shape in latents:
        numel = math.prod(shape)
        big = numel > 1_000_000
        repeats = 1 if big else 3
        steps = 3 if (quick or big) else 6
        for device in devices:
            sigmas = _sigmas(steps).to(device)
            x = torch.randn(shape, generator=torch.Generator().manual_seed(0)).to(device) * float(sigmas[0])
            for sampler in S.SAMPLERS:
                name, ours = sampler.name, S.SAMPLER_FUNCTIONS[sampler.name]
                model = _Denoiser()
                run = lambda mode: ours(model, x.clone(), sigmas.clone(),  # noqa: E731
                                        extra_args={"seed": 1}, disable=True, noise_mode=mode)
                for _ in range(1 if big else 2):
                    run("fast")  # warm-up: kernel self-check / compile, allocator, thread pool
                fast = _time_per_step(lambda: run("fast"), steps, device, repeats)
                exact = _time_per_step(lambda: run("exact"), steps, device, repeats) if (sampler.noisy and kds) else \
                    (fast if not sampler.noisy else float("nan"))
                if kds is not None:
                    theirs_fn = S.comfy_function(name)
                    theirs = _time_per_step(lambda: theirs_fn(model, x.clone(), sigmas.clone(),
                                                              extra_args={"seed": 1}, disable=True),
                                            steps, device, repeats)
                    ratio = f"{theirs / fast:.2f}x"
                else:
                    theirs, ratio = why_not, "n/a"
                time_table.add(label, name, device, fast, exact, theirs, ratio)
        # bytes and syncs per step, on the CPU (aten traffic is device independent)
        sigmas = _sigmas(steps)
        x = torch.randn(shape, generator=torch.Generator().manual_seed(0)) * float(sigmas[0])
        for name in S.SAMPLER_NAMES:
            ours_traffic = _traffic_mode()
            with ours_traffic, dispatch.recording_traffic() as kernel_traffic:
                S.SAMPLER_FUNCTIONS[name](_Denoiser(ours_traffic), x.clone(), sigmas.clone(), extra_args={"seed": 1},
                                          disable=True, noise_mode="fast")
            fused = kernel_traffic.bytes / steps
            fused_exact = why_not
            if kds is not None:
                with dispatch.recording_traffic() as kernel_traffic:
                    S.SAMPLER_FUNCTIONS[name](_Denoiser(), x.clone(), sigmas.clone(), extra_args={"seed": 1},
                                              disable=True, noise_mode="exact")
                fused_exact = human_bytes(kernel_traffic.bytes / steps)
            if kds is not None:
                traffic = _traffic_mode()
                with traffic:
                    S.comfy_function(name)(_Denoiser(traffic), x.clone(), sigmas.clone(), extra_args={"seed": 1},
                                           disable=True)
                cb, cs = human_bytes(traffic.bytes / steps), f"{traffic.syncs / steps:.1f}"
                cr = f"{traffic.bytes / steps / fused:.1f}x"
            else:
                cb, cs, cr = why_not, "n/a", "n/a"
            bytes_table.add(label, name, human_bytes(fused), fused_exact, cb, cr, cs,
                            f"{ours_traffic.syncs / steps:.2f} (one-time reads only)")
    time_table.note = ("pack exact = ComfyUI's own noise sampler (identical results); fast = device noise, no host "
                       "sync. nan: exact mode needs ComfyUI. " + ("" if kds else why_not))
    bytes_table.note = ("fused kernel: measured from the pack's kernel calls in the run (metal_kernels.dispatch."
                        "recording_traffic): each tensor argument once + the outputs, which is what a fused kernel "
                        "reads and writes (fast noise is generated in the kernel, exact noise is one more input). "
                        "pack syncs/step: the schedule read and NaN record, once per run, divided by the steps.")
    return [time_table, bytes_table]
