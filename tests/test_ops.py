"""``mlx_recgen.ops``: flash-linear-attention's and mamba_ssm's call forms against loops written
from their semantics (``references.fla_sequences`` with one step function per kernel, and
``references.selective_scan_ref``), on ``mlx`` and on the Metal simulator: outputs, final
states and the gradient of every input and initial state, for a batch, for sequences packed with
``cu_seqlens`` (unequal lengths: the padded batch; equal lengths: a reshape) and in reverse.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest

from conftest import rel_err
from mlx_recgen import ops
from references import (fla_delta_step, fla_gla_step, fla_hgrn_step, fla_rwkv6_step,
                        fla_rwkv7_step, fla_sequences, l2norm_ref, selective_scan_ref)

TOL = 1e-5
H, K, V = 2, 3, 5
CU = [0, 4, 11, 13]  # three sequences of lengths 4, 7 and 2
CU_EQUAL = [0, 5, 10, 15]
BACKENDS = ["mlx", pytest.param("metal-sim", marks=pytest.mark.sim)]


def _n(*shape, scale=1.0):
    return scale * mx.random.normal(shape)


def _compare(ours, ref, arrays, tol=TOL):
    """``ours(**arrays)`` and ``ref(**arrays)`` return lists of arrays; compare them and the
    gradients of a random weighting of them with respect to every array."""
    names = list(arrays)

    def as_loss(fn, weights):
        def loss(*xs):
            return sum(mx.sum(v * w) for v, w in zip(fn(**dict(zip(names, xs))), weights))
        return loss

    ref_values = ref(**arrays)
    weights = [mx.random.normal(v.shape, key=mx.random.key(i)) for i, v in enumerate(ref_values)]
    values = ours(**arrays)
    assert len(values) == len(ref_values)
    for i, (v, r) in enumerate(zip(values, ref_values)):
        assert v.shape == r.shape, f"result {i}: {v.shape} vs {r.shape}"
        assert rel_err(v, r) < tol, f"result {i}"
    argnums = tuple(range(len(names)))
    g = mx.grad(as_loss(ours, weights), argnums=argnums)(*arrays.values())
    g_ref = mx.grad(as_loss(ref, weights), argnums=argnums)(*arrays.values())
    for name, a, b in zip(names, g, g_ref):
        assert rel_err(a, b) < tol, f"gradient of {name}"


def _qkv(B, T, HV=H):
    return dict(q=_n(B, T, H, K, scale=0.5), k=_n(B, T, H, K, scale=0.5), v=_n(B, T, HV, V))


# ---------------------------------------------------------------------------------------------
# gated delta rule, delta rule
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule, HV", [("auto", H), ("matrix", H), ("matrix", 2 * H)])
@pytest.mark.parametrize("backend", BACKENDS)
def test_gated_delta_rule_packed_sequences(backend, schedule, HV):
    """Also in the matrix schedule (the UT transform per chunk), with grouped value heads and
    q, k normalised in the kernel."""
    T = CU[-1]
    l2 = schedule == "matrix"
    arrays = dict(**_qkv(1, T, HV), g=_n(1, T, HV, scale=0.3), beta=_n(1, T, HV, scale=0.5),
                  h0=_n(3, HV, K, V, scale=0.5))

    def ours(q, k, v, g, beta, h0):
        o, ht = ops.fused_recurrent_gated_delta_rule(q, k, v, g, beta=beta, initial_state=h0,
                                                     output_final_state=True, cu_seqlens=CU,
                                                     use_qk_l2norm_in_kernel=l2,
                                                     backend=backend, seg=4, schedule=schedule)
        return [o, ht]

    def ref(q, k, v, g, beta, h0):
        step = fla_delta_step(K ** -0.5)
        if l2:
            q, k = l2norm_ref(q), l2norm_ref(k)
        q, k = (mx.repeat(x, HV // H, axis=2) for x in (q, k))
        return list(fla_sequences(step, [q, k, v, g, None, None, beta], h0, CU))

    _compare(ours, ref, arrays)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gated_delta_rule_general_form(backend):
    """Grouped value heads (4 value heads on 2 query/key heads), per-key and per-value gates,
    a per-channel beta, qk l2-norm, the gate computed from A_log and dt_bias, beta through a
    sigmoid with negative eigenvalues allowed, and the state stored V-first."""
    B, T, HV = 2, 7, 4
    arrays = dict(**_qkv(B, T, HV), g=_n(B, T, HV), gk=_n(B, T, HV, K, scale=0.3),
                  gv=_n(B, T, HV, V, scale=0.3), beta=_n(B, T, HV, V), A_log=_n(HV, scale=0.5),
                  dt_bias=_n(HV, scale=0.5), h0=_n(B, HV, V, K, scale=0.5))

    def ours(q, k, v, g, gk, gv, beta, A_log, dt_bias, h0):
        o, ht = ops.fused_recurrent_gated_delta_rule(
            q, k, v, g, gk, gv, beta, scale=0.7, initial_state=h0, output_final_state=True,
            use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True, A_log=A_log,
            dt_bias=dt_bias, use_beta_sigmoid_in_kernel=True, allow_neg_eigval=True,
            state_v_first=True, backend=backend, seg=4)
        return [o, ht]

    def ref(q, k, v, g, gk, gv, beta, A_log, dt_bias, h0):
        g = -mx.exp(A_log) * mx.log(1 + mx.exp(g + dt_bias))
        beta = 2 * mx.sigmoid(beta)
        step = fla_delta_step(0.7, gated_heads=HV // H)
        o, ht = fla_sequences(step, [l2norm_ref(q), l2norm_ref(k), v, g, gk, gv, beta],
                              h0.swapaxes(-1, -2))
        return [o, ht.swapaxes(-1, -2)]

    _compare(ours, ref, arrays)


def test_gated_delta_rule_batch_defaults():
    """A batch without cu_seqlens; beta None is ones, scale None is K ** -0.5, no initial state
    is zeros, and output_final_state=False returns None."""
    B, T = 2, 9
    arrays = dict(**_qkv(B, T), g=_n(B, T, H, scale=0.3))

    def ours(q, k, v, g):
        o, ht = ops.fused_recurrent_gated_delta_rule(q, k, v, g, backend="mlx", seg=4)
        assert ht is None
        return [o]

    def ref(q, k, v, g):
        step = fla_delta_step(K ** -0.5)
        o, _ = fla_sequences(step, [q, k, v, g, None, None, mx.ones((B, T, H))],
                             mx.zeros((B, H, K, V)))
        return [o]

    _compare(ours, ref, arrays)


@pytest.mark.parametrize("schedule", ["auto", "matrix"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_delta_rule_packed_sequences(backend, schedule):
    T = CU[-1]
    arrays = dict(**_qkv(1, T), beta=_n(1, T, H, scale=0.5), h0=_n(3, H, K, V, scale=0.5))

    def ours(q, k, v, beta, h0):
        return list(ops.fused_recurrent_delta_rule(q, k, v, beta, 0.6, h0, True,
                                                   use_qk_l2norm_in_kernel=True, cu_seqlens=CU,
                                                   backend=backend, seg=4, schedule=schedule))

    def ref(q, k, v, beta, h0):
        step = fla_delta_step(0.6)
        return list(fla_sequences(step, [l2norm_ref(q), l2norm_ref(k), v, None, None, None, beta],
                                  h0, CU))

    _compare(ours, ref, arrays)


def test_delta_rule_per_channel_beta():
    B, T = 2, 6
    arrays = dict(**_qkv(B, T), beta=_n(B, T, H, V, scale=0.5), h0=_n(B, H, K, V, scale=0.5))

    def ours(q, k, v, beta, h0):
        return list(ops.fused_recurrent_delta_rule(q, k, v, beta, initial_state=h0,
                                                   output_final_state=True, backend="mlx"))

    def ref(q, k, v, beta, h0):
        return list(fla_sequences(fla_delta_step(K ** -0.5), [q, k, v, None, None, None, beta], h0))

    _compare(ours, ref, arrays)


# ---------------------------------------------------------------------------------------------
# GLA family: simple GLA, GLA, retention
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_simple_gla_packed_sequences_in_reverse(backend):
    T = CU[-1]
    arrays = dict(**_qkv(1, T), g=_n(1, T, H, scale=0.3), h0=_n(3, H, K, V, scale=0.5))

    def ours(q, k, v, g, h0):
        return list(ops.fused_recurrent_simple_gla(q, k, v, g, initial_state=h0,
                                                   output_final_state=True, reverse=True,
                                                   cu_seqlens=mx.array(CU), backend=backend,
                                                   seg=4))

    def ref(q, k, v, g, h0):
        return list(fla_sequences(fla_gla_step(K ** -0.5), [q, k, v, g, None, None], h0, CU,
                                  reverse=True))

    _compare(ours, ref, arrays)


@pytest.mark.parametrize("backend", ["mlx", "metal-sim"])
def test_simple_gla_takes_its_gate_in_log_space(backend, kernel_calls):
    """``fused_recurrent_simple_gla`` runs GLA with the gate in log space (``ops.gla_g``):
    the compiler knows the decay ``exp(g)`` is positive and its log is ``g``, so the matrix
    kernels run without signs (``signed`` false), and outputs, final state and every gradient
    match FLA's formula, with log gates from -6 to 0."""
    T = 40
    arrays = dict(**_qkv(2, T), g=-6 * mx.random.uniform(shape=(2, T, H)),
                  h0=_n(2, H, K, V, scale=0.5))

    def ours(q, k, v, g, h0):
        return list(ops.fused_recurrent_simple_gla(q, k, v, g, initial_state=h0,
                                                   output_final_state=True, backend=backend,
                                                   schedule="matrix", seg=16))

    def ref(q, k, v, g, h0):
        return list(fla_sequences(fla_gla_step(K ** -0.5), [q, k, v, g, None, None], h0))

    _compare(ours, ref, arrays)
    assert (backend == "mlx") != bool(kernel_calls)  # the kernels ran where there are any
    assert not any(s.signed for s in kernel_calls)


