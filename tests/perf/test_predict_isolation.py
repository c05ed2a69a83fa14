"""A prediction depends on its case alone: the same case predicted first in a process, or after other
kernels' predictions (whose tensors moved the host allocator on), gives the identical Prediction. The GPU
sees every tensor's storage at the start of its own buffer, wherever the CPU allocator put it: the profiler
must not count 32-byte sectors and 128-byte lines by host addresses (the GGUF Q6_K GEMV's L1 limit moved
between 83% and 100% of roofline with the placement of its input vector)."""
from __future__ import annotations

import dataclasses

import pytest
import torch

from comfy_metal.metal_kernels import emulator as emu

pytestmark = pytest.mark.skipif(not emu.available(), reason="clang-19 not installed: the MSL emulator needs it")


@pytest.fixture(scope="module")
def lib():
    from comfy_metal.metal_kernels import dispatch
    from comfy_metal.metal_kernels.emulator import profiler

    return profiler.compile_profile_library(dispatch.library_source())


def _gguf_case(qtype: str, n: int, k: int):
    from comfy_metal.metal_kernels.gguf import gguf_gemv_metal
    from comfy_metal.metal_kernels.perf import PredictCase
    from comfy_metal.metal_kernels.perf.cases import _gen, _gguf_weight

    def run(lib, device):
        gen = _gen(4)
        w = _gguf_weight(qtype, n, k, gen, device)
        x = torch.randn(1, k, generator=gen).to(device=device, dtype=torch.bfloat16)
        return gguf_gemv_metal(lib, x, w, qtype)
    return PredictCase(f"{qtype} M=1 {n}x{k}", run)


def _predict(case, lib):
    from comfy_metal.metal_kernels.perf import predict, profile_case

    return dataclasses.asdict(predict(profile_case(case, lib), "M4 Max", flops=case.flops))


def test_a_prediction_does_not_depend_on_the_predictions_before_it(lib):
    case = _gguf_case("Q6_K", 64, 2048)            # the kernel of the report, at a small shape
    alone = _predict(case, lib)
    others = [_gguf_case("Q8_0", 32, 1024), _gguf_case("Q4_K", 32, 1024)]
    keep = []                                       # what a bench run keeps: earlier profiles, other tensors
    for i in range(4):
        keep.append(_predict(others[i % 2], lib))
        keep.append(torch.empty(1 + 16 * i))
        after = _predict(case, lib)
        assert after == alone, f"prediction changed after {i + 1} other kernel predictions"
