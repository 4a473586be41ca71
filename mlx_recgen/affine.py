"""Affine analysis: is the state update ``h' = M(inputs) h + b(inputs)``?

When it is, a sequence of steps composes into one affine map, so time can run in parallel:
every segment summarises itself from a zero state (its local end state and its composed
multiplier ``P = M_last ... M_first``), a short carry over segments turns summaries into the
states at segment starts, and every segment then reruns its steps from its own start. The
adjoint is affine in ``λ`` with the transposed multipliers, so the backward runs the same three
phases in reverse. One analysis serves every backend.

The multiplier must be block-diagonal over the state index: each state element ``h[n]`` is
mixed only with the same element ``n`` of the other components of its block (a scalar per
element for GLA, SSD, RG-LRU; a 2x2 rotation for the rotational LRU). The analysis is symbolic:

* a reduction over the state axis that reads the state (``Σ_n k[n] h[n]``, a delta rule)
  mixes state elements: the multiplier is then diagonal plus low rank (``LowRankRead``), still
  affine and time-parallel, but its chunks compose ``K x K`` products, which the chunked and
  scan schedules do not run (``AffineForm.block_diagonal``): the matrix schedule runs it
  (``matrix.py``, the UT transform of a delta rule);
* ``M = ∂F/∂h`` must not depend on the state (``tanh(h)``, ``max(h, x)`` and ``|h|`` fail);
* a state with the state axis and one without may not feed each other's updates.

Outputs may be any function of the states: they are recomputed per segment.

Non-finite values. The sequential steps never form a product of multipliers, the chunked
schedule does, and IEEE's ``inf * 0 = NaN`` would turn exact results into NaN: a product that
overflows meets a zero state, one that underflows meets an infinite state, an infinite gate
meets the zero state a summary starts from. A composed map keeps the state's part apart from
the inputs' part, so the chunked forms compose with three operations (``scale``, ``compose``
here; the carry's ``apply`` in the backends), each IEEE's product but for one rule:

* a zero state is no term: ``scale(m, 0)`` is 0 (NaN if ``m`` is NaN), ``apply(P, 0)`` is 0
  whatever ``P`` (a NaN gate inside ``P`` also reached the inputs' part through ``scale``);
* ``compose`` keeps a product of nonzero multipliers that underflows at the smallest normal
  float with its sign, so that an infinite state it scales stays infinite;
* a summary counts where an infinite multiplier met its zero state (``zero_hit``): from a zero
  segment start the sequential steps meet ``inf * 0`` there, and the carry gives NaN.

The backward's local adjoint (``local_adjoint_program``) is swept from a zero ``λ`` likewise: its
stores ``M w`` (``w`` the cotangent reaching the updated state) become ``scale(M, w)`` with a
count of zero hits, which the adjoint carry reads as the forward carry reads the summary's.

The scan schedule composes the same maps in a tree instead of a chain; a composed map's count
of zero hits is the later map's where the earlier one leaves a zero start at zero.

What remains different from the sequential steps: a product that overflows applied to a tiny
state is infinite here where the sequential steps may stay finite; in a ``K x K`` block, an
infinite multiplier distributed over the block's entries (``a cos u - a sin w``) may be
``inf - inf`` where the step's own expression (``a (cos u - sin w)``) is infinite; likewise an
infinite gate that meets an already infinite state multiplies the state's two parts apart
(``inf * (P h + l)`` becomes ``inf * P h + inf * l``), which is ``inf - inf`` where the local
part ``l`` has the other sign. Each of these gives NaN where the sequential steps give an
infinity, never a finite number.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import sympy

from .ir import Assign, Loop, Program, StepIR, Store, prune, schedule_forward
from .spec import Slot


@dataclass(frozen=True)
class AffineBlock:
    """State slots mixed with each other by the multiplier, and the multiplier itself.

    ``multiplier[i][j] = ∂F_i/∂h_j`` over the step's inputs and state-free reductions.
    ``vector``: the slots carry the state axis. ``pointwise``: some entry varies over the state
    index (SSD's ``exp(delta A[n])``); otherwise one multiplier serves every element (GLA's
    ``g``), and the composed multiplier is stored once per lane instead of once per element."""

    slots: tuple
    multiplier: tuple  # K x K sympy expressions
    vector: bool
    pointwise: bool
    components: int = 1  # of the slots' tensor, for labels

    @property
    def size(self) -> int:
        return len(self.slots)


@dataclass(frozen=True)
class LowRankRead:
    """A read of a state through a sum over the state axis that the state's own update adds
    back: ``ρ = Σ_n β[n] h[n]`` and ``h'[n] = d[n] h[n] + α[n] ρ + ...``, so the multiplier is
    ``diag(d) + α βᵀ`` over the state axis (a delta rule: ``α = -β_t k``, ``β = k``; RWKV-7:
    ``α = b``, ``β = a``). ``probe``: the sum's target ``ρ``; ``alpha = ∂h'/∂ρ`` and
    ``beta = ∂ρ/∂h``, both free of the state."""

    slot: Slot
    probe: sympy.Symbol
    alpha: sympy.Expr
    beta: sympy.Expr


@dataclass(frozen=True)
class AffineForm:
    """The result of the analysis: blocks when time-parallel, else the reason it is not.
    ``low_rank``: the reads that add a low-rank part to a block's diagonal multiplier (empty:
    the multiplier is block-diagonal)."""

    time_parallel: bool
    reason: str
    blocks: tuple = ()
    low_rank: tuple = ()

    @property
    def block_diagonal(self) -> bool:
        """Time-parallel with a block-diagonal multiplier: every state element is mixed only
        with the other components of its own element, so a chunk's composed multiplier is a
        small block per element (what the chunked and scan schedules compose)."""
        return self.time_parallel and not self.low_rank

    def describe(self) -> str:
        if not self.time_parallel:
            return f"sequential only: {self.reason}"
        parts = []
        for b in self.blocks:
            names = ", ".join(s.label(b.components) for s in b.slots)
            kind = "per state element" if b.pointwise else "per lane"
            shape = "scalar" if b.size == 1 else f"{b.size}x{b.size} block"
            reads = [r for r in self.low_rank if r.slot in b.slots]
            if reads:
                sums = ", ".join(f"{r.probe} = Σ({r.beta}·{names})" for r in reads)
                parts.append(f"{names}: diagonal {kind} plus rank {len(reads)} over the state "
                             f"axis (reads {sums})")
            else:
                parts.append(f"{names}: {shape} multiplier {kind}")
        return "time-parallel (state-affine: h' = M h + b; " + "; ".join(parts) + ")"


def _state_dependent_reductions(ir: StepIR, state_syms: set) -> dict:
    """Reductions whose body reads the state, directly or through another such reduction."""
    dependent = {}
    for r in ir.reductions:  # ordered by level: a reduction only reads lower levels
        reads = r.body.free_symbols & (state_syms | set(dependent))
        if reads:
            dependent[r.target] = r
    return dependent


def analyse(ir: StepIR) -> AffineForm:
    """Decide symbolically whether the step's state update is affine with a block-diagonal
    multiplier, and return its blocks."""
    spec = ir.spec
    slots = spec.state_slots()

    def label(slot):
        return slot.label(spec.states[slot.tensor].components)

    sym = {s: spec.symbols[s] for s in slots}
    state_syms = set(sym.values())
    dependent = _state_dependent_reductions(ir, state_syms)

    low_rank, reason = _low_rank_reads(ir, dependent, sym, label)
    if reason:
        return AffineForm(False, reason)
    probes = {r.probe for r in low_rank}

    entries = {}
    for s in slots:
        update = ir.new_state[s]
        for other in slots:
            m = sympy.diff(update, sym[other]) if sym[other] in update.free_symbols else sympy.S.Zero
            if m.free_symbols & (state_syms | probes):
                return AffineForm(False, f"the update of state '{label(s)}' is not affine in "
                                         f"'{label(other)}': ∂/∂{label(other)} = {m} depends on "
                                         "the state")
            if m != 0 and ir.is_vector_slot(s) != ir.is_vector_slot(other):
                return AffineForm(False, f"the update of state '{label(s)}' reads state "
                                         f"'{label(other)}', and only one of them carries the "
                                         "state axis (the multiplier is not block-diagonal)")
            entries[(s, other)] = m

    # Blocks: slots connected by a nonzero off-diagonal multiplier entry.
    parent = {s: s for s in slots}

    def root(s):
        while parent[s] != s:
            s = parent[s]
        return s

    for (a, b), m in entries.items():
        if a != b and m != 0:
            parent[root(a)] = root(b)
    groups: dict = {}
    for s in slots:
        groups.setdefault(root(s), []).append(s)
    vector_syms = set(ir.vector)
    blocks = []
    for members in groups.values():
        mult = tuple(tuple(entries[(a, b)] for b in members) for a in members)
        pointwise = any(e.free_symbols & vector_syms for row in mult for e in row)
        comps = spec.states[members[0].tensor].components
        blocks.append(AffineBlock(tuple(members), mult, ir.is_vector_slot(members[0]), pointwise,
                                  comps))
    return AffineForm(True, "", tuple(blocks), tuple(low_rank))


def _low_rank_reads(ir: StepIR, dependent: dict, sym: dict, label) -> tuple:
    """The reads of the state through sums over the state axis that updates add back
    (``LowRankRead``), or the reason an update's read of such a sum is not of that form:
    ``(reads, reason)``. A sum qualifies when it is linear in one state with a state-free
    coefficient and no constant part, and only that state's update reads it, linearly."""
    spec = ir.spec
    state_syms = set(sym.values())
    reads = []
    for s in spec.state_slots():
        update = ir.new_state[s]
        for target in sorted(update.free_symbols & set(dependent), key=str):
            r = dependent[target]
            why = f"the update of state '{label(s)}' reads the reduction {target} = Σ({r.body})"
            if not ir.is_vector_slot(s):
                return [], f"{why}, and '{label(s)}' has no state axis"
            others = r.body.free_symbols & ((state_syms - {sym[s]}) | set(dependent))
            if others:
                return [], (f"{why}, which reads {sorted(map(str, others))} besides "
                            f"'{label(s)}' (a read of another state or sum mixes states)")
            beta = sympy.diff(r.body, sym[s])
            if beta.free_symbols & state_syms or r.body.xreplace({sym[s]: 0}) != 0:
                return [], f"{why}, which is not linear in '{label(s)}' without a constant part"
            alpha = sympy.diff(update, target)
            if alpha.free_symbols & (state_syms | set(dependent)):
                return [], f"{why} and is not linear in it: ∂/∂{target} = {alpha}"
            readers = [o for o in spec.state_slots() if o != s and
                       target in ir.new_state[o].free_symbols]
            if readers:
                return [], (f"{why}, and so does the update of '{label(readers[0])}' (a read "
                            "shared by two states mixes them)")
            reads.append(LowRankRead(s, target, alpha, beta))
    return reads, ""


