"""Sequence parallelism: one sequence spread over the ranks of an ``mx.distributed`` group.

``rec(*chunk, group=g)`` runs the recurrence over a sequence whose time axis is split into
contiguous chunks, one per rank in rank order (chunks may differ in length; every other axis
must agree). Each rank passes its own chunk and gets back the outputs of its chunk; the final
state (``return_state=True``) is the state after the last rank's chunk, identical on every rank.
``initial_state`` is the state before rank 0's chunk: every rank passes one of the same shape,
and rank 0's is the one used. The backward is collective: every rank's gradients are those of
the sum of all ranks' losses,

* inputs with the time axis: the gradient for this rank's chunk;
* parameters (inputs without the time axis) and the initial state: this rank's contribution;
  their sum over ranks is the full gradient (``mx.distributed.all_sum``, as for data-parallel
  gradients). The initial state's contribution is the whole gradient on rank 0 and zero on the
  other ranks.

Two algorithms, chosen by the affine analysis (``rec.affine.block_diagonal``, and for delta
rules ``_LowRankPasses.applies``):

* **State-affine recurrences** (``h' = M h + b``): no rank waits for another's scan. Every rank
  summarises its chunk: ``b_r``, its final state from a zero state, and ``P_r = M_last ...
  M_first``, its composed multiplier, so that the chunk maps a start state ``h`` to
  ``P_r h + b_r``. ``P_r`` is block-diagonal over (instance, lane, state element) with the
  K x K blocks of ``rec.affine.blocks``. One ``all_gather`` exchanges ``(P_r, b_r)`` and the
  initial state; every rank folds ``h <- P_q h + b_q`` over the ranks before it from rank 0's
  initial state (in fp32) to get its start state, and over all ranks to get the final state,
  then runs its chunk from its start state. The backward mirrors it: every rank computes its
  local adjoint ``λloc_r`` (the start-state cotangent of its chunk with a zero final-state
  cotangent), one ``all_gather`` exchanges ``λloc_r`` and the final state's cotangent, every
  rank folds ``λ_end_r = P_{r+1}ᵀ λ_end_{r+1} + λloc_{r+1}`` down from the last rank, whose
  ``λ_end`` is the final state's cotangent summed over ranks (every rank returns the final
  state), then runs its chunk's backward from ``λ_end_r``.

  Where the summaries come from (``_Segments``, ``_Passes``):

  - On a kernel backend's chunked schedule (``auto`` on a GPU for long chunks) the chunk's own
    kernels already summarise each segment of it: the summary kernel's local end states and
    composed multipliers, composed over the segments (``_fold``), give ``(P_r, b_r)``, and the
    carry kernel then runs from the start state on those same summaries; the local-adjoint
    kernel's per-segment adjoints, composed with the transposed multipliers, give ``λloc_r``,
    and the adjoint carry reuses them. A rank runs every kernel of one device's forward and
    backward once over its chunk, plus the two folds (each writes 1/16 of a checkpoint buffer)
    and two collectives of a few states: its time and memory are about those of one device on
    its chunk alone.
  - Elsewhere (sequential schedules, the ``mlx`` backend) the backend's passes run twice:
    ``b_r`` from its forward from a zero state, ``λloc_r`` from its backward with a zero
    end-state cotangent (only their end states are kept), and ``P_r`` from
    ``chunk_products``, which evaluates the per-step multipliers ``M_t[i][j] = ∂h'_i/∂h_j``
    (free of the state) with MLX ops and multiplies them in a pairwise tree over time. That is
    two forward and two backward passes per rank. A GPU keeps every buffer a kernel reads or
    writes until the command batch that holds it completes, and MLX encodes far ahead of it,
    so with kernels a rank's peak there is about the sum of the buffers of all four passes:
    2/n of one device's on the whole sequence (with two ranks, as much).
  - A delta rule (every state's multiplier diagonal plus low rank, with the matrix form) is
    summarised the same way with ``P_r`` a ``K x K`` matrix per instance: the matrix form's
    chunk maps composed over the rank's chunk, and ``b_r`` from that same pass
    (``_LowRankPasses``, ``_Transitions``); ``λloc_r`` from the backend's passes as above.
  The products and folds are the chunked schedule's (``affine.py``; ``_matmul``, ``_then``,
  ``_apply``): a zero state is no term, an underflowing product keeps its sign at the smallest
  normal float, and each rank's summary carries its count of zero hits, which the fold
  (``_advance``) turns into NaN where it meets an all-zero state, so non-finite and
  overflowing inputs give what the sequential steps give. The adjoint fold
  (``_Products.retreat``) reads the zero hits of each rank's local adjoint likewise (counted by
  the chunked kernels; ``_Passes``' backward from a zero cotangent meets ``inf * 0`` itself).
* **Other recurrences**: a pipeline, sequential across ranks. Rank ``r`` waits for the state at
  the end of rank ``r - 1``'s chunk, runs its chunk and hands its end state on; the backward
  hands the state adjoint from rank ``r + 1`` to rank ``r``. One forward and one backward pass
  per rank, one rank at a time.

Communication uses collectives only (``all_gather``, ``all_sum``): MLX's NCCL backend has no
``send``/``recv``, so a pipeline hand-over is an ``all_sum`` to which only the sender contributes
a nonzero term (exact: the other terms are zeros). Nothing depends on the backend of the group
(ring, MPI, NCCL, JACCL).

Ordering. Collectives pair up by their order on each rank, and MLX evaluates lazily: every
collective of this module therefore depends on the previous one issued on the same group
(``_collective``), so they run in the order they were created, the same on every rank when the
ranks run the same program. Each call first checks, with one small blocking ``all_gather``,
that all ranks call the same recurrence with chunks that agree on every axis but time (a
mismatch raises on every rank instead of hanging); that check evaluates the previous call's
collectives first. So every rank must make the same calls on the group in the same order, and
every rank must evaluate (or differentiate) what its call returns, as with any collective.
``mx.jvp``, ``mx.vmap`` and second derivatives raise ``NotImplementedError`` with ``group=``;
``mx.compile`` is not supported either.
"""

