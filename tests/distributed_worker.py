"""One rank of a sequence-parallel check, run under ``mlx.launch`` by ``test_distributed.py``.

    mlx.launch --backend ring -n N -- python tests/distributed_worker.py CASES.json OUTDIR

Every rank draws the same full-length inputs (``make_case``), takes its chunk of the time axis,
runs the recurrence with ``group=`` and differentiates the loss ``case_loss`` with respect to
its chunk, the parameters and the initial state; it saves its outputs, final state and
gradients to ``OUTDIR/<case>-rank<r>.npz``, then ``OUTDIR/done-rank<r>``. The test compares
them with one process over the whole sequence (``reference``), which uses the same functions.
"""

from __future__ import annotations

import faulthandler
import json
import os
import sys

import mlx.core as mx
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

import mlx_recgen as rg  # noqa: E402


# -- specs: state-affine ones with parameters, blocks of one and two slots, and a delta rule ----

@rg.recurrence(lane="V", state={"S": "B H K V", "z": "B H V"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "dt": "B L H",
                       "A": "H K", "w": "H V"},
               outputs={"o": "B L H V"})
def decay(S, z, q, k, v, dt, A, w, i):
    """GLA-like with a per-element decay exp(-dt A) (a parameter shared over lanes) and a
    second, lane-scalar state."""
    S[i] = rg.exp(-dt * A[i]) * S[i] + k[i] * v
    z = w * z + v
    return {"o": rg.Sum(q[i] * S[i], i) + z}


@rg.recurrence(lane="P", state={"h": "B P 2"},
               inputs={"a": "B L P", "c": "B L P", "om": "P", "x": "B L P 2"},
               outputs={"y": "B L P"})
def rot(h, a, c, om, x):
    """A 2x2 block [[a, -om], [c, a]] with a per-channel parameter: its steps do not
    commute, so the order of every product shows."""
    u, w = h[0], h[1]
    h[0] = a * u - om * w + x[0]
    h[1] = c * u + a * w + x[1]
    return {"y": h[0] * h[1]}


@rg.recurrence(lane="P", state={"h": "B P N"},
               inputs={"q": "B L N", "k": "B L N", "v": "B L P", "beta": "B L", "d": "P"},
               outputs={"y": "B L P"})
def delta(h, q, k, v, beta, d, n):
    """A delta rule with a per-channel decay parameter (not state-affine)."""
    r = rg.Sum(k[n] * h[n], n)
    h[n] = rg.sigmoid(d) * h[n] + rg.sigmoid(beta) * (v - r) * k[n]
    return {"y": rg.Sum(q[n] * h[n], n)}


@rg.recurrence(lane="V", state={"S": "B H K V"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "g": "B L H",
                       "beta": "B L H"},
               outputs={"o": "B L H V"})
def gdelta(S, q, k, v, g, beta, i):
    """A gated delta rule (a decay per head): its multiplier diagonal plus rank one, summarised
    per rank by the matrix form's K x K chunk maps."""
    r = rg.Sum(k[i] * S[i], i)
    S[i] = g * S[i] + 2 * beta * (v - g * r) * k[i]
    return {"o": rg.Sum(q[i] * S[i], i)}


SPECS = {"decay": decay, "rot": rot, "delta": delta, "gla": rg.load_spec("gla"),
         "gdelta": gdelta}
SIZES = {"B": 2, "H": 2, "K": 3, "V": 4, "P": 3, "N": 4}


def make_case(case):
    """The full-length inputs, initial state and loss weights of a case (the same on every
    rank): ``(rec, inputs, initial states, output weights, per-rank final-state weights)``."""
    rec = SPECS[case["spec"]]
    spec = rec.spec
    rng = np.random.RandomState(case["seed"])
    sizes = dict(SIZES, L=sum(case["chunks"]))

    def draw(t, kind):
        shape = tuple(a if isinstance(a, int) else sizes[a] for a in t.axes)
        x = rng.standard_normal(shape).astype(np.float32)
        if kind == "gate":
            x = 1.0 / (1.0 + np.exp(-x))
        elif kind == "positive":
            x = np.abs(x) * 0.5 + 0.1
        else:
            x = x * 0.5
        return mx.array(x)

    kinds = {"dt": "positive", "A": "positive", "a": "gate", "g": "gate", "w": "gate",
             "c": "gate", "om": "gate", "beta": "gate"}
    gate = case.get("infinite_gate")
    if gate:  # every value positive (no inf - inf), then one infinite gate
        kinds = dict.fromkeys([*spec.inputs, *spec.states, *spec.outputs], "positive")
        kinds[gate["input"]] = "gate"
    inputs = [draw(t, kinds.get(n)) for n, t in spec.inputs.items()]
    states = [draw(t, kinds.get(n)) for n, t in spec.states.items()]
    weights = [draw(t, kinds.get(n)) for n, t in spec.outputs.items()]
    final_weights = [[draw(t, kinds.get(n)) for n, t in spec.states.items()]
                     for _ in case["chunks"]]
    if gate:  # no cotangent from the gate's step up to gate["quiet_to"] (None: the end)
        step, quiet_to = gate["step"], gate["quiet_to"]
        if quiet_to is None:
            final_weights = [[w * 0 for w in ws] for ws in final_weights]
        g = list(spec.inputs).index(gate["input"])
        inputs[g][:, step] = float("inf")
        for w, t in zip(weights, spec.outputs.values()):
            w[(slice(None),) * t.axes.index(spec.time) + (slice(step, quiet_to),)] = 0.0
    return rec, inputs, states, weights, final_weights


