"""Shapes: B=1, L=1, L not a multiple of the segment, seg=1, lane and state sizes that are not
multiples of 32 (1, 7, 33 / 1, 3, 16). Forward, final state and every gradient against the hand
references, for ssd, gla and rglru."""

import mlx.core as mx
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import mlx_recgen as rg
from conftest import rel_err
from references import (gla_inputs, gla_ref, rglru_inputs, rglru_ref, ssd_inputs, ssd_ref,
                        value_and_grads)

SETTINGS = settings(max_examples=15, deadline=None,
                    suppress_health_check=[HealthCheck.function_scoped_fixture])

batch = st.sampled_from([1, 2])
length = st.sampled_from([1, 2, 5, 13, 34])
segs = st.sampled_from([1, 3, 8, 32])
lanes = st.sampled_from([1, 7, 33])
states = st.sampled_from([1, 3, 16])
heads = st.sampled_from([1, 2])


def _check(name, rec, ref, inputs, h0, seg, tol=1e-5):
    """Compiler vs the hand reference. Ground truth is the hand loop in float64; the compiler
    must be within ``tol`` of it, or (for a gradient that is a long sum with cancellation, e.g.
    a single gate summed over lanes x state) no more than 10x as far as the fp32 hand loop."""
    mx.eval(inputs, h0)
    y_r, h_r = ref(*inputs, h0)
    Wy, Wh = mx.random.normal(y_r.shape), mx.random.normal(h_r.shape)

    def fn(*args):
        return rec(*args[:-1], initial_state=args[-1], return_state=True, backend="mlx", seg=seg)

    def ref64(*args):
        return ref(*args, dtype=mx.float64)

    y, h, grads = value_and_grads(fn, inputs, h0, Wy, Wh)
    y_r, h_r, grads_r = value_and_grads(ref, inputs, h0, Wy, Wh)
    y_64, h_64, grads_64 = value_and_grads(ref64, inputs, h0, Wy, Wh)
    where = (name, [tuple(x.shape) for x in inputs], f"seg={seg}")
    assert y.shape == y_r.shape and h.shape == h_r.shape, where
    labels = ["output", "final state"] + [f"grad {x}" for x in rec.spec.inputs] + ["grad h0"]
    for label, a, r32, r64 in zip(labels, [y, h] + grads, [y_r, h_r] + grads_r,
                                  [y_64, h_64] + grads_64):
        assert a.shape == r64.shape, (label, where)
        err, ref_err = rel_err(a, r64), rel_err(r32, r64)
        assert err < max(tol, 10 * ref_err), (label, where, err, ref_err)


@SETTINGS
@given(b=batch, L=length, seg=segs, H=heads, P=lanes, N=states)
@example(b=1, L=1, seg=1, H=1, P=1, N=1)
@example(b=1, L=13, seg=8, H=1, P=33, N=3)
@example(b=2, L=5, seg=1, H=2, P=7, N=16)
def test_ssd_shapes(b, L, seg, H, P, N):
    mx.random.seed(b + 10 * L + 100 * seg + 1000 * P + 10000 * N)
    inputs, h0 = ssd_inputs(b, L, H, P, N)
    _check("ssd", rg.load_spec("ssd"), ssd_ref, inputs, h0, seg)


@SETTINGS
@given(b=batch, L=length, seg=segs, H=heads, K=states, V=lanes)
@example(b=1, L=1, seg=1, H=1, K=1, V=1)
@example(b=1, L=34, seg=32, H=1, K=16, V=33)
@example(b=2, L=13, seg=3, H=2, K=3, V=7)
def test_gla_shapes(b, L, seg, H, K, V):
    mx.random.seed(b + 10 * L + 100 * seg + 1000 * K + 10000 * V)
    inputs, S0 = gla_inputs(b, L, H, K, V)
    _check("gla", rg.load_spec("gla"), gla_ref, inputs, S0, seg)


@SETTINGS
@given(b=batch, L=length, seg=segs, D=lanes, negative=st.booleans())
@example(b=1, L=1, seg=1, D=1, negative=False)
@example(b=1, L=34, seg=8, D=33, negative=True)
def test_rglru_shapes(b, L, seg, D, negative):
    mx.random.seed(b + 10 * L + 100 * seg + 1000 * D)
    inputs, h0 = rglru_inputs(b, L, D, negative=negative)
    _check("rglru", rg.load_spec("rglru"), rglru_ref, inputs, h0, seg)
