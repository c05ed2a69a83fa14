"""Tiled low-memory VAE: kernels (emulator vs reference on odd shapes), tile planning, and tiled vs
untiled decode/encode of diffusers' AutoencoderKL and AutoencoderKLWan (small random configs)."""
from __future__ import annotations

import dataclasses
import types

import pytest
import torch
import torch.nn.functional as F

from comfy_metal.metal_kernels import dispatch
from comfy_metal.metal_kernels.vae import (vae_blend_accumulate, vae_blend_accumulate_reference, vae_pad,
                                           vae_pad_reference)
from comfy_metal.nodes import vae as vt
from comfy_metal.nodes.common.quality import psnr as psnr_db


def psnr(a, b, peak=None):
    return psnr_db(a, b, float(b.abs().max()) if peak is None else peak)


def img_psnr(a, b):
    """PSNR of two [-1, 1] images mapped to [0, 1] (how ComfyUI's process_output shows them)."""
    return psnr((a.clamp(-1, 1) + 1) / 2, (b.clamp(-1, 1) + 1) / 2, peak=1.0)


# ---------------------------------------------------------------- kernels


def test_pad_kernel_matches_reference_in_emulator(emulator_backend):
    gen = torch.Generator().manual_seed(0)
    for shape, pad, mode, dtype in [((1, 3, 5, 7), (1, 2, 3, 0), "constant", torch.float32),
                                    ((2, 3, 3, 5, 7), (1, 0, 2, 1, 2, 0), "constant", torch.float16),
                                    ((1, 2, 3, 5, 9), (1, 1, 1, 1, 2, 0), "replicate", torch.float32),
                                    ((1, 3, 7, 5), (2, 1, 1, 2), "replicate", torch.bfloat16)]:
        x = torch.randn(shape, generator=gen).to(dtype)
        got = vae_pad(x, pad, mode=mode, value=0.25)
        assert dispatch.last_backend["vae_pad"] == "emulator"
        want = vae_pad_reference(x, pad, mode=mode, value=0.25)
        assert got.shape == want.shape and torch.equal(got, want), (shape, pad, mode)


def test_blend_kernel_matches_reference_in_emulator(emulator_backend):
    gen = torch.Generator().manual_seed(1)
    for acc_shape, tile_shape, offset, dtype in [((1, 3, 13, 11), (1, 3, 7, 5), (5, 3), torch.float32),
                                                 ((1, 3, 5, 9, 7), (1, 3, 3, 5, 3), (2, 3, 4), torch.float16),
                                                 ((2, 1, 7, 9), (2, 1, 7, 9), (0, 0), torch.bfloat16)]:
        acc = torch.randn(acc_shape, generator=gen)
        tile = torch.randn(tile_shape, generator=gen).to(dtype)
        wy, wx = torch.rand(tile_shape[-2], generator=gen), torch.rand(tile_shape[-1], generator=gen)
        want = vae_blend_accumulate_reference(acc.clone(), tile, wy, wx, offset)
        got = vae_blend_accumulate(acc.clone(), tile, wy, wx, offset)
        assert dispatch.last_backend["vae_blend_accumulate"] == "emulator"
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_pad_router_is_scoped_and_routes_vae_pads(emulator_backend):
    x = torch.randn(1, 2, 3, 5, 4)
    mode = vt.MetalPadMode(device_types=("cpu",))
    with mode:
        y = F.pad(x, (1, 1, 1, 1, 2, 0))            # a causal 3-D conv pad
        r = F.pad(x[:, :, 0], (0, 1, 0, 1), mode="replicate")
        reflect = F.pad(x[:, :, 0], (1, 1, 1, 1), mode="reflect")   # not ours: passes through
    assert mode.routed == 2 and dispatch.last_backend["vae_pad"] == "emulator"
    assert torch.equal(y, F.pad(x, (1, 1, 1, 1, 2, 0)))
    assert torch.equal(r, F.pad(x[:, :, 0], (0, 1, 0, 1), mode="replicate"))
    assert reflect.shape == (1, 2, 7, 6)
    dispatch.last_backend.clear()
    F.pad(x, (1, 1))                                  # outside the block: untouched
    assert "vae_pad" not in dispatch.last_backend


