"""The matrix schedule's two ways through MLX on a kernel backend, in one process: the direct
path (``CallPlan.direct``, the default: plain MLX ops around the kernels' core, whose VJP MLX
takes from the forward's graph) and the full path (the recurrence's custom function, whose VJP
traces and computes the forward again). One training step's ``value_and_grad`` of
``sum(y * w)`` over every input, ms per step:

* build: building the step's graph (Python), 10 steps;
* queued: 10 steps built, then evaluated together (``bench_peers.py``'s method);
* async: each step handed to ``mx.async_eval`` as it is built (Python overlaps the GPU);
* compiled: the step under ``mx.compile`` (traced once);
* peak: MLX's peak memory of one step, GB.

    python benchmarks/bench_matrix_paths.py --spec gla --backend cuda

``--spec`` names a bundled spec or ``bench_peers.py``'s ``gated_delta``.

The two paths alternate (direct, full, direct, full); the table takes each one's best run, and
the largest relative difference between their values and gradients.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np

import mlx_recgen as rg
import mlx_recgen.function as F
from bench_call_modes import driven  # this script's folder is first on sys.path
from bench_peers import gated_delta, make_inputs

STEPS = 10
_plan = F.Recurrence._make_plan


def _full_path(self, call, backend, seg, schedule):
    """A plan without its direct path: the call runs the custom function."""
    plan = _plan(self, call, backend, seg, schedule)
    return F.CallPlan(plan.recurrence, plan.backend, plan.schedule, plan.seg, plan.sizes,
                      plan.out_dtype, plan.options, plan.decode, None)


def measure(spec, shape, dtype, backend, path):
    F.Recurrence._make_plan = _plan if path == "direct" else _full_path
    try:
        declared = gated_delta if spec == "gated_delta" else rg.load_spec(spec)
        rec = rg.Recurrence(declared.spec)  # fresh: no plan kept from the other path
        xs = [mx.array(x).astype(dtype) for x in make_inputs(spec, shape, np.random.default_rng(0))]

        def call(*a):
            return rec(*a, backend=backend, schedule="matrix")

        w = mx.random.normal(call(*xs).shape, key=mx.random.key(1)).astype(dtype)
        step_fn = mx.value_and_grad(lambda *a: mx.sum(call(*a) * w), argnums=tuple(range(len(xs))))

        def step():
            return step_fn(*xs)

        modes = driven(step, STEPS)  # µs per step
        out = {k: modes[v] / 1e3 for k, v in (("build", "build"), ("queued", "queued"),
                                               ("async_", "async"))}
        out["compiled"] = float("nan")  # the simulator runs no kernel under mx.compile
        if backend != "metal-sim":
            compiled = mx.compile(step_fn)
            out["compiled"] = driven(lambda: compiled(*xs), STEPS)["queued"] / 1e3
        mx.reset_peak_memory()
        value, grads = step()
        mx.eval(value, grads)
        mx.synchronize()
        out["peak"] = mx.get_peak_memory() / 1e9
        return out, [np.array(t.astype(mx.float32)) for t in (value, *grads)]
    finally:
        F.Recurrence._make_plan = _plan


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--spec", default="gla")
    p.add_argument("--backend", default="cuda")
    p.add_argument("--shapes", nargs="+", default=["B=3,L=2048,H=12,K=64,V=64",
                                                   "B=8,L=4096,H=16,K=64,V=64"])
    p.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = p.parse_args()
    print("| shape | dtype | path | build | queued | async | compiled | peak GB |")
    print("|---|---|---|---|---|---|---|---|")
    for text in args.shapes:
        shape = {k: int(v) for k, v in (s.split("=") for s in text.split(","))}
        for name in args.dtypes:
            runs, values = {}, {}
            for path in ("direct", "full", "direct", "full"):
                r, values[path] = measure(args.spec, shape, getattr(mx, name), args.backend, path)
                runs.setdefault(path, []).append(r)
            diff = max(float(np.max(np.abs(a - b)) / (np.max(np.abs(a)) + 1e-30))
                       for a, b in zip(values["full"], values["direct"]))
            for path in ("full", "direct"):
                best = {k: min(r[k] for r in runs[path]) for k in runs[path][0]}
                print(f"| {text} | {name} | {path} | " + " | ".join(
                    f"{best[k]:.3f}" for k in ("build", "queued", "async_", "compiled")) +
                    f" | {best['peak']:.2f} |")
            print(f"| | | largest relative difference, values and gradients | {diff:.1e} | | | | |")


if __name__ == "__main__":
    main()
