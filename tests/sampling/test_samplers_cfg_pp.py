"""The CFG++ Metal samplers (euler_cfg_pp, euler_ancestral_cfg_pp, dpmpp_2m_cfg_pp, res_multistep_cfg_pp).

The generic sampler tests in test_samplers.py / test_samplers_unet.py cover them too (every name in
SAMPLER_NAMES: kernels vs references in the emulator, emulator vs reference, zero host syncs per
step, KSampler list registration, KSampler on a tiny SD1.5-architecture UNet with cfg 2 against
ComfyUI's sampler of the same name). Here:

Always run: without a CFG hook (no ComfyUI, or a model that runs no CFG) the CFG++ samplers equal
their plain counterparts; with a stand-in of ComfyUI's post-CFG hook contract the unconditional
output is captured per call, the caller's dicts are left alone, no host sync per step, and the
emulator (real MSL + launch glue, distinct uncond tensors) matches the reference path.

With a real ComfyUI (COMFYUI_PATH): each CFG++ sampler vs ComfyUI's own function on a two-branch
toy denoiser combined by ComfyUI's own `comfy.samplers.cfg_function` (exact noise, reference path
within 1e-5, emulator within 1e-3, epsilon and flow), and MetalSamplerSelect's SAMPLER through
ComfyUI's sample_custom on the tiny UNet, whole in the emulator.
"""
from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from comfy_metal.nodes.common import syncs as sync_count
from comfy_metal.metal_kernels import dispatch
from comfy_metal.nodes import sampling as S
from test_samplers import CONST, ToyDenoiser, ToyEPS, _comfy_model_sampling, _conds, _emulator_reason, \
    _run, _tiny_unet_patcher, pack_function, reference_then_emulator, toy_schedule

CFG_PP = ("euler_cfg_pp", "euler_ancestral_cfg_pp", "dpmpp_2m_cfg_pp", "dpmpp_2s_ancestral_cfg_pp",
          "res_multistep_cfg_pp", "gradient_estimation_cfg_pp")
PLAIN = {"euler_cfg_pp": "euler", "dpmpp_2m_cfg_pp": "dpmpp_2m", "res_multistep_cfg_pp": "res_multistep",
         "gradient_estimation_cfg_pp": "gradient_estimation"}
STEP_KERNEL = {"euler_cfg_pp": "sampler_euler_cfg_pp_step", "euler_ancestral_cfg_pp": "sampler_euler_cfg_pp_step",
               "dpmpp_2m_cfg_pp": "sampler_dpmpp_2m_cfg_pp_step",
               "dpmpp_2s_ancestral_cfg_pp": "sampler_dpmpp_2s_ancestral_cfg_pp_step",
               "res_multistep_cfg_pp": "sampler_res_multistep_cfg_pp_step",
               "gradient_estimation_cfg_pp": "sampler_gradient_estimation_step"}


def standin_cfg_function(model, cond_pred, uncond_pred, cond_scale, x, timestep, model_options={}):
    """The contract of ComfyUI's cfg_function that the CFG++ samplers rely on: the guided result, passed
    through each sampler_post_cfg_function with the unconditional prediction as 'uncond_denoised'."""
    out = uncond_pred + (cond_pred - uncond_pred) * cond_scale
    for fn in model_options.get("sampler_post_cfg_function", []):
        out = fn({"denoised": out, "cond_denoised": cond_pred, "uncond_denoised": uncond_pred, "cond_scale": cond_scale,
                  "sigma": timestep, "input": x, "model": model, "model_options": model_options})
    return out


class CFGToy(ToyDenoiser):
    """Two toy branches (cond, uncond) combined by a CFG function: ComfyUI's own, or the stand-in."""

    def __init__(self, model_sampling, cfg_function, cond_scale=3.0):
        super().__init__(model_sampling)
        self.w_uncond = torch.randn(4, 4, generator=torch.Generator().manual_seed(9)) * 0.4
        self.cfg_function, self.cond_scale = cfg_function, cond_scale
        self.hook_calls = 0

    def _branch(self, w, x, sigma):
        s = sigma.view(-1, *([1] * (x.ndim - 1))).to(x.dtype)
        return torch.tanh(torch.einsum("oc,bc...->bo...", w.to(x.dtype), x)) * 0.8 + x / (1 + s * s) * 0.5

    def __call__(self, x, sigma, model_options=None, **kwargs):
        self.calls += 1
        model_options = model_options or {}
        self.hook_calls += len(model_options.get("sampler_post_cfg_function", []))
        cond, uncond = self._branch(self.w, x, sigma), self._branch(self.w_uncond, x, sigma)
        return self.cfg_function(self, cond, uncond, self.cond_scale, x, sigma, model_options)


