"""A call's time by how it is driven, ours (the scan schedule) and accelerated-scan in one
process: RG-LRU forward and forward+backward (gradients of ``sum(y * w)``), µs per call.

* build: building 20 calls' graphs (Python only);
* queued: 20 calls built, then evaluated together (``bench_peers.py``'s method);
* prebuilt: the evaluation alone of 20 calls built beforehand;
* async: each call handed to ``mx.async_eval`` as it is built, so Python builds the next while
  the GPU runs this one (as torch's launches overlap the GPU);
* alone: each call evaluated and waited for before the next is built;
* accelerated-scan: 20 calls launched, then one synchronisation (its native ``[B, D, T]``
  layout, transposed outside the timing).

    python benchmarks/bench_call_modes.py

Needs MLX's CUDA build, torch and accelerated-scan on one NVIDIA GPU. Medians of 7 batches.
"""

from __future__ import annotations

import statistics
import time

import mlx.core as mx
import numpy as np

import mlx_recgen as rg
from bench_peers import run_pipelined, run_queued  # this script's folder is first on sys.path

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


def main():
    import torch
    from accelerated_scan.scalar import scan

    rec = rg.load_spec("rglru")
    print(f"{torch.cuda.get_device_name()}; mlx {mx.__version__}, torch {torch.__version__}")
    print("| shape | dtype | pass | build | queued | prebuilt | async | alone | accelerated-scan |")
    print("|---|---|---|---|---|---|---|---|---|")
    for B, L, D in SHAPES:
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

            for label, call, peer in (
                    ("forward", lambda: rec(a, x, backend="cuda", schedule="scan"), peer_forward),
                    ("forward+backward", lambda: grad(a, x), peer_backward)):
                t = driven(call)
                print(f"| B{B} L{L} D{D} | {name} | {label} | " + " | ".join(
                    f"{t[k]:.0f}" for k in ("build", "queued", "prebuilt", "async", "alone")) +
                    f" | {per_call(peer):.0f} |", flush=True)


if __name__ == "__main__":
    main()
