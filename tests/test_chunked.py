"""Chunking: L steps at once equal two chunks with the first chunk's final state passed as the
second's ``initial_state`` — outputs, final state and gradients, including the gradient of the
first chunk's inputs that flows through the passed state. And the chunked schedule on
non-finite and overflowing inputs: what the sequential schedule and the reference give."""

import mlx.core as mx
import numpy as np
import pytest

import mlx_recgen as rg
from mlx_recgen import scans
from conftest import KERNEL_BACKENDS, rel_err
from references import INPUTS, REFERENCES

F32 = mx.float32
TOL = 1e-5


# -- runners: (full inputs, h0) -> (y, h_final) -------------------------------------------------


def spec_runner(name, seg):
    rec = rg.load_spec(name)

    def run(*args):
        return rec(*args[:-1], initial_state=args[-1], return_state=True, backend="mlx", seg=seg)
    return run


def _interleave(x):  # [b,L,P,2] -> [b,L,2P]
    return x.reshape(*x.shape[:-2], -1)


def scan_runner(name, seg):
    """The scans API, adapted to the spec's argument layout (x and the state as pairs)."""
    if name == "ssd":
        def run(u, delta, B, C, A, h0):
            return scans.ssd_scan_with_state(u, delta, B, C, A, initial_state=h0, seg=seg,
                                             backend="mlx")
    elif name == "gla":
        def run(q, k, v, g, S0):
            return scans.gla_scan_with_state(q, k, v, g, initial_state=S0, seg=seg, backend="mlx")
    elif name == "rglru":
        def run(a, x, h0):
            return scans.rglru_scan_with_state(a, x, initial_state=h0, seg=seg, backend="mlx")
    elif name == "rotlru":
        def run(a, cos, sin, x, h0):
            b, L, P, _ = x.shape
            y, h = scans.rotlru_scan_with_state(a, cos, sin, _interleave(x),
                                                initial_state=h0.reshape(b, 2 * P), seg=seg,
                                                backend="mlx")
            return y.reshape(b, L, P, 2), h.reshape(b, P, 2)
    return run


def chunked(run, split, time_axes):
    """Run ``run`` on [0, split) then on [split, L) with the first final state passed on."""
    def go(*args):
        *inputs, h0 = args
        first = [x[:, :split] if t else x for x, t in zip(inputs, time_axes)]
        second = [x[:, split:] if t else x for x, t in zip(inputs, time_axes)]
        y1, h1 = run(*first, h0)
        y2, h2 = run(*second, h1)
        return mx.concatenate([y1, y2], axis=1), h2
    return go


def _grads(run, inputs, h0, Wy, Wh):
    def loss(*args):
        y, h = run(*args)
        return mx.sum(y.astype(F32) * Wy) + mx.sum(h * Wh)
    return mx.grad(loss, argnums=tuple(range(len(inputs) + 1)))(*inputs, h0)


def _time_axes(name):
    return [t.has_time for t in rg.load_spec(name).spec.inputs.values()]


# inputs that only the output reads (never the state update)
READ_ONLY_BY_OUTPUT = {"ssd": ("C",), "gla": ("q",)}

CASES = [("ssd", spec_runner), ("rotlru", spec_runner), ("ssd", scan_runner),
         ("rotlru", scan_runner), ("gla", scan_runner), ("rglru", scan_runner)]
IDS = [f"{n}-{'spec' if r is spec_runner else 'scan'}" for n, r in CASES]


@pytest.mark.parametrize("split", [1, 9, 22])
@pytest.mark.parametrize("name,runner", CASES, ids=IDS)
def test_two_chunks_equal_one_run(name, runner, split):
    L, seg = 23, 4
    inputs, h0 = INPUTS[name](b=2, L=L)
    run = runner(name, seg)
    two = chunked(run, split, _time_axes(name))

    y, h = run(*inputs, h0)
    y2, h2 = two(*inputs, h0)
    y_ref, h_ref = REFERENCES[name](*inputs, h0)
    assert rel_err(y, y_ref) < TOL and rel_err(h, h_ref) < TOL
    assert rel_err(y2, y) < TOL and rel_err(h2, h) < TOL

    Wy, Wh = mx.random.normal(y.shape), mx.random.normal(h.shape)
    g = _grads(run, inputs, h0, Wy, Wh)
    g2 = _grads(two, inputs, h0, Wy, Wh)
    g_ref = _grads(REFERENCES[name], inputs, h0, Wy, Wh)
    labels = list(rg.load_spec(name).spec.inputs) + ["initial_state"]
    for label, a, b, r in zip(labels, g2, g, g_ref):
        assert rel_err(b, r) < TOL, f"one run, gradient of {label}"
        assert rel_err(a, b) < TOL, f"two chunks, gradient of {label}"


