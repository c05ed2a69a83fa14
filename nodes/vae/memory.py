"""Memory of a decode: the peak it allocates (CUDA stats, elsewhere the live bytes of every tensor it
allocates), the automatic budget, and recognising out-of-memory errors."""
from __future__ import annotations

import contextlib
import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

# ---------------------------------------------------------------- memory measurement


class LiveTensorBytes(TorchDispatchMode):
    """Peak bytes of live tensor storages allocated by ops under this mode (per device type): a
    tracemalloc-style measurement that works on CPU and MPS alike."""

    def __init__(self, device: torch.device | None = None):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = 0
        self.peak = 0
        # MPS: also sample the driver's allocation after every op (the allocator's pools and
        # MPSGraph temporaries are not tensors); the peak is the larger of the two
        self._driver = None
        if device is not None and device.type == "mps":
            try:
                self._driver = torch.mps.driver_allocated_memory
                self._driver_base = self._driver()
            except Exception:
                self._driver = None

    def _free(self, key):
        n = self.live.pop(key, 0)
        self.current -= n

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        # an op returning views (or its in-place input) allocates nothing: the storage is its input's, counted
        # when allocated here, or allocated before this mode (a crop of the input image is not the image)
        schema = getattr(func, "_schema", None)
        if schema is not None and any(r.alias_info is not None for r in schema.returns):
            return out
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                try:
                    s = t.untyped_storage()
                except Exception:
                    continue
                key = id(s)
                if key in self.live:
                    continue
                n = s.nbytes()
                self.live[key] = n
                self.current += n
                weakref.finalize(s, self._free, key)
        if self.current > self.peak:
            self.peak = self.current
        if self._driver is not None:
            self.peak = max(self.peak, self._driver() - self._driver_base)
        return out


@contextlib.contextmanager
def measure_peak(device: torch.device):
    """Yields a dict; after the block, dict["peak"] = peak bytes allocated inside it on `device`."""
    result = {"peak": 0}
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        base = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        yield result
        torch.cuda.synchronize(device)
        result["peak"] = torch.cuda.max_memory_allocated(device) - base
        return
    tracker = LiveTensorBytes(device)
    with tracker:
        yield result
    result["peak"] = tracker.peak


def auto_budget(device: torch.device) -> int:
    """Bytes a decode may use when the node's budget is 0 (auto)."""
    try:
        if device.type == "mps":
            rec = torch.mps.recommended_max_memory()
            used = torch.mps.driver_allocated_memory()
            return max(int((rec - used) * 0.6), 512 << 20)
        if device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(device)
            return max(int(free * 0.7), 256 << 20)
    except Exception:
        pass
    try:
        import psutil

        return max(int(psutil.virtual_memory().available * 0.4), 256 << 20)
    except Exception:
        return 2 << 30


def is_oom(e: BaseException) -> bool:
    if isinstance(e, getattr(torch, "OutOfMemoryError", ())):
        return True
    msg = str(e).lower()
    return isinstance(e, (RuntimeError, MemoryError)) and (
        "out of memory" in msg or "can't allocate memory" in msg or "cannot allocate memory" in msg
        or isinstance(e, MemoryError))
