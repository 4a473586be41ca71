"""``rec.reference``: the traced spec evaluated on MLX arrays, independent of the compiler's
lowering, adjoint and renderers. Its forward is held to the float64 numpy forwards of the custom
specs, and it must keep working (and keep being right) when the renderers are broken."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

import mlx_recgen as rg
from mlx_recgen.render import expr as expr_module
from conftest import rel_err
from test_adjoint import _as_tuple, _finals, _init, make_case

CASES = ["delta_rule", "tanh_rnn", "fancy", "shared_param", "two_states", "normalized",
         "leaky_max", "scalar_sum"]


@pytest.mark.parametrize("name", CASES)
def test_reference_matches_numpy_forward(name):
    case = make_case(name)
    outs, fins = case.rec.reference(*case.inputs, initial_state=_init(case.rec, case.states),
                                    return_state=True)
    np_outs, np_fins = case.np_forward(*[np.array(x, dtype=np.float64)
                                         for x in case.inputs + case.states])
    for a, b in zip(_as_tuple(outs), np_outs):
        assert rel_err(a, b) < 1e-5
    for a, b in zip(_finals(case.rec, fins), np_fins):
        assert a.dtype == mx.float32
        assert rel_err(a, b) < 1e-5


def _components_spec():
    @rg.recurrence(lane="P", state={"h": "B P 2"},
                   inputs={"a": "B L P", "x": "B L P 2", "w": "P"}, outputs={"y": "B L P 2"})
    def rot(h, a, x, w):
        u, v = h[0], h[1]
        h[0] = a * (rg.cos(w) * u - rg.sin(w) * v) + x[0]
        h[1] = a * (rg.sin(w) * u + rg.cos(w) * v) + x[1]
        return {"y": (h[0] * h[1], rg.softplus(h[1]))}
    return rot


def _components_hand(a, x, w, h0):
    u, v = h0[..., 0], h0[..., 1]
    ys = []
    for t in range(a.shape[1]):
        at = a[:, t]
        u, v = (at * (mx.cos(w) * u - mx.sin(w) * v) + x[:, t, :, 0],
                at * (mx.sin(w) * u + mx.cos(w) * v) + x[:, t, :, 1])
        ys.append(mx.stack([u * v, mx.logaddexp(v, 0.0)], axis=-1))
    return mx.stack(ys, axis=1), mx.stack([u, v], axis=-1)


def test_reference_components_and_parameters():
    """Component axes, a lane-wise parameter without time or batch, gradients by autodiff."""
    rec = _components_spec()
    b, L, P = 2, 9, 5
    a, x = mx.random.uniform(-0.9, 0.9, (b, L, P)), mx.random.normal((b, L, P, 2))
    w, h0 = mx.random.normal((P,)), mx.random.normal((b, P, 2))
    Wy, Wh = mx.random.normal((b, L, P, 2)), mx.random.normal((b, P, 2))

    def loss(fn):
        def f(*args):
            y, h = fn(*args)
            return mx.sum(y * Wy) + mx.sum(h * Wh)
        return f

    ours = loss(lambda *z: rec.reference(*z[:3], initial_state=z[3], return_state=True))
    hand = loss(_components_hand)
    assert abs(ours(a, x, w, h0).item() - hand(a, x, w, h0).item()) < 1e-4 * abs(hand(a, x, w, h0).item())
    for g, gh in zip(mx.grad(ours, argnums=(0, 1, 2, 3))(a, x, w, h0),
                     mx.grad(hand, argnums=(0, 1, 2, 3))(a, x, w, h0)):
        assert rel_err(g, gh) < 1e-5


def test_reference_does_not_use_the_compiler(monkeypatch):
    """With every printer, the MLX backend and the lowered programs out of action, the reference
    still runs and still agrees with a hand loop."""
    def broken(*_, **__):
        raise AssertionError("the reference used the compiler")

    rec = _components_spec()
    monkeypatch.setattr(expr_module.ExprPrinter, "__call__", broken)
    monkeypatch.setattr(rec, "_backend", broken)
    rec.forward_program = rec.adjoint = rec.ir = None
    b, L, P = 2, 6, 3
    a, x = mx.random.uniform(-0.9, 0.9, (b, L, P)), mx.random.normal((b, L, P, 2))
    w, h0 = mx.random.normal((P,)), mx.random.normal((b, P, 2))
    y, h = rec.reference(a, x, w, initial_state=h0, return_state=True)
    y_hand, h_hand = _components_hand(a, x, w, h0)
    assert rel_err(y, y_hand) < 1e-5 and rel_err(h, h_hand) < 1e-5


def test_reference_output_dtype_and_broadcast_inputs():
    """Outputs in the inputs' dtype; an input lacking a batch axis is broadcast over it."""
    @rg.recurrence(lane="P", state={"h": "B H P"}, inputs={"x": "B L H P", "g": "L H"},
                   outputs={"y": "B L H P"})
    def gated(h, x, g):
        h = rg.sigmoid(g) * h + x
        return {"y": rg.where(h > 0, h, 0.0) + 1}

    b, L, H, P = 2, 7, 3, 4
    x, g = mx.random.normal((b, L, H, P)), mx.random.normal((L, H))
    y = gated.reference(x.astype(mx.bfloat16), g.astype(mx.bfloat16))
    assert y.dtype == mx.bfloat16 and y.shape == (b, L, H, P)
    h, ys = mx.zeros((b, H, P)), []
    xb, gb = x.astype(mx.bfloat16).astype(mx.float32), g.astype(mx.bfloat16).astype(mx.float32)
    for t in range(L):
        h = mx.sigmoid(gb[t])[None, :, None] * h + xb[:, t]
        ys.append(mx.maximum(h, 0.0) + 1)
    assert rel_err(y, mx.stack(ys, axis=1)) < 1e-2
