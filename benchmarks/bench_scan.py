"""Fused kernels vs the MLX per-step loop vs the pure-MLX checkpointed backend.

    python benchmarks/bench_scan.py --backend cuda --out benchmarks/results/bench-cuda.md

For each bundled spec at a training shape: forward time, forward+backward time and peak memory
of forward+backward (``mx.get_peak_memory``), for
  * ``kernel``: the generated kernels (``--backend``),
  * ``loop``: ``rec.reference`` — the per-step MLX loop, differentiated by MLX autodiff, which
    keeps every state for the backward,
  * ``mlx``: the pure-MLX backend (checkpointed; the state chain step by step, the rest per
    segment).
Ratios are measured in one run on one device. The forward kernel's achieved bandwidth (bytes of
inputs, outputs and checkpoints over time) is put beside the device's measured copy bandwidth.
"""

import argparse
import datetime
import subprocess
import time

import mlx.core as mx

import mlx_recgen as rg

SHAPES = {
    "ssd": dict(B=3, L=512, H=12, P=64, N=16),
    "gla": dict(B=3, L=512, H=12, K=64, V=64),
    "rglru": dict(B=3, L=512, D=1536),
    "rotlru": dict(B=3, L=512, P=768),
}


def inputs_for(rec, sizes):
    """Random inputs in a stable range: decays in (0.5, 1), drives ~N(0, 1) scaled."""
    spec = rec.spec
    out = []
    for t in spec.inputs.values():
        shape = tuple(a if isinstance(a, int) else sizes[a] for a in t.axes)
        if t.name in ("A",):
            out.append(-mx.random.uniform(0.3, 1.5, shape))
        elif t.name in ("delta",):
            out.append(mx.random.uniform(0.01, 0.1, shape))
        elif t.name in ("g", "a"):
            out.append(mx.random.uniform(0.5, 0.99, shape))
        else:
            out.append(mx.random.normal(shape) * 0.25)
    return out


def timed(fn, reps=5):
    mx.eval(fn())
    mx.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    mx.synchronize()
    return (time.perf_counter() - t0) / reps


def peak(fn):
    mx.eval(fn())
    mx.synchronize()
    mx.clear_cache()
    mx.reset_peak_memory()
    mx.eval(fn())
    mx.synchronize()
    return mx.get_peak_memory()


def copy_bandwidth():
    x = mx.random.normal((1 << 28,))  # 1 GiB
    t = timed(lambda: x + 1.0, reps=10)
    return 2 * x.nbytes / t


def device_name():
    try:
        return subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return str(mx.default_device())


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default=rg.default_backend())
    p.add_argument("--out", default=None)
    p.add_argument("--specs", nargs="*", default=list(SHAPES))
    p.add_argument("--length", type=int, default=None, help="override L (a quick smoke run)")
    args = p.parse_args()
    mx.random.seed(0)
    bw_copy = copy_bandwidth()
    rows = []
    for name in args.specs:
        rec = rg.load_spec(name)
        sizes = dict(SHAPES[name], **({"L": args.length} if args.length else {}))
        xs = inputs_for(rec, sizes)
        n = len(xs)
        variants = {
            "kernel": lambda *a: rec(*a, backend=args.backend),
            "mlx": lambda *a: rec(*a, backend="mlx"),
            "loop": rec.reference,
        }
        result = {}
        for label, f in variants.items():
            grad = mx.grad(lambda *a, f=f: mx.sum(f(*a)), argnums=tuple(range(n)))
            result[label] = dict(fwd=timed(lambda f=f: f(*xs)),
                                 fwdbwd=timed(lambda grad=grad: grad(*xs)),
                                 peak=peak(lambda grad=grad: grad(*xs)))
        y = variants["kernel"](*xs)
        ckpt = 0  # bytes of checkpoints (one state per segment) and the final state
        for t in rec.spec.states.values():
            elems = 1
            for a in t.axes:
                elems *= a if isinstance(a, int) else sizes[a]
            ckpt += 4 * elems * (-(-sizes[rec.spec.time] // 32) + 1)
        moved = sum(x.nbytes for x in xs) + y.nbytes + ckpt
        rows.append((name, sizes, result, moved / result["kernel"]["fwd"]))

    lines = [f"# Scan benchmark: {args.backend} kernels vs MLX per-step loop vs pure-MLX backend",
             f"device: {device_name()}; date: {datetime.date.today()}; mlx {mx.__version__}; "
             f"seg=32; fp32; mean of 5 runs after a warm-up", "",
             f"measured copy bandwidth (MLX, 1 GiB x + 1): {bw_copy / 1e9:.0f} GB/s", "",
             "| spec | shape | fwd kernel | fwd loop | fwd speedup | fwd+bwd kernel | fwd+bwd loop "
             "| fwd+bwd mlx backend | fwd+bwd speedup vs loop | peak kernel | peak loop | peak mlx "
             "| memory vs loop | fwd kernel bandwidth |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, sizes, r, bw in rows:
        k, lo, ml = r["kernel"], r["loop"], r["mlx"]
        shape = " ".join(f"{a}={v}" for a, v in sizes.items())
        lines.append(
            f"| {name} | {shape} | {k['fwd'] * 1e3:.2f} ms | {lo['fwd'] * 1e3:.2f} ms "
            f"| {lo['fwd'] / k['fwd']:.1f}x | {k['fwdbwd'] * 1e3:.2f} ms | {lo['fwdbwd'] * 1e3:.2f} ms "
            f"| {ml['fwdbwd'] * 1e3:.2f} ms | {lo['fwdbwd'] / k['fwdbwd']:.1f}x "
            f"| {k['peak'] / 2**20:.0f} MiB | {lo['peak'] / 2**20:.0f} MiB | {ml['peak'] / 2**20:.0f} MiB "
            f"| {lo['peak'] / k['peak']:.1f}x less | {bw / 1e9:.0f} GB/s |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
