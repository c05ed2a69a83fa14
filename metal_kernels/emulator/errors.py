"""The emulator's exceptions."""
from __future__ import annotations


class EmulatorError(RuntimeError):
    """Base class of every emulator error."""


class MSLCompileError(EmulatorError):
    """The MSL source failed to preprocess/compile, or uses something the emulator rejects."""


class OutOfBoundsWrite(EmulatorError):
    """A kernel wrote outside the memory of one of its arguments."""


class BarrierDivergence(EmulatorError):
    """threadgroup_barrier reached in divergent control flow (a deadlock on a GPU)."""


class KernelCrash(EmulatorError):
    """The kernel crashed (invalid memory access, integer division by zero, stack overflow...)."""


class DataRace(EmulatorError):
    """Two threads accessed the same memory in one barrier interval (or from two threadgroups), one writing."""


class UninitializedRead(EmulatorError):
    """The result depends on memory the kernel never wrote: uninitialised threadgroup memory or out of bounds."""
