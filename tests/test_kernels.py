"""Generated kernels against the hand-written references and the pure-MLX backend.

The same cases run on two backends: ``metal-sim`` (the emitted Metal, executed by the simulator
on the CPU; marker ``sim``) and ``cuda`` (the same templates rendered as CUDA on an NVIDIA GPU;
marker ``gpu``, skipped where MLX has no CUDA backend). Every case checks the forward output, the
final state and the gradient of every input and of the initial state.
"""

from __future__ import annotations

import mlx.core as mx
import pytest

import mlx_recgen as rg
from references import (INPUTS, gla_ref, rglru_ref, rotlru_ref, ssd_ref, state_loss_weights,
                        value_and_grads)
from conftest import KERNEL_BACKENDS, rel_err


BACKENDS = KERNEL_BACKENDS

REFERENCES = {"ssd": ssd_ref, "gla": gla_ref, "rglru": rglru_ref, "rotlru": rotlru_ref}

# (spec, input sizes, seg): lane sizes not multiples of 32 (and above 32: two simdgroups
# reduce through threadgroup memory), L not a multiple of seg, B = 1, L = 1, seg = 1.
CASES = [
    ("ssd", dict(b=2, L=13, H=2, P=5, N=4), 4),
    ("ssd", dict(b=1, L=1, H=1, P=33, N=3), 32),
    ("ssd", dict(b=1, L=9, H=2, P=40, N=16), 4),
    ("gla", dict(b=2, L=13, H=2, K=4, V=5), 4),
    ("gla", dict(b=1, L=7, H=1, K=3, V=33), 1),
    ("rglru", dict(b=2, L=13, D=7, negative=True), 4),
    ("rglru", dict(b=1, L=1, D=33), 32),
    ("rotlru", dict(b=2, L=13, P=5), 4),
    ("rotlru", dict(b=1, L=6, P=33), 32),
    # many segments: the chunked schedule's carry runs over 19 and 17 of them
    ("ssd", dict(b=1, L=37, H=1, P=7, N=3), 2),
    ("rglru", dict(b=2, L=50, D=9, negative=True), 3),
]

SCHEDULES = ["sequential", "chunked"]


def _ids(case):
    spec, sizes, seg = case
    return f"{spec}-" + "-".join(f"{k}{v}" for k, v in sizes.items()) + f"-seg{seg}"


def _run(spec, backend, inputs, h0, Wy, Wh, seg, schedule="sequential", **call):
    rec = rg.load_spec(spec)

    def fn(*args):
        return rec(*args[:-1], initial_state=args[-1], return_state=True, backend=backend, seg=seg,
                   schedule=schedule, **call)

    return value_and_grads(fn, inputs, h0, Wy, Wh)


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_fp32_matches_reference(backend, case, schedule):
    spec, sizes, seg = case
    inputs, h0 = INPUTS[spec](**sizes)
    ref = REFERENCES[spec]
    y_ref, h_ref = ref(*inputs, h0)
    Wy, Wh = state_loss_weights(y_ref, h_ref)
    ry, rh, rgrads = value_and_grads(lambda *a: ref(*a[:-1], a[-1]), inputs, h0, Wy, Wh)
    ky, kh, kgrads = _run(spec, backend, inputs, h0, Wy, Wh, seg, schedule)
    assert ky.dtype == mx.float32
    assert rel_err(ky, ry) < 1e-5
    assert rel_err(kh, rh) < 1e-5
    for i, (g, r) in enumerate(zip(kgrads, rgrads)):
        assert g.shape == r.shape, f"gradient {i}"
        assert rel_err(g, r) < 1e-5, f"gradient {i} of {spec}"


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("spec", ["ssd", "gla", "rglru", "rotlru"])
def test_bf16_matches_reference_and_mlx_backend(backend, spec, schedule):
    sizes = dict(ssd=dict(b=2, L=11, H=2, P=5, N=4), gla=dict(b=2, L=11, H=2, K=4, V=5),
                 rglru=dict(b=2, L=11, D=7), rotlru=dict(b=2, L=11, P=5))[spec]
    inputs, h0 = INPUTS[spec](**sizes)
    inputs = [x.astype(mx.bfloat16) for x in inputs]
    ref = REFERENCES[spec]
    y_ref, h_ref = ref(*inputs, h0)
    Wy, Wh = state_loss_weights(y_ref, h_ref)
    ry, rh, rgrads = value_and_grads(lambda *a: ref(*a[:-1], a[-1]), inputs, h0, Wy, Wh)
    ky, kh, kgrads = _run(spec, backend, inputs, h0, Wy, Wh, 4, schedule)
    my, mh, mgrads = _run(spec, "mlx", inputs, h0, Wy, Wh, 4)
    assert ky.dtype == mx.bfloat16 and kh.dtype == mx.float32
    assert rel_err(ky, ry) < 2e-2 and rel_err(kh, rh) < 1e-5
    # the kernels and the pure-MLX backend compute the same fp32 steps
    assert rel_err(ky, my) < 1e-2 and rel_err(kh, mh) < 1e-5
    for g, r, m, x in zip(kgrads, rgrads, mgrads, [*inputs, h0]):
        assert g.dtype == x.dtype
        assert rel_err(g, r) < 2e-2
        assert rel_err(g, m) < 1e-2


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_repeated_runs_are_bit_identical(backend, schedule):
    inputs, h0 = INPUTS["gla"](b=1, L=9, H=2, K=3, V=40)
    y_ref, h_ref = gla_ref(*inputs, h0)
    Wy, Wh = state_loss_weights(y_ref, h_ref)
    first = _run("gla", backend, inputs, h0, Wy, Wh, 4, schedule)
    second = _run("gla", backend, inputs, h0, Wy, Wh, 4, schedule)
    for a, b in zip([first[0], first[1], *first[2]], [second[0], second[1], *second[2]]):
        assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("backend", BACKENDS)
