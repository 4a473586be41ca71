"""The matrix schedule in MLX ops: chunkwise products for recurrences of the matrix form.

For a spec that ``matrix.analyse`` puts in the matrix form (``S_t = d_t ⊙ S_{t-1} + Σ_r a_r ⊗
b_r``, outputs from readouts ``Σ_n c_t[n] S_{t-1}[n, :]``), the sequence is cut into chunks of
``C`` steps and, with ``Λ`` the cumulative ``log |d|`` within a chunk (``Λ_t`` inclusive,
``Λ'_t`` exclusive):

* readouts of the chunk's starting state: ``(c ⊙ exp(Λ')) @ S_start`` — ``[C, K] @ [K, V]``;
* readouts of the chunk's own inputs: ``(M ∘ (c @ a_rᵀ)) @ b_r`` with the causal decay matrix
  ``M[t, j] = exp(Λ'_t - Λ_j)`` for ``j < t`` (0 elsewhere) — ``[C, C]`` products. Where ``d``
  varies over the state axis, ``M`` has a third axis and cannot leave the product: the chunk is
  cut into sub-chunks of ``SUB`` steps; between sub-chunks the product factors through the
  boundary's cumulative decay (every factor ``≤ 1`` for decays, so nothing overflows), within a
  sub-chunk the ``[SUB, SUB, K]`` weights are taken element by element;
* a scalar ``d`` leaves the products: ``exp(Λ')`` scales the rows of ``c @ S_start``, ``M`` is
  ``[C, C]`` and multiplies ``c @ a_rᵀ`` element by element, and where ``c`` and ``a_r`` read
  only inputs given per group of heads (``groups=``, Mamba-2's ``B`` and ``C``) ``c @ a_rᵀ``
  is taken once per group and broadcast over the group's members (nothing is repeated);
* the chunk's end state from zero, ``Σ_r (a_r ⊙ exp(Λ_C - Λ))ᵀ @ b_r``; the states at every
  chunk's start follow from these by the same causal weights one level up, as one product over
  chunks (``matrix_chunks.carry``: no loop over chunks).

Every exponent is the sum of its own range of ``log |d|`` (a masked reverse cumulative sum,
``matrix_chunks.causal_weights``), not a difference of two running sums, so it is as exact as
the range allows; the excluded entries are masked to ``-inf`` before ``exp``, and for decays
``|d| ≤ 1`` no factor exceeds 1. A multiplier whose sign is not known symbolically carries its
sign as a running parity of ``-1``s (``matrix_chunks.parity``). A non-finite value spreads NaN
over the products it enters (``0 · inf``), wider than in the sequential schedule: see
docs/matrix.md.

Everything is MLX ops (``mx.matmul``: MLX's GEMM on every device), so the backward is MLX's
VJP of the same computation, recomputed from the inputs (nothing is kept from the forward but
the inputs), and every MLX transformation applies.
"""

from __future__ import annotations

import collections
import functools
import operator

import mlx.core as mx
import sympy

from ..function import COMPILED_BACKENDS
from ..ir import Accumulate, Loop, Program, Store
from ..layout import expand_groups, expanded, from_canonical, spread, to_canonical
from ..matrix import LOG_FLOOR
from ..memo import LRU
from ..render.matrix import decay_score_chunk
from ..render.mlx_ops import render_mlx
from ..spec import Slot
from .matrix_chunks import MatrixChunks, carry, causal_weights, parity, product, sign_of
from .matrix_kernels import enabled as kernels_enabled
from .matrix_kernels import kernel_chunk, kernel_flags, matrix_kernels
from .mlx_blocks import Block
from .mlx_ops import COMPILED_SIZES, SequentialForm

SUB = 16  # the sub-chunk of vector decays: [SUB, SUB, K] weights per sub-chunk


def _program(ir, stores: list, extra_sums=(), given=frozenset(), slots=None) -> Program:
    """A program storing ``stores`` (expressions), after the sums over the state axis they
    read, except those ``given`` as arguments (``extra_sums``: more ``(target, body)`` sums,
    after those)."""
    need = _sums_read(ir, [*stores, *(b for _, b in extra_sums)], given)
    statements = []
    for level in sorted({r.level for r in need}):
        statements.append(Loop([Accumulate(r.target, r.body) for r in ir.reductions
                                if r in need and r.level == level]))
    if extra_sums:
        statements.append(Loop([Accumulate(t, b) for t, b in extra_sums]))
    statements += [Store("output", slot, e) for slot, e in zip(slots or
                   [Slot(f"m{i}") for i in range(len(stores))], stores)]
    return Program(statements, frozenset(ir.vector))


def _sums_read(ir, exprs, given=frozenset()) -> list:
    """The sums over the state axis (``ir.reductions``) that ``exprs`` read, directly or
    through other sums, except those ``given``."""
    targets = {r.target: r for r in ir.reductions if r.target not in given}
    need, frontier = set(), [x for e in exprs for x in e.free_symbols if x in targets]
    while frontier:
        x = frontier.pop()
        if x not in need:
            need.add(x)
            frontier += [y for y in targets[x].body.free_symbols if y in targets]
    return [targets[x] for x in need]


_NO_SIGN = mx.array(1.0)  # the kernels' core's sign where the decay is known positive


def _add_to(sums: dict, key, y):
    """``sums[key] += y``, starting from ``y`` itself (not from 0 + y, a pass of its own)."""
    sums[key] = y if key not in sums else sums[key] + y


def _as_fp32(x):
    """``x`` in fp32, converted where it lies: MLX keeps a transposed array's strides, and the
    matrix kernels read their factors at any strides (``matrix_kernels.STRIDED``)."""
    return x if x.dtype == mx.float32 else x.astype(mx.float32)


@mx.custom_function
def read_as_given(x):
    """``x``, an input in half precision that the matrix kernels read as given (widening it as
    they read): the identity, whose VJP rounds the cotangent to ``x``'s dtype once, after MLX
    has summed every use's in fp32 (the kernels' and those through ``widened``)."""
    return x


@read_as_given.vjp
def _read_as_given_vjp(primals, cotangent, _):
    return cotangent.astype(primals[0].dtype)


@mx.custom_function
def widened(x):
    """``x`` in fp32, for the uses of an input in half precision below ``read_as_given``: its
    VJP keeps the cotangent in fp32 (a conversion's would round it to ``x``'s dtype, and the
    sum of the uses' cotangents would round again)."""
    return x.astype(mx.float32)


