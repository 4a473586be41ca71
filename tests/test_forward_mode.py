"""Forward mode (``mx.jvp``) and second-order derivatives.

``mx.jvp`` of a compiled recurrence runs its derived tangent recurrence; it is compared with
``mx.jvp`` of ``rec.reference`` (the plain per-step loop, differentiated by MLX) and, for a custom
spec, with float64 central finite differences of a hand-written numpy forward. Second order:
exact on ``mlx``; on the kernel backends a clear error, never a silently wrong derivative. The
simulator cannot run under ``mx.compile``/``mx.vmap`` and says so.
"""

from __future__ import annotations

import dataclasses

import mlx.core as mx
import numpy as np
import pytest

import mlx_recgen as rg
from mlx_recgen import Sum, abs as rg_abs, maximum, sigmoid, tanh, where
from mlx_recgen.backends.kernels import _refusing_vmap
from mlx_recgen.backends.mlx_backend import MLXBackend
from mlx_recgen.sim import SimulatorTransformError
from conftest import KERNEL_BACKENDS, rel_err
from references import INPUTS

BACKENDS = ["mlx", *KERNEL_BACKENDS]

SIZES = {"ssd": dict(b=2, L=9, H=2, P=3, N=4), "gla": dict(b=2, L=9, H=2, K=3, V=4),
         "rglru": dict(b=2, L=9, D=5, negative=True), "rotlru": dict(b=2, L=9, P=3)}
SEG = 4  # < L: the checkpoints and their tangents matter


# ---------------------------------------------------------------------------------------------
# Custom specs
# ---------------------------------------------------------------------------------------------


@rg.recurrence(lane="P", state={"h": "B P N"},
               inputs={"q": "B L N", "k": "B L N", "v": "B L P", "beta": "B L"},
               outputs={"y": "B L P"})
def delta_tanh(h, q, k, v, beta, n):
    r = Sum(k[n] * h[n], n)  # a reduction feeding the update
    h[n] = h[n] + sigmoid(beta) * (v - r) * k[n]
    return {"y": tanh(Sum(q[n] * h[n], n))}  # a nonlinear output of a reduction


def np_delta_tanh(q, k, v, beta, h0):
    h, ys = h0.copy(), []
    for t in range(q.shape[1]):
        kt = k[:, t]
        r = np.einsum("bpn,bn->bp", h, kt)
        h = h + ((1 / (1 + np.exp(-beta[:, t, None]))) * (v[:, t] - r))[:, :, None] * kt[:, None, :]
        ys.append(np.tanh(np.einsum("bpn,bn->bp", h, q[:, t])))
    return np.stack(ys, axis=1), h


def delta_tanh_inputs(b=2, L=7, P=3, N=4):
    k = mx.random.normal((b, L, N))
    k = k / mx.sqrt(mx.sum(k * k, axis=-1, keepdims=True))
    return ([0.5 * mx.random.normal((b, L, N)), k, mx.random.normal((b, L, P)),
             mx.random.normal((b, L))], 0.5 * mx.random.normal((b, P, N)))


@rg.recurrence(lane="D", state={"h": "B D"}, inputs={"w": "B L D", "x": "B L D", "z": "B L D"},
               outputs={"y": "B L D"})
def kinks(h, w, x, z):
    h = tanh(w * h + x)
    return {"y": maximum(h, 0.5 * z) + rg_abs(z) * h + where(x > 0, x, 0.1 * x)}


def kinks_inputs(b=2, L=7, D=5):
    return [mx.random.normal((b, L, D)) for _ in range(3)], mx.random.normal((b, D))


SPECS = {"delta_tanh": (delta_tanh, delta_tanh_inputs), "kinks": (kinks, kinks_inputs)}


# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


def _rec_and_inputs(name):
    if name in SPECS:
        rec, make = SPECS[name]
        inputs, h0 = make()
    else:
        rec = rg.load_spec(name)
        inputs, h0 = INPUTS[name](**SIZES[name])
    return rec, inputs, h0


def _fn(rec, backend, seg=SEG, schedule="auto"):
    """(*inputs, h0) -> (outputs, final state) on ``backend`` ("reference": the plain loop)."""
    if backend == "reference":
        return lambda *a: rec.reference(*a[:-1], initial_state=a[-1], return_state=True)
    return lambda *a: rec(*a[:-1], initial_state=a[-1], return_state=True, backend=backend,
                          seg=seg, schedule=schedule)


def _directions(arrays):
    return [mx.random.normal(x.shape) for x in arrays]


