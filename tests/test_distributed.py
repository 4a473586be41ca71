"""Sequence parallelism (``group=``): ranks launched with ``mlx.launch --backend ring`` on
localhost against one process over the whole sequence, plus in-process checks of the pieces.

``mlx.launch --backend ring -n N`` (hosts default to 127.0.0.1) gives rank ``r`` the address
``127.0.0.1:<starting port + r>`` in a JSON hostfile (``MLX_HOSTFILE``): each rank listens on
its own port and connects to the next rank's. The launcher's default starting port is fixed
(32323), so the test picks ``N`` consecutive ports that are free now, passes them with
``--starting-port`` and retries once with other ports if a rank cannot bind or connect. The
launcher exits 0 even when a rank fails, so success is read from the files each rank writes at
its end; the launcher runs in its own session, so a timeout kills it and every rank at once.
"""

from __future__ import annotations

import functools
import json
import os
import random
import signal
import socket
import subprocess
import sys

import mlx.core as mx
import numpy as np
import pytest

import distributed_worker as worker
import mlx_recgen as rg
import conftest
from conftest import rel_err
from test_chunked import NONFINITE, _assert_same, _nonfinite_case
from mlx_recgen import distributed
from mlx_recgen.backends import kernels
from mlx_recgen.distributed import chunk_products
from mlx_recgen.layout import to_canonical
from mlx_recgen.spec import Slot

HERE = os.path.dirname(os.path.abspath(__file__))
TOL = 2e-5
SMALLEST_NORMAL = float(np.finfo(np.float32).tiny)


def _launcher():
    near = os.path.join(os.path.dirname(sys.executable), "mlx.launch")
    if os.path.exists(near):
        return [near]
    return [sys.executable, "-c",
            "import sys; from mlx._distributed_utils.launch import main; "
            "sys.argv[0] = 'mlx.launch'; main()"]


def free_port_base(n: int) -> int:
    """A port ``p`` such that ``p, ..., p + n - 1`` on 127.0.0.1 can be bound now."""
    for _ in range(100):
        base = random.randint(20000, 60000 - n)
        sockets = []
        try:
            for port in range(base, base + n):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(s)
                s.bind(("127.0.0.1", port))
            return base
        except OSError:
            continue
        finally:
            for s in sockets:
                s.close()
    raise RuntimeError("no run of free ports found on 127.0.0.1")


def launch(n: int, cases: list, out_dir, timeout: float = 150.0) -> str:
    """Run the worker on ``n`` ring ranks over ``cases``; returns the launcher's output."""
    cases_path = os.path.join(out_dir, "cases.json")
    with open(cases_path, "w") as f:
        json.dump(cases, f)
    env = dict(os.environ, WORKER_TIMEOUT=str(int(timeout)))
    output = ""
    for attempt in range(2):
        for name in os.listdir(out_dir):
            if name.startswith("done-rank"):
                os.remove(os.path.join(out_dir, name))
        command = [*_launcher(), "--backend", "ring", "-n", str(n),
                   "--starting-port", str(free_port_base(n)), "--",
                   sys.executable, os.path.join(HERE, "distributed_worker.py"), cases_path,
                   str(out_dir)]
        # stdin: a pipe left open (the launcher forwards its stdin; /dev/null would keep its
        # select loop busy)
        proc = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            output = proc.communicate(timeout=timeout)[0].decode(errors="replace")
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            output = proc.communicate()[0].decode(errors="replace")
            pytest.fail(f"mlx.launch -n {n} timed out after {timeout} s:\n{output[-4000:]}")
        done = all(os.path.exists(os.path.join(out_dir, f"done-rank{r}")) for r in range(n))
        if done:
            return output
        if attempt == 0 and any(word in output for word in ("bind", "Address already in use",
                                                             "connect")):
            continue  # another process took a port meanwhile
        break
    pytest.fail(f"mlx.launch -n {n}: not every rank finished:\n{output[-4000:]}")


