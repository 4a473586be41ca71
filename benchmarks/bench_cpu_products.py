"""The matrix schedule's products on the CPU: MLX's batched matmul by operand layout, and the
matrix form's gradients by chunk length (``benchmarks/results/bench-matrix-cpu-products-*.md``).

    python benchmarks/bench_cpu_products.py

* Layouts: ``x @ y`` with both operands row-major, the left one transposed, the right one
  transposed, and the right one transposed but copied row-major first, in GFLOP/s, at a large
  size and at the chunk products' sizes. MLX's Linux CPU build multiplies through the reference
  BLAS it bundles, which runs the transposed-right case at about half the rate;
  ``matrix_chunks.product`` passes the right operand row-major for that reason.
* Chunks: gradients of every input of the matrix schedule (``backend="mlx"``) at chunks of 16,
  32 and 64, for scalar decays (GLA, gated DeltaNet) and a vector decay (HGRN2); ms, medians of
  5 after a warm-up. ``schedule.matrix_chunk`` picks the CPU's default chunk from these.
"""

from __future__ import annotations

import platform

import mlx.core as mx

import mlx_recgen as rg
from bench_models import median_time  # this script's folder is first on sys.path

LAYOUT_SHAPES = ((64, 256, 256, 256), (128, 64, 128, 64), (128, 64, 64, 128), (128, 64, 64, 64))
CHUNK_CASES = (
    ("gla", dict(B=2, L=1024, H=4, K=32, V=32)),
    ("gla", dict(B=2, L=512, H=8, K=64, V=64)),
    ("gated_deltanet", dict(B=2, L=512, H=4, K=64, V=64)),
    ("hgrn2", dict(B=2, L=512, H=4, K=32, V=32)),
)
GATES = ("g", "f", "beta")  # inputs drawn in (0.8, 0.99): decays and gates


def median_ms(fn, reps=5) -> float:
    return median_time(fn, reps) * 1e3


def layouts():
    print("| batch, M, K, N | both row-major | left transposed | right transposed | "
          "right transposed, copied first |")
    print("|---|---:|---:|---:|---:|")
    for batch, M, K, N in LAYOUT_SHAPES:
        x, y = mx.random.normal((batch, M, K)), mx.random.normal((batch, K, N))
        x_t = mx.swapaxes(mx.random.normal((batch, K, M)), -1, -2)
        y_t = mx.swapaxes(mx.random.normal((batch, N, K)), -1, -2)
        flops = 2 * batch * M * K * N
        rates = [flops / median_ms(f, 10) / 1e6 for f in (
            lambda: x @ y, lambda: x_t @ y, lambda: x @ y_t, lambda: x @ mx.contiguous(y_t))]
        print(f"| {batch}, {M}, {K}, {N} | " + " | ".join(f"{r:.1f}" for r in rates) + " |",
              flush=True)


def chunks():
    print("\n| case | chunk 16 | chunk 32 | chunk 64 |")
    print("|---|---:|---:|---:|")
    for name, sizes in CHUNK_CASES:
        rec = rg.load_spec(name)
        inputs = []
        for t in rec.spec.inputs.values():
            shape = tuple(sizes[a] for a in t.axes)
            inputs.append(mx.random.uniform(0.8, 0.99, shape) if t.name in GATES
                          else 0.2 * mx.random.normal(shape))
        row = []
        for seg in (16, 32, 64):
            grad = mx.grad(lambda *a, seg=seg: mx.sum(rec(*a, backend="mlx", schedule="matrix",
                                                          seg=seg)),
                           argnums=tuple(range(len(inputs))))
            row.append(median_ms(lambda: grad(*inputs)))
        label = f"{name} " + " ".join(f"{k}{v}" for k, v in sizes.items())
        print(f"| {label} | " + " | ".join(f"{t:.1f} ms" for t in row) + " |", flush=True)


def main():
    mx.random.seed(0)
    print(f"{platform.machine()}, {mx.default_device()}, mlx {mx.__version__}; GFLOP/s, then ms\n")
    layouts()
    chunks()


if __name__ == "__main__":
    main()