def test_bad_inputs_get_clear_errors():
    with pytest.raises(ValueError, match="4-D"):
        vae_pad(torch.zeros(3, 4), (1, 1))
    with pytest.raises(TypeError, match="float32"):
        vae_blend_accumulate(torch.zeros(1, 3, 4, 4, dtype=torch.float16), torch.zeros(1, 3, 2, 2),
                             torch.ones(2), torch.ones(2), (0, 0))
    with pytest.raises(ValueError, match="does not fit"):
        vae_blend_accumulate(torch.zeros(1, 3, 4, 4), torch.zeros(1, 3, 2, 2), torch.ones(2), torch.ones(2), (3, 0))


# ---------------------------------------------------------------- planning


@pytest.mark.parametrize("size,tile,overlap", [(48, 16, 4), (17, 8, 4), (37, 16, 8), (100, 24, 6), (10, 16, 4), (33, 32, 16)])
def test_feather_weights_are_a_partition_of_unity(size, tile, overlap):
    plan = vt.plan_axis(size, tile, overlap)
    assert plan[0][0] == 0 and plan[-1][1] == size
    for scale in (1, 8):
        total = torch.zeros(size * scale)
        for k, (s, e) in enumerate(plan):
            total[s * scale:e * scale] += vt.axis_weights(plan, k, scale)
        torch.testing.assert_close(total, torch.ones_like(total), atol=1e-6, rtol=0)
    cores = [(s + vt.axis_core(plan, k)[0], s + vt.axis_core(plan, k)[1]) for k, (s, e) in enumerate(plan)]
    assert cores[0][0] == 0 and cores[-1][1] == size
    assert all(a[1] == b[0] for a, b in zip(cores, cores[1:]))      # the cores partition the axis


# ---------------------------------------------------------------- image VAE (GroupNorm)


@pytest.fixture(scope="module")
def kl_vae():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4,
                                  up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(32, 64, 64, 64),
                                  layers_per_block=1, norm_num_groups=16, latent_channels=4).eval()
    return vae


@pytest.fixture(scope="module")
def kl_case(kl_vae):
    torch.manual_seed(1)
    z = torch.randn(1, 4, 48, 40)
    with torch.inference_mode():
        ref = kl_vae.decode(z).sample
    return z, ref


def test_kl_feather_decode_matches_untiled(kl_vae, kl_case):
    z, ref = kl_case
    eng = vt.TiledVAE(vt.codec_from_diffusers(kl_vae), vt.TilingOptions(tile=32, overlap=12))
    out = eng.decode(z)
    assert eng.info.tiles == 4 and eng.info.passes == 1 and out.dtype == torch.float32
    assert out.shape == ref.shape
    p = img_psnr(out, ref)
    print("feather PSNR", p)
    assert p >= 32.0


