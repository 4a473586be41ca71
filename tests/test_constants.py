"""Non-finite constants in a spec (``float("inf")``, ``float("-inf")``, ``float("nan")``): printed
for every target and run on ``mlx`` and ``metal-sim``, values and gradients against hand-written
MLX loops. Constants that are not real (``sympy.I``, ``x / 0``) are refused when the spec is
defined."""

from __future__ import annotations

import shutil

import mlx.core as mx
import numpy as np
import pytest
import sympy

import mlx_recgen as rg
from conftest import assert_nvcc_compiles, rel_err

INF = float("inf")
BACKENDS = ["mlx", pytest.param("metal-sim", marks=pytest.mark.sim)]


@rg.recurrence(lane="D", state={"h": "B D"}, inputs={"x": "B L D"}, outputs={"y": "B L D"})
def running_max(h, x):
    """The running maximum of the positive inputs (non-positive ones never count)."""
    h = rg.maximum(h, rg.where(x > 0, x, float("-inf")))
    return {"y": h}


def running_max_ref(x, h0):
    h, ys = h0, []
    for t in range(x.shape[1]):
        h = mx.maximum(h, mx.where(x[:, t] > 0, x[:, t], -mx.inf))
        ys.append(h)
    return mx.stack(ys, axis=1), h


@rg.recurrence(lane="D", state={"h": "B D"}, inputs={"x": "B L D"}, outputs={"y": "B L D"})
def running_min(h, x):
    """The running minimum of the negative inputs."""
    h = rg.minimum(h, rg.where(x < 0, x, float("inf")))
    return {"y": h}


def running_min_ref(x, h0):
    h, ys = h0, []
    for t in range(x.shape[1]):
        h = mx.minimum(h, mx.where(x[:, t] < 0, x[:, t], mx.inf))
        ys.append(h)
    return mx.stack(ys, axis=1), h


@rg.recurrence(lane="D", state={"h": "B D"}, inputs={"dt": "B L D", "x": "B L D"},
               outputs={"y": "B L D"})
def clamped(h, dt, x):
    """A decay whose step is clamped to [0, inf), as mlx-lm's time_step_limit=(0, inf)."""
    d = rg.minimum(rg.maximum(rg.softplus(dt) - 0.5, 0.0), float("inf"))
    h = rg.exp(-d) * h + d * x
    return {"y": h}


def clamped_ref(dt, x, h0):
    h, ys = h0, []
    for t in range(x.shape[1]):
        d = mx.minimum(mx.maximum(mx.logaddexp(dt[:, t], 0.0) - 0.5, 0.0), mx.inf)
        h = mx.exp(-d) * h + d * x[:, t]
        ys.append(h)
    return mx.stack(ys, axis=1), h


@rg.recurrence(lane="D", state={"h": "B D"}, inputs={"a": "B L D", "x": "B L D"},
               outputs={"y": "B L D"})
def masked(h, a, x):
    """A linear scan whose output is NaN where x > 1."""
    h = a * h + x
    return {"y": rg.where(x > 1.0, float("nan"), h)}


def masked_ref(a, x, h0):
    h, ys = h0, []
    for t in range(x.shape[1]):
        h = a[:, t] * h + x[:, t]
        ys.append(mx.where(x[:, t] > 1.0, mx.nan, h))
    return mx.stack(ys, axis=1), h


def _run(rec, backend, inputs, h0):
    return rec(*inputs, initial_state=h0, return_state=True, backend=backend, seg=4)


def _grads(fn, inputs, h0, Wy, Wh):
    """Gradients of sum(y * Wy) + sum(h * Wh) w.r.t. every input and h0 (NaN outputs masked)."""
    def loss(*args):
        y, h = fn(*args[:-1], args[-1])
        return mx.sum(mx.where(mx.isnan(y), 0.0, y) * Wy) + mx.sum(h * Wh)
    return mx.grad(loss, argnums=tuple(range(len(inputs) + 1)))(*inputs, h0)


