"""Metal samplers (nodes/sampling/ + metal_kernels/sampling/).

Always run: every step kernel vs its reference in the MSL emulator on odd shapes (and the NaN
record), the launch glue issues no host sync, whole samplers in the emulator vs the reference path,
zero host syncs inside the step loop (and a check that the count would catch an `.item()`), bad
input, KSampler list registration against stand-in modules.

With a real ComfyUI (COMFYUI_PATH, fixture `comfyui`): every sampler vs ComfyUI's own function of
the same name on a toy denoiser, epsilon and flow model sampling (reference path within 1e-5,
emulator within fp16 tolerance), KSampler end to end on a tiny random SD1.5-architecture UNet
(`<name>_metal` gives ComfyUI's latent), and MetalSamplerSelect's SAMPLER run whole in the emulator.
"""
from __future__ import annotations

import math
import sys
import types

import pytest
import torch

from comfy_metal.nodes.common import syncs as sync_count
from comfy_metal.metal_kernels import dispatch, registry, sampling as K
from comfy_metal.nodes import sampling as S
from comfy_metal.nodes.sampling import cfg_pp, more, samplers as plain, unipc

SAMPLER_SPECS = sorted(n for n in registry.REGISTRY if n.startswith("sampler_"))


# --------------------------------------------------------------------------------------------
# Toy denoisers (ComfyUI-free stand-ins for model sampling, or ComfyUI's real classes)
# --------------------------------------------------------------------------------------------

class ToyEPS:
    """Epsilon-style model sampling: the noise_scaling of ComfyUI's EPS."""

    def noise_scaling(self, sigma, noise, latent_image, max_denoise=False):
        sigma = sigma.view(()) if sigma.numel() == 1 else sigma.view(sigma.shape[:1] + (1,) * (noise.ndim - 1))
        return noise * sigma + latent_image


class CONST:  # the name marks rectified-flow sampling, as ComfyUI's class of that name does
    noise_scale = 1.0

    def noise_scaling(self, sigma, noise, latent_image, max_denoise=False):
        sigma = sigma.view(()) if sigma.numel() == 1 else sigma.view(sigma.shape[:1] + (1,) * (noise.ndim - 1))
        return sigma * noise + (1.0 - sigma) * latent_image

    def percent_to_sigma(self, percent):
        return 1.0 - percent


class ToyDenoiser:
    """model(x, sigma) -> denoised: smooth, nonlinear, channel-mixing, sigma dependent; with the
    attributes ComfyUI's samplers read (inner_model.inner_model.model_sampling and
    inner_model.model_patcher.get_model_object('model_sampling'))."""

    def __init__(self, model_sampling, channels=4, nan_at_call=None):
        self.inner_model = types.SimpleNamespace(
            inner_model=types.SimpleNamespace(model_sampling=model_sampling),
            model_patcher=types.SimpleNamespace(get_model_object=lambda name: model_sampling))
        self.w = torch.randn(channels, channels, generator=torch.Generator().manual_seed(5)) * 0.4
        self.calls = 0
        self.nan_at_call = nan_at_call

    def __call__(self, x, sigma, **kwargs):
        self.calls += 1
        s = sigma.view(-1, *([1] * (x.ndim - 1))).to(x.dtype)
        h = torch.einsum("oc,bc...->bo...", self.w.to(x.dtype), x)
        out = torch.tanh(h) * 0.8 + x / (1 + s * s) * 0.5
        if self.nan_at_call is not None and self.calls == self.nan_at_call:
            out = out.clone()
            out.view(-1)[3] = float("nan")
        return out


def toy_schedule(kind, steps):
    if kind == "eps":  # Karras, SD-like range
        ramp = torch.linspace(0, 1, steps)
        rho = 7.0
        lo, hi = 0.0292 ** (1 / rho), 14.6146 ** (1 / rho)
        sig = (hi + ramp * (lo - hi)) ** rho
    else:  # flow: 1 -> 0 with a shift
        t = torch.linspace(1, 0, steps + 1)[:-1]
        sig = 3 * t / (1 + 2 * t)
    return torch.cat([sig, sig.new_zeros(1)])


def _emulator_reason():
    try:
        from comfy_metal.metal_kernels import emulator
    except Exception as e:
        return f"MSL emulator not importable: {e}"
    return None if emulator.available() else "clang-19 not found: MSL emulator unavailable"


def reference_then_emulator(monkeypatch, run):
    """run() on the reference kernels, then on the real MSL in the emulator: (reference result,
    emulator result, the backends the emulator run recorded)."""
    monkeypatch.setenv("COMFY_METAL_BACKEND", "reference")
    dispatch.reset()
    want = run()
    monkeypatch.setenv("COMFY_METAL_BACKEND", "emulator")
    dispatch.reset()
    try:
        got = run()
        backends = dict(dispatch.last_backend)
    finally:
        dispatch.reset()
    return want, got, backends


# Samplers whose step kernel is another sampler's (the rest use sampler_<name>_step).
_SHARED_STEP = {"uni_pc_bh2": "uni_pc", "ddim": "euler", "dpmpp_2m_sde_gpu": "dpmpp_2m_sde",
                "res_multistep_ancestral": "res_multistep", "gradient_estimation_cfg_pp": "gradient_estimation",
                "dpmpp_2s_ancestral": "dpmpp_2s_ancestral_cfg_pp"}
_FLOW_STEP = {"dpmpp_2s_ancestral": "euler_ancestral"}   # its _RF form for flow models


def pack_function(name):
    """sample_<name>_metal from the sampling module that defines it."""
    return next(getattr(m, f"sample_{name}_metal") for m in (plain, cfg_pp, unipc, more)
                if hasattr(m, f"sample_{name}_metal"))


def _step_kernel(name, kind="eps"):
    if kind == "flow" and name in _FLOW_STEP:
        return f"sampler_{_FLOW_STEP[name]}_step"
    return f"sampler_{_SHARED_STEP.get(name, name)}_step"