@widened.vjp
def _widened_vjp(primals, cotangent, _):
    return cotangent


@mx.custom_function
def unit_lower_inverse(A):
    """``(I - A)⁻¹`` for ``A`` strictly lower triangular, ``(..., n, n)``: block forward
    substitution with blocks doubling from 1, ``[[X, 0], [-A₂₁, Y]]⁻¹ = [[X⁻¹, 0], [Y⁻¹ A₂₁ X⁻¹,
    Y⁻¹]]``, every block of one size at once (``log₂ n`` rounds of batched products; ``n`` is
    padded to a power of two with zero rows). The same sums as substituting row by row, in
    another order. Its VJP is two products (``_unit_lower_inverse_vjp``)."""
    n = A.shape[-1]
    m = 1 << (n - 1).bit_length()
    lead = A.shape[:-2]
    if m != n:
        A = mx.pad(A, [(0, 0)] * len(lead) + [(0, m - n), (0, m - n)])
    T = mx.ones((*lead, m, 1, 1), dtype=A.dtype)  # the inverses of the diagonal blocks
    size = 1
    while size < m:
        blocks = mx.moveaxis(mx.diagonal(A.reshape(*lead, m // (2 * size), 2 * size,
                                                   m // (2 * size), 2 * size),
                                         axis1=-4, axis2=-2), -1, -3)  # (..., m / 2s, 2s, 2s)
        pairs = T.reshape(*lead, m // (2 * size), 2, size, size)
        X, Y = pairs[..., 0, :, :], pairs[..., 1, :, :]
        below = product(product(Y, blocks[..., size:, :size]), X)
        T = mx.concatenate([mx.concatenate([X, mx.zeros_like(X)], axis=-1),
                            mx.concatenate([below, Y], axis=-1)], axis=-2)
        size *= 2
    return T[..., 0, :n, :n]


@unit_lower_inverse.vjp
def _unit_lower_inverse_vjp(primals, cotangent, output):
    """``dT = T dA T``, so the gradient of ``A`` is ``Tᵀ Ḡ Tᵀ`` on its strictly lower entries
    (MLX's VJP of the doubling rounds took 7 ms on an H100 at 8192 blocks of 64, these
    products 0.5 ms)."""
    T = mx.swapaxes(output, -1, -2)
    n = T.shape[-1]
    return mx.where(mx.tri(n, n, -1, dtype=mx.bool_), product(product(T, cotangent), T), 0.0)


@mx.custom_function
def chunk_chain(P, U, S0):
    """The states at every chunk's start ``(..., nc, K, V)`` and after the last, of
    ``S_{c+1} = P_c S_c + U_c`` (``P``: ``(..., nc, K, K)``, ``U``: ``(..., nc, K, V)``), chunk by
    chunk. Its VJP runs the adjoint ``λ_c = P_cᵀ λ_{c+1} + S̄_c`` backwards and stacks the
    gradients once (MLX's VJP of the loop scattered every chunk's cotangent into a zero array
    of all of them: 33 ms and 17 GB on an H100 at B8 H16 L4096, against 1.4 ms forward)."""
    starts, S = [], S0
    for P_c, U_c in zip(_chunks(P), _chunks(U)):
        starts.append(S)
        S = product(P_c, S) + U_c
    return mx.stack(starts, axis=-3), S


def _compose_chunk_maps(P):
    """``P_{nc-1} ... P_0`` of chunk maps ``(..., nc, K, K)``, in order."""
    maps = _chunks(P)
    total = maps[0]
    for P_c in maps[1:]:
        total = product(P_c, total)
    return total


def _chunks(x):
    """``(..., nc, X, Y)`` as ``nc`` arrays ``(..., X, Y)``."""
    return [mx.squeeze(c, -3) for c in mx.split(x, x.shape[-3], axis=-3)]


@chunk_chain.vjp
def _chunk_chain_vjp(primals, cotangents, outputs):
    """Only ``λ`` runs in order (one product a chunk, ``Pᵀ`` transposed once); ``Ū_c = λ_{c+1}``
    and ``P̄_c = λ_{c+1} S_cᵀ`` follow for all chunks in one product."""
    P, U, _ = primals
    d_starts, lam = cotangents
    lams = []
    for P_t, d_c in reversed(list(zip(_chunks(mx.swapaxes(P, -1, -2)), _chunks(d_starts)))):
        lams.append(lam)
        lam = product(P_t, lam) + d_c
    d_U = mx.stack(lams[::-1], axis=-3)
    return product(d_U, mx.swapaxes(outputs[0], -1, -2)), d_U, lam


class _Members:
    """Arrays of a group axis against arrays of the batch-like axis it groups (position ``p``
    among the batch axes, ``n`` members a group): the member-level array is split into
    ``(groups, n)`` and the group-level one broadcast over ``n``, so nothing is repeated."""

    def __init__(self, p: int, n: int):
        self.p, self.n = p, n

    def _split(self, y):
        p = self.p
        return y.reshape(*y.shape[:p], y.shape[p] // self.n, self.n, *y.shape[p + 1:])

    def _merge(self, z):
        p = self.p
        return z.reshape(*z.shape[:p], z.shape[p] * z.shape[p + 1], *z.shape[p + 2:])

    def times(self, g, y):
        """``g * y`` per member: ``g`` per group, ``y`` per member."""
        return self._merge(mx.expand_dims(g, self.p + 1) * self._split(y))

    def matmul(self, g, y, mm):
        """``g @ y`` per member."""
        return self._merge(mm(mx.expand_dims(g, self.p + 1), self._split(y)))

    def spread(self, g):
        """``g`` per member."""
        x = mx.expand_dims(g, self.p + 1)
        return self._merge(mx.broadcast_to(x, (*x.shape[:self.p + 1], self.n,
                                               *x.shape[self.p + 2:])))


def _matmul(members: dict, g, x, y, mm):
    """``x @ y``, ``x`` per group of axis ``g`` (None: per member) and ``y`` per member."""
    return mm(x, y) if g is None else members[g].matmul(x, y, mm)


def _spread(members: dict, g, x):
    """``x`` per member, from per group of axis ``g`` (None: already per member)."""
    return x if g is None else members[g].spread(x)


class MatrixForm(SequentialForm):
    """Outputs and final states of a matrix-form recurrence by chunkwise matrix products."""

    name = "matrix"

    def __init__(self, rec, table, form, kernels=None):
        # form: matrix.MatrixForm, the analysis; kernels: a kernel backend whose matrix kernels
        # (``matrix_kernels.py``) run the states they serve. Only the shared plumbing of
        # SequentialForm (layouts, calls of rendered programs) is used: its step chains are not
        # split and rendered again for this form
        self.rec, self.table = rec, table
        self.form = form
        self.kernels = matrix_kernels(kernels) if kernels else None
        ir = rec.ir
        exprs, self.layout = [], []  # layout: (what, state index, readout index, term index)
        by_group: dict = {}  # group axis -> (expressions, layout) of the factors of a group
        self.level = {}  # (what, s, i, r) -> the group axis its factor is evaluated at, or None
        self.along = {}  # (state, read) -> the term whose vector the read's α and β scale
        # (what, s, i, r) -> the input (tensor, component) a kernel factor is, as it is given
        self.bare = {}
        every = []  # every expression of the call, for the inputs each reads

        def add(expr, what, s=None, i=None, r=None):
            expr = sympy.sympify(expr)
            every.append(expr)
            g = self._group_of(expr) if what in ("a", "c") and not \
                form.states[s].vector_decay else None
            self.level[(what, s, i, r)] = g
            if what in ("a", "b", "c") and expr in self.table.key:
                self.bare[(what, s, i, r)] = self.table.key[expr][1]
            into, layout = (exprs, self.layout) if g is None else by_group.setdefault(g, ([], []))
            layout.append((what, s, i, r))
            into.append(expr)

        for s, st in enumerate(form.states):
            add(st.log_decay, "log_decay", s)
            if not st.positive:
                add(st.decay, "decay", s)
            for r, (a, b) in enumerate(st.terms):
                add(a, "a", s, r=r)
                add(b, "b", s, r=r)
            for r, (_, alpha, beta) in enumerate(st.low_rank):
                add(alpha, "alpha", s, r=r)
                add(beta, "beta", s, r=r)
                # a delta rule writes and reads along the vector it adds (``α = -β_t k``,
                # ``β = k``, ``a = k``): its products then share one causal matrix W(k, k)
                shared = self._along_term(alpha, beta, st.terms, set(ir.vector))
                if shared is not None:
                    self.along[(s, r)] = shared[0]
                    add(shared[1], "alpha_scale", s, r=r)
                    add(shared[2], "beta_scale", s, r=r)
        # sums over the state axis of state-free parts, Σ_n rest[n] = Σ_r b_r Σ_n a_r[n] (their
        # lane factors taken out of the sum, so no [V, K] array is formed)
        sums = []

        def lane_sum(expr, label):
            total = sympy.S.Zero
            for term in sympy.Add.make_args(sympy.expand(expr, deep=False, power_exp=False,
                                                         power_base=False, log=False)):
                if term == 0:
                    continue
                lane_part = [f for f in sympy.Mul.make_args(term)
                             if not f.free_symbols & set(ir.vector)]
                inner = sympy.Mul(*[f for f in sympy.Mul.make_args(term) if f not in lane_part])
                target = ir.namer(label)
                sums.append((target, inner))
                total += sympy.Mul(*lane_part) * target
            return total

        for i, ro in enumerate(form.readouts):
            for s, st in enumerate(form.states):
                if st.symbol in ro.coefficients:
                    add(ro.coefficients[st.symbol], "c", s, i)
            if ro.rest != 0:  # the readout of the state after the update has none (diagonal)
                add(lane_sum(ro.rest, f"rest{i}_"), "rest", None, i)
            for p, w in ro.reads.items():  # the weight of a delta rule's read ρ: Σ_n w[n] ρ
                add(lane_sum(w, f"read{i}_"), "read", None, i, p)
        # the factors whose input nothing else reads: the kernels' gradient of such a factor
        # is the input's whole gradient, so it may be written in the input's dtype. What the
        # call reads: the factors, the sums of state-free parts, the outputs and the sums over
        # the state axis these read (not the readouts, which the chunk products replace)
        every += [body for _, body in sums] + list(ir.outputs.values())
        every += [r.body for r in _sums_read(ir, every, {ro.target for ro in form.readouts})]
        readers = collections.Counter(self.table.key[sym][1] for e in every
                                      for sym in e.free_symbols if sym in self.table.key)
        self.alone = {key for key, slot in self.bare.items() if readers[slot] == 1}
        # the inputs the kernels may read as given (a factor of a state they serve); others in
        # half precision are converted as before, a conversion MLX fuses with what reads it
        self.as_given = {slot[0] for (_, s, _, _), slot in self.bare.items()
                         if kernel_flags(form, form.states[s]) is not None}
        # the readouts that are outputs as they are (read from one state, with no rest and no
        # delta-rule read, and read by no other output): the kernels may write them in the
        # outputs' dtype
        targets = collections.Counter(x for e in ir.outputs.values() for x in e.free_symbols)
        self.plain = {i for i, ro in enumerate(form.readouts)
                      if ro.rest == 0 and not ro.reads and len(ro.coefficients) == 1
                      and targets[ro.target] == sum(e == ro.target for e in ir.outputs.values())}
        self.factors = render_mlx(_program(ir, exprs, sums), "matrix_factors")
        self.group_factors = {g: (render_mlx(_program(ir, e), f"matrix_factors_{g}"), layout)
                              for g, (e, layout) in by_group.items()}
        readouts = frozenset(ro.target for ro in form.readouts)  # arguments of the outputs
        self.post = render_mlx(_program(ir, list(ir.outputs.values()), given=readouts,
                                        slots=list(ir.outputs)), "matrix_outputs")
        self._compiled_calls = LRU(COMPILED_SIZES)  # bounded: a trace per shape is kept

    # -- the factors of every step ---------------------------------------------------------------
    @staticmethod
    def _along_term(alpha, beta, terms, vector):
        """``(j, α / a_j, β / a_j)`` for the first added term ``j`` whose state-axis vector
        ``a_j`` the read's ``α`` and ``β`` are per-step multiples of, else None."""
        for j, (a, _) in enumerate(terms):
            ratios = [sympy.cancel(x / a) for x in (alpha, beta)]
            if not any(q.free_symbols & vector for q in ratios):
                return j, ratios[0], ratios[1]
        return None

    def _group_of(self, expr):
        """The group axis ``g`` at which ``expr`` can be evaluated without expanding its inputs
        to the axis ``g`` groups: it reads an input that carries ``g`` and none that carries
        the grouped axis or another group axis; else None."""
        spec = self.rec.spec
        tensors = {spec.tensors[self.table.key[sym][1][0]] for sym in expr.free_symbols
                   if sym in self.table.key}
        carried = {a for t in tensors for a in t.batch_axes}
        found = carried & set(spec.groups)
        if len(found) != 1:
            return None
        g, = found
        return None if spec.groups[g] in carried else g

    def _batch_major(self, inputs, sizes):
        """Inputs by (tensor, component) in the canonical layout with the time axis after the
        batch axes, ``(*batch, T, V or 1, K or 1)`` (parameters with a time axis of 1), fp32,
        group axes expanded: the layout of the chunked products, so no transposition follows.
        Also those that carry a group axis as given (the group axis in place of the grouped
        one), for the factors evaluated per group. Third, where the kernels run, the inputs of
        ``as_given`` with the time axis given in half precision, as given (the same two kinds
        by ``(tensor, component)`` and ``(tensor, component, "grouped")``), which the kernels
        widen as they read them (``_half_factors``; an fp32 copy that no factor needs is never
        evaluated); every use of such an input hangs below one ``read_as_given``."""
        spec, nb = self.rec.spec, len(self.rec.spec.batch_axes)
        out, grouped = {}, {}
        # a parameter spread over time and the batch axes no group touches, so that its
        # gradient is summed in stages (``layout.spread``); a grouped axis keeps its size 1, as
        # the factors evaluated per group read the same arrays
        grouping = set(spec.groups) | set(spec.groups.values())
        over = [1 if a in grouping else sizes[a] for a in spec.batch_axes] + [sizes[spec.time]]

        def parameter(part):
            part = _as_fp32(mx.expand_dims(part, nb))
            return spread(part, (*(n if m == 1 else m for n, m in zip(over, part.shape)),
                                 *part.shape[nb + 1:]))

        def parts(t, x):  # by component, as given (half precision kept)
            return dict(enumerate(to_canonical(spec, expanded(spec, t), x)))

        def cast(t, given, widen=_as_fp32):
            return {(t.name, c): widen(part) if t.has_time else parameter(part)
                    for c, part in given.items()}

        halves = {}
        for t, x in zip(spec.inputs.values(), inputs):
            half = t.name in self.as_given and x.dtype in (mx.bfloat16, mx.float16) and \
                t.has_time and self._kernels_on()
            if half:  # one node below which every use's cotangent is summed in fp32
                x = read_as_given(x)
            given, widen = parts(t, x), widened if half else _as_fp32
            grouped.update(cast(t, given, widen))
            # without a group axis the expanded arrays are the same ones
            if expanded(spec, t) is t:
                members = given
                out.update({(t.name, c): grouped[(t.name, c)] for c in given})
            else:
                members = parts(t, expand_groups(spec, t, x, sizes))
                out.update(cast(t, members, widen))
            if half:
                halves.update({(t.name, c, "grouped"): part for c, part in given.items()})
                halves.update({(t.name, c): part for c, part in members.items()})
        return out, grouped, halves

    def _factors(self, values: dict, grouped: dict, sizes: dict, ones):
        """``(*batch, T, X)`` arrays of every factor, by (what, state, readout, term) (those
        evaluated per group with the group axis's size in place of the grouped one's);
        readouts' rests as ``(*batch, T, V, 1)``."""
        spec = self.rec.spec
        out = self._evaluate(self.factors, self.layout, values, sizes, ones)
        for g, (program, layout) in self.group_factors.items():
            out.update(self._evaluate(program, layout, grouped, {**sizes, spec.groups[g]: sizes[g]},
                                      ones))
        return out

    def _evaluate(self, program, layout, values: dict, sizes: dict, ones):
        spec = self.rec.spec
        args = [ones] if program.needs_state_ones else []
        args += [values[self.table.key[sym][1]] for sym in program.args]
        results = program.fn(*args)
        return {key: self._shaped(key, x if isinstance(x, mx.array) else
                                  mx.array(x, dtype=mx.float32), sizes)
                for key, x in zip(layout, results)}

    def _shaped(self, key, x, sizes):
        """The factor ``key`` (what, state, readout, term) as ``(*batch, T, X)`` (a readout's
        rest as ``(*batch, T, V, 1)``) from its value in the canonical layout."""
        spec, (what, s, _, _) = self.rec.spec, key
        T, batch = sizes[spec.time], [sizes[a] for a in spec.batch_axes]
        V, K = sizes[spec.lane], sizes[spec.state_axis]
        st = self.form.states[s] if s is not None else None
        if what in ("a", "c", "alpha", "beta") or (what in ("log_decay", "decay")
                                                   and st.vector_decay):
            shape, drop = (*batch, T, 1, K), -2  # over the state axis
        elif what in ("b", "rest", "read"):
            lanes = V if st is None or st.has_lane else 1  # a shared state: one "lane"
            shape, drop = (*batch, T, lanes, 1), -1  # over the lanes
        else:
            shape, drop = (*batch, T, 1, 1), -2  # one per step
        x = mx.broadcast_to(x.reshape((1,) * (len(shape) - x.ndim) + x.shape), shape)
        # a squeeze, not an index: MLX has no forward-mode derivative of an index's VJP
        return x if what == "rest" else mx.squeeze(x, axis=drop)

    def _half_factors(self, halves: dict, sizes: dict):
        """The kernels' factors (``a``, ``b``, ``c``) that are inputs given in half precision,
        as given (``_batch_major``), shaped as ``_factors`` shapes them: the kernels widen them
        as they read them, so no fp32 copy is made or kept for the backward."""
        spec, out = self.rec.spec, {}
        for key, slot in self.bare.items():
            g = self.level[key]
            at = slot if g is None else (*slot, "grouped")
            if at in halves:
                out[key] = self._shaped(key, halves[at], sizes if g is None else
                                        {**sizes, spec.groups[g]: sizes[g]})
        return out

    # -- one call --------------------------------------------------------------------------------
    def run(self, inputs, states, sizes, seg, operands=mx.float32, transitions=False,
            out_dtype=mx.float32, ends=(True, True)):
        """Outputs (canonical, ``(*batch, T, V, 1)``, fp32, or ``out_dtype`` where the kernels
        write an output as it is: ``plain``) and final states (``(*batch, K, V)``).
        ``operands``: the dtype of the products' operands within a chunk (accumulation and
        the states between chunks stay fp32). ``transitions``: instead, ``(P, final states)`` with
        ``P`` every state's ``K x K`` map of the whole call, ``S_end = P S_start + b``, per
        instance, and the final states from ``states`` (``b`` from zero states; delta-rule
        states only: sequence parallelism's summaries). ``ends``: whether the initial states
        are given (else zeros) and the final states wanted, for the kernels' core
        (``MatrixKernels.core``; a final state it does not give is None)."""
        spec = self.rec.spec
        nb = len(spec.batch_axes)
        T = sizes[spec.time]
        values, grouped, halves = self._batch_major(inputs, sizes)

        def mm(x, y):
            if operands == mx.float32:
                return product(x, y)
            return product(x.astype(operands), y.astype(operands)).astype(mx.float32)

        f = self._factors(values, grouped, sizes, self._ones(sizes))
        half = self._half_factors(halves, sizes)  # those the kernels read as given
        members = {g: _Members(spec.batch_axes.index(spec.groups[g]),
                               sizes[spec.groups[g]] // sizes[g]) for g in self.group_factors}
        chunks = MatrixChunks(T, seg, nb)
        # readouts by chunk (*batch, nc, C, V), and those of the kernels' states (*batch, T, V);
        # a delta rule's reads ρ by chunk, (*batch, nc, C, V), once solved
        readouts, direct, reads = {}, {}, {}
        finals, maps = [], []
        for s, st in enumerate(self.form.states):
            S0 = self._state(states, st, sizes)  # (*batch, K, V)
            served = self._kernel_core(st, S0, seg)
            if served is not None:
                shape, i = served
                y, S = self._run_core(shape, st, s, i, f, half, members, S0,
                                      out_dtype if i in self.plain else mx.float32, ends)
                _add_to(direct, i, y)
                finals.append(S)
                continue
            # a zero multiplier would give -inf - -inf below: its log is floored where exp
            # underflows anyway
            log_d = chunks.cut(mx.maximum(f[("log_decay", s, None, None)], LOG_FLOOR))
            # a scalar decay's causal weights, one [C, C] matrix for every product of the state
            between = None if st.vector_decay else causal_weights(log_d)[..., 0]
            before = mx.cumsum(log_d, axis=-2, inclusive=False)  # log |d(1..t-1)|
            from_start = mx.exp(before)
            to_end = mx.cumsum(log_d, axis=-2, reverse=True, inclusive=False)  # Σ_{s>j}
            whole = mx.sum(log_d, axis=-2, keepdims=True)
            terms = [(chunks.cut(f[("a", s, None, r)]), self.level[("a", s, None, r)],
                      chunks.cut(f[("b", s, None, r)])) for r in range(len(st.terms))]
            # a sign not known symbolically: the sign of d(j+1..t) is sign(d(..t)) sign(d(..j)),
            # so it folds into the factors of t and of j
            sign = sign_ex = sign_end = sg = None
            to_end = mx.exp(to_end)
            if not st.positive:
                sg = chunks.cut(sign_of(f[("decay", s, None, None)]), 1.0)
                sign = parity(sg, axis=-2)
                sign_ex, sign_end = sign * sg, sign[..., -1:, :]
                to_end = to_end * sign * sign_end
            # the chunk's end state from its own inputs, and its decay over the whole chunk
            # (a scalar decay scales b, the side that is per member anyway, and a stays per group)
            U = sum(_matmul(members, la, mx.swapaxes(a, -1, -2), to_end * b, mm)
                    if not st.vector_decay else mm(mx.swapaxes(a * to_end, -1, -2), b)
                    for a, la, b in terms) if terms else \
                mx.zeros((*S0.shape[:nb], chunks.nc, *S0.shape[nb:]))
            if transitions and not st.low_rank:
                raise ValueError(f"{spec.name}: the transition maps of the matrix form are "
                                 "those of delta-rule states")
            if st.low_rank:  # a delta rule: its reads solved, they are one more added term
                S_start, S, solved, P = self._solve_reads(st, s, f, terms, log_d, between,
                                                          from_start, to_end, whole,
                                                          (sign, sign_ex, sign_end),
                                                          U, S0, chunks, members)
                if transitions:
                    maps.append(_compose_chunk_maps(P))
                    finals.append(S)
                    continue
                reads.update(solved)
                terms = list(terms)
                for r, (p, _, _) in enumerate(st.low_rank):
                    j = self.along.get((s, r))
                    if j is None:
                        terms.append((chunks.cut(f[("alpha", s, None, r)]), None, solved[p]))
                    else:  # α ⊗ ρ = a_j ⊗ (α / a_j) ρ: one more value on term j's products
                        a, la, b = terms[j]
                        terms[j] = (a, la, b + chunks.cut(f[("alpha_scale", s, None, r)]) *
                                    solved[p])
            else:
                S_start, S = carry(S0, whole[..., 0, :], sign_end, U)
            finals.append(S)
            for i, ro in enumerate(self.form.readouts):
                if st.symbol not in ro.coefficients or ro.target in reads:
                    continue
                c_t, lc = chunks.cut(f[("c", s, i, None)]), self.level[("c", s, i, None)]
                if st.vector_decay:
                    c_t = c_t if sign_ex is None else c_t * sign_ex
                    y = mm(c_t * from_start, S_start)
                    for a, _, b in terms:
                        a = a if sign is None else a * sign
                        y = y + mm(self._decay_scores(c_t, a, log_d, mm, before), b)
                    _add_to(readouts, i, y)
                    continue
                # a scalar decay: its weights are per step (rows t, columns j), out of the
                # products, so ``c @ aᵀ`` runs per group where c and a are per group
                row, w = from_start, between
                if sign is not None:
                    row, w = row * sign_ex, w * sign_ex * mx.swapaxes(sign, -1, -2)
                if st.symbol in ro.decayed:  # a scalar decay taken out of c: d_t on row t
                    d_t = mx.exp(log_d) if sg is None else mx.exp(log_d) * sg
                    row, w = row * d_t, w * d_t
                if st.symbol in ro.diagonal:  # the step's own terms: j = t, weight 1
                    w = w + mx.eye(w.shape[-1])
                y = row * _matmul(members, lc, c_t, S_start, mm)
                for a, la, b in terms:
                    if la == lc and lc is not None:
                        scores = members[lc].times(mm(c_t, mx.swapaxes(a, -1, -2)), w)
                    else:
                        scores = mm(_spread(members, lc, c_t),
                                    mx.swapaxes(_spread(members, la, a), -1, -2)) * w
                    y = y + mm(scores, b)
                _add_to(readouts, i, y)
        if transitions:
            return maps, finals
        env = {}
        for i, ro in enumerate(self.form.readouts):
            if ro.target in reads:  # a delta rule's read: solved
                env[ro.target] = chunks.join(reads[ro.target])[..., None]
                continue
            parts = [chunks.join(readouts[i])] if i in readouts else []
            parts += [direct[i]] if i in direct else []
            parts += [f[("read", None, i, p)] * chunks.join(reads[p]) for p in ro.reads]
            # no 0 + y: an addition of zero is a pass over the readouts (65 µs of GLA's forward
            # at B8 H16 L4096 on an H200)
            y = functools.reduce(operator.add, parts) if parts else 0.0
            y = y[..., None] if isinstance(y, mx.array) else y
            rest = f.get(("rest", None, i, None))
            env[ro.target] = y if rest is None else y + rest
        outs = self._call(self.post, env, self._block(values, T, sizes))
        return outs, finals

    # -- the states the matrix kernels serve ----------------------------------------------------
    def _kernels_on(self) -> bool:
        """Whether this call runs the matrix kernels (``matrix_kernels.enabled``)."""
        return self.kernels is not None and kernels_enabled(self.kernels.backend)

    def _switches(self):
        """What decides the kernels a call traces: whether they run and, where they do, which
        of them (``MatrixKernels.switches``). Part of the keys of the compiled calls, so a
        change of a switch traces anew instead of replaying the trace made before it."""
        return self._kernels_on() and self.kernels.switches()

    def _kernel_core(self, st, S0, seg):
        """``(kernels' shape, readout index)`` where the kernels run state ``st`` (a scalar
        decay, one added term, one readout, a tiling that fits group memory), else None."""
        flags = kernel_flags(self.form, st) if self._kernels_on() else None
        if flags is None:
            return None
        i, inclusive, signed, diagonal = flags
        K, V = S0.shape[-2:]
        shape = self.kernels.shape(kernel_chunk(seg), K, V, inclusive, signed, diagonal=diagonal)
        return None if shape is None else (shape, i)

    def _run_core(self, shape, st, s, i, f, half, members, S0, out=mx.float32,
                  ends=(True, True)):
        """Readouts ``(*batch, T, V)`` (in the dtype ``out``) and final state of state ``s``
        (None where ``ends`` says it is not wanted) from the kernels' core of ``shape``, on the
        factors ``f`` (those given in half precision as given, ``half``: their gradients in
        that precision where nothing else reads their input)."""
        nb = len(self.rec.spec.batch_axes)
        batch, (K, V) = S0.shape[:nb], S0.shape[nb:]
        keys = [("c", s, i, None), ("a", s, None, 0), ("b", s, None, 0)]
        c, a, b = (_spread(members, self.level[k], half.get(k, f[k])) for k in keys)
        grads = [half[k].dtype if k in half and k in self.alone and self.level[k] is None
                 else mx.float32 for k in keys]
        core = self.kernels.core(shape, grads, out, ends)
        T = f[("log_decay", s, None, None)].shape[-2]
        # the factors and log d as (*batch, T, X) and (*batch, T) views, read where they lie
        # (``matrix_kernels.STRIDED``; the kernels floor log d as they read it)
        lead = lambda x: mx.broadcast_to(x, (*batch, T, x.shape[-1]))
        flat = lambda x: mx.contiguous(lead(x)).reshape(-1, T, x.shape[-1])
        log_d = lead(f[("log_decay", s, None, None)])[..., 0]
        # the core reads the sign for a signed shape only; a constant stands in otherwise (not
        # log d: its zero cotangent would be filled and added to log d's); a zero multiplier
        # counts as positive: its floored log erases the state anyway. Piecewise constant, the
        # sign has no gradient: MLX's VJP stops at it rather than fill and add zeros on the
        # way to d
        sign = _NO_SIGN if st.positive else \
            mx.stop_gradient(flat(sign_of(f[("decay", s, None, None)]))[..., 0])
        results = core(lead(c), lead(a), lead(b), log_d, sign, S0.reshape(-1, K, V))
        return results[0], results[1].reshape(*batch, K, V) if ends[1] else None

    def _solve_reads(self, st, s, f, terms, log_d, between, from_start, to_end, whole, signs, U,
                     S0, chunks, members):
        """The states at every chunk's start and after the last chunk of a delta-rule state
        (``matrix.py``), its reads ``ρ`` by chunk ``(*batch, nc, C, V)`` by symbol, and its
        chunk maps ``P`` ``(*batch, nc, K, K)``.

        Within a chunk the reads of every step and read ``r``, time-major (row ``t R + r``),
        solve ``(I - A) ρ = B̂ S_start + Σ_terms W(β, a) b`` with ``A = W(β, α)`` strictly lower
        triangular (``W``: the readouts' causal decay-weighted products, ``_scores``) and
        ``B̂ = β ⊙ d(1..t-1)``: ``ρ = M S_start + ρ₀`` with ``M = T B̂``, ``ρ₀ = T Σ W(β, a) b``,
        ``T = (I - A)⁻¹`` (the UT transform). The chunk then maps its start to its end through
        ``P = d(1..C) + α̃ᵀ M`` (``α̃ = α ⊙ d(t+1..C)``), ``K x K``, with the offset
        ``U + α̃ᵀ ρ₀``; the chunks pass their states on in order. All in fp32: the solve is where
        precision goes. ``signs``: the running parities of a decay whose sign is not known
        (``(sign(d(..t)), sign(d(..t-1)), sign(d(..C)))``, or Nones), folded into the factors of
        ``t`` and ``j`` as in the readouts; ``to_end`` carries its own. ``between``: a scalar
        decay's causal weights (None for a vector decay); ``from_start``: ``|d(1..t-1)|``."""
        R = len(st.low_rank)
        vector = st.vector_decay
        sign, sign_ex, sign_end = signs
        alphas = [chunks.cut(f[("alpha", s, None, r)]) for r in range(R)]
        betas = [chunks.cut(f[("beta", s, None, r)]) for r in range(R)]
        alphas_j = alphas  # as the later factor j of W(β, α)
        if sign is not None:  # sign(d(j+1..t-1)) = sign(d(..t-1)) sign(d(..j))
            alphas_j = [a * sign for a in alphas]
            betas = [b * sign_ex for b in betas]

        def time_major(xs):  # R arrays (..., C, X) -> (..., C R, X)
            x = mx.stack(xs, axis=-2)
            return x.reshape(*x.shape[:-3], -1, x.shape[-1])

        def scores(c, a):
            if vector:
                return self._decay_scores(c, a, log_d, mx.matmul)
            return product(c, mx.swapaxes(a, -1, -2)) * between

        def term(a, la):
            a = _spread(members, la, a)
            return a if sign is None else a * sign

        j = self.along.get((s, 0)) if R == 1 else None
        if j is None:
            A = mx.stack([mx.stack([scores(b, a) for a in alphas_j], axis=-1) for b in betas],
                         axis=-3)
            read_scores = [{} for _ in betas]  # W(β, a_term) by term, where already known
        else:  # α and β along term j's vector a: W(β, α) and W(β, a_j) from one W(a_j, a_j)
            a, la, _ = terms[j]
            a = _spread(members, la, a)
            row_scale = chunks.cut(f[("beta_scale", s, None, 0)])
            row_scale = row_scale if sign is None else row_scale * sign_ex
            along_a = row_scale * scores(a, a if sign is None else a * sign)  # W(β, a_j)
            A = (along_a * mx.swapaxes(chunks.cut(f[("alpha_scale", s, None, 0)]), -1, -2)
                 )[..., :, None, :, None]
            read_scores = [{j: along_a}]
        C = log_d.shape[-2]
        T = unit_lower_inverse(A.reshape(*A.shape[:-4], C * R, C * R))
        M = product(T, time_major([b * from_start for b in betas]))
        inputs = [sum(product(known[n] if n in known else scores(b, term(a, la)), x)
                      for n, (a, la, x) in enumerate(terms))
                  if terms else mx.zeros((*b.shape[:-1], U.shape[-1]))
                  for b, known in zip(betas, read_scores)]
        rho0 = product(T, time_major(inputs))
        alpha_end = mx.swapaxes(time_major([a * to_end for a in alphas]), -1, -2)
        decay = mx.exp(whole[..., 0, :])  # (*batch, nc, 1 or K): d(1..C)
        if sign_end is not None:
            decay = decay * sign_end[..., 0, :]
        P = product(alpha_end, M) + decay[..., :, None] * mx.eye(S0.shape[-2])
        offset = U + product(alpha_end, rho0)
        S_start, S = chunk_chain(P, offset, S0)
        rho = (product(M, S_start) + rho0).reshape(*S_start.shape[:-2], C, R, S_start.shape[-1])
        return S_start, S, {p: rho[..., r, :] for r, (p, _, _) in enumerate(st.low_rank)}, P

    def _decay_scores(self, c, a, log_d, mm, before=None):
        """The causal weights of a decay per state element (``_scores``): in the decay-score
        kernels where this call runs the matrix kernels and they take its chunk (fp32 sums,
        no ``[C, C, K]`` array), else in MLX ops. ``before``: ``log_d``'s exclusive running
        sums within each chunk, where already known."""
        C, K = c.shape[-2:]
        padded = decay_score_chunk(C)
        if not (self._kernels_on() and self.kernels.decay_scores_fit(padded)):
            return self._scores(c, a, log_d, mm)
        shape = mx.broadcast_shapes(c.shape, a.shape, log_d.shape)
        pad = [(0, 0)] * (len(shape) - 2) + [(0, padded - C), (0, 0)]

        def rows(x):
            x = mx.broadcast_to(x.astype(mx.float32), shape)
            return (mx.pad(x, pad) if padded > C else x).reshape(-1, padded, K)

        # exponents from the chunk's start: Σ_{j<s<t} log d_s = row_log[t] - col_log[j]
        row_log = mx.cumsum(log_d, axis=-2, inclusive=False) if before is None else before
        col_log = row_log + log_d
        W = self.kernels.decay_scores(padded, K)(rows(c), rows(a), rows(row_log), rows(col_log))
        W = W.reshape(*shape[:-2], padded, padded)
        return W[..., :C, :C] if padded > C else W

    @staticmethod
    def _scores(c, a, log_d, mm):
        """The causal weights ``W[t, j] = Σ_k c[t,k] a[j,k] d(j+1..t-1)[k]`` for ``j < t`` of
        every chunk, for a decay per state element ``log_d`` ``(*batch, nc, C, K)`` (a scalar
        decay's weights are one ``[C, C]`` matrix, ``between``): ``(*batch, nc, C, C)``."""
        C, K = c.shape[-2:]
        sub = min(SUB, C) if C % min(SUB, C) == 0 else C
        P, lead = C // sub, c.shape[:-2]
        c, a, log_d = (x.reshape(*lead, P, sub, K) for x in (c, a, log_d))
        # within a sub-chunk: element by element
        inner = mx.sum(c[..., :, :, None, :] * a[..., :, None, :, :] * causal_weights(log_d),
                       axis=-1)
        if P == 1:
            return inner.reshape(*lead, C, C)
        # between sub-chunks q < p: the decay from j to the end of q, over the sub-chunks
        # strictly between, and from the start of p to t (every factor <= 1 for decays)
        c = c * mx.exp(mx.cumsum(log_d, axis=-2, inclusive=False))
        a = a * mx.exp(mx.cumsum(log_d, axis=-2, reverse=True, inclusive=False))
        across = causal_weights(mx.sum(log_d, axis=-2))  # (.., P, P, K)
        w = mm(c[..., :, None, :, :] * across[..., :, :, None, :],
               mx.swapaxes(a[..., None, :, :, :], -1, -2))  # (.., P, P, sub, sub)
        eye = mx.eye(P, dtype=mx.bool_)[:, :, None, None]
        w = mx.where(eye, inner[..., :, None, :, :], w)
        return mx.swapaxes(w, -3, -2).reshape(*lead, C, C)

    def _state(self, states, st, sizes):
        """The initial state of ``st`` as ``(*batch, K, V)`` (``V = 1`` for a shared state)."""
        init = mx.squeeze(self._initial(states, [st.symbol], sizes)[st.symbol], 0)  # (*batch, V, K)
        return mx.swapaxes(init, -1, -2)

    def _block(self, values, T, sizes):
        return Block(values, T, self._ones(sizes))

    def _results(self, outs, finals, out_dtype, sizes):
        spec = self.rec.spec
        T, batch = sizes[spec.time], [sizes[a] for a in spec.batch_axes]
        parts = {}
        for (_, slot), y in zip(self.post.results, outs):
            y = y if isinstance(y, mx.array) else mx.array(y, dtype=mx.float32)
            parts[(slot.tensor, slot.component)] = mx.broadcast_to(
                y, (*batch, T, sizes[spec.lane], 1))
        outputs = [from_canonical(spec, t, [parts[(t.name, c)] for c in range(t.components)],
                                  reduce_missing=False).astype(out_dtype)
                   for t in spec.outputs.values()]
        if finals is None:  # not wanted
            return outputs, []
        last = {st.symbol: mx.swapaxes(S, -1, -2)[None] for st, S in
                zip(self.form.states, finals)}
        return outputs, self._declared(last, self.table.states)

    # -- the backend's interface -----------------------------------------------------------------
    def _call_declared(self, sizes, seg, out_dtype, ends, *arrays):
        """Outputs (in ``out_dtype``) and final states in their declared layouts (none where
        ``ends`` says they are not wanted: ``direct``), from the inputs and the initial
        states: the whole computation, for ``mx.compile``. Half-precision inputs (all of the
        floating-point ones) multiply in their dtype within a chunk."""
        n = len(self.rec.spec.inputs)
        floats = {x.dtype for x in arrays[:n] if mx.issubdtype(x.dtype, mx.floating)}
        operands = floats.pop() if len(floats) == 1 and floats <= {mx.bfloat16, mx.float16} \
            else mx.float32
        outs, finals = self.run(list(arrays[:n]), list(arrays[n:]), dict(sizes), seg, operands,
                                out_dtype=out_dtype, ends=ends)
        outputs, finals = self._results(outs, finals if ends[1] else None, out_dtype,
                                        dict(sizes))
        return (*outputs, *finals)

    def _compiles(self) -> bool:
        """Whether the computation runs under ``mx.compile``: on a GPU, where MLX then fuses its
        elementwise chains (an H100, GLA B8 H16 L4096: forward 4.9 -> 3.3 ms with the layout
        change), and where the kernels it calls, if any, can be traced
        (``function.COMPILED_BACKENDS``: not the simulator's, which evaluate their inputs). Not
        on the CPU, where the compiled call was slower (Mamba-2 B2 L256 H8 N128 forward on 2 x86
        cores: 54 against 41 ms)."""
        return mx.default_device().type == mx.gpu and (
            not self._kernels_on() or self.kernels.backend in COMPILED_BACKENDS)

    def _compiled(self, sizes, seg, out_dtype, ends=(True, True)):
        """The computation for these sizes, compiled where ``_compiles``; ``ends`` as
        ``direct``'s."""
        key = (tuple(sorted(sizes.items())), seg, self._compiles(), self._switches(),
               out_dtype, ends)

        def build():
            call = functools.partial(self._call_declared, key[0], seg, out_dtype, ends)
            return mx.compile(call) if key[2] else call

        return self._compiled_calls.get_or_build(key, build)

    def direct(self, sizes, seg, out_dtype):
        """``(*inputs, *initial states) -> (*outputs, *final states)`` as plain MLX ops (around
        the kernels' core, ``MatrixKernels.core``, where kernels run): MLX's own transforms
        differentiate it from the graph the forward built, and compile it. Through the custom
        function of the full path a VJP traces the forward again and computes it twice when
        the value is used too (a training step's ``value_and_grad``): on an H100 GLA's step
        at B8 H16 L4096 K=V=64 fp32 took 6.3 against 8.6 ms this way (5.1 against 6.4 ms
        under ``mx.compile``), with 4.5 against 5.6 GB of peak memory
        (benchmarks/results/bench-matrix-direct-H100-2026-11-25.md). With MLX ops alone,
        derivatives of any order and vmap are MLX's; through the core, forward mode runs its
        MLX-op form (``core_in_ops``), while a second derivative and vmap raise (the kernels
        have none).

        ``run(*arrays, ends=(initial, final))``: ``initial`` False where the initial states
        are the zeros of a call without ``initial_state``, ``final`` False where the call does
        not return its final states (then none are given): the kernels' core then neither
        reads the one nor writes the other, and no zero cotangent of an unused final state is
        filled for the backward (``MatrixKernels.core``)."""
        n_in = len(self.rec.spec.inputs)

        def run(*arrays, ends=(True, True)):
            outs, finals, _ = self.forward(list(arrays[:n_in]), list(arrays[n_in:]), sizes, seg,
                                           out_dtype, ends)
            return (*outs, *finals)

        return run

    def forward(self, inputs, states, sizes, seg, out_dtype, ends=(True, True)):
        results = self._compiled(sizes, seg, out_dtype, ends)(*inputs, *states)
        n_out = len(self.rec.spec.outputs)
        return list(results[:n_out]), list(results[n_out:]), []

    def _gradients(self, sizes, seg):
        """``(inputs, states, cotangents) -> (input gradients, initial-state gradients)``: MLX's
        VJP of the whole computation, compiled with it (``_compiles``)."""
        spec = self.rec.spec
        n_in, n_state = len(spec.inputs), len(spec.states)
        diff = [i for i, t in enumerate(spec.inputs.values()) if t.differentiable]
        key = ("vjp", tuple(sorted(sizes.items())), seg, self._compiles(), self._switches())

        def build():
            def vjp(*arrays):
                inputs, states = list(arrays[:n_in]), list(arrays[n_in:n_in + n_state])

                def f(*primals):
                    xs = list(inputs)
                    for i, x in zip(diff, primals[:len(diff)]):
                        xs[i] = x
                    return self._call_declared(key[1], seg, mx.float32, (True, True), *xs,
                                               *primals[len(diff):])

                primals = [inputs[i] for i in diff] + states
                return tuple(mx.vjp(f, primals, list(arrays[n_in + n_state:]))[1])

            return mx.compile(vjp) if key[3] else vjp

        return self._compiled_calls.get_or_build(key, build), diff

    def backward(self, inputs, states, residuals, d_outputs, d_finals, sizes, seg,
                 d_residuals=None):
        vjp, diff = self._gradients(sizes, seg)
        cotangents = [d.astype(mx.float32) for d in (*d_outputs, *d_finals)]
        vjps = vjp(*inputs, *states, *cotangents)
        grads = [g.astype(inputs[i].dtype) for i, g in zip(diff, vjps[:len(diff)])]
        d_init = [g.astype(x.dtype) for g, x in zip(vjps[len(diff):], states)]
        return grads, d_init


__all__ = ["MatrixForm", "SUB", "chunk_chain", "read_as_given", "unit_lower_inverse",
           "widened"]
