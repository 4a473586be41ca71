"""mlx-lm's recurrent models on mlx-recgen recurrences.

mlx-lm computes the recurrences of its state-space and linear-attention layers in three helpers:

* ``mlx_lm.models.ssm.ssm_update``: Mamba-2's SSD (mamba2, falcon_h1, nemotron_h,
  granitemoehybrid, plamo2);
* ``mlx_lm.models.gated_delta.gated_delta_update``: the gated delta rule (qwen3_next, qwen3_5,
  kimi_linear, kimi_k3, olmo_hybrid, bailing_moe_v3);
* ``mlx_lm.models.recurrent_gemma.rnn_scan``: RG-LRU's linear scan (recurrent_gemma).

Wherever a gradient is taken (mlx-lm's Metal kernels have none) and off Apple silicon, mlx-lm runs
them as MLX ops: the SSD as a blockwise quadratic form, the other two as a Python loop over time.
``patch()`` routes all three through recurrences compiled by mlx-recgen (fused forward and
backward; ``backend=`` and ``schedule=`` as for any recurrence, except that under
``schedule="auto"`` the SSD runs the matrix form, as mlx-lm's own ``ssm_attn`` computes it,
on the backends where that was measured (``mlx`` and ``cuda``); the delta rule runs the
matrix form under ``schedule="chunked"``, and RG-LRU, which has no matrix form, what ``auto``
picks under ``schedule="matrix"``)::

    from mlx_recgen.integrations.mlx_lm import patch

    with patch():                    # or: handle = patch(); ...; handle.undo()
        loss, grads = loss_and_grad(model, inputs, targets)

``python -m mlx_recgen.integrations.mlx_lm lora ARGS`` runs ``mlx_lm lora ARGS`` (fine-tuning)
with the patch in place; any other mlx-lm command works the same way.

Where the helpers are rebound: in the modules that define them, so that a model module imported
while the patch is active binds the routed version, and in every loaded ``mlx_lm`` module that
holds the original under any name (model modules import them by name: ``from .ssm import
ssm_update``). ``undo()`` puts the originals back wherever a routed version is bound, in modules
imported meanwhile too. A reference kept elsewhere (an attribute of an object, a
``functools.partial``) is not seen. One patch at a time: ``patch()`` raises ``RuntimeError`` while
another is active.

What is reproduced: the originals of mlx-lm 0.32.2 and later, in the form mlx-lm would run on the
current device (its Metal kernels on a Metal GPU, else its MLX ops; they differ where noted): the
same arguments, outputs of the same dtypes and layouts, states in the dtype the original returns,
and the same values up to floating-point rounding (the recurrence accumulates in fp32). The decay
and step-size preprocessing (``A_log``, ``dt_bias``, ``time_step_limit`` with infinite bounds,
``lower_bound``, ``allow_neg_eigval``) is done with MLX ops before the recurrence, as mlx-lm does.

* ``ssm_update``: groups of heads (``n_groups``) through the spec's group axis; the D skip added
  after the scan, in the dtype mlx-lm adds it in; bool padding masks (masked steps hold the state)
  and ``lengths``. mlx-lm's MLX form runs blocks of 256 steps and its state hand-off between
  blocks and its outputs at padded steps depend on those blocks: the routed form evaluates the
  mask once per call to check that a recurrence reproduces the hand-off (true of the masks
  mlx-lm's caches build, left padding and ``lengths``), and recomputes the outputs at padded
  steps that follow unpadded ones blockwise, as mlx-lm does. Its single-step Metal kernel (one
  step with a state, on a Metal GPU) ignores the mask and ``lengths``, and so does the routed
  form there.
* ``gated_delta_update``: fewer key than value heads through the group axis; scalar and
  per-channel gates; bool masks (masked steps hold the state). At a masked step mlx-lm's MLX ops
  output the query read of the updated-then-discarded state and its Metal kernels output zero:
  the routed form does what the original would.
* ``rnn_scan``: with or without ``h0``, one step or many.

Falls back to the original (counted in ``Patch.fallbacks`` with the reason) for: float arrays of
another dtype than float32, float16 and bfloat16 (float64, which mlx-lm's MLX ops take on the CPU),
states included; arrays outside the layouts above, or empty; a non-bool mask; ``ssm_update`` with
``lengths`` but no mask, with a mask whose blocks mlx-lm hands on differently from a recurrence (a
padded tail without ``lengths``, as nemotron_h's right-padded prefill passes it; ``lengths`` beyond
a short last block; a mask that contradicts ``lengths``), or with a mask under ``mx.compile`` or
``mx.vmap`` (its values decide the form); ``gated_delta_update`` with value heads that are not a
multiple of the key heads; ``rnn_scan`` with a gate of another shape or dtype than ``x`` (the
original's assertions then raise as before). The original then answers: never a different result.

Under ``backend="metal-sim"`` a routed helper evaluates its inputs when it is called (the
simulator runs kernels on the CPU through numpy), where mlx-lm only builds a lazy graph: an
operation upstream that fails when evaluated fails there, and is reported as such
(``RuntimeError`` naming the helper and the upstream error). mlx-lm's fp16 mixture-of-experts
models on the CPU are the known case (``gather_mm`` evaluates only fp32 there): their shape and
dtype checks pass unpatched, never evaluating. ``backend="mlx"`` stays lazy.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import inspect
import sys
from collections import Counter
from typing import NamedTuple

import mlx.core as mx
import mlx.nn as nn

import mlx_recgen as rg
from mlx_recgen import Sum, exp, where
from mlx_recgen.function import (BACKENDS, FLOAT_DTYPES, PLAN_CACHE_SIZE, default_backend,
                                 device_key, require_backend)
from mlx_recgen.memo import LRU
from mlx_recgen.schedule import SCHEDULES

MIN_MLX_LM = (0, 32, 2)  # from this release on, ssm_attn masks the decay of padded steps
SSM_BLOCK = 256  # ssm_attn's block of steps: its state hand-off happens at these boundaries

__all__ = ["patch", "Patch", "main"]


# -- the recurrences ---------------------------------------------------------------------------


@functools.cache
def ssd(masked: bool) -> rg.Recurrence:
    """Mamba-2's SSD scan in mlx-lm's layout, without the D skip (added after rounding)::

        h[p, n] <- exp(dt A) h[p, n] + dt B[n] x[p]      (held where mask is false)
        y[p]     = sum_n C[n] h[p, n]

    x [b, L, H, P]; dt [b, L, H], after softplus and clipping; A [H]; B, C [b, L, G, N] for G
    groups of heads; mask [b, L] bool; state [b, H, P, N]."""
    inputs = {"x": "B L H P", "dt": "B L H", "A": "H", "B": "B L G N", "C": "B L G N"}
    declared = dict(lane="P", state={"h": "B H P N"}, outputs={"y": "B L H P"}, groups={"G": "H"})
    if masked:
        @rg.recurrence(inputs={**inputs, "mask": "B L"}, **declared)
        def mlx_lm_ssd_masked(h, x, dt, A, B, C, mask, n):
            h[n] = where(mask, exp(dt * A) * h[n] + dt * B[n] * x, h[n])
            return {"y": Sum(C[n] * h[n], n)}

        return mlx_lm_ssd_masked

    @rg.recurrence(inputs=inputs, **declared)
    def mlx_lm_ssd(h, x, dt, A, B, C, n):
        h[n] = exp(dt * A) * h[n] + dt * B[n] * x
        return {"y": Sum(C[n] * h[n], n)}

    return mlx_lm_ssd


def _delta_rule(S, q, k, v, decay, beta, i):
    """The gated delta step on one value channel: the updated state and the query's read."""
    decayed = decay * S[i]
    updated = decayed + beta * (v - Sum(k[i] * decayed, i)) * k[i]
    return updated, Sum(q[i] * updated, i)