# ---------------------------------------------------------------------------------------------
# The segment summary: the state update plus the running product of multipliers
# ---------------------------------------------------------------------------------------------


class scale(sympy.Function):
    """``m * h``, a step's multiplier applied to a state, where a zero state is no term: 0 even
    for an infinite ``m`` (NaN for a NaN ``m``). Rendered ``recgen_scale``; never
    differentiated (the summary is a forward program). Symbolically ``scale(m, 0)`` is 0: the
    step maps' offsets, whose non-finite multipliers the pure-MLX scan counts itself."""

    nargs = 2

    @classmethod
    def eval(cls, m, h):
        if h.is_zero or m.is_zero:
            return sympy.S.Zero
        if m == 1:
            return h


class zero_hit(sympy.Function):
    """1 where an infinite multiplier ``m`` meets a zero state ``h``, else 0. Counted over a
    segment summary, which starts from zero: where the state at the segment's start is zero
    too, the sequential steps meet ``inf * 0 = NaN`` there, and the carry gives NaN. Rendered
    ``recgen_zero_hit``."""

    nargs = 2

    @classmethod
    def eval(cls, m, h):
        if m.is_Number and m.is_finite:  # (a spec's symbols are real, so "finite" to sympy)
            return sympy.S.Zero


class compose(sympy.Function):
    """``m * p``, a step's multiplier times a product of multipliers: zero terms as in
    ``scale``, and a product of nonzero factors that underflows is the smallest normal float
    with its sign. Rendered ``recgen_compose``."""

    nargs = 2

    @classmethod
    def eval(cls, m, p):
        if m.is_zero or p.is_zero:
            return sympy.S.Zero
        if m == 1:
            return p
        if p == 1:
            return m


