"""Prebuilt scans with the positional API and state layouts of the mlx-recurrence package.

Switching is a change of import::

    from mlx_recgen.scans import ssd_scan, gla_scan, rglru_scan, rotlru_scan

| function | inputs | output | state |
|---|---|---|---|
| ``ssd_scan(u, delta, B, C, A_neg)`` | ``[B,L,H,Dh]``, ``[B,L,H]``, ``[B,L,H,N]`` x2, ``[H,N]`` | ``[B,L,H,Dh]`` | ``[B,H,Dh,N]`` |
| ``gla_scan(q, k, v, gates)`` | ``[B,L,H,Dk]`` x2, ``[B,L,H,Dv]``, ``[B,L,H]`` | ``[B,L,H,Dv]`` | ``[B,H,Dk,Dv]`` |
| ``rglru_scan(a, x)`` | ``[B,L,D]`` x2 | ``[B,L,D]`` | ``[B,D]`` |
| ``rotlru_scan(a, cos, sin, x)`` | ``[B,L,D/2]`` x3, ``[B,L,D]`` interleaved pairs | ``[B,L,D]`` | ``[B,D]`` |

Each has ``*_with_state`` (returns ``(y, final_state)``) and ``*_reference`` (the plain MLX loop).
Keyword-only extras: ``initial_state=``, ``seg=`` (checkpoint interval, default 32) and
``backend=`` (``"auto"``, ``"mlx"``, ``"metal"``, ``"metal-sim"``, ``"cuda"``). Unlike
mlx-recurrence there is no constraint on ``L`` or on the lane size.
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
def ssd_scan(u, delta, B, C, A_neg, *, initial_state=None, seg=32, backend="auto"):
    """Mamba-2 head-wise SSD scan: ``h <- exp(delta*A)*h + delta*B*u``, ``y = C.h``.

    u: [B,L,H,Dh], delta: [B,L,H], B, C: [B,L,H,N], A_neg: [H,N]. Returns y: [B,L,H,Dh]."""
    return _run("ssd", (u, delta, B, C, A_neg), initial_state, False, False, seg=seg, backend=backend)


def ssd_scan_with_state(u, delta, B, C, A_neg, *, initial_state=None, seg=32, backend="auto"):
    """``ssd_scan`` that also returns the final state [B,H,Dh,N] (fp32)."""
    return _run("ssd", (u, delta, B, C, A_neg), initial_state, True, False, seg=seg, backend=backend)


def ssd_scan_reference(u, delta, B, C, A_neg, *, initial_state=None):
    """The plain MLX loop for ``ssd_scan`` (differentiable by MLX autodiff)."""
    return _run("ssd", (u, delta, B, C, A_neg), initial_state, False, True)


# -- GLA ----------------------------------------------------------------------------------------
def gla_scan(q, k, v, gates, *, initial_state=None, seg=32, backend="auto"):
    """Gated linear attention: ``S <- g*S + k v^T``, ``o = q^T S`` (post-update state).

    q, k: [B,L,H,Dk], v: [B,L,H,Dv], gates: [B,L,H]. Returns o: [B,L,H,Dv]."""
    return _run("gla", (q, k, v, gates), initial_state, False, False, seg=seg, backend=backend)


def gla_scan_with_state(q, k, v, gates, *, initial_state=None, seg=32, backend="auto"):
    """``gla_scan`` that also returns the final state [B,H,Dk,Dv] (fp32)."""
    return _run("gla", (q, k, v, gates), initial_state, True, False, seg=seg, backend=backend)


def gla_scan_reference(q, k, v, gates, *, initial_state=None):
    """The plain MLX loop for ``gla_scan``."""
    return _run("gla", (q, k, v, gates), initial_state, False, True)


# -- RG-LRU -------------------------------------------------------------------------------------
def rglru_scan(a, x, *, initial_state=None, seg=32, backend="auto"):
    """RG-LRU's diagonal scan ``h <- a*h + x``, ``y = h``. a, x: [B,L,D]; any real a."""
    return _run("rglru", (a, x), initial_state, False, False, seg=seg, backend=backend)


def rglru_scan_with_state(a, x, *, initial_state=None, seg=32, backend="auto"):
    """``rglru_scan`` that also returns the final state [B,D] (fp32)."""
    return _run("rglru", (a, x), initial_state, True, False, seg=seg, backend=backend)


def rglru_scan_reference(a, x, *, initial_state=None):
    """The plain MLX loop for ``rglru_scan``."""
    return _run("rglru", (a, x), initial_state, False, True)


# -- rotational LRU -----------------------------------------------------------------------------
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


def _rotlru(a, cos, sin, x, initial_state, with_state, reference, **options):
    xp, h0 = _pairs("rotlru_scan", a, x, initial_state)
    out = _run("rotlru", (a, cos, sin, xp), h0, with_state, reference, **options)
    b, L, D = x.shape
    if with_state:
        y, h = out
        return y.reshape(b, L, D), h.reshape(b, D)
    return out.reshape(b, L, D)


def rotlru_scan(a, cos, sin, x, *, initial_state=None, seg=32, backend="auto"):
    """Rotational LRU: each pair ``(u, w) <- a*R(theta)(u, w) + x``.

    a, cos, sin: [B,L,D/2]; x: [B,L,D] with pairs interleaved. Returns y: [B,L,D]."""
    return _rotlru(a, cos, sin, x, initial_state, False, False, seg=seg, backend=backend)


def rotlru_scan_with_state(a, cos, sin, x, *, initial_state=None, seg=32, backend="auto"):
    """``rotlru_scan`` that also returns the final state [B,D] (interleaved, fp32)."""
    return _rotlru(a, cos, sin, x, initial_state, True, False, seg=seg, backend=backend)


def rotlru_scan_reference(a, cos, sin, x, *, initial_state=None):
    """The plain MLX loop for ``rotlru_scan``."""
    return _rotlru(a, cos, sin, x, initial_state, False, True)