class _TwiceNormed(torch.nn.Module):
    """A decoder whose one GroupNorm module runs twice per forward (module count 1, calls 2)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.conv_in = torch.nn.Conv2d(4, 16, 3, padding=1)
        self.norm = torch.nn.GroupNorm(4, 16)
        self.mid = torch.nn.Conv2d(16, 16, 3, padding=1)
        self.up = torch.nn.Upsample(scale_factor=8.0, mode="nearest")
        self.conv_out = torch.nn.Conv2d(16, 3, 3, padding=1)

    def forward(self, z):
        h = self.mid(F.silu(self.norm(self.conv_in(z))))
        return self.conv_out(self.up(F.silu(self.norm(h))))


@pytest.mark.parametrize("decoder", ["doctor", "groupnorm_called_twice"])
def test_shared_statistics_progress_total_is_fixed_from_the_first_report(decoder):
    """Every (done, total) reported during a shared-statistics decode has the same total, `done` only
    grows, and the last report is (total, total) with total = tiles x passes (the doctor showed
    36/45, then 40/54, then 45/45)."""
    from comfy_metal.nodes.cli import doctor as doctor_pipeline

    module = doctor_pipeline.tiny_decoder(0) if decoder == "doctor" else _TwiceNormed().eval()
    seen = []
    eng = vt.TiledVAE(vt.codec_from_fn(module, 8, module=module),
                      vt.TilingOptions(budget_bytes=8 * 2**20, tile=8, overlap=4, seam="exact",
                                       progress=lambda done, total: seen.append((done, total))))
    eng.decode(torch.randn(1, 4, 16, 16, generator=torch.Generator().manual_seed(0)))
    assert eng.info.tiles > 1 and eng.info.passes == eng.info.groupnorm_calls + 1
    assert eng.info.groupnorm_calls == (4 if decoder == "doctor" else 2)
    total = eng.info.tiles * eng.info.passes
    assert {t for _, t in seen} == {total}, seen
    done = [d for d, _ in seen]
    assert done == sorted(done) and done[-1] == total, seen


def test_kl_shared_statistics(kl_vae, kl_case):
    """Lock-step shared statistics on an AutoencoderKL with mid-block attention: >= 40 dB against the
    untiled decode, and better than feather alone (attention still sees only its tile)."""
    z, ref = kl_case
    codec = vt.codec_from_diffusers(kl_vae)
    n_gn = sum(isinstance(m, torch.nn.GroupNorm) for m in kl_vae.decoder.modules())
    n_mid = sum(isinstance(m, torch.nn.GroupNorm) for m in kl_vae.decoder.mid_block.modules())
    # one tile: its statistics are the whole image's, so it decodes in one plain pass, untiled
    eng = vt.TiledVAE(codec, vt.TilingOptions(tile=48, seam="exact"))
    out = eng.decode(z)
    assert not eng.info.shared_stats and eng.info.passes == 1
    assert img_psnr(out, ref) >= 90
    # the GroupNorms and blocks are restored afterwards
    assert all("forward" not in m.__dict__ for m in kl_vae.modules())
    # several tiles
    feather = img_psnr(vt.TiledVAE(codec, vt.TilingOptions(tile=32, overlap=12)).decode(z), ref)
    eng = vt.TiledVAE(codec, vt.TilingOptions(tile=32, overlap=12, seam="exact"))
    out = eng.decode(z)
    assert eng.info.tiles == 4 and eng.info.untiled_head
    assert eng.info.groupnorm_calls == n_gn - n_mid and eng.info.passes == n_gn - n_mid + 1
    p = img_psnr(out, ref)
    print("shared-statistics PSNR", p, "feather", feather)
    assert p >= 40.0 and p > feather + 3
    # without the block cache (every pass restarts from the latent): the same result up to the cache's
    # fp16 rounding
    eng = vt.TiledVAE(codec, vt.TilingOptions(tile=32, overlap=12, seam="exact", stats_cache=False))
    assert img_psnr(eng.decode(z), out) >= 60
    assert all("forward" not in m.__dict__ for m in kl_vae.modules())


def test_kl_shared_statistics_exact_without_attention():
    """No mid-block attention and an overlap covering the receptive field: every tile's core sees its
    untiled activations, so lock-step statistics reproduce the untiled decode (fp32 rounding only);
    feather alone cannot (each tile normalises itself)."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 3,
                                  up_block_types=("UpDecoderBlock2D",) * 3, block_out_channels=(16, 32, 32),
                                  layers_per_block=1, norm_num_groups=8, latent_channels=4,
                                  mid_block_add_attention=False).eval()
    torch.manual_seed(1)
    z = torch.randn(1, 4, 40, 36)
    with torch.inference_mode():
        ref = vae.decode(z).sample
    codec = vt.codec_from_diffusers(vae)
    eng = vt.TiledVAE(codec, vt.TilingOptions(tile=32, overlap=24, seam="exact", stats_cache_half=False))
    out = eng.decode(z)
    assert eng.info.tiles == 4 and eng.info.untiled_head
    p = img_psnr(out, ref)
    # the default fp16 block cache: its rounding only
    half = img_psnr(vt.TiledVAE(codec, vt.TilingOptions(tile=32, overlap=24, seam="exact")).decode(z), ref)
    print("fp16 cache PSNR", half)
    assert half >= 60.0
    feather = img_psnr(vt.TiledVAE(codec, vt.TilingOptions(tile=32, overlap=24)).decode(z), ref)
    print("exact shared-statistics PSNR", p, "feather", feather)
    assert p >= 80.0 and feather < p - 20
    # a smaller overlap (halo 8 latent px, under the receptive field): still >= 40 dB
    eng = vt.TiledVAE(codec, vt.TilingOptions(tile=28, overlap=16, seam="exact"))
    assert img_psnr(eng.decode(z), ref) >= 40.0


