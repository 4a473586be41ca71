"""The decode path: calls of a few steps (``function.DECODE_MAX_STEPS``) on the mlx backend run
the whole step as plain MLX ops, without checkpoints (``CallPlan.decode``).

Held to the full path (the plan's custom function), to ``rec.reference`` and to a hand-written
gated DeltaNet loop, for L = 1 and small L, with and without ``initial_state`` and
``return_state``, gradients included; on the Metal simulator short calls share one set of
kernels (no compile per length); the decode path inside ``mx.compile`` of a model-like step.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import pytest
from conftest import cuda_available, rel_err
from references import gated_deltanet_ref

import mlx_recgen as rg
from mlx_recgen.backends.mlx_decode import COMPILE_MAX_STATE
from mlx_recgen.function import DECODE_MAX_STEPS
from mlx_recgen.integrations.mlx_lm import gated_delta

# specs of every kind of tensor: a plain diagonal state (rglru), a vector state (ssd,
# gated_deltanet), a component axis (complex_lru), several states (mlstm), group axes and a
# bool input (mlx-lm's masked gated delta rule)
SPECS = ["rglru", "ssd", "gated_deltanet", "complex_lru", "mlstm", "mlx_lm_gated_delta_masked"]


def _load(name):
    return gated_delta(False, True) if name == "mlx_lm_gated_delta_masked" else rg.load_spec(name)


def _arguments(rec, L, size=3):
    """Inputs of both signs (a bool ``mask`` where the spec has one) and an initial state."""
    spec = rec.spec
    sizes = {a: size for t in spec.tensors.values() for a in t.axes if isinstance(a, str)}
    sizes.update({spec.time: L, spec.batch_axes[0]: 2})
    for coarse, fine in spec.groups.items():
        sizes.update({coarse: 2, fine: 4})

    def shape(t):
        return tuple(a if isinstance(a, int) else sizes[a] for a in t.axes)

    inputs = [mx.random.uniform(shape=shape(t)) > 0.3 if name == "mask" else
              mx.random.uniform(-0.6, 0.6, shape(t)) for name, t in spec.inputs.items()]
    states = {k: mx.random.uniform(-1, 1, shape(t)) for k, t in spec.states.items()}
    return inputs, states


def _close(got, want, tol) -> bool:
    """``‖got − want‖ <= tol ‖want‖``, give or take 1e-6 per element: a gradient may be zero or
    rounding noise (a decay's for one step from a zero state, mLSTM's stabiliser's)."""
    assert got.shape == want.shape and got.dtype == want.dtype
    diff = mx.sqrt(mx.sum(mx.square(got - want))).item()
    return diff <= tol * mx.sqrt(mx.sum(mx.square(want))).item() + 1e-6 * want.size ** 0.5


def _flat(result) -> list:
    """The arrays of a call's result: outputs, then final states."""
    if isinstance(result, mx.array):
        return [result]
    out = []
    for r in result:
        out += _flat(r) if not isinstance(r, dict) else list(r.values())
    return out


@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("L", [1, 5, DECODE_MAX_STEPS])
@pytest.mark.parametrize("with_state", [False, True])
def test_decode_matches_full_path_and_reference(name, L, with_state):
    rec = _load(name)
    inputs, states = _arguments(rec, L)
    kw = dict(initial_state=states, return_state=True) if with_state else {}
    plan = rec.plan(*inputs, backend="mlx", initial_state=kw.get("initial_state"))
    assert plan.decode is not None
    got = _flat(rec(*inputs, backend="mlx", **kw))
    want = _flat(rec.reference(*inputs, **kw))
    call = rec.check(*inputs, initial_state=kw.get("initial_state"))
    outs, finals = dataclasses.replace(plan, decode=None).run(call.inputs, call.states)
    full = outs + (finals if with_state else [])
    assert len(got) == len(want) == len(full)
    for g, w, f in zip(got, want, full):
        assert g.dtype == w.dtype and g.shape == w.shape
        assert rel_err(g, w) < 1e-5 and rel_err(g, f) < 1e-5

    floats = [i for i, x in enumerate(inputs) if x.dtype == mx.float32]
    weights = [mx.random.normal(x.shape) for x in want]

    def loss(f):
        def of(*args):
            xs = list(inputs)
            for i, a in zip(floats, args):
                xs[i] = a
            init = dict(zip(sorted(states), args[len(floats):])) if with_state else None
            extra = dict(initial_state=init, return_state=True) if with_state else {}
            return sum(mx.sum(y * w) for y, w in zip(_flat(f(*xs, **extra)), weights))
        return of

    primals = [inputs[i] for i in floats] + ([states[k] for k in sorted(states)]
                                             if with_state else [])
    argnums = tuple(range(len(primals)))
    got = mx.grad(loss(lambda *a, **k: rec(*a, backend="mlx", **k)), argnums)(*primals)
    want = mx.grad(loss(rec.reference), argnums)(*primals)
    for g, w in zip(got, want):
        assert _close(g, w, 1e-4)


def test_decode_step_matches_a_hand_written_gated_deltanet():
    """One decode step of gated DeltaNet, state in and state out, against a plain MLX loop."""
    rec = rg.load_spec("gated_deltanet")
    B, H, K, V = 1, 4, 16, 8
    q, k = mx.random.normal((B, 1, H, K)), mx.random.normal((B, 1, H, K)) * 0.3
    v, g = mx.random.normal((B, 1, H, V)), -mx.random.uniform(shape=(B, 1, H))
    beta, S = mx.random.uniform(shape=(B, 1, H)), mx.random.normal((B, H, K, V))
    y, S1 = rec(q, k, v, g, beta, initial_state=S, return_state=True, backend="mlx")
    y_ref, S_ref = gated_deltanet_ref(q, k, v, g, beta, S)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(S1, S_ref) < 1e-5


@pytest.mark.parametrize("H, K, compiled", [(2, 8, True), (4, 64, True), (16, 64, False)])
def test_small_states_decode_compiled(H, K, compiled):
    """Up to ``COMPILE_MAX_STATE`` state elements the decode path runs ``mx.compile``d, beyond
    it as plain ops; both the hand-written loop's values, gradients and vmap alike."""
    rec = rg.load_spec("gated_deltanet")
    B, V = 1, K
    q, k = mx.random.normal((B, 1, H, K)), mx.random.normal((B, 1, H, K)) * 0.3
    v, g = mx.random.normal((B, 1, H, V)), -mx.random.uniform(shape=(B, 1, H))
    beta, S = mx.random.uniform(shape=(B, 1, H)), mx.random.normal((B, H, K, V))
    decode = rec.plan(q, k, v, g, beta, initial_state=S, backend="mlx").decode
    assert decode.compiled is compiled and (H * K * V <= COMPILE_MAX_STATE) is compiled
    y, S1 = rec(q, k, v, g, beta, initial_state=S, return_state=True, backend="mlx")
    y_ref, S_ref = gated_deltanet_ref(q, k, v, g, beta, S)
    assert rel_err(y, y_ref) < 1e-5 and rel_err(S1, S_ref) < 1e-5

    def loss(fn):
        return lambda v, S: (fn(q, k, v, g, beta, S)[0] ** 2).sum()

    got = mx.grad(loss(lambda *a: rec(*a[:-1], initial_state=a[-1], return_state=True,
                                      backend="mlx")), argnums=(0, 1))(v, S)
    want = mx.grad(loss(gated_deltanet_ref), argnums=(0, 1))(v, S)
    assert all(rel_err(a, b) < 1e-4 for a, b in zip(got, want))
    mapped = mx.vmap(lambda v: rec(q, k, v, g, beta, initial_state=S, backend="mlx"))(
        mx.stack([v, -v]))
    assert rel_err(mapped[1], gated_deltanet_ref(q, k, -v, g, beta, S)[0]) < 1e-5


def test_layout_changes_leave_out_the_ops_that_move_nothing():
    """A transpose that keeps the order of the axes of size > 1 is left out of the decode
    step's graph (it moves no element), and so is a reshape to the shape at hand; the result
    is ``reshape(transpose(x, perm), shape)`` whatever the sizes."""
    from mlx_recgen.backends.mlx_decode import arranged, arrangement

    for shape, perm in [((1, 1, 4, 8), (1, 0, 2, 3)), ((2, 1, 4, 8), (1, 0, 2, 3)),
                        ((1, 3, 4, 8), (1, 0, 3, 2)), ((2, 3, 1), (2, 0, 1))]:
        x = mx.random.normal(shape)
        want = mx.transpose(x, perm)
        for target in (want.shape, (-1,), (*want.shape, 1)):
            target = [want.size] if target == (-1,) else list(target)
            ops = arrangement(x.shape, list(perm), target)
            assert mx.array_equal(arranged(x, *ops), mx.reshape(want, target))
    x = mx.random.normal((1, 1, 4, 8))
    assert arrangement(x.shape, [1, 0, 2, 3], [1, 1, 4, 8]) == (None, None)  # no op at all
    assert arranged(x, None, None) is x


def test_grouped_inputs_expand_as_repeat_does():
    """A grouped input enters the decode layout as ``mx.repeat`` along its group axis puts it
    there, then arranged: the same values from the same ops (the same copy), with the
    arrangement's reshape taken by the expansion's where no transpose follows; a group of one
    member is not expanded (``mx.repeat`` by 1 returns its input)."""
    import io
    import re

    from mlx_recgen.backends.mlx_decode import DecodeLayout, arranged, arrangement
    from mlx_recgen.layout import expand_groups

    def ops(x):
        dot = io.StringIO()
        mx.export_to_dot(dot, x)
        return re.findall(r'label ="([A-Za-z]+)"', dot.getvalue())

    spec = rg.load_spec("mamba2").spec  # B, C: [B, L, G, N], G grouping H
    t = spec.inputs["B"]
    for b, L, G, H in [(1, 1, 2, 4), (2, 1, 2, 4), (1, 3, 2, 6), (2, 3, 2, 4), (1, 1, 4, 4)]:
        sizes = dict(B=b, L=L, G=G, H=H, P=8, N=16)
        layout = DecodeLayout(spec, t, sizes, True)
        contiguous = mx.random.normal((b, L, G, 16))
        strided = mx.swapaxes(mx.random.normal((b, L, 16, G)), 2, 3)
        mx.eval(contiguous, strided)
        for x in (contiguous, strided):
            expanded = expand_groups(spec, t, x, sizes)
            perm, shape = arrangement(expanded.shape, layout.perm, layout.shape)
            want = arranged(expanded, perm, shape)
            (got,) = layout.parts(spec, x, sizes)
            if G == H or perm is not None:
                assert ops(got) == ops(want)
            else:
                assert ops(got) == ["ExpandDims", "Broadcast", "Reshape"] and ops(want) == [
                    "ExpandDims", "Broadcast", "Reshape"] + (["Reshape"] if shape else [])
            assert got.shape == want.shape and mx.array_equal(got, want)


def test_longer_calls_take_the_full_path():
    rec = rg.load_spec("rglru")
    short = rec.plan(mx.ones((1, DECODE_MAX_STEPS, 4)), mx.ones((1, DECODE_MAX_STEPS, 4)),
                     backend="mlx")
    long = rec.plan(mx.ones((1, DECODE_MAX_STEPS + 1, 4)), mx.ones((1, DECODE_MAX_STEPS + 1, 4)),
                    backend="mlx")
    assert short.decode is not None and long.decode is None


@pytest.mark.parametrize("backend", [
    "mlx", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(
        not cuda_available(), reason="MLX has no CUDA backend on this machine")])])