def _check(rec, ref, backend, inputs, h0):
    y, h = _run(rec, backend, inputs, h0)
    y_ref, h_ref = ref(*inputs, h0)
    y_rec, h_rec = rec.reference(*inputs, initial_state=h0, return_state=True)
    np.testing.assert_allclose(np.array(y_rec), np.array(y_ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(h_rec), np.array(h_ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(y), np.array(y_ref), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(np.array(h), np.array(h_ref), rtol=1e-5, atol=1e-6)
    Wy, Wh = mx.random.normal(y_ref.shape), mx.random.normal(h_ref.shape)
    ours = _grads(lambda *a: _run(rec, backend, a[:-1], a[-1]), inputs, h0, Wy, Wh)
    hand = _grads(ref, inputs, h0, Wy, Wh)
    for i, (a, b) in enumerate(zip(ours, hand)):
        assert rel_err(a, b) < 1e-5, f"{rec.name} on {backend}: gradient of argument {i}"
    return y, h


def test_constants_are_printed_for_every_target():
    for rec, inf in ((running_max, "-"), (running_min, "")):
        assert f"{inf}mx.inf" in rec.source("forward", backend="mlx")
        assert f"{inf}INFINITY" in rec.source("forward", backend="metal")
        assert f"{inf}__int_as_float(0x7f800000)" in rec.source("forward", backend="cuda")
    assert "mx.nan" in masked.source("forward", backend="mlx")
    assert "NAN" in masked.source("forward", backend="metal")
    assert "__int_as_float(0x7fffffff)" in masked.source("forward", backend="cuda")
    for backend in ("mlx", "metal", "cuda"):
        assert "inff" not in running_max.source("forward", backend=backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("rec, ref, sign", [(running_max, running_max_ref, -1),
                                            (running_min, running_min_ref, 1)],
                         ids=["max", "min"])
def test_running_extremum(backend, rec, ref, sign):
    x = mx.random.normal((2, 11, 5))
    h0 = mx.random.normal((2, 5))  # both signs: some lanes start beyond every input
    _check(rec, ref, backend, [x], h0)
    # starting from -inf (+inf): infinite until the first positive (negative) input
    start = mx.full((2, 5), sign * INF)
    y, h = _run(rec, backend, [x], start)
    y_ref, h_ref = ref(x, start)
    assert np.isinf(np.array(y_ref)).any() and np.isfinite(np.array(y_ref)).any()
    np.testing.assert_array_equal(np.array(y), np.array(y_ref))
    np.testing.assert_array_equal(np.array(h), np.array(h_ref))


@pytest.mark.parametrize("backend", BACKENDS)
def test_clamp_with_infinite_bound(backend):
    dt, x = mx.random.normal((2, 11, 5)), mx.random.normal((2, 11, 5))
    assert (mx.logaddexp(dt, 0.0) < 0.5).any().item()  # the lower bound bites somewhere
    _check(clamped, clamped_ref, backend, [dt, x], mx.random.normal((2, 5)))


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_constant(backend):
    a, x = mx.random.uniform(-0.9, 0.9, (2, 11, 5)), mx.random.normal((2, 11, 5))
    y, _ = _check(masked, masked_ref, backend, [a, x], mx.random.normal((2, 5)))
    assert np.isnan(np.array(y)).any() and not np.isnan(np.array(y)).all()


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("kernel", ["forward", "backward"])
def test_cuda_text_with_constants_compiles(tmp_path, kernel):
    """The CUDA text compiles with nvcc (MLX's device header replaced by a stub)."""
    sources = []
    for rec in (running_max, running_min, masked):
        text = rec.source(kernel, backend="cuda")
        text = text.replace('#include "mlx/backend/cuda/device/utils.cuh"', "#include <cstdint>")
        sources.append(tmp_path / f"{rec.name}_{kernel}.cu")
        sources[-1].write_text(text)
    assert_nvcc_compiles(sources, flags=())



# ---------------------------------------------------------------------------------------------
# Constants that are not real numbers: refused when the spec is defined
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("body, what", [
    (lambda h, x: {"y": h + sympy.I * x}, r"'I'"),
    (lambda h, x: {"y": h + x / 0}, r"zoo"),
    (lambda h, x: {"y": h + sympy.zoo}, r"zoo"),
])
def test_complex_constants_are_refused_at_definition(body, what):
    def spec(h, x):
        h = 0.5 * h + x
        return body(h, x)

    with pytest.raises(rg.SpecError, match=r"spec 'nonreal': output 'y' .*" + what
                       + r".*not a real number"):
        rg.recurrence(lane="D", state={"h": "B D"}, inputs={"x": "B L D"},
                      outputs={"y": "B L D"}, name="nonreal")(spec)


def test_complex_constant_in_state_update_is_refused():
    def spec(h, x):
        h = h * sympy.exp(sympy.I * x)
        return {"y": h}

    with pytest.raises(rg.SpecError, match=r"spec 'rot': state 'h' .*not a real number"):
        rg.recurrence(lane="D", state={"h": "B D"}, inputs={"x": "B L D"},
                      outputs={"y": "B L D"}, name="rot")(spec)
