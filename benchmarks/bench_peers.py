"""Our kernels (both schedules) beside the hand-written peers, in one run on one GPU.

    python benchmarks/bench_peers.py --out results.json     # on an NVIDIA GPU (MLX's CUDA build)
    python benchmarks/plot_peers.py results.json            # the markdown table and the chart

Peers (PyTorch): flash-linear-attention's ``fused_recurrent_simple_gla``, ``chunk_simple_gla``,
``fused_recurrent_gla`` (per-channel decay ``gk``), ``chunk_gla``,
``fused_recurrent_gated_delta_rule``, ``chunk_gated_delta_rule``, ``fused_recurrent_delta_rule``,
``chunk_delta_rule``, ``fused_recurrent_rwkv7``, ``chunk_rwkv7``; accelerated-scan's
``scalar.scan``. Ours (MLX): the ``cuda`` backend with ``schedule="sequential"``,
``"chunked"`` and ``"matrix"`` (where each applies; ``--schedules`` picks), and the per-step MLX
loop (``rec.reference``, at the smaller shapes).

For every case and dtype (fp32, bf16): forward time, forward+backward time (the outputs and
the gradients w.r.t. every input for the outputs' cotangent ``w``, fixed random: ``mx.vjp``,
``torch.autograd.grad(y, inputs, w)``) and the peak memory of forward+backward
(each framework's own allocator counter, inputs included). Times are medians of 5 batches of
``reps`` calls and one synchronisation. Torch launches each call as it is built; by default each
MLX call is likewise handed to ``mx.async_eval`` as it is built (``--mlx-timing pipelined``),
so Python overlaps the GPU and one call's kernels follow the last's. ``--mlx-timing queued``
builds the batch, then evaluates it at once: MLX's CUDA graphs may then run independent calls'
kernels side by side, which flatters a kernel that leaves the GPU partly idle (a sequential
GLA B3 forward on an H200: 0.36-0.49 ms queued, 1.53-1.56 ms pipelined;
``benchmarks/results/bench-peers-b3-pipelined-H200-2026-11-27.md``,
``benchmarks/bench_call_modes.py``).
Every peer's fp32 output is checked against ours (relative error) on the same inputs. A peer
that refuses to run is recorded with its error.

Mappings: SSD's ``h[p,n] <- exp(delta A[n]) h + delta B[n] u[p]; y = C.h`` is GLA with
``q=C, k=delta*B, v=u, gk=delta*A`` (FLA gets those precomputed: its gradients are w.r.t.
``q, k, v, gk``, ours w.r.t. ``u, delta, B, C, A``). FLA's gates are in log space; ``scale=1``.
accelerated-scan takes ``[B, D, T]`` (its native layout, transposed outside the timing).
DeltaNet and RWKV-7 are the bundled specs, on the peers' own inputs (RWKV-7 in FLA's form:
``w`` the log decay, ``a = -kk``, ``b = kk * a_t``).
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import subprocess
import time
import traceback

import mlx.core as mx
import numpy as np

import mlx_recgen as rg
from mlx_recgen.schedule import scan_misfit
from bench_scan import peak as peak_mlx  # the same peak-memory measure as bench_scan


@rg.recurrence(lane="V", state={"S": "B H K V"},
               inputs={"q": "B L H K", "k": "B L H K", "v": "B L H V", "g": "B L H",
                       "beta": "B L H"},
               outputs={"o": "B L H V"})
def gated_delta(S, q, k, v, g, beta, i):
    """Gated DeltaNet (Yang et al. 2024): S <- exp(g) S (I - beta k k^T) + beta v k^T, o = S q."""
    a = rg.exp(g)
    r = rg.Sum(k[i] * S[i], i) * a
    S[i] = a * S[i] + beta * (v - r) * k[i]
    return {"o": rg.Sum(q[i] * S[i], i)}


CASES = [  # (spec, shape, also time the per-step MLX loop)
    ("rglru", dict(B=8, L=4096, D=1024), False),
    ("rglru", dict(B=3, L=2048, D=768), False),
    ("ssd", dict(B=3, L=2048, H=12, P=64, N=16), True),
    ("ssd", dict(B=8, L=4096, H=16, P=64, N=64), False),
    ("gla", dict(B=3, L=2048, H=12, K=64, V=64), True),
    ("gla", dict(B=8, L=4096, H=16, K=64, V=64), False),
    ("gated_delta", dict(B=3, L=2048, H=12, K=64, V=64), False),
    ("gated_delta", dict(B=8, L=4096, H=16, K=64, V=64), False),
    ("deltanet", dict(B=3, L=2048, H=12, K=64, V=64), False),
    ("deltanet", dict(B=8, L=4096, H=16, K=64, V=64), False),
    ("rwkv7", dict(B=3, L=2048, H=12, K=64, V=64), False),
    ("rwkv7", dict(B=8, L=4096, H=16, K=64, V=64), False),
]


def make_inputs(name, s, rng):
    """numpy fp32 inputs in the spec's layout, in ranges that keep the recurrence stable."""
    B, L = s["B"], s["L"]
    n = lambda *shape, scale=1.0: (scale * rng.standard_normal(shape)).astype(np.float32)
    u = lambda lo, hi, *shape: rng.uniform(lo, hi, shape).astype(np.float32)
    if name == "gla":
        H, K, V = s["H"], s["K"], s["V"]
        return [n(B, L, H, K, scale=K ** -0.5), n(B, L, H, K, scale=K ** -0.5), n(B, L, H, V),
                u(0.9, 1.0, B, L, H)]
    if name == "ssd":
        H, P, N = s["H"], s["P"], s["N"]
        return [n(B, L, H, P), u(0.01, 0.1, B, L, H), n(B, L, H, N, scale=N ** -0.5),
                n(B, L, H, N, scale=N ** -0.5), -u(0.3, 1.5, H, N)]
    if name == "rglru":
        D = s["D"]
        return [u(0.5, 0.99, B, L, D) * np.where(rng.uniform(size=(B, L, D)) < 0.5, -1, 1).astype(np.float32),
                n(B, L, D)]
    H, K, V = s["H"], s["K"], s["V"]

    def unit(*shape):
        x = n(*shape)
        return x / np.linalg.norm(x, axis=-1, keepdims=True)

    if name == "rwkv7":  # FLA's form: a = -kk, b = kk * a_t, kk a unit key, a_t in (0, 1)
        kk = unit(B, L, H, K)
        return [n(B, L, H, K, scale=K ** -0.5), np.log(u(0.9, 1.0, B, L, H, K)),
                n(B, L, H, K, scale=K ** -0.5), n(B, L, H, V), -kk,
                kk * u(0.0, 1.0, B, L, H, K)]
    if name == "deltanet":
        return [n(B, L, H, K, scale=K ** -0.5), unit(B, L, H, K), n(B, L, H, V),
                u(0.1, 0.9, B, L, H)]
    return [n(B, L, H, K, scale=K ** -0.5), unit(B, L, H, K), n(B, L, H, V),
            np.log(u(0.9, 1.0, B, L, H)), u(0.1, 0.9, B, L, H)]


