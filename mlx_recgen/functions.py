"""The elementwise vocabulary of the spec language.

Every function is a sympy object, so the compiler can differentiate it. Functions that sympy does
not have, or whose sympy derivative is not the one we want on GPUs, are defined here with their
derivative (``fdiff``); the renderers know how to print each of them.

``abs`` and ``pow`` deliberately share Python's builtin names: a spec reads like math.

Subgradients at kinks (documented in the README):
  * ``abs(x)``: d/dx at 0 is 0 (``sign(0) == 0``).
  * ``maximum(a, b)`` / ``minimum(a, b)``: at a tie the whole gradient goes to ``a``.
  * ``where(cond, a, b)``: the gradient flows into the branch that was taken; ``cond`` gets none.
"""

import sympy
from sympy.codegen.cfunctions import log1p as _log1p

__all__ = [
    "exp", "log", "log1p", "sigmoid", "softplus", "tanh", "sin", "cos", "sqrt", "rsqrt",
    "pow", "abs", "maximum", "minimum", "where",
]


class sigmoid(sympy.Function):
    """The logistic function 1 / (1 + exp(-x))."""

    nargs = 1

    def fdiff(self, argindex=1):
        s = sigmoid(self.args[0])
        return s * (1 - s)


class softplus(sympy.Function):
    """log(1 + exp(x)), rendered in the overflow-free form max(x, 0) + log1p(exp(-|x|))."""

    nargs = 1

    def fdiff(self, argindex=1):
        return sigmoid(self.args[0])


exp = sympy.exp
log = sympy.log
log1p = _log1p
tanh = sympy.tanh
sin = sympy.sin
cos = sympy.cos
sqrt = sympy.sqrt
abs = sympy.Abs


def rsqrt(x):
    """1 / sqrt(x)."""
    return sympy.Pow(x, sympy.Rational(-1, 2))


def pow(x, y):
    """x ** y."""
    return sympy.Pow(x, y)


def where(cond, a, b):
    """``a`` where ``cond`` holds, else ``b``. ``cond`` is a comparison such as ``x > 0`` (or a
    logical combination of comparisons), or a value, which holds where it is nonzero: a bool
    mask input holds where it is true."""
    try:
        cond = sympy.sympify(cond)
    except sympy.SympifyError:
        raise TypeError(f"where(): the condition must be a comparison or a value, got {cond!r}") from None
    if isinstance(cond, sympy.Expr):  # a value (an input symbol is one too): nonzero holds
        cond = sympy.Ne(cond, 0)
    elif not isinstance(cond, sympy.logic.boolalg.Boolean):
        raise TypeError(f"where(): the condition must be a comparison or a value, got {cond!r}")
    return sympy.Piecewise((sympy.sympify(a), cond), (sympy.sympify(b), True))


def maximum(a, b):
    """Elementwise maximum; at a tie the gradient goes to ``a``."""
    a, b = sympy.sympify(a), sympy.sympify(b)
    return sympy.Piecewise((a, a >= b), (b, True))


def minimum(a, b):
    """Elementwise minimum; at a tie the gradient goes to ``a``."""
    a, b = sympy.sympify(a), sympy.sympify(b)
    return sympy.Piecewise((a, a <= b), (b, True))
