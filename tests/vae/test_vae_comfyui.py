"""The low-memory VAE nodes on ComfyUI's own VAE objects (comfy.sd.VAE built from small random state
dicts), against ComfyUI's untiled decode/encode of the same VAE. Runs only with COMFYUI_PATH."""
from __future__ import annotations

import pytest
import torch

from comfy_metal.nodes.common.quality import psnr
from vae_weights import vae_state_dict



@pytest.fixture(scope="module")
def sd_vae(comfyui):
    import comfy.sd
    from comfy.ldm.modules.diffusionmodules.model import Decoder

    ddconfig = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 32,
                "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
    holder = torch.nn.Module()
    holder.decoder = Decoder(**ddconfig)
    holder.post_quant_conv = torch.nn.Conv2d(4, 4, 1)
    sd = vae_state_dict(holder, 0)
    return comfy.sd.VAE(sd=sd)


@pytest.fixture(scope="module")
def wan_vae(comfyui):
    import comfy.sd
    from comfy.ldm.wan.vae import WanVAE

    model = WanVAE(dim=8, z_dim=16, dim_mult=[1, 2, 4, 4], num_res_blocks=2, attn_scales=[],
                   temperal_downsample=[False, True, True])
    return comfy.sd.VAE(sd=vae_state_dict(model, 1))


def _tiles_logged(text):
    import re

    found = re.findall(r"in [0-9.]+s: (\d+) tiles", text)
    assert found, text[-2000:]
    return int(found[-1])


def test_sd_vae_decode_tiled_vs_untiled(comfyui, sd_vae, caplog):
    from comfy_metal.nodes import vae as vt
    from comfy_metal.nodes.vae.nodes import MetalVAEDecodeTiled

    torch.manual_seed(0)
    z = torch.randn(1, 4, 40, 32)
    ref = sd_vae.decode(z)                                    # [1, 320, 256, 3] in [0, 1]
    codec = vt.codec_from_comfy(sd_vae)
    assert codec is not None and codec.name == "comfy-kl"
    out = vt.TiledVAE(codec, vt.TilingOptions(tile=28, overlap=16)).decode(z)
    p = psnr(sd_vae.process_output(out).movedim(1, -1), ref)
    print("ComfyUI SD VAE feather PSNR", p)
    assert p >= 32.0
    with caplog.at_level("INFO", logger="comfy_metal"):
        (images,) = MetalVAEDecodeTiled().decode({"samples": z}, sd_vae, memory_budget_gb=0.06, overlap=12,
                                                 seam_mode="feather")
    assert _tiles_logged(caplog.text) > 1
    assert images.shape == ref.shape and images.min() >= 0 and images.max() <= 1
    print("node PSNR", psnr(images, ref))
    assert psnr(images, ref) >= 28.0


def test_sd_vae_shared_statistics_vs_untiled(comfyui, sd_vae, caplog):
    """Lock-step shared GroupNorm statistics on ComfyUI's SD VAE object (its Decoder, mid-block
    attention included): >= 40 dB against ComfyUI's untiled decode, above feather alone."""
    from comfy_metal.nodes import vae as vt
    from comfy_metal.nodes.vae.nodes import EXACT, MetalVAEDecodeTiled

    torch.manual_seed(0)
    z = torch.randn(1, 4, 40, 32)
    ref = sd_vae.decode(z)
    codec = vt.codec_from_comfy(sd_vae)
    feather = psnr(sd_vae.process_output(vt.TiledVAE(codec, vt.TilingOptions(tile=28, overlap=16)).decode(z))
                      .movedim(1, -1), ref)
    eng = vt.TiledVAE(codec, vt.TilingOptions(tile=28, overlap=16, seam="exact"))
    out = eng.decode(z)
    dec = sd_vae.first_stage_model.decoder
    n_gn = sum(isinstance(m, torch.nn.GroupNorm) for m in dec.modules())
    n_mid = sum(isinstance(m, torch.nn.GroupNorm) for m in dec.mid.modules())   # run once, untiled
    assert eng.info.tiles > 1 and eng.info.untiled_head and eng.info.groupnorm_calls == n_gn - n_mid
    p = psnr(sd_vae.process_output(out).movedim(1, -1), ref)
    print("ComfyUI SD VAE shared-statistics PSNR", p, "feather", feather)
    assert p >= 40.0 and p > feather
    assert all("forward" not in m.__dict__ for m in sd_vae.first_stage_model.modules())
    with caplog.at_level("INFO", logger="comfy_metal"):
        (images,) = MetalVAEDecodeTiled().decode({"samples": z}, sd_vae, memory_budget_gb=0.08, overlap=16,
                                                 seam_mode=EXACT)
    assert ("stage by stage" in caplog.text or _tiles_logged(caplog.text) > 1) \
        and "shared GroupNorm statistics" in caplog.text
    p = psnr(images, ref)
    print("node shared-statistics PSNR", p)
    assert p >= 45.0