def in_log_space(name, spec, xs, gate):
    """GLA's spec and inputs with the gate in log space (``ops.gla_g`` on ``log g``), as FLA's
    ``chunk_simple_gla`` takes it, where ``gate`` is ``"log"``; otherwise as given."""
    if name != "gla" or gate != "log":
        return spec, xs
    from mlx_recgen import ops

    return ops.gla_g.spec, [*xs[:3], np.log(xs[3])]


# -- timing ----------------------------------------------------------------------------------------


def _median_batches(run_batch, reps):
    run_batch(1)
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        run_batch(reps)
        times.append((time.perf_counter() - t0) / reps)
    return statistics.median(times)


def run_queued(fn, r):
    """``r`` calls of ``fn`` built, then evaluated together."""
    mx.eval([fn() for _ in range(r)])
    mx.synchronize()


def run_pipelined(fn, r):
    """``r`` calls of ``fn``, each handed to ``mx.async_eval`` as it is built."""
    for _ in range(r):
        mx.async_eval(fn())
    mx.synchronize()


# How a batch of MLX calls runs (``--mlx-timing``): all built, then evaluated together; or each
# handed to ``mx.async_eval`` as it is built, so that Python builds the next call while the GPU
# runs this one, as torch's launches overlap the GPU
MLX_TIMINGS = {"queued": run_queued, "pipelined": run_pipelined}
mlx_timing = "pipelined"


def time_mlx(fn, reps):
    return _median_batches(lambda r: MLX_TIMINGS[mlx_timing](fn, r), reps)


def time_torch(fn, reps):
    import torch

    def batch(r):
        for _ in range(r):
            fn()
        torch.cuda.synchronize()
    return _median_batches(batch, reps)


def peak_torch(fn, above=False):
    """Peak bytes of a call of ``fn()`` after a warm-up; ``above``: less what was allocated
    before it (its outputs and temporaries alone)."""
    import torch

    fn()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated() if above else 0
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - before


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


# -- ours ------------------------------------------------------------------------------------------


