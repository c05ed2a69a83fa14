"""The pack's attention inside a real ComfyUI ($COMFYUI_PATH; skipped with the reason otherwise).

Oracles: ComfyUI's own `attention_pytorch` (SDPA) and `attention_sub_quad` (its MPS default), run in
float32 on the same (rounded) inputs. The pack's function runs the Metal kernel in the MSL emulator
(COMFY_METAL_BACKEND=emulator) through ComfyUI's signature, both layouts, masks, GQA. Also: on CPU the
pack never replaces ComfyUI's attention unless asked; the Metal Attention node patches a clone through
set_model_optimized_attention; the measured dispatch never picks a slower kernel; and a tiny Flux
through KSampler with Metal Attention (emulated Metal) matches the stock run.
"""
from __future__ import annotations

import importlib

import pytest
import torch
from fake_clock import FakeClock

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

LOW_PRECISION_REL = 2e-3


@pytest.fixture(scope="module")
def pack(comfyui):
    """(comfy_attention module, metal_kernels package) of the pack as ComfyUI loaded it."""
    name = comfyui.pack_module.__name__
    return (importlib.import_module(name + ".nodes.attention.comfy_attention"),
            importlib.import_module(name + ".metal_kernels"))


@pytest.fixture
def emulated(pack, monkeypatch):
    from comfy_metal.metal_kernels import emulator

    if not emulator.available():
        pytest.skip("clang-19 not found: the MSL emulator cannot run")
    monkeypatch.setenv("COMFY_METAL_BACKEND", "emulator")
    pack[1].dispatch.reset()
    yield pack
    monkeypatch.delenv("COMFY_METAL_BACKEND")
    pack[1].dispatch.reset()


def _comfy():
    import comfy.ldm.modules.attention as attention

    return attention


def rel(got, want):
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


def make(b, heads, kv_heads, lq, lk, d, dtype, skip_reshape, seed=0):
    g = torch.Generator().manual_seed(seed)
    if skip_reshape:
        shapes = [(b, heads, lq, d), (b, kv_heads, lk, d), (b, kv_heads, lk, d)]
    else:
        shapes = [(b, lq, heads * d), (b, lk, kv_heads * d), (b, lk, kv_heads * d)]
    return [torch.randn(s, generator=g).to(dtype) for s in shapes]


CASES = [
    # (b, heads, kv_heads, lq, lk, d, dtype, skip_reshape, skip_output_reshape, mask kind)
    (1, 2, 2, 37, 37, 64, torch.float16, False, False, None),         # SDXL-like self-attention, odd length
    (2, 3, 3, 21, 77, 40, torch.float16, False, False, None),         # SD1.5 cross-attention to 77 tokens
    (1, 2, 2, 33, 50, 128, torch.bfloat16, True, True, None),         # Flux/Wan layout (B, H, L, D)
    (1, 2, 2, 19, 19, 160, torch.float32, True, False, None),
    (1, 4, 2, 17, 29, 72, torch.bfloat16, True, True, "gqa"),         # GQA (enable_gqa)
    (1, 4, 1, 13, 26, 80, torch.float16, False, False, "gqa"),
    (2, 2, 2, 18, 35, 96, torch.float16, False, False, "add2d"),
    (2, 2, 2, 18, 35, 64, torch.float32, True, True, "add3d"),
    (2, 2, 2, 18, 35, 256, torch.bfloat16, True, True, "add4d"),
    (2, 2, 2, 18, 35, 64, torch.float16, False, False, "bool4d"),
]


