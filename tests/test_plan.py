"""Call plans: a call looks up the plan decided for its shapes, dtypes, options and device
(``Recurrence.plan_for``), kept in a bounded cache; the memos behind it are bounded too."""

from __future__ import annotations

import gc

import mlx.core as mx
import pytest

import mlx_recgen as rg
from mlx_recgen.backends import mlx_ops
from mlx_recgen.function import PLAN_CACHE_SIZE, CallPlan, Recurrence
from mlx_recgen.memo import LRU

from conftest import KERNEL_BACKENDS


def _rglru():
    return Recurrence(rg.load_spec("rglru").spec)  # a fresh recurrence: empty caches


def _args(L, D=4, dtype=mx.float32):
    return mx.random.uniform(-1, 1, (2, L, D)).astype(dtype), mx.random.normal((2, L, D))


def test_lru_evicts_the_least_recently_used():
    memo = LRU(2)
    built = []

    def build(v):
        return lambda: built.append(v) or v

    assert memo.get_or_build("a", build(1)) == 1 and memo.get_or_build("b", build(2)) == 2
    assert memo.get_or_build("a", build(9)) == 1  # a hit: "a" is now the most recent
    memo.get_or_build("c", build(3))  # evicts "b"
    assert list(memo) == ["a", "c"] and built == [1, 2, 3]
    memo["d"] = 4
    assert list(memo) == ["c", "d"]
    with pytest.raises(ValueError, match="at least one entry"):
        LRU(0)


def test_a_call_reuses_its_plan():
    rec = _rglru()
    a, x = _args(40)
    plan = rec.plan(a, x, backend="mlx")
    assert isinstance(plan, CallPlan)
    assert rec.plan(*_args(40), backend="mlx") is plan  # same shapes, new arrays
    assert (plan.backend.name, plan.schedule, plan.seg) == ("mlx", "sequential", 32)
    assert dict(plan.sizes) == {"B": 2, "L": 40, "D": 4}
    assert plan.decode is None and plan.function is plan.function
    rec(a, x, backend="mlx")
    assert len(rec._plans) == 1
    # what decides a plan: a new dtype, seg, schedule or length is a new plan
    assert rec.plan(*_args(40, dtype=mx.float16), backend="mlx") is not plan
    assert rec.plan(a, x, backend="mlx", seg=8).seg == 8
    assert rec.plan(a, x, backend="mlx", schedule="chunked").schedule == "chunked"
    assert rec.plan(*_args(41), backend="mlx") is not plan


def test_plan_cache_is_bounded():
    rec = _rglru()
    first = rec.plan(*_args(100), backend="mlx")
    for L in range(101, 101 + PLAN_CACHE_SIZE):
        rec(*_args(L), backend="mlx")
    assert len(rec._plans) == PLAN_CACHE_SIZE and len(rec._functions) <= PLAN_CACHE_SIZE
    assert rec.plan(*_args(100), backend="mlx") is not first  # evicted, planned again
    recent = rec.plan(*_args(100 + PLAN_CACHE_SIZE), backend="mlx")
    assert rec.plan(*_args(100 + PLAN_CACHE_SIZE), backend="mlx") is recent


def test_errors_are_not_planned():
    rec = _rglru()
    a, x = _args(5)
    with pytest.raises(ValueError, match=r"rglru\(\): threads= applies to the kernel backends"):
        rec(a, x, backend="mlx", threads=64)
    with pytest.raises(ValueError, match=r"rglru\(\): seg must be a positive integer"):
        rec.plan(a, x, backend="mlx", seg=0)
    # an unhashable option still meets the check that names it
    with pytest.raises(ValueError, match=r"rglru\(\): schedule must be one of .*got \['x'\]"):
        rec(a, x, backend="mlx", schedule=["x"])
    assert len(rec._plans) == 0


