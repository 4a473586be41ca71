"""Forward mode: the tangent of a recurrence is itself a recurrence.

For a step ``h' = F(h, x)``, ``y = G(h, x)`` (with reductions ``R = Σ_n b(n)`` anywhere inside),
the tangents follow the same time loop:

    ḣ' = Σ_j ∂F/∂h_j ḣ_j + Σ_x ∂F/∂x ẋ + Σ_R ∂F/∂R Ṙ,      Ṙ = Σ_n ḃ(n)
    ẏ  = the same with G

so the *tangent spec* has the original states plus one tangent state per state (same axes), the
original inputs plus one tangent per differentiable input (a bool or integer input has none),
and the original outputs plus one tangent per output.
It is a plain ``Spec`` and compiles, checkpoints and runs like any other recurrence, on every
backend. Each ``Reduce`` node is an atom while differentiating (a dummy symbol); its tangent is
the ``Reduce`` of its body's tangent.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import sympy

from .spec import Reduce, Slot, Spec, _validate_expressions


@dataclass
class TangentSpec:
    """A tangent spec and, for every tensor of the original spec, the name of its tangent."""

    spec: Spec
    names: dict  # original tensor name -> tangent tensor name


class _Names:
    """Hands out tensor and symbol names that collide with nothing the spec (or the kernels'
    buffers derived from it) uses."""

    def __init__(self, spec: Spec):
        self.taken = set(spec.tensors) | {str(s) for s in spec.symbols.values()}
        self.taken |= {str(v) for v in spec.reduce_names.values()}

    def _free(self, name: str) -> bool:
        # generated code spells every spec name apart from its own identifiers (render.names),
        # so a tangent name only has to differ from the spec's names
        if name in self.taken or f"d{name}" in self.taken:
            return False
        return not (name.startswith("d") and name[1:] in self.taken)

    def __call__(self, base: str) -> str:
        name, k = base, 0
        while not self._free(name):
            k += 1
            name = f"{base}_{k}"
        self.taken.add(name)
        return name


def _outer_reduces(expr) -> list:
    """The ``Reduce`` nodes of ``expr`` that are not inside another ``Reduce``."""
    found = []

    def visit(e):
        if isinstance(e, Reduce):
            if e not in found:
                found.append(e)
            return
        for a in e.args:
            visit(a)

    visit(expr)
    return found


def _sign_free(expr):
    """``sign`` (from ``d|x|/dx``) as a Piecewise, so the result stays in the spec language and
    differentiates again to 0 (``abs'(0) = 0`` as in the reverse mode)."""
    return expr.replace(
        lambda e: isinstance(e, sympy.sign),
        lambda e: sympy.Piecewise((sympy.Integer(1), e.args[0] > 0),
                                  (sympy.Integer(-1), e.args[0] < 0), (sympy.Integer(0), True)))


class _Tangents:
    """Tangents of spec expressions, given the tangent symbol of every leaf symbol."""

    def __init__(self, dot: dict, reduce_names: dict):
        self.dot = dot  # leaf symbol -> its tangent symbol
        self.reduce_names = reduce_names  # original Reduce -> local name (for readable IR)
        self.new_reduce_names = {}
        self.memo = {}

    def __call__(self, expr):
        expr = sympy.sympify(expr)
        if expr in self.memo:
            return self.memo[expr]
        reduces = _outer_reduces(expr)
        atoms = {r: sympy.Dummy(f"R{i}", real=True) for i, r in enumerate(reduces)}
        back = {d: r for r, d in atoms.items()}
        flat = expr.xreplace(atoms)
        terms = []
        for z in sorted(flat.free_symbols & set(self.dot), key=str):
            d = sympy.diff(flat, z)
            if d != 0:
                terms.append(d * self.dot[z])
        for r, a in atoms.items():
            if a not in flat.free_symbols:
                continue
            d = sympy.diff(flat, a)
            body = self(r.args[0])
            if d != 0 and body != 0:
                rdot = Reduce(body)
                if r in self.reduce_names:
                    self.new_reduce_names.setdefault(rdot, f"{self.reduce_names[r]}_dot")
                terms.append(d * rdot)
        out = _sign_free(sympy.Add(*terms).xreplace(back))
        self.memo[expr] = out
        return out


def tangent_spec(spec: Spec) -> TangentSpec:
    """The forward-mode twin of ``spec`` (see the module docstring).

    States, inputs and outputs keep their order; the tangents follow the originals, in the same
    order: states ``(*states, *state tangents)``, likewise inputs and outputs."""
    names = _Names(spec)
    tname = {k: names(f"{k}_dot") for k, t in spec.tensors.items() if t.differentiable}

    def tangent_tensor(t):
        return dataclasses.replace(t, name=tname[t.name])

    symbols = dict(spec.symbols)
    vector = set(spec.vector_symbols)
    dot = {}
    for slot, sym in spec.symbols.items():
        t = spec.tensors[slot.tensor]
        if not t.differentiable:  # a bool or integer input: its tangent is zero
            continue
        base = tname[t.name] if t.components == 1 else f"{tname[t.name]}{slot.component}"
        s = sympy.Symbol(base if base == tname[t.name] else names(base), real=True)
        symbols[Slot(tname[t.name], slot.component)] = s
        dot[sym] = s
        if sym in spec.vector_symbols:
            vector.add(s)

    tangent = _Tangents(dot, spec.reduce_names)
    updates = dict(spec.state_updates)
    for slot, e in spec.state_updates.items():
        updates[Slot(tname[slot.tensor], slot.component)] = tangent(e)
    outputs = dict(spec.output_exprs)
    for slot, e in spec.output_exprs.items():
        outputs[Slot(tname[slot.tensor], slot.component)] = tangent(e)

    tspec = Spec(
        name=f"{spec.name}_tangent",
        doc=f"Forward-mode tangent of {spec.name}: its states, inputs and outputs, each followed "
            "by its tangent.",
        time=spec.time, lane=spec.lane, batch_axes=spec.batch_axes, state_axis=spec.state_axis,
        index_name=spec.index_name,
        states={**spec.states, **{tname[k]: tangent_tensor(t) for k, t in spec.states.items()}},
        inputs={**spec.inputs, **{tname[k]: tangent_tensor(t) for k, t in spec.inputs.items()
                                  if t.differentiable}},
        outputs={**spec.outputs, **{tname[k]: tangent_tensor(t) for k, t in spec.outputs.items()}},
        symbols=symbols, vector_symbols=frozenset(vector), state_updates=updates,
        output_exprs=outputs, reduce_names={**spec.reduce_names, **tangent.new_reduce_names},
        source_file=spec.source_file, groups=spec.groups,
    )
    _validate_expressions(tspec)
    return TangentSpec(tspec, tname)


__all__ = ["TangentSpec", "tangent_spec"]
