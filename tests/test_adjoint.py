"""The sympy-derived adjoint on small custom specs.

Each spec's VJP (the compiled recurrence under ``mx.grad``) is compared with
  * ``mx.grad`` through ``rec.reference`` (the plain per-step loop), and
  * central finite differences in float64 of a hand-written numpy forward (``references.py``),
    along random directions, one per input and initial state plus one joint direction.
"""

from dataclasses import dataclass

import mlx.core as mx
import numpy as np
import pytest

import mlx_recgen as rg
from mlx_recgen import (Sum, abs as rg_abs, log1p, maximum, minimum, rsqrt, sigmoid, softplus,
                        sqrt, tanh, where)
from conftest import rel_err
from references import (np_delta_rule, np_fancy, np_leaky_max, np_normalized, np_scalar_sum,
                        np_shared_param, np_tanh_rnn, np_two_states)

F32 = mx.float32

# ---------------------------------------------------------------------------------------------
# Custom specs
# ---------------------------------------------------------------------------------------------


@rg.recurrence(lane="P", state={"h": "B P N"},
               inputs={"q": "B L N", "k": "B L N", "v": "B L P", "beta": "B L"},
               outputs={"y": "B L P"})
def delta_rule(h, q, k, v, beta, n):
    r = Sum(k[n] * h[n], n)  # a reduction before the update, feeding it
    h[n] = h[n] + beta * (v - r) * k[n]
    return {"y": Sum(q[n] * h[n], n)}


@rg.recurrence(lane="D", state={"h": "B D"}, inputs={"w": "B L D", "x": "B L D"},
               outputs={"y": "B L D"})
def tanh_rnn(h, w, x):
    h = tanh(w * h + x)
    return {"y": h}


@rg.recurrence(lane="D", state={"h": "B D"},
               inputs={"g": "B L D", "x": "B L D", "z": "B L D"}, outputs={"y": "B L D"})
def fancy(h, g, x, z):
    a = sigmoid(g)
    h = a * h + (1 - a) * softplus(x) + 0.1 * log1p(rg_abs(z))
    y = (maximum(h, 0.5 * z) * sqrt(1 + h * h) + where(x > 0, x, 0.1 * x) * rsqrt(1 + z * z)
         + minimum(z, h) * 0.25)
    return {"y": y}


@rg.recurrence(lane="P", state={"h": "B H P"},
               inputs={"x": "B L H P", "decay": "H", "gain": "H P"}, outputs={"y": "B L H P"})
def shared_param(h, x, decay, gain):
    h = sigmoid(decay) * h + x  # decay: a parameter shared across lanes, batch and time
    return {"y": gain * tanh(h)}


@rg.recurrence(lane="P", state={"S": "B P N", "m": "B P"},
               inputs={"k": "B L N", "v": "B L P", "g": "B L P"},
               outputs={"y": "B L P", "z": "B L P"})
def two_states(S, m, k, v, g, n):
    m = g * m + v
    S[n] = g * S[n] + k[n] * m
    return {"y": Sum(k[n] * S[n], n), "z": m * Sum(S[n], n)}


@rg.recurrence(lane="P", state={"S": "B P N", "m": "B P"},
               inputs={"q": "B L N", "k": "B L N", "v": "B L P", "g": "B L"},
               outputs={"y": "B L P"})
def normalized(S, m, q, k, v, g, n):
    m = g * m + Sum(k[n] * S[n], n)  # a scalar state fed by a reduction of the old state
    S[n] = g * S[n] + k[n] * v / (1 + m * m)  # a vector update reading the new scalar state
    return {"y": Sum(q[n] * S[n], n) / (1 + m * m)}


@rg.recurrence(lane="D", state={"h": "B D"}, inputs={"x": "B L D"}, outputs={"y": "B L D"})
def leaky_max(h, x):
    h = 0.5 * h + where(x > 0, x, 0.1 * x)
    return {"y": maximum(h, x)}  # a where() inside a maximum(): nested Piecewise


@rg.recurrence(lane="P", state={"h": "B P N"}, inputs={"x": "B L P", "C": "B L N"},
               outputs={"y": "B L P"})
def scalar_sum(h, x, C, n):
    h[n] = 0.5 * h[n] + C[n] * x
    return {"y": Sum(C[n] * h[n], n) + Sum(x, n)}  # Sum over n of an n-independent term: N*x


