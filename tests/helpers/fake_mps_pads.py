"""Fake MPS for the video VAEs' padding: 5-D pads routed as on MPS (the Metal `vae_pad` kernel, which the tests run
in the MSL emulator), and every F.pad call's tensor rank recorded."""
from __future__ import annotations

import torch
import torch.nn.functional as F


def record_pad_ranks(monkeypatch) -> list:
    """Route nodes/vae's 5-D pads as on MPS and return the list that every later F.pad call appends its input's
    rank to (F.pad and torch's C pad both, as `F.pad` may be either)."""
    from comfy_metal.metal_kernels.vae import vae_pad
    from comfy_metal.nodes.vae import causal

    vae_pad(torch.zeros(1, 1, 1, 2, 2), (0, 0, 0, 0, 1, 0))      # its one-time self-check pads with the reference
    ranks = []
    real_pad, real_c_pad = F.pad, torch._C._nn.pad

    def pad(x, *args, **kwargs):
        ranks.append(x.dim())
        return real_pad(x, *args, **kwargs)

    def c_pad(x, *args, **kwargs):
        ranks.append(x.dim())
        return real_c_pad(x, *args, **kwargs)

    monkeypatch.setattr(causal, "metal_pads", lambda device: True)
    monkeypatch.setattr(F, "pad", pad)
    monkeypatch.setattr(torch._C._nn, "pad", c_pad)
    return ranks
