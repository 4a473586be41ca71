"""Mamba-2's SSD forward (or forward+backward): our bundled ``mamba2`` spec on the ``mlx``
backend against mlx-lm's chunked ``ssm_attn``, same inputs, same process, alternating (needs
``pip install mlx-lm``; ``PYTHONPATH=.`` from a checkout measures that checkout).

    python benchmarks/bench_mamba2_mlx_lm.py [--out results.md] [--backward]
        [--shapes 2,256,8,1,64,128] [--schedules matrix]

mlx-lm takes the raw ``dt`` and ``A_log`` and applies ``softplus(dt + dt_bias)`` clipped to
``time_step_limit`` and ``A = -exp(A_log)``; the spec takes the processed ``dt`` and ``A``. Ours
processes ``dt`` the same way inside the timed call (so ``--backward`` differentiates the same
function of the raw ``dt`` in both); ``A`` is processed once, outside the timing. The outputs
(or gradients) are checked against mlx-lm's. B and C are given per group of heads (G groups),
in both. ``--backward`` times the gradients of ``x``, the raw ``dt``, ``B`` and ``C`` of the
output's sum.
"""

from __future__ import annotations

import argparse
import datetime
import platform
import statistics
import time

import mlx.core as mx
import mlx.nn as nn

import mlx_recgen as rg


def timed(fns, reps=5):
    """The median time of each of ``fns``, called in turn ``reps`` times after a warm-up."""
    for fn in fns:
        mx.eval(fn())
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, t in zip(fns, times):
            t0 = time.perf_counter()
            mx.eval(fn())
            t.append(time.perf_counter() - t0)
    return [statistics.median(t) for t in times]


def main():
    from mlx_lm.models.ssm import ssm_attn
    import mlx_lm

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--shapes", default="1,512,8,2,32,64;2,1024,8,2,32,64")
    p.add_argument("--schedules", default="sequential,chunked,matrix")
    p.add_argument("--backward", action="store_true", help="time forward+backward")
    args = p.parse_args()
    rec = rg.load_spec("mamba2")
    what = "forward+backward" if args.backward else "forward"
    lines = [f"# Mamba-2 SSD {what}: mlx-recgen (`mlx` backend) vs mlx-lm's `ssm_attn`", "",
             f"machine: {platform.machine()} CPU, {mx.default_device()}; date "
             f"{datetime.date.today()}; mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}; fp32; "
             "median of 5 after a warm-up, ours and mlx-lm's alternating", "",
             "| shape (B, L, H, G, P, N) | schedule | ours | mlx-lm ssm_attn | ours / mlx-lm | rel. error |",
             "|---|---|---|---|---|---|"]
    mx.random.seed(0)
    for text in args.shapes.split(";"):
        b, L, H, G, P, N = map(int, text.split(","))
        x = mx.random.normal((b, L, H, P))
        dt_raw = mx.random.normal((b, L, H))
        dt_bias = mx.random.normal((H,)) * 0.5
        A_log = mx.random.uniform(-1.0, 1.0, (H,))
        B = mx.random.normal((b, L, G, N)) * N ** -0.5
        C = mx.random.normal((b, L, G, N)) * N ** -0.5
        D = mx.random.normal((H,))
        limit = (0.001, 100.0)
        A = -mx.exp(A_log)
        mx.eval(A)

        def theirs_of(x, dt_raw, B, C):
            return ssm_attn(x, A_log, B, C, D, dt_raw, dt_bias, time_step_limit=limit)[0]

        def ours_of(schedule):
            def call(x, dt_raw, B, C):
                dt = mx.clip(nn.softplus(dt_raw + dt_bias), *limit)
                return rec(x, dt, A, B, C, D, backend="mlx", schedule=schedule)
            return call

        def timed_call(f):
            if not args.backward:
                return lambda: f(x, dt_raw, B, C)
            grad = mx.grad(lambda *a: f(*a).sum(), argnums=(0, 1, 2, 3))
            return lambda: mx.concatenate([g.flatten() for g in grad(x, dt_raw, B, C)])

        theirs = timed_call(theirs_of)
        want = theirs()
        for schedule in args.schedules.split(","):
            try:
                ours = timed_call(ours_of(schedule))
                got = ours()
            except ValueError as exc:  # a schedule this backend does not run
                lines.append(f"| {text} | {schedule} | not run: {exc} | | | |")
                continue
            err = (mx.linalg.norm((got - want).flatten()) / mx.linalg.norm(want.flatten())).item()
            t_ours, t_theirs = timed([ours, theirs])
            lines.append(f"| {text} | {schedule} | {t_ours * 1e3:.1f} ms | {t_theirs * 1e3:.1f} ms | "
                         f"{t_ours / t_theirs:.2f} | {err:.1e} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
