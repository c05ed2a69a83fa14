"""HunyuanVideo 1.0's VAE stage by stage over the whole frame (nodes/vae/hunyuan.py) against ComfyUI's own
untiled decode and encode of the same VAE object (comfy.sd.VAE from a state dict in its key layout): decode
of 1, 5 and 21 latent frames, encode of 1 and 17 frames (and frame counts ComfyUI's encoder cuts short),
within the budget and the cost model's prediction, at odd frame sizes; fp16/bf16; no 5-D F.pad on MPS."""
from __future__ import annotations

import pytest
import torch

from fake_mps_pads import record_pad_ranks
from video_vae_checks import banded_budget, check_exact, run, runner
from vae_weights import vae_state_dict

CPU = torch.device("cpu")


def _hunyuan(ch=32, seed=2, dtype=None):
    """comfy.sd.VAE of a HunyuanVideo 1.0 VAE at width `ch` (the real one: 128). comfy.sd's branch for the
    `decoder.conv_in.conv.weight` layout hard-codes ch 128, so its AutoencoderKL is narrowed while the VAE is
    built; the detection and everything else are ComfyUI's."""
    import comfy.sd
    from comfy.ldm.models.autoencoder import AutoencoderKL

    seen = {}

    def narrow(ddconfig, embed_dim, **kw):
        seen.update(ddconfig)
        return AutoencoderKL(ddconfig={**ddconfig, "ch": ch}, embed_dim=embed_dim, **kw)

    ddconfig = {"double_z": True, "z_channels": 16, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": ch,
                "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0,
                "conv3d": True, "time_compress": 4}
    sd = vae_state_dict(AutoencoderKL(ddconfig=ddconfig, embed_dim=16), seed)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(comfy.sd, "AutoencoderKL", narrow)
        vae = comfy.sd.VAE(sd=sd, dtype=dtype)
    assert seen.get("conv3d") is True and seen.get("time_compress") == 4, seen
    return vae


@pytest.fixture(scope="module")
def hy(comfyui):
    return _hunyuan()


@pytest.mark.parametrize("frames", [1, 5, 21])
def test_decode_stage_by_stage_is_comfyuis_untiled(hy, frames):
    torch.manual_seed(frames)
    z = torch.randn(1, 16, frames, 5, 7)
    with torch.no_grad():
        ref = hy.first_stage_model.decode(z)
    assert ref.shape == (1, 3, 1 + 4 * (frames - 1), 40, 56)
    check_exact(hy, z, ref, encode=False)
    if frames == 5:
        check_exact(hy, z, ref, encode=False, store=torch.float16)


@pytest.mark.parametrize("frames", [1, 3, 11, 17])
def test_encode_stage_by_stage_is_comfyuis_untiled(hy, frames):
    torch.manual_seed(frames)
    x = torch.rand(1, 3, frames, 40, 56) * 2 - 1
    with torch.no_grad():
        ref = hy.first_stage_model.encode(x)
    check_exact(hy, x, ref, encode=True)


def test_programs_are_comfyuis_modules(hy):
    """HunyuanVideo's decoder and encoder become stage programs of ComfyUI's own modules (the convolutions are
    its CarriedConv3d's, the norms its GroupNorms); a module the stages do not know is named, and the codec says
    why it has no program."""
    from comfy_metal.nodes import vae as vt
    from comfy_metal.nodes.vae import hunyuan

    codec = vt.codec_from_comfy(hy)
    dec, enc = codec.decode_program, codec.encode_program
    assert isinstance(dec, hunyuan.HunyuanProgram) and isinstance(enc, hunyuan.HunyuanProgram), codec.programs_note
    fsm = hy.first_stage_model
    assert dec.whole[0].conv is fsm.decoder.conv_in.conv and dec.chunked[-1].norm is fsm.decoder.norm_out
    assert [s.kind for s in dec.whole].count("attn") == 1 and [s.kind for s in dec.chunked].count("up") == 3
    assert sum(s.kind == "conv" and s.conv.stride[1] == 2 for s in enc.chunked) == 3
    assert [s.conv.stride[0] for s in enc.chunked if s.kind == "conv" and s.conv.stride[1] == 2] == [1, 2, 2]
    assert [s.time for s in dec.chunked if s.kind == "up"] == [False, True, True]
    assert dec.time_compress == enc.time_compress == 4 and dec.out_frames(3) == 9 and enc.out_frames(11) == 3
    block = fsm.decoder.up[0].block[0]
    norm = block.norm2
    try:
        block.norm2 = torch.nn.LayerNorm(norm.num_channels)
        assert "ResnetBlock is not GroupNorm" in hunyuan.program(fsm, encode=False)
        assert "decoder: " in vt.codec_from_comfy(hy).programs_note
    finally:
        block.norm2 = norm
    assert not isinstance(hunyuan.program(fsm, encode=False), str)