def ours(rec, xs_np, w_np, dtype, schedule, reps, compiled=False):
    """Our forward, forward+backward and peak memory; ``compiled``: also the forward+backward
    under ``mx.compile`` (``fwdbwd_compiled``), as a compiled training step runs it: MLX then
    fuses the elementwise passes around the kernels, which a call as made runs one by one."""
    xs = [mx.array(x).astype(dtype) for x in xs_np]
    w = mx.array(w_np).astype(dtype)
    call = rec.reference if schedule == "loop" else \
        (lambda *a: rec(*a, backend="cuda", schedule=schedule))
    # the outputs and the gradients with ``w`` as the outputs' cotangent, as the peers'
    # ``torch.autograd.grad(y, args, w)`` (``mx.grad`` of ``sum(y * w)`` would add a pass that
    # forms ``w`` times the sum's cotangent)
    fwdbwd = lambda: mx.vjp(call, xs, [w])
    y = call(*xs)
    mx.eval(y)
    r = 1 if schedule == "loop" else reps
    out = dict(fwd=time_mlx(lambda: call(*xs), r), fwdbwd=time_mlx(fwdbwd, r),
               peak=peak_mlx(fwdbwd), y=np.array(y.astype(mx.float32)))
    if compiled:
        step = mx.compile(lambda *a: mx.vjp(call, list(a[:-1]), [a[-1]]))
        out["fwdbwd_compiled"] = time_mlx(lambda: step(*xs, w), r)
    return out


# -- peers -----------------------------------------------------------------------------------------


def peer_call(peer, name, xs):
    """(callable on torch tensors, the tensors to differentiate) for a peer on our inputs."""
    import torch

    if peer == "accelerated_scan.scalar":
        from accelerated_scan.scalar import scan
        a, x = (t.transpose(1, 2).contiguous() for t in xs)
        return (lambda a, x: scan(a, x).transpose(1, 2)), [a, x]
    import fla.ops as ops

    if name == "gla":
        q, k, v, g = xs
        lg = torch.log(g)
        f = getattr(ops, peer)
        return (lambda q, k, v, lg: f(q, k, v, g=lg, scale=1.0)[0]), [q, k, v, lg]
    if name == "ssd":
        u, delta, B, C, A = xs
        k = delta[..., None] * B
        gk = delta[..., None] * A  # log decay per channel
        f = getattr(ops, peer)
        if peer == "fused_recurrent_gla":
            return (lambda q, k, v, gk: f(q, k, v, gk=gk, scale=1.0)[0]), [C, k, u, gk]
        return (lambda q, k, v, gk: f(q, k, v, g=gk, scale=1.0)[0]), [C, k, u, gk]
    f = getattr(ops, peer)
    if name == "deltanet":
        return (lambda q, k, v, beta: f(q, k, v, beta=beta, scale=1.0)[0]), xs
    if name == "rwkv7":
        return (lambda r, w, k, v, a, b: f(r, w, k, v, a, b, scale=1.0)[0]), xs
    q, k, v, g, beta = xs
    return (lambda q, k, v, g, beta: f(q, k, v, g=g, beta=beta, scale=1.0)[0]), [q, k, v, g, beta]


def peer_operands(peer, name, xs_np, dtype):
    """A peer's call on our inputs (numpy) in ``dtype`` (a torch dtype's name) on the GPU, and its
    operands as leaves that take gradients."""
    import torch

    tdt = getattr(torch, dtype)
    fn, args = peer_call(peer, name, [torch.tensor(x, device="cuda").to(tdt) for x in xs_np])
    return fn, [a.detach().clone().requires_grad_(True) for a in args]


