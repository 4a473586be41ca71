"""Render a step program as an MLX Python function.

Scalars are arrays of shape ``(..., lanes, 1)`` and pointwise values ``(..., lanes, N)``, so a
loop over the state axis is array broadcasting and ``Σ_n`` is a sum over the last axis.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from ..ir import Accumulate, Assign, Loop, Program, Store
from .expr import MLXPrinter
from .names import Identifiers


@dataclass
class MLXStep:
    """A rendered step: ``fn(*args) -> tuple(results)``."""

    source: str
    args: list  # sympy symbols, in call order
    results: list  # (kind, slot) of each store, in return order (``returns`` values follow)
    fn: object
    needs_state_ones: bool  # first argument is ones over the state axis
    returns: tuple = ()  # symbols returned after the stores


def program_arguments(program: Program) -> list:
    """Free symbols of a program (what it reads), sorted by name."""
    assigned, free = set(), set()
    for st in program.statements:
        for b in st.body if isinstance(st, Loop) else [st]:
            free |= b.expr.free_symbols - assigned
            if not isinstance(b, Store):
                assigned.add(b.target)
    return sorted(free, key=str)


def render_mlx(program: Program, name: str, args=None, returns=(), state_axis=-1) -> MLXStep:
    """``program`` as an MLX function of ``args`` (default: what it reads, by name) returning
    its stores in order, then the values of the symbols ``returns``; ``Σ_n`` sums over axis
    ``state_axis`` (the last, or -2 for arrays laid out state axis before lane). Symbols are spelled
    through ``render.names`` (``u_q``), so no spec name meets a keyword (``lambda``), ``mx`` or
    the function's own names (``state_ones``, ``out0``)."""
    args = program_arguments(program) if args is None else args
    ids = Identifiers()
    symbols = set(args) | set(returns) | {b.target for st in program.statements
                           for b in (st.body if isinstance(st, Loop) else [st])
                           if not isinstance(b, Store)}
    for sym in sorted(symbols, key=str):
        ids.add(sym, str(sym))
    names = {s: ids[s] for s in symbols}
    pr = MLXPrinter(names)
    lines, results = [], []
    ones = False

    def emit(stmt):
        if isinstance(stmt, Assign):
            lines.append(f"    {names[stmt.target]} = {pr(stmt.expr)}")
        elif isinstance(stmt, Accumulate):
            body = pr(stmt.expr)
            if not stmt.expr.free_symbols & program.vector:
                # constant over the state axis: Σ_n adds N copies, as the kernels' loop does
                nonlocal ones
                ones = True
                body = f"({body}) * state_ones"
            lines.append(f"    {names[stmt.target]} = mx.sum({body}, axis={state_axis}, "
                         "keepdims=True)")
        elif isinstance(stmt, Store):
            var = f"out{len(results)}"
            lines.append(f"    {var} = {pr(stmt.expr)}")
            results.append((stmt.kind, stmt.slot))

    for st in program.statements:
        if isinstance(st, Loop):
            lines.append("    # sweep over the state axis")
            for b in st.body:
                emit(b)
        else:
            emit(st)
    ret = ", ".join([f"out{i}" for i in range(len(results))] + [names[r] for r in returns])
    n_ret = len(results) + len(returns)
    params = (["state_ones"] if ones else []) + [names[s] for s in args]
    source = (f"def {name}({', '.join(params)}):\n" + "\n".join(lines)
              + f"\n    return ({ret}{',' if n_ret == 1 else ''})\n")
    scope = {"mx": mx}
    exec(compile(source, f"<mlx-recgen {name}>", "exec"), scope)
    return MLXStep(source, list(args), results, scope[name], ones, tuple(returns))
