"""The affine analysis (``rec.time_parallel``) and the chunked schedule on specs beyond the
bundled ones: vector decay, a component block with parameters, two states, a nonlinear output
of an affine state, a lane-shared parameter. Each is checked against a hand-written MLX loop
(differentiated by MLX autodiff): outputs, final state and every gradient incl. the initial
state. Non-affine specs refuse ``schedule="chunked"`` and say why."""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_recgen as rg
from conftest import rel_err
from test_kernels import BACKENDS

TOL = 1e-5


# -- specs and their hand-written loops -------------------------------------------------------


@rg.recurrence(lane="V", state={"S": "B H K V"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "gk": "B L H K"},
               outputs={"o": "B L H V"})
def gla_vector(S, q, k, v, gk, i):
    """GLA with a decay per key channel (FLA's ``gk``)."""
    S[i] = gk[i] * S[i] + k[i] * v
    return {"o": rg.Sum(q[i] * S[i], i)}


def gla_vector_ref(q, k, v, gk, S):
    ys = []
    for t in range(q.shape[1]):
        S = gk[:, t][..., None] * S + k[:, t][..., None] * v[:, t][:, :, None, :]
        ys.append(mx.sum(q[:, t][..., None] * S, axis=2))
    return mx.stack(ys, axis=1), S


@rg.recurrence(lane="D", state={"h": "B D 2"},
               inputs={"nu": "D", "theta": "D", "x": "B L D 2"}, outputs={"y": "B L D"})
def complex_lru(h, nu, theta, x):
    """The LRU of Orvieto et al.: h <- exp(-exp(nu) + i theta) h + x, y = Re(h) (parameters
    without the time axis: their gradients sum over time, segments and batch)."""
    r = rg.exp(-rg.exp(nu))
    re, im = h[0], h[1]
    h[0] = r * (rg.cos(theta) * re - rg.sin(theta) * im) + x[0]
    h[1] = r * (rg.sin(theta) * re + rg.cos(theta) * im) + x[1]
    return {"y": h[0]}


def complex_lru_ref(nu, theta, x, h):
    r = mx.exp(-mx.exp(nu))
    re, im = h[..., 0], h[..., 1]
    ys = []
    for t in range(x.shape[1]):
        re, im = (r * (mx.cos(theta) * re - mx.sin(theta) * im) + x[:, t, :, 0],
                  r * (mx.sin(theta) * re + mx.cos(theta) * im) + x[:, t, :, 1])
        ys.append(re)
    return mx.stack(ys, axis=1), mx.stack([re, im], axis=-1)


@rg.recurrence(lane="V", state={"C": "B K V", "nrm": "B K V"},
               inputs={"q": "B L K", "k": "B L K", "v": "B L V", "f": "B L", "w": "K"},
               outputs={"h": "B L V"})
def mlstm_like(C, nrm, q, k, v, f, w, i):
    """Two affine states sharing a gate, a lane-shared parameter ``w``, and a nonlinear output
    (an mLSTM-style normalised read)."""
    C[i] = f * C[i] + w[i] * k[i] * v
    nrm[i] = f * nrm[i] + k[i]
    num = rg.Sum(q[i] * C[i], i)
    den = rg.Sum(q[i] * nrm[i], i)
    return {"h": num / rg.maximum(rg.abs(den), 1.0)}


def mlstm_like_ref(q, k, v, f, w, C, nrm):
    ys = []
    for t in range(q.shape[1]):
        ft = f[:, t][:, None, None]
        C = ft * C + (w * k[:, t])[:, :, None] * v[:, t][:, None, :]
        nrm = ft * nrm + k[:, t][:, :, None]
        num = mx.sum(q[:, t][:, :, None] * C, axis=1)
        den = mx.sum(q[:, t][:, :, None] * nrm, axis=1)
        ys.append(num / mx.maximum(mx.abs(den), 1.0))
    return mx.stack(ys, axis=1), (C, nrm)


@rg.recurrence(lane="P", state={"h": "B P N", "c": "B P"},
               inputs={"a": "B L N", "x": "B L P", "z": "B L P"}, outputs={"y": "B L P"})
def vector_and_scalar(h, c, a, x, z, n):
    """A vector state and a scalar state in separate blocks, an output nonlinear in both."""
    h[n] = rg.sigmoid(a[n]) * h[n] + x
    c = 0.9 * c + z
    return {"y": rg.tanh(rg.Sum(h[n], n)) * c}


def vector_and_scalar_ref(a, x, z, h, c):
    ys = []
    for t in range(a.shape[1]):
        h = mx.sigmoid(a[:, t])[:, None, :] * h + x[:, t][:, :, None]
        c = 0.9 * c + z[:, t]
        ys.append(mx.tanh(mx.sum(h, axis=-1)) * c)
    return mx.stack(ys, axis=1), (h, c)


