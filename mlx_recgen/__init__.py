"""mlx-recgen: a declarative recurrence compiler for MLX.

Write a recurrence as a short spec; get fused forward and backward scans with a symbolically
derived adjoint, as an MLX function that ``mx.grad`` differentiates::

    import mlx_recgen as rg

    @rg.recurrence(lane="D", state={"h": "B D"}, inputs={"a": "B L D", "x": "B L D"},
                   outputs={"y": "B L D"})
    def lru(h, a, x):
        h = a * h + x
        return {"y": h}
"""

from .errors import SpecError
from .functions import (abs, cos, exp, log, log1p, maximum, minimum, pow, rsqrt, sigmoid,
                        sin, softplus, sqrt, tanh, where)
from .function import Recurrence, default_backend
from .spec import Sum, build_spec
from .specs import list_specs, load_spec

__version__ = "0.1.0"


def recurrence(*, lane, time="L", state, inputs, outputs, name=None, groups=None):
    """Declare a recurrence; decorates its one-step body and returns a ``Recurrence``.

    Args:
      lane: the lane axis (one GPU thread per lane value).
      time: the sequential axis (default ``"L"``). Inputs without it are parameters.
      state: state name -> axes, e.g. ``{"h": "B H P N"}``. A state without the lane axis is
        shared by the lanes of an instance; its update may read only lane-invariant values.
      inputs: input name -> axes, e.g. ``{"u": "B L H P", "A": "H N"}``. Bool and integer
        arrays may be passed for any input; they get no gradient.
      outputs: output name -> axes; they carry time, lane and every batch-like axis.
      name: the recurrence's name (default: the function's).
      groups: group axis -> the batch-like axis it groups, e.g. ``{"Hk": "H"}``: an input
        carrying ``Hk`` in place of ``H`` serves every ``h`` with ``h // (H / Hk)`` equal to its
        index (grouped heads), and its gradient is summed over each group.

    The body takes the states and inputs by name (then the state index, if the state has a
    state axis), updates the state and returns ``{output: expression}``.
    Raises ``SpecError`` for a malformed spec.
    """

    def decorate(fn):
        return Recurrence(build_spec(fn, lane=lane, time=time, state=state, inputs=inputs,
                                     outputs=outputs, name=name, groups=groups))

    return decorate


__all__ = [
    "recurrence", "Recurrence", "SpecError", "Sum", "load_spec", "list_specs", "default_backend",
    "exp", "log", "log1p", "sigmoid", "softplus", "tanh", "sin", "cos", "sqrt", "rsqrt", "pow",
    "abs", "maximum", "minimum", "where",
]