def test_sd_vae_exact_holds_45_db_at_small_budgets(comfyui, sd_vae, caplog):
    """The exact floor on ComfyUI's own VAE object, non-square latent: exact >= 45 dB against ComfyUI's
    untiled decode both ways it runs -- stage by stage at 0.6x the untiled decode's peak (well under
    ComfyUI's tiled peak; fp16 buffers, several bands a stage) and, for decoders without stages,
    lock-step tiles (two, with the exact overlap) -- and the node's default (auto) picks exact and says so."""
    import dataclasses

    from comfy_metal.nodes import vae as vt
    from comfy_metal.nodes.vae import planner
    from comfy_metal.nodes.vae.nodes import MetalVAEDecodeTiled

    torch.manual_seed(5)
    z = torch.randn(1, 4, 24, 44)
    ref = sd_vae.decode(z)
    codec = vt.codec_from_comfy(sd_vae)
    assert codec.decode_stages is not None
    cpu = torch.device("cpu")
    with vt.measure_peak(cpu) as untiled, torch.no_grad():
        sd_vae.first_stage_model.decode(z)
    budget = int(untiled["peak"] * 0.6)

    def run(c, **kw):
        eng = vt.TiledVAE(c, vt.TilingOptions(budget_bytes=budget, seam="exact", **kw))
        with vt.measure_peak(cpu) as m, torch.no_grad():
            out = eng.decode(z)
        p = psnr(sd_vae.process_output(out).movedim(1, -1), ref)
        print(f"exact, {eng.info.scheme or 'lock-step'}: {p:.1f} dB, tiles {eng.info.tiles} bands {eng.info.bands} "
              f"peak {m['peak'] / 2**20:.1f} MiB (budget {budget / 2**20:.1f}, predicted "
              f"{eng.info.expected_peak / 2**20:.1f})")
        return eng.info, p, m["peak"], out

    info, p, peak, out = run(codec)
    assert info.scheme == "stages" and info.bands > len(codec.decode_stages) and p >= 45.0
    assert peak <= budget + out.numel() * 4
    info, p, _, _ = run(dataclasses.replace(codec, decode_stages=None), tile=32)
    assert info.shared_stats and info.tiles > 1 and info.overlap >= planner.EXACT_OVERLAP and p >= 45.0
    caplog.clear()
    with caplog.at_level("INFO", logger="comfy_metal"):
        (images,) = MetalVAEDecodeTiled().decode({"samples": z}, sd_vae, memory_budget_gb=budget / 2**30)
    assert "quality vs untiled: exact (shared statistics); auto: exact" in caplog.text, caplog.text[-1500:]
    assert psnr(images, ref) >= 45.0