@rg.recurrence(lane="D", state={"pos": "B D N", "vel": "B D N"},
               inputs={"damp": "B L D", "force": "B L N"}, outputs={"y": "B L D"})
def oscillator(pos, vel, damp, force, n):
    """A damped oscillator per state element: a 2x2 block spanning two state tensors."""
    p, v = pos[n], vel[n]
    pos[n] = p + 0.1 * v
    vel[n] = rg.sigmoid(damp) * v - 0.1 * p + force[n]
    return {"y": rg.Sum(pos[n] * pos[n], n)}


def oscillator_ref(damp, force, pos, vel):
    ys = []
    for t in range(damp.shape[1]):
        pos, vel = (pos + 0.1 * vel,
                    mx.sigmoid(damp[:, t])[..., None] * vel - 0.1 * pos + force[:, t][:, None, :])
        ys.append(mx.sum(pos * pos, axis=-1))
    return mx.stack(ys, axis=1), (pos, vel)


@rg.recurrence(lane="V", state={"S": "B K V"}, inputs={"k": "B L K", "v": "B L V"},
               outputs={"o": "B L V"})
def normalized_decay(S, k, v, i):
    """A multiplier read from a reduction that does not read the state (Σ k², so the summary
    kernel computes it too)."""
    norm = rg.Sum(k[i] * k[i], i)
    S[i] = rg.exp(-norm) * S[i] + k[i] * v
    return {"o": rg.Sum(S[i], i) * v}


def normalized_decay_ref(k, v, S):
    ys = []
    for t in range(k.shape[1]):
        decay = mx.exp(-mx.sum(k[:, t] * k[:, t], axis=-1))
        S = decay[:, None, None] * S + k[:, t][:, :, None] * v[:, t][:, None, :]
        ys.append(mx.sum(S, axis=1) * v[:, t])
    return mx.stack(ys, axis=1), S


def _n(*shape, scale=1.0):
    return scale * mx.random.normal(shape)


def _u(lo, hi, *shape):
    return mx.random.uniform(lo, hi, shape)


# (recurrence, reference, inputs, initial states)
def _case(name):
    b, L = 2, 23
    if name == "gla_vector":
        H, K, V = 2, 4, 37
        ins = [_n(b, L, H, K, scale=0.5), _n(b, L, H, K, scale=0.5), _n(b, L, H, V),
               _u(0.6, 1.0, b, L, H, K)]
        return gla_vector, gla_vector_ref, ins, [_n(b, H, K, V, scale=0.5)]
    if name == "complex_lru":
        D = 9
        ins = [_u(-2.0, 0.5, D), _u(-3.0, 3.0, D), _n(b, L, D, 2)]
        return complex_lru, complex_lru_ref, ins, [_n(b, D, 2)]
    if name == "mlstm_like":
        K, V = 3, 6
        ins = [_n(b, L, K), _n(b, L, K), _n(b, L, V), _u(0.7, 1.0, b, L), _n(K)]
        return mlstm_like, mlstm_like_ref, ins, [_n(b, K, V, scale=0.5), _n(b, K, V, scale=0.5)]
    if name == "normalized_decay":
        K, V = 3, 7
        return (normalized_decay, normalized_decay_ref, [_n(b, L, K, scale=0.5), _n(b, L, V)],
                [_n(b, K, V)])
    if name == "oscillator":
        D, N = 6, 3
        ins = [_n(b, L, D), _n(b, L, N, scale=0.3)]
        return oscillator, oscillator_ref, ins, [_n(b, D, N), _n(b, D, N)]
    P, N = 5, 3
    ins = [_n(b, L, N), _n(b, L, P), _n(b, L, P)]
    return vector_and_scalar, vector_and_scalar_ref, ins, [_n(b, P, N), _n(b, P)]


CUSTOM = ["gla_vector", "complex_lru", "mlstm_like", "vector_and_scalar", "oscillator",
          "normalized_decay"]


# -- the analysis ------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["ssd", "gla", "rglru", "rotlru"])
def test_bundled_specs_are_time_parallel(name):
    rec = rg.load_spec(name)
    assert rec.time_parallel
    assert "chunked" in rec.adjoint_ir().splitlines()[-1]


