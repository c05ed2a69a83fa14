"""Bench section "FP8": bytes a weight, load time and peak memory of FP8 loading against ComfyUI's
stock loader on the same file, and the GEMV-versus-decode+matmul crossover by M.

Each load runs in a fresh subprocess; its peak RSS is the kernel's high-water mark (VmHWM, reset
just before the load) on Linux, else a 1 ms RSS sampler. ComfyUI is used when it is importable
($COMFYUI_PATH or on sys.path); otherwise the table says so.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import textwrap

import torch

from ...common.comfyui import PACK_ROOT, find_comfyui_dir
from ...common.report import Table, human_bytes, median_seconds

ROOT = PACK_ROOT

_PRELUDE = textwrap.dedent("""
    import importlib.util, json, os, sys, threading, time
    root = sys.argv[1]
    spec = importlib.util.spec_from_file_location("comfy_metal", os.path.join(root, "__init__.py"),
                                                  submodule_search_locations=[root])
    pkg = importlib.util.module_from_spec(spec); sys.modules["comfy_metal"] = pkg; spec.loader.exec_module(pkg)
    import torch

    def linear_bytes(model):
        # (Linear weights, bytes of their weights + scales) as held by the model
        n = b = 0
        for mod in model.modules():
            if type(mod).__name__ != "Linear" or getattr(mod, "weight", None) is None:
                continue
            shape = getattr(mod, "quant_shape", None)      # block-quantized (nodes/quant): the logical shape
            n += shape[0] * shape[1] if shape else mod.weight.numel()
            b += sum(t.nbytes for key, t in mod.state_dict().items() if not key.endswith(("bias", "comfy_quant")))
        return n, b

    from comfy_metal.nodes.common.memory import PeakRSS as Peak
""")

_COMFY_SETUP = textwrap.dedent("""
    comfy_path = sys.argv[2]
    stubs = os.path.join(root, "tests", "comfy_stubs")
    try:
        import torchvision  # noqa
    except ImportError:
        if os.path.isdir(stubs):
            sys.path.insert(0, stubs)
    sys.path.insert(0, comfy_path)
    import comfy.options
    comfy.options.enable_args_parsing()
    saved = sys.argv
    sys.argv = ["main.py"] + ([] if torch.backends.mps.is_available() or torch.cuda.is_available() else ["--cpu"])
    import comfy.cli_args
    sys.argv = saved
    import logging; logging.disable(logging.WARNING)
""")

_MAKE_FLUX = _PRELUDE + _COMFY_SETUP + textwrap.dedent("""
    import comfy.ldm.flux.model, comfy.ops
    from safetensors.torch import save_file
    from comfy_metal.nodes.fp8 import quantize as fp8_quantize
    hidden, depth, single, out = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    cfg = dict(image_model="flux", in_channels=16, out_channels=16, vec_in_dim=768, context_in_dim=4096,
               hidden_size=hidden, mlp_ratio=4.0, num_heads=hidden // 128, depth=depth, depth_single_blocks=single,
               axes_dim=[16, 56, 56], theta=10000, patch_size=2, qkv_bias=True, guidance_embed=False, txt_ids_dims=[])
    net = comfy.ldm.flux.model.Flux(**cfg, dtype=torch.bfloat16, operations=comfy.ops.manual_cast)
    g = torch.Generator().manual_seed(0)
    sd = {}
    for k, v in net.state_dict().items():
        sd[k] = (torch.randn(v.shape, generator=g) * (v.shape[-1] ** -0.5 if v.dim() > 1 else 0.02)).to(torch.bfloat16)
    del net
    src = out + ".bf16.safetensors"
    save_file(sd, src); del sd
    fp8_quantize.quantize_file(src, out, "e4m3fn")
    print(json.dumps({"bf16": src}))
""")

# Both ComfyUI loads do the same two steps inside the timed block: build the MODEL from the file, then
# load it in full onto the compute device, as sampling does before its first step.
TO_DEVICE = "mm.load_models_gpu([m], force_full_load=True)"
_LOAD_REPORT = textwrap.dedent("""
    n, b = linear_bytes(m.model)
    print(json.dumps({"seconds": p.seconds, "peak": p.grown, "bpw": b / n, "size": m.model_size(),
                      "loaded": m.loaded_size()}))
""")

_LOAD_OURS = _PRELUDE + _COMFY_SETUP + textwrap.dedent(f"""
    from comfy_metal.nodes.fp8 import loader as fp8_loader
    import comfy.sd, comfy.ops, comfy.model_patcher, comfy.model_management as mm  # imported before timing
    with Peak() as p:
        m = fp8_loader.load_diffusion_model(sys.argv[3], "auto", "auto")
        {TO_DEVICE}
""") + _LOAD_REPORT

_LOAD_STOCK = _PRELUDE + _COMFY_SETUP + textwrap.dedent(f"""
    import comfy.sd, comfy.ops, comfy.model_patcher, comfy.model_management as mm  # imported before timing
    with Peak() as p:
        m = comfy.sd.load_diffusion_model(sys.argv[3])
        {TO_DEVICE}
