"""An on-disk cache of derived step programs, keyed by the content of a spec.

Deriving the adjoint runs sympy; a spec that has not changed need not pay that again in every
process. The cache stores the adjoint of a spec (and its forward program, as a check) under a key
made of

* a stable text of the spec: its axes and roles, every declared tensor, the traced symbols and
  the traced expressions (``sympy.srepr``), the names of its reductions;
* the library version, a digest of the compiler modules' source (a changed compiler misses)
  and the sympy and Python versions.

Location: ``$MLX_RECGEN_CACHE`` if set (``0``, ``off`` or ``none`` disable the cache), else
``$XDG_CACHE_HOME/mlx-recgen/programs``, else ``~/.cache/mlx-recgen/programs``. Missing
directories are created with mode 0700. A directory that another user owns or can write is not
used at all (a ``RuntimeWarning`` says so once): whoever can write the records chooses the
programs, so only the user's own private directory is trusted.

A record is JSON: the statements of each program, and each expression as a tree of node class
names drawn from a fixed list (the functions of the spec language, arithmetic, comparisons and
logic) with symbols by name and assumptions. Reading one runs no code: nothing is unpickled,
evaluated or imported, and an unknown node is refused. A file is written under a temporary name
(mode 0600) and renamed into place (``os.replace``), so processes can share the directory.

A record is used only if it parses, names the same full key text, its forward program equals the
one derived again on load (deriving the forward program takes milliseconds, the adjoint up to a
second), and its adjoint is consistent with the spec (its stores and free symbols, names disjoint
from the forward program's); anything else is a miss, and the programs are derived again. These
checks catch damaged and stale records; the adjoint itself is trusted because the directory is.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
import tempfile
from pathlib import Path

import mpmath
import sympy
from sympy.codegen.cfunctions import log1p
from sympy.functions.elementary.piecewise import ExprCondPair

from . import cachedirs
from .adjoint import Adjoint
from .functions import sigmoid, softplus
from .ir import Accumulate, Assign, Loop, Program, Store, lower, schedule_forward
from .spec import Slot

FORMAT = "mlx-recgen-programs-2"
_DISABLED = {"0", "off", "none", "false", "no"}
# The modules whose code decides the derived programs.
_COMPILER_MODULES = ("spec.py", "functions.py", "ir.py", "adjoint.py", "simplify.py", "cache.py")
_compiler_digest_value = None


def cache_dir() -> Path | None:
    """The directory of the program cache, or ``None`` when it is disabled."""
    env = os.environ.get("MLX_RECGEN_CACHE")
    if env is not None and env.strip().lower() in _DISABLED | {""}:
        return None
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlx-recgen" / "programs"


def _compiler_digest() -> str:
    global _compiler_digest_value
    if _compiler_digest_value is None:
        h = hashlib.sha256()
        here = Path(__file__).resolve().parent
        for name in _COMPILER_MODULES:
            h.update(name.encode())
            h.update((here / name).read_bytes())
        _compiler_digest_value = h.hexdigest()
    return _compiler_digest_value


def spec_key(spec) -> str:
    """A stable text of everything in the spec that the derived programs depend on."""
    from . import __version__

    def tensor(t):  # every field: roles, group axes, whether it is differentiated
        return repr(t)

    lines = [FORMAT, f"mlx-recgen {__version__} {_compiler_digest()}",
             f"sympy {sympy.__version__}", f"python {sys.version_info[0]}.{sys.version_info[1]}",
             f"spec {spec.name}", f"time {spec.time}", f"lane {spec.lane}",
             f"batch {spec.batch_axes!r}", f"state_axis {spec.state_axis!r}",
             f"index {spec.index_name!r}", f"groups {sorted(spec.groups.items())!r}"]
    lines += [tensor(t) for group in (spec.states, spec.inputs, spec.outputs) for t in group.values()]
    lines += [f"symbol {slot.tensor} {slot.component} {sympy.srepr(sym)}"
              for slot, sym in spec.symbols.items()]
    lines += [f"vector {name}" for name in sorted(str(s) for s in spec.vector_symbols)]
    lines += [f"update {slot.tensor} {slot.component} {sympy.srepr(e)}"
              for slot, e in spec.state_updates.items()]
    lines += [f"output {slot.tensor} {slot.component} {sympy.srepr(e)}"
              for slot, e in spec.output_exprs.items()]
    lines += [f"reduce {name} {sympy.srepr(e)}" for e, name in spec.reduce_names.items()]
    return "\n".join(lines)


def _path(directory: Path, spec, key: str) -> Path:
    digest = hashlib.sha256(key.encode()).hexdigest()[:32]
    safe = "".join(c if c.isalnum() or c in "_-" else "_" for c in spec.name)[:40]
    return directory / f"{safe}-{digest}.json"


def _directory():
    """The cache directory when it exists (created 0700 if missing) and only this user can
    write it; ``None`` otherwise (a directory others control is reported once)."""
    directory = cache_dir()
    if directory is None:
        return None
    why, unsafe = cachedirs.prepare(directory)
    if why is None:
        return directory
    if unsafe:
        cachedirs.warn_once("program cache", directory, why,
                            "programs are derived without it (set MLX_RECGEN_CACHE to a "
                            "private directory)")
    return None


def load(spec):
    """``(forward_program, adjoint)`` from the cache, or ``None`` (a miss, an unreadable,
    corrupt or foreign file, a disabled or unsafe cache). The forward program is always
    derived again (it is cheap) and the record's must equal it."""
    directory = _directory()
    if directory is None:
        return None
    try:
        key = spec_key(spec)
        with open(_path(directory, spec, key), "rb") as f:
            if cachedirs.unsafe_reason(f.name, os.fstat(f.fileno())) is not None:
                return None
            record = json.loads(f.read().decode("utf-8"))
        if not (isinstance(record, dict) and record.get("format") == FORMAT
                and record.get("key") == key):
            return None
        forward, adjoint = _decode_record(record)
        if forward != schedule_forward(lower(spec)):
            return None
        if not _consistent(spec, forward, adjoint):
            return None
        return forward, adjoint
    except Exception:  # any failure to read or validate is a miss: derive again
        return None