def test_wan21_decode_and_encode_tiled_vs_untiled(comfyui, wan_vae, caplog):
    from comfy_metal.nodes import vae as vt
    from comfy_metal.nodes.vae.nodes import MetalVAEDecodeTiled, MetalVAEEncodeTiled

    torch.manual_seed(1)
    z = torch.randn(1, 16, 3, 20, 16)
    ref = wan_vae.decode(z)                                   # [1, 9, 160, 128, 3]
    codec = vt.codec_from_comfy(wan_vae)
    assert codec is not None and codec.name == "comfy-wan21" and codec.decode_stream is not None
    with caplog.at_level("INFO", logger="comfy_metal"):
        (images,) = MetalVAEDecodeTiled().decode({"samples": z}, wan_vae, memory_budget_gb=0.0, overlap=6)
    assert images.shape == (9, 160, 128, 3)
    one = vt.TiledVAE(codec, vt.TilingOptions(tile=20)).decode(z)      # one tile: the streaming is exact
    assert psnr(wan_vae.process_output(one).movedim(1, -1), ref) >= 60
    out = vt.TiledVAE(codec, vt.TilingOptions(tile=14, overlap=6)).decode(z)
    p = psnr(wan_vae.process_output(out).movedim(1, -1).reshape(images.shape), ref.reshape(images.shape))
    print("ComfyUI Wan 2.1 decode PSNR", p)
    assert p >= 35.0
    pixels = ref.reshape(images.shape)
    lat_ref = wan_vae.encode(pixels)
    caplog.clear()
    with caplog.at_level("INFO", logger="comfy_metal"):
        (lat,) = MetalVAEEncodeTiled().encode(pixels, wan_vae, memory_budget_gb=0.02, overlap=8,
                                            seam_mode="feather")   # exact: test_vae_causal.py
    print("encode tiles", _tiles_logged(caplog.text))
    assert _tiles_logged(caplog.text) > 1
    assert lat["samples"].shape == lat_ref.shape
    p = psnr(lat["samples"], lat_ref, peak=float(lat_ref.abs().max()))
    print("ComfyUI Wan 2.1 encode PSNR", p)
    assert p >= 35.0


def test_unknown_vae_falls_back_to_comfyui_tiled(comfyui, sd_vae, caplog, monkeypatch):
    from comfy_metal.nodes.vae import codecs
    from comfy_metal.nodes.vae.nodes import MetalVAEDecodeTiled

    monkeypatch.setattr(codecs, "codec_from_comfy", lambda vae: None)
    z = torch.randn(1, 4, 8, 8)
    with caplog.at_level("INFO", logger="comfy_metal"):
        (images,) = MetalVAEDecodeTiled().decode({"samples": z}, sd_vae)
    assert images.shape == (1, 64, 64, 3)
    assert "ComfyUI's own tiled decode" in caplog.text


def test_bench_section_against_comfyui_tiled(comfyui, monkeypatch):
    """`bench` of nodes/cli/bench/vae.py against the real ComfyUI (narrow SDXL-, Wan 2.1- and HunyuanVideo-shaped VAEs):
    ComfyUI's tiled run measured and every one of our rows given as a ratio of its time and peak, PSNR filled;
    the Qwen-Image frame's tables at ComfyUI tiled's peak run exact (>= 60 dB)."""
    from comfy_metal.nodes.cli.bench import vae as bench_vae

    monkeypatch.setattr(bench_vae, "SDXL_WIDTHS", (32, 64, 128, 128))   # SD ratios (ComfyUI infers them)
    monkeypatch.setattr(bench_vae, "SDXL_SIDE", {True: 24, False: 24})
    sdxl, *at_peak = bench_vae.bench(quick=True, parts=["sdxl", "peak", "encode"])
    # the video part with Wan 2.1 / Qwen-Image's VAE narrowed (ComfyUI reads its width from the weights; Wan
    # 2.2's it fixes, so its case is left to `bench`): a frame decoded and encoded, a clip decoded
    monkeypatch.setattr(bench_vae, "WAN21_DIM", 16)
    # and HunyuanVideo's narrowed as the VAE tests narrow it (comfy.sd fixes its width: 128)
    import comfy.sd
    from comfy.ldm.models.autoencoder import AutoencoderKL

    monkeypatch.setattr(bench_vae, "HUNYUAN_DDCONFIG", {**bench_vae.HUNYUAN_DDCONFIG, "ch": 32})
    monkeypatch.setattr(comfy.sd, "AutoencoderKL",
                        lambda ddconfig, embed_dim, **kw: AutoencoderKL(ddconfig={**ddconfig, "ch": 32},
                                                                        embed_dim=embed_dim, **kw))
    monkeypatch.setattr(bench_vae, "VIDEO_CASES",
                        {True: [c for c in bench_vae.VIDEO_CASES[True] if c[1] in ("wan21", "hunyuan")]})
    video = bench_vae.bench(quick=True, parts=["video"])
    assert len(at_peak) == 4 and len(video) == 4
    assert ["Qwen-Image frame" in t.title for t in video] == [True, True, False, False], [t.title for t in video]
    assert "HunyuanVideo clip" in video[3].title and "failed" not in video[3].note, video[3].render()
    for table in video[:2]:     # the frame; the quick clip's causal caches alone exceed its quick tiles' peak
        exact = [r for r in table.rows if "peak, exact" in r[0]]
        assert exact and exact[0][1].startswith("stages") and _psnr_cell(exact[0][4]) >= 60, table.render()
    for table in at_peak:       # feather and exact at ComfyUI's tiled peak, side by side (decode, encode)
        labels = [r[0] for r in table.rows]
        assert any("peak, feather" in x for x in labels) and any("peak, exact" in x for x in labels), table.render()
        assert "PSNR vs the untiled encode" in table.note or "PSNR vs untiled: feather" in table.note, table.render()
    assert [t.title.startswith("VAE encode") for t in at_peak] == [False, False, True, True]
    assert bench_vae.bench(quick=True, parts=["encode"])[0].title == at_peak[2].title
    for table in (sdxl, *at_peak, *video):
        rows = {r[0]: r for r in table.rows}
        assert rows["ComfyUI tiled"][5] == "1x", table.render()
        ours = [r for r in table.rows if r[0].startswith("ours")]
        assert len(ours) >= 2, table.render()
        for r in ours:
            assert r[5].endswith("x") and r[6].endswith("x") and _psnr_cell(r[4]) > 20, table.render()