@functools.cache
def gated_delta(vector_gate: bool, masked: bool) -> rg.Recurrence:
    """The gated delta rule in mlx-lm's layout (state [b, H, Dv, Dk]: value channels first)::

        S <- g S;   S <- S + beta k (v - S^T k)^T      (held where mask is false)
        y  = S^T q                                      (the updated S, even where it is held)

    q, k [b, L, Hk, Dk] for Hk groups of value heads; v [b, L, H, Dv]; g (the decay) [b, L, H],
    or [b, L, H, Dk] per key channel; beta [b, L, H]; mask [b, L] bool."""
    inputs = {"q": "B L Hk K", "k": "B L Hk K", "v": "B L H V",
              "g": "B L H K" if vector_gate else "B L H", "beta": "B L H"}
    declared = dict(lane="V", state={"S": "B H V K"}, outputs={"y": "B L H V"},
                    groups={"Hk": "H"})
    name = "mlx_lm_gated_delta" + ("_vector_gate" if vector_gate else "") + (
        "_masked" if masked else "")
    if masked:
        def body(S, q, k, v, g, beta, mask, i):
            updated, y = _delta_rule(S, q, k, v, g[i] if vector_gate else g, beta, i)
            S[i] = where(mask, updated, S[i])
            return {"y": y}

        return rg.recurrence(inputs={**inputs, "mask": "B L"}, name=name, **declared)(body)

    def body(S, q, k, v, g, beta, i):
        S[i], y = _delta_rule(S, q, k, v, g[i] if vector_gate else g, beta, i)
        return {"y": y}

    return rg.recurrence(inputs=inputs, name=name, **declared)(body)


