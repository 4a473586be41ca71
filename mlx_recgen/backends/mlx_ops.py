"""The pure-MLX backend: the step programs run with MLX ops, on any MLX device.

It is the reference the kernels are held to, and the backend of machines without Metal or CUDA
(the Linux CPU included). Forward keeps only the state at the start of every segment of ``seg``
steps; backward walks the segments newest to oldest, recomputes the segment's states from its
checkpoint with the forward's own functions (so they are bit-identical), then sweeps the derived
adjoint over the segment.

How the time loop is computed is a *form*; ``MLXBackend.form`` (``mlx_backend.py``) is the one
place where the form of a call is chosen, from the schedule that ``schedule.choose`` picked.
This module holds the first form; the plumbing the forms share is ``mlx_blocks.py``, and the
decode path of short calls ``mlx_decode.py``. Three forms:

* ``SequentialForm``, for any spec. Each step program is split (``phases.split``) around its
  carry (the state forward, ``λ`` backward): only the carry chain runs step by step, with as few
  MLX ops per step as the chain needs; the carry-free part of the chain (``pre``) and everything
  that is not the carry (``post``: outputs, input gradients and their reductions over lanes and
  batch) run once per segment on arrays with a leading time axis. Inputs are laid out time-major
  once per call, so a segment is one slice and its steps one split.
* ``ChunkedForm`` (``mlx_chunked.py``), for state-affine specs (``schedule="chunked"``): within
  a segment the states of all steps come from an associative scan of the per-step affine maps
  in ``log2(seg)`` rounds of MLX ops; the backward differentiates that scan per segment.
* ``MatrixForm`` (``mlx_matrix.py``), for specs of the matrix form (``schedule="matrix"``):
  chunkwise matrix products (``matrix.analyse``), differentiated by MLX.

Group axes are expanded (``layout.expand_groups``) and their gradients summed back over the
group; bool and integer inputs are read as fp32 and get no gradient (``backward`` returns the
gradients of the differentiable inputs only). A shared state (without the lane axis) has size 1
along the lanes in the forward, and its adjoint one share per lane in the backward, lane 0
seeded with the cotangent (see ``adjoint``), summed over lanes for the initial state's gradient.

Under ``mx.grad``, ``mx.vmap`` and inside any VJP, MLX traces every array and runs an
``mx.compile``d function as plain ops, so the ops per step are what counts there; a call outside
any transform runs each forward segment as compiled calls of at most ``unroll`` steps.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..layout import (canonical_shape, expand_groups, expanded, from_time_major, sum_groups, sum_to,
                      to_time_major)
from ..memo import LRU
from ..phases import Phases, split
from ..render.mlx_ops import MLXStep, render_mlx
from .mlx_blocks import Block, SymbolTable, computed_after, concat, fit, write


@dataclass
class _Chain:
    """A split step program and its rendered phases."""

    phases: Phases
    pre: MLXStep
    sweep: MLXStep
    post: MLXStep
    carry: list  # the carry symbols, in the order of the sweep's stores
    reverse: bool  # the chain runs from the last step to the first (the adjoint)


def _split_steps(x, steps: int, rank: int) -> list:
    """Per-step slices of ``x`` (``rank`` axes with the time axis), or ``x`` for every step.

    One slice per step rather than ``mx.split``: the backward recomputes the forward's splits,
    and ``mx.compile`` (MLX 0.32.4) fails with ``IndexError: _Map_base::at`` when it merges two
    equal multi-output ``Split`` nodes, which it does under ``mx.compile(mx.grad(...))``.
    Single-output slices merge cleanly."""
    if not isinstance(x, mx.array) or x.ndim < rank:
        return [x] * steps
    return [x] if steps == 1 else [x[j:j + 1] for j in range(steps)]


def _power_runs(start: int, stop: int, longest: int):
    """``[lo, hi)`` runs covering ``[start, stop)``, each a power of two of steps, at most
    ``longest`` (a power of two), longest first. A compiled forward block is traced once per
    length: runs of power-of-two lengths leave ``log2(longest) + 1`` traces per shape of the
    other axes, whatever the lengths of the calls."""
    lo = start
    while lo < stop:
        hi = lo + min(longest, 1 << ((stop - lo).bit_length() - 1))
        yield lo, hi
        lo = hi


# The compiled forward blocks a form keeps: one per shape of the axes other than time.
COMPILED_SIZES = 16


class SequentialForm:
    """Step by step within a segment; per segment, the ``pre`` and ``post`` phases batched."""

    name = "sequential"
    unroll = 64  # the most steps one compiled forward call unrolls (a segment may be longer)

    def __init__(self, rec, table: SymbolTable):
        self.rec, self.table = rec, table
        spec, namer = rec.spec, rec.ir.namer
        fwd = split(rec.forward_program, table.states, "state", namer)
        bwd = split(rec.adjoint.program, table.lambdas, "lambda", namer)
        self.forward_chain = self._chain(fwd, "forward", spec.symbols, reverse=False)
        self.backward_chain = self._chain(bwd, "backward", rec.adjoint.state_cotangents,
                                          reverse=True)
        # compiled forward blocks by the call's sizes less the time axis: one compiled function
        # per shape of the other axes, its traces one per block length (at most ``unroll``)
        self._compiled_blocks = LRU(COMPILED_SIZES)

    @staticmethod
    def _chain(phases, name, symbol_of_slot, reverse) -> _Chain:
        sweep = render_mlx(phases.sweep, f"{name}_sweep")
        return _Chain(phases, render_mlx(phases.pre, f"{name}_pre", returns=phases.pre_values),
                      sweep, render_mlx(phases.post, f"{name}_post"),
                      [symbol_of_slot[slot] for _, slot in sweep.results], reverse)

    def sources(self) -> str:
        """The rendered phases, for inspection."""
        return "\n".join(c.source for ch in (self.forward_chain, self.backward_chain)
                         for c in (ch.pre, ch.sweep, ch.post))

    # -- plumbing ------------------------------------------------------------------------------
    def _call(self, step: MLXStep, env: dict, block: Block):
        """Call a rendered phase, its arguments from ``env``, else from ``block``."""
        args = [block.ones] if step.needs_state_ones else []
        for sym in step.args:
            args.append(env[sym] if sym in env else block.values[self.table.key[sym][1]])
        return step.fn(*args)

    def _slice(self, values: dict, start: int, end: int, ones) -> Block:
        """The block of steps [start, end) of the call's arrays."""
        spec = self.rec.spec
        timed = {k for k in values if k[0] not in spec.inputs or spec.inputs[k[0]].has_time}
        return Block({k: x[start:end] if k in timed else x for k, x in values.items()},
                      end - start, ones)

    def _rank(self) -> int:
        return len(self.rec.spec.batch_axes) + 3

    def _run_chain(self, chain: _Chain, carry: dict, block: Block, env: dict, per_step: dict,
                   final: bool = True):
        """Run a carry chain over the steps of ``block``. ``env`` holds block values besides the
        block's own (with a time axis), ``per_step`` lists of per-step values. Returns the
        carries that entered each step, in time order, and (with ``final``) the carry after the
        chain."""
        steps, rank = block.steps, self._rank()
        pre = self._call(chain.pre, env, block)
        slices = {s: _split_steps(v, steps, rank) for s, v in zip(chain.phases.pre_values, pre)}
        position = {s: i for i, s in enumerate(chain.carry)}
        columns = [] if not chain.sweep.needs_state_ones else [(None, [block.ones] * steps)]
        for sym in chain.sweep.args:
            if sym in position:
                columns.append((position[sym], None))
            elif sym in slices:
                columns.append((None, slices[sym]))
            else:
                columns.append((None, per_step[sym] if sym in per_step else _split_steps(
                    env[sym] if sym in env else block.values[self.table.key[sym][1]], steps, rank)))
        state = [carry[s] for s in chain.carry]
        shapes = [x.shape for x in state]
        fn = chain.sweep.fn
        order = list(reversed(range(steps)) if chain.reverse else range(steps))
        entered = [None] * steps
        for j in order:
            entered[j] = state
            if j == order[-1] and not final:
                break
            new = fn(*[state[i] if i is not None else col[j] for i, col in columns])
            state = [fit(x, sh) for x, sh in zip(new, shapes)]
        entered = [dict(zip(chain.carry, c)) for c in entered]
        return entered, (dict(zip(chain.carry, state)) if final else None)

    def _stacked(self, entered: list, symbols) -> dict:
        return {s: concat([c[s] for c in entered]) for s in symbols}

    def _initial(self, arrays, symbols, sizes) -> dict:
        """Carries ``(1, *step shape)`` from arrays in the declared state layout."""
        spec = self.rec.spec
        by_tensor = dict(zip(spec.states, arrays))
        out = {}
        for sym in symbols:
            tensor, c = self.table.key[self.table.state_of.get(sym, sym)][1]
            part = to_time_major(spec, spec.states[tensor], by_tensor[tensor].astype(mx.float32))[c]
            out[sym] = mx.broadcast_to(part, (1, *self.table.step_shape(sym, sizes)))
        return out

    def _shares(self, carry: dict, sizes) -> dict:
        """Adjoint carries of shared states spread over the lanes as shares: the value on lane 0,
        zeros on the others (the other carries unchanged)."""
        spec = self.rec.spec
        lane_axis, lanes = 1 + len(spec.batch_axes), sizes[spec.lane]
        out = {}
        for sym, v in carry.items():
            tensor = self.table.key[self.table.state_of.get(sym, sym)][1][0]
            if not spec.states[tensor].has_lane and lanes > 1:
                pad = [(0, 0)] * v.ndim
                pad[lane_axis] = (0, lanes - 1)
                v = mx.pad(v, pad)
            out[sym] = v
        return out

    def _declared(self, carry: dict, symbols) -> list:
        """Carries -> arrays in the declared state layout (a shared state's adjoint shares
        summed over the lanes)."""
        spec = self.rec.spec
        lane_axis = len(spec.batch_axes)
        by_slot = {}
        for s in symbols:
            slot = self.table.key[self.table.state_of.get(s, s)][1]
            v = mx.squeeze(carry[s], axis=0)  # not [0]: a gather, whose vjp has no jvp
            if not spec.states[slot[0]].has_lane and v.shape[lane_axis] != 1:
                v = mx.sum(v, axis=lane_axis, keepdims=True)
            by_slot[slot] = v
        return [from_time_major(spec, t, [by_slot[(t.name, c)] for c in range(t.components)], False)
                for t in spec.states.values()]

    def _time_major(self, tensors, arrays, sizes) -> dict:
        """Arrays by (tensor, component), time-major and fp32 (bool and integer inputs too),
        with group axes expanded."""
        spec = self.rec.spec
        out = {}
        for t, x in zip(tensors, arrays):
            x = expand_groups(spec, t, x.astype(mx.float32), sizes)
            for c, part in enumerate(to_time_major(spec, expanded(spec, t), x)):
                out[(t.name, c)] = part
        return out

    def _ones(self, sizes):
        spec = self.rec.spec
        return mx.ones((sizes[spec.state_axis] if spec.state_axis else 1,))

    # -- forward -------------------------------------------------------------------------------
    def _forward_block(self, carry: dict, block: Block, sizes):
        """The outputs of a block of steps (time-major) and the carry after it."""
        spec = self.rec.spec
        entered, carry = self._run_chain(self.forward_chain, carry, block, {}, {})
        stacked = self._stacked(entered, self.table.states)
        outs = self._call(self.forward_chain.post, stacked, block)
        blocks = [fit(y, (block.steps, *canonical_shape(spec, spec.outputs[slot.tensor], sizes,
                                                          with_time=False)))
                  for (_, slot), y in zip(self.forward_chain.post.results, outs)]
        return blocks, carry

    def _forward_block_arrays(self, keys, sizes, *arrays):
        """``_forward_block`` over flat arrays (carries, then the block's values by ``keys``), the
        form ``mx.compile`` takes; ``keys`` and ``sizes`` are constants of the compiled function."""
        n = len(self.table.states)
        carry = dict(zip(self.table.states, arrays[:n]))
        values = dict(zip(keys, arrays[n:]))
        steps = next((x.shape[0] for k, x in values.items() if self.rec.spec.inputs[k[0]].has_time), 1)
        sizes = dict(sizes)
        blocks, carry = self._forward_block(carry, Block(values, steps, self._ones(sizes)), sizes)
        return (*blocks, *(carry[s] for s in self.table.states))

    def forward(self, inputs, states, sizes, seg, out_dtype):
        spec, table = self.rec.spec, self.table
        L = sizes[spec.time]
        values = self._time_major(spec.inputs.values(), inputs, sizes)
        keys = tuple(values)
        # the block's sizes but the time axis: a new length reuses the compiled function
        frozen_sizes = tuple(sorted((a, n) for a, n in sizes.items() if a != spec.time))
        compiled = self._compiled_blocks.get_or_build(
            (keys, frozen_sizes), lambda: mx.compile(self._forward_block_arrays))
        carry = self._initial(states, table.states, sizes)
        n_out = len(self.forward_chain.post.results)
        checkpoints, buffers = [], [None] * n_out
        for start in range(0, L, seg):
            checkpoints.append(carry)
            for lo, hi in _power_runs(start, min(L, start + seg), self.unroll):
                block = self._slice(values, lo, hi, None)
                res = compiled(keys, frozen_sizes, *(carry[s] for s in table.states),
                                           *(block.values[k] for k in keys))
                buffers = [write(b, y, lo, L) for b, y in zip(buffers, res[:n_out])]
                carry = computed_after(dict(zip(table.states, res[n_out:])), res[:n_out])
        return self._forward_results(buffers, checkpoints, carry, out_dtype)

    def _forward_results(self, buffers, checkpoints, carry, out_dtype):
        """(outputs, final states, residuals) of a forward: the output buffers (time-major, in
        the order of the forward's ``post`` stores) in their declared layouts, and the
        checkpoints stacked per state."""
        table = self.table
        residuals = [concat([c[s] for c in checkpoints]) for s in table.states]
        parts = {(slot.tensor, slot.component): b
                 for (_, slot), b in zip(self.forward_chain.post.results, buffers)}
        return self._outputs(parts, out_dtype), self._declared(carry, table.states), residuals

    def _outputs(self, parts: dict, out_dtype) -> list:
        """The outputs in their declared layouts, from time-major parts by (tensor,
        component)."""
        spec = self.rec.spec
        return [from_time_major(spec, t, [parts[(t.name, c)] for c in range(t.components)],
                                reduce_missing=False).astype(out_dtype)
                for t in spec.outputs.values()]

    # -- backward ------------------------------------------------------------------------------
    def backward(self, inputs, states, residuals, d_outputs, d_finals, sizes, seg,
                 d_residuals=None):
        """Input and initial-state gradients. ``d_residuals`` (cotangents of the checkpoints,
        nonzero only when a gradient is differentiated again) join the state adjoint at the
        start of their segment."""
        spec, table = self.rec.spec, self.table
        L = sizes[spec.time]
        values = self._time_major(spec.inputs.values(), inputs, sizes)
        values.update(self._time_major(spec.outputs.values(), d_outputs, sizes))
        ones = self._ones(sizes)
        lam = self._shares(self._initial(d_finals, table.lambdas, sizes), sizes)
        checkpoints = dict(zip(table.states, residuals))
        step_grads, param_grads = {}, {}  # time blocks written into one buffer; sums
        for s in reversed(range(-(-L // seg))):
            block = self._slice(values, s * seg, min(L, (s + 1) * seg), ones)
            carry = {sym: checkpoints[sym][s:s + 1] for sym in table.states}
            entered, _ = self._run_chain(self.forward_chain, carry, block, {}, {}, final=False)
            lam, grads = self._backward_segment(entered, lam, block, sizes)
            if d_residuals is not None:
                seeds = self._shares({l: d_residuals[i][s:s + 1]
                                      for i, l in enumerate(table.lambdas)}, sizes)
                lam = {l: lam[l] + seeds[l] for l in table.lambdas}
            lam = computed_after(lam, list(grads.values()))
            self._collect(grads, step_grads, param_grads, s * seg, L)
        grads = self._input_grads(inputs, step_grads, param_grads, sizes)
        d_init = [d.astype(x.dtype) for d, x in zip(self._declared(lam, table.lambdas), states)]
        return grads, d_init

    def _collect(self, grads: dict, step_grads: dict, param_grads: dict, start: int, L: int):
        """Add one segment's gradient blocks: per-step ones written at ``start`` along time,
        parameter ones summed."""
        for key, g in grads.items():
            if self.rec.spec.inputs[key[0]].has_time:
                step_grads[key] = write(step_grads.get(key), g, start, L)
            else:
                param_grads[key] = g + param_grads[key] if key in param_grads else g

    def _input_grads(self, inputs, step_grads: dict, param_grads: dict, sizes) -> list:
        """The gradients of the differentiable inputs in their declared layouts (group axes
        summed back over their groups)."""
        spec = self.rec.spec
        grads = []
        for t, x in zip(spec.inputs.values(), inputs):
            if not t.differentiable:
                continue
            parts = [(step_grads if t.has_time else param_grads)[(t.name, c)]
                     for c in range(t.components)]
            g = from_time_major(spec, expanded(spec, t), parts, reduce_missing=True)
            grads.append(sum_groups(spec, t, g, sizes).astype(x.dtype))
        return grads

    def _backward_segment(self, entered: list, lam: dict, block: Block, sizes):
        """λ before the segment and the input-gradient blocks of the segment, given the states
        that entered each of its steps and λ after it."""
        spec, table = self.rec.spec, self.table
        stacked = self._stacked(entered, table.states)
        per_step = {s: [c[s] for c in entered] for s in table.states}
        lams, lam = self._run_chain(self.backward_chain, lam, block, stacked, per_step)
        env = dict(stacked)
        env.update(self._stacked(lams, table.lambdas))
        outs = self._call(self.backward_chain.post, env, block)
        grads = {}
        for (_, slot), g in zip(self.backward_chain.post.results, outs):
            t = spec.inputs[slot.tensor]
            shape = canonical_shape(spec, expanded(spec, t), sizes, with_time=False)
            grads[(slot.tensor, slot.component)] = sum_to(g, (block.steps, *shape) if t.has_time
                                                          else shape)
        return lam, grads