def _psnr_cell(v):
    return float("inf") if v == "inf" else float(v)


def test_bench_runs_comfyuis_own_tiled_decode_node(comfyui, sd_vae):
    """The full-size bench calls ComfyUI's VAEDecodeTiled node at its defaults: the same pixels as
    vae.decode_tiled with the node's arithmetic (512 px tiles, 64 px overlap -> 64 / 8 latent px)."""
    from comfy_metal.nodes.cli.bench import vae as bench_vae

    torch.manual_seed(0)
    z = torch.randn(1, 4, 72, 80)
    got = bench_vae._comfy_tiled_decode(sd_vae, z)
    want = sd_vae.decode_tiled(z, tile_x=64, tile_y=64, overlap=8).movedim(-1, 1) * 2 - 1
    assert got.shape == (1, 3, 576, 640)
    torch.testing.assert_close(got, want)


@pytest.fixture(scope="module")
def hunyuan_vae(comfyui):
    """HunyuanVideo 1.0 VAE as comfy.sd.VAE builds it from a state dict in its key layout (the
    `decoder.conv_in.conv.weight` branch: SD Encoder/Decoder with causal 3-D convolutions, 16 latent
    channels, 8x spatial, 4x temporal). That branch hard-codes the real width (ch 128, ~250M parameters),
    so comfy.sd's AutoencoderKL is narrowed to ch 32 while the VAE is built; everything else, the
    detection included, is ComfyUI's."""
    import comfy.sd
    from comfy.ldm.models.autoencoder import AutoencoderKL

    seen = {}

    def narrow(ddconfig, embed_dim, **kw):
        seen.update(ddconfig)
        return AutoencoderKL(ddconfig={**ddconfig, "ch": 32}, embed_dim=embed_dim, **kw)

    ddconfig = {"double_z": True, "z_channels": 16, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 32,
                "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0,
                "conv3d": True, "time_compress": 4}
    sd = vae_state_dict(AutoencoderKL(ddconfig=ddconfig, embed_dim=16), 2)
    assert "decoder.conv_in.conv.weight" in sd
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(comfy.sd, "AutoencoderKL", narrow)
        vae = comfy.sd.VAE(sd=sd)
    assert seen.get("conv3d") is True and seen.get("time_compress") == 4, seen     # ComfyUI's HunyuanVideo branch
    assert vae.latent_dim == 3 and vae.latent_channels == 16 and vae.temporal_compression_decode() == 4
    return vae


