"""The matrix schedule (``schedule="matrix"``: ``matrix.analyse`` and ``backends/mlx_matrix.py``)
against loops written from each paper (``references``), independent of the compiler: outputs,
final states and the gradient of every input and initial state, with L not a multiple of the
chunk, L shorter than one chunk, sub-chunks of vector decays, decays near 0, near 1, negative
and exactly 0, and custom specs of the class (two states with a shared normaliser, grouped
heads, an output nonlinearity, a readout of the state before the update)."""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_recgen as rg
from conftest import rel_err
from mlx_recgen.schedule import choose
from references import ZOO_REFERENCES, gla_ref, ssd_ref
from test_zoo import _draw, _from_spec, _reference, _to_spec, _values_and_grads

TOL = 1e-5
# the zoo's specs of the matrix form (the last three are delta rules: test_matrix_delta.py)
MATRIX_ZOO = ["mamba2", "rwkv6", "hgrn2", "retnet", "deltanet", "gated_deltanet", "rwkv7"]
OUTSIDE = {  # spec -> what the refusal names
    "mamba1": "varies along the lane axis",
    "rglru": "no state axis",
    "rotlru": "no state axis",
    "s4d": "2x2",
    "mlstm": "not state-affine",
}


def _matrix(name, seg):
    rec = rg.load_spec(name)

    def run(inputs, states):
        y, finals = rec(*inputs, initial_state=_to_spec(name, states), return_state=True,
                        backend="mlx", schedule="matrix", seg=seg)
        return [y], _from_spec(name, finals)

    return run


def _assert_matches(fn, ref, inputs, states, tol=TOL):
    ref_values, weights, ref_grads = _values_and_grads(ref, inputs, states)
    values, _, grads = _values_and_grads(fn, inputs, states, weights)
    errors = [rel_err(v, r) for v, r in zip(values, ref_values)]
    errors += [rel_err(g, r) for g, r in zip(grads, ref_grads)]
    assert max(errors) < tol, errors


@pytest.mark.parametrize("seg", [4, 16])  # L = 11: a partial last chunk; one short chunk
@pytest.mark.parametrize("name", MATRIX_ZOO)
def test_zoo_matches_the_paper(name, seg):
    mx.random.seed(sum(map(ord, name)))
    inputs, states = _draw(name)
    _assert_matches(_matrix(name, seg), lambda i, s: _reference(name, i, s), inputs, states)


@pytest.mark.parametrize("name", MATRIX_ZOO)
def test_zoo_membership(name):
    assert rg.load_spec(name).matrix.applies
    assert "matrix" in rg.load_spec(name).adjoint_ir().splitlines()[-1]


@pytest.mark.parametrize("name, why", sorted(OUTSIDE.items()))
def test_outside_the_class_is_refused_with_the_reason(name, why):
    rec = rg.load_spec(name)
    assert not rec.matrix.applies and why in rec.matrix.reason
    assert "not matrix" in rec.adjoint_ir() or "sequential only" in rec.adjoint_ir()
    args = [mx.ones([3 if isinstance(a, str) else a for a in t.axes])
            for t in rec.spec.inputs.values()]
    with pytest.raises(ValueError, match="schedule='matrix' needs the matrix form"):
        rec(*args, backend="mlx", schedule="matrix")


def _ssd_inputs(b, L, H, P, N, decay=(0.05, 0.6)):
    return [mx.random.normal((b, L, H, P)), mx.random.uniform(*decay, (b, L, H)),
            0.5 * mx.random.normal((b, L, H, N)), 0.5 * mx.random.normal((b, L, H, N)),
            -mx.exp(0.5 * mx.random.normal((H, N)))]


@pytest.mark.parametrize("sub", [2, 4])
def test_vector_decay_across_sub_chunks(sub, monkeypatch):
    """SSD (a decay per state element): chunks of 8 cut into sub-chunks of 2 or 4, so the
    weights between sub-chunks go through the boundary decays."""
    from mlx_recgen.backends import mlx_matrix

    monkeypatch.setattr(mlx_matrix, "SUB", sub)
    inputs = _ssd_inputs(2, 21, 2, 3, 4)
    h0 = 0.5 * mx.random.normal((2, 2, 3, 4))
    rec = rg.load_spec("ssd")

    def run(i, s):
        y, h = rec(*i, initial_state=s[0], return_state=True, backend="mlx", schedule="matrix",
                   seg=8)
        return [y], [h]

    def ref(i, s):
        y, h = ssd_ref(*i, h0=s[0])
        return [y], [h]

    _assert_matches(run, ref, inputs, [h0])