def test_shared_statistics_groupnorm_gather_is_core_weighted():
    """The gathered statistics of the first GroupNorm equal the whole input's (cores partition it)."""
    gn = torch.nn.GroupNorm(2, 4)
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 1), gn)
    torch.manual_seed(5)
    z = torch.randn(1, 3, 21, 17) * 3 + 1
    with torch.no_grad():
        ref = model(z)
    codec = vt.codec_from_fn(model, 1, module=model)
    eng = vt.TiledVAE(codec, vt.TilingOptions(tile=8, overlap=4, seam="exact", stats_cache_half=False))
    out = eng.decode(z)
    assert eng.info.tiles > 4 and eng.info.groupnorm_calls == 1
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)


def test_kl_encode_matches_untiled(kl_vae):
    torch.manual_seed(2)
    x = torch.rand(1, 3, 256, 192) * 2 - 1
    with torch.inference_mode():
        ref = kl_vae.encode(x).latent_dist.mode()
    eng = vt.TiledVAE(vt.codec_from_diffusers(kl_vae), vt.TilingOptions(tile=24, overlap=8))
    out = eng.encode(x)
    assert out.shape == ref.shape and eng.info.tiles > 1
    p = psnr(out, ref)
    print("encode PSNR", p)
    assert p >= 32.0
    # shared statistics through the encoder's GroupNorms (lock-step, cores at the pixel resolution); the
    # tiles run only the first down level(s), the rest of the encoder once over the whole image
    eng = vt.TiledVAE(vt.codec_from_diffusers(kl_vae), vt.TilingOptions(tile=24, overlap=8, seam="exact"))
    p_shared = psnr(eng.encode(x), ref)
    print("encode shared-statistics PSNR", p_shared, "tiled stages", eng.info.tiled_stages)
    assert eng.info.untiled_rest and eng.info.tiled_stages >= 1
    assert eng.info.groupnorm_calls == sum(isinstance(m, torch.nn.GroupNorm)
                                           for b in kl_vae.encoder.down_blocks[:eng.info.tiled_stages] for m in b.modules())
    assert p_shared >= 40.0 and p_shared > p
    # and with every GroupNorm of the encoder in lock-step (each tile runs the whole encoder)
    eng = vt.TiledVAE(vt.codec_from_diffusers(kl_vae), vt.TilingOptions(tile=24, overlap=8, seam="exact",
                                                                         untiled_rest=False))
    p_whole = psnr(eng.encode(x), ref)
    assert eng.info.groupnorm_calls == sum(isinstance(m, torch.nn.GroupNorm) for m in kl_vae.encoder.modules())
    print("encode shared statistics, whole encoder per tile", p_whole)
    assert p_shared > p_whole >= 40.0          # per-tile mid-block attention is what the untiled rest removes