@pytest.mark.heavy
def test_real_width_stage_by_stage_is_comfyuis_untiled(comfyui):
    """At the real width (ch 128: 128 to 512 channels, GroupNorm over 32 groups), frames of 24x32 px: decode of 5
    latent frames and encode of 9 frames, banded, against ComfyUI's untiled runs."""
    vae = _hunyuan(128, seed=4)
    torch.manual_seed(5)
    z = torch.randn(1, 16, 5, 3, 4)
    with torch.no_grad():
        ref = vae.first_stage_model.decode(z)
    check_exact(vae, z, ref, encode=False)
    x = torch.rand(1, 3, 9, 24, 32) * 2 - 1
    with torch.no_grad():
        ref = vae.first_stage_model.encode(x)
    check_exact(vae, x, ref, encode=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_within_the_formats_rounding(comfyui, dtype):
    """The VAE in bf16 / fp16: our stages and ComfyUI's untiled decode in that dtype, both against the fp32 decode
    of the same weights: ours within twice ComfyUI's own rounding error, and finite."""
    fp32, half = _hunyuan(seed=5), _hunyuan(seed=5, dtype=dtype)
    torch.manual_seed(0)
    z = torch.randn(1, 16, 3, 5, 6)
    with torch.no_grad():
        ref = fp32.first_stage_model.decode(z)
        comfy = half.first_stage_model.decode(z.to(dtype)).float()
    from comfy_metal.nodes.vae.planner import CPU_WORKSPACE_FACTOR, HEADROOM

    full = runner(half, False).plan(tuple(z.shape), 1 << 50)
    out, info, _ = run(half, z, full.peak * CPU_WORKSPACE_FACTOR * 0.6 / HEADROOM)
    assert info.scheme == "stages" and info.bands > 40 and out.dtype == torch.float32 and torch.isfinite(out).all()
    err, comfy_err = float((out - ref).abs().max()), float((comfy - ref).abs().max())
    print(dtype, "ours", err, "ComfyUI", comfy_err)
    assert err <= 2 * comfy_err + 1e-3


def test_untiled_when_it_fits_and_auto_picks_exact(hy):
    """Budget above the unbanded plan: every stage one band over the whole frame. Below it: bands, the plan's
    peak at least 80% of the budget. Seam mode auto chooses exact in both."""
    from comfy_metal.nodes.vae.planner import CPU_WORKSPACE_FACTOR, HEADROOM

    torch.manual_seed(3)
    z = torch.randn(1, 16, 3, 5, 6)
    prog = runner(hy, False).prog
    full = runner(hy, False, CPU_WORKSPACE_FACTOR).plan(tuple(z.shape), 1 << 50)
    _, info, _ = run(hy, z, full.peak / HEADROOM * 1.01, seam="auto")
    assert info.scheme == "stages" and info.auto.startswith("auto: exact"), info.auto
    assert info.bands == len(prog.whole) - 1 + len(prog.chunks(3)) * len(prog.chunked)    # the attention: no bands
    budget, plan, _ = banded_budget(hy, z, False)
    _, small, _ = run(hy, z, budget, seam="auto")
    assert small.scheme == "stages" and small.auto.startswith("auto: exact") and small.bands > info.bands, small.auto
    assert small.expected_peak == plan.peak >= 0.8 * budget


def test_default_path_peak_within_1_1x_comfyuis_untiled(hy):
    """The node's default (auto budget, seam auto) on one frame and on a short clip peaks at no more than 1.1x
    ComfyUI's untiled decode of the same latent (tracked bytes, the output included in both)."""
    from comfy_metal.nodes import vae as vt

    for frames in (1, 5):
        torch.manual_seed(frames)
        z = torch.randn(1, 16, frames, 8, 10)
        with vt.measure_peak(CPU) as m, torch.no_grad():
            hy.first_stage_model.decode(z)
        comfy = m["peak"]
        out, info, ours = run(hy, z, vt.auto_budget(CPU), seam="auto")
        ours += out.numel() * out.element_size()
        print(frames, "frame(s): ours", ours, "ComfyUI untiled", comfy, info.auto)
        assert info.scheme == "stages" and ours <= 1.1 * comfy


def test_no_5d_pad_on_mps(hy, emulator_backend, monkeypatch):
    """On MPS (faked: 5-D pads routed as on MPS, the Metal pad kernel run by the MSL emulator) the stages never
    call F.pad on a 5-D tensor -- the replicate padding in space and time included -- and give the CPU path's
    result."""
    torch.manual_seed(2)
    z = torch.randn(1, 16, 3, 3, 4)
    x = torch.rand(1, 3, 5, 24, 32) * 2 - 1
    want = [run(hy, z, 1 << 30)[0], run(hy, x, 1 << 30, encode=True)[0]]
    padded = record_pad_ranks(monkeypatch)
    got = [run(hy, z, 1 << 30)[0], run(hy, x, 1 << 30, encode=True)[0]]
    assert 5 not in padded, padded
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
