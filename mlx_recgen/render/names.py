"""Identifiers of generated code that derive from a spec's names.

Generated code (the kernels, the MLX step functions) holds two kinds of identifiers:

* its own: fixed words (``t``, ``n``, ``lane``, ``meta``, ``L``, ``NS``, ``red``, ``out0``,
  ``mx``), the target's keywords and library names (``float``, ``expf``, ``threadIdx``) and
  MLX's generated parameters (``<buffer>_shape``, thread attributes). None starts with
  ``PREFIX``.
* those derived from the spec: tensor buffers, bases and strides, axis coordinates, and the
  values of the step's symbols (inputs, states, temporaries, reductions named after the body's
  locals). Each is spelled by ``Identifiers``: ``PREFIX`` and a readable form of the name
  (``u_q``, ``u_q_base``, ``u_q_stride_L``, ``u_idx_B``, ``u_h_s``).

So a tensor may carry any name Python accepts (``L``, ``n``, ``int``, ``lambda``, ``idx_B``)
without meeting a generated identifier, a keyword or a library name. Non-ASCII characters are
spelled by their code points, and two keys never share a spelling: a readable form already
taken (only contrived names do that, such as a tensor ``q_base`` beside the base of ``q``) gets a
numeric suffix, in an order fixed by the spec, so every kernel of a spec agrees.
"""

from __future__ import annotations

import hashlib
import json

from ..ir import Accumulate, Assign, Loop
from ..schedule import COMPONENT, LANE_GROUPS, LANES, SEGMENTS

PREFIX = "u_"

# MLX adds a parameter ``<name>_shape`` (``_strides``, ``_ndim``) for every input buffer whose
# name followed by the suffix occurs in the body; no other identifier may be spelled so.
MLX_INPUT_SUFFIXES = ("_shape", "_strides", "_ndim")


def ascii_name(name: str) -> str:
    """``name`` with each non-ASCII character spelled by its code point (``λ`` -> ``u03bb``):
    CUDA compilers need not accept UTF-8 identifiers, and Python would NFKC-fold them."""
    return "".join(c if c.isascii() else f"u{ord(c):04x}" for c in name)


class Identifiers:
    """Spellings of the identifiers derived from spec names, by key.

    ``add(key, readable)`` spells ``key`` as ``PREFIX + readable`` unless that is taken (then
    with ``_1``, ``_2``...); ``ids[key]`` returns the spelling."""

    def __init__(self):
        self._spelling: dict = {}
        self._taken: set = set()

    def add(self, key, readable: str, reserve=()) -> str:
        """Spell ``key``; ``reserve`` lists suffixes that must stay free after the spelling (and
        are taken with it), for names MLX derives from a buffer's."""
        if key in self._spelling:
            return self._spelling[key]
        base = PREFIX + ascii_name(readable)
        spelling, k = base, 0
        while spelling in self._taken or any(spelling + s in self._taken for s in reserve):
            k += 1
            spelling = f"{base}_{k}"
        self._spelling[key] = spelling
        self._taken.add(spelling)
        self._taken.update(spelling + s for s in reserve)
        return spelling

    def __getitem__(self, key) -> str:
        return self._spelling[key]

    def __contains__(self, key) -> bool:
        return key in self._spelling

    def items(self):
        """(key, spelling) pairs in the order they were spelled."""
        return self._spelling.items()


def _axis_text(a) -> str:
    if isinstance(a, str):
        return a
    if isinstance(a, tuple):  # schedule.members(group axis)
        return f"{a[1]}_members"
    return {COMPONENT: "comp", LANE_GROUPS: "lane_group", SEGMENTS: "segment", LANES: "lane"}[a]


def program_symbols(program) -> set:
    """Every symbol a program reads or assigns."""
    out = set()
    for st in program.statements:
        for b in st.body if isinstance(st, Loop) else [st]:
            out |= b.expr.free_symbols
            if isinstance(b, (Assign, Accumulate)):
                out.add(b.target)
    return out


