"""The pure-MLX backend against the per-step loop, and the time to build a spec.

    python benchmarks/bench_mlx_backend.py --out benchmarks/results/bench-mlx-cpu.md

For each spec: forward and forward+backward (``mx.grad`` of a weighted sum of the outputs with
respect to every input) of
  * ``mlx``: the recurrence on the pure-MLX backend (``backend="mlx"``, seg=32),
  * ``loop``: ``rec.reference``, the plain per-step MLX loop differentiated by MLX autodiff,
and the ratio loop / mlx, measured in one process: the two alternate, and each time is the
median over repeats. Build times are those of ``rg.load_spec`` in a fresh process, with an
empty program cache and then with the cache the first process filled (import not included).
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

import mlx_recgen as rg  # noqa: E402

SPECS = {  # name -> (spec to load, shape)
    "rglru": ("rglru", dict(B=2, L=1024, D=256)),
    "ssd": ("ssd", dict(B=1, L=1024, H=4, P=32, N=16)),
    "gla": ("gla", dict(B=1, L=1024, H=4, K=32, V=32)),
    "gated_delta": (str(HERE / "specs" / "gated_delta.py"), dict(B=1, L=1024, H=4, K=32, V=32)),
    "mlstm": (str(HERE / "specs" / "mlstm.py"), dict(B=1, L=1024, H=4, K=32, V=32)),
    "clamp": (str(HERE / "specs" / "clamp.py"), dict(B=2, L=1024, D=256)),
    "rotlru": ("rotlru", dict(B=2, L=1024, P=128)),
}


def inputs_for(rec, sizes):
    """Random inputs in a stable range: decays in (0.5, 1), unit-norm keys for the delta rule,
    drives ~N(0, 1) scaled."""
    out = []
    for t in rec.spec.inputs.values():
        shape = tuple(a if isinstance(a, int) else sizes[a] for a in t.axes)
        name = t.name
        if name == "A" and rec.name == "ssd":
            x = -mx.random.uniform(0.3, 1.5, shape)
        elif name == "delta":
            x = mx.random.uniform(0.01, 0.1, shape)
        elif name in ("g", "a", "alpha"):
            x = mx.random.uniform(0.5, 0.99, shape)
        elif name == "beta":
            x = mx.random.uniform(0.1, 0.9, shape)
        elif name == "k" and rec.name == "gated_delta":
            x = mx.random.normal(shape)
            x = x / mx.linalg.norm(x, axis=-1, keepdims=True)
        elif name == "fpre":
            x = mx.random.normal(shape) + 3.0
        elif name in ("cos", "sin"):
            x = mx.random.uniform(-1, 1, shape)
        else:
            x = mx.random.normal(shape) * 0.25
        out.append(x)
    return out


CHUNKED_SEG = 64


def make_fns(rec, xs, chunked=True):
    """(forward, forward+backward) for the mlx backend (sequential form, and the chunked form
    for state-affine specs) and the loop."""
    n = len(xs)
    variants = {"mlx": lambda *a: rec(*a, backend="mlx", schedule="sequential")}
    if chunked and rec.affine.block_diagonal:
        variants["chunked"] = lambda *a: rec(*a, backend="mlx", schedule="chunked",
                                             seg=CHUNKED_SEG)
    variants["loop"] = rec.reference
    first = rec.reference(*xs)
    weights = [mx.random.normal(v.shape) for v in (first if isinstance(first, tuple) else (first,))]
    fns = {}
    for label, f in variants.items():
        def loss(*a, f=f):
            y = f(*a)
            ys = y if isinstance(y, tuple) else (y,)
            return sum(mx.sum(w * v) for w, v in zip(weights, ys))

        grad = mx.grad(loss, argnums=tuple(range(n)))
        fns[label] = (lambda f=f: f(*xs), lambda grad=grad: grad(*xs))
    return fns


def run_once(fn):
    mx.synchronize()
    t0 = time.perf_counter()
    mx.eval(fn())
    mx.synchronize()
    return time.perf_counter() - t0


def compare(fns, reps):
    """Median times, the variants alternating so that load on the machine hits both alike."""
    times = {(label, kind): [] for label in fns for kind in ("fwd", "fwdbwd")}
    for label, (fwd, fwdbwd) in fns.items():  # warm-up: compile and allocate
        run_once(fwd)
        run_once(fwdbwd)
    for _ in range(reps):
        for kind, i in (("fwd", 0), ("fwdbwd", 1)):
            for label in fns:
                times[(label, kind)].append(run_once(fns[label][i]))
    return {k: statistics.median(v) for k, v in times.items()}


BUILD = """
import sys, time
sys.path.insert(0, {root!r})
t0 = time.perf_counter()
import mlx_recgen as rg
t1 = time.perf_counter()
rg.load_spec({spec!r})
print(t1 - t0, time.perf_counter() - t1)
"""


def build_times(spec, reps=1):
    """(import, cold, warm) seconds: importing mlx_recgen, then building ``spec`` in a fresh
    process with an empty program cache, then again in a fresh process with the cache the first
    one filled."""
    imports, cold, warm = [], [], []
    for _ in range(reps):
        with tempfile.TemporaryDirectory() as d:
            env = dict(os.environ, MLX_RECGEN_CACHE=d)
            code = BUILD.format(root=str(ROOT), spec=spec)
            for out in (cold, warm):
                r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                                   text=True, check=True)
                t_import, t_build = map(float, r.stdout.strip().splitlines()[-1].split())
                imports.append(t_import)
                out.append(t_build)
    return statistics.median(imports), statistics.median(cold), statistics.median(warm)


def machine():
    cpu = platform.processor() or platform.machine()
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{os.cpu_count()}-core CPU ({cpu}), {platform.system()}"


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--specs", nargs="*", default=list(SPECS))
    p.add_argument("--length", type=int, default=None, help="override L")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--build-reps", type=int, default=1)
    p.add_argument("--no-build", action="store_true")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    mx.random.seed(0)
    rows, builds = [], []
    for name in args.specs:
        spec, shape = SPECS[name]
        sizes = dict(shape, **({"L": args.length} if args.length else {}))
        rec = rg.load_spec(spec)
        xs = inputs_for(rec, sizes)
        mx.eval(xs)
        t = compare(make_fns(rec, xs), args.reps)
        row = (name, sizes, t)
        rows.append(row)
        if ("chunked", "fwd") in t:
            print(f"{name:12s} chunked: fwd {t['chunked', 'fwd'] * 1e3:8.1f} ms "
                  f"fwd+bwd {t['chunked', 'fwdbwd'] * 1e3:8.1f} ms ({t['loop', 'fwdbwd'] / t['chunked', 'fwdbwd']:.2f}x "
                  f"the loop, {t['mlx', 'fwdbwd'] / t['chunked', 'fwdbwd']:.2f}x the sequential form)",
                  flush=True)
        print(f"{name:12s} fwd mlx {t['mlx', 'fwd'] * 1e3:8.1f} ms loop {t['loop', 'fwd'] * 1e3:8.1f} ms "
              f"({t['loop', 'fwd'] / t['mlx', 'fwd']:.2f}x)   fwd+bwd mlx {t['mlx', 'fwdbwd'] * 1e3:8.1f} ms "
              f"loop {t['loop', 'fwdbwd'] * 1e3:8.1f} ms ({t['loop', 'fwdbwd'] / t['mlx', 'fwdbwd']:.2f}x)",
              flush=True)
    if not args.no_build:
        for name in args.specs:
            imp, cold, warm = build_times(SPECS[name][0], args.build_reps)
            builds.append((name, imp, cold, warm))
            print(f"{name:12s} build: empty cache {cold:.3f} s, warm {warm:.3f} s "
                  f"(import {imp:.2f} s)", flush=True)

    lines = ["# Pure-MLX backend vs the per-step loop", "",
             f"machine: {machine()}; date: {datetime.date.today()}; mlx {mx.__version__}; "
             f"device {mx.default_device()}; fp32; seg=32; median of {args.reps} alternating runs "
             "after a warm-up; ratio = loop / mlx (higher is better). The machine is shared: "
             "absolute times are noisy, ratios are taken in one process.", "",
             "| spec | shape | fwd mlx | fwd loop | fwd ratio | fwd+bwd mlx | fwd+bwd loop "
             "| fwd+bwd ratio |", "|---|---|---|---|---|---|---|---|"]
    for name, sizes, t in rows:
        shape = " ".join(f"{a}={v}" for a, v in sizes.items())
        lines.append(f"| {name} | {shape} | {t['mlx', 'fwd'] * 1e3:.1f} ms | {t['loop', 'fwd'] * 1e3:.1f} ms "
                     f"| {t['loop', 'fwd'] / t['mlx', 'fwd']:.2f}x | {t['mlx', 'fwdbwd'] * 1e3:.1f} ms "
                     f"| {t['loop', 'fwdbwd'] * 1e3:.1f} ms | {t['loop', 'fwdbwd'] / t['mlx', 'fwdbwd']:.2f}x |")
    chunked_rows = [(n, sz, t) for n, sz, t in rows if ("chunked", "fwd") in t]
    if chunked_rows:
        lines += ["", f"The chunked form (`schedule=\"chunked\"`, seg={CHUNKED_SEG}) of the "
                  "state-affine specs, same runs; ratios = loop / chunked and sequential form / "
                  "chunked (higher is better).", "",
                  "| spec | shape | fwd chunked | fwd vs loop | fwd vs sequential | fwd+bwd chunked "
                  "| fwd+bwd vs loop | fwd+bwd vs sequential |", "|---|---|---|---|---|---|---|---|"]
        for name, sizes, t in chunked_rows:
            shape = " ".join(f"{a}={v}" for a, v in sizes.items())
            c, cb = t["chunked", "fwd"], t["chunked", "fwdbwd"]
            lines.append(f"| {name} | {shape} | {c * 1e3:.1f} ms | {t['loop', 'fwd'] / c:.2f}x "
                         f"| {t['mlx', 'fwd'] / c:.2f}x | {cb * 1e3:.1f} ms "
                         f"| {t['loop', 'fwdbwd'] / cb:.2f}x | {t['mlx', 'fwdbwd'] / cb:.2f}x |")
    if builds:
        lines += ["", f"Build time of `rg.load_spec` in a fresh process, median of "
                  f"{args.build_reps}: with an empty program cache, and with the cache the first "
                  "process filled; the import of mlx_recgen (sympy included) comes before and is "
                  "shown apart.", "",
                  "| spec | empty cache | warm cache | import |", "|---|---|---|---|"]
        lines += [f"| {n} | {c:.2f} s | {w:.2f} s | {i:.2f} s |" for n, i, c, w in builds]
    text = "\n".join(lines) + "\n"
    print()
    print(text)
    if args.out:
        Path(args.out).write_text(text)


if __name__ == "__main__":
    main()