def test_decode_inside_mx_compile_of_a_model_step(backend):
    """A model-like decode step — projections, the recurrence with its state, a readout —
    compiled whole: the same tokens and states as uncompiled, step after step (on CUDA the
    recurrence's own compiled call inside the model's)."""
    rec = rg.load_spec("gated_deltanet")
    B, H, K, V, D = 1, 2, 8, 8, 16
    w_in = mx.random.normal((D, H * (2 * K + V + 2))) * 0.2
    w_out = mx.random.normal((H * V, D)) * 0.2

    def step(x, S):
        p = (x @ w_in).reshape(B, 1, H, 2 * K + V + 2)
        q, k, v = p[..., :K], p[..., K:2 * K] * 0.3, p[..., 2 * K:2 * K + V]
        g, beta = -mx.sigmoid(p[..., -2]), mx.sigmoid(p[..., -1])
        y, S = rec(q, k, v, g, beta, initial_state=S, return_state=True, backend=backend)
        return y.reshape(B, 1, H * V) @ w_out, S

    compiled = mx.compile(step)
    x, S = mx.random.normal((B, 1, D)), mx.zeros((B, H, K, V))
    xc, Sc = x, S
    for _ in range(4):
        x, S = step(x, S)
        xc, Sc = compiled(xc, Sc)
        assert rel_err(xc, x) < 1e-5 and rel_err(Sc, S) < 1e-5