def make_mask(kind, b, heads, lq, lk, dtype, seed=3):
    g = torch.Generator().manual_seed(seed)
    if kind in (None, "gqa"):
        return None
    if kind == "bool4d":
        m = torch.rand(b, 1, lq, lk, generator=g) > 0.3
        m[..., 0] = True                     # no fully masked row: ComfyUI's SDPA would give NaN there
        return m
    shape = {"add2d": (lq, lk), "add3d": (b, lq, lk), "add4d": (b, heads, lq, lk)}[kind]
    m = (torch.randn(shape, generator=g) * 2).to(dtype)
    m[..., 1] = -10000.0
    return m


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[6]}-d{c[5]}-{c[9]}-skip{int(c[7])}{int(c[8])}".replace("torch.", ""))
def test_matches_comfyui_attention(emulated, case):
    ca, kernels = emulated
    attention = _comfy()
    b, heads, kv_heads, lq, lk, d, dtype, skip_reshape, skip_out, kind = case
    q, k, v = make(b, heads, kv_heads, lq, lk, d, dtype, skip_reshape)
    mask = make_mask(kind, b, heads, lq, lk, dtype)
    kw = {"enable_gqa": True} if kv_heads != heads else {}
    got = ca.metal_flash_attention(q, k, v, heads, mask=mask, skip_reshape=skip_reshape,
                                   skip_output_reshape=skip_out, **kw)
    assert kernels.dispatch.last_backend.get("flash_attention") == "emulator"
    assert ca.last_choice["choice"] == "metal_flash"
    fp32 = [t.float() for t in (q, k, v)]
    fmask = None if mask is None or mask.dtype == torch.bool else mask.float()
    fmask = mask if fmask is None else fmask
    oracles = {"sub_quad": attention.attention_sub_quad, "pytorch": attention.attention_pytorch}
    for name, fn in oracles.items():
        if name == "sub_quad" and mask is not None and mask.dtype == torch.bool:
            continue                          # sub-quad adds the mask: it takes additive masks only
        want = fn(*fp32, heads, mask=fmask, skip_reshape=skip_reshape, skip_output_reshape=skip_out, **kw)
        assert got.shape == want.shape, (name, got.shape, want.shape)
        assert got.dtype == dtype
        err = rel(got, want)
        bound = 2e-5 if dtype == torch.float32 else LOW_PRECISION_REL
        assert err <= bound, f"{name}: relative error {err:.3g} > {bound}"


def test_scale_kwarg_matches_comfyui(emulated):
    ca, _ = emulated
    q, k, v = make(1, 2, 2, 15, 23, 64, torch.float32, True)
    got = ca.metal_flash_attention(q, k, v, 2, skip_reshape=True, skip_output_reshape=True, scale=0.37)
    want = _comfy().attention_pytorch(q, k, v, 2, skip_reshape=True, skip_output_reshape=True, scale=0.37)
    assert rel(got, want) <= 2e-5


def test_fully_masked_row_gives_zero(emulated):
    ca, _ = emulated
    q, k, v = make(1, 2, 2, 9, 12, 64, torch.float16, False)
    mask = torch.ones(1, 1, 9, 12, dtype=torch.bool)
    mask[..., 4, :] = False
    out = ca.metal_flash_attention(q, k, v, 2, mask=mask)
    assert not torch.isnan(out).any()
    assert torch.equal(out[0, 4], torch.zeros_like(out[0, 4]))
    keep = torch.ones(9, dtype=torch.bool)
    keep[4] = False
    want = _comfy().attention_pytorch(q.float(), k.float(), v.float(), 2, mask=mask)
    assert rel(out[:, keep], want[:, keep]) <= LOW_PRECISION_REL


def test_cpu_never_replaces_comfyui_unless_asked(pack, monkeypatch):
    """auto on CPU: ComfyUI's own attention, bit for bit; 'always' runs the pack's reference."""
    ca, kernels = pack
    monkeypatch.delenv("COMFY_METAL_BACKEND", raising=False)
    kernels.dispatch.reset()
    kernels.dispatch.last_backend.clear()
    q, k, v = make(1, 2, 2, 20, 20, 64, torch.float32, False)
    got = ca.metal_flash_attention(q, k, v, 2)
    want = _comfy().optimized_attention(q, k, v, 2)
    assert torch.equal(got, want)
    assert "flash_attention" not in kernels.dispatch.last_backend
    assert ca.last_choice["choice"] != "metal_flash"
    asked = ca.attention_function("always")(q, k, v, 2)
    assert kernels.dispatch.last_backend["flash_attention"] == "reference"
    assert rel(asked, want) <= 2e-5


def test_uncovered_calls_go_to_comfyui(emulated, caplog):
    ca, kernels = emulated
    q, k, v = make(1, 1, 1, 8, 8, 320, torch.float32, True)            # head dim past 256
    kernels.dispatch.last_backend.clear()
    out = ca.metal_flash_attention(q, k, v, 1, skip_reshape=True)
    want = _comfy().optimized_attention(q, k, v, 1, skip_reshape=True)
    assert torch.equal(out, want)
    assert "flash_attention" not in kernels.dispatch.last_backend
    assert any("head dim 320" in r for r in ca.fallback_reasons)


