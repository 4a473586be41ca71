"""Exceptions raised by the Metal simulator.

Every runtime error message names the kernel, the thread (grid position, threadgroup,
position in the threadgroup, simdgroup and lane) and the buffer involved.
"""

from __future__ import annotations


class SimulatorError(RuntimeError):
    """Base class of everything the Metal simulator reports."""

    def __init__(self, message: str, *, kernel: str | None = None, line: int | None = None):
        super().__init__(message)
        self.kernel = kernel
        self.line = line


class MetalCompileError(SimulatorError):
    """The kernel does not compile (C++ compiler errors, or something Metal rejects:
    `double`, recursion, address-space mismatches, ...)."""


class SimulatorSetupError(SimulatorError):
    """No usable C++ compiler, or the runtime library failed to build."""


class SimulatorTransformError(SimulatorError):
    """The simulator was called under ``mx.compile`` or ``mx.vmap``: it runs kernels on the CPU
    through numpy, so it needs concrete inputs, which those transformations do not provide."""


class KernelRuntimeError(SimulatorError):
    """Base class of errors found while executing a kernel."""


class OutOfBoundsError(KernelRuntimeError):
    """A read or write outside an input, output or threadgroup array."""


class UnwrittenOutputError(KernelRuntimeError):
    """An output element no thread wrote (outputs start as garbage without init_value)."""


class UninitializedReadError(KernelRuntimeError):
    """A read of threadgroup memory (or of an output without init_value) no thread wrote."""


class SimdDivergenceError(KernelRuntimeError):
    """A simd collective (or simdgroup_barrier) reached by only part of a simdgroup's
    threads, or different collectives reached at the same time."""


class BarrierDivergenceError(KernelRuntimeError):
    """A threadgroup_barrier not reached by every thread of the threadgroup."""


class DataRaceError(KernelRuntimeError):
    """Two threads access the same address, at least one writing, with no barrier
    (or no ordering at all: different threadgroups) between them, without atomics."""


class SameValueStoreWarning(RuntimeWarning):
    """Threads with no ordering between them stored the identical value to one element
    (e.g. every lane of a simdgroup writing ``y[i] = 0``): harmless on the GPU, so a
    warning; ``strict_races=True`` makes it a :class:`DataRaceError`."""


class KernelCrashError(KernelRuntimeError):
    """The kernel crashed (stack overflow, access through an unchecked pointer, ...)."""


# runtime error codes (msl_runtime.cpp ErrKind) -> exception classes
ERROR_CLASSES = {
    1: OutOfBoundsError,
    2: UnwrittenOutputError,
    3: UninitializedReadError,
    4: SimdDivergenceError,
    5: BarrierDivergenceError,
    6: DataRaceError,
    7: KernelCrashError,
    8: KernelRuntimeError,
}
