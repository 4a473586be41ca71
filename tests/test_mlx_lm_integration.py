"""mlx-lm's recurrent models with and without ``mlx_recgen.integrations.mlx_lm.patch()``.

Tiny random models built from mlx-lm's own ``ModelArgs``/``Model`` classes (parameters of both
signs) run once through mlx-lm's helpers and once through the routed recurrences: logits, loss,
every parameter gradient, a prompt prefilled in chunks and decoded step by step through the
cache, left- and right-padded batches (masks and ``lengths``), on the ``mlx`` backend and the
Metal simulator. Every fp32 array agrees within ``RTOL`` (relative, in the norm) and has the same
dtype and shape; every routed call is counted where it runs its ``CallPlan``.
"""

from __future__ import annotations

import importlib
import json
import sys

import pytest

pytest.importorskip("mlx_lm")

import mlx.core as mx  # noqa: E402
import mlx.nn as nn  # noqa: E402
import numpy as np  # noqa: E402
from mlx.utils import tree_flatten, tree_unflatten  # noqa: E402
from mlx_lm.models import gated_delta, recurrent_gemma, ssm  # noqa: E402
from mlx_lm.models.cache import ArraysCache, make_prompt_cache  # noqa: E402

from mlx_recgen.function import CallPlan  # noqa: E402
from mlx_recgen.integrations import mlx_lm as integration  # noqa: E402
from mlx_recgen.integrations.mlx_lm import SSM_BLOCK, patch  # noqa: E402

RTOL = 1e-5  # fp32, ‖patched − original‖ / ‖original‖ for every compared array
BACKENDS = ["mlx", pytest.param("metal-sim", marks=pytest.mark.sim)]
VOCAB = 64

# One or two layers, hidden size 32; grouped heads wherever the model has groups.
CONFIGS = {
    "mamba2": dict(  # ssm_update, 2 groups of 2 heads
        num_heads=4, head_dim=8, vocab_size=VOCAB, hidden_size=32, intermediate_size=32,
        state_size=16, num_hidden_layers=1, layer_norm_epsilon=1e-5, conv_kernel=4, n_groups=2,
        use_bias=False, use_conv_bias=True, tie_word_embeddings=False,
        time_step_limit=(0.001, 100.0), time_step_rank="auto"),
    "nemotron_h": dict(  # ssm_update with time_step_limit (0, inf), beside attention
        vocab_size=VOCAB, hidden_size=32, intermediate_size=32, max_position_embeddings=128,
        num_attention_heads=2, num_key_value_heads=1, attention_bias=False, mamba_num_heads=4,
        mamba_head_dim=8, mamba_proj_bias=False, ssm_state_size=16, conv_kernel=4, n_groups=2,
        mlp_bias=False, layer_norm_epsilon=1e-5, use_bias=False, use_conv_bias=True,
        hybrid_override_pattern=["M", "*"], head_dim=16),
    "qwen3_next": dict(  # gated_delta_update, 2 key heads for 4 value heads
        hidden_size=32, num_hidden_layers=2, intermediate_size=32, num_attention_heads=2,
        linear_num_value_heads=4, linear_num_key_heads=2, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=0, num_experts_per_tok=1,
        decoder_sparse_step=1, shared_expert_intermediate_size=32, mlp_only_layers=[0, 1],
        moe_intermediate_size=32, rms_norm_eps=1e-6, vocab_size=VOCAB, num_key_value_heads=1,
        rope_theta=10000.0, partial_rotary_factor=0.5, max_position_embeddings=128, head_dim=16,
        full_attention_interval=2),
    "olmo_hybrid": dict(  # gated_delta_update with allow_neg_eigval
        hidden_size=32, intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, rms_norm_eps=1e-6, vocab_size=VOCAB, max_position_embeddings=128,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, linear_allow_neg_eigval=True,
        tie_word_embeddings=False, attention_bias=False,
        layer_types=["linear_attention", "full_attention"]),
    "kimi_linear": dict(  # gated_delta_update with a gate per key channel
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, intermediate_size=32, head_dim=16, rope_theta=10000.0,
        rms_norm_eps=1e-6, model_max_length=128, num_experts=2, moe_intermediate_size=16,
        kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        first_k_dense_replace=2,
        linear_attn_config={"num_heads": 2, "head_dim": 8, "kda_layers": [1],
                            "full_attn_layers": [2], "short_conv_kernel_size": 4}),
    "recurrent_gemma": dict(  # rnn_scan, beside local attention
        attention_bias=False, conv1d_width=4, hidden_size=32, intermediate_size=64,
        logits_soft_cap=30.0, num_attention_heads=2, num_hidden_layers=2, num_key_value_heads=1,
        rms_norm_eps=1e-6, rope_theta=10000.0, attention_window_size=16, vocab_size=VOCAB,
        block_types=["recurrent", "attention"]),
}
MASKED_MODELS = [m for m in CONFIGS if m != "recurrent_gemma"]  # rnn_scan takes no mask
HELPER_OF = {"mamba2": "ssm_update", "nemotron_h": "ssm_update",
             "qwen3_next": "gated_delta_update", "olmo_hybrid": "gated_delta_update",
             "kimi_linear": "gated_delta_update", "recurrent_gemma": "rnn_scan"}


def build(model_type: str, seed: int = 0, dtype=mx.float32):
    """An mlx-lm model of this type, its parameters drawn N(0, 0.3²) (both signs)."""
    module = importlib.import_module(f"mlx_lm.models.{model_type}")
    model = module.Model(module.ModelArgs.from_dict({"model_type": model_type,
                                                     **CONFIGS[model_type]}))
    flat = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(seed), len(flat))
    model.update(tree_unflatten([(name, (0.3 * mx.random.normal(p.shape, key=key)).astype(dtype))
                                 for (name, p), key in zip(flat, keys)]))
    mx.eval(model.parameters())
    return model


@pytest.fixture(scope="module")
def models():
    """Each model built once for the module."""
    built = {}

    def get(model_type):
        if model_type not in built:
            built[model_type] = build(model_type)
        return built[model_type]

    return get


