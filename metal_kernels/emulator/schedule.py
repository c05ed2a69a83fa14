"""Thread schedules inside a threadgroup: forward, reverse, shuffle[:seed]."""
from __future__ import annotations

import contextlib
import os
import threading

_SCHED_KINDS = {"forward": 0, "reverse": 1, "shuffle": 2}
_DEFAULT_SCHEDULE = "shuffle:24301"
_schedule_override: str | None = None
_schedule_lock = threading.Lock()


def _parse_schedule(spec: str) -> tuple[int, int]:
    spec = spec.strip().lower()
    kind, _, seed = spec.partition(":")
    if kind not in _SCHED_KINDS:
        raise ValueError(f"unknown emulator schedule {spec!r}; use forward, reverse or shuffle[:seed]")
    try:
        s = int(seed, 0) if seed else 24301
    except ValueError:
        raise ValueError(f"bad seed in emulator schedule {spec!r}") from None
    return _SCHED_KINDS[kind], s & 0xFFFFFFFFFFFFFFFF


def get_schedule() -> str:
    """The schedule the next launch uses: set_schedule() value, else $COMFY_METAL_EMU_SCHEDULE, else shuffle."""
    if _schedule_override is not None:
        return _schedule_override
    return os.environ.get("COMFY_METAL_EMU_SCHEDULE") or _DEFAULT_SCHEDULE


def set_schedule(spec: str | None) -> None:
    """Set the thread schedule: "forward", "reverse", "shuffle" or "shuffle:<seed>"; None = env/default."""
    global _schedule_override
    if spec is not None:
        _parse_schedule(spec)
    _schedule_override = spec


@contextlib.contextmanager
def schedule(spec: str):
    """Context manager running the enclosed launches under `spec` (see set_schedule)."""
    global _schedule_override
    _parse_schedule(spec)
    with _schedule_lock:
        prev = _schedule_override
        _schedule_override = spec
    try:
        yield
    finally:
        _schedule_override = prev
