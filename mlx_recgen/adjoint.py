"""Reverse mode over one step, derived symbolically.

For a step ``h_t = F(h_{t-1}, x_t, p)``, ``y_t = G(...)`` with reductions ``s_k = Σ_n b_k(n)`` in
between, let ``ȳ`` be the output cotangents and ``λ`` the adjoint of the new state. Then

    s̄_k   = Σ_scalar-uses cot · ∂e/∂s_k  +  Σ_n [ Σ_h λ_h(n) ∂F_h/∂s_k + Σ_{j>k} s̄_j ∂b_j/∂s_k ]
    v̄(n)  = Σ_h λ_h(n) ∂F_h/∂v + Σ_k s̄_k ∂b_k/∂v                         (pointwise leaves)
    z̄     = Σ_scalar-uses cot · ∂e/∂z  +  Σ_n [ same pointwise terms ]       (scalar leaves)

where reductions are visited from the highest level down (a reduction of level k only feeds
reductions of higher levels), leaves are the old state and the differentiable inputs, and the
adjoint of the old state is the new ``λ``.

A state without the lane axis (shared by the lanes of an instance) is read by every lane, so
its true adjoint is a sum over lanes. Each lane's ``λ`` of such a state is one lane's share of
it: the statements above are linear in the cotangents, and a shared state's cotangent flows only
into lane-invariant values (its update reads nothing else), so when the final state's cotangent
seeds one lane and the others start from zero, the shares of every step sum over lanes to the
true adjoint. The backends keep one share per lane and sum them once, for the initial state's
gradient, instead of reducing over lanes every step.

Every partial derivative comes from sympy; the result is a ``Program`` with the same statement
vocabulary as the forward step.
"""

from __future__ import annotations

from dataclasses import dataclass

import sympy

from .ir import (Accumulate, Assign, Program, Store, StepIR, is_vector, _loop, cse_block,
                 free_symbols, loop_symbols, schedule_forward)
from .simplify import simplify_derivative


@dataclass
class Adjoint:
    """The backward step and the cotangent symbols it reads."""

    program: Program
    output_cotangents: dict  # output Slot -> symbol ȳ
    state_cotangents: dict  # state Slot -> symbol λ (vector for vector states)


def _grad(e, z):
    return simplify_derivative(sympy.diff(e, z)) if z in e.free_symbols else sympy.Integer(0)