def test_scratch_history_path(backend):
    """seg * state size beyond the register budget: the recomputed segment goes to scratch."""
    from mlx_recgen.schedule import make_schedule

    rec = rg.load_spec("ssd")
    sizes = dict(b=1, L=20, H=1, P=6, N=16)
    sch = make_schedule(rec.spec, {"B": 1, "L": 20, "H": 1, "P": 6, "N": 16}, 16, split=1)
    assert sch.history == "scratch"
    inputs, h0 = INPUTS["ssd"](**sizes)
    y_ref, h_ref = ssd_ref(*inputs, h0)
    Wy, Wh = state_loss_weights(y_ref, h_ref)
    ry, rh, rgrads = value_and_grads(lambda *a: ssd_ref(*a[:-1], a[-1]), inputs, h0, Wy, Wh)
    ky, kh, kgrads = _run("ssd", backend, inputs, h0, Wy, Wh, 16, split=1)
    assert rel_err(ky, ry) < 1e-5 and rel_err(kh, rh) < 1e-5
    for g, r in zip(kgrads, rgrads):
        assert rel_err(g, r) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_custom_spec_with_parameter_and_nonlinearity(backend):
    """A user spec: a shared time-invariant parameter (reduced over lanes and time in-kernel),
    a reduction feeding the update, and nonlinear functions."""

    @rg.recurrence(lane="P", state={"h": "B P N"},
                   inputs={"k": "B L N", "v": "B L P", "beta": "B L", "w": "N"},
                   outputs={"y": "B L P"})
    def delta_tanh(h, k, v, beta, w, n):
        r = rg.Sum(k[n] * h[n], n)
        h[n] = h[n] + rg.sigmoid(beta) * (v - r) * k[n] * w[n]
        return {"y": rg.tanh(rg.Sum(k[n] * h[n], n))}

    b, L, P, N = 2, 7, 35, 3
    k = mx.random.normal((b, L, N)) * 0.5
    v = mx.random.normal((b, L, P))
    beta = mx.random.normal((b, L))
    w = mx.random.uniform(0.2, 1.0, (N,))
    h0 = mx.random.normal((b, P, N)) * 0.5
    args = [k, v, beta, w]
    y0, hf = delta_tanh.reference(*args, initial_state=h0, return_state=True)
    Wy, Wh = state_loss_weights(y0, hf)

    def run(kind):
        def fn(*a):
            if kind == "reference":
                return delta_tanh.reference(*a[:-1], initial_state=a[-1], return_state=True)
            return delta_tanh(*a[:-1], initial_state=a[-1], return_state=True, backend=kind, seg=3)
        return value_and_grads(fn, args, h0, Wy, Wh)

    ry, rh, rgrads = run("reference")
    ky, kh, kgrads = run(backend)
    assert rel_err(ky, ry) < 1e-5 and rel_err(kh, rh) < 1e-5
    for g, r in zip(kgrads, rgrads):
        assert rel_err(g, r) < 1e-5