@dataclass(frozen=True)
class ProductEntry:
    """Entry (row, col) of block ``block``'s composed multiplier, and the symbol that holds it.
    Row ``K`` (the block's size), column 0, with ``hits``, is the block's count of zero hits
    instead (see ``zero_hit``; per state element where the block has the state axis): a buffer
    of its own in the kernels, read by the forward carry only."""

    block: int
    row: int
    col: int
    symbol: sympy.Symbol
    pointwise: bool
    hits: bool = False

    @property
    def slot(self) -> Slot:
        return Slot(str(self.symbol), 0)


class _SummaryIR(StepIR):
    """The step IR extended with product entries, which are state-like slots of their own."""

    product_vector: frozenset = frozenset()

    def is_vector_slot(self, slot):
        if slot.tensor in self.spec.tensors:
            return super().is_vector_slot(slot)
        return slot in self.product_vector


def product_entries(ir: StepIR, form: AffineForm) -> list:
    """One symbol per entry of every block's composed multiplier ``P``."""
    out = []
    for b, block in enumerate(form.blocks):
        for i in range(block.size):
            for j in range(block.size):
                out.append(ProductEntry(b, i, j, ir.namer(f"P{b}_{i}{j}"), block.pointwise))
        # a hit depends on the state element: per element in a block with the state axis
        out.append(ProductEntry(b, block.size, 0, ir.namer(f"Z{b}"),
                                block.pointwise or block.vector, True))
    return out