def rglru() -> rg.Recurrence:
    """RG-LRU's scan ``h <- a h + x; y = h`` (the bundled ``rglru`` spec)."""
    return rg.load_spec("rglru")


# -- preprocessing, as mlx-lm does it (compiled alike, so that it rounds alike) ----------------


@mx.compile
def _ssm_step_size(dt, dt_bias, time_step_limit):
    return mx.clip(nn.softplus(dt.astype(mx.float32) + dt_bias), *time_step_limit)


@functools.partial(mx.compile, shapeless=True)
def _decay(A_log, a, dt_bias):
    return mx.exp(-mx.exp(A_log.astype(mx.float32)) * nn.softplus(a + dt_bias))


@functools.partial(mx.compile, shapeless=True)
def _bounded_decay(A_log, a, dt_bias, lower_bound):
    rate = mx.exp(A_log.astype(mx.float32)) * (a.astype(mx.float32) + dt_bias)
    return mx.exp(lower_bound * mx.sigmoid(rate))


def _run(rec, options, *args, **kwargs):
    """``rec(*args, **kwargs)`` with the patch's backend and schedule (``_schedule``), returning
    the final state too."""
    if options["backend"] == "metal-sim":
        _evaluate_for_simulator([*args, *kwargs.values()])
    return rec(*args, backend=options["backend"], schedule=_schedule(rec, options),
               return_state=True, **kwargs)


def _schedule(rec, options) -> str:
    """The schedule the patch asks ``rec`` for: a request for the chunked schedule runs a
    recurrence that neither its segment summaries nor the matrix form serve sequentially; one
    for the matrix schedule runs a recurrence without the matrix form (RG-LRU) as ``auto``
    would."""
    schedule = options["schedule"]
    if schedule == "chunked" and not rec.affine.block_diagonal and not rec.matrix.applies:
        return "sequential"
    if schedule == "matrix" and not rec.matrix.applies:
        return "auto"
    return schedule


_TRANSFORMED = "function transformations"  # in MLX's error for an eval under compile or vmap


class _InputsFailed(Exception):
    """Evaluating a routed helper's inputs for the simulator failed; the cause is chained."""


def _evaluate_for_simulator(arguments):
    """Evaluate the recurrence's array arguments, as the simulator is about to (it runs kernels
    on the CPU through numpy, so it reads its inputs' values when called, where mlx-lm only
    builds a lazy graph): an operation upstream that fails when evaluated is then reported as
    that, not as a failure of the routed helper. Under ``mx.compile`` or ``mx.vmap`` nothing can
    be evaluated; the simulator says so itself."""
    try:
        mx.eval([a for a in arguments if isinstance(a, mx.array)])
    except (RuntimeError, ValueError) as exc:
        if _TRANSFORMED not in str(exc):
            raise _InputsFailed() from exc


def _on_metal() -> bool:
    """Whether mlx-lm would run its own Metal kernels (where their conditions hold)."""
    return mx.default_device() == mx.gpu and mx.metal.is_available()


# -- the routed helpers ------------------------------------------------------------------------


class _Unsupported(Exception):
    """Arguments the routed form does not reproduce; the original runs instead."""


def _require(condition, reason: str):
    if not condition:
        raise _Unsupported(reason)


# MLX's floating dtypes a recurrence does not take (float64), found once: a routed call checks
# each argument against them (gated_delta_update once per layout of its arguments)
_OTHER_FLOATS = frozenset(d for d in vars(mx).values() if isinstance(d, mx.Dtype)
                          and mx.issubdtype(d, mx.floating) and d not in FLOAT_DTYPES)


def _require_recurrence_dtypes(arguments: dict):
    """A recurrence takes float32, float16 and bfloat16 arrays; mlx-lm's MLX ops take float64
    too (on the CPU): such calls are the original's. The first check of each routed form, on
    its arguments by name."""
    if not any(type(x) is mx.array and x.dtype in _OTHER_FLOATS for x in arguments.values()):
        return  # the common case, once per layer and token: no message to build
    other = {}
    for name, x in arguments.items():
        if isinstance(x, mx.array) and x.dtype in _OTHER_FLOATS:
            other.setdefault(str(x.dtype).replace("mlx.core.", ""), []).append(name)
    _require(not other, "; ".join(f"{dtype} {', '.join(names)}" for dtype, names in other.items())
             + " (a recurrence takes float32, float16 or bfloat16)")


def _is_array(x, kind=mx.floating, ndim=None) -> bool:
    return (isinstance(x, mx.array) and mx.issubdtype(x.dtype, kind) and x.size > 0
            and (ndim is None or x.ndim == ndim))


# The backends where the SSD's matrix form was measured against mlx-lm's own ``ssm_attn`` (the
# products on MLX's matmuls on the CPU, on the matrix kernels on CUDA; docs/mlx-lm.md)
SSD_MATRIX_BACKENDS = ("mlx", "cuda")


