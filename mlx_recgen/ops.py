"""Call forms of flash-linear-attention's recurrent kernels and mamba_ssm's selective scan, on
mlx-recgen's recurrences.

Code written against those packages ports by a change of import::

    from mlx_recgen.ops import fused_recurrent_gated_delta_rule, selective_scan_fn

flash-linear-attention (FLA) forms: time-major ``[B, T, H, K]`` inputs, gates in log space,
``scale`` (default ``K ** -0.5``) applied to the queries, states ``[N, H, K, V]`` in fp32, and
``(o, final_state)`` results with ``final_state`` ``None`` unless ``output_final_state``.
``cu_seqlens`` (cumulative lengths ``[N + 1]``, as in FlashAttention) packs ``N`` sequences of
any lengths along time with ``B = 1``; each starts from its own initial state. Sequences of
equal length run as a batch of ``N``; otherwise they run as a batch padded to the longest, with
padding steps that leave the state unchanged (a key of zero and a log-gate of zero), so the
cost is ``N`` times the longest sequence.

Results come in FLA's dtypes: ``o`` in ``v``'s dtype for the gated delta rule, RWKV-6 and
RWKV-7, in ``q``'s for the delta rule, simple GLA, GLA and retention, in ``x``'s for HGRN (what
each FLA function allocates it in, which matters when input dtypes mix); final states in fp32,
HGRN's in ``x``'s dtype. The recurrence itself accumulates in fp32.

FLA's retired keywords are taken as FLA takes them: ``head_first=False`` (the time-major layout,
the only one) is accepted and ``head_first=True`` refused with ``ValueError``;
``transpose_state_layout`` is the deprecated name of ``state_v_first`` (gated delta rule, simple
GLA, GLA, retention), accepted with a ``DeprecationWarning``. Any other unknown keyword raises
``TypeError`` (FLA ignores it).

What differs from FLA (0.6.0, read from its source), for every function:

* Everything is differentiable, the initial state and the final state included (FLA's
  ``fused_recurrent_gated_delta_rule`` has no backward).
* Keyword-only extras: ``backend=`` (``"auto"``, ``"mlx"``, ``"metal"``, ``"metal-sim"``,
  ``"cuda"``), ``seg=`` (the checkpoint interval, chosen when omitted) and ``schedule=`` (as for
  any recurrence: ``"matrix"`` runs GLA, retention and RWKV-6 as chunkwise matrix products).

mamba_ssm's ``selective_scan_fn`` keeps its channel-major layout (``u`` ``[B, D, L]``); see its
docstring for what differs.
"""

from __future__ import annotations

import math
import operator
import warnings

import mlx.core as mx

from . import recurrence
from .function import FLOAT_DTYPES
from .functions import exp
from .spec import Sum
from .specs import load_spec

__all__ = [
    "fused_recurrent_gated_delta_rule", "fused_recurrent_delta_rule",
    "fused_recurrent_simple_gla", "fused_recurrent_gla", "fused_recurrent_retention",
    "fused_recurrent_rwkv6", "fused_recurrent_rwkv7", "fused_recurrent_hgrn",
    "selective_scan_fn",
]


# ---------------------------------------------------------------------------------------------
# Recurrences that no bundled spec covers: per-key and per-value log gates, a per-channel beta,
# channel groups sharing B and C
# ---------------------------------------------------------------------------------------------


@recurrence(lane="V", state={"S": "B H K V"},
            inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "g": "B L H",
                    "gk": "B L H K", "gv": "B L H V", "beta": "B L H V"},
            outputs={"o": "B L H V"})
def gated_delta_rule_general(S, q, k, v, g, gk, gv, beta, i):
    """S <- exp(g + gk[i] + gv[j]) S;  S <- S + beta[j] k (v - k^T S);  o = S^T q."""
    S[i] = exp(g + gk[i] + gv) * S[i]
    r = Sum(k[i] * S[i], i)
    S[i] = S[i] + beta * (v - r) * k[i]
    return {"o": Sum(q[i] * S[i], i)}


@recurrence(lane="V", state={"S": "B H K V"},
            inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "g": "B L H"},
            outputs={"o": "B L H V"})
def gla_g(S, q, k, v, g, i):
    """GLA with a log gate per head and step: S <- exp(g) S + k v^T;  o = S^T q. The bundled
    ``gla`` with the gate exp(g), written so: the compiler then knows the decay is positive and
    its log is g (no log of the gate, no signs), and g's gradient comes without a division by
    the gate."""
    S[i] = exp(g) * S[i] + k[i] * v
    return {"o": Sum(q[i] * S[i], i)}


