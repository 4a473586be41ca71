"""Hand-written references, independent of the compiler.

Each bundled spec has a plain MLX per-step loop written from its math (differentiated by MLX
autodiff in the tests), and the custom specs of ``test_adjoint.py`` have float64 numpy forwards
for finite differences. Nothing here imports ``mlx_recgen``.

Every reference returns ``(outputs, final_state)`` with the state in the layout the spec
declares; the MLX loops compute in ``dtype`` (float32 by default, float64 for ground truth on the
CPU), the numpy forwards in float64.
"""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np

F32 = mx.float32


def _cast(dtype, *xs):
    return [x.astype(dtype) for x in xs]


# ---------------------------------------------------------------------------------------------
# Bundled specs: plain MLX loops
# ---------------------------------------------------------------------------------------------


def ssd_ref(u, delta, B, C, A, h0=None, dtype=F32):
    """h[p,n] <- exp(delta*A[n]) h[p,n] + delta B[n] u[p];  y[p] = sum_n C[n] h[p,n].

    u [b,L,H,P], delta [b,L,H], B, C [b,L,H,N], A [H,N]; state [b,H,P,N]."""
    u, delta, B, C, A = _cast(dtype, u, delta, B, C, A)
    b, L, H, P = u.shape
    N = B.shape[-1]
    h = mx.zeros((b, H, P, N), dtype) if h0 is None else h0.astype(dtype)
    ys = []
    for t in range(L):
        dt = delta[:, t]  # [b,H]
        decay = mx.exp(dt[:, :, None] * A[None])  # [b,H,N]
        inject = (dt[:, :, None, None] * B[:, t][:, :, None, :]) * u[:, t][:, :, :, None]
        h = decay[:, :, None, :] * h + inject  # [b,H,P,N]
        ys.append(mx.sum(C[:, t][:, :, None, :] * h, axis=-1))  # [b,H,P]
    return mx.stack(ys, axis=1), h


def gla_ref(q, k, v, g, S0=None, dtype=F32):
    """S[i,j] <- g S[i,j] + k[i] v[j];  o[j] = sum_i q[i] S[i,j] (post-update).

    q, k [b,L,H,K], v [b,L,H,V], g [b,L,H]; state [b,H,K,V]."""
    q, k, v, g = _cast(dtype, q, k, v, g)
    b, L, H, K = q.shape
    V = v.shape[-1]
    S = mx.zeros((b, H, K, V), dtype) if S0 is None else S0.astype(dtype)
    os_ = []
    for t in range(L):
        S = g[:, t][:, :, None, None] * S + k[:, t][:, :, :, None] * v[:, t][:, :, None, :]
        os_.append(mx.sum(q[:, t][:, :, :, None] * S, axis=2))  # [b,H,V]
    return mx.stack(os_, axis=1), S


def rglru_ref(a, x, h0=None, dtype=F32):
    """h <- a h + x;  y = h.  a, x [b,L,D]; state [b,D]."""
    a, x = _cast(dtype, a, x)
    b, L, D = x.shape
    h = mx.zeros((b, D), dtype) if h0 is None else h0.astype(dtype)
    ys = []
    for t in range(L):
        h = a[:, t] * h + x[:, t]
        ys.append(h)
    return mx.stack(ys, axis=1), h


def rotlru_ref(a, cos, sin, x, h0=None, dtype=F32):
    """(u, w) <- a (cos u - sin w) + x0, a (sin u + cos w) + x1;  y = (u, w).

    a, cos, sin [b,L,P], x [b,L,P,2]; state [b,P,2]."""
    a, cos, sin, x = _cast(dtype, a, cos, sin, x)
    b, L, P, _ = x.shape
    h = mx.zeros((b, P, 2), dtype) if h0 is None else h0.astype(dtype)
    u, w = h[..., 0], h[..., 1]
    ys = []
    for t in range(L):
        at, ct, st = a[:, t], cos[:, t], sin[:, t]
        u, w = (at * (ct * u - st * w) + x[:, t, :, 0],
                at * (st * u + ct * w) + x[:, t, :, 1])
        ys.append(mx.stack([u, w], axis=-1))
    return mx.stack(ys, axis=1), mx.stack([u, w], axis=-1)


REFERENCES = {"ssd": ssd_ref, "gla": gla_ref, "rglru": rglru_ref, "rotlru": rotlru_ref}


