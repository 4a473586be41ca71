"""The step IR: one time step of a recurrence as a short statement list.

A program is a list of statements over *scalars* (one value per lane) and, inside ``Loop``s,
*pointwise* values (one per lane and state index ``n``):

* ``Assign(x, e)``: bind a scalar, or inside a loop a pointwise value;
* ``Accumulate(s, e)``: inside a loop, ``s = Σ_n e`` (a reduction over the state axis);
* ``Store(kind, slot, e)``: a result — a new state (``"state"``), an output (``"output"``), the
  adjoint of the previous state (``"lambda"``) or an input gradient (``"grad"``). A store inside a
  loop is a vector over the state axis, outside it a scalar.
* ``Loop(body)``: one sweep over the state axis.

All expressions are sympy over plain symbols. Which symbols vary over the state index is
recorded in ``Program.vector``; the renderers (MLX ops, Metal, CUDA) turn the same program into
code.
"""

from __future__ import annotations

from dataclasses import dataclass

import itertools

import sympy

from .spec import Reduce, Slot, Spec


@dataclass(frozen=True)
class Assign:
    target: sympy.Symbol
    expr: sympy.Expr


@dataclass(frozen=True)
class Accumulate:
    target: sympy.Symbol
    expr: sympy.Expr


@dataclass(frozen=True)
class Store:
    kind: str  # "state" | "output" | "lambda" | "grad" | "hits" (adds to a zero-hit count)
    slot: Slot
    expr: sympy.Expr


@dataclass
class Loop:
    body: list


@dataclass
class Program:
    """A step program and the roles of its symbols."""

    statements: list
    vector: frozenset  # symbols that vary over the state index

    def loops(self):
        return [s for s in self.statements if isinstance(s, Loop)]

    def stores(self, kind=None):
        out = []
        for s in self.statements:
            body = s.body if isinstance(s, Loop) else [s]
            out += [b for b in body if isinstance(b, Store) and (kind is None or b.kind == kind)]
        return out

    def text(self, index="n") -> str:
        """The program as readable pseudo-code."""
        lines = []

        def fmt(stmt, pad):
            if isinstance(stmt, Assign):
                lines.append(f"{pad}{stmt.target} = {stmt.expr}")
            elif isinstance(stmt, Accumulate):
                lines.append(f"{pad}{stmt.target} += {stmt.expr}")
            elif isinstance(stmt, Store):
                where = f"[{index}]" if pad else ""
                lines.append(f"{pad}{stmt.kind} {stmt.slot.tensor}"
                             f"{'' if stmt.slot.component == 0 else '.' + str(stmt.slot.component)}"
                             f"{where} <- {stmt.expr}")

        for s in self.statements:
            if isinstance(s, Loop):
                accs = [b.target for b in s.body if isinstance(b, Accumulate)]
                if accs:
                    lines.append(f"{', '.join(map(str, accs))} = 0")
                lines.append(f"for {index} in state axis:")
                for b in s.body:
                    fmt(b, "    ")
            else:
                fmt(s, "")
        return "\n".join(lines)


class Namer:
    """Hands out symbol names that collide with nothing the spec declares."""

    def __init__(self, taken):
        self.taken = set(taken)

    def __call__(self, base: str) -> sympy.Symbol:
        name, k = base, 0
        while name in self.taken:
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        return sympy.Symbol(name, real=True)


# ---------------------------------------------------------------------------------------------
# Lowering the traced spec
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reduction:
    target: sympy.Symbol  # the scalar holding Σ_n body
    body: sympy.Expr  # pointwise
    level: int  # 0: needs no other reduction; k: needs one of level k-1


@dataclass
class StepIR:
    """The forward step, Sum-free: reductions hoisted into named scalars."""

    spec: Spec
    reductions: list  # [Reduction] ordered by level
    new_state: dict  # Slot -> expression over old states, inputs and reduction targets
    outputs: dict  # Slot -> scalar expression
    vector: frozenset  # vector symbols (inputs/old states with the state axis)
    namer: Namer

    @property
    def levels(self) -> int:
        return 1 + max((r.level for r in self.reductions), default=-1)

    def is_vector_slot(self, slot: Slot) -> bool:
        return self.spec.tensors[slot.tensor].has_state_axis


def lower(spec: Spec) -> StepIR:
    namer = Namer(list(spec.tensors) + [str(s) for s in spec.symbols.values()])
    table: dict = {}  # hoisted reduce body -> Reduction
    memo: dict = {}

    def level_of(expr):
        lv = [r.level for r in table.values() if r.target in expr.free_symbols]
        return 1 + max(lv) if lv else 0

    def hoist(expr):
        if expr in memo:
            return memo[expr]
        if not expr.has(Reduce):
            out = expr
        elif isinstance(expr, Reduce):
            body = hoist(expr.args[0])
            if body not in table:
                base = spec.reduce_names.get(expr, f"sum{len(table)}")
                table[body] = Reduction(namer(base), body, level_of(body))
            out = table[body].target
        else:
            out = expr.func(*[hoist(a) for a in expr.args])
        memo[expr] = out
        return out

    new_state = {slot: hoist(e) for slot, e in spec.state_updates.items()}
    outputs = {slot: hoist(e) for slot, e in spec.output_exprs.items()}
    reductions = sorted(table.values(), key=lambda r: r.level)
    return StepIR(spec, reductions, new_state, outputs, spec.vector_symbols, namer)


