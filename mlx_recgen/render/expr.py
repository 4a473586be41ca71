"""Expression printers: sympy expressions to source text.

One walker (``ExprPrinter``) knows the structure of expressions — sums, products with their
divisions, integer powers expanded to multiplications (GPU ``pow`` is undefined for negative
bases), comparisons, ``where`` — and asks a small subclass how to spell literals, calls and
selects. ``MLXPrinter`` spells MLX Python; ``CPrinter`` spells C-family code through a
``Dialect`` (Metal, CUDA).
"""

from __future__ import annotations

import abc
import struct

import sympy
from sympy.codegen.cfunctions import log1p

from ..affine import compose, scale, zero_hit
from ..functions import sigmoid, softplus

ATOM, MUL, ADD = 3, 2, 1  # binding strength of what a printed piece is

# spec-language function -> neutral name; printers map neutral names to their spelling
FUNCTION_NAMES = {
    sympy.exp: "exp", sympy.log: "log", log1p: "log1p", sympy.tanh: "tanh", sympy.sin: "sin",
    sympy.cos: "cos", sympy.tan: "tan", sympy.cosh: "cosh", sympy.sinh: "sinh",
    sympy.Abs: "abs", sympy.sign: "sign", sigmoid: "sigmoid", softplus: "softplus",
    # the chunked schedule's products (``affine``)
    scale: "scale", compose: "compose", zero_hit: "zero_hit",
}

_RELATIONS = {sympy.StrictGreaterThan: ">", sympy.GreaterThan: ">=", sympy.StrictLessThan: "<",
              sympy.LessThan: "<=", sympy.Eq: "==", sympy.Ne: "!="}


class ExprPrinter(abc.ABC):
    """Prints an expression; ``names`` maps symbols to identifiers."""

    def __init__(self, names: dict):
        self.names = names

    def __call__(self, expr) -> str:
        return self._p(sympy.sympify(expr))[0]

    # -- spelled by subclasses ------------------------------------------------------------------
    @abc.abstractmethod
    def number(self, value: float) -> str:
        """A non-negative, finite float literal."""

    @abc.abstractmethod
    def infinity(self) -> str:
        """Positive infinity (a float); ``-oo`` prints as ``-`` followed by it."""

    @abc.abstractmethod
    def nan(self) -> str:
        """A quiet NaN (a float)."""

    @abc.abstractmethod
    def call(self, name: str, args: list) -> str:
        """A call of a neutral function name (``exp``, ``sigmoid``, ``pow``...)."""

    @abc.abstractmethod
    def select(self, cond: str, a: str, b: str) -> str:
        """``a`` where ``cond`` holds, else ``b``."""

    @abc.abstractmethod
    def logical(self, op: str, args: list) -> str:
        """``and`` / ``or`` / ``not`` of conditions."""

    @abc.abstractmethod
    def boolean(self, value: bool) -> str:
        """A boolean literal."""

    # -- structure --------------------------------------------------------------------------------
    def _wrap(self, piece, strength):
        text, s = piece
        return text if s >= strength else f"({text})"

    def _p(self, e):
        if isinstance(e, sympy.Symbol):
            return self.names.get(e, str(e)), ATOM
        if e is sympy.nan:
            return self.nan(), ATOM
        if e is sympy.oo:
            return self.infinity(), ATOM
        if e is sympy.S.NegativeInfinity:
            return f"-{self.infinity()}", ADD
        if e.is_Number or isinstance(e, sympy.NumberSymbol):
            v = float(e)
            text = self.number(abs(v))
            return (f"-{text}", ADD) if v < 0 else (text, ATOM)
        if isinstance(e, sympy.Add):
            return self._add(e)
        if isinstance(e, sympy.Mul):
            return self._mul(e)
        if isinstance(e, sympy.Pow):
            return self._pow(e)
        if isinstance(e, sympy.Piecewise):
            return self._piecewise(e.args), ATOM
        if type(e) in _RELATIONS:
            a, b = (self._wrap(self._p(x), MUL) for x in e.args)
            return f"({a} {_RELATIONS[type(e)]} {b})", ATOM
        if isinstance(e, (sympy.And, sympy.Or)):
            return self.logical("and" if isinstance(e, sympy.And) else "or",
                                [self._p(a)[0] for a in e.args]), ATOM
        if isinstance(e, sympy.Not):
            return self.logical("not", [self._p(e.args[0])[0]]), ATOM
        if isinstance(e, sympy.ITE):  # a boolean if-then-else, left by piecewise folding
            return self.select(*(self._p(a)[0] for a in e.args)), ATOM
        if e in (sympy.true, sympy.false):
            return self.boolean(bool(e)), ATOM
        if e.func in FUNCTION_NAMES:
            return self.call(FUNCTION_NAMES[e.func], [self._p(a)[0] for a in e.args]), ATOM
        raise TypeError(f"cannot render {e!r} ({type(e).__name__})")

    def _piecewise(self, pieces):
        (value, cond), rest = pieces[0], pieces[1:]
        if cond == sympy.true or not rest:
            return self._p(value)[0]
        return self.select(self._p(cond)[0], self._p(value)[0], self._piecewise(rest))

    def _add(self, e):
        terms = sorted(e.args, key=lambda t: t.could_extract_minus_sign())
        out = ""
        for t in terms:
            if t.could_extract_minus_sign():
                body = self._wrap(self._p(-t), MUL)
                out = f"{out} - {body}" if out else f"-{body}"
            else:
                body = self._p(t)[0]
                out = f"{out} + {body}" if out else body
        return out, ADD

    def _mul(self, e):
        coeff, factors = e.as_coeff_mul()
        if coeff < 0:
            text, _ = self._mul_positive(-coeff, factors)
            return f"-{text}", ADD
        return self._mul_positive(coeff, factors)

    def _mul_positive(self, coeff, factors):
        num, den = [], []
        for f in factors:
            if isinstance(f, sympy.Pow) and f.exp.is_Number and f.exp < 0:
                den.append(sympy.Pow(f.base, -f.exp))
            else:
                num.append(f)
        if coeff != 1:
            if isinstance(coeff, sympy.Rational) and coeff.q != 1:
                if coeff.p != 1:
                    num.insert(0, sympy.Integer(coeff.p))
                den.insert(0, sympy.Integer(coeff.q))
            else:
                num.insert(0, coeff)
        text = " * ".join(self._wrap(self._p(f), ATOM if f.is_Number else MUL) for f in num)
        if not text:
            text = self.number(1.0)
        if den:
            dens = [self._wrap(self._p(f), ATOM) for f in den]
            denom = dens[0] if len(dens) == 1 else "(" + " * ".join(dens) + ")"
            return f"{text} / {denom}", MUL
        return text, MUL if len(num) > 1 else self._p(num[0])[1] if num else ATOM

    def _pow(self, e):
        base, ex = e.base, e.exp
        if ex.is_Integer and 0 < int(ex) <= 4:
            b = self._wrap(self._p(base), ATOM)
            return " * ".join([b] * int(ex)), MUL
        if ex.is_Integer and -4 <= int(ex) < 0:
            return self._mul_positive(sympy.Integer(1), [e])
        if ex == sympy.Rational(1, 2):
            return self.call("sqrt", [self._p(base)[0]]), ATOM
        if ex == sympy.Rational(-1, 2):
            return self.call("rsqrt", [self._p(base)[0]]), ATOM
        if base == sympy.E:
            return self.call("exp", [self._p(ex)[0]]), ATOM
        return self.call("pow", [self._p(base)[0], self._p(ex)[0]]), ATOM


