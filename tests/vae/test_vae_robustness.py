"""The robustness cases of the low-memory VAE engine (nodes/vae/engine.py): the CPU fallback after
repeated out-of-memory, a latent with NaN/inf, a batch, a 1x1 latent, and a budget no plan fits."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from comfy_metal.nodes import vae as vt
from comfy_metal.nodes.vae.planner import MIN_TILE
from comfy_metal.nodes.common.quality import psnr


def _img_psnr(a, b):
    return psnr((a.clamp(-1, 1) + 1) / 2, (b.clamp(-1, 1) + 1) / 2, 1.0)


@pytest.fixture(scope="module")
def small_kl():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 2,
                                   up_block_types=("UpDecoderBlock2D",) * 2, block_out_channels=(16, 32),
                                   layers_per_block=1, norm_num_groups=8, latent_channels=4).eval()


class _LocalDecoder(torch.nn.Module):
    """A 3x3 conv and a 2x nearest upsample: every output pixel depends on a 3x3 latent neighbourhood."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.conv = torch.nn.Conv2d(4, 3, 3, padding=1)

    def forward(self, z):
        return F.interpolate(self.conv(z), scale_factor=2, mode="nearest")


def test_cpu_fallback_after_repeated_oom(caplog):
    """The codec runs out of memory on its device at every tile size: the engine halves the tile down to
    the minimum, then decodes on the CPU with a warning, and the result is the untiled decode's."""
    dec = _LocalDecoder()
    calls = {"oom": 0}

    def decode(z):
        if z.device.type == "meta":          # the "accelerator": always out of memory
            calls["oom"] += 1
            raise RuntimeError("MPS backend out of memory (simulated)")
        return dec(z)

    codec = vt.Codec("oom-test", 2, decode=decode, device=torch.device("meta"))
    z = torch.randn(1, 4, 40, 40)
    with caplog.at_level(logging.WARNING, logger="comfy_metal"):
        out = vt.TiledVAE(codec, vt.TilingOptions(tile=32, overlap=4, calibrate=False,
                                                  budget_bytes=1 << 30)).decode(z)
    eng_info = [r.getMessage() for r in caplog.records]
    assert calls["oom"] >= 3
    assert any("retrying with 16px tiles" in m for m in eng_info) and any("on the CPU" in m for m in eng_info)
    with torch.no_grad():
        ref = dec(z)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_oom_on_cpu_at_the_smallest_tile_raises():
    def decode(z):
        raise RuntimeError("CPU: can't allocate memory (simulated)")

    codec = vt.Codec("oom-cpu", 2, decode=decode)
    with pytest.raises(RuntimeError, match="allocate memory"):
        vt.TiledVAE(codec, vt.TilingOptions(tile=16, overlap=4, calibrate=False)).decode(torch.randn(1, 4, 20, 20))


def test_nonfinite_latent_decodes_and_warns_once(caplog):
    """NaN/inf in the latent: the decode finishes, warns once naming the first tile and its count, counts
    every non-finite value, and leaves the far tiles finite."""
    dec = _LocalDecoder()
    codec = vt.codec_from_fn(dec, 2)
    z = torch.randn(1, 4, 40, 40)
    z[0, 0, 20, 20] = float("nan")           # in the overlap of several tiles
    z[0, 1, 21, 20] = float("inf")
    with caplog.at_level(logging.WARNING, logger="comfy_metal"):
        eng = vt.TiledVAE(codec, vt.TilingOptions(tile=24, overlap=8, calibrate=False))
        out = eng.decode(z)
    warnings = [r.getMessage() for r in caplog.records if "NaN/inf" in r.getMessage()]
    assert len(warnings) == 1 and "latent rows" in warnings[0] and "(the input has 2)" in warnings[0], warnings
    assert eng.info.tiles == 4 and eng.info.nonfinite > 0
    assert torch.isfinite(out[..., :20, :20]).all() and torch.isfinite(out[..., -20:, -20:]).all()
    assert not torch.isfinite(out[..., 40, 40]).all()
    assert torch.isfinite(z).sum() == z.numel() - 2          # the input latent is not modified