def compare(case, out_dir):
    """Every rank's outputs, final state and gradients against one process over the whole
    sequence: outputs and time-axis gradients concatenated over ranks, parameter and
    initial-state gradients summed over ranks, the final state on every rank."""
    rec = worker.SPECS[case["spec"]]
    spec = rec.spec
    n = len(case["chunks"])
    ranks = [np.load(os.path.join(out_dir, f"{case['name']}-rank{r}.npz")) for r in range(n)]
    ref_outs, ref_finals, ref_grads = worker.reference(case)
    what = f"{case['name']} over {case['chunks']}"
    if "infinite_gate" in case:  # NaN and infinities where the reference has them
        rel_err = functools.partial(_finite_rel_err, what=what)
    else:
        rel_err = conftest.rel_err
    for i, t in enumerate(spec.outputs.values()):
        got = np.concatenate([r[f"out{i}"] for r in ranks], axis=t.axes.index(spec.time))
        assert rel_err(got, ref_outs[i]) < TOL, f"{what}: output {t.name}"
    for i, t in enumerate(spec.states.values()):
        for r in range(n):
            assert rel_err(ranks[r][f"final{i}"], ref_finals[i]) < TOL, \
                f"{what}: final state {t.name} on rank {r}"
            np.testing.assert_array_equal(ranks[r][f"final{i}"], ranks[0][f"final{i}"])
    for i, t in enumerate([*spec.inputs.values(), *spec.states.values()]):
        parts = [r[f"grad{i}"] for r in ranks]
        if t.kind == "input" and t.has_time:
            got = np.concatenate(parts, axis=t.axes.index(spec.time))
        else:  # a parameter or an initial state: the ranks' contributions add up
            got = np.sum(parts, axis=0)
        label = f"initial state {t.name}" if t.kind == "state" else f"input {t.name}"
        assert rel_err(got, ref_grads[i]) < TOL, f"{what}: gradient of {label}"
    for i, t in enumerate(spec.states.values()):  # the initial state's gradient lives on rank 0
        for r in range(1, n):
            assert not np.any(ranks[r][f"grad{len(spec.inputs) + i}"])


def _finite_rel_err(a, b, what):
    """``rel_err`` of the finite values, after NaN and infinities are found where ``b`` has
    them."""
    a, b = np.asarray(a), np.asarray(b)
    _assert_same(a, b, what)
    finite = np.isfinite(b)
    if not np.any(b[finite]):  # nothing finite but zeros (a gradient with no cotangent)
        np.testing.assert_array_equal(a[finite], b[finite], err_msg=what)
        return 0.0
    return conftest.rel_err(a[finite], b[finite])


def check_errors(case, out_dir, n):
    messages = [open(os.path.join(out_dir, f"{case['name']}-rank{r}.txt")).read()
                for r in range(n)]
    if case["error"] == "sizes":
        for m in messages:
            assert m.startswith("ValueError") and "disagree" in m and "B=1" in m, messages
    else:
        assert messages[-1].startswith("TypeError") and "complex64" in messages[-1], messages
        for m in messages[:-1]:
            assert m.startswith("RuntimeError") and f"[{n - 1}]" in m, messages


# The sim cases use seg=4, shorter than every chunk, so that every rank (and the reference)
# compiles the same kernels: the reference, run first, fills the simulator's disk cache.
CASES_2 = [
    {"name": "decay", "spec": "decay", "backend": "mlx", "chunks": [5, 8], "seed": 1},
    {"name": "rot", "spec": "rot", "backend": "mlx", "chunks": [7, 4], "seed": 2},
    {"name": "delta", "spec": "delta", "backend": "mlx", "chunks": [5, 8], "seed": 3},
    {"name": "sizes", "spec": "delta", "backend": "mlx", "chunks": [3, 3], "seed": 4,
     "error": "sizes"},
    {"name": "dtype", "spec": "delta", "backend": "mlx", "chunks": [3, 3], "seed": 4,
     "error": "dtype"},
    {"name": "rot-sim", "spec": "rot", "backend": "metal-sim", "chunks": [5, 9], "seed": 5,
     "options": {"schedule": "chunked", "seg": 4}},
    {"name": "delta-sim", "spec": "delta", "backend": "metal-sim", "chunks": [6, 4], "seed": 6,
     "options": {"seg": 4}},
    # two states, per-element and per-lane multipliers, and a tree of segment summaries with
    # a level of 16 and leftovers (``_fold``)
    {"name": "decay-sim", "spec": "decay", "backend": "metal-sim", "chunks": [78, 45],
     "seed": 9, "options": {"schedule": "chunked", "seg": 4}},
    # auto: chunked kernels on the long chunk, the sequential kernel on the short one
    {"name": "gla-sim-mixed", "spec": "gla", "backend": "metal-sim", "chunks": [40, 5],
     "seed": 10, "options": {"seg": 4}},
    # a delta rule summarised by K x K chunk maps, on the sequential passes of each backend
    {"name": "gdelta", "spec": "gdelta", "backend": "mlx", "chunks": [70, 9], "seed": 11},
    {"name": "gdelta-sim", "spec": "gdelta", "backend": "metal-sim", "chunks": [6, 13],
     "seed": 12, "options": {"seg": 4}},
]
CASES_3 = [
    {"name": "decay", "spec": "decay", "backend": "mlx", "chunks": [4, 1, 6], "seed": 7},
    {"name": "delta", "spec": "delta", "backend": "mlx", "chunks": [3, 6, 2], "seed": 8},
    {"name": "gdelta", "spec": "gdelta", "backend": "mlx", "chunks": [5, 1, 8], "seed": 13},
    {"name": "sizes", "spec": "decay", "backend": "mlx", "chunks": [2, 2, 2], "seed": 4,
     "error": "sizes"},
    # an infinite gate on rank 1 with no cotangent after it on that rank: rank 0's end adjoint
    # is the fold's, whose local adjoint of rank 1 counted the zero hit: infinite where an
    # adjoint arrives from rank 2, NaN (inf * 0) where none does
    {"name": "gla-sim-hit", "spec": "gla", "backend": "metal-sim", "chunks": [4, 8, 4],
     "seed": 14, "options": {"schedule": "chunked", "seg": 4},
     "infinite_gate": {"input": "g", "step": 5, "quiet_to": 12}},
    {"name": "gla-sim-hit-none-later", "spec": "gla", "backend": "metal-sim",
     "chunks": [4, 8, 4], "seed": 14, "options": {"schedule": "chunked", "seg": 4},
     "infinite_gate": {"input": "g", "step": 5, "quiet_to": None}},
]