@pytest.fixture
def standin_model_patcher(monkeypatch):
    """comfy.model_patcher as the samplers find it when ComfyUI is loaded, with ComfyUI's contract of
    set_model_options_post_cfg_function (append the function, optionally disable the cfg=1 shortcut)."""
    def set_model_options_post_cfg_function(model_options, post_cfg_function, disable_cfg1_optimization=False):
        model_options["sampler_post_cfg_function"] = model_options.get("sampler_post_cfg_function", []) + \
            [post_cfg_function]
        if disable_cfg1_optimization:
            model_options["disable_cfg1_optimization"] = True
        return model_options

    module = types.ModuleType("comfy.model_patcher")
    module.set_model_options_post_cfg_function = set_model_options_post_cfg_function
    monkeypatch.setitem(sys.modules, "comfy.model_patcher", module)
    return module


@pytest.fixture
def no_model_patcher(monkeypatch):
    monkeypatch.delitem(sys.modules, "comfy.model_patcher", raising=False)


def _setup(kind, steps=5, shape=(1, 4, 3, 5), seed=2):
    sigmas = toy_schedule(kind, steps)
    x = torch.randn(shape, generator=torch.Generator().manual_seed(seed)) * sigmas[0]
    return sigmas, x


# --------------------------------------------------------------------------------------------
# Without ComfyUI
# --------------------------------------------------------------------------------------------

def test_registered_everywhere():
    for name in CFG_PP:
        assert name in S.SAMPLER_NAMES and name in S.CFG_PP_NAMES
        assert S.get_sampler_function(f"{name}_metal").__wrapped__ is pack_function(name)
    assert S.CFG_PP_NAMES == CFG_PP
    assert {"sampler_euler_cfg_pp_step", "sampler_dpmpp_2m_cfg_pp_step", "sampler_dpmpp_2s_ancestral_cfg_pp_step",
            "sampler_res_multistep_cfg_pp_step"} <= set(S.SAMPLER_KERNELS)
    assert S.sampler_options("euler_cfg_pp_metal", "exact") == {"noise_mode": "exact"}
    assert S.sampler_options("euler_ancestral_cfg_pp", "fast", 0.5, 0.9) == {"noise_mode": "fast", "eta": 0.5,
                                                                             "s_noise": 0.9}
    assert S.sampler_options("dpmpp_2m_cfg_pp") == {"noise_mode": "auto"}
    assert S.sampler_options("res_multistep_cfg_pp", "fast", 0.7) == {"noise_mode": "fast", "s_noise": 1.0}


def test_register_ksampler_entries_adds_cfg_pp(monkeypatch):
    fake_samplers = types.ModuleType("comfy.samplers")
    fake_samplers.KSAMPLER_NAMES = ["euler", "euler_cfg_pp"]
    fake_samplers.SAMPLER_NAMES = fake_samplers.KSAMPLER_NAMES + ["ddim"]
    fake_kds = types.ModuleType("comfy.k_diffusion.sampling")
    monkeypatch.setitem(sys.modules, "comfy.samplers", fake_samplers)
    monkeypatch.setitem(sys.modules, "comfy.k_diffusion.sampling", fake_kds)
    S.register_ksampler_entries()
    for name in CFG_PP:
        assert f"{name}_metal" in fake_samplers.KSAMPLER_NAMES and f"{name}_metal" in fake_samplers.SAMPLER_NAMES
        assert getattr(fake_kds, f"sample_{name}_metal").__wrapped__ is pack_function(name)


