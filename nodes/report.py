"""Plain-text tables for `doctor` and `bench`, also serialisable to JSON."""
from __future__ import annotations

import dataclasses
from typing import Any


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
