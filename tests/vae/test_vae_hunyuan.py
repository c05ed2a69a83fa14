"""HunyuanVideo 1.0's VAE stage by stage over the whole frame (nodes/vae/hunyuan.py) against ComfyUI's own
untiled decode and encode of the same VAE object (comfy.sd.VAE from a state dict in its key layout): decode
of 1, 5 and 21 latent frames, encode of 1 and 17 frames (and frame counts ComfyUI's encoder cuts short),
within the budget and the cost model's prediction, at odd frame sizes; fp16/bf16; no 5-D F.pad on MPS."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from comfy_metal.nodes.common.quality import psnr
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


def _run(vae, x, budget, encode=False, seam="exact"):
    from comfy_metal.nodes import vae as vt

    codec = vt.codec_from_comfy(vae)
    eng = vt.TiledVAE(codec, vt.TilingOptions(budget_bytes=int(budget), seam=seam))
    with vt.measure_peak(CPU) as m, torch.no_grad():
        out = eng.encode(x) if encode else eng.decode(x)
    return out, eng.info, m["peak"] - out.numel() * out.element_size()


def _runner(vae, encode, workspace=1.0):
    from comfy_metal.nodes import vae as vt

    codec = vt.codec_from_comfy(vae)
    prog = codec.encode_program if encode else codec.decode_program
    assert prog is not None, codec.programs_note
    return prog.runner(codec.device, codec.dtype, workspace)


def _budget(vae, x, encode, store=torch.float32):
    """The largest budget under the unbanded plan whose plan has bands and buffers in `store`."""
    from comfy_metal.nodes.vae.planner import CPU_WORKSPACE_FACTOR, HEADROOM

    full = _runner(vae, encode).plan(tuple(x.shape), 1 << 50)
    runner = _runner(vae, encode, CPU_WORKSPACE_FACTOR)
    for share in (0.8, 0.65, 0.5, 0.4, 0.3, 0.2, 0.15, 0.1):
        budget = int(full.peak * CPU_WORKSPACE_FACTOR * share / HEADROOM)
        p = runner.plan(tuple(x.shape), budget * HEADROOM)
        if p is not None and p.store_dtype == store and p.work > 1.0:
            return budget, p
    raise AssertionError(f"no banded plan with {store} buffers")


def _check(vae, x, ref, encode, store=torch.float32):
    budget, plan = _budget(vae, x, encode, store)
    out, info, peak = _run(vae, x, budget, encode)
    assert info.scheme == "stages" and info.mode == "exact (stage by stage)", info
    assert info.expected_peak == plan.peak, info
    assert out.shape == ref.shape
    scale = float(ref.abs().max())
    print(f"{'encode' if encode else 'decode'} {tuple(x.shape)}: {info.bands} bands, measured {peak / 2**20:.2f} MiB, "
          f"predicted {plan.tracked / 2**20:.2f} MiB tracked, budget {budget / 2**20:.2f} MiB, buffers "
          f"{plan.store_dtype}, max diff {float((out - ref).abs().max()):.2e}")
    if store == torch.float32:
        torch.testing.assert_close(out, ref.float(), atol=2e-5 * max(1.0, scale), rtol=0)
    else:
        assert psnr(out, ref.float(), peak=2 * scale) >= 60
    assert peak <= budget
    assert abs(peak / plan.tracked - 1) <= 0.15, (peak, plan.tracked)
    assert plan.peak >= 0.8 * budget
    return out, info


@pytest.mark.parametrize("frames", [1, 5, 21])
def test_decode_stage_by_stage_is_comfyuis_untiled(hy, frames):
    torch.manual_seed(frames)
    z = torch.randn(1, 16, frames, 5, 7)
    with torch.no_grad():
        ref = hy.first_stage_model.decode(z)
    assert ref.shape == (1, 3, 1 + 4 * (frames - 1), 40, 56)
    _check(hy, z, ref, encode=False)
    if frames == 5:
        _check(hy, z, ref, encode=False, store=torch.float16)


@pytest.mark.parametrize("frames", [1, 3, 11, 17])
def test_encode_stage_by_stage_is_comfyuis_untiled(hy, frames):
    torch.manual_seed(frames)
    x = torch.rand(1, 3, frames, 40, 56) * 2 - 1
    with torch.no_grad():
        ref = hy.first_stage_model.encode(x)
    _check(hy, x, ref, encode=True)
