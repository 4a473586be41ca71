"""Delta rules in the matrix schedule (``affine.LowRankRead``, ``matrix.py``, ``mlx_matrix.
_solve_reads``): specs whose update reads the state through a sum and adds it back, against
loops written here from the update rule, step by step, independent of the compiler. Outputs,
final states and the gradient of every input and initial state, with L not a multiple of the
chunk and L shorter than one chunk; a decay per key channel, grouped heads, two reads, an output
of the read itself, a readout before the update; the chunked schedule taking the matrix
form; refusals with their reasons; the precision of long chunks with beta up to 2 and keys not
normalised. The zoo's delta rules against their papers' loops are in ``test_matrix.py``."""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_recgen as rg
from conftest import KERNEL_BACKENDS, rel_err
from distributed_worker import gdelta
from test_matrix import _assert_matches

TOL = 1e-5
b, L, H, K, V = 2, 11, 2, 4, 3


def _n(*shape, scale=1.0):
    return scale * mx.random.normal(shape)


def _unit(*shape):
    x = mx.random.normal(shape)
    return x / mx.linalg.norm(x, axis=-1, keepdims=True)


def _runner(rec, backend="mlx", schedule="matrix", seg=4):
    def run(inputs, states):
        y, S = rec(*inputs, initial_state=states[0], return_state=True, backend=backend,
                   schedule=schedule, seg=seg)
        return [y], [S]

    return run


def _delta_loop(q, k, v, beta, S, decay=None, members=1):
    """``S <- decay S; S <- S + beta k (v - kᵀ S)ᵀ; o = Sᵀ q`` per step and head. q, k
    ``[b, L, H / members, K]`` (one per group of ``members`` heads); v ``[b, L, H, V]``; beta
    ``[b, L, H]``; decay ``[b, L, H]`` or ``[b, L, H, K]``; S ``[b, H, K, V]``."""
    if members > 1:
        q, k = (mx.repeat(x, members, axis=2) for x in (q, k))
    ys = []
    for t in range(q.shape[1]):
        if decay is not None:
            d = decay[:, t]
            S = (d[..., None] if d.ndim == 3 else d[..., None, None]) * S
        kt = k[:, t]
        read = mx.sum(kt[..., None] * S, axis=-2)  # kᵀ S: [b, H, V]
        S = S + beta[:, t, :, None, None] * kt[..., None] * (v[:, t] - read)[..., None, :]
        ys.append(mx.sum(q[:, t][..., None] * S, axis=-2))
    return mx.stack(ys, axis=1), S


@rg.recurrence(lane="V", state={"S": "B H K V"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "gk": "B L H K",
                       "beta": "B L H"},
               outputs={"o": "B L H V"})
def key_decay_delta(S, q, k, v, gk, beta, i):
    """A delta rule with a decay per key channel (Kimi Delta Attention's form)."""
    S[i] = rg.exp(gk[i]) * S[i]
    r = rg.Sum(k[i] * S[i], i)
    S[i] = S[i] + beta * (v - r) * k[i]
    return {"o": rg.Sum(q[i] * S[i], i)}


@pytest.mark.parametrize("seg", [4, 16])
def test_a_decay_per_key_channel(seg):
    mx.random.seed(1)
    inputs = [_n(b, L, H, K), _unit(b, L, H, K), _n(b, L, H, V), _n(b, L, H, K, scale=0.3),
              mx.random.uniform(0, 2, (b, L, H))]
    S0 = _n(b, H, K, V, scale=0.5)
    assert key_decay_delta.matrix.states[0].vector_decay

    def ref(i, s):
        q, k, v, gk, beta = i
        y, S = _delta_loop(q, k, v, beta, s[0], decay=mx.exp(gk))
        return [y], [S]

    _assert_matches(_runner(key_decay_delta, seg=seg), ref, inputs, [S0])


@rg.recurrence(lane="V", state={"S": "B H K V"},
               inputs={"q": "B L Hk K", "k": "B L Hk K", "v": "B L H V", "g": "B L H",
                       "beta": "B L H"},
               outputs={"o": "B L H V"}, groups={"Hk": "H"})
