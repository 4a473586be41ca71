"""The decode path of the ``mlx`` backend (``CallPlan.decode``; docs/calls.md): a call of a few
steps (a decode step, a short prompt) as the whole forward step (``MLXBackend.decode_step``),
once per step, in plain MLX ops on arrays laid out for it; initial states in, final states out,
no checkpoints. MLX's own transforms differentiate, vmap and compile it."""

from __future__ import annotations

import math

import mlx.core as mx

from ..layout import declared_shape, expanded
from .mlx_blocks import concat, fit


class DecodeLayout:
    """Declared layout <-> the decode layout ``([time], batch axes..., state axis, lane)`` of
    one tensor (size 1 on the axes it lacks, one array per component), as a transpose and a
    reshape worked out once per plan. State axis before lane: the state's sums then run over
    rows of lanes, which the CPU adds as vectors (about a third less time per gated DeltaNet
    step than sums along the last axis), and a state declared so (``[B, H, K, V]``) needs no
    copy."""

    def __init__(self, spec, t, sizes, with_time: bool):
        self.t, self.components = t, t.components
        self.groups = any(a in spec.groups for a in t.batch_axes)
        t = expanded(spec, t)
        target = ([spec.time] if with_time else []) + list(spec.batch_axes) + \
            [spec.state_axis or "__state__", spec.lane]
        named = [a for a in t.axes if isinstance(a, str)]
        present = [a for a in target if a in named]
        comp = [i for i, a in enumerate(t.axes) if isinstance(a, int)]
        self.perm = [t.axes.index(a) for a in present] + comp
        self.shape = [sizes[a] if a in named else 1 for a in target]
        self.present_shape = [sizes[a] for a in present] + ([t.components] if comp else [])
        # back: the present axes in declared order (components last, then moved into place)
        order = [present.index(a) if isinstance(a, str) else len(present) for a in t.axes]
        self.back = order
        # the ops of each arrangement, by the shape of the array arranged (decided once: a
        # decode step's layouts are arranged every call, and the decisions cost more Python
        # than the ops they leave out)
        self._to_parts, self._to_declared = {}, {}

    def parts(self, spec, x, sizes) -> list:
        ops = self._to_parts.get(x.shape)
        if ops is None:
            ops = self._to_parts[x.shape] = self._to_parts_ops(spec, x.shape, sizes)
        expand, perm, shape = ops
        if expand is not None:
            axes, wide, merged = expand
            x = mx.broadcast_to(mx.expand_dims(x, axes), wide)
            if merged is not None:
                x = mx.reshape(x, merged)
        x = arranged(x, perm, shape)
        if self.components == 1:
            return [x]
        # a slice, not x[..., c] (a gather, whose vjp has no jvp)
        return [mx.squeeze(x[..., c:c + 1], axis=-1) for c in range(self.components)]

    def _to_parts_ops(self, spec, shape, sizes) -> tuple:
        """``(expand or None, perm or None, shape or None)``: the group expansion, then the
        ``arrangement``, of an array of ``shape``. The expansion repeats each group's slice as
        ``mx.repeat`` does (expand, broadcast, reshape: the reshape copies), along the group
        axes of more than one member; where no transpose follows, its reshape is the
        arrangement's, one op less (the same copy, in the decode layout's shape)."""
        full = self.shape + ([self.components] if self.components > 1 else [])
        repeats = [(i, sizes[spec.groups[a]] // sizes[a]) for i, a in enumerate(self.t.axes)
                   if self.groups and a in spec.groups]
        repeats = [(i, r) for i, r in repeats if r > 1]  # mx.repeat by 1 returns x itself
        merged = tuple(n * dict(repeats).get(i, 1) for i, n in enumerate(shape))
        perm, target = arrangement(merged, self.perm, full)
        if not repeats:
            return None, perm, target
        axes = [i + 1 + k for k, (i, _) in enumerate(repeats)]
        wide = list(shape)
        for k, (i, r) in enumerate(repeats):
            wide.insert(i + 1 + k, r)
        if perm is None:
            return (axes, tuple(wide), None), None, target or merged
        return (axes, tuple(wide), merged), perm, target

    def declared(self, parts: list) -> mx.array:
        x = mx.stack(parts, axis=-1) if self.components > 1 else parts[0]
        ops = self._to_declared.get(x.shape)
        if ops is None:
            flat = arrangement(x.shape, list(range(x.ndim)), self.present_shape)
            ops = self._to_declared[x.shape] = (flat, arrangement(
                tuple(self.present_shape), self.back,
                [self.present_shape[i] for i in self.back]))
        return arranged(arranged(x, *ops[0]), *ops[1])


def arrangement(shape, perm, target) -> tuple:
    """``(perm or None, target or None)``: the transpose and the reshape that take an array of
    ``shape`` to ``reshape(transpose(x, perm), target)`` in as few ops as the sizes allow. A
    transpose that keeps the order of the axes of size > 1 (a decode step's time and batch axes
    are often of size 1) moves no element and is left out, and so is a reshape to the shape the
    array has."""
    moved = [i for i in perm if shape[i] > 1]
    transpose = moved != sorted(moved)
    after = tuple(shape[i] for i in perm) if transpose else tuple(shape)
    return (perm if transpose else None), (None if after == tuple(target) else tuple(target))


def arranged(x, perm, shape) -> mx.array:
    """``x`` transposed by ``perm`` and reshaped to ``shape``, each where not None
    (``arrangement``)."""
    if perm is not None:
        x = mx.transpose(x, perm)
    return x if shape is None else mx.reshape(x, shape)


# State elements per call up to which the decode path is compiled: a step of mlx-lm's
# gated_delta_update routed at 4 value heads of K = V = 64 (16384) took 0.98-1.04x mlx-lm's own
# compiled and 1.10-1.23x plain; at K = V = 128 (65536) 0.94-1.00x compiled and 0.82-0.89x plain
# (benchmarks/results/decode-compile-threshold-cpu-2026-11-27.md)
COMPILE_MAX_STATE = 16384


class Decoder:
    """The decode path of one plan: ``decoder(*inputs, *initial states) -> (*outputs, *final
    states)``, the whole step (``MLXBackend.decode_step``: state update and outputs in one pass)
    once per step as plain MLX ops in the ``DecodeLayout`` worked out for the plan's sizes; no
    checkpoints. MLX's own transforms differentiate (a few steps' states are cheap to keep),
    vmap and compile it. Calls whose states hold at most ``COMPILE_MAX_STATE`` elements run it
    ``mx.compile``d: there the ops' dispatch dominates and compiling fuses it away (a tiny
    gated DeltaNet step, H4 K=V=8: 42 against 67 µs on the CPU, mlx 0.32; H4 K=V=64 too);
    larger states run the plain ops, which the CPU runs faster than the compiled step (H4
    K=V=128; H16 K=V=128: 423 against 494 µs)."""

    def __init__(self, backend, sizes: dict, out_dtype):  # an MLXBackend (mlx_backend.py)
        spec, table = backend.rec.spec, backend.table
        self.spec, self.out_dtype, self.sizes = spec, out_dtype, dict(sizes)
        self.step = step = backend.decode_step
        self.steps = sizes[spec.time]
        self.inputs = [DecodeLayout(spec, t, sizes, t.has_time) for t in spec.inputs.values()]
        self.states = [DecodeLayout(spec, t, sizes, False) for t in spec.states.values()]
        self.outputs = [DecodeLayout(spec, t, sizes, True) for t in spec.outputs.values()]
        ns = sizes[spec.state_axis] if spec.state_axis else 1
        self.ones = step.needs_state_ones
        self.ns = ns
        # where each argument of the step comes from: ("state", index of the state part) or
        # ("input", index of the input part, whether it has the time axis)
        state_parts = [(t.name, c) for t in spec.states.values() for c in range(t.components)]
        input_parts = [(t.name, c) for t in spec.inputs.values() for c in range(t.components)]
        self.sources = []
        for sym in step.args:
            kind, part = table.key[sym]
            if kind == "state":
                self.sources.append((True, state_parts.index(part), False))
            else:
                self.sources.append((False, input_parts.index(part),
                                     spec.inputs[part[0]].has_time))
        outputs_parts = [(t.name, c) for t in spec.outputs.values() for c in range(t.components)]
        self.results = [(kind == "state", (state_parts if kind == "state" else outputs_parts)
                         .index((slot.tensor, slot.component))) for kind, slot in step.results]
        self.n_in, self.n_out_parts = len(spec.inputs), len(outputs_parts)
        state_elements = sum(math.prod(declared_shape(t, sizes)) for t in spec.states.values())
        self.compiled = state_elements <= COMPILE_MAX_STATE
        # what a call runs (``CallPlan.run`` calls it directly: a decode step is called once
        # per layer and token, and a Python frame around it costs as much as an op)
        self.run = mx.compile(self._steps) if self.compiled else self._steps

    def __call__(self, *arrays):
        return self.run(*arrays)

    def _steps(self, *arrays):
        spec, sizes = self.spec, self.sizes
        inputs = []
        for t, layout, x in zip(spec.inputs.values(), self.inputs, arrays[:self.n_in]):
            if not t.differentiable:  # read as fp32: no gradient flows back to it
                x = mx.stop_gradient(x)
            if x.dtype != mx.float32:
                x = x.astype(mx.float32)
            inputs += layout.parts(spec, x, sizes)
        state = []
        for layout, x in zip(self.states, arrays[self.n_in:]):
            x = x if x.dtype == mx.float32 else x.astype(mx.float32)
            state += [mx.expand_dims(p, 0) for p in layout.parts(spec, x, sizes)]
        shapes = [x.shape for x in state]
        ones = [mx.ones((self.ns, 1))] if self.ones else []
        per_step = [[] for _ in range(self.n_out_parts)]
        fn = self.step.fn
        one = self.steps == 1  # a decode step: the inputs' time axis is the step already
        for j in range(self.steps):
            args = [state[i] if is_state else inputs[i][j:j + 1] if timed and not one
                    else inputs[i] for is_state, i, timed in self.sources]
            new = list(state)
            for (is_state, i), x in zip(self.results, fn(*ones, *args)):
                if is_state:
                    new[i] = fit(x, shapes[i])
                else:
                    per_step[i].append(x)
            state = new
        outs, k = [], 0
        for layout in self.outputs:
            parts = []
            for _ in range(layout.components):
                shape = (1, *layout.shape[1:])
                parts.append(concat([fit(x, shape) for x in per_step[k]]))
                k += 1
            y = layout.declared(parts)
            outs.append(y if y.dtype == self.out_dtype else y.astype(self.out_dtype))
        finals, k = [], 0
        for layout in self.states:
            finals.append(layout.declared([mx.squeeze(x, axis=0)
                                           for x in state[k:k + layout.components]]))
            k += layout.components
        return (*outs, *finals)


__all__ = ["COMPILE_MAX_STATE", "Decoder", "DecodeLayout", "arranged", "arrangement"]