def _loss(f):
    """A nonlinear scalar of the outputs and the final state (nonzero second derivatives)."""
    def loss(*a):
        y, h = f(*a)
        return mx.sum(mx.sin(y)) + mx.sum(h * h)

    return loss


def _close(got, want, tol=1e-5):
    got = got if isinstance(got, (list, tuple)) else [got]
    want = want if isinstance(want, (list, tuple)) else [want]
    assert len(got) == len(want)
    for i, (g, w) in enumerate(zip(got, want)):
        assert g.shape == w.shape, f"result {i}: shape {g.shape} vs {w.shape}"
        assert rel_err(g, w) < tol, f"result {i}: relative error {rel_err(g, w):.2e}"


# ---------------------------------------------------------------------------------------------
# First order: mx.jvp
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("schedule", ["sequential", "auto"])
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", ["ssd", "gla", "rglru", "rotlru", "delta_tanh"])
def test_jvp_matches_reference(backend, name, schedule):
    """Every input and the initial state perturbed; output and final-state tangents. With
    ``auto`` the state-affine specs run (and their tangents, also state-affine) chunked."""
    _check_jvp(name, backend, schedule)


def test_jvp_through_abs_maximum_where():
    """Piecewise tangents and abs' = sign (as a Piecewise). On ``mlx`` only: a kernel backend
    renders the tangent's adjoint with its forward kernel, which sympy is slow to derive for
    this spec."""
    _check_jvp("kinks", "mlx")


def _check_jvp(name, backend, schedule="auto"):
    rec, inputs, h0 = _rec_and_inputs(name)
    args = [*inputs, h0]
    tangents = _directions(args)
    (y, h), (ty, th) = mx.jvp(_fn(rec, backend, schedule=schedule), args, tangents)
    (ry, rh), (rty, rth) = mx.jvp(_fn(rec, "reference"), args, tangents)
    _close([y, h], [ry, rh])
    assert ty.dtype == y.dtype and th.dtype == mx.float32
    _close([ty, th], [rty, rth])


@pytest.mark.parametrize("backend", BACKENDS)
def test_jvp_matches_finite_differences(backend):
    inputs, h0 = delta_tanh_inputs()
    args = [*inputs, h0]
    tangents = _directions(args)
    _, (ty, th) = mx.jvp(_fn(delta_tanh, backend), args, tangents)
    x = [np.array(a, dtype=np.float64) for a in args]
    d = [np.array(t, dtype=np.float64) for t in tangents]
    eps = 1e-5
    plus = np_delta_tanh(*[a + eps * t for a, t in zip(x, d)])
    minus = np_delta_tanh(*[a - eps * t for a, t in zip(x, d)])
    fd = [(p - m) / (2 * eps) for p, m in zip(plus, minus)]
    assert rel_err(ty, fd[0]) < 1e-4
    assert rel_err(th, fd[1]) < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_jvp_of_initial_state_only(backend):
    """Only the initial state is perturbed: the inputs' tangents arrive as None (zeros)."""
    rec, inputs, h0 = _rec_and_inputs("ssd")
    t0 = mx.random.normal(h0.shape)

    def run(f):
        return mx.jvp(lambda h: f(*inputs, h), [h0], [t0])[1]

    _close(run(_fn(rec, backend)), run(_fn(rec, "reference")))


@pytest.mark.parametrize("backend", BACKENDS)
def test_jvp_of_one_input_without_state(backend):
    """Default initial state, one perturbed input, outputs only."""
    rec, inputs, _ = _rec_and_inputs("gla")
    tk = mx.random.normal(inputs[1].shape)

    def run(call):
        return mx.jvp(lambda k: call(inputs[0], k, *inputs[2:]), [inputs[1]], [tk])[1]

    _close(run(lambda *a: rec(*a, backend=backend, seg=SEG)), run(rec.reference))


def test_jvp_half_precision_dtypes():
    """fp16 inputs: output tangents in the outputs' dtype, the state tangent in fp32."""
    rec, inputs, h0 = _rec_and_inputs("rglru")
    inputs = [x.astype(mx.float16) for x in inputs]
    tangents = _directions(inputs)
    (y, h), (ty, th) = mx.jvp(lambda *a: rec(*a, return_state=True, backend="mlx", seg=SEG),
                              inputs, [t.astype(mx.float16) for t in tangents])
    assert y.dtype == ty.dtype == mx.float16 and h.dtype == th.dtype == mx.float32
    (_, _), (rty, rth) = mx.jvp(lambda *a: rec.reference(*a, return_state=True),
                                [x.astype(mx.float32) for x in inputs], tangents)
    assert rel_err(ty, rty) < 1e-2 and rel_err(th, rth) < 1e-2