@recurrence(lane="V", state={"S": "B H K V"},
            inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "gk": "B L H K"},
            outputs={"o": "B L H V"})
def gla_gk(S, q, k, v, gk, i):
    """GLA with a log gate per key channel: S <- exp(gk[i]) S + k v^T;  o = S^T q."""
    S[i] = exp(gk[i]) * S[i] + k[i] * v
    return {"o": Sum(q[i] * S[i], i)}


@recurrence(lane="V", state={"S": "B H K V"},
            inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "gk": "B L H K",
                    "gv": "B L H V"},
            outputs={"o": "B L H V"})
def gla_gk_gv(S, q, k, v, gk, gv, i):
    """GLA with log gates per key and per value channel: S <- exp(gk[i] + gv[j]) S + k v^T."""
    S[i] = exp(gk[i] + gv) * S[i] + k[i] * v
    return {"o": Sum(q[i] * S[i], i)}


@recurrence(lane="D", state={"h": "B G D N"},
            inputs={"u": "B L G D", "delta": "B L G D", "A": "G D N", "B": "B L G N",
                    "C": "B L G N", "D": "G D"},
            outputs={"y": "B L G D"})
def selective_scan_grouped(h, u, delta, A, B, C, D, n):
    """Mamba's S6 over G groups of channels, each group with its own B and C."""
    h[n] = exp(delta * A[n]) * h[n] + delta * B[n] * u
    return {"y": Sum(C[n] * h[n], n) + D * u}


# ---------------------------------------------------------------------------------------------
# Arguments, sequences and the common driver
# ---------------------------------------------------------------------------------------------


def _check(fn, name, x, layout, sizes):
    """``x`` must be a float mx.array with the axes ``layout`` (names; sizes shared through
    ``sizes``)."""
    if not isinstance(x, mx.array):
        raise TypeError(f"{fn}(): '{name}' must be an mx.array, got {type(x).__name__}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{fn}(): '{name}' has dtype {str(x.dtype).replace('mlx.core.', '')}; "
                        "expected float32, float16 or bfloat16")
    axes = layout.split()
    if x.ndim != len(axes):
        raise ValueError(f"{fn}(): '{name}' has shape {tuple(x.shape)}; expected "
                         f"[{', '.join(axes)}]")
    for a, n in zip(axes, x.shape):
        if sizes.setdefault(a, (n, name))[0] != n:
            raise ValueError(f"{fn}(): axis {a} of '{name}' {tuple(x.shape)} has size {n}, but "
                             f"{sizes[a][0]} in '{sizes[a][1]}'")
    return x


def _offsets(fn, cu_seqlens, T) -> list:
    """``cu_seqlens`` as a list of Python ints: an integer array (MLX or numpy) or a sequence of
    integers. Floats are refused, not truncated: a truncated offset moves a sequence boundary
    without a word."""
    if isinstance(cu_seqlens, mx.array):
        if not mx.issubdtype(cu_seqlens.dtype, mx.integer):
            raise TypeError(f"{fn}(): cu_seqlens must be integers, got dtype "
                            f"{str(cu_seqlens.dtype).replace('mlx.core.', '')}")
        if cu_seqlens.ndim != 1:
            raise ValueError(f"{fn}(): cu_seqlens must be 1-d, got shape "
                             f"{tuple(cu_seqlens.shape)}")
        cu_seqlens = cu_seqlens.tolist()
    try:  # operator.index takes Python and numpy integers, and refuses floats
        cu = [operator.index(c) for c in cu_seqlens]
    except TypeError:
        raise TypeError(f"{fn}(): cu_seqlens must be a 1-d sequence of integers, got "
                        f"{cu_seqlens!r}") from None
    if len(cu) < 2 or cu[0] != 0 or cu[-1] != T or any(b < a for a, b in zip(cu, cu[1:])):
        raise ValueError(f"{fn}(): cu_seqlens must rise from 0 to the number of tokens {T}, got "
                         f"{cu}")
    return cu