@pytest.mark.parametrize("n, cases", [(2, CASES_2), (3, CASES_3)], ids=["n2", "n3"])
def test_ring(n, cases, tmp_path):
    for case in cases:  # warms the simulator's cache before the ranks need it
        if case["backend"] == "metal-sim":
            worker.reference(case)
    launch(n, cases, tmp_path)
    for case in cases:
        if "error" in case:
            check_errors(case, tmp_path, n)
        else:
            compare(case, tmp_path)


# -- in process ----------------------------------------------------------------------------------

def _jvp_products(rec, inputs, sizes):
    """``P`` read off the tangent recurrence: one ``mx.jvp`` per block column, with tangent 1 on
    that column's slot of every element."""
    spec = rec.spec
    zeros = [mx.zeros(worker_shape(t, sizes)) for t in spec.states.values()]
    names = list(spec.states)
    out = {}
    width = max(b.size for b in rec.affine.blocks)
    for j in range(width):
        tangents = []
        for t in spec.states.values():
            comps = []
            for c in range(t.components):
                hot = any(b.size > j and b.slots[j] == Slot(t.name, c)
                          for b in rec.affine.blocks)
                comps.append(1.0 if hot else 0.0)
            shape = worker_shape(t, sizes)
            if t.components > 1:
                axis = next(i for i, a in enumerate(t.axes) if isinstance(a, int))
                mask = mx.array(comps).reshape([-1 if i == axis else 1 for i in range(len(shape))])
                tangents.append(mx.broadcast_to(mask, shape))
            else:
                tangents.append(mx.full(shape, comps[0]))

        def final(*init):
            _, h = rec(*inputs, initial_state=dict(zip(names, init)), return_state=True,
                       backend="mlx")
            return [h[k] for k in names] if isinstance(h, dict) else [h]

        _, d_final = mx.jvp(final, zeros, tangents)
        for b, block in enumerate(rec.affine.blocks):
            if block.size <= j:
                continue
            for i, slot in enumerate(block.slots):
                t = spec.states[slot.tensor]
                out[b, i, j] = to_canonical(spec, t, d_final[names.index(slot.tensor)])[
                    slot.component]
    return out


def worker_shape(t, sizes):
    """The declared shape of tensor ``t``."""
    return tuple(a if isinstance(a, int) else sizes[a] for a in t.axes)


@rg.recurrence(lane="P", state={"h": "B P N"}, inputs={"k": "B L N", "v": "B L P"},
               outputs={"y": "B L P"})
def normdecay(h, k, v, n):
    """A decay read from a state-free reduction over the state axis."""
    h[n] = rg.exp(-rg.Sum(k[n] * k[n], n)) * h[n] + v * k[n]
    return {"y": rg.Sum(h[n], n)}


