"""The attention launcher and the reference never read a device value back to the host (no syncs per
call: a sampling step runs dozens of attention calls)."""
from __future__ import annotations

import torch

from comfy_metal.metal_kernels import attention as A
from comfy_metal.nodes.common import syncs as sync_count


class FakeLib:
    def __getattr__(self, name):
        return lambda *args, threads, group_size: None


def test_attention_makes_no_host_syncs():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 40, 64, generator=g).half()
    k = torch.randn(2, 2, 50, 64, generator=g).half()
    v = torch.randn(2, 2, 50, 64, generator=g).half()
    bool_mask = torch.rand(2, 1, 40, 50, generator=g) > 0.5
    add_mask = torch.randn(40, 50, generator=g).half()
    with sync_count.SyncCounter() as counter:
        for mask in (None, bool_mask, add_mask):
            for variant in ("auto", "simd", "mma"):
                A.flash_attention_metal(FakeLib(), q, k, v, mask=mask, variant=variant)
            A.flash_attention_reference(q, k, v, mask=mask)
    assert counter.total == 0, dict(counter.counts)