@pytest.fixture
def recurrence_calls(monkeypatch):
    """Names of the recurrences run during the test (``count_plans``)."""
    return count_plans(monkeypatch, lambda plan: plan.recurrence.name)


def count_plans(monkeypatch, what):
    """``what(plan)`` of each plan a routed call runs, whether through ``Recurrence.__call__``,
    a plan the integration keeps, or the compiled decode step of a kept plan
    (``_gated_delta_step``; its trace's run of the plan not counted again). Kept plans start
    afresh, so that their steps are made (and counted) here."""
    import mlx_recgen.integrations.mlx_lm as integration

    calls, in_step = [], []
    run, make_step = CallPlan.run, integration._gated_delta_step

    def counted(self, *args, **kwargs):
        if not in_step:
            calls.append(what(self))
        return run(self, *args, **kwargs)

    def counted_step(plan, *args, **kwargs):
        step = make_step(plan, *args, **kwargs)

        def run_step(*arrays):
            calls.append(what(plan))
            in_step.append(True)
            try:
                return step(*arrays)
            finally:
                in_step.pop()
        return run_step

    monkeypatch.setattr(CallPlan, "run", counted)
    monkeypatch.setattr(integration, "_gated_delta_step", counted_step)
    monkeypatch.setattr(integration, "_GATED_DELTA_PLANS", type(integration._GATED_DELTA_PLANS)(
        integration.PLAN_CACHE_SIZE))
    return calls


def tokens(shape, seed):
    return mx.random.randint(0, VOCAB, shape, key=mx.random.key(seed))


def both(run, backend, schedule="auto"):
    """``run()`` as mlx-lm computes it and under ``patch(backend, schedule)``: (original, routed,
    the patch)."""
    want = run()
    mx.eval(want)
    with patch(backend=backend, schedule=schedule) as routing:
        got = run()
        mx.eval(got)
    return want, got, routing


def assert_close(got, want, rtol=RTOL, what=""):
    """Same structure, shapes and dtypes; each array within ``rtol`` (an all-zero one exact)."""
    got, want = dict(tree_flatten(got)), dict(tree_flatten(want))
    assert got.keys() == want.keys(), what
    worst = 0.0
    for name, w in want.items():
        g = got[name]
        assert g.dtype == w.dtype and g.shape == w.shape, (what, name, g.dtype, w.dtype)
        g, w = (np.array(t.astype(mx.float32), np.float64) for t in (g, w))
        scale = np.linalg.norm(w)
        err = np.linalg.norm(g - w) / scale if scale else np.abs(g).max()
        assert err <= rtol, f"{what} {name}: relative error {err:.2e} > {rtol:.0e}"
        worst = max(worst, err)
    return worst


def loss_and_gradients(model, batch):
    """Next-token cross entropy and its gradient for every parameter (recurrent_gemma's Model
    lacks nn.Module's initialiser, so nn.value_and_grad cannot list its trainable ones)."""
    def loss(params):
        model.update(params)
        logits = model(batch[:, :-1])
        return nn.losses.cross_entropy(logits, batch[:, 1:]).mean()

    return mx.value_and_grad(loss)(model.parameters())


def recurrent_states(cache):
    """The recurrent layers' cache entries (conv and recurrent states)."""
    return [[entry for entry in c.cache] for c in cache if isinstance(c, ArraysCache)]


# -- whole models ---------------------------------------------------------------------------------


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_logits_loss_and_every_gradient(model_type, backend, models, recurrence_calls):
    model, batch = models(model_type), tokens((2, 9), seed=1)

    def run():
        loss, grads = loss_and_gradients(model, batch)
        return {"logits": model(batch[:, :-1]), "loss": loss, "grads": grads}

    want, got, routing = both(run, backend)
    assert_close(got, want, what=model_type)
    assert routing.routed[HELPER_OF[model_type]] > 0 and not routing.fallbacks
    assert len(recurrence_calls) == sum(routing.routed.values())


@pytest.mark.parametrize("model_type", ["mamba2", "qwen3_next", "recurrent_gemma"])
def test_chunked_schedule(model_type, models, recurrence_calls):
    """schedule="chunked": the SSD and RG-LRU run time-parallel, the delta rule in the matrix
    form (its chunks through the UT transform)."""
    model, batch = models(model_type), tokens((2, 41), seed=8)

    def run():
        loss, grads = loss_and_gradients(model, batch)
        return {"loss": loss, "grads": grads}

    want, got, routing = both(run, "mlx", "chunked")
    assert_close(got, want, what=model_type)
    assert routing.routed[HELPER_OF[model_type]] > 0 and not routing.fallbacks


@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_matrix_schedule(model_type, models, recurrence_calls):
    """schedule="matrix": a training step and a prefill then a decoded token, unchanged. The SSD
    and the delta rules run the matrix form (a decoded token what auto picks), RG-LRU, which has
    none, what auto picks."""
    model, batch = models(model_type), tokens((2, 41), seed=9)

    def run():
        loss, grads = loss_and_gradients(model, batch)
        cache = make_prompt_cache(model)
        logits = [model(batch[:, :23], cache=cache), model(batch[:, 23:24], cache=cache)]
        return {"loss": loss, "grads": grads, "logits": logits}

    want, got, routing = both(run, "mlx", "matrix")
    assert_close(got, want, what=model_type)
    assert routing.routed[HELPER_OF[model_type]] > 0 and not routing.fallbacks


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model_type", list(CONFIGS))
def test_prefill_in_chunks_then_decode(model_type, backend, models, recurrence_calls):
    """A prompt prefilled in two chunks through the cache, then three steps decoded one token
    at a time: every step's logits and the recurrent states left in the cache."""
    model, prompt = models(model_type), tokens((2, 11), seed=2)

    def run():
        cache = make_prompt_cache(model)
        logits = [model(prompt[:, :8], cache=cache), model(prompt[:, 8:], cache=cache)]
        for step in range(3):
            logits.append(model(tokens((2, 1), seed=10 + step), cache=cache))
        return {"logits": logits, "states": recurrent_states(cache)}

    want, got, routing = both(run, backend)
    assert_close(got, want, what=model_type)
    layers = len(recurrent_states(make_prompt_cache(model)))
    assert routing.routed[HELPER_OF[model_type]] == 5 * layers  # 2 prefill + 3 decode calls
    assert not routing.fallbacks and len(recurrence_calls) == sum(routing.routed.values())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("model_type", MASKED_MODELS)
