"""Chunking: L steps at once equal two chunks with the first chunk's final state passed as the
second's ``initial_state`` — outputs, final state and gradients, including the gradient of the
first chunk's inputs that flows through the passed state."""

import mlx.core as mx
import pytest

import mlx_recgen as rg
from mlx_recgen import scans
from conftest import rel_err
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
