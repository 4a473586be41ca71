"""The pure-MLX backend under MLX's transforms, against ``rec.reference`` (the plain per-step loop
under MLX autodiff): ``mx.grad`` of the whole call, ``mx.compile`` (a new ``L`` retraces),
``mx.compile(shapeless=True)`` (never a silently wrong result), ``mx.vmap`` and its compositions
with ``mx.grad``; and the split of the step programs that the backend runs."""

import os

import mlx.core as mx
import pytest

import mlx_recgen as rg
from mlx_recgen import Sum
from mlx_recgen.ir import Accumulate, Assign, Store
from mlx_recgen.phases import split
from conftest import check_vmap_compositions, rel_err


@rg.recurrence(lane="V", state={"S": "B H K V"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "alpha": "B L H",
                       "beta": "B L H"},
               outputs={"o": "B L H V"})
def gated_delta(S, q, k, v, alpha, beta, i):
    r = Sum(k[i] * S[i], i)
    S[i] = alpha * S[i] + beta * (v - alpha * r) * k[i]
    return {"o": Sum(q[i] * S[i], i)}


# the stabilised mLSTM with its normaliser per value channel, as the benchmarks time it
mlstm = rg.load_spec(os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks",
                                  "specs", "mlstm.py"))


def _inputs(rec, L, B=2, H=2, K=3, V=4):
    sizes = dict(B=B, L=L, H=H, K=K, V=V)
    out = []
    for t in rec.spec.inputs.values():
        shape = tuple(sizes[a] for a in t.axes)
        if t.name in ("alpha",):
            out.append(mx.random.uniform(0.5, 0.95, shape))
        elif t.name == "beta":
            out.append(mx.random.uniform(0.1, 0.9, shape))
        elif t.name == "k":
            k = mx.random.normal(shape)
            out.append(k / mx.linalg.norm(k, axis=-1, keepdims=True))
        elif t.name == "fpre":
            out.append(mx.random.normal(shape) + 2.0)
        else:
            out.append(mx.random.normal(shape))
    return out


def _loss(fn, weights):
    def loss(*xs):
        return mx.sum(fn(*xs) * weights)
    return loss


def _initial_state(rec, B=2, H=2, K=3, V=4):
    sizes = dict(B=B, H=H, K=K, V=V)
    return {t.name: mx.random.normal(tuple(sizes[a] for a in t.axes)) * 0.5
            for t in rec.spec.states.values()}


SPECS = {"gated_delta": gated_delta, "mlstm": mlstm}


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("L,seg", [(1, 32), (7, 1), (19, 4)])
def test_grad_of_the_whole_call_matches_the_loop(name, L, seg):
    rec = SPECS[name]
    xs = _inputs(rec, L)
    h0 = _initial_state(rec)
    names = list(h0)
    n = len(xs)

    def split_args(fn):
        return lambda *a: fn(*a[:n], initial_state=dict(zip(names, a[n:])))

    w = mx.random.normal(rec.reference(*xs).shape)
    args = xs + [h0[k] for k in names]
    argnums = tuple(range(len(args)))
    ours = split_args(lambda *a, **kw: rec(*a, backend="mlx", seg=seg, **kw))
    got = mx.value_and_grad(_loss(ours, w), argnums)(*args)
    want = mx.value_and_grad(_loss(split_args(rec.reference), w), argnums)(*args)
    assert abs(got[0].item() - want[0].item()) <= 1e-4 * abs(want[0].item())
    for label, g, r in zip(list(rec.spec.inputs) + names, got[1], want[1]):
        assert rel_err(g, r) < 1e-4, f"{name}: gradient of {label}"


def test_compile_retraces_for_a_new_length():
    """A compiled forward and a compiled training step, called again with a new ``L`` (MLX
    retraces: shapes are part of a compiled function's key). RG-LRU keeps the first compile
    (MLX builds its CPU kernels with the C++ compiler) short."""
    rec = rg.load_spec("rglru")
    forward = mx.compile(lambda a, x: rec(a, x, backend="mlx", seg=4))
    step = mx.compile(mx.grad(lambda a, x, w: mx.sum(rec(a, x, backend="mlx", seg=4) * w),
                              argnums=(0, 1)))
    for L in (9, 14, 9):
        a, x = mx.random.uniform(-0.9, 0.9, (2, L, 4)), mx.random.normal((2, L, 4))
        w = mx.random.normal((2, L, 4))
        assert rel_err(forward(a, x), rec.reference(a, x)) < 1e-5
        want = mx.grad(lambda a, x: mx.sum(rec.reference(a, x) * w), argnums=(0, 1))(a, x)
        for g, r in zip(step(a, x, w), want):
            assert rel_err(g, r) < 1e-5


