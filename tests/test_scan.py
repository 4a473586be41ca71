"""The scan schedule (``render/scan.py``, docs/scan.md) against loops written from each paper's
formula, for every bundled spec it serves (state-affine, no state axis): outputs, final states
and the gradient of every input and initial state (``mx.grad`` of a random weighting of them),
on the Metal simulator (marker ``sim``) and CUDA (marker ``gpu``).

Small threadgroups keep the simulator fast and still cover each part of the composition: runs
of ``seg`` steps per thread, time-threads inside a simdgroup (lane blocks of 8: four per
simdgroup) and across simdgroups (``threads=64``: two), stretches carried one to the next
(``L`` above ``threads / 8 * seg``, and not a multiple of it), a sequence shorter than one
stretch, and ``L = 1``."""

from __future__ import annotations

import shutil

import mlx.core as mx
import pytest

import mlx_recgen as rg
from conftest import KERNEL_BACKENDS, assert_nvcc_compiles, rel_err
from references import REFERENCES, ZOO_REFERENCES
import mlx_recgen.schedule as schedule_module
from mlx_recgen.backends.kernels import kernel_source
from mlx_recgen.function import Recurrence
from mlx_recgen.schedule import SCHEDULES, choose, make_scan_schedule, scan_misfit, scan_run

SCAN_SPECS = ["rglru", "rotlru", "mingru", "complex_lru"]
TOL = 1e-5
b = 2


def _draw(name, L, D=5):
    """Inputs (in the spec's order) and the initial state, of both signs."""
    n, u = mx.random.normal, mx.random.uniform
    if name == "rglru":
        a = u(0.5, 0.99, (b, L, D)) * mx.where(u(shape=(b, L, D)) < 0.5, -1.0, 1.0)
        return [a, n((b, L, D))], n((b, D))
    if name == "rotlru":
        theta = u(-3.0, 3.0, (b, L, D))
        return [u(0.5, 0.99, (b, L, D)), mx.cos(theta), mx.sin(theta), n((b, L, D, 2))], \
            n((b, D, 2))
    if name == "mingru":
        return [2.0 * n((b, L, D)), n((b, L, D))], n((b, D))
    if name == "complex_lru":
        return [n((b, L, D, 2)), 0.5 * n((D,)), 0.5 * n((D,))], n((b, D, 2))
    raise KeyError(name)


def _reference(name):
    ref = REFERENCES.get(name) or ZOO_REFERENCES[name]
    return lambda *args: ref(*args[:-1], args[-1])


def _compiled(name, backend, rec=None, **call):
    rec = rec or rg.load_spec(name)

    def run(*args):
        return rec(*args[:-1], initial_state=args[-1], return_state=True, backend=backend,
                   schedule="scan", **call)
    return run


def _values_and_grads(fn, args, weights):
    def loss(*a):
        y, h = fn(*a)
        return mx.sum(y * weights[0]) + mx.sum(h * weights[1])

    y, h = fn(*args)
    grads = mx.grad(loss, argnums=tuple(range(len(args))))(*args)
    mx.eval(y, h, grads)
    return [y, h, *grads]


def compare(name, backend, L, dtype=mx.float32, lanes=5, rec=None, **call):
    """Relative errors against the reference: output, final state, then the gradients of the
    inputs and of the initial state. With ``dtype``, the inputs are cast to it and the
    reference runs in float32 on the cast values; ``rec``: the recurrence to call (else the
    bundled spec's)."""
    mx.random.seed(sum(map(ord, name)) + L)
    inputs, h0 = _draw(name, L, lanes)
    inputs = [x.astype(dtype) for x in inputs]
    args = [*inputs, h0]
    y, h = _reference(name)(*[x.astype(mx.float32) for x in inputs], h0)
    weights = [mx.random.normal(y.shape), mx.random.normal(h.shape)]
    want = _values_and_grads(_reference(name), [x.astype(mx.float32) for x in args], weights)
    got = _values_and_grads(_compiled(name, backend, rec, **call), args, weights)
    labels = ["output", "final state", *rg.load_spec(name).spec.inputs, "initial state"]
    return {label: rel_err(g.astype(mx.float32), w) for label, g, w in zip(labels, got, want)}