@pytest.mark.parametrize("schedule", SCHEDULES)
@pytest.mark.parametrize("backend", BACKENDS)
def test_padded_lanes_do_not_leak_into_lane_reductions(backend, schedule):
    """Padded lanes load zeros, so here their state becomes 1/0 = inf; their contributions to
    the lane-reduced gradients (of the per-step g and the parameter c) must still be zero."""

    @rg.recurrence(lane="P", state={"h": "B P"}, inputs={"x": "B L P", "g": "B L", "c": "B"},
                   outputs={"y": "B L P"})
    def inverse_drive(h, x, g, c):
        h = c * g * h + 1 / x
        return {"y": h}

    b, L, P = 2, 6, 5  # 27 padded lanes per instance
    x = mx.random.uniform(1.0, 2.0, (b, L, P))
    g = mx.random.uniform(0.5, 1.0, (b, L))
    c = mx.random.uniform(0.5, 1.0, (b,))
    h0 = mx.random.normal((b, P))
    y0, hf = inverse_drive.reference(x, g, c, initial_state=h0, return_state=True)
    Wy, Wh = state_loss_weights(y0, hf)

    def run(kind):
        def fn(*a):
            if kind == "reference":
                return inverse_drive.reference(*a[:-1], initial_state=a[-1], return_state=True)
            return inverse_drive(*a[:-1], initial_state=a[-1], return_state=True, backend=kind,
                                 seg=4, schedule=schedule)
        return value_and_grads(fn, [x, g, c], h0, Wy, Wh)

    ry, rh, rgrads = run("reference")
    ky, kh, kgrads = run(backend)
    assert rel_err(ky, ry) < 1e-5 and rel_err(kh, rh) < 1e-5
    for grad, ref in zip(kgrads, rgrads):
        assert rel_err(grad, ref) < 1e-5


def _check_against_reference(rec, inputs, states, backend, tol=1e-5, **call):
    """Outputs, final states and the gradients of every input and initial state (a weighted
    loss over outputs and final states, through ``mx.grad``) on ``backend`` against
    ``rec.reference``. Returns the backend's results, for bit-identity checks."""
    names = list(rec.spec.states)
    n_in = len(inputs)

    def results(fn, args):
        outs, fins = fn(*args[:n_in], initial_state=dict(zip(names, args[n_in:])),
                        return_state=True)
        outs = list(outs) if isinstance(outs, tuple) else [outs]
        fins = [fins[k] for k in names] if isinstance(fins, dict) else [fins]
        return outs + fins

    def run(fn):
        args = [*inputs, *states]
        values = results(fn, args)
        weights = [mx.random.normal(v.shape, key=mx.random.key(i)) for i, v in enumerate(values)]

        def loss(*a):
            return sum(mx.sum(v.astype(mx.float32) * w) for v, w in zip(results(fn, a), weights))

        grads = mx.grad(loss, argnums=tuple(range(len(args))))(*args)
        mx.eval(values, grads)
        return values, list(grads)

    ref_values, ref_grads = run(rec.reference)
    values, grads = run(lambda *a, **kw: rec(*a, backend=backend, **call, **kw))
    labels = [*rec.spec.outputs, *(f"final {s}" for s in names)]
    for label, v, r in zip(labels, values, ref_values):
        assert rel_err(v, r) < tol, label
    labels = [*rec.spec.inputs, *(f"initial {s}" for s in names)]
    for label, g, r in zip(labels, grads, ref_grads):
        assert g.shape == r.shape, label
        assert rel_err(g, r) < tol, f"gradient of {label}"
    return values, grads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("N, seg, history, split", [(3, 3, "registers", 1), (8, 16, "scratch", 1),
                                                    (8, 16, "registers", 4)])