def _like_ssm_attn(options) -> dict:
    """The options of a routed SSD call: under the patch's ``auto``, on ``SSD_MATRIX_BACKENDS``,
    the matrix schedule, the chunkwise matmul form that mlx-lm's own ``ssm_attn`` computes (TF32
    for fp32 inputs on NVIDIA GPUs, as its matmuls; a one-step call runs what ``auto`` picks).
    A Mamba-2 training step takes 0.63-0.74x mlx-lm's own time this way on an H100 (the matrix
    kernels; 0.70x on MLX's matmuls) against 1.82x on the sequential and chunked kernels, and
    1.04x on the CPU against 2.35x (docs/mlx-lm.md). On Metal and the simulator ``auto`` stays
    ``auto``: the matrix kernels' speed is unmeasured on an Apple GPU."""
    if options["schedule"] != "auto":
        return options
    backend = default_backend() if options["backend"] == "auto" else options["backend"]
    if backend in SSD_MATRIX_BACKENDS:
        return {**options, "schedule": "matrix"}
    return options


def _ssm_update(options, /, hidden_states, A_log, B, C, D, dt, dt_bias, state=None,
                time_step_limit=(0.001, 100.0), mask=None, lengths=None):
    _require_recurrence_dtypes(dict(
        hidden_states=hidden_states, A_log=A_log, B=B, C=C, D=D, dt=dt, dt_bias=dt_bias,
        state=state, time_step_limit=time_step_limit, mask=mask, lengths=lengths))
    options = _like_ssm_attn(options)
    x = hidden_states
    _require(all(_is_array(t, ndim=4) for t in (x, B, C)), "x, B, C are not [b, L, ., .] floats")
    b, L, H, P = x.shape
    G, N = B.shape[2:]
    _require(B.shape == C.shape and B.shape[:2] == (b, L) and H % G == 0,
             "B, C are not [b, L, G, N] with G dividing the heads")
    _require(all(_is_array(t) for t in (A_log, D, dt, dt_bias)) and A_log.size == H
             and D.size == H, "A_log, D, dt, dt_bias are not float arrays with a value per head")
    _require(state is None or (_is_array(state) and state.shape == (b, H, P, N)),
             "state is not [b, H, P, N]")
    dt = _ssm_step_size(dt, dt_bias, (time_step_limit[0], time_step_limit[1]))
    _require(dt.shape == (b, L, H), "dt + dt_bias is not [b, L, H]")
    if L == 1 and state is not None and _on_metal():
        # mlx-lm's single-step kernel: no mask, no lengths; D added before rounding
        A = -mx.exp(A_log.reshape(H).astype(mx.float32))
        y, h = _run(ssd(False), options, x, dt, A, B, C, initial_state=state)
        y = y + x.astype(mx.float32) * D.reshape(1, 1, H, 1).astype(mx.float32)
        return y.astype(x.dtype), h.astype(state.dtype)

    A = -mx.exp(A_log.reshape(H)).astype(dt.dtype)  # exp in A_log's dtype, as ssm_attn
    if mask is None:
        _require(lengths is None, "lengths without a mask")
        y, h = _run(ssd(False), options, x, dt, A, B, C, initial_state=state)
    else:
        _require(_is_array(mask, mx.bool_) and mask.shape == (b, L), "mask is not [b, L] bool")
        _require(lengths is None
                 or (_is_array(lengths, mx.signedinteger) and lengths.shape == (b,)),
                 "lengths is not [b] integers")
        if _padded_after_unpadded(mask, lengths, state is not None):
            y, h = _ssd_blockwise(options, x, dt, A, B, C, state, mask)
        else:
            y, h = _run(ssd(True), options, x, dt, A, B, C, mask, initial_state=state)
    return y.astype(x.dtype) + x * D.reshape(1, 1, H, 1), h


_HANDED_ON_OTHERWISE = "a mask whose blocks ssm_attn hands on otherwise than a recurrence"


