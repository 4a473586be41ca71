"""Tensor layouts: the declared layout of a spec's tensors and the canonical layout the pure-MLX
backend computes in.

Canonical layout of a tensor: ``(batch axes in spec order..., [time], lane, state axis)`` with
size 1 wherever the tensor lacks an axis, one array per component. A step slice of it
broadcasts against every other tensor of the step. An input with a group axis enters it
expanded (``expand_groups``): as if it carried the batch-like axis the group axis groups.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import mlx.core as mx

from .spec import Spec, Tensor


def canonical_axes(spec: Spec, t: Tensor, with_time: bool | None = None) -> list:
    with_time = t.has_time if with_time is None else with_time
    return _axes(spec.batch_axes, spec.time, spec.lane, spec.state_axis, with_time)


def _axes(batch_axes: tuple, time, lane, state_axis, with_time: bool) -> list:
    return [*batch_axes, *([time] if with_time else []), lane, state_axis or "__state__"]


def canonical_shape(spec: Spec, t: Tensor, sizes: dict, with_time: bool | None = None) -> tuple:
    """The canonical shape of tensor ``t`` (size 1 on the axes it lacks)."""
    return tuple(sizes[a] if a in t.axes else 1 for a in canonical_axes(spec, t, with_time))


def declared_shape(t: Tensor, sizes: dict) -> tuple:
    return tuple(a if isinstance(a, int) else sizes[a] for a in t.axes)


@functools.lru_cache(maxsize=512)
def _canonical_plan(batch_axes: tuple, time, lane, state_axis, t: Tensor) -> tuple:
    """``(permutation or None, source, components)`` of ``to_canonical``, decided once per
    layout (a call builds its graph again on every step, and under ``mx.grad`` twice): where
    each canonical axis comes from (an index into the permuted shape, None for an axis of size
    1), and whether a component axis is split off last."""
    named = [a for a in t.axes if isinstance(a, str)]
    target = _axes(batch_axes, time, lane, state_axis, t.has_time)
    present = [a for a in target if a in named]
    components = [i for i, a in enumerate(t.axes) if isinstance(a, int)]
    perm = [t.axes.index(a) for a in present] + components
    source = tuple(present.index(a) if a in named else None for a in target)
    return (None if perm == list(range(len(perm))) else tuple(perm)), source, bool(components)


def to_canonical(spec: Spec, t: Tensor, x: mx.array) -> list:
    """Declared-layout array -> one canonical array per component."""
    perm, source, components = _canonical_plan(spec.batch_axes, spec.time, spec.lane,
                                               spec.state_axis, t)
    x = x if perm is None else mx.transpose(x, perm)
    full = [1 if i is None else x.shape[i] for i in source]
    if components:
        x = mx.reshape(x, full + [t.components])
        return [x[..., c] for c in range(t.components)]
    return [mx.reshape(x, full)]


def from_canonical(spec: Spec, t: Tensor, parts: list, reduce_missing: bool) -> mx.array:
    """Canonical arrays (one per component) -> the declared layout.

    With ``reduce_missing`` the axes the tensor lacks are summed (gradients of broadcast inputs);
    otherwise they must already have size 1."""
    named = [a for a in t.axes if isinstance(a, str)]
    target = canonical_axes(spec, t)
    x = mx.stack(parts, axis=-1) if t.components > 1 else parts[0]
    missing = [i for i, a in enumerate(target) if a not in named]
    if missing:
        x = mx.sum(x, axis=missing) if reduce_missing else mx.squeeze(x, axis=missing)
    present = [a for a in target if a in named]
    order = [present.index(a) if isinstance(a, str) else len(present) for a in t.axes]
    return mx.transpose(x, order)


# A sum into fewer outputs than this, over many more elements, runs in two stages: MLX's GPU
# reductions parallelise over the outputs (an H200 summed (32768, 1024) over its first axis in
# 490 us, and in 138 us as 64 runs of 512 rows summed first, then the 64)
STAGED_OUTPUTS = 1 << 16
STAGED_MIN_SIZE = 1 << 20


def _stage(shape: tuple, axes: list):
    """``(axis, outer)``: split reduced ``axis`` into ``(outer, rest)`` and sum ``rest`` first, so
    the first sum has ``outer`` times as many outputs; None where one sum serves (few elements,
    or outputs enough already)."""
    size = math.prod(shape)
    kept = size // max(1, math.prod(shape[i] for i in axes))
    if size < STAGED_MIN_SIZE or kept >= STAGED_OUTPUTS:
        return None
    want = -(-STAGED_OUTPUTS // kept)
    for axis in sorted(axes, key=lambda i: -shape[i]):  # the longest axis that splits
        n = shape[axis]
        outer = max((d for d in range(2, min(n - 1, want) + 1) if n % d == 0), default=None)
        if outer is not None:
            return axis, outer
    return None


def staged_sum(x: mx.array, axes: list) -> mx.array:
    """``mx.sum(x, axes, keepdims=True)``, in two stages where the outputs are few (``_stage``)."""
    stage = _stage(tuple(x.shape), axes)
    if stage is not None:
        axis, outer = stage
        shape = tuple(x.shape)
        x = mx.sum(x.reshape(*shape[:axis], outer, shape[axis] // outer, *shape[axis + 1:]),
                   axis=axis + 1)
    return mx.sum(x, axis=axes, keepdims=True)


def spread(x: mx.array, shape: tuple) -> mx.array:
    """``x`` broadcast to ``shape`` in the steps whose reverse, MLX's derivative of the
    broadcasts, is ``staged_sum``: a parameter spread over batch and time gets its gradient
    summed in two stages, not in one reduction into its few elements."""
    shape = tuple(shape)
    axes = [i for i, (a, b) in enumerate(zip(x.shape, shape)) if a == 1 and b != 1]
    stage = _stage(shape, axes) if axes else None
    if stage is None:
        return mx.broadcast_to(x, shape)
    axis, outer = stage
    split = (*shape[:axis], outer, shape[axis] // outer, *shape[axis + 1:])
    ones = (*x.shape[:axis], 1, 1, *x.shape[axis + 1:])
    first = (*split[:axis], outer, 1, *split[axis + 2:])  # every axis but the run's steps
    return mx.broadcast_to(mx.broadcast_to(x.reshape(ones), first), split).reshape(shape)


def reduce_to(x: mx.array, shape: tuple) -> mx.array:
    """Sum ``x`` over the axes where ``shape`` has size 1 (undo broadcasting)."""
    x = x if isinstance(x, mx.array) else mx.array(x, dtype=mx.float32)
    if x.ndim < len(shape):
        x = mx.reshape(x, (1,) * (len(shape) - x.ndim) + tuple(x.shape))
    axes = [i for i, (a, b) in enumerate(zip(x.shape, shape)) if b == 1 and a != 1]
    if axes:
        x = staged_sum(x, axes)
    if tuple(x.shape) != tuple(shape):
        x = mx.broadcast_to(x, shape)
    return x


def to_time_major(spec: Spec, t: Tensor, x: mx.array) -> list:
    """Declared-layout array -> one canonical array per component, with the time axis (if the
    tensor has it) moved to the front: ``(time, batch axes..., lane, state axis)``."""
    parts = to_canonical(spec, t, x)
    if t.has_time:
        parts = [mx.moveaxis(p, len(spec.batch_axes), 0) for p in parts]
    return parts


def from_time_major(spec: Spec, t: Tensor, parts: list, reduce_missing: bool) -> mx.array:
    """The inverse of ``to_time_major`` (see ``from_canonical``)."""
    if t.has_time:
        parts = [mx.moveaxis(p, 0, len(spec.batch_axes)) for p in parts]
    return from_canonical(spec, t, parts, reduce_missing)


def sum_to(x, shape: tuple) -> mx.array:
    """``x`` summed over its extra leading axes and over the axes where ``shape`` has size 1,
    then broadcast to ``shape`` (undo broadcasting both ways)."""
    x = x if isinstance(x, mx.array) else mx.array(x, dtype=mx.float32)
    extra = x.ndim - len(shape)
    if extra > 0:
        x = mx.sum(x, axis=list(range(extra)))
    return reduce_to(x, shape)


def expanded(spec: Spec, t: Tensor) -> Tensor:
    """Tensor ``t`` with every group axis replaced by the batch-like axis it groups."""
    if not any(a in spec.groups for a in t.batch_axes):
        return t
    return dataclasses.replace(
        t, axes=tuple(spec.grouped(a) if isinstance(a, str) else a for a in t.axes),
        batch_axes=tuple(spec.grouped(a) for a in t.batch_axes))


def expand_groups(spec: Spec, t: Tensor, x: mx.array, sizes: dict) -> mx.array:
    """An input in the layout of ``expanded(spec, t)``: along each group axis, every group's
    slice repeated for the ``H / Hk`` members of the group (member ``h`` reads ``h // (H / Hk)``)."""
    for i, a in enumerate(t.axes):
        if a in spec.groups:
            x = mx.repeat(x, sizes[spec.groups[a]] // sizes[a], axis=i)
    return x


def sum_groups(spec: Spec, t: Tensor, g: mx.array, sizes: dict) -> mx.array:
    """A gradient in the layout of ``expanded(spec, t)`` summed over the members of each group:
    the gradient of ``t`` itself (the adjoint of ``expand_groups``)."""
    for i, a in enumerate(t.axes):
        if a in spec.groups:
            shape = list(g.shape)
            g = mx.sum(mx.reshape(g, shape[:i] + [sizes[a], shape[i] // sizes[a]] + shape[i + 1:]),
                       axis=i + 1)
    return g