@pytest.mark.parametrize("name", ["decay", "rot", "gla", "ssd", "rotlru", "normdecay"])
@pytest.mark.parametrize("block_floats", [1 << 24, 1])
def test_chunk_products_match_forward_mode(name, block_floats):
    """The composed multiplier from the per-step multipliers equals the Jacobian of the
    chunk's final state in its initial state (forward mode), in blocks of steps too."""
    rec = {"normdecay": normdecay, **worker.SPECS}.get(name) or rg.load_spec(name)
    assert rec.time_parallel
    spec = rec.spec
    rng = np.random.RandomState(0)
    sizes = dict(worker.SIZES, L=11, D=4)
    inputs = []
    for t in spec.inputs.values():
        x = rng.uniform(0.3, 0.9, worker_shape(t, sizes)).astype(np.float32)
        inputs.append(mx.array(x))
    got = chunk_products(rec, inputs, sizes, block_floats=block_floats)
    want = _jvp_products(rec, inputs, sizes)
    assert set(got) == set(want)
    for key, w in want.items():
        assert rel_err(np.broadcast_to(np.array(got[key]), w.shape), w) < 1e-5, (name, key)


def _draw(rec, sizes, rng):
    return [mx.array(rng.uniform(0.3, 0.9, worker_shape(t, sizes)).astype(np.float32))
            for t in rec.spec.inputs.values()]


def _normal(tensors, sizes, rng):
    return [mx.array(rng.standard_normal(worker_shape(t, sizes)).astype(np.float32))
            for t in tensors]


@pytest.mark.parametrize("arity", [16, 3])
@pytest.mark.parametrize("name", ["gla", "rot", "decay", "s4d"])
def test_segment_summaries_match_the_passes(name, arity, monkeypatch):
    """On the chunked kernel schedule a rank composes its kernels' per-segment summaries
    (``_Segments``) where elsewhere it runs the backend's passes twice (``_Passes``): the same
    products, local end state, outputs, residuals, local adjoint and gradients. 78 steps are 20
    segments of 4 (the last one partial): at arity 16 one group and 4 left over, at arity 3
    three levels, one with leftovers."""
    monkeypatch.setattr(distributed, "FOLD_ARITY", arity)
    rec = worker.SPECS.get(name) or rg.load_spec(name)
    spec = rec.spec
    sizes = dict(worker.SIZES, L=78, D=3)
    rng = np.random.RandomState(0)
    inputs = _draw(rec, sizes, rng)
    start = _normal(spec.states.values(), sizes, rng)
    d_out = _normal(spec.outputs.values(), sizes, rng)
    lam_end = _normal(spec.states.values(), sizes, rng)
    impl = rec._backend("metal-sim")
    options = {"schedule": "chunked"}
    assert distributed._Segments.applies(rec, impl, options)
    states = distributed._States(spec, sizes)
    args = (rec, impl, 4, sizes, mx.float32, options, states)
    ours, passes = distributed._Segments(*args), distributed._Passes(*args)
    layout = distributed._Products(rec, sizes)

    def close(a, b, what):  # relative per element: products span many orders of magnitude
        # (a product that underflows is kept at the smallest normal float, its sign from
        # whichever order of products reached it; a 2x2 block sums two such terms: values of
        # underflowed products agree within 4 smallest normals)
        b = np.array(b, dtype=np.float64)
        np.testing.assert_allclose(np.array(a, dtype=np.float64), b, rtol=2e-5,
                                   atol=max(1e-6 * np.abs(b).max(), 4 * SMALLEST_NORMAL),
                                   err_msg=f"{name}: {what}")

    products, local_end, memo = ours.summarise(inputs)
    want_products, want_end, _ = passes.summarise(inputs)
    close(layout.flat(products), layout.flat(want_products), "products")
    close(states.flat(local_end), states.flat(want_end), "local end state")
    outs, residuals = ours.forward(inputs, start, memo)
    want_outs, want_residuals = passes.forward(inputs, start, None)
    for a, b in zip([*outs, *residuals], [*want_outs, *want_residuals]):
        close(a, b, "outputs and residuals")
    lam_local, hits, memo = ours.local_adjoint(inputs, start, residuals, d_out)
    want_lam, want_hits, _ = passes.local_adjoint(inputs, start, residuals, d_out)
    close(states.flat(lam_local), states.flat(want_lam), "local adjoint")
    close(layout.hits.flat(hits), layout.hits.flat(want_hits), "zero hits (none: finite inputs)")
    grads, d_start = ours.backward(inputs, start, residuals, d_out, lam_end, memo)
    want_grads, want_d_start = passes.backward(inputs, start, residuals, d_out, lam_end, None)
    for a, b in zip([*grads, *d_start], [*want_grads, *want_d_start]):
        close(a, b, "gradients")