def _run(name, model, x, sigmas, **kw):
    kw.setdefault("extra_args", {"seed": 42})
    return S.SAMPLER_FUNCTIONS[name](model, x.clone(), sigmas.clone(), disable=True, **kw)


# --------------------------------------------------------------------------------------------
# Kernels vs references (emulator), launch glue, NaN record
# --------------------------------------------------------------------------------------------

def test_sampling_metal_lints_clean():
    from comfy_metal.metal_kernels.emulator import lint

    kinds = {k: list(v) for name in SAMPLER_SPECS for k, v in registry.REGISTRY[name].entry_points.items()}
    assert lint.lint_source(dispatch.library_source("sampling.metal"), kinds) == []


@pytest.mark.parametrize("name", SAMPLER_SPECS)
def test_kernel_matches_reference_in_emulator(emulator_backend, name):
    spec = registry.REGISTRY[name]
    problem = dispatch.self_check(spec, "emulator", torch.device("cpu"))
    assert problem is None, problem
    assert dispatch.choose(spec, torch.device("cpu"))[0] == "emulator"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_kernels_odd_shapes_and_nan_record_in_emulator(emulator_backend, monkeypatch, dtype):
    g = torch.Generator().manual_seed(1)
    shape = (2, 3, 5, 7)  # 210 elements
    x, d, o, o2, n = [(torch.randn(shape, generator=g) * 2).to(dtype) for _ in range(5)]
    bridge = K.BrownianBridge(3).increment(6.1, 3.9)
    calls = {
        "sampler_euler_step": lambda **f: K.sampler_euler_step(x, d, 6.1, 3.9, **f),
        "sampler_heun_step": lambda **f: K.sampler_heun_step(x, d, o, 6.1, 3.9, **f),
        "sampler_dpmpp_2m_step": lambda **f: K.sampler_dpmpp_2m_step(x, d, o, 6.1, 3.9, 9.7, **f),
        "sampler_dpmpp_2m_sde_step": lambda **f: K.sampler_dpmpp_2m_sde_step(x, d, o, 6.1, 3.9, 0.4, bridge,
                                                                             eta=0.9, **f),
        "sampler_dpmpp_3m_sde_step": lambda **f: K.sampler_dpmpp_3m_sde_step(x, d, o, o2, 6.1, 3.9, 0.45, 0.4, n,
                                                                             **f),
        "sampler_euler_ancestral_step": lambda **f: K.sampler_euler_ancestral_step(x, d, 6.1, 3.9, K.iid_noise(1, 2),
                                                                                   **f),
        "sampler_lcm_step": lambda **f: K.sampler_lcm_step(d, n, 3.9, 1.0, **f),
        "sampler_res_multistep_step": lambda **f: K.sampler_res_multistep_step(x, d, o, 6.1, 3.9, 9.7, 6.1, **f),
        "sampler_euler_cfg_pp_step": lambda **f: K.sampler_euler_cfg_pp_step(x, d, o, 6.1, 3.9, K.iid_noise(1, 2),
                                                                             eta=0.9, **f),
        "sampler_dpmpp_2m_cfg_pp_step": lambda **f: K.sampler_dpmpp_2m_cfg_pp_step(x, d, o, o2, 6.1, 3.9, 9.7, **f),
        "sampler_res_multistep_cfg_pp_step": lambda **f: K.sampler_res_multistep_cfg_pp_step(x, d, o, o2, 6.1, 3.9,
                                                                                             9.7, 6.1, n, eta=0.5,
                                                                                             **f),
    }
    calls["sampler_dpmpp_2s_ancestral_cfg_pp_step"] = lambda **f: K.sampler_dpmpp_2s_ancestral_cfg_pp_step(
        x, d, o, o2, 6.1, 3.9, bridge, eta=0.8, **f)
    plan = K.unipc_plan([9.7, 6.1, 3.9], 2.0, 3, "bh2", True, 4.0, 2.2)
    calls["sampler_uni_pc_step"] = lambda **f: K.sampler_uni_pc_step(x, d, o, o2, n, plan=plan, **f)
    calls["sampler_to_d_step"] = lambda **f: K.sampler_to_d_step(x, d, 3.9, **f)
    calls["sampler_gradient_estimation_step"] = lambda **f: K.sampler_gradient_estimation_step(
        x, d, o, o2, 6.1, 3.9, 9.7, n, x, cfg_pp=True, **f)
    calls["sampler_dpmpp_sde_step"] = lambda **f: K.sampler_dpmpp_sde_step(x, d, o, 6.1, 3.9, bridge, eta=0.7, **f)
    er_plan = K.er_sde_plans([9.7, 6.1, 3.9, 2.0])[2]
    calls["sampler_er_sde_step"] = lambda **f: K.sampler_er_sde_step(x, d, o, o2, n, plan=er_plan, **f)
    calls["sampler_ipndm_step"] = lambda **f: K.sampler_ipndm_step(x, d, o, o2, n, 6.1, 3.9, **f)
    deis_plan = K.deis_coefficients([14.6, 9.7, 6.1, 3.9, 2.0], 4)[3]
    calls["sampler_deis_step"] = lambda **f: K.sampler_deis_step(x, d, o, o2, n, 3.9, 2.0, coefficients=deis_plan,
                                                                 **f)
    assert set(calls) == set(SAMPLER_SPECS) - {"sampler_churn_step", "sampler_device_noise"}
    tol = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]
    for name, call in calls.items():
        monkeypatch.setenv("COMFY_METAL_BACKEND", "emulator")
        flags = torch.zeros(4, dtype=torch.int32)
        got = call(flags=flags, step=2)
        assert dispatch.last_backend[name] == "emulator"
        assert flags.tolist() == [0, 0, 0, 0]
        monkeypatch.setenv("COMFY_METAL_BACKEND", "reference")
        want = call()
        assert dispatch.last_backend[name] == "reference"
        assert got.dtype == dtype and got.shape == shape
        torch.testing.assert_close(got.float(), want.float(), atol=tol * 10, rtol=tol)
    # a NaN in an input is recorded at the step index on the device
    monkeypatch.setenv("COMFY_METAL_BACKEND", "emulator")
    d_bad = d.clone()
    d_bad.view(-1)[111] = float("nan")
    flags = torch.zeros(5, dtype=torch.int32)
    K.sampler_euler_step(x, d_bad, 6.1, 3.9, flags=flags, step=3)
    assert dispatch.last_backend["sampler_euler_step"] == "emulator"
    assert flags.tolist() == [0, 0, 0, 1, 0]