def test_vector_state_beside_scalar_state(backend, N, seg, history, split):
    """A scalar state checkpoints (and keeps in the recomputed segment) one row per lane, a
    vector state NS rows (NS / PARTS per thread of a split state, the scalar in every part)."""
    from mlx_recgen.schedule import make_schedule

    @rg.recurrence(lane="P", state={"h": "B P N", "c": "B P"},
                   inputs={"k": "B L N", "v": "B L P", "a": "B L P"}, outputs={"y": "B L P"})
    def gated_memory(h, c, k, v, a, n):
        h[n] = rg.sigmoid(a) * h[n] + k[n] * v
        c = 0.5 * c + rg.tanh(rg.Sum(k[n] * h[n], n))
        return {"y": c * v + rg.Sum(k[n] * h[n], n)}

    b, L, P = 2, 20, 5
    sch = make_schedule(gated_memory.spec, dict(B=b, L=L, P=P, N=N), seg, split=split)
    assert sch.history == history and sch.parts == split
    inputs = [mx.random.normal((b, L, N)) * 0.5, mx.random.normal((b, L, P)),
              mx.random.normal((b, L, P))]
    states = [mx.random.normal((b, P, N)) * 0.5, mx.random.normal((b, P))]
    _check_against_reference(gated_memory, inputs, states, backend, seg=seg, split=split)


@pytest.mark.parametrize("backend", BACKENDS)
def test_zero_dimensional_parameter(backend):
    """A 0-d input (declared with no axes) reaches the kernels as one element; its gradient is
    reduced over lanes, batch and time and comes back 0-d."""

    @rg.recurrence(lane="D", state={"h": "B D"}, inputs={"x": "B L D", "tau": ""},
                   outputs={"y": "B L D"})
    def leaky(h, x, tau):
        h = rg.sigmoid(tau) * h + x
        return {"y": rg.tanh(h) * tau}

    b, L, D = 2, 9, 40  # two simdgroups per instance
    inputs = [mx.random.normal((b, L, D)), mx.array(-0.7)]
    _, grads = _check_against_reference(leaky, inputs, [mx.random.normal((b, D))], backend,
                                        seg=4)
    assert grads[1].shape == ()


@pytest.mark.parametrize("backend", [pytest.param("mlx"), *BACKENDS])
def test_tensor_names_colliding_with_generated_identifiers(backend):
    """Tensor and local names that generated code also uses (kernel variables, meta entries,
    coordinates, C/Metal/CUDA and Python keywords, the MLX module), names whose readable
    spelling another name's derived identifier takes (s_v: the value of s; j_shape: what MLX
    calls the shape of buffer j) and a non-ASCII name."""

    @rg.recurrence(lane="P", state={"s": "B P N"},
                   inputs={"L": "B L N", "t": "B L P", "idx_B": "B L", "int": "N", "meta": "P"},
                   outputs={"lambda": "B L P"})
    def colliding_names_vector(s, L, t, idx_B, int, meta, i):
        j = rg.Sum(L[i] * s[i], i)
        s[i] = rg.sigmoid(idx_B) * s[i] + int[i] * rg.tanh(t - j) * L[i]
        n = rg.Sum(L[i] * s[i], i)
        return {"lambda": meta * n + j}

    @rg.recurrence(lane="D", state={"n": "B D", "mx": "B D"},
                   inputs={"j_shape": "B L D", "s": "B L D", "j": "B L", "size_B": "B D",
                           "t": "", "s_v": "B L D", "λ": "B L D"},
                   outputs={"L": "B L D"})
    def colliding_names_scalar(n, mx, j_shape, s, j, size_B, t, s_v, λ):
        n = rg.sigmoid(j) * n + s * size_B + 0.5 * j_shape * s_v
        mx = 0.5 * mx + rg.tanh(n) * t + λ
        return {"L": n * mx}

    b, L, P, N, D = 2, 9, 5, 3, 6
    vec = [mx.random.normal((b, L, N)) * 0.5, mx.random.normal((b, L, P)),
           mx.random.normal((b, L)), mx.random.normal((N,)), mx.random.normal((P,))]
    _check_against_reference(colliding_names_vector, vec, [mx.random.normal((b, P, N))],
                             backend, seg=4)
    scal = [mx.random.normal((b, L, D)), mx.random.normal((b, L, D)), mx.random.normal((b, L)),
            mx.random.normal((b, D)), mx.array(0.8), mx.random.normal((b, L, D)),
            mx.random.normal((b, L, D))]
    _check_against_reference(colliding_names_scalar, scal,
                             [mx.random.normal((b, D)), mx.random.normal((b, D))], backend, seg=4)