def derive(ir: StepIR) -> Adjoint:
    spec, namer = ir.spec, ir.namer
    vector = set(ir.vector)

    ybar = {s: namer(f"d_{s.tensor}{s.component if spec.outputs[s.tensor].components > 1 else ''}")
            for s in ir.outputs}
    lam = {s: namer(f"lam_{s.tensor}{s.component if spec.states[s.tensor].components > 1 else ''}")
           for s in ir.new_state}
    for s, sym in lam.items():
        if ir.is_vector_slot(s):
            vector.add(sym)

    # Expressions used as scalars (with their cotangent) and pointwise (vector state updates).
    scalar_uses = [(ybar[s], e) for s, e in ir.outputs.items()]
    scalar_uses += [(lam[s], e) for s, e in ir.new_state.items() if not ir.is_vector_slot(s)]
    pointwise_uses = [(lam[s], e) for s, e in ir.new_state.items() if ir.is_vector_slot(s)]

    # A value read by several uses gets the sum of their cotangents before the product with its
    # derivative, as reverse mode does: ``h * (ȳ + λ)``, not ``ȳ h + λ h``, which is NaN for an
    # infinite ``h`` and a zero cotangent where the true gradient is infinite.
    def direct(z):
        return sympy.factor_terms(sympy.Add(*[c * _grad(e, z) for c, e in scalar_uses]))

    def pointwise(z, reductions):
        terms = [c * _grad(e, z) for c, e in pointwise_uses]
        terms += [sbar[r.target] * _grad(r.body, z) for r in reductions]
        return sympy.factor_terms(sympy.Add(*terms))

    # Accumulated sums, by summand: Σ_n c·f(n) is kept as c · Σ_n f(n) (c free of n), so
    # sums that differ only in such a factor are accumulated once (a delta rule's dβ, dv and
    # the adjoint of <S, k> all sum k(n)·(λ(n) + ȳ q(n)))
    sums = {}

    def accumulated(e, name, pairs):
        """``e`` summed over the state axis: an accumulator times a factor free of ``n``; a new
        accumulator joins ``pairs`` unless one with this summand exists."""
        factor, summand = _sum_factor(e, vector)
        if summand not in sums:
            sums[summand] = namer(name)
            pairs.append(((lambda e, a=sums[summand]: Accumulate(a, e)), summand))
        return factor * sums[summand]

    statements = []
    sbar = {}
    for level in reversed(range(ir.levels)):
        here = [r for r in ir.reductions if r.level == level]
        above = [r for r in ir.reductions if r.level > level]
        accs = []
        for r in here:
            sbar[r.target] = namer(f"d_{r.target}")
            acc = pointwise(r.target, above)
            accs.append((r, acc))
        loop_pairs, finals = [], []
        for r, acc in accs:
            if acc == 0:
                finals.append(Assign(sbar[r.target], direct(r.target)))
            else:
                total = accumulated(acc, f"acc_{r.target}", loop_pairs)
                finals.append(Assign(sbar[r.target], direct(r.target) + total))
        statements += _loop(loop_pairs, vector, namer, prefix="u") + finals

    # Leaves: old states and inputs.
    leaves = [(("lambda", s), spec.symbols[s]) for s in spec.state_slots()]
    leaves += [(("grad", s), spec.symbols[s]) for s in spec.input_slots(differentiable_only=True)]
    loop_pairs, scalar_pairs = [], []
    for (kind, slot), z in leaves:
        pw = pointwise(z, ir.reductions)
        if z in ir.vector:
            loop_pairs.append(((lambda e, kind=kind, slot=slot: Store(kind, slot, e)), pw))
        else:
            d = direct(z)
            if pw != 0:
                d = d + accumulated(pw, f"acc_{z}", loop_pairs)
            scalar_pairs.append(((lambda e, kind=kind, slot=slot: Store(kind, slot, e)), d))
    statements += _loop(loop_pairs, vector, namer, prefix="v")
    temps, stores = cse_block(scalar_pairs, namer, prefix="w")
    statements += temps + stores

    # Recompute the forward reductions the derivatives read (and those they depend on).
    needed = _needed_reductions(ir, statements)
    recompute = schedule_forward(_restrict(ir, needed), for_backward=True) if needed else None
    statements = (recompute.statements if recompute else []) + statements
    program = Program(statements, frozenset(vector | loop_symbols(statements)))
    return Adjoint(program, ybar, lam)


def _sum_factor(e, vector):
    """``(c, f)`` with ``e == c * f`` and ``c`` free of the per-element symbols ``vector``
    (``(1, e)`` where no such factor comes out): the common factors of ``e``'s terms, pulled
    out by ``factor_terms``."""
    factored = sympy.factor_terms(e)
    factor = [a for a in sympy.Mul.make_args(factored) if not is_vector(a, vector)]
    summand = [a for a in sympy.Mul.make_args(factored) if is_vector(a, vector)]
    if not factor or not summand:
        return sympy.Integer(1), e
    return sympy.Mul(*factor), sympy.Mul(*summand)


def _needed_reductions(ir: StepIR, statements):
    targets = {r.target: r for r in ir.reductions}
    need = {s for s in free_symbols(statements) if s in targets}
    frontier = list(need)
    while frontier:
        r = targets[frontier.pop()]
        for s in r.body.free_symbols:
            if s in targets and s not in need:
                need.add(s)
                frontier.append(s)
    return need


def _restrict(ir: StepIR, keep):
    return StepIR(ir.spec, [r for r in ir.reductions if r.target in keep], {}, {}, ir.vector,
                  ir.namer)


__all__ = ["Adjoint", "derive"]
