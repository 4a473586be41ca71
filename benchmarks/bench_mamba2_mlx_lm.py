"""Mamba-2's SSD forward: our bundled ``mamba2`` spec on the ``mlx`` backend against mlx-lm's
chunked ``ssm_attn``, same inputs, same process (needs ``pip install mlx-lm``).

    python benchmarks/bench_mamba2_mlx_lm.py [--out results.md]

mlx-lm takes the raw ``dt`` and ``A_log`` and applies ``softplus(dt + dt_bias)`` clipped to
``time_step_limit`` and ``A = -exp(A_log)``; the spec takes the processed ``dt`` and ``A`` (that
processing is done once, outside the timing, and checked to give the same outputs). B and C are
given per group of heads (G groups), in both.
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


def timed(fn, reps=5):
    mx.eval(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main():
    from mlx_lm.models.ssm import ssm_attn
    import mlx_lm

    p = argparse.ArgumentParser()
    p.add_argument("--out", default=None)
    p.add_argument("--shapes", default="1,512,8,2,32,64;2,1024,8,2,32,64")
    args = p.parse_args()
    rec = rg.load_spec("mamba2")
    lines = ["# Mamba-2 SSD forward: mlx-recgen (`mlx` backend) vs mlx-lm's `ssm_attn`", "",
             f"machine: {platform.machine()} CPU, {mx.default_device()}; date "
             f"{datetime.date.today()}; mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}; fp32; "
             "median of 5 after a warm-up", "",
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
        dt = mx.clip(nn.softplus(dt_raw + dt_bias), *limit)
        A = -mx.exp(A_log)
        mx.eval(dt, A)

        def theirs():
            return ssm_attn(x, A_log, B, C, D, dt_raw, dt_bias, time_step_limit=limit)[0]

        want = theirs()
        t_theirs = timed(theirs)
        for schedule in ("sequential", "chunked", "matrix"):
            try:
                def ours(schedule=schedule):
                    return rec(x, dt, A, B, C, D, backend="mlx", schedule=schedule)
                got = ours()
            except ValueError as exc:  # a schedule this backend does not run
                lines.append(f"| {text} | {schedule} | not run: {exc} | | | |")
                continue
            err = (mx.linalg.norm((got - want).flatten()) / mx.linalg.norm(want.flatten())).item()
            t_ours = timed(ours)
            lines.append(f"| {text} | {schedule} | {t_ours * 1e3:.1f} ms | {t_theirs * 1e3:.1f} ms | "
                         f"{t_ours / t_theirs:.2f} | {err:.1e} |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
