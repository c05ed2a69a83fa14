"""Bench section "kernels": the FP8 and GEMV kernels of the shared Metal module against their
pure-torch references, and what each GEMV weight type costs in bytes and time. (The GEMV versus
decode + matmul crossover by M is bench_fp8's table.)

On a machine without MPS only the references run (the emulator is a correctness tool, never timed).
"""
from __future__ import annotations

import time

import torch

from ...common.report import Table, bench_device, human_bytes, median_seconds

SIZES = {True: 1024, False: 4096}


def time_ms(fn, device: torch.device, reps: int) -> float:
    """Median wall time of fn() in ms (one warm-up call; synchronised around each call)."""
    return median_seconds(fn, device, repeat=reps) * 1e3


def _metal_launcher(name: str, device: torch.device):
    """spec.metal bound to the compiled library if dispatch would run Metal for `name` on `device`,
    else (None, why not)."""
    from ....metal_kernels import dispatch
    from ....metal_kernels.registry import REGISTRY

    spec = REGISTRY[name]
    if device.type != "mps":
        return None, "n/a (no MPS)"
    backend, reason = dispatch.choose(spec, device)
    if backend != "metal":
        return None, f"n/a ({reason[:60]})"
    lib = dispatch._library_for(spec, "metal")
    return (lambda *a, **k: spec.metal(lib, *a, **k)), ""


def _fp8_weight(n: int, k: int, device, gen) -> torch.Tensor:
    return (torch.randint(0, 256, (n, k), generator=gen, dtype=torch.uint8) & 0xBF).to(device)


def bench(quick: bool) -> list[Table]:
    from ....metal_kernels import fp8 as fp8_mod
    from ....metal_kernels import linear as linear_mod

    device = bench_device()
    size = SIZES[quick]
    reps = 3 if quick else 10
    gen = torch.Generator().manual_seed(0)
    on = "MPS" if device.type == "mps" else device.type.upper()

    # ---- per kernel: reference vs Metal
    kt = Table("Kernels: Metal vs reference",
               ["kernel", "case", "reference ms", "Metal ms", "speed-up"],
               note=f"device {on}; reference = the pure-torch fallback on the same device; the MSL emulator is "
                    f"a correctness tool and is not timed.")
    raw = _fp8_weight(size, size, device, gen)
    row_scale = (torch.rand(size, generator=gen) + 0.5).to(device)
    x_bf16 = torch.randn(size, size, generator=gen).to(device=device, dtype=torch.bfloat16)
    x1 = torch.randn(1, size, generator=gen).to(device=device, dtype=torch.bfloat16)
    w_bf16 = torch.randn(size, size, generator=gen).to(device=device, dtype=torch.bfloat16)
    cases = [
        ("fp8_decode", f"e4m3fn {size}x{size} -> bf16, row scale",
         fp8_mod.fp8_decode_reference, (raw, "e4m3fn"), {"scale": row_scale, "out_dtype": torch.bfloat16}),
        ("fp8_decode", f"e5m2 {size}x{size} -> fp16, no scale",
         fp8_mod.fp8_decode_reference, (raw, "e5m2"), {"out_dtype": torch.float16}),
        ("fp8_encode", f"bf16 {size}x{size} -> e4m3fn, row scale",
         fp8_mod.fp8_encode_reference, (x_bf16, "e4m3fn"), {"scale": row_scale}),
        ("gemv", f"M=1 x {size}x{size} e4m3fn weight, row scale",
         linear_mod.gemv_reference, (x1, raw), {"fmt": "e4m3fn", "scale": row_scale}),
        ("gemv", f"M=1 x {size}x{size} bf16 weight",
         linear_mod.gemv_reference, (x1, w_bf16), {}),
    ]
    for name, label, reference, args, kwargs in cases:
        ref_ms = time_ms(lambda: reference(*args, **kwargs), device, reps)
        metal, why = _metal_launcher(name, device)
        if metal is None:
            kt.add(name, label, ref_ms, why, "")
        else:
            metal_ms = time_ms(lambda: metal(*args, **kwargs), device, reps)
            kt.add(name, label, ref_ms, metal_ms, f"{ref_ms / metal_ms:.2f}x")

    # ---- bytes per weight
    from .... import metal_kernels

    bt = Table("GEMV weight storage by type",
               ["weight type", "bytes / weight", f"{size}x{size} weight", "gemv M=1 ms", "weight GB/s"],
               note="FP8 weights add 4 bytes per output row for a row scale (or 4 bytes for a tensorwise one). "
                    f"Device {on}; times are the public gemv (Metal on MPS after its self-check, else the reference).")
    x1f = torch.randn(1, size, generator=gen).to(device=device, dtype=torch.bfloat16)
    for label, weight, kw in [("float32", torch.randn(size, size, generator=gen).to(device), {}),
                              ("float16", w_bf16.to(torch.float16), {}),
                              ("bfloat16", w_bf16, {}),
                              ("e4m3fn (uint8)", raw, {"fmt": "e4m3fn", "scale": row_scale}),
                              ("e5m2 (uint8)", raw, {"fmt": "e5m2", "scale": row_scale})]:
        bpe = linear_mod.weight_bytes_per_element(weight)
        nbytes = bpe * weight.numel()
        ms = time_ms(lambda: metal_kernels.gemv(x1f, weight, **kw), device, reps)
        bt.add(label, bpe, human_bytes(nbytes), ms, f"{nbytes / (ms * 1e-3) / 1e9:.1f}")
    return [kt, bt]
