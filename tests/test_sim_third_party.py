"""Metal kernels nobody on this project wrote, run on the simulator through
``sim.patch_mlx`` and compared with their library's own reference path.

mlx-lm's kernels (gated delta in six variants, SSM, RWKV-7, two fused norms) take their
Metal path only when ``mx.metal.is_available()`` and the default device is the GPU, and
build their kernels at import: under ``patch_mlx(rebuild=[module])`` both hold on Linux.
The reference is mlx-lm's ops path (the same public function outside the patch), or an
independent numpy formula where the library has none. The last tests are kernels of the
kind MLX's custom-kernel documentation shows (written here, small).
"""

import contextlib
import importlib

import mlx.core as mx
import numpy as np
import pytest

from mlx_recgen import sim

pytestmark = [
    pytest.mark.sim,
    pytest.mark.skipif(not sim.is_available(), reason="no C++ compiler for the Metal simulator"),
    pytest.mark.filterwarnings("ignore:clang\\+\\+ not found"),
]

rng = np.random.default_rng(2024)


def randn(*shape, dtype=mx.float32):
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(dtype)


def close(a, b, tol=1e-4):
    np.testing.assert_allclose(np.array(a.astype(mx.float32)), np.array(b.astype(mx.float32)),
                               rtol=tol, atol=tol)


# -- the patch itself -----------------------------------------------------------------
def test_patch_swaps_and_restores():
    before = (mx.fast.metal_kernel, mx.metal.is_available, mx.default_device)
    with sim.patch_mlx():
        assert mx.metal.is_available()
        assert mx.default_device() == mx.gpu
        k = mx.fast.metal_kernel("p", ["x"], ["out"], "out[0] = x[0];")
        assert isinstance(k, sim.SimKernel)
    assert (mx.fast.metal_kernel, mx.metal.is_available, mx.default_device) == before


def test_patch_restores_after_an_error_and_passes_options():
    before = mx.fast.metal_kernel
    src = "uint i = thread_position_in_grid.x; out[i] = x[i]; out[0] = 1.0f;"
    with pytest.raises(sim.DataRaceError, match="same value"):
        with sim.patch_mlx(strict_races=True):
            k = mx.fast.metal_kernel("p_strict", ["x"], ["out"], src)
            k(inputs=[mx.ones(64)], grid=(64, 1, 1), threadgroup=(64, 1, 1),
              output_shapes=[(64,)], output_dtypes=[mx.float32])
    assert mx.fast.metal_kernel is before


def test_patch_blocks_nest():
    before = (mx.fast.metal_kernel, mx.metal.is_available, mx.default_device)
    with sim.patch_mlx():
        outer = mx.fast.metal_kernel
        with sim.patch_mlx(strict_races=True):
            assert mx.fast.metal_kernel is not outer and mx.metal.is_available()
        assert mx.fast.metal_kernel is outer and mx.metal.is_available()
        assert mx.default_device() == mx.gpu
    assert (mx.fast.metal_kernel, mx.metal.is_available, mx.default_device) == before


# -- mlx-lm ---------------------------------------------------------------------------
mlx_lm = pytest.importorskip("mlx_lm", reason="mlx-lm (optional extra) is not installed")


def gated_delta_inputs(Dk, Dv, vectorized=False, masked=False, B=1, T=3, Hk=1, Hv=2):
    q, k = randn(B, T, Hk, Dk), randn(B, T, Hk, Dk)
    q, k = q / Dk ** 0.5, k / Dk ** 0.5
    v = randn(B, T, Hv, Dv)
    gshape = (B, T, Hv, Dk) if vectorized else (B, T, Hv)
    g = mx.exp(-mx.abs(randn(*gshape)))
    beta = mx.sigmoid(randn(B, T, Hv))
    state = randn(B, Hv, Dv, Dk)
    mask = mx.array(np.array([[True, False, True]] * B)) if masked else None
    return q, k, v, g, beta, state, mask


GD = "mlx_lm.models.gated_delta"