class _FakeLibrary:
    """Records launches instead of running them (the launch glue runs for real)."""

    def __init__(self):
        self.launches = []

    def __getattr__(self, name):
        def launch(*args, threads, group_size):
            kinds = tuple("tensor" if isinstance(a, torch.Tensor) else "int" if isinstance(a, int) else
                          "float" if isinstance(a, float) else
                          ("int[]" if all(isinstance(v, int) for v in a) else "float[]") for a in args)
            self.launches.append((name, kinds, threads, group_size))
        return launch


@pytest.mark.parametrize("name", SAMPLER_SPECS)
def test_launch_glue_no_host_sync_and_declared_kinds(name):
    spec = registry.REGISTRY[name]
    lib = _FakeLibrary()
    for args, kwargs in spec.self_check_cases(torch.device("cpu")):
        with sync_count.SyncCounter() as counter:
            spec.metal(lib, *args, flags=torch.zeros(3, dtype=torch.int32), step=1, **kwargs) \
                if name != "sampler_device_noise" else spec.metal(lib, *args, **kwargs)
        assert counter.total == 0, (name, dict(counter.counts))
    assert lib.launches
    for entry, kinds, threads, group in lib.launches:
        assert spec.entry_points[entry] == kinds, (entry, kinds)
        assert 1 <= group <= 1024 and threads >= 1


# --------------------------------------------------------------------------------------------
# Whole samplers: emulator vs reference, zero host syncs in the loop, bad input
# --------------------------------------------------------------------------------------------

def toy_emulator_run(monkeypatch, name, kind, steps, **options):
    """The sampler on the toy denoiser (fast noise), on the reference kernels and then in the emulator."""
    reason = _emulator_reason()
    if reason:
        pytest.skip(reason)
    model = ToyDenoiser(ToyEPS() if kind == "eps" else CONST())
    sigmas = toy_schedule(kind, steps)
    x = torch.randn(1, 4, 3, 5, generator=torch.Generator().manual_seed(2)) * sigmas[0]
    return reference_then_emulator(monkeypatch, lambda: _run(name, model, x, sigmas, noise_mode="fast", **options))


@pytest.mark.parametrize("kind", ["eps", "flow"])
@pytest.mark.parametrize("name", S.SAMPLER_NAMES)
def test_sampler_in_emulator_matches_reference(name, kind, monkeypatch):
    want, got, backends = toy_emulator_run(monkeypatch, name, kind, 5)
    used = {k: v for k, v in backends.items() if k.startswith("sampler_")}
    assert used and set(used.values()) == {"emulator"}, used
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("name", ["heun", "dpmpp_3m_sde", "euler_ancestral"])
def test_low_precision_latent_in_emulator(name, dtype, monkeypatch):
    """fp16 / bf16 latents: the kernels store in the latent's dtype and compute in fp32, like the references."""
    reason = _emulator_reason()
    if reason:
        pytest.skip(reason)
    model = ToyDenoiser(ToyEPS())
    sigmas = toy_schedule("eps", 4)
    x = (torch.randn(1, 4, 3, 5, generator=torch.Generator().manual_seed(4)) * sigmas[0]).to(dtype)
    want, got, backends = reference_then_emulator(monkeypatch,
                                                  lambda: _run(name, model, x, sigmas, noise_mode="fast"))
    assert backends[f"sampler_{name}_step"] == "emulator"
    assert got.dtype == want.dtype == dtype
    tol = 1e-2 if dtype == torch.float16 else 5e-2
    torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=tol)


def _syncs(name, steps, **kw):
    model = ToyDenoiser(ToyEPS())
    sigmas = toy_schedule("eps", steps)
    x = torch.randn(1, 4, 5, 7, generator=torch.Generator().manual_seed(0)) * sigmas[0]
    with sync_count.SyncCounter() as counter:
        _run(name, model, x, sigmas, noise_mode="fast", **kw)
    return dict(counter.counts)


def _per_step_syncs(name, **kw):
    few, many = _syncs(name, 3, **kw), _syncs(name, 9, **kw)
    return {k: (many.get(k, 0) - few.get(k, 0)) / 6 for k in set(few) | set(many)}, many


@pytest.mark.parametrize("name", S.SAMPLER_NAMES)
def test_zero_host_syncs_inside_the_step_loop(name, reference_backend):
    """The counts are the same for 3 and 9 steps (nothing per step), and only the one-time reads
    (input latent check before the loop, NaN record after it) remain."""
    per_step, total = _per_step_syncs(name, **({"eta": 1.0} if name == "res_multistep" else {}))
    assert all(v == 0 for v in per_step.values()), per_step
    assert sum(total.values()) <= 2, total


def test_sync_count_catches_an_item_in_a_step(reference_backend, monkeypatch):
    original = K.sampler_euler_step

    def with_item(x, denoised, *args, **kwargs):
        out = original(x, denoised, *args, **kwargs)
        float(out.abs().max())  # what someone might add to a step
        return out

    monkeypatch.setattr(K, "sampler_euler_step", with_item)
    per_step, _ = _per_step_syncs("euler")
    assert per_step.get("aten::_local_scalar_dense", 0) == 1


def test_the_sampler_table_pairs_each_name_with_its_function():
    """One SAMPLERS entry a name, each with the pack's sample_<name>_metal; every list derives from it."""
    assert [d.name for d in S.SAMPLERS] == list(S.SAMPLER_NAMES) and len(set(S.SAMPLER_NAMES)) == len(S.SAMPLERS)
    for d in S.SAMPLERS:
        assert d.function is pack_function(d.name), d.name
        assert S.SAMPLER_FUNCTIONS[d.name].__wrapped__ is d.function, d.name