def chunk(rec, x, t, start, stop):
    """The slice [start, stop) of input ``x`` of tensor ``t`` along the time axis."""
    if not t.has_time:
        return x
    axis = t.axes.index(rec.spec.time)
    return x[(slice(None),) * axis + (slice(start, stop),)]


def case_loss(rec, weights, final_weights, outs, finals):
    outs = outs if isinstance(outs, tuple) else (outs,)
    finals = list(finals.values()) if isinstance(finals, dict) else [finals]
    total = sum(((w * y.astype(mx.float32)).sum() for w, y in zip(weights, outs)),
                start=mx.array(0.0))
    return total + sum(((w * h).sum() for w, h in zip(final_weights, finals)), start=mx.array(0.0))


def run(rec, inputs, states, weights, final_weights, **options):
    """Outputs, final states and gradients (every input, then every initial state)."""
    spec = rec.spec
    n_in = len(spec.inputs)

    def loss(*arrays):
        init = arrays[n_in:]
        init = init[0] if len(init) == 1 else dict(zip(spec.states, init))
        outs, finals = rec(*arrays[:n_in], initial_state=init, return_state=True, **options)
        return case_loss(rec, weights, final_weights, outs, finals)

    outs, finals = rec(*inputs, initial_state=states[0] if len(states) == 1 else
                       dict(zip(spec.states, states)), return_state=True, **options)
    grads = mx.grad(loss, argnums=tuple(range(n_in + len(states))))(*inputs, *states)
    outs = list(outs) if isinstance(outs, tuple) else [outs]
    finals = list(finals.values()) if isinstance(finals, dict) else [finals]
    mx.eval(outs, finals, grads)
    return outs, finals, list(grads)


def reference(case):
    """One process over the whole sequence, with the sum over ranks of the ranks' losses."""
    rec, inputs, states, weights, final_weights = make_case(case)
    summed = [sum(ws[i] for ws in final_weights) for i in range(len(states))]
    return run(rec, inputs, states, weights, summed, backend=case["backend"],
               **case.get("options", {}))


def main(cases_path, out_dir):
    faulthandler.dump_traceback_later(float(os.environ.get("WORKER_TIMEOUT", "120")), exit=True)
    group = mx.distributed.init(strict=True, backend=os.environ.get("WORKER_BACKEND", "ring"))
    rank = group.rank()
    with open(cases_path) as f:
        cases = json.load(f)
    for case in cases:
        assert len(case["chunks"]) == group.size(), (case, group.size())
        rec, inputs, states, weights, final_weights = make_case(case)
        start = sum(case["chunks"][:rank])
        stop = start + case["chunks"][rank]
        spec = rec.spec
        mine = [chunk(rec, x, t, start, stop) for x, t in zip(inputs, spec.inputs.values())]
        my_weights = [chunk(rec, w, t, start, stop) for w, t in zip(weights, spec.outputs.values())]
        if "error" in case:  # a bad call on the last rank: every rank must raise, none hang
            if rank == group.size() - 1:
                if case["error"] == "sizes":  # one fewer instance along B
                    mine = [x[:1] if "B" in t.axes else x for x, t in zip(mine, spec.inputs.values())]
                else:  # "dtype"
                    mine[0] = mine[0].astype(mx.complex64)
            try:
                rec(*mine, group=group, backend=case["backend"])
                message = "no error"
            except Exception as exc:  # noqa: BLE001 - recorded for the test
                message = f"{type(exc).__name__}: {exc}"
            with open(os.path.join(out_dir, f"{case['name']}-rank{rank}.txt"), "w") as f:
                f.write(message)
            continue
        outs, finals, grads = run(rec, mine, states, my_weights, final_weights[rank], group=group,
                                  backend=case["backend"], **case.get("options", {}))
        arrays = {f"out{i}": np.array(x) for i, x in enumerate(outs)}
        arrays.update({f"final{i}": np.array(x) for i, x in enumerate(finals)})
        arrays.update({f"grad{i}": np.array(x) for i, x in enumerate(grads)})
        np.savez(os.path.join(out_dir, f"{case['name']}-rank{rank}.npz"), **arrays)
    open(os.path.join(out_dir, f"done-rank{rank}"), "w").close()


if __name__ == "__main__":
    main(*sys.argv[1:3])
