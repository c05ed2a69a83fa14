"""Exact low-memory decode: the stage-by-stage decode (nodes/vae/stagewise.py) against the
untiled decode, the lock-step shared statistics' invariants (cache limit, halo, the planner's fallback),
seam mode auto's choice from the planner's predicted costs, and what the node reports. Small diffusers
AutoencoderKL decoders with random weights; the untiled decode of the same model is the oracle."""
from __future__ import annotations

import dataclasses
import logging
import types

import pytest
import torch
import torch.nn.functional as F

from comfy_metal.nodes import vae as vt
from comfy_metal.nodes.common.quality import psnr as psnr_db
from comfy_metal.nodes.vae import planner, stagewise


def img_psnr(a, b):
    return psnr_db((a.clamp(-1, 1) + 1) / 2, (b.clamp(-1, 1) + 1) / 2, 1.0)


@pytest.fixture(scope="module")
def kl():
    """A KL VAE with SD's layout (4 levels, 2 ResNet blocks a level in the decoder's 3, channel changes
    between levels, mid-block attention), narrow; its untiled decode of a non-square latent."""
    diffusers = pytest.importorskip("diffusers")
    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4,
                                  up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=(16, 32, 64, 64),
                                  layers_per_block=2, norm_num_groups=8, latent_channels=4).eval()
    torch.manual_seed(1)
    z = torch.randn(1, 4, 20, 36)
    with torch.inference_mode():
        ref = vae.decode(z).sample
    return vae, vt.codec_from_diffusers(vae), z, ref


def _head(codec, z):
    with torch.no_grad():
        return codec.decode_head(z)


def test_stages_are_the_decoders_chain(kl):
    vae, codec, z, ref = kl
    kinds = [s.kind for s in codec.decode_stages]
    assert kinds == (["resnet"] * 3 + ["upsample"]) * 3 + ["resnet"] * 3 + ["out"]