def test_bad_input_errors():
    model = ToyDenoiser(ToyEPS())
    sig = toy_schedule("eps", 4)
    x = torch.randn(1, 4, 3, 5)
    with pytest.raises(S.SamplingError, match="unknown Metal sampler 'dpm_fast'"):
        S.get_sampler_function("dpm_fast")
    assert S.get_sampler_function("euler_metal").__wrapped__ is plain.sample_euler_metal
    with pytest.raises(S.SamplingError, match="strictly decreasing"):
        _run("euler", model, x, sig.flip(0))
    bad = sig.clone()
    bad[2] = float("nan")
    with pytest.raises(S.SamplingError, match="NaN/inf/negative values at index 2"):
        _run("dpmpp_2m", model, x, bad)
    x_bad = x.clone()
    x_bad[0, 1, 2, 3] = float("inf")
    with pytest.raises(S.SamplingError, match="input latent .* contains NaN or inf"):
        _run("euler_ancestral", model, x_bad, sig)
    with pytest.raises(S.SamplingError, match="noise_mode 'slow'"):
        _run("dpmpp_2m_sde", model, x, sig, noise_mode="slow")
    with pytest.raises(S.SamplingError, match="dtype torch.float64"):
        _run("euler", model, x.double(), sig)
    with pytest.raises(S.SamplingError, match="exceeds the fast Brownian noise range"):
        _run("dpmpp_2m_sde", model, x, sig * 1000, noise_mode="fast")
    # an empty schedule returns the latent unchanged, as ComfyUI's samplers do
    assert torch.equal(_run("dpmpp_3m_sde", model, x, sig[:1]), x)


@pytest.mark.parametrize("name", ["euler", "heun", "dpmpp_2m_sde", "lcm"])
def test_nan_mid_sampling_reports_the_step(name):
    model = ToyDenoiser(ToyEPS(), nan_at_call=3)  # heun calls the model twice per step
    sig = toy_schedule("eps", 6)
    step = {"heun": 1}.get(name, 2)
    with pytest.raises(S.SamplingError, match=rf"NaN/inf at step {step + 1} of 6 \(i={step},"):
        _run(name, model, torch.randn(1, 4, 3, 5), sig)


def test_noise_modes_and_seeds():
    model = ToyDenoiser(ToyEPS())
    sig = toy_schedule("eps", 5)
    x = torch.randn(1, 4, 3, 5, generator=torch.Generator().manual_seed(3)) * sig[0]
    a = _run("dpmpp_2m_sde", model, x, sig, noise_mode="fast")
    b = _run("dpmpp_2m_sde", model, x, sig, noise_mode="fast")
    c = _run("dpmpp_2m_sde", model, x, sig, noise_mode="fast", extra_args={"seed": 43})
    assert torch.equal(a, b) and not torch.allclose(a, c)
    # s_noise=0 / eta=0 remove the noise: the SDE samplers become deterministic in the seed
    d = _run("dpmpp_2m_sde", model, x, sig, noise_mode="fast", eta=0.0)
    e = _run("dpmpp_2m_sde", model, x, sig, noise_mode="fast", eta=0.0, extra_args={"seed": 7})
    assert torch.equal(d, e)


def test_default_noise_mode_per_device(monkeypatch):
    """auto: fast (in-kernel hashed noise) on MPS, exact (ComfyUI's noise sampler) on CPU and CUDA,
    where host syncs cost nothing and the hashed noise is the slower one; the env var overrides it."""
    monkeypatch.delenv(S.NOISE_ENV, raising=False)
    assert S.default_noise_mode("cpu") == "exact"
    assert S.default_noise_mode(torch.device("cuda", 0)) == "exact"
    assert S.default_noise_mode(torch.device("mps")) == "fast"
    assert S.default_noise_mode("mps:0") == "fast"
    monkeypatch.setenv(S.NOISE_ENV, "exact")
    assert S.default_noise_mode("mps") == "exact"
    monkeypatch.setenv(S.NOISE_ENV, "fast")
    assert S.default_noise_mode("cpu") == "fast"
    monkeypatch.setenv(S.NOISE_ENV, "auto")
    assert (S.default_noise_mode("cpu"), S.default_noise_mode("mps")) == ("exact", "fast")
    monkeypatch.setenv(S.NOISE_ENV, "slow")
    with pytest.raises(S.SamplingError, match="COMFY_METAL_SAMPLER_NOISE='slow'"):
        S.default_noise_mode("cpu")


def test_auto_noise_without_comfyui_falls_back_to_fast_and_explicit_choices_are_kept(monkeypatch):
    """On CPU, auto means exact; where ComfyUI's noise sampler cannot be imported (bench, doctor) auto
    takes the fast noise, while an explicit noise_mode='exact' is an error, never silently replaced."""
    monkeypatch.delenv(S.NOISE_ENV, raising=False)
    monkeypatch.setitem(sys.modules, "comfy.k_diffusion.sampling", None)   # import fails as without ComfyUI
    model = ToyDenoiser(ToyEPS())
    sig = toy_schedule("eps", 5)
    x = torch.randn(1, 4, 3, 5, generator=torch.Generator().manual_seed(3)) * sig[0]
    fast = _run("dpmpp_2m_sde", model, x, sig, noise_mode="fast")
    assert torch.equal(_run("dpmpp_2m_sde", model, x, sig), fast)
    assert torch.equal(_run("dpmpp_2m_sde", model, x, sig, noise_mode="auto"), fast)
    with pytest.raises(S.SamplingError, match="noise_mode='exact' uses ComfyUI's noise sampler"):
        _run("dpmpp_2m_sde", model, x, sig, noise_mode="exact")


def test_auto_noise_on_cpu_is_comfyuis_exact_noise(comfyui, monkeypatch):
    monkeypatch.delenv(S.NOISE_ENV, raising=False)
    model = ToyDenoiser(ToyEPS())
    sig = toy_schedule("eps", 5)
    x = torch.randn(1, 4, 3, 5, generator=torch.Generator().manual_seed(3)) * sig[0]
    exact = _run("dpmpp_2m_sde", model, x, sig, noise_mode="exact")
    assert torch.equal(_run("dpmpp_2m_sde", model, x, sig), exact)
    assert not torch.allclose(_run("dpmpp_2m_sde", model, x, sig, noise_mode="fast"), exact)


