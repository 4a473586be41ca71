"""``mx.compile`` of ``mx.grad`` through a recurrence on the pure-MLX backend, sequential
schedule: the backward recomputes each segment's forward, so the compiled graph holds the same
per-step slices twice and ``mx.compile`` merges them. It must trace, and agree with the
uncompiled gradient, for every input and the initial state, with several segments."""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_recgen as rg
from conftest import rel_err

SIZES = dict(B=2, L=6, H=2, K=3, V=4, P=3, N=3, D=4, G=1)
SEG = 4  # two segments, the last one shorter


def _draw(rec):
    """Inputs in (0.2, 0.8), initial states in (-0.5, 0.5): bounded over six steps in every
    spec below (decays and step sizes positive, gates below one)."""
    def shape(t):
        return tuple(a if isinstance(a, int) else SIZES[a] for a in t.axes)

    inputs = [mx.random.uniform(0.2, 0.8, shape(t)) for t in rec.spec.inputs.values()]
    states = {t.name: mx.random.uniform(-0.5, 0.5, shape(t)) for t in rec.spec.states.values()}
    return inputs, states


@pytest.mark.parametrize("name", ["gla", "ssd", "gated_deltanet", "mingru", "mamba2",
                                  "complex_lru", "rglru"])
def test_compiled_grad_matches_grad(name):
    rec = rg.load_spec(name)
    inputs, states = _draw(rec)
    n = len(inputs)
    w = mx.random.normal(rec(*inputs, initial_state=states, backend="mlx").shape)

    def loss(*a):
        y = rec(*a[:n], initial_state=dict(zip(states, a[n:])), backend="mlx",
                schedule="sequential", seg=SEG)
        return mx.sum(y * w)

    args = inputs + list(states.values())
    grad = mx.grad(loss, argnums=tuple(range(len(args))))
    want, got = grad(*args), mx.compile(grad)(*args)
    for label, g, r in zip(list(rec.spec.inputs) + list(states), got, want):
        assert rel_err(g, r) < 1e-5, f"{name}: gradient of {label}"


@rg.recurrence(lane="D", state={"h": "B D"}, inputs={"a": "B L D", "x": "B L D"},
               outputs={"y": "B L D"})
def gated_product(h, a, x):
    h = a * h + x
    return {"y": h * x}


@pytest.mark.parametrize("argnums", [0, 1, (0, 1)])
def test_compiled_grad_of_some_inputs(argnums):
    a, x = mx.random.uniform(0.5, 0.9, (1, 4, 2)), mx.random.normal((1, 4, 2))

    def loss(a, x):
        return gated_product(a, x, backend="mlx", schedule="sequential").sum()

    grad = mx.grad(loss, argnums=argnums)
    want, got = grad(a, x), mx.compile(grad)(a, x)
    for g, r in zip(*(v if isinstance(v, tuple) else (v,) for v in (got, want))):
        assert rel_err(g, r) < 1e-5