# Lane reductions past one threadgroup and past its memory: (spec, sizes, seg, threads, what the
# schedule must do). gla with 1056 lanes: two groups, each writing a partial sum. ssd with
# N = 300 on 1024 lanes: 601 rows per step exceed the 256 rows of 32 KiB at 32 simdgroups, so
# dB and dC are reduced in three rounds of the state loop and dA in two. ssd with 1056 lanes:
# both. gla with threads=32: partial sums chosen by the caller.
LARGE_REDUCTIONS = [
    ("gla", dict(b=1, L=3, H=1, K=2, V=1056), 2, None, dict(groups_per_instance=2)),
    ("ssd", dict(b=1, L=3, H=1, P=1024, N=300), 2, None,
     dict(groups_per_instance=1, time_rounds=True)),
    ("ssd", dict(b=2, L=3, H=1, P=1056, N=300), 2, None,
     dict(groups_per_instance=2, time_rounds=True)),
    ("gla", dict(b=2, L=5, H=2, K=3, V=40), 2, 32, dict(groups_per_instance=2)),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", LARGE_REDUCTIONS, ids=lambda c: _ids(c[:3]) + f"-tg{c[3]}")
def test_lane_reductions_across_groups_and_in_rounds(backend, case):
    from mlx_recgen.render.dialects import DIALECTS
    from mlx_recgen.schedule import make_schedule

    spec, sizes, seg, threads, expect = case
    rec = rg.load_spec(spec)
    axes = {"b": "B", "L": "L", "H": "H", "P": "P", "N": "N", "K": "K", "V": "V"}
    sch = make_schedule(rec.spec, {axes[k]: v for k, v in sizes.items()}, seg, threads)
    for field, value in expect.items():
        assert getattr(sch, field) == value, field
    # CUDA caps its own choice at 256 threads per group: more groups, each a partial sum
    cuda = make_schedule(rec.spec, {axes[k]: v for k, v in sizes.items()}, seg, threads,
                         max_threads=DIALECTS["cuda"].max_threads)
    assert cuda.threads <= (threads or 256)
    assert cuda.groups_per_instance >= sch.groups_per_instance
    inputs, h0 = INPUTS[spec](**sizes)
    call = dict(seg=seg) if threads is None else dict(seg=seg, threads=threads)
    first = _check_against_reference(rec, inputs, [h0], backend, **call)
    second = _check_against_reference(rec, inputs, [h0], backend, **call)
    for a, b in zip([*first[0], *first[1]], [*second[0], *second[1]]):
        assert mx.array_equal(a, b).item()


@pytest.mark.parametrize("backend", BACKENDS)
def test_backward_with_its_own_groups(backend):
    """The sequential backward of a lane-reduced spec picks smaller groups than the forward
    (partial sums per group); the forward's checkpoints serve it unchanged."""
    from mlx_recgen.render.dialects import DIALECTS
    from mlx_recgen.schedule import make_schedule

    rec = rg.load_spec("gated_deltanet")
    sizes = dict(B=1, L=7, H=2, K=16, V=64)
    cap = DIALECTS[backend].max_threads
    fwd = make_schedule(rec.spec, sizes, 4, max_threads=cap)
    bwd = make_schedule(rec.spec, sizes, 4, max_threads=cap, sweep="backward")
    assert (fwd.threads, fwd.groups_per_instance) == (256, 1)
    assert bwd.threads == 128 and bwd.groups_per_instance == 2
    b, L, H, K, V = 1, 7, 2, 16, 64
    q, k = (mx.random.normal((b, L, H, K)) * 0.4 for _ in range(2))
    inputs = [q, k, mx.random.normal((b, L, H, V)), mx.random.normal((b, L, H)) * 0.3,
              mx.random.normal((b, L, H)) * 0.5]
    _check_against_reference(rec, inputs, [mx.random.normal((b, H, K, V)) * 0.5], backend, seg=4)


# (K, split): lanes per simdgroup 32 / split; LC values per thread summed at once (schedule.lane_chunk)
LANE_CHUNK_CASES = [
    (64, 8),  # LC 8 over 4 lanes: each thread ends with 2 of the sums
    (16, 4),  # LC 4 over 8 lanes: the last level adds whole values, 2 lanes hold each sum
    (16, 1),  # LC 8 over 32 lanes: 4 lanes hold each sum
    (6, 1),  # LC 2
    (5, 1),  # LC 1: one value at a time
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("K,split", LANE_CHUNK_CASES)
def test_lane_reductions_in_chunks(backend, K, split):
    """A thread's values of a lane-reduced gradient are summed over lanes LC at a time, the sums
    left spread over the lanes (``recgen_lane_scatter``): every chunk size against the number
    of lanes in a simdgroup, with and without a split state."""
    from mlx_recgen.schedule import make_schedule

    rec = rg.load_spec("gated_deltanet")
    b, L, H, V = 1, 6, 1, 64
    sch = make_schedule(rec.spec, dict(B=b, L=L, H=H, K=K, V=V), 4, split=split,
                        sweep="backward")
    per_thread = K // split
    assert sch.parts == split and sch.lane_chunk == min(8, per_thread & -per_thread)
    q, k = (mx.random.normal((b, L, H, K)) * 0.4 for _ in range(2))
    inputs = [q, k, mx.random.normal((b, L, H, V)), mx.random.normal((b, L, H)) * 0.3,
              mx.random.normal((b, L, H)) * 0.5]
    _check_against_reference(rec, inputs, [mx.random.normal((b, H, K, V)) * 0.5], backend, seg=4,
                             split=split)


@pytest.mark.parametrize("backend", BACKENDS)
def test_staged_tiles_several_per_segment(backend, monkeypatch):
    """Tiles of 2 steps: several per segment and a partial last segment (L = 13, seg = 8), in
    the forward, the backward's recompute (oldest first) and its adjoint sweep (newest
    first)."""
    import mlx_recgen.schedule as schedule

    monkeypatch.setattr(schedule, "STAGE_MAX_STEPS", 2)
    rec = rg.load_spec("gated_deltanet")
    b, L, H, K, V = 1, 13, 2, 16, 32
    assert schedule.make_schedule(rec.spec, dict(B=b, L=L, H=H, K=K, V=V), 8).stage_steps == 2
    impl = rec._backend(backend)
    impl.forget_shapes()
    q, k = (mx.random.normal((b, L, H, K)) * 0.4 for _ in range(2))
    inputs = [q, k, mx.random.normal((b, L, H, V)), mx.random.normal((b, L, H)) * 0.3,
              mx.random.normal((b, L, H)) * 0.5]
    try:
        _check_against_reference(rec, inputs, [mx.random.normal((b, H, K, V)) * 0.5], backend,
                                 seg=8)
    finally:
        impl.forget_shapes()


def test_whole_simdgroup_sum_of_one_value_is_the_targets_sum():
    """A lane-reduced gradient summed one value at a time over a whole simdgroup (no split) is
    Metal's ``simd_sum``; CUDA spells it as its warp shuffles (the dialect table's
    ``simd_sum``). The kernels running it: ``test_lane_reductions_in_chunks`` (LC 1)."""
    rec = rg.load_spec("gated_deltanet")
    metal = rec.source("backward", backend="metal")
    cuda = rec.source("backward", backend="cuda")
    assert "recgen_lane_scatter<1, PARTS>" in metal and "v[0] = simd_sum(v[0]);" in metal
    assert "simd_sum(" not in cuda and "v[0] = recgen_warp_sum(v[0]);" in cuda
    assert "__shfl_xor_sync" in cuda


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("schedule", ["sequential", "scan"])
def test_launches_are_kept_per_call_shape(backend, schedule):
    """A kernel call of a known shape reuses its launch (``kernels._Launch``); inputs of another
    dtype, another length or another output dtype get launches of their own, and every call
    stays right."""
    rec = rg.load_spec("rglru")
    impl = rec._backend(backend)
    impl.forget_shapes()
    a = mx.random.uniform(0.3, 0.9, (2, 40, 8))
    x = mx.random.normal((2, 40, 8))
    calls = [(a, x), (a, x), (a.astype(mx.bfloat16), x.astype(mx.bfloat16)),
             (a[:, :17], x[:, :17])]
    for inputs in calls:
        y = rec(*inputs, backend=backend, schedule=schedule)
        assert y.dtype == inputs[0].dtype
        want = rec.reference(*(v.astype(mx.float32) for v in inputs))
        assert rel_err(y.astype(mx.float32), want) < (1e-2 if y.dtype == mx.bfloat16 else 1e-5)
    forward = [k for k in impl._launches if "forward" in str(k[0])]
    assert len(forward) == 3  # fp32 at L 40, bf16 at L 40, fp32 at L 17
    impl.forget_shapes()