@pytest.mark.parametrize("decay", [(1e-4, 1e-3), (0.999, 1.0), (-0.99, -0.5), (-1.0, 1.0)],
                         ids=["near0", "near1", "negative", "both-signs"])
def test_scalar_and_vector_decays_of_any_size_and_sign(decay):
    """GLA's scalar gate and HGRN2's per-element forget gate drawn near 0, near 1, negative
    and of both signs (the sign is carried apart from the log of the magnitude)."""
    b, L, H, K, V = 2, 19, 2, 4, 3
    q, k = mx.random.normal((b, L, H, K)), mx.random.normal((b, L, H, K))
    v, S0 = mx.random.normal((b, L, H, V)), mx.random.normal((b, H, K, V))
    g = mx.random.uniform(*decay, (b, L, H))
    gla = rg.load_spec("gla")

    def run(i, s):
        y, S = gla(*i, initial_state=s[0], return_state=True, backend="mlx", schedule="matrix",
                   seg=8)
        return [y], [S]

    _assert_matches(run, lambda i, s: [[x] for x in gla_ref(*i, S0=s[0])], [q, k, v, g], [S0])

    f = mx.random.uniform(*decay, (b, L, H, K))
    hgrn2 = rg.load_spec("hgrn2")

    def run2(i, s):
        y, S = hgrn2(*i, initial_state=s[0], return_state=True, backend="mlx",
                     schedule="matrix", seg=8)
        return [y], [S]

    # near 1, HGRN2's gradient of f is a near-cancelling difference of its path through the
    # decay (log f) and through the input (1 - f): measured 3.9e-5 (sequential 6e-8)
    _assert_matches(run2, lambda i, s: [[x] for x in ZOO_REFERENCES["hgrn2"](*i, s[0])],
                    [q, f, v], [S0], tol=1e-4 if decay == (0.999, 1.0) else TOL)


def test_a_zero_decay_erases_the_state():
    b, L, H, K, V = 1, 12, 2, 3, 4
    q, k = mx.random.normal((b, L, H, K)), mx.random.normal((b, L, H, K))
    v, S0 = mx.random.normal((b, L, H, V)), mx.random.normal((b, H, K, V))
    g = mx.random.uniform(0.5, 1.0, (b, L, H))
    g[:, 5] = 0.0
    rec = rg.load_spec("gla")
    y, S = rec(q, k, v, g, initial_state=S0, return_state=True, backend="mlx", schedule="matrix",
               seg=8)
    y_ref, S_ref = gla_ref(q, k, v, g, S0=S0)
    assert rel_err(y, y_ref) < TOL and rel_err(S, S_ref) < TOL


@rg.recurrence(lane="V", state={"C": "B H K V", "n": "B H K"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "igate": "B L H",
                       "fgate": "B L H"},
               outputs={"h": "B L H V"})
def mlstm_plain(C, n, q, k, v, igate, fgate, j):
    """mLSTM without the stabiliser (Beck et al. 2024): a matrix memory and a shared
    normaliser, the output divided by the normaliser's readout."""
    f = rg.sigmoid(fgate)
    i = rg.exp(igate)
    C[j] = f * C[j] + i * k[j] * v
    n[j] = f * n[j] + i * k[j]
    return {"h": rg.Sum(q[j] * C[j], j) / rg.maximum(abs(rg.Sum(q[j] * n[j], j)), 1.0)}


