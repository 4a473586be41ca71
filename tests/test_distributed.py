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
from conftest import rel_err
from mlx_recgen.distributed import chunk_products
from mlx_recgen.layout import to_canonical
from mlx_recgen.spec import Slot

HERE = os.path.dirname(os.path.abspath(__file__))
TOL = 2e-5


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
]
CASES_3 = [
    {"name": "decay", "spec": "decay", "backend": "mlx", "chunks": [4, 1, 6], "seed": 7},
    {"name": "delta", "spec": "delta", "backend": "mlx", "chunks": [3, 6, 2], "seed": 8},
    {"name": "sizes", "spec": "decay", "backend": "mlx", "chunks": [2, 2, 2], "seed": 4,
     "error": "sizes"},
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
                                           ("rot", "metal-sim")])
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


def test_readme_shows_the_example():
    with open(os.path.join(HERE, "..", "README.md")) as f:
        readme = f.read()
    with open(os.path.join(HERE, "..", "examples", "sequence_parallel.py")) as f:
        assert f.read() in readme