def test_budget_picks_tiles_and_oom_halves(kl_vae, kl_case, caplog):
    z, ref = kl_case
    codec = vt.codec_from_diffusers(kl_vae)
    eng = vt.TiledVAE(codec, vt.TilingOptions(budget_bytes=40 << 20))
    out = eng.decode(z)
    cal = eng.info.calibration
    assert eng.info.tiles > 1 and cal["b"] > 0
    assert cal["a"] + cal["b"] * eng.info.tile ** 2 <= 40 << 20
    # an out-of-memory error on big tiles: halve and retry, the latent is untouched
    calls = {"n": 0}
    real = codec.decode

    def flaky(t):
        calls["n"] += 1
        if t.shape[-1] * t.shape[-2] > 24 * 24:
            raise RuntimeError("MPS backend out of memory (simulated)")
        return real(t)

    z_before = z.clone()
    flaky_codec = vt.Codec("flaky", 8, decode=flaky, module=kl_vae)
    eng = vt.TiledVAE(flaky_codec, vt.TilingOptions(tile=48, overlap=8))
    with caplog.at_level("WARNING", logger="comfy_metal"):
        out = eng.decode(z)
    assert eng.info.retries == 1 and eng.info.tile == 24
    assert "ran out of memory" in caplog.text
    assert torch.equal(z, z_before) and out.shape == ref.shape


def test_node_runs_with_emulator_backend(emulator_backend, kl_vae):
    """The whole decode node on a VAE-like object (a diffusers model inside), every kernel launched
    through the real Metal source in the emulator."""
    from comfy_metal.nodes.vae.nodes import MetalVAEDecodeTiled, MetalVAEEncodeTiled

    vae = types.SimpleNamespace(first_stage_model=kl_vae, latent_dim=2, latent_channels=4, device="cpu",
                                vae_dtype=torch.float32, output_device=torch.device("cpu"),
                                spacial_compression_decode=lambda: 8,
                                process_output=lambda im: im.add_(1.0).div_(2.0).clamp_(0.0, 1.0),
                                process_input=lambda im: im * 2.0 - 1.0,
                                vae_encode_crop_pixels=lambda p: p)
    from comfy_metal.nodes import status

    z = torch.randn(1, 4, 6, 5)
    _, index = status.records_since(0)
    (images,) = MetalVAEDecodeTiled().decode({"samples": z}, vae, overlap=2, seam_mode="feather")
    assert dispatch.last_backend["vae_blend_accumulate"] == "emulator"
    records, _ = status.records_since(index)     # the node badge: which backend its kernels used
    assert [r["node_class"] for r in records] == ["MetalVAEDecodeTiled"]
    assert records[0]["kernels"]["vae_blend_accumulate"]["backend"] == "emulator"
    with torch.inference_mode():
        ref = (kl_vae.decode(z).sample + 1) / 2
    assert images.shape == (1, 48, 40, 3)
    assert img_psnr(images.movedim(-1, 1) * 2 - 1, ref.clamp(0, 1) * 2 - 1) >= 20
    (lat,) = MetalVAEEncodeTiled().encode(images[:, :48, :40], vae, overlap=1)
    assert lat["samples"].shape == (1, 4, 6, 5)


# ---------------------------------------------------------------- causal video VAE (Wan)


@pytest.fixture(scope="module")
def wan_vae():
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    return diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                      latents_mean=[0.0] * 4, latents_std=[1.0] * 4).eval()


def test_wan_decode_matches_untiled(wan_vae):
    torch.manual_seed(3)
    z = torch.randn(1, 4, 3, 20, 16)
    with torch.inference_mode():
        ref = wan_vae.decode(z).sample
    eng = vt.TiledVAE(vt.codec_from_diffusers(wan_vae), vt.TilingOptions(tile=14, overlap=6))
    out = eng.decode(z)
    assert out.shape == ref.shape == (1, 3, 9, 160, 128) and eng.info.tiles > 1
    p = img_psnr(out, ref)
    print("wan decode PSNR", p)
    assert p >= 35.0


def test_wan_encode_matches_untiled(wan_vae):
    torch.manual_seed(4)
    x = torch.rand(1, 3, 5, 128, 96) * 2 - 1
    with torch.inference_mode():
        ref = wan_vae.encode(x).latent_dist.mode()
    eng = vt.TiledVAE(vt.codec_from_diffusers(wan_vae), vt.TilingOptions(tile=12, overlap=6))
    out = eng.encode(x)
    assert out.shape == ref.shape and eng.info.tiles > 1
    p = psnr(out, ref)
    print("wan encode PSNR", p)
    assert p >= 35.0


