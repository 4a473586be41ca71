"""The chunked form of the pure-MLX backend: time in parallel for state-affine recurrences.

For a spec that ``affine.analyse`` finds time-parallel, every state update is ``h' = M h + b``
with ``M`` and ``b`` free of the state and ``M`` block-diagonal over the state index. Within a
segment of ``seg`` steps:

* the per-step multipliers ``M_t`` (one ``K x K`` block per group of mixed slots, entries
  scalar per lane or per state element) and offsets ``b_t = F(0)`` come from one call of the
  step maps program (``affine.step_maps_program``) on time-stacked inputs;
* the segment's checkpoint enters the first offset (``b_0 <- M_0 h_0 + b_0``) and an inclusive
  Hillis-Steele scan composes the affine maps over time in ``ceil(log2 seg)`` rounds of MLX ops,
  ``(A2, b2) o (A1, b1) = (A2 A1, A2 b1 + b2)`` (elementwise for scalar blocks, explicit sums of
  products for ``K x K`` blocks), giving the state after every step. Its products are
  ``affine``'s (``compose_multipliers``, ``apply_multiplier``: a zero state is no term), so
  that overflow, underflow and infinite gates give what the sequential steps give, and its VJP
  is the recurrence's (``_scan_function``);
* the outputs are evaluated for the whole segment from the stacked states after each step
  where they read the old state only through its update (``affine.outputs_of_updated_state``:
  one cotangent per updated state, as in the sequential steps), else by the forward program's
  ``post`` phase (``phases.split``) from the stacked states that entered each step.

Checkpoints are the states at segment starts, laid out as the sequential form's. The backward
walks the segments newest first: it recomputes a segment from its checkpoint with the same
scan and lets MLX autodiff take the VJP of that vectorized computation, seeded with the
outputs' cotangents and ``λ`` at the segment end (the cotangent of its end state); the VJP's
cotangent of the checkpoint is ``λ`` at the segment start. Memory stays at one segment; the
gradients of inputs without the time axis are summed over segments.
"""

from __future__ import annotations

import functools

import mlx.core as mx

from ..affine import outputs_of_updated_state
from ..layout import canonical_shape
from ..render.mlx_ops import render_mlx
from .mlx_blocks import Block, computed_after, concat, fit, write
from .mlx_ops import SequentialForm


def _shift(x, d: int, fill: float):
    """``x`` delayed by ``d`` steps along the time axis, the first ``d`` steps ``fill``."""
    pad = mx.full((d, *x.shape[1:]), fill, dtype=x.dtype)
    return mx.concatenate([pad, x[:-d]], axis=0)


# The chunked schedule's products (``affine.py``; the kernels' ``recgen_compose`` and
# ``recgen_apply``; ``scale`` is resolved symbolically in the step maps): IEEE's, but a zero state
# is no term. Their derivatives are the product's (``d/dh = p`` at ``h == 0`` too), so they carry
# their own VJP and JVP.
_SMALLEST_NORMAL = 1.17549435e-38