@pytest.mark.parametrize("kind", ["eps", "flow"])
@pytest.mark.parametrize("name", sorted(PLAIN))
def test_without_a_cfg_hook_equals_the_plain_sampler(name, kind, no_model_patcher, reference_backend):
    """No ComfyUI loaded: uncond is the denoised output, and CFG++ reduces to the plain sampler."""
    model = ToyDenoiser(ToyEPS() if kind == "eps" else CONST())
    sigmas, x = _setup(kind)
    got = _run(name, model, x, sigmas)
    want = _run(PLAIN[name], model, x, sigmas)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_a_model_without_cfg_gets_denoised_as_uncond(standin_model_patcher, reference_backend):
    """ComfyUI loaded but the model runs no CFG (the hook is never called): same as without the hook."""
    model = ToyDenoiser(ToyEPS())
    sigmas, x = _setup("eps")
    torch.testing.assert_close(_run("dpmpp_2m_cfg_pp", model, x, sigmas), _run("dpmpp_2m", model, x, sigmas),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", CFG_PP)
def test_hook_captures_uncond_and_leaves_the_callers_dicts(name, standin_model_patcher, reference_backend):
    model = CFGToy(ToyEPS(), standin_cfg_function)
    sigmas, x = _setup("eps")
    user_hook = []
    model_options = {"sampler_post_cfg_function": [lambda a: (user_hook.append(1), a["denoised"])[1]]}
    extra_args = {"seed": 42, "model_options": model_options}
    got = _run(name, model, x, sigmas, extra_args=extra_args)
    # the caller's extra_args / model_options are not modified; their own post-CFG function still runs
    assert extra_args == {"seed": 42, "model_options": model_options}
    assert len(model_options["sampler_post_cfg_function"]) == 1 and "disable_cfg1_optimization" not in model_options
    steps = len(sigmas) - 1
    assert model.calls == (2 * steps - 1 if name == "dpmpp_2s_ancestral_cfg_pp" else steps)
    assert len(user_hook) == model.calls and model.hook_calls == 2 * model.calls
    assert torch.isfinite(got).all()
    # the unconditional branch matters: guidance with cond == uncond would give the plain result
    no_guidance = CFGToy(ToyEPS(), standin_cfg_function)
    no_guidance.w_uncond = no_guidance.w
    plain = _run(name, no_guidance, x, sigmas)
    assert (got - plain).abs().max() > 1e-2


def test_euler_cfg_pp_step_by_hand(standin_model_patcher, reference_backend):
    """One epsilon step written out: x1 = denoised + sigma_next / sigma * (x - uncond)."""
    model = CFGToy(ToyEPS(), standin_cfg_function)
    sigmas = torch.tensor([3.0, 1.5])
    x = torch.randn(1, 4, 3, 5, generator=torch.Generator().manual_seed(1)) * 3
    s = sigmas[:1]
    cond, uncond = model._branch(model.w, x, s), model._branch(model.w_uncond, x, s)
    denoised = uncond + (cond - uncond) * model.cond_scale
    want = denoised + 0.5 * (x - uncond)
    torch.testing.assert_close(_run("euler_cfg_pp", model, x, sigmas), want, atol=1e-5, rtol=1e-5)


def _per_step_syncs(name):
    def count(steps):
        model = CFGToy(ToyEPS(), standin_cfg_function)
        sigmas, x = _setup("eps", steps, (1, 4, 5, 7), 0)
        with sync_count.SyncCounter() as counter:
            _run(name, model, x, sigmas, noise_mode="fast", **({"eta": 1.0} if "res_multistep" in name else {}))
        return dict(counter.counts)

    few, many = count(3), count(9)
    return {k: (many.get(k, 0) - few.get(k, 0)) / 6 for k in set(few) | set(many)}, many


@pytest.mark.parametrize("name", CFG_PP)
def test_zero_host_syncs_per_step_with_the_cfg_hook(name, standin_model_patcher, reference_backend):
    per_step, total = _per_step_syncs(name)
    assert all(v == 0 for v in per_step.values()), per_step
    assert sum(total.values()) <= 2, total


@pytest.mark.parametrize("kind", ["eps", "flow"])
@pytest.mark.parametrize("name", CFG_PP)
def test_emulator_matches_reference_with_distinct_uncond(name, kind, standin_model_patcher, monkeypatch):
    """The real MSL and launch glue (3- and 4-tensor launches, device noise) vs the reference path."""
    reason = _emulator_reason()
    if reason:
        pytest.skip(reason)
    model = CFGToy(ToyEPS() if kind == "eps" else CONST(), standin_cfg_function)
    sigmas, x = _setup(kind)
    opts = {"eta": 0.8} if name == "res_multistep_cfg_pp" else {}
    want, got, backends = reference_then_emulator(monkeypatch,
                                                  lambda: _run(name, model, x, sigmas, noise_mode="fast", **opts))
    assert backends[STEP_KERNEL[name]] == "emulator"
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


def test_fast_noise_is_seeded(standin_model_patcher, reference_backend):
    model = CFGToy(ToyEPS(), standin_cfg_function)
    sigmas, x = _setup("eps")
    a = _run("euler_ancestral_cfg_pp", model, x, sigmas)
    b = _run("euler_ancestral_cfg_pp", model, x, sigmas)
    c = _run("euler_ancestral_cfg_pp", model, x, sigmas, extra_args={"seed": 43})
    d = _run("euler_ancestral_cfg_pp", model, x, sigmas, eta=0.0, extra_args={"seed": 43})
    assert torch.equal(a, b) and not torch.allclose(a, c)
    torch.testing.assert_close(d, _run("euler_cfg_pp", model, x, sigmas), atol=1e-6, rtol=1e-6)


def test_nan_reports_the_step(standin_model_patcher):
    model = CFGToy(ToyEPS(), standin_cfg_function)
    real = model._branch

    def branch(w, x, sigma):
        out = real(w, x, sigma)
        if model.calls == 3 and w is model.w_uncond:  # only the unconditional output goes bad
            out = out.clone()
            out.view(-1)[2] = float("nan")
        return out

    model._branch = branch
    sigmas, x = _setup("eps", 6)
    with pytest.raises(S.SamplingError, match=r"NaN/inf at step 3 of 6 \(i=2,"):
        _run("euler_cfg_pp", model, x, sigmas)


# --------------------------------------------------------------------------------------------
# Against a real ComfyUI
# --------------------------------------------------------------------------------------------

COMFY_CASES = [
    ("euler_cfg_pp", "euler_cfg_pp", {}),
    ("euler_ancestral_cfg_pp", "euler_ancestral_cfg_pp", {}),
    ("euler_ancestral_cfg_pp", "euler_ancestral_cfg_pp", {"eta": 0.6, "s_noise": 0.9}),
    ("dpmpp_2m_cfg_pp", "dpmpp_2m_cfg_pp", {}),
    ("dpmpp_2s_ancestral_cfg_pp", "dpmpp_2s_ancestral_cfg_pp", {}),
    ("dpmpp_2s_ancestral_cfg_pp", "dpmpp_2s_ancestral_cfg_pp", {"eta": 0.5, "s_noise": 1.2}),
    ("res_multistep_cfg_pp", "res_multistep_cfg_pp", {}),
    ("res_multistep_cfg_pp", "res_multistep_ancestral_cfg_pp", {"eta": 0.8, "s_noise": 0.9}),
    ("gradient_estimation_cfg_pp", "gradient_estimation_cfg_pp", {}),
    ("gradient_estimation_cfg_pp", "gradient_estimation_cfg_pp", {"ge_gamma": 2.5}),
]


def _case_id(case):
    ours, theirs, opts = case
    return theirs + ("-" + "-".join(f"{k}={v}" for k, v in opts.items()) if opts else "")


@pytest.mark.parametrize("kind", ["eps", "flow"])
@pytest.mark.parametrize("case", COMFY_CASES, ids=_case_id)
def test_matches_comfyui_cfg_pp_sampler(comfyui, case, kind, monkeypatch):
    """Exact noise, ComfyUI's own cfg_function (its post-CFG hook): the reference path equals ComfyUI's
    CFG++ sampler within 1e-5 of the latent's scale (the form test_samplers_unet uses) and so does every
    per-step callback; the emulator within 1e-3. (ComfyUI forms log-sigma differences in float32, the
    pack on the host in float64: on dpmpp_2m_cfg_pp that alone moves a final value by ~3e-5 at scale 10;
    with float32 coefficients the two agree exactly.)"""
    import comfy.k_diffusion.sampling as kds
    import comfy.samplers

    ours_name, theirs_name, opts = case
    model = CFGToy(_comfy_model_sampling(kind), comfy.samplers.cfg_function, cond_scale=2.5)
    ms = model.inner_model.inner_model.model_sampling
    sigmas = comfy.samplers.calculate_sigmas(ms, "karras" if kind == "eps" else "simple", 7).float()
    x = torch.randn(2, 4, 5, 7, generator=torch.Generator().manual_seed(1)) * sigmas[0]
    ours_opts = opts  # res_multistep_cfg_pp_metal(eta > 0) is ComfyUI's res_multistep_ancestral_cfg_pp

    seen_theirs = []
    want = getattr(kds, f"sample_{theirs_name}")(model, x.clone(), sigmas.clone(), extra_args={"seed": 42},
                                                 callback=seen_theirs.append, disable=True, **opts)
    calls = model.calls
    assert model.hook_calls == calls >= 7  # ComfyUI's hook ran on every call
    monkeypatch.setenv("COMFY_METAL_BACKEND", "reference")
    dispatch.reset()
    seen = []
    got = _run(ours_name, model, x, sigmas, noise_mode="exact", callback=seen.append, **ours_opts)
    assert model.hook_calls == model.calls == 2 * calls  # and ours, on as many calls
    scale = max(want.abs().max().item(), 1.0)
    torch.testing.assert_close(got, want, atol=1e-5 * scale, rtol=1e-5)
    assert [d["i"] for d in seen] == [d["i"] for d in seen_theirs]
    for a, b in zip(seen, seen_theirs):
        assert set(a) == set(b)
        torch.testing.assert_close(a["denoised"], b["denoised"], atol=1e-5 * scale, rtol=1e-5)
        torch.testing.assert_close(a["x"], b["x"], atol=1e-5 * scale, rtol=1e-5)
        assert float(a["sigma"]) == float(b["sigma"]) and float(a["sigma_hat"]) == float(b["sigma_hat"])

    if _emulator_reason():
        pytest.skip(_emulator_reason())
    monkeypatch.setenv("COMFY_METAL_BACKEND", "emulator")
    dispatch.reset()
    try:
        emu = _run(ours_name, model, x, sigmas, noise_mode="exact", **ours_opts)
        assert dispatch.last_backend.get(STEP_KERNEL[ours_name]) == "emulator", dispatch.last_backend
    finally:
        dispatch.reset()
    torch.testing.assert_close(emu, want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("kind", ["eps", "flow"])
def test_fast_noise_statistics_match_comfyui(comfyui, kind, reference_backend):
    """euler_ancestral_cfg_pp with fast noise: a different draw of the same process as ComfyUI's."""
    import comfy.k_diffusion.sampling as kds
    import comfy.samplers

    model = CFGToy(_comfy_model_sampling(kind), comfy.samplers.cfg_function, cond_scale=1.5)
    ms = model.inner_model.inner_model.model_sampling
    sigmas = comfy.samplers.calculate_sigmas(ms, "karras" if kind == "eps" else "simple", 6).float()
    x = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(3)) * sigmas[0]
    ours = torch.stack([_run("euler_ancestral_cfg_pp", model, x, sigmas, noise_mode="fast", extra_args={"seed": s})
                        for s in range(12)])
    theirs = torch.stack([kds.sample_euler_ancestral_cfg_pp(model, x.clone(), sigmas.clone(), extra_args={"seed": s},
                                                            disable=True) for s in range(12)])
    assert abs(ours.std().item() / theirs.std().item() - 1) < 0.05
    assert abs(ours.std(0).mean().item() / theirs.std(0).mean().item() - 1) < 0.1
    assert (ours.mean(0) - theirs.mean(0)).abs().mean().item() < 0.5 * theirs.std(0).mean().item()


@pytest.fixture(scope="module")
def tiny_unet(comfyui):
    return _tiny_unet_patcher("eps")


@pytest.mark.parametrize("name", ["euler_ancestral_cfg_pp", "dpmpp_2m_cfg_pp"])
def test_metal_sampler_select_cfg_pp_whole_in_emulator(comfyui, tiny_unet, name, monkeypatch):
    """MetalSamplerSelect -> SAMPLER -> ComfyUI's sample_custom (real CFGGuider, real post-CFG hook) on a
    tiny random SD1.5 UNet, cfg 1.0 (the cfg=1 shortcut is disabled by the hook, as in ComfyUI): the
    reference path equals ComfyUI's sampler; the real kernels in the emulator equal the reference."""
    import comfy.sample
    import comfy.samplers

    reason = _emulator_reason()
    if reason:
        pytest.skip(reason)
    positive, negative = _conds()
    sigmas = comfy.samplers.calculate_sigmas(tiny_unet.get_model_object("model_sampling"), "karras", 3).float()
    noise = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(6))
    latent = torch.zeros(1, 4, 8, 8)
    (sampler,) = S.MetalSamplerSelect().get_sampler(name, "exact", 0.7, 1.0)
    assert sampler.extra_options == S.sampler_options(name, "exact", 0.7, 1.0)

    def run(s):
        return comfy.sample.sample_custom(tiny_unet, noise, 1.0, s, sigmas, positive, negative, latent, seed=5,
                                          disable_pbar=True)

    builtin = comfy.samplers.ksampler(name, {"eta": 0.7} if "ancestral" in name else {})
    want = run(builtin)
    ref, emu, backends = reference_then_emulator(monkeypatch, lambda: run(sampler))
    assert backends.get(STEP_KERNEL[name]) == "emulator"
    scale = max(want.abs().max().item(), 1)
    torch.testing.assert_close(ref, want, atol=1e-5 * scale, rtol=1e-5)
    torch.testing.assert_close(emu, ref, atol=1e-3 * scale, rtol=1e-3)
    assert math.isfinite(float(emu.abs().max()))
