"""Prebuilt scans with the call forms and state layouts of the mlx-recurrence package.

Switching is a change of import::

    from mlx_recgen.scans import ssd_scan, gla_scan, rglru_scan, rotlru_scan

| function | inputs | output | state |
|---|---|---|---|
| ``ssd_scan(u, delta, B, C, A_neg, seg=32)`` | ``[B,L,H,Dh]``, ``[B,L,H]``, ``[B,L,H,N]`` x2, ``[H,N]`` | ``[B,L,H,Dh]`` | ``[B,H,Dh,N]`` |
| ``gla_scan(q, k, v, gates, seg=32)`` | ``[B,L,H,Dk]`` x2, ``[B,L,H,Dv]``, ``[B,L,H]`` | ``[B,L,H,Dv]`` | ``[B,H,Dk,Dv]`` |
| ``rglru_scan(a, x, seg=32)`` | ``[B,L,D]`` x2 | ``[B,L,D]`` | ``[B,D]`` |
| ``rotlru_scan(a, cs, sn, x, seg=32)`` | ``[B,L,D/2]`` x3, ``[B,L,D]`` interleaved pairs | ``[B,L,D]`` | ``[B,D]`` |

As in mlx-recurrence, ``seg`` (the checkpoint interval) may be passed by position or by keyword,
and rotlru's rotation is ``cs``/``sn`` (``cos``/``sin`` are accepted as keyword aliases).
Each has ``*_with_state`` (returns ``(y, final_state)``) and ``*_reference`` (the plain MLX loop).
Keyword-only extras: ``initial_state=`` and ``backend=`` (``"auto"``, ``"mlx"``, ``"metal"``,
``"metal-sim"``, ``"cuda"``). Unlike mlx-recurrence there is no constraint on ``L`` or on the
lane size; the README lists the remaining differences.
"""

from __future__ import annotations

import mlx.core as mx

from .errors import dtype_name
from .function import BACKENDS, FLOAT_DTYPES, positive_int
from .specs import load_spec

__all__ = [
    "ssd_scan", "ssd_scan_with_state", "ssd_scan_reference",
    "gla_scan", "gla_scan_with_state", "gla_scan_reference",
    "rglru_scan", "rglru_scan_with_state", "rglru_scan_reference",
    "rotlru_scan", "rotlru_scan_with_state", "rotlru_scan_reference",
]

# Each scan's parameters and state with their axes, in the scan's own terms (an axis ``D/2`` has
# half the size of ``D``). Arguments are checked against these before the spec sees them, so an
# error names the scan, its parameter and the layout it documents.
SIGNATURES = {
    "ssd": ({"u": "B L H Dh", "delta": "B L H", "B": "B L H N", "C": "B L H N", "A_neg": "H N"},
            "B H Dh N"),
    "gla": ({"q": "B L H Dk", "k": "B L H Dk", "v": "B L H Dv", "gates": "B L H"}, "B H Dk Dv"),
    "rglru": ({"a": "B L D", "x": "B L D"}, "B D"),
    "rotlru": ({"a": "B L D/2", "cs": "B L D/2", "sn": "B L D/2", "x": "B L D"}, "B D"),
}


