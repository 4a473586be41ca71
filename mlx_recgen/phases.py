"""Split a step program into what must run step by step and what can run for many steps at once.

A step program computes a *carry* (the new state in the forward; the new ``λ`` in the backward)
from the previous carry and per-step values. Only the chain that leads from the old carry to the
new one is sequential; everything else can be evaluated for a whole block of steps in one go,
with a leading time axis on every array:

* ``pre``: the values the chain reads that do not depend on the carry, including the maximal
  carry-free subexpressions of the chain's own expressions (hoisted like loop invariants);
* ``sweep``: one step of the chain, reading the carry and per-step slices of ``pre``;
* ``post``: every other result (outputs, input gradients), evaluated for the block from the
  stacked carries that entered each step.

All three are ``Program``s over the symbols of the original one plus the hoisted ones; the pure-MLX
backend renders each as one MLX function. Loops are flattened (a pointwise value is an array with
the state axis; ``Program.vector`` still says which values vary over it).
"""

from __future__ import annotations

import itertools
from collections import Counter
from dataclasses import dataclass

import sympy

from .ir import Accumulate, Assign, Loop, Namer, Program, Store, split_invariants


@dataclass
class Phases:
    """A step program split around its carry."""

    pre: Program  # carry-free, for a block of steps; its results are ``pre_values``
    pre_values: list  # symbols computed by ``pre`` that ``sweep`` reads, in a fixed order
    sweep: Program  # one step of the carry chain: stores of kind ``carry_kind``
    post: Program  # the other stores, for a block of steps, from the stacked carries
    carry: frozenset  # the carry symbols (old state or λ)
    carry_kind: str  # "state" (forward) or "lambda" (backward)


def flatten(program: Program) -> list:
    """The program's statements with the loops opened."""
    return [b for s in program.statements for b in (s.body if isinstance(s, Loop) else [s])]


def _rebuild(b, expr):
    if isinstance(b, Store):
        return Store(b.kind, b.slot, expr)
    return type(b)(b.target, expr)


def _evaluated(e):
    """``e`` rebuilt bottom-up with evaluation (unevaluated products left by hoisting become
    canonical: ``Mul(x, -1)`` -> ``-x``)."""
    if e.is_Atom:
        return e
    return e.func(*[_evaluated(a) for a in e.args])


def _dag_size(e) -> int:
    """The number of distinct subexpressions of ``e`` (shared ones counted once)."""
    seen, stack = set(), [e]
    while stack:
        x = stack.pop()
        if x not in seen:
            seen.add(x)
            stack.extend(x.args)
    return len(seen)


def inline(statements, limit: int = 200) -> list:
    """Substitute every assignment into the statements after it and drop it: what remains are
    reductions and stores over the program's inputs, whose common parts ``cse`` then names
    once (constants fold: ``d_s = 0`` makes every product with ``d_s`` vanish). An assignment
    whose expression would exceed ``limit`` distinct subexpressions stays."""
    known, out = {}, []
    for b in statements:
        e = b.expr.xreplace(known) if known else b.expr
        if isinstance(b, Assign) and (e.is_Atom or _dag_size(e) <= limit):
            known[b.target] = e
        else:
            out.append(_rebuild(b, e))
    return out


def _without(term, factor):
    """``term`` with one factor ``factor`` taken out of its product (no division: ``exp(x)``
    over ``exp(x)`` does not cancel by itself)."""
    args = list(sympy.Mul.make_args(term))
    args.remove(factor)
    return sympy.Mul(*args)


def _group(e):
    """Greedy partial factoring of every sum: ``a*x + a*y + z`` -> ``a*(x + y) + z``, the most
    shared factor first."""
    if e.is_Atom:
        return e
    args = [_group(a) for a in e.args]
    if any(a is not b for a, b in zip(args, e.args)):
        e = e.func(*args)
    if not isinstance(e, sympy.Add):
        return e
    terms = list(e.args)
    while True:
        counts = Counter(f for t in terms for f in set(sympy.Mul.make_args(t)) if not f.is_Number)
        shared = [(n, sympy.count_ops(f), str(f), f) for f, n in counts.items() if n > 1]
        if not shared:
            return sympy.Add(*terms)
        f = max(shared, key=lambda x: x[:3])[3]
        inner = [_without(t, f) for t in terms if f in sympy.Mul.make_args(t)]
        terms = [t for t in terms if f not in sympy.Mul.make_args(t)] + [f * _group(sympy.Add(*inner))]


def factor(statements) -> list:
    """Each expression with its common factors pulled out (``a*x + a*y`` -> ``a*(x + y)``),
    where that is smaller: gradients share the factor ``(λ + ȳ·∂y/∂h)`` this way."""
    out = []
    for b in statements:
        best = min((b.expr, sympy.factor_terms(b.expr), _group(b.expr)), key=sympy.count_ops)
        out.append(_rebuild(b, best))
    return out


def dedupe_sums(statements) -> list:
    """A reduction of the same expression as an earlier one becomes a copy of it."""
    seen, out = {}, []
    for b in statements:
        if isinstance(b, Accumulate):
            if b.expr in seen:
                out.append(Assign(b.target, seen[b.expr]))
                continue
            seen[b.expr] = b.target
        out.append(b)
    return out