def test_padded_batch(model_type, backend, models, recurrence_calls):
    """A batch of three prompts, left-padded (mask) and then right-padded (``lengths``, as
    mlx-lm's batch generator prepares the cache), prefilled and decoded through the cache."""
    model = models(model_type)

    def run():
        logits = []
        cache = make_prompt_cache(model)
        for c in cache:
            if isinstance(c, ArraysCache):
                c.left_padding = mx.array([0, 3, 5])
        logits.append(model(tokens((3, 6), seed=3), cache=cache))
        logits.append(model(tokens((3, 4), seed=4), cache=cache))
        left = recurrent_states(cache)

        cache = make_prompt_cache(model)
        for c in cache:
            if isinstance(c, ArraysCache):
                c.prepare(lengths=[9, 4, 7])
        logits.append(model(tokens((3, 9), seed=5), cache=cache))
        for c in cache:
            if isinstance(c, ArraysCache):
                c.finalize()
        logits.append(model(tokens((3, 1), seed=6), cache=cache))
        return {"logits": logits, "left padded": left, "right padded": recurrent_states(cache)}

    want, got, routing = both(run, backend)
    assert_close(got, want, what=model_type)
    assert routing.routed[HELPER_OF[model_type]] > 0
    assert len(recurrence_calls) == sum(routing.routed.values())
    if model_type == "nemotron_h":
        # its layer passes the mask but not the cache's lengths: ssm_attn then hands on nothing
        # of a block whose last step is padded, which mlx-lm's own function answers
        assert routing.fallbacks == {("ssm_update", integration._HANDED_ON_OTHERWISE): 1}
    else:
        assert not routing.fallbacks


def test_bf16_model_keeps_dtypes_and_is_as_accurate(recurrence_calls):
    """A bf16 Mamba-2: the same dtypes everywhere (fp32 state), and logits at least as close to
    the fp32 model's as mlx-lm's own (which rounds C·B to bf16)."""
    model = build("mamba2", dtype=mx.bfloat16)
    reference = build("mamba2")
    prompt = tokens((2, 12), seed=7)

    def run(model):
        cache = make_prompt_cache(model)
        return {"logits": [model(prompt[:, :10], cache=cache), model(prompt[:, 10:], cache=cache)],
                "states": recurrent_states(cache)}

    exact = run(reference)
    want, got, routing = both(lambda: run(model), "mlx")
    assert routing.routed["ssm_update"] == 2
    assert_close(got, want, rtol=3e-2, what="bf16")

    def error(result):
        return max(np.linalg.norm(np.array(r.astype(mx.float32)) - np.array(e)) /
                   np.linalg.norm(np.array(e)) for r, e in zip(result["logits"], exact["logits"]))

    assert error(got) <= 1.1 * error(want)


# -- the helpers, argument by argument -----------------------------------------------------------


def normal(*shape, seed, scale=1.0):
    return scale * mx.random.normal(shape, key=mx.random.key(seed))


def ssm_inputs(b=3, L=21, H=4, G=2, P=8, N=16, seed=0):
    return dict(hidden_states=normal(b, L, H, P, seed=seed), A_log=normal(H, seed=seed + 1),
                B=normal(b, L, G, N, seed=seed + 2, scale=0.25),
                C=normal(b, L, G, N, seed=seed + 3, scale=0.25), D=normal(H, seed=seed + 4),
                dt=normal(b, L, H, seed=seed + 5), dt_bias=normal(H, seed=seed + 6))


def padding_mask(L, left, lengths=None):
    pos = mx.arange(L)[None]
    mask = pos >= mx.array(left)[:, None]
    return mask if lengths is None else mask & (pos < mx.array(lengths)[:, None])


def differentiated(helper, arrays):
    """``helper``'s outputs and the gradients of a random weighting of them for ``arrays`` (a
    dict of its float array arguments; the rest are passed as they are)."""
    names = [k for k, v in arrays.items() if isinstance(v, mx.array) and v.dtype == mx.float32]

    def f(*values):
        out = helper(**{**arrays, **dict(zip(names, values))})
        return sum((o * normal(*o.shape, seed=99 + i)).sum() for i, o in enumerate(out)), out

    (_, out), grads = mx.value_and_grad(f, argnums=tuple(range(len(names))))(
        *[arrays[n] for n in names])
    return {"outputs": list(out), "grads": dict(zip(names, grads))}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["left over two blocks", "lengths", "lengths and state",
                                  "state, long left padding"])
def test_ssm_update_masks_across_blocks(case, backend, recurrence_calls):
    """Sequences longer than ssm_attn's blocks of 256 steps: outputs, state and every gradient,
    padded steps after unpadded ones (recomputed blockwise) included."""
    L = SSM_BLOCK + 45
    args = ssm_inputs(L=L, P=4, N=8)
    args.update({
        "left over two blocks": dict(mask=padding_mask(L, [0, 3, 260])),
        "lengths": dict(mask=padding_mask(L, [0, 3, 7], [L, 200, 270]),
                        lengths=mx.array([L, 200, 270])),
        "lengths and state": dict(mask=padding_mask(L, [0, 0, 9], [256, L, 100]),
                                  lengths=mx.array([256, L, 100]),
                                  state=normal(3, 4, 4, 8, seed=40)),
        "state, long left padding": dict(mask=padding_mask(L, [299, 0, 256]),
                                         state=normal(3, 4, 4, 8, seed=41)),
    }[case])
    want, got, routing = both(lambda: differentiated(ssm.ssm_update, args), backend)
    assert_close(got, want, what=case)
    assert routing.routed["ssm_update"] == 1 and not routing.fallbacks
    blockwise = case.startswith("lengths")  # a padded tail in a block with unpadded steps
    assert len(recurrence_calls) == (2 if blockwise else 1)