def _summary_updates(ir: StepIR, form: AffineForm, products: list) -> dict:
    """The summary step's stores: ``h_i <- Σ_j scale(M_ij, h_j) + F_i(0)`` (the update split
    into the state's part and the inputs' part, ``F_i(0)`` with the state symbolically zero)
    and ``P_ij <- Σ_k compose(M_ik, P_kj)``."""
    spec = ir.spec
    entry = {(p.block, p.row, p.col): p for p in products}
    new_state = {}
    for b, block in enumerate(form.blocks):
        syms = [spec.symbols[s] for s in block.slots]
        zero = {h: sympy.S.Zero for h in syms}
        for i, s in enumerate(block.slots):
            offset = ir.new_state[s].xreplace(zero)
            new_state[s] = sympy.Add(offset, *[scale(block.multiplier[i][j], syms[j])
                                               for j in range(block.size)])
        for i in range(block.size):
            for j in range(block.size):
                new_state[entry[(b, i, j)].slot] = sympy.Add(*[
                    compose(block.multiplier[i][k], entry[(b, k, j)].symbol)
                    for k in range(block.size)])
        hits = entry[(b, block.size, 0)]
        new_state[hits.slot] = sympy.Add(hits.symbol, *[
            zero_hit(m, syms[j]) for row in block.multiplier for j, m in enumerate(row)])
    return new_state


def _summary_ir(ir: StepIR, products: list, new_state: dict) -> _SummaryIR:
    reads = set().union(*(e.free_symbols for e in new_state.values()))
    keep = with_dependencies(ir.reductions, reads)
    vector = set(ir.vector) | {p.symbol for p in products if p.pointwise}
    summary = _SummaryIR(ir.spec, keep, new_state, {}, frozenset(vector), ir.namer)
    summary.product_vector = frozenset(p.slot for p in products if p.pointwise)
    return summary


def summary_program(ir: StepIR, form: AffineForm, products: list) -> Program:
    """One step of a segment summary: the state update (run from a zero state it yields the
    segment's local end state) and ``P <- M P`` (from the identity, the composed multiplier).
    Stores are all of kind ``state``: product entries are stored to their own slots."""
    return schedule_forward(_summary_ir(ir, products, _summary_updates(ir, form, products)))