# (L, seg = steps per thread, threads): with D = 5 lanes and 2 instances the lane block is 8
# lanes, so 64 threads are 8 time-threads in 2 simdgroups (a stretch of 8 * seg steps)
CASES = [
    (37, 2, 64),  # 3 stretches of 16, the last partial; shuffles and the threadgroup pass
    (11, 4, 64),  # shorter than one stretch (32): most runs past the end
    (1, 2, 64),  # one step
    (32, 1, 32),  # one step per thread, 4 time-threads in one simdgroup, stretches of 4
]


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("name", SCAN_SPECS)
@pytest.mark.parametrize("L, seg, threads", CASES)
def test_scan_matches_reference(backend, name, L, seg, threads):
    errors = compare(name, backend, L, seg=seg, threads=threads)
    bad = {k: v for k, v in errors.items() if not v < TOL}
    assert not bad, bad


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("name", ["rglru", "complex_lru"])
def test_scan_lane_blocks_and_simdgroups(backend, name):
    """20 lanes in blocks of 8 (three threadgroups per instance, the last one part padding);
    128 threads: 16 runs per stretch over 4 simdgroups."""
    errors = compare(name, backend, 70, lanes=20, seg=2, threads=128)
    bad = {k: v for k, v in errors.items() if not v < TOL}
    assert not bad, bad


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
@pytest.mark.parametrize("name", ["rglru", "rotlru"])
def test_scan_bfloat16_inputs(backend, name):
    """bf16 inputs read as floats, the state carried in fp32, outputs written as bf16: the
    output within bf16 rounding of the fp32 loop on the same (rounded) inputs."""
    errors = compare(name, backend, 37, dtype=mx.bfloat16, seg=2, threads=64)
    bad = {k: v for k, v in errors.items() if not v < 1e-2}
    assert not bad, bad


def test_scan_writes_gradients_in_the_input_dtype():
    """A gradient the kernel writes whole goes out in its input's dtype (no fp32 buffer and
    cast pass); one summed after the kernel (over time-threads and batch) stays fp32."""
    text = rg.load_spec("complex_lru").source("backward", backend="metal", schedule="scan",
                                              dtype=mx.bfloat16)
    assert "device bfloat16_t* u_d_bx " in text
    assert "device float* u_d_nu_log " in text


@pytest.mark.parametrize("backend", KERNEL_BACKENDS)
def test_scan_jvp(backend):
    """``mx.jvp`` runs the tangent recurrence (itself in the scan's class: a 2x2 block of the
    state and its tangent) under the scan schedule."""
    rec = rg.load_spec("rglru")
    mx.random.seed(3)
    (a, x), h0 = _draw("rglru", 37)
    ta, tx = mx.random.normal(a.shape), mx.random.normal(x.shape)

    def f(backend, **call):
        return lambda a, x: rec(a, x, initial_state=h0, backend=backend, **call)

    _, got = mx.jvp(f(backend, schedule="scan", seg=2, threads=64), [a, x], [ta, tx])
    _, want = mx.jvp(lambda a, x: REFERENCES["rglru"](a, x, h0)[0], [a, x], [ta, tx])
    assert rel_err(got[0], want[0]) < TOL


def test_scan_default_schedule_runs(backend="metal-sim"):
    """Without seg= and threads=: the chosen run and group size (256 threads, runs of
    ``scan_run`` steps)."""
    errors = compare("rglru", backend, 40)
    assert max(errors.values()) < TOL, errors


# -- choosing the schedule ----------------------------------------------------------------------