# ---------------------------------------------------------------------------------------------
# Cases: the spec, random inputs and states, the numpy forward
# ---------------------------------------------------------------------------------------------


@dataclass
class Case:
    rec: object
    inputs: list  # mx arrays in declaration order
    states: list  # mx arrays in declaration order
    np_forward: object  # (*inputs, *states) float64 -> (outputs, finals)


def _n(shape, s=1.0):
    return s * mx.random.normal(shape)


def _u(shape, lo, hi):
    return mx.random.uniform(lo, hi, shape)


def make_case(name, b=2, L=11):
    if name == "delta_rule":
        P, N = 5, 4
        k = _n((b, L, N))
        k = k / mx.sqrt(mx.sum(k * k, axis=-1, keepdims=True))  # unit keys: a contraction
        return Case(delta_rule, [_n((b, L, N), 0.5), k, _n((b, L, P)), _u((b, L), 0.1, 0.9)],
                    [_n((b, P, N), 0.5)], np_delta_rule)
    if name == "tanh_rnn":
        D = 6
        return Case(tanh_rnn, [_n((b, L, D)), _n((b, L, D))], [_n((b, D), 0.5)], np_tanh_rnn)
    if name == "fancy":
        D = 7
        return Case(fancy, [_n((b, L, D)), _n((b, L, D)), _n((b, L, D))], [_n((b, D))], np_fancy)
    if name == "shared_param":
        H, P = 3, 5
        return Case(shared_param, [_n((b, L, H, P)), _n((H,)), _n((H, P))], [_n((b, H, P))],
                    np_shared_param)
    if name == "two_states":
        P, N = 4, 3
        return Case(two_states, [_n((b, L, N), 0.5), _n((b, L, P)), _u((b, L, P), 0.5, 0.95)],
                    [_n((b, P, N), 0.5), _n((b, P))], np_two_states)
    if name == "normalized":
        P, N = 3, 4
        return Case(normalized, [_n((b, L, N), 0.5), _n((b, L, N), 0.5), _n((b, L, P)),
                                 _u((b, L), 0.5, 0.9)], [_n((b, P, N), 0.5), _n((b, P))],
                    np_normalized)
    if name == "leaky_max":
        D = 6
        return Case(leaky_max, [_n((b, L, D))], [_n((b, D))], np_leaky_max)
    if name == "scalar_sum":
        P, N = 3, 4
        return Case(scalar_sum, [_n((b, L, P)), _n((b, L, N), 0.5)], [_n((b, P, N))],
                    np_scalar_sum)
    raise KeyError(name)


NAMES = ["delta_rule", "tanh_rnn", "fancy", "shared_param", "two_states", "normalized"]


def _as_tuple(x):
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _finals(rec, h):
    return [h] if len(rec.spec.states) == 1 else [h[k] for k in rec.spec.states]


def _init(rec, states):
    return states[0] if len(states) == 1 else dict(zip(rec.spec.states, states))


def _weights(case):
    outs, fins = case.rec.reference(*case.inputs, initial_state=_init(case.rec, case.states),
                                    return_state=True)
    return ([mx.random.normal(o.shape) for o in _as_tuple(outs)],
            [mx.random.normal(f.shape) for f in _finals(case.rec, fins)])


def _mx_loss(run, case, Wo, Wf):
    n_in = len(case.inputs)

    def f(*args):
        outs, fins = run(*args[:n_in], initial_state=_init(case.rec, list(args[n_in:])),
                         return_state=True)
        total = sum(mx.sum(o.astype(F32) * w) for o, w in zip(_as_tuple(outs), Wo))
        return total + sum(mx.sum(s * w) for s, w in zip(_finals(case.rec, fins), Wf))

    return f


def _np_loss(case, Wo, Wf):
    Wo = [np.array(w, dtype=np.float64) for w in Wo]
    Wf = [np.array(w, dtype=np.float64) for w in Wf]

    def f(args):
        outs, fins = case.np_forward(*args)
        return (sum(float(np.sum(o * w)) for o, w in zip(outs, Wo))
                + sum(float(np.sum(s * w)) for s, w in zip(fins, Wf)))

    return f