def _padded_after_unpadded(mask, lengths, has_state: bool) -> bool:
    """Whether some padded step follows an unpadded one in a block of ``SSM_BLOCK`` steps;
    ``_Unsupported`` unless the state a recurrence hands on (the state after the block's last
    step, held at padded steps) is the one ssm_attn hands on.

    ssm_attn hands on the state at one row r of each block: its last, or with ``lengths`` the one
    before position ``lengths``; nothing of the block's inputs if row r is padded; and the
    block's initial state where ``lengths`` < 0. The two agree when each block has no unpadded
    step or has row r unpadded and none after it, and, where the state is held, has none at all.
    Evaluates the mask (once per call), except for one step without ``lengths`` (a decode
    step), where the two always agree."""
    b, L = mask.shape
    if L == 1 and lengths is None:
        return False
    blocks = -(-L // SSM_BLOCK)
    steps = mx.pad(mask, [(0, 0), (0, blocks * SSM_BLOCK - L)]).reshape(b, blocks, SSM_BLOCK)
    pos = mx.arange(SSM_BLOCK)
    block = mx.arange(blocks)
    block_len = mx.minimum(L - SSM_BLOCK * block, SSM_BLOCK)
    if lengths is None:
        row, held = mx.broadcast_to(block_len - 1, (b, blocks)), mx.zeros((b, blocks), mx.bool_)
    else:
        remaining = lengths[:, None] - SSM_BLOCK * block
        row = mx.maximum(mx.minimum(remaining, SSM_BLOCK) - 1, 0)
        held = (remaining < 0) & ((block > 0) | has_state)
    unpadded = steps.any(axis=-1)
    at_row = mx.take_along_axis(steps, row[..., None], axis=-1)[..., 0]
    after_row = (steps & (pos > row[..., None])).any(axis=-1)
    agree = (mx.where(held, ~unpadded, ~unpadded | (at_row & ~after_row))
             & (row < block_len)).all()
    seen = mx.cumsum(steps.astype(mx.int32), axis=-1) > 0
    late_padding = (~steps & seen & (pos < block_len[:, None])).any()
    try:
        agree, late_padding = mx.stack([agree, late_padding]).tolist()
    except ValueError as exc:  # inside mx.compile or mx.vmap nothing may be evaluated
        raise _Unsupported("a mask under a function transformation") from exc
    _require(agree, _HANDED_ON_OTHERWISE)
    return late_padding


def _ssd_blockwise(options, x, dt, A, B, C, state, mask):
    """The masked scan one block of ``SSM_BLOCK`` steps at a time, with ssm_attn's outputs at
    padded steps: C times the block's initial state, decayed over the block so far."""
    b, L, H, P = x.shape
    G, N = B.shape[2:]
    h = mx.zeros((b, H, P, N), mx.float32) if state is None else state
    ys = []
    for start in range(0, L, SSM_BLOCK):
        block = slice(start, start + SSM_BLOCK)
        m = mask[:, block]
        y, h_next = _run(ssd(True), options, x[:, block], dt[:, block], A, B[:, block],
                         C[:, block], m, initial_state=h)
        decay = mx.exp(mx.cumsum(dt[:, block] * A * m[..., None], axis=1))
        carried = mx.einsum("bsgn,bgrpn->bsgrp", C[:, block], h.reshape(b, G, H // G, P, N))
        carried = decay[..., None] * carried.reshape(b, -1, H, P)
        ys.append(mx.where(m[..., None, None], y, carried))
        h = h_next
    return mx.concatenate(ys, axis=1), h


def _gated_delta_update(options, /, q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *,
                        use_kernel=True, lower_bound=None, allow_neg_eigval=False):
    # a call like one that passed the checks below (arguments of the same shapes and dtypes, the
    # same option values, patch options and device) runs what that call decided: a decode step
    # calls this once per layer and token, so the key is built inline
    if (type(q) is _ARRAY and type(k) is _ARRAY and type(v) is _ARRAY and type(a) is _ARRAY
            and type(b) is _ARRAY and type(A_log) is _ARRAY and type(dt_bias) is _ARRAY):
        key = (q.shape, q.dtype, k.shape, k.dtype, v.shape, v.dtype, a.shape, a.dtype, b.shape,
               b.dtype, A_log.shape, A_log.dtype, dt_bias.shape, dt_bias.dtype,
               (state.shape, state.dtype) if type(state) is _ARRAY else type(state),
               (mask.shape, mask.dtype) if type(mask) is _ARRAY else type(mask),
               use_kernel, lower_bound, allow_neg_eigval, options["backend"],
               options["schedule"], device_key())
        try:
            known = _GATED_DELTA_PLANS.get(key)
        except TypeError:  # an unhashable option: the checks below see to it
            key, known = None, None
    else:  # the checks below say which argument is not an array
        key, known = None, None
    if known is not None and known.step is not None:  # a decode step: the whole call compiled
        return known.step(q, k, v, a, b, A_log, dt_bias,
                          *([] if state is None else [state]), *([] if mask is None else [mask]))
    if known is None:
        _require_recurrence_dtypes(dict(
            q=q, k=k, v=v, a=a, b=b, A_log=A_log, dt_bias=dt_bias, state=state, mask=mask,
            use_kernel=use_kernel, lower_bound=lower_bound, allow_neg_eigval=allow_neg_eigval))
        _require(all(_is_array(t, ndim=4) for t in (q, k, v)) and q.shape == k.shape
                 and v.shape[:2] == k.shape[:2], "q, k, v are not [B, T, ., .] floats")
        _require(v.shape[2] % k.shape[2] == 0, "value heads are not a multiple of the key heads")
        _require(all(_is_array(t) for t in (a, b, A_log, dt_bias)),
                 "a, b, A_log, dt_bias are not float arrays")
    g, beta = _gate_and_beta(a, b, A_log, dt_bias, lower_bound, allow_neg_eigval)
    args = [q, k, v, g, beta] if mask is None else [q, k, v, g, beta, mask]
    if known is None:
        batch, T, Hk, Dk = k.shape
        Hv, Dv = v.shape[2:]
        _require(beta.shape == (batch, T, Hv), "b is not [B, T, Hv]")
        _require(g.shape in ((batch, T, Hv), (batch, T, Hv, Dk)),
                 "the gate is not [B, T, Hv(, Dk)]")
        _require(state is None or (_is_array(state) and state.shape == (batch, Hv, Dv, Dk)),
                 "state is not [B, Hv, Dv, Dk]")
        _require(mask is None or (_is_array(mask, mx.bool_) and mask.shape == (batch, T)),
                 "mask is not [B, T] bool")
        rec = gated_delta(vector_gate=g.ndim == 4, masked=mask is not None)
        states = [mx.zeros((batch, Hv, Dv, Dk), mx.float32) if state is None else state]
        call = rec.check(*args, initial_state=states[0])
        plan = rec.plan_for(call, backend=options["backend"], schedule=_schedule(rec, options))
        args, states = call.inputs, call.states
        may_kernel = bool(use_kernel) and Dk % 32 == 0
        step = None
        if plan.decode is not None and plan.decode.compiled and options["backend"] != "metal-sim":
            step = _gated_delta_step(plan, (batch, Hv, Dv, Dk), state is not None,
                                     mask is not None, allow_neg_eigval, lower_bound,
                                     may_kernel and _on_metal())
        known = _GatedDeltaPlan(plan, (batch, Hv, Dv, Dk), may_kernel, step)
        if key is not None:
            _GATED_DELTA_PLANS[key] = known
    else:
        states = [mx.zeros(known.state_shape, mx.float32) if state is None else state]
    if options["backend"] == "metal-sim":
        _evaluate_for_simulator([*args, *states])
    (y,), (S,) = known.plan.run(args, states)
    # mlx-lm's Metal kernel where it would run (use_kernel, Dk a multiple of 32, on Metal)
    return _as_mlx_lm_returns(y, S, q, state, mask, known.may_kernel and _on_metal())


def _gate_and_beta(a, b, A_log, dt_bias, lower_bound, allow_neg_eigval):
    """The recurrence's gate and ``beta`` from mlx-lm's ``a``, ``b``, ``A_log``, ``dt_bias``."""
    beta = mx.sigmoid(b)
    if allow_neg_eigval:
        beta = beta * 2.0
    if lower_bound is None:
        return _decay(A_log, a, dt_bias), beta
    return _bounded_decay(A_log, a, dt_bias, lower_bound), beta


def _as_mlx_lm_returns(y, S, q, state, mask, kernel):
    """``(y, S)`` as mlx-lm's ``gated_delta_update`` returns them: ``kernel``, where its Metal
    kernel would run, writes zeros at masked steps and keeps the state's dtype; its MLX ops
    promote the state with the fp32 decay."""
    if kernel and mask is not None:
        y = mx.where(mask[..., None, None], y, 0)
    return y.astype(q.dtype), S.astype(state.dtype if kernel and state is not None else mx.float32)


class _GatedDeltaPlan(NamedTuple):
    """What a call of ``gated_delta_update`` decided for the calls like it: the plan, the shape
    of the zero state, whether mlx-lm's Metal kernel could run (``use_kernel`` and ``Dk``; the
    device is read each call), and where the plan's decode path is compiled, the whole call as
    one compiled step (``_gated_delta_step``)."""

    plan: object
    state_shape: tuple
    may_kernel: bool
    step: object = None


def _gated_delta_step(plan, state_shape, has_state, masked, allow_neg_eigval, lower_bound,
                      kernel):
    """A decode step of ``gated_delta_update`` as one compiled function of its arrays
    (``q, k, v, a, b, A_log, dt_bias[, state][, mask]``): the gate and ``beta`` from mlx-lm's
    inputs, the plan's decode path, and the results in mlx-lm's dtypes, what the routed call
    does op by op, with one dispatch and the elementwise work fused (a tiny Qwen3-Next's step on
    a 2-core CPU: 61 against 66-70 µs, mlx-lm's own 88; docs/calls.md). ``kernel``: mlx-lm's
    Metal kernel would run (``_as_mlx_lm_returns``)."""
    def step(q, k, v, a, b, A_log, dt_bias, *rest):
        state = rest[0] if has_state else None
        mask = rest[-1] if masked else None
        g, beta = _gate_and_beta(a, b, A_log, dt_bias, lower_bound, allow_neg_eigval)
        (y,), (S,) = plan.run([q, k, v, g, beta, *([] if mask is None else [mask])],
                              [mx.zeros(state_shape, mx.float32) if state is None else state])
        return _as_mlx_lm_returns(y, S, q, state, mask, kernel)

    return mx.compile(step)


# what the calls whose arguments passed the checks decided, by the key of their arguments
_GATED_DELTA_PLANS = LRU(PLAN_CACHE_SIZE)
_ARRAY = mx.array  # a global's lookup, not mx's attribute's, in the key


def _rnn_scan(options, /, x, a, h0):
    _require_recurrence_dtypes(dict(x=x, a=a, h0=h0))
    # the original asserts a.shape == x.shape[-a.ndim:], but its loop indexes a[:, t]: only a
    # gate of x's shape means the same in both of its modes
    _require(_is_array(x, ndim=3) and isinstance(a, mx.array) and a.shape == x.shape
             and a.dtype == x.dtype, "a is not of x's shape and dtype")
    batch, L, D = x.shape
    _require(h0 is None or (_is_array(h0) and h0.shape == (batch, D)), "h0 is not [B, D]")
    y, h = _run(rglru(), options, a, x, initial_state=h0)
    if h0 is None:
        return y.astype(x.dtype), h.astype(x.dtype)
    carried = mx.result_type(a, h0, x)  # the dtype the original's loop carries the state in
    return y.astype(x.dtype if L > 1 else carried), h.astype(carried)


# (defining module, helper, the routed form): each routed form takes the patch's options, then
# the helper's parameters as mlx-lm 0.32.2 declares them (names, kinds and defaults: a call binds
# to it as to the original, which ``patch()`` checks)
HELPERS = (
    ("mlx_lm.models.ssm", "ssm_update", _ssm_update),
    ("mlx_lm.models.gated_delta", "gated_delta_update", _gated_delta_update),
    ("mlx_lm.models.recurrent_gemma", "rnn_scan", _rnn_scan),
)


# -- patching ----------------------------------------------------------------------------------


class Patch:
    """mlx-lm's recurrence helpers routed through mlx-recgen; made by ``patch()``.

    ``routed`` counts, per helper, the calls run as recurrences; ``fallbacks`` counts the calls
    handed to mlx-lm's original, by ``(helper, reason)``. ``undo()`` (also ``close()``, or the
    end of a ``with`` block) restores mlx-lm exactly; a second ``undo()`` does nothing."""

    def __init__(self, backend: str, schedule: str):
        self.options = {"backend": backend, "schedule": schedule}
        # the counts behind ``routed``: a plain dict, which a decode step's call adds to faster
        self._routed = {name: 0 for _, name, _ in HELPERS}
        self.fallbacks = Counter()
        self._routes = {}  # id(original) -> (original, routed)
        self.active = False

    @property
    def routed(self) -> Counter:
        """The calls run as recurrences so far, per helper (a snapshot)."""
        return Counter({name: n for name, n in self._routed.items() if n})

    def __repr__(self):
        state = "active" if self.active else "undone"
        return (f"<mlx-lm patch ({state}) backend={self.options['backend']!r} "
                f"schedule={self.options['schedule']!r}: routed {dict(self.routed)}, "
                f"fell back {sum(self.fallbacks.values())}>")

    def _route(self, name, original, implementation):
        signature = inspect.signature(original)
        # the forms of call (how many positional arguments, which keywords in which order) that
        # bind to the original, and so to the routed form, whose parameters are the same: a call
        # of a form seen is bound by Python itself (a decode step calls each helper once per
        # layer and token, and Signature.bind costs several times the rest of the routing)
        binding = LRU(PLAN_CACHE_SIZE)
        counts = self._routed

        @functools.wraps(original)
        def routed(*args, **kwargs):
            if not self.active:  # a reference kept past undo(): mlx-lm's own again
                return original(*args, **kwargs)
            form = (len(args), *kwargs)
            if form not in binding:
                try:
                    signature.bind(*args, **kwargs)
                except TypeError:
                    return original(*args, **kwargs)  # raises as the original does
                binding[form] = True
            try:
                result = implementation(self.options, *args, **kwargs)
            except _Unsupported as exc:
                self.fallbacks[(name, str(exc))] += 1
                return original(*args, **kwargs)
            except _InputsFailed as exc:
                raise RuntimeError(
                    f"mlx-lm's {name} under backend='metal-sim': evaluating its inputs failed: "
                    f"{exc.__cause__}. The simulator runs kernels on the CPU through numpy, so it "
                    "evaluates a routed helper's inputs when the helper is called, where mlx-lm "
                    "builds a lazy graph; the operation that computes them fails when evaluated "
                    "on this device and dtype (mlx-lm's own result would fail so when "
                    "evaluated). backend='mlx' stays lazy.") from exc.__cause__
            counts[name] += 1
            return result

        routed.__mlx_recgen_patch__ = self
        return routed

    def _install(self):
        for module_name, name, implementation in HELPERS:
            original = getattr(importlib.import_module(module_name), name)
            if hasattr(original, "__mlx_recgen_patch__"):
                raise RuntimeError(f"{module_name}.{name} is already routed by another patch; "
                                   "undo that one first")
            found = _parameters(inspect.signature(original))
            reproduced = _parameters(inspect.signature(implementation))[1:]  # after the options
            if found != reproduced:
                raise RuntimeError(f"{module_name}.{name} takes {_parameters_text(found)}; this "
                                   "integration reproduces the one that takes "
                                   f"{_parameters_text(reproduced)}")
            self._routes[id(original)] = (original, self._route(name, original, implementation))
        _rebind({key: routed for key, (_, routed) in self._routes.items()})
        self.active = True

    def undo(self):
        """Put mlx-lm's originals back wherever a routed helper of this patch is bound."""
        global _active
        if not self.active:
            return
        _rebind({id(routed): original for original, routed in self._routes.values()})
        self.active = False
        if _active is self:
            _active = None

    close = undo

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.undo()
        return False


def _parameters(signature: inspect.Signature) -> list:
    """What a call binds by: each parameter's name, kind and default (annotations aside)."""
    return [(p.name, p.kind, p.default) for p in signature.parameters.values()]


def _parameters_text(parameters: list) -> str:
    """The parameters as a signature writes them."""
    return str(inspect.Signature([inspect.Parameter(name, kind, default=default)
                                  for name, kind, default in parameters]))


def _rebind(replacements: dict):
    """In every loaded ``mlx_lm`` module, replace each attribute whose ``id`` is a key."""
    for module_name, module in list(sys.modules.items()):
        if module is None or not (module_name == "mlx_lm" or module_name.startswith("mlx_lm.")):
            continue
        for attribute, value in list(vars(module).items()):
            if id(value) in replacements:
                setattr(module, attribute, replacements[id(value)])


_active: Patch | None = None


def patch(backend: str = "auto", schedule: str = "auto") -> Patch:
    """Route mlx-lm's ``ssm_update``, ``gated_delta_update`` and ``rnn_scan`` through mlx-recgen
    recurrences run with this ``backend`` and ``schedule`` (see ``Recurrence.__call__``).

    Returns the ``Patch``: a context manager, or call its ``undo()``. Raises ``ValueError`` for an
    unknown backend or schedule, ``ImportError`` without mlx-lm (or one older than 0.32.2), and
    ``RuntimeError`` where the backend cannot run on this machine (``"metal"`` without Metal,
    ``"cuda"`` without CUDA, ``"metal-sim"`` without a C++ compiler), while another patch is
    active, or where mlx-lm's helpers take other parameters than the ones reproduced here."""
    global _active
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be one of {SCHEDULES}, got {schedule!r}")
    require_backend(backend)
    if _active is not None:
        raise RuntimeError(f"mlx-lm is already patched ({_active!r}); undo that patch first")
    import mlx_lm

    version = tuple(int(p) for p in mlx_lm.__version__.split(".")[:3] if p.isdigit())
    if version < MIN_MLX_LM:
        raise ImportError(f"mlx-lm {mlx_lm.__version__} is installed; the integration reproduces "
                          f"mlx-lm >= {'.'.join(map(str, MIN_MLX_LM))}")
    handle = Patch(backend, schedule)
    handle._install()
    _active = handle
    return handle


# -- command line ------------------------------------------------------------------------------


def main(argv=None) -> None:
    """``python -m mlx_recgen.integrations.mlx_lm [--backend B] [--schedule S] COMMAND ARGS``:
    mlx-lm's command (``lora``, ``generate``, ...) with its arguments, under ``patch()``."""
    parser = argparse.ArgumentParser(
        prog="python -m mlx_recgen.integrations.mlx_lm",
        description="Run an mlx-lm command (lora, generate, ...) with mlx-lm's recurrences "
                    "routed through mlx-recgen.")
    parser.add_argument("--backend", default="auto", choices=BACKENDS,
                        help="the recurrences' backend (default: auto)")
    parser.add_argument("--schedule", default="auto", choices=SCHEDULES,
                        help="the recurrences' schedule (default: auto)")
    parser.add_argument("command", help="an mlx-lm command, e.g. lora")
    parser.add_argument("arguments", nargs=argparse.REMAINDER, help="its arguments")
    args = parser.parse_args(argv)
    from mlx_lm import cli

    saved, sys.argv = sys.argv, ["mlx_lm", args.command, *args.arguments]
    try:
        with patch(args.backend, args.schedule):
            cli.main()
    finally:
        sys.argv = saved


if __name__ == "__main__":
    main()