def test_stagewise_decode_equals_untiled(kl):
    """fp32 buffers: the untiled decode up to float rounding (statistics combined in float64, each
    convolution over its rows plus a one-row halo); fp16 buffers at a budget that needs them, in many
    bands: the same within fp16 rounding of the stored activations (>= 60 dB)."""
    vae, codec, z, ref = kl
    h = _head(codec, z)
    sw = stagewise.StagewiseDecode(codec.decode_stages, "cpu", torch.float32)
    roomy = sw.plan(tuple(h.shape), 1 << 34)
    assert roomy.store_dtype == torch.float32 and roomy.rows[0] == h.shape[-2]
    with torch.no_grad():
        out = sw.run(h.clone(), dataclasses.replace(roomy, rows=[3] * len(roomy.rows)), "cpu")   # 3-row bands
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    tight = sw.plan(tuple(h.shape), roomy.peak // 3)
    assert tight is not None and tight.store_dtype == torch.float16
    assert any(r < ci[1] for r, (_, ci, _) in zip(tight.rows, sw._shapes(tuple(h.shape))))   # several bands
    assert tight.peak <= roomy.peak // 3
    with torch.no_grad():
        half = sw.run(h.clone(), tight, "cpu")
    print("stage-wise fp16 buffers PSNR", img_psnr(half, ref), "rows", tight.rows)
    assert img_psnr(half, ref) >= 60
    assert sw.plan(tuple(h.shape), tight.peak // 20) is None        # does not fit: None, never over


def test_fp16_buffer_turns_bf16_when_out_of_range():
    buf = stagewise._Buffer((1, 2, 6, 3), torch.float16, "cpu")
    a = torch.full((1, 2, 2, 3), 1.5)
    buf.write(0, 2, a)
    buf.write(2, 4, torch.full((1, 2, 2, 3), 1e6))
    buf.write(4, 6, a)
    assert buf.t.dtype == torch.bfloat16
    assert torch.equal(buf.t[..., :2, :].float(), a) and torch.equal(buf.t[..., 4:, :].float(), a)
    assert float(buf.t[..., 2:4, :].float().min()) == pytest.approx(1e6, rel=1e-2)


def test_fp16_to_bf16_switch_in_an_in_place_stage():
    """An in-place ResNet stage (same width, no shortcut) writes into its input buffer: when a band's output
    leaves fp16's range, the rows not yet read must turn bf16 too, or later bands read fp16 bytes as bf16."""
    import torch.nn as nn

    torch.manual_seed(0)
    c = 16

    def resnet():
        return stagewise.ResnetStage(nn.GroupNorm(4, c), nn.Conv2d(c, c, 3, padding=1), nn.GroupNorm(4, c),
                                     nn.Conv2d(c, c, 3, padding=1), None, F.silu)

    stages = [resnet(), resnet(), stagewise.OutStage(nn.GroupNorm(4, c), F.silu, nn.Conv2d(c, 3, 3, padding=1))]
    h = torch.randn(1, c, 24, 20) * 3000
    with torch.no_grad():
        stages[1].conv2.weight.mul_(1e5)               # the second stage's output passes 60000
        want = h
        for s in stages[:2]:
            want = want + s.conv2(s.act(s.norm2(s.conv1(s.act(s.norm1(want))))))
        want = stages[2].conv(stages[2].act(stages[2].norm(want)))
        got = stagewise.StagewiseDecode(stages, "cpu", torch.float32).run(
            h, stagewise.StagePlan(torch.float16, [6, 6, 6], 0, 1.0), torch.device("cpu"))
    err = ((got - want).abs().max() / want.abs().max()).item()
    assert err < 0.05, err                            # bf16 rounding; fp16 bytes read as bf16 give ~1.0


def test_budget_decode_runs_stagewise_within_the_budget(kl):
    """Exact at a budget well under the untiled decode's peak: one pass stage by stage, the measured
    peak within the budget (the output image on top) and near the plan's prediction."""
    vae, codec, z, ref = kl
    cpu = torch.device("cpu")
    with vt.measure_peak(cpu) as untiled, torch.inference_mode():
        vae.decode(z)
    budget = untiled["peak"] // 2
    eng = vt.TiledVAE(codec, vt.TilingOptions(budget_bytes=budget, seam="exact"))
    with vt.measure_peak(cpu) as m, torch.inference_mode():
        out = eng.decode(z)
    info = eng.info
    assert info.scheme == "stages" and info.shared_stats and info.passes == 1 and info.untiled_head
    assert info.mode == "exact (shared statistics)"
    p = img_psnr(out, ref)
    print("stage-wise at half the untiled peak:", p, "dB; peak", m["peak"], "predicted", info.expected_peak,
          "budget", budget)
    assert p >= 60
    assert m["peak"] <= budget + out.numel() * 4
    assert 0.5 * info.expected_peak <= m["peak"] <= 1.15 * info.expected_peak + out.numel() * 4


# ---------------------------------------------------------------- lock-step shared statistics (no stages)


def _lockstep_codec(codec):
    return dataclasses.replace(codec, decode_stages=None)


def test_lockstep_output_does_not_depend_on_the_cache_limit(kl):
    """Invariant: which blocks the cache holds changes the work, never the pixels (fp32 cache): the whole
    plan cached, a cache too small for one block per tile, and no cache give the same output."""
    vae, codec, z, ref = kl
    codec = _lockstep_codec(codec)
    opts = dict(tile=24, overlap=12, seam="exact", stats_cache_half=False)
    full = vt.TiledVAE(codec, vt.TilingOptions(**opts, stats_cache_bytes=1 << 40))
    want = full.decode(z)
    assert full.info.tiles > 1 and full.info.scheme == "tiles"
    tiny = vt.TiledVAE(codec, vt.TilingOptions(**opts, stats_cache_bytes=full.info.stats_cache_peak // 8))
    torch.testing.assert_close(tiny.decode(z), want, atol=1e-5, rtol=0)
    assert tiny.info.blocks_computed > full.info.blocks_computed
    none = vt.TiledVAE(codec, vt.TilingOptions(**opts, stats_cache=False))
    torch.testing.assert_close(none.decode(z), want, atol=1e-5, rtol=0)


def test_lockstep_with_the_exact_overlap_matches_untiled(kl):
    """With an overlap of EXACT_OVERLAP (the default in exact mode, not feather's 3/8 of the tile) the
    feathered cores lie a quarter of it, 4 latent px, inside each tile; the up path's theoretical reach is
    ~12 px but its effective reach decays fast (each ResNet block adds its input back), so the
    remaining error is far under fp16 rounding of the cache: >= 60 dB. Feather's own overlap at the
    same tiles is visibly worse."""
    vae, codec, z, ref = kl
    codec = _lockstep_codec(codec)
    eng = vt.TiledVAE(codec, vt.TilingOptions(tile=32, seam="exact"))
    p = img_psnr(eng.decode(z), ref)
    assert eng.info.overlap == planner.EXACT_OVERLAP and eng.info.tiles > 1
    small = vt.TiledVAE(codec, vt.TilingOptions(tile=32, overlap=vt.default_overlap(8), seam="exact"))
    q = img_psnr(small.decode(z), ref)
    print("lock-step exact overlap", p, "dB; overlap", small.info.overlap, q, "dB")
    assert p >= 60 and p > q


def test_lockstep_planner_fallback_is_still_exact(kl, monkeypatch, caplog):
    """`_plan_shared`'s fallback (the whole plan's cache does not fit: later passes recompute blocks)
    keeps the exact overlap, so it gives the cached plan's quality. The planner's inputs are fixed (cost
    model 1000 bytes a latent px, a cache too large for any plan, the head always fitting) so the
    fallback runs with tiles of 54 px, two of them."""
    vae, codec, _, _ = kl
    codec = _lockstep_codec(codec)
    torch.manual_seed(4)
    z = torch.randn(1, 4, 20, 72)
    with torch.inference_mode():
        ref = vae.decode(z).sample

    def calibrate(self, fn, sample, encode=False, budget=None):
        return {"points": [], "a": 0.0, "b": 1000.0}

    monkeypatch.setattr(planner.Planner, "calibrate", calibrate)
    monkeypatch.setattr(planner.Planner, "peak_of_area", lambda self, x, fn, area=None, unit=1: 0)
    monkeypatch.setattr(planner.Planner, "cache_bytes_per_px", lambda self, fn, x, encode: 1e12)
    head_bytes = 20 * 72 * 64 * 4
    eng = vt.TiledVAE(codec, vt.TilingOptions(budget_bytes=(1 << 20) + head_bytes, seam="exact"))
    with caplog.at_level(logging.WARNING, logger="comfy_metal"):
        out = eng.decode(z)
    assert "does not fit" in caplog.text and "not exact" not in caplog.text
    assert eng.info.shared_stats and eng.info.untiled_head and eng.info.tiles == 2
    assert eng.info.overlap == planner.EXACT_OVERLAP
    p = img_psnr(out, ref)
    print("lock-step fallback plan PSNR", p, "tile", eng.info.tile_shape)
    assert p >= 60


# ---------------------------------------------------------------- seam mode auto


@pytest.fixture
def small(kl):
    vae, codec, _, _ = kl
    torch.manual_seed(3)
    return codec, torch.randn(1, 4, 12, 20)


def _auto(codec, z, monkeypatch, exact_work, feather_work, feather_tile=8, fits=True, comfy_work=3.0):
    real_plan = stagewise.StagewiseDecode.plan

    def plan(self, shape, budget):
        p = real_plan(self, shape, 1 << 34)
        return dataclasses.replace(p, work=exact_work) if fits else None

    monkeypatch.setattr(stagewise.StagewiseDecode, "plan", plan)
    monkeypatch.setattr(planner.Planner, "tile_for_budget",
                        lambda self, p, fn, x, budget, h, w, encode=False: feather_tile)
    monkeypatch.setattr(planner.Planner, "feather_work", lambda self, tile, h, w, exact=False: feather_work)
    monkeypatch.setattr(planner, "comfy_tiled_work", lambda codec, shape, encode: comfy_work)
    eng = vt.TiledVAE(codec, vt.TilingOptions(budget_bytes=1 << 30, seam="auto"))
    eng.decode(z)
    return eng.info


def test_auto_picks_exact_unless_slower_than_comfyui_tiled(small, monkeypatch):
    """Exact whenever it fits and is not predicted slower than ComfyUI's tiled decode, even when feather's tiles
    would be faster (the Flux-width case at ComfyUI's tiled peak: feather scores below ComfyUI)."""
    codec, z = small
    info = _auto(codec, z, monkeypatch, exact_work=2.5, feather_work=1.0, comfy_work=3.0)
    assert info.scheme == "stages" and info.mode == "exact (shared statistics)" and info.auto.startswith("auto: exact")
    assert "ComfyUI tiled 3.00" in info.auto


def test_auto_picks_exact_when_faster_than_feather(small, monkeypatch):
    codec, z = small
    info = _auto(codec, z, monkeypatch, exact_work=1.2, feather_work=1.3, comfy_work=1.0)
    assert info.scheme == "stages" and info.auto.startswith("auto: exact")


def test_auto_picks_feather_when_exact_is_slower_than_comfyui_and_feather(small, monkeypatch):
    codec, z = small
    info = _auto(codec, z, monkeypatch, exact_work=3.5, feather_work=1.0, comfy_work=3.0)
    assert info.scheme == "tiles" and info.mode.startswith("feather, overlap") and info.tile == 8
    assert info.auto.startswith("auto: feather") and "3.50 passes" in info.auto


def test_auto_picks_feather_when_exact_does_not_fit(small, monkeypatch):
    codec, z = small
    info = _auto(codec, z, monkeypatch, exact_work=1.0, feather_work=2.0, fits=False)
    assert info.mode.startswith("feather") and "does not fit" in info.auto


def test_auto_one_tile_is_exact_already(small, monkeypatch):
    codec, z = small
    info = _auto(codec, z, monkeypatch, exact_work=1.1, feather_work=1.0, feather_tile=64)
    assert info.tiles == 1 and info.mode == "exact (one tile)" and "exact already" in info.auto


def test_feather_and_exact_modes_are_not_overridden_by_auto(small):
    codec, z = small
    eng = vt.TiledVAE(codec, vt.TilingOptions(budget_bytes=1 << 30, tile=8))
    eng.decode(z)
    assert eng.info.auto == "" and eng.info.mode.startswith("feather")


def test_node_reports_the_mode_in_its_log_line_and_badge(kl, caplog):
    """The decode node defaults to auto; its log line and its badge record name the mode that ran and
    why auto chose it; saved workflows' seam_mode strings stay valid."""
    from comfy_metal.nodes import status
    from comfy_metal.nodes.vae.nodes import AUTO, EXACT, FEATHER, SEAM_MODES, MetalVAEDecodeTiled

    assert SEAM_MODES == [AUTO, FEATHER, EXACT] == ["auto", "feather", "exact"]
    choices, opts = MetalVAEDecodeTiled.INPUT_TYPES()["required"]["seam_mode"]
    assert choices == SEAM_MODES and opts["default"] == AUTO and "ComfyUI's own tiled decode" in opts["tooltip"]
    vae_model, codec, z, ref = kl
    vae = types.SimpleNamespace(first_stage_model=vae_model, latent_dim=2, latent_channels=4, device="cpu",
                                vae_dtype=torch.float32, output_device=torch.device("cpu"),
                                spacial_compression_decode=lambda: 8,
                                process_output=lambda im: im.add_(1.0).div_(2.0).clamp_(0.0, 1.0))
    _, index = status.records_since(0)
    with caplog.at_level(logging.INFO, logger="comfy_metal"):
        (images,) = MetalVAEDecodeTiled().decode({"samples": z}, vae, memory_budget_gb=0.02)
    line = [r.getMessage() for r in caplog.records if "VAE decode (" in r.getMessage()][-1]
    records, _ = status.records_since(index)
    note = records[-1].get("note", "")
    print(line, "|", note)
    assert "quality vs untiled: " in line and "; auto: " in line
    assert note.startswith("auto: ") and (note.endswith("exact (shared statistics)") or "feather, overlap" in note)
    if "exact" in note:
        assert "stage by stage" in line
        assert img_psnr(images.movedim(-1, 1) * 2 - 1, ref) >= 60
    (images,) = MetalVAEDecodeTiled().decode({"samples": z}, vae, memory_budget_gb=0.02, seam_mode=FEATHER)
    records, _ = status.records_since(index)
    assert records[-1]["note"].startswith("feather, overlap") or records[-1]["note"] == "exact (one tile)"


def test_saved_workflows_old_seam_mode_names_still_run(kl):
    """A workflow saved when exact was called "feather + shared statistics" passes ComfyUI's input check (the
    nodes' VALIDATE_INPUTS, which replaces the combo check for seam_mode) and runs exact; a name that never
    existed is refused there with the list of modes."""
    from comfy_metal.nodes.vae.nodes import LEGACY_SEAM_MODES, MetalVAEDecodeTiled, MetalVAEEncodeTiled, seam_mode

    assert LEGACY_SEAM_MODES == {"feather + shared statistics": "exact"}
    for node in (MetalVAEDecodeTiled, MetalVAEEncodeTiled):
        assert node.VALIDATE_INPUTS(seam_mode="feather + shared statistics") is True
        assert node.VALIDATE_INPUTS(seam_mode="auto") is True
        assert "must be one of" in node.VALIDATE_INPUTS(seam_mode="sharp")
    assert seam_mode("feather + shared statistics") == "exact" and seam_mode("feather") == "feather"
    with pytest.raises(ValueError, match="must be one of"):
        seam_mode("sharp")
    vae_model, codec, z, ref = kl
    vae = types.SimpleNamespace(first_stage_model=vae_model, latent_dim=2, latent_channels=4, device="cpu",
                                vae_dtype=torch.float32, output_device=torch.device("cpu"),
                                spacial_compression_decode=lambda: 8,
                                process_output=lambda im: im.add_(1.0).div_(2.0).clamp_(0.0, 1.0))
    old = MetalVAEDecodeTiled().decode({"samples": z}, vae, memory_budget_gb=0.02,
                                       seam_mode="feather + shared statistics")[0]
    new = MetalVAEDecodeTiled().decode({"samples": z}, vae, memory_budget_gb=0.02, seam_mode="exact")[0]
    assert torch.equal(old, new)