def plain_summary_program(ir: StepIR, form: AffineForm, products: list):
    """The summary step in IEEE products, for forms whose blocks are all 1 x 1 (else ``None``):
    ``scale`` and ``compose`` as ``*``, no zero hits (their counts stay at zero).

    A run of this step whose composed multipliers all end finite and nonzero gives the values
    of ``summary_program`` up to the sign of a zero: a non-finite factor leaves a product of 1 x 1
    multipliers non-finite (``inf * x`` is infinite or NaN, and stays so), a zero factor or an
    underflow leaves it zero, so such a run met neither, and with finite nonzero multipliers
    ``scale``, ``compose`` and ``zero_hit`` are ``m * h``, ``m * p`` and 0. The kernels run it
    first and the careful step only on runs that fail that test (``recgen_exact``): the careful
    products are most of a diagonal summary's instructions."""
    if any(block.size != 1 for block in form.blocks):
        return None
    hits = {p.slot for p in products if p.hits}
    updates = {s: e.replace(scale, lambda m, h: m * h).replace(compose, lambda m, q: m * q)
               for s, e in _summary_updates(ir, form, products).items() if s not in hits}
    return schedule_forward(_summary_ir(ir, products, updates))


def step_maps_program(ir: StepIR, form: AffineForm, products: list) -> Program:
    """Every step's own map: the summary step from a zero state and the identity product,
    symbolically, so its stores are the offset ``F(0)`` (under the state's slots) and the
    multiplier ``M`` (under the product entries' slots), read from the inputs only."""
    start = {ir.spec.symbols[s]: sympy.S.Zero for s in ir.spec.state_slots()}
    start.update({p.symbol: sympy.S.One if p.row == p.col else sympy.S.Zero for p in products})
    hits = {p.slot for p in products if p.hits}
    maps = {s: e.xreplace(start) for s, e in _summary_updates(ir, form, products).items()
            if s not in hits}
    return schedule_forward(_summary_ir(ir, products, maps))


def with_dependencies(reductions, reads) -> list:
    targets = {r.target: r for r in reductions}
    need = {s for s in reads if s in targets}
    frontier = list(need)
    while frontier:
        for s in targets[frontier.pop()].body.free_symbols:
            if s in targets and s not in need:
                need.add(s)
                frontier.append(s)
    return [r for r in reductions if r.target in need]


def outputs_of_updated_state(ir: StepIR):
    """The outputs as functions of the updated state, where every read of the old state is
    inside the update's own expression (``y = a h + x`` with ``h <- a h + x`` reads ``h'``):
    a program whose state symbols stand for the states after the step, or ``None``.

    The chunked forms know the states after every step; outputs computed from them take one
    cotangent per updated state, as the sequential steps' do (recomputed from the states
    before the step, an input's gradient is split between two products, ``ȳ h + λ h``, which
    is NaN for an infinite ``h`` and ``λ = 0``)."""
    spec = ir.spec
    old = {spec.symbols[s] for s in spec.state_slots()}
    fresh = {e: sympy.Dummy(f"{spec.symbols[s]}_new") for s, e in ir.new_state.items()}
    outputs = {s: e.xreplace(fresh) for s, e in ir.outputs.items()}
    reads = set().union(*(e.free_symbols for e in outputs.values()))
    reductions = [type(r)(r.target, r.body.xreplace(fresh), r.level)
                  for r in with_dependencies(ir.reductions, reads)]
    exprs = list(outputs.values()) + [r.body for r in reductions]
    if any(e.free_symbols & old for e in exprs):
        return None
    back = {d: spec.symbols[s] for s, d in ((s, fresh[e]) for s, e in ir.new_state.items())}
    outputs = {s: e.xreplace(back) for s, e in outputs.items()}
    reductions = [type(r)(r.target, r.body.xreplace(back), r.level) for r in reductions]
    return schedule_forward(StepIR(spec, reductions, {}, outputs, ir.vector, ir.namer))


class LocalAdjoint(NamedTuple):
    """The step of a local adjoint (``local_adjoint_program``): its program, and whether that
    counts zero hits (stores of kind ``hits``)."""

    program: Program
    counts_hits: bool