def test_tangent_spec_and_ir():
    rec = delta_tanh
    spec = rec.tangent.spec
    assert list(spec.inputs) == ["q", "k", "v", "beta", "q_dot", "k_dot", "v_dot", "beta_dot"]
    assert list(spec.states) == ["h", "h_dot"] and list(spec.outputs) == ["y", "y_dot"]
    text = rec.tangent_ir()
    assert "state h_dot[n] <-" in text and "output y_dot <-" in text


def test_tangent_names_do_not_collide():
    @rg.recurrence(lane="D", state={"h": "B D"}, inputs={"x": "B L D", "x_dot": "B L D"},
                   outputs={"y": "B L D"})
    def clash(h, x, x_dot):
        h = x * h + x_dot
        return {"y": h}

    spec = clash.tangent.spec
    names = [*spec.states, *spec.inputs, *spec.outputs]
    assert len(set(names)) == len(names) == 8
    assert len({str(s) for s in spec.symbols.values()}) == len(spec.symbols)
    a, b = mx.random.uniform(0.5, 0.9, (2, 5, 3)), mx.random.normal((2, 5, 3))
    ta, tb = _directions([a, b])
    got = mx.jvp(lambda *v: clash(*v, backend="mlx", seg=2), [a, b], [ta, tb])[1]
    want = mx.jvp(clash.reference, [a, b], [ta, tb])[1]
    _close(got, want)


# ---------------------------------------------------------------------------------------------
# Second order
# ---------------------------------------------------------------------------------------------


def _grad_of_grad(f, n):
    argnums = tuple(range(n))

    def inner(*a):
        return sum(mx.sum(mx.cos(g)) for g in mx.grad(_loss(f), argnums=argnums)(*a))

    return mx.grad(inner, argnums=argnums)


@pytest.mark.parametrize("name", ["ssd", "rotlru", "delta_tanh"])
def test_grad_of_grad_on_mlx(name):
    """Checkpoints (seg < L) and the initial state both carry second-order terms."""
    rec, inputs, h0 = _rec_and_inputs(name)
    args = [*inputs, h0]
    _close(_grad_of_grad(_fn(rec, "mlx"), len(args))(*args),
           _grad_of_grad(_fn(rec, "reference"), len(args))(*args))


def test_forward_over_reverse_on_mlx():
    rec, inputs, h0 = _rec_and_inputs("ssd")
    args = [*inputs, h0]
    tangents = _directions(args)
    argnums = tuple(range(len(args)))

    def hvp(f):
        return mx.jvp(lambda *a: mx.grad(_loss(f), argnums=argnums)(*a), args, tangents)[1]

    _close(hvp(_fn(rec, "mlx")), hvp(_fn(rec, "reference")))


@pytest.mark.parametrize("backend", BACKENDS)
def test_reverse_over_forward(backend):
    """The gradient of a jvp (w.r.t. primals and tangents) runs the tangent recurrence's VJP."""
    rec, inputs, h0 = _rec_and_inputs("ssd")
    args = [*inputs, h0]
    tangents = _directions(args)
    n = len(args)

    def grads(f):
        def g(*a):
            (y, h), (ty, th) = mx.jvp(f, list(a[:n]), list(a[n:]))
            return mx.sum(mx.cos(ty)) + mx.sum(th * h)

        return mx.grad(g, argnums=tuple(range(2 * n)))(*args, *tangents)

    _close(grads(_fn(rec, backend)), grads(_fn(rec, "reference")))


@pytest.mark.parametrize("backend", BACKENDS)
def test_jvp_of_jvp(backend):
    rec, inputs, h0 = _rec_and_inputs("rglru")
    args = [*inputs, h0]
    t1, t2 = _directions(args), _directions(args)

    def second(f):
        return mx.jvp(lambda *a: mx.jvp(f, list(a), t1)[1], args, t2)[1]

    _close(second(_fn(rec, backend)), second(_fn(rec, "reference")))


SECOND_ORDER = r"second-order derivatives .* not supported by the kernel backends.*backend='mlx'"


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_grad_of_grad_on_kernels_raises(backend):
    rec, inputs, h0 = _rec_and_inputs("rglru")
    args = [*inputs, h0]
    with pytest.raises(NotImplementedError, match=SECOND_ORDER):
        mx.eval(_grad_of_grad(_fn(rec, backend), len(args))(*args))


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_forward_over_reverse_on_kernels_raises(backend):
    rec, inputs, h0 = _rec_and_inputs("rglru")
    args = [*inputs, h0]
    argnums = tuple(range(len(args)))
    with pytest.raises(NotImplementedError, match=SECOND_ORDER):
        mx.eval(mx.jvp(lambda *a: mx.grad(_loss(_fn(rec, backend)), argnums=argnums)(*a), args,
                       _directions(args))[1])


