"""Memory bounds of the tiled VAE decode (CPU, measured, no timing).

* Peak resident memory of a decode within the requested budget (plus weights, already resident, and the
  output), measured in a fresh subprocess with the kernel's peak-RSS counter (VmHWM, reset through
  /proc/self/clear_refs), while an untiled decode of the same latent needs at least 4x more.
* A 21-frame video latent decodes with the same peak (live tensor bytes, output excluded) as a 5-frame one.
* The cost model's peak of the plan that ran is within +-15% of the measured peak, decode and encode.
"""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

diffusers = pytest.importorskip("diffusers", reason="diffusers is needed for the reference VAEs")

ROOT = pathlib.Path(__file__).resolve().parents[2]

SCRIPT = r"""
import json, sys, gc
sys.path.insert(0, sys.argv[1])
import conftest  # maps the repo to comfy_metal
import torch
from diffusers import AutoencoderKL
from comfy_metal.nodes import vae as vt
from comfy_metal.nodes.common.memory import proc_status_bytes as rss, reset_peak_rss

torch.manual_seed(0)
torch.set_num_threads(1)
vae = AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                    block_out_channels=(32, 64, 64, 64), layers_per_block=1, norm_num_groups=16).eval()
z = torch.randn(1, 4, 64, 64)
mode, budget = sys.argv[2], int(sys.argv[3])
with torch.inference_mode():
    # warm up kernels/allocator paths on a tiny input so one-time costs are not counted
    vae.decode(torch.randn(1, 4, 8, 8))
    vt.TiledVAE(vt.codec_from_diffusers(vae), vt.TilingOptions(tile=8, calibrate=False)).decode(torch.randn(1, 4, 8, 8))
gc.collect()
assert reset_peak_rss()
base = rss("VmRSS")
with torch.inference_mode():
    if mode == "untiled":
        out = vae.decode(z).sample
        info = {}
    else:
        eng = vt.TiledVAE(vt.codec_from_diffusers(vae), vt.TilingOptions(budget_bytes=budget))
        out = eng.decode(z)
        info = {"tile": eng.info.tile, "tiles": eng.info.tiles, "calibration": eng.info.calibration}
peak = rss("VmHWM") - base
print(json.dumps({"peak": peak, "out_bytes": out.numel() * out.element_size(), "info": info}))
"""


def _run(mode, budget=0):
    if not pathlib.Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc/self/clear_refs to measure peak RSS")
    env = dict(os.environ, OMP_NUM_THREADS="1", MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="65536")
    script = pathlib.Path(os.environ.get("TMPDIR", "/tmp")) / f"comfy_metal_vae_mem_{os.getpid()}.py"
    script.write_text(SCRIPT)
    try:
        res = subprocess.run([sys.executable, str(script), str(ROOT / "tests"), mode, str(budget)],
                             capture_output=True, text=True, timeout=300, env=env)
    finally:
        script.unlink(missing_ok=True)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_peak_memory_within_budget_and_untiled_needs_4x():
    budget = 48 << 20
    tiled = _run("tiled", budget)
    untiled = _run("untiled")
    print("tiled", tiled, "untiled", untiled)
    assert tiled["info"]["tiles"] > 1
    # peak <= budget + output (the weights were resident before the measurement started)
    assert tiled["peak"] <= budget + tiled["out_bytes"], tiled
    assert untiled["peak"] >= 4 * tiled["peak"], (untiled["peak"], tiled["peak"])


def test_video_peak_is_flat_in_frames():
    from comfy_metal.nodes import vae as vt

    torch.manual_seed(0)
    vae = diffusers.AutoencoderKLWan(base_dim=8, z_dim=4, dim_mult=[1, 2, 2, 2], num_res_blocks=1,
                                     latents_mean=[0.0] * 4, latents_std=[1.0] * 4).eval()
    codec = vt.codec_from_diffusers(vae)
    peaks = {}
    for frames in (5, 21):
        z = torch.randn(1, 4, frames, 8, 8)
        eng = vt.TiledVAE(codec, vt.TilingOptions(tile=6, overlap=2, calibrate=False))
        with vt.measure_peak(torch.device("cpu")) as m:
            out = eng.decode(z)
        assert out.shape == (1, 3, 1 + 4 * (frames - 1), 64, 64)
        peaks[frames] = m["peak"] - out.numel() * 4      # the accumulator is the output
    print(peaks)
    assert abs(peaks[21] - peaks[5]) <= 0.10 * peaks[5], peaks


