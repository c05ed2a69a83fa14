"""Peak process memory: the kernel's resident-set high-water mark (VmHWM, reset through
/proc/self/clear_refs) on Linux, else a 1 ms RSS sampler (psutil)."""
from __future__ import annotations

import threading
import time


def proc_status_bytes(field: str) -> int | None:
    """A /proc/self/status field in bytes ("VmRSS", "VmHWM"), or None where there is none (not Linux)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux); False where the kernel does not support it."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return False
    return proc_status_bytes("VmHWM") is not None


class PeakRSS:
    """`with PeakRSS() as p:` ... then p.seconds, p.base, p.peak (bytes of RSS) and p.grown = peak - base."""

    def __enter__(self):
        import psutil

        self.proc = psutil.Process()
        self.hwm = reset_peak_rss()
        self.base = self.proc.memory_info().rss
        self.peak = self.base
        self.stop = False
        if not self.hwm:
            def run():
                while not self.stop:
                    self.peak = max(self.peak, self.proc.memory_info().rss)
                    time.sleep(0.001)
            self.t = threading.Thread(target=run, daemon=True)
            self.t.start()
        self.t0 = time.perf_counter()
        return self

    def __exit__(self, *a):
        self.seconds = time.perf_counter() - self.t0
        if self.hwm:
            self.peak = proc_status_bytes("VmHWM")
        else:
            self.stop = True
            self.t.join()
            self.peak = max(self.peak, self.proc.memory_info().rss)
        self.grown = self.peak - self.base