def test_shapeless_compile_is_never_silently_wrong():
    """MLX cannot replay a custom function (or a time loop) for new shapes: a shapeless compile
    must raise, or, should MLX ever allow it, give the loop's result."""
    rec = gated_delta
    forward = mx.compile(lambda *a: rec(*a, backend="mlx", seg=4), shapeless=True)
    for L in (9, 14):
        xs = _inputs(rec, L)
        try:
            y = forward(*xs)
        except ValueError:
            continue
        assert y.shape == (2, L, 2, 4) and rel_err(y, rec.reference(*xs)) < 1e-5


def test_vmap_and_its_compositions_with_grad():
    rec = gated_delta
    n, L = 3, 6
    per = [_inputs(rec, L, B=1) for _ in range(n)]
    xs = [mx.stack([p[i][0] for p in per]) for i in range(len(per[0]))]  # batch axis B vmapped
    call = lambda *a: rec(*a, backend="mlx", seg=4)  # noqa: E731
    ref = lambda *a: rec.reference(*a)  # noqa: E731

    def unbatched(f):
        return lambda *a: f(*(x[None] for x in a))[0]

    want = mx.stack([rec.reference(*p)[0] for p in per])
    check_vmap_compositions(call, ref, xs, unbatched, want)


def test_only_the_carry_chain_runs_per_step():
    """The forward sweep of SSD is ``h <- a * h + b`` with ``a`` and ``b`` computed for the whole
    segment; no statement of any sweep is free of the carry."""
    for rec in (rg.load_spec("ssd"), gated_delta, mlstm):
        form = rec._backend("mlx").sequential
        for chain in (form.forward_chain, form.backward_chain):
            dependent = set(chain.phases.carry)
            for b in chain.phases.sweep.statements:
                assert b.expr.free_symbols & dependent, f"{rec.name}: {b} is carry-free"
                if not isinstance(b, Store):
                    dependent.add(b.target)
    ssd = rg.load_spec("ssd")
    sweep = ssd._backend("mlx").sequential.forward_chain.phases.sweep.statements
    assert sum(sympy_ops(b.expr) for b in sweep) == 2  # one multiply, one add


def sympy_ops(e):
    import sympy
    return sympy.count_ops(e)


def test_split_keeps_every_result():
    for rec in (gated_delta, mlstm):
        for program, carry, kind in (
                (rec.forward_program, [rec.spec.symbols[s] for s in rec.spec.state_slots()], "state"),
                (rec.adjoint.program, list(rec.adjoint.state_cotangents.values()), "lambda")):
            ph = split(program, carry, kind, rec.ir.namer)
            stores = lambda p: {(b.kind, b.slot) for b in p.statements if isinstance(b, Store)}  # noqa: E731
            assert stores(ph.sweep) | stores(ph.post) == {(b.kind, b.slot) for b in program.stores()}
            assert all(isinstance(b, (Assign, Accumulate)) for b in ph.pre.statements)


def test_a_long_segment_is_compiled_in_blocks():
    """A forward segment longer than what one compiled call unrolls (64 steps) runs as several
    calls; outputs, final state and gradients still match the loop."""
    rec = rg.load_spec("rglru")
    a, x = mx.random.uniform(-0.9, 0.9, (2, 150, 4)), mx.random.normal((2, 150, 4))
    y, h = rec(a, x, backend="mlx", seg=100, return_state=True)
    y_r, h_r = rec.reference(a, x, return_state=True)
    assert rel_err(y, y_r) < 1e-5 and rel_err(h, h_r) < 1e-5
    w = mx.random.normal(y.shape)
    got = mx.grad(lambda a, x: mx.sum(rec(a, x, backend="mlx", seg=100) * w), argnums=(0, 1))(a, x)
    want = mx.grad(lambda a, x: mx.sum(rec.reference(a, x) * w), argnums=(0, 1))(a, x)
    for g, r in zip(got, want):
        assert rel_err(g, r) < 1e-5