# ---------------------------------------------------------------------------------------------
# Scheduling expressions into loops: loop-invariant hoisting and CSE
# ---------------------------------------------------------------------------------------------


def is_vector(expr, vector) -> bool:
    return bool(expr.free_symbols & vector)


def split_invariants(exprs, vector, namer, prefix="c"):
    """Pull the maximal scalar (lane-invariant over ``n``) subexpressions out of pointwise
    expressions, so a loop over the state axis does not recompute them per ``n``.

    Returns (scalar assignments, rewritten expressions)."""
    hoisted: dict = {}
    order: list = []

    def visit(e):
        if e.is_Atom:
            return e
        if not is_vector(e, vector):
            if e not in hoisted:
                hoisted[e] = namer(f"{prefix}{len(hoisted)}")
                order.append(e)
            return hoisted[e]
        if isinstance(e, (sympy.Add, sympy.Mul)):
            scal = [a for a in e.args if not is_vector(a, vector)]
            vec = [a for a in e.args if is_vector(a, vector)]
            parts = [visit(a) for a in vec]
            if scal:
                parts.append(visit(e.func(*scal)))
            return e.func(*parts, evaluate=False)
        if isinstance(e, sympy.Piecewise):
            return sympy.Piecewise(*[(visit(x), visit(c)) for x, c in e.args])
        return e.func(*[visit(a) for a in e.args])

    rewritten = [visit(e) for e in exprs]
    return [Assign(hoisted[e], e) for e in order], rewritten


def cse_block(pairs, namer, prefix="t"):
    """CSE a block of (make_statement, expression) pairs.

    Returns (temp assignments, final statements)."""
    exprs = [e for _, e in pairs]
    if not exprs:
        return [], []
    symbols = (namer(f"{prefix}{i}") for i in itertools.count())
    repl, reduced = sympy.cse(exprs, symbols=symbols, order="none")
    return [Assign(sym, e) for sym, e in repl], [make(e) for (make, _), e in zip(pairs, reduced)]


def schedule_forward(ir: StepIR, *, for_backward: bool = False) -> Program:
    """The forward step as a program. Reductions of level k run in loop k; new vector states are
    stored in the last loop (after every read of the old state); scalars come after the loops.
    With ``for_backward`` the program only recomputes the reductions (no stores)."""
    vector = set(ir.vector)
    statements = []
    vec_updates = {s: e for s, e in ir.new_state.items() if ir.is_vector_slot(s)}
    scal_updates = {s: e for s, e in ir.new_state.items() if not ir.is_vector_slot(s)}
    n_loops = ir.levels
    if vec_updates and not for_backward:
        need = [1 + max([r.level for r in ir.reductions if r.target in e.free_symbols], default=-1)
                for e in vec_updates.values()]
        n_loops = max(n_loops, max(need) + 1)
    for k in range(n_loops):
        pairs = [((lambda e, r=r: Accumulate(r.target, e)), r.body)
                 for r in ir.reductions if r.level == k]
        if k == n_loops - 1 and not for_backward:
            pairs += [((lambda e, s=s: Store("state", s, e)), e) for s, e in vec_updates.items()]
        statements += _loop(pairs, vector, ir.namer)
    if not for_backward:
        pairs = [((lambda e, s=s: Store("state", s, e)), e) for s, e in scal_updates.items()]
        pairs += [((lambda e, s=s: Store("output", s, e)), e) for s, e in ir.outputs.items()]
        temps, stmts = cse_block(pairs, ir.namer)
        statements += temps + stmts
    return Program(statements, frozenset(vector | loop_symbols(statements)))


def _loop(pairs, vector, namer, prefix="t"):
    """Statements for one loop: hoisted invariants, then the loop (CSE'd pointwise body)."""
    if not pairs:
        return []
    invariants, exprs = split_invariants([e for _, e in pairs], vector, namer)
    temps, stmts = cse_block([(m, e) for (m, _), e in zip(pairs, exprs)], namer, prefix)
    return invariants + [Loop(temps + stmts)]


def loop_symbols(statements) -> set:
    """Symbols assigned inside loops: they are pointwise."""
    return {b.target for s in statements if isinstance(s, Loop)
            for b in s.body if isinstance(b, Assign)}


def free_symbols(statements) -> set:
    """Every symbol the statements' expressions read (including their own temporaries)."""
    return {x for s in statements for b in (s.body if isinstance(s, Loop) else [s])
            for x in b.expr.free_symbols}


def prune(program: Program, keep_store) -> Program:
    """The program with only the stores ``keep_store(store)`` accepts, and only the statements
    they need (dead-code elimination, last statement first)."""
    live: set = set()

    def needed(stmt) -> bool:
        if isinstance(stmt, Store):
            return keep_store(stmt)
        return stmt.target in live

    kept = []
    for st in reversed(program.statements):
        if isinstance(st, Loop):
            body = []
            # a loop body reads its own temporaries: sweep it until nothing new becomes live
            while True:
                body = [b for b in st.body if needed(b)]
                grown = {x for b in body for x in b.expr.free_symbols} - live
                if not grown:
                    break
                live |= grown
            if body:
                kept.append(Loop(body))
        elif needed(st):
            live |= st.expr.free_symbols
            kept.append(st)
    kept.reverse()
    return Program(kept, program.vector)
