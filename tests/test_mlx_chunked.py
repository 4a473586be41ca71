"""The chunked form of the pure-MLX backend (``backend="mlx", schedule="chunked"``) against
``rec.reference``: outputs, final states and every gradient (initial states' included), for the
bundled state-affine specs and custom ones (a 2x2 block over two states, a scalar state beside a
vector one, a parameter without the time axis, a nonlinear output); segment edge cases; the
schedule's choice; and the transforms (``mx.compile``, ``mx.vmap``, ``mx.grad``)."""

import mlx.core as mx
import pytest

import mlx_recgen as rg
from mlx_recgen import Sum, sigmoid, tanh, where
from mlx_recgen import schedule
from mlx_recgen.schedule import choose
from conftest import check_vmap_compositions, rel_err
from references import INPUTS

TOL = 2e-5


@rg.recurrence(lane="D", state={"a": "B D", "b": "B D"},
               inputs={"r": "B L D", "s": "B L D", "x": "B L D"},
               outputs={"y": "B L D"})
def rotation(a, b, r, s, x):
    a_new = r * a - s * b + x  # a 2x2 block mixing two states
    b = s * a + r * b
    a = a_new
    return {"y": a * b}


@rg.recurrence(lane="P", state={"S": "B P N", "m": "B P"},
               inputs={"k": "B L N", "v": "B L P", "g": "B L P"},
               outputs={"y": "B L P", "z": "B L P"})
def two_states(S, m, k, v, g, n):
    S[n] = g * S[n] + k[n] * v  # two blocks: a vector state and a scalar one
    m = g * m + v
    return {"y": Sum(k[n] * S[n], n), "z": m * Sum(S[n], n)}


@rg.recurrence(lane="P", state={"h": "B H P"},
               inputs={"x": "B L H P", "decay": "H", "gain": "H P"}, outputs={"y": "B L H P"})
def shared_param(h, x, decay, gain):
    h = sigmoid(decay) * h + gain * x  # parameters shared across lanes, batch and time
    return {"y": tanh(h) * where(x > 0, x, 0.1 * x)}  # a nonlinear output


@rg.recurrence(lane="D", state={"h": "B D"}, inputs={"w": "B L D", "x": "B L D"},
               outputs={"y": "B L D"})
def tanh_rnn(h, w, x):
    h = tanh(w * h + x)
    return {"y": h}


def _custom(name, b=2, L=11):
    u = lambda shape, lo, hi: mx.random.uniform(lo, hi, shape)  # noqa: E731
    n = lambda shape, s=1.0: s * mx.random.normal(shape)  # noqa: E731
    if name == "rotation":
        D = 5
        return rotation, [u((b, L, D), 0.3, 0.7), u((b, L, D), -0.5, 0.5), n((b, L, D))], \
            {"a": n((b, D), 0.5), "b": n((b, D), 0.5)}
    if name == "two_states":
        P, N = 3, 4
        return two_states, [n((b, L, N), 0.5), n((b, L, P)), u((b, L, P), 0.5, 0.95)], \
            {"S": n((b, P, N), 0.5), "m": n((b, P))}
    if name == "shared_param":
        H, P = 2, 3
        return shared_param, [n((b, L, H, P)), n((H,)), n((H, P))], {"h": n((b, H, P), 0.5)}
    raise KeyError(name)


def _case(name, L, b=2):
    if name in INPUTS:
        rec = rg.load_spec(name)
        inputs, h0 = INPUTS[name](b=b, L=L)
        return rec, list(inputs), {next(iter(rec.spec.states)): h0}
    return _custom(name, b, L)


def _flat(y, h):
    ys = list(y) if isinstance(y, tuple) else [y]
    hs = list(h.values()) if isinstance(h, dict) else [h]
    return ys + hs