""") + _LOAD_REPORT

_STANDALONE = _PRELUDE + textwrap.dedent("""
    from comfy_metal.nodes.fp8 import formats as fp8_formats, loader as fp8_loader, ops as fp8_ops
    path, layers, n, k, how = sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]), sys.argv[6]
    ops = fp8_ops.make_fp8_ops(standalone=True)
    net = torch.nn.Module()
    net.blocks = torch.nn.ModuleList([ops.Linear(k, n, bias=False) for _ in range(layers)])
    with Peak() as p:
        if how == "fp8":
            ck = fp8_formats.open_checkpoint(path)
            sd, _ = fp8_loader.build_state_dict(ck)
            net.load_state_dict(sd, strict=False)
            del sd
            b = sum(m.weight.nbytes + m.weight_scale.nbytes for m in net.blocks)
        else:  # what a loader without FP8 support does: read the file and upcast to bf16
            from safetensors.torch import load_file
            from comfy_metal.metal_kernels import fp8_decode
            sd = load_file(path)
            w = {key: fp8_decode(v, None, sd.get(key[:-6] + "weight_scale"), out_dtype=torch.bfloat16)
                 for key, v in sd.items() if key.endswith(".weight")}
            del sd
            b = sum(t.nbytes for t in w.values())
        for t in (net.state_dict().values() if how == "fp8" else w.values()):
            if t.dim():
                t.view(torch.uint8).reshape(-1)[::4096].sum().item()    # make every page resident
    print(json.dumps({"seconds": p.seconds, "peak": p.grown, "bpw": b / (layers * n * k)}))