# ---------------------------------------------------------------------------------------------
# Random inputs in a stable range (never zeros)
# ---------------------------------------------------------------------------------------------


def _u(shape, lo, hi):
    return mx.random.uniform(lo, hi, shape)


def _n(shape, scale=1.0):
    return scale * mx.random.normal(shape)


def ssd_inputs(b=2, L=13, H=2, P=5, N=4):
    u = _n((b, L, H, P))
    delta = _u((b, L, H), 0.05, 0.6)
    B = _n((b, L, H, N), 0.5)
    C = _n((b, L, H, N), 0.5)
    A = -_u((H, N), 0.3, 1.5)
    h0 = _n((b, H, P, N), 0.5)
    return [u, delta, B, C, A], h0


def gla_inputs(b=2, L=13, H=2, K=4, V=5):
    q = _n((b, L, H, K), 0.5)
    k = _n((b, L, H, K), 0.5)
    v = _n((b, L, H, V))
    g = _u((b, L, H), 0.5, 1.0)
    S0 = _n((b, H, K, V), 0.5)
    return [q, k, v, g], S0


def rglru_inputs(b=2, L=13, D=6, negative=False):
    a = _u((b, L, D), 0.5, 0.99)
    if negative:  # any real a: |a| in (0.5, 0.99) with random signs
        sign = mx.where(mx.random.uniform(shape=(b, L, D)) < 0.5, -1.0, 1.0)
        a = a * sign
    x = _n((b, L, D))
    h0 = _n((b, D))
    return [a, x], h0


def rotlru_inputs(b=2, L=13, P=5):
    a = _u((b, L, P), 0.5, 0.99)
    theta = _u((b, L, P), -math.pi, math.pi)
    x = _n((b, L, P, 2))
    h0 = _n((b, P, 2))
    return [a, mx.cos(theta), mx.sin(theta), x], h0


INPUTS = {"ssd": ssd_inputs, "gla": gla_inputs, "rglru": rglru_inputs, "rotlru": rotlru_inputs}


def state_loss_weights(y, h):
    """Random weights for loss = sum(y*Wy) + sum(h*Wh) (both cotangents nonzero)."""
    return mx.random.normal(y.shape), mx.random.normal(h.shape)


# ---------------------------------------------------------------------------------------------
# float64 numpy forwards of the custom specs in test_adjoint.py
# ---------------------------------------------------------------------------------------------


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


def _softplus(x):
    return np.logaddexp(x, 0.0)


def np_delta_rule(q, k, v, beta, h0):
    """r = sum_n k[n] h[p,n];  h[p,n] += beta (v[p] - r) k[n];  y[p] = sum_n q[n] h[p,n].

    q, k [b,L,N], v [b,L,P], beta [b,L]; state [b,P,N]."""
    h = h0.copy()
    L = q.shape[1]
    ys = []
    for t in range(L):
        kt, qt = k[:, t], q[:, t]  # [b,N]
        r = np.einsum("bpn,bn->bp", h, kt)
        h = h + (beta[:, t, None] * (v[:, t] - r))[:, :, None] * kt[:, None, :]
        ys.append(np.einsum("bpn,bn->bp", h, qt))
    return [np.stack(ys, axis=1)], [h]


def np_tanh_rnn(w, x, h0):
    """h <- tanh(w h + x);  y = h.  w, x [b,L,D]; state [b,D]."""
    h = h0.copy()
    ys = []
    for t in range(x.shape[1]):
        h = np.tanh(w[:, t] * h + x[:, t])
        ys.append(h)
    return [np.stack(ys, axis=1)], [h]


def np_fancy(g, x, z, h0):
    """Every elementwise function of the language (see ``fancy`` in test_adjoint.py)."""
    h = h0.copy()
    ys = []
    for t in range(x.shape[1]):
        gt, xt, zt = g[:, t], x[:, t], z[:, t]
        a = _sigmoid(gt)
        h = a * h + (1 - a) * _softplus(xt) + 0.1 * np.log1p(np.abs(zt))
        leaky = np.where(xt > 0, xt, 0.1 * xt)
        y = (np.maximum(h, 0.5 * zt) * np.sqrt(1 + h * h)
             + leaky * (1.0 / np.sqrt(1 + zt * zt)) + np.minimum(zt, h) * 0.25)
        ys.append(y)
    return [np.stack(ys, axis=1)], [h]


