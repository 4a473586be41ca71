"""The layers of ``mlx_recgen.nn`` against per-step references written here from the papers'
formulas (plain MLX, nothing from mlx-recgen): outputs and every parameter gradient, on the
pure-MLX backend (both schedules) and the Metal simulator; prefill in pieces and decoding
through a cache against one call; argument errors."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx.utils import tree_flatten, tree_map

from conftest import rel_err
from mlx_recgen.nn import GLA, RGLRU, GatedDeltaNet, Mamba2, RecurrentCache

TOL = 2e-5  # relative (‖a − b‖ / ‖b‖ per array), fp32


# ---------------------------------------------------------------------------------------------
# References: one time step at a time, from the papers' equations
# ---------------------------------------------------------------------------------------------


def silu(x):
    return x / (1 + mx.exp(-x))


def softplus(x):
    return mx.log(1 + mx.exp(x))


def sigmoid(x):
    return 1 / (1 + mx.exp(-x))


def linear(x, layer):
    y = x @ layer.weight.T
    return y + layer.bias if "bias" in layer else y


def rms(x, eps):
    return x / mx.sqrt(mx.mean(x * x, axis=-1, keepdims=True) + eps)


def causal_conv(x, weight, bias=None):
    """Depthwise causal convolution, one output step at a time: y[t] = sum_j w[:, j] x[t-K+1+j]."""
    K = weight.shape[1]
    steps = []
    for t in range(x.shape[1]):
        acc = mx.zeros_like(x[:, 0]) if bias is None else mx.broadcast_to(bias, x[:, 0].shape)
        for j in range(K):
            s = t - K + 1 + j
            if s >= 0:
                acc = acc + x[:, s] * weight[:, j]
        steps.append(acc)
    return mx.stack(steps, axis=1)


def ref_mamba2(m: Mamba2, u):
    """Mamba-2 (Dao & Gu 2024, Listing 1 / mamba_ssm's Mamba2 step) with per-group B, C."""
    b, L, _ = u.shape
    H, P, G, N, d = m.n_heads, m.head_dim, m.n_groups, m.state_size, m.d_inner
    zxbcdt = linear(u, m.in_proj)
    z, xBC, dt_raw = zxbcdt[..., :d], zxbcdt[..., d:2 * d + 2 * G * N], zxbcdt[..., -H:]
    xBC = silu(causal_conv(xBC, m.conv1d.weight, m.conv1d.bias))
    x = xBC[..., :d].reshape(b, L, H, P)
    Bm = xBC[..., d:d + G * N].reshape(b, L, G, N)
    Cm = xBC[..., d + G * N:].reshape(b, L, G, N)
    dt = mx.minimum(mx.maximum(softplus(dt_raw + m.dt_bias), m.dt_low), m.dt_high)
    A = -mx.exp(m.A_log)
    group = [h * G // H for h in range(H)]  # head h reads group h // (H / G)
    h_state = mx.zeros((b, H, P, N))
    ys = []
    for t in range(L):
        Bt, Ct = Bm[:, t][:, group], Cm[:, t][:, group]  # [b, H, N]
        dA = mx.exp(dt[:, t] * A)[..., None, None]
        h_state = dA * h_state + (dt[:, t, :, None, None] * x[:, t, :, :, None]
                                  * Bt[:, :, None, :])
        ys.append((h_state * Ct[:, :, None, :]).sum(-1) + m.D[:, None] * x[:, t])
    y = mx.stack(ys, axis=1).reshape(b, L, d) * silu(z)
    gs = d // G
    y = rms(y.reshape(b, L, G, gs), m.norm.eps).reshape(b, L, d) * m.norm.weight
    return linear(y, m.out_proj)


def ref_gated_deltanet(m: GatedDeltaNet, u):
    """Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024), the recurrent form of FLA's
    fused_recurrent_gated_delta_rule: decay, read, delta write, query."""
    b, L, _ = u.shape
    Hk, K, H, V = m.num_key_heads, m.key_head_dim, m.num_heads, m.value_head_dim
    q, k, v = linear(u, m.q_proj), linear(u, m.k_proj), linear(u, m.v_proj)
    qkv = silu(causal_conv(mx.concatenate([q, k, v], -1), m.conv1d.weight))
    q = qkv[..., :Hk * K].reshape(b, L, Hk, K)
    k = qkv[..., Hk * K:2 * Hk * K].reshape(b, L, Hk, K)
    v = qkv[..., 2 * Hk * K:].reshape(b, L, H, V)
    q = q / mx.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / math.sqrt(K)
    k = k / mx.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    head = [h * Hk // H for h in range(H)]
    beta = sigmoid(linear(u, m.b_proj))
    g = -mx.exp(m.A_log) * softplus(linear(u, m.a_proj) + m.dt_bias)
    S = mx.zeros((b, H, K, V))
    os = []
    for t in range(L):
        qt, kt = q[:, t][:, head], k[:, t][:, head]
        S = S * mx.exp(g[:, t])[..., None, None]
        kv = (kt[..., None] * S).sum(-2)
        delta = beta[:, t, :, None] * (v[:, t] - kv)
        S = S + kt[..., None] * delta[..., None, :]
        os.append((qt[..., None] * S).sum(-2))
    o = mx.stack(os, axis=1)  # [b, L, H, V]
    gate = linear(u, m.g_proj).reshape(b, L, H, V)
    o = (rms(o, m.norm.eps) * m.norm.weight.reshape(H, V) * silu(gate)).reshape(b, L, H * V)
    return linear(o, m.o_proj)


def ref_gla(m: GLA, u):
    """GLA (Yang et al. 2024): S_t = (alpha_t^T 1) * S_{t-1} + k_t^T v_t, o_t = q_t S_t, with
    alpha_t = sigmoid(u W1 W2 + b)^(1 / tau)."""
    b, L, _ = u.shape
    H, K, V = m.num_heads, m.key_head_dim, m.value_head_dim
    q = linear(u, m.q_proj).reshape(b, L, H, K) / math.sqrt(K)
    k = linear(u, m.k_proj).reshape(b, L, H, K)
    v = linear(u, m.v_proj).reshape(b, L, H, V)
    logits = linear(linear(u, m.gk_proj.layers[0]), m.gk_proj.layers[1]).reshape(b, L, H, K)
    alpha = sigmoid(logits) ** (1 / m.gate_logit_normalizer)
    S = mx.zeros((b, H, K, V))
    os = []
    for t in range(L):
        S = alpha[:, t, :, :, None] * S + k[:, t, :, :, None] * v[:, t, :, None, :]
        os.append((q[:, t, :, :, None] * S).sum(-2))
    o = mx.stack(os, axis=1)
    gate = linear(u, m.g_proj).reshape(b, L, H, V)
    o = (rms(o, m.norm.eps) * m.norm.weight.reshape(H, V) * silu(gate)).reshape(b, L, H * V)
    return linear(o, m.o_proj)


def ref_rglru(m: RGLRU, u):
    """Griffin's recurrent block (De et al. 2024): RG-LRU with a_t = sigmoid(Λ)^(c r_t),
    h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t), times the GeLU branch."""
    b, L, _ = u.shape
    y = linear(u, m.linear_y)
    y = 0.5 * y * (1 + mx.tanh(math.sqrt(2 / math.pi) * (y + 0.044715 * y ** 3)))
    x = causal_conv(linear(u, m.linear_x), m.conv1d.weight, m.conv1d.bias)

    def block_diagonal(gate, x):
        nb, n = gate.bias.shape
        xb = x.reshape(b, L, nb, n)
        return (mx.einsum("blhi,hij->blhj", xb, gate.weight) + gate.bias).reshape(x.shape)

    r, i = sigmoid(block_diagonal(m.a_gate, x)), sigmoid(block_diagonal(m.input_gate, x))
    a = sigmoid(m.a_param) ** (m.c * r)
    h = mx.zeros((b, m.lru_width))
    hs = []
    for t in range(L):
        h = a[:, t] * h + mx.sqrt(1 - a[:, t] ** 2) * (i[:, t] * x[:, t])
        hs.append(h)
    return linear(mx.stack(hs, axis=1) * y, m.linear_out)


# ---------------------------------------------------------------------------------------------
# Layers at tiny sizes (one per kind, reused: the simulator compiles each kernel once)
# ---------------------------------------------------------------------------------------------

DIMS, BATCH, LENGTH = 16, 2, 11
PIECES = (4, 4, 1, 1, 1)  # two prefill pieces, then three decoding steps

LAYERS = {
    # 4 heads in 2 groups; dt clipped to a range that cuts some steps at both ends
    "mamba2": (lambda **kw: Mamba2(DIMS, state_size=4, head_dim=8, n_groups=2,
                                   time_step_limit=(0.005, 0.05), **kw), ref_mamba2),
    # 4 value heads reading 2 key heads
    "gated_deltanet": (lambda **kw: GatedDeltaNet(DIMS, num_heads=4, num_key_heads=2,
                                                  key_head_dim=4, value_head_dim=6, **kw),
                       ref_gated_deltanet),
    "gla": (lambda **kw: GLA(DIMS, num_heads=2, gate_low_rank_dim=4, **kw), ref_gla),
    "rglru": (lambda **kw: RGLRU(DIMS, lru_width=12, num_heads=3, **kw), ref_rglru),
}
TIME_PARALLEL = ("mamba2", "gla", "rglru")

BACKENDS = [
    pytest.param(("mlx", "sequential"), id="mlx-sequential"),
    pytest.param(("mlx", "chunked"), id="mlx-chunked"),
    pytest.param(("metal-sim", "auto"), id="metal-sim", marks=pytest.mark.sim),
]


def make_layer(kind, **options):
    """A layer with every parameter moved off its initial value (ones and zeros included), so
    that a transposed weight or a skipped term shows."""
    mx.random.seed(7)
    layer = LAYERS[kind][0](**options)
    layer.update(tree_map(lambda p: p + 0.3 * mx.random.normal(p.shape), layer.parameters()))
    mx.eval(layer.parameters())
    return layer


def value_and_grads(layer, forward, x, weights):
    loss = lambda x: (forward(x) * weights).sum()  # noqa: E731
    value, grads = nn.value_and_grad(layer, loss)(x)
    mx.eval(value, grads)
    return value, dict(tree_flatten(grads))


def data(seed=0):
    mx.random.seed(seed)
    x = mx.random.normal((BATCH, LENGTH, DIMS))
    weights = mx.random.normal((BATCH, LENGTH, DIMS))
    return x, weights


# (layer, (backend, schedule)); the delta rule is not state-affine: no chunked schedule
LAYER_RUNS = [pytest.param(kind, p.values[0], id=f"{kind}-{p.id}", marks=p.marks)
              for kind in LAYERS for p in BACKENDS
              if p.values[0][1] != "chunked" or kind in TIME_PARALLEL]


@pytest.mark.parametrize("kind, backend", LAYER_RUNS)
def test_layer_matches_reference(kind, backend):
    backend, schedule = backend
    layer = make_layer(kind, backend=backend, schedule=schedule)
    reference = LAYERS[kind][1]
    x, weights = data()
    y, y_ref = layer(x), reference(layer, x)
    assert y.shape == x.shape
    assert rel_err(y, y_ref) < TOL
    _, grads = value_and_grads(layer, layer, x, weights)
    _, grads_ref = value_and_grads(layer, lambda x: reference(layer, x), x, weights)
    assert grads.keys() == grads_ref.keys() == dict(tree_flatten(layer.parameters())).keys()
    for name in grads_ref:
        assert rel_err(grads[name], grads_ref[name]) < TOL, name


@pytest.mark.parametrize("kind, backend", LAYER_RUNS)
def test_prefill_and_decode_match_one_call(kind, backend):
    backend, schedule = backend
    layer = make_layer(kind, backend=backend, schedule=schedule)
    x, _ = data(1)
    whole = layer(x)
    cache = layer.make_cache()
    assert cache.empty and cache.batch_size is None
    pieces, start = [], 0
    for n in PIECES:
        pieces.append(layer(x[:, start:start + n], cache=cache))
        start += n
    assert start == LENGTH and cache.offset == LENGTH and cache.batch_size == BATCH
    assert rel_err(mx.concatenate(pieces, axis=1), whole) < TOL
    # the cache holds the state after the whole sequence: continuing from it matches too
    more = mx.random.normal((BATCH, 3, DIMS))
    longer = layer(mx.concatenate([x, more], axis=1))[:, LENGTH:]
    assert rel_err(layer(more, cache=cache), longer) < TOL


def test_cache_gradients_flow_across_pieces():
    """Training through a cache (truncated backpropagation through chunks) differentiates the
    carried state and conv window: the gradient of the second piece's loss reaches the first
    piece's input."""
    layer = make_layer("mamba2", backend="mlx")
    x, _ = data(2)

    def second_piece(x):
        cache = layer.make_cache()
        layer(x[:, :5], cache=cache)
        return layer(x[:, 5:], cache=cache).sum()

    def whole(x):
        return layer(x)[:, 5:].sum()

    g, g_ref = mx.grad(second_piece)(x), mx.grad(whole)(x)
    assert float(mx.abs(g[:, :5]).max()) > 0
    assert rel_err(g, g_ref) < TOL


@pytest.mark.parametrize("kind", list(LAYERS))
def test_reference_backend_is_the_per_step_loop(kind):
    """``backend="reference"`` (the spec's own per-step loop) agrees with the compiled
    recurrence: the baseline the training example compares against computes the same model."""
    layer = make_layer(kind, backend="mlx")
    x, weights = data(3)
    _, grads = value_and_grads(layer, layer, x, weights)
    layer.backend = "reference"
    y_loop = layer(x)
    _, grads_loop = value_and_grads(layer, layer, x, weights)
    layer.backend = "mlx"
    assert rel_err(layer(x), y_loop) < TOL
    for name in grads:
        assert rel_err(grads[name], grads_loop[name]) < TOL, name


def test_initialisation_follows_the_papers():
    mx.random.seed(0)
    m = Mamba2(64, head_dim=4, state_size=4)  # 32 heads
    dt = np.array(nn.softplus(m.dt_bias))
    assert dt.min() >= 0.001 * (1 - 1e-4) and dt.max() <= 0.1 * (1 + 1e-4)
    assert np.log(dt).std() > 0.5  # log-uniform over two decades, not a constant
    A = np.exp(np.array(m.A_log))
    assert A.min() >= 1 and A.max() <= 16 and A.std() > 2
    assert np.all(np.array(m.D) == 1)
    g = GatedDeltaNet(64, num_heads=32, key_head_dim=4, value_head_dim=4)
    A = np.exp(np.array(g.A_log))
    assert A.min() > 0 and A.max() <= 16
    r = RGLRU(64, lru_width=256)
    a_c = np.exp(r.c * np.array(nn.log_sigmoid(r.a_param)))
    assert a_c.min() >= 0.9 - 1e-5 and a_c.max() <= 0.999 + 1e-5 and a_c.std() > 0.02


# ---------------------------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(LAYERS))
def test_bad_inputs_raise(kind):
    layer = LAYERS[kind][0](backend="mlx")
    name = type(layer).__name__
    with pytest.raises(ValueError, match=rf"{name}: x has shape \(2, 5, 15\); expected "
                                         rf"\[batch, length, {DIMS}\]"):
        layer(mx.zeros((2, 5, DIMS - 1)))
    with pytest.raises(ValueError, match="expected \\[batch, length"):
        layer(mx.zeros((5, DIMS)))
    with pytest.raises(ValueError, match="length at least 1"):
        layer(mx.zeros((2, 0, DIMS)))
    with pytest.raises(TypeError, match="x must be an mx.array"):
        layer(np.zeros((2, 5, DIMS), dtype=np.float32))
    with pytest.raises(TypeError, match="floating-point"):
        layer(mx.zeros((2, 5, DIMS), dtype=mx.int32))
    with pytest.raises(TypeError, match="cache must be a RecurrentCache"):
        layer(mx.zeros((2, 5, DIMS)), cache={})
    cache = layer.make_cache()
    layer(mx.zeros((2, 5, DIMS)), cache=cache)
    with pytest.raises(ValueError, match="the cache holds 2 sequences but x has batch size 3"):
        layer(mx.zeros((3, 1, DIMS)), cache=cache)


def test_bad_options_raise():
    with pytest.raises(ValueError, match="backend must be one of"):
        Mamba2(16, head_dim=8, backend="gpu")
    with pytest.raises(ValueError, match="schedule must be one of"):
        GLA(16, schedule="parallel")
    with pytest.raises(ValueError, match="head_dim 12 does not divide"):
        Mamba2(16, head_dim=12)
    with pytest.raises(ValueError, match="n_groups 3 does not divide the 4 heads"):
        Mamba2(16, head_dim=8, n_groups=3)
    with pytest.raises(ValueError, match="num_key_heads 3 does not divide num_heads 4"):
        GatedDeltaNet(16, num_heads=4, num_key_heads=3)
    with pytest.raises(ValueError, match="num_heads 3 must divide"):
        GLA(16, num_heads=3)
    with pytest.raises(ValueError, match="num_blocks 5 does not divide"):
        RGLRU(16, num_heads=5)
    with pytest.raises(ValueError, match="schedule='scan' needs a state-affine"):
        GatedDeltaNet(16, num_heads=2, key_head_dim=4, value_head_dim=4,
                      schedule="scan", backend="mlx")(mx.zeros((1, 4, 16)))


def test_cache_starts_empty():
    cache = RecurrentCache()
    assert cache.empty and cache.conv is None and cache.state is None and cache.offset == 0
    assert "offset=0" in repr(cache)
