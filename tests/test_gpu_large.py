"""Large cases only an NVIDIA GPU can run (marker ``gpu``): long sequences, inputs with more
than 2^31 elements (64-bit offsets) and batches far beyond one wave of threads."""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_recgen as rg
from references import INPUTS, rglru_ref, ssd_ref, state_loss_weights, value_and_grads
from conftest import rel_err

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(
    not (hasattr(mx, "cuda") and mx.cuda.is_available()),
    reason="MLX has no CUDA backend on this machine")]


def test_long_sequence_ssd():
    inputs, h0 = INPUTS["ssd"](b=2, L=8192, H=2, P=64, N=16)
    y_ref, h_ref = ssd_ref(*inputs, h0)
    Wy, Wh = state_loss_weights(y_ref, h_ref)
    rec = rg.load_spec("ssd")
    ry, rh, rgrads = value_and_grads(
        lambda *a: rec(*a[:-1], initial_state=a[-1], return_state=True, backend="mlx"),
        inputs, h0, Wy, Wh)
    ky, kh, kgrads = value_and_grads(
        lambda *a: rec(*a[:-1], initial_state=a[-1], return_state=True, backend="cuda"),
        inputs, h0, Wy, Wh)
    assert rel_err(ky, ry) < 1e-5 and rel_err(kh, rh) < 1e-5
    for g, r in zip(kgrads, rgrads):
        assert rel_err(g, r) < 1e-4


def test_many_instances_gla():
    """B*H instances far above one wave (132 SMs x 2048 threads)."""
    inputs, S0 = INPUTS["gla"](b=64, L=64, H=32, K=16, V=64)
    rec = rg.load_spec("gla")
    y_c, s_c = rec(*inputs, initial_state=S0, return_state=True, backend="cuda")
    y_m, s_m = rec(*inputs, initial_state=S0, return_state=True, backend="mlx")
    assert rel_err(y_c, y_m) < 1e-5 and rel_err(s_c, s_m) < 1e-5


def test_offsets_beyond_2_to_31():
    """x has 2^31 + 2^22 elements: the last lanes are addressed past 2^31."""
    b, L, D = 2, 32768, 32832
    assert b * L * D > 2**31
    a = mx.random.uniform(0.5, 0.99, (b, L, D)).astype(mx.bfloat16)
    x = mx.random.normal((b, L, D)).astype(mx.bfloat16)
    rec = rg.load_spec("rglru")
    y, h = rec(a, x, return_state=True, backend="cuda")
    w = mx.random.normal((b, L, 64)).astype(mx.bfloat16)

    def loss(a, x):
        return mx.sum((rec(a, x, backend="cuda")[:, :, -64:] * w).astype(mx.float32))

    da, dx = mx.grad(loss, argnums=(0, 1))(a, x)
    tail_y, tail_h = rglru_ref(a[:, :, -64:], x[:, :, -64:])
    assert rel_err(y[:, :, -64:], tail_y) < 2e-2
    assert rel_err(h[:, -64:], tail_h) < 1e-5

    def loss_ref(a, x):
        return mx.sum(rglru_ref(a, x)[0].astype(mx.float32) * w.astype(mx.float32))

    ra, rx = mx.grad(loss_ref, argnums=(0, 1))(a[:, :, -64:], x[:, :, -64:])
    assert rel_err(da[:, :, -64:], ra) < 2e-2
    assert rel_err(dx[:, :, -64:], rx) < 2e-2