def test_auto_picks_the_scan_where_it_is_measured_faster():
    """``auto`` runs the scan where it would run the chunked schedule, on CUDA (measured) and
    without a ``seg`` of the caller's; Metal and the mlx backend keep their choice."""
    assert "scan" in SCHEDULES
    rec = rg.load_spec("rglru")
    long = {"B": 8, "L": 4096, "D": 1024}
    assert choose(rec, long, "auto", None, "cuda") == ("scan", scan_run(rec.spec))
    assert choose(rec, long, "auto", 64, "cuda")[0] == "chunked"
    assert choose(rec, {"B": 8, "L": 1, "D": 1024}, "auto", None, "cuda")[0] == "sequential"
    for backend in ("metal", "metal-sim", "mlx"):
        assert choose(rec, long, "auto", None, backend)[0] != "scan"
    gla = rg.load_spec("gla")  # a state axis: no scan, the chunked schedule as before
    assert choose(gla, {"B": 8, "L": 4096, "H": 16, "K": 64, "V": 64}, "auto", None,
                  "cuda")[0] != "scan"
    assert choose(rec, {"B": 8, "L": 4096, "D": 1024}, "scan", None, "cuda") == ("scan", 8)
    assert choose(rec, {"B": 1, "L": 3, "D": 8}, "scan", 8, "metal")[1] == 3


def test_scan_on_the_mlx_backend_runs_the_chunked_form():
    rec = rg.load_spec("rglru")
    assert choose(rec, {"B": 2, "L": 100, "D": 8}, "scan", None, "mlx")[0] == "chunked"
    errors = compare("rglru", "mlx", 19)
    assert max(errors.values()) < TOL, errors


@pytest.mark.parametrize("name, reason", [
    ("gla", "state axis"),  # a state of K x V per lane
    ("mamba1", "state axis"),  # per (channel, state element): see docs/scan.md
    ("deltanet", "low rank"),  # a delta rule: diagonal plus low rank
])
def test_scan_outside_its_class_raises(name, reason):
    rec = rg.load_spec(name)
    assert reason in scan_misfit(rec)
    sizes = {a: 4 for a in [*rec.spec.batch_axes, rec.spec.lane, rec.spec.time]}
    if rec.spec.state_axis:
        sizes[rec.spec.state_axis] = 4
    with pytest.raises(ValueError, match="schedule='scan' needs"):
        choose(rec, sizes, "scan", None, "cuda")


def test_scan_lane_blocks_narrow_for_few_instances():
    spec = rg.load_spec("rglru").spec
    assert make_scan_schedule(spec, {"B": 8, "L": 64, "D": 1024}, 16).lane_block == 32
    few = make_scan_schedule(spec, {"B": 4, "L": 64, "D": 1024}, 16)
    assert few.lane_block == 16 and few.groups_per_instance == 64
    assert few.seg == 256 // 16 * 16  # the stretch: time-threads x run
    fewer = make_scan_schedule(spec, {"B": 3, "L": 64, "D": 768}, 16)
    assert fewer.lane_block == 8 and fewer.groups_per_instance == 96


def test_scan_groups_halve_to_run_in_one_wave():
    """Groups of 256 threads halve where groups of 128 keep the call within
    ``SCAN_TARGET_THREADS``; where no size down to ``SCAN_MIN_THREADS`` does, they stay."""
    spec = rg.load_spec("rglru").spec
    assert make_scan_schedule(spec, {"B": 8, "L": 64, "D": 1024}, 8).threads == 256  # 2^16
    b3 = make_scan_schedule(spec, {"B": 3, "L": 64, "D": 768}, 8)  # 288 groups
    assert (b3.threads, b3.lane_block, b3.seg) == (128, 8, 128)
    assert make_scan_schedule(spec, {"B": 16, "L": 64, "D": 2048}, 8).threads == 256
    assert make_scan_schedule(spec, {"B": 3, "L": 64, "D": 768}, 8, threads=256).threads == 256


