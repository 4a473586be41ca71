"""Matrix analysis: does the recurrence have the chunkwise matrix form of linear attention?

A state-affine recurrence (``affine.analyse``) whose states are matrices over (state axis,
lane) with a multiplier that is the same for every lane runs as matrix products over chunks of
steps, the form of linear attention, GLA and SSD:

    S_t = d_t ⊙ S_{t-1} + Σ_r a_{r,t} ⊗ b_{r,t}          (S: K x V, d_t and a_{r,t}: K, b_{r,t}: V)
    y_t = f(Σ_n c_{t}[n] S_{t-1}[n, :], inputs of step t)

``d_t`` is free of the state and the lane axis (a scalar per instance, or a vector over the
state axis), every added term factors into a lane-free state-axis vector ``a`` and a vector
``b`` free of the state axis, and the outputs read the states only through sums over the state
axis that are linear in them, with lane-free coefficients ``c``. A readout of the state *after*
the update (``Σ q[n] S_t[n]``, the usual way a spec is written) is rewritten as one of the state
before it, ``c = q ⊙ d``, plus a state-free sum ``Σ_n q[n] a_r[n] · b_r``: every readout is then
of ``S_{t-1}``, strictly causal. For a scalar ``d`` the coefficient stays ``q`` and the readout
is marked ``decayed`` (``d_t`` multiplies the whole readout of step ``t``), so ``q`` keeps the
axes of the inputs it reads (per group of heads, Mamba-2's ``C``). Where the state-free sum is
exactly the step's own added terms, it leaves the rest too and the readout is marked
``diagonal``: the chunk products take it whole, their causal weights including ``j = t`` with
weight 1 (no ``Σ_n q[n] a_r[n]`` per step beside them, nor its gradient). The analysis is
symbolic and serves every backend: it yields
the expressions of ``log d``, ``a``, ``b`` and ``c`` per step and the outputs as functions of
the readouts (``MatrixForm``), which ``backends/mlx_matrix.py`` evaluates and multiplies.

Delta rules. A state whose update adds back a read of itself, ``ρ_t = Σ_n β_t[n] S_{t-1}[n]``
(``affine.LowRankRead``: ``S_t = (d_t + α_t β_tᵀ) S_{t-1} + Σ_r a_r ⊗ b_r``), is of the same
form once the reads ``ρ`` are known: they enter as one more added term ``α ⊗ ρ``. Within a
chunk the reads solve a unit lower-triangular system (the UT transform of DeltaNet's WY
representation): ``ρ = T (β ⊙ γ) S_start + T Σ_r W(β, a_r) b_r`` with ``T = (I - W(β, α))⁻¹``,
``W`` the same causal decay-weighted products as the readouts', so a chunk maps its starting
state through a ``K x K`` matrix (``backends/mlx_matrix.py``). ``α`` and ``β`` must be free of
the lane axis (one solve serves every lane).

Outside the class (a multiplier that varies along the lane axis as in Mamba-1, per-lane scalar
states as in RG-LRU, 2x2 blocks, nonlinear updates) ``analyse`` returns the reason.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import sympy

from .affine import AffineForm
from .functions import sigmoid, softplus
from .ir import StepIR
from .spec import Slot

# log |d| is floored here by every reader of it (a zero multiplier's -inf would give -inf - -inf
# in the chunks' differences of running sums): exp(-100) ~ 4e-44, a multiplier this small or
# zero erases the state anyway. A floored step's log d has no cotangent, as MLX's maximum gives
LOG_FLOOR = -100.0


@dataclass(frozen=True)
class MatrixState:
    """One state of the matrix form: ``S' = d ⊙ S + Σ_r a_r ⊗ b_r``.

    ``log_decay`` is ``log |d|`` as an expression (simplified: ``exp(x)`` gives ``x``,
    ``sigmoid(x)`` gives ``-softplus(-x)``), ``positive`` whether ``d > 0`` is known
    symbolically (else the sign is carried at run time). ``vector_decay``: ``d`` varies over the
    state axis. ``terms``: ``(a_r, b_r)`` pairs, ``a_r`` over the state axis and free of the
    lane, ``b_r`` free of the state axis. ``has_lane``: the state carries the lane axis (else it
    is shared by the lanes, ``V = 1``). ``low_rank``: ``(ρ, α, β)`` of the reads of the state
    that its update adds back (a delta rule), ``α`` and ``β`` over the state axis."""

    slot: Slot
    symbol: sympy.Symbol
    decay: sympy.Expr
    log_decay: sympy.Expr
    positive: bool
    vector_decay: bool
    terms: tuple
    has_lane: bool
    low_rank: tuple = ()


@dataclass(frozen=True)
class Readout:
    """A sum over the state axis that reads the states: ``target = Σ_n Σ_s d_s^[s ∈ decayed]
    coefficients[s][n] S_s[n] + Σ_n rest[n]`` with the states *before* the step.

    ``decayed``: the states of scalar decay ``d_s`` whose decay was a factor of the coefficient
    (a readout of the state after the update) and was taken out of it: the backend applies it
    to the whole readout of step ``t``, so the coefficient stays the un-decayed vector ``q``
    (shared by a group of heads where ``q`` is, Mamba-2's ``C``). ``reads``: the reads ``ρ``
    of a delta rule the sum takes, known per step once solved, by their weights ``w[n]``
    (``Σ_n w[n] ρ``: a readout of the state after the update reads its ``α ρ``).
    ``diagonal``: the decayed states (no delta rule) whose own added terms of the step,
    ``Σ_n q[n] a_r[n] b_r``, the readout takes through the chunk products (their causal weights
    include ``j = t``, weight 1) and not through ``rest``: it reads the state after the
    update whole."""

    target: sympy.Symbol
    coefficients: dict  # state symbol -> lane-free expression over the state axis
    rest: sympy.Expr  # state-free
    decayed: frozenset = frozenset()
    reads: dict = field(default_factory=dict)  # ρ -> its weight in the sum (a delta rule)
    diagonal: frozenset = frozenset()


@dataclass(frozen=True)
class MatrixForm:
    """The result of the analysis: the matrix form when it applies, else the reason."""

    applies: bool
    reason: str
    states: tuple = ()
    readouts: tuple = ()

    def describe(self) -> str:
        if not self.applies:
            return f"matrix form does not apply: {self.reason}"
        parts = []
        for s in self.states:
            decay = "vector decay" if s.vector_decay else "scalar decay"
            shape = "K x V" if s.has_lane else "K (shared by the lanes)"
            delta = (f", rank {len(s.low_rank)} transition (a delta rule: chunks through the UT "
                     "transform)" if s.low_rank else "")
            parts.append(f"{s.slot.tensor}: {shape}, {decay}, rank {len(s.terms)} input{delta}")
        return ("matrix form (chunkwise products: S' = d ⊙ S + Σ a ⊗ b, readouts Σ c S): "
                + "; ".join(parts))


def _log_abs(d: sympy.Expr) -> sympy.Expr:
    """``log |d|`` in the form that stays finite where ``d`` underflows: ``exp(x) -> x``,
    ``sigmoid(x) -> -softplus(-x)``, products to sums, powers to multiples."""
    if isinstance(d, sympy.Mul):
        return sympy.Add(*[_log_abs(f) for f in d.args])
    if isinstance(d, sympy.exp):
        return d.args[0]
    if isinstance(d, sigmoid):
        return -softplus(-d.args[0])
    if isinstance(d, sympy.Pow) and d.exp.is_number:
        return d.exp * _log_abs(d.base)
    if isinstance(d, sympy.Piecewise):  # a mask that holds the state: log 1 = 0 there
        return sympy.Piecewise(*[(_log_abs(e), c) for e, c in d.args])
    if d.is_number:
        return sympy.log(abs(d))
    return sympy.log(sympy.Abs(d))


def _factor_terms(offset: sympy.Expr, vector: set, lane: set, label: str):
    """``offset`` as ``Σ_r a_r b_r`` with ``a_r`` free of the lane and ``b_r`` free of the state
    axis; terms that share ``b`` are merged. Factors free of both axes (per-step scalars of an
    instance, Mamba-2's ``dt``) go to ``b``, which varies per instance anyway: ``a`` then reads
    only what it must, so it can be shared by the members of a group of heads (``B``). Numbers
    stay on ``a``, so terms that differ by a constant share ``b`` and merge.
    Returns (pairs, reason)."""
    by_value: dict = {}
    for term in sympy.Add.make_args(sympy.expand(offset, deep=False, power_exp=False,
                                                  power_base=False, log=False)):
        key, value = [], []
        for f in sympy.Mul.make_args(term):
            on_state, on_lane = bool(f.free_symbols & vector), bool(f.free_symbols & lane)
            if on_state and on_lane:
                split = _split_piecewise(f, vector, lane)
                if split is None:
                    return None, (f"the update of '{label}' adds {term}, whose factor {f} varies "
                                  "over both the state axis and the lane axis (not an outer "
                                  "product)")
                key.append(split[0])
                value.append(split[1])
                continue
            (key if on_state or f.is_number else value).append(f)
        b = sympy.Mul(*value)
        by_value[b] = by_value.get(b, sympy.S.Zero) + sympy.Mul(*key)
    return tuple((a, b) for b, a in by_value.items() if a != 0), ""


def _split_piecewise(f: sympy.Expr, vector: set, lane: set):
    """``(a, b)`` with ``f = a * b``, ``a`` over the state axis and ``b`` free of it, for a
    ``Piecewise`` whose conditions read neither axis (a mask that holds the state: ``where(mask,
    B[n] x, 0)`` is ``B[n] * where(mask, x, 0)``) and whose nonzero branches share their factor
    over the state axis; else None."""
    if not isinstance(f, sympy.Piecewise) or any(c.free_symbols & (vector | lane)
                                                  for _, c in f.args):
        return None
    common, branches = None, []
    for e, c in f.args:
        if e == 0:
            branches.append((e, c))
            continue
        factors = sympy.Mul.make_args(e)
        a = sympy.Mul(*[x for x in factors if x.free_symbols & vector])
        if common is not None and a != common:
            return None
        common = a
        branches.append((sympy.Mul(*[x for x in factors if not x.free_symbols & vector]), c))
    if common is None or common.free_symbols & lane:
        return None
    return common, sympy.Piecewise(*branches)


def _without(c: sympy.Expr, d: sympy.Expr):
    """``q`` with ``c = q * d`` where the factors of ``d`` are among those of ``c`` (nothing is
    divided: the factors are taken out as they stand), else None."""
    factors = list(sympy.Mul.make_args(c))
    for f in sympy.Mul.make_args(d):
        if f not in factors:
            return None
        factors.remove(f)
    return sympy.Mul(*factors)


def _expanded_terms(e: sympy.Expr) -> list:
    """The terms of ``e`` expanded, each with its masks folded (``C * where(m, B x, 0)`` and
    ``B C * where(m, x, 0)`` are one term)."""
    return [sympy.piecewise_fold(t) for t in sympy.Add.make_args(
        sympy.expand(e, deep=False, power_exp=False, power_base=False, log=False))]


def _own_terms(rest: sympy.Expr, coefficients: dict, decayed: set, by_symbol: dict):
    """``(rest, diagonal)``: the states of ``decayed`` whose own added terms of the step,
    ``Σ_r q[n] a_r[n] b_r``, are all terms of ``rest`` (a readout of the state after the
    update), and ``rest`` without them. Delta rules keep theirs: their reads add to the step."""
    diagonal, terms = set(), _expanded_terms(rest)
    for s in sorted(decayed, key=str):
        st = by_symbol[s]
        if st.low_rank or not st.terms:
            continue
        own = _expanded_terms(sum(coefficients[s] * a * b for a, b in st.terms))
        remaining = list(terms)
        for term in own:
            if term not in remaining:
                break
            remaining.remove(term)
        else:
            diagonal.add(s)
            terms = remaining
    return sympy.Add(*terms), frozenset(diagonal)


def analyse(ir: StepIR, affine: AffineForm) -> MatrixForm:
    """Decide whether the step has the chunkwise matrix form, and derive its parts."""
    spec = ir.spec
    if not affine.time_parallel:
        return MatrixForm(False, f"not state-affine ({affine.reason})")
    if spec.state_axis is None:
        return MatrixForm(False, "the states have no state axis (elementwise states are scans, "
                                 "not matrix products)")
    vector = set(ir.vector)
    lane = set(spec.lane_varying())
    # reductions are scalars per lane: they vary over the lanes when their body does
    for r in ir.reductions:
        if r.body.free_symbols & lane:
            lane.add(r.target)
    state_syms = {spec.symbols[s]: s for s in spec.state_slots()}

    states = []
    for block in affine.blocks:
        slot = block.slots[0]
        label = slot.label(block.components)
        if block.size != 1:
            return MatrixForm(False, f"the multiplier of '{label}' is a {block.size}x{block.size} "
                                     "block (only a diagonal multiplier has the matrix form)")
        if not ir.is_vector_slot(slot):
            return MatrixForm(False, f"state '{label}' has no state axis (per-lane scalar states "
                                     "are elementwise scans)")
        sym = spec.symbols[slot]
        d = block.multiplier[0][0]
        if d.free_symbols & lane:
            return MatrixForm(False, f"the multiplier of '{label}' ({d}) varies along the lane "
                                     "axis, so the lanes do not share one decay")
        if d == 0:
            return MatrixForm(False, f"the multiplier of '{label}' is zero")
        low_rank = tuple((r.probe, r.alpha, r.beta) for r in affine.low_rank if r.slot == slot)
        for probe, alpha, beta in low_rank:
            for what, e in (("adds it back with", alpha), ("reads it with", beta)):
                if e.free_symbols & lane:
                    return MatrixForm(False, f"the update of '{label}' {what} {e} through "
                                             f"{probe}, which varies along the lane axis (one "
                                             "triangular solve per chunk serves every lane only "
                                             "where it does not)")
        offset = ir.new_state[slot].xreplace({sym: 0, **{p: 0 for p, _, _ in low_rank}})
        terms, reason = _factor_terms(offset, vector, lane, label)
        if terms is None:
            return MatrixForm(False, reason)
        has_lane = spec.tensors[slot.tensor].has_lane
        states.append(MatrixState(slot, sym, d, _log_abs(d), bool(d.is_positive),
                                  bool(d.free_symbols & vector), terms, has_lane, low_rank))

    by_symbol = {st.symbol: st for st in states}
    probes = {p for st in states for p, _, _ in st.low_rank}  # known per step once solved
    readouts = []
    dependent: set = set()
    for r in ir.reductions:  # by level: a reduction reads only lower levels
        reads = r.body.free_symbols & (set(state_syms) | dependent)
        if not reads:
            continue
        if reads & (dependent - probes):
            return MatrixForm(False, f"the sum {r.target} = Σ({r.body}) reads the state through "
                                     "another sum")
        weights = {}
        for p in reads & probes:
            w = sympy.diff(r.body, p)
            if w.free_symbols & (set(state_syms) | probes):
                return MatrixForm(False, f"the sum {r.target} = Σ({r.body}) is not linear in "
                                         f"the read {p}")
            weights[p] = w
        reads -= probes
        coefficients = {}
        for s in reads:
            c = sympy.diff(r.body, s)
            if c.free_symbols & set(state_syms):
                return MatrixForm(False, f"the sum {r.target} = Σ({r.body}) is not linear in "
                                         f"the state '{state_syms[s].tensor}'")
            if c.free_symbols & lane:
                return MatrixForm(False, f"the sum {r.target} = Σ({r.body}) reads the state "
                                         f"with a coefficient {c} that varies along the lanes")
            coefficients[s] = c
        decayed = set()
        for s, c in coefficients.items():
            q = _without(c, by_symbol[s].decay) if not by_symbol[s].vector_decay else None
            if q is not None:
                coefficients[s] = q
                decayed.add(s)
        rest = r.body.xreplace({s: 0 for s in (*reads, *weights)})
        rest, diagonal = _own_terms(rest, coefficients, decayed, by_symbol)
        readouts.append(Readout(r.target, coefficients, rest, frozenset(decayed), weights,
                                diagonal))
        dependent.add(r.target)
    for slot, e in ir.outputs.items():
        if e.free_symbols & set(state_syms):
            return MatrixForm(False, f"output '{slot.tensor}' reads a state outside a sum over "
                                     "the state axis")
    return MatrixForm(True, "", tuple(states), tuple(readouts))


__all__ = ["MatrixForm", "MatrixState", "Readout", "analyse"]