@pytest.mark.parametrize("case", ["plain", "state", "unbounded step", "decode", "group per head"])
def test_ssm_update_arguments(case, recurrence_calls):
    args = ssm_inputs(G=4 if case == "group per head" else 2)
    if case == "state":
        args["state"] = normal(3, 4, 8, 16, seed=50)
    if case == "unbounded step":
        args["time_step_limit"] = (0.0, float("inf"))
    if case == "decode":
        args = {k: v[:, :1] if v.ndim > 1 else v for k, v in args.items()}
        args.update(state=normal(3, 4, 8, 16, seed=51), mask=mx.array([[True], [False], [True]]))
    want, got, routing = both(lambda: differentiated(ssm.ssm_update, args), "mlx")
    assert_close(got, want, what=case)
    assert routing.routed["ssm_update"] == 1 and len(recurrence_calls) == 1


def test_ssm_decode_step_with_mask_runs_under_compile(recurrence_calls):
    """A decode step's mask needs no evaluation: routed under mx.compile too."""
    step = {k: v[:, :1] if v.ndim > 1 else v for k, v in ssm_inputs().items()}
    state, mask = normal(3, 4, 8, 16, seed=52), mx.array([[True], [False], [True]])
    want, got, routing = both(lambda: mx.compile(
        lambda m, s: ssm.ssm_update(**step, state=s, mask=m))(mask, state), "mlx")
    assert_close(got, want)
    assert routing.routed["ssm_update"] == 1 and len(recurrence_calls) == 1


def gated_delta_inputs(B=2, T=13, Hk=2, Hv=4, Dk=16, Dv=8, vector_gate=False, seed=0):
    gate = (B, T, Hv, Dk) if vector_gate else (B, T, Hv)
    return dict(q=normal(B, T, Hk, Dk, seed=seed, scale=0.25),
                k=normal(B, T, Hk, Dk, seed=seed + 1, scale=0.25),
                v=normal(B, T, Hv, Dv, seed=seed + 2),
                a=normal(*gate, seed=seed + 3), b=normal(B, T, Hv, seed=seed + 4),
                A_log=normal(*((Hv, 1) if vector_gate else (Hv,)), seed=seed + 5),
                dt_bias=normal(*((Hv, Dk) if vector_gate else (Hv,)), seed=seed + 6))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["plain", "state and mask", "vector gate, lower bound, mask",
                                  "negative eigenvalues", "decode"])
def test_gated_delta_update_arguments(case, backend, recurrence_calls):
    args = gated_delta_inputs(vector_gate=case.startswith("vector"))
    if "mask" in case:
        args.update(state=normal(2, 4, 8, 16, seed=60), mask=padding_mask(13, [0, 4], [13, 11]))
    if "lower bound" in case:
        args["lower_bound"] = -5.0
    if case == "negative eigenvalues":
        args["allow_neg_eigval"] = True
    if case == "decode":
        args = {k: v[:, :1] if v.ndim > 1 else v for k, v in args.items()}
        args["state"] = normal(2, 4, 8, 16, seed=61)
    want, got, routing = both(lambda: differentiated(gated_delta.gated_delta_update, args), backend)
    assert_close(got, want, what=case)
    assert routing.routed["gated_delta_update"] == 1 and len(recurrence_calls) == 1


@pytest.mark.parametrize("case", ["state", "no state", "state and mask",
                                  "vector gate, lower bound, mask", "negative eigenvalues"])
def test_gated_delta_decode_step_compiled_whole(case, monkeypatch):
    """A decode step whose plan has a compiled decode path runs as one compiled step after the
    first call (``_gated_delta_step``): the gate, beta, the recurrence and the casts; over
    several steps, its state fed back, it gives mlx-lm's own results with every option, also
    inside ``mx.compile`` of a model's step, and its gradients agree with mlx-lm's own."""
    import mlx_recgen.integrations.mlx_lm as integration

    made = []
    make = integration._gated_delta_step
    monkeypatch.setattr(integration, "_gated_delta_step",
                        lambda *a, **k: made.append(a[2:]) or make(*a, **k))
    monkeypatch.setattr(integration, "_GATED_DELTA_PLANS", type(integration._GATED_DELTA_PLANS)(
        integration.PLAN_CACHE_SIZE))
    args = gated_delta_inputs(T=1, vector_gate=case.startswith("vector"), seed=7)
    options = {}
    if "mask" in case:
        options["mask"] = mx.array([[True], [False]])
    if "lower bound" in case:
        options["lower_bound"] = -5.0
    if case == "negative eigenvalues":
        options["allow_neg_eigval"] = True
    state = None if case == "no state" else normal(2, 4, 8, 16, seed=62)
    own = routed = state
    with patch(backend="mlx"):
        for step in range(4):
            x = {k: v * (1 + 0.1 * step) for k, v in args.items()}  # a new step's inputs
            want = gated_delta.gated_delta_update.__wrapped__(**x, state=own, **options,
                                                               use_kernel=False)
            got = gated_delta.gated_delta_update(**x, state=routed, **options, use_kernel=False)
            assert_close(got, want, what=f"{case}, step {step}")
            if state is not None:  # fed back (without a state, every step starts from zero)
                own, routed = want[1], got[1]
        # the first call checks and plans; its step is made for the next ones
        assert len(made) == 1 and made[0][:2] == (state is not None, "mask" in options), made
        routed = want[1]
        # inside mx.compile of a model's step too (the kept step, called with tracers)
        inside = mx.compile(lambda q, k, v: gated_delta.gated_delta_update(
            q, k, v, x["a"], x["b"], x["A_log"], x["dt_bias"], state=state, **options,
            use_kernel=False))(x["q"], x["k"], x["v"])
        assert_close(inside, gated_delta.gated_delta_update.__wrapped__(
            **x, state=state, **options, use_kernel=False), what=f"{case}: under mx.compile")

        def loss(q, k, v):
            y, S = gated_delta.gated_delta_update(q, k, v, x["a"], x["b"], x["A_log"],
                                                  x["dt_bias"], state=routed, **options,
                                                  use_kernel=False)
            return (y * y).sum() + (S * S).sum()

        compiled = mx.grad(loss, argnums=(0, 1, 2))(x["q"], x["k"], x["v"])
    original = mx.grad(lambda q, k, v: sum(
        (t * t).sum() for t in gated_delta.gated_delta_update(
            q, k, v, x["a"], x["b"], x["A_log"], x["dt_bias"], state=routed, **options,
            use_kernel=False)), argnums=(0, 1, 2))(x["q"], x["k"], x["v"])
    assert_close(compiled, original, what=f"{case}: gradients")


