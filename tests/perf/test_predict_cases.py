"""Every registered kernel has predict cases (`bench --predict`), and a kernel can bring its own."""
from __future__ import annotations

import dataclasses

from comfy_metal.metal_kernels import REGISTRY
from comfy_metal.metal_kernels.perf import PredictCase, cases_for


def test_every_registered_kernel_has_predict_cases():
    missing = [name for name, spec in REGISTRY.items() if not cases_for(spec)]
    assert not missing, f"kernels without a predict case (metal_kernels/perf/cases.py): {missing}"
    for spec in REGISTRY.values():
        for case in cases_for(spec):
            assert isinstance(case, PredictCase) and case.label and case.repeat >= 1


def test_a_kernel_spec_brings_its_own_cases():
    spec = REGISTRY["gemv"]
    own = [PredictCase("mine", lambda lib, device: None)]
    assert cases_for(dataclasses.replace(spec, predict_cases=lambda: own)) == own
    assert cases_for(spec) != own
