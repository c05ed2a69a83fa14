"""deis_metal (nodes/sampling/more.py, metal_kernels/sampling/deis.py) beyond the generic sampler tests.

test_samplers.py covers deis with every sampler name: the step kernel vs its reference in the emulator on odd
shapes, whole-sampler emulator vs reference, zero host syncs per step, the KSampler / Metal Sampler Select
lists, and ComfyUI's sample_deis (max_order 2, 3, 4, "tab") within 1e-5 on 7 steps. Here:

Always run: bad max_order / deis_mode give clear errors before any model call; every order and both modes
in the emulator vs the reference path and without host syncs per step; the "rhoab" coefficients integrate
polynomials exactly.

With a real ComfyUI: the coefficients vs ComfyUI's get_deis_coeff_list; the sampler vs ComfyUI's
sample_deis on longer schedules (tab) and, where ComfyUI's rhoab list matches its history, in rhoab mode;
max_order 1 vs ComfyUI's Euler step. Where ComfyUI v0.33's own sample_deis fails (max_order 1, rhoab beyond
max_order + 1 steps) a check says so, so that a fixed ComfyUI shows up here.
"""
from __future__ import annotations

import pytest
import torch

from comfy_metal.metal_kernels import sampling as K
from comfy_metal.nodes import sampling as S
from test_samplers import ToyDenoiser, ToyEPS, _comfy_model_sampling, _per_step_syncs, _run, toy_emulator_run, \
    toy_schedule


def _schedule(kind, steps):
    import comfy.samplers

    model = ToyDenoiser(_comfy_model_sampling(kind))
    ms = model.inner_model.inner_model.model_sampling
    return model, comfy.samplers.calculate_sigmas(ms, "karras" if kind == "eps" else "simple", steps).float()


def _latent(sigmas, seed=1):
    return torch.randn(2, 4, 5, 7, generator=torch.Generator().manual_seed(seed)) * sigmas[0]


# --------------------------------------------------------------------------------------------
# Always run
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("options, message", [
    ({"max_order": 0}, "max_order must be an integer from 1 to 4, got 0"),
    ({"max_order": 5}, "max_order must be an integer from 1 to 4, got 5"),
    ({"max_order": 2.5}, "max_order must be an integer from 1 to 4, got 2.5"),
    ({"deis_mode": "tabb"}, "deis_mode 'tabb' is not supported; expected one of tab, rhoab"),
])
def test_bad_options_are_refused_before_any_model_call(options, message, reference_backend):
    model = ToyDenoiser(ToyEPS())
    with pytest.raises(S.SamplingError, match=f"deis_metal: deis: {message}"):
        _run("deis", model, torch.randn(1, 4, 3, 5), toy_schedule("eps", 4), **options)
    assert model.calls == 0
    # an integral float is an order (as a workflow's FLOAT widget would give it)
    assert torch.isfinite(_run("deis", model, torch.randn(1, 4, 3, 5), toy_schedule("eps", 4), max_order=2.0)).all()


def test_step_refuses_history_that_does_not_fit_the_coefficients(reference_backend):
    x = torch.randn(1, 4, 3, 5)
    with pytest.raises(ValueError, match="1 earlier derivatives for 3 coefficients; expected 2"):
        K.sampler_deis_step(x, x, x, None, None, 3.0, 2.0, coefficients=(0.1, 0.2, 0.3))
    with pytest.raises(ValueError, match="1 earlier derivatives for an Euler step; expected 0"):
        K.sampler_deis_step(x, x, x, None, None, 3.0, 2.0)


