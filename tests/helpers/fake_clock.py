"""A fake timing source for the measured dispatch's tests (plain module: `from fake_clock import FakeClock`):
candidates advance `t` by their cost; `dispatch.measured_choice` reads it in place of the device clock."""
from __future__ import annotations


class FakeClock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t
