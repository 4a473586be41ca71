"""The sequential schedule on recurrences that must walk time in order, beside their peers, in
one run on one GPU (MLX's CUDA build; PyTorch peers from flash-linear-attention).

    python benchmarks/bench_sequential.py --out results.json

Cases (fp32 unless named):

* gated DeltaNet (``bench_peers.gated_delta``) B3 H12 K=V=64 L2048 and B8 H16 L4096: our
  forward and forward+backward; FLA's ``fused_recurrent_gated_delta_rule`` forward (it has no
  backward; FLA 0.6.0's chunked kernels refuse their backward on Hopper with Triton 3.6); also bf16.
* GLA (bundled ``gla``, a scalar decay per head) forced onto the sequential schedule beside
  FLA's ``fused_recurrent_simple_gla``.
* A diagonal tanh RNN ``h <- tanh(w h + x)``, D=4096, B=8, L=4096: forward time against the
  bytes it must move (read x, write y) at MLX's copy bandwidth.
* Decoding: one step (L=1, state in and out) of gated DeltaNet at B1 H16 K=V=128, per call,
  against the same step in plain MLX ops.

Each of our kernels is timed as chosen by default (lane-shared inputs staged in threadgroup
memory, the state split over threads where instances x lanes are few) and, as ablations,
without the split (``split=1``) and without staging either (``STAGE_MAX_BYTES = 0``); the
kernels differ in their template arguments, so all stay compiled side by side. ``--threads``,
``--seg``, ``--split`` and ``--backward-threads`` add variants.
"""

from __future__ import annotations

import argparse
import datetime
import json
import time

import mlx.core as mx
import numpy as np

import mlx_recgen as rg
import mlx_recgen.schedule as schedule
from bench_peers import (gated_delta, make_inputs, peak_mlx, peers_run, rel, time_mlx,
                         versions)


@rg.recurrence(lane="D", state={"h": "B D"}, inputs={"x": "B L D", "w": "D"},
               outputs={"y": "B L D"})
def tanh_rnn(h, x, w):
    """A diagonal tanh RNN: h <- tanh(w h + x), y = h."""
    h = rg.tanh(w * h + x)
    return {"y": h}


def with_schedule(constants, fn, rec=None):
    """``fn()`` with the ``schedule`` module's ``constants`` (name -> value) set; the backend's
    memoised schedules of ``rec`` are dropped before and after, so that no setting reuses
    another's."""
    saved = {k: getattr(schedule, k) for k in constants}
    forget = (lambda: rec._backend("cuda")._schedules.clear()) if rec is not None else (lambda: None)
    forget()
    try:
        for k, v in constants.items():
            setattr(schedule, k, v)
        return fn()
    finally:
        for k, v in saved.items():
            setattr(schedule, k, v)
        forget()


def ours(rec, xs, w, reps, **call):
    f = lambda *a: rec(*a, backend="cuda", schedule="sequential", **call)
    grad = mx.grad(lambda *a: mx.sum(f(*a) * w), argnums=tuple(range(len(xs))))
    y = f(*xs)
    mx.eval(y)
    out = dict(fwd=time_mlx(lambda: f(*xs), reps), fwdbwd=time_mlx(lambda: grad(*xs), reps),
               peak=peak_mlx(lambda: grad(*xs)))
    return out, np.array(y.astype(mx.float32))


# (label, schedule constants, call options): the defaults, then ablations
UNSTAGED = dict(STAGE_MAX_BYTES=0)
VARIANTS = [("ours-sequential", {}, {}), ("ours-sequential-nosplit", {}, dict(split=1)),
            ("ours-sequential-nosplit-unstaged", UNSTAGED, dict(split=1))]


def case(name, rec, shape, dtype, reps, rng, peers):
    xs_np = make_inputs(name, shape, rng)
    B, L, H, V = (shape[a] for a in ("B", "L", "H", "V"))
    w_np = rng.standard_normal((B, L, H, V)).astype(np.float32)
    mdt = {"float32": mx.float32, "bfloat16": mx.bfloat16}[dtype]
    xs = [mx.array(x).astype(mdt) for x in xs_np]
    w = mx.array(w_np).astype(mdt)
    row = dict(spec=name, shape=shape, dtype=dtype, runs={})
    base = None
    for label, constants, call in VARIANTS:
        r, y = with_schedule(constants, lambda: ours(rec, xs, w, reps, **call), rec)
        base = y if base is None else base
        r["err_vs_default"] = rel(y, base)
        row["runs"][label] = r
        print(name, shape, dtype, label, r, flush=True)
    for peer in peers:
        try:
            r = peers_run(peer, name, xs_np, w_np, dtype, reps)
            r["err_vs_ours"] = rel(r.pop("y"), base)
        except Exception as exc:  # noqa: BLE001 - a peer's refusal is a result
            r = dict(error=f"{type(exc).__name__}: {str(exc).splitlines()[0][:300]}")
        row["runs"][peer] = r
        print(name, shape, dtype, peer, r, flush=True)
    return row


def tanh_case(reps, rng, bandwidth):
    B, L, D = 8, 4096, 4096
    x = mx.array(rng.standard_normal((B, L, D)).astype(np.float32))
    wd = mx.array(rng.uniform(-1, 1, (D,)).astype(np.float32))
    row = dict(spec="tanh_rnn", shape=dict(B=B, L=L, D=D), dtype="float32", runs={})
    moved = 2 * x.nbytes  # read x, write y
    for staged in (True, False):
        f = lambda: tanh_rnn(x, wd, backend="cuda", schedule="sequential")
        t = with_schedule({} if staged else UNSTAGED, lambda: (mx.eval(f()), time_mlx(f, reps))[1],
                          tanh_rnn)
        row["runs"]["ours-sequential" + ("" if staged else "-unstaged")] = dict(
            fwd=t, bytes=moved, fraction_of_copy_bandwidth=moved / t / bandwidth)
    print(row, flush=True)
    return row