@pytest.mark.parametrize("name,runner", CASES, ids=IDS)
def test_gradient_flows_through_passed_state(name, runner):
    """The loss reads only the second chunk's output: every gradient on the first chunk's steps
    (and on h0) comes through the state handed from chunk one to chunk two."""
    L, split, seg = 17, 7, 3
    inputs, h0 = INPUTS[name](b=2, L=L)
    run = runner(name, seg)
    time_axes = _time_axes(name)

    y_full, h_full = run(*inputs, h0)
    mask = (mx.arange(L) >= split).astype(F32).reshape(1, L, *([1] * (y_full.ndim - 2)))
    Wy = mx.random.normal(y_full.shape) * mask  # zero on the first chunk's steps
    Wh = mx.zeros(h_full.shape)

    def second_only(*args):
        *ins, s0 = args
        y1, h1 = run(*[x[:, :split] if t else x for x, t in zip(ins, time_axes)], s0)
        y2, _ = run(*[x[:, split:] if t else x for x, t in zip(ins, time_axes)], h1)
        return mx.sum(y2.astype(F32) * Wy[:, split:])

    argnums = tuple(range(len(inputs) + 1))
    g_two = mx.grad(second_only, argnums=argnums)(*inputs, h0)
    g_ref = _grads(REFERENCES[name], inputs, h0, Wy, Wh)
    labels = list(rg.load_spec(name).spec.inputs) + ["initial_state"]
    for label, a, r, t in zip(labels, g_two, g_ref, time_axes + [False]):
        if t and label in READ_ONLY_BY_OUTPUT.get(name, ()):
            # it does not reach the state: no gradient on the first chunk's steps
            assert mx.abs(a[:, :split]).max().item() == 0, label
        elif t:
            first = a[:, :split]
            assert mx.abs(first).max().item() > 0, f"no gradient reaches chunk one's {label}"
            assert rel_err(first, r[:, :split]) < TOL, f"chunk one's gradient of {label}"
        assert rel_err(a, r) < TOL, f"gradient of {label}"


# -- non-finite and overflowing inputs ---------------------------------------------------------
# The chunked schedule forms products of multipliers that the sequential steps never form: they
# overflow over a zero state, underflow under an infinite one, and an infinite gate meets the zero
# state a segment summary starts from. Each case gives what the sequential schedule and the
# reference give, forward and gradients, NaN and infinities included.

INF = float("inf")
NONFINITE_L, NONFINITE_SEG = 12, 4


def _nonfinite_case(name, case):
    L = NONFINITE_L
    full = lambda shape, v: mx.full(shape, v)  # noqa: E731
    if name == "rglru":
        ins = {"a": full((1, L, 2), 0.5), "x": full((1, L, 2), 1.0)}
        gate, drive = "a", "x"
    elif name == "gla":
        ins = {"q": full((1, L, 1, 3), 0.5), "k": full((1, L, 1, 3), 0.7),
               "v": full((1, L, 1, 2), 0.3), "g": full((1, L, 1), 0.5)}
        gate, drive = "g", "k"
    else:  # rotlru: a 2x2 block
        ins = {"a": full((1, L, 2), 0.5), "cos": full((1, L, 2), 0.8),
               "sin": full((1, L, 2), 0.6), "x": full((1, L, 2, 2), 1.0)}
        gate, drive = "a", "x"
    if case == "overflow":  # products of 1e20 over a zero state: the state stays 0
        ins[gate][:, :4] = 1e20
        ins[drive][:, :4] = 0.0
    elif case == "inf_gate_inside":  # the second step of a segment
        ins[gate][:, 5] = INF
    elif case == "inf_gate_first":  # the first step of a segment: the summary starts from 0
        ins[gate][:, 4] = INF
    elif case == "inf_gate_zero_state":  # inf * 0 in the sequential steps: NaN from there on
        ins[gate][:, 1] = INF
        ins[drive][:, :2] = 0.0
    elif case == "inf_gate_zero_state_later":  # the same in a later run or segment
        ins[gate][:, 5] = INF
        ins[drive][:, :6] = 0.0
    elif case == "nan_gate_zero_state":  # NaN * 0 likewise
        ins[gate][:, 5] = float("nan")
        ins[drive][:, :6] = 0.0
    elif case == "zero_gate":  # a product of multipliers that is exactly zero
        ins[gate][:, 5] = 0.0
    elif case == "inf_state":  # products of 1e-30 under an infinite state: it stays inf
        ins[drive][:, 1] = INF
        ins[gate][:, 2:] = 1e-30
    return list(ins.values())