def grouped_gated_delta(S, q, k, v, g, beta, i):
    """Gated DeltaNet with a key head per group of value heads (Qwen3-Next's layout)."""
    r = rg.Sum(k[i] * S[i], i)
    S[i] = rg.exp(g) * S[i] + beta * (v - rg.exp(g) * r) * k[i]
    return {"o": rg.Sum(q[i] * S[i], i)}


@pytest.mark.parametrize("seg", [4, 16])
@pytest.mark.parametrize("backend", ["mlx", *KERNEL_BACKENDS])
def test_grouped_heads(seg, backend):
    mx.random.seed(2)
    Hv = 4
    inputs = [_n(b, L, H, K), _unit(b, L, H, K), _n(b, L, Hv, V), _n(b, L, Hv, scale=0.3),
              mx.random.uniform(0, 2, (b, L, Hv))]
    S0 = _n(b, Hv, K, V, scale=0.5)

    def ref(i, s):
        q, k, v, g, beta = i
        y, S = _delta_loop(q, k, v, beta, s[0], decay=mx.exp(g), members=Hv // H)
        return [y], [S]

    _assert_matches(_runner(grouped_gated_delta, backend, seg=seg), ref, inputs, [S0])


@rg.recurrence(lane="V", state={"S": "B H K V"},
               inputs={"q": "B L H K", "k": "B L H K", "u": "B L H K", "v": "B L H V",
                       "beta": "B L H"},
               outputs={"o": "B L H V"})
def two_reads(S, q, k, u, v, beta, i):
    """Rank two: S <- (I - beta k kᵀ - u uᵀ / 2) S + k vᵀ."""
    r = rg.Sum(k[i] * S[i], i)
    w = rg.Sum(u[i] * S[i], i)
    S[i] = S[i] - beta * k[i] * r - 0.5 * u[i] * w + k[i] * v
    return {"o": rg.Sum(q[i] * S[i], i)}


def test_two_reads():
    mx.random.seed(3)
    inputs = [_n(b, L, H, K), _unit(b, L, H, K), _unit(b, L, H, K), _n(b, L, H, V),
              mx.random.uniform(0, 1.5, (b, L, H))]
    S0 = _n(b, H, K, V, scale=0.5)
    assert len(two_reads.affine.low_rank) == 2
    assert "rank 2 transition" in two_reads.matrix.describe()

    def ref(i, s):
        q, k, u, v, beta = i
        S, ys = s[0], []
        for t in range(L):
            kt, ut = k[:, t, ..., None], u[:, t, ..., None]
            r = mx.sum(kt * S, axis=-2, keepdims=True)
            w = mx.sum(ut * S, axis=-2, keepdims=True)
            S = S - beta[:, t, :, None, None] * kt * r - 0.5 * ut * w + kt * v[:, t, :, None, :]
            ys.append(mx.sum(q[:, t, ..., None] * S, axis=-2))
        return [mx.stack(ys, axis=1)], [S]

    for seg in (4, 16):
        _assert_matches(_runner(two_reads, seg=seg), ref, inputs, [S0])


@rg.recurrence(lane="V", state={"S": "B H K V"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "beta": "B L H"},
               outputs={"o": "B L H V", "read": "B L H V"})
def read_before_the_update(S, q, k, v, beta, i):
    """A readout of the state before the update, gated by the delta rule's read, which is
    also an output of its own."""
    before = rg.Sum(q[i] * S[i], i)
    r = rg.Sum(k[i] * S[i], i)
    S[i] = S[i] + beta * (v - r) * k[i]
    return {"o": before * rg.sigmoid(r), "read": r}


def test_a_readout_before_the_update_and_the_read_as_an_output():
    mx.random.seed(4)
    inputs = [_n(b, L, H, K), _unit(b, L, H, K), _n(b, L, H, V), mx.random.uniform(0, 2, (b, L, H))]
    S0 = _n(b, H, K, V, scale=0.5)

    def run(i, s):
        (o, read), S = read_before_the_update(*i, initial_state=s[0], return_state=True,
                                              backend="mlx", schedule="matrix", seg=4)
        return [o, read], [S]

    def ref(i, s):
        q, k, v, beta = i
        S, os_, reads = s[0], [], []
        for t in range(L):
            before = mx.sum(q[:, t, ..., None] * S, axis=-2)
            r = mx.sum(k[:, t, ..., None] * S, axis=-2)
            S = S + beta[:, t, :, None, None] * k[:, t, ..., None] * (v[:, t] - r)[..., None, :]
            os_.append(before * mx.sigmoid(r))
            reads.append(r)
        return [mx.stack(os_, axis=1), mx.stack(reads, axis=1)], [S]

    _assert_matches(run, ref, inputs, [S0])


@pytest.mark.parametrize("backend", ["mlx", pytest.param("metal-sim", marks=pytest.mark.sim)])
def test_the_chunked_schedule_takes_the_matrix_form(backend):
    """A delta rule has no segment summaries of its own: ``schedule="chunked"`` runs its chunks
    in the matrix form, bit for bit what ``schedule="matrix"`` gives."""
    mx.random.seed(6)
    rec = rg.load_spec("gated_deltanet")
    args = [_n(b, L, H, K), _unit(b, L, H, K), _n(b, L, H, V), _n(b, L, H, scale=0.3),
            mx.random.uniform(0, 2, (b, L, H))]
    S0 = _n(b, H, K, V)
    from mlx_recgen.schedule import choose

    assert choose(rec, {"B": b, "L": L, "H": H, "K": K, "V": V}, "chunked", 4, backend)[0] \
        == "matrix"
    y1, S1 = rec(*args, initial_state=S0, return_state=True, backend=backend,
                 schedule="chunked", seg=4)
    y2, S2 = rec(*args, initial_state=S0, return_state=True, backend=backend,
                 schedule="matrix", seg=4)
    assert mx.array_equal(y1, y2) and mx.array_equal(S1, S2)
    y3 = rec(*args, initial_state=S0, backend="mlx", schedule="sequential")
    assert rel_err(y1, y3) < TOL
    # auto keeps the sequential schedule for a delta rule (the matrix form by name only)
    assert choose(rec, {"B": b, "L": 4096, "H": H, "K": K, "V": V}, "auto", None, backend)[0] \
        == "sequential"


@rg.recurrence(lane="V", state={"S": "B H K V"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "beta": "B L H V"},
               outputs={"o": "B L H V"})
def beta_per_value(S, q, k, v, beta, i):
    r = rg.Sum(k[i] * S[i], i)
    S[i] = S[i] + beta * (v - r) * k[i]
    return {"o": rg.Sum(q[i] * S[i], i)}


@rg.recurrence(lane="V", state={"S": "B H K V", "T": "B H K V"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V"},
               outputs={"o": "B L H V"})
def shared_read(S, T, q, k, v, i):
    r = rg.Sum(k[i] * S[i], i)
    S[i] = S[i] + (v - r) * k[i]
    T[i] = 0.5 * T[i] + r * k[i]
    return {"o": rg.Sum(q[i] * (S[i] + T[i]), i)}


def test_refusals_name_the_reason():
    """A read whose weight varies along the lanes is affine (time-parallel) but has no
    triangular solve shared by the lanes; a read that feeds another state mixes the states."""
    assert beta_per_value.time_parallel and not beta_per_value.matrix.applies
    assert "varies along the lane axis" in beta_per_value.matrix.reason
    args = [_n(1, 5, 1, K), _unit(1, 5, 1, K), _n(1, 5, 1, V), _n(1, 5, 1, V)]
    with pytest.raises(ValueError, match="schedule='chunked' has no form for it"):
        beta_per_value(*args, backend="mlx", schedule="chunked")
    with pytest.raises(ValueError, match="schedule='matrix' needs the matrix form"):
        beta_per_value(*args, backend="mlx", schedule="matrix")
    y = beta_per_value(*args, backend="mlx")  # auto: sequential
    assert rel_err(y, beta_per_value.reference(*args)) < TOL
    assert not shared_read.time_parallel and "mixes them" in shared_read.affine.reason
    text = rg.load_spec("deltanet").adjoint_ir().splitlines()[-1]
    assert "rank 1 transition" in text and "UT transform" in text


@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_long_chunks_beta_up_to_two_keys_not_normalised(dtype):
    """The solve is where precision goes: chunks of 64 and a partial one, beta in [0, 2]
    (``allow_neg_eigval``), keys of norm about 1 but not normalised, against the sequential
    schedule in fp32; bf16 inputs (bf16 products within a chunk, fp32 solve) within 2e-2."""
    mx.random.seed(7)
    rec = rg.load_spec("gated_deltanet")
    T = 150
    args = [_n(b, T, H, 16), _n(b, T, H, 16, scale=16 ** -0.5), _n(b, T, H, 8),
            mx.random.uniform(-0.2, 0, (b, T, H)), mx.random.uniform(0, 2, (b, T, H))]
    S0 = _n(b, H, 16, 8)
    want, S_want = rec(*args, initial_state=S0, return_state=True, backend="mlx",
                       schedule="sequential")
    got, S_got = rec(*[x.astype(dtype) for x in args], initial_state=S0, return_state=True,
                     backend="mlx", schedule="matrix", seg=64)
    tol = 1e-4 if dtype == mx.float32 else 2e-2
    assert rel_err(got, want) < tol and rel_err(S_got, S_want) < tol


@rg.recurrence(lane="V", state={"S": "B H K V"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "g": "B L H K",
                       "beta": "B L H"},
               outputs={"o": "B L H V"})
def signed_gate_delta(S, q, k, v, g, beta, i):
    """The gate given as the decay itself (mlx-lm's layout), so its sign is not known: the
    solve carries it as a running parity."""
    decayed = g[i] * S[i]
    S[i] = decayed + beta * (v - rg.Sum(k[i] * decayed, i)) * k[i]
    return {"o": rg.Sum(q[i] * S[i], i)}


@pytest.mark.parametrize("seg", [4, 8])
@pytest.mark.parametrize("per_key", [True, False])
def test_a_decay_of_either_sign(seg, per_key):
    """A gate per key channel, and one per head (the sequence-parallel tests' gated delta rule,
    ``S <- g S + 2 beta k (v - g kᵀ S)``), whose read and write run along the key, so the
    solve's products share one causal matrix (``MatrixForm.along``)."""
    mx.random.seed(8)
    rec = signed_gate_delta if per_key else gdelta
    assert not rec.matrix.states[0].positive
    gate = (b, L, H, K) if per_key else (b, L, H)
    inputs = [_n(b, L, H, K), _unit(b, L, H, K), _n(b, L, H, V),
              mx.random.uniform(-1, 1, gate), mx.random.uniform(0, 2, (b, L, H))]
    S0 = _n(b, H, K, V, scale=0.5)

    def ref(i, s):
        q, k, v, g, beta = i
        y, S = _delta_loop(q, k, v, beta if per_key else 2 * beta, s[0], decay=g)
        return [y], [S]

    _assert_matches(_runner(rec, seg=seg), ref, inputs, [S0])


@pytest.mark.parametrize("n", [1, 5, 16, 24])
def test_the_unit_lower_inverse_and_its_gradient(n):
    """The doubling rounds (n padded to a power of two) against numpy's inverse, and the
    hand-written VJP against the derivative of ``(I - A)⁻¹`` by finite differences."""
    import numpy as np

    from mlx_recgen.backends.mlx_matrix import unit_lower_inverse

    mx.random.seed(n)
    A = mx.tril(_n(3, n, n, scale=0.3), k=-1)
    want = np.linalg.inv(np.eye(n) - np.array(A, dtype=np.float64))
    assert np.abs(np.array(unit_lower_inverse(A)) - want).max() < 1e-5
    G = _n(3, n, n)
    grad = np.array(mx.grad(lambda a: mx.sum(unit_lower_inverse(a) * G))(A), dtype=np.float64)
    eps, Gn = 1e-4, np.array(G, dtype=np.float64)
    rows, cols = np.tril_indices(n, -1)
    for i, j in list(zip(rows, cols))[:6]:
        bump = np.array(A, dtype=np.float64)
        bump[:, i, j] += eps
        plus = np.linalg.inv(np.eye(n) - bump)
        bump[:, i, j] -= 2 * eps
        minus = np.linalg.inv(np.eye(n) - bump)
        fd = np.sum((plus - minus) * Gn, axis=(1, 2)) / (2 * eps)
        assert np.abs(grad[:, i, j] - fd).max() < 1e-3
    assert np.abs(np.triu(grad)).max() == 0  # A's free entries only


@rg.recurrence(lane="V", state={"S": "B H K V"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "beta": "B L H",
                       "mask": "B L"},
               outputs={"o": "B L H V"})
def masked_delta(S, q, k, v, beta, mask, i):
    """Padding holds the state (``where``): the read's weight and the added term are
    piecewise, their factor over the state axis shared by the branches."""
    r = rg.Sum(k[i] * S[i], i)
    S[i] = rg.where(mask, S[i] + rg.sigmoid(beta) * (v - r) * k[i], S[i])
    return {"o": rg.Sum(q[i] * S[i], i)}


@rg.recurrence(lane="P", state={"h": "B H P N"},
               inputs={"x": "B L H P", "dt": "B L H", "A": "H N", "Bm": "B L H N",
                       "C": "B L H N", "mask": "B L"},
               outputs={"y": "B L H P"})
def masked_ssd(h, x, dt, A, Bm, C, mask, n):
    """SSD whose padding holds the state (mlx-lm's masked scan): a piecewise decay."""
    h[n] = rg.where(mask, rg.exp(dt * A[n]) * h[n] + dt * Bm[n] * x, h[n])
    return {"y": rg.Sum(C[n] * h[n], n)}


def test_a_mask_that_holds_the_state():
    mx.random.seed(5)
    mask = mx.arange(L)[None] < mx.array([[L], [7]])
    keep = mask.astype(mx.float32)
    assert masked_delta.matrix.applies, masked_delta.matrix.reason
    assert masked_ssd.matrix.applies, masked_ssd.matrix.reason

    def run_delta(i, s):
        y, S = masked_delta(*i, mask, initial_state=s[0], return_state=True, backend="mlx",
                            schedule="matrix", seg=4)
        return [y], [S]

    def ref_delta(i, s):
        q, k, v, beta = i
        y, S = _delta_loop(q, k, v, mx.sigmoid(beta) * keep[..., None], s[0])
        return [y], [S]

    inputs = [_n(b, L, H, K), _unit(b, L, H, K), _n(b, L, H, V), _n(b, L, H)]
    _assert_matches(run_delta, ref_delta, inputs, [_n(b, H, K, V, scale=0.5)])

    def run_ssd(i, s):
        y, h = masked_ssd(*i, mask, initial_state=s[0], return_state=True, backend="mlx",
                          schedule="matrix", seg=4)
        return [y], [h]

    def ref_ssd(i, s):
        x, dt, A, Bm, C = i
        h, ys = s[0], []
        for t in range(L):
            m = keep[:, t, None, None, None]
            new = mx.exp(dt[:, t, :, None, None] * A[None, :, None, :]) * h + \
                dt[:, t, :, None, None] * Bm[:, t, :, None, :] * x[:, t, ..., None]
            h = m * new + (1 - m) * h
            ys.append(mx.sum(C[:, t, :, None, :] * h, axis=-1))
        return [mx.stack(ys, axis=1)], [h]

    P, N = 3, 4
    inputs = [_n(b, L, H, P), mx.random.uniform(0.05, 0.6, (b, L, H)),
              -mx.exp(_n(H, N, scale=0.5)), _n(b, L, H, N, scale=0.5), _n(b, L, H, N, scale=0.5)]
    _assert_matches(run_ssd, ref_ssd, inputs, [_n(b, H, P, N, scale=0.5)])


@rg.recurrence(lane="V", state={"S": "B H K V", "n": "B H K"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "beta": "B L H"},
               outputs={"o": "B L H V"})
def normalised_delta(S, n, q, k, v, beta, i):
    """Beside the delta rule's S, a state shared by the lanes with its own read and a decay:
    ``n <- 0.9 n + beta k (1 - kᵀ n)``; the output divides by a readout of it."""
    r = rg.Sum(k[i] * S[i], i)
    rn = rg.Sum(k[i] * n[i], i)
    S[i] = S[i] + beta * (v - r) * k[i]
    n[i] = 0.9 * n[i] + beta * (1 - rn) * k[i]
    return {"o": rg.Sum(q[i] * S[i], i) / (1 + rg.Sum(q[i] * n[i], i) ** 2)}


def test_a_shared_state_with_its_own_read():
    """Also the reference's sums: a lane-free body summed over the state axis stays lane-free,
    so a shared state's update keeps its shape."""
    mx.random.seed(9)
    inputs = [_n(b, L, H, K), _unit(b, L, H, K), _n(b, L, H, V), mx.random.uniform(0, 2, (b, L, H))]
    states = [_n(b, H, K, V, scale=0.5), _n(b, H, K, scale=0.5)]
    assert [len(st.low_rank) for st in normalised_delta.matrix.states] == [1, 1]

    def run(fn, **kw):
        def call(i, s):
            y, f = fn(*i, initial_state={"S": s[0], "n": s[1]}, return_state=True, **kw)
            return [y], [f["S"], f["n"]]
        return call

    def ref(i, s):
        q, k, v, beta = i
        S, n, ys = s[0], s[1], []
        for t in range(L):
            kt, bt = k[:, t], beta[:, t, :, None]
            r = mx.sum(kt[..., None] * S, axis=-2)
            S = S + bt[..., None] * kt[..., None] * (v[:, t] - r)[..., None, :]
            rn = mx.sum(kt * n, axis=-1, keepdims=True)
            n = 0.9 * n + bt * (1 - rn) * kt
            qn = mx.sum(q[:, t] * n, axis=-1, keepdims=True)
            ys.append(mx.sum(q[:, t][..., None] * S, axis=-2) / (1 + qn ** 2))
        return [mx.stack(ys, axis=1)], [S, n]

    _assert_matches(run(normalised_delta, backend="mlx", schedule="matrix", seg=4), ref, inputs,
                    states)
    _assert_matches(run(normalised_delta.reference), ref, inputs, states)


def test_transformations_through_the_solve():
    """``mx.vmap``, a second derivative and forward over reverse (a Hessian-vector product)
    through the hand-written VJPs of the inverse and the chunk chain."""
    mx.random.seed(10)
    rec = rg.load_spec("gated_deltanet")
    q, k, v = _n(b, L, H, K), _unit(b, L, H, K), _n(b, L, H, V)
    g, beta = mx.random.uniform(-0.3, 0, (b, L, H)), mx.random.uniform(0, 2, (b, L, H))

    def f(sch):
        return lambda k: rec(q, k, v, g, beta, backend="mlx", schedule=sch, seg=4)

    ks = mx.stack([k, _unit(b, L, H, K), _unit(b, L, H, K)])
    assert rel_err(mx.vmap(f("matrix"))(ks), mx.vmap(f("sequential"))(ks)) < TOL

    def second(sch):
        return mx.grad(lambda k: mx.sum(mx.grad(lambda k: mx.sum(f(sch)(k) ** 2))(k) ** 2))(k)

    assert rel_err(second("matrix"), second("sequential")) < 1e-4

    def hvp(sch):
        grad = mx.grad(lambda k: mx.sum(f(sch)(k) ** 2))
        return mx.jvp(grad, [k], [mx.ones_like(k)])[1][0]

    assert rel_err(hvp("matrix"), hvp("sequential")) < 1e-4


def test_non_finite_values_give_nan_never_a_finite_wrong_number():
    """An infinite beta, or keys that overflow the reads: the solve and the chunk products
    turn what they touch into NaN (docs/matrix.md); every output that stays finite equals the
    sequential schedule's."""
    mx.random.seed(11)
    rec = rg.load_spec("gated_deltanet")
    q, k, v = _n(1, 12, 2, K), _unit(1, 12, 2, K), _n(1, 12, 2, V)
    g, beta = mx.random.uniform(-0.3, 0, (1, 12, 2)), mx.random.uniform(0, 1, (1, 12, 2))
    inf_beta = mx.where(mx.arange(12)[None, :, None] == 5, float("inf"), beta)
    for args in ([q, k, v, g, inf_beta], [q, k * 1e20, v, g, beta]):
        want = rec(*args, backend="mlx", schedule="sequential")
        got = rec(*args, backend="mlx", schedule="matrix", seg=4)
        assert not mx.all(mx.isfinite(want)).item()
        finite = mx.isfinite(got)
        assert mx.all(mx.where(finite, mx.abs(got - want) <= 1e-5 * (1 + mx.abs(want)),
                               mx.isnan(got))).item()