def test_simple_gla_g_gamma_equal_lengths_v_first():
    """g and g_gamma together, sequences of equal length (run as a reshaped batch), the state
    stored V-first."""
    T = CU_EQUAL[-1]
    arrays = dict(**_qkv(1, T), g=_n(1, T, H, scale=0.3), g_gamma=_n(H, scale=0.3),
                  h0=_n(3, H, V, K, scale=0.5))

    def ours(q, k, v, g, g_gamma, h0):
        return list(ops.fused_recurrent_simple_gla(q, k, v, g, g_gamma, 0.8, h0, True,
                                                   state_v_first=True, cu_seqlens=CU_EQUAL,
                                                   backend="mlx", seg=4))

    def ref(q, k, v, g, g_gamma, h0):
        o, ht = fla_sequences(fla_gla_step(0.8), [q, k, v, g + g_gamma, None, None],
                              h0.swapaxes(-1, -2), CU_EQUAL)
        return [o, ht.swapaxes(-1, -2)]

    _compare(ours, ref, arrays)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gla_packed_sequences_in_reverse(backend):
    T = CU[-1]
    arrays = dict(**_qkv(1, T), gk=_n(1, T, H, K, scale=0.3), h0=_n(3, H, K, V, scale=0.5))

    def ours(q, k, v, gk, h0):
        return list(ops.fused_recurrent_gla(q, k, v, gk, initial_state=h0, output_final_state=True,
                                            reverse=True, cu_seqlens=CU, backend=backend, seg=4))

    def ref(q, k, v, gk, h0):
        return list(fla_sequences(fla_gla_step(K ** -0.5), [q, k, v, None, gk, None], h0, CU,
                                  reverse=True))

    _compare(ours, ref, arrays)


