"""Real-model shapes for `python -m comfy_metal bench --predict`: a list of `PredictCase` per kernel.

A kernel names its cases either on its KernelSpec (`predict_cases=` a function returning the list) or here
in CASES (kernel name -> that function). A case's `run(lib, device)` builds its inputs on `device` and calls
the kernel's own launch code (`spec.metal(lib, ...)`), so the profile sees exactly the grid, group size and
arguments MPS gets; on a Mac the same call is timed for the measured column.

Inputs are random where values steer control flow (FP8 and GGUF codes, routing); a huge bank a sampled
profile mostly leaves untouched is allocated without being filled (its pages stay unallocated).
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

from ..registry import REGISTRY, KernelSpec


@dataclasses.dataclass(frozen=True)
class PredictCase:
    label: str
    run: Callable[[Any, torch.device], Any]   # run(lib, device): the kernel's launch code at the case's shapes
    quick: bool = False                        # part of `bench --predict --quick`
    sample: int | None = 3                     # threadgroups profiled per shape class (None: all of them)
    repeat: int = 1                            # the profiled launches stand for this many side by side
    flops: float | None = None                 # useful FLOPs of the call, where known (attention: 4 H L^2 D): the
                                               # ideal then leaves out work the kernel wastes (else: FLOPs executed)


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _fp8_bytes(shape, gen) -> torch.Tensor:
    return torch.randint(0, 256, shape, generator=gen, dtype=torch.uint8) & 0xBF   # finite codes, |w| < 2


# ------------------------------------------------------------------------------------------ linear / FP8

# (label, N, K): the M=1 decode shapes of the issue: Flux's 3072 square and Llama-3-8B's 4096 -> 14336
GEMV_SHAPES = [("3072x3072", 3072, 3072), ("4096->14336", 14336, 4096)]


def _gemv_cases():
    from ..linear import gemv_metal

    def case(n, k, weight):
        def run(lib, device):
            gen = _gen(1)
            x = torch.randn(1, k, generator=gen).to(device=device, dtype=torch.bfloat16)
            if weight == "e4m3fn":
                w = _fp8_bytes((n, k), gen).to(device)
                return gemv_metal(lib, x, w, fmt="e4m3fn", scale=(torch.rand(n, generator=gen) + .5).to(device))
            w = torch.randn(n, k, generator=gen).to(device=device, dtype=torch.bfloat16)
            return gemv_metal(lib, x, w)
        return run
    out = [PredictCase(f"FP8 e4m3fn row-scaled M=1 {lbl}", case(n, k, "e4m3fn"), quick=lbl == "3072x3072")
           for lbl, n, k in GEMV_SHAPES]
    out.append(PredictCase("bf16 M=1 4096->14336", case(14336, 4096, "bf16")))
    return out


def _fp8_decode_cases():
    from ..fp8 import fp8_decode_metal

    def run(lib, device):
        gen = _gen(2)
        raw = _fp8_bytes((3072, 3072), gen).to(device)
        return fp8_decode_metal(lib, raw, "e4m3fn", scale=(torch.rand(3072, 1, generator=gen) + .5).to(device),
                                    out_dtype=torch.bfloat16)
    return [PredictCase("e4m3fn 3072x3072 -> bf16, row scale", run, quick=True)]


def _fp8_encode_cases():
    from ..fp8 import fp8_encode_metal

    def run(lib, device):
        gen = _gen(3)
        x = torch.randn(3072, 3072, generator=gen).to(device=device, dtype=torch.bfloat16)
        return fp8_encode_metal(lib, x, "e4m3fn", scale=(torch.rand(3072, 1, generator=gen) + .5).to(device))
    return [PredictCase("bf16 3072x3072 -> e4m3fn, row scale", run)]


# ------------------------------------------------------------------------------------------ GGUF

GGUF_GEMV_TYPES = ("Q8_0", "Q4_K", "Q6_K", "Q5_K", "IQ4_XS")


def _gguf_weight(qtype, n, k, gen, device):
    from ..gguf import GGUF_QUANTS, random_blocks

    return random_blocks(qtype, n, k // GGUF_QUANTS[qtype][0], gen, scale=0.002).to(device)


def _gguf_gemv_cases():
    from ..gguf import gguf_gemv_metal

    def case(qtype, n, k):
        def run(lib, device):
            gen = _gen(4)
            w = _gguf_weight(qtype, n, k, gen, device)
            x = torch.randn(1, k, generator=gen).to(device=device, dtype=torch.bfloat16)
            return gguf_gemv_metal(lib, x, w, qtype)
        return run
    return [PredictCase(f"{q} M=1 {lbl}", case(q, n, k), quick=(q, lbl) == ("Q4_K", "3072x3072"))
            for q in GGUF_GEMV_TYPES for lbl, n, k in GEMV_SHAPES]


def _gguf_dequant_cases():
    from ..gguf import gguf_dequantize_metal

    def case(qtype):
        def run(lib, device):
            w = _gguf_weight(qtype, 3072, 3072, _gen(5), device)
            return gguf_dequantize_metal(lib, w, qtype, torch.float16)
        return run
    return [PredictCase(f"{q} 3072x3072 -> fp16", case(q), quick=q == "Q4_K") for q in ("Q8_0", "Q4_K", "Q6_K")]


# ------------------------------------------------------------------------------------------ attention

# (label, heads profiled, heads, tokens, head dim, dtype): Flux at 1024x1024 (4096 image + 512 text tokens),
# SDXL's first transformer level at 1024x1024, Wan 2.1 14B at 480p x 81 frames (21 x 30 x 52 latent tokens)
ATTENTION_SHAPES = [("Flux 1024x1024: 24 heads x 4608 tokens, D128, bf16", 24, 24, 4608, 128, torch.bfloat16),
                    ("SDXL 1024x1024: 10 heads x 4096 tokens, D64, fp16", 10, 10, 4096, 64, torch.float16),
                    ("Wan 2.1 14B 480p: 40 heads x 32760 tokens, D128, bf16", 4, 40, 32760, 128, torch.bfloat16)]


def _attention_cases():
    from ..attention import flash_attention_metal

    def case(h, tokens, d, dtype):
        def run(lib, device):
            gen = _gen(6)
            q, k, v = (torch.randn(1, h, tokens, d, generator=gen).to(device=device, dtype=dtype) for _ in range(3))
            return flash_attention_metal(lib, q, k, v)
        return run
    return [PredictCase(lbl, case(hp, n, d, dt), quick=lbl.startswith("SDXL"), repeat=h // hp, flops=4.0 * h * n * n * d)
            for lbl, hp, h, n, d, dt in ATTENTION_SHAPES]


def _softmax_cases():
    from ..softmax import softmax_metal

    def run(lib, device):
        return softmax_metal(lib, torch.randn(1, 151936, generator=_gen(7)).to(device), 0.7)
    return [PredictCase("Qwen3 logits 1x151936 fp32, temperature 0.7", run)]


# ------------------------------------------------------------------------------------------ MoE

# Qwen3-30B-A3B: hidden 2048, 128 experts of intermediate 768 (gate+up fused: 1536 rows), top-8
MOE_HIDDEN, MOE_INTER, MOE_EXPERTS, MOE_TOP_K = 2048, 768, 128, 8
PREFILL_TOKENS = 512


def _moe_route_cases():
    from ..moe import moe_route_metal

    def case(tokens):
        def run(lib, device):
            logits = torch.randn(tokens, MOE_EXPERTS, generator=_gen(8)).to(device=device, dtype=torch.bfloat16)
            return moe_route_metal(lib, logits, MOE_TOP_K)
        return run
    return [PredictCase("Qwen3-30B-A3B decode: 1 token, 128 experts, top-8", case(1), quick=True, sample=None),
            PredictCase(f"Qwen3-30B-A3B prefill: {PREFILL_TOKENS} tokens", case(PREFILL_TOKENS))]


def _moe_experts_gemm_cases():
    from ..moe import moe_experts_gemm_metal

    def case(n, k, x_div, fp8=True):
        def run(lib, device):
            gen = _gen(9)
            experts = torch.randperm(MOE_EXPERTS, generator=gen)[:MOE_TOP_K]
            bank = torch.empty(MOE_EXPERTS, n, k, dtype=torch.uint8 if fp8 else torch.bfloat16)  # pages untouched
            bank[experts] = _fp8_bytes((MOE_TOP_K, n, k), gen) if fp8 else \
                torch.randn(MOE_TOP_K, n, k, generator=gen).to(torch.bfloat16)   # but for the routed experts
            rows = MOE_TOP_K // x_div
            x = torch.randn(rows, k, generator=gen).to(device=device, dtype=torch.bfloat16)
            scale = (torch.rand(MOE_EXPERTS, n, generator=gen) + 0.5).to(device) if fp8 else None
            return moe_experts_gemm_metal(lib, x, experts.to(device), bank.to(device), scale, x_div=x_div,
                                          fmt="e4m3fn" if fp8 else None)
        return run
    return [PredictCase("Qwen3-30B-A3B decode gate+up: 8 experts x 1536x2048 FP8", case(2 * MOE_INTER, MOE_HIDDEN, 8),
                        quick=True),
            PredictCase("Qwen3-30B-A3B decode down: 8 experts x 2048x768 FP8", case(MOE_HIDDEN, MOE_INTER, 1)),
            PredictCase("Qwen3-30B-A3B decode gate+up: 8 experts x 1536x2048 bf16",
                        case(2 * MOE_INTER, MOE_HIDDEN, 8, fp8=False)),
            PredictCase("Qwen3-30B-A3B decode down: 8 experts x 2048x768 bf16", case(MOE_HIDDEN, MOE_INTER, 1, fp8=False))]


def _moe_grouped_gemm_cases():
    from ..moe import moe_grouped_gemm_metal

    experts = 16                        # profiled: 16 of the 128 experts with their share of the rows, x 8
    rows = PREFILL_TOKENS * MOE_TOP_K * experts // MOE_EXPERTS

    def case(n, k, fp8=True):
        def run(lib, device):
            gen = _gen(10)
            counts = torch.bincount(torch.randint(0, experts, (rows,), generator=gen), minlength=experts)
            offsets = torch.cumsum(counts, 0).to(device)
            bank = (_fp8_bytes((experts, n, k), gen) if fp8 else
                    torch.randn(experts, n, k, generator=gen).to(torch.bfloat16)).to(device)
            xs = torch.randn(rows, k, generator=gen).to(device=device, dtype=torch.bfloat16)
            scale = (torch.rand(experts, n, generator=gen) + 0.5).to(device) if fp8 else None
            return moe_grouped_gemm_metal(lib, xs, offsets, bank, scale, fmt="e4m3fn" if fp8 else None)
        return run
    # the row tiles differ (experts of different row counts, tiles past the last one): profile an evenly
    # spaced sample of 16 groups, not 3
    return [PredictCase(f"Qwen3-30B-A3B prefill gate+up: {PREFILL_TOKENS} tokens, FP8", case(2 * MOE_INTER, MOE_HIDDEN),
                        sample=16, repeat=MOE_EXPERTS // experts),
            PredictCase(f"Qwen3-30B-A3B prefill down: {PREFILL_TOKENS} tokens, FP8", case(MOE_HIDDEN, MOE_INTER),
                        sample=16, repeat=MOE_EXPERTS // experts),
            PredictCase(f"Qwen3-30B-A3B prefill gate+up: {PREFILL_TOKENS} tokens, bf16",
                        case(2 * MOE_INTER, MOE_HIDDEN, fp8=False), sample=16, repeat=MOE_EXPERTS // experts)]


# ------------------------------------------------------------------------------------------ sampling, VAE

LATENTS = [("SDXL 1024x1024 latent (1, 4, 128, 128)", (1, 4, 128, 128)),
           ("Flux 1024x1024 latent (1, 16, 128, 128)", (1, 16, 128, 128))]


def at_shape(spec: KernelSpec, shape, case_index: int = 0, quick: bool = False, label: str = "") -> PredictCase:
    """A case from the spec's own self-check case: every tensor argument shaped like the first one is
    replaced by a random tensor of `shape` (same dtype). For element-wise kernels (the sampler steps)."""
    def run(lib, device):
        args, kwargs = spec.self_check_cases(torch.device("cpu"))[case_index]
        like = next(a for a in args if isinstance(a, torch.Tensor))
        gen = _gen(11)

        def swap(a):
            if isinstance(a, torch.Tensor) and a.shape == like.shape:
                return (torch.randn(shape, generator=gen) * 3).to(dtype=a.dtype, device=device)
            return a.to(device) if isinstance(a, torch.Tensor) else a
        return spec.metal(lib, *[swap(a) for a in args], **{k: swap(v) for k, v in kwargs.items()})
    return PredictCase(label or str(tuple(shape)), run, quick=quick)


def _sampler_cases(spec: KernelSpec):
    quick = spec.name in ("sampler_euler_step", "sampler_dpmpp_2m_sde_step")
    return [at_shape(spec, shape, quick=quick and i == 0, label=lbl) for i, (lbl, shape) in enumerate(LATENTS)]


def _vae_pad_cases():
    from ..vae import vae_pad_metal

    def case(shape, pad, dtype, mode):
        def run(lib, device):
            x = torch.randn(shape, generator=_gen(12)).to(device=device, dtype=dtype)
            return vae_pad_metal(lib, x, pad, mode)
        return run
    return [PredictCase("SDXL VAE decoder conv input (1, 512, 128, 128) fp16, pad 1", case(
                (1, 512, 128, 128), (1, 1, 1, 1), torch.float16, "constant"), quick=True),
            PredictCase("Wan VAE causal pad (1, 384, 4, 60, 104) bf16, t+2 replicate", case(
                (1, 384, 4, 60, 104), (1, 1, 1, 1, 2, 0), torch.bfloat16, "replicate"))]


def _vae_blend_cases():
    from ..vae import vae_blend_accumulate_metal

    def case(acc_shape, tile_shape, offset):
        def run(lib, device):
            gen = _gen(13)
            acc = torch.empty(acc_shape, device=device)     # accumulated into; its values do not matter here
            tile = torch.randn(tile_shape, generator=gen).to(device=device, dtype=torch.float16)
            wy, wx = torch.rand(tile_shape[-2], generator=gen).to(device), torch.rand(tile_shape[-1], generator=gen).to(device)
            return vae_blend_accumulate_metal(lib, acc, tile, wy, wx, offset)
        return run
    return [PredictCase("SDXL decode: 512x512 tile into a 1024x1024 image", case(
                (1, 3, 1024, 1024), (1, 3, 512, 512), (256, 256)), quick=True),
            PredictCase("Wan decode: (1, 3, 9, 240, 416) tile into 81 x 480x832", case(
                (1, 3, 81, 480, 832), (1, 3, 9, 240, 416), (8, 120, 208)))]


CASES: dict[str, Callable[[], list[PredictCase]]] = {
    "gemv": _gemv_cases, "fp8_decode": _fp8_decode_cases, "fp8_encode": _fp8_encode_cases,
    "gguf_gemv": _gguf_gemv_cases, "gguf_dequantize": _gguf_dequant_cases, "flash_attention": _attention_cases,
    "softmax": _softmax_cases, "moe_route": _moe_route_cases, "moe_experts_gemm": _moe_experts_gemm_cases,
    "moe_grouped_gemm": _moe_grouped_gemm_cases, "vae_pad": _vae_pad_cases, "vae_blend_accumulate": _vae_blend_cases,
}


def cases_for(spec: KernelSpec) -> list[PredictCase]:
    """The kernel's predict cases: its spec's own, else CASES, else (a sampler step kernel) its self-check
    case at the SDXL and Flux latent shapes; [] when it has none."""
    if getattr(spec, "predict_cases", None) is not None:
        return list(spec.predict_cases())
    if spec.name in CASES:
        return CASES[spec.name]()
    if spec.source == "sampling.metal":
        return _sampler_cases(spec)
    return []


def all_cases(quick: bool = False) -> list[tuple[KernelSpec, list[PredictCase]]]:
    out = []
    for name in sorted(REGISTRY):
        spec = REGISTRY[name]
        cs = cases_for(spec)
        out.append((spec, [c for c in cs if c.quick] if quick else cs))
    return out