def test_shared_statistics_stay_within_the_budget(kl_vae):
    """The per-tile block cache of shared statistics shares the budget with the tiles (a quarter by
    default): tiles + cache + the output buffers stay within it, where untiled needs far more."""
    cpu = torch.device("cpu")
    z = torch.randn(1, 4, 32, 32)
    with vt.measure_peak(cpu) as untiled, torch.inference_mode():
        kl_vae.decode(z)
    budget = untiled["peak"] // 4
    eng = vt.TiledVAE(vt.codec_from_diffusers(kl_vae), vt.TilingOptions(budget_bytes=budget, seam="exact"))
    with vt.measure_peak(cpu) as tiled, torch.inference_mode():
        out = eng.decode(z)
    assert eng.info.tiles > 1 and eng.info.shared_stats
    output_buffers = 2 * out.numel() * 4          # the fp32 output and its feather-weight accumulator
    assert tiled["peak"] <= budget + output_buffers, (tiled["peak"], budget, output_buffers)


# ---------------------------------------------------------------- bench section


def _cell_float(v):
    return float(v) if isinstance(v, (int, float)) else float(str(v).rstrip("x"))


def test_bench_section_without_comfyui(monkeypatch):
    """`bench` of nodes/cli/bench/vae.py on a narrow SDXL-shaped VAE without ComfyUI: untiled and our three
    decoders measured, PSNR against untiled above the feather bar at this overlap, ComfyUI columns n/a
    with the reason, and the Wan table saying what it needs."""
    pytest.importorskip("diffusers")
    from comfy_metal.nodes.cli.bench import vae as bench_vae

    monkeypatch.setattr(bench_vae, "SDXL_WIDTHS", (32, 64, 128, 128))   # SD ratios (ComfyUI infers them)
    monkeypatch.setattr(bench_vae, "SDXL_SIDE", {True: 24, False: 24})
    monkeypatch.setattr(bench_vae, "_comfy", lambda: "ComfyUI not importable (test)")
    sdxl, *at_peak, wan = bench_vae.bench(quick=True)
    assert len(at_peak) == 4 and all(not t.rows and "needs ComfyUI" in t.note for t in at_peak)   # decode, encode
    labels = [r[0] for r in sdxl.rows]
    assert labels == ["untiled (diffusers decode)", "ours, feather, ComfyUI's overlap", "ours, feather",
                      "ours, shared GroupNorm stats"], sdxl.render()
    for row in sdxl.rows[1:]:
        tiles, seconds, psnr = row[1], row[2], row[4]
        assert int(tiles.split(" x ")[0]) == 4 and _cell_float(seconds) > 0, sdxl.render()
        assert 20 < _cell_float(psnr) < 200 and row[5] == "n/a", sdxl.render()
    assert "ComfyUI rows n/a: ComfyUI not importable (test)" in sdxl.note
    assert not wan.rows and "COMFYUI_PATH" in wan.note