def test_rhoab_coefficients_integrate_polynomials_exactly():
    """A step of order k integrates any polynomial of degree < k in sigma through the k sigmas it uses: with
    d_j = p(sigma_j), sum_j c_j d_j is the integral of p over [sigma, sigma_next]."""
    sigmas = [14.6, 9.7, 6.1, 3.9, 2.0, 1.1, 0.4, 0.0]
    for max_order in (2, 3, 4):
        for i, c in enumerate(K.deis_coefficients(sigmas, max_order, "rhoab")):
            if c is None:
                continue
            for degree in range(len(c)):
                def p(s):
                    return 0.3 * s ** degree - 0.7

                a, b = sigmas[i], sigmas[i + 1]
                exact = 0.3 * (b ** (degree + 1) - a ** (degree + 1)) / (degree + 1) - 0.7 * (b - a)
                got = sum(cj * p(sigmas[i - j]) for j, cj in enumerate(c))
                assert abs(got - exact) <= 1e-9 * max(1.0, abs(exact)), (max_order, i, degree)


def test_orders_of_the_steps():
    sigmas = [14.6, 9.7, 6.1, 3.9, 2.0, 1.1, 0.0]
    for mode in K.DEIS_MODES:
        for max_order in K.DEIS_MAX_ORDERS:
            orders = [1 if c is None else len(c) for c in K.deis_coefficients(sigmas, max_order, mode)]
            assert orders == [min(max_order, i + 1) for i in range(5)] + [1]   # the step to 0 is Euler


@pytest.mark.parametrize("options", [{"max_order": 1}, {"max_order": 4}, {"max_order": 4, "deis_mode": "rhoab"}],
                         ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_zero_host_syncs_per_step_at_every_order(options, reference_backend):
    """As test_samplers' sync test (which runs the defaults): the host coefficient maths (numpy) and the history
    add nothing per step."""
    per_step, total = _per_step_syncs("deis", **options)
    assert all(v == 0 for v in per_step.values()), per_step
    assert sum(total.values()) <= 2, total


@pytest.mark.parametrize("kind", ["eps", "flow"])
@pytest.mark.parametrize("options", [{"max_order": 1}, {"max_order": 2}, {"max_order": 4},
                                     {"max_order": 4, "deis_mode": "rhoab"}, {"deis_mode": "rhoab"}],
                         ids=lambda o: "-".join(f"{k}={v}" for k, v in o.items()))
def test_every_order_in_emulator_matches_reference(kind, options, monkeypatch):
    want, got, backends = toy_emulator_run(monkeypatch, "deis", kind, 7, **options)
    assert backends["sampler_deis_step"] == "emulator"
    if options.get("max_order", 3) > 1:
        assert backends["sampler_to_d_step"] == "emulator"
    torch.testing.assert_close(got, want, atol=1e-3, rtol=1e-3)


# --------------------------------------------------------------------------------------------
# Against a real ComfyUI
# --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["eps", "flow"])
@pytest.mark.parametrize("steps", [7, 20])
def test_coefficients_match_comfyuis(comfyui, kind, steps):
    """tab: ComfyUI's list from float64 sigmas (its float32 list is within ~1e-4 relative, its float32
    rounding); rhoab: each step of order k is ComfyUI's step of its list at max_order k - 1, the one whose
    polynomial goes through the same k sigmas."""
    from comfy.k_diffusion import deis

    _, sigmas = _schedule(kind, steps)
    sig64 = sigmas.double()
    for max_order in (2, 3, 4):
        theirs = deis.get_deis_coeff_list(sig64, max_order, deis_mode="tab")
        for i, ours in enumerate(K.deis_coefficients(sigmas.tolist(), max_order, "tab")):
            if ours is not None:
                torch.testing.assert_close(torch.tensor(ours, dtype=torch.float64),
                                           torch.stack([torch.as_tensor(c).detach() for c in theirs[i]]).double(),
                                           atol=1e-7, rtol=2e-5)
    by_order = {k: deis.get_deis_coeff_list(sig64, k - 1, deis_mode="rhoab") for k in (2, 3, 4)}
    for i, ours in enumerate(K.deis_coefficients(sigmas.tolist(), 4, "rhoab")):
        if ours is not None:
            theirs = torch.stack([torch.as_tensor(c) for c in by_order[len(ours)][i]]).double()
            torch.testing.assert_close(torch.tensor(ours, dtype=torch.float64), theirs, atol=1e-12, rtol=1e-9)


def _compare(model, x, sigmas, comfy_fn, **options):
    want = comfy_fn(model, x.clone(), sigmas.clone(), disable=True)
    got = _run("deis", model, x, sigmas, **options)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["eps", "flow"])