def test_a_repeated_call_skips_the_check_but_not_what_decides_it(monkeypatch):
    """A call like one that passed the check (positional arrays of the same shapes and dtypes,
    the same options) runs its plan without checking again; anything else is checked."""
    rec = _rglru()
    a, x = _args(3)
    h0 = mx.random.normal((2, 4))
    y, h = rec(a, x, initial_state=h0, return_state=True, backend="mlx")
    checks = []
    monkeypatch.setattr(rec, "check", lambda *s, **k: checks.append(1) or Recurrence.check(
        rec, *s, **k))
    y2, h2 = rec(a, x, initial_state=h0, return_state=True, backend="mlx")
    assert checks == [] and mx.array_equal(y, y2) and mx.array_equal(h, h2)
    # without the state: zeros, its own entry
    assert mx.allclose(rec(a, x, backend="mlx"), rec.reference(a, x), atol=1e-6)
    assert mx.allclose(rec(a, x, backend="mlx"), rec.reference(a, x), atol=1e-6)
    assert len(checks) == 1
    # a new dtype of the same shapes is a new plan: outputs in that dtype
    assert rec(a.astype(mx.float16), x.astype(mx.float16), backend="mlx").dtype == mx.float16
    assert rec(a.astype(mx.bfloat16), x.astype(mx.bfloat16), backend="mlx").dtype == mx.bfloat16
    # what would fail the check still fails it, with its message
    with pytest.raises(ValueError, match=r"rglru\(\): axis D has size 5 in 'x'"):
        rec(a, mx.zeros((2, 3, 5)), backend="mlx")
    with pytest.raises(TypeError, match=r"rglru\(\): argument 'x' must be an mx.array"):
        rec(a, [[0.0]], backend="mlx")
    with pytest.raises(ValueError, match=r"rglru\(\): argument 'initial_state' has shape"):
        rec(a, x, initial_state=mx.zeros((2, 4, 1)), backend="mlx")
    for L in range(4, 4 + PLAN_CACHE_SIZE + 2):
        rec(*_args(L), backend="mlx")
    assert len(rec._checked) == PLAN_CACHE_SIZE


@pytest.mark.parametrize("backend", ["mlx", *KERNEL_BACKENDS])
@pytest.mark.parametrize("kept_max", [1 << 16, 4])
def test_calls_without_an_initial_state_share_a_kept_zero_state(backend, kept_max, monkeypatch):
    """A zero state is kept with the checked call's plan and passed again: a small one filled,
    one above ``ZEROS_KEPT_MAX`` elements a view of one kept zero (``zero_state``); the calls
    like it (forward and backward) give the reference's results, and the kept state stays
    zero."""
    from mlx_recgen import function

    monkeypatch.setattr(function, "ZEROS_KEPT_MAX", kept_max)
    rec = _rglru()
    for _ in range(3):
        a, x = _args(9)
        y = rec(a, x, backend=backend, seg=4)
        assert mx.allclose(y, rec.reference(a, x), rtol=1e-5, atol=1e-6)
        grads = mx.grad(lambda a, x: mx.sum(rec(a, x, backend=backend, seg=4) * x), (0, 1))(a, x)
        want = mx.grad(lambda a, x: mx.sum(rec.reference(a, x) * x), (0, 1))(a, x)
        assert all(mx.allclose(g, w, rtol=1e-4, atol=1e-6) for g, w in zip(grads, want))
    (_, (kept,)), = [v for v in rec._checked.values() if v[1] is not None][:1]
    assert isinstance(kept, mx.array) and kept.shape == (2, 4) and kept.dtype == mx.float32
    assert not mx.any(kept).item()
    assert function.zero_state((3, 5)).shape == (3, 5)


def test_compiled_blocks_are_bounded_and_shared_across_lengths(monkeypatch):
    """The mlx backend's compiled forward blocks: one compiled function per shape of the axes
    other than time (a new length reuses it), at most ``COMPILED_SIZES`` of them."""
    monkeypatch.setattr(mlx_ops, "COMPILED_SIZES", 3)
    rec = _rglru()
    form = rec._backend("mlx").sequential
    for L in (40, 57, 70, 200):
        mx.eval(rec(*_args(L), backend="mlx"))
    assert len(form._compiled_blocks) == 1
    for D in (5, 6, 7, 8):
        mx.eval(rec(*_args(40, D=D), backend="mlx"))
    assert len(form._compiled_blocks) == 3