@pytest.mark.parametrize("gates", ["gk and gv", "gv", "none"])
def test_gla_gate_combinations(gates):
    B, T = 2, 7
    arrays = dict(**_qkv(B, T), h0=_n(B, H, K, V, scale=0.5))
    if "gk" in gates:
        arrays["gk"] = _n(B, T, H, K, scale=0.3)
    if "gv" in gates:
        arrays["gv"] = _n(B, T, H, V, scale=0.3)

    def ours(q, k, v, h0, gk=None, gv=None):
        return list(ops.fused_recurrent_gla(q, k, v, gk, gv, initial_state=h0,
                                            output_final_state=True, backend="mlx"))

    def ref(q, k, v, h0, gk=None, gv=None):
        return list(fla_sequences(fla_gla_step(K ** -0.5), [q, k, v, None, gk, gv], h0))

    _compare(ours, ref, arrays)


def test_gla_batch_in_reverse():
    B, T = 2, 7
    arrays = dict(**_qkv(B, T), gk=_n(B, T, H, K, scale=0.3), h0=_n(B, H, K, V, scale=0.5))

    def ours(q, k, v, gk, h0):
        return list(ops.fused_recurrent_gla(q, k, v, gk, initial_state=h0, output_final_state=True,
                                            reverse=True, backend="mlx"))

    def ref(q, k, v, gk, h0):
        return list(fla_sequences(fla_gla_step(K ** -0.5), [q, k, v, None, gk, None], h0,
                                  reverse=True))

    _compare(ours, ref, arrays)