@pytest.mark.parametrize("vectorized,masked", [(False, False), (False, True), (True, False),
                                               (True, True)],
                         ids=["scalar", "scalar-masked", "vector", "vector-masked"])
def test_mlx_lm_gated_delta_kernels(vectorized, masked):
    from mlx_lm.models import gated_delta as gd

    q, k, v, g, beta, state, mask = gated_delta_inputs(32, 4, vectorized, masked)
    with sim.patch_mlx(rebuild=[GD]):
        kernel = (gd._gated_delta_kernel_vec if vectorized else gd._gated_delta_kernel)
        assert isinstance(kernel, sim.SimKernel)
        # the masked kernels zero y from every lane: same-value stores, a warning
        with pytest.warns(sim.SameValueStoreWarning) if masked else contextlib.nullcontext():
            y, s = gd.gated_delta_kernel(q, k, v, g, beta, state, mask)
    y_ref, s_ref = gd.gated_delta_ops(q, k, v, g, beta, state, mask)
    if masked:
        # at masked (padding) steps the kernels write y = 0 and the ops path computes y
        # from the unchanged state: the outputs agree where the mask is set
        y, y_ref = (mx.where(mask[:, :, None, None], z, 0) for z in (y, y_ref))
    close(y, y_ref)
    close(s, s_ref)


def test_mlx_lm_gated_delta_public_path_takes_the_kernel(monkeypatch):
    # gated_delta_update picks its path by mx.default_device() and mx.metal.is_available()
    from mlx_lm.models import gated_delta as gd

    B, T, Hk, Hv, Dk, Dv = 1, 3, 1, 2, 32, 4
    q, k, v = randn(B, T, Hk, Dk) / 6, randn(B, T, Hk, Dk) / 6, randn(B, T, Hv, Dv)
    a, b = randn(B, T, Hv), randn(B, T, Hv)
    A_log, dt_bias = randn(Hv), randn(Hv)
    state = randn(B, Hv, Dv, Dk)
    y_ref, s_ref = gd.gated_delta_update(q, k, v, a, b, A_log, dt_bias, state)
    with sim.patch_mlx(rebuild=[GD]):
        with monkeypatch.context() as m:
            m.setattr(gd, "gated_delta_ops", lambda *a, **k: pytest.fail("took the ops path"))
            y, s = gd.gated_delta_update(q, k, v, a, b, A_log, dt_bias, state)
    close(y, y_ref)
    close(s, s_ref)


def test_mlx_lm_gated_delta_packed_and_tree_kernels():
    from mlx_lm.models import gated_delta as gd

    q, k, v, g, beta, state, _ = gated_delta_inputs(128, 8)
    with sim.patch_mlx(rebuild=[GD]):
        y_packed, s_packed = gd.gated_delta_kernel(q, k, v, g, beta, state)
        y_tree, s_tree = gd.gated_delta_kernel_xtree(q, k, v, g, beta, state)
    y_ref, s_ref = gd.gated_delta_ops(q, k, v, g, beta, state)
    for y, s in ((y_packed, s_packed), (y_tree, s_tree)):
        close(y, y_ref)
        close(s, s_ref)


def test_mlx_lm_ssm_update_kernel():
    from mlx_lm.models import ssm

    n, h, d, ds = 1, 2, 8, 32
    x = randn(n, 1, h, d)
    B, C = randn(n, 1, 1, ds), randn(n, 1, 1, ds)
    A_log, D, dt_bias = randn(h), randn(h), randn(h)
    dt = randn(n, 1, h)
    state = randn(n, h, d, ds)
    with sim.patch_mlx(rebuild=["mlx_lm.models.ssm"]):
        assert isinstance(ssm._ssm_kernel, sim.SimKernel)
        y, s = ssm.ssm_update(x, A_log, B, C, D, dt, dt_bias, state)
    y_ref, s_ref = ssm.ssm_update(x, A_log, B, C, D, dt, dt_bias, state)
    close(y, y_ref)
    close(s, s_ref)