def test_blocks_and_multipliers():
    ssd = rg.load_spec("ssd").affine
    assert [b.size for b in ssd.blocks] == [1] and ssd.blocks[0].pointwise  # exp(delta A[n])
    gla = rg.load_spec("gla").affine
    assert not gla.blocks[0].pointwise  # one gate per lane serves every state element
    rot = rg.load_spec("rotlru").affine
    assert [b.size for b in rot.blocks] == [2]
    pair = vector_and_scalar.affine
    assert sorted(b.size for b in pair.blocks) == [1, 1] and len(pair.blocks) == 2
    assert gla_vector.affine.blocks[0].pointwise
    assert [b.size for b in oscillator.affine.blocks] == [2]  # across the tensors pos and vel
    assert all(rec.time_parallel for rec in (complex_lru, mlstm_like, normalized_decay))


def _not_parallel():
    @rg.recurrence(lane="P", state={"h": "B P N"}, inputs={"k": "B L N", "v": "B L P"},
                   outputs={"y": "B L P"})
    def delta_rule(h, k, v, n):
        r = rg.Sum(k[n] * h[n], n)
        h[n] = h[n] + (v - rg.tanh(r)) * k[n]  # a nonlinear read: no longer low rank
        return {"y": rg.Sum(h[n], n)}

    @rg.recurrence(lane="D", state={"h": "B D"}, inputs={"x": "B L D"}, outputs={"y": "B L D"})
    def tanh_rnn(h, x):
        h = rg.tanh(0.5 * h + x)
        return {"y": h}

    @rg.recurrence(lane="D", state={"m": "B D"}, inputs={"x": "B L D"}, outputs={"y": "B L D"})
    def running_max(m, x):
        m = rg.maximum(m, x)
        return {"y": m}

    @rg.recurrence(lane="D", state={"h": "B D", "c": "B D N"},
                   inputs={"x": "B L D", "k": "B L N"}, outputs={"y": "B L D"})
    def coupled(h, c, x, k, n):
        c[n] = 0.9 * c[n] + h * k[n]
        h = 0.5 * h + x
        return {"y": h + rg.Sum(c[n], n)}

    return {"delta_rule": (delta_rule, "not linear in it"), "tanh_rnn": (tanh_rnn, "not affine"),
            "running_max": (running_max, "not affine"), "coupled": (coupled, "block-diagonal")}


@pytest.mark.parametrize("name", ["delta_rule", "tanh_rnn", "running_max", "coupled"])
def test_non_affine_specs_refuse_chunked(name):
    rec, why = _not_parallel()[name]
    assert not rec.time_parallel and why in rec.affine.reason
    assert "sequential only" in rec.adjoint_ir().splitlines()[-1]
    spec = rec.spec
    sizes = {a: 3 for a in (*spec.batch_axes, spec.lane, spec.time)}
    if spec.state_axis:
        sizes[spec.state_axis] = 3
    args = [mx.random.normal(tuple(a if isinstance(a, int) else sizes[a] for a in t.axes))
            for t in spec.inputs.values()]
    with pytest.raises(ValueError, match="state-affine"):
        rec(*args, backend="metal-sim", schedule="chunked")
    rec(*args, backend="mlx", schedule="auto")  # auto falls back to the sequential schedule


def test_schedule_argument_is_checked():
    rec = rg.load_spec("rglru")
    a, x = mx.random.uniform(0.5, 0.9, (1, 4, 3)), mx.random.normal((1, 4, 3))
    with pytest.raises(ValueError, match="schedule must be one of"):
        rec(a, x, schedule="parallel")
    # the mlx backend runs the chunked schedule too (its chunked form)
    assert mx.allclose(rec(a, x, backend="mlx", schedule="chunked", seg=2), rec.reference(a, x),
                       atol=1e-6)


def test_auto_schedule_choice():
    from mlx_recgen.schedule import choose

    rglru, delta = rg.load_spec("rglru"), _not_parallel()["delta_rule"][0]
    assert choose(rglru, {"B": 8, "L": 4096, "D": 1024}, "auto", None, "metal") == ("chunked", 256)
    # on CUDA the scan runs where the chunked schedule would (schedule.SCAN_AUTO_BACKENDS)
    assert choose(rglru, {"B": 8, "L": 4096, "D": 1024}, "auto", None, "cuda") == ("scan", 8)
    assert choose(rglru, {"B": 8, "L": 4096, "D": 1024}, "auto", None, "mlx")[0] == "sequential"
    assert choose(rglru, {"B": 1, "L": 12, "D": 8}, "auto", 8, "cuda")[0] == "sequential"
    assert choose(delta, {"B": 8, "L": 4096, "P": 64, "N": 16}, "auto", None, "cuda") == \
        ("sequential", 32)
    # the chunk's recomputed states must fit a thread's budget: 16 steps of 64 floats (Metal;
    # on CUDA this GLA takes the matrix schedule, schedule.matrix_pays)
    gla = rg.load_spec("gla")
    assert choose(gla, {"B": 3, "L": 2048, "H": 12, "K": 64, "V": 64}, "auto", None, "metal") == \
        ("chunked", 16)
    # 128 instances x 64 lanes x 64 state floats: one sequential step already fills the GPU
    assert choose(gla, {"B": 8, "L": 4096, "H": 16, "K": 64, "V": 64}, "auto", None, "metal")[0] \
        == "sequential"
    assert choose(gla, {"B": 8, "L": 4096, "H": 16, "K": 64, "V": 64}, "chunked", None,
                  "cuda") == ("chunked", 16)