def _check(rec, inputs, states, **kw):
    names = list(states)
    n_in = len(inputs)

    def run(fn):
        def go(*args):
            init = dict(zip(names, args[n_in:]))
            init = init[names[0]] if len(names) == 1 else init
            return _flat(*fn(*args[:n_in], initial_state=init, return_state=True))
        return go

    ours = run(lambda *a, **k: rec(*a, backend="mlx", schedule="chunked", **kw, **k))
    ref = run(rec.reference)
    args = [*inputs, *states.values()]
    got, want = ours(*args), ref(*args)
    for i, (a, r) in enumerate(zip(got, want)):
        assert rel_err(a, r) < TOL, f"result {i}"
    weights = [mx.random.normal(r.shape) for r in want]

    def loss(fn):
        return lambda *a: sum(mx.sum(w * y) for w, y in zip(weights, fn(*a)))

    argnums = tuple(range(len(args)))
    g = mx.grad(loss(ours), argnums=argnums)(*args)
    g_ref = mx.grad(loss(ref), argnums=argnums)(*args)
    labels = list(rec.spec.inputs) + [f"initial {s}" for s in names]
    for label, a, r in zip(labels, g, g_ref):
        assert rel_err(a, r) < TOL, f"gradient of {label}"


NAMES = ["ssd", "gla", "rglru", "rotlru", "rotation", "two_states", "shared_param"]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("L,seg", [(23, 4), (19, 1), (1, 8), (37, 37), (64, 2)])
def test_chunked_matches_the_reference(name, L, seg):
    rec, inputs, states = _case(name, L)
    _check(rec, inputs, states, seg=seg)


def test_non_affine_specs_refuse_chunked_with_the_reason():
    x = mx.random.normal((2, 8, 3))
    with pytest.raises(ValueError, match="state-affine.*not affine"):
        tanh_rnn(x, x, backend="mlx", schedule="chunked")


def test_auto_picks_chunked_on_mlx_where_expected(monkeypatch):
    rglru, ssd = rg.load_spec("rglru"), rg.load_spec("ssd")
    sizes = dict(B=1, L=1024, D=32)
    on_gpu = mx.default_device().type == mx.gpu
    assert (choose(rglru, sizes, "auto", None, "mlx")[0] == "chunked") == on_gpu
    monkeypatch.setattr(schedule, "mlx_time_parallel_pays", lambda: True)
    kind, seg = choose(rglru, sizes, "auto", None, "mlx")
    assert kind == "chunked" and 2 * seg <= 1024
    assert choose(rglru, dict(sizes, L=seg), "auto", None, "mlx")[0] == "sequential"
    assert choose(tanh_rnn, dict(B=2, L=1024, D=3), "auto", None, "mlx")[0] == "sequential"
    ssd_sizes = dict(B=1, L=1024, H=4, P=32, N=16)
    assert choose(ssd, ssd_sizes, "chunked", 16, "mlx") == ("chunked", 16)
    # the matrix form only by name (docs/matrix.md), on a GPU and on the CPU
    assert choose(ssd, ssd_sizes, "auto", None, "mlx")[0] == "chunked"
    assert choose(ssd, ssd_sizes, "auto", None, "metal-sim")[0] != "matrix"
    assert choose(ssd, ssd_sizes, "matrix", None, "mlx") == ("matrix", schedule.MATRIX_CHUNK)
    monkeypatch.setattr(schedule, "mlx_time_parallel_pays", lambda: False)
    assert choose(ssd, ssd_sizes, "auto", None, "mlx")[0] == "sequential"


def test_the_matrix_chunk_by_device_and_decay():
    """The matrix schedule's chunk when none is given: ``MATRIX_CHUNK_CPU`` in MLX ops on the
    CPU for scalar decays (GLA, gated DeltaNet), ``MATRIX_CHUNK`` for a vector decay (SSD), on
    a GPU and on the kernel backends; a given ``seg`` is kept."""
    gla, gdn, ssd = (rg.load_spec(n) for n in ("gla", "gated_deltanet", "ssd"))
    sizes = dict(B=1, L=1024, H=2, K=8, V=8)
    ssd_sizes = dict(B=1, L=1024, H=2, P=8, N=8)
    with mx.stream(mx.cpu):
        for rec in (gla, gdn):
            assert choose(rec, sizes, "matrix", None, "mlx") == ("matrix",
                                                                 schedule.MATRIX_CHUNK_CPU)
            assert choose(rec, sizes, "matrix", None, "metal-sim") == ("matrix",
                                                                       schedule.MATRIX_CHUNK)
            assert choose(rec, sizes, "matrix", 16, "mlx") == ("matrix", 16)
        assert choose(gdn, sizes, "chunked", None, "mlx") == ("matrix", schedule.MATRIX_CHUNK_CPU)
        assert choose(ssd, ssd_sizes, "matrix", None, "mlx") == ("matrix", schedule.MATRIX_CHUNK)
    assert schedule.MATRIX_CHUNK_CPU != schedule.MATRIX_CHUNK


