"""bench section "attention": the pack's attention against ComfyUI's attention functions at the shapes of
real diffusion models (random inputs of the real sizes).

Cases: Flux 1024² (4096 image + 512 text tokens, 24 heads, D 128, bf16), SDXL 1024² (its largest
attention, 4096 tokens, 10 heads, D 64, fp16) and Wan 2.2 480p with 81 frames (21 x 30 x 52 = 32,760
tokens, 40 heads, D 128, bf16). Rows: the pack's attention (Metal on MPS; on CPU/CUDA its chunked
pure-torch reference, labelled so), ComfyUI's MPS default `attention_sub_quad`, and PyTorch SDPA
(ComfyUI's `attention_pytorch`). Columns: median time, peak bytes of live tensors allocated during one
call, max error against a float64 oracle on a slice (the first heads x query rows; the full key
length), and time ratios to sub-quad and SDPA (> 1 = slower than that path). On MPS also TFLOP/s.
On a machine without MPS the sizes are reduced (fewer heads, shorter Wan) so the section finishes in
a minute or two; the table says so. ComfyUI's functions need ComfyUI importable (COMFYUI_PATH).
"""
from __future__ import annotations

import math

import torch

from ...common.comfyui import import_comfy
from ...common.report import Table, bench_device, human_bytes, median_seconds
from ...vae.memory import measure_peak

# (name, batch, heads, tokens, head dim, dtype) at full size; CPU: (heads, tokens) reduced
CASES = [("Flux 1024² (4096+512 tok)", 1, 24, 4608, 128, torch.bfloat16),
         ("SDXL 1024² (4096 tok)", 1, 10, 4096, 64, torch.float16),
         ("Wan 2.2 480p 81 frames (32760 tok)", 1, 40, 32760, 128, torch.bfloat16)]
CPU_REDUCED = {"Flux 1024² (4096+512 tok)": (2, 4608), "SDXL 1024² (4096 tok)": (2, 4096),
               "Wan 2.2 480p 81 frames (32760 tok)": (1, 8192)}
QUICK_TOKENS = 1024
ORACLE_HEADS, ORACLE_ROWS = 2, 64
MPS_SDPA_MAX_SCORE_BYTES = 4 << 30


def _comfy_attention():
    """comfy.ldm.modules.attention when ComfyUI is importable, else the reason (a str)."""
    module, why = import_comfy("comfy.ldm.modules.attention")
    return module if module is not None else why


def _oracle_error(out, q, k, v) -> float:
    """Max |out - float64 attention| over the first ORACLE_HEADS heads x ORACLE_ROWS query rows."""
    h, r = min(ORACLE_HEADS, q.shape[1]), min(ORACLE_ROWS, q.shape[2])
    qs = q[:, :h, :r].double().cpu()
    ks, vs = k[:, :h].double().cpu(), v[:, :h].double().cpu()
    p = torch.softmax(qs @ ks.transpose(-1, -2) / math.sqrt(q.shape[-1]), dim=-1)
    want = p @ vs
    return (out[:, :h, :r].double().cpu() - want).abs().max().item()


def _case_table(name, B, H, L, D, dtype, device, attention, reps):
    from ....metal_kernels import attention as kernels
    from ....metal_kernels import dispatch

    on_mps = device.type == "mps"
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, L, D, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
    flops = 4.0 * B * H * L * L * D
    rows = []
    if on_mps:
        spec = dispatch.REGISTRY["flash_attention"]
        backend, reason = dispatch.choose(spec, device)
        if backend == "metal":
            lib = dispatch._library_for(spec, "metal")
            rows.append(("metal_flash (mma kernel)", lambda: kernels.flash_attention_metal(lib, q, k, v, variant="mma")))
        else:
            rows.append((f"metal_flash unavailable: {reason[:60]}", None))
    else:
        rows.append((f"metal_flash reference ({device.type.upper()}, no Metal)",
                     lambda: kernels.flash_attention_reference(q, k, v)))
    if isinstance(attention, str):
        rows.append((f"sub_quad: {attention}", None))
        rows.append((f"SDPA: {attention}", None))
    else:
        rows.append(("ComfyUI sub_quad (MPS default)", lambda: attention.attention_sub_quad(
            q, k, v, H, skip_reshape=True, skip_output_reshape=True)))
        score_bytes = 4 * B * H * L * L
        if on_mps and score_bytes > MPS_SDPA_MAX_SCORE_BYTES:
            # MPS SDPA builds the whole fp32 score matrix; past 4 GiB buffers crash the process (pytorch #149325)
            rows.append((f"SDPA skipped: its {human_bytes(score_bytes)} score matrix", None))
        else:
            rows.append(("ComfyUI attention_pytorch (SDPA)", lambda: attention.attention_pytorch(
                q, k, v, H, skip_reshape=True, skip_output_reshape=True)))
    measured = []
    for label, fn in rows:
        if fn is None:
            measured.append((label, None, None, None))
            continue
        try:
            with measure_peak(device) as m:
                out = fn()
            err = _oracle_error(out, q, k, v)
            del out
            seconds = median_seconds(fn, device, repeat=reps, warmup=0)
            measured.append((label, seconds, m["peak"], err))
        except Exception as e:  # an OOM or a missing op is a row, not a crashed bench
            measured.append((f"{label}: {type(e).__name__}: {str(e)[:50]}", None, None, None))
    base = {i: measured[i][1] for i in (-2, -1)}      # ComfyUI's sub_quad and SDPA rows
    title = f"Attention: {name}, {str(dtype).replace('torch.', '')}, B{B} H{H} L{L} D{D}"
    columns = ["path", "ms", "peak", "max err vs fp64", "time / sub_quad", "time / SDPA"]
    if on_mps:
        columns.append("TFLOP/s")
    table = Table(title, columns)
    for label, seconds, peak, err in measured:
        if seconds is None:
            table.add(label, "n/a", "n/a", "n/a", "", "", *([""] if on_mps else []))
            continue
        ratios = [f"{seconds / base[i]:.2f}x" if base.get(i) else "n/a" for i in (-2, -1)]
        row = [label, round(seconds * 1e3, 2), human_bytes(peak), f"{err:.2e}", *ratios]
        if on_mps:
            row.append(f"{flops / seconds / 1e12:.2f}")
        table.add(*row)
    return table


def bench(quick: bool = False) -> list[Table]:
    device = bench_device()
    attention = _comfy_attention()
    reps = 2 if quick or device.type == "cpu" else 5
    tables = []
    for name, B, H, L, D, dtype in CASES:
        note = ""
        if device.type != "mps":
            H, L = CPU_REDUCED[name]
            note = f"reduced on {device.type.upper()} to {H} heads x {L} tokens"
        if quick:
            L = min(L, QUICK_TOKENS)
            note = (note + "; " if note else "") + f"--quick: {L} tokens"
        t = _case_table(name, B, H, L, D, dtype, device, attention, reps)
        t.note = ((note + ". ") if note else "") + (
            f"Device {device.type.upper()}. peak = live tensor bytes allocated during one call (inputs excluded); "
            f"error over {ORACLE_HEADS} heads x {ORACLE_ROWS} query rows against float64; time ratios > 1 = "
            f"slower than that path." + ("" if device.type == "mps" else
                                        " No MPS: the pack's row is its pure-torch reference, not Metal."))
        tables.append(t)
    return tables
