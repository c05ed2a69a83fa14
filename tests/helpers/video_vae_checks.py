"""The video VAEs' stage-by-stage checks shared by tests/vae/test_vae_causal.py (Wan) and test_vae_hunyuan.py: our
run at a budget, the plan of a codec's program, a budget that needs bands, and the exactness / budget / cost-model
check against ComfyUI's untiled run."""
from __future__ import annotations

import torch

from comfy_metal.nodes.common.quality import psnr

CPU = torch.device("cpu")


def run(vae, x, budget, encode=False, seam="exact"):
    """Our run of `x` at `budget` bytes: (output, RunInfo, tracked peak bytes with the output excluded)."""
    from comfy_metal.nodes import vae as vt

    codec = vt.codec_from_comfy(vae)
    eng = vt.TiledVAE(codec, vt.TilingOptions(budget_bytes=int(budget), seam=seam))
    with vt.measure_peak(CPU) as m, torch.no_grad():
        out = eng.encode(x) if encode else eng.decode(x)
    return out, eng.info, m["peak"] - out.numel() * out.element_size()


def runner(vae, encode, workspace=1.0):
    """The runner of the codec's decode or encode program (its plan and run)."""
    from comfy_metal.nodes import vae as vt

    codec = vt.codec_from_comfy(vae)
    prog = codec.encode_program if encode else codec.decode_program
    assert prog is not None, codec.programs_note
    return prog.runner(codec.device, codec.dtype, workspace)


def full_plan(vae, x, encode=False):
    """The stage plan at an unlimited budget (whole-frame bands) and the codec's program."""
    r = runner(vae, encode)
    return r.plan(tuple(x.shape), 1 << 50), r.prog


def banded_budget(vae, x, encode, store=torch.float32):
    """(budget, plan, program): the largest budget under the unbanded plan whose plan has bands (halo rows: more
    predicted work) and buffers in `store`."""
    from comfy_metal.nodes.vae.planner import CPU_WORKSPACE_FACTOR, HEADROOM

    full, prog = full_plan(vae, x, encode)
    r = runner(vae, encode, CPU_WORKSPACE_FACTOR)
    for share in (0.8, 0.65, 0.5, 0.4, 0.3, 0.2, 0.15, 0.1):
        budget = int(full.peak * CPU_WORKSPACE_FACTOR * share / HEADROOM)
        p = r.plan(tuple(x.shape), budget * HEADROOM)
        if p is not None and p.store_dtype == store and p.work > full.work:
            return budget, p, prog
    raise AssertionError(f"no banded plan with {store} buffers")


def check_exact(vae, x, ref, encode, store=torch.float32):
    """Stage by stage at a budget that needs bands: exact to fp32 rounding against ComfyUI's untiled run (fp32
    buffers; fp16 ones: >= 60 dB), the measured peak within the budget and within 15% of the plan's prediction
    (in the tracked bytes it predicts; its budget figure adds the CPU's convolution workspace), and the budget
    used (the plan's peak at least 80% of it)."""
    budget, plan, prog = banded_budget(vae, x, encode, store)
    out, info, peak = run(vae, x, budget, encode)
    assert info.scheme == "stages" and info.mode == "exact (stage by stage)", info
    assert info.expected_peak == plan.peak, info          # this plan
    assert out.shape == ref.shape
    scale = float(ref.abs().max())
    print(f"{'encode' if encode else 'decode'} {tuple(x.shape)}: {info.bands} bands, measured {peak / 2**20:.2f} MiB, "
          f"predicted {plan.tracked / 2**20:.2f} MiB tracked ({plan.peak / 2**20:.2f} with the CPU workspace), "
          f"budget {budget / 2**20:.2f} MiB, buffers {plan.store_dtype}, max diff {float((out - ref).abs().max()):.2e}")
    if store == torch.float32:
        torch.testing.assert_close(out, ref.float(), atol=2e-5 * max(1.0, scale), rtol=0)
    else:
        assert psnr(out, ref.float(), peak=2 * scale) >= 60
    assert peak <= budget
    assert abs(peak / plan.tracked - 1) <= 0.15, (peak, plan.tracked)
    assert plan.peak >= 0.8 * budget
    return out, info
