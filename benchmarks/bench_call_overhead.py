"""What a call costs beside its ops: per-call overhead, the decode step, resident growth.

    python benchmarks/bench_call_overhead.py --out benchmarks/results/call-overhead-cpu.md

* Overhead: a call's Python time (building the lazy graph, ``mx.eval`` excluded) beside the
  time of its ops (``mx.eval`` of the built graph), in microseconds, for short and long calls
  of RG-LRU and gated DeltaNet on the requested backends.
* Decode step: gated DeltaNet, B1 H16 K=V=128, one step with ``initial_state`` and
  ``return_state``, against the same step written in MLX ops (its state fed back, as a
  decoder does); the ratio of the medians. Then the same step in mlx-lm's layout against
  mlx-lm's ``gated_delta_ops`` and MLX's ``mx.fast.gated_delta_update``.
* Resident growth: RG-LRU forward (B2 D64) at 200 distinct sequence lengths after 20 others:
  resident set size before and after, with MLX's buffer cache on (its default) and off
  (``mx.set_cache_limit(0)``: only what the compiler keeps), and the size of MLX's cache.
* Kernel compiles (``--sim``): 20 distinct prompt lengths below 32 on the Metal simulator,
  and how many kernels compiled after the first.
* mlx-lm decoding (``--mlx-lm``): tiny random Qwen3-Next and Mamba-2 models, tokens/s patched
  and unpatched in alternating rounds, and the median of the rounds' ratios (``--runs``
  measurements of 15 rounds each: their median and range). Then one ``gated_delta_update``
  call at the tiny Qwen3-Next's head counts, routed and mlx-lm's own, its state fed back.

Each time is the median over repeats; the alternatives alternate in one process.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import importlib.metadata
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))

import mlx_recgen as rg  # noqa: E402


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f
                        if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def _version(package) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def _resident_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 1e6


def _split_times(call, repeats):
    """Medians (build µs, eval µs, total µs) of ``call()`` (it returns what to evaluate)."""
    builds, evals = [], []
    for _ in range(5):
        mx.eval(call())
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = call()
        t1 = time.perf_counter()
        mx.eval(out)
        t2 = time.perf_counter()
        builds.append(t1 - t0)
        evals.append(t2 - t1)
    totals = [b + e for b, e in zip(builds, evals)]
    return tuple(statistics.median(x) * 1e6 for x in (builds, evals, totals))


def overhead(backends, repeats):
    rows = []
    cases = [("rglru", dict(B=2, D=256), (1, 1024)),
             ("gated_deltanet", dict(B=1, H=16, K=128, V=128), (1, 64))]
    for name, sizes, lengths in cases:
        rec = rg.load_spec(name)
        for L in lengths:
            full = dict(sizes, L=L)
            inputs = [mx.random.uniform(-0.5, 0.5, tuple(full[a] for a in t.axes))
                      for t in rec.spec.inputs.values()]
            for backend in backends:
                b, e, _ = _split_times(lambda: rec(*inputs, backend=backend), repeats)
                plan = rec.plan(*inputs, backend=backend)
                path = "decode" if plan.decode is not None else plan.schedule
                rows.append((name, L, backend, path, b, e))
    return rows


def gated_deltanet_step_ops(q, k, v, g, beta, S):
    """One gated DeltaNet step in MLX ops: q, k [B, 1, H, K], v [B, 1, H, V], g, beta
    [B, 1, H], S [B, H, K, V] -> (o [B, 1, H, V], S)."""
    a = mx.exp(g)[:, 0, :, None, None]
    kk = k[:, 0, :, :, None]
    decayed = a * S
    r = mx.sum(kk * decayed, axis=2, keepdims=True)  # k^T S
    S = decayed + beta[:, 0, :, None, None] * (v[:, 0, :, None, :] - r) * kk
    return mx.sum(q[:, 0, :, :, None] * S, axis=2)[:, None], S


def _time_steps(steps: dict, S0, repeats):
    """Per step function (``S -> (y, S)``): the best of 3 rounds of the median Python and total
    time (µs) of a step fed its own state, after 10 warm-up steps; the functions alternate."""
    times = {name: [] for name in steps}
    for _ in range(3):
        for name, f in steps.items():
            S = S0
            for _ in range(10):
                y, S = f(S)
                mx.eval(y, S)
            builds, totals = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                y, S = f(S)
                t1 = time.perf_counter()
                mx.eval(y, S)
                t2 = time.perf_counter()
                builds.append(t1 - t0)
                totals.append(t2 - t0)
            times[name].append((statistics.median(builds) * 1e6, statistics.median(totals) * 1e6))
    return {n: min(t, key=lambda x: x[1]) for n, t in times.items()}


def decode_step(repeats):
    rec = rg.load_spec("gated_deltanet")
    B, H, K, V = 1, 16, 128, 128
    q = mx.random.normal((B, 1, H, K))
    k = mx.random.normal((B, 1, H, K)) / K ** 0.5
    v = mx.random.normal((B, 1, H, V))
    g, beta = -mx.random.uniform(shape=(B, 1, H)), mx.random.uniform(shape=(B, 1, H))
    S0 = mx.random.normal((B, H, K, V))
    mx.eval(q, k, v, g, beta, S0)

    def ours(S):
        return rec(q, k, v, g, beta, initial_state=S, return_state=True, backend="mlx")

    def ops(S):
        return gated_deltanet_step_ops(q, k, v, g, beta, S)

    y1, S1 = ours(S0)
    y2, S2 = ops(S0)
    error = (mx.max(mx.abs(y1 - y2)) / mx.max(mx.abs(y2))).item()
    return _time_steps({"recgen": ours, "ops": ops}, S0, repeats), error


def mlx_lm_decode_step(repeats):
    """The same step in mlx-lm's layout (state ``[B, Hv, Dv, Dk]``, 8 key heads for 16 value
    heads, the decay itself): mlx-lm's ``gated_delta_update``'s recurrence as mlx-recgen runs it
    under ``patch(backend="mlx")``, mlx-lm's ``gated_delta_ops`` and MLX's own
    ``mx.fast.gated_delta_update`` (where this MLX has it). None without mlx-lm."""
    try:
        from mlx_lm.models.gated_delta import gated_delta_ops
    except ImportError:
        return None
    from mlx_recgen.integrations.mlx_lm import gated_delta

    rec = gated_delta(vector_gate=False, masked=False)
    B, Hk, Hv, K, V = 1, 8, 16, 128, 128
    q = mx.random.normal((B, 1, Hk, K))
    k = mx.random.normal((B, 1, Hk, K)) / K ** 0.5
    v = mx.random.normal((B, 1, Hv, V))
    g, beta = mx.random.uniform(0.8, 1.0, (B, 1, Hv)), mx.random.uniform(shape=(B, 1, Hv))
    S0 = mx.random.normal((B, Hv, V, K))
    mx.eval(q, k, v, g, beta, S0)
    steps = {"recgen": lambda S: rec(q, k, v, g, beta, initial_state=S, return_state=True,
                                     backend="mlx"),
             "mlx-lm ops": lambda S: gated_delta_ops(q, k, v, g, beta, S)}
    if hasattr(mx.fast, "gated_delta_update"):
        steps["mx.fast.gated_delta_update"] = \
            lambda S: mx.fast.gated_delta_update(q, k, v, g, beta, S)
    want = steps["mlx-lm ops"](S0)
    errors = {}
    for name, f in steps.items():
        got = f(S0)
        errors[name] = max((mx.max(mx.abs(a - b)) / mx.max(mx.abs(b))).item()
                           for a, b in zip(got, want))
    return _time_steps(steps, S0, repeats), errors


def growth_in_this_process(cache: str, lengths=200):
    """(RSS growth MB, MLX cache MB) over ``lengths`` distinct lengths after 20 others."""
    if cache == "off":
        mx.set_cache_limit(0)
    rec = rg.load_spec("rglru")

    def run(L):
        a, x = mx.random.uniform(-1, 1, (2, L, 64)), mx.random.normal((2, L, 64))
        mx.eval(rec(a, x, backend="mlx"))

    for L in range(1000, 1020):
        run(L)
    gc.collect()
    before = _resident_mb()
    for L in range(1, lengths + 1):
        run(L)
    gc.collect()
    return _resident_mb() - before, mx.get_cache_memory() / 1e6


def growth():
    """``growth_in_this_process`` in a fresh process per setting of MLX's buffer cache (memory
    freed by an earlier measurement would be reused by the next)."""
    import subprocess

    out = {}
    for cache in ("on", "off"):
        text = subprocess.run([sys.executable, __file__, "--growth", cache], check=True,
                              capture_output=True, text=True).stdout
        out[cache] = tuple(float(v) for v in text.split())
    return out


def sim_compiles():
    from mlx_recgen.sim import compiler

    rec = rg.load_spec("gated_deltanet")
    lengths = [3, 1, 2, 4, 5, 6, 7, 9, 10, 12, 13, 15, 17, 19, 21, 24, 26, 28, 30, 31]
    counts = []
    for L in lengths:
        sizes = dict(B=1, L=L, H=8, K=16, V=16)  # inputs of >= 8 elements (see test_decode)
        inputs = [mx.random.uniform(-0.5, 0.5, tuple(sizes[a] for a in t.axes))
                  for t in rec.spec.inputs.values()]
        mx.eval(rec(*inputs, backend="metal-sim"))
        counts.append(len(compiler._libs))
    return len(lengths), counts[-1] - counts[0]


MLX_LM_MODELS = {"qwen3_next": "Qwen3-Next", "mamba2": "Mamba-2"}


def mlx_lm_decode(model_type, tokens, rounds=15):
    """Tokens/s of mlx-lm's ``generate_step`` on a tiny random model of the test suite,
    unpatched and patched in alternating rounds (after one of each to warm up): the median
    rates and the median of the rounds' patched / unpatched time per token."""
    sys.path.insert(0, str(ROOT / "tests"))
    from mlx_lm.generate import generate_step
    from test_mlx_lm_integration import build

    from mlx_recgen.integrations.mlx_lm import patch

    model = build(model_type)
    prompt = mx.array([3, 1, 4, 1, 5, 9, 2, 6])

    def rate():
        t0 = time.perf_counter()
        n = sum(1 for _ in generate_step(prompt, model, max_tokens=tokens))
        return n / (time.perf_counter() - t0)

    rates = {"unpatched": [], "patched": []}
    for r in range(rounds + 1):
        unpatched = rate()
        with patch(backend="mlx"):
            patched = rate()
        if r:
            rates["unpatched"].append(unpatched)
            rates["patched"].append(patched)
    ratios = [u / p for u, p in zip(rates["unpatched"], rates["patched"])]
    return {**{k: statistics.median(v) for k, v in rates.items()},
            "ratio": statistics.median(ratios)}


