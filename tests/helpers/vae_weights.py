"""Random weights for the VAE tests' ComfyUI VAE objects (ComfyUI's layers skip init)."""
from __future__ import annotations

import math

import torch


def vae_state_dict(module: torch.nn.Module, seed: int) -> dict:
    """A state dict of explicit random weights at PyTorch's default init scale (uniform +-1/sqrt(fan_in), as
    the diffusers models in test_vae.py get), norms near 1, small biases."""
    gen = torch.Generator().manual_seed(seed)
    sd = {}
    for k, v in module.state_dict().items():
        if v.dim() > 1:
            sd[k] = (torch.rand(v.shape, generator=gen) * 2 - 1) / math.sqrt(v[0].numel())
        elif k.endswith(("weight", "gamma")):
            sd[k] = 1.0 + 0.1 * torch.randn(v.shape, generator=gen)
        else:
            sd[k] = 0.05 * torch.randn(v.shape, generator=gen)
    return sd