def pull_out_of_sums(statements, vector, namer: Namer) -> list:
    """``s = Σ_n a*f(n)`` -> ``u = Σ_n f(n); s = a*u`` when ``a`` does not vary over ``n``: the
    product is then taken on the reduced array (worth it where arrays are large)."""
    vector = set(vector)
    out = []
    for b in statements:
        if isinstance(b, Accumulate) and isinstance(b.expr, sympy.Mul):
            inv = [a for a in b.expr.args if not a.free_symbols & vector]
            var = [a for a in b.expr.args if a.free_symbols & vector]
            if inv and var:
                u = namer(f"{b.target}_n")
                out += [Accumulate(u, sympy.Mul(*var)), Assign(b.target, sympy.Mul(*inv) * u)]
                continue
        if isinstance(b, Assign) and b.expr.free_symbols & vector:
            vector.add(b.target)
        out.append(b)
    return out


def cse(statements, namer: Namer, prefix="x") -> list:
    """Common subexpressions of a flat statement list, each assigned once, just before its first
    use (the MLX rendering evaluates every operation it prints)."""
    if not statements:
        return []
    symbols = (namer(f"{prefix}{i}") for i in itertools.count())
    temps, reduced = sympy.cse([b.expr for b in statements], symbols=symbols, order="none")
    # a negation is no saving: ``x - y`` twice beats ``n = -y`` then ``x + n`` twice
    negations = {}
    kept = []
    for sym, e in temps:
        e = e.xreplace(negations) if negations else e
        if isinstance(e, sympy.Mul) and len(e.args) == 2 and e.args[0] == -1:
            negations[sym] = e
        else:
            kept.append((sym, e))
    if negations:
        temps = kept
        reduced = [e.xreplace(negations) for e in reduced]
    definition = dict(temps)
    emitted, out = set(), []

    def emit(sym):
        if sym in emitted:
            return
        for dep in sorted(definition[sym].free_symbols & definition.keys(), key=str):
            emit(dep)
        emitted.add(sym)
        out.append(Assign(sym, definition[sym]))

    for b, e in zip(statements, reduced):
        for sym in sorted(e.free_symbols & definition.keys(), key=str):
            emit(sym)
        out.append(_rebuild(b, e))
    return out


def _needed(statements, roots) -> list:
    """The statements that ``roots`` (stores) need, in program order (a backward slice)."""
    need = set()
    for r in roots:
        need |= r.expr.free_symbols
    keep = []
    for b in reversed(statements):
        if b in roots or (not isinstance(b, Store) and b.target in need):
            keep.append(b)
            need |= b.expr.free_symbols
    return keep[::-1]


def _vector(statements, vector) -> frozenset:
    """``vector`` plus every assigned symbol whose expression varies over the state axis."""
    vector = set(vector)
    for b in statements:
        if isinstance(b, Assign) and b.expr.free_symbols & vector:
            vector.add(b.target)
    return frozenset(vector)


def _step_ops(e, dependent) -> int:
    """Operations of ``e`` left per step once its carry-free parts are hoisted."""
    _, (rest,) = split_invariants([e], dependent, Namer(()), prefix="p")
    return sympy.count_ops(_evaluated(rest))


def _fewest_step_ops(e, dependent, limit=80):
    """``e``, or its expansion when that leaves fewer operations per step: in
    ``c*(x + d*r)`` with carry-free ``c``, ``d`` the products ``c*x`` and ``c*d`` are hoisted."""
    if sympy.count_ops(e) > limit:
        return e
    expanded = sympy.expand_mul(e)
    if sympy.count_ops(expanded) > 4 * limit:
        return e
    return min((e, expanded), key=lambda x: _step_ops(x, dependent))


def split(program: Program, carry, carry_kind: str, namer: Namer) -> Phases:
    """Split ``program`` around ``carry`` (the symbols of the old carry), whose new values are
    the stores of kind ``carry_kind``."""
    carry = frozenset(carry)
    flat = factor(inline(flatten(program)))
    dependent = set(carry)
    for b in flat:
        if not isinstance(b, Store) and b.expr.free_symbols & dependent:
            dependent.add(b.target)

    carry_stores = [b for b in flat if isinstance(b, Store) and b.kind == carry_kind]
    chain = _needed(flat, carry_stores)
    pre = [b for b in chain if not isinstance(b, Store) and b.target not in dependent]
    sweep = [b for b in chain if isinstance(b, Store) or b.target in dependent]

    # hoist the carry-free subexpressions of the chain into ``pre``
    sweep = [_rebuild(b, _fewest_step_ops(b.expr, dependent)) for b in sweep]
    hoisted, exprs = split_invariants([b.expr for b in sweep], dependent, namer, prefix="p")
    sweep = cse([_rebuild(b, _evaluated(e)) for b, e in zip(sweep, exprs)], namer, "s")
    pre = [_rebuild(b, _evaluated(b.expr)) for b in pre + hoisted]
    pre = cse(dedupe_sums(pull_out_of_sums(pre, _vector(pre, program.vector), namer)), namer, "x")

    vector = _vector(pre, program.vector)
    assigned_pre = {b.target for b in pre}
    read = set()
    for b in sweep:
        read |= b.expr.free_symbols
    pre_values = sorted(read & assigned_pre, key=str)

    post = _needed(flat, [b for b in flat if isinstance(b, Store) and b.kind != carry_kind])
    post = cse(dedupe_sums(pull_out_of_sums(post, _vector(post, program.vector), namer)), namer, "y")
    return Phases(
        pre=Program(pre, vector),
        pre_values=pre_values,
        sweep=Program(sweep, _vector(sweep, vector)),
        post=Program(post, _vector(post, program.vector)),
        carry=carry,
        carry_kind=carry_kind,
    )


__all__ = ["Phases", "split", "flatten"]