def mlx_lm_routed_call(repeats, K):
    """One ``gated_delta_update`` call at the tiny Qwen3-Next's head counts (B1, 2 key and 4 value
    heads, Dk = Dv = ``K``), its state fed back, with its inputs made as the model makes them
    (q and k normalized from a split, a and b slices): mlx-lm's own and routed by
    ``patch(backend="mlx")``, timed by ``_time_steps``; and the largest difference of their
    outputs over the steps."""
    from mlx_lm.models import gated_delta as gd

    from mlx_recgen.integrations.mlx_lm import patch

    Hk, Hv = 2, 4
    conv = mx.random.normal((1, 1, 2 * Hk * K + Hv * K))
    q, k, v = [t.reshape(1, 1, h, K) for t, h in zip(
        mx.split(conv, [Hk * K, 2 * Hk * K], -1), (Hk, Hk, Hv))]
    q, k = gd.normalize_qk(q, k, inv_scale=K ** -0.5, eps=1e-6)
    ba = mx.random.normal((1, 1, 2 * Hv))
    b, a = ba[..., :Hv], ba[..., Hv:]
    A_log, dt_bias = mx.random.normal((Hv,)), mx.ones(Hv)
    S0 = 0.1 * mx.random.normal((1, Hv, K, K))
    mx.eval(q, k, v, a, b, A_log, dt_bias, S0)
    with patch(backend="mlx"):
        routed = gd.gated_delta_update
        steps = {"mlx-lm's own": lambda S: routed.__wrapped__(q, k, v, a, b, A_log, dt_bias, S,
                                                             None, use_kernel=True),
                 "routed": lambda S: routed(q, k, v, a, b, A_log, dt_bias, S, None,
                                            use_kernel=True)}
        S_own = S_routed = S0
        difference = 0.0
        for _ in range(20):
            (y_own, S_own), (y_routed, S_routed) = steps["mlx-lm's own"](S_own), \
                steps["routed"](S_routed)
            difference = max(difference, mx.max(mx.abs(y_own - y_routed)).item(),
                             mx.max(mx.abs(S_own - S_routed)).item())
        return _time_steps(steps, S0, repeats), difference


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--backends", default="mlx")
    p.add_argument("--sim", action="store_true", help="count Metal-simulator kernel compiles")
    p.add_argument("--mlx-lm", action="store_true", help="tokens/s of tiny Qwen3-Next and Mamba-2 models")
    p.add_argument("--runs", type=int, default=1,
                   help="--mlx-lm: measurements of 15 alternating rounds per model")
    p.add_argument("--out", help="write a Markdown report here")
    p.add_argument("--growth", choices=("on", "off"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.growth:  # one measurement, in the process growth() started
        print(*growth_in_this_process(args.growth))
        return
    mx.random.seed(0)
    lines = [f"# Call overhead ({datetime.date.today()})", "",
             f"Device: {_cpu_name()}, {os.cpu_count()} cores, MLX {mx.default_device()}; "
             f"Python {platform.python_version()}, mlx {mx.__version__}, "
             f"mlx-lm {_version('mlx_lm')}, {platform.system()} {platform.release()}.", ""]

    g = growth()  # first: MLX's buffer cache starts empty
    lines += ["## Resident growth over 200 distinct lengths (RG-LRU forward, B2 D64, mlx)", "",
              "| MLX buffer cache | RSS growth (MB) | MLX cache after (MB) |", "|---|---:|---:|",
              f"| on (default) | {g['on'][0]:.1f} | {g['on'][1]:.1f} |",
              f"| off | {g['off'][0]:.1f} | {g['off'][1]:.1f} |", ""]
    print("\n".join(lines[-7:]), flush=True)

    best, error = decode_step(args.repeats)
    r, o = best["recgen"], best["ops"]
    lines += ["## Decode step: gated DeltaNet B1 H16 K=V=128, initial_state, return_state "
              "(backend mlx)", "",
              "| | Python (µs) | total (µs) |", "|---|---:|---:|",
              f"| mlx-recgen | {r[0]:.1f} | {r[1]:.1f} |",
              f"| MLX ops | {o[0]:.1f} | {o[1]:.1f} |", "",
              f"Ratio (total): **{r[1] / o[1]:.2f}x**; max relative difference of the outputs "
              f"{error:.1e}.", ""]
    print("\n".join(lines[-9:]), flush=True)

    measured = mlx_lm_decode_step(args.repeats)
    if measured is not None:
        best, errors = measured
        lines += ["## Decode step in mlx-lm's layout: B1, 16 value and 8 key heads, K=V=128 "
                  "(backend mlx)", "", "| | Python (µs) | total (µs) | vs mlx-lm ops | "
                  "max relative difference to mlx-lm ops |", "|---|---:|---:|---:|---:|"]
        base = best["mlx-lm ops"][1]
        lines += [f"| {name} | {p:.1f} | {t:.1f} | {t / base:.2f}x | {errors[name]:.1e} |"
                  for name, (p, t) in best.items()]
        lines.append("")
        print("\n".join(lines[-len(best) - 4:]), flush=True)

    rows = overhead(args.backends.split(","), max(20, args.repeats // 4))
    lines += ["## Per-call overhead beside the op time", "",
              "| spec | L | backend | path | Python per call (µs) | ops (µs) |",
              "|---|---:|---|---|---:|---:|"]
    lines += [f"| {n} | {L} | {b} | {path} | {bt:.1f} | {et:.1f} |"
              for n, L, b, path, bt, et in rows]
    lines.append("")
    print("\n".join(lines[-len(rows) - 3:]), flush=True)

    if args.sim:
        n, new = sim_compiles()
        lines += ["## Kernel compiles (metal-sim, gated DeltaNet forward)", "",
                  f"{n} distinct lengths below 32: {new} kernel(s) compiled after the first "
                  "length.", ""]
        print("\n".join(lines[-4:]), flush=True)
    if args.mlx_lm:
        runs = max(1, args.runs)
        lines += ["## mlx-lm decoding, tiny random models (8-token prompt, 64 tokens)", "",
                  f"{runs} measurement(s) of 15 alternating rounds per model; tokens/s are the "
                  "medians of the first.", "",
                  "| model | unpatched (tokens/s) | patched, backend mlx (tokens/s) | "
                  "patched / unpatched time per token: median of the measurements | range |",
                  "|---|---:|---:|---:|---|"]
        for model_type, title in MLX_LM_MODELS.items():
            measured = [mlx_lm_decode(model_type, 64) for _ in range(runs)]
            ratios = sorted(m["ratio"] for m in measured)
            lines.append(f"| {title} | {measured[0]['unpatched']:.0f} | "
                         f"{measured[0]['patched']:.0f} | **{statistics.median(ratios):.3f}x** | "
                         f"{ratios[0]:.3f}-{ratios[-1]:.3f}x |")
            print(lines[-1], flush=True)
        lines += ["", "## One gated_delta_update call, B1, 2 key and 4 value heads (the tiny "
                  "Qwen3-Next's), state fed back (backend mlx)", "",
                  "| Dk = Dv | | Python (µs) | total (µs) | vs mlx-lm's own | "
                  "max difference to mlx-lm's own |", "|---:|---|---:|---:|---:|---:|"]
        for K in (8, 64):
            best, difference = mlx_lm_routed_call(args.repeats, K)
            base = best["mlx-lm's own"][1]
            lines += [f"| {K} | {name} | {p:.1f} | {t:.1f} | {t / base:.2f}x | "
                      f"{difference if name == 'routed' else 0:.1e} |"
                      for name, (p, t) in best.items()]
            print("\n".join(lines[-2:]), flush=True)
        lines.append("")
    if args.out:
        Path(args.out).write_text("\n".join(lines))


if __name__ == "__main__":
    main()
