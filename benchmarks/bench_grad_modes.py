"""A bundled spec's forward and gradient on one backend and schedule, three ways in one process:
the forward alone, ``mx.grad`` as called (MLX differentiates eagerly: every elementwise step of
the backward its own kernel), and ``mx.compile(mx.grad(...))`` (a compiled training step: MLX
fuses those steps). ``--plain-broadcast`` spreads parameters with one ``mx.broadcast_to``
instead of ``layout.spread``, for a before/after of the staged parameter sums in separate
processes::

    python benchmarks/bench_grad_modes.py ssd --shape B=8 L=4096 H=16 P=64 N=64
    python benchmarks/bench_grad_modes.py ssd --shape B=8 L=4096 H=16 P=64 N=64 --plain-broadcast

The inputs are ``bench_peers.py``'s (``make_inputs``); the loss is the sum of the outputs
weighted by a random array. Times are medians of ``--reps`` evaluated calls, each waited for.
"""

from __future__ import annotations

import argparse
import statistics
import time


def main(args):
    import mlx.core as mx
    import numpy as np

    import mlx_recgen as rg
    import mlx_recgen.backends.mlx_matrix as mlx_matrix
    from bench_peers import make_inputs

    if args.plain_broadcast:
        mlx_matrix.spread = lambda x, shape: mx.broadcast_to(x, shape)
    label = "plain-broadcast" if args.plain_broadcast else "staged"
    shape = {k: int(v) for k, v in (s.split("=") for s in args.shape)}
    rec = rg.load_spec(args.spec)
    xs = [mx.array(x).astype(getattr(mx, args.dtype))
          for x in make_inputs(args.spec, shape, np.random.default_rng(0))]

    def call(*a):
        return rec(*a, backend=args.backend, schedule=args.schedule)

    w = mx.random.normal(call(*xs).shape)
    grad = mx.grad(lambda *a: mx.sum(call(*a) * w), argnums=tuple(range(len(xs))))
    compiled = mx.compile(grad)
    for mode, f in (("forward", lambda: call(*xs)), ("grad", lambda: grad(*xs)),
                    ("compiled grad", lambda: compiled(*xs))):
        for _ in range(3):
            mx.eval(f())
        mx.synchronize()
        mx.reset_peak_memory()
        times = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            mx.eval(f())
            mx.synchronize()
            times.append(time.perf_counter() - t0)
        print(f"{args.spec} {shape} {args.dtype} {label} {mode}: "
              f"{1e3 * statistics.median(times):.2f} ms (min {1e3 * min(times):.2f}), "
              f"peak {mx.get_peak_memory() / 1e9:.2f} GB", flush=True)


if __name__ == "__main__":
    from profile_calls import call_arguments

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    call_arguments(p, "ssd", ("B=8", "L=4096", "H=16", "P=64", "N=64"))
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--plain-broadcast", action="store_true")
    main(p.parse_args())