# ---------------------------------------------------------------------------------------------
# mx.compile / mx.vmap
# ---------------------------------------------------------------------------------------------


SIM_TRANSFORM = r"metal-sim.*mx\.compile or mx\.vmap.*backend='mlx'"


@pytest.mark.sim
@pytest.mark.parametrize("transform", ["compile", "vmap", "compile-grad", "vmap-grad"])
def test_simulator_refuses_compile_and_vmap(transform):
    rec, (a, x), _ = _rec_and_inputs("rglru")

    def f(a, x):
        return rec(a, x, backend="metal-sim", seg=SEG)

    def loss(a, x):
        return mx.sum(f(a, x))

    fn = {"compile": mx.compile(f), "vmap": mx.vmap(f), "compile-grad": mx.compile(mx.grad(loss)),
          "vmap-grad": mx.vmap(mx.grad(loss))}[transform]
    if transform.startswith("vmap"):
        a, x = mx.stack([a, a]), mx.stack([x, x])
    with pytest.raises(SimulatorTransformError, match=SIM_TRANSFORM):
        mx.eval(fn(a, x))


def test_compile_and_vmap_on_mlx():
    rec, (a, x), _ = _rec_and_inputs("rglru")
    a2, x2 = mx.stack([a, a[:, ::-1]]), mx.stack([x, -x])
    _close(mx.compile(lambda a, x: rec(a, x, backend="mlx", seg=SEG))(a, x), rec.reference(a, x))
    _close(mx.vmap(lambda a, x: rec(a, x, backend="mlx", seg=SEG))(a2, x2),
           mx.stack([rec.reference(a2[i], x2[i]) for i in range(2)]))


# ---------------------------------------------------------------------------------------------
# A kernel backend as MLX sees it on a GPU, emulated on the CPU
# ---------------------------------------------------------------------------------------------


def _qr_kernel(inputs, **launch):
    """A stand-in for a custom kernel: zero from every input through a QR factorization, an op
    that MLX can neither jvp nor vmap."""
    total = sum(mx.sum(x.astype(mx.float32)) for x in inputs)
    return [0 * mx.sum(mx.linalg.qr(mx.eye(2) + 0 * total, stream=mx.cpu)[0])]


class OpaqueBackend:
    """The pure-MLX passes plus, in each, a kernel of every input that MLX can neither jvp nor
    vmap, made as the kernel backends make theirs (``kernels._refusing_vmap``): what a custom
    kernel is to MLX's transforms."""

    name = "cuda"

    def __init__(self, rec):
        self.impl = MLXBackend(rec)
        self.kernel = _refusing_vmap(lambda **definition: _qr_kernel, "cuda")()

    def _opaque_zero(self, arrays):
        return self.kernel([*arrays, mx.array([1])])[0]

    def forward(self, inputs, states, sizes, seg, out_dtype, schedule="sequential"):
        assert schedule == "sequential"
        outs, finals, residuals = self.impl.forward(inputs, states, sizes, seg, out_dtype)
        outs[0] = outs[0] + self._opaque_zero([*inputs, *states]).astype(outs[0].dtype)
        return outs, finals, residuals

    def backward(self, inputs, states, residuals, d_outputs, d_finals, sizes, seg,
                 schedule="sequential"):
        grads, d_init = self.impl.backward(inputs, states, residuals, d_outputs, d_finals, sizes,
                                           seg)
        zero = self._opaque_zero([*inputs, *d_outputs, *d_finals])
        grads[0] = grads[0] + zero.astype(grads[0].dtype)
        return grads, d_init


@pytest.fixture
def opaque_rec():
    @rg.recurrence(lane="D", state={"h": "B D"}, inputs={"a": "B L D", "x": "B L D"},
                   outputs={"y": "B L D"})
    def lru(h, a, x):
        h = a * h + tanh(x)
        return {"y": h * h}

    for rec in (lru, lru.tangent):
        rec._backends["cuda"] = OpaqueBackend(rec)
    return lru