def test_gated_delta_update_plan_follows_the_patch(monkeypatch):
    """The routed helper keeps the plan of arguments it checked once; a call with the same
    arguments under another patch (backend, schedule) runs that patch's plan, not the kept
    one."""
    ran = count_plans(monkeypatch, lambda plan: (plan.backend.name, plan.schedule))
    args = gated_delta_inputs()
    want = gated_delta.gated_delta_update(**args, use_kernel=False)
    for backend, schedule in [("mlx", "sequential"), ("mlx", "matrix"), ("mlx", "sequential"),
                              ("metal-sim", "auto")]:
        for _ in range(2):  # the second call takes the kept plan
            with patch(backend=backend, schedule=schedule):
                got = gated_delta.gated_delta_update(**args, use_kernel=False)
            assert_close(got, want, what=f"{backend} {schedule}")
    assert ran[:6] == [("mlx", "sequential")] * 2 + [("mlx", "matrix")] * 2 + [
        ("mlx", "sequential")] * 2
    assert len(ran) == 8 and ran[6] == ran[7] and ran[6][0] == "metal-sim"


def test_ssm_update_runs_the_matrix_form_like_ssm_attn(monkeypatch):
    """Under the patch's ``auto`` the SSD runs the matrix form (mlx-lm's ``ssm_attn`` is the
    chunkwise matmul form) on the backends where that was measured (``SSD_MATRIX_BACKENDS``); a
    decode step runs what ``auto`` picks, and an explicit schedule is kept."""
    ran = []
    run = CallPlan.run
    monkeypatch.setattr(CallPlan, "run", lambda self, *a: ran.append(
        (self.backend.name, self.schedule)) or run(self, *a))
    args = ssm_inputs()
    step = {**{k: v[:, :1] if v.ndim > 1 else v for k, v in args.items()},
            "state": normal(3, 4, 8, 16, seed=51)}
    for backend, schedule, arguments, want in [
            ("mlx", "auto", args, ("mlx", "matrix")),
            ("mlx", "auto", step, ("mlx", "sequential")),
            ("mlx", "sequential", args, ("mlx", "sequential")),
            ("metal-sim", "auto", args, None)]:
        ran.clear()
        with patch(backend=backend, schedule=schedule):
            got = ssm.ssm_update(**arguments)
        assert_close(got, ssm.ssm_update(**arguments), what=f"{backend} {schedule}")
        if want is None:  # unmeasured on an Apple GPU: auto stays auto
            assert len(ran) == 1 and ran[0][1] != "matrix", ran
        else:
            assert ran == [want], (backend, schedule, ran)


@pytest.mark.parametrize("case", ["no h0", "h0", "decode", "decode, no h0"])
def test_rnn_scan_arguments(case, recurrence_calls):
    L = 1 if case.startswith("decode") else 19
    x, h0 = normal(2, L, 12, seed=70), None if "no h0" in case else normal(2, 12, seed=71)
    a = mx.sigmoid(normal(2, L, 12, seed=72))
    arrays = {"x": x, "a": a} if h0 is None else {"x": x, "a": a, "h0": h0}
    want, got, routing = both(lambda: differentiated(
        lambda x, a, h0=None: recurrent_gemma.rnn_scan(x, a, h0), arrays), "mlx")
    assert_close(got, want, what=case)
    assert routing.routed["rnn_scan"] == 1 and len(recurrence_calls) == 1


def test_bf16_helpers_keep_dtypes_and_are_as_accurate():
    """bf16 activations: outputs and states in the original's dtypes, values at least as close to
    the fp32 computation on the same (bf16-valued) inputs."""
    bf16 = mx.bfloat16
    s = ssm_inputs()
    s = {**s, **{k: s[k].astype(bf16) for k in ("hidden_states", "B", "C", "D", "dt")}}
    g = gated_delta_inputs()
    g = {**g, **{k: g[k].astype(bf16) for k in ("q", "k", "v", "a", "b")},
         "state": normal(2, 4, 8, 16, seed=80).astype(bf16)}
    x = normal(2, 19, 12, seed=81).astype(bf16)
    a = mx.sigmoid(normal(2, 19, 12, seed=82)).astype(bf16)
    calls = {"ssm_update": lambda **k: ssm.ssm_update(**k), "gated_delta_update":
             lambda **k: gated_delta.gated_delta_update(**k), "rnn_scan":
             lambda **k: recurrent_gemma.rnn_scan(k["x"], k["a"], k["h0"])}
    for name, args in [("ssm_update", s), ("gated_delta_update", g),
                       ("rnn_scan", {"x": x, "a": a, "h0": normal(2, 12, seed=83).astype(bf16)})]:
        exact = calls[name](**{k: v.astype(mx.float32) if isinstance(v, mx.array) else v
                               for k, v in args.items()})
        want, got, _ = both(lambda: calls[name](**args), "mlx")
        assert_close(got, want, rtol=2e-2, what=name)
        for r, w, e in zip(got, want, exact):
            mine = np.linalg.norm(np.array(r.astype(mx.float32) - e))
            theirs = np.linalg.norm(np.array(w.astype(mx.float32) - e))
            assert mine <= 1.1 * theirs + 1e-6 * np.linalg.norm(np.array(e)), name


# -- mlx-lm's Metal kernels, as the routed helpers reproduce them -------------------------------