@pytest.mark.parametrize("backend", BACKENDS)
def test_retention_packed_sequences(backend):
    T = CU[-1]
    arrays = dict(**_qkv(1, T), h0=_n(3, H, K, V, scale=0.5))
    log_gamma = mx.array([math.log(1 - 2.0 ** (-5 - h)) for h in range(H)])

    def ours(q, k, v, h0):
        return list(ops.fused_recurrent_retention(q, k, v, initial_state=h0,
                                                  output_final_state=True, cu_seqlens=CU,
                                                  backend=backend, seg=4))

    def ref(q, k, v, h0):
        g = mx.broadcast_to(log_gamma, (1, T, H))
        return list(fla_sequences(fla_gla_step(K ** -0.5), [q, k, v, g, None, None], h0, CU))

    _compare(ours, ref, arrays)


# ---------------------------------------------------------------------------------------------
# RWKV-6, RWKV-7, HGRN
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
def test_rwkv6_packed_sequences_in_reverse(backend):
    T = CU[-1]
    arrays = dict(r=_n(1, T, H, K, scale=0.5), k=_n(1, T, H, K, scale=0.5), v=_n(1, T, H, V),
                  w=_n(1, T, H, K, scale=0.3), u=_n(H, K, scale=0.5), h0=_n(3, H, K, V, scale=0.5))

    def ours(r, k, v, w, u, h0):
        return list(ops.fused_recurrent_rwkv6(r, k, v, w, u, initial_state=h0,
                                              output_final_state=True, reverse=True,
                                              cu_seqlens=CU, backend=backend, seg=4))

    def ref(r, k, v, w, u, h0):
        return list(fla_sequences(fla_rwkv6_step(K ** -0.5, u), [r, k, v, w], h0, CU, reverse=True))

    _compare(ours, ref, arrays)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("schedule", ["auto", "matrix"])