def test_shared_statistics_sequential_cache_keeps_one_block_per_tile(kl_vae, kl_case):
    """A chain decoder (diffusers' KL) keeps only each tile's latest finished block: the same pixels as
    keeping every block, a far smaller cache, and under a cache limit fewer recomputed blocks."""
    z, _ = kl_case
    codec = vt.codec_from_diffusers(kl_vae)
    assert codec.sequential_blocks
    opts = dict(tile=32, overlap=12, seam="exact", stats_cache_half=False)
    chain = vt.TiledVAE(codec, vt.TilingOptions(**opts, stats_cache_bytes=1 << 40))
    out = chain.decode(z)
    keep_all = vt.TiledVAE(dataclasses.replace(codec, sequential_blocks=False),
                           vt.TilingOptions(**opts, stats_cache_bytes=1 << 40))
    torch.testing.assert_close(keep_all.decode(z), out, atol=1e-5, rtol=0)
    print("cache peak: chain", chain.info.stats_cache_peak, "keep all", keep_all.info.stats_cache_peak)
    assert chain.info.stats_cache_peak < keep_all.info.stats_cache_peak * 0.7   # latest block + one block's convs
    assert chain.info.blocks_computed == keep_all.info.blocks_computed     # nothing recomputed either way
    # a cache limit that holds one block per tile but not all of them
    limit = chain.info.stats_cache_peak
    chain_l = vt.TiledVAE(codec, vt.TilingOptions(**opts, stats_cache_bytes=limit))
    keep_l = vt.TiledVAE(dataclasses.replace(codec, sequential_blocks=False),
                         vt.TilingOptions(**opts, stats_cache_bytes=limit))
    torch.testing.assert_close(chain_l.decode(z), out, atol=1e-5, rtol=0)
    assert img_psnr(keep_l.decode(z), out) >= 60      # recomputed blocks are fp32, cached ones fp16
    print("blocks computed under the limit: chain", chain_l.info.blocks_computed, "keep all",
          keep_l.info.blocks_computed)
    assert chain_l.info.blocks_computed == chain.info.blocks_computed
    assert keep_l.info.blocks_computed > chain_l.info.blocks_computed


@pytest.mark.parametrize("encode", [False, True])
def test_attention_stays_under_the_mps_score_limit(kl_vae, kl_case, monkeypatch, caplog, encode):
    """On MPS (its score-matrix limit faked lower on CPU) no attention of the VAE sees more tokens than the
    limit allows: the whole-latent head/rest are skipped and tiles are cut small enough, with a warning.
    Oracle: every score matrix the VAE's attention (diffusers' SDPA) really builds."""
    import logging

    from comfy_metal.nodes.vae import planner

    limit = 300 ** 2                               # 1920 latent px -> tiles of at most 17 x 17 = 289 tokens
    monkeypatch.setattr(planner, "score_limited", lambda device: True)
    monkeypatch.setattr(planner, "MPS_MAX_SCORE_ELEMENTS", limit)
    built = []
    real_sdpa = F.scaled_dot_product_attention

    def recording_sdpa(q, k, v, *args, **kwargs):
        built.append(q.shape[:-2].numel() * q.shape[-2] * k.shape[-2])
        return real_sdpa(q, k, v, *args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", recording_sdpa)
    z, ref = kl_case
    eng = vt.TiledVAE(vt.codec_from_diffusers(kl_vae))
    with caplog.at_level(logging.WARNING, logger="comfy_metal"):
        out = eng.encode(ref.clamp(-1, 1)) if encode else eng.decode(z)
    assert out.shape[-2:] == ((z.shape[-2], z.shape[-1]) if encode else ref.shape[-2:])
    assert built and max(built) < limit, max(built)
    assert eng.info.tiles > 1 and not eng.info.untiled_head
    assert any("2^31" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize("over_frames", [True, False])
def test_mps_score_limit_counts_attention_over_frames(over_frames):
    """HunyuanVideo 1.0's mid attention runs over all latent frames of a tile as one sequence (ComfyUI's
    AttnBlock on a 5-D tensor): 9 frames of 96x96 latent px are (9 * 96 * 96)^2 = 6.9e9 scores, past 2^31;
    Wan's runs frame by frame (9 sequences of 96 * 96 tokens: 7.6e8). The largest tile side is the last
    one under the limit."""
    from comfy_metal.nodes.vae import planner

    codec = dataclasses.replace(vt.codec_from_fn(lambda z: z, 8), video=True, device=torch.device("mps"),
                                attention_over_frames=over_frames)
    plans = planner.Planner(codec, vt.TilingOptions(), 1 << 30)
    x = torch.empty(1, 16, 9, 96, 96, device="meta")
    assert plans.attention_fits(x, 96 * 96) is (not over_frames)
    side = plans.attention_side(x)
    scores = (lambda s: (9 * s * s) ** 2) if over_frames else (lambda s: 9 * (s * s) ** 2)
    assert scores(side) < planner.MPS_MAX_SCORE_ELEMENTS <= scores(side + 1), side
