"""A cheap, bounded simplifier for the derivatives of a step.

``sympy.simplify`` tries everything and is slow on ``Piecewise`` (it proves relations between
conditions by numeric sampling: seconds per derivative of a ``maximum``). The derivatives of a
step need far less: a kink (``maximum``, ``minimum``, ``where``, ``abs``) differentiates into
products and compositions of ``Piecewise`` over the same few conditions, and the useful rewrite
is to pull them to the top and resolve the inner ones with what each branch already knows. The
pipeline:

1. fold ``Piecewise`` to the top of the expression, substituting into each branch the truth of
   its own condition and the falsity of the earlier ones (nested selects on the same condition
   collapse); the fold gives up when the result grows past a bound;
2. per branch: combine exponentials (``powsimp``) and pull common factors (``factor_terms``);
3. per condition: boolean minimisation with relations as atoms (``simplify_logic``, which knows
   that ``a > b`` is ``not a <= b``) and moving cancelling terms of a relation to one side.

Every step is an identity, and of the candidates the one with the fewest operations
(``count_ops``) is kept, so the result is never larger than the input.
"""

from __future__ import annotations

from functools import lru_cache

import sympy
from sympy.logic.boolalg import ITE, And, BooleanFalse, BooleanTrue, Not, Or, simplify_logic

# The fold multiplies branches: it stops past this many operations (and past this many pieces).
MAX_FOLD_OPS = 400
MAX_PIECES = 16


class _TooLarge(Exception):
    pass


def _ops(e) -> int:
    """Operations of ``e``: ``count_ops``, plus the comparisons (which it skips in a
    ``Piecewise``'s conditions)."""
    return sympy.count_ops(e) + sum(isinstance(x, sympy.core.relational.Relational)
                                    for x in sympy.preorder_traversal(e))


@lru_cache(maxsize=4096)
def simplify_derivative(e):
    """A simplified form of ``e`` with no more operations than ``e`` (``e`` if none is found)."""
    e = sympy.sympify(e)
    if e.is_Atom:
        return e
    candidates = [e]
    folded = e
    if e.has(sympy.Piecewise):
        try:
            folded = _fold(e, _ops(e))
        except _TooLarge:
            folded = e
        candidates.append(folded)
    candidates.append(_tidy(folded))
    return min(candidates, key=_ops)


# ---------------------------------------------------------------------------------------------
# Piecewise folding with branch knowledge
# ---------------------------------------------------------------------------------------------


def _knowledge(cond, value: bool) -> dict:
    """Replacements that hold where ``cond`` is ``value``."""
    true, false = sympy.true, sympy.false
    out = {}
    if cond in (true, false):
        return out
    out[cond] = true if value else false
    if isinstance(cond, sympy.core.relational.Relational):
        for c, v in ((cond, value), (cond.negated, not value)):
            for form in (c, c.reversed, c.canonical):
                out.setdefault(form, true if v else false)
    elif isinstance(cond, And) and value:
        for a in cond.args:
            out.update(_knowledge(a, True))
    elif isinstance(cond, Or) and not value:
        for a in cond.args:
            out.update(_knowledge(a, False))
    elif isinstance(cond, Not):
        out.update(_knowledge(cond.args[0], not value))
    return out


def _assume(e, known: dict):
    return e.xreplace(known) if known else e


def _fold(e, budget_base):
    """``e`` with every ``Piecewise`` of an arithmetic subexpression pulled to the top."""
    if not isinstance(e, sympy.Expr) or not e.has(sympy.Piecewise):
        return e
    if isinstance(e, sympy.Piecewise):
        pieces = []
        known = {}
        for value, cond in e.args:
            cond = _assume(cond, known)
            if cond == sympy.false:
                continue
            here = {**known, **_knowledge(cond, True)}
            pieces.append((_fold(_assume(value, here), budget_base), cond))
            known.update(_knowledge(cond, False))
            if cond == sympy.true:
                break
        return _flatten(pieces, budget_base)
    args = [_fold(a, budget_base) for a in e.args]
    at = next((i for i, a in enumerate(args) if isinstance(a, sympy.Piecewise)), None)
    if at is None:
        return e.func(*args)
    pieces = []
    known = {}
    for value, cond in args[at].args:
        here = {**known, **_knowledge(cond, True)}
        rest = [_assume(a, here) for a in args]
        rest[at] = value
        pieces.append((_fold(e.func(*rest), budget_base), cond))
        known.update(_knowledge(cond, False))
    return _flatten(pieces, budget_base)


def _flatten(pieces, budget_base):
    """A Piecewise of (value, condition) pieces; a Piecewise value under the catch-all condition
    extends the list (the others are kept nested)."""
    out = []
    for value, cond in pieces:
        if cond == sympy.true and isinstance(value, sympy.Piecewise):
            out += list(value.args)
        else:
            out.append((value, cond))
    result = sympy.Piecewise(*out)
    if len(out) > MAX_PIECES or _ops(result) > max(MAX_FOLD_OPS, 4 * budget_base):
        raise _TooLarge
    return result


# ---------------------------------------------------------------------------------------------
# Algebraic and logical tidying
# ---------------------------------------------------------------------------------------------


def _smallest(*candidates):
    return min(candidates, key=_ops)


def _tidy(e):
    """Tidy the values of a top-level Piecewise (or the expression) and its conditions."""
    if isinstance(e, sympy.Piecewise):
        return sympy.Piecewise(*[(_tidy_value(v), _tidy_condition(c)) for v, c in e.args])
    return _tidy_value(e)


def _tidy_value(e):
    if e.is_Atom:
        return e
    combined = sympy.powsimp(e, combine="exp")
    return _smallest(e, combined, sympy.factor_terms(e), sympy.factor_terms(combined))


def _tidy_condition(c):
    if isinstance(c, (BooleanTrue, BooleanFalse)):
        return c
    c = c.replace(lambda x: isinstance(x, sympy.core.relational.Relational), _tidy_relation)
    candidates = [c]
    try:
        candidates.append(simplify_logic(c, deep=False))  # relations are atoms; <= 8 of them
    except (TypeError, ValueError):
        pass
    if c.has(ITE):
        candidates.append(c.replace(lambda x: isinstance(x, ITE), lambda x: x.to_nnf()))
    return _smallest(*candidates)


def _tidy_relation(r):
    """``x <= y + x`` -> ``y >= 0``: collect both sides on one (terms may cancel), then put the
    negative terms on the right; kept when smaller."""
    lhs, rhs = r.lhs, r.rhs
    if not (isinstance(lhs, sympy.Expr) and isinstance(rhs, sympy.Expr)):
        return r
    d = lhs - rhs
    terms = sympy.Add.make_args(d)
    neg = [-t for t in terms if t.could_extract_minus_sign()]
    pos = [t for t in terms if not t.could_extract_minus_sign()]
    return _smallest(r, r.func(sympy.Add(*pos), sympy.Add(*neg)))


__all__ = ["simplify_derivative"]