def test_fast_sde_noise_is_split_invariant_in_a_sampler():
    """The fast noise a sampler draws for a step is the bridge increment of that sigma interval: a
    noise_sampler call sequence over a refined schedule sums to the coarse one."""
    bridge = K.BrownianBridge(42)
    coarse = K.device_noise_reference(bridge.increment(4.0, 1.0), (999,), "cpu") * math.sqrt(3.0)
    fine = sum(K.device_noise_reference(bridge.increment(a, b), (999,), "cpu") * math.sqrt(a - b)
               for a, b in [(4.0, 2.5), (2.5, 1.7), (1.7, 1.0)])
    torch.testing.assert_close(fine, coarse, atol=1e-4, rtol=1e-4)


def test_register_ksampler_entries_with_stand_in_modules(monkeypatch):
    builtins = ["euler", "euler_ancestral", "heun", "dpmpp_2m", "dpmpp_2m_sde", "lcm"]
    ks_names = list(builtins)
    sampler_names = ks_names + ["ddim", "uni_pc"]
    fake_samplers = types.ModuleType("comfy.samplers")
    fake_samplers.KSAMPLER_NAMES = ks_names
    fake_samplers.SAMPLER_NAMES = sampler_names
    fake_samplers.KSampler = type("KSampler", (), {"SAMPLERS": sampler_names})
    fake_kds = types.ModuleType("comfy.k_diffusion.sampling")
    monkeypatch.setitem(sys.modules, "comfy.samplers", fake_samplers)
    monkeypatch.setitem(sys.modules, "comfy.k_diffusion.sampling", fake_kds)
    added = S.register_ksampler_entries()
    metal = [f"{n}_metal" for n in S.SAMPLER_NAMES]
    assert ks_names == builtins + metal
    assert sampler_names == builtins + ["ddim", "uni_pc"] + metal
    assert fake_samplers.KSampler.SAMPLERS is sampler_names
    assert len(added) == 2 * len(metal)
    assert fake_kds.sample_euler_metal.__wrapped__ is plain.sample_euler_metal
    assert S.register_ksampler_entries() == []  # idempotent
    assert ks_names == builtins + metal
    # without ComfyUI loaded: nothing happens, nothing is imported
    monkeypatch.delitem(sys.modules, "comfy.samplers")
    assert S.register_ksampler_entries() == []
    assert "comfy.samplers" not in sys.modules


def test_sampler_options():
    assert S.sampler_options("dpmpp_2m_sde", "exact", 0.5, 0.9) == {"noise_mode": "exact", "eta": 0.5, "s_noise": 0.9}
    assert S.sampler_options("euler_metal", "fast") == {"noise_mode": "fast", "s_noise": 1.0}
    assert S.sampler_options("dpmpp_2m") == {"noise_mode": "auto"}
    assert "eta" not in S.sampler_options("res_multistep")  # ComfyUI's res_multistep has eta 0
    assert "eta" not in S.sampler_options("res_multistep_cfg_pp")
    assert S.sampler_options("euler_ancestral_cfg_pp", "fast", 0.5)["eta"] == 0.5
    with pytest.raises(S.SamplingError):
        S.sampler_options("euler", "loud")


# --------------------------------------------------------------------------------------------
# Against a real ComfyUI
# --------------------------------------------------------------------------------------------

# (sampler, options) run through both ComfyUI's function and ours.
COMFY_CASES = [
    ("euler", {}), ("euler", {"s_churn": 1.0, "s_noise": 1.003}),
    ("euler_ancestral", {}), ("euler_ancestral", {"eta": 0.6, "s_noise": 0.9}),
    ("heun", {}), ("dpmpp_2m", {}),
    ("dpmpp_2m_sde", {}), ("dpmpp_2m_sde", {"eta": 0.5, "solver_type": "heun"}),
    ("dpmpp_3m_sde", {}), ("dpmpp_3m_sde", {"eta": 0.7, "s_noise": 1.1}),
    ("lcm", {}), ("lcm", {"s_noise": 0.8, "s_noise_end": 1.2, "noise_clip_std": 1.5}),
    ("res_multistep", {}), ("uni_pc", {}), ("uni_pc_bh2", {}),
    ("ddim", {}), ("dpmpp_2m_sde_gpu", {}), ("dpmpp_2m_sde_gpu", {"eta": 0.5, "solver_type": "heun"}),
    ("res_multistep_ancestral", {}), ("res_multistep_ancestral", {"eta": 0.6, "s_noise": 0.9}),
    ("dpmpp_2s_ancestral", {}), ("dpmpp_2s_ancestral", {"eta": 0.5, "s_noise": 1.1}),
    ("dpmpp_2s_ancestral", {"eta": 0.0}),
    ("gradient_estimation", {}), ("gradient_estimation", {"ge_gamma": 3.0}),
    ("ipndm", {}), ("ipndm", {"max_order": 2}),
    ("dpmpp_sde", {}), ("dpmpp_sde", {"eta": 0.6, "s_noise": 1.1, "r": 0.4}),
    ("er_sde", {}), ("er_sde", {"s_noise": 0.7, "max_stage": 2}),
    ("deis", {}), ("deis", {"max_order": 2}), ("deis", {"max_order": 4}),
]


def _comfy_model_sampling(kind):
    import comfy.model_sampling as cms

    if kind == "eps":
        class EpsSampling(cms.ModelSamplingDiscrete, cms.EPS):
            pass

        return EpsSampling()

    class FlowSampling(cms.ModelSamplingDiscreteFlow, cms.CONST):
        pass

    ms = FlowSampling()
    ms.set_parameters(shift=3.0)
    return ms


def _case_id(case):
    name, opts = case
    return name + ("-" + "-".join(f"{k}={v}" for k, v in opts.items()) if opts else "")