def test_two_states_a_shared_normaliser_and_a_nonlinear_output():
    b, L, H, K, V = 2, 13, 2, 3, 4
    q, k = 0.5 * mx.random.normal((b, L, H, K)), 0.5 * mx.random.normal((b, L, H, K))
    v = mx.random.normal((b, L, H, V))
    ig, fg = 0.5 * mx.random.normal((b, L, H)), 2.0 + mx.random.normal((b, L, H))
    assert mlstm_plain.matrix.applies
    assert "K (shared by the lanes)" in mlstm_plain.matrix.describe()

    def run(i, s):
        h, st = mlstm_plain(*i, return_state=True, backend="mlx", schedule="matrix", seg=4)
        return [h], [st["C"], st["n"]]

    def ref(i, s):
        q, k, v, ig, fg = i
        C, n = mx.zeros((b, H, K, V)), mx.zeros((b, H, K))
        hs = []
        for t in range(L):
            f, a = mx.sigmoid(fg[:, t])[..., None], mx.exp(ig[:, t])[..., None]
            C = f[..., None] * C + (a * k[:, t])[..., None] * v[:, t][:, :, None, :]
            n = f * n + a * k[:, t]
            num = mx.sum(q[:, t][..., None] * C, axis=-2)
            den = mx.maximum(mx.abs(mx.sum(q[:, t] * n, axis=-1)), 1.0)
            hs.append(num / den[..., None])
        return [mx.stack(hs, axis=1)], [C, n]

    _assert_matches(run, ref, [q, k, v, ig, fg], [])
    # the bundled mLSTM is stabilised (a running max): outside the class, refused
    assert not rg.load_spec("mlstm").matrix.applies


@rg.recurrence(lane="P", state={"h": "B H P N"},
               inputs={"x": "B L H P", "dt": "B L H", "A": "H N", "B": "B L G N",
                       "C": "B L G N"},
               outputs={"y": "B L H P"}, groups={"G": "H"})
def grouped_ssd(h, x, dt, A, B, C, n):
    """SSD with a decay per state element and B, C shared by groups of heads, gated output."""
    h[n] = rg.exp(dt * A[n]) * h[n] + dt * B[n] * x
    y = rg.Sum(C[n] * h[n], n)
    return {"y": y * rg.sigmoid(y)}