def check_arguments(fn: str, spec: str, args, initial_state=None):
    """Check a scan's arguments against ``SIGNATURES[spec]``: arrays of a float dtype, of the
    documented rank, non-empty, with consistent axis sizes. Errors name ``fn`` and the
    parameter with its documented axes."""
    params, state_axes = SIGNATURES[spec]
    named = list(zip(params, args))
    layouts = dict(params)
    if initial_state is not None:
        named.append(("initial_state", initial_state))
        layouts["initial_state"] = state_axes
    seen = {}  # axis -> (its size, the argument and axis token that fixed it)

    def label(name):
        return f"{'argument ' if name != 'initial_state' else ''}'{name}' " \
               f"[{', '.join(layouts[name].split())}]"

    for name, x in named:
        if not isinstance(x, mx.array):
            raise TypeError(f"{fn}(): {label(name)} must be an mx.array, got {type(x).__name__}")
        if x.dtype not in FLOAT_DTYPES:
            raise TypeError(f"{fn}(): {label(name)} has dtype {dtype_name(x.dtype)}; expected "
                            "float32, float16 or bfloat16")
        tokens = layouts[name].split()
        if x.ndim != len(tokens):
            raise ValueError(f"{fn}(): {label(name)} has shape {tuple(x.shape)} ({x.ndim} axes); "
                             f"expected {len(tokens)} axes")
        if x.size == 0:
            raise ValueError(f"{fn}(): {label(name)} is empty (shape {tuple(x.shape)})")
        for token, n in zip(tokens, x.shape):
            axis, factor = (token[:-2], 2) if token.endswith("/2") else (token, 1)
            if axis not in seen:
                seen[axis] = (n * factor, name, token, n)
                continue
            size, other, other_token, other_n = seen[axis]
            if n * factor != size:
                raise ValueError(f"{fn}(): {label(name)} has shape {tuple(x.shape)}, so {token} = "
                                 f"{n}, but {label(other)} has {other_token} = {other_n}")


def _call(fn, spec, args, initial_state, with_state, reference, seg, backend):
    """Run the bundled spec (or its reference loop) on arguments already in its layout."""
    rec = load_spec(spec)
    if reference:
        return rec.reference(*args, initial_state=initial_state, return_state=with_state)
    seg = positive_int(f"{fn}()", "seg", seg)
    if backend not in BACKENDS:
        raise ValueError(f"{fn}(): backend must be one of {BACKENDS}, got {backend!r}")
    return rec(*args, initial_state=initial_state, return_state=with_state, seg=seg,
               backend=backend)


def _run(fn, spec, args, initial_state, with_state, reference, seg=None, backend=None):
    check_arguments(fn, spec, args, initial_state)
    return _call(fn, spec, args, initial_state, with_state, reference, seg, backend)


# -- SSD ----------------------------------------------------------------------------------------
def ssd_scan(u, delta, B, C, A_neg, seg=32, *, initial_state=None, backend="auto"):
    """Mamba-2 head-wise SSD scan: ``h <- exp(delta*A)*h + delta*B*u``, ``y = C.h``.

    u: [B,L,H,Dh], delta: [B,L,H], B, C: [B,L,H,N], A_neg: [H,N]. Returns y: [B,L,H,Dh]."""
    return _run("ssd_scan", "ssd", (u, delta, B, C, A_neg), initial_state, False, False, seg,
                backend)


def ssd_scan_with_state(u, delta, B, C, A_neg, seg=32, *, initial_state=None, backend="auto"):
    """``ssd_scan`` that also returns the final state [B,H,Dh,N] (fp32)."""
    return _run("ssd_scan_with_state", "ssd", (u, delta, B, C, A_neg), initial_state, True, False,
                seg, backend)


def ssd_scan_reference(u, delta, B, C, A_neg, *, initial_state=None):
    """The plain MLX loop for ``ssd_scan`` (differentiable by MLX autodiff)."""
    return _run("ssd_scan_reference", "ssd", (u, delta, B, C, A_neg), initial_state, False, True)


# -- GLA ----------------------------------------------------------------------------------------
def gla_scan(q, k, v, gates, seg=32, *, initial_state=None, backend="auto"):
    """Gated linear attention: ``S <- g*S + k v^T``, ``o = q^T S`` (post-update state).

    q, k: [B,L,H,Dk], v: [B,L,H,Dv], gates: [B,L,H]. Returns o: [B,L,H,Dv]."""
    return _run("gla_scan", "gla", (q, k, v, gates), initial_state, False, False, seg, backend)


def gla_scan_with_state(q, k, v, gates, seg=32, *, initial_state=None, backend="auto"):
    """``gla_scan`` that also returns the final state [B,H,Dk,Dv] (fp32)."""
    return _run("gla_scan_with_state", "gla", (q, k, v, gates), initial_state, True, False, seg,
                backend)