from __future__ import annotations

import functools
import zlib

import mlx.core as mx
import numpy as np

from .affine import with_dependencies
from .backends.mlx_chunked import apply_multiplier, compose_multipliers
from .backends.reference import Evaluator
from .layout import declared_shape, from_canonical, to_canonical
from .schedule import matrix_chunk
from .spec import Slot

HEADER_SIZE = 16
# Floats of per-step multipliers evaluated at once; longer chunks are multiplied in blocks.
PRODUCT_BLOCK_FLOATS = 1 << 24

_LAST = {}  # _key(group) -> the last collective issued on the group by this module


def _key(group):
    """The group's key in ``_LAST``. ``mx.distributed.init()`` returns a new Python object for
    the same group at every call, so groups are told apart by this process's rank in them and
    their size."""
    return group.rank(), group.size()


def _collective(op, x, group):
    """``op(x, group=group)`` ordered after the previous collective of this module on
    ``group`` (a data dependency, so lazy evaluation cannot reorder them)."""
    last = _LAST.get(_key(group))
    if last is not None:
        x = mx.depends(x, last)
    y = op(x, group=group)
    _LAST[_key(group)] = y
    return y


# ---------------------------------------------------------------------------------------------
# The call
# ---------------------------------------------------------------------------------------------


def call_distributed(rec, group, args, kwargs, *, initial_state, return_state, backend, seg,
                     schedule):
    """``rec(*args, group=group, ...)``: this rank's chunk of a sequence spread over ``group``
    (see the module docstring). Same arguments and results as a call without ``group``."""
    if not isinstance(group, mx.distributed.Group):
        raise TypeError(f"{rec.name}(): group must be an mx.distributed.Group (from "
                        f"mx.distributed.init()), got {type(group).__name__}")
    try:
        call = rec.check(*args, initial_state=initial_state, **kwargs)
        plan = rec.plan_for(call, backend=backend, seg=seg, schedule=schedule)
        if schedule == "auto" and dict(plan.options).get("schedule") in ("scan", "matrix"):
            # the chunked kernels' own summaries serve the cross-rank composition (_Segments);
            # the scan's or the matrix form's passes would each run twice (_Passes)
            plan = rec.plan_for(call, backend=backend, seg=seg, schedule="chunked")
    except Exception:
        _exchange_headers(rec, group, None)  # the other ranks raise too, instead of hanging
        raise
    sizes = dict(plan.sizes)
    _check_chunks(rec, group, sizes)
    checked = _LAST[_key(group)]
    # the plan's recurrence: the twin without gradients for bool and integer inputs, when the
    # call has some
    rules = _Rules(group, checked)
    if rec.affine.block_diagonal:
        fn = _affine_function(plan, group, rules)
    elif _LowRankPasses.applies(rec):  # the matrix form's chunk maps summarise a chunk
        matrix = rec.plan_for(call, backend="mlx", schedule="matrix").backend.matrix
        fn = _affine_function(plan, group, rules, matrix)
    else:
        fn = _pipeline_function(plan, group, rules)
    try:
        results = fn(*call.inputs, *call.states)
    except Exception:  # its collectives are abandoned (alike on every rank): do not chain them
        _LAST[_key(group)] = checked
        raise
    n_out, n_state = len(rec.spec.outputs), len(rec.spec.states)
    return plan.package(results[:n_out], results[n_out:n_out + n_state], return_state)


def _other_axes(spec):
    return [spec.lane, *spec.batch_axes] + ([spec.state_axis] if spec.state_axis else [])


def _fingerprint(rec) -> int:
    s = rec.spec
    text = repr((s.name, s.time, s.lane, [(t.name, t.kind, t.axes) for t in s.tensors.values()],
                 rec.affine.block_diagonal))
    return zlib.crc32(text.encode()) & 0x7FFFFFFF


def _exchange_headers(rec, group, sizes):
    """Every rank's header (one blocking ``all_gather``): ``[ok, fingerprint, chunk length,
    sizes of the other axes...]``; ``sizes`` is None on a rank whose arguments failed."""
    header = np.zeros(HEADER_SIZE, dtype=np.int32)
    if sizes is not None:
        spec = rec.spec
        other = [sizes[a] for a in _other_axes(spec)]
        room = HEADER_SIZE - 3
        if len(other) > room:  # keep the first ones, fold the rest into one checksum
            rest = zlib.crc32(repr(other[room - 1:]).encode()) & 0x7FFFFFFF
            other = other[:room - 1] + [rest]
        header[:3 + len(other)] = [1, _fingerprint(rec), sizes[spec.time], *other]
    gathered = np.array(_collective(mx.distributed.all_gather, mx.array(header)[None], group))
    # Evaluated after every earlier collective: the next one may follow a constant instead,
    # which also holds if this call fails under a transformation (whose arrays are tracers).
    _LAST[_key(group)] = mx.array(gathered)
    return gathered.tolist()