# -- transforms ----------------------------------------------------------------------------------


def _rglru(L, b=2, D=4):
    return mx.random.uniform(-0.9, 0.9, (b, L, D)), mx.random.normal((b, L, D))


def test_compile_retraces_for_a_new_length():
    rec = rg.load_spec("rglru")
    call = lambda a, x: rec(a, x, backend="mlx", schedule="chunked", seg=4)  # noqa: E731
    forward = mx.compile(call)
    step = mx.compile(mx.grad(lambda a, x, w: mx.sum(call(a, x) * w), argnums=(0, 1)))
    for L in (9, 14, 9):
        a, x = _rglru(L)
        w = mx.random.normal((2, L, 4))
        assert rel_err(forward(a, x), rec.reference(a, x)) < 1e-5
        want = mx.grad(lambda a, x: mx.sum(rec.reference(a, x) * w), argnums=(0, 1))(a, x)
        for g, r in zip(step(a, x, w), want):
            assert rel_err(g, r) < 1e-5


def test_shapeless_compile_is_never_silently_wrong():
    rec = rg.load_spec("rglru")
    forward = mx.compile(lambda a, x: rec(a, x, backend="mlx", schedule="chunked", seg=4),
                         shapeless=True)
    for L in (9, 14):
        a, x = _rglru(L)
        try:
            y = forward(a, x)
        except ValueError:
            continue
        assert y.shape == (2, L, 4) and rel_err(y, rec.reference(a, x)) < 1e-5


@pytest.mark.parametrize("name", ["rotation", "gla"])
def test_vmap_and_its_compositions_with_grad(name):
    n, L = 3, 10
    cases = [_case(name, L, b=1) for _ in range(n)]
    rec = cases[0][0]
    xs = [mx.stack([c[1][i][0] for c in cases]) for i in range(len(cases[0][1]))]
    call = lambda *a: _flat(*rec(*a, backend="mlx", schedule="chunked", seg=4,  # noqa: E731
                                 return_state=True))
    ref = lambda *a: _flat(*rec.reference(*a, return_state=True))  # noqa: E731

    def unbatched(f):  # the first output and the first final state of one example
        return lambda *a: (lambda r: r[0][0] + mx.sum(r[-1][0]))(f(*(x[None] for x in a)))

    check_vmap_compositions(call, ref, xs, unbatched)


def test_second_order():
    """The gradient of a gradient: the backward's VJP is itself differentiable."""
    rec = rg.load_spec("rglru")
    a, x = _rglru(13)
    w = mx.random.normal((2, 13, 4))

    def outer(f):
        def inner(a, x):
            return mx.sum(f(a, x) * w)
        return lambda a, x: mx.sum(mx.grad(inner, argnums=0)(a, x) ** 2)

    ours = lambda a, x: rec(a, x, backend="mlx", schedule="chunked", seg=4)  # noqa: E731
    got = mx.grad(outer(ours), argnums=(0, 1))(a, x)
    want = mx.grad(outer(rec.reference), argnums=(0, 1))(a, x)
    for g, r in zip(got, want):
        assert rel_err(g, r) < 1e-4


@pytest.mark.parametrize("name", ["rotation", "ssd"])
def test_forward_mode(name):
    """``mx.jvp`` runs the tangent recurrence, itself state-affine, on the chunked form."""
    rec, inputs, states = _case(name, 13)
    init = states if len(states) > 1 else next(iter(states.values()))
    tangents = [mx.random.normal(x.shape) for x in inputs]

    def f(fn):
        return lambda *a: _flat(*fn(*a, initial_state=init, return_state=True))

    ours = f(lambda *a, **k: rec(*a, backend="mlx", schedule="chunked", seg=4, **k))
    _, got = mx.jvp(ours, inputs, tangents)
    _, want = mx.jvp(f(rec.reference), inputs, tangents)
    for a, r in zip(got, want):
        assert rel_err(a, r) < 1e-4
