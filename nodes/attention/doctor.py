"""doctor stage "Metal attention": on a Mac, the measured choice between the Metal kernel and the
platform attention at one SDXL-like shape (the record goes to doctor's "Measured choices" table);
elsewhere the pack's attention (reference, or the emulated kernel with COMFY_METAL_BACKEND=emulator)
against float64 at a small shape."""
from __future__ import annotations

import math

import torch

SHAPE_MPS = (1, 10, 1024, 64)          # (B, H, L, D), fp16: an SDXL attention at 512² scale
SHAPE_CPU = (1, 2, 40, 64)


def _platform_attention():
    """(name, fn(q, k, v)) of the attention ComfyUI would use when ComfyUI is importable, else SDPA."""
    try:
        import comfy.ldm.modules.attention as attention

        fn = attention.optimized_attention
        name = fn.__name__.replace("attention_", "")
        return name, lambda q, k, v: fn(q, k, v, q.shape[1], skip_reshape=True, skip_output_reshape=True)
    except Exception:
        return "sdpa", torch.nn.functional.scaled_dot_product_attention


def _float64_error(out, q, k, v) -> float:
    qd, kd, vd = (t.double().cpu() for t in (q, k, v))
    want = torch.softmax(qd @ kd.transpose(-1, -2) / math.sqrt(q.shape[-1]), -1) @ vd
    return ((out.double().cpu() - want).norm() / want.norm()).item()


def attention_stage() -> str:
    from ...metal_kernels import attention as kernels
    from ...metal_kernels import dispatch
    from ...metal_kernels.probe import mps_available

    gen = torch.Generator().manual_seed(0)
    if mps_available():
        device = torch.device("mps")
        q, k, v = (torch.randn(*SHAPE_MPS, generator=gen).to(device, torch.float16) for _ in range(3))
        backend, reason = dispatch.choose(dispatch.REGISTRY["flash_attention"], device)
        if backend != "metal":
            return f"the Metal kernel is not used ({reason}); ComfyUI's attention stays"
        name, platform = _platform_attention()
        shape_class = kernels.attention_shape_class(q, k)
        choice = dispatch.measured_choice("flash_attention", shape_class,
                                          {name: lambda: platform(q, k, v),
                                           "metal_flash": lambda: kernels.flash_attention(q, k, v)}, device)
        err = _float64_error(kernels.flash_attention(q, k, v)[:, :2, :128], q[:, :2, :128], k[:, :2], v[:, :2])
        record = dispatch.measured[("flash_attention", shape_class)]
        times = ", ".join(f"{n} {t:.3g} ms" for n, t in record["times_ms"].items())
        return (f"fp16 {SHAPE_MPS}: {choice} kept ({times}); Metal kernel error vs float64 {err:.1e}")
    q, k, v = (torch.randn(*SHAPE_CPU, generator=gen) for _ in range(3))
    out = kernels.flash_attention(q, k, v)
    used = dispatch.last_backend.get("flash_attention")
    err = _float64_error(out, q, k, v)
    if err > 1e-5:
        raise AssertionError(f"the pack's attention ({used}) is off float64 by {err:.2e}")
    return (f"no MPS: ComfyUI's attention stays unless asked; the pack's attention ({used}) matches "
            f"float64 ({err:.1e})")


def doctor_stages(args):
    return [("Metal attention", attention_stage)]