def _check_chunks(rec, group, sizes):
    spec = rec.spec
    headers = _exchange_headers(rec, group, sizes)
    failed = [q for q, h in enumerate(headers) if h[0] != 1]
    if failed:
        raise RuntimeError(f"{rec.name}(group=...): the arguments of rank(s) {failed} failed "
                           "their checks (see the error raised there)")
    if len({h[1] for h in headers}) > 1:
        raise RuntimeError(f"{rec.name}(group=...): the ranks call different recurrences "
                           "(every rank must call the same spec)")
    mine = headers[group.rank()][3:]
    bad = [q for q, h in enumerate(headers) if h[3:] != mine]
    if bad:
        axes = _other_axes(spec)

        def text(h):
            return ", ".join(f"{a}={n}" for a, n in zip(axes, h[3:]))

        lines = "; ".join(f"rank {q}: {text(h)}" for q, h in enumerate(headers))
        raise ValueError(f"{rec.name}(group=...): the ranks' chunks disagree on axes other than "
                         f"the time axis {spec.time} ({lines}); each rank passes a chunk of the "
                         "same sequence, which differs only in length")


# ---------------------------------------------------------------------------------------------
# States as flat fp32 vectors, through the canonical per-slot layout
# ---------------------------------------------------------------------------------------------


class _States:
    """Converts states between the declared layout, canonical arrays by ``Slot`` (shape
    ``(batch..., lane, state axis or 1)``, fp32) and flat vectors."""

    def __init__(self, spec, sizes):
        self.spec, self.sizes = spec, sizes
        self.slots = spec.state_slots()
        self.shapes = {}
        for t in spec.states.values():
            shape = tuple(sizes[a] if a in t.axes else 1 for a in
                          [*spec.batch_axes, spec.lane, spec.state_axis or "__state__"])
            for c in range(t.components):
                self.shapes[Slot(t.name, c)] = shape
        self.size = sum(int(np.prod(s)) for s in self.shapes.values())

    def declared_shapes(self):
        return [declared_shape(t, self.sizes) for t in self.spec.states.values()]

    def canonical(self, states) -> dict:
        out = {}
        for t, x in zip(self.spec.states.values(), states):
            for c, part in enumerate(to_canonical(self.spec, t, x.astype(mx.float32))):
                out[Slot(t.name, c)] = mx.broadcast_to(part, self.shapes[Slot(t.name, c)])
        return out

    def declared(self, canonical: dict) -> list:
        return [from_canonical(self.spec, t, [mx.broadcast_to(canonical[Slot(t.name, c)],
                                                              self.shapes[Slot(t.name, c)])
                                              for c in range(t.components)], False)
                for t in self.spec.states.values()]

    def flat(self, canonical: dict) -> mx.array:
        return mx.concatenate([mx.broadcast_to(canonical[s], self.shapes[s]).reshape(-1)
                               for s in self.slots])

    def unflat(self, x) -> dict:
        out, at = {}, 0
        for s in self.slots:
            n = int(np.prod(self.shapes[s]))
            out[s] = x[at:at + n].reshape(self.shapes[s])
            at += n
        return out

    def zeros(self) -> list:
        return [mx.zeros(s, dtype=mx.float32) for s in self.declared_shapes()]


# ---------------------------------------------------------------------------------------------
# Chunk summaries of state-affine recurrences
# ---------------------------------------------------------------------------------------------


def _matmul(a: dict, b: dict, k: int) -> dict:
    """Per-element product of K x K blocks of multipliers given as ``{(i, j): array}``, with
    the chunked schedule's products (``affine.compose``: a zero factor is no term, an underflow
    keeps its sign at the smallest normal)."""
    out = {}
    for i in range(k):
        for j in range(k):
            acc = compose_multipliers(a[i, 0], b[0, j])
            for m in range(1, k):
                acc = acc + compose_multipliers(a[i, m], b[m, j])
            out[i, j] = acc
    return out


def _tree_product(m: dict, k: int) -> dict:
    """``M_T ... M_1`` of per-step K x K blocks ``{(i, j): array with time first}``, earliest
    step first, by pairwise products (``_matmul``'s, so that an overflow or underflow on the
    way composes as the chunked schedule's products do)."""
    while m[0, 0].shape[0] > 1:
        if m[0, 0].shape[0] % 2:  # the identity after the last step
            m = {(i, j): mx.concatenate([v, mx.full((1, *v.shape[1:]), float(i == j))])
                 for (i, j), v in m.items()}
        later = {key: v[1::2] for key, v in m.items()}
        earlier = {key: v[0::2] for key, v in m.items()}
        m = _matmul(later, earlier, k)
    return {key: v[0] for key, v in m.items()}