def store(spec, forward, adjoint) -> bool:
    """Write the programs of ``spec``; ``False`` when the cache is disabled, unsafe or not
    writable, or when the programs hold something the record cannot represent exactly."""
    directory = _directory()
    if directory is None:
        return False
    tmp = None
    try:
        key = spec_key(spec)
        record = {"format": FORMAT, "key": key, **_encode_record(forward, adjoint)}
        if _decode_record(record) != (forward, adjoint):  # written only if read back exactly
            return False
        path = _path(directory, spec, key)
        fd, tmp = tempfile.mkstemp(prefix=path.stem + ".", suffix=".tmp", dir=directory)
        with os.fdopen(fd, "w", encoding="utf-8") as f:  # mkstemp: mode 0600
            json.dump(record, f, separators=(",", ":"))
        os.replace(tmp, path)
        return True
    except Exception:  # a cache that cannot be written is no cache
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        return False


# ---------------------------------------------------------------------------------------------
# The record: programs as JSON, expressions as trees of whitelisted node classes
# ---------------------------------------------------------------------------------------------

# Every node class a derived program may hold (what the renderers print). A record naming any
# other class is refused; nothing in a record is evaluated, imported or called except these
# constructors on already-built arguments.
_FUNCTIONS = {cls.__name__: cls for cls in (
    sympy.Add, sympy.Mul, sympy.Pow, sympy.exp, sympy.log, log1p, sympy.tanh, sympy.sin,
    sympy.cos, sympy.tan, sympy.cosh, sympy.sinh, sympy.Abs, sympy.sign, sigmoid, softplus,
    sympy.Piecewise, sympy.StrictGreaterThan, sympy.GreaterThan, sympy.StrictLessThan,
    sympy.LessThan, sympy.Equality, sympy.Unequality, sympy.And, sympy.Or, sympy.Not, sympy.ITE)}
_PAIR = "ExprCondPair"  # Piecewise's (value, condition): built without an evaluate option
_CONSTANTS = {type(c).__name__: c for c in (
    sympy.S.Infinity, sympy.S.NegativeInfinity, sympy.S.NaN, sympy.S.ComplexInfinity,
    sympy.S.Pi, sympy.S.Exp1, sympy.S.true, sympy.S.false)}
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_KINDS = ("state", "output", "lambda", "grad")


