"""What counting the local adjoint's zero hits costs: the chunked and scan backwards with
``Recurrence.local_adjoint`` as derived (``scale(M, w)`` and a count of zero hits) against the
plain ``λ`` statements, in one process on a kernel backend.

    python benchmarks/bench_adjoint_hits.py --backend cuda

GLA B8 H16 L4096 K=V=64 (chunked) and RG-LRU B8 D1024 L4096 (scan and chunked), fp32, forward
+ backward (gradients of ``sum(y * w)``): the best of two alternating rounds, each the median of
5 batches of 10 calls.
"""

from __future__ import annotations

import argparse
import statistics
import time

import mlx.core as mx

import mlx_recgen as rg
from mlx_recgen.affine import LocalAdjoint
from mlx_recgen.ir import prune


def variant(name: str, hits: bool) -> rg.Recurrence:
    """A fresh recurrence of a bundled spec; without ``hits``, its local adjoint is the plain
    ``λ`` statements (what the backwards ran before they counted zero hits)."""
    rec = rg.Recurrence(rg.load_spec(name).spec)
    if not hits:
        plain = prune(rec.adjoint.program, lambda store: store.kind == "lambda")
        rec.__dict__["local_adjoint"] = LocalAdjoint(plain, False)
    return rec


def timed(fn, reps=10) -> float:
    mx.eval(fn())
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        mx.eval([fn() for _ in range(reps)])
        mx.synchronize()
        times.append((time.perf_counter() - t0) / reps * 1e3)
    return statistics.median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--backend", default="cuda")
    args = p.parse_args()
    B, L, H, K, V = 8, 4096, 16, 64, 64
    q = mx.random.normal((B, L, H, K)) * K ** -0.5
    k = mx.random.normal((B, L, H, K)) * K ** -0.5
    v, g = mx.random.normal((B, L, H, V)), mx.random.uniform(0.9, 1.0, (B, L, H))
    a, x = mx.random.uniform(0.5, 0.99, (8, 4096, 1024)), mx.random.normal((8, 4096, 1024))
    mx.eval(q, k, v, g, a, x)
    print(f"{mx.default_device()}, backend {args.backend}, fp32, fwd+bwd in ms\n")
    print("| case | with zero hits | without | ratio |\n|---|---|---|---|")
    for name, arrays, schedule in [("gla", (q, k, v, g), "chunked"), ("rglru", (a, x), "scan"),
                                   ("rglru", (a, x), "chunked")]:
        best = {}
        for hits in (True, False, True, False):
            rec = variant(name, hits)
            w = mx.random.normal(rec(*arrays, backend=args.backend, schedule=schedule).shape)
            grad = mx.grad(lambda *z, rec=rec, w=w: mx.sum(
                rec(*z, backend=args.backend, schedule=schedule) * w),
                argnums=tuple(range(len(arrays))))
            t = timed(lambda: grad(*arrays))
            best[hits] = min(best.get(hits, t), t)
        print(f"| {name} {schedule} | {best[True]:.3f} | {best[False]:.3f} | "
              f"{best[True] / best[False]:.3f} |")


if __name__ == "__main__":
    main()