def gla_scan_reference(q, k, v, gates, *, initial_state=None):
    """The plain MLX loop for ``gla_scan``."""
    return _run("gla_scan_reference", "gla", (q, k, v, gates), initial_state, False, True)


# -- RG-LRU -------------------------------------------------------------------------------------
def rglru_scan(a, x, seg=32, *, initial_state=None, backend="auto"):
    """RG-LRU's diagonal scan ``h <- a*h + x``, ``y = h``. a, x: [B,L,D]; any real a."""
    return _run("rglru_scan", "rglru", (a, x), initial_state, False, False, seg, backend)


def rglru_scan_with_state(a, x, seg=32, *, initial_state=None, backend="auto"):
    """``rglru_scan`` that also returns the final state [B,D] (fp32)."""
    return _run("rglru_scan_with_state", "rglru", (a, x), initial_state, True, False, seg, backend)


def rglru_scan_reference(a, x, *, initial_state=None):
    """The plain MLX loop for ``rglru_scan``."""
    return _run("rglru_scan_reference", "rglru", (a, x), initial_state, False, True)


# -- rotational LRU -----------------------------------------------------------------------------
def _rotlru(fn, a, cs, sn, x, cos, sin, initial_state, with_state, reference, seg=None,
            backend=None):
    """Resolve ``cs``/``sn`` and their aliases, check the arguments in the scan's layout
    (x [B, L, D] with (u, w) pairs interleaved), then run the spec on x as [B, L, D/2, 2]."""
    rotation = []
    for name, value, alias, alias_value in (("cs", cs, "cos", cos), ("sn", sn, "sin", sin)):
        if value is not None and alias_value is not None:
            raise TypeError(f"{fn}() got both '{name}' and its alias '{alias}'; pass one")
        if value is None and alias_value is None:
            raise TypeError(f"{fn}() missing required argument '{name}' (or '{alias}')")
        rotation.append(value if value is not None else alias_value)
    if x is None:
        raise TypeError(f"{fn}() missing required argument 'x'")
    cs, sn = rotation
    if isinstance(x, mx.array) and x.ndim == 3 and x.shape[-1] % 2:
        raise ValueError(f"{fn}(): argument 'x' [B, L, D] holds (u, w) pairs along D, which must "
                         f"be even; got shape {tuple(x.shape)}")
    check_arguments(fn, "rotlru", (a, cs, sn, x), initial_state)
    b, L, D = x.shape
    h0 = None if initial_state is None else initial_state.reshape(b, D // 2, 2)
    out = _call(fn, "rotlru", (a, cs, sn, x.reshape(b, L, D // 2, 2)), h0, with_state, reference,
                seg, backend)
    if with_state:
        y, h = out
        return y.reshape(b, L, D), h.reshape(b, D)
    return out.reshape(b, L, D)


def rotlru_scan(a, cs=None, sn=None, x=None, seg=32, *, initial_state=None, backend="auto",
                cos=None, sin=None):
    """Rotational LRU: each pair ``(u, w) <- a*R(theta)(u, w) + x``.

    a, cs (cos theta), sn (sin theta): [B,L,D/2]; x: [B,L,D] with pairs interleaved. Returns
    y: [B,L,D]. ``cos=``/``sin=`` are keyword aliases of ``cs``/``sn``."""
    return _rotlru("rotlru_scan", a, cs, sn, x, cos, sin, initial_state, False, False, seg,
                   backend)


def rotlru_scan_with_state(a, cs=None, sn=None, x=None, seg=32, *, initial_state=None,
                           backend="auto", cos=None, sin=None):
    """``rotlru_scan`` that also returns the final state [B,D] (interleaved, fp32)."""
    return _rotlru("rotlru_scan_with_state", a, cs, sn, x, cos, sin, initial_state, True, False,
                   seg, backend)


def rotlru_scan_reference(a, cs=None, sn=None, x=None, *, initial_state=None, cos=None,
                          sin=None):
    """The plain MLX loop for ``rotlru_scan``."""
    return _rotlru("rotlru_scan_reference", a, cs, sn, x, cos, sin, initial_state, False, True)