class _Sequences:
    """The map between the caller's time-major layout ``[B, T, ...]`` and the recurrence's batch
    of sequences ``[N, T', ...]``, in processing order (reversed when ``reverse``)."""

    def __init__(self, fn, B, T, cu_seqlens, reverse):
        self.reverse = reverse
        self.padded = False
        if cu_seqlens is None:
            self.N, self.shape = B, None
            return
        if B != 1:
            raise ValueError(f"{fn}(): the batch size must be 1 with cu_seqlens (sequences are "
                             f"packed along time), got {B}")
        cu = _offsets(fn, cu_seqlens, T)
        lengths = [b - a for a, b in zip(cu, cu[1:])]
        self.N = len(lengths)
        if len(set(lengths)) == 1:  # one batch of equal lengths: a reshape
            self.shape = (self.N, lengths[0])
            return
        self.padded = True
        width = max(lengths)
        index, valid, inverse = [], [], []
        for n, (start, length) in enumerate(zip(cu, lengths)):
            order = list(range(length))[::-1] if reverse else list(range(length))
            index += [start + t for t in order] + [0] * (width - length)
            valid += [True] * length + [False] * (width - length)
            inverse += [n * width + (length - 1 - j if reverse else j) for j in range(length)]
        self.width = width
        self.index = mx.array(index, dtype=mx.int32)
        self.valid = mx.array(valid).reshape(self.N, width)
        self.inverse = mx.array(inverse, dtype=mx.int32)

    def pack(self, x):
        """``[B, T, ...]`` -> ``[N, T', ...]``; padding steps are zeros."""
        if self.padded:
            rest = x.shape[2:]
            y = mx.take(x[0], self.index, axis=0).reshape(self.N, self.width, *rest)
            mask = self.valid.reshape(self.N, self.width, *([1] * len(rest)))
            return mx.where(mask, y, mx.zeros((), y.dtype))
        if self.shape is not None:
            x = x.reshape(*self.shape, *x.shape[2:])
        return x[:, ::-1] if self.reverse else x

    def unpack(self, y):
        """``[N, T', ...]`` -> ``[B, T, ...]``."""
        if self.padded:
            flat = y.reshape(self.N * self.width, *y.shape[2:])
            return mx.take(flat, self.inverse, axis=0)[None]
        if self.reverse:
            y = y[:, ::-1]
        if self.shape is not None:
            y = y.reshape(1, self.shape[0] * self.shape[1], *y.shape[2:])
        return y


def _run(rec, fn, seq, params, initial_state, output_final_state, cu_seqlens, reverse, backend,
         seg, out_dtype, after_packing=None, state_v_first=False, state_dtype=mx.float32,
         schedule="auto"):
    """Run ``rec`` on the per-step inputs ``seq`` (``[B, T, ...]``, by the spec's names) and the
    time-invariant ``params`` over the sequences ``cu_seqlens`` describes; ``after_packing`` maps
    the packed per-step inputs (log gates to gates: padding must stay the identity step).
    Returns FLA's ``(o, final_state or None)``, in ``out_dtype`` and ``state_dtype``."""
    first = next(iter(seq.values()))
    sequences = _Sequences(fn, first.shape[0], first.shape[1], cu_seqlens, reverse)
    packed = {k: sequences.pack(x) for k, x in seq.items()}
    if after_packing is not None:
        packed = after_packing(packed)
    if initial_state is not None:
        if not isinstance(initial_state, mx.array):
            raise TypeError(f"{fn}(): initial_state must be an mx.array, got "
                            f"{type(initial_state).__name__}")
        if initial_state.ndim >= 1 and initial_state.shape[0] != sequences.N:
            raise ValueError(f"{fn}(): initial_state has {initial_state.shape[0]} states for "
                             f"{sequences.N} sequences (shape {tuple(initial_state.shape)})")
        if state_v_first:
            initial_state = initial_state.swapaxes(-1, -2)
    o, final = rec(**packed, **params, initial_state=initial_state, return_state=True,
                   backend=backend, seg=seg, schedule=schedule)
    if state_v_first:
        final = final.swapaxes(-1, -2)
    o = sequences.unpack(o).astype(out_dtype)
    return o, (final.astype(state_dtype) if output_final_state else None)


def _scale(fn, scale, K):
    if scale is None:
        return K ** -0.5
    if not isinstance(scale, (int, float)) or isinstance(scale, bool) or not scale > 0:
        raise ValueError(f"{fn}(): scale must be a positive number, got {scale!r}")
    return float(scale)


def _retired_keywords(fn, head_first, state_v_first=False, transpose_state_layout=None):
    """FLA's retired keywords: ``head_first=True`` is refused (inputs are time-major);
    ``transpose_state_layout`` is the deprecated name of ``state_v_first``. Returns
    ``state_v_first``."""
    if head_first:
        raise ValueError(f"{fn}(): head_first=True is not supported: inputs are time-major, "
                         "[B, T, H, ...] (FLA removed the head-first layout); pass "
                         "x.swapaxes(1, 2) for a head-first x")
    if transpose_state_layout is None:
        return state_v_first
    if state_v_first:
        raise ValueError(f"{fn}(): pass state_v_first or its deprecated name "
                         "transpose_state_layout, not both")
    warnings.warn(f"{fn}(): transpose_state_layout is deprecated; it is now named state_v_first",
                  DeprecationWarning, stacklevel=3)
    return bool(transpose_state_layout)