def test_scan_totals_fit_in_threadgroup_memory():
    """Two buffers of simdgroup totals, 2 x TG / 32 x map floats x LB: a 4x4 block's maps (20
    floats) in lane blocks of 32 halve the chosen 256 threads to 128 (40 KiB to 20 KiB); asked
    for, too many threads raise."""
    spec = rg.load_spec("rglru").spec
    sizes = {"B": 8, "L": 64, "D": 1024}
    assert make_scan_schedule(spec, sizes, 16, map_floats=2).threads == 256
    assert make_scan_schedule(spec, sizes, 16, map_floats=20).threads == 128
    with pytest.raises(ValueError, match="threadgroup memory"):
        make_scan_schedule(spec, sizes, 16, threads=256, map_floats=20)


# -- the look-back (CUDA) ---------------------------------------------------------------------
# On CUDA the forward takes a group per stretch where the lane blocks leave the GPU mostly idle
# (``Schedule.lookback``): every case above with several stretches runs it there. These run
# both forwards on purpose, on a recurrence of their own (its plans and schedules fresh).

CUDA = [p for p in KERNEL_BACKENDS if p.values[0] == "cuda"]


@pytest.fixture(params=["look-back", "one group"])
def cuda_walk(request, monkeypatch):
    """The CUDA forward with the look-back, and with one group walking all stretches (as on
    Metal), by the schedule's threshold."""
    if request.param == "one group":
        monkeypatch.setattr(schedule_module, "SCAN_LOOKBACK_THREADS", 0)
    return request.param


def _fresh(name):
    return Recurrence(rg.load_spec(name).spec)


