"""The reference: the traced spec evaluated directly on MLX arrays, one time step at a time.

It shares nothing with the compiler past tracing: no lowering, no derived adjoint, no printer,
no canonical layout. Each step evaluates the spec's own sympy expressions
(``Spec.state_updates``, ``Spec.output_exprs``) node by node with MLX ops, ``Reduce(body)``
being a sum of ``body`` over the state axis; MLX autodiff differentiates the loop (it stores
every state). So a bug in the lowering, the adjoint or a renderer shows up as a difference
between a backend and this loop.

Values are laid out along ``(batch axes..., lane, state axis)`` with size 1 where a tensor
lacks an axis (a shared state has size 1 along the lanes), one array per component; an input
with a group axis is repeated over the members of each group; bool and integer inputs are
converted to fp32; the state and all arithmetic are fp32.
"""

from __future__ import annotations

import math
from functools import reduce

import mlx.core as mx
import sympy
from sympy.codegen.cfunctions import log1p

from ..functions import sigmoid, softplus
from ..spec import Reduce, Slot

_UNARY = {
    sympy.exp: mx.exp, sympy.log: mx.log, log1p: mx.log1p, sympy.tanh: mx.tanh,
    sympy.sin: mx.sin, sympy.cos: mx.cos, sympy.Abs: mx.abs, sigmoid: mx.sigmoid,
    softplus: lambda x: mx.logaddexp(x, 0.0),
}
_RELATIONS = {
    sympy.StrictGreaterThan: mx.greater, sympy.GreaterThan: mx.greater_equal,
    sympy.StrictLessThan: mx.less, sympy.LessThan: mx.less_equal, sympy.Eq: mx.equal,
    sympy.Ne: mx.not_equal,
}


def _array(v):
    """An evaluated value as an array (constants evaluate to Python floats)."""
    return v if isinstance(v, mx.array) else mx.array(v, dtype=mx.float32)


class Evaluator:
    """Evaluates sympy expressions of one step on MLX arrays.

    ``env`` maps the spec's symbols to arrays; ``vector_shape`` is the full shape of a
    pointwise value (the sum of a ``Reduce`` runs over its last axis). Shared subexpressions
    are evaluated once per evaluator."""

    def __init__(self, env: dict, vector_shape: tuple):
        self.env, self.vector_shape, self.memo = env, vector_shape, {}

    def __call__(self, e):
        if e not in self.memo:
            self.memo[e] = self._eval(e)
        return self.memo[e]

    def _eval(self, e):
        if isinstance(e, sympy.Symbol):
            return self.env[e]
        if e is sympy.true or e is sympy.false:
            return mx.array(bool(e))
        if e.is_Number or isinstance(e, sympy.NumberSymbol):
            return float(e)  # nan and +-inf included
        args = e.args
        if isinstance(e, sympy.Add):
            return reduce(lambda a, b: a + b, map(self, args))
        if isinstance(e, sympy.Mul):
            return reduce(lambda a, b: a * b, map(self, args))
        if isinstance(e, sympy.Pow):
            base, ex = self(args[0]), args[1]
            if ex == sympy.Rational(1, 2):
                return mx.sqrt(base)
            if ex == sympy.Rational(-1, 2):
                return mx.rsqrt(base)
            return mx.power(base, self(ex))
        if isinstance(e, Reduce):  # over the state axis only: a lane-free body stays lane-free
            body, full = _array(self(args[0])), self.vector_shape
            body = body.reshape((1,) * (len(full) - body.ndim) + body.shape)
            return mx.sum(mx.broadcast_to(body, (*body.shape[:-1], full[-1])), axis=-1,
                          keepdims=True)
        if e.func in _UNARY:
            return _UNARY[e.func](self(args[0]))
        if isinstance(e, sympy.Piecewise):
            value, cond = args[-1]
            out = self(value) if cond == sympy.true else mx.where(self(cond), self(value), math.nan)
            for value, cond in reversed(args[:-1]):
                out = mx.where(self(cond), self(value), out)
            return out
        if type(e) in _RELATIONS:
            return _RELATIONS[type(e)](*map(self, args))
        if isinstance(e, sympy.And):
            return reduce(mx.logical_and, map(self, args))
        if isinstance(e, sympy.Or):
            return reduce(mx.logical_or, map(self, args))
        if isinstance(e, sympy.Not):
            return mx.logical_not(self(args[0]))
        if isinstance(e, sympy.ITE):
            return mx.where(*map(self, args))
        raise TypeError(f"the reference cannot evaluate {e!r} ({type(e).__name__})")