def test_rwkv7_packed_sequences(backend, schedule):
    T = CU[-1]
    arrays = dict(r=_n(1, T, H, K, scale=0.5), w=_n(1, T, H, K, scale=0.3),
                  k=_n(1, T, H, K, scale=0.5), v=_n(1, T, H, V), a=_n(1, T, H, K, scale=0.4),
                  b=_n(1, T, H, K, scale=0.4), h0=_n(3, H, K, V, scale=0.5))

    def ours(r, w, k, v, a, b, h0):
        return list(ops.fused_recurrent_rwkv7(r, w, k, v, a, b, initial_state=h0, cu_seqlens=CU,
                                              backend=backend, seg=4, schedule=schedule))

    def ref(r, w, k, v, a, b, h0):
        return list(fla_sequences(fla_rwkv7_step(K ** -0.5), [r, w, k, v, a, b], h0, CU))

    _compare(ours, ref, arrays)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hgrn_packed_sequences(backend):
    T, D = CU[-1], 6
    arrays = dict(x=_n(1, T, D), g=_n(1, T, D, scale=0.3), h0=_n(3, D))

    def ours(x, g, h0):
        return list(ops.fused_recurrent_hgrn(x, g, h0, True, CU, backend=backend, seg=4))

    def ref(x, g, h0):
        return list(fla_sequences(fla_hgrn_step, [x, g], h0, CU))

    _compare(ours, ref, arrays)


# ---------------------------------------------------------------------------------------------
# mamba_ssm's selective scan
# ---------------------------------------------------------------------------------------------


def _selective_scan_arrays(b, Dm, L, N, G=None):
    BC = (b, N, L) if G is None else (b, G, N, L)
    return dict(u=_n(b, Dm, L), delta=_n(b, Dm, L, scale=0.5), A=_n(Dm, N, scale=0.5),
                B=_n(*BC, scale=0.5), C=_n(*BC, scale=0.5), D=_n(Dm), z=_n(b, Dm, L),
                delta_bias=_n(Dm, scale=0.3))


@pytest.mark.parametrize("groups", [None, 2])
@pytest.mark.parametrize("backend", BACKENDS)
def test_selective_scan(backend, groups):
    """Every option: D, z, delta_bias, softplus and the last state; B and C shared by all
    channels ([B, N, L]) or per group of channels ([B, G, N, L])."""
    arrays = _selective_scan_arrays(2, 6, 11, K, groups)

    def ours(**a):
        return list(ops.selective_scan_fn(**a, delta_softplus=True, return_last_state=True,
                                          backend=backend, seg=4))

    def ref(**a):
        return list(selective_scan_ref(**a, delta_softplus=True))

    _compare(ours, ref, arrays)


def test_selective_scan_packed_sequences_and_defaults():
    """cu_seqlens restarts the state at each sequence (the last state is the last sequence's);
    without D, z and delta_bias the scan is the bare recurrence."""
    arrays = _selective_scan_arrays(1, 6, CU[-1], K)
    for name in ("D", "z", "delta_bias"):
        del arrays[name]

    def ours(**a):
        return list(ops.selective_scan_fn(**a, return_last_state=True, cu_seqlens=CU,
                                          backend="mlx"))

    def ref(**a):
        return list(selective_scan_ref(**a, cu_seqlens=CU))

    _compare(ours, ref, arrays)
    out = ops.selective_scan_fn(*arrays.values(), backend="mlx")
    assert isinstance(out, mx.array) and out.shape == arrays["u"].shape


# ---------------------------------------------------------------------------------------------
# Argument errors
# ---------------------------------------------------------------------------------------------