@pytest.mark.sim
def test_short_lengths_share_one_set_of_kernels_on_the_simulator():
    """Twenty distinct lengths below the sequential segment, forward and backward: after the
    first, nothing compiles, and every call matches the reference. (Every input has at least 8
    elements: MLX passes smaller ones in constant memory, a kernel variant of their own.)"""
    from mlx_recgen.sim import compiler

    rec = rg.load_spec("gated_deltanet")
    compiled = None
    for L in [3, *range(1, 32, 2)][:20] + [30, 2, 4]:
        inputs, states = _arguments(rec, L, size=4)
        y, S = rec(*inputs, initial_state=states, return_state=True, backend="metal-sim")
        y_ref, S_ref = rec.reference(*inputs, initial_state=states, return_state=True)
        assert rel_err(y, y_ref) < 1e-5 and rel_err(S, S_ref) < 1e-5

        def loss(*xs):
            return mx.sum(rec(*xs, initial_state=states, backend="metal-sim") * y_ref)

        def loss_ref(*xs):
            return mx.sum(rec.reference(*xs, initial_state=states) * y_ref)

        for g, w in zip(mx.grad(loss, (0, 1, 2))(*inputs), mx.grad(loss_ref, (0, 1, 2))(*inputs)):
            assert _close(g, w, 1e-4)
        if compiled is None:
            compiled = set(compiler._libs)
        assert set(compiler._libs) == compiled, f"L={L} compiled a kernel"