def np_shared_param(x, decay, gain, h0):
    """h[b,h,p] <- sigmoid(decay[h]) h + x;  y = gain[h,p] tanh(h).

    x [b,L,H,P], decay [H], gain [H,P]; state [b,H,P]."""
    h = h0.copy()
    a = _sigmoid(decay)[None, :, None]
    ys = []
    for t in range(x.shape[1]):
        h = a * h + x[:, t]
        ys.append(gain[None] * np.tanh(h))
    return [np.stack(ys, axis=1)], [h]


def np_two_states(k, v, g, S0, m0):
    """m <- g m + v;  S[p,n] <- g S[p,n] + k[n] m;  y = sum_n k[n] S[p,n];  z = m sum_n S[p,n].

    k [b,L,N], v, g [b,L,P]; states S [b,P,N], m [b,P]."""
    S, m = S0.copy(), m0.copy()
    ys, zs = [], []
    for t in range(k.shape[1]):
        gt = g[:, t]
        m = gt * m + v[:, t]
        S = gt[:, :, None] * S + k[:, t][:, None, :] * m[:, :, None]
        ys.append(np.einsum("bpn,bn->bp", S, k[:, t]))
        zs.append(m * S.sum(axis=-1))
    return [np.stack(ys, axis=1), np.stack(zs, axis=1)], [S, m]


def np_leaky_max(x, h0):
    """h <- 0.5 h + where(x > 0, x, 0.1 x);  y = maximum(h, x).  x [b,L,D]; state [b,D]."""
    h = h0.copy()
    ys = []
    for t in range(x.shape[1]):
        h = 0.5 * h + np.where(x[:, t] > 0, x[:, t], 0.1 * x[:, t])
        ys.append(np.maximum(h, x[:, t]))
    return [np.stack(ys, axis=1)], [h]


# ---------------------------------------------------------------------------------------------
# Loss and gradients of a scan (compiled or reference) through mx.grad
# ---------------------------------------------------------------------------------------------


def weighted_loss(y, h, Wy, Wh):
    """sum(y*Wy) + sum(h*Wh): both the output and the final-state cotangents are nonzero."""
    dt = mx.float64 if mx.float64 in (y.dtype, h.dtype) else F32
    return mx.sum(y.astype(dt) * Wy.astype(dt)) + mx.sum(h.astype(dt) * Wh.astype(dt))


def value_and_grads(fn, inputs, h0, Wy, Wh):
    """``fn(*inputs, h0) -> (y, h_final)``; returns y, h and the gradients of the weighted loss
    w.r.t. every input and h0 (evaluated)."""
    def loss(*args):
        y, h = fn(*args)
        return weighted_loss(y, h, Wy, Wh)

    y, h = fn(*inputs, h0)
    grads = mx.grad(loss, argnums=tuple(range(len(inputs) + 1)))(*inputs, h0)
    mx.eval(y, h, grads)
    return y, h, list(grads)


def np_scalar_sum(x, C, h0):
    """h[p,n] <- 0.5 h[p,n] + C[n] x[p];  y[p] = sum_n C[n] h[p,n] + sum_n x[p] (= N x[p]).

    x [b,L,P], C [b,L,N]; state [b,P,N]."""
    h = h0.copy()
    N = C.shape[-1]
    ys = []
    for t in range(x.shape[1]):
        h = 0.5 * h + C[:, t][:, None, :] * x[:, t][:, :, None]
        ys.append(np.einsum("bpn,bn->bp", h, C[:, t]) + N * x[:, t])
    return [np.stack(ys, axis=1)], [h]


def np_normalized(q, k, v, g, S0, m0):
    """m <- g m + sum_n k[n] S[p,n] (old S);  S[p,n] <- g S[p,n] + k[n] v[p] / (1 + m^2) (new m);
    y[p] = sum_n q[n] S[p,n] / (1 + m^2).  q, k [b,L,N], v [b,L,P], g [b,L]; S [b,P,N], m [b,P]."""
    S, m = S0.copy(), m0.copy()
    ys = []
    for t in range(q.shape[1]):
        gt = g[:, t][:, None]
        m = gt * m + np.einsum("bpn,bn->bp", S, k[:, t])
        S = gt[..., None] * S + k[:, t][:, None, :] * (v[:, t] / (1 + m * m))[..., None]
        ys.append(np.einsum("bpn,bn->bp", S, q[:, t]) / (1 + m * m))
    return [np.stack(ys, axis=1)], [S, m]
