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
# The zoo: one loop per paper, written from its formula (not from the spec)
# ---------------------------------------------------------------------------------------------


def _outer(a, b):
    """a [..., K], b [..., V] -> [..., K, V]."""
    return a[..., :, None] * b[..., None, :]


def _cmul(ar, ai, br, bi):
    """(ar + i ai)(br + i bi) as a pair."""
    return ar * br - ai * bi, ar * bi + ai * br


def mamba1_ref(u, delta, A, B, C, D, h0=None, dtype=F32):
    """Mamba's S6: h = exp(delta A) h + (delta u) B;  y = C h + D u.

    u, delta [b,L,D], A [D,N], B, C [b,L,N], D [D]; state [b,D,N]."""
    u, delta, A, B, C, D = _cast(dtype, u, delta, A, B, C, D)
    b, L, Dm = u.shape
    h = mx.zeros((b, Dm, A.shape[1]), dtype) if h0 is None else h0.astype(dtype)
    ys = []
    for t in range(L):
        A_bar = mx.exp(delta[:, t, :, None] * A)  # [b,D,N]
        h = A_bar * h + _outer(delta[:, t] * u[:, t], B[:, t])
        ys.append((h @ C[:, t, :, None])[..., 0] + D * u[:, t])
    return mx.stack(ys, axis=1), h


