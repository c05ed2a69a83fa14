"""Exact low-memory encode: the stage-by-stage encode (nodes/vae/stagewise_encode.py)
against the untiled encoder, within the budget, and seam mode auto choosing it when it fits. A small
diffusers AutoencoderKL with SD's encoder layout and random weights; its untiled encode is the oracle."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from comfy_metal.nodes import vae as vt
from comfy_metal.nodes.common.quality import psnr
from comfy_metal.nodes.vae.planner import chain as _chain
from comfy_metal.nodes.vae.stagewise_encode import StagewiseEncode


@pytest.fixture(scope="module")
def kl():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4,
                                  up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(16, 32, 64, 64),
                                  layers_per_block=2, norm_num_groups=8, latent_channels=4).eval()
    torch.manual_seed(1)
    x = torch.rand(1, 3, 160, 288) * 2 - 1                   # non-square, latent 20 x 36
    with torch.inference_mode():
        ref = vae.encode(x).latent_dist.mode()
    return vae, vt.codec_from_diffusers(vae), x, ref


def _lat_psnr(a, b):
    return psnr(a, b, float(b.abs().max()))


def test_body_stages_are_the_encoders_down_path(kl):
    vae, codec, x, ref = kl
    kinds = [s.kind for s in codec.encode_body_stages]
    assert kinds == ["in"] + (["resnet"] * 2 + ["down"]) * 3 + ["resnet"] * 2


def test_stagewise_encode_equals_untiled(kl):
    """fp32 buffers in 3-row bands: the untiled encoder's down path up to float rounding (statistics in
    float64, each convolution over its rows plus one row; a downsample's band reads twice its rows plus
    one); fp16 buffers at a budget that needs them: >= 60 dB on the latent."""
    vae, codec, x, ref = kl
    sw = StagewiseEncode(codec.encode_body_stages, "cpu", torch.float32)
    with torch.no_grad():
        want = _chain(codec.encode_stages[:-1])(x)
    roomy = sw.plan(tuple(x.shape), 1 << 34)
    assert roomy.store_dtype == torch.float32
    with torch.no_grad():
        body = sw.run(x, dataclasses.replace(roomy, rows=[3] * len(roomy.rows)))
    torch.testing.assert_close(body, want, atol=2e-5, rtol=1e-4)
    plans = [sw.plan(tuple(x.shape), roomy.peak // d) for d in (2, 3, 4, 6, 8)]
    tight = next(p for p in plans if p is not None and p.store_dtype == torch.float16)   # fp32 no longer fits
    assert tight.peak < roomy.peak // 2
    with torch.no_grad():
        z = codec.encode_stages[-1](sw.run(x, tight).float())
    print("stage-wise encode, fp16 buffers:", _lat_psnr(z, ref), "dB, rows", tight.rows)
    assert _lat_psnr(z, ref) >= 60
    assert sw.plan(tuple(x.shape), tight.peak // 20) is None


def test_budget_encode_runs_stagewise_within_the_budget(kl):
    """Exact (and auto) at a budget under the untiled encode's peak: one pass stage by stage, the latent
    the untiled one's, the measured peak within the budget and near the plan's prediction."""
    vae, codec, x, ref = kl
    cpu = torch.device("cpu")
    with vt.measure_peak(cpu) as untiled, torch.no_grad():
        vae.encode(x)
    budget = int(untiled["peak"] * 0.8)
    for shared in ("exact", "auto"):
        eng = vt.TiledVAE(codec, vt.TilingOptions(budget_bytes=budget, seam=shared))
        with vt.measure_peak(cpu) as m, torch.no_grad():
            out = eng.encode(x)
        info = eng.info
        print("stage-wise encode at 0.8x the untiled peak:", _lat_psnr(out, ref), "dB; peak", m["peak"],
              "predicted", info.expected_peak, "budget", budget, info.auto)
        assert info.scheme == "stages" and info.passes == 1 and info.mode == "exact (shared statistics)"
        assert (shared == "auto") == info.auto.startswith("auto: exact")
        assert _lat_psnr(out, ref) >= 60
        assert m["peak"] <= budget
        assert 0.5 * info.expected_peak <= m["peak"] <= 1.15 * info.expected_peak


def test_auto_encodes_in_tiles_when_the_stages_do_not_fit(kl):
    vae, codec, x, ref = kl
    eng = vt.TiledVAE(codec, vt.TilingOptions(budget_bytes=1 << 20, seam="auto"))
    out = eng.encode(x)
    assert eng.info.scheme == "tiles" and eng.info.tiles > 1 and out.shape == ref.shape
    assert eng.info.auto.startswith("auto: feather") and not eng.info.shared_stats
