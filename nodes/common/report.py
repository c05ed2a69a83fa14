"""Plain-text tables for `doctor` and `bench`, also serialisable to JSON."""
from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Any, Callable

import torch


@dataclasses.dataclass
class Table:
    title: str
    columns: list[str]
    rows: list[list[Any]] = dataclasses.field(default_factory=list)
    note: str = ""

    def add(self, *row: Any) -> None:
        if len(row) != len(self.columns):
            raise ValueError(f"table {self.title!r}: row has {len(row)} cells, expected {len(self.columns)}")
        self.rows.append(list(row))

    def to_json(self) -> dict:
        return {"title": self.title, "columns": self.columns, "rows": self.rows, "note": self.note}

    def to_markdown(self) -> str:
        """The table as GitHub Markdown (title as a heading line, note below)."""
        def cell(v):
            return _fmt(v).replace("|", "\\|")
        out = [f"**{self.title}**", "", "| " + " | ".join(self.columns) + " |",
               "|" + "|".join("---:" if any(_numeric(cell(r[i])) for r in self.rows) else "---"
                              for i in range(len(self.columns))) + "|"]
        out += ["| " + " | ".join(cell(c) for c in r) + " |" for r in self.rows]
        if self.note:
            out += ["", self.note]
        return "\n".join(out)

    def render(self) -> str:
        cells = [[_fmt(c) for c in row] for row in self.rows]
        widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(self.columns)]
        line = "  ".join("-" * w for w in widths)
        out = [self.title, line, "  ".join(h.ljust(w) for h, w in zip(self.columns, widths)), line]
        for r in cells:
            out.append("  ".join(c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(r, widths)))
        out.append(line)
        if self.note:
            out.append(self.note)
        return "\n".join(out)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        if v != v:
            return "nan"
        if abs(v) >= 100:
            return f"{v:,.0f}"
        if abs(v) >= 1:
            return f"{v:.2f}"
        return f"{v:.3g}"
    return str(v)


def _numeric(s: str) -> bool:
    try:
        float(s.replace(",", "").rstrip("x%"))
        return True
    except ValueError:
        return False


def human_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{int(n)} B"
        n /= 1024
    return str(n)


# ---------------------------------------------------------------- timing for the bench modules

def bench_device() -> torch.device:
    """The device a benchmark measures: MPS, else CUDA, else the CPU."""
    from ...metal_kernels.probe import mps_available

    if mps_available():
        return torch.device("mps")
    if torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def synchronize(device) -> None:
    """Wait for the device's queued work (timing only; no-op on the CPU)."""
    kind = torch.device(device).type
    if kind == "mps":
        torch.mps.synchronize()
    elif kind == "cuda":
        torch.cuda.synchronize()


def median_seconds(fn: Callable[[], Any], device, repeat: int = 5, warmup: int = 1) -> float:
    """Median wall time of fn() in seconds, synchronising the device around each call."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
