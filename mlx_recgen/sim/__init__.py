"""Metal simulator: compile and execute Metal Shading Language kernels on the CPU.

``metal_kernel`` takes the same arguments as ``mx.fast.metal_kernel`` and returns a
callable taking the same arguments as the object MLX returns; the kernel text is
built exactly as MLX builds it (``mlx_recgen.backends.mlx_source.metal_source``),
compiled as C++ against a shim of MSL, and executed with Metal's execution model:
threadgroups one after another, the threads of a group as cooperative fibers
that meet at barriers and simd collectives (simdgroups of 32).  Out-of-bounds
accesses, unwritten outputs, uninitialised reads, divergent collectives and
barriers, and data races raise subclasses of :class:`SimulatorError` naming the line of
the statement; stores of an identical value from unordered threads give a
:class:`SameValueStoreWarning`. Simdgroup matrices (8x8) and quad collectives are modelled.
``patch_mlx()`` runs code written for ``mx.fast.metal_kernel`` (a library's kernels) on the
simulator.

See docs/simulator.md.
"""

from .errors import (
    BarrierDivergenceError,
    DataRaceError,
    KernelCrashError,
    KernelRuntimeError,
    MetalCompileError,
    OutOfBoundsError,
    SameValueStoreWarning,
    SimdDivergenceError,
    SimulatorError,
    SimulatorSetupError,
    SimulatorTransformError,
    UninitializedReadError,
    UnwrittenOutputError,
)
from .kernel import SimKernel, metal_kernel
from .patch import patch_mlx
from .compiler import cache_dir, clear_memory_cache, find_clang, find_compiler


def is_available() -> bool:
    """True when a C++ compiler for the simulator is on PATH."""
    try:
        find_compiler()
        return True
    except SimulatorError:
        return False


__all__ = [
    "metal_kernel",
    "patch_mlx",
    "SimKernel",
    "is_available",
    "cache_dir",
    "clear_memory_cache",
    "find_clang",
    "find_compiler",
    "SimulatorError",
    "SimulatorSetupError",
    "SimulatorTransformError",
    "MetalCompileError",
    "KernelRuntimeError",
    "OutOfBoundsError",
    "UnwrittenOutputError",
    "UninitializedReadError",
    "SimdDivergenceError",
    "BarrierDivergenceError",
    "DataRaceError",
    "SameValueStoreWarning",
    "KernelCrashError",
]