def test_hunyuan_video_decode_and_encode_tiled_vs_untiled(comfyui, hunyuan_vae, caplog):
    """HunyuanVideo 1.0: spatial tiles, each decoded causally two latent frames at a time through the
    decoder's own carried 3-D convolutions (decode_stream), against ComfyUI's untiled decode; the
    node in seam mode feather tiles it (not the fallback), encode through the encoder's own chunking; in seam
    mode auto the node runs the exact stages (ComfyUI's untiled decode and encode up to rounding)."""
    import dataclasses

    from comfy_metal.nodes import vae as vt
    from comfy_metal.nodes.vae.nodes import MetalVAEDecodeTiled, MetalVAEEncodeTiled

    vae = hunyuan_vae
    codec = vt.codec_from_comfy(vae)
    assert codec is not None and codec.name == "comfy-hunyuan-video" and codec.video and codec.scale == 8
    assert codec.decode_stream is not None and codec.encode is not None and not codec.sequential_blocks
    torch.manual_seed(2)
    small = torch.randn(1, 16, 4, 12, 10)
    # one tile: the chunked stream (three chunks of up to two latent frames, causal carries) is exact
    one = vt.TiledVAE(codec, vt.TilingOptions(tile=12)).decode(small)
    want = vae.decode(small)
    assert one.shape == (1, 3, 13, 96, 80) and want.shape == (1, 13, 96, 80, 3)
    assert psnr(vae.process_output(one).movedim(1, -1), want) >= 60
    # 2 x 2 tiles: streamed chunks accumulate exactly as each tile's whole (non-streamed 5-D) decode does
    eng = vt.TiledVAE(codec, vt.TilingOptions(tile=8, overlap=4))
    streamed = eng.decode(small)
    assert eng.info.tiles == 4
    whole = vt.TiledVAE(dataclasses.replace(codec, decode_stream=None), vt.TilingOptions(tile=8, overlap=4)).decode(small)
    assert whole.shape == streamed.shape == one.shape
    torch.testing.assert_close(streamed, whole, atol=1e-4, rtol=1e-4)

    z = torch.randn(1, 16, 2, 40, 32)
    ref = vae.decode(z)                                       # [1, 5, 320, 256, 3]
    assert ref.shape == (1, 5, 320, 256, 3)
    assert float((ref[:, 0] - ref[:, -1]).abs().mean()) > 1e-3     # the frames differ
    eng = vt.TiledVAE(codec, vt.TilingOptions(tile=28, overlap=14))
    out = eng.decode(z)
    assert eng.info.tiles == 4
    p = psnr(vae.process_output(out).movedim(1, -1), ref)
    print("ComfyUI HunyuanVideo decode PSNR", p, "tiles", eng.info.tiles)
    assert p >= 32.0
    with caplog.at_level("INFO", logger="comfy_metal"):
        (images,) = MetalVAEDecodeTiled().decode({"samples": z}, vae, memory_budget_gb=0.5, overlap=14,
                                                 seam_mode="feather")
    assert "ComfyUI's own tiled decode" not in caplog.text
    assert images.shape == (5, 320, 256, 3) and images.min() >= 0 and images.max() <= 1
    p = psnr(images, ref.reshape(images.shape))
    print("node PSNR", p, "tiles", _tiles_logged(caplog.text))
    assert _tiles_logged(caplog.text) > 1 and p >= 28.0
    # seam mode auto: the exact stages (nodes/vae/hunyuan.py), ComfyUI's untiled decode up to rounding
    caplog.clear()
    with caplog.at_level("INFO", logger="comfy_metal"):
        (images,) = MetalVAEDecodeTiled().decode({"samples": z}, vae, memory_budget_gb=0.5, overlap=14)
    assert "auto: exact (stage by stage" in caplog.text, caplog.text[-1500:]
    torch.testing.assert_close(images, ref.reshape(images.shape), atol=1e-5, rtol=0)

    pixels = ref.reshape(images.shape)
    lat_ref = vae.encode(pixels)
    caplog.clear()
    with caplog.at_level("INFO", logger="comfy_metal"):
        (lat,) = MetalVAEEncodeTiled().encode(pixels, vae, memory_budget_gb=0.5, overlap=14, seam_mode="feather")
    assert "ComfyUI's own tiled encode" not in caplog.text
    print("encode tiles", _tiles_logged(caplog.text))
    assert _tiles_logged(caplog.text) > 1
    assert lat["samples"].shape == lat_ref.shape == (1, 16, 2, 40, 32)
    p = psnr(lat["samples"], lat_ref, peak=float(lat_ref.abs().max()))
    print("ComfyUI HunyuanVideo encode PSNR", p)
    assert p >= 32.0
    caplog.clear()
    with caplog.at_level("INFO", logger="comfy_metal"):
        (lat,) = MetalVAEEncodeTiled().encode(pixels, vae, memory_budget_gb=0.5, overlap=14)
    assert "auto: exact (stage by stage" in caplog.text, caplog.text[-1500:]
    torch.testing.assert_close(lat["samples"], lat_ref, atol=1e-5 * max(1.0, float(lat_ref.abs().max())), rtol=0)


