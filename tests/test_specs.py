"""The bundled specs against hand-written MLX loops: forward output, final state, and the
gradient of every input and of the initial state (through ``mx.grad``)."""

import mlx.core as mx
import pytest

import mlx_recgen as rg
from conftest import rel_err
from references import INPUTS, REFERENCES, value_and_grads

F32, BF16 = mx.float32, mx.bfloat16

CASES = {
    "ssd": ("ssd", {}),
    "gla": ("gla", {}),  # K=4 != V=5
    "rglru": ("rglru", {}),
    "rglru-negative-a": ("rglru", {"negative": True}),
    "rotlru": ("rotlru", {}),
}


def compiled_value_and_grads(rec, inputs, h0, Wy, Wh, seg):
    def fn(*args):
        return rec(*args[:-1], initial_state=args[-1], return_state=True, backend="mlx", seg=seg)
    return value_and_grads(fn, inputs, h0, Wy, Wh)


def reference_value_and_grads(ref, inputs, h0, Wy, Wh):
    return value_and_grads(ref, inputs, h0, Wy, Wh)


def _setup(case, L=13):
    name, kw = CASES[case]
    rec = rg.load_spec(name)
    inputs, h0 = INPUTS[name](L=L, **kw)
    y_ref, h_ref = REFERENCES[name](*inputs, h0)
    Wy, Wh = mx.random.normal(y_ref.shape), mx.random.normal(h_ref.shape)
    return name, rec, inputs, h0, Wy, Wh


@pytest.mark.parametrize("L,seg", [(13, 4), (13, 32), (70, 32)])
@pytest.mark.parametrize("case", list(CASES))
def test_fp32_forward_state_and_all_gradients(case, L, seg):
    name, rec, inputs, h0, Wy, Wh = _setup(case, L)
    y, h, grads = compiled_value_and_grads(rec, inputs, h0, Wy, Wh, seg)
    y_r, h_r, grads_r = reference_value_and_grads(REFERENCES[name], inputs, h0, Wy, Wh)

    assert y.dtype == F32 and h.dtype == F32
    assert y.shape == y_r.shape and h.shape == h_r.shape
    assert rel_err(y, y_r) < 1e-5
    assert rel_err(h, h_r) < 1e-5
    labels = list(rec.spec.inputs) + ["initial_state"]
    assert len(grads) == len(labels)
    for label, g, g_r, x in zip(labels, grads, grads_r, inputs + [h0]):
        assert g.shape == x.shape, label
        assert g.dtype == x.dtype, label
        assert rel_err(g, g_r) < 1e-5, f"{case}: gradient of {label}"


@pytest.mark.parametrize("case", list(CASES))
def test_reference_method_matches_hand_loop(case):
    """``rec.reference`` (the spec's own per-step loop) agrees with the hand loop too."""
    name, rec, inputs, h0, Wy, Wh = _setup(case)
    y, h = rec.reference(*inputs, initial_state=h0, return_state=True)
    y_r, h_r = REFERENCES[name](*inputs, h0)
    assert rel_err(y, y_r) < 1e-5 and rel_err(h, h_r) < 1e-5


@pytest.mark.parametrize("case", list(CASES))
def test_default_initial_state_is_zero(case):
    name, rec, inputs, h0, Wy, Wh = _setup(case)
    y, h = rec(*inputs, return_state=True, backend="mlx", seg=4)
    y_r, h_r = REFERENCES[name](*inputs)
    assert rel_err(y, y_r) < 1e-5 and rel_err(h, h_r) < 1e-5
    assert rel_err(rec(*inputs, backend="mlx"), y_r) < 1e-5


@pytest.mark.parametrize("case", list(CASES))
def test_bf16_inputs(case):
    """bf16 in, bf16 out and bf16 gradients, close to the fp32 reference of the bf16-rounded
    inputs (the state is fp32 throughout)."""
    name, rec, inputs, h0, Wy, Wh = _setup(case)
    inputs16 = [x.astype(BF16) for x in inputs]
    rounded = [x.astype(F32) for x in inputs16]
    y, h, grads = compiled_value_and_grads(rec, inputs16, h0, Wy, Wh, seg=4)
    y_r, h_r, grads_r = reference_value_and_grads(REFERENCES[name], rounded, h0, Wy, Wh)

    assert y.dtype == BF16, "outputs are written in the inputs' dtype"
    assert h.dtype == F32, "the returned state is fp32"
    assert rel_err(y, y_r) < 1e-2
    assert rel_err(h, h_r) < 1e-2
    labels = list(rec.spec.inputs) + ["initial_state"]
    for label, g, g_r, x in zip(labels, grads, grads_r, inputs16 + [h0]):
        assert g.dtype == x.dtype, f"{case}: gradient of {label} has dtype {g.dtype}"
        assert rel_err(g, g_r) < 1e-2, f"{case}: gradient of {label}"


def test_gradient_under_mx_compile():
    """A training step is usually wrapped in ``mx.compile``; the gradient of a recurrence must
    work there too (and equal the uncompiled one)."""
    rec = rg.load_spec("rglru")
    (a, x), h0 = INPUTS["rglru"](b=2, L=9, D=4)

    def loss(a, x):
        return mx.sum(rec(a, x, backend="mlx", seg=4) ** 2)

    step = mx.grad(loss, argnums=(0, 1))
    expected = step(a, x)
    got = mx.compile(step)(a, x)
    for g, e in zip(got, expected):
        assert rel_err(g, e) < 1e-6