def test_metal_kernel_forms(monkeypatch):
    """Where mlx-lm would run its Metal kernels, the routed helpers do what those kernels do:
    ssm_update's single step ignores the mask and keeps the state's dtype; gated_delta_update
    outputs zero at masked steps and keeps the state's dtype."""
    monkeypatch.setattr(integration, "_on_metal", lambda: True)
    step = {k: v[:, :1] if v.ndim > 1 else v for k, v in ssm_inputs().items()}
    state = normal(3, 4, 8, 16, seed=90)
    want = ssm.ssm_update(**step, state=state)  # the kernel's math, without the mask
    with patch("mlx"):
        got = ssm.ssm_update(**step, state=state, mask=mx.array([False, True, False]))
        kept = ssm.ssm_update(**step, state=state.astype(mx.bfloat16))[1]
    assert_close(got, want)
    assert kept.dtype == mx.bfloat16

    args = gated_delta_inputs(Dk=32)  # the kernels need a multiple of 32 key channels
    mask, state = padding_mask(13, [0, 4], [13, 11]), normal(2, 4, 8, 32, seed=91)
    y, s = gated_delta.gated_delta_update(**args, state=state, mask=mask)  # MLX ops
    with patch("mlx"):
        got = gated_delta.gated_delta_update(**args, state=state, mask=mask)
        kept = gated_delta.gated_delta_update(**args, state=state.astype(mx.bfloat16))[1]
        ops = gated_delta.gated_delta_update(**args, state=state, mask=mask, use_kernel=False)
    assert_close(got, (mx.where(mask[..., None, None], y, 0), s))
    assert_close(ops, (y, s))
    assert kept.dtype == mx.bfloat16


# -- what falls back ------------------------------------------------------------------------------


def test_fallbacks_answer_as_mlx_lm():
    """Arguments the routed form does not reproduce run mlx-lm's original, bit for bit, and are
    counted with the reason."""
    L = 21
    args = ssm_inputs(L=L)
    cases = {
        "lengths without a mask": lambda: ssm.ssm_update(**args, lengths=mx.array([21, 5, 9])),
        # ssm_attn hands on nothing of a block whose last step is padded, unless told lengths
        "padded tail without lengths": lambda: ssm.ssm_update(
            **args, mask=padding_mask(L, [0, 0, 2], [21, 15, 21])),
        # lengths beyond a short block: ssm_attn reads past the block
        "lengths beyond the call": lambda: ssm.ssm_update(
            **args, mask=padding_mask(L, [0, 0, 0]), lengths=mx.array([30, 21, 21])),
        "a mask under mx.compile": lambda: mx.compile(
            lambda m: ssm.ssm_update(**args, mask=m))(padding_mask(L, [0, 2, 4])),
        "a beta broadcast over the heads": lambda: gated_delta.gated_delta_update(
            **{**gated_delta_inputs(), "b": normal(2, 13, 1, seed=5)}),
    }
    for reason, run in cases.items():
        want, got, routing = both(run, "mlx")
        assert not routing.routed and sum(routing.fallbacks.values()) == 1, reason
        for g, w in zip(tree_flatten(got), tree_flatten(want)):
            assert mx.array_equal(g[1], w[1]), reason


def test_float64_falls_back_to_mlx_lm():
    """mlx-lm's MLX ops take float64 arrays (on the CPU), a recurrence does not: such calls, a
    float64 state beside fp32 inputs included, run the original and are counted with the
    reason."""
    f64 = mx.float64

    def as_f64(arrays):
        return {k: v.astype(f64) if isinstance(v, mx.array) else v for k, v in arrays.items()}

    x, a = normal(2, 9, 12, seed=70), mx.sigmoid(normal(2, 9, 12, seed=72))
    cases = {
        "ssm_update": lambda: ssm.ssm_update(**as_f64(ssm_inputs())),
        "ssm_update, float64 state": lambda: ssm.ssm_update(
            **ssm_inputs(), state=normal(3, 4, 8, 16, seed=50).astype(f64)),
        "gated_delta_update": lambda: gated_delta.gated_delta_update(
            **as_f64(gated_delta_inputs())),
        "gated_delta_update, float64 state": lambda: gated_delta.gated_delta_update(
            **gated_delta_inputs(), state=normal(2, 4, 8, 16, seed=60).astype(f64)),
        "rnn_scan": lambda: recurrent_gemma.rnn_scan(x.astype(f64), a.astype(f64), None),
        "rnn_scan, float64 h0": lambda: recurrent_gemma.rnn_scan(
            x, a, normal(2, 12, seed=71).astype(f64)),
    }
    with mx.stream(mx.cpu):  # float64 runs on the CPU only
        for case, run in cases.items():
            want, got, routing = both(run, "mlx")
            helper = case.split(",")[0]
            assert not routing.routed, case
            [(key, count)] = routing.fallbacks.items()
            assert key[0] == helper and count == 1, case
            assert key[1].startswith("float64 ") and key[1].endswith(
                "(a recurrence takes float32, float16 or bfloat16)"), key
            for g, w in zip(tree_flatten(got), tree_flatten(want)):
                assert g[1].dtype == w[1].dtype and mx.array_equal(g[1], w[1]), case



def test_a_float64_state_after_a_routed_call_of_the_same_shapes_falls_back():
    """A routed ``gated_delta_update`` skips its checks for a call like one that passed them: a
    float64 state of the same shape as a float32 one routed before is not like it, and runs the
    original."""
    inputs = gated_delta_inputs(seed=80)
    state = normal(2, 4, 8, 16, seed=81)
    with mx.stream(mx.cpu):  # float64 runs on the CPU only
        want = gated_delta.gated_delta_update(**inputs, state=state.astype(mx.float64))
        mx.eval(want)
        with patch(backend="mlx") as routing:
            mx.eval(gated_delta.gated_delta_update(**inputs, state=state))
            assert routing.routed["gated_delta_update"] == 1
            got = gated_delta.gated_delta_update(**inputs, state=state.astype(mx.float64))
            mx.eval(got)
        assert routing.routed["gated_delta_update"] == 1 and len(routing.fallbacks) == 1
    for g, w in zip(got, want):
        assert g.dtype == w.dtype and mx.array_equal(g, w)

# -- the simulator ------------------------------------------------------------------------------