def test_argument_errors():
    q, k, v = _qkv(2, 6).values()
    g = _n(2, 6, H)
    with pytest.raises(ValueError, match=r"fused_recurrent_gated_delta_rule\(\): the batch size "
                                         r"must be 1 with cu_seqlens"):
        ops.fused_recurrent_gated_delta_rule(q, k, v, g, cu_seqlens=[0, 6])
    q1, k1, v1, g1 = q[:1], k[:1], v[:1], g[:1]
    with pytest.raises(ValueError, match=r"initial_state has 2 states for 3 sequences"):
        ops.fused_recurrent_gated_delta_rule(q1, k1, v1, g1, initial_state=_n(2, H, K, V),
                                             cu_seqlens=[0, 2, 4, 6], backend="mlx")
    with pytest.raises(ValueError, match=r"cu_seqlens must rise from 0 to the number of tokens 6"):
        ops.fused_recurrent_simple_gla(q1, k1, v1, g1, cu_seqlens=[0, 4, 3, 6])
    with pytest.raises(ValueError, match=r"v has 3 heads, not a multiple of the 2 heads"):
        ops.fused_recurrent_gated_delta_rule(q, k, _n(2, 6, 3, V), g)
    with pytest.raises(ValueError, match=r"axis T of 'g' \(2, 5, 2\) has size 5, but 6 in 'q'"):
        ops.fused_recurrent_simple_gla(q, k, v, g[:, :5])
    with pytest.raises(ValueError, match=r"scale must be a positive number"):
        ops.fused_recurrent_delta_rule(q, k, v, scale=-1.0)
    with pytest.raises(TypeError, match=r"unexpected keyword argument 'layout'"):
        ops.fused_recurrent_rwkv6(q, k, v, _n(2, 6, H, K), _n(H, K), layout="BTHK")
    A = _n(6, K)
    with pytest.raises(ValueError, match=r"selective_scan_fn\(\): an input-independent 'B' "
                                         r"\[D, N\] is not supported"):
        ops.selective_scan_fn(_n(1, 6, 4), _n(1, 6, 4), A, A, _n(1, K, 4))
    with pytest.raises(ValueError, match=r"a complex A is not supported"):
        ops.selective_scan_fn(_n(1, 6, 4), _n(1, 6, 4), A.astype(mx.complex64), _n(1, K, 4),
                              _n(1, K, 4))
    with pytest.raises(ValueError, match=r"groups must agree and divide the 6 channels"):
        ops.selective_scan_fn(_n(1, 6, 4), _n(1, 6, 4), A, _n(1, 4, K, 4), _n(1, K, 4))


@pytest.mark.parametrize("cu_seqlens", [[0, 3.7, 6], np.array([0, 3.0, 6.0]), [0, 3, 6.5],
                                        mx.array([0.0, 3.0, 6.0]), [0, np.float32(3), 6]],
                         ids=["float in a list", "float numpy array", "float last offset",
                              "float mx.array", "numpy float scalar"])
def test_float_cu_seqlens_are_refused(cu_seqlens):
    """Float offsets are refused, not truncated (3.7 would silently become 3); integer numpy
    arrays and numpy integers are offsets like any other."""
    q, k, v = _qkv(1, 6).values()
    g = _n(1, 6, H, scale=0.3)
    for fn, args in ((ops.fused_recurrent_simple_gla, (q, k, v, g)),
                     (ops.selective_scan_fn, (_n(1, 6, 4), _n(1, 6, 4), _n(6, K), _n(1, K, 4),
                                              _n(1, K, 4)))):
        with pytest.raises(TypeError, match=r"cu_seqlens must be"):
            fn(*args, cu_seqlens=cu_seqlens, backend="mlx")
    with pytest.raises(ValueError, match=r"cu_seqlens must be 1-d"):
        ops.fused_recurrent_simple_gla(q, k, v, g, cu_seqlens=mx.array([[0, 3, 6]]))
    want, _ = ops.fused_recurrent_simple_gla(q, k, v, g, cu_seqlens=[0, 3, 6], backend="mlx")
    for integers in (np.array([0, 3, 6]), [0, np.int64(3), 6], mx.array([0, 3, 6])):
        got, _ = ops.fused_recurrent_simple_gla(q, k, v, g, cu_seqlens=integers, backend="mlx")
        assert mx.array_equal(got, want)


# ---------------------------------------------------------------------------------------------
# FLA's call conventions: retired keywords, result dtypes
# ---------------------------------------------------------------------------------------------