def _sum_to(g, shape):
    """``g`` summed over the axes that broadcasting added to an array of ``shape``."""
    g = g.sum(axis=tuple(range(g.ndim - len(shape)))) if g.ndim > len(shape) else g
    axes = tuple(i for i, (n, m) in enumerate(zip(shape, g.shape)) if n == 1 and m != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


def _product(value):
    """``value(x, y)``, differentiated as ``x * y``."""
    f = mx.custom_function(value)

    @f.vjp
    def _(primals, cotangent, output):
        x, y = primals
        return _sum_to(cotangent * y, x.shape), _sum_to(cotangent * x, y.shape)

    @f.jvp
    def _(primals, tangents):
        (x, y), (dx, dy) = primals, tangents
        return dx * y + x * dy

    return f


@_product
def compose_multipliers(m, p):
    """``m`` times a product of multipliers: a zero ``p`` is no term (NaN for a NaN ``m``), and
    a product of nonzero factors that underflows is the smallest normal float with its sign."""
    r = mx.where((p == 0) & (m == m), 0.0, m * p)
    tiny = mx.where((m < 0) != (p < 0), -_SMALLEST_NORMAL, _SMALLEST_NORMAL)
    return mx.where((r == 0) & (m != 0) & (p != 0), tiny, r)


@_product
def apply_multiplier(p, h):
    """A composed multiplier applied to a state: 0 for a zero state whatever ``p``."""
    return mx.where(h == 0, 0.0, p * h)


def _timed(x, T: int, rank: int):
    """``x`` with a leading time axis of ``T`` steps and ``rank`` axes in all (other axes are
    left to broadcasting)."""
    x = x if isinstance(x, mx.array) else mx.array(x, dtype=mx.float32)
    if x.ndim < rank:
        x = x.reshape((1,) * (rank - x.ndim) + tuple(x.shape))
    return x if x.shape[0] == T else mx.broadcast_to(x, (T, *x.shape[1:]))


def _hillis_steele(A: list, b: list, Z=None) -> list:
    """The offsets of the inclusive scan of ``h <- A_t h + b_t``: round ``d`` composes every map
    with the one ``d`` steps before it. ``Z``: per step, whether a non-finite multiplier meets
    the zero state a step's own map starts from (``affine.zero_hit``); composed, it says
    whether the sequential steps from the first step met ``inf * 0`` or ``NaN * 0``, and those
    states are NaN."""
    K, T = len(b), b[0].shape[0]
    d = 1
    while d < T:
        last = 2 * d >= T
        Ab = [[_shift(A[k][j], d, 1.0 if k == j else 0.0) for j in range(K)] for k in range(K)]
        bb = [_shift(x, d, 0.0) for x in b]
        if Z is not None:  # the earlier maps' hits, and the later ones' where they start at 0
            zero = functools.reduce(mx.logical_and, [x == 0 for x in bb])
            Z = mx.logical_or(_shift(Z, d, False), mx.logical_and(zero, Z))
        b = [sum((apply_multiplier(A[i][k], bb[k]) for k in range(K)), start=b[i])
             for i in range(K)]
        if not last:
            A = [[sum((compose_multipliers(A[i][k], Ab[k][j]) for k in range(1, K)),
                      start=compose_multipliers(A[i][0], Ab[0][j]))
                  for j in range(K)] for i in range(K)]
        d *= 2
    return b if Z is None else [mx.where(Z, mx.nan, x) for x in b]


def _newest_first(x):
    return x[::-1]


def _next(x, fill: float):
    """``x`` advanced by one step along the time axis, the last step ``fill``."""
    pad = mx.full((1, *x.shape[1:]), fill, dtype=x.dtype)
    return mx.concatenate([x[1:], pad], axis=0)


@functools.lru_cache(maxsize=None)
def _scan_function(K: int):
    """``affine_scan`` over flat arguments (``A`` row-major, then ``b``), with the VJP of the
    recurrence rather than of the scan's rounds: ``λ_t = ḡ_t + A_{t+1}ᵀ λ_{t+1}`` by the same
    scan, newest step first, then ``db_t = λ_t`` and ``dA_t = λ_t h_{t-1}ᵀ`` — one product
    per step, as the sequential steps form it (the rounds' products of infinite and zero
    cotangents would be NaN)."""
    def split(arrays):
        return ([list(arrays[i * K:(i + 1) * K]) for i in range(K)],
                list(arrays[K * K:K * K + K]), arrays[-1])

    f = mx.custom_function(lambda *arrays: tuple(_hillis_steele(*split(arrays))))

    @f.vjp
    def _(primals, cotangents, outputs):
        A, b, Z = split(primals)
        T = b[0].shape[0]
        At = [[_newest_first(_next(A[j][i], 1.0 if i == j else 0.0)) for j in range(K)]
              for i in range(K)]
        lam = [_newest_first(x) for x in _hillis_steele(At, [_newest_first(g) for g in cotangents])]
        before = [_shift(h, 1, 0.0) if T > 1 else mx.zeros_like(h) for h in outputs]
        first = (mx.arange(T) == 0).reshape((T,) + (1,) * (lam[0].ndim - 1))
        dA = [_sum_to(mx.where(first, 0.0, lam[i] * before[j]), A[i][j].shape)
              for i in range(K) for j in range(K)]
        return (*dA, *(_sum_to(g, x.shape) for g, x in zip(lam, b)), mx.zeros_like(Z))

    return f


def affine_scan(A: list, b: list, Z=None) -> list:
    """The inclusive scan of the affine maps ``h <- A_t h + b_t`` over the leading (time) axis:
    ``A`` is a ``K x K`` list of arrays, ``b`` a list of ``K`` arrays; returns, for every ``t``,
    the offsets of the composed map ``(A_t, b_t) o ... o (A_0, b_0)`` (Hillis-Steele). ``Z``
    (bool, default none): the steps whose multiplier is not finite (see ``_hillis_steele``)."""
    K = len(b)
    if Z is None:
        Z = mx.zeros(b[0].shape[:1] + (1,) * (b[0].ndim - 1), dtype=mx.bool_)
    return list(_scan_function(K)(*(x for row in A for x in row), *b, Z))


class ChunkedForm(SequentialForm):
    """Per segment, the states of all its steps by an associative scan of the affine maps."""

    name = "chunked"

    def __init__(self, rec, table):
        super().__init__(rec, table)
        self.form = rec.affine
        self.products = rec.segment_summary.products
        self.maps = render_mlx(rec.segment_summary.maps, "step_maps")
        after = outputs_of_updated_state(rec.ir)
        self.outputs_after = after and render_mlx(after, "outputs_after")
        if self.outputs_after:  # its results in the post phase's order
            order = [slot for _, slot in self.outputs_after.results]
            self.after_order = [order.index(slot) for _, slot in self.forward_chain.post.results]
        self.slot_index = {}  # the step maps' stores, by (tensor, component) or (block, row, col)
        for i, (_, slot) in enumerate(self.maps.results):
            self.slot_index[slot] = i

    # -- one segment ---------------------------------------------------------------------------
    def _segment(self, carry: dict, block: Block, sizes):
        """The outputs of a block of steps (time-major) and the states after each step."""
        spec, table = self.rec.spec, self.table
        T = block.steps
        args = [block.ones] if self.maps.needs_state_ones else []
        args += [block.values[table.key[sym][1]] for sym in self.maps.args]  # inputs only
        res = self.maps.fn(*args)
        after = {}
        for bi, blk in enumerate(self.form.blocks):
            syms = [spec.symbols[s] for s in blk.slots]
            shapes = [(T, *table.step_shape(s, sizes)) for s in syms]
            K = blk.size
            A = [[_timed(res[self.slot_index[self._product(bi, i, j).slot]], T, len(shapes[i]))
                  for j in range(K)] for i in range(K)]
            b = [fit(res[self.slot_index[s]], sh) for s, sh in zip(blk.slots, shapes)]
            h0 = [carry[s] for s in syms]
            # the checkpoint is a state, not the structure of a map: IEEE's product, as the
            # sequential step forms it
            first = [sum((A[i][k][:1] * h0[k] for k in range(K)), start=b[i][:1])
                     for i in range(K)]
            b = [concat([f, x[1:]]) if T > 1 else f for f, x in zip(first, b)]
            # a non-finite multiplier: from a zero state, inf * 0 or NaN * 0 in the sequential
            # steps (the first step's IEEE product forms it itself)
            hits = functools.reduce(mx.logical_or,
                                    [mx.logical_not(mx.isfinite(a)) for row in A for a in row])
            hits = mx.logical_and(hits, (mx.arange(T) > 0).reshape((T,) + (1,) * (hits.ndim - 1)))
            for s, h in zip(syms, affine_scan(A, b, mx.stop_gradient(hits))):
                after[s] = h
        if self.outputs_after:
            outs = self._call(self.outputs_after, after, block)
            outs = [outs[i] for i in self.after_order]
        else:
            entered = {s: concat([carry[s], after[s][:-1]]) if T > 1 else carry[s]
                       for s in table.states}
            outs = self._call(self.forward_chain.post, entered, block)
        blocks = [fit(y, (T, *canonical_shape(spec, spec.outputs[slot.tensor], sizes,
                                                with_time=False)))
                  for (_, slot), y in zip(self.forward_chain.post.results, outs)]
        return blocks, {s: after[s][-1:] for s in table.states}

    def _product(self, block: int, row: int, col: int):
        return next(p for p in self.products if (p.block, p.row, p.col) == (block, row, col))

    # -- forward -------------------------------------------------------------------------------
    def forward(self, inputs, states, sizes, seg, out_dtype):
        spec, table = self.rec.spec, self.table
        L = sizes[spec.time]
        values = self._time_major(spec.inputs.values(), inputs, sizes)
        ones = self._ones(sizes)
        carry = self._initial(states, table.states, sizes)
        n_out = len(self.forward_chain.post.results)
        checkpoints, buffers = [], [None] * n_out
        for start in range(0, L, seg):
            checkpoints.append(carry)
            block = self._slice(values, start, min(L, start + seg), ones)
            outs, carry = self._segment(carry, block, sizes)
            buffers = [write(b, y, start, L) for b, y in zip(buffers, outs)]
            carry = computed_after(carry, outs)
        return self._forward_results(buffers, checkpoints, carry, out_dtype)

    # -- backward ------------------------------------------------------------------------------
    def backward(self, inputs, states, residuals, d_outputs, d_finals, sizes, seg,
                 d_residuals=None):
        spec, table = self.rec.spec, self.table
        L = sizes[spec.time]
        values = self._time_major(spec.inputs.values(), inputs, sizes)
        d_values = self._time_major(spec.outputs.values(), d_outputs, sizes)
        ones = self._ones(sizes)
        lam = self._initial(d_finals, table.states, sizes)
        checkpoints = dict(zip(table.states, residuals))
        keys = [k for k in values if spec.inputs[k[0]].differentiable]
        out_slots = [(slot.tensor, slot.component) for _, slot in self.forward_chain.post.results]
        n_state = len(table.states)
        step_grads, param_grads = {}, {}
        for s in reversed(range(-(-L // seg))):
            lo, hi = s * seg, min(L, (s + 1) * seg)
            block = self._slice(values, lo, hi, ones)

            def segment(*arrays, block=block):
                carry = dict(zip(table.states, arrays[:n_state]))
                vals = dict(block.values)
                vals.update(zip(keys, arrays[n_state:]))
                outs, end = self._segment(carry, Block(vals, block.steps, ones), sizes)
                # an output may be the end state itself (``y = h'`` over one step): a VJP takes
                # one cotangent per distinct array, so the end states are made distinct
                return (*outs, *(end[x] * 1.0 for x in table.states))

            primals = [checkpoints[x][s:s + 1] for x in table.states] + [block.values[k] for k in keys]
            cot = [fit(d_values[k][lo:hi], (hi - lo, *canonical_shape(
                spec, spec.outputs[k[0]], sizes, with_time=False))) for k in out_slots]
            cot += [fit(lam[x], checkpoints[x][s:s + 1].shape) for x in table.states]
            _, vjps = mx.vjp(segment, primals, cot)
            lam = dict(zip(table.states, vjps[:n_state]))
            if d_residuals is not None:
                lam = {x: lam[x] + d_residuals[i][s:s + 1] for i, x in enumerate(table.states)}
            grads = dict(zip(keys, vjps[n_state:]))
            lam = computed_after(lam, list(grads.values()))
            self._collect(grads, step_grads, param_grads, lo, L)
        grads = self._input_grads(inputs, step_grads, param_grads, sizes)
        d_init = [d.astype(x.dtype) for d, x in zip(self._declared(lam, table.states), states)]
        return grads, d_init


__all__ = ["ChunkedForm", "affine_scan"]