def test_mlx_lm_rwkv7_kernel():
    from mlx_lm.models import rwkv7

    B, T, H, D = 1, 3, 2, 32
    r, k, v = randn(B, T, H, D), randn(B, T, H, D), randn(B, T, H, D)
    w = mx.exp(-mx.exp(randn(B, T, H, D)))
    kk = rwkv7.l2_norm(randn(B, T, H, D))
    a, b = -kk, kk * mx.sigmoid(randn(B, T, H, D))
    state = randn(B, H, D, D) / 4
    with sim.patch_mlx(rebuild=["mlx_lm.models.rwkv7"]):
        y, s = rwkv7.wkv7_kernel(r, w, k, v, a, b, state)
    ys, s_ref = [], state
    for t in range(T):
        y_t, s_ref = rwkv7._wkv7_step_ops(r[:, t], w[:, t], k[:, t], v[:, t], a[:, t], b[:, t],
                                         s_ref)
        ys.append(y_t)
    close(y, mx.stack(ys, axis=1)[..., 0], tol=1e-3)
    close(s, s_ref, tol=1e-3)


def rms(x, axis=-1, eps=1e-6):
    return x / np.sqrt((x * x).mean(axis=axis, keepdims=True) + eps)


def test_mlx_lm_qk_norm_kernel():
    mod = importlib.import_module("mlx_lm.kernels.qk_norm")

    N, HQ, HK, D = 3, 2, 1, 64
    qkvg = randn(N, 2 * (HQ + HK) * D)
    with sim.patch_mlx(rebuild=["mlx_lm.kernels.qk_norm"]):
        q, k = mod.qk_norm(qkvg, n_heads=HQ, n_kv_heads=HK, head_dim=D, eps=1e-6,
                           query_scale=0.5)
    x = np.array(qkvg)
    q_ref = rms(x[:, :HQ * D].reshape(N, HQ, D)) * 0.5
    k_ref = rms(x[:, HQ * D:(HQ + HK) * D].reshape(N, HK, D))
    np.testing.assert_allclose(np.array(q), q_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(np.array(k), k_ref, rtol=1e-5, atol=1e-5)


def test_mlx_lm_rms_norm_sigmoid_gate_kernel():
    mod = importlib.import_module("mlx_lm.kernels.rms_norm_sigmoid_gate")

    B, H, L, D = 1, 3, 2, 32
    x, gate = randn(B, H, L, D), randn(B, L, H * D)
    with sim.patch_mlx(rebuild=["mlx_lm.kernels.rms_norm_sigmoid_gate"]):
        out = mod.rms_norm_sigmoid_gate(x, gate, eps=1e-6)
    xn = rms(np.array(x)).transpose(0, 2, 1, 3).reshape(B, L, H * D)
    want = xn / (1 + np.exp(-np.array(gate)))
    np.testing.assert_allclose(np.array(out), want, rtol=1e-5, atol=1e-5)


def test_mlx_lm_deepseek_v41_sinkhorn_kernel():
    mod = importlib.import_module("mlx_lm.models.deepseek_v41")
    comb, eps = mx.exp(randn(5, 4, 4)), mx.array([1e-6])
    ref = mod._sinkhorn(comb, iters=3, eps=eps)
    with sim.patch_mlx(rebuild=["mlx_lm.models.deepseek_v41"]):
        assert isinstance(mod._sinkhorn_kernel, sim.SimKernel)
        out = mod._sinkhorn(comb, iters=3, eps=eps)
    close(out, ref, tol=1e-6)


def test_mlx_lm_kimi_k3_attention_residual_kernel():
    mod = importlib.import_module("mlx_lm.models.kimi_k3")
    D = 64
    blocks = mod.ResidualBlocks(1e-6)
    for _ in range(2):
        blocks.append(randn(1, 3, D))
    partial, w_eff = randn(1, 3, D), randn(D) / 8
    ref = mod._attn_res_mix(blocks, partial, w_eff, 1e-6, use_kernel=False)
    with sim.patch_mlx(rebuild=["mlx_lm.models.kimi_k3"]):
        assert isinstance(mod._attn_res_kernel, sim.SimKernel)
        out = mod._attn_res_mix(blocks, partial, w_eff, 1e-6)
    close(out, ref, tol=1e-5)


def test_mlx_lm_norm_add_norm_kernels():
    # three kernels: post-norm + gated add (+ pre-norm of the sum), and the pre-norm alone;
    # D = 512 gives 64-thread rows, so the block sums go through threadgroup memory
    mod = importlib.import_module("mlx_lm.kernels.norm_add_norm")
    import mlx.nn as nn

    N, D, eps = 2, 512, 1e-6
    branch, stream = randn(N, D), randn(N, D)
    alpha, beta, post_w = randn(D), randn(D), randn(D)
    norm = nn.RMSNorm(D, eps=eps)
    norm.weight = randn(D)
    with sim.patch_mlx(rebuild=["mlx_lm.kernels.norm_add_norm"]):
        s1, normed = mod.norm_add_norm(branch, stream, alpha=alpha, beta=beta,
                                       post_weight=post_w, post_eps=eps, next_norm=norm)
        s2, none = mod.norm_add_norm(branch, stream, alpha=alpha, beta=beta, post_weight=None,
                                     post_eps=eps, next_norm=None)
        pre = mod.pre_norm(s1, norm, dtype=mx.float32)
    b, st, al, be, pw, w = (np.array(a).astype(np.float64)
                            for a in (branch, stream, alpha, beta, post_w, norm.weight))
    want1 = al * st + be * rms(b * pw, eps=eps)
    want2 = al * st + be * rms(b, eps=eps)
    assert none is None
    for got, want in ((s1, want1), (s2, want2), (normed, rms(want1, eps=eps) * w),
                      (pre, rms(want1, eps=eps) * w)):
        np.testing.assert_allclose(np.array(got), want, rtol=1e-4, atol=1e-4)


def test_mlx_lm_expert_routing_kernel():
    mod = importlib.import_module("mlx_lm.kernels.expert_routing")
    T, E, K = 4, 48, 3
    logits, bias = randn(T, E), randn(E) / 4
    with sim.patch_mlx(rebuild=["mlx_lm.kernels.expert_routing"]):
        inds, weights = mod.expert_routing(logits, bias, top_k=K, multiplier=1.5, score_eps=1e-9,
                                           route_scale=2.0)
    score = 1 / (1 + np.exp(-1.5 * np.array(logits).astype(np.float64)))
    top = np.argsort(-(score + np.array(bias)), axis=-1, kind="stable")[:, :K]
    w = np.take_along_axis(score, top, -1)
    np.testing.assert_array_equal(np.array(inds), top)
    np.testing.assert_allclose(np.array(weights), w / w.sum(-1, keepdims=True) * 2.0, rtol=1e-5)


def test_mlx_lm_qk_norm_rope_kernel():
    mod = importlib.import_module("mlx_lm.kernels.qk_norm_rope")
    B, L, HQ, HK, D = 1, 3, 2, 1, 64
    qkvg = randn(B, L, 2 * (HQ + HK) * D)
    with sim.patch_mlx(rebuild=["mlx_lm.kernels.qk_norm_rope"]):
        q, k = mod.qk_norm_rope(qkvg, n_heads=HQ, n_kv_heads=HK, head_dim=D, eps=1e-6,
                                query_scale=0.5, rope_base=10000.0, offset=5)
    x = np.array(qkvg)
    q_n = mx.array(rms(x[..., :HQ * D].reshape(B, L, HQ, D)) * 0.5)
    k_n = mx.array(rms(x[..., HQ * D:(HQ + HK) * D].reshape(B, L, HK, D)))

    def rope(a):  # rotate along L, per head
        a = a.transpose(0, 2, 1, 3)
        return mx.fast.rope(a, D, traditional=True, base=10000.0, scale=1.0,
                            offset=5).transpose(0, 2, 1, 3)

    close(q, rope(q_n), tol=1e-4)
    close(k, rope(k_n), tol=1e-4)


def test_mlx_lm_post_expert_norm_combine_kernel():
    mod = importlib.import_module("mlx_lm.kernels.post_expert_norm_combine")
    T, K, D = 2, 3, 256
    experts, weights, norm_w = randn(T, K, D), randn(T, K), randn(D)
    with sim.patch_mlx(rebuild=["mlx_lm.kernels.post_expert_norm_combine"]):
        out = mod.post_expert_norm_combine(experts, weights, norm_weight=norm_w, eps=1e-6)
    x = np.array(experts).astype(np.float64) * np.array(norm_w)
    want = (rms(x) * np.array(weights)[..., None]).sum(1)
    np.testing.assert_allclose(np.array(out), want, rtol=1e-4, atol=1e-4)


LOSSES = "mlx_lm.tuner.losses"


@pytest.mark.parametrize("name", ["kl_div_loss", "js_div_loss"])
def test_mlx_lm_loss_kernels_values(name):
    # forward and backward kernels against mlx-lm's ops path; race checking is off here
    # because these kernels (mlx-lm 0.32) miss a barrier, see the next test
    losses = importlib.import_module(LOSSES)
    q, p, cot = randn(2, 64), randn(2, 64), randn(2)

    def loss_vjp():
        return mx.vjp(lambda a: getattr(losses, name)(a, p), [q], [cot])

    (ref,), (gref,) = loss_vjp()
    with sim.patch_mlx(rebuild=[LOSSES], check_races=False):
        assert isinstance(losses._kl_forward_kernel, sim.SimKernel)
        (out,), (grad,) = loss_vjp()
    close(out, ref, tol=1e-5)
    close(grad, gref, tol=1e-5)


@pytest.mark.parametrize("name", ["kl", "js"])
@pytest.mark.parametrize("direction", ["forward", "backward"])
def test_mlx_lm_loss_kernels_missing_barrier_is_found(name, direction):
    # mlx-lm 0.32's KL/JS kernels read the per-simdgroup maxima from `shared` and then
    # overwrite the same slots with sums, with no threadgroup barrier in between
    losses = importlib.import_module(LOSSES)
    q, p, cot = randn(2, 64), randn(2, 64), randn(2)
    with sim.patch_mlx(rebuild=[LOSSES]):
        if direction == "backward":  # let the forward kernel through unchecked
            getattr(losses, f"_{name}_forward_kernel").check_races = False
        with pytest.raises(sim.DataRaceError) as e:
            mx.vjp(lambda a: getattr(losses, f"{name}_div_loss")(a, p), [q], [cot])
    msg = str(e.value)
    assert f"custom_kernel_{name}_{direction}" in msg, msg
    assert "threadgroup array `shared`" in msg, msg
    assert "`shared[simd_group_id * 2 + 0] = sum_exp_q;`" in msg, msg
    assert "`max_q = shared[simd_lane_id * 2 + 0];`" in msg, msg


# -- kernels like those of MLX's custom-kernel documentation ---------------------------
def test_docs_style_elementwise_and_strided_kernels():
    contiguous = """
        uint i = thread_position_in_grid.x;
        T v = inp[i];
        out[i] = metal::exp(v);
    """
    strided = """
        uint i = thread_position_in_grid.x;
        uint loc = elem_to_loc(i, inp_shape, inp_strides, inp_ndim);
        out[i] = metal::exp(inp[loc]);
    """
    x = randn(4, 16)
    with sim.patch_mlx():
        k1 = mx.fast.metal_kernel("docs_exp", ["inp"], ["out"], contiguous)
        k2 = mx.fast.metal_kernel("docs_exp_strided", ["inp"], ["out"], strided,
                                  ensure_row_contiguous=False)
        outs = [k(inputs=[x.T], template=[("T", mx.float32)], grid=(64, 1, 1),
                  threadgroup=(32, 1, 1), output_shapes=[(16, 4)],
                  output_dtypes=[mx.float32])[0] for k in (k1, k2)]
    for out in outs:
        close(out, mx.exp(x.T), tol=1e-6)


BILINEAR = """
    // 1-D linear interpolation of x at positions p (in pixels), zero outside
    uint i = thread_position_in_grid.x;
    float pos = p[i];
    int j = int(metal::floor(pos));
    float w = pos - j;
    float left = (j >= 0 && j < N) ? x[j] : 0.0f;
    float right = (j + 1 >= 0 && j + 1 < N) ? x[j + 1] : 0.0f;
    out[i] = (1.0f - w) * left + w * right;
"""
BILINEAR_VJP = """
    // gradient of the interpolation above with respect to x: several positions
    // may touch one x element, so the accumulation is atomic
    uint i = thread_position_in_grid.x;
    float pos = p[i];
    int j = int(metal::floor(pos));
    float w = pos - j;
    float g = cot[i];
    if (j >= 0 && j < N)
        atomic_fetch_add_explicit(&x_grad[j], (1.0f - w) * g, memory_order_relaxed);
    if (j + 1 >= 0 && j + 1 < N)
        atomic_fetch_add_explicit(&x_grad[j + 1], w * g, memory_order_relaxed);
"""


def interp_ref(x, p):
    xs = np.concatenate([[0.0], x, [0.0, 0.0]])
    j = np.floor(p).astype(int)
    w = p - j
    return (1 - w) * xs[np.clip(j + 1, 0, len(xs) - 1)] + w * xs[np.clip(j + 2, 0, len(xs) - 1)]


def test_docs_style_interpolation_and_atomic_vjp():
    N, M = 12, 40
    x = randn(N)
    p = mx.array(rng.uniform(-2, N + 1, M).astype(np.float32))
    cot = randn(M)
    with sim.patch_mlx():
        fwd = mx.fast.metal_kernel("docs_interp", ["x", "p"], ["out"], BILINEAR)
        vjp = mx.fast.metal_kernel("docs_interp_vjp", ["p", "cot"], ["x_grad"], BILINEAR_VJP,
                                   atomic_outputs=True)
        (out,) = fwd(inputs=[x, p], template=[("N", N)], grid=(M, 1, 1), threadgroup=(32, 1, 1),
                     output_shapes=[(M,)], output_dtypes=[mx.float32])
        (grad,) = vjp(inputs=[p, cot], template=[("N", N)], grid=(M, 1, 1),
                      threadgroup=(32, 1, 1), output_shapes=[(N,)], output_dtypes=[mx.float32],
                      init_value=0)
    xn, pn = np.array(x).astype(np.float64), np.array(p).astype(np.float64)
    np.testing.assert_allclose(np.array(out), interp_ref(xn, pn), rtol=1e-5, atol=1e-5)
    # the vjp of a linear map: finite differences along each basis vector are exact
    want = [np.dot(interp_ref(np.eye(N)[n], pn), np.array(cot)) for n in range(N)]
    np.testing.assert_allclose(np.array(grad), want, rtol=1e-5, atol=1e-5)


def test_docs_style_read_before_the_bounds_check_is_out_of_bounds():
    # the same interpolation, reading x before testing the index (the order of the
    # grid-sample example in MLX's documentation): positions outside [0, N) read past x
    src = BILINEAR.replace(
        "float left = (j >= 0 && j < N) ? x[j] : 0.0f;",
        "float left = x[j];\n    if (j < 0 || j >= N) left = 0.0f;")
    N, M = 12, 40
    x = randn(N)
    p = mx.array(rng.uniform(-2, N + 1, M).astype(np.float32))
    with sim.patch_mlx():
        fwd = mx.fast.metal_kernel("docs_interp_unchecked", ["x", "p"], ["out"], src)
        with pytest.raises(sim.OutOfBoundsError, match=r"input `x`.*`float left = x\[j\];`"):
            fwd(inputs=[x, p], template=[("N", N)], grid=(M, 1, 1), threadgroup=(32, 1, 1),
                output_shapes=[(M,)], output_dtypes=[mx.float32])
