"""The causal 3-D video VAEs stage by stage over the whole frame (nodes/vae/causal.py) against ComfyUI's own
untiled decode and encode of the same VAE object: Wan 2.1 (and the Qwen-Image image path: one frame through
the nodes) and Wan 2.2, tiny and at their real widths (small frames), decode of 1, 5 and 21 latent frames,
encode of 1 and 17; within the budget and the cost model's prediction; fp16/bf16; no 5-D F.pad on MPS.

Real widths are sized small in every other dimension (frames of 24x32 to 32x48 px) so the file stays cheap
on a 2-core CI machine; those tests carry the marker `heavy`."""
from __future__ import annotations

import pytest
import torch

from fake_mps_pads import record_pad_ranks
from video_vae_checks import banded_budget, check_exact, full_plan, run
from vae_weights import vae_state_dict

CPU = torch.device("cpu")



def _wan21(dim, seed=1, dtype=None):
    """comfy.sd.VAE of a Wan 2.1 / Qwen-Image VAE (ComfyUI reads the width from the state dict)."""
    import comfy.sd
    from comfy.ldm.wan.vae import WanVAE

    model = WanVAE(dim=dim, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                   temperal_downsample=[False, True, True])
    return comfy.sd.VAE(sd=vae_state_dict(model, seed), dtype=dtype)


def _wan22(dim, dec_dim, seed=2):
    """comfy.sd.VAE of a Wan 2.2 VAE (48 channels, 16x). comfy.sd builds it at the real width (160 / 256);
    narrower ones go through a narrowed constructor, the detection and everything else ComfyUI's."""
    import comfy.ldm.wan.vae2_2 as wan22
    import comfy.sd

    real = wan22.WanVAE
    model = real(dim=dim, dec_dim=dec_dim, z_dim=48, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                 temperal_downsample=[False, True, True])
    sd = vae_state_dict(model, seed)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(wan22, "WanVAE", lambda **cfg: real(**{**cfg, "dim": dim, "dec_dim": dec_dim}))
        vae = comfy.sd.VAE(sd=sd)
    assert vae.latent_channels == 48 and vae.spacial_compression_decode() == 16
    return vae


@pytest.fixture(scope="module")
def wan21(comfyui):
    return _wan21(8)


@pytest.fixture(scope="module")
def wan22(comfyui):
    return _wan22(8, 8)


def test_programs_are_comfyuis_wan_modules(wan21, wan22):
    """Every WanVAE decoder and encoder of ComfyUI becomes a stage program; a module the stages do not know is
    named, and the codec says why it has no program."""
    import dataclasses

    from comfy_metal.nodes import vae as vt
    from comfy_metal.nodes.vae import causal_program

    for vae, version in ((wan21, "wan21"), (wan22, "wan22")):
        codec = vt.codec_from_comfy(vae)
        assert codec.decode_program.version == codec.encode_program.version == version and not codec.programs_note
        kinds = [s.kind for s in codec.decode_program.stages]
        assert kinds[0] == "conv" and kinds[-1] == "conv" and kinds.count("attn") == 1 and "up" in kinds
        assert "down" in [s.kind for s in codec.encode_program.stages]
    fsm = wan21.first_stage_model
    block = fsm.decoder.upsamples[0]
    norm = block.residual[0]
    try:
        block.residual[0] = torch.nn.GroupNorm(1, norm.gamma.shape[0])
        assert "is not RMS_norm" in causal_program.program(fsm, encode=False)
        assert "decoder: " in vt.codec_from_comfy(wan21).programs_note
    finally:
        block.residual[0] = norm
    assert not isinstance(causal_program.program(fsm, encode=False), str)
    assert dataclasses.replace(vt.codec_from_comfy(wan21), decode_program=None).decode_program is None


# (latent channels, latent h, w, pixels per latent px) of the tiny test VAEs' cases
SHAPES = {"wan21": (16, 5, 6, 8), "wan22": (48, 3, 4, 16)}


@pytest.mark.parametrize("frames", [1, 5, 21])
@pytest.mark.parametrize("which", ["wan21", "wan22"])
def test_decode_stage_by_stage_is_comfyuis_untiled(wan21, wan22, which, frames):
    vae = wan21 if which == "wan21" else wan22
    zc, h, w, f = SHAPES[which]
    torch.manual_seed(frames)
    z = torch.randn(1, zc, frames, h, w)
    with torch.no_grad():
        ref = vae.first_stage_model.decode(z)
    assert ref.shape == (1, 3, 1 + 4 * (frames - 1), h * f, w * f)
    check_exact(vae, z, ref, encode=False)
    if frames == 21:            # a smaller budget: 2-byte buffers
        check_exact(vae, z, ref, encode=False, store=torch.float16)