@pytest.mark.parametrize("max_order", [3, 4])
def test_tab_matches_comfyui_on_a_longer_schedule(comfyui, kind, max_order, reference_backend):
    import comfy.k_diffusion.sampling as kds

    model, sigmas = _schedule(kind, 30)
    x = _latent(sigmas)
    _compare(model, x, sigmas, lambda *a, **k: kds.sample_deis(*a, max_order=max_order, **k), max_order=max_order)


@pytest.mark.parametrize("kind", ["eps", "flow"])
@pytest.mark.parametrize("max_order", [2, 3, 4])
def test_rhoab_matches_comfyui_where_its_list_matches_its_history(comfyui, kind, max_order, reference_backend):
    """Schedules of max_order + 1 steps (every step before the last within ComfyUI's consistent range)."""
    import comfy.k_diffusion.sampling as kds

    model, sigmas = _schedule(kind, max_order + 1)
    x = _latent(sigmas, seed=3)
    _compare(model, x, sigmas, lambda *a, **k: kds.sample_deis(*a, max_order=max_order, deis_mode="rhoab", **k),
             max_order=max_order, deis_mode="rhoab")


@pytest.mark.parametrize("kind", ["eps", "flow"])
@pytest.mark.parametrize("deis_mode", ["tab", "rhoab"])
def test_max_order_1_is_comfyuis_euler_step(comfyui, kind, deis_mode, reference_backend):
    """ComfyUI's sample_deis at max_order 1 takes `x + (t_next - t) * d` every step (its sample_euler's step)
    but raises IndexError in its history update after the first one."""
    import comfy.k_diffusion.sampling as kds

    model, sigmas = _schedule(kind, 7)
    x = _latent(sigmas, seed=4)
    _compare(model, x, sigmas, kds.sample_euler, max_order=1, deis_mode=deis_mode)
    with pytest.raises(IndexError):
        kds.sample_deis(model, x.clone(), sigmas.clone(), disable=True, max_order=1, deis_mode=deis_mode)


def test_comfyuis_rhoab_fails_on_longer_schedules_where_ours_converges(comfyui, reference_backend):
    """Why rhoab differs from ComfyUI's beyond max_order + 1 steps: its list has a coefficient too many for
    the step (max_order 2, 3: ValueError) or repeats step 4's (max_order 4: the latent diverges); the pack's
    rhoab converges to the tab result as the order grows."""
    import comfy.k_diffusion.sampling as kds

    model, sigmas = _schedule("eps", 20)
    x = _latent(sigmas, seed=5)
    for max_order in (2, 3):
        with pytest.raises(ValueError, match="too many values to unpack"):
            kds.sample_deis(model, x.clone(), sigmas.clone(), disable=True, max_order=max_order, deis_mode="rhoab")
    theirs = kds.sample_deis(model, x.clone(), sigmas.clone(), disable=True, max_order=4, deis_mode="rhoab")
    tab = kds.sample_deis(model, x.clone(), sigmas.clone(), disable=True, max_order=4)
    ours = {k: _run("deis", model, x, sigmas, max_order=k, deis_mode="rhoab") for k in (2, 3, 4)}
    assert theirs.abs().max() > 100 * tab.abs().max()
    gaps = [(ours[k] - tab).abs().max().item() for k in (2, 3, 4)]
    assert gaps[0] > gaps[1] > gaps[2] and gaps[2] < 1e-2 * tab.abs().max().item(), gaps