def test_batch_of_latents_decodes_each_as_alone(small_kl):
    """A batch of three latents: each image equals the tiled decode of its latent alone (GroupNorm
    statistics per sample, feather and shared statistics), and shared statistics stay near untiled."""
    codec = vt.codec_from_diffusers(small_kl)
    torch.manual_seed(4)
    z = torch.randn(3, 4, 20, 28)
    with torch.no_grad():
        ref = small_kl.decode(z).sample
    for shared in ("feather", "exact"):
        opt = dict(tile=16, overlap=8, seam=shared, stats_cache_half=False)
        out = vt.TiledVAE(codec, vt.TilingOptions(**opt)).decode(z)
        assert out.shape == ref.shape
        for i in range(3):
            alone = vt.TiledVAE(codec, vt.TilingOptions(**opt)).decode(z[i:i + 1])
            torch.testing.assert_close(out[i:i + 1], alone, atol=1e-4, rtol=0)
        if shared == "exact":
            assert min(_img_psnr(out[i], ref[i]) for i in range(3)) >= 45.0


def test_one_by_one_latent(small_kl):
    """A 1x1 latent decodes to the untiled result, with an automatic budget and with shared statistics."""
    codec = vt.codec_from_diffusers(small_kl)
    z = torch.randn(1, 4, 1, 1)
    with torch.no_grad():
        ref = small_kl.decode(z).sample
    for shared in ("feather", "exact"):
        eng = vt.TiledVAE(codec, vt.TilingOptions(seam=shared))
        out = eng.decode(z)
        assert out.shape == ref.shape == (1, 3, 2, 2) and eng.info.tiles == 1
        torch.testing.assert_close(out, ref, atol=1e-5, rtol=0)


def test_absurdly_small_budget_finishes_with_a_warning_naming_the_budget(small_kl, caplog):
    """A budget of a few KiB: the smallest plan runs, with a warning naming its expected peak and the
    budget that would hold it; nothing exceeds the budget silently."""
    codec = vt.codec_from_diffusers(small_kl)
    z = torch.randn(1, 4, 24, 24)
    with torch.no_grad():
        ref = small_kl.decode(z).sample
    with caplog.at_level(logging.WARNING, logger="comfy_metal"):
        eng = vt.TiledVAE(codec, vt.TilingOptions(budget_bytes=4096))
        out = eng.decode(z)
    msgs = [r.getMessage() for r in caplog.records if "no tile plan fits" in r.getMessage()]
    assert msgs and "would hold it" in msgs[0] and eng.info.over_budget and eng.info.expected_peak > 4096
    assert eng.info.tile == MIN_TILE and out.shape == ref.shape
    assert _img_psnr(out, ref) > 15


def test_encode_rest_out_of_memory_encodes_again_with_whole_encoder_tiles(small_kl, caplog):
    """Encode: the tiles ran the encoder's first level(s) and the untiled rest runs out of memory: the engine
    warns and encodes again with the whole encoder in each tile (the pixels are untouched): the result of
    that plan."""
    import dataclasses

    codec = vt.codec_from_diffusers(small_kl)
    rest = codec.encode_stages[-1]

    def oom_rest(h):
        raise RuntimeError("MPS backend out of memory (simulated)")

    flaky = dataclasses.replace(codec, encode_stages=(*codec.encode_stages[:-1], oom_rest))
    torch.manual_seed(4)
    x = torch.rand(1, 3, 96, 80) * 2 - 1
    before = x.clone()
    with torch.no_grad():
        ref = small_kl.encode(x).latent_dist.mode()
    eng = vt.TiledVAE(flaky, vt.TilingOptions(tile=8, overlap=4, calibrate=False, budget_bytes=1 << 30))
    with caplog.at_level(logging.WARNING, logger="comfy_metal"):
        out = eng.encode(x)
    assert "untiled rest ran out of memory" in caplog.text
    assert eng.info.retries == 1 and not eng.info.untiled_rest and eng.info.tiles > 1
    assert torch.equal(x, before) and out.shape == ref.shape
    whole = vt.TiledVAE(codec, vt.TilingOptions(tile=8, overlap=4, calibrate=False, budget_bytes=1 << 30,
                                                untiled_rest=False)).encode(x)
    torch.testing.assert_close(out, whole)               # the whole-encoder tiles, as if asked for them
    # the same engine without the simulated failure runs the rest untiled
    eng = vt.TiledVAE(codec, vt.TilingOptions(tile=8, overlap=4, calibrate=False, budget_bytes=1 << 30))
    eng.encode(x)
    assert eng.info.untiled_rest and rest is codec.encode_stages[-1]
