"""Count the operations that make the host wait for the device, inside a block of code.

A TorchDispatchMode sees every aten op. Host syncs are: reading a value to Python (item,
_local_scalar_dense), data-dependent output shapes (nonzero, masked_select, unique, ...), and
copies from a device to the CPU. On CPU-only runs the last kind cannot occur, but the first two
are counted exactly as they would be on MPS or CUDA. Used by the benches and the tests.
"""
from __future__ import annotations

import collections

import torch

SYNC_OPS = {
    "aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::nonzero_static",
    "aten::masked_select", "aten::unique", "aten::_unique", "aten::_unique2", "aten::unique_consecutive",
    "aten::unique_dim", "aten::bincount", "aten::histc", "aten::repeat_interleave", "aten::argwhere",
    "aten::is_nonzero", "aten::equal", "aten::allclose", "aten::_assert_async",
}

try:
    from torch.utils._python_dispatch import TorchDispatchMode
except ImportError:  # a torch without dispatch modes: nothing can be counted
    TorchDispatchMode = None


class _NoDispatchMode:
    def __init__(self):
        raise RuntimeError("this torch has no TorchDispatchMode: host syncs cannot be counted")


class SyncCounter(TorchDispatchMode or _NoDispatchMode):
    """`with SyncCounter() as c:` ... then c.counts (op name -> count) and c.total."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        self.note(func, args, kwargs)
        return func(*args, **kwargs)

    def note(self, func, args, kwargs) -> None:
        """Count `func(*args, **kwargs)` if it makes the host wait."""
        name = func._schema.name
        if name in SYNC_OPS:
            # repeat_interleave with output_size given needs no sync
            if not (name == "aten::repeat_interleave" and kwargs.get("output_size") is not None):
                self.counts[name] += 1
        elif name in ("aten::_to_copy", "aten::copy_", "aten::to"):
            src = args[0] if name != "aten::copy_" else args[1]
            dst_dev = kwargs.get("device") if name != "aten::copy_" else args[0].device
            if isinstance(src, torch.Tensor) and src.device.type != "cpu" and dst_dev is not None \
                    and torch.device(dst_dev).type == "cpu":
                self.counts["device->cpu copy"] += 1


def count_syncs(fn) -> int | str:
    """Host syncs `fn()` makes, or "n/a" where this torch cannot count them."""
    if TorchDispatchMode is None:
        return "n/a"
    with SyncCounter() as counter:
        fn()
    return counter.total