def _l2norm(x):
    """x / sqrt(sum(x^2) + 1e-6) over the last axis (FLA's ``l2norm``)."""
    x32 = x.astype(mx.float32)
    return (x32 * mx.rsqrt(mx.sum(x32 * x32, axis=-1, keepdims=True) + 1e-6)).astype(x.dtype)


def _softplus(x):
    return mx.logaddexp(x, mx.zeros((), x.dtype))


# ---------------------------------------------------------------------------------------------
# flash-linear-attention
# ---------------------------------------------------------------------------------------------


def fused_recurrent_gated_delta_rule(q, k, v, g=None, gk=None, gv=None, beta=None, scale=None,
                                     initial_state=None, output_final_state=False,
                                     use_qk_l2norm_in_kernel=False, use_gate_in_kernel=False,
                                     A_log=None, dt_bias=None, use_beta_sigmoid_in_kernel=False,
                                     allow_neg_eigval=False, state_v_first=False, cu_seqlens=None,
                                     *, backend="auto", seg=None, schedule="auto", head_first=False,
                                     transpose_state_layout=None):
    """Gated DeltaNet, ``fla.ops.gated_delta_rule.fused_recurrent_gated_delta_rule``.

    Per step and value head: ``S <- exp(g) exp(gk[i]) exp(gv[j]) S`` (each gate optional), then
    ``S <- S + beta k (v - k^T S)`` and ``o = S^T (scale q)``.

    Args (FLA's names, order and defaults): q, k ``[B, T, H, K]``; v ``[B, T, HV, V]`` (``HV`` a
    multiple of ``H``: grouped value heads, head ``h`` of q and k serving value heads
    ``h * HV/H ...``); g ``[B, T, HV]``, gk ``[B, T, HV, K]``, gv ``[B, T, HV, V]`` log decays;
    beta ``[B, T, HV]`` or ``[B, T, HV, V]`` (ones when None); scale (``K ** -0.5`` when None);
    initial_state ``[N, HV, K, V]`` (``[N, HV, V, K]`` with ``state_v_first``);
    use_qk_l2norm_in_kernel (``x / sqrt(sum x^2 + 1e-6)`` on q and k); use_gate_in_kernel with
    A_log, dt_bias ``[HV]`` (``g <- -exp(A_log) softplus(g + dt_bias)``);
    use_beta_sigmoid_in_kernel (``beta <- sigmoid(beta)``, doubled with allow_neg_eigval);
    cu_seqlens ``[N + 1]``.

    Returns ``(o [B, T, HV, V], final_state or None)``.

    Differences from FLA: a backward (FLA's raises ``NotImplementedError``); grouped value heads
    copy q and k per value head (their gradients are summed back); with ``gk``, ``gv`` or a
    per-channel ``beta`` the recurrence reads every gate (absent ones as zeros) and beta per
    channel, otherwise the bundled ``gated_deltanet`` spec runs.
    """
    fn = "fused_recurrent_gated_delta_rule"
    state_v_first = _retired_keywords(fn, head_first, state_v_first, transpose_state_layout)
    sizes = {}
    _check(fn, "q", q, "B T H K", sizes)
    _check(fn, "k", k, "B T H K", sizes)
    _check(fn, "v", v, "B T HV V", sizes)
    B, T, H, K = q.shape
    HV = v.shape[2]
    if HV % H:
        raise ValueError(f"{fn}(): v has {HV} heads, not a multiple of the {H} heads of q and k")
    if use_gate_in_kernel:
        if A_log is None or g is None:
            raise ValueError(f"{fn}(): use_gate_in_kernel=True needs g (the raw gate) and A_log")
        _check(fn, "A_log", A_log, "HV", sizes)
        gate = g + dt_bias if dt_bias is not None else g
        g = -mx.exp(A_log) * _softplus(gate)
    if allow_neg_eigval and not use_beta_sigmoid_in_kernel:
        raise ValueError(f"{fn}(): allow_neg_eigval=True needs use_beta_sigmoid_in_kernel=True")
    for name, x, layout in (("g", g, "B T HV"), ("gk", gk, "B T HV K"), ("gv", gv, "B T HV V")):
        if x is not None:
            _check(fn, name, x, layout, sizes)
    if beta is None:
        beta = mx.ones((B, T, HV), q.dtype)
    if use_beta_sigmoid_in_kernel:
        beta = mx.sigmoid(beta) * (2 if allow_neg_eigval else 1)
    _check(fn, "beta", beta, "B T HV" if beta.ndim == 3 else "B T HV V", sizes)
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q = q * _scale(fn, scale, K)
    if HV != H:
        q, k = mx.repeat(q, HV // H, axis=2), mx.repeat(k, HV // H, axis=2)
    if gk is None and gv is None and beta.ndim == 3:
        rec = load_spec("gated_deltanet")
        seq = dict(q=q, k=k, v=v, g=g if g is not None else mx.zeros((B, T, HV), q.dtype),
                   beta=beta)
    else:
        rec = gated_delta_rule_general
        V = v.shape[-1]
        seq = dict(q=q, k=k, v=v, g=g if g is not None else mx.zeros((B, T, HV), q.dtype),
                   gk=gk if gk is not None else mx.zeros((B, T, HV, K), q.dtype),
                   gv=gv if gv is not None else mx.zeros((B, T, HV, V), q.dtype),
                   beta=beta if beta.ndim == 4 else mx.broadcast_to(beta[..., None], v.shape))
    return _run(rec, fn, seq, {}, initial_state, output_final_state, cu_seqlens, False, backend,
                seg, v.dtype, state_v_first=state_v_first, schedule=schedule)


def fused_recurrent_delta_rule(q, k, v, beta=None, scale=None, initial_state=None,
                               output_final_state=False, use_qk_l2norm_in_kernel=False,
                               cu_seqlens=None, *, backend="auto", seg=None,
                               schedule="auto", head_first=False):
    """DeltaNet, ``fla.ops.delta_rule.fused_recurrent_delta_rule``.

    Per step and head: ``S <- S + beta k (v - k^T S)``, ``o = S^T (scale q)``. q, k
    ``[B, T, H, K]``, v ``[B, T, H, V]``, beta ``[B, T, H]`` or ``[B, T, H, V]`` (ones when
    None), scale (``K ** -0.5`` when None), initial_state ``[N, H, K, V]``,
    use_qk_l2norm_in_kernel, cu_seqlens ``[N + 1]``. Returns ``(o, final_state or None)``.

    Runs the bundled ``deltanet`` spec (a per-channel beta runs the general gated delta rule
    with zero gates); no other difference from FLA beyond the module's list.
    """
    fn = "fused_recurrent_delta_rule"
    _retired_keywords(fn, head_first)
    sizes = {}
    _check(fn, "q", q, "B T H K", sizes)
    _check(fn, "k", k, "B T H K", sizes)
    _check(fn, "v", v, "B T H V", sizes)
    B, T, H, K = q.shape
    if beta is None:
        beta = mx.ones((B, T, H), q.dtype)
    _check(fn, "beta", beta, "B T H" if beta.ndim == 3 else "B T H V", sizes)
    if beta.ndim == 4:
        o, final = fused_recurrent_gated_delta_rule(
            q, k, v, beta=beta, scale=scale, initial_state=initial_state,
            output_final_state=output_final_state,
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, cu_seqlens=cu_seqlens,
            backend=backend, seg=seg, schedule=schedule)
        return o.astype(q.dtype), final
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)
    q = q * _scale(fn, scale, K)
    return _run(load_spec("deltanet"), fn, dict(q=q, k=k, v=v, beta=beta), {}, initial_state,
                output_final_state, cu_seqlens, False, backend, seg, q.dtype, schedule=schedule)