def local_adjoint_program(ir: StepIR, form: AffineForm, adjoint, products: list) -> LocalAdjoint:
    """The adjoint's ``λ`` statements for a sweep from a zero ``λ`` (a segment's or a run's
    local adjoint; ``adjoint`` is ``adjoint.Adjoint``), and whether they count zero hits.

    The adjoint of an affine step is ``λ_j <- Σ_i M_ij w_i + r_j`` with ``w_i = λ_i + u_i``, the
    cotangent that reaches the updated state (``u`` from the outputs that read it), and ``r``
    from outputs that read the state before the step (RWKV-6's). From a zero ``λ`` an infinite
    ``M`` meets ``w = 0`` where the sequential sweep, from the true ``λ``, may not. As in the
    forward summary, the store becomes ``scale(M, w) + r`` and a count of zero hits per block
    (stores of kind ``hits``, which add to the block's count: per element where the block has
    the state axis), and the carry gives NaN where the incoming adjoint is zero too.

    For a single-slot block the store's expression, temporaries substituted, is ``M w`` where
    it divided by ``M`` has no denominator and the derivative 1 in the slot's own ``λ`` (then
    ``r = 0``); or ``M λ + r`` where no term of ``r`` is a multiple of ``M`` (then ``u = 0``).
    Where a state's store is neither (a block of several slots, a state without the lane axis,
    whose ``λ`` is a lane's share, or outputs that read the state both before and after the
    step), the plain ``λ`` statements are returned and no hits are counted."""
    plain = prune(adjoint.program, lambda store: store.kind == "lambda")
    if any(blk.size != 1 for blk in form.blocks) or not all(
            t.has_lane for t in ir.spec.states.values()):
        return LocalAdjoint(plain, False)
    block_of = {blk.slots[0]: b for b, blk in enumerate(form.blocks)}
    hits_slot = {p.block: p.slot for p in products if p.hits}
    defs, factored = {}, []

    def split(expr, m, lam):
        """``(w, r)`` with ``expr == m w + r`` as above, or None."""
        full = expr.xreplace(defs)
        w = sympy.piecewise_fold(sympy.together(full / m))  # a masked M: branch by branch
        if w.as_numer_denom()[1].is_number and sympy.expand(sympy.diff(w, lam)) == 1:
            return w, sympy.S.Zero
        full = sympy.expand(full)
        if sympy.expand(full.coeff(lam) - m) != 0:
            return None
        rest = sympy.expand(full - m * lam)
        if any(sympy.together(t / m).as_numer_denom()[1].is_number
               for t in sympy.Add.make_args(rest) if t != 0):
            return None  # part of the rest may be M u: w is not found
        return lam, rest

    def rewrite(statements):
        out = []
        for st in statements:
            if isinstance(st, Loop):
                out.append(Loop(rewrite(st.body)))
                continue
            if isinstance(st, Assign):
                defs[st.target] = st.expr.xreplace(defs)
            if not (isinstance(st, Store) and st.kind == "lambda"):
                out.append(st)
                continue
            b = block_of[st.slot]
            m = form.blocks[b].multiplier[0][0]
            parts = split(st.expr, m, adjoint.state_cotangents[st.slot])
            factored.append(parts is not None)
            if parts is None:
                out.append(st)
                continue
            w, r = parts
            out += [Store("lambda", st.slot, scale(m, w) + r),
                    Store("hits", hits_slot[b], zero_hit(m, w))]
        return out

    rewritten = Program(rewrite(plain.statements), plain.vector)
    if not all(factored):
        return LocalAdjoint(plain, False)
    return LocalAdjoint(prune(rewritten, lambda store: True), True)


@dataclass(frozen=True)
class SegmentSummary:
    """The segment summary of a state-affine recurrence: its product entries and the step that
    advances the state and ``P`` together. Derived once (``Recurrence.segment_summary``) and
    rendered by both the kernels and the pure-MLX chunked form."""

    products: tuple
    program: Program
    maps: Program  # every step's multiplier and offset (``step_maps_program``)
    plain: Program | None = None  # the step in IEEE products (``plain_summary_program``)


def segment_summary(ir: StepIR, form: AffineForm) -> SegmentSummary:
    products = tuple(product_entries(ir, form))
    return SegmentSummary(products, summary_program(ir, form, list(products)),
                          step_maps_program(ir, form, list(products)),
                          plain_summary_program(ir, form, list(products)))


__all__ = ["AffineBlock", "AffineForm", "LocalAdjoint", "LowRankRead", "ProductEntry",
           "SegmentSummary", "analyse", "compose", "local_adjoint_program",
           "outputs_of_updated_state", "plain_summary_program", "product_entries", "scale",
           "segment_summary", "step_maps_program", "summary_program", "zero_hit"]
