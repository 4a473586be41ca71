"""A call's time by how it is driven, ours (the scan schedule) and accelerated-scan in one
process: RG-LRU forward and forward+backward (gradients of ``sum(y * w)``), µs per call; with
``--cases``, any of ``bench_peers.py``'s cases in the schedules named, ours alone.

* build: building 20 calls' graphs (Python only);
* queued: 20 calls built, then evaluated together (``bench_peers.py``'s method);
* prebuilt: the evaluation alone of 20 calls built beforehand (independent calls: the GPU may
  overlap them where one leaves it idle, so this understates one call there);
* async: each call handed to ``mx.async_eval`` as it is built, so Python builds the next while
  the GPU runs this one (as torch's launches overlap the GPU);
* alone: each call evaluated and waited for before the next is built;
* accelerated-scan: 20 calls launched, then one synchronisation (its native ``[B, D, T]``
  layout, transposed outside the timing);
* peak MB: the memory one call allocates beyond what was allocated before it (its outputs,
  gradients included, and its temporaries), ours (``bench_scan.peak``) and accelerated-scan's
  (``bench_peers.peak_torch``), each after a warm-up call.

    python benchmarks/bench_call_modes.py
    python benchmarks/bench_call_modes.py --set SCAN_LOOKBACK_THREADS=0  # no look-back
    python benchmarks/bench_call_modes.py --cases 4,6 --schedules sequential,matrix

Needs MLX's CUDA build on one NVIDIA GPU, and torch and accelerated-scan for the first form.
Medians of 7 batches.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx
import numpy as np

import mlx_recgen as rg
# this script's folder is first on sys.path
from bench_peers import CASES, gated_delta, make_inputs, peak_torch, run_pipelined, run_queued
from bench_scan import peak as peak_mlx

CALLS = 20
SHAPES = ((8, 4096, 1024), (3, 2048, 768))


def per_call(run, calls=CALLS, reps=7):
    """µs per call of ``run`` (which runs ``calls`` calls): the median of ``reps`` runs."""
    run()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        run()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) / calls * 1e6


def driven(call, calls=CALLS) -> dict:
    """µs per call of ``call`` (which builds one call's graph), by each way of driving it
    (module docstring): build, queued, prebuilt, async, alone."""
    for _ in range(3):
        mx.eval(call())
    mx.synchronize()

    def alone():
        for _ in range(calls):
            mx.eval(call())
            mx.synchronize()

    def prebuilt():
        graphs = [call() for _ in range(calls)]
        t0 = time.perf_counter()
        mx.eval(graphs)
        mx.synchronize()
        return (time.perf_counter() - t0) / calls * 1e6

    return {"build": per_call(lambda: [call() for _ in range(calls)], calls),
            "queued": per_call(lambda: run_queued(call, calls), calls),
            "prebuilt": statistics.median(prebuilt() for _ in range(7)),
            "async": per_call(lambda: run_pipelined(call, calls), calls),
            "alone": per_call(alone, calls)}


COLUMNS = ("build", "queued", "prebuilt", "async", "alone")


def cases(indices, schedules, dtypes=("float32", "bfloat16"), backend="cuda"):
    """The driven table of ``bench_peers.CASES[i]`` for each index, schedule and dtype: its
    inputs (``bench_peers.make_inputs``), forward and forward+backward."""
    print(f"mlx {mx.__version__}, {mx.default_device()}")
    print("| case | dtype | schedule | pass | " + " | ".join(COLUMNS) + " |")
    print("|---|---|---|---|" + "---|" * len(COLUMNS))
    for i in indices:
        name, shape, _ = CASES[i]
        rec = gated_delta if name == "gated_delta" else rg.load_spec(name)
        label = f"{name} " + " ".join(f"{k}{v}" for k, v in shape.items())
        for dtype in dtypes:
            xs = [mx.array(x).astype(getattr(mx, dtype))
                  for x in make_inputs(name, shape, np.random.default_rng(0))]
            for schedule in schedules:
                def call(schedule=schedule):
                    return rec(*xs, backend=backend, schedule=schedule)

                grad = mx.grad(lambda *a, schedule=schedule: mx.sum(
                    rec(*a, backend=backend, schedule=schedule)), argnums=tuple(range(len(xs))))
                for kind, fn in (("forward", call), ("forward+backward", lambda: grad(*xs))):
                    t = driven(fn)
                    print(f"| {label} | {dtype} | {schedule} | {kind} | "
                          + " | ".join(f"{t[k]:.0f}" for k in COLUMNS) + " |", flush=True)
                mx.clear_cache()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", help="indices into bench_peers.CASES (ours alone, no peer)")
    p.add_argument("--schedules", default="sequential", help="with --cases: comma-separated")
    p.add_argument("--dtypes", default="float32,bfloat16", help="with --cases")
    p.add_argument("--backend", default="cuda", help="with --cases")
    p.add_argument("--set", action="append", default=[], metavar="NAME=VALUE",
                   help="a schedule constant for this run (e.g. SCAN_LOOKBACK_THREADS=0: the "
                        "scan's forward without the look-back)")
    p.add_argument("--shapes", help="B,L,D;B,L,D... (default: %s)" % ";".join(
        ",".join(map(str, s)) for s in SHAPES))
    args = p.parse_args()
    import mlx_recgen.schedule as schedule

    for setting in args.set:
        name, value = setting.split("=")
        if not hasattr(schedule, name):
            raise SystemExit(f"schedule has no constant {name}")
        setattr(schedule, name, int(value))
    shapes = SHAPES if not args.shapes else [tuple(int(v) for v in s.split(","))
                                             for s in args.shapes.split(";")]
    if args.cases:
        cases([int(i) for i in args.cases.split(",")], args.schedules.split(","),
              args.dtypes.split(","), args.backend)
        return
    import torch
    from accelerated_scan.scalar import scan

    rec = rg.load_spec("rglru")
    print(f"{torch.cuda.get_device_name()}; mlx {mx.__version__}, torch {torch.__version__}")
    print("| shape | dtype | pass | build | queued | prebuilt | async | alone | accelerated-scan "
          "| peak MB, ours / accelerated-scan |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for B, L, D in shapes:
        for name in ("float32", "bfloat16"):
            rng = np.random.default_rng(0)
            sign = np.where(rng.uniform(size=(B, L, D)) < 0.5, -1, 1)
            arrays = [(rng.uniform(0.5, 0.99, (B, L, D)) * sign).astype(np.float32),
                      rng.standard_normal((B, L, D)).astype(np.float32),
                      rng.standard_normal((B, L, D)).astype(np.float32)]
            a, x, w = (mx.array(v).astype(getattr(mx, name)) for v in arrays)
            mx.eval(a, x, w)
            grad = mx.grad(lambda a, x: mx.sum(rec(a, x, backend="cuda", schedule="scan") * w),
                           argnums=(0, 1))
            ta, tx, tw = (torch.from_numpy(v).cuda().to(getattr(torch, name))
                          .transpose(1, 2).contiguous() for v in arrays)

            def peer_forward():
                for _ in range(CALLS):
                    scan(ta, tx)
                torch.cuda.synchronize()

            ga, gx = ta.clone().requires_grad_(), tx.clone().requires_grad_()

            def peer_backward():
                for _ in range(CALLS):
                    torch.autograd.grad((scan(ga, gx) * tw).sum(), (ga, gx))
                torch.cuda.synchronize()

            for label, call, peer, peer_once in (
                    ("forward", lambda: rec(a, x, backend="cuda", schedule="scan"), peer_forward,
                     lambda: scan(ta, tx)),
                    ("forward+backward", lambda: grad(a, x), peer_backward,
                     lambda: torch.autograd.grad((scan(ga, gx) * tw).sum(), (ga, gx)))):
                t = driven(call)
                print(f"| B{B} L{L} D{D} | {name} | {label} | " + " | ".join(
                    f"{t[k]:.0f}" for k in COLUMNS) +
                    f" | {per_call(peer):.0f} | {peak_mlx(call, above=True) / 1e6:.0f} / "
                    f"{peak_torch(peer_once, above=True) / 1e6:.0f} |", flush=True)


if __name__ == "__main__":
    main()