def test_node_patches_a_clone_through_comfyui(comfyui, pack):
    """MetalAttention sets transformer_options['optimized_attention_override'] on a clone and registers
    'metal_flash' in ComfyUI's attention registry."""
    import comfy.model_patcher

    attention = _comfy()
    node_cls = comfyui.nodes.NODE_CLASS_MAPPINGS["MetalAttention"]
    base = comfy.model_patcher.ModelPatcher(torch.nn.Linear(2, 2), torch.device("cpu"), torch.device("cpu"))
    (patched,) = node_cls().patch(base, "auto")
    assert patched is not base
    assert "optimized_attention_override" not in base.model_options.get("transformer_options", {})
    override = patched.model_options["transformer_options"]["optimized_attention_override"]
    assert attention.get_attention_function("metal_flash") is pack[0].metal_flash_attention
    q, k, v = make(1, 2, 2, 6, 6, 8, torch.float32, False)
    torch.testing.assert_close(override(None, q, k, v, 2), attention.optimized_attention(q, k, v, 2))
    info = comfyui.object_info()["MetalAttention"]
    assert info["category"].startswith("Comfy Metal/")
    for name, spec in info["input"]["required"].items():
        assert spec[1].get("tooltip"), f"input {name} has no tooltip"


def test_measured_choice_never_picks_the_slow_kernel(pack):
    _, kernels = pack
    d = kernels.dispatch
    d.reset()
    clock = FakeClock()

    def cost(seconds):
        def run():
            clock.t += seconds
        return run

    syncs = []
    pick = d.measured_choice("k", ("a",), {"platform": cost(1.0), "metal": cost(5.0)}, "mps",
                             sync=syncs.append, clock=clock)
    assert pick == "platform" and syncs
    assert d.measured_choice("k", ("b",), {"platform": cost(5.0), "metal": cost(1.0)}, "mps",
                             sync=lambda dev: None, clock=clock) == "metal"
    # a tie keeps the platform op (listed first); a failing kernel is never chosen
    assert d.measured_choice("k", ("c",), {"platform": cost(1.0), "metal": cost(1.0)}, "mps",
                             sync=lambda dev: None, clock=clock) == "platform"

    def broken():
        raise RuntimeError("launch failed")
    assert d.measured_choice("k", ("d",), {"platform": cost(9.0), "metal": broken}, "mps",
                             sync=lambda dev: None, clock=clock) == "platform"
    # remembered: the same key is not measured again, even if the costs change
    assert d.measured_choice("k", ("a",), {"platform": cost(9.0), "metal": cost(1.0)}, "mps",
                             sync=lambda dev: None, clock=clock) == "platform"
    records = {tuple(r["shape_class"]): r for r in d.measured_records()}
    assert records[("a",)]["times_ms"] == {"platform": 1000.0, "metal": 5000.0}
    assert "failed: metal" in records[("d",)]["reason"]
    d.reset()


def test_attention_on_mps_never_picks_a_slow_kernel(pack, monkeypatch):
    """The attention function's measured dispatch, with MPS faked (CPU tensors, a fake timing source):
    a slow 'Metal kernel' is never used, a fast one is, and each shape class is measured once."""
    ca, kernels = pack
    d = kernels.dispatch
    d.reset()
    clock = FakeClock()
    monkeypatch.delenv("COMFY_METAL_BACKEND", raising=False)
    monkeypatch.setattr(d, "measuring_enabled", lambda device: True)
    monkeypatch.setattr(d, "_clock", clock)
    monkeypatch.setattr(d, "choose", lambda spec, device: ("metal", "faked for the test"))
    real_comfy = ca.comfy_attention()
    calls = {"metal": 0, "comfy": 0}
    kernel_cost = {"t": 10.0}

    def fake_comfy(*args, **kwargs):
        calls["comfy"] += 1
        clock.t += 1.0
        return real_comfy(*args, **kwargs)

    def fake_kernel(q, k, v, mask=None, scale=None):
        calls["metal"] += 1
        clock.t += kernel_cost["t"]
        return kernels.attention.flash_attention_reference(q, k, v, mask=mask, scale=scale)

    monkeypatch.setattr(ca, "comfy_attention", lambda: fake_comfy)
    monkeypatch.setattr(ca.attention_kernels, "flash_attention", fake_kernel)
    q, k, v = make(1, 2, 2, 20, 20, 64, torch.float32, False)
    out = ca.metal_flash_attention(q, k, v, 2)
    assert ca.last_choice["choice"] != "metal_flash"
    torch.testing.assert_close(out, real_comfy(q, k, v, 2))
    n = calls["metal"]
    for _ in range(3):                               # decided: the slow kernel never runs again
        ca.metal_flash_attention(q, k, v, 2)
    assert calls["metal"] == n
    kernel_cost["t"] = 0.1                          # another shape class, where the kernel is faster
    q2, k2, v2 = make(1, 2, 2, 300, 300, 64, torch.float32, False)
    ca.metal_flash_attention(q2, k2, v2, 2)
    assert ca.last_choice["choice"] == "metal_flash"
    records = d.measured_records()
    assert sorted(r["choice"] == "metal_flash" for r in records) == [False, True]
    # the badge of the node that ran it (here no executing node) carries the measured choice
    status = importlib.import_module(comfyui_pack_name(ca) + ".nodes.status")
    notes = [r.get("note") for r in list(status.history)[-2:]]
    comfy_name = "fake_comfy"                      # the name of the function standing for ComfyUI's
    assert notes[0].startswith(f"{comfy_name} (metal_flash ") and notes[0].endswith("x slower)"), notes
    assert notes[1].startswith("metal_flash ") and notes[1].endswith(f"x {comfy_name}"), notes
    d.reset()


