"""Bench section "GGUF" (`python -m comfy_metal bench --only gguf`): bytes a weight per quant type, load
time and peak memory of GGUF files against an FP8 and a bf16 file of the same model, and the time of one
Linear layer (dequantise + matmul, or the fused GEMV for M <= 8) against the pure-torch reference.

Loads run in fresh subprocesses with the FP8 bench's peak-RSS probe; ComfyUI is used when importable
($COMFYUI_PATH or on sys.path), otherwise the load table says so.
"""
from __future__ import annotations

import os
import tempfile
import textwrap

import torch

from ...common.report import Table, human_bytes, median_seconds
from .fp8 import _COMFY_SETUP, _MAKE_FLUX, _PRELUDE, TO_DEVICE, _comfy_path, _run
from .moe import copy_bandwidth



def _device() -> torch.device:
    from ....metal_kernels.probe import mps_available

    return torch.device("mps" if mps_available() else "cpu")


def bytes_table(quick: bool) -> Table:
    """Bytes a weight as held by a loaded layer (the block bytes over the logical weights)."""
    from .... import metal_kernels as mk
    from ....metal_kernels.gguf import random_blocks
    from ...gguf.ops import GGUFTensor, make_gguf_ops, weight_bytes

    ops = make_gguf_ops("bench", standalone=True)
    t = Table("GGUF: bytes per weight held in memory, by quant type (a loaded 512x1024 Linear)",
              ["type", "block", "bytes/weight", "bits/weight", "vs bf16", "vs FP8"])
    g = torch.Generator().manual_seed(0)
    for q, (bs, ts) in mk.GGUF_QUANTS.items():
        net = torch.nn.Module()
        net.lin = ops.Linear(1024, 512, bias=False)
        net.lin.load_state_dict({"weight": GGUFTensor(random_blocks(q, 512, 1024 // bs, g), q, (512, 1024))})
        bpw = weight_bytes(net)["bytes_per_gguf_weight"]
        t.add(q, f"{bs} in {ts} B", round(bpw, 4), round(bpw * 8, 3), f"{bpw / 2:.3f}x", f"{bpw:.3f}x")
    t.note = "bf16 holds 2 bytes a weight, FP8 (Load Diffusion Model (FP8, Metal)) 1 byte plus its scale."
    return t


_MAKE_GGUF = _PRELUDE + textwrap.dedent("""
    import gguf, numpy as np
    from gguf.quants import quantize
    from safetensors.torch import load_file
    from comfy_metal.metal_kernels.gguf import random_blocks, GGUF_QUANTS
    src, out, qtype = sys.argv[2], sys.argv[3], sys.argv[4]
    sd = load_file(src)
    bs, ts = GGUF_QUANTS[qtype]
    w = gguf.GGUFWriter(out, "flux")
    g = torch.Generator().manual_seed(0)
    for k, v in sd.items():
        if k.endswith(".weight") and v.dim() == 2 and v.shape[-1] % bs == 0 and "norm" not in k:
            if qtype in ("Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"):
                raw = quantize(v.float().numpy(), gguf.GGMLQuantizationType[qtype])
            else:   # no quantiser in the gguf package: random blocks of the same size (timing only)
                raw = random_blocks(qtype, v.shape[0], v.shape[1] // bs, g, scale=1e-4).numpy()
            w.add_tensor(k, raw, raw_shape=raw.shape, raw_dtype=gguf.GGMLQuantizationType[qtype])
        else:
            w.add_tensor(k, v.float().numpy())
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    print(json.dumps({"ok": True}))
""")

_REPORT = textwrap.dedent("""
    n = b = 0
    for mod in m.model.modules():
        if type(mod).__name__ != "Linear" or getattr(mod, "weight", None) is None:
            continue
        shape = getattr(mod, "gguf_shape", None) or tuple(mod.weight.shape)
        n += shape[0] * shape[1]
        b += sum(t.nbytes for key, t in mod.state_dict().items() if not key.endswith(("bias", "comfy_quant")))
    print(json.dumps({"seconds": p.seconds, "peak": p.grown, "bpw": b / n, "size": m.model_size(),
                      "loaded": m.loaded_size()}))
""")

_LOADERS = {
    "gguf": ("MetalGGUFModelLoader", "from comfy_metal.nodes.gguf import loader as L",
             "L.load_diffusion_model(sys.argv[3], 'auto')"),
    "fp8": ("MetalFP8ModelLoader", "from comfy_metal.nodes.fp8 import loader as L",
            "L.load_diffusion_model(sys.argv[3], 'auto', 'auto')"),
    "stock": ("ComfyUI UNETLoader (stock)", "L = None", "comfy.sd.load_diffusion_model(sys.argv[3])"),
}


def _load_script(kind: str) -> str:
    _, imp, call = _LOADERS[kind]
    return _PRELUDE + _COMFY_SETUP + textwrap.dedent(f"""
        {imp}
        import comfy.sd, comfy.ops, comfy.model_patcher, comfy.model_management as mm  # imported before timing
        with Peak() as p:
            m = {call}
            {TO_DEVICE}
    """) + _REPORT


def load_table(quick: bool) -> Table:
    t = Table("GGUF loading: bytes per Linear weight, load time, peak RSS growth (same Flux-shaped model)",
              ["loader", "file", "file size", "bytes/weight", "load s", "peak RSS growth", "on device"])
    comfy = _comfy_path()
    if comfy is None:
        t.note = "ComfyUI is not importable (set COMFYUI_PATH): no load comparison."
        return t
    notes = []
    hidden, depth, single = (256, 1, 2) if quick else (1536, 4, 8)
    with tempfile.TemporaryDirectory(prefix="comfy-metal-bench-gguf-") as d:
        fp8 = os.path.join(d, "flux_fp8.safetensors")
        try:
            bf16 = _run(_MAKE_FLUX, comfy, hidden, depth, single, fp8)["bf16"]
        except Exception as e:
            t.note = f"building the Flux-shaped model failed: {e}"
            return t
        label = f"Flux-shaped h{hidden} d{depth}+{single}"
        runs = []
        for q in ("Q8_0", "Q4_K"):
            path = os.path.join(d, f"flux_{q}.gguf")
            try:
                _run(_MAKE_GGUF, bf16, path, q)
                runs.append(("gguf", path, q))
            except Exception as e:
                notes.append(f"writing the {q} file failed: {e}")
        runs += [("fp8", fp8, "FP8 e4m3fn"), ("stock", bf16, "bf16")]
        for kind, path, what in runs:
            name = _LOADERS[kind][0] + (" on the bf16 file" if what == "bf16" else "")
            try:
                r = _run(_load_script(kind), comfy, path)
                t.add(name, f"{label}, {what}", human_bytes(os.path.getsize(path)), round(r["bpw"], 3),
                      round(r["seconds"], 3), human_bytes(r["peak"]), f"{human_bytes(r['loaded'])} of "
                      f"{human_bytes(r['size'])}")
            except Exception as e:
                t.add(name, f"{label}, {what}", "", "error", "", str(e)[:60], "")
    notes.append(f"Every row times the same steps: build the MODEL from the file, then {TO_DEVICE}. The Q4_K file "
                 "holds random blocks (the gguf package has no K-quant quantiser); Q8_0 is quantised from the bf16 "
                 "weights. bytes/weight counts the Linear layers' weights (+ scales); the rest stays F32 in GGUF "
                 "files.")
    t.note = "\n".join(notes)
    return t


def layer_table(quick: bool) -> Table:
    """One Linear layer: the public kernels (Metal on MPS) against the pure-torch reference, by M; and the
    dequantise kernel alone."""
    from .... import metal_kernels as mk
    from ....metal_kernels import dispatch
    from ....metal_kernels.gguf import gguf_dequantize_reference, gguf_gemv_reference, random_blocks

    device = _device()
    shapes = [(1024, 1024)] if quick else [(3072, 3072), (14336, 4096)]
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    reps = 3 if quick else 10
    t = Table(f"GGUF Linear (N x K) on {device.type}: fused GEMV (M <= 8), dequantise alone, dequantise + matmul "
              f"(M > 8), against the reference and a plain {str(dtype).replace('torch.', '')} matmul",
              ["type", "N x K", "M", "path", "ms", "reference ms", "vs reference", "plain matmul ms", "GB/s",
               "of roofline", "backend"])
    bw = copy_bandwidth(device, (64 if quick else 256) << 20)
    g = torch.Generator().manual_seed(0)
    for n, k in shapes:
        w_plain = (torch.randn(n, k, generator=g) * 0.02).to(device, dtype)
        for q in ("Q8_0", "Q4_K", "Q6_K", "Q4_0") if quick else mk.GGUF_QUANTS:
            bs, ts = mk.GGUF_QUANTS[q]
            raw = random_blocks(q, n, k // bs, g, scale=1e-4).to(device)
            for m in (1, 8, 0, 4096) if n == k else (1, 0):
                x = torch.randn(max(m, 1), k, generator=g).to(device, dtype)
                if 1 <= m <= 8:
                    path, kernel, nbytes = "gemv", "gguf_gemv", raw.numel()
                    fn = lambda: mk.gguf_gemv(x, raw, q, out_dtype=dtype)                                   # noqa: E731
                    ref = lambda: gguf_gemv_reference(x, raw, q, out_dtype=dtype)                            # noqa: E731
                elif m == 0:
                    path, kernel, nbytes = "dequantize", "gguf_dequantize", raw.numel() + n * k * 2
                    fn = lambda: mk.gguf_dequantize(raw, q, out_dtype=dtype)                                 # noqa: E731
                    ref = lambda: gguf_dequantize_reference(raw, q, dtype)                                   # noqa: E731
                else:
                    path, kernel, nbytes = "dequantize+matmul", "gguf_dequantize", 0
                    fn = lambda: torch.nn.functional.linear(x, mk.gguf_dequantize(raw, q, out_dtype=dtype))  # noqa: E731
                    ref = lambda: torch.nn.functional.linear(x, gguf_dequantize_reference(raw, q, dtype))    # noqa: E731
                tm = median_seconds(fn, device, reps)
                tr = median_seconds(ref, device, reps)
                tp = median_seconds(lambda: torch.nn.functional.linear(x, w_plain), device, reps) if m else None
                gbs = nbytes / tm
                t.add(q, f"{n}x{k}", m or "", path, round(tm * 1e3, 3), round(tr * 1e3, 3), f"{tm / tr:.2f}x",
                      round(tp * 1e3, 3) if tp else "", round(gbs / 1e9, 2) if nbytes else "",
                      f"{gbs / bw:.1%}" if nbytes else "", dispatch.last_backend.get(kernel, "?"))
    t.note = (f"GB/s: the bytes a kernel must move (GEMV: the block bytes; dequantise: blocks read + output written) "
              f"over its time; of roofline: that against the measured copy bandwidth, {bw / 1e9:.1f} GB/s on "
              f"{device.type}." + ("" if device.type == "mps" else " No MPS here: every column is the pure-torch "
                                   "reference."))
    return t


def bench(quick: bool = False) -> list[Table]:
    tables = []
    for make in (bytes_table, load_table, layer_table):
        try:
            tables.append(make(quick))
        except Exception as e:
            tables.append(Table(f"GGUF bench section {make.__name__} failed", ["error"], [[f"{type(e).__name__}: {e}"]]))
    return tables