def fused_recurrent_simple_gla(q, k, v, g=None, g_gamma=None, scale=None, initial_state=None,
                               output_final_state=False, reverse=False, state_v_first=False,
                               cu_seqlens=None, *, backend="auto", seg=None,
                               schedule="auto", head_first=False,
                               transpose_state_layout=None):
    """GLA with a scalar gate per head, ``fla.ops.simple_gla.fused_recurrent_simple_gla``.

    Per step and head: ``S <- exp(g + g_gamma) S + k v^T``, ``o = S^T (scale q)``. q, k
    ``[B, T, H, K]``, v ``[B, T, H, V]``, g ``[B, T, H]`` (log gate per step) and/or g_gamma
    ``[H]`` (a fixed log decay per head; neither: no decay), scale, initial_state
    ``[N, H, K, V]`` (``[N, H, V, K]`` with ``state_v_first``), reverse (run each sequence from
    its last step), cu_seqlens. Returns ``(o, final_state or None)``.

    Runs the bundled ``gla`` spec's recurrence with the gate in log space (``gla_g``); no other
    difference from FLA beyond the module's list.
    """
    fn = "fused_recurrent_simple_gla"
    state_v_first = _retired_keywords(fn, head_first, state_v_first, transpose_state_layout)
    sizes = {}
    _check(fn, "q", q, "B T H K", sizes)
    _check(fn, "k", k, "B T H K", sizes)
    _check(fn, "v", v, "B T H V", sizes)
    B, T, H, K = q.shape
    log_g = mx.zeros((B, T, H), q.dtype)
    if g is not None:
        log_g = log_g + _check(fn, "g", g, "B T H", sizes)
    if g_gamma is not None:
        log_g = log_g + _check(fn, "g_gamma", g_gamma, "H", sizes)
    seq = dict(q=q * _scale(fn, scale, K), k=k, v=v, g=log_g)
    return _run(gla_g, fn, seq, {}, initial_state, output_final_state, cu_seqlens, reverse,
                backend, seg, q.dtype, state_v_first=state_v_first, schedule=schedule)