def _assert_same(ours, ref, label):
    """NaN exactly where ``ref`` is NaN, the same infinities, finite values close."""
    a, r = np.array(ours, dtype=np.float64), np.array(ref, dtype=np.float64)
    where = np.argwhere(np.isnan(a) != np.isnan(r))[:4].tolist()
    assert not where, f"{label}: NaN differs at {where}"
    inf_a, inf_r = np.where(np.isinf(a), a, 0), np.where(np.isinf(r), r, 0)
    assert np.array_equal(inf_a, inf_r), f"{label}: infinities differ"
    fin = np.isfinite(r)
    np.testing.assert_allclose(a[fin], r[fin], rtol=1e-5, atol=1e-6, err_msg=label)


NONFINITE = [(n, c) for n in ("rglru", "gla")
             for c in ("overflow", "inf_gate_inside", "inf_gate_first", "inf_gate_zero_state",
                       "inf_gate_zero_state_later", "nan_gate_zero_state", "zero_gate",
                       "inf_state")]
# a rotation of infinite vectors is NaN in an order-dependent way (inf - inf): the cases whose
# values stay defined
NONFINITE += [("rotlru", "overflow"), ("rotlru", "inf_state")]


# the scan schedule composes the same maps in a tree of shuffles: the specs without a state axis
NONFINITE_RUNS = [(n, c, "chunked") for n, c in NONFINITE]
NONFINITE_RUNS += [(n, c, "scan") for n, c in NONFINITE if n != "gla"]


@pytest.mark.parametrize("backend", ["mlx", *KERNEL_BACKENDS])
@pytest.mark.parametrize("name,case,schedule", NONFINITE_RUNS,
                         ids=[f"{s}-{n}-{c}" for n, c, s in NONFINITE_RUNS])
def test_nonfinite_inputs_give_the_sequential_result(backend, name, case, schedule):
    rec = rg.load_spec(name)
    inputs = _nonfinite_case(name, case)
    argnums = tuple(range(len(inputs)))

    def run(schedule):
        return lambda *a: rec(*a, backend=backend, schedule=schedule, seg=NONFINITE_SEG)

    def grads(f):
        return mx.grad(lambda *a: mx.sum(f(*a)), argnums=argnums)(*inputs)

    chunked, sequential = run(schedule), run("sequential")
    y = chunked(*inputs)
    _assert_same(y, rec.reference(*inputs), "forward against the reference")
    _assert_same(y, sequential(*inputs), "forward against the sequential schedule")
    if name == "rotlru" and case == "overflow":
        return  # gradients of 1e80 mixed by rotations: inf - inf in every schedule
    g, g_seq, g_ref = grads(chunked), grads(sequential), grads(rec.reference)
    for label, a, s, r in zip(rec.spec.inputs, g, g_seq, g_ref):
        _assert_same(a, r, f"gradient of {label} against the reference")
        _assert_same(a, s, f"gradient of {label} against the sequential schedule")


# An infinite gate whose step's cotangent is zero, and zero up to its segment's end: the local
# adjoint of that segment meets inf * 0 where the sequential sweep meets inf times the adjoint
# arriving from later segments. Nonzero later: the gradients before the gate are infinite;
# zero to the end: they are NaN (the sequential sweep's inf * 0).
ADJOINT_HITS = [(n, later, s) for n in ("rglru", "gla", "rwkv6") for later in (True, False)
                for s in ("chunked", "scan") if not (s == "scan" and n != "rglru")]


def _adjoint_hit_inputs(name):
    """Positive inputs (no inf - inf) with an infinite multiplier at step 5, the second step of
    the segment 4..7; RWKV-6's outputs read the state before the step (``λ <- M λ + r``)."""
    if name != "rwkv6":
        return _nonfinite_case(name, "inf_gate_inside")
    L = NONFINITE_L
    r, k, v = mx.full((1, L, 1, 3), 0.5), mx.full((1, L, 1, 3), 0.7), mx.full((1, L, 1, 2), 0.3)
    w = mx.full((1, L, 1, 3), -0.7)  # a log decay: exp(w) multiplies the state
    w[:, 5] = INF
    return [r, k, v, w, mx.full((1, 3), 0.2)]


@pytest.mark.parametrize("backend", ["mlx", *KERNEL_BACKENDS])
@pytest.mark.parametrize("name,later,schedule", ADJOINT_HITS,
                         ids=[f"{s}-{n}-{'later' if t else 'none_later'}"
                              for n, t, s in ADJOINT_HITS])
