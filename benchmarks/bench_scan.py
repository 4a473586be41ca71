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

A second table puts the kernel schedules side by side (``--schedules``, default ``chunked scan``;
each spec runs the ones that apply to it), with the bytes each pass moves against the floor:

    python benchmarks/bench_scan.py --backend cuda --specs rglru --shape B=8 L=4096 D=1024 \\
        --dtype bfloat16 --json rglru-b8.json --skip-first-table [--scan-seg 4 8 16] \\
        [--scan-threads 128 256]

* floor, forward: every input read once, every output written once, the initial and final
  states; backward: the inputs and output cotangents read once, every gradient written once,
  the final state's cotangent and the initial state's gradient.
* ``scan`` moves the floor plus its residual, one state per stretch (written forward, read
  backward; see docs/scan.md).
* ``chunked`` (seg chunks) reads the inputs twice per pass (summary, then outputs/gradients),
  writes and reads a local state and composed multiplier per chunk and state float, and a
  checkpoint (forward) or end adjoint (backward) per chunk.

Bandwidth columns divide the floor by the time (what the pass achieves as useful traffic) and
the modelled bytes by the time (what the memory system moved), beside the copy bandwidth.
"""

import argparse
import datetime
import json
import subprocess
import time

import mlx.core as mx

import mlx_recgen as rg

SHAPES = {
    "ssd": dict(B=3, L=512, H=12, P=64, N=16),
    "gla": dict(B=3, L=512, H=12, K=64, V=64),
    "rglru": dict(B=3, L=512, D=1536),
    "rotlru": dict(B=3, L=512, P=768),
    "mingru": dict(B=3, L=512, D=1536),
    "complex_lru": dict(B=3, L=512, D=1536),
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


def peak(fn, above=False):
    """Peak bytes of an evaluation of ``fn()`` after a warm-up; ``above``: less what was
    allocated before it (its outputs and temporaries alone)."""
    mx.eval(fn())
    mx.synchronize()
    mx.clear_cache()
    before = mx.get_active_memory() if above else 0
    mx.reset_peak_memory()
    mx.eval(fn())
    mx.synchronize()
    return mx.get_peak_memory() - before


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


def _elements(t, sizes):
    n = 1
    for a in t.axes:
        n *= a if isinstance(a, int) else sizes[a]
    return n


def _instances_lanes(spec, sizes):
    n = sizes[spec.lane]
    for b in spec.batch_axes:
        n *= sizes[b]
    return n


def pass_bytes(rec, sizes, xs, out_itemsize, schedule, seg, threads=None):
    """Modelled bytes of (forward, backward) for a kernel schedule, and the floor of each (see
    the module docstring). States, cotangents of states and residuals are fp32."""
    spec = rec.spec
    inputs = sum(x.nbytes for x in xs)
    outputs = sum(_elements(t, sizes) for t in spec.outputs.values()) * out_itemsize
    states = sum(4 * _elements(t, sizes) for t in spec.states.values())
    grads = inputs  # every gradient in its input's dtype
    floor = (inputs + outputs + 2 * states, inputs + outputs + grads + 2 * states)
    # the chunked kernels write gradients in fp32; an MLX cast to a narrower input dtype reads
    # and writes them once more (the scan writes them in the input's dtype)
    f32 = sum(4 * x.size for x in xs)
    cast = sum(4 * x.size + x.nbytes for x in xs if x.dtype != mx.float32)
    extra_bwd = f32 - grads + cast
    L = sizes[spec.time]
    state_floats = sum(t.components for t in spec.states.values())
    per_lane = 4 * _instances_lanes(spec, sizes) * state_floats
    if schedule == "scan":
        from mlx_recgen.schedule import make_scan_schedule, scan_map_floats

        stretch = make_scan_schedule(spec, sizes, seg, threads, max_threads=256,
                                     map_floats=scan_map_floats(rec.affine)).seg
        ckpt = per_lane * -(-L // stretch)
        return floor, (floor[0] + ckpt, floor[1] + ckpt)
    if schedule == "chunked":
        chunks = -(-L // seg)
        blocks = rec.affine.blocks
        summaries = 4 * _instances_lanes(spec, sizes) * chunks * (
            state_floats + sum(b.size * b.size for b in blocks))
        ckpt = per_lane * chunks
        # summary writes, carry reads them and writes checkpoints, the last pass reads those
        return floor, (floor[0] + inputs + 2 * summaries + 2 * ckpt,
                       floor[1] + inputs + 2 * summaries + 2 * ckpt + ckpt + extra_bwd)
    return floor, (None, None)


def schedule_rows(args, bw_copy):
    """The kernel schedules of ``--schedules`` side by side, with bytes per pass."""
    from mlx_recgen.schedule import choose

    rows = []
    dtype = getattr(mx, args.dtype)
    for name in args.specs:
        rec = rg.load_spec(name)
        sizes = dict(SHAPES[name], **parse_shape(args.shape))
        xs = [x.astype(dtype) for x in inputs_for(rec, sizes)]
        n = len(xs)
        configs = [(s, None, None) for s in args.schedules if s != "scan"]
        if "scan" in args.schedules:
            configs += [("scan", seg, threads) for seg in args.scan_seg or [None]
                        for threads in args.scan_threads or [None]]
        for schedule, seg, threads in configs:
            try:
                kind, seg = choose(rec, sizes, schedule, seg, args.backend)
            except ValueError:
                continue  # the schedule does not apply to this spec
            call = dict(backend=args.backend, schedule=schedule, seg=seg,
                        **({"threads": threads} if threads else {}))
            f = lambda *a, call=call: rec(*a, **call)  # noqa: E731
            grad = mx.grad(lambda *a, f=f: mx.sum(f(*a).astype(mx.float32)),
                           argnums=tuple(range(n)))
            fwd, fwdbwd = timed(lambda f=f: f(*xs)), timed(lambda grad=grad: grad(*xs))
            floor, moved = pass_bytes(rec, sizes, xs, dtype.size, kind, seg, threads)
            bwd = fwdbwd - fwd  # the backward pass: forward+backward less the forward
            rows.append(dict(spec=name, sizes=sizes, dtype=args.dtype, schedule=kind, seg=seg,
                             threads=threads,
                             fwd_ms=fwd * 1e3, fwdbwd_ms=fwdbwd * 1e3,
                             peak_mib=peak(lambda grad=grad: grad(*xs)) / 2**20,
                             floor_fwd_mb=floor[0] / 1e6, floor_bwd_mb=floor[1] / 1e6,
                             moved_fwd_mb=moved[0] and moved[0] / 1e6,
                             moved_bwd_mb=moved[1] and moved[1] / 1e6,
                             floor_fwd_tbs=floor[0] / fwd / 1e12,
                             floor_bwd_tbs=floor[1] / bwd / 1e12 if bwd > 0 else None,
                             copy_tbs=bw_copy / 1e12))
    return rows


def schedule_table(rows) -> list:
    lines = ["", "## Kernel schedules: time and bytes per pass against the floor", "",
             "| spec | shape | dtype | schedule | seg | threads | fwd | fwd+bwd | peak "
             "| fwd MB (floor) | bwd MB (floor) | fwd floor/time | bwd floor/time | copy |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]

    def mb(moved, floor):
        return f"{moved:.1f} ({floor:.1f})" if moved else f"? ({floor:.1f})"

    for r in rows:
        shape = " ".join(f"{a}={v}" for a, v in r["sizes"].items())
        bwd = f"{r['floor_bwd_tbs']:.2f} TB/s" if r["floor_bwd_tbs"] else "-"
        lines.append(f"| {r['spec']} | {shape} | {r['dtype']} | {r['schedule']} | {r['seg']} "
                     f"| {r['threads'] or 'auto'} "
                     f"| {r['fwd_ms']:.3f} ms | {r['fwdbwd_ms']:.3f} ms | {r['peak_mib']:.0f} MiB "
                     f"| {mb(r['moved_fwd_mb'], r['floor_fwd_mb'])} "
                     f"| {mb(r['moved_bwd_mb'], r['floor_bwd_mb'])} "
                     f"| {r['floor_fwd_tbs']:.2f} TB/s | {bwd} | {r['copy_tbs']:.2f} TB/s |")
    return lines


def parse_shape(items) -> dict:
    """``["B=8", "L=4096"]`` -> ``{"B": 8, "L": 4096}``."""
    return {k: int(v) for k, v in (item.split("=") for item in items or [])}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--backend", default=rg.default_backend())
    p.add_argument("--out", default=None)
    p.add_argument("--json", default=None, help="write the schedules table's rows as JSON")
    p.add_argument("--specs", nargs="*", default=["ssd", "gla", "rglru", "rotlru"])
    p.add_argument("--length", type=int, default=None, help="override L (a quick smoke run)")
    p.add_argument("--shape", nargs="*", default=None, help="override sizes: B=8 L=4096 D=1024")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="inputs of the schedules table")
    p.add_argument("--schedules", nargs="*", default=["chunked", "scan"],
                   help="kernel schedules compared in the second table (those that apply)")
    p.add_argument("--scan-seg", nargs="*", type=int, default=None,
                   help="steps per thread of the scan to sweep (default: chosen)")
    p.add_argument("--scan-threads", nargs="*", type=int, default=None,
                   help="threads per group of the scan to sweep (default: chosen)")
    p.add_argument("--skip-first-table", action="store_true",
                   help="only the schedules table")
    args = p.parse_args()
    if args.length:
        args.shape = [*(args.shape or []), f"L={args.length}"]
    mx.random.seed(0)
    bw_copy = copy_bandwidth()
    rows = []
    for name in [] if args.skip_first_table else args.specs:
        rec = rg.load_spec(name)
        sizes = dict(SHAPES[name], **parse_shape(args.shape))
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
    sched = schedule_rows(args, bw_copy) if args.schedules and args.backend != "mlx" else []
    if sched:
        lines += schedule_table(sched)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=device_name(), date=str(datetime.date.today()),
                           mlx=mx.__version__, rows=sched), f, indent=1)
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