def compiled(case, seg=4):
    def run(*args, **kw):
        return case.rec(*args, backend="mlx", seg=seg, **kw)
    return run


def check_against_finite_differences(case, name):
    """The compiler's VJP (fp32) against central differences of the float64 numpy forward."""
    Wo, Wf = _weights(case)
    args = case.inputs + case.states
    g = mx.grad(_mx_loss(compiled(case), case, Wo, Wf), argnums=tuple(range(len(args))))(*args)
    g = [np.array(x, dtype=np.float64) for x in g]
    x64 = [np.array(x, dtype=np.float64) for x in args]
    loss = _np_loss(case, Wo, Wf)
    rng = np.random.default_rng(7)
    labels = list(case.rec.spec.inputs) + [f"initial {s}" for s in case.rec.spec.states]
    # one direction per argument, then one joint direction over all of them
    directions = []
    for i in range(len(args)):
        directions.append((labels[i], [rng.standard_normal(x.shape) if j == i else np.zeros(x.shape)
                                       for j, x in enumerate(x64)]))
    directions.append(("all", [rng.standard_normal(x.shape) for x in x64]))
    eps = 1e-6
    for label, d in directions:
        plus = loss([x + eps * dx for x, dx in zip(x64, d)])
        minus = loss([x - eps * dx for x, dx in zip(x64, d)])
        fd = (plus - minus) / (2 * eps)
        ad = sum(float(np.sum(gi * di)) for gi, di in zip(g, d))
        assert abs(fd) > 1e-6, f"{name}/{label}: degenerate direction"
        assert abs(ad - fd) / abs(fd) < 1e-3, f"{name}: d/d({label}) vjp {ad} vs fd {fd}"


def test_adjoint_ir_delta_rule():
    text = delta_rule.adjoint_ir()
    for name in delta_rule.spec.inputs:
        assert f"grad {name}" in text
    assert "lambda h" in text
    # the forward reduction r is recomputed, and its adjoint is itself a reduction
    assert "r += " in text and "acc_r += " in text
    red = delta_rule.gradient_reductions()
    assert red["q"] == ["lanes"] and red["k"] == ["lanes"]
    assert red["v"] == ["state index"] and red["beta"] == ["state index", "lanes"]


@pytest.mark.parametrize("name", NAMES)
def test_adjoint_ir_mentions_every_gradient(name):
    rec = make_case(name).rec
    text = rec.adjoint_ir()
    for t in rec.spec.inputs.values():
        assert f"grad {t.name}" in text, f"{name}: no gradient of {t.name} in\n{text}"
        if t.components > 1:
            for c in range(1, t.components):
                assert f"grad {t.name}.{c}" in text
    for s in rec.spec.states:
        assert f"lambda {s}" in text
        assert f"{s} (initial state)" in text
    if rec.spec.state_axis is not None:
        assert "for n in state axis:" in text and "+= " in text


def test_adjoint_ir_reductions_shared_param():
    red = shared_param.gradient_reductions()
    assert red["decay"] == ["lanes", "time", "batch"]
    assert red["gain"] == ["time", "batch"]
    assert red["x"] == []
    text = shared_param.adjoint_ir()
    assert "decay: lanes, time, batch" in text


def test_two_states_reductions():
    red = two_states.gradient_reductions()
    assert "lanes" in red["k"]
    assert "state index" in red["v"] and "state index" in red["g"]


# ---------------------------------------------------------------------------------------------
# Tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMES)
def test_numpy_forward_matches(name):
    """The hand-written float64 forward computes the same function as the compiler."""
    case = make_case(name)
    outs, fins = compiled(case)(*case.inputs, initial_state=_init(case.rec, case.states),
                                return_state=True)
    args = [np.array(x, dtype=np.float64) for x in case.inputs + case.states]
    np_outs, np_fins = case.np_forward(*args)
    for a, b in zip(_as_tuple(outs), np_outs):
        assert rel_err(a, b) < 1e-5
    for a, b in zip(_finals(case.rec, fins), np_fins):
        assert rel_err(a, b) < 1e-5


