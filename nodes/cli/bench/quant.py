"""Bench section "quant": ComfyUI's comfy_quant block formats (NVFP4, MXFP8, INT8, W4A8, W4A4).

1. Loading: a Flux-shaped model quantized into each format by ComfyUI's own quantizers (comfy.quant_ops),
   loaded by Load Diffusion Model (FP8, Metal) and by ComfyUI's stock loader, each in a fresh subprocess:
   bits a Linear weight as held (packed weights + every scale), load time, peak RSS growth, bytes on the
   compute device (the FP8 section's scripts, nodes/cli/bench/fp8.py).
2. GEMV: each format's fused quant_gemv against dequantise + matmul at M = 1 (the decode step).
"""
from __future__ import annotations

import os
import tempfile
import textwrap

import torch

from ...common.report import Table, human_bytes, median_seconds
from .fp8 import _COMFY_SETUP, _LOAD_OURS, _LOAD_REPORT, _LOAD_STOCK, _PRELUDE, TO_DEVICE, _comfy_path, _run

# The FP8 section's load scripts, reporting bits a weight over the QUANTIZED Linear layers only (ours: a
# quant_shape; stock: a QuantizedTensor weight), packed weights and every scale.
_QUANT_REPORT = textwrap.dedent("""
    n = b = 0
    for mod in m.model.modules():
        w = getattr(mod, "weight", None)
        shape = getattr(mod, "quant_shape", None) or (tuple(w.shape) if type(w).__name__ == "QuantizedTensor" else None)
        if type(mod).__name__ != "Linear" or shape is None:
            continue
        n += shape[0] * shape[1]
        b += sum(t.nbytes for key, t in mod.state_dict().items() if not key.endswith(("bias", "comfy_quant")))
    print(json.dumps({"seconds": p.seconds, "peak": p.grown, "bpw": b / n, "size": m.model_size(),
                      "loaded": m.loaded_size()}))
""")
_LOAD_OURS_Q, _LOAD_STOCK_Q = (s.replace(_LOAD_REPORT, _QUANT_REPORT) for s in (_LOAD_OURS, _LOAD_STOCK))

FORMATS = {  # variant -> (comfy_quant format, layout, from_float kwargs, comfy_quant JSON extras)
    "nvfp4": ("nvfp4", "TensorCoreNVFP4Layout", {}, {}),
    "mxfp8": ("mxfp8", "TensorCoreMXFP8Layout", {}, {}),
    "int8_tensorwise": ("int8_tensorwise", "TensorWiseINT8Layout", {}, {}),
    "asym_w4a8_int8": ("asym_w4a8_int8", "AsymW4A8Int8Layout", {"convrot_groupsize": 256},
                       {"group_size": 16, "convrot_groupsize": 256}),
    "convrot_w4a4": ("convrot_w4a4", "TensorCoreConvRotW4A4Layout", {"convrot_groupsize": 256},
                     {"convrot_groupsize": 256}),
}

# argv: root, comfy, hidden, depth, single, out prefix, formats JSON -> one file per format (ComfyUI's
# serialisation: the layout's state_dict + comfy_quant JSON; input/output projections stay bf16).
_MAKE = _PRELUDE + _COMFY_SETUP + textwrap.dedent("""
    import comfy.ldm.flux.model, comfy.ops, comfy.quant_ops as cq
    from safetensors.torch import save_file
    hidden, depth, single, out, formats = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6], \\
        json.loads(sys.argv[7])
    cfg = dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=4096,
               hidden_size=hidden, mlp_ratio=4.0, num_heads=hidden // 128, depth=depth, depth_single_blocks=single,
               axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True, guidance_embed=False, txt_ids_dims=[])
    net = comfy.ldm.flux.model.Flux(**cfg, dtype=torch.bfloat16, operations=comfy.ops.manual_cast)
    g = torch.Generator().manual_seed(0)
    sd = {k: (torch.randn(v.shape, generator=g) * (v.shape[-1] ** -0.5 if v.dim() > 1 else 0.02)).to(torch.bfloat16)
          for k, v in net.state_dict().items()}
    del net
    keep = ("img_in", "txt_in", "time_in", "vector_in", "final_layer")
    for variant, (fmt, layout, kw, extras) in formats.items():
        out_sd = {}
        for key, t in sd.items():
            if not key.endswith(".weight") or t.dim() != 2 or any(s in key for s in keep) or t.shape[1] % 256:
                out_sd[key] = t
                continue
            qt = cq.QuantizedTensor.from_float(t.float(), layout, **kw)
            out_sd.update({k: v.contiguous() for k, v in qt.state_dict(key).items()})
            out_sd[key[:-7] + ".comfy_quant"] = torch.tensor(list(json.dumps({"format": fmt, **extras}).encode()),
                                                             dtype=torch.uint8)
        save_file(out_sd, f"{out}_{variant}.safetensors")
    print(json.dumps({"ok": True}))
""")