def test_sd_vae_untiled_mid_block_raises_psnr(comfyui, sd_vae):
    """conv_in and the mid block (its attention included) run once over the whole latent and
    the tiles start from that mid output: closer to ComfyUI's untiled decode than tiles that each run the
    whole decoder, in feather mode and with shared statistics (which is then exact up to the halo)."""
    from comfy_metal.nodes import vae as vt

    torch.manual_seed(0)
    z = torch.randn(1, 4, 24, 40)
    ref = sd_vae.decode(z)
    codec = vt.codec_from_comfy(sd_vae)
    assert codec.decode_head is not None
    with torch.no_grad():
        whole = codec.decode_tail(codec.decode_head(z))
    assert torch.equal(whole, sd_vae.first_stage_model.decode(z))     # the split is the same chain

    def run(**kw):
        eng = vt.TiledVAE(codec, vt.TilingOptions(tile=24, overlap=16, **kw))
        out = eng.decode(z)
        assert eng.info.tiles > 1
        return eng, psnr(sd_vae.process_output(out).movedim(1, -1), ref)

    _, per_tile = run(untiled_head=False)
    eng, head = run()
    assert eng.info.untiled_head and not eng.info.shared_stats
    _, per_tile_stats = run(untiled_head=False, seam="exact")
    eng, head_stats = run(seam="exact")
    print("feather", per_tile, "->", head, "; shared statistics", per_tile_stats, "->", head_stats)
    assert head > per_tile
    assert head_stats > per_tile_stats and head_stats >= 45.0
    assert eng.info.untiled_head and eng.info.groupnorm_calls < sum(
        isinstance(m, torch.nn.GroupNorm) for m in sd_vae.first_stage_model.decoder.modules())


# ---------------------------------------------------------------- encode

ENCODER_DDCONFIG = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 32,
                    "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}


@pytest.fixture(scope="module")
def sd_vae_with_encoder(comfyui):
    """An SD VAE with its encoder (AutoencoderKL: quant_conv, DiagonalGaussianRegularizer), narrowed to ch 32
    through comfy.sd.VAE's `config` argument (its state-dict detection builds the encoder at SD's ch 128)."""
    import comfy.sd
    from comfy.ldm.models.autoencoder import AutoencoderKL

    sd = vae_state_dict(AutoencoderKL(ddconfig=ENCODER_DDCONFIG, embed_dim=4), 3)
    return comfy.sd.VAE(sd=sd, config={"params": {"ddconfig": ENCODER_DDCONFIG, "embed_dim": 4}})


@pytest.fixture(scope="module")
def flux_vae_with_encoder(comfyui):
    """A Flux-style VAE (16 channels, no quant_conv: ComfyUI detects an AutoencodingEngine), the encoder
    narrowed to ch 32 while comfy.sd builds it (the decoder's width ComfyUI infers itself)."""
    import comfy.sd
    from comfy.ldm.models.autoencoder import AutoencodingEngine

    ddconfig = {**ENCODER_DDCONFIG, "z_channels": 16}
    enc = {"target": "comfy.ldm.modules.diffusionmodules.model.Encoder", "params": ddconfig}
    dec = {"target": "comfy.ldm.modules.diffusionmodules.model.Decoder", "params": ddconfig}
    reg = {"target": "comfy.ldm.models.autoencoder.DiagonalGaussianRegularizer"}
    sd = vae_state_dict(AutoencodingEngine(regularizer_config=reg, encoder_config=enc, decoder_config=dec), 4)

    def narrow(encoder_config, **kw):
        params = {**encoder_config["params"], "ch": 32}
        return AutoencodingEngine(encoder_config={**encoder_config, "params": params}, **kw)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(comfy.sd, "AutoencodingEngine", narrow)
        vae = comfy.sd.VAE(sd=sd)
    assert type(vae.first_stage_model).__name__ == "AutoencodingEngine" and vae.latent_channels == 16
    return vae


def _picture(h, w, seed=0):
    """[1, h, w, 3] in [0, 1]: smooth colour regions, hard-edged rectangles, mild noise."""
    from comfy_metal.nodes.cli.bench.vae import _bench_image

    return _bench_image(h, w, seed)