@pytest.mark.parametrize("seg", [3, 64])
@pytest.mark.parametrize("name", NAMES)
def test_vjp_matches_autodiff_of_reference(name, seg):
    case = make_case(name)
    Wo, Wf = _weights(case)
    args = case.inputs + case.states
    argnums = tuple(range(len(args)))
    g = mx.grad(_mx_loss(compiled(case, seg), case, Wo, Wf), argnums=argnums)(*args)
    g_ref = mx.grad(_mx_loss(case.rec.reference, case, Wo, Wf), argnums=argnums)(*args)
    labels = list(case.rec.spec.inputs) + [f"initial {s}" for s in case.rec.spec.states]
    for label, a, b, x in zip(labels, g, g_ref, args):
        assert a.shape == x.shape, label
        assert rel_err(a, b) < 1e-5, f"{name}: gradient of {label}"


@pytest.mark.parametrize("name", NAMES)
def test_vjp_matches_float64_finite_differences(name):
    check_against_finite_differences(make_case(name), name)


def test_where_nested_in_maximum():
    """maximum(a, b) of an expression that contains where(): sympy folds the nested Piecewise
    into an ``ITE`` condition, which every spec-language function must still render."""
    case = make_case("leaky_max")
    outs = compiled(case)(*case.inputs, initial_state=case.states[0])
    np_outs, _ = case.np_forward(*[np.array(x, dtype=np.float64) for x in case.inputs + case.states])
    assert rel_err(outs, np_outs[0]) < 1e-5
    check_against_finite_differences(case, "leaky_max")


def test_sum_of_state_index_independent_term():
    """Sum(x, n) with x constant over the state index is N*x (the IR's loop says so); forward and
    gradient must agree with the float64 numpy forward."""
    case = make_case("scalar_sum")
    y = compiled(case)(*case.inputs, initial_state=case.states[0])
    np_y, _ = case.np_forward(*[np.array(x, dtype=np.float64) for x in case.inputs + case.states])
    assert rel_err(y, np_y[0]) < 1e-5
    check_against_finite_differences(case, "scalar_sum")


def test_component_symbols_do_not_clash_with_inputs():
    """A component state h ("B P 2") and an input named h1: the input is not the state's second
    component. The spec must either be rejected at definition time or compute the right thing."""
    try:
        @rg.recurrence(lane="P", state={"h": "B P 2"}, inputs={"a": "B L P", "h1": "B L P"},
                       outputs={"y": "B L P 2"})
        def clash(h, a, h1):
            u, w = h[0], h[1]
            h[0] = a * u + h1
            h[1] = a * w
            return {"y": (h[0], h[1])}
    except rg.SpecError as exc:
        assert "h1" in str(exc)
        return
    a, x, h0 = _u((2, 5, 3), 0.5, 0.9), _n((2, 5, 3)), _n((2, 3, 2))
    y = clash(a, x, initial_state=h0, backend="mlx")
    u, w = h0[..., 0], h0[..., 1]
    ys = []
    for t in range(5):
        u, w = a[:, t] * u + x[:, t], a[:, t] * w
        ys.append(mx.stack([u, w], axis=-1))
    assert rel_err(y, mx.stack(ys, axis=1)) < 1e-5


@rg.recurrence(lane="D", state={"h": "B D"}, inputs={"a": "B L D", "b": "B L D", "c": "B L D"},
               outputs={"y": "B L D"})
def kinks(h, a, b, c):
    h = 0.5 * h + maximum(a, b) + 2 * minimum(a, b) + 3 * rg_abs(c)
    return {"y": h}


def test_documented_subgradients_at_kinks():
    """At a tie maximum/minimum send the whole gradient to their first argument; abs'(0) = 0."""
    a = _n((2, 6, 5))
    b, c = mx.array(a), mx.zeros(a.shape)  # exact ties, exact zeros
    W = _n(a.shape)
    g = mx.grad(lambda a, b, c: mx.sum(kinks(a, b, c, backend="mlx", seg=4) * W),
                argnums=(0, 1, 2))(a, b, c)
    lam, lams = mx.zeros((2, 5)), []
    for t in reversed(range(6)):  # lambda_t = W_t + 0.5 lambda_{t+1}
        lam = W[:, t] + 0.5 * lam
        lams.append(lam)
    expected_a = 3 * mx.stack(lams[::-1], axis=1)
    assert rel_err(g[0], expected_a) < 1e-6
    assert mx.all(g[1] == 0).item() and mx.all(g[2] == 0).item()
