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

from .specs import load_spec

__all__ = [
    "ssd_scan", "ssd_scan_with_state", "ssd_scan_reference",
    "gla_scan", "gla_scan_with_state", "gla_scan_reference",
    "rglru_scan", "rglru_scan_with_state", "rglru_scan_reference",
    "rotlru_scan", "rotlru_scan_with_state", "rotlru_scan_reference",
]


def _run(spec, args, initial_state, with_state, reference, **options):
    rec = load_spec(spec)
    if reference:
        return rec.reference(*args, initial_state=initial_state, return_state=with_state)
    return rec(*args, initial_state=initial_state, return_state=with_state, **options)


# -- SSD ----------------------------------------------------------------------------------------
def ssd_scan(u, delta, B, C, A_neg, seg=32, *, initial_state=None, backend="auto"):
    """Mamba-2 head-wise SSD scan: ``h <- exp(delta*A)*h + delta*B*u``, ``y = C.h``.

    u: [B,L,H,Dh], delta: [B,L,H], B, C: [B,L,H,N], A_neg: [H,N]. Returns y: [B,L,H,Dh]."""
    return _run("ssd", (u, delta, B, C, A_neg), initial_state, False, False, seg=seg, backend=backend)


def ssd_scan_with_state(u, delta, B, C, A_neg, seg=32, *, initial_state=None, backend="auto"):
    """``ssd_scan`` that also returns the final state [B,H,Dh,N] (fp32)."""
    return _run("ssd", (u, delta, B, C, A_neg), initial_state, True, False, seg=seg, backend=backend)


def ssd_scan_reference(u, delta, B, C, A_neg, *, initial_state=None):
    """The plain MLX loop for ``ssd_scan`` (differentiable by MLX autodiff)."""
    return _run("ssd", (u, delta, B, C, A_neg), initial_state, False, True)


# -- GLA ----------------------------------------------------------------------------------------
def gla_scan(q, k, v, gates, seg=32, *, initial_state=None, backend="auto"):
    """Gated linear attention: ``S <- g*S + k v^T``, ``o = q^T S`` (post-update state).

    q, k: [B,L,H,Dk], v: [B,L,H,Dv], gates: [B,L,H]. Returns o: [B,L,H,Dv]."""
    return _run("gla", (q, k, v, gates), initial_state, False, False, seg=seg, backend=backend)


def gla_scan_with_state(q, k, v, gates, seg=32, *, initial_state=None, backend="auto"):
    """``gla_scan`` that also returns the final state [B,H,Dk,Dv] (fp32)."""
    return _run("gla", (q, k, v, gates), initial_state, True, False, seg=seg, backend=backend)


def gla_scan_reference(q, k, v, gates, *, initial_state=None):
    """The plain MLX loop for ``gla_scan``."""
    return _run("gla", (q, k, v, gates), initial_state, False, True)


# -- RG-LRU -------------------------------------------------------------------------------------
def rglru_scan(a, x, seg=32, *, initial_state=None, backend="auto"):
    """RG-LRU's diagonal scan ``h <- a*h + x``, ``y = h``. a, x: [B,L,D]; any real a."""
    return _run("rglru", (a, x), initial_state, False, False, seg=seg, backend=backend)


def rglru_scan_with_state(a, x, seg=32, *, initial_state=None, backend="auto"):
    """``rglru_scan`` that also returns the final state [B,D] (fp32)."""
    return _run("rglru", (a, x), initial_state, True, False, seg=seg, backend=backend)


def rglru_scan_reference(a, x, *, initial_state=None):
    """The plain MLX loop for ``rglru_scan``."""
    return _run("rglru", (a, x), initial_state, False, True)


# -- rotational LRU -----------------------------------------------------------------------------
def _rotation(fn, cs, sn, x, cos, sin):
    """(cs, sn), from the names of mlx-recurrence (``cs``, ``sn``) or their aliases."""
    out = []
    for name, value, alias, alias_value in (("cs", cs, "cos", cos), ("sn", sn, "sin", sin)):
        if value is not None and alias_value is not None:
            raise TypeError(f"{fn}() got both '{name}' and its alias '{alias}'; pass one")
        if value is None and alias_value is None:
            raise TypeError(f"{fn}() missing required argument '{name}' (or '{alias}')")
        out.append(value if value is not None else alias_value)
    if x is None:
        raise TypeError(f"{fn}() missing required argument 'x'")
    return out


def _pairs(name, a, x, initial_state):
    if not isinstance(x, mx.array) or x.ndim != 3:
        raise ValueError(f"rotlru_scan: x must have shape [B, L, D] (interleaved pairs), got "
                         f"{getattr(x, 'shape', type(x).__name__)}")
    if x.shape[-1] % 2:
        raise ValueError(f"rotlru_scan: x's last axis holds (u, w) pairs and must be even, got "
                         f"shape {tuple(x.shape)}")
    b, L, D = x.shape
    xp = x.reshape(b, L, D // 2, 2)
    if initial_state is not None:
        if not isinstance(initial_state, mx.array) or initial_state.shape != (b, D):
            raise ValueError(f"rotlru_scan: initial_state must have shape {(b, D)}, got "
                             f"{getattr(initial_state, 'shape', type(initial_state).__name__)}")
        initial_state = initial_state.reshape(b, D // 2, 2)
    return xp, initial_state


def _rotlru(a, cs, sn, x, initial_state, with_state, reference, **options):
    xp, h0 = _pairs("rotlru_scan", a, x, initial_state)
    out = _run("rotlru", (a, cs, sn, xp), h0, with_state, reference, **options)
    b, L, D = x.shape
    if with_state:
        y, h = out
        return y.reshape(b, L, D), h.reshape(b, D)
    return out.reshape(b, L, D)


def rotlru_scan(a, cs=None, sn=None, x=None, seg=32, *, initial_state=None, backend="auto",
                cos=None, sin=None):
    """Rotational LRU: each pair ``(u, w) <- a*R(theta)(u, w) + x``.

    a, cs (cos theta), sn (sin theta): [B,L,D/2]; x: [B,L,D] with pairs interleaved. Returns
    y: [B,L,D]. ``cos=``/``sin=`` are keyword aliases of ``cs``/``sn``."""
    cs, sn = _rotation("rotlru_scan", cs, sn, x, cos, sin)
    return _rotlru(a, cs, sn, x, initial_state, False, False, seg=seg, backend=backend)


def rotlru_scan_with_state(a, cs=None, sn=None, x=None, seg=32, *, initial_state=None,
                           backend="auto", cos=None, sin=None):
    """``rotlru_scan`` that also returns the final state [B,D] (interleaved, fp32)."""
    cs, sn = _rotation("rotlru_scan_with_state", cs, sn, x, cos, sin)
    return _rotlru(a, cs, sn, x, initial_state, True, False, seg=seg, backend=backend)


def rotlru_scan_reference(a, cs=None, sn=None, x=None, *, initial_state=None, cos=None,
                          sin=None):
    """The plain MLX loop for ``rotlru_scan``."""
    cs, sn = _rotation("rotlru_scan_reference", cs, sn, x, cos, sin)
    return _rotlru(a, cs, sn, x, initial_state, False, True)