@pytest.mark.parametrize("frames", [1, 17])
@pytest.mark.parametrize("which", ["wan21", "wan22"])
def test_encode_stage_by_stage_is_comfyuis_untiled(wan21, wan22, which, frames):
    vae = wan21 if which == "wan21" else wan22
    _, h, w, f = SHAPES[which]
    torch.manual_seed(frames)
    x = torch.rand(1, 3, frames, h * f, w * f) * 2 - 1
    with torch.no_grad():
        ref = vae.first_stage_model.encode(x)
    assert ref.shape[2] == 1 + (frames - 1) // 4
    check_exact(vae, x, ref, encode=True)


@pytest.mark.heavy
def test_real_widths_stage_by_stage_are_comfyuis_untiled(comfyui):
    """Wan 2.1 / Qwen-Image at its real width (96) and Wan 2.2 at its (160 / 256), frames of 24x32 / 32x48 px:
    decode of 1 and 5 latent frames, encode of 1 and 17 frames."""
    for vae, zc, f in ((_wan21(96), 16, 8), (_wan22(160, 256), 48, 16)):
        h, w = (3, 4) if f == 8 else (2, 3)
        for frames in (1, 5):
            torch.manual_seed(frames)
            z = torch.randn(1, zc, frames, h, w)
            with torch.no_grad():
                ref = vae.first_stage_model.decode(z)
            check_exact(vae, z, ref, encode=False)
        for frames in (1, 17):
            x = torch.rand(1, 3, frames, h * f, w * f) * 2 - 1
            with torch.no_grad():
                ref = vae.first_stage_model.encode(x)
            check_exact(vae, x, ref, encode=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_the_formats_rounding(comfyui, dtype):
    """A Wan 2.1 VAE in bf16 / fp16: our stages and ComfyUI's untiled decode in that dtype, both against the
    fp32 decode of the same weights: ours within twice ComfyUI's own rounding error, and finite."""
    fp32, half = _wan21(8, seed=5), _wan21(8, seed=5, dtype=dtype)
    torch.manual_seed(0)
    z = torch.randn(1, 16, 5, 5, 6)
    with torch.no_grad():
        ref = fp32.first_stage_model.decode(z)
        comfy = half.first_stage_model.decode(z.to(dtype)).float()
    from comfy_metal.nodes.vae.planner import CPU_WORKSPACE_FACTOR, HEADROOM

    full, _ = full_plan(half, z)
    out, info, _ = run(half, z, full.peak * CPU_WORKSPACE_FACTOR * 0.6 / HEADROOM)
    assert info.scheme == "stages" and out.dtype == torch.float32 and torch.isfinite(out).all()
    err, comfy_err = float((out - ref).abs().max()), float((comfy - ref).abs().max())
    print(dtype, "ours", err, "ComfyUI", comfy_err)
    assert err <= 2 * comfy_err + 1e-3


def test_qwen_image_frame_through_the_nodes(wan21, caplog):
    """The Qwen-Image image path: one frame through the decode and encode nodes (5-D latent [1, 16, 1, h, w],
    an IMAGE batch of one) at the node's default budget: the same image and latent as ComfyUI's VAE.decode /
    VAE.encode, and the log line names the stage-by-stage exact run."""
    from comfy_metal.nodes.vae.nodes import MetalVAEDecodeTiled, MetalVAEEncodeTiled

    torch.manual_seed(7)
    z = torch.randn(1, 16, 1, 6, 8)
    ref = wan21.decode(z)                                        # [1, 1, 48, 64, 3]
    with caplog.at_level("INFO", logger="comfy_metal"):
        (images,) = MetalVAEDecodeTiled().decode({"samples": z}, wan21)
    assert images.shape == (1, 48, 64, 3)
    assert "stage by stage" in caplog.text and "exact (stage by stage)" in caplog.text, caplog.text[-1500:]
    torch.testing.assert_close(images, ref.reshape(images.shape), atol=1e-5, rtol=0)
    lat_ref = wan21.encode(images)
    caplog.clear()
    with caplog.at_level("INFO", logger="comfy_metal"):
        (lat,) = MetalVAEEncodeTiled().encode(images, wan21)
    assert "stage by stage" in caplog.text, caplog.text[-1500:]
    assert lat["samples"].shape == lat_ref.shape == (1, 16, 1, 6, 8)
    torch.testing.assert_close(lat["samples"], lat_ref, atol=1e-5, rtol=0)


def test_untiled_when_it_fits_and_the_budget_used_when_it_does_not(wan21):
    """Budget above the unbanded plan: every stage one band over the whole frame (1.0 passes). Below it: bands,
    the plan's peak at least 80% of the budget (`_check` asserts it too). Auto chooses exact in both."""
    from comfy_metal.nodes.vae.planner import CPU_WORKSPACE_FACTOR, HEADROOM

    torch.manual_seed(3)
    z = torch.randn(1, 16, 5, 5, 6)
    full, prog = full_plan(wan21, z)
    budget = full.peak * CPU_WORKSPACE_FACTOR / HEADROOM * 1.01
    _, info, peak = run(wan21, z, budget, seam="auto")
    n_chunks = len(prog.chunks(5))
    assert info.scheme == "stages" and info.auto.startswith("auto: exact"), info.auto
    assert info.bands <= n_chunks * 4 * len(prog.stages)            # one band per stage (and per piece)
    budget, plan, _ = banded_budget(wan21, z, False)
    _, small, _ = run(wan21, z, budget, seam="auto")
    assert small.scheme == "stages" and small.auto.startswith("auto: exact") and small.bands > info.bands
    assert small.expected_peak == plan.peak >= 0.8 * budget


def test_default_path_peak_within_1_1x_comfyuis_untiled(wan21):
    """The node's default (auto budget, seam auto) on one frame and on a short clip peaks at no more than 1.1x
    ComfyUI's untiled decode of the same latent (tracked bytes, the output included in both: ours is allocated
    before the first stage, ComfyUI's grows chunk by chunk and is concatenated at the end)."""
    from comfy_metal.nodes import vae as vt

    for frames in (1, 3):
        torch.manual_seed(frames)
        z = torch.randn(1, 16, frames, 8, 10)
        with vt.measure_peak(CPU) as m, torch.no_grad():
            ref = wan21.first_stage_model.decode(z)
        comfy = m["peak"]
        out, info, ours = run(wan21, z, vt.auto_budget(CPU), seam="auto")
        ours += out.numel() * out.element_size()
        print(frames, "frame(s): ours", ours, "ComfyUI untiled", comfy, info.auto)
        assert info.scheme == "stages" and ours <= 1.1 * comfy


def test_no_5d_pad_on_mps(wan21, wan22, emulator_backend, monkeypatch):
    """On MPS (faked: 5-D pads routed as on MPS, the Metal pad kernel run by the MSL emulator) the stages never
    call F.pad on a 5-D tensor -- the causal time padding and Wan 2.2's AvgDown3D included -- and give the same
    result as the CPU path."""
    torch.manual_seed(2)
    z21 = torch.randn(1, 16, 3, 3, 4)
    x22 = torch.rand(1, 3, 5, 32, 48) * 2 - 1
    want = [run(wan21, z21, 1 << 30)[0], run(wan22, x22, 1 << 30, encode=True)[0]]
    padded = record_pad_ranks(monkeypatch)
    got = [run(wan21, z21, 1 << 30)[0], run(wan22, x22, 1 << 30, encode=True)[0]]
    assert 5 not in padded, padded
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)