""")


def _run(script: str, *args, timeout=900) -> dict:
    out = subprocess.run([sys.executable, "-c", script, str(ROOT), *map(str, args)], capture_output=True, text=True,
                         timeout=timeout, env={**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"})
    if out.returncode != 0:
        raise RuntimeError(out.stderr.strip().splitlines()[-1] if out.stderr.strip() else f"exit {out.returncode}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def _comfy_path() -> str | None:
    path = find_comfyui_dir()
    return None if path is None else str(path)


def load_table(quick: bool) -> Table:
    t = Table("FP8 loading: bytes per Linear weight, load time, peak RSS growth during the load",
              ["loader", "file", "file size", "bytes/weight", "load s", "peak RSS growth", "on device"])
    notes = []
    with tempfile.TemporaryDirectory(prefix="comfy-metal-bench-fp8-") as d:
        from safetensors.torch import save_file

        from ...fp8.quantize import comfy_quant_entries, quantize

        layers, n, k = (8, 1024, 1024) if quick else (32, 3072, 3072)
        path = os.path.join(d, "stack_fp8.safetensors")
        g = torch.Generator().manual_seed(0)
        base = torch.randn(n, k, generator=g) * 0.02
        tensors = {}
        for i in range(layers):
            q, s = quantize(base * (1 + 0.01 * i), "e4m3fn")
            tensors.update(comfy_quant_entries(f"blocks.{i}", q, s, "e4m3fn"))
        save_file(tensors, path)
        del tensors, base
        size = os.path.getsize(path)
        label = f"{layers} x Linear({k}, {n})"
        for how, name in (("fp8", "comfy_metal FP8 layers (kept FP8)"),
                          ("bf16", "safetensors load + upcast to bf16")):
            try:
                r = _run(_STANDALONE, path, layers, n, k, how)
                t.add(name, label, human_bytes(size), round(r["bpw"], 3), round(r["seconds"], 3), human_bytes(r["peak"]),
                      "-")
            except Exception as e:
                t.add(name, label, human_bytes(size), "error", "", str(e)[:60], "")
        comfy = _comfy_path()
        if comfy is None:
            notes.append("ComfyUI is not importable (set COMFYUI_PATH): the stock-loader comparison was skipped.")
        else:
            hidden, depth, single = (256, 1, 2) if quick else (1536, 4, 8)
            fpath = os.path.join(d, "flux_fp8.safetensors")
            try:
                _run(_MAKE_FLUX, comfy, hidden, depth, single, fpath)
                fsize = os.path.getsize(fpath)
                flabel = f"Flux-shaped h{hidden} d{depth}+{single}"
                for script, name in ((_LOAD_OURS, "MetalFP8ModelLoader"), (_LOAD_STOCK, "ComfyUI UNETLoader (stock)")):
                    try:
                        r = _run(script, comfy, fpath)
                        t.add(name, flabel, human_bytes(fsize), round(r["bpw"], 3), round(r["seconds"], 3),
                              human_bytes(r["peak"]), f"{human_bytes(r['loaded'])} of {human_bytes(r['size'])}")
                    except Exception as e:
                        t.add(name, flabel, human_bytes(fsize), "error", "", str(e)[:60], "")
                notes.append(f"Both ComfyUI rows time the same steps: build the MODEL from the file, then {TO_DEVICE} "
                             "(load it in full onto the compute device, as sampling does first); 'on device' is "
                             "ModelPatcher.loaded_size() of model_size() after that.")
            except Exception as e:
                notes.append(f"building the Flux-shaped file failed: {e}")
    notes.append("peak RSS growth: kernel high-water mark reset before the load (Linux) or 1 ms RSS sampling; "
                 "memory-mapped file pages count once they are touched.")
    t.note = "\n".join(notes)
    return t


def crossover_table(quick: bool) -> Table:
    from .... import metal_kernels as mk
    from ....metal_kernels.probe import fp8_storage_dtype, mps_available

    device = torch.device("mps" if mps_available() else "cpu")
    n = k = 1024 if quick else 4096
    g = torch.Generator().manual_seed(0)
    w32 = torch.randn(n, k, generator=g) * 0.02
    scale = (w32.abs().amax() / 448).reshape(())
    wq = mk.fp8_encode(w32, "e4m3fn", scale).to(device)
    if fp8_storage_dtype(device, "e4m3fn") != torch.uint8:
        wq = wq.view(torch.float8_e4m3fn)
    scale = scale.to(device)
    dtype = torch.bfloat16 if device.type != "cpu" else torch.float32
    t = Table(f"FP8 Linear {n}x{k} on {device.type}: GEMV kernel vs decode + matmul, by rows M",
              ["M", "gemv ms", "decode+matmul ms", "gemv / decode", "backend"])
    reps = 3 if quick else 10
    faster = []
    for m in (1, 2, 4, 8, 16, 32) if quick else (1, 2, 4, 8, 12, 16, 32, 64):
        x = torch.randn(m, k, generator=g).to(device, dtype)
        tg = median_seconds(lambda: mk.gemv(x, wq, None, fmt="e4m3fn", scale=scale, out_dtype=dtype), device, reps)
        td = median_seconds(lambda: torch.nn.functional.linear(x, mk.fp8_decode(wq, "e4m3fn", scale, out_dtype=dtype)),
                            device, reps)
        from ....metal_kernels import dispatch

        t.add(m, round(tg * 1e3, 3), round(td * 1e3, 3), f"{tg / td:.2f}x", dispatch.last_backend.get("gemv", "?"))
        faster.append((m, tg < td))
    upto = 0
    for m, ok in faster:
        if not ok:
            break
        upto = m
    where = f"GEMV is faster for every measured M up to {upto}" if upto else "GEMV was not faster at M=1"
    t.note = (f"{where}; the FP8 Linear uses GEMV for M <= 8."
              + ("" if device.type == "mps" else " (No MPS: these are the pure-torch reference paths.)"))
    return t


def gemv_table(quick: bool) -> Table:
    """The M=1 GEMV and the decode kernel at model shapes: GB/s of the bytes they must move and the fraction of
    the measured copy bandwidth (the roofline of these bandwidth-bound kernels)."""
    from .... import metal_kernels as mk
    from ....metal_kernels import dispatch
    from ....metal_kernels.probe import mps_available
    from .moe import copy_bandwidth

    device = torch.device("mps" if mps_available() else "cpu")
    dtype = torch.bfloat16 if device.type != "cpu" else torch.float32
    shapes = [(1024, 1024)] if quick else [(3072, 3072), (14336, 4096)]
    reps = 3 if quick else 10
    bw = copy_bandwidth(device, (64 if quick else 256) << 20)
    g = torch.Generator().manual_seed(1)
    t = Table(f"FP8 GEMV (M=1) and decode on {device.type}: bandwidth against the measured copy bandwidth",
              ["kernel", "format", "N x K", "ms", "GB/s", "of roofline", "backend"])
    for n, k in shapes:
        raw = (torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8) & 0xBF).to(device)
        scale = (torch.rand(n, generator=g) + 0.5).to(device)
        x = torch.randn(1, k, generator=g).to(device, dtype)
        for fmt in ("e4m3fn", "e5m2"):
            for kernel, fn, nbytes in (
                    ("gemv", lambda: mk.gemv(x, raw, fmt=fmt, scale=scale, out_dtype=dtype), n * k),
                    ("fp8_decode", lambda: mk.fp8_decode(raw, fmt, scale, out_dtype=dtype), n * k * 3)):
                s = median_seconds(fn, device, reps)
                t.add(kernel, fmt, f"{n}x{k}", round(s * 1e3, 3), round(nbytes / s / 1e9, 2), f"{nbytes / s / bw:.1%}",
                      dispatch.last_backend.get(kernel, "?"))
    t.note = (f"bytes moved: the weight (GEMV; x and y are negligible), weight + bf16 output (decode); copy "
              f"bandwidth {bw / 1e9:.1f} GB/s on {device.type}." + ("" if device.type == "mps" else
                                                                    " No MPS here: these are the pure-torch references."))
    return t


def bench(quick: bool = False) -> list[Table]:
    tables = []
    for make in (load_table, crossover_table, gemv_table):
        try:
            tables.append(make(quick))
        except Exception as e:
            tables.append(Table(f"FP8 bench section {make.__name__} failed", ["error"], [[f"{type(e).__name__}: {e}"]]))
    return tables