def mamba2_ref(x, dt, A, B, C, D, h0=None, dtype=F32):
    """Mamba-2's SSD with a scalar decay per head: h = exp(dt A) h + dt x B^T;  y = h C + D x.

    x [b,L,H,P], dt [b,L,H], A, D [H], B, C [b,L,G,N] (one per group of H/G heads); state
    [b,H,P,N]."""
    x, dt, A, B, C, D = _cast(dtype, x, dt, A, B, C, D)
    b, L, H, P = x.shape
    B, C = (mx.repeat(z, H // z.shape[2], axis=2) for z in (B, C))  # head h reads group h // (H/G)
    h = mx.zeros((b, H, P, B.shape[-1]), dtype) if h0 is None else h0.astype(dtype)
    ys = []
    for t in range(L):
        a = mx.exp(dt[:, t] * A)[..., None, None]  # [b,H,1,1]
        h = a * h + dt[:, t, :, None, None] * _outer(x[:, t], B[:, t])
        ys.append((h @ C[:, t, :, :, None])[..., 0] + D[:, None] * x[:, t])
    return mx.stack(ys, axis=1), h


def _eye_minus(beta, k):
    """I - beta k k^T for k [b,H,K], beta [b,H] -> [b,H,K,K]."""
    K = k.shape[-1]
    return mx.eye(K, dtype=k.dtype) - beta[..., None, None] * _outer(k, k)


def deltanet_ref(q, k, v, beta, S0=None, dtype=F32):
    """The delta rule in matrix form: S = (I - beta k k^T) S + beta k v^T;  o = S^T q.

    q, k [b,L,H,K], v [b,L,H,V], beta [b,L,H]; state [b,H,K,V]."""
    q, k, v, beta = _cast(dtype, q, k, v, beta)
    b, L, H, K = q.shape
    S = mx.zeros((b, H, K, v.shape[-1]), dtype) if S0 is None else S0.astype(dtype)
    os_ = []
    for t in range(L):
        S = _eye_minus(beta[:, t], k[:, t]) @ S + beta[:, t, :, None, None] * _outer(k[:, t], v[:, t])
        os_.append((q[:, t, :, None, :] @ S)[..., 0, :])
    return mx.stack(os_, axis=1), S


def gated_deltanet_ref(q, k, v, g, beta, S0=None, dtype=F32):
    """Gated DeltaNet: S = exp(g) (I - beta k k^T) S + beta k v^T;  o = S^T q.

    q, k [b,L,H,K], v [b,L,H,V], g, beta [b,L,H]; state [b,H,K,V]."""
    q, k, v, g, beta = _cast(dtype, q, k, v, g, beta)
    b, L, H, K = q.shape
    S = mx.zeros((b, H, K, v.shape[-1]), dtype) if S0 is None else S0.astype(dtype)
    os_ = []
    for t in range(L):
        alpha = mx.exp(g[:, t])[..., None, None]
        S = alpha * (_eye_minus(beta[:, t], k[:, t]) @ S) \
            + beta[:, t, :, None, None] * _outer(k[:, t], v[:, t])
        os_.append((q[:, t, :, None, :] @ S)[..., 0, :])
    return mx.stack(os_, axis=1), S


def rwkv6_ref(r, k, v, w, u, S0=None, dtype=F32):
    """RWKV-6: o = r^T (S + diag(u) k v^T);  S = diag(exp(w)) S + k v^T.

    r, k, w [b,L,H,K], v [b,L,H,V], u [H,K]; state [b,H,K,V]."""
    r, k, v, w, u = _cast(dtype, r, k, v, w, u)
    b, L, H, K = r.shape
    S = mx.zeros((b, H, K, v.shape[-1]), dtype) if S0 is None else S0.astype(dtype)
    os_ = []
    for t in range(L):
        kv = _outer(k[:, t], v[:, t])
        os_.append((r[:, t, :, None, :] @ (S + u[:, :, None] * kv))[..., 0, :])
        S = mx.exp(w[:, t])[..., None] * S + kv
    return mx.stack(os_, axis=1), S


def rwkv7_ref(r, w, k, v, a, b, S0=None, dtype=F32):
    """RWKV-7 in the paper's layout (state V x K): S = S (diag(exp(w)) + a b^T) + v k^T;
    o = S r. Takes and returns the state as [b,H,K,V] (the transpose).

    r, w, k, a, b [b,L,H,K], v [b,L,H,V]."""
    r, w, k, v, a, b = _cast(dtype, r, w, k, v, a, b)
    n, L, H, K = r.shape
    V = v.shape[-1]
    S = mx.zeros((n, H, V, K), dtype) if S0 is None else S0.astype(dtype).swapaxes(-1, -2)
    eye = mx.eye(K, dtype=dtype)
    os_ = []
    for t in range(L):
        G = eye * mx.exp(w[:, t])[..., None, :] + _outer(a[:, t], b[:, t])  # [n,H,K,K]
        S = S @ G + _outer(v[:, t], k[:, t])
        os_.append((S @ r[:, t, :, :, None])[..., 0])
    return mx.stack(os_, axis=1), S.swapaxes(-1, -2)


def hgrn2_ref(q, f, i, S0=None, dtype=F32):
    """HGRN2: S = diag(f) S + (1 - f) i^T;  o = S^T q.

    q, f [b,L,H,K], i [b,L,H,V]; state [b,H,K,V]."""
    q, f, i = _cast(dtype, q, f, i)
    b, L, H, K = q.shape
    S = mx.zeros((b, H, K, i.shape[-1]), dtype) if S0 is None else S0.astype(dtype)
    os_ = []
    for t in range(L):
        S = f[:, t, :, :, None] * S + _outer(1 - f[:, t], i[:, t])
        os_.append((q[:, t, :, None, :] @ S)[..., 0, :])
    return mx.stack(os_, axis=1), S


def retnet_ref(q, k, v, gamma, S0=None, dtype=F32):
    """Retention, recurrent form: S = gamma S + k v^T;  o = S^T q.

    q, k [b,L,H,K], v [b,L,H,V], gamma [H]; state [b,H,K,V]."""
    q, k, v, gamma = _cast(dtype, q, k, v, gamma)
    b, L, H, K = q.shape
    S = mx.zeros((b, H, K, v.shape[-1]), dtype) if S0 is None else S0.astype(dtype)
    os_ = []
    for t in range(L):
        S = gamma[:, None, None] * S + _outer(k[:, t], v[:, t])
        os_.append((q[:, t, :, None, :] @ S)[..., 0, :])
    return mx.stack(os_, axis=1), S


def mlstm_ref(q, k, v, igate, fgate, C0=None, n0=None, m0=None, dtype=F32):
    """xLSTM's mLSTM, stabilised (the paper's per-head normaliser and stabiliser):
    m' = max(log sigmoid(f~) + m, i~);  f' = exp(log sigmoid(f~) + m - m');  i' = exp(i~ - m');
    C = f' C + i' k v^T;  n = f' n + i' k;  h = C^T q / max(|n^T q|, exp(-m')).

    q, k [b,L,H,K], v [b,L,H,V], igate, fgate [b,L,H]; states C [b,H,K,V], n [b,H,K], m [b,H].
    Returns (h, (C, n, m))."""
    q, k, v, igate, fgate = _cast(dtype, q, k, v, igate, fgate)
    b, L, H, K = q.shape
    V = v.shape[-1]
    C = mx.zeros((b, H, K, V), dtype) if C0 is None else C0.astype(dtype)
    n = mx.zeros((b, H, K), dtype) if n0 is None else n0.astype(dtype)
    m = mx.zeros((b, H), dtype) if m0 is None else m0.astype(dtype)
    hs = []
    for t in range(L):
        log_f = mx.log(mx.sigmoid(fgate[:, t]))
        m_new = mx.maximum(log_f + m, igate[:, t])
        f = mx.exp(log_f + m - m_new)
        i = mx.exp(igate[:, t] - m_new)
        C = f[..., None, None] * C + i[..., None, None] * _outer(k[:, t], v[:, t])
        n = f[..., None] * n + i[..., None] * k[:, t]
        m = m_new
        num = (q[:, t, :, None, :] @ C)[..., 0, :]  # [b,H,V]
        den = mx.maximum(mx.abs(mx.sum(n * q[:, t], axis=-1)), mx.exp(-m))
        hs.append(num / den[..., None])
    return mx.stack(hs, axis=1), (C, n, m)


def mlstm_unstabilised_ref(q, k, v, igate, fgate, dtype=F32):
    """The mLSTM without the stabiliser, from zero states: C = f C + i k v^T, n = f n + i k,
    h = C^T q / max(|n^T q|, 1) with i = exp(i~), f = sigmoid(f~). Returns h."""
    q, k, v, igate, fgate = _cast(dtype, q, k, v, igate, fgate)
    b, L, H, K = q.shape
    C = mx.zeros((b, H, K, v.shape[-1]), dtype)
    n = mx.zeros((b, H, K), dtype)
    hs = []
    for t in range(L):
        f, i = mx.sigmoid(fgate[:, t]), mx.exp(igate[:, t])
        C = f[..., None, None] * C + i[..., None, None] * _outer(k[:, t], v[:, t])
        n = f[..., None] * n + i[..., None] * k[:, t]
        den = mx.maximum(mx.abs(mx.sum(n * q[:, t], axis=-1)), 1.0)
        hs.append((q[:, t, :, None, :] @ C)[..., 0, :] / den[..., None])
    return mx.stack(hs, axis=1)


def mingru_ref(k, htilde, h0=None, dtype=F32):
    """minGRU: z = sigmoid(k);  h = (1 - z) h + z h~.  k, h~ [b,L,D]; state [b,D]."""
    k, htilde = _cast(dtype, k, htilde)
    b, L, D = k.shape
    h = mx.zeros((b, D), dtype) if h0 is None else h0.astype(dtype)
    ys = []
    for t in range(L):
        z = mx.sigmoid(k[:, t])
        h = (1 - z) * h + z * htilde[:, t]
        ys.append(h)
    return mx.stack(ys, axis=1), h


def _causal_powers(L, log_mag, angle):
    """lambda^p for p = t - s (s <= t) of lambda = exp(log_mag + i angle), as pairs [..., L, L]
    (zero above the diagonal), and lambda^(t+1) as pairs [..., L]."""
    t = mx.arange(L)
    p = (t[:, None] - t[None, :]).astype(log_mag.dtype)
    causal = (p >= 0).astype(log_mag.dtype)
    p = mx.maximum(p, 0)
    mag = mx.exp(log_mag[..., None, None] * p) * causal
    re, im = mag * mx.cos(angle[..., None, None] * p), mag * mx.sin(angle[..., None, None] * p)
    q = (t + 1).astype(log_mag.dtype)
    mag0 = mx.exp(log_mag[..., None] * q)
    return (re, im), (mag0 * mx.cos(angle[..., None] * q), mag0 * mx.sin(angle[..., None] * q))


def complex_lru_ref(bx, nu_log, theta_log, h0=None, dtype=F32):
    """The LRU in closed form (no step loop): h_t = lambda^(t+1) h_0 + sum_{s<=t}
    lambda^(t-s) gamma bx_s with lambda = exp(-exp(nu_log) + i exp(theta_log)),
    gamma = sqrt(1 - |lambda|^2); y_t = h_t.

    bx [b,L,D,2], nu_log, theta_log [D]; state [b,D,2]."""
    bx, nu_log, theta_log = _cast(dtype, bx, nu_log, theta_log)
    b, L, D, _ = bx.shape
    h0 = mx.zeros((b, D, 2), dtype) if h0 is None else h0.astype(dtype)
    log_mag, angle = -mx.exp(nu_log), mx.exp(theta_log)  # [D]
    gamma = mx.sqrt(1 - mx.exp(2 * log_mag))
    (pr, pi), (zr, zi) = _causal_powers(L, log_mag, angle)  # [D,L,L], [D,L]
    xr = gamma * bx[..., 0]  # [b,L,D]
    xi = gamma * bx[..., 1]
    # sum_s P[d,t,s] x[b,s,d]
    conv = lambda P, x: mx.einsum("dts,bsd->btd", P, x)
    yr = conv(pr, xr) - conv(pi, xi)
    yi = conv(pr, xi) + conv(pi, xr)
    ir, ii = _cmul(zr.T[None], zi.T[None], h0[:, None, :, 0], h0[:, None, :, 1])  # [b,L,D]
    y = mx.stack([yr + ir, yi + ii], axis=-1)
    return y, y[:, -1]


def s4d_ref(u, log_dt, log_A_real, A_imag, C, D, h0=None, dtype=F32):
    """S4D as its convolution (no step loop): with dA = exp(dt A), dB = (dA - 1) / A,
    y_t = 2 Re sum_n C_n (dA_n^(t+1) h0_n + sum_{s<=t} dA_n^(t-s) dB_n u_s) + D u_t,
    and the final state dA^L h0 + sum_s dA^(L-1-s) dB u_s.

    u [b,L,D], log_dt, D [D], log_A_real, A_imag [D,N], C [D,N,2]; state [b,D,N,2]."""
    u, log_dt, log_A_real, A_imag, C, D = _cast(dtype, u, log_dt, log_A_real, A_imag, C, D)
    b, L, Dm = u.shape
    N = A_imag.shape[-1]
    h0 = mx.zeros((b, Dm, N, 2), dtype) if h0 is None else h0.astype(dtype)
    dt = mx.exp(log_dt)[:, None]  # [D,1]
    ar, ai = -mx.exp(log_A_real), A_imag  # [D,N]
    (pr, pi), (zr, zi) = _causal_powers(L, dt * ar, dt * ai)  # [D,N,L,L], [D,N,L]
    dar, dai = mx.exp(dt * ar) * mx.cos(dt * ai), mx.exp(dt * ar) * mx.sin(dt * ai)
    den = ar * ar + ai * ai
    dbr, dbi = ((dar - 1) * ar + dai * ai) / den, (dai * ar - (dar - 1) * ai) / den
    cbr, cbi = _cmul(C[..., 0], C[..., 1], dbr, dbi)  # C dB [D,N]
    kr, ki = _cmul(cbr[..., None, None], cbi[..., None, None], pr, pi)  # [D,N,L,L]
    y = 2 * mx.einsum("dnts,bsd->btd", kr, u)  # Re of the kernel part
    hr, hi = _cmul(zr[None], zi[None], h0[..., 0, None], h0[..., 1, None])  # [b,D,N,L]
    chr_, _ = _cmul(C[None, ..., 0, None], C[None, ..., 1, None], hr, hi)
    y = y + 2 * mx.sum(chr_, axis=2).swapaxes(1, 2) + D * u
    # final state: the last row of the powers
    fr = mx.einsum("dns,bsd->bdn", pr[:, :, -1], u)
    fi = mx.einsum("dns,bsd->bdn", pi[:, :, -1], u)
    fr, fi = _cmul(fr, fi, dbr[None], dbi[None])
    return y, mx.stack([hr[..., -1] + fr, hi[..., -1] + fi], axis=-1)


ZOO_REFERENCES = {
    "mamba1": mamba1_ref, "mamba2": mamba2_ref, "deltanet": deltanet_ref,
    "gated_deltanet": gated_deltanet_ref, "rwkv6": rwkv6_ref, "rwkv7": rwkv7_ref,
    "hgrn2": hgrn2_ref, "retnet": retnet_ref, "mlstm": mlstm_ref, "mingru": mingru_ref,
    "complex_lru": complex_lru_ref, "s4d": s4d_ref,
}


# ---------------------------------------------------------------------------------------------
# Ecosystem call forms (mlx_recgen.ops): flash-linear-attention's and mamba_ssm's semantics,
# one sequence and one step at a time
# ---------------------------------------------------------------------------------------------


def fla_sequences(step, seqs, h0, cu_seqlens=None, reverse=False):
    """Run ``step(S, xs_t) -> (S, o_t)`` over FLA's time-major inputs ``seqs`` (``[B, T, ...]``):
    the ``B`` rows, or with ``cu_seqlens`` the sequences packed along time (``B = 1``), each from
    its own initial state ``h0[n]``, in reverse step order when ``reverse``. Returns
    ``(o [B, T, ...], final states [N, ...])``."""
    B, T = seqs[0].shape[:2]
    if cu_seqlens is None:
        spans = [(b, 0, T) for b in range(B)]
    else:
        cu = [int(c) for c in cu_seqlens]
        spans = [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]
    rows, finals = {}, []
    for n, (b, start, end) in enumerate(spans):
        S = h0[n]
        steps = range(end - 1, start - 1, -1) if reverse else range(start, end)
        for t in steps:
            S, o = step(S, [None if x is None else x[b, t] for x in seqs])
            rows[(b, t)] = o
        finals.append(S)
    o = mx.stack([mx.stack([rows[(b, t)] for t in range(T)]) for b in range(B)])
    return o, mx.stack(finals)


def fla_delta_step(scale, gated_heads=1):
    """FLA's gated delta rule for one step of one sequence: q, k [H, K], v [HV, V], g [HV],
    gk [HV, K], gv [HV, V] (log gates, None when absent), beta [HV] or [HV, V]; state
    [HV, K, V]. Value head h reads query/key head h // gated_heads."""
    def step(S, xs):
        q, k, v, g, gk, gv, beta = xs
        HV = v.shape[0]
        heads = [h // gated_heads for h in range(HV)]
        q, k = q[mx.array(heads)] * scale, k[mx.array(heads)]
        if g is not None:
            S = S * mx.exp(g)[:, None, None]
        if gk is not None:
            S = S * mx.exp(gk)[:, :, None]
        if gv is not None:
            S = S * mx.exp(gv)[:, None, :]
        b = beta if beta.ndim == 2 else beta[:, None]
        u = b * (v - mx.sum(S * k[:, :, None], axis=1))  # [HV, V]
        S = S + k[:, :, None] * u[:, None, :]
        return S, mx.sum(S * q[:, :, None], axis=1)
    return step


def fla_gla_step(scale):
    """GLA for one step: q, k [H, K], v [H, V], per-head log gate g [H], per-key gk [H, K],
    per-value gv [H, V] (None when absent); S <- decays * S + k v^T; o = (scale q)^T S."""
    def step(S, xs):
        q, k, v, g, gk, gv = xs
        if g is not None:
            S = S * mx.exp(g)[:, None, None]
        if gk is not None:
            S = S * mx.exp(gk)[:, :, None]
        if gv is not None:
            S = S * mx.exp(gv)[:, None, :]
        S = S + k[:, :, None] * v[:, None, :]
        return S, mx.sum(S * (scale * q)[:, :, None], axis=1)
    return step


def fla_rwkv6_step(scale, u):
    """RWKV-6 for one step: o = (scale r)^T (S + diag(u) k v^T); S <- diag(exp(w)) S + k v^T."""
    def step(S, xs):
        r, k, v, w = xs
        kv = k[:, :, None] * v[:, None, :]
        o = mx.sum((S + u[:, :, None] * kv) * (scale * r)[:, :, None], axis=1)
        return mx.exp(w)[:, :, None] * S + kv, o
    return step


def fla_rwkv7_step(scale):
    """FLA's RWKV-7 (DPLR) for one step: S <- diag(exp(w)) S + b (a^T S) + k v^T;
    o = (scale r)^T S."""
    def step(S, xs):
        r, w, k, v, a, b = xs
        aS = mx.sum(a[:, :, None] * S, axis=1)  # [H, V]
        S = mx.exp(w)[:, :, None] * S + b[:, :, None] * aS[:, None, :] + k[:, :, None] * v[:, None, :]
        return S, mx.sum(S * (scale * r)[:, :, None], axis=1)
    return step


def fla_hgrn_step(S, xs):
    """HGRN for one step: h <- exp(g) h + x; o = h."""
    x, g = xs
    S = mx.exp(g) * S + x
    return S, S


def l2norm_ref(x):
    """x / sqrt(sum(x^2) + 1e-6) over the last axis."""
    return x / mx.sqrt(mx.sum(x * x, axis=-1, keepdims=True) + 1e-6)


def selective_scan_ref(u, delta, A, B, C, D=None, z=None, delta_bias=None, delta_softplus=False,
                       cu_seqlens=None):
    """mamba_ssm's selective scan in its own layout: u, delta, z [b, D, L], A [D, N], B, C
    [b, N, L] or [b, G, N, L] (channel d reads group d // (D/G)); the state restarts from zero
    at every cu_seqlens boundary. Returns (out [b, D, L], the state after the last step)."""
    if delta_bias is not None:
        delta = delta + delta_bias[:, None]
    if delta_softplus:
        delta = mx.log(1 + mx.exp(delta))
    b, Dm, L = u.shape

    def per_channel(X):  # -> [b, D, N, L]
        if X.ndim == 3:
            return mx.broadcast_to(X[:, None], (b, Dm, *X.shape[1:]))
        return mx.repeat(X, Dm // X.shape[1], axis=1)

    B, C = per_channel(B), per_channel(C)
    starts = set() if cu_seqlens is None else {int(c) for c in cu_seqlens[1:-1]}
    x = mx.zeros((b, Dm, A.shape[1]))
    ys = []
    for t in range(L):
        if t in starts:
            x = mx.zeros_like(x)
        x = mx.exp(delta[:, :, t, None] * A) * x + (delta[:, :, t] * u[:, :, t])[..., None] * B[..., t]
        ys.append(mx.sum(x * C[..., t], axis=-1))
    y = mx.stack(ys, axis=-1)
    if D is not None:
        y = y + D[:, None] * u
    if z is not None:
        y = y * z * mx.sigmoid(z)
    return y, x


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