# -- the chunked kernels on custom affine specs -----------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("seg", [1, 4, 23])
@pytest.mark.parametrize("name", CUSTOM)
def test_chunked_custom_specs_match_hand_loops(backend, name, seg):
    rec, ref, inputs, states = _case(name)
    n = len(inputs)
    single = len(states) == 1

    def ours(*a):
        h0 = a[n] if single else dict(zip(rec.spec.states, a[n:]))
        y, h = rec(*a[:n], initial_state=h0, return_state=True, backend=backend, seg=seg,
                   schedule="chunked")
        return y, (h if single else tuple(h[k] for k in rec.spec.states))

    def theirs(*a):
        return ref(*a)

    y0, h0 = theirs(*inputs, *states)
    hs = h0 if isinstance(h0, tuple) else (h0,)
    Wy = mx.random.normal(y0.shape)
    Wh = [mx.random.normal(h.shape) for h in hs]

    def loss(fn):
        def f(*a):
            y, h = fn(*a)
            h = h if isinstance(h, tuple) else (h,)
            return mx.sum(y * Wy) + sum(mx.sum(x * w) for x, w in zip(h, Wh))
        return f

    argnums = tuple(range(n + len(states)))
    ry, rh = theirs(*inputs, *states)
    ky, kh = ours(*inputs, *states)
    rg_ = mx.grad(loss(theirs), argnums=argnums)(*inputs, *states)
    kg = mx.grad(loss(ours), argnums=argnums)(*inputs, *states)
    assert rel_err(ky, ry) < TOL
    for a, b in zip(kh if isinstance(kh, tuple) else (kh,), rh if isinstance(rh, tuple) else (rh,)):
        assert rel_err(a, b) < TOL
    for i, (a, b) in enumerate(zip(kg, rg_)):
        assert a.shape == b.shape
        assert rel_err(a, b) < TOL, f"gradient {i} of {name}"


@pytest.mark.parametrize("name", ["rglru", "mingru", "rotlru", "complex_lru"])
def test_plain_summary_is_the_summary_in_ieee_products(name):
    """``affine.plain_summary_program``: for forms of 1 x 1 blocks, the summary step with plain
    products and no zero-hit counts, which run over finite nonzero multipliers gives the end
    state from zero and the product of the multipliers, as a hand loop of the update does; for
    forms with larger blocks, none (the kernels keep the careful products there)."""
    from mlx_recgen.affine import compose, scale, zero_hit
    from mlx_recgen.ir import Loop
    from mlx_recgen.render.mlx_ops import render_mlx

    rec = rg.load_spec(name)
    summary = rec.segment_summary
    if any(block.size > 1 for block in rec.affine.blocks):
        assert summary.plain is None
        return
    plain = summary.plain
    exprs = [b.expr for st in plain.statements for b in (st.body if isinstance(st, Loop) else [st])]
    assert not any(e.has(scale, compose, zero_hit) for e in exprs)
    hits = {p.slot for p in summary.products if p.hits}
    assert not {st.slot for st in plain.statements if hasattr(st, "slot")} & hits

    if name != "rglru":
        return
    # rglru: s <- a s + x from zero and P <- a P from one, against the hand loop
    step = render_mlx(plain, "plain_summary")
    mx.random.seed(3)
    a = mx.random.uniform(0.5, 1.5, (12, 5)) * mx.where(mx.random.uniform(shape=(12, 5)) < 0.5,
                                                          -1.0, 1.0)
    x = mx.random.normal((12, 5))
    values = {"h": mx.zeros((5,)), "P0_00": mx.ones((5,))}
    s, P = mx.zeros((5,)), mx.ones((5,))
    for t in range(12):
        env = {"a": a[t], "x": x[t], **values}
        out = step.fn(*[env[str(sym)] for sym in step.args])
        for (kind, slot), v in zip(step.results, out):
            values[slot.tensor] = v
        s, P = a[t] * s + x[t], a[t] * P
    assert rel_err(values["h"], s) < 1e-6 and rel_err(values["P0_00"], P) < 1e-6