def peers_run(peer, name, xs_np, w_np, dtype, reps):
    import torch

    fn, args = peer_operands(peer, name, xs_np, dtype)
    w = torch.tensor(w_np, device="cuda").to(getattr(torch, dtype))
    out = {}
    with torch.no_grad():
        y = fn(*args)
    out["y"] = y.float().cpu().numpy()
    out["fwd"] = time_torch(lambda: fn(*args), reps)
    try:
        def fwdbwd():
            y = fn(*args)
            return torch.autograd.grad(y, args, w)
        fwdbwd()
        out["fwdbwd"] = time_torch(fwdbwd, reps)
        out["peak"] = peak_torch(fwdbwd)
    except Exception as exc:  # noqa: BLE001 - a peer's refusal is a result
        out["bwd_error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200]}"
    return out


PEERS = {
    "gla": ["fused_recurrent_simple_gla", "chunk_simple_gla"],
    "ssd": ["fused_recurrent_gla", "chunk_gla"],
    "rglru": ["accelerated_scan.scalar"],
    "gated_delta": ["fused_recurrent_gated_delta_rule", "chunk_gated_delta_rule"],
    "deltanet": ["fused_recurrent_delta_rule", "chunk_delta_rule"],
    "rwkv7": ["fused_recurrent_rwkv7", "chunk_rwkv7"],
}


def versions():
    out = {"mlx": mx.__version__}
    for mod in ("torch", "triton", "fla", "accelerated_scan"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception as exc:  # noqa: BLE001
            out[mod] = f"unavailable ({type(exc).__name__})"
    try:
        out["device"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version",
                                        "--format=csv,noheader"], capture_output=True, text=True,
                                       check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        out["device"] = str(mx.default_device())
    return out


def copy_bandwidth():
    """Bytes read + written per second by a large elementwise op, MLX and PyTorch."""
    x = mx.random.normal((1 << 28,))
    mlx_bw = 2 * x.nbytes / time_mlx(lambda: x + 1.0, 10)
    import torch
    t = torch.randn(1 << 28, device="cuda")
    torch_bw = 2 * t.numel() * 4 / time_torch(lambda: t + 1.0, 10)
    return mlx_bw, torch_bw


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench-peers.json")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--cases", default=None, help="comma-separated indices into CASES")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--schedules", default="sequential,chunked,matrix,loop",
                   help="our schedules to run, where they apply (loop: the per-step MLX loop)")
    p.add_argument("--peers", default=None, help="comma-separated peers (default: all of a case)")
    p.add_argument("--mlx-timing", choices=sorted(MLX_TIMINGS), default="pipelined",
                   help="how a batch of MLX calls runs (MLX_TIMINGS)")
    args = p.parse_args()
    global mlx_timing
    mlx_timing = args.mlx_timing
    rng = np.random.default_rng(0)
    result = dict(date=str(datetime.date.today()), versions=versions(), rows=[],
                  mlx_timing=mlx_timing)
    result["copy_bandwidth_mlx"], result["copy_bandwidth_torch"] = copy_bandwidth()
    cases = [CASES[int(i)] for i in args.cases.split(",")] if args.cases else CASES
    # every case in fp32 first, so that a run cut short still has the main table
    for dtype in args.dtypes.split(","):
        for name, shape, with_loop in cases:
            result["rows"].append(run_case(name, shape, with_loop, dtype, args.reps, rng,
                                           args.schedules.split(","),
                                           args.peers.split(",") if args.peers else None))
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)


def run_case(name, shape, with_loop, dtype, reps, rng, wanted=("sequential", "chunked", "matrix"),
             peers=None):
    """Every implementation of one case at one dtype, on the same inputs."""
    rec = gated_delta if name == "gated_delta" else rg.load_spec(name)
    xs = make_inputs(name, shape, rng)
    out_shape = ("B", "L", "H", "P") if name == "ssd" else ("B", "L", "D") if name == "rglru" \
        else ("B", "L", "H", "V")
    w = rng.standard_normal(tuple(shape[a] for a in out_shape)).astype(np.float32)
    mdt = {"float32": mx.float32, "bfloat16": mx.bfloat16}[dtype]
    row = dict(spec=name, shape=shape, dtype=dtype, runs={})
    schedules = ["sequential"] + (["chunked"] if rec.affine.block_diagonal else []) + \
        (["matrix"] if rec.matrix.applies else []) + (["scan"] if not scan_misfit(rec) else [])
    schedules = [s for s in schedules if s in wanted]
    if with_loop and dtype == "float32" and "loop" in wanted:
        schedules.append("loop")
    base = first = None  # the sequential schedule's outputs, and our first run's (the peers')
    for sch in schedules:
        try:
            r = ours(rec, xs, w, mdt, sch, reps)
            # the sequential schedule, where this call runs it (first), is the reference; else
            # there is none (None, not a zero against itself)
            base = r["y"] if sch == "sequential" else base
            y = r.pop("y")
            first = y if first is None else first
            r["err_vs_sequential"] = None if base is None else rel(y, base)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            r = dict(error=f"{type(exc).__name__}: {str(exc)[:300]}")
        row["runs"][f"ours-{sch}"] = r
        print(name, shape, dtype, sch, r, flush=True)
        mx.clear_cache()
    for peer in [p for p in PEERS[name] if peers is None or p in peers]:
        try:
            r = peers_run(peer, name, xs, w, dtype, reps)
            r["err_vs_ours"] = rel(r.pop("y"), first) if first is not None else None
        except Exception as exc:  # noqa: BLE001
            r = dict(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
        row["runs"][peer] = r
        print(name, shape, dtype, peer, r, flush=True)
        import torch
        torch.cuda.empty_cache()
    return row


if __name__ == "__main__":
    main()