def test_opaque_kernel_jvp(opaque_rec):
    a, x = mx.random.uniform(0.5, 0.9, (2, 9, 5)), mx.random.normal((2, 9, 5))
    ta, tx = _directions([a, x])
    def f(a, x):
        return opaque_rec(a, x, backend="cuda", seg=SEG, schedule="sequential")

    got = mx.jvp(f, [a, x], [ta, tx])[1]
    _close(got, mx.jvp(opaque_rec.reference, [a, x], [ta, tx])[1])
    grads = mx.grad(lambda a, x: mx.sum(f(a, x)), argnums=(0, 1))(a, x)
    _close(grads, mx.grad(lambda a, x: mx.sum(opaque_rec.reference(a, x)), argnums=(0, 1))(a, x))


def test_opaque_kernel_transform_errors(opaque_rec):
    a, x = mx.random.uniform(0.5, 0.9, (2, 9, 5)), mx.random.normal((2, 9, 5))

    def f(a, x):
        return opaque_rec(a, x, backend="cuda", seg=SEG, schedule="sequential")

    refusal = r"mx\.vmap is not supported by the kernel backends \(backend='cuda'\)"
    with pytest.raises(NotImplementedError, match=refusal):
        mx.eval(mx.vmap(f)(mx.stack([a, a]), mx.stack([x, x])))
    with pytest.raises(NotImplementedError, match=refusal):  # a later input mapped alone
        mx.eval(mx.vmap(f, in_axes=(None, 0))(a, mx.stack([x, x])))
    with pytest.raises(NotImplementedError, match=refusal):  # the backward's kernel, mapped alone
        cotangents = mx.stack([mx.ones_like(x), -mx.ones_like(x)])
        mx.eval(mx.vmap(lambda d: mx.vjp(f, [a, x], [d])[1][0])(cotangents))
    args = [a, x, mx.random.normal((2, 5))]

    def g(a, x, h0):
        return opaque_rec(a, x, initial_state=h0, return_state=True, backend="cuda", seg=SEG,
                          schedule="sequential")

    with pytest.raises(NotImplementedError, match=SECOND_ORDER):
        mx.eval(_grad_of_grad(g, 3)(*args))
    with pytest.raises(NotImplementedError, match=SECOND_ORDER):
        mx.eval(mx.jvp(lambda *v: mx.grad(_loss(g), argnums=(0, 1, 2))(*v), args,
                       _directions(args))[1])


def test_calls_on_a_device_run_compiled(opaque_rec):
    """On Metal and CUDA the full path runs under ``mx.compile`` (``CallPlan.compiled``), on
    the simulator it does not. Compiled, it gives the uncompiled path's values and gradients
    bit for bit, the reference's within rounding, its jvp on the tangent recurrence, and its
    refusal of vmap."""
    def arguments(L):
        return [mx.random.uniform(-0.9, 0.9, (2, L, 5)), mx.random.normal((2, L, 5)),
                mx.random.normal((2, 5))]

    a, x, h0 = arguments(9)
    plan = opaque_rec.plan(a, x, initial_state=h0, backend="cuda", schedule="sequential")
    assert plan.compiled
    uncompiled = dataclasses.replace(plan, compiled=False)
    assert plan._path is not plan.function and uncompiled._path is uncompiled.function

    def via(p):
        def f(a, x, h0):
            outs, finals = p.run([a, x], [h0])
            return outs[0], finals[0]
        return f

    for got, want in zip(via(plan)(a, x, h0), via(uncompiled)(a, x, h0)):
        assert mx.array_equal(got, want)
    argnums = (0, 1, 2)
    got = mx.grad(_loss(via(plan)), argnums=argnums)(a, x, h0)
    for g, w in zip(got, mx.grad(_loss(via(uncompiled)), argnums=argnums)(a, x, h0)):
        assert mx.array_equal(g, w)

    def reference(a, x, h0):
        return opaque_rec.reference(a, x, initial_state=h0, return_state=True)

    _close(list(got), list(mx.grad(_loss(reference), argnums=argnums)(a, x, h0)))
    directions = _directions([a, x, h0])
    _close(mx.jvp(via(plan), [a, x, h0], directions)[1],
           mx.jvp(reference, [a, x, h0], directions)[1])
    with pytest.raises(NotImplementedError, match=r"mx\.vmap is not supported"):
        mx.eval(mx.vmap(via(plan))(*[mx.stack([v, v]) for v in (a, x, h0)]))


def test_the_simulator_runs_calls_uncompiled():
    rec = rg.load_spec("rglru")
    plan = rec.plan(mx.ones((1, 3, 4)), mx.ones((1, 3, 4)), backend="metal-sim")
    assert not plan.compiled  # it evaluates its inputs through numpy: it cannot be traced