class _Symbols:
    """Symbols of a record by index: name and assumptions (those fix a sympy symbol)."""

    def __init__(self, table=None):
        self.table, self.index = [], {}
        for entry in table or []:
            name, assumptions = entry
            if not (isinstance(name, str) and _NAME.match(name) and isinstance(assumptions, dict)
                    and all(isinstance(k, str) and _NAME.match(k) and isinstance(v, bool)
                            for k, v in assumptions.items())):
                raise ValueError("malformed symbol in a cache record")
            self.table.append(sympy.Symbol(name, **assumptions))

    def ref(self, sym) -> int:
        if type(sym) is not sympy.Symbol or not _NAME.match(sym.name):
            raise TypeError(f"cannot record symbol {sym!r}")
        if sym not in self.index:
            self.index[sym] = len(self.table)
            self.table.append(sym)
        return self.index[sym]

    def get(self, i) -> sympy.Symbol:
        if type(i) is not int or not 0 <= i < len(self.table):
            raise ValueError("bad symbol index in a cache record")
        return self.table[i]

    def entries(self) -> list:
        return [[s.name, dict(sorted(s.assumptions0.items()))] for s in self.table]


def _encode_expr(e, symbols: _Symbols):
    if isinstance(e, sympy.Symbol):
        return ["Symbol", symbols.ref(e)]
    name = type(e).__name__
    if name in _CONSTANTS and e is _CONSTANTS[name]:
        return ["Constant", name]
    if isinstance(e, sympy.Integer):
        return ["Integer", int(e.p)]
    if isinstance(e, sympy.Rational):
        return ["Rational", int(e.p), int(e.q)]
    if isinstance(e, sympy.Float):
        sign, man, exp, bc = mpmath.libmp.to_pickable(e._mpf_)
        return ["Float", sign, man, exp, bc, e._prec]
    if name == _PAIR or _FUNCTIONS.get(name) is type(e):
        return [name] + [_encode_expr(a, symbols) for a in e.args]
    raise TypeError(f"cannot record {name} in a cache record")


def _decode_expr(node, symbols: _Symbols):
    if not (isinstance(node, list) and node and isinstance(node[0], str)):
        raise ValueError("malformed expression in a cache record")
    name, args = node[0], node[1:]
    if name == "Symbol" and len(args) == 1:
        return symbols.get(args[0])
    if name == "Constant" and len(args) == 1 and args[0] in _CONSTANTS:
        return _CONSTANTS[args[0]]
    if name in ("Integer", "Rational", "Float"):
        if not all(type(a) is int or (name == "Float" and type(a) is str) for a in args):
            raise ValueError("malformed number in a cache record")
        if name == "Integer" and len(args) == 1:
            return sympy.Integer(args[0])
        if name == "Rational" and len(args) == 2 and args[1] > 0:
            return sympy.Rational(args[0], args[1])
        if (name == "Float" and len(args) == 5 and args[0] in (0, 1) and type(args[1]) is str
                and re.fullmatch(r"[0-9a-f]{1,4096}", args[1]) and 0 < args[4] <= 4096):
            return sympy.Float(tuple(args[:4]), precision=args[4])
        raise ValueError("malformed number in a cache record")
    values = [_decode_expr(a, symbols) for a in args]
    if name == _PAIR and len(values) == 2:
        return ExprCondPair(*values)
    if name in _FUNCTIONS and values:
        return _FUNCTIONS[name](*values, evaluate=False)
    raise ValueError(f"node {name!r} is not allowed in a cache record")


def _encode_program(program: Program, symbols: _Symbols) -> dict:
    def statement(st):
        if isinstance(st, Loop):
            return ["loop", [statement(b) for b in st.body]]
        if isinstance(st, (Assign, Accumulate)):
            return [type(st).__name__.lower(), symbols.ref(st.target),
                    _encode_expr(st.expr, symbols)]
        if isinstance(st, Store):
            return ["store", st.kind, st.slot.tensor, st.slot.component,
                    _encode_expr(st.expr, symbols)]
        raise TypeError(f"cannot record statement {st!r}")

    return {"statements": [statement(s) for s in program.statements],
            "vector": sorted(symbols.ref(s) for s in program.vector)}


