"""``patch_mlx``: run any library's ``mx.fast.metal_kernel`` kernels on the simulator.

Libraries guard their Metal paths with ``mx.metal.is_available()`` and
``mx.default_device() == mx.gpu``, and many build their kernels once, at import.
Inside ``with patch_mlx(rebuild=[...]):`` those checks pass, ``mx.fast.metal_kernel``
is :func:`mlx_recgen.sim.metal_kernel`, and the named modules are re-executed so that
their import-time kernels are simulator kernels; on exit everything is put back and
the modules are re-executed again (their kernels are MLX's once more).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import sys
from typing import Iterator, Sequence

import mlx.core as mx

from .kernel import metal_kernel


def _reload(names: Sequence[str]) -> None:
    for name in names:
        module = sys.modules.get(name) or importlib.import_module(name)
        importlib.reload(module)


@contextlib.contextmanager
def patch_mlx(rebuild: Sequence[str] = (), *, gpu_default: bool = True,
              **sim_options) -> Iterator[None]:
    """Within the block, MLX looks like a Metal machine whose kernels run on the simulator.

    * ``mx.fast.metal_kernel`` is :func:`mlx_recgen.sim.metal_kernel` (``sim_options``,
      e.g. ``strict_races=True``, are passed to every kernel it makes);
    * ``mx.metal.is_available()`` returns True;
    * with ``gpu_default`` (the default), ``mx.default_device()`` returns ``mx.gpu``, for
      libraries that take their kernel path only on the GPU. Only the Python answer
      changes: MLX's own operations still run on the real default device;
    * ``rebuild``: module names (``"mlx_lm.models.ssm"``) re-executed on entry, so that
      kernels they build at import are built by the simulator, and again on exit.

    A library that bound these functions to its own names (``from mlx.core.fast import
    metal_kernel``) before the block keeps MLX's; list its module in ``rebuild``.
    """
    saved = [
        (mx.fast, "metal_kernel", mx.fast.metal_kernel),
        (mx.metal, "is_available", mx.metal.is_available),
        (mx, "default_device", mx.default_device),
    ]

    @functools.wraps(metal_kernel)
    def sim_metal_kernel(*args, **kwargs):
        return metal_kernel(*args, **{**sim_options, **kwargs})

    entered = False
    try:
        mx.fast.metal_kernel = sim_metal_kernel
        mx.metal.is_available = lambda: True
        if gpu_default:
            mx.default_device = lambda: mx.Device(mx.gpu, 0)
        _reload(rebuild)
        entered = True
        yield
    finally:
        for owner, name, value in saved:
            setattr(owner, name, value)
        if entered or rebuild:
            _reload(rebuild)