def fused_recurrent_gla(q, k, v, gk=None, gv=None, scale=None, initial_state=None,
                        output_final_state=False, reverse=False, state_v_first=False,
                        cu_seqlens=None, *, backend="auto", seg=None,
                        schedule="auto", head_first=False,
                        transpose_state_layout=None):
    """GLA with a gate per key (and per value) channel, ``fla.ops.gla.fused_recurrent_gla``.

    Per step and head: ``S[i, j] <- exp(gk[i] + gv[j]) S[i, j] + k[i] v[j]``,
    ``o = S^T (scale q)``. q, k, gk ``[B, T, H, K]``, v, gv ``[B, T, H, V]`` (gates in log
    space, each optional), scale, initial_state ``[N, H, K, V]`` (``[N, H, V, K]`` with
    ``state_v_first``), reverse, cu_seqlens. Returns ``(o, final_state or None)``.

    No difference from FLA beyond the module's list.
    """
    fn = "fused_recurrent_gla"
    state_v_first = _retired_keywords(fn, head_first, state_v_first, transpose_state_layout)
    sizes = {}
    _check(fn, "q", q, "B T H K", sizes)
    _check(fn, "k", k, "B T H K", sizes)
    _check(fn, "v", v, "B T H V", sizes)
    B, T, H, K = q.shape
    q = q * _scale(fn, scale, K)
    if gk is not None:
        _check(fn, "gk", gk, "B T H K", sizes)
    if gv is not None:
        _check(fn, "gv", gv, "B T H V", sizes)
    if gv is None and gk is None:  # no decay: GLA with a log gate of 0
        return _run(gla_g, fn, dict(q=q, k=k, v=v, g=mx.zeros((B, T, H), q.dtype)),
                    {}, initial_state, output_final_state, cu_seqlens, reverse, backend, seg,
                    q.dtype, state_v_first=state_v_first, schedule=schedule)
    if gv is None:
        rec, seq = gla_gk, dict(q=q, k=k, v=v, gk=gk)
    else:
        rec = gla_gk_gv
        seq = dict(q=q, k=k, v=v, gk=gk if gk is not None else mx.zeros(q.shape, q.dtype), gv=gv)
    return _run(rec, fn, seq, {}, initial_state, output_final_state, cu_seqlens, reverse,
                backend, seg, q.dtype, state_v_first=state_v_first, schedule=schedule)


def fused_recurrent_retention(q, k, v, scale=None, initial_state=None, output_final_state=False,
                              reverse=False, state_v_first=False, cu_seqlens=None, *,
                              backend="auto", seg=None, schedule="auto", head_first=False,
                              transpose_state_layout=None):
    """RetNet's retention, ``fla.ops.retention.fused_recurrent_retention``: simple GLA with the
    fixed log decay ``g_gamma[h] = log(1 - 2^(-5 - h))`` of head ``h``. Arguments and results
    as ``fused_recurrent_simple_gla``; no difference from FLA beyond the module's list."""
    fn = "fused_recurrent_retention"
    state_v_first = _retired_keywords(fn, head_first, state_v_first, transpose_state_layout)
    _check(fn, "q", q, "B T H K", {})
    g_gamma = mx.array([math.log(1 - 2.0 ** (-5 - h)) for h in range(q.shape[2])], dtype=q.dtype)
    return fused_recurrent_simple_gla(
        q, k, v, g_gamma=g_gamma, scale=scale,
        initial_state=initial_state, output_final_state=output_final_state, reverse=reverse,
        state_v_first=state_v_first, cu_seqlens=cu_seqlens, backend=backend, seg=seg,
        schedule=schedule)