def chunk_products(rec, inputs, sizes, block_floats: int = PRODUCT_BLOCK_FLOATS) -> dict:
    """The composed multiplier ``P = M_L ... M_1`` of a state-affine recurrence over a chunk:
    ``{(block, i, j): array}`` in fp32, each of a shape that broadcasts against the canonical
    state layout ``(batch..., lane, state axis or 1)``, so that the chunk maps a start state
    ``h`` to ``P h + b`` (block by block, per element).

    The per-step multipliers ``M_t[i][j] = ∂h'_i/∂h_j`` (``rec.affine.blocks``) are free of the
    state: they are evaluated for the whole chunk at once with MLX ops (time first), then
    multiplied, later steps on the left, in a pairwise tree over time. Chunks whose multipliers
    exceed ``block_floats`` floats are taken in blocks of steps, each block evaluated before
    the next."""
    spec, form = rec.spec, rec.affine
    if not form.block_diagonal:
        raise ValueError(f"{rec.name}: chunk products need a state-affine recurrence with a "
                         f"block-diagonal multiplier ({form.describe()})")
    nb, L = len(spec.batch_axes), sizes[spec.time]
    entries = {(b, i, j): block.multiplier[i][j] for b, block in enumerate(form.blocks)
               for i in range(block.size) for j in range(block.size)}
    reads = set().union(*(e.free_symbols for e in entries.values()))
    reductions = with_dependencies(rec.ir.reductions, reads)
    for r in reductions:
        reads |= r.body.free_symbols
    timed, fixed = {}, {}
    for t, x in zip(spec.inputs.values(), inputs):
        for c in range(t.components):
            sym = spec.symbols[Slot(t.name, c)]
            if sym not in reads:
                continue
            part = to_canonical(spec, t, x.astype(mx.float32))[c]
            if t.has_time:
                timed[sym] = mx.moveaxis(part, nb, 0)
            else:
                fixed[sym] = part[None]
    full = (*[sizes[a] for a in spec.batch_axes], sizes[spec.lane],
            sizes[spec.state_axis] if spec.state_axis else 1)

    def evaluate(start, stop):
        env = dict(fixed)
        env.update({s: v[start:stop] for s, v in timed.items()})
        ev = Evaluator(env, (stop - start, *full))
        for r in reductions:  # ordered by level: a reduction reads only lower ones
            body = mx.broadcast_to(_array(ev(r.body)), (stop - start, *full))
            env[r.target] = mx.sum(body, axis=-1, keepdims=True)
        return {key: _array(ev(e)) for key, e in entries.items()}

    # the shape of each block's entries (one step, never evaluated: shapes are known lazily)
    one = evaluate(0, 1)
    shapes, per_step = {}, 0
    for b, block in enumerate(form.blocks):
        shape = np.broadcast_shapes(*[(1,) * (len(full) + 1)] +
                                    [tuple(one[b, i, j].shape) for i in range(block.size)
                                     for j in range(block.size)])[1:]
        shapes[b] = shape
        per_step += block.size ** 2 * int(np.prod(shape))
    if reductions:
        per_step += len(reductions) * int(np.prod(full))
    step_block = max(1, min(L, block_floats // max(1, per_step)))

    total = None  # the product over the blocks of steps so far
    for start in range(0, L, step_block):
        stop = min(L, start + step_block)
        values = evaluate(start, stop)
        product = {}
        for b, block in enumerate(form.blocks):
            k = block.size
            m = {(i, j): mx.broadcast_to(values[b, i, j], (stop - start, *shapes[b]))
                 for i in range(k) for j in range(k)}
            m = _tree_product(m, k)
            if total is not None:  # later steps on the left
                m = _matmul(m, {(i, j): total[b, i, j] for i in range(k) for j in range(k)}, k)
            product.update({(b, i, j): v for (i, j), v in m.items()})
        total = product
        if stop < L:  # evaluated, then cut from the graph: under mx.grad an evaluated array
            # keeps its inputs, and so every block's multipliers, until the graph is released
            total = {k: mx.array(np.array(v)) for k, v in total.items()}
    return total


def _array(v):
    """An evaluated value as an fp32 array (constants evaluate to Python floats)."""
    return v.astype(mx.float32) if isinstance(v, mx.array) else mx.array(v, dtype=mx.float32)


def _apply(form, products: dict, h: dict, transpose: bool = False) -> dict:
    """``P h`` (or ``Pᵀ h``) block by block, per element; a zero state is no term whatever
    ``P`` (``affine.py``: ``P`` may have overflowed)."""
    out = {}
    for b, block in enumerate(form.blocks):
        for i, si in enumerate(block.slots):
            terms = [apply_multiplier(products[(b, j, i) if transpose else (b, i, j)], h[sj])
                     for j, sj in enumerate(block.slots)]
            acc = terms[0]
            for term in terms[1:]:
                acc = acc + term
            out[si] = acc
    return out


def _advance(form, products: dict, h: dict, offsets: dict, transpose: bool = False) -> dict:
    """``P h + b`` of one rank's chunk (``products`` holds ``P`` and the chunk's zero hits,
    ``offsets`` is ``b``): NaN in a block whose state is all zero where the chunk counted a zero
    hit, as the sequential steps meet ``inf * 0`` there (``affine.zero_hit``). ``transpose``:
    the adjoint's ``Pᵀ λ + λloc``, with the zero hits of the chunk's local adjoint."""
    ph = _apply(form, products, h, transpose)
    out = {}
    for b, block in enumerate(form.blocks):
        zero = h[block.slots[0]] == 0
        for s in block.slots[1:]:
            zero = mx.logical_and(zero, h[s] == 0)
        met = mx.logical_and(zero, products[(b, "hits")] != 0)
        for s in block.slots:
            out[s] = mx.where(met, mx.nan, ph[s] + offsets[s])
    return out


class _FlatMaps:
    """Arrays by key, of fixed shapes (``shapes``), as one flat fp32 vector in a fixed order:
    the same layout on every rank, whichever way its chunk's summary was computed."""

    def __init__(self, shapes: dict):
        self.shapes = shapes

    @functools.cached_property
    def keys(self) -> list:  # the shapes are fixed once made: keys and size are taken once
        return list(self.shapes)

    @functools.cached_property
    def size(self) -> int:
        return sum(int(np.prod(s)) for s in self.shapes.values())

    def flat(self, products: dict) -> mx.array:
        if not self.shapes:
            return mx.zeros((0,), mx.float32)
        return mx.concatenate([mx.broadcast_to(products[k].astype(mx.float32),
                                               self.shapes[k]).reshape(-1) for k in self.keys])

    def unflat(self, x) -> dict:
        out, at = {}, 0
        for k in self.keys:
            n = int(np.prod(self.shapes[k]))
            out[k] = x[at:at + n].reshape(self.shapes[k])
            at += n
        return out


class _Products(_FlatMaps):
    """Product entries of every block, each broadcast to ``(batch..., lane, state axis or 1)``
    (the state axis for blocks whose multiplier varies over it), and the folds over ranks that
    apply them (``_advance``, ``_apply``)."""

    def __init__(self, rec, sizes):
        self.form = rec.affine
        spec = rec.spec
        lead = (*[sizes[a] for a in spec.batch_axes], sizes[spec.lane])
        ns = sizes[spec.state_axis] if spec.state_axis else 1
        self.shapes = {(b, i, j): (*lead, ns if block.pointwise else 1)
                       for b, block in enumerate(rec.affine.blocks)
                       for i in range(block.size) for j in range(block.size)}
        # and per block the chunk's count of zero hits, per state element with the state axis
        self.shapes.update({(b, "hits"): (*lead, ns if block.vector else 1)
                            for b, block in enumerate(rec.affine.blocks)})

    def advance(self, products: dict, h: dict, offsets: dict) -> dict:
        """``P h + b`` of one rank's chunk."""
        return _advance(self.form, products, h, offsets)

    def retreat(self, products: dict, lam: dict, local: dict, hits: dict) -> dict:
        """``Pᵀ λ + λloc`` of one rank's chunk, NaN where ``λ`` is all zero in a block whose
        local adjoint counted zero hits (``hits``, in ``self.hits``' layout)."""
        return _advance(self.form, {**products, **hits}, lam, local, transpose=True)

    @property
    def hits(self) -> "_FlatMaps":
        """The layout of a chunk's local adjoint's zero hits: those of ``P``'s."""
        return _FlatMaps({k: v for k, v in self.shapes.items() if k[1] == "hits"})


class _Transitions(_FlatMaps):
    """The chunk maps of delta-rule states: per state a ``K x K`` matrix per instance, shared
    by the lanes (``S_end = P S_start + b``; the canonical states hold a lane's state as a row,
    so ``P h`` is ``h Pᵀ``)."""

    def __init__(self, rec, sizes):
        spec = rec.spec
        K = sizes[spec.state_axis]
        self.shapes = {slot: (*[sizes[a] for a in spec.batch_axes], K, K)
                       for slot in spec.state_slots()}

    def advance(self, products: dict, h: dict, offsets: dict) -> dict:
        return {s: h[s] @ mx.swapaxes(products[s], -1, -2) + offsets[s] for s in h}

    def retreat(self, products: dict, lam: dict, local: dict, hits: dict) -> dict:
        return {s: lam[s] @ products[s] + local[s] for s in lam}

    @property
    def hits(self) -> _FlatMaps:
        """None counted: the backend's passes give the local adjoint (``_Passes``)."""
        return _FlatMaps({})


# ---------------------------------------------------------------------------------------------
# One rank's chunk: its summary, its run from the start state, and their adjoints
# ---------------------------------------------------------------------------------------------


class _Passes:
    """A chunk run by the backend's own passes, each twice: the forward from a zero state gives
    the local end state ``b`` (``chunk_products`` gives ``P``), then from the start state the
    outputs; the backward from a zero end adjoint gives the local adjoint, then from the end
    adjoint the gradients. Any backend and schedule.

    Only the end state (adjoint) is taken from the summarising passes: a lazy backend does not
    compute the rest of them (outputs, gradients) and an eager one frees it at once."""

    def __init__(self, rec, impl, seg, sizes, out_dtype, options, states):
        self.rec, self.impl, self.seg, self.sizes = rec, impl, seg, sizes
        self.out_dtype, self.options, self.states = out_dtype, options, states

    def summarise(self, inputs):
        """``(P, b, memo)``: the chunk's products and local end state (canonical), and what
        ``forward`` reuses."""
        local_end = self.impl.forward(inputs, self.states.zeros(), self.sizes, self.seg,
                                      self.out_dtype, **self.options)[1]
        # the passes run the steps from a zero state: where they met inf * 0, b is NaN already
        products = chunk_products(self.rec, inputs, self.sizes)
        products.update(_no_hits(self.rec))
        return products, self.states.canonical(local_end), None

    def forward(self, inputs, start, memo):
        """``(outputs, residuals)`` of the chunk from its start states (declared layout)."""
        outs, _, residuals = self.impl.forward(inputs, start, self.sizes, self.seg,
                                               self.out_dtype, **self.options)
        return outs, residuals

    def local_adjoint(self, inputs, start, residuals, d_out):
        """``(λloc, hits, memo)``: the start-state cotangent with a zero end-state cotangent
        (canonical), the zero hits of that sweep by block (none here: the backend's backward
        from a zero cotangent met any ``inf * 0`` itself), and what ``backward`` reuses."""
        lam = self.impl.backward(inputs, start, residuals, d_out, self.states.zeros(), self.sizes,
                                 self.seg, **self.options)[1]
        return self.states.canonical(lam), _no_hits(self.rec), None

    def backward(self, inputs, start, residuals, d_out, lam_end, memo):
        """``(input gradients, start-state gradients)`` from the end adjoint (declared)."""
        return self.impl.backward(inputs, start, residuals, d_out, lam_end, self.sizes, self.seg,
                                  **self.options)


class _LowRankPasses(_Passes):
    """A chunk of a delta rule (every state's multiplier diagonal plus low rank, in the matrix
    form): ``P``, the matrix form's chunk maps composed over the chunk, a ``K x K`` matrix per
    instance where per-step products would hold one per step, and ``b`` from the same pass
    (``MatrixForm.run(transitions=True)`` from zero states); the rest the backend's passes, as
    in ``_Passes``."""

    def __init__(self, rec, impl, seg, sizes, out_dtype, options, states, matrix):
        super().__init__(rec, impl, seg, sizes, out_dtype, options, states)
        self.matrix = matrix

    @staticmethod
    def applies(rec) -> bool:
        form = rec.matrix
        return bool(rec.affine.low_rank) and form.applies and all(st.low_rank
                                                                  for st in form.states)

    def summarise(self, inputs):
        chunk = matrix_chunk(self.rec, "mlx")  # the chunk of the matrix form in MLX ops
        maps, ends = self.matrix.run(inputs, self.states.zeros(), self.sizes, chunk,
                                     transitions=True)
        states = self.matrix.form.states
        # the matrix form's states are (*batch, K, V); canonical ones (*batch, V, K)
        local_end = {st.slot: mx.swapaxes(S, -1, -2) for st, S in zip(states, ends)}
        return {st.slot: P for st, P in zip(states, maps)}, local_end, None


class _Segments:
    """A chunk on a kernel backend's chunked schedule, summarised from its own kernels'
    per-segment summaries (see the module docstring): every kernel of one device's forward and
    backward runs once, and nothing twice.

    The passes are the backend's chunked ones (``backends.kernels.ChunkedPasses``, whose
    buffers hold a state per segment as ``[segment, instance, component, NS or 1, lane]``),
    composed as its forward and backward compose them but cut at the carries, which the ranks
    compose across devices."""

    @staticmethod
    def applies(rec, impl, options) -> bool:
        """On the chunked kernel schedule, for states with every batch axis and the lane axis
        (whose buffers map onto the canonical layout by a reshape)."""
        spec = rec.spec
        return (impl.name != "mlx" and options.get("schedule") == "chunked"
                and all(t.has_lane and set(spec.batch_axes) <= set(t.batch_axes)
                        for t in spec.states.values()))

    def __init__(self, rec, impl, seg, sizes, out_dtype, options, states):
        self.rec, self.sizes, self.out_dtype = rec, sizes, out_dtype
        self.spec = spec = rec.spec
        self.passes = impl.chunked(sizes, seg, options.get("threads"))
        self.where = {Slot(t.name, c): (n, c)  # each slot's state buffer and component
                      for n, t in enumerate(spec.states.values()) for c in range(t.components)}

    def _canonical(self, x):
        """One segment's ``[instance, NS or 1, lane]`` as ``(batch..., lane, NS or 1)``."""
        batch = [self.sizes[a] for a in self.spec.batch_axes]
        return mx.swapaxes(x.reshape(*batch, *x.shape[-2:]), -1, -2)

    def _compose(self, prods, per_segment, adjoint, hits=None):
        """The chunk's ``(P, offsets)`` (canonical) from per-segment buffers: forward, the maps
        ``h <- P_s h + local_s`` from the first segment on, with the chunk's count of zero hits
        under ``(block, "hits")`` (from ``hits``, the summaries'); for the adjoint,
        ``λ <- P_sᵀ λ + local_s`` from the last segment back (only the offsets, ``λloc``)."""
        products, offsets = {}, {}
        for b, block in enumerate(self.rec.affine.blocks):
            k = block.size
            A = [[prods[b][:, :, (j * k + i) if adjoint else (i * k + j)] for j in range(k)]
                 for i in range(k)]
            c = [per_segment[n][:, :, comp] for n, comp in (self.where[s] for s in block.slots)]
            Z = None if hits is None else hits[b][:, :, 0]
            A, c, Z = _fold(A, c, reverse=adjoint, Z=Z)
            for i, s in enumerate(block.slots):
                offsets[s] = self._canonical(c[i][0])
                for j in range(k):
                    products[b, i, j] = self._canonical(A[i][j][0])
            if Z is not None:
                products[b, "hits"] = self._canonical(Z[0])
        return products, offsets

    def summarise(self, inputs):
        local, prods, hits = self.passes.summary(inputs)
        products, local_end = self._compose(prods, local, adjoint=False, hits=hits)
        return products, local_end, (local, prods, hits)

    def forward(self, inputs, start, memo):
        local, prods, hits = memo
        _, ckpts = self.passes.carry(start, local, prods, hits)
        return self.passes.outputs(inputs, ckpts, self.out_dtype), ckpts + prods

    def local_adjoint(self, inputs, start, residuals, d_out):
        n = len(self.spec.states)
        local, hits = self.passes.local_adjoint(inputs, residuals[:n], d_out)
        composed, lam_local = self._compose(residuals[n:], local, adjoint=True, hits=hits or None)
        chunk_hits = {(b, "hits"): composed.get((b, "hits"), mx.array(0.0))
                      for b in range(len(self.rec.affine.blocks))}
        return lam_local, chunk_hits, (local, hits)

    def backward(self, inputs, start, residuals, d_out, lam_end, memo):
        n = len(self.spec.states)
        local, hits = memo
        ckpts, prods = residuals[:n], residuals[n:]
        d_start, lam_ends = self.passes.adjoint_carry(lam_end, local, prods, hits)
        return (self.passes.gradients(inputs, ckpts, d_out, lam_ends),
                self.passes.initial_gradients(d_start, start))


def _no_hits(rec) -> dict:
    """A count of zero hits of none, per block (``_Products``' layout)."""
    return {(b, "hits"): mx.array(0.0) for b in range(len(rec.affine.blocks))}


# ---------------------------------------------------------------------------------------------
# Composing per-segment affine maps
# ---------------------------------------------------------------------------------------------

# The arity of the tree in ``_fold``: each level writes 1/FOLD_ARITY of what it reads.
FOLD_ARITY = 16


def _then(first, second):
    """The affine map ``second ∘ first`` of maps ``(A, c, Z)``: ``x -> A x + c`` per element,
    ``A`` a K x K list of arrays, ``c`` a list of K arrays, with the chunked schedule's products
    (``affine.py``: a zero factor is no term). ``Z``, where not None, counts the zero hits of a
    map started from zero: the first's, and the second's where the first leaves a zero start
    at zero."""
    (A1, c1, Z1), (A2, c2, Z2) = first, second
    k = len(c1)
    A = [[sum((compose_multipliers(A2[i][m], A1[m][j]) for m in range(1, k)),
              compose_multipliers(A2[i][0], A1[0][j])) for j in range(k)] for i in range(k)]
    c = [sum((apply_multiplier(A2[i][m], c1[m]) for m in range(1, k)),
             apply_multiplier(A2[i][0], c1[0]) + c2[i]) for i in range(k)]
    Z = None
    if Z1 is not None:
        zero = c1[0] == 0
        for x in c1[1:]:
            zero = mx.logical_and(zero, x == 0)
        Z = Z1 + mx.where(zero, Z2, 0.0)
    return A, c, Z


def _in_order(maps, reverse=False):
    """The composition of ``maps`` applied first to last (last to first when ``reverse``)."""
    maps = maps[::-1] if reverse else maps
    total = maps[0]
    for m in maps[1:]:
        total = _then(total, m)
    return total


def _fold(A, c, reverse=False, Z=None):
    """The composition of the affine maps ``x -> A_s x + c_s`` stacked along the leading axis
    of ``A`` (a K x K list of arrays) and ``c`` (a list of K arrays), the first map applied
    first (the last first when ``reverse``): ``(A, c, Z)`` with a leading axis of one, ``Z``
    the zero hits of the composed map (``_then``) where the maps' own ``Z`` is given.

    A tree of ``FOLD_ARITY``-ary levels. A level composes the maps of all its groups at once,
    one map after the other, reading them as strided views. Each op of that chain is the only
    reader of the previous op's result, whose buffer MLX then reuses (donation), so a level
    allocates about one buffer the size of its results: 1/FOLD_ARITY of what it reads, which is
    what a GPU, holding every buffer of an evaluation until it completes, keeps of it. The maps
    left at the end of a level (fewer than a group, one segment's each) are composed on their
    own and join the total in time order."""
    leftovers = []  # per level, its last maps composed: later in time than the level's groups
    while c[0].shape[0] > 1:
        n = c[0].shape[0]
        arity = min(FOLD_ARITY, n)
        whole = n - n % arity
        if whole < n:
            leftovers.append(_in_order([_at(A, c, Z, slice(s, s + 1)) for s in range(whole, n)],
                                       reverse))
        A, c, Z = _in_order([_at(A, c, Z, slice(j, whole, arity)) for j in range(arity)],
                            reverse)
    # in time order: the last level's groups, then each level's leftovers, deepest first
    return _in_order([(A, c, Z), *leftovers[::-1]], reverse)


def _at(A, c, Z, index):
    """The maps ``index`` (a slice along the leading axis) of stacked maps."""
    return [[a[index] for a in row] for row in A], [x[index] for x in c], \
        None if Z is None else Z[index]


# ---------------------------------------------------------------------------------------------
# The two algorithms as custom functions
# ---------------------------------------------------------------------------------------------

_NO_TRANSFORM = ("{what} is not supported for a call with group= (sequence parallelism): "
                 "use mx.grad / mx.vjp, or call without group=")
_SECOND = "a second derivative (mx.grad or mx.jvp of a gradient)"


class _Rules:
    """The refusing transformation rules of one call. A refusal abandons the collectives that
    the failed transformation created (alike on every rank), so the next collective on the
    group follows the call's header instead (a constant, evaluated after everything before)."""

    def __init__(self, group, checked):
        self.group, self.checked = group, checked
        self.no_vmap = mx.custom_function(lambda *arrays: arrays)
        self.no_vmap.vmap(self.refuse("mx.vmap"))

    def refuse(self, what):
        def rule(*_):
            _LAST[_key(self.group)] = self.checked
            raise NotImplementedError(_NO_TRANSFORM.format(what=what))

        return rule

    def opaque(self, arrays):
        """The arguments as a custom function's body uses them. MLX's jvp and vmap walk into
        the body: the stop-gradient keeps jvp on the custom rule, and ``no_vmap`` meets vmap
        first; both refuse with a clear error instead of failing in the body's collectives."""
        return list(self.no_vmap(*[mx.stop_gradient(a) for a in arrays]))

    def forward(self, fn):
        fn.jvp(self.refuse("mx.jvp"))
        fn.vmap(self.refuse("mx.vmap"))
        return fn

    def first_order(self, fn):
        fn.vjp(self.refuse(_SECOND))
        fn.jvp(self.refuse(_SECOND))
        fn.vmap(self.refuse("mx.vmap"))
        return fn


def _affine_function(plan, group, rules, matrix=None):
    """``matrix``: for a delta rule, the matrix form whose chunk maps summarise the chunk
    (``_LowRankPasses``)."""
    rec, impl, seg, out_dtype = plan.recurrence, plan.backend, plan.seg, plan.out_dtype
    sizes, options = dict(plan.sizes), dict(plan.options)
    spec = rec.spec
    n_in, n_out, n_state = len(spec.inputs), len(spec.outputs), len(spec.states)
    rank, size = group.rank(), group.size()
    states = _States(spec, sizes)
    if matrix is not None:
        products = _Transitions(rec, sizes)
        chunk = _LowRankPasses(rec, impl, seg, sizes, out_dtype, options, states, matrix)
    else:
        products = _Products(rec, sizes)
        chunk = (_Segments if _Segments.applies(rec, impl, options) else _Passes)(
            rec, impl, seg, sizes, out_dtype, options, states)

    def unpack_summary(row):
        p, n = products.size, states.size
        return (products.unflat(row[:p]), states.unflat(row[p:p + n]), states.unflat(row[p + n:]))

    @mx.custom_function
    def forward(*arrays):
        arrays = rules.opaque(arrays)
        inputs, init = list(arrays[:n_in]), list(arrays[n_in:])
        mine, local_end, memo = chunk.summarise(inputs)
        payload = mx.concatenate([products.flat(mine), states.flat(local_end),
                                  states.flat(states.canonical(init))])
        gathered = _collective(mx.distributed.all_gather, payload[None], group)
        h = unpack_summary(gathered[0])[2]  # rank 0's initial state
        start = h
        for q in range(size):
            if q == rank:
                start = h
            p, b, _ = unpack_summary(gathered[q])
            h = products.advance(p, h, b)
        start = states.declared(start)
        outs, residuals = chunk.forward(inputs, start, memo)
        return (*outs, *states.declared(h), *start, gathered, *residuals)

    @mx.custom_function
    def backward(*arrays):
        inputs, init, start, (gathered,), residuals, d_out, d_fin = _backward_arguments(
            rules.opaque(arrays), n_in, n_state, n_out)
        lam_local, lam_hits, memo = chunk.local_adjoint(inputs, start, residuals, d_out)
        hits = products.hits
        payload = mx.concatenate([states.flat(lam_local), hits.flat(lam_hits),
                                  states.flat(states.canonical(d_fin))])
        adjoints = _collective(mx.distributed.all_gather, payload[None], group)
        n, z = states.size, hits.size
        parts = [(states.unflat(adjoints[q, :n]), hits.unflat(adjoints[q, n:n + z]),
                  states.unflat(adjoints[q, n + z:])) for q in range(size)]
        lam = parts[0][2]
        for q in range(1, size):  # the final state's cotangent, summed over ranks in rank order
            lam = {s: lam[s] + parts[q][2][s] for s in states.slots}
        for q in range(size - 1, rank, -1):  # λ_end_{q-1} = P_qᵀ λ_end_q + λloc_q
            lam = products.retreat(unpack_summary(gathered[q])[0], lam, parts[q][0], parts[q][1])
        grads, lam_start = chunk.backward(inputs, start, residuals, d_out, states.declared(lam),
                                          memo)
        d_init = [(g if rank == 0 else mx.zeros_like(x)).astype(x.dtype)
                  for g, x in zip(lam_start, init)]
        return tuple(mx.depends([*grads, *d_init], adjoints))

    return _with_backward(forward, backward, rules, n_out, n_state)


def _backward_arguments(arrays, n_in, n_state, n_out) -> tuple:
    """A collective backward's arguments, split: inputs, initial states, this chunk's start
    states, the forward's one extra output, the inner residuals, output and final-state
    cotangents (the order ``_with_backward`` passes them in)."""
    arrays = list(arrays)
    head = n_in + 2 * n_state
    tail = len(arrays) - n_out - n_state
    return (arrays[:n_in], arrays[n_in:n_in + n_state], arrays[n_in + n_state:head],
            arrays[head:head + 1], arrays[head + 1:tail], arrays[tail:tail + n_out],
            arrays[tail + n_out:])


def _with_backward(forward, backward, rules, n_out, n_state):
    """``forward`` with ``backward`` as its VJP (fed the forward's extra residual outputs), and
    both wrapped by the group's transform rules (first order only)."""
    rules.first_order(backward)

    @forward.vjp
    def forward_vjp(primals, cotangents, outputs):
        extra = list(outputs[n_out + n_state:])
        return backward(*primals, *extra, *cotangents[:n_out + n_state])

    return rules.forward(forward)


def _pipeline_function(plan, group, rules):
    impl, seg, sizes, options = plan.backend, plan.seg, dict(plan.sizes), dict(plan.options)
    spec = plan.recurrence.spec
    n_in, n_out, n_state = len(spec.inputs), len(spec.outputs), len(spec.states)
    rank, size = group.rank(), group.size()
    inner = plan.function  # the full path: its checkpoints are the backward's residuals
    states = _States(spec, sizes)

    def flat(declared):
        return states.flat(states.canonical(declared))

    def unflat(x):
        return states.declared(states.unflat(x))

    @mx.custom_function
    def forward(*arrays):
        arrays = rules.opaque(arrays)
        inputs, init = list(arrays[:n_in]), list(arrays[n_in:])
        start = [x.astype(mx.float32) for x in init]
        for q in range(size):  # hand-over q: the state after rank q's chunk
            if q == rank:
                results = inner(*inputs, *start)
                outs, residuals = results[:n_out], results[n_out + n_state:]
                x = flat(results[n_out:n_out + n_state])
            else:
                x = mx.zeros((states.size,), dtype=mx.float32)
            handed = _collective(mx.distributed.all_sum, x, group)
            if q == rank - 1:
                start = unflat(handed)
        outs = mx.depends(list(outs), handed)
        return (*outs, *unflat(handed), *start, handed, *residuals)

    @mx.custom_function
    def backward(*arrays):
        # the extra forward output (the last hand-over) only orders the collectives
        inputs, init, start, _, residuals, d_out, d_fin = _backward_arguments(
            rules.opaque(arrays), n_in, n_state, n_out)
        lam = _collective(mx.distributed.all_sum, flat(d_fin), group)  # summed over ranks
        grads = lam_start = None
        for q in range(size - 1, -1, -1):  # hand-over q: the adjoint at the start of chunk q
            if q == rank:
                grads, lam_start = impl.backward(inputs, start, residuals, d_out, unflat(lam),
                                                 sizes, seg, **options)
            if q == 0:
                break
            x = flat(lam_start) if q == rank else mx.zeros((states.size,), dtype=mx.float32)
            handed = _collective(mx.distributed.all_sum, x, group)
            if q == rank + 1:
                lam = handed
        last = _LAST[_key(group)]
        d_init = [(g if rank == 0 else mx.zeros_like(x)).astype(x.dtype)
                  for g, x in zip(lam_start, init)]
        return tuple(mx.depends([*grads, *d_init], last))

    return _with_backward(forward, backward, rules, n_out, n_state)


__all__ = ["call_distributed", "chunk_products"]