def _walk_of(name, L, lanes=5, seg=None, threads=None):
    """Whether the CUDA forward of that call takes the look-back, and its stretches."""
    spec = rg.load_spec(name).spec
    sch = make_scan_schedule(spec, {"B": b, spec.time: L, spec.lane: lanes},
                             seg or scan_run(spec), threads, max_threads=256, lookback=True)
    return ("look-back" if sch.lookback else "one group"), -(-L // sch.seg)


# complex_lru over more steps: its error against the reference grows with L on CUDA in both
# walks alike (2e-4 at L = 300; 1e-7 on metal-sim), from the target's math, not the walk
LOOKBACK_CASES = [(name, *case) for name in SCAN_SPECS for case in [(37, 2, 64)]] + [
    (name, *case) for name in ["rglru", "rotlru", "mingru"] for case in [(300, 2, 64),
                                                                          (211, 1, 32)]]


@pytest.mark.parametrize("backend", CUDA)
@pytest.mark.parametrize("name, L, seg, threads", LOOKBACK_CASES)
def test_scan_lookback_matches_reference(backend, name, L, seg, threads, cuda_walk):
    """Several stretches, more than ``SCAN_WINDOW`` (a stretch then starts from the end state
    another group published WINDOW stretches before it), the last one partial."""
    walk, stretches = _walk_of(name, L, seg=seg, threads=threads)
    assert walk == cuda_walk and stretches > 1
    errors = compare(name, backend, L, rec=_fresh(name), seg=seg, threads=threads)
    bad = {k: v for k, v in errors.items() if not v < TOL}
    assert not bad, bad


@pytest.mark.parametrize("backend", CUDA)
@pytest.mark.parametrize("window", [2, 3])
def test_scan_lookback_short_windows(backend, window, monkeypatch):
    """Windows of 2 and 3 stretches over 38 stretches: long chains of published end states,
    each stretch applying one or two maps."""
    monkeypatch.setattr(schedule_module, "SCAN_WINDOW", window)
    assert _walk_of("rotlru", 300, seg=1, threads=64) == ("look-back", 38)
    errors = compare("rotlru", backend, 300, rec=_fresh("rotlru"), seg=1, threads=64)
    bad = {k: v for k, v in errors.items() if not v < TOL}
    assert not bad, bad


@pytest.mark.parametrize("backend", CUDA)
def test_scan_lookback_reruns_are_bit_identical(backend, monkeypatch):
    """Thousands of groups along time (RG-LRU B1 D256 L32768: 4096) finishing in whatever
    order: a stretch's entering state does not depend on which have finished, so reruns give
    the same bits; and they agree with one group walking all stretches."""
    mx.random.seed(5)
    B, L, D = 1, 32768, 256
    a = mx.random.uniform(0.5, 0.999, (B, L, D)) * mx.where(mx.random.uniform(shape=(B, L, D))
                                                              < 0.5, -1.0, 1.0)
    x, h0 = mx.random.normal((B, L, D)), mx.random.normal((B, D))
    spec = rg.load_spec("rglru").spec
    assert make_scan_schedule(spec, {"B": B, "L": L, "D": D}, scan_run(spec),
                              max_threads=256, lookback=True).lookback
    rec = _fresh("rglru")
    runs = [rec(a, x, initial_state=h0, return_state=True, backend=backend, schedule="scan")
            for _ in range(4)]
    mx.eval(runs)
    for y, h in runs[1:]:
        assert mx.array_equal(y, runs[0][0]) and mx.array_equal(h, runs[0][1])
    monkeypatch.setattr(schedule_module, "SCAN_LOOKBACK_THREADS", 0)
    y, h = _fresh("rglru")(a, x, initial_state=h0, return_state=True, backend=backend,
                           schedule="scan")
    assert rel_err(runs[0][0], y) < TOL and rel_err(runs[0][1], h) < TOL


def test_lookback_is_taken_where_the_target_has_it():
    """A group per stretch where the lane blocks' threads are few (B1 D256: 32 groups of
    256), there are several stretches, and the target has the look-back (CUDA, not Metal: no
    promise of progress to a group that waits on another); not at B3 D768 (288 groups of 128,
    where it measured slower); the windows are at least 2."""
    spec = rg.load_spec("rglru").spec
    b1 = {"B": 1, "L": 32768, "D": 256}
    assert make_scan_schedule(spec, b1, 8, lookback=True).lookback == schedule_module.SCAN_WINDOW
    assert make_scan_schedule(spec, b1, 8).lookback == 0
    assert make_scan_schedule(spec, {**b1, "L": 128}, 8, lookback=True).lookback == 0
    assert make_scan_schedule(spec, {"B": 3, "L": 2048, "D": 768}, 8, lookback=True).lookback == 0
    assert schedule_module.SCAN_WINDOW >= 2
    rec = rg.load_spec("rglru")
    # kernel_source: 4 instances, here of 64 lanes (32 groups)
    cuda = kernel_source(rec, "forward", "cuda", lanes=64, schedule="scan", length=32768)
    metal = kernel_source(rec, "forward", "metal", lanes=64, schedule="scan", length=32768)
    assert "recgen_publish(" in cuda and "scan_words" in cuda
    assert "scan_words" not in metal and "WINDOW" not in metal
    backward = kernel_source(rec, "backward", "cuda", lanes=64, schedule="scan", length=32768)
    assert "scan_words" not in backward


# -- CUDA text --------------------------------------------------------------------------------


@pytest.mark.skipif(shutil.which("nvcc") is None, reason="needs nvcc")
@pytest.mark.parametrize("kernel, length", [("forward", 128), ("forward", 4096),
                                            ("backward", 128)])
@pytest.mark.parametrize("dtype", [mx.float32, mx.bfloat16])
def test_scan_cuda_text_compiles(tmp_path, kernel, dtype, length):
    """The scan kernels' CUDA text compiles with nvcc (MLX's device header replaced by the
    standard and bf16 headers); at 4096 steps of 4 x 64 lanes the forward has the look-back."""
    sources = []
    for name in SCAN_SPECS:
        text = kernel_source(rg.load_spec(name), kernel, "cuda", dtype, lanes=64,
                             schedule="scan", length=length)
        assert ("scan_words" in text) == (length == 4096)
        text = text.replace('#include "mlx/backend/cuda/device/utils.cuh"',
                            "#include <cstdint>\n#include <cuda_bf16.h>")
        sources.append(tmp_path / f"{name}_{kernel}.cu")
        sources[-1].write_text(text)
    assert_nvcc_compiles(sources)