def decode_case(reps, rng):
    """One gated DeltaNet step with the state in and out, per call (each call evaluated)."""
    B, H, K, V = 1, 16, 128, 128
    q, k = (mx.array(rng.standard_normal((B, 1, H, K)).astype(np.float32) * K ** -0.5)
            for _ in range(2))
    v = mx.array(rng.standard_normal((B, 1, H, V)).astype(np.float32))
    g = mx.array(np.log(rng.uniform(0.9, 1.0, (B, 1, H))).astype(np.float32))
    beta = mx.array(rng.uniform(0.1, 0.9, (B, 1, H)).astype(np.float32))
    S = mx.array(rng.standard_normal((B, H, K, V)).astype(np.float32) * 0.1)

    def ours_step(**call):
        return gated_delta(q, k, v, g, beta, initial_state=S, return_state=True, backend="cuda",
                           schedule="sequential", **call)

    def mlx_step():
        a = mx.exp(g[:, 0])[..., None, None]  # [B, H, 1, 1]
        kk, qq, vv = k[:, 0], q[:, 0], v[:, 0]
        r = a[..., 0] * mx.einsum("bhk,bhkv->bhv", kk, S)
        S2 = a * S + (beta[:, 0, :, None] * (vv - r))[:, :, None, :] * kk[..., None]
        return mx.einsum("bhk,bhkv->bhv", qq, S2)[:, None], S2

    (o1, S1), (o2, S2) = ours_step(), mlx_step()
    err = max(rel(np.array(o1), np.array(o2)), rel(np.array(S1), np.array(S2)))

    def per_call(fn):
        mx.eval(fn())
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                mx.eval(fn())
            times.append((time.perf_counter() - t0) / reps)
        return sorted(times)[2]

    def build(fn):  # the Python side of a call: building the graph, no evaluation
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps

    row = dict(spec="gated_delta decode step", shape=dict(B=B, H=H, K=K, V=V), dtype="float32",
               runs={"ours-sequential": dict(per_call=per_call(ours_step), build=build(ours_step)),
                     "ours-sequential-nosplit": dict(per_call=per_call(lambda: ours_step(split=1))),
                     "mlx-ops": dict(per_call=per_call(mlx_step), build=build(mlx_step))},
               err=err)
    print(row, flush=True)
    return row


def mlx_copy_bandwidth():
    """Bytes read + written per second by MLX's ``x + 1`` over a 1 GiB array."""
    x = mx.random.normal((1 << 28,))
    return 2 * x.nbytes / time_mlx(lambda: x + 1.0, 10)


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="bench-sequential.json")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--only", default=None, choices=["gated_delta", "tanh", "decode", "gla", "bf16"],
                   help="run one group of cases")
    p.add_argument("--threads", default="",
                   help="comma-separated threads per group to time as extra variants")
    p.add_argument("--seg", default="", help="comma-separated checkpoint intervals, likewise")
    p.add_argument("--split", default="", help="comma-separated state splits, likewise")
    p.add_argument("--backward-threads", default="",
                   help="comma-separated caps of the sequential backward's own groups "
                        "(schedule.BACKWARD_MAX_THREADS), likewise")
    args = p.parse_args()
    run = lambda group: args.only in (None, group)  # noqa: E731
    for t in filter(None, args.threads.split(",")):
        VARIANTS.append((f"ours-sequential-threads{t}", {}, dict(threads=int(t))))
    for n in filter(None, args.seg.split(",")):
        VARIANTS.append((f"ours-sequential-seg{n}", {}, dict(seg=int(n))))
    for n in filter(None, args.split.split(",")):
        VARIANTS.append((f"ours-sequential-split{n}", {}, dict(split=int(n))))
    for t in filter(None, args.backward_threads.split(",")):
        VARIANTS.append((f"ours-sequential-bwdthreads{t}", dict(BACKWARD_MAX_THREADS=int(t)), {}))
    rng = np.random.default_rng(0)
    bandwidth = mlx_copy_bandwidth()
    result = dict(date=str(datetime.date.today()), versions=versions(),
                  copy_bandwidth_mlx=bandwidth, rows=[])

    def save(row):
        result["rows"].append(row)
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    delta_peers = ["fused_recurrent_gated_delta_rule"]  # chunk_*: backward refuses on Hopper
    shapes = (dict(B=3, L=2048, H=12, K=64, V=64), dict(B=8, L=4096, H=16, K=64, V=64))
    if run("gated_delta"):
        for shape in shapes:
            save(case("gated_delta", gated_delta, shape, "float32", args.reps, rng, delta_peers))
    if run("tanh"):
        save(tanh_case(args.reps, rng, bandwidth))
    if run("decode"):
        save(decode_case(100, rng))
    if run("gla"):
        for shape in shapes:
            save(case("gla", rg.load_spec("gla"), shape, "float32", args.reps, rng,
                      ["fused_recurrent_simple_gla"]))
    if run("bf16"):
        save(case("gated_delta", gated_delta, shapes[1], "bfloat16", args.reps, rng, delta_peers))


if __name__ == "__main__":
    main()