def _stand_in_kernels(kept):
    """A stand-in for ``mx.fast.cuda_kernel`` on the CPU: a kernel's outputs are slices of one
    fresh buffer that depends on every input (row-contiguous, as a kernel reads them), without
    the kernel's work; every kernel's inputs and outputs are appended to ``kept``. Holding them
    until the evaluation ends is what a GPU does when MLX encodes ahead of it (every buffer a
    kernel reads or writes lives until its command batch completes), so the peak is what a GPU
    would hold."""
    def factory(backend):
        def make(name, input_names, output_names, source, header="", **_):
            def kernel(*, inputs, output_shapes, output_dtypes, grid, threadgroup, **_):
                flat = [x.reshape(-1) for x in inputs]
                probe = sum(f[:1].astype(mx.float32).sum() for f in flat)
                sizes = [int(np.prod(s)) * d.size for s, d in zip(output_shapes, output_dtypes)]
                buffer = mx.zeros((sum(sizes),), dtype=mx.uint8) + probe.astype(mx.uint8)
                kept.append([*flat, buffer])
                outs, at = [], 0
                for shape, dtype, n in zip(output_shapes, output_dtypes, sizes):
                    outs.append(buffer[at:at + n].view(dtype).reshape(tuple(shape)))
                    at += n
                return outs
            return kernel
        return make
    return factory