def test_simulator_reports_an_input_that_fails_when_evaluated():
    """The simulator reads a routed helper's inputs when it is called; mlx-lm builds a lazy
    graph. An input computed by an operation that fails only when evaluated (gather_mm in fp16
    on the CPU, as in mlx-lm's fp16 mixture-of-experts models) is reported as that, with the
    way out, not as the helper's failure."""
    with mx.stream(mx.cpu):
        experts = normal(3, 12, 12, seed=1).astype(mx.float16)
        x = normal(2, 9, 1, 12, seed=2).astype(mx.float16)
        x = mx.gather_mm(x, experts, rhs_indices=mx.array([[0], [2]]))[:, :, 0]  # [2, 9, 12]
        try:
            mx.eval(x)
        except RuntimeError:
            pass
        else:
            pytest.skip("this MLX evaluates gather_mm in fp16 on the CPU")
    a = mx.sigmoid(normal(2, 9, 12, seed=3)).astype(mx.float16)
    y, h = recurrent_gemma.rnn_scan(x, a, None)  # lazy: what mlx-lm's model tests check
    assert y.shape == (2, 9, 12) and y.dtype == mx.float16
    with patch("mlx"):
        y, h = recurrent_gemma.rnn_scan(x, a, None)
    assert y.shape == (2, 9, 12) and y.dtype == mx.float16
    with patch("metal-sim") as routing:
        with pytest.raises(RuntimeError, match=r"mlx-lm's rnn_scan under backend='metal-sim': "
                                               r"evaluating its inputs failed: \[GatherMM::eval\]"
                                               r".* backend='mlx' stays lazy") as error:
            recurrent_gemma.rnn_scan(x, a, None)
    assert "GatherMM" in str(error.value.__cause__)
    assert not routing.routed and not routing.fallbacks


@pytest.mark.sim
def test_simulator_under_compile_says_so_itself():
    """Under mx.compile nothing can be evaluated: the simulator's own error, not the one for an
    input that fails when evaluated."""
    from mlx_recgen.sim import SimulatorTransformError

    x, a = normal(2, 9, 12, seed=4), mx.sigmoid(normal(2, 9, 12, seed=5))
    with patch("metal-sim"):
        with pytest.raises(SimulatorTransformError, match="cannot run under mx.compile"):
            mx.compile(lambda x, a: recurrent_gemma.rnn_scan(x, a, None))(x, a)


# -- patching -----------------------------------------------------------------------------------


def bindings():
    """Every mlx_lm module attribute that is one of the three helpers: (module, name) -> id."""
    helpers = {id(getattr(importlib.import_module(m), n)) for m, n, *_ in integration.HELPERS}
    return {(name, attr): id(value) for name, module in list(sys.modules.items())
            if name.startswith("mlx_lm") and module is not None
            for attr, value in vars(module).items() if id(value) in helpers}


def test_patch_rebinds_every_import_and_restores_exactly(monkeypatch):
    import mlx_lm.models as models_package
    import mlx_lm.models.mamba2 as mamba2

    before = bindings()
    assert (("mlx_lm.models.mamba2", "ssm_update") in before
            and ("mlx_lm.models.recurrent_gemma", "rnn_scan") in before)
    original = mamba2.ssm_update
    # a model module imported while the patch is active binds the routed helper
    monkeypatch.delitem(sys.modules, "mlx_lm.models.granitemoehybrid", raising=False)
    monkeypatch.setattr(models_package, "granitemoehybrid", None, raising=False)
    with patch() as routing:
        late = importlib.import_module("mlx_lm.models.granitemoehybrid")
        assert routing.active and mamba2.ssm_update is not original
        assert late.ssm_update is mamba2.ssm_update is ssm.ssm_update
        assert mamba2.ssm_update.__wrapped__ is original
        with pytest.raises(RuntimeError, match="already patched"):
            patch()
    assert not routing.active and late.ssm_update is original
    assert bindings() == {**before, ("mlx_lm.models.granitemoehybrid", "ssm_update"): id(original)}

    handle = patch("mlx", "sequential")  # a plain call, undone by hand; undo is idempotent
    assert handle.active and gated_delta.gated_delta_update.__mlx_recgen_patch__ is handle
    handle.undo()
    handle.close()
    assert bindings() == {**before, ("mlx_lm.models.granitemoehybrid", "ssm_update"): id(original)}


def test_patch_refuses_unknown_options():
    with pytest.raises(ValueError, match="backend"):
        patch(backend="tpu")
    with pytest.raises(ValueError, match="schedule"):
        patch(schedule="parallel")
    assert integration._active is None


def test_patch_refuses_a_backend_that_cannot_run_here(monkeypatch):
    """At ``patch()``, not at the first routed call: Metal without Metal, CUDA without CUDA, the
    simulator without a C++ compiler."""
    from mlx_recgen.sim import SimulatorSetupError, compiler

    if not mx.metal.is_available():
        with pytest.raises(RuntimeError, match=r"backend='metal' needs MLX with Metal"):
            patch(backend="metal")
    if not (hasattr(mx, "cuda") and mx.cuda.is_available()):
        with pytest.raises(RuntimeError, match=r"backend='cuda' needs MLX's CUDA build"):
            patch(backend="cuda")
    monkeypatch.setattr(compiler, "_compiler", None)  # forget the compiler found so far
    monkeypatch.setenv("MLX_RECGEN_SIM_CXX", "no-such-c++-compiler")
    with pytest.raises(SimulatorSetupError, match=r"needs a C\+\+17 compiler"):
        patch(backend="metal-sim")
    assert integration._active is None
    assert not hasattr(gated_delta.gated_delta_update, "__mlx_recgen_patch__")


# -- fine-tuning from the command line ----------------------------------------------------------


def test_lora_command_help(capsys):
    with pytest.raises(SystemExit) as exit_:
        integration.main(["lora", "--help"])
    assert exit_.value.code == 0
    assert "--fine-tune-type" in capsys.readouterr().out  # mlx-lm's own LoRA arguments
    assert integration._active is None