def float32_literal(value: float) -> str:
    """The shortest decimal text that reads back as the same float32."""
    target = struct.unpack("f", struct.pack("f", value))[0]
    for digits in range(1, 10):
        text = f"{target:.{digits}g}"
        if struct.unpack("f", struct.pack("f", float(text)))[0] == target:
            break
    if "e" not in text and "." not in text and "n" not in text:
        text += ".0"
    return text


class MLXPrinter(ExprPrinter):
    """MLX Python: ``mx.exp(a) * b``."""

    CALLS = {"exp": "mx.exp", "log": "mx.log", "log1p": "mx.log1p", "tanh": "mx.tanh",
             "sin": "mx.sin", "cos": "mx.cos", "tan": "mx.tan", "cosh": "mx.cosh",
             "sinh": "mx.sinh", "abs": "mx.abs", "sign": "mx.sign", "sigmoid": "mx.sigmoid",
             "sqrt": "mx.sqrt", "rsqrt": "mx.rsqrt", "pow": "mx.power"}

    def number(self, value):
        return repr(float(value))

    def infinity(self):
        return "mx.inf"

    def nan(self):
        return "mx.nan"

    def call(self, name, args):
        if name == "softplus":
            return f"mx.logaddexp({args[0]}, 0.0)"
        return f"{self.CALLS[name]}({', '.join(args)})"

    def select(self, cond, a, b):
        return f"mx.where({cond}, {a}, {b})"

    def boolean(self, value):
        return f"mx.array({value})"

    def logical(self, op, args):
        if op == "not":
            return f"mx.logical_not({args[0]})"
        return f"mx.logical_{op}({', '.join(args)})"


class CPrinter(ExprPrinter):
    """C-family code over ``float``, with function names from a dialect."""

    def __init__(self, names, dialect):
        super().__init__(names)
        self.dialect = dialect

    def number(self, value):
        return float32_literal(value) + "f"

    def infinity(self):
        return self.dialect.infinity

    def nan(self):
        return self.dialect.nan

    def call(self, name, args):
        return f"{self.dialect.math[name]}({', '.join(args)})"

    def select(self, cond, a, b):
        return f"({cond} ? {a} : {b})"

    def boolean(self, value):
        return "true" if value else "false"

    def logical(self, op, args):
        if op == "not":
            return f"(!{args[0]})"
        return "(" + f" {'&&' if op == 'and' else '||'} ".join(args) + ")"