@pytest.mark.parametrize("slower, picks", [(1.05, "exact"), (1.5, "feather")])
def test_auto_compares_with_feather_only_when_exact_is_predicted_clearly_slower(wan21, monkeypatch, slower, picks):
    """Seam mode auto at a budget that needs bands: exact, without feather's calibration runs, while the stages
    are predicted within VIDEO_AUTO_SLACK of ComfyUI's tiled run (their halo rows); past it, feather is timed
    and picked when it is predicted faster."""
    from comfy_metal.nodes.vae import planner

    z = torch.randn(1, 16, 3, 8, 10)
    budget, plan, _ = banded_budget(wan21, z, False)
    assert plan.work > 1.0
    monkeypatch.setattr(planner, "comfy_tiled_work", lambda codec, shape, encode: plan.work / slower)
    calibrated = []
    real = planner.Planner.tile_for_budget

    def tile_for_budget(self, *args, **kwargs):
        calibrated.append(1)
        return real(self, *args, **kwargs)

    monkeypatch.setattr(planner.Planner, "tile_for_budget", tile_for_budget)
    monkeypatch.setattr(planner.Planner, "feather_work", lambda self, tile, h, w, exact=False: 1.0)
    _, info, _ = run(wan21, z, budget, seam="auto")
    print(info.auto)
    if picks == "exact":
        assert info.scheme == "stages" and info.auto.startswith("auto: exact") and not calibrated
    else:
        assert info.scheme == "tiles" and info.auto.startswith("auto: feather") and calibrated