@pytest.mark.parametrize("kind", ["eps", "flow"])
@pytest.mark.parametrize("case", COMFY_CASES, ids=_case_id)
def test_matches_comfyui_sampler(comfyui, case, kind, monkeypatch):
    """Exact noise: the reference path equals ComfyUI's sampler within 1e-5 (fp32); the fused kernels
    in the emulator equal it within fp16 tolerance; each per-step callback matches too."""
    import comfy.k_diffusion.sampling as kds
    import comfy.samplers

    name, opts = case
    model = ToyDenoiser(_comfy_model_sampling(kind))
    ms = model.inner_model.inner_model.model_sampling
    sigmas = comfy.samplers.calculate_sigmas(ms, "karras" if kind == "eps" else "simple", 7).float()
    x = torch.randn(2, 4, 5, 7, generator=torch.Generator().manual_seed(1)) * sigmas[0]

    def comfy_run():
        torch.manual_seed(0)  # churn noise comes from the global generator
        seen = []
        out = S.comfy_function(name)(model, x.clone(), sigmas.clone(), extra_args={"seed": 42},
                                             callback=lambda d: seen.append(d), disable=True, **opts)
        return out, seen

    def ours():
        torch.manual_seed(0)
        seen = []
        out = _run(name, model, x, sigmas, noise_mode="exact", callback=lambda d: seen.append(d), **opts)
        return out, seen

    want, want_cb = comfy_run()
    monkeypatch.setenv("COMFY_METAL_BACKEND", "reference")
    dispatch.reset()
    got, got_cb = ours()
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert [d["i"] for d in got_cb] == [d["i"] for d in want_cb]
    # ComfyUI's uni_pc reports x, i and denoised only (its x is in its variance-preserving space)
    keys = {"x", "i", "denoised"} if name.startswith("uni_pc") else {"x", "i", "sigma", "sigma_hat", "denoised"}
    assert set(got_cb[0]) == set(want_cb[0]) == keys
    for a, b in zip(got_cb, want_cb):
        torch.testing.assert_close(a["denoised"], b["denoised"], atol=1e-5, rtol=1e-5)
        if "sigma" in keys:
            assert float(a["sigma"]) == float(b["sigma"])
            assert math.isclose(float(a["sigma_hat"]), float(b["sigma_hat"]), rel_tol=1e-6)

    if _emulator_reason():
        pytest.skip(_emulator_reason())
    monkeypatch.setenv("COMFY_METAL_BACKEND", "emulator")
    dispatch.reset()
    try:
        emu, _ = ours()
        assert dispatch.last_backend.get(_step_kernel(name, kind)) == "emulator", dispatch.last_backend
    finally:
        dispatch.reset()
    torch.testing.assert_close(emu, got, atol=1e-3, rtol=1e-3)


@pytest.mark.parametrize("kind", ["eps", "flow"])
def test_res_multistep_with_eta_matches_comfyui_ancestral(comfyui, kind, reference_backend):
    """res_multistep_metal(eta > 0) is ComfyUI's res_multistep_ancestral (exact noise)."""
    import comfy.k_diffusion.sampling as kds
    import comfy.samplers

    model = ToyDenoiser(_comfy_model_sampling(kind))
    ms = model.inner_model.inner_model.model_sampling
    sigmas = comfy.samplers.calculate_sigmas(ms, "karras" if kind == "eps" else "simple", 6).float()
    x = torch.randn(1, 4, 5, 7, generator=torch.Generator().manual_seed(8)) * sigmas[0]
    want = kds.sample_res_multistep_ancestral(model, x.clone(), sigmas.clone(), extra_args={"seed": 3}, disable=True,
                                              eta=0.8, s_noise=0.9)
    got = _run("res_multistep", model, x, sigmas, extra_args={"seed": 3}, noise_mode="exact", eta=0.8, s_noise=0.9)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["eps", "flow"])
@pytest.mark.parametrize("name", ["euler_ancestral", "dpmpp_2m_sde", "dpmpp_3m_sde"])
def test_fast_noise_statistics_match_comfyui(comfyui, name, kind, reference_backend):
    """Fast noise is a different draw of the same process: over many seeds the per-element mean and
    spread of the final latents agree with ComfyUI's."""
    import comfy.k_diffusion.sampling as kds
    import comfy.samplers

    model = ToyDenoiser(_comfy_model_sampling(kind))
    ms = model.inner_model.inner_model.model_sampling
    sigmas = comfy.samplers.calculate_sigmas(ms, "karras" if kind == "eps" else "simple", 6).float()
    x = torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(3)) * sigmas[0]
    ours = torch.stack([_run(name, model, x, sigmas, noise_mode="fast", extra_args={"seed": s}) for s in range(12)])
    theirs = torch.stack([getattr(kds, f"sample_{name}")(model, x.clone(), sigmas.clone(), extra_args={"seed": s},
                                                         disable=True) for s in range(12)])
    assert abs(ours.std().item() / theirs.std().item() - 1) < 0.05
    assert abs(ours.std(0).mean().item() / theirs.std(0).mean().item() - 1) < 0.1
    assert (ours.mean(0) - theirs.mean(0)).abs().mean().item() < 0.5 * theirs.std(0).mean().item()


# ---- a tiny random UNet of the SD1.5 architecture, through ComfyUI's KSampler ----

def _tiny_unet_patcher(kind):
    import comfy.model_base
    import comfy.model_patcher
    import comfy.supported_models

    unet_config = {"use_checkpoint": False, "image_size": 32, "out_channels": 4, "use_spatial_transformer": True,
                   "legacy": False, "adm_in_channels": None, "dtype": torch.float32, "in_channels": 4,
                   "model_channels": 32, "num_res_blocks": [1], "transformer_depth": [1],
                   "channel_mult": [1], "transformer_depth_middle": 1, "use_linear_in_transformer": False,
                   "context_dim": 32, "num_heads": 2, "num_head_channels": -1,
                   "transformer_depth_output": [1, 1], "use_temporal_attention": False,
                   "use_temporal_resblock": False}
    config = comfy.supported_models.SD15(unet_config)
    config.set_inference_dtype(torch.float32, None)
    model_type = comfy.model_base.ModelType.EPS if kind == "eps" else comfy.model_base.ModelType.FLOW
    model = comfy.model_base.BaseModel(config, model_type=model_type, device=torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # ComfyUI's layers skip init: fill every weight explicitly
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * (0.05 if p.dim() > 1 else 0.01))
    return comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))