def _decode_program(data, symbols: _Symbols) -> Program:
    def statement(st, in_loop):
        if not (isinstance(st, list) and st and isinstance(st[0], str)):
            raise ValueError("malformed statement in a cache record")
        if st[0] == "loop" and len(st) == 2 and isinstance(st[1], list) and not in_loop:
            return Loop([statement(b, True) for b in st[1]])
        if st[0] in ("assign", "accumulate") and len(st) == 3:
            cls = Assign if st[0] == "assign" else Accumulate
            return cls(symbols.get(st[1]), _decode_expr(st[2], symbols))
        if (st[0] == "store" and len(st) == 5 and st[1] in _KINDS and isinstance(st[2], str)
                and type(st[3]) is int):
            return Store(st[1], Slot(st[2], st[3]), _decode_expr(st[4], symbols))
        raise ValueError("malformed statement in a cache record")

    if not (isinstance(data, dict) and isinstance(data.get("statements"), list)
            and isinstance(data.get("vector"), list)):
        raise ValueError("malformed program in a cache record")
    return Program([statement(s, False) for s in data["statements"]],
                   frozenset(symbols.get(i) for i in data["vector"]))


def _encode_slots(mapping: dict, symbols: _Symbols) -> list:
    return [[slot.tensor, slot.component, symbols.ref(sym)] for slot, sym in mapping.items()]


def _decode_slots(data, symbols: _Symbols) -> dict:
    if not (isinstance(data, list) and all(
            isinstance(e, list) and len(e) == 3 and isinstance(e[0], str) and type(e[1]) is int
            for e in data)):
        raise ValueError("malformed cotangents in a cache record")
    return {Slot(tensor, component): symbols.get(i) for tensor, component, i in data}


def _encode_record(forward: Program, adjoint: Adjoint) -> dict:
    symbols = _Symbols()
    body = {"forward": _encode_program(forward, symbols),
            "adjoint": _encode_program(adjoint.program, symbols),
            "output_cotangents": _encode_slots(adjoint.output_cotangents, symbols),
            "state_cotangents": _encode_slots(adjoint.state_cotangents, symbols)}
    return {"symbols": symbols.entries(), **body}


def _decode_record(record: dict):
    if not isinstance(record.get("symbols"), list):
        raise ValueError("malformed cache record")
    symbols = _Symbols(record["symbols"])
    forward = _decode_program(record.get("forward"), symbols)
    adjoint = Adjoint(_decode_program(record.get("adjoint"), symbols),
                      _decode_slots(record.get("output_cotangents"), symbols),
                      _decode_slots(record.get("state_cotangents"), symbols))
    return forward, adjoint


def _consistent(spec, forward, adjoint) -> bool:
    """The loaded programs fit the spec: the stores it needs, and no symbol it does not know."""
    if not (isinstance(forward, Program) and isinstance(adjoint, Adjoint)
            and isinstance(adjoint.program, Program)):
        return False
    ybar, lam = adjoint.output_cotangents, adjoint.state_cotangents
    if set(ybar) != set(spec.output_slots()) or set(lam) != set(spec.state_slots()):
        return False
    known = set(spec.symbols.values())
    expected = {
        id(forward): (known, {("state", s) for s in spec.state_slots()}
                      | {("output", s) for s in spec.output_slots()}),
        id(adjoint.program): (known | set(ybar.values()) | set(lam.values()),
                              {("lambda", s) for s in spec.state_slots()}
                              | {("grad", s) for s in spec.input_slots()}),
    }
    for program in (forward, adjoint.program):
        readable, stores = expected[id(program)]
        readable = set(readable)
        seen = set()
        for st in program.statements:
            body = st.body if isinstance(st, Loop) else [st]
            if not isinstance(st, (Loop, Assign, Accumulate, Store)):
                return False
            # every statement is one of the vocabulary and reads only what is defined
            targets = {b.target for b in body if isinstance(b, (Assign, Accumulate))}
            readable |= targets  # a loop body reads its own temporaries and accumulators
            for b in body:
                if not isinstance(b, (Assign, Accumulate, Store)):
                    return False
                if not isinstance(b.expr, sympy.Basic) or not b.expr.free_symbols <= readable:
                    return False
                if isinstance(b, Store):
                    seen.add((b.kind, b.slot))
        if seen != stores:
            return False
    # the adjoint was derived after the forward program: its temporaries have fresh names (the
    # reductions it recomputes keep theirs)
    return not (_temporaries(forward) & _temporaries(adjoint.program))


def _temporaries(program: Program) -> set:
    return {b.target for st in program.statements
            for b in (st.body if isinstance(st, Loop) else [st]) if isinstance(b, Assign)}


__all__ = ["cache_dir", "load", "store", "spec_key"]