@pytest.mark.parametrize("widths", [(32, 64, 64, 64), (64, 128, 128, 128)])
def test_cost_model_predicts_the_measured_peak(widths):
    """The cost model's peak of the plan that ran (RunInfo.expected_peak: the largest tile's
    forward, the whole-image mid output, the untiled mid block) is within +-15% of the measured peak of
    the whole decode (live tensor bytes, calibration and mid block included, the output accumulator
    excluded as the budget excludes it), at several budgets and two VAE widths; and it uses the budget:
    the tile peak fills at least half of it."""
    from comfy_metal.nodes import vae as vt
    from comfy_metal.nodes.vae.planner import CPU_WORKSPACE_FACTOR

    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4,
                                  up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=widths,
                                  layers_per_block=1, norm_num_groups=16).eval()
    z = torch.randn(1, 4, 40, 56)
    for budget in (16 << 20, 40 << 20):
        eng = vt.TiledVAE(vt.codec_from_diffusers(vae), vt.TilingOptions(budget_bytes=budget))
        with vt.measure_peak(torch.device("cpu")) as m, torch.no_grad():
            out = eng.decode(z)
        measured = m["peak"] - out.numel() * out.element_size()
        predicted = eng.info.expected_peak / CPU_WORKSPACE_FACTOR     # the model in tracked bytes
        print(widths, budget >> 20, "MiB:", eng.info.tiles, "tiles", eng.info.tile_shape, "predicted",
              predicted / 2**20, "measured", measured / 2**20)
        assert eng.info.tiles > 1 and not eng.info.over_budget
        assert abs(measured / predicted - 1) <= 0.15, (measured, predicted)
        assert eng.info.expected_peak >= budget * 0.5


@pytest.mark.parametrize("widths", [(32, 64, 64, 64), (64, 128, 128, 128)])
def test_encode_cost_model_predicts_the_measured_peak(widths):
    """Encode: the tiles run the encoder's body (conv_in, down blocks) blended at latent
    resolution, and its tail (mid block with attention, norm_out, conv_out, quant_conv) runs once over the
    whole latent grid. RunInfo.expected_peak (the largest body tile + the blended body output held across
    the tiles, or the tail with its input) is within +-15% of the measured peak of the whole encode (the
    latent output excluded), at two budgets and two widths, and the plan uses the budget (at least half)."""
    from comfy_metal.nodes import vae as vt
    from comfy_metal.nodes.vae.planner import CPU_WORKSPACE_FACTOR

    torch.manual_seed(0)
    vae = diffusers.AutoencoderKL(down_block_types=("DownEncoderBlock2D",) * 4,
                                  up_block_types=("UpDecoderBlock2D",) * 4, block_out_channels=widths,
                                  layers_per_block=1, norm_num_groups=16).eval()
    x = torch.rand(1, 3, 320, 448) * 2 - 1
    for budget in (24 << 20, 64 << 20):
        eng = vt.TiledVAE(vt.codec_from_diffusers(vae), vt.TilingOptions(budget_bytes=budget))
        with vt.measure_peak(torch.device("cpu")) as m, torch.no_grad():
            out = eng.encode(x)
        measured = m["peak"] - out.numel() * out.element_size()
        predicted = eng.info.expected_peak / CPU_WORKSPACE_FACTOR     # the model in tracked bytes
        print(widths, budget >> 20, "MiB:", eng.info.tiles, "tiles", eng.info.tile_shape, "predicted",
              predicted / 2**20, "measured", measured / 2**20)
        assert eng.info.tiles > 1 and eng.info.untiled_rest and not eng.info.over_budget
        assert abs(measured / predicted - 1) <= 0.15, (measured, predicted)
        assert eng.info.expected_peak >= budget * 0.5