def fused_recurrent_rwkv6(r, k, v, w, u, scale=None, initial_state=None, output_final_state=False,
                          reverse=False, cu_seqlens=None, *, backend="auto", seg=None,
                          schedule="auto",
                          head_first=False):
    """RWKV-6, ``fla.ops.rwkv6.fused_recurrent_rwkv6``.

    Per step and head: ``o = (scale r)^T (S + diag(u) k v^T)`` (the state before the step), then
    ``S <- diag(exp(w)) S + k v^T``. r, k, w (log decay) ``[B, T, H, K]``, v ``[B, T, H, V]``,
    u (bonus) ``[H, K]``, scale (``K ** -0.5`` when None), initial_state ``[N, H, K, V]``,
    reverse, cu_seqlens. Returns ``(o, final_state or None)``.

    Runs the bundled ``rwkv6`` spec; no difference from FLA beyond the module's list.
    """
    fn = "fused_recurrent_rwkv6"
    _retired_keywords(fn, head_first)
    sizes = {}
    for name, x, layout in (("r", r, "B T H K"), ("k", k, "B T H K"), ("v", v, "B T H V"),
                            ("w", w, "B T H K"), ("u", u, "H K")):
        _check(fn, name, x, layout, sizes)
    seq = dict(r=r * _scale(fn, scale, k.shape[-1]), k=k, v=v, w=w)
    return _run(load_spec("rwkv6"), fn, seq, {"u": u}, initial_state, output_final_state,
                cu_seqlens, reverse, backend, seg, v.dtype, schedule=schedule)


def fused_recurrent_rwkv7(r, w, k, v, a, b, scale=None, initial_state=None,
                          output_final_state=True, cu_seqlens=None, *, backend="auto", seg=None,
                          schedule="auto",
                          head_first=False):
    """RWKV-7, ``fla.ops.rwkv7.fused_recurrent_rwkv7`` (FLA's diagonal-plus-low-rank form).

    Per step and head: ``S <- diag(exp(w)) S + b (a^T S) + k v^T``, ``o = S^T (scale r)``.
    r, w (log decay), k, a, b ``[B, T, H, K]``, v ``[B, T, H, V]``, scale (``K ** -0.5`` when
    None), initial_state ``[N, H, K, V]``, output_final_state (True by default, as in FLA),
    cu_seqlens. Returns ``(o, final_state or None)``.

    Runs the bundled ``rwkv7`` spec; no difference from FLA beyond the module's list.
    """
    fn = "fused_recurrent_rwkv7"
    _retired_keywords(fn, head_first)
    sizes = {}
    for name, x, layout in (("r", r, "B T H K"), ("w", w, "B T H K"), ("k", k, "B T H K"),
                            ("v", v, "B T H V"), ("a", a, "B T H K"), ("b", b, "B T H K")):
        _check(fn, name, x, layout, sizes)
    seq = dict(r=r * _scale(fn, scale, r.shape[-1]), w=w, k=k, v=v, a=a, b=b)
    return _run(load_spec("rwkv7"), fn, seq, {}, initial_state, output_final_state, cu_seqlens,
                False, backend, seg, v.dtype, schedule=schedule)


def fused_recurrent_hgrn(x, g, initial_state=None, output_final_state=False, cu_seqlens=None, *,
                         backend="auto", seg=None, schedule="auto", head_first=False):
    """HGRN, ``fla.ops.hgrn.fused_recurrent_hgrn``: ``h <- exp(g) h + x``, ``o = h``.

    x, g (log forget gate) ``[B, T, D]``, initial_state ``[N, D]``, cu_seqlens. Returns
    ``(o [B, T, D], final_state [N, D] or None)``, both in x's dtype (as FLA). Runs the bundled
    ``rglru`` spec with ``a = exp(g)``.
    """
    fn = "fused_recurrent_hgrn"
    _retired_keywords(fn, head_first)
    sizes = {}
    _check(fn, "x", x, "B T D", sizes)
    _check(fn, "g", g, "B T D", sizes)
    return _run(load_spec("rglru"), fn, dict(a=g, x=x), {}, initial_state, output_final_state,
                cu_seqlens, False, backend, seg, x.dtype,
                after_packing=lambda p: {**p, "a": mx.exp(p["a"])}, state_dtype=x.dtype,
                schedule=schedule)


# ---------------------------------------------------------------------------------------------
# mamba_ssm
# ---------------------------------------------------------------------------------------------