def test_a_rank_of_two_holds_half_the_kernel_buffers_of_one_device(monkeypatch):
    """What a GPU holds for forward+backward on the chunked kernel schedule: one rank of two
    (a group of one over half the sequence runs the same per-rank work) about half of one
    device over the whole sequence. Running the backend's passes twice per rank (``_Passes``)
    held 0.82 of it here."""
    kept = []
    monkeypatch.setattr(kernels, "kernel_factory", _stand_in_kernels(kept))
    rec = rg.Recurrence(rg.load_spec("gla").spec)  # its own backends, built with the stand-in
    K, L = 16, 4096

    def peak(steps, group):
        mx.random.seed(0)
        q, k, v = (mx.random.normal((1, steps, 2, K)) for _ in range(3))
        g, h0 = mx.random.uniform(shape=(1, steps, 2)), mx.zeros((1, 2, K, K))

        def loss(*arrays):
            y, h = rec(*arrays[:4], initial_state=arrays[4], return_state=True, backend="cuda",
                       seg=16, group=group)
            return y.sum() + h.sum()

        step = mx.value_and_grad(loss, argnums=tuple(range(5)))
        mx.eval(q, k, v, g, h0, step(q, k, v, g, h0))  # kernels built
        kept.clear()
        mx.synchronize()
        base = mx.get_active_memory()
        mx.reset_peak_memory()
        mx.eval(step(q, k, v, g, h0))
        kept.clear()
        return mx.get_peak_memory() - base

    device = mx.default_device()
    mx.set_default_device(mx.cpu)
    try:
        one, rank = peak(L, None), peak(L // 2, mx.distributed.init())
    finally:
        mx.set_default_device(device)
    assert one > 0, "this MLX build reports no peak memory"
    assert rank < 0.6 * one, (f"one of two ranks {rank / 2**20:.2f} MiB, "
                              f"one device {one / 2**20:.2f} MiB")


def _single(rec, inputs, states, **options):
    n_in = len(rec.spec.inputs)

    def loss(*arrays):
        y, h = rec(*arrays[:n_in], initial_state=arrays[n_in], return_state=True, **options)
        y = y if isinstance(y, tuple) else (y,)
        return sum((mx.sin(mx.arange(v.size).reshape(v.shape)) * v).sum() for v in y) + \
            (h * h).sum()

    y, h = rec(*inputs, initial_state=states[0], return_state=True, **options)
    grads = mx.grad(loss, argnums=tuple(range(n_in + 1)))(*inputs, *states)
    return [y, h, *grads]


@pytest.mark.parametrize("name, backend", [("rot", "mlx"), ("delta", "mlx"),
                                           ("rot", "metal-sim"), ("gdelta", "mlx"),
                                           ("gdelta", "metal-sim")])
def test_group_of_one_is_the_plain_call(name, backend):
    rec = worker.SPECS[name]
    case = {"spec": name, "chunks": [9], "seed": 3}
    _, inputs, states, _, _ = worker.make_case(case)
    group = mx.distributed.init()
    assert group.size() == 1
    plain = _single(rec, inputs, states, backend=backend)
    split = _single(rec, inputs, states, backend=backend, group=group)
    for a, b in zip(split, plain):
        assert rel_err(a, b) < 1e-6


def test_auto_keeps_the_chunked_summaries_where_a_plain_call_would_scan(monkeypatch):
    """Where ``auto`` runs the scan (``schedule.SCAN_AUTO_BACKENDS``, CUDA), a call with
    ``group=`` plans the chunked schedule instead: its kernels' summaries serve the cross-rank
    composition, where the scan's passes would each run twice."""
    from mlx_recgen import schedule

    monkeypatch.setattr(schedule, "SCAN_AUTO_BACKENDS", ("metal-sim",))
    rec = rg.load_spec("rglru")
    a = mx.random.uniform(0.5, 0.9, (2, 200, 8))
    x = mx.random.normal((2, 200, 8))
    assert dict(rec.plan_for(rec.check(a, x), backend="metal-sim").options)["schedule"] == "scan"
    planned = []
    plan_for = rec.plan_for

    def spy(call, **options):
        plan = plan_for(call, **options)
        planned.append(dict(plan.options)["schedule"])
        return plan

    monkeypatch.setattr(rec, "plan_for", spy)
    y = rec(a, x, backend="metal-sim", group=mx.distributed.init())
    assert planned == ["scan", "chunked"]
    assert rel_err(y, rec.reference(a, x)) < TOL


@pytest.mark.parametrize("backend, schedule", [("mlx", "sequential"),
                                               pytest.param("metal-sim", "chunked",
                                                            marks=pytest.mark.sim)])
@pytest.mark.parametrize("name, case", NONFINITE, ids=[f"{n}-{c}" for n, c in NONFINITE])
def test_nonfinite_inputs_through_the_cross_rank_fold(name, case, backend, schedule):
    """The item-4 cases of ``tests/test_chunked.py`` with ``group=``: the final state comes from
    the fold ``P h0 + b`` over the ranks' summaries (``_Passes`` on mlx, the chunked kernels'
    ``_Segments`` on metal-sim), which composes with the chunked schedule's products and zero
    hits; outputs, final state and gradients are the sequential schedule's."""
    rec = rg.load_spec(name)
    inputs = _nonfinite_case(name, case)
    group = mx.distributed.init()

    def run(**options):
        return lambda *a: rec(*a, backend=backend, return_state=True, **options)

    split, plain = run(schedule=schedule, seg=4, group=group), run(schedule="sequential")
    for got, want, label in zip(split(*inputs), plain(*inputs), ("output", "final state")):
        _assert_same(got, want, label)
    if name == "rotlru":
        return  # gradients of 1e80 mixed by rotations: inf - inf in every schedule
    argnums = tuple(range(len(inputs)))
    grads = [mx.grad(lambda *a, f=f: mx.sum(f(*a)[0]), argnums=argnums)(*inputs)
             for f in (split, plain)]
    for label, a, b in zip(rec.spec.inputs, *grads):
        _assert_same(a, b, f"gradient of {label}")


def test_errors():
    rec = worker.SPECS["rot"]
    _, inputs, states, _, _ = worker.make_case({"spec": "rot", "chunks": [4], "seed": 0})
    with pytest.raises(TypeError, match="mx.distributed.Group"):
        rec(*inputs, group=0)
    group = mx.distributed.init()
    with pytest.raises(NotImplementedError, match="group="):
        mx.jvp(lambda x: rec(x, *inputs[1:], group=group, backend="mlx"), [inputs[0]],
               [inputs[0]])
    with pytest.raises(NotImplementedError, match="vmap"):
        mx.vmap(lambda *x: rec(*x, group=group, backend="mlx"))(*[mx.stack([x, x]) for x in inputs])
    second = mx.grad(lambda x: mx.grad(
        lambda y: rec(y, *inputs[1:], group=group, backend="mlx").sum())(x).sum())
    with pytest.raises(NotImplementedError, match="second derivative"):
        second(inputs[0])


def test_docs_show_the_example():
    with open(os.path.join(HERE, "..", "docs", "distributed.md")) as f:
        readme = f.read()
    with open(os.path.join(HERE, "..", "examples", "sequence_parallel.py")) as f:
        assert f.read() in readme