@pytest.mark.sim
@pytest.mark.parametrize("L", [1, 4])
@pytest.mark.parametrize("with_state", [False, True])
def test_short_calls_on_the_simulator_match_the_reference(L, with_state):
    rec = rg.load_spec("ssd")
    inputs, states = _arguments(rec, L)
    kw = dict(initial_state=states, return_state=True) if with_state else {}
    got = _flat(rec(*inputs, backend="metal-sim", **kw))
    want = _flat(rec.reference(*inputs, **kw))
    for g, w in zip(got, want):
        assert rel_err(g, w) < 1e-5
    weights = [mx.random.normal(x.shape) for x in want]

    def loss(f):
        return lambda *xs: sum(mx.sum(y * w) for y, w in zip(_flat(f(*xs, **kw)), weights))

    argnums = tuple(range(len(inputs)))
    got = mx.grad(loss(lambda *a, **k: rec(*a, backend="metal-sim", **k)), argnums)(*inputs)
    for g, w in zip(got, mx.grad(loss(rec.reference), argnums)(*inputs)):
        assert _close(g, w, 1e-4)


def test_generate_command_decodes_through_the_recurrences(tmp_path, monkeypatch, capsys):
    """``python -m mlx_recgen.integrations.mlx_lm generate``: mlx-lm's generation of a tiny
    random Qwen3-Next saved to disk, under the patch: the tokens of mlx-lm's own run, its
    tokens/s report, and every decode step through the gated delta rule's decode path."""
    pytest.importorskip("mlx_lm")
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    import sys

    from mlx_lm import cli
    from mlx_lm.utils import save_config, save_model
    from test_mlx_lm_integration import CONFIGS, VOCAB, build, count_plans

    from mlx_recgen.integrations import mlx_lm as integration

    save_model(tmp_path, build("qwen3_next"))
    save_config({"model_type": "qwen3_next", **CONFIGS["qwen3_next"]}, tmp_path / "config.json")
    words = ["<unk>", "<eos>"] + [f"w{i}" for i in range(VOCAB - 2)]
    vocab = tokenizers.Tokenizer(tokenizers.models.WordLevel(
        {w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    vocab.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=vocab, unk_token="<unk>",
                                         eos_token="<eos>").save_pretrained(tmp_path)
    arguments = ["generate", "--model", str(tmp_path), "--prompt", "w3 w1 w4 w1 w5",
                 "--max-tokens", "12"]

    def generated(text):
        return text.split("==========")[1].strip()

    monkeypatch.setattr(sys, "argv", ["mlx_lm", *arguments])
    cli.main()  # mlx-lm's own
    want = generated(capsys.readouterr().out)
    # every call of a recurrence runs a plan (or a kept plan's compiled decode step): its steps
    calls = count_plans(monkeypatch, lambda plan: dict(plan.sizes)[plan.recurrence.spec.time])
    integration.main(["--backend", "mlx", *arguments])
    out = capsys.readouterr().out
    assert generated(out) == want and len(want.split()) == 12
    assert "Generation: 12 tokens" in out and "tokens-per-sec" in out
    # the prompt but its last token (mlx-lm's prefill), then one step per token: its one
    # linear-attention layer decodes through the recurrence
    assert calls[0] == 4 and set(calls[1:]) == {1} and len(calls) >= 12
    assert integration._active is None


@pytest.mark.gpu
@pytest.mark.skipif(not cuda_available(), reason="MLX has no CUDA backend on this machine")
@pytest.mark.parametrize("name", SPECS)
@pytest.mark.parametrize("L", [1, 5])
def test_short_calls_on_cuda_run_compiled(name, L):
    """On CUDA a decode call runs its full path under ``mx.compile``: outputs, final states and
    gradients bit for bit those of the same path uncompiled, and the reference's."""
    rec = _load(name)
    inputs, states = _arguments(rec, L)
    plan = rec.plan(*inputs, initial_state=states, backend="cuda")
    assert plan.compiled
    call = rec.check(*inputs, initial_state=states)
    floats = [i for i, x in enumerate(inputs) if x.dtype == mx.float32]
    weights = None

    def loss(p):
        def of(*args):
            xs = list(call.inputs)
            for i, a in zip(floats, args):
                xs[i] = a
            outs, finals = p.run(xs, list(args[len(floats):]))
            return sum(mx.sum(y * w) for y, w in zip(outs + finals, weights))
        return of

    results = {}
    for p in (plan, dataclasses.replace(plan, compiled=False)):
        outs, finals = p.run(call.inputs, call.states)
        weights = weights or [mx.random.normal(y.shape) for y in outs + finals]
        grads = mx.grad(loss(p), tuple(range(len(floats) + len(states))))(
            *[inputs[i] for i in floats], *call.states)
        results[p.compiled] = outs + finals + list(grads)
    for got, want in zip(results[True], results[False]):
        assert mx.array_equal(got, want)
    want = _flat(rec.reference(*inputs, initial_state=states, return_state=True))
    for got, w in zip(results[True], want):
        assert rel_err(got, w) < 1e-5