def test_lora_command_trains_through_the_recurrences(tmp_path, monkeypatch, recurrence_calls):
    """Two LoRA iterations on a tiny Mamba-2 saved to disk: the losses mlx-lm's trainer
    reports are those of its run without the patch, and the SSD ran as a recurrence."""
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    from mlx_lm.utils import save_config, save_model

    model_dir, data = tmp_path / "model", tmp_path / "data"
    save_model(model_dir, build("mamba2"))
    # "expand" keeps transformers' config check (hidden_size * expand = heads * head_dim) happy
    save_config({"model_type": "mamba2", "expand": 1, **CONFIGS["mamba2"]},
                model_dir / "config.json")
    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(VOCAB - 2)]
    vocab = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    vocab.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=vocab, unk_token="<unk>",
                                         eos_token="<eos>").save_pretrained(model_dir)
    data.mkdir()
    rng = np.random.default_rng(0)
    for split in ("train", "valid"):
        lines = [json.dumps({"text": " ".join(rng.choice(words[2:], 12))}) for _ in range(4)]
        (data / f"{split}.jsonl").write_text("\n".join(lines) + "\n")

    from mlx_lm.tuner import trainer

    losses = []
    train = trainer.train

    def recording(*args, training_callback=None, **kwargs):
        class Record(trainer.TrainingCallback):
            def on_train_loss_report(self, info):
                losses.append(info["train_loss"])

        return train(*args, training_callback=Record(), **kwargs)

    monkeypatch.setattr("mlx_lm.lora.train", recording)
    arguments = ["lora", "--model", str(model_dir), "--train", "--data", str(data),
                 "--iters", "2", "--batch-size", "2", "--num-layers", "-1",
                 "--steps-per-report", "1", "--val-batches", "1", "--seed", "0"]
    monkeypatch.setattr(sys, "argv", ["mlx_lm", *arguments, "--adapter-path", str(tmp_path / "a0")])
    from mlx_lm import cli

    cli.main()  # mlx-lm's own trainer
    want, losses[:] = list(losses), []
    assert not recurrence_calls
    integration.main(["--backend", "mlx", *arguments, "--adapter-path", str(tmp_path / "a1")])
    assert len(want) == len(losses) == 2 and recurrence_calls
    assert np.allclose(losses, want, rtol=1e-5), (losses, want)
    assert integration._active is None


def test_routed_helpers_bind_arguments_as_the_originals_do():
    """A routed helper takes its arguments positionally or by name, defaults filled in, as the
    original does (the same values, whatever the form of the call, a form seen before too);
    a call the original refuses raises the original's ``TypeError``, never a routed one."""
    args = gated_delta_inputs(T=1)
    names = ("q", "k", "v", "a", "b", "A_log", "dt_bias")
    state = normal(2, 4, 8, 16, seed=62)
    want = gated_delta.gated_delta_update(*(args[n] for n in names), state, use_kernel=False)
    forms = [((*(args[n] for n in names), state), {}),
             ((*(args[n] for n in names), state, None), {"use_kernel": True}),
             ((), {**args, "state": state, "allow_neg_eigval": False}),
             ((args["q"], args["k"]), {**{n: args[n] for n in names[2:]}, "state": state})]
    with patch(backend="mlx") as routing:
        for _ in range(2):  # the second time, each form is one seen before
            for positional, named in forms:
                got = gated_delta.gated_delta_update(*positional, **named)
                for g, w in zip(got, want):
                    assert mx.array_equal(g, w)
        for positional, named in [((*(args[n] for n in names), state, None, True), {}),
                                  ((args["q"],), {"k": args["k"]}),
                                  ((args["q"],), {**args}),
                                  ((), {**args, "options": {}})]:
            for _ in range(2):
                with pytest.raises(TypeError) as routed_error:
                    gated_delta.gated_delta_update(*positional, **named)
                with pytest.raises(TypeError) as original_error:
                    gated_delta.gated_delta_update.__wrapped__(*positional, **named)
                assert str(routed_error.value) == str(original_error.value)
    assert routing.routed["gated_delta_update"] == 2 * len(forms) and not routing.fallbacks


def test_patch_refuses_a_helper_of_other_parameters(monkeypatch):
    """The routed forms bind a call as the originals of mlx-lm 0.32.2 do: a helper of other
    parameters (names, kinds or defaults) is refused at ``patch()``, named."""
    def other(q, k, v, a, b, A_log, dt_bias, state=None, mask=None, *, use_kernel=False,
              lower_bound=None, allow_neg_eigval=False):
        pass

    monkeypatch.setattr(gated_delta, "gated_delta_update", other)
    with pytest.raises(RuntimeError, match=r"gated_delta_update takes \(.*use_kernel=False.*\); "
                                           r"this integration reproduces the one that takes "
                                           r"\(.*use_kernel=True"):
        patch()
    assert integration._active is None


def test_gated_delta_checks_are_remembered_by_layout_only():
    """Arguments of the shapes, dtypes and options of a call that passed the checks skip them;
    a mask of another dtype, or a float64 state of the same shape, still falls back with its
    reason."""
    from mlx_lm.models import gated_delta as gd

    mx.random.seed(3)
    q, k = mx.random.normal((1, 1, 2, 8)), mx.random.normal((1, 1, 2, 8))
    v = mx.random.normal((1, 1, 4, 8))
    a, b = mx.random.normal((1, 1, 4)), mx.random.normal((1, 1, 4))
    A_log, dt_bias = mx.random.normal((4,)), mx.random.normal((4,))
    S = mx.random.normal((1, 4, 8, 8))
    mask = mx.array([[True]])
    with patch(backend="mlx") as routing:
        for _ in range(2):
            y, S1 = gd.gated_delta_update(q, k, v, a, b, A_log, dt_bias, S, mask)
        gd.gated_delta_update(q, k, v, a, b, A_log, dt_bias, S, mask.astype(mx.int32))
        with mx.stream(mx.cpu):  # float64 runs on the CPU only
            gd.gated_delta_update(q, k, v, a, b, A_log, dt_bias, S.astype(mx.float64), mask)
    y_ref, S_ref = gd.gated_delta_update(q, k, v, a, b, A_log, dt_bias, S, mask)
    assert mx.allclose(y, y_ref, atol=1e-5) and mx.allclose(S1, S_ref, atol=1e-5)
    assert routing.routed["gated_delta_update"] == 2
    assert set(routing.fallbacks) == {
        ("gated_delta_update", "mask is not [B, T] bool"),
        ("gated_delta_update", "float64 state (a recurrence takes float32, float16 or bfloat16)")}