@pytest.fixture(scope="module")
def tiny_unets(comfyui):
    return {kind: _tiny_unet_patcher(kind) for kind in ("eps", "flow")}


def _conds():
    g = torch.Generator().manual_seed(4)
    return [[torch.randn(1, 5, 32, generator=g), {}]], [[torch.randn(1, 5, 32, generator=g), {}]]


def test_ksampler_dropdown_has_metal_entries(comfyui):
    import comfy.samplers

    names = comfyui.nodes.KSampler.INPUT_TYPES()["required"]["sampler_name"][0]
    for n in S.SAMPLER_NAMES:
        assert f"{n}_metal" in names and n in names
        assert names.count(f"{n}_metal") == 1
    assert comfy.samplers.KSampler.SAMPLERS is comfy.samplers.SAMPLER_NAMES
    assert all(f"{n}_metal" in comfy.samplers.KSAMPLER_NAMES for n in S.SAMPLER_NAMES)
    # built-ins unchanged and first; our entries only appended
    first_metal = min(names.index(f"{n}_metal") for n in S.SAMPLER_NAMES)
    assert all(not n.endswith("_metal") for n in names[:first_metal])
    assert "MetalSamplerSelect" in comfyui.nodes.NODE_CLASS_MAPPINGS
    before = list(comfy.samplers.SAMPLER_NAMES)
    S.register_ksampler_entries()
    assert comfy.samplers.SAMPLER_NAMES == before


def test_the_sampler_table_holds_comfyuis_options(comfyui):
    """Each entry's ComfyUI function, inpaint options and penultimate-sigma rule are those ComfyUI's KSampler
    uses for the sampler of that name (comfy.samplers.sampler_object, DISCARD_PENULTIMATE_SIGMA_SAMPLERS)."""
    import comfy.samplers

    discard = comfy.samplers.KSampler.DISCARD_PENULTIMATE_SIGMA_SAMPLERS
    for d in S.SAMPLERS:
        theirs = comfy.samplers.sampler_object(d.name)
        assert S.comfy_function(d.name) is theirs.sampler_function, d.name
        assert d.inpaint_options == theirs.inpaint_options, d.name
        assert d.discard_penultimate == (d.name in discard), d.name


def test_object_info_lists_metal_samplers(comfyui):
    """What the UI sees: KSampler, KSamplerAdvanced and KSamplerSelect offer <name>_metal; MetalSamplerSelect
    is a node with its four inputs returning SAMPLER."""
    metal = [f"{n}_metal" for n in S.SAMPLER_NAMES]
    for node in ("KSampler", "KSamplerAdvanced"):
        info = comfyui.object_info(node)[node]
        options = info["input"]["required"]["sampler_name"][0]
        assert all(m in options for m in metal) and "euler" in options, node
    select = comfyui.object_info("KSamplerSelect")["KSamplerSelect"]
    raw = select["input"]["required"]["sampler_name"]
    options = raw[1]["options"] if raw[0] == "COMBO" else raw[0]
    assert all(m in options for m in metal)
    ours = comfyui.object_info("MetalSamplerSelect")["MetalSamplerSelect"]
    assert set(ours["input"]["required"]) == {"sampler_name", "noise_mode", "eta", "s_noise"}
    assert ours["output"] == ["SAMPLER"]
    assert ours["input"]["required"]["sampler_name"][0] == list(S.SAMPLER_NAMES)


@pytest.mark.parametrize("kind", ["eps", "flow"])
@pytest.mark.parametrize("name", ["euler", "dpmpp_2m_sde", "uni_pc", "dpmpp_2s_ancestral", "ipndm"])
def test_ksampler_end_to_end_same_latent(comfyui, tiny_unets, name, kind, monkeypatch, reference_backend):
    """ComfyUI's KSampler node: `<name>_metal` (exact noise) gives the latent of `<name>` (uni_pc: on the
    schedule without its penultimate sigma, as KSampler gives uni_pc)."""
    monkeypatch.setenv(S.NOISE_ENV, "exact")
    positive, negative = _conds()
    latent = {"samples": torch.zeros(1, 4, 8, 8)}
    scheduler = "karras" if kind == "eps" else "simple"
    node = comfyui.nodes.KSampler()
    (want,) = node.sample(tiny_unets[kind], 11, 4, 2.5, name, scheduler, positive, negative, latent)
    (got,) = node.sample(tiny_unets[kind], 11, 4, 2.5, f"{name}_metal", scheduler, positive, negative, latent)
    assert torch.isfinite(want["samples"]).all()
    scale = want["samples"].abs().max().item()
    torch.testing.assert_close(got["samples"], want["samples"], atol=1e-5 * max(scale, 1), rtol=1e-5)