def _fla_calls(B=1, T=6, dtypes=None):
    """Every FLA function with small inputs: name -> (function, positional arguments). ``dtypes``
    casts inputs by name (the rest stay fp32)."""
    dtypes = dtypes or {}
    a = {"q": _n(B, T, H, K, scale=0.5), "k": _n(B, T, H, K, scale=0.5), "v": _n(B, T, H, V),
         "g": _n(B, T, H, scale=0.3), "gk": _n(B, T, H, K, scale=0.3),
         "w": _n(B, T, H, K, scale=0.3), "u": _n(H, K, scale=0.5), "a": _n(B, T, H, K, scale=0.4), "b": _n(B, T, H, K, scale=0.4),
         "x": _n(B, T, V), "gx": _n(B, T, V, scale=0.3)}
    a = {n: x.astype(dtypes.get(n, mx.float32)) for n, x in a.items()}
    q, k, v, g, gk, w, u, ra, rb, x, gx = a.values()
    return {"fused_recurrent_gated_delta_rule": (ops.fused_recurrent_gated_delta_rule,
                                                 (q, k, v, g)),
            "fused_recurrent_delta_rule": (ops.fused_recurrent_delta_rule, (q, k, v)),
            "fused_recurrent_simple_gla": (ops.fused_recurrent_simple_gla, (q, k, v, g)),
            "fused_recurrent_gla": (ops.fused_recurrent_gla, (q, k, v, gk)),
            "fused_recurrent_retention": (ops.fused_recurrent_retention, (q, k, v)),
            "fused_recurrent_rwkv6": (ops.fused_recurrent_rwkv6, (q, k, v, w, u)),
            "fused_recurrent_rwkv7": (ops.fused_recurrent_rwkv7, (q, w, k, v, ra, rb)),
            "fused_recurrent_hgrn": (ops.fused_recurrent_hgrn, (x, gx))}


V_FIRST = ["fused_recurrent_gated_delta_rule", "fused_recurrent_simple_gla", "fused_recurrent_gla",
           "fused_recurrent_retention"]


@pytest.mark.parametrize("name", V_FIRST)
def test_transpose_state_layout_is_a_deprecated_state_v_first(name):
    """FLA renamed ``transpose_state_layout`` to ``state_v_first`` and still takes the old name,
    with a DeprecationWarning; both at once is an error."""
    fn, args = _fla_calls()[name]
    h0 = _n(1, H, V, K, scale=0.5)
    common = dict(initial_state=h0, output_final_state=True, backend="mlx")
    want = fn(*args, state_v_first=True, **common)
    with pytest.warns(DeprecationWarning, match=rf"{name}\(\): transpose_state_layout is "
                                                r"deprecated; it is now named state_v_first"):
        got = fn(*args, transpose_state_layout=True, **common)
    assert got[1].shape == (1, H, V, K)
    for g, w in zip(got, want):
        assert mx.array_equal(g, w)
    with pytest.warns(DeprecationWarning):
        plain = fn(*args, transpose_state_layout=False, output_final_state=True, backend="mlx")
    assert plain[1].shape == (1, H, K, V)
    with pytest.raises(ValueError, match=r"state_v_first or its deprecated name "
                                         r"transpose_state_layout, not both"):
        fn(*args, state_v_first=True, transpose_state_layout=True, **common)


@pytest.mark.parametrize("name", list(_fla_calls()))
def test_head_first_false_is_accepted_true_is_refused(name):
    """FLA's inputs are time-major only: ``head_first=False`` says so and changes nothing;
    ``head_first=True`` asks for a layout that is not there."""
    fn, args = _fla_calls()[name]
    want = fn(*args, output_final_state=True, backend="mlx")
    got = fn(*args, output_final_state=True, backend="mlx", head_first=False)
    for g, w in zip(got, want):
        assert mx.array_equal(g, w)
    with pytest.raises(ValueError, match=rf"{name}\(\): head_first=True is not supported: "
                                         r"inputs are time-major, \[B, T, H, \.\.\.\]"):
        fn(*args, head_first=True, backend="mlx")