def selective_scan_fn(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                      return_last_state=False, cu_seqlens=None, *, backend="auto", seg=None,
                      schedule="auto"):
    """Mamba's selective scan, ``mamba_ssm.ops.selective_scan_interface.selective_scan_fn``.

    With ``delta <- softplus(delta + delta_bias)`` (each step optional), per batch, channel d and
    state n: ``x[d, n] <- exp(delta[d] A[d, n]) x[d, n] + delta[d] B[n] u[d]``,
    ``y[d] = sum_n C[n] x[d, n] + D[d] u[d]``, ``out = y * silu(z)`` when z is given.

    Args (mamba_ssm's names, order, defaults and layout): u, delta, z ``[B, D, L]``; A ``[D, N]``
    (real); B, C ``[B, N, L]``, or ``[B, G, N, L]`` for G groups of ``D/G`` consecutive channels
    each reading its group's B and C; D, delta_bias ``[D]``; cu_seqlens ``[S + 1]`` (``B = 1``):
    sequences packed along L, each starting from a zero state.

    Returns ``out [B, D, L]`` in u's dtype, or ``(out, last_state)`` with ``return_last_state``:
    the fp32 state ``[B, D, N]`` after the last step (of the last sequence with cu_seqlens).

    Differences from mamba_ssm: a complex A and input-independent B or C (``[D, N]``) are not
    supported (``ValueError``); the gradient flows through ``last_state`` too (mamba_ssm ignores
    its cotangent); keyword-only extras ``backend=`` and ``seg=``. One group runs the bundled
    ``mamba1`` spec, several a variant with a batch axis of groups.
    """
    fn = "selective_scan_fn"
    sizes = {}
    _check(fn, "u", u, "B D L", sizes)
    _check(fn, "delta", delta, "B D L", sizes)
    if isinstance(A, mx.array) and mx.issubdtype(A.dtype, mx.complexfloating):
        raise ValueError(f"{fn}(): a complex A is not supported; pass a real A [D, N]")
    _check(fn, "A", A, "D N", sizes)
    for name, x in (("B", B), ("C", C)):
        if isinstance(x, mx.array) and x.ndim == 2:
            raise ValueError(f"{fn}(): an input-independent '{name}' [D, N] is not supported; "
                             f"pass it per step as [B, N, L]")
        _check(fn, name, x, "B N L" if isinstance(x, mx.array) and x.ndim == 3 else
               f"B G{name} N L", sizes)
    Bsz, Dm, L = u.shape
    N = A.shape[1]
    groups = {x.shape[1] for x in (B, C) if x.ndim == 4} or {1}
    G = max(groups)
    if any(g not in (1, G) for g in groups) or Dm % G:
        raise ValueError(f"{fn}(): B and C have {sorted(groups)} groups; the groups must agree "
                         f"and divide the {Dm} channels")
    if D is not None:
        _check(fn, "D", D, "D", sizes)
    if z is not None:
        _check(fn, "z", z, "B D L", sizes)
    if delta_bias is not None:
        _check(fn, "delta_bias", delta_bias, "D", sizes)
        delta = delta + delta_bias[:, None]
    if delta_softplus:
        delta = _softplus(delta)
    skip = D if D is not None else mx.zeros((Dm,), mx.float32)
    time_major = lambda x: x.swapaxes(1, 2)  # noqa: E731  [B, X, L] -> [B, L, X]
    if G == 1:
        rec = load_spec("mamba1")
        Bt = time_major(B if B.ndim == 3 else B[:, 0])
        Ct = time_major(C if C.ndim == 3 else C[:, 0])
        seq = dict(u=time_major(u), delta=time_major(delta), B=Bt, C=Ct)
        params = dict(A=A, D=skip)
    else:
        rec = selective_scan_grouped
        per_group = lambda x: time_major(x).reshape(Bsz, L, G, Dm // G)  # noqa: E731
        grouped = lambda x: (mx.broadcast_to(x, (Bsz, G, N, L)) if x.ndim == 4  # noqa: E731
                             else mx.broadcast_to(x[:, None], (Bsz, G, N, L))).transpose(0, 3, 1, 2)
        seq = dict(u=per_group(u), delta=per_group(delta), B=grouped(B), C=grouped(C))
        params = dict(A=A.reshape(G, Dm // G, N), D=skip.reshape(G, Dm // G))
    first = next(iter(seq.values()))
    sequences = _Sequences(fn, first.shape[0], first.shape[1], cu_seqlens, False)
    packed = {k: sequences.pack(x) for k, x in seq.items()}
    y, last = rec(**packed, **params, return_state=True, backend=backend, seg=seg,
                  schedule=schedule)
    y = sequences.unpack(y).reshape(Bsz, L, Dm).swapaxes(1, 2)
    if z is not None:
        y = y * (z * mx.sigmoid(z))
    out = y.astype(u.dtype)
    if not return_last_state:
        return out
    last = last.reshape(last.shape[0], Dm, N)
    return out, (last[-1:] if cu_seqlens is not None else last)