def _to_steps(x, axes, order, sizes, time=None):
    """A declared-layout array -> one array per component laid out along ``order`` (size 1 on
    the axes ``axes`` lacks), with the time axis first when ``time`` is among ``axes``."""
    axes = list(axes)
    lead = [time] if time is not None and time in axes else []
    comp = next((i for i, a in enumerate(axes) if isinstance(a, int)), None)
    parts = [x] if comp is None else [x[(slice(None),) * comp + (c,)] for c in range(axes[comp])]
    if comp is not None:
        del axes[comp]
    present = lead + [a for a in order if a in axes]
    shape = [sizes[a] for a in lead] + [sizes[a] if a in axes else 1 for a in order]
    perm = [axes.index(a) for a in present]
    return [mx.reshape(mx.transpose(p, perm), shape) for p in parts]


def _to_declared(parts, src, axes):
    """Arrays laid out along ``src`` (one per component) -> the declared layout ``axes``."""
    x = mx.stack(parts, axis=-1) if len(parts) > 1 else parts[0]
    src = list(src) + ([None] if len(parts) > 1 else [])
    return mx.transpose(x, [src.index(None if isinstance(a, int) else a) for a in axes])


def run_reference(rec, inputs, states, sizes, out_dtype):
    """Outputs (in ``out_dtype``) and final states (fp32) of the spec on ``inputs`` from the
    initial ``states``, all in their declared layouts."""
    spec = rec.spec
    order = [*spec.batch_axes, spec.lane] + ([spec.state_axis] if spec.state_axis else [])
    full = tuple(sizes[a] for a in order)
    scalar_shape = full[:-1] + (1,) if spec.state_axis else full

    lane_at = len(spec.batch_axes)
    step_inputs = {}  # symbol -> (array, whether it has the time axis first)
    for t, x in zip(spec.inputs.values(), inputs):
        x, axes = x.astype(mx.float32), list(t.axes)
        for i, a in enumerate(t.axes):  # a group axis: each group's slice for all its members
            if a in spec.groups:
                x = mx.repeat(x, sizes[spec.groups[a]] // sizes[a], axis=i)
                axes[i] = spec.groups[a]
        parts = _to_steps(x, axes, order, sizes, spec.time)
        for c, part in enumerate(parts):
            step_inputs[spec.symbols[Slot(t.name, c)]] = (part, t.has_time)

    def state_shape(t):  # a shared state (without the lane axis) has one value per instance
        shape = list(full if t.has_state_axis else scalar_shape)
        if not t.has_lane:
            shape[lane_at] = 1
        return shape

    state = {}
    for t, x in zip(spec.states.values(), states):
        for c, part in enumerate(_to_steps(x.astype(mx.float32), t.axes, order, sizes)):
            state[Slot(t.name, c)] = mx.broadcast_to(part, state_shape(t))

    # one array per step from a split: its derivatives (a concatenation) have derivatives too,
    # where those of integer indexing (a scatter) have no forward mode
    L = sizes[spec.time]
    per_step = {sym: ([p.squeeze(0) for p in mx.split(x, L, axis=0)] if timed else None)
                for sym, (x, timed) in step_inputs.items()}
    outs = {slot: [] for slot in spec.output_exprs}
    for step in range(L):
        env = {sym: (per_step[sym][step] if timed else x) for sym, (x, timed) in step_inputs.items()}
        env.update({spec.symbols[slot]: v for slot, v in state.items()})
        ev = Evaluator(env, full)
        for slot, e in spec.output_exprs.items():
            outs[slot].append(mx.broadcast_to(_array(ev(e)), scalar_shape))
        state = {slot: mx.broadcast_to(_array(ev(e)), state_shape(spec.states[slot.tensor]))
                 for slot, e in spec.state_updates.items()}

    lane_order = [*spec.batch_axes, spec.lane]
    outputs = []
    for t in spec.outputs.values():
        parts = [mx.stack([v.reshape(v.shape[:len(lane_order)]) for v in outs[Slot(t.name, c)]])
                 for c in range(t.components)]
        outputs.append(_to_declared(parts, [spec.time, *lane_order], t.axes).astype(out_dtype))
    finals = []
    for t in spec.states.values():
        src = [a for a in (order if t.has_state_axis else lane_order) if a in t.axes]
        parts = [state[Slot(t.name, c)].reshape([sizes[a] for a in src])
                 for c in range(t.components)]
        finals.append(_to_declared(parts, src, t.axes))
    return outputs, finals

