"""The pure-MLX backend: the rendered step programs run with MLX ops, one call per time step.

It runs on any MLX device (the Linux CPU included). It is not the reference: ``rec.reference``
evaluates the traced spec directly, without the rendered programs (``backends/reference.py``).
Forward keeps only the state at the start of every segment; backward walks segments newest to
oldest, recomputes the segment's states from its checkpoint with the same step function (so the
recomputed states are bit-identical), then sweeps the derived adjoint over the segment. A shared
state (without the lane axis) has size 1 along the lanes in the forward, and its adjoint one
share per lane in the backward (``adjoint``). ``backward`` returns the gradients of the
differentiable inputs only.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ..layout import (canonical_shape, expand_groups, expanded, from_canonical, reduce_to,
                      sum_groups, to_canonical)
from ..render.mlx_ops import render_mlx


class MLXBackend:
    name = "mlx"

    def __init__(self, rec):
        self.rec = rec
        spec = rec.spec
        self.forward_step = render_mlx(rec.forward_program, "forward_step")
        self._fwd = mx.compile(self.forward_step.fn)
        # where each step argument comes from
        self.origin = {}
        for slot, sym in spec.symbols.items():
            kind = "state" if slot.tensor in spec.states else "input"
            self.origin[sym] = (kind, slot)

    @functools.cached_property
    def backward_step(self):
        """The rendered adjoint step, on first use (a forward-only recurrence, such as the
        tangent recurrence of ``mx.jvp``, never derives its adjoint)."""
        adjoint = self.rec.adjoint
        for slot, sym in adjoint.output_cotangents.items():
            self.origin[sym] = ("d_output", slot)
        for slot, sym in adjoint.state_cotangents.items():
            self.origin[sym] = ("d_state", slot)
        return render_mlx(adjoint.program, "backward_step")

    @functools.cached_property
    def _bwd(self):
        return mx.compile(self.backward_step.fn)

    # -- helpers ------------------------------------------------------------------------------
    def _ones(self, sizes):
        """Ones over the state axis, for sums of terms constant over it."""
        return mx.ones((sizes[self.rec.spec.state_axis] if self.rec.spec.state_axis else 1,))

    def _canonical_inputs(self, inputs, sizes):
        """Inputs in the canonical layout, fp32 (bool and integer inputs too), with group axes
        expanded."""
        spec = self.rec.spec
        out = {}
        for t, x in zip(spec.inputs.values(), inputs):
            x = expand_groups(spec, t, x.astype(mx.float32), sizes)
            for c, part in enumerate(to_canonical(spec, expanded(spec, t), x)):
                out[(t.name, c)] = part
        return out

    def _shares(self, values, sizes):
        """Canonical values of states -> the per-lane shares of their adjoint: a shared state's
        value goes to lane 0, the other lanes start from zero (see ``adjoint``); a state with
        the lane axis keeps its value."""
        spec = self.rec.spec
        nb, lanes = len(spec.batch_axes), sizes[spec.lane]
        out = {}
        for (name, c), v in values.items():
            if not spec.states[name].has_lane and lanes > 1:
                pad = [(0, 0)] * v.ndim
                pad[nb] = (0, lanes - 1)
                v = mx.pad(v, pad)
            out[(name, c)] = v
        return out

    def _state_shapes(self, sizes):
        spec = self.rec.spec
        return {(t.name, c): canonical_shape(spec, t, sizes)
                for t in spec.states.values() for c in range(t.components)}

    def _canonical_states(self, states, sizes):
        spec = self.rec.spec
        shapes = self._state_shapes(sizes)
        out = {}
        for t, x in zip(spec.states.values(), states):
            for c, part in enumerate(to_canonical(spec, t, x.astype(mx.float32))):
                out[(t.name, c)] = mx.broadcast_to(part, shapes[(t.name, c)])
        return out

    def _args(self, step, t, state, canon_in, ones, extra=None):
        spec = self.rec.spec
        nb = len(spec.batch_axes)
        args = [ones] if step.needs_state_ones else []
        for sym in step.args:
            kind, slot = self.origin[sym]
            key = (slot.tensor, slot.component)
            if kind == "state":
                args.append(state[key])
            elif kind == "input":
                x = canon_in[key]
                args.append(x[(slice(None),) * nb + (t,)] if spec.inputs[slot.tensor].has_time else x)
            else:
                args.append(extra[(kind, key)])
        return args

    def _step_forward(self, t, state, canon_in, shapes, ones, fn=None):
        res = (fn or self._fwd)(*self._args(self.forward_step, t, state, canon_in, ones))
        new_state, outs = dict(state), {}
        for (kind, slot), r in zip(self.forward_step.results, res):
            key = (slot.tensor, slot.component)
            if kind == "state":
                new_state[key] = reduce_to(r, shapes[key])
            else:
                outs[key] = r
        return new_state, outs

    # -- passes -------------------------------------------------------------------------------
    def forward(self, inputs, states, sizes, seg, out_dtype, *, compiled=True):
        spec = self.rec.spec
        L, nb = sizes[spec.time], len(spec.batch_axes)
        shapes = self._state_shapes(sizes)
        ones = self._ones(sizes)
        canon_in = self._canonical_inputs(inputs, sizes)
        state = self._canonical_states(states, sizes)
        keys = list(state)
        checkpoints = {k: [] for k in keys}
        outs = {(s.tensor, s.component): [] for s in spec.output_slots()}
        for t in range(L):
            if t % seg == 0:
                for k in keys:
                    checkpoints[k].append(state[k])
            state, step_out = self._step_forward(
                t, state, canon_in, shapes, ones, None if compiled else self.forward_step.fn)
            for k, v in step_out.items():
                outs[k].append(v)
        outputs = []
        for t in spec.outputs.values():
            shape = canonical_shape(spec, t, sizes, with_time=False)
            parts = [mx.stack([reduce_to(v, shape) for v in outs[(t.name, c)]], axis=nb)
                     for c in range(t.components)]
            outputs.append(from_canonical(spec, t, parts, reduce_missing=False).astype(out_dtype))
        finals = [from_canonical(spec, t, [state[(t.name, c)] for c in range(t.components)], False)
                  for t in spec.states.values()]
        residuals = [mx.stack(checkpoints[k]) for k in keys]
        return outputs, finals, residuals

    def backward(self, inputs, states, residuals, d_outputs, d_finals, sizes, seg,
                 d_residuals=None):
        """Input and initial-state gradients. ``d_residuals`` (cotangents of the checkpoints,
        nonzero only when a gradient is differentiated again) join the state adjoint at the start
        of their segment."""
        spec = self.rec.spec
        L, nb = sizes[spec.time], len(spec.batch_axes)
        shapes = self._state_shapes(sizes)
        ones = self._ones(sizes)
        canon_in = self._canonical_inputs(inputs, sizes)
        keys = [(t.name, c) for t in spec.states.values() for c in range(t.components)]
        checkpoints = dict(zip(keys, residuals))
        # a shared state's adjoint is kept as one share per lane, summed at the end
        lam = self._shares(self._canonical_states(d_finals, sizes), sizes)
        lam_shapes = {k: v.shape for k, v in lam.items()}
        d_out = {}
        for t, g in zip(spec.outputs.values(), d_outputs):
            for c, part in enumerate(to_canonical(spec, t, g.astype(mx.float32))):
                d_out[(t.name, c)] = part
        differentiable = {k for k in canon_in if spec.inputs[k[0]].differentiable}
        step_grads = {k: [None] * L for k in differentiable if spec.inputs[k[0]].has_time}
        param_grads = {k: None for k in differentiable if not spec.inputs[k[0]].has_time}

        n_seg = -(-L // seg)
        for s in reversed(range(n_seg)):
            start, end = s * seg, min(L, (s + 1) * seg)
            state = {k: checkpoints[k][s] for k in keys}
            history = []
            for t in range(start, end):
                history.append(state)
                state, _ = self._step_forward(t, state, canon_in, shapes, ones)
            for t in reversed(range(start, end)):
                extra = {("d_state", k): lam[k] for k in keys}
                extra.update({("d_output", k): v[(slice(None),) * nb + (t,)] for k, v in d_out.items()})
                res = self._bwd(*self._args(self.backward_step, t, history[t - start], canon_in, ones, extra))
                new_lam = {}
                for (kind, slot), r in zip(self.backward_step.results, res):
                    key = (slot.tensor, slot.component)
                    if kind == "lambda":
                        new_lam[key] = reduce_to(r, lam_shapes[key])
                        continue
                    x = canon_in[key]
                    if key in step_grads:
                        step_grads[key][t] = reduce_to(r, x.shape[:nb] + x.shape[nb + 1:])
                    else:
                        g = reduce_to(r, x.shape)
                        param_grads[key] = g if param_grads[key] is None else param_grads[key] + g
                lam = new_lam
            if d_residuals is not None:
                seeds = self._shares({k: d_residuals[i][s] for i, k in enumerate(keys)}, sizes)
                lam = {k: lam[k] + seeds[k] for k in keys}

        grads = []  # of the differentiable inputs
        for t, x in zip(spec.inputs.values(), inputs):
            if not t.differentiable:
                continue
            parts = []
            for c in range(t.components):
                key = (t.name, c)
                parts.append(mx.stack(step_grads[key], axis=nb) if key in step_grads else param_grads[key])
            g = from_canonical(spec, expanded(spec, t), parts, reduce_missing=True)
            grads.append(sum_groups(spec, t, g, sizes).astype(x.dtype))
        d_init = []
        for t, x in zip(spec.states.values(), states):
            parts = [lam[(t.name, c)] for c in range(t.components)]
            if not t.has_lane:  # the sum of the lanes' shares
                parts = [mx.sum(p, axis=nb, keepdims=True) for p in parts]
            d_init.append(from_canonical(spec, t, parts, False).astype(x.dtype))
        return grads, d_init