def test_power_runs_cover_the_range():
    runs = list(mlx_ops._power_runs(32, 32 + 59, 64))
    assert runs == [(32, 64), (64, 80), (80, 88), (88, 90), (90, 91)]
    assert list(mlx_ops._power_runs(0, 200, 64))[-2:] == [(128, 192), (192, 200)]


def _resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 1e6


def test_resident_memory_does_not_grow_per_length(monkeypatch):
    """Forward calls of 120 new lengths, after 120 others: resident memory stays (MLX's buffer
    cache off, so that only what the compiler keeps counts). Before the plans and bounded memos,
    every length kept its compiled traces and custom function: about 0.15 MB each."""
    limit = mx.set_cache_limit(0)
    try:
        rec = _rglru()
        for L in range(200, 320):
            mx.eval(rec(*_args(L, D=64), backend="mlx"))
        gc.collect()
        before = _resident_mb()
        for L in range(320, 440):
            mx.eval(rec(*_args(L, D=64), backend="mlx"))
        gc.collect()
        assert _resident_mb() - before < 4
    finally:
        mx.set_cache_limit(limit)


@pytest.mark.parametrize("backend", ["mlx", *KERNEL_BACKENDS])
def test_the_matrix_form_runs_as_plain_ops(backend, monkeypatch):
    """The matrix schedule's plan runs the form as plain MLX ops (``CallPlan.direct``), around
    the kernels' core on a kernel backend: a training step's ``value_and_grad`` takes the VJP
    from the forward's graph, never the full path's backward (which traces and computes the
    forward again), and its values and gradients are those of the full path. MLX's own vmap
    and compile take the plain ops; through the kernels vmap raises, clearly."""
    from mlx_recgen.backends.mlx_matrix import MatrixForm

    backwards = []
    backward = MatrixForm.backward
    monkeypatch.setattr(MatrixForm, "backward",
                        lambda self, *a, **k: backwards.append(1) or backward(self, *a, **k))
    gla = Recurrence(rg.load_spec("gla").spec)
    q, k, v = (mx.random.normal((2, 20, 2, 4)) for _ in range(3))
    g = mx.random.uniform(0.5, 1.0, (2, 20, 2))
    w = mx.random.normal((2, 20, 2, 4))
    plan = gla.plan(q, k, v, g, backend=backend, schedule="matrix", seg=8)
    assert plan.direct is not None and plan.decode is None

    def loss(run):
        return lambda q, k, v, g: mx.sum(run(q, k, v, g) * w)

    def call(schedule, on=backend):
        return lambda *a: gla(*a, backend=on, schedule=schedule, seg=8)

    direct = mx.value_and_grad(loss(call("matrix")), argnums=(0, 1, 2, 3))(q, k, v, g)
    mx.eval(direct)
    assert not backwards
    full = mx.value_and_grad(loss(lambda *a: plan.function(*a, mx.zeros((2, 2, 4, 4)))[0]),
                             argnums=(0, 1, 2, 3))(q, k, v, g)
    mx.eval(full)
    assert backwards
    for a, b in zip([direct[0], *direct[1]], [full[0], *full[1]]):
        assert mx.allclose(a, b, rtol=1e-5, atol=1e-6).item()
    # vmap and compile of the plain ops, against the sequential schedule
    stacked = [mx.stack([x, -x]) for x in (q, k, v)] + [mx.stack([g, g[::-1]])]
    if backend != "mlx":  # the kernels have no batching rule (the simulator says so itself)
        with pytest.raises((NotImplementedError, RuntimeError), match="vmap"):
            mx.eval(mx.vmap(call("matrix"))(*stacked))
        return
    want = mx.vmap(call("sequential"))(*stacked)
    assert mx.allclose(mx.vmap(call("matrix"))(*stacked), want, rtol=1e-4, atol=1e-5).item()
    assert mx.allclose(mx.compile(call("matrix"))(q, k, v, g), want[0], rtol=1e-4,
                       atol=1e-5).item()