# FLA allocates o like v (gated delta rule, RWKV-6, RWKV-7), like q (delta rule, the GLA
# family) or like x (HGRN); final states in fp32, HGRN's like x.
OUTPUT_LIKE = {"fused_recurrent_gated_delta_rule": "v", "fused_recurrent_delta_rule": "q",
               "fused_recurrent_simple_gla": "q", "fused_recurrent_gla": "q",
               "fused_recurrent_retention": "q", "fused_recurrent_rwkv6": "v",
               "fused_recurrent_rwkv7": "v", "fused_recurrent_hgrn": "x"}


@pytest.mark.parametrize("name", list(OUTPUT_LIKE))
def test_result_dtypes_follow_fla_when_inputs_mix_dtypes(name):
    like = OUTPUT_LIKE[name]
    for dtype in (mx.bfloat16, mx.float16):
        fn, args = _fla_calls(dtypes={like: dtype})[name]
        o, final = fn(*args, output_final_state=True, backend="mlx")
        assert o.dtype == dtype, (dtype, o.dtype)
        assert final.dtype == (dtype if name == "fused_recurrent_hgrn" else mx.float32)
        exact, exact_final = fn(*[x.astype(mx.float32) for x in args], output_final_state=True,
                                backend="mlx")
        assert rel_err(o, exact) < 1e-2 and rel_err(final, exact_final) < 1e-2
    fn, args = _fla_calls()[name]  # one dtype throughout: o in it
    o, _ = fn(*[x.astype(mx.bfloat16) for x in args], backend="mlx")
    assert o.dtype == mx.bfloat16


@pytest.mark.parametrize("name", ["simple_gla", "gla", "retention", "rwkv6"])
def test_matrix_schedule_through_the_call_forms(name, monkeypatch):
    """``schedule="matrix"`` through the FLA call forms, packed sequences of unequal lengths
    (the padding must stay the identity step), against FLA's per-step math."""
    from mlx_recgen.backends import mlx_matrix

    runs = []
    run = mlx_matrix.MatrixForm.run
    monkeypatch.setattr(mlx_matrix.MatrixForm, "run",
                        lambda self, *a, **k: runs.append(1) or run(self, *a, **k))
    T = CU[-1]
    arrays = dict(**_qkv(1, T), h0=_n(3, H, K, V, scale=0.5))
    log_gamma = mx.array([math.log(1 - 2.0 ** (-5 - h)) for h in range(H)])
    if name == "simple_gla":
        arrays["g"] = _n(1, T, H, scale=0.3)
    elif name in ("gla", "rwkv6"):
        arrays["g"] = _n(1, T, H, K, scale=0.3)
    if name == "rwkv6":
        arrays["u"] = _n(H, K, scale=0.5)
    call = dict(output_final_state=True, cu_seqlens=CU, backend="mlx", seg=4, schedule="matrix")

    def ours(q, k, v, h0, g=None, u=None):
        if name == "simple_gla":
            return list(ops.fused_recurrent_simple_gla(q, k, v, g, initial_state=h0, **call))
        if name == "gla":
            return list(ops.fused_recurrent_gla(q, k, v, g, initial_state=h0, **call))
        if name == "retention":
            return list(ops.fused_recurrent_retention(q, k, v, initial_state=h0, **call))
        return list(ops.fused_recurrent_rwkv6(q, k, v, g, u, initial_state=h0, **call))

    def ref(q, k, v, h0, g=None, u=None):
        if name == "rwkv6":
            return list(fla_sequences(fla_rwkv6_step(K ** -0.5, u), [q, k, v, g], h0, CU))
        if name == "retention":
            g = mx.broadcast_to(log_gamma, (1, T, H))
        gates = [g, None, None] if name != "gla" else [None, g, None]
        return list(fla_sequences(fla_gla_step(K ** -0.5), [q, k, v, *gates], h0, CU))

    _compare(ours, ref, arrays)
    assert runs, "the matrix form did not run"