def test_metal_sampler_select_node_whole_in_emulator(comfyui, tiny_unets, monkeypatch):
    """MetalSamplerSelect -> SAMPLER -> ComfyUI's sample_custom on the tiny UNet with the real Metal
    kernels and launch glue in the emulator: equals the reference path, and (exact noise) ComfyUI."""
    import comfy.sample
    import comfy.samplers

    reason = _emulator_reason()
    if reason:
        pytest.skip(reason)
    positive, negative = _conds()
    model = tiny_unets["eps"]
    sigmas = comfy.samplers.calculate_sigmas(model.get_model_object("model_sampling"), "karras", 3).float()
    noise = torch.randn(1, 4, 8, 8, generator=torch.Generator().manual_seed(6))
    latent = torch.zeros(1, 4, 8, 8)
    (sampler,) = S.MetalSamplerSelect().get_sampler("dpmpp_2m_sde", "exact", 1.0, 1.0)
    assert isinstance(sampler, comfy.samplers.KSAMPLER)

    def run(s):
        return comfy.sample.sample_custom(model, noise, 2.0, s, sigmas, positive, negative, latent, seed=5,
                                          disable_pbar=True)

    want = run(comfy.samplers.sampler_object("dpmpp_2m_sde"))
    ref, emu, backends = reference_then_emulator(monkeypatch, lambda: run(sampler))
    assert backends.get("sampler_dpmpp_2m_sde_step") == "emulator"
    scale = max(want.abs().max().item(), 1)
    torch.testing.assert_close(ref, want, atol=1e-5 * scale, rtol=1e-5)
    torch.testing.assert_close(emu, ref, atol=1e-3 * scale, rtol=1e-3)
    # fast noise through the node: runs, finite, differs from the exact draw
    monkeypatch.setenv("COMFY_METAL_BACKEND", "reference")
    (fast,) = S.MetalSamplerSelect().get_sampler("dpmpp_2m_sde", "fast", 1.0, 1.0)
    out = run(fast)
    assert torch.isfinite(out).all() and not torch.allclose(out, want)
    with pytest.raises(S.SamplingError, match="unknown Metal sampler"):
        S.MetalSamplerSelect().get_sampler("nope", "fast", 1.0, 1.0)


def test_bench_runs_and_reports(monkeypatch, reference_backend):
    """The bench section on a tiny latent: both tables, every sampler, the fused-bytes column measured from
    the kernel calls (euler: x, denoised and the new x on every step; dpmpp_3m_sde: up to two history
    tensors more once it has them), and the ComfyUI column either filled or saying ComfyUI was not found."""
    from comfy_metal.nodes.cli.bench import samplers as B

    monkeypatch.setattr(B, "LATENTS", [("tiny (4x8x8)", (1, 4, 8, 8))])
    if "comfy.k_diffusion.sampling" not in sys.modules:
        monkeypatch.delenv("COMFYUI_PATH", raising=False)
    times, traffic = B.bench(quick=True)
    assert [r[1] for r in times.rows if r[2] == "cpu"] == list(S.SAMPLER_NAMES)
    for row in times.rows:
        assert isinstance(row[3], float) and row[3] > 0
        if "comfy.k_diffusion.sampling" not in sys.modules:
            assert str(row[5]).startswith("ComfyUI not found")
    fused = {r[1]: r[2] for r in traffic.rows}
    assert fused["euler"] == "3.0 KiB"  # 3 fp32 tensors of 1 KiB a step
    assert 3.0 < float(fused["dpmpp_3m_sde"].split()[0]) <= 5.0
    assert "ComfyUI" in times.render()


def test_kernel_traffic_counts_each_tensor_of_a_call_once(reference_backend):
    x = torch.randn(1, 4, 5, 7)
    sigmas = torch.tensor([2.0, 1.0, 0.5, 0.0])
    with dispatch.recording_traffic() as traffic:
        S.get_sampler_function("euler")(lambda x, s, **kw: x * 0.5, x, sigmas, disable=True)
    # three steps of one fused call each, reading x and denoised and writing the new x (+ the NaN flags)
    assert traffic.calls == 3 and set(traffic.bytes_by_kernel) == {"sampler_euler_step"}
    assert 3 * 3 * x.nbytes <= traffic.bytes < 3 * 3 * x.nbytes + 3 * 64
    with dispatch.recording_traffic() as outside:
        pass
    assert outside.bytes == 0


def test_a_sampler_run_records_its_kernel_backends_for_the_badge():
    """The record goes to the executing node (node_class None) and lists only the kernels that ran."""
    from comfy_metal.nodes import sampling as samplers, status

    status.clear_records()
    _, index = status.records_since(0)
    x = torch.randn(1, 4, 5, 7)
    sigmas = torch.tensor([2.0, 1.0, 0.5, 0.0])
    samplers.get_sampler_function("euler")(lambda x, s, **kw: x * 0.5, x, sigmas, disable=True)
    records, _ = status.records_since(index)
    assert len(records) == 1 and records[0]["node_class"] is None
    assert set(records[0]["kernels"]) == {"sampler_euler_step"}
    assert records[0]["kernels"]["sampler_euler_step"]["backend"] == "reference"


@pytest.mark.parametrize("name", ["euler", "dpmpp_2m", "uni_pc", "deis", "dpmpp_2m_sde"])
def test_measured_dispatch_times_each_kernel_once_not_each_step(name, monkeypatch):
    """On MPS (faked: CPU tensors, the emulator as "Metal", syncs counted) every step kernel is timed
    against its reference once per shape class, at its first call: the device syncs of a run do not grow
    with its number of steps, and a second run makes none (the sigmas and step index a sampler passes
    each step must not make a new shape class)."""
    reason = _emulator_reason()
    if reason:
        pytest.skip(reason)
    dispatch.reset()
    real_library_for = dispatch._library_for
    syncs = []
    monkeypatch.setattr(dispatch, "_first_device", lambda args, kwargs: torch.device("mps"))
    monkeypatch.setattr(dispatch, "self_check", lambda spec, backend, device: None)
    monkeypatch.setattr(dispatch, "_library_for", lambda spec, backend: real_library_for(spec, "emulator"))
    monkeypatch.setattr(dispatch, "_device_sync", syncs.append)
    model = ToyDenoiser(ToyEPS())
    x = torch.randn(1, 4, 5, 7, generator=torch.Generator().manual_seed(0))

    def run(steps):
        del syncs[:]
        sigmas = toy_schedule("eps", steps)
        _run(name, model, x * sigmas[0], sigmas, noise_mode="fast")
        return len(syncs)

    first = {}
    for steps in (6, 12):
        dispatch.measured.clear()
        first[steps] = run(steps)
    classes = len(dispatch.measured_records())
    # a class per kernel and argument set (a multistep sampler's first steps have less history), not per step
    assert first[6] == first[12] > 0 and classes <= 8, [r["shape_class"] for r in dispatch.measured_records()]
    assert run(12) == 0               # every class already decided
    dispatch.reset()