def test_infinite_gate_meeting_a_zero_local_adjoint(backend, name, later, schedule):
    rec = rg.load_spec(name)
    inputs = _adjoint_hit_inputs(name)
    y = rec(*inputs, backend="mlx", schedule="sequential")
    weights = mx.random.uniform(0.5, 1.5, y.shape, key=mx.random.key(7))
    weights[:, 5:8] = 0.0  # no cotangent from the gate to its segment's end
    if not later:
        weights[:, 8:] = 0.0
    argnums = tuple(range(len(inputs)))

    def grads(f):
        return mx.grad(lambda *a: mx.sum(f(*a) * weights), argnums=argnums)(*inputs)

    ours = grads(lambda *a: rec(*a, backend=backend, schedule=schedule, seg=NONFINITE_SEG))
    seq = grads(lambda *a: rec(*a, backend=backend, schedule="sequential"))
    ref = grads(rec.reference)
    for label, a, s, r in zip(rec.spec.inputs, ours, seq, ref):
        if name == "rwkv6" and label == "w" and backend != "mlx":
            # the kernels' sequential schedule too: the last step's w moves only the final
            # state, whose cotangent is zero, times an infinite state: NaN, where autodiff of
            # the reference, which has no path from it to the loss, gives 0
            r = np.array(r)
            r[:, -1] = np.nan
        _assert_same(a, r, f"gradient of {label} against the reference")
        _assert_same(a, s, f"gradient of {label} against the sequential schedule")
    early = np.array(ours[1][:, :4])  # x's or k's: through the adjoint of the state
    if name == "rwkv6":  # o reads the state before the step: k's gradient at step 4 is finite
        early = early[:, :3]
    assert (np.isinf(early).all() if later else np.isnan(early).all()), "the case is not met"


@pytest.mark.parametrize("backend", ["mlx", *KERNEL_BACKENDS])
@pytest.mark.parametrize("held", [6, 2], ids=["held_after_the_gate", "held_before"])
@pytest.mark.parametrize("later", [True, False], ids=["later", "none_later"])
def test_masked_gate_meeting_a_zero_local_adjoint(backend, held, later):
    """The same with a mask that holds the state at one step (mlx-lm's masked SSD): the
    multiplier is piecewise, 1 at a held step, and the local adjoint still counts its zero
    hits. Against the sequential schedule (the reference's `where` differentiates the held
    step's discarded update too, which is NaN here)."""
    from mlx_recgen.integrations.mlx_lm import ssd

    rec = ssd(True)
    L = NONFINITE_L
    x, dt = mx.full((1, L, 2, 2), 0.5), mx.full((1, L, 2), 0.4)
    A, B, C = mx.array([-0.6, -0.3]), mx.full((1, L, 1, 2), 0.7), mx.full((1, L, 1, 2), 0.6)
    dt[:, 5] = -INF  # exp(A dt) = inf at the second step of the segment 4..7
    mask = mx.array(np.arange(L) != held)[None]
    y = rec(x, dt, A, B, C, mask, backend="mlx", schedule="sequential")
    weights = mx.random.uniform(0.5, 1.5, y.shape, key=mx.random.key(7))
    weights[:, 5:8 if later else L] = 0.0
    inputs = [x, dt, A, B, C]

    def grads(f):
        return mx.grad(lambda *a: mx.sum(f(*a, mask) * weights), argnums=(0, 1, 3, 4))(*inputs)

    ours = grads(lambda *a: rec(*a, backend=backend, schedule="chunked", seg=NONFINITE_SEG))
    seq = grads(lambda *a: rec(*a, backend=backend, schedule="sequential"))
    for label, a, s in zip(["x", "dt", "B", "C"], ours, seq):
        _assert_same(a, s, f"gradient of {label} against the sequential schedule")
    # the gate reaches x's gradient before it (infinite or NaN, as each backend's sequential
    # steps order the terms of the dt-gradient's -inf)
    assert not np.isfinite(np.array(ours[0][:, :2])).any(), "the case is not met"


@pytest.mark.parametrize("backend", ["mlx", pytest.param("metal-sim", marks=pytest.mark.sim)])
def test_zero_initial_state_gradient(backend):
    """A zero state is no term of a composed map's value, but its derivative is the
    multiplier: the gradient of a zero initial state (and of the multipliers read with it)."""
    rec = rg.load_spec("rglru")
    a = mx.random.uniform(0.2, 0.9, (2, 9, 3))
    x = mx.random.normal((2, 9, 3))
    h0 = mx.zeros((2, 3))
    W = mx.random.normal((2, 9, 3))

    def grads(f):
        return mx.grad(lambda a, x, h: mx.sum(f(a, x, h) * W), argnums=(0, 1, 2))(a, x, h0)

    ours = grads(lambda a, x, h: rec(a, x, initial_state=h, backend=backend,
                                     schedule="chunked", seg=4))
    ref = grads(lambda a, x, h: rec.reference(a, x, initial_state=h))
    for label, g, r in zip(["a", "x", "initial_state"], ours, ref):
        assert rel_err(g, r) < TOL, label