def comfyui_pack_name(module):
    return module.__name__.rsplit(".nodes.", 1)[0]


@pytest.mark.parametrize("free", [1e12, 4 * 4 * 256 * 4 * 200 + 1, 1000.0])
def test_platform_score_elements_is_the_largest_matrix_sub_quad_builds(pack, monkeypatch, free):
    """Oracle: the score matrices ComfyUI's attention_sub_quad really builds (every torch.baddbmm it
    runs), at three free-memory levels that make it pick its largest query chunk, its smallest, and
    its sqrt(Lk) key chunks."""
    import comfy.model_management as mm

    ca, _ = pack
    monkeypatch.setattr(mm, "get_free_memory", lambda dev=None, torch_free_too=False: (free, free))
    built = []
    real_baddbmm = torch.baddbmm

    def recording_baddbmm(*args, **kwargs):
        out = real_baddbmm(*args, **kwargs)
        built.append(out.numel())
        return out

    monkeypatch.setattr(torch, "baddbmm", recording_baddbmm)
    q, k, v = make(2, 2, 2, 300, 200, 16, torch.float32, True)
    _comfy().attention_sub_quad(q, k, v, 2, skip_reshape=True)
    monkeypatch.setattr(torch, "baddbmm", real_baddbmm)
    assert built and ca.platform_score_elements("sub_quad", q, k) == max(built)
    # SDPA builds the whole matrix above 8 query rows; unknown functions are bounded by it
    assert ca.platform_score_elements("pytorch", q, k) == 2 * 2 * 300 * 200
    assert ca.platform_score_elements("pytorch", q[:, :, :8], k) == 0
    assert ca.platform_score_elements("split", q, k) == 2 * 2 * 300 * 200


@pytest.mark.parametrize("metal_available", [True, False])
def test_past_2_to_the_31_scores_the_pack_runs_even_when_slower(pack, monkeypatch, metal_available):
    """Correctness before speed on MPS (faked): where ComfyUI's attention would build a score matrix past
    the MPS limit (lowered here so small tensors cross it), the pack's attention runs although ComfyUI's
    is measured faster, and although the Metal kernel is unavailable (its chunked reference then)."""
    ca, kernels = pack
    d = kernels.dispatch
    d.reset()
    monkeypatch.delenv("COMFY_METAL_BACKEND", raising=False)
    monkeypatch.setattr(d, "measuring_enabled", lambda device: True)
    monkeypatch.setattr(d, "choose", lambda spec, device: ("metal", "faked") if metal_available
                        else ("reference", "faked: self-check failed"))
    real_comfy = _comfy().attention_pytorch
    comfy_calls, kernel_calls = [], []

    def attention_pytorch(*args, **kwargs):        # named like ComfyUI's SDPA function
        comfy_calls.append(1)
        return real_comfy(*args, **kwargs)

    def kernel(q, k, v, mask=None, scale=None):
        kernel_calls.append(1)
        return kernels.attention.flash_attention_reference(q, k, v, mask=mask, scale=scale)

    monkeypatch.setattr(ca, "comfy_attention", lambda: attention_pytorch)
    monkeypatch.setattr(ca.attention_kernels, "flash_attention", kernel)
    monkeypatch.setattr(d, "measured_choice", lambda *a, **k: "pytorch")     # ComfyUI's measured faster
    q, k, v = make(1, 2, 2, 40, 40, 32, torch.float32, False)
    monkeypatch.setattr(ca, "MPS_MAX_SCORES", 2 * 40 * 40)                  # exactly at the limit
    out = ca.metal_flash_attention(q, k, v, 2)
    assert kernel_calls and not comfy_calls and ca.last_choice["choice"] == "metal_flash"
    torch.testing.assert_close(out, real_comfy(q, k, v, 2), rtol=1e-4, atol=1e-5)
    assert any("2^31" in r for r in ca.fallback_reasons)
    monkeypatch.setattr(ca, "MPS_MAX_SCORES", 2 * 40 * 40 + 1)              # below it: the measured choice
    kernel_calls.clear()
    ca.metal_flash_attention(q, k, v, 2)
    assert comfy_calls and not kernel_calls
    d.reset()