def test_grouped_heads_and_an_output_gate():
    b, L, H, G, P, N = 2, 15, 4, 2, 3, 5
    x, dt = mx.random.normal((b, L, H, P)), mx.random.uniform(0.05, 0.5, (b, L, H))
    A = -mx.exp(0.5 * mx.random.normal((H, N)))
    B, C = 0.5 * mx.random.normal((b, L, G, N)), 0.5 * mx.random.normal((b, L, G, N))
    h0 = 0.5 * mx.random.normal((b, H, P, N))

    def run(i, s):
        y, h = grouped_ssd(*i, initial_state=s[0], return_state=True, backend="mlx",
                           schedule="matrix", seg=4)
        return [y], [h]

    def ref(i, s):
        x, dt, A, B, C = i
        Bh, Ch = mx.repeat(B, H // G, axis=2), mx.repeat(C, H // G, axis=2)
        h, ys = s[0], []
        for t in range(L):
            d = mx.exp(dt[:, t][..., None] * A)  # (b, H, N)
            h = d[:, :, None, :] * h + (dt[:, t][..., None, None] * Bh[:, t][:, :, None, :]
                                        * x[:, t][..., None])
            y = mx.sum(Ch[:, t][:, :, None, :] * h, axis=-1)
            ys.append(y * mx.sigmoid(y))
        return [mx.stack(ys, axis=1)], [h]

    _assert_matches(run, ref, [x, dt, A, B, C], [h0])


def test_reruns_are_bit_identical_and_other_backends_run_the_same_ops(monkeypatch):
    monkeypatch.setenv("MLX_RECGEN_MATRIX_KERNELS", "0")
    mx.random.seed(5)
    inputs = _ssd_inputs(1, 40, 2, 4, 8)
    rec = rg.load_spec("ssd")
    a = rec(*inputs, backend="mlx", schedule="matrix")
    b = rec(*inputs, backend="mlx", schedule="matrix")
    assert mx.array_equal(a, b).item()
    # the matrix kernels off: the simulator backend runs the same MLX ops
    c = rec(*inputs, backend="metal-sim", schedule="matrix")
    assert mx.array_equal(a, c).item()
    with pytest.raises(ValueError, match="not schedule='matrix'"):
        rec(*inputs, backend="metal-sim", schedule="matrix", threads=64)


def test_auto_takes_the_matrix_form_where_it_was_measured_faster():
    """``auto`` on CUDA runs the matrix schedule for a scalar decay with enough work (GLA at
    B3 H12 L2048 and B8 H16 L4096, Mamba-2, RetNet), and not: below two chunks or
    ``MATRIX_AUTO_MIN_WORK`` instance-steps, with a chunk length of the caller's, for a decay
    per state element (SSD) or a delta rule, nor on Metal or the pure-MLX backend."""
    from mlx_recgen.schedule import MATRIX_AUTO_MIN_WORK, choose, matrix_pays

    gla = rg.load_spec("gla")
    b3 = {"B": 3, "L": 2048, "H": 12, "K": 64, "V": 64}
    b8 = {"B": 8, "L": 4096, "H": 16, "K": 64, "V": 64}
    for sizes in (b3, b8):
        assert choose(gla, sizes, "auto", None, "cuda") == ("matrix", 64)
        for backend in ("metal", "metal-sim", "mlx"):
            assert choose(gla, sizes, "auto", None, backend)[0] != "matrix"
    assert choose(gla, b3, "auto", 16, "cuda")[0] != "matrix"  # the caller's chunk length
    assert not matrix_pays(gla, {**b3, "L": 127})  # under two chunks
    small = {**b3, "B": 1, "H": 1, "L": MATRIX_AUTO_MIN_WORK // 2}
    assert not matrix_pays(gla, small) and matrix_pays(gla, {**small, "L": MATRIX_AUTO_MIN_WORK})
    for name in ("mamba2", "retnet"):
        rec = rg.load_spec(name)
        sizes = {a: 8 for a in rec.spec.batch_axes}
        sizes.update({rec.spec.time: 4096, rec.spec.lane: 64, rec.spec.state_axis: 64})
        assert choose(rec, sizes, "auto", None, "cuda")[0] == "matrix", name
    for name in ("ssd", "hgrn2", "gated_deltanet", "deltanet", "rwkv7"):  # vector decay, delta
        rec = rg.load_spec(name)
        sizes = {a: 8 for a in rec.spec.batch_axes}
        sizes.update({rec.spec.time: 4096, rec.spec.lane: 64, rec.spec.state_axis: 64})
        assert not matrix_pays(rec, sizes), name
        assert choose(rec, sizes, "auto", None, "cuda")[0] != "matrix", name


@pytest.mark.parametrize("backend", ["mlx", pytest.param("metal-sim", marks=pytest.mark.sim)])
def test_one_step_runs_what_auto_picks(backend):
    """A decode step (L = 1) asked for as ``matrix`` runs what ``auto`` picks there (the decode
    path, the sequential kernel): the same state and outputs, bit for bit, and gradients."""
    mx.random.seed(7)
    inputs = _ssd_inputs(2, 1, 3, 4, 8)
    h0 = mx.random.normal((2, 3, 4, 8))
    rec = rg.load_spec("ssd")
    assert choose(rec, {"B": 2, "L": 1, "H": 3, "P": 4, "N": 8}, "matrix", None, backend)[0] \
        != "matrix"
    assert choose(rec, {"B": 2, "L": 2, "H": 3, "P": 4, "N": 8}, "matrix", None, backend)[0] \
        == "matrix"

    def run(schedule, h=h0):
        return rec(*inputs, initial_state=h, return_state=True, backend=backend,
                   schedule=schedule)

    for a, b in zip(run("matrix"), run("auto")):
        assert mx.array_equal(a, b).item()

    def grad(schedule):
        return mx.grad(lambda h: sum(mx.sum(o * o) for o in run(schedule, h)))(h0)

    ref = mx.grad(lambda h: sum(mx.sum(o * o) for o in
                                rec.reference(*inputs, initial_state=h,
                                              return_state=True)))(h0)
    assert rel_err(grad("matrix"), ref) < TOL


def test_forward_mode_and_second_order():
    mx.random.seed(6)
    inputs = _ssd_inputs(1, 10, 2, 3, 4)
    rec = rg.load_spec("ssd")
    t = [mx.random.normal(x.shape) for x in inputs]
    f = lambda sch: (lambda *a: rec(*a, backend="mlx", schedule=sch, seg=4))  # noqa: E731
    _, jm = mx.jvp(f("matrix"), inputs, t)
    _, js = mx.jvp(f("sequential"), inputs, t)
    assert rel_err(jm[0], js[0]) < TOL
    w = mx.random.normal((1, 10, 2, 3))
    u, delta, rest = inputs[0], inputs[1], inputs[2:]
    g2 = lambda sch: mx.grad(lambda d: mx.sum(mx.grad(  # noqa: E731
        lambda d: mx.sum(f(sch)(u, d, *rest) * w))(d) ** 2))(delta)
    assert rel_err(g2("matrix"), g2("sequential")) < 1e-4
    # forward over reverse (a Hessian-vector product), through a sign carried at run time
    gla = rg.load_spec("gla")
    q, k, v = (mx.random.normal((1, 9, 2, 3)) for _ in range(3))
    g = mx.random.uniform(-1.0, 1.0, (1, 9, 2))
    hvp = lambda sch: mx.jvp(lambda g: mx.grad(lambda g: mx.sum(gla(  # noqa: E731
        q, k, v, g, backend="mlx", schedule=sch, seg=4) ** 2))(g), [g], [mx.ones_like(g)])[1][0]
    assert rel_err(hvp("matrix"), hvp("sequential")) < 1e-4


def test_non_finite_values_give_nan_never_a_finite_wrong_number():
    """An infinite gate or an overflowing state: the chunk products turn what they touch into
    NaN (docs/matrix.md); every output that stays finite equals the sequential schedule's."""
    gla = rg.load_spec("gla")
    q, k, v = (mx.random.normal((1, 12, 2, 3)) for _ in range(3))
    g = mx.random.uniform(0.3, 0.9, (1, 12, 2))
    g[0, 5, 0] = float("inf")
    for args in ([q, k, v, g], [q * 1e20, k * 1e20, v, mx.abs(g)]):
        want = gla(*args, backend="mlx", schedule="sequential", seg=4)
        got = gla(*args, backend="mlx", schedule="matrix", seg=4)
        assert not mx.all(mx.isfinite(want)).item()
        finite = mx.isfinite(got)
        assert mx.all(mx.where(finite, mx.abs(got - want) <= 1e-5 * (1 + mx.abs(want)),
                               mx.isnan(got))).item()


@pytest.mark.parametrize("backend", ["mlx", pytest.param("metal-sim", marks=pytest.mark.sim)])
def test_growing_decays_give_gradients_right_or_nan(backend):
    """Decays above 1 (Mamba-2 with ``dt * A`` of both signs, up to 9): states of 1e20 and more
    that stay finite step by step. Every gradient entry of the matrix schedule is the loop's
    within 1e-4 of the gradient's scale, or NaN where the form's cancelling terms leave the
    fp32 range (the MLX-op form does so at these seeds; docs/matrix.md), never a finite wrong
    number."""
    import numpy as np

    mamba2 = rg.load_spec("mamba2")
    sizes = dict(B=2, L=70, H=2, P=2, G=1, N=2)

    def loss(fn):
        def f(*a):
            y = fn(*a)
            return mx.sum(y * mx.cos(mx.arange(y.size).reshape(y.shape)))
        return f

    for seed in (10, 25):
        rng = np.random.default_rng(seed)
        inputs = [mx.array(rng.uniform(-3, 3, tuple(sizes[a] for a in t.axes)).astype(np.float32))
                  for t in mamba2.spec.inputs.values()]
        every = tuple(range(len(inputs)))
        want = mx.grad(loss(mamba2.reference), argnums=every)(*inputs)
        assert all(mx.all(mx.isfinite(w)).item() for w in want)
        got = mx.grad(loss(lambda *a: mamba2(*a, backend=backend, schedule="matrix", seg=64)),
                      argnums=every)(*inputs)
        for g, w in zip(got, want):
            close = mx.abs(g - w) <= 1e-4 * mx.max(mx.abs(w))
            assert mx.all(mx.where(mx.isfinite(g), close, mx.isnan(g))).item()


def test_chunk_products_match_matmul_with_their_transforms():
    """``matrix_chunks.product``, the chunk products' matmul (on the CPU with its operands
    passed row-major, the VJP's included): values, gradients of both operands (transposed and
    broadcast ones), a jvp, a vmap and a second derivative equal those of ``x @ y``."""
    from mlx_recgen.backends.matrix_chunks import product

    with mx.stream(mx.cpu):
        x = mx.random.normal((3, 1, 5, 4))  # broadcast over the second axis
        y = mx.swapaxes(mx.random.normal((2, 6, 4)), -1, -2)  # transposed, broadcast over the first
        w = mx.random.normal((3, 2, 5, 6))

        def loss(mm):
            return lambda x, y: mx.sum(mm(x, y) * w) + mx.sum(mm(x, y) ** 2)

        assert rel_err(product(x, y), x @ y) < 1e-6
        got = mx.grad(loss(product), argnums=(0, 1))(x, y)
        want = mx.grad(loss(mx.matmul), argnums=(0, 1))(x, y)
        assert [g.shape for g in got] == [x.shape, y.shape]
        assert max(rel_err(g, r) for g, r in zip(got, want)) < 1e-5
        dx, dy = mx.random.normal(x.shape), mx.random.normal(y.shape)
        assert rel_err(mx.jvp(product, [x, y], [dx, dy])[1][0],
                       mx.jvp(mx.matmul, [x, y], [dx, dy])[1][0]) < 1e-5
        xs = mx.random.normal((7, 5, 4))
        assert rel_err(mx.vmap(product, in_axes=(0, None))(xs, y[0]), xs @ y[0]) < 1e-6

        def second(mm):
            return mx.grad(lambda x: mx.sum(mx.grad(lambda x: loss(mm)(x, y))(x) ** 2))(x)

        assert rel_err(second(product), second(mx.matmul)) < 1e-5


def test_instance_scalars_go_to_the_value_side_and_a_scalar_decay_leaves_the_readout():
    """Mamba-2: ``dt`` (free of the state and the lane axis) goes to ``b``, so ``a = B`` and
    ``c = C`` stay per group; the scalar decay read after the update leaves ``c`` (applied to
    the readout's row); a vector decay stays in ``c`` (HGRN2); numbers stay on ``a``."""
    import sympy
    form = rg.load_spec("mamba2").matrix
    sym = {s.name: s for s in rg.load_spec("mamba2").spec.symbols.values()}
    (a, b), = form.states[0].terms
    assert a == sym["B"] and b == sym["dt"] * sym["x"]
    ro, = form.readouts
    assert ro.coefficients == {sym["h"]: sym["C"]} and ro.decayed == {sym["h"]}
    hgrn2 = rg.load_spec("hgrn2").matrix
    f = {s.name: s for s in rg.load_spec("hgrn2").spec.symbols.values()}
    assert hgrn2.states[0].terms == ((1 - f["f"], f["i"]),)
    assert not hgrn2.readouts[0].decayed
    assert sympy.diff(hgrn2.readouts[0].coefficients[f["S"]], f["f"]) != 0


@rg.recurrence(lane="P", state={"h": "B H P N"},
               inputs={"x": "B L H P", "g": "B L H", "B": "B L G N", "C": "B L G N",
                       "E": "B L H N"},
               outputs={"y": "B L H P", "z": "B L H P"}, groups={"G": "H"})
def grouped_scalar(h, x, g, B, C, E, n):
    """A scalar decay of either sign with B and C per group of heads: the readout ``y`` reads
    the state after the update with a per-group coefficient, ``z`` with a per-head one."""
    h[n] = g * h[n] + g * B[n] * x
    return {"y": rg.Sum(C[n] * h[n], n), "z": rg.Sum(C[n] * E[n] * h[n], n)}


@pytest.mark.parametrize("decay", [(0.3, 1.0), (-1.0, 1.0)], ids=["positive", "both-signs"])
def test_factors_per_group_of_heads(decay):
    """``a = B`` and ``c = C`` evaluated per group (G = 2 groups of 3 heads, member ``h`` of
    group ``h // 3``), ``c @ aᵀ`` per group and spread over the members; a per-head coefficient
    (``C E``) beside them; the sign of the decay carried."""
    form = grouped_scalar.matrix
    sym = {s.name: s for s in grouped_scalar.spec.symbols.values()}
    assert form.states[0].terms == ((sym["B"], sym["g"] * sym["x"]),)
    b, L, H, G, P, N = 2, 13, 6, 2, 3, 5
    x, g = mx.random.normal((b, L, H, P)), mx.random.uniform(*decay, (b, L, H))
    B, C = mx.random.normal((b, L, G, N)), mx.random.normal((b, L, G, N))
    E = mx.random.normal((b, L, H, N))
    h0 = mx.random.normal((b, H, P, N))

    def run(i, s):
        (y, z), h = grouped_scalar(*i, initial_state=s[0], return_state=True, backend="mlx",
                                   schedule="matrix", seg=4)
        return [y, z], [h]

    def ref(i, s):
        x, g, B, C, E = i
        Bh, Ch = mx.repeat(B, H // G, axis=2), mx.repeat(C, H // G, axis=2)
        h, ys, zs = s[0], [], []
        for t in range(L):
            gt = g[:, t][..., None, None]
            h = gt * h + gt * Bh[:, t][:, :, None, :] * x[:, t][..., None]
            ys.append(mx.sum(Ch[:, t][:, :, None, :] * h, axis=-1))
            zs.append(mx.sum((Ch[:, t] * E[:, t])[:, :, None, :] * h, axis=-1))
        return [mx.stack(ys, axis=1), mx.stack(zs, axis=1)], [h]

    _assert_matches(run, ref, [x, g, B, C, E], [h0])


@rg.recurrence(lane="V", state={"S": "B H K V"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "p": "B L H K",
                       "u": "B L H V", "x": "B L H K", "g": "B L H"},
               outputs={"o": "B L H V"})
def two_terms_read_after(S, q, k, v, p, u, x, g, i):
    """Two added terms, read after the update together with a state-free part of the sum."""
    S[i] = g * S[i] + k[i] * v + p[i] * u
    return {"o": rg.Sum(q[i] * (S[i] + x[i]), i)}


@rg.recurrence(lane="P", state={"h": "B H P N"},
               inputs={"x": "B L H P", "dt": "B L H", "A": "H", "B": "B L H N", "C": "B L H N",
                       "mask": "B L"},
               outputs={"y": "B L H P"})
def masked_ssd(h, x, dt, A, B, C, mask, n):
    """Mamba-2's step held where ``mask`` is false (padded steps)."""
    h[n] = rg.where(mask, rg.exp(dt * A) * h[n] + dt * B[n] * x, h[n])
    return {"y": rg.Sum(C[n] * h[n], n)}


def test_a_readout_after_the_update_takes_its_own_step_in_the_products():
    """A readout of the state after the update takes the step's own added terms through the
    chunk products (``Readout.diagonal``: the causal weights' diagonal, weight 1), so no
    ``Σ_n q[n] a_r[n] b_r`` per step is left beside them; what else the sum reads stays in
    the rest. Vector decays and delta rules keep theirs in the rest."""
    import sympy
    for name in ("gla", "retnet", "mamba2"):
        ro, = rg.load_spec(name).matrix.readouts
        assert ro.diagonal == ro.decayed and len(ro.diagonal) == 1 and ro.rest == 0, name
    for name in ("ssd", "hgrn2", "rwkv6", "gated_deltanet"):
        assert not any(ro.diagonal for ro in rg.load_spec(name).matrix.readouts), name
    # a mask that holds the state: the step's own term under the mask is still the rest's
    ro, = masked_ssd.matrix.readouts
    assert len(ro.diagonal) == 1 and ro.rest == 0
    sym = {s.name: s for s in two_terms_read_after.spec.symbols.values()}
    ro, = two_terms_read_after.matrix.readouts
    assert ro.diagonal == {sym["S"]} and sympy.expand(ro.rest - sym["q"] * sym["x"]) == 0

    b, L, H, K, V = 2, 11, 2, 3, 4
    q, k, p, x = (0.5 * mx.random.normal((b, L, H, K)) for _ in range(4))
    v, u = mx.random.normal((b, L, H, V)), mx.random.normal((b, L, H, V))
    g = mx.random.uniform(-1.0, 1.0, (b, L, H))
    S0 = mx.random.normal((b, H, K, V))

    def run(i, s):
        o, S = two_terms_read_after(*i, initial_state=s[0], return_state=True, backend="mlx",
                                    schedule="matrix", seg=4)
        return [o], [S]

    def ref(i, s):
        q, k, v, p, u, x, g = i
        S, os_ = s[0], []
        for t in range(L):
            S = (g[:, t][..., None, None] * S + k[:, t][..., None] * v[:, t][..., None, :]
                 + p[:, t][..., None] * u[:, t][..., None, :])
            os_.append(mx.einsum("bhk,bhkv->bhv", q[:, t], S + x[:, t][..., None]))
        return [mx.stack(os_, axis=1)], [S]

    _assert_matches(run, ref, [q, k, v, p, u, x, g], [S0])
