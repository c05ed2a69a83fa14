"""Image quality against a reference."""
from __future__ import annotations

import math


def psnr(a, b, peak: float = 1.0) -> float:
    """Peak signal-to-noise ratio of `a` against `b` in dB (inf when equal); `peak` is the signal's range
    (1.0 for [0, 1] images, 2.0 for [-1, 1]). Compared in float32 on `b`'s device."""
    a = a.detach().float().to(b.device)
    b = b.detach().float()
    mse = float(((a - b) ** 2).mean())
    return float("inf") if mse == 0 else 10 * math.log10(peak * peak / mse)
