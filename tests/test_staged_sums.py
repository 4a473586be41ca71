"""Sums into few outputs in two stages (``layout.staged_sum``, ``layout.spread``): the same sums
as one reduction, in float64 by numpy; the derivative of a spread parameter is that sum; and the
matrix schedule's parameter gradients, summed in stages, against the papers' loops."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from conftest import rel_err
from mlx_recgen import layout
from test_matrix import _assert_matches, _matrix
import test_zoo
from test_zoo import _draw, _reference


@pytest.fixture
def stage_everything(monkeypatch):
    """Stage every sum with fewer than 64 outputs, however small, and record which split."""
    monkeypatch.setattr(layout, "STAGED_MIN_SIZE", 1)
    monkeypatch.setattr(layout, "STAGED_OUTPUTS", 64)
    staged = []
    plan = layout._stage

    def counted(shape, axes):
        stage = plan(shape, axes)
        staged.append(stage is not None)
        return stage

    monkeypatch.setattr(layout, "_stage", counted)
    return staged


def test_a_large_sum_into_few_outputs_is_split():
    # an H16 N64 parameter's gradient over B8 x L4096: 64 runs of 64 steps first
    assert layout._stage((8, 16, 4096, 1, 64), [0, 2]) == (2, 64)
    assert layout._stage((8, 16, 4096, 1, 64), [4]) is None  # outputs enough already
    assert layout._stage((4, 3, 5), [0]) is None  # too small to gain
    assert layout._stage((128, 8191, 2), [1]) is None  # a prime extent does not split
    assert layout._stage((128, 8191, 2), [0, 1]) == (0, 64)  # ... but the other axis does


@pytest.mark.parametrize("shape, axes", [((6, 3, 40, 2, 5), [0, 2]), ((97, 4, 6), [0, 2]),
                                         ((4, 64, 3), [0, 1]), ((5, 2, 9, 8), [0, 2, 3])])
def test_staged_sums_are_the_sums(stage_everything, shape, axes):
    x = mx.random.normal(shape) * 3 - 1
    got = layout.staged_sum(x, axes)
    want = np.sum(np.array(x, dtype=np.float64), axis=tuple(axes), keepdims=True)
    assert got.shape == want.shape
    assert rel_err(got, want) < 1e-6
    assert rel_err(layout.reduce_to(x, want.shape), want) < 1e-6
    assert any(stage_everything)  # the split ran (97 is prime: the other axis split)


def test_the_derivatives_of_a_spread_parameter(stage_everything):
    x = mx.random.normal((1, 3, 1, 1, 5))
    shape = (6, 3, 40, 2, 5)
    w = mx.random.normal(shape)
    y = layout.spread(x, shape)
    assert y.shape == shape and mx.array_equal(y, mx.broadcast_to(x, shape))
    grad = mx.grad(lambda p: mx.sum(layout.spread(p, shape) * w))(x)
    want = np.sum(np.array(w, dtype=np.float64), axis=(0, 2, 3), keepdims=True)
    assert rel_err(grad, want) < 1e-6
    assert any(stage_everything)
    tangent = mx.random.normal(x.shape)
    _, (jvp,) = mx.jvp(lambda p: layout.spread(p, shape), [x], [tangent])
    assert mx.array_equal(jvp, mx.broadcast_to(tangent, shape))
    xs = mx.random.normal((4, *x.shape))
    assert mx.array_equal(mx.vmap(lambda p: layout.spread(p, shape))(xs),
                          mx.broadcast_to(xs[:, None], (4, 1, *shape))[:, 0])


@pytest.mark.parametrize("name", ["mamba2", "rwkv6", "retnet"])
def test_parameter_gradients_in_stages_match_the_paper(stage_everything, monkeypatch, name):
    monkeypatch.setattr(test_zoo, "L", 12)  # steps that split (the zoo's 11 do not)
    mx.random.seed(sum(map(ord, name)) + 1)
    inputs, states = _draw(name)
    _assert_matches(_matrix(name, 4), lambda i, s: _reference(name, i, s), inputs, states)
    assert any(stage_everything)