@pytest.mark.parametrize("which", ["sd", "flux"])
def test_kl_encode_stages_are_the_encoder(comfyui, sd_vae_with_encoder, flux_vae_with_encoder, which):
    """The codec's encode stages (one per down level, then mid block + norm_out + conv_out + quant_conv +
    the posterior's mode) chain to exactly ComfyUI's first_stage_model.encode."""
    from comfy_metal.nodes import vae as vt
    from comfy_metal.nodes.vae.planner import chain as _chain

    vae = sd_vae_with_encoder if which == "sd" else flux_vae_with_encoder
    codec = vt.codec_from_comfy(vae)
    assert len(codec.encode_stages) == 5 and codec.encode_scales == (2, 4, 8, 8, 8)
    x = vae.process_input(_picture(64, 96).movedim(-1, 1))
    with torch.no_grad():
        assert torch.equal(_chain(codec.encode_stages)(x), vae.first_stage_model.encode(x))


def test_sd_vae_encode_untiled_rest_vs_untiled(comfyui, sd_vae_with_encoder, caplog):
    """On ComfyUI's own VAE object: at half the untiled encode's peak (several tiles), the
    tiles run only the encoder's first level(s) and the rest (the mid block's attention included) runs once
    over the whole image. With shared statistics the latent matches the untiled encode (>= 45 dB, far above
    ComfyUI's VAEEncodeTiled with tiles scaled to the image); feather is not below ComfyUI's. The node
    reports it. With more budget, auto runs the exact stage-by-stage encode."""
    from comfy_metal.nodes import vae as vt
    from comfy_metal.nodes.vae.nodes import EXACT, MetalVAEEncodeTiled

    vae = sd_vae_with_encoder
    pixels = _picture(192, 320)
    with torch.no_grad():
        ref = vae.encode(pixels)                               # [1, 4, 24, 40]
    peak = float(ref.abs().max())
    with torch.inference_mode():
        p_comfy = psnr(vae.encode_tiled(pixels, tile_x=96, tile_y=96, overlap=16), ref, peak=peak)
    x = vae.process_input(pixels.movedim(-1, 1))
    with vt.measure_peak(torch.device("cpu")) as untiled, torch.no_grad():
        vae.first_stage_model.encode(x)
    budget = int(untiled["peak"] * 0.5)
    codec = vt.codec_from_comfy(vae)
    got = {}
    for shared in ("feather", "exact"):
        eng = vt.TiledVAE(codec, vt.TilingOptions(budget_bytes=budget, seam=shared))
        out = eng.encode(x)
        assert out.shape == ref.shape and eng.info.tiles > 1 and eng.info.untiled_rest and not eng.info.over_budget
        assert 1 <= eng.info.tiled_stages < len(codec.encode_stages)
        got[shared] = psnr(out, ref, peak=peak)
    print("ComfyUI tiled", p_comfy, "feather", got["feather"], "exact", got["exact"], "budget", budget / 2**20, "MiB,",
          eng.info.tiles, "tiles,", eng.info.tiled_stages, "stage(s) tiled,", eng.info.passes, "passes")
    assert got["exact"] >= 45.0 and got["exact"] > p_comfy + 10
    assert got["feather"] >= p_comfy - 1.0
    with caplog.at_level("INFO", logger="comfy_metal"):
        (lat,) = MetalVAEEncodeTiled().encode(pixels, vae, memory_budget_gb=budget / 2**30, seam_mode=EXACT)
    assert _tiles_logged(caplog.text) > 1 and "mid block untiled" in caplog.text
    assert psnr(lat["samples"], ref, peak=peak) >= 45.0
    # at 0.8x the untiled peak the down path runs stage by stage over the whole image: the node's default
    # (auto) chooses that exact encode, one pass
    caplog.clear()
    with caplog.at_level("INFO", logger="comfy_metal"):
        (lat,) = MetalVAEEncodeTiled().encode(pixels, vae, memory_budget_gb=untiled["peak"] * 0.8 / 2**30)
    assert "stage by stage" in caplog.text and "auto: exact" in caplog.text, caplog.text[-2000:]
    p_auto = psnr(lat["samples"], ref, peak=peak)
    print("node, auto, stage by stage:", p_auto)
    assert p_auto >= 60.0