def kernel_identifiers(rec, meta) -> Identifiers:
    """The spec-derived identifiers of a recurrence's kernels, all spelled up front in one order
    (buffers, runtime values, coordinates and bases, then symbols by name), so the forward and
    backward kernels and the buffer names handed to MLX agree.

    Keys: ``(role, tensor)`` for buffers and bases (roles ``buffer``, ``init``, ``final``,
    ``ckpt``, ``local``, ``lamend``, ``d``, ``d_init``, ``d_final``, ``base``, ``d_base``); the ``meta`` layout's keys
    (``("size", axis)``, ``("stride", tensor, axis)``, ``("d_stride", tensor, axis)``);
    ``("idx", axis)``, ``("rest", axis)``, ``("member", group axis)``; ``(role, symbol)`` for symbols: ``sym`` (its value),
    ``value`` (an input or cotangent loaded this step), ``state`` (the state register),
    ``acc`` (a parameter gradient's accumulator), ``stage`` (a lane-shared input's tile of steps
    in threadgroup memory)."""
    spec = rec.spec
    ids = Identifiers()
    for t in spec.inputs.values():
        ids.add(("buffer", t.name), t.name, MLX_INPUT_SUFFIXES)
    for t in spec.outputs.values():
        ids.add(("buffer", t.name), t.name, MLX_INPUT_SUFFIXES)
    for t in spec.states.values():
        # local: a segment's local end state or adjoint; lamend: the adjoint at a segment's end
        for role in ("init", "final", "ckpt", "local", "lamend"):
            ids.add((role, t.name), f"{t.name}_{role}", MLX_INPUT_SUFFIXES)
    for t in [*spec.inputs.values(), *spec.outputs.values()]:
        ids.add(("d", t.name), f"d_{t.name}", MLX_INPUT_SUFFIXES)
    for t in spec.states.values():
        for role in ("init", "final"):
            ids.add((f"d_{role}", t.name), f"d_{t.name}_{role}", MLX_INPUT_SUFFIXES)
    for key in meta.keys:
        if isinstance(key, tuple):
            role, *parts = key
            if role == "size":
                ids.add(key, f"size_{parts[0]}")
            elif role == "stride":
                ids.add(key, f"{parts[0]}_stride_{_axis_text(parts[1])}")
            else:
                ids.add(key, f"d_{parts[0]}_stride_{_axis_text(parts[1])}")
    for b in spec.batch_axes:
        ids.add(("idx", b), f"idx_{b}")
        ids.add(("rest", b), f"rest_{b}")
    for g in spec.groups:  # a group axis: the group's index and the member's within it
        ids.add(("idx", g), f"idx_{g}")
        ids.add(("member", g), f"member_{g}")
    for t in spec.tensors.values():
        ids.add(("base", t.name), f"{t.name}_base")
    for t in spec.inputs.values():
        ids.add(("d_base", t.name), f"d_{t.name}_base")

    roles = {}
    for slot, sym in spec.symbols.items():
        t = spec.tensors[slot.tensor]
        roles[sym] = ["state"] if t.kind == "state" else ["value"]
        if t.kind == "input" and not t.has_time:
            roles[sym].append("acc")
        if t.kind == "input" and t.has_time and not t.has_lane:
            roles[sym].append("stage")
    for sym in rec.adjoint.output_cotangents.values():
        roles[sym] = ["value"]
    symbols = (program_symbols(rec.forward_program) | program_symbols(rec.adjoint.program)
               | set(rec.adjoint.state_cotangents.values()) | set(roles))
    for sym in sorted(symbols, key=str):
        for role in roles.get(sym, ["sym"]):
            readable = {"sym": str(sym), "value": f"{sym}_v", "state": f"{sym}_s",
                        "acc": f"acc_d{sym}", "stage": f"{sym}_tile"}[role]
            ids.add((role, sym), readable)
    return ids


def kernel_name(spec_name: str, kind: str, header: str, body: str, input_names=(),
                output_names=()) -> str:
    """The name MLX compiles a kernel under (it prepends ``custom_kernel_``): the spec's name
    (ASCII), the kernel's kind and the first 12 hex digits of the sha256 of the kernel's text
    (header, body and buffer names), so kernels of different text never share a name: MLX
    before 0.32.2 caches compiled CUDA modules by name alone, and two specs may share a name, as
    do the kernels of one spec for other dtypes (the header names them) or schedules."""
    text = "".join(c if c.isascii() and (c.isalnum() or c == "_") else f"u{ord(c):04x}"
                   for c in spec_name)
    source = json.dumps([header, body, list(input_names), list(output_names)])
    return f"recgen_{text}_{kind}_{hashlib.sha256(source.encode()).hexdigest()[:12]}"


__all__ = ["PREFIX", "COMPONENT", "Identifiers", "ascii_name", "kernel_identifiers",
           "kernel_name", "program_symbols"]