def load_table(quick: bool) -> Table:
    t = Table("comfy_quant loading: bits a quantized weight as held, load time, peak RSS growth during the load",
              ["loader", "format", "file size", "bits/weight", "load s", "peak RSS growth", "on device"])
    comfy = _comfy_path()
    if comfy is None:
        t.note = "ComfyUI is not importable (set COMFYUI_PATH): nothing to compare (the files are ComfyUI's)."
        return t
    import json

    hidden, depth, single = (256, 1, 2) if quick else (1536, 4, 8)
    with tempfile.TemporaryDirectory(prefix="comfy-metal-bench-quant-") as d:
        prefix = os.path.join(d, "flux")
        _run(_MAKE, comfy, hidden, depth, single, prefix, json.dumps(FORMATS), timeout=1800)
        for variant in FORMATS:
            path = f"{prefix}_{variant}.safetensors"
            size = os.path.getsize(path)
            for script, name in ((_LOAD_OURS_Q, "MetalFP8ModelLoader"), (_LOAD_STOCK_Q, "ComfyUI UNETLoader (stock)")):
                try:
                    r = _run(script, comfy, path)
                    t.add(name, variant, human_bytes(size), round(8 * r["bpw"], 3), round(r["seconds"], 3),
                          human_bytes(r["peak"]), f"{human_bytes(r['loaded'])} of {human_bytes(r['size'])}")
                except Exception as e:
                    t.add(name, variant, human_bytes(size), "error", "", str(e)[:60], "")
    t.note = (f"Flux-shaped h{hidden} d{depth}+{single}, bf16 random weights, Linear layers with K % 256 == 0 "
              "quantized by ComfyUI's own quantizers (input/output projections stay bf16). Both rows time: build "
              f"the MODEL from the file, then {TO_DEVICE}. bits/weight: the quantized Linear layers' packed weights "
              "and all their scales, as held (stock: its QuantizedTensor state dicts). peak RSS growth: kernel "
              "high-water mark reset before the load (Linux) or 1 ms RSS sampling.")
    return t


def gemv_table(quick: bool) -> Table:
    from ....metal_kernels import dispatch, quant
    from ....metal_kernels.probe import mps_available

    device = torch.device("mps" if mps_available() else "cpu")
    n, k = (1024, 1024) if quick else (4096, 14336)
    dtype = torch.bfloat16 if device.type != "cpu" else torch.float32
    t = Table(f"comfy_quant Linear {n}x{k} on {device.type}, M = 1: quant_gemv vs dequantise + matmul",
              ["format", "bits/weight", "gemv ms", "dequantize+matmul ms", "gemv / dequantize", "backend"])
    g = torch.Generator().manual_seed(0)
    reps = 3 if quick else 10
    x = torch.randn(1, k, generator=g).to(device, dtype)
    for fmt, variant in (("nvfp4", {}), ("mxfp8", {}), ("int8", {}), ("w4a8", {"group_size": 16}), ("w4a4", {})):
        q, s, s2, cb, kw = quant.random_weight(fmt, n, k, g, **variant)
        q, s, s2, cb = (None if v is None else v.to(device) for v in (q, s, s2, cb))
        bits = 8 * sum(v.nbytes for v in (q, s, s2, cb) if v is not None) / (n * k)
        tg = median_seconds(lambda: quant.quant_gemv(x, q, fmt, s, s2, cb, **kw), device, reps)
        td = median_seconds(lambda: torch.nn.functional.linear(
            x, quant.quant_dequantize(q, fmt, s, s2, cb, out_dtype=dtype, **kw)), device, reps)
        t.add(fmt, round(bits, 3), round(tg * 1e3, 3), round(td * 1e3, 3), f"{tg / td:.2f}x",
              dispatch.last_backend.get("quant_gemv", "?"))
    t.note = ("Random weights with finite scales; the layers use the GEMV for M <= 8 where the measured dispatch "
              "finds it faster on MPS." + ("" if device.type == "mps" else
                                           " (No MPS: these are the pure-torch reference paths.)"))
    return t


def bench(quick: bool = False) -> list[Table]:
    tables = []
    for make in (load_table, gemv_table):
        try:
            tables.append(make(quick))
        except Exception as e:
            tables.append(Table(f"quant bench section {make.__name__} failed", ["error"],
                                [[f"{type(e).__name__}: {e}"]]))
    return tables
