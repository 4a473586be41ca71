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

from dataclasses import dataclass

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


def split(program: Program, carry, carry_kind: str, namer: Namer) -> Phases:
    """Split ``program`` around ``carry`` (the symbols of the old carry), whose new values are
    the stores of kind ``carry_kind``."""
    carry = frozenset(carry)
    flat = flatten(program)
    dependent = set(carry)
    for b in flat:
        if not isinstance(b, Store) and b.expr.free_symbols & dependent:
            dependent.add(b.target)

    carry_stores = [b for b in flat if isinstance(b, Store) and b.kind == carry_kind]
    chain = _needed(flat, carry_stores)
    pre = [b for b in chain if not isinstance(b, Store) and b.target not in dependent]
    sweep = [b for b in chain if isinstance(b, Store) or b.target in dependent]

    # hoist the carry-free subexpressions of the chain into ``pre``
    hoisted, exprs = split_invariants([b.expr for b in sweep], dependent, namer, prefix="p")
    sweep = [type(b)(b.target, e) if not isinstance(b, Store) else Store(b.kind, b.slot, e)
             for b, e in zip(sweep, exprs)]
    pre = pre + hoisted

    vector = _vector(pre, program.vector)
    assigned_pre = {b.target for b in pre}
    read = set()
    for b in sweep:
        read |= b.expr.free_symbols
    pre_values = sorted(read & assigned_pre, key=str)

    post = _needed(flat, [b for b in flat if isinstance(b, Store) and b.kind != carry_kind])
    return Phases(
        pre=Program(pre, vector),
        pre_values=pre_values,
        sweep=Program(sweep, _vector(sweep, vector)),
        post=Program(post, program.vector),
        carry=carry,
        carry_kind=carry_kind,
    )


__all__ = ["Phases", "split", "flatten"]
