"""Sequence parallelism (``group=``): correctness against one process, then time and peak
memory of forward+backward per rank.

One process per device. On NVIDIA GPUs with NCCL, for 1 and 2 GPUs::

    python benchmarks/bench_distributed.py --L 262144                     # 1 GPU, no group
    for r in 0 1; do
      MLX_RANK=$r MLX_WORLD_SIZE=2 NCCL_HOST_IP=127.0.0.1 NCCL_PORT=29517 \\
      CUDA_VISIBLE_DEVICES=$r python benchmarks/bench_distributed.py --dist nccl --L 262144 &
    done; wait

On CPUs over the ring backend (small sizes, to check that it runs)::

    mlx.launch --backend ring -n 2 -- python benchmarks/bench_distributed.py --dist ring \\
        --B 1 --H 2 --K 16 --V 16 --L 512 --check-L 128 --reps 1

``--backend metal-sim --seg 16`` runs the GPU's kernels and chunk length there (the simulator
executes each kernel as it is called, so its memory is that of the kernels' buffers).

The recurrence is the bundled GLA (``--spec``), state-affine, so ranks exchange chunk
summaries; ``--spec`` may name any bundled or file spec whose inputs are drawn by
``bench_scan.inputs_for``, and the delta rules ``gated_deltanet`` and ``deltanet`` (drawn as
``bench_peers`` draws them: ``--spec gated_deltanet --K 128 --V 128`` for Qwen3-Next's heads). Inputs are drawn piece by piece (one random key per piece of
``gcd(chunks)`` steps), so every rank draws only its chunk and one process draws the same
sequence.

* Check (``--check-L``, 0 to skip): every rank also runs the whole (shorter) sequence in one
  process, and prints the largest relative error of its chunk's outputs and input gradients,
  of the final state, and of the parameters' and initial state's gradients summed over ranks
  (``mx.distributed.all_sum``), against that run.
* Timing (``--L``): forward+backward of ``sum(y) + sum(final state)`` with respect to every
  input and the initial state, median of ``--reps`` after one warm-up, and the peak memory
  (``mx.get_peak_memory``) of one pass on each rank. Rank 0 prints one row per rank.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time

import mlx.core as mx
import numpy as np

import mlx_recgen as rg
from bench_peers import make_inputs  # this script's folder is first on sys.path
from bench_scan import inputs_for


def chunk_lengths(L, world, chunks):
    if chunks:
        lengths = [int(c) for c in chunks.split(",")]
        if len(lengths) != world or sum(lengths) != L:
            raise SystemExit(f"--chunks {chunks} must give {world} lengths summing to {L}")
        return lengths
    return [L // world + (1 if r < L % world else 0) for r in range(world)]


GATES = ("g", "a")
# Delta rules draw their pieces as ``bench_peers`` draws them against FLA (unit keys, beta in
# (0.1, 0.9), a log gate), their gate's log divided by ``decay_scale``: ``bench_scan``'s
# drives would make ``I - beta k kᵀ`` grow and its gates, read as logs, overflow.
DELTA_RULES = {"gated_deltanet": "gated_delta", "deltanet": "deltanet"}


def draw(rec, sizes, start, stop, piece, seed, decay_scale):
    """Inputs for steps [start, stop) of a sequence drawn one piece of ``piece`` steps at a
    time (parameters: one draw). Gates (``GATES``, drawn in (0.5, 0.99)) become
    ``1 - (1 - g) / decay_scale``: with fast decays the start state of a long chunk would
    vanish below rounding and a wrong carry between chunks would go unnoticed."""
    spec = rec.spec
    parts = []
    for p in range(start // piece, stop // piece):
        if spec.name in DELTA_RULES:
            drawn = [mx.array(x) for x in make_inputs(
                DELTA_RULES[spec.name], dict(sizes, **{spec.time: piece}),
                np.random.default_rng(seed * 1_000_003 + p))]
            parts.append([x / decay_scale if n == "g" else x
                          for n, x in zip(spec.inputs, drawn)])
            continue
        mx.random.seed(seed * 1_000_003 + p)
        drawn = inputs_for(rec, dict(sizes, **{spec.time: piece}))
        parts.append([1 - (1 - x) / decay_scale if n in GATES else x
                      for n, x in zip(spec.inputs, drawn)])
    out = []
    for i, t in enumerate(spec.inputs.values()):
        if t.has_time:
            out.append(mx.concatenate([p[i] for p in parts], axis=t.axes.index(spec.time)))
        else:
            out.append(parts[0][i])
    return out


def initial_states(rec, sizes, seed):
    mx.random.seed(seed + 17)
    return [mx.random.normal(tuple(a if isinstance(a, int) else sizes[a] for a in t.axes)) * 0.1
            for t in rec.spec.states.values()]


def make_loss(rec, n_in, weights, backend, group, final_weight=1.0, **options):
    """``value_and_grad`` of ``sum(w * y) + final_weight * sum(final state)`` (``sum(y)``
    without weights) with respect to every input and the initial state; ``options``
    (``schedule=``, ``seg=``) go to the recurrence."""
    names = list(rec.spec.states)

    def loss(*arrays):
        init = dict(zip(names, arrays[n_in:]))
        y, h = rec(*arrays[:n_in], initial_state=init, return_state=True, backend=backend,
                   group=group, **options)
        ys = y if isinstance(y, tuple) else (y,)
        hs = list(h.values()) if isinstance(h, dict) else [h]
        total = sum(((w * v.astype(mx.float32)).sum() if w is not None else
                     v.astype(mx.float32).sum()) for w, v in zip(weights, ys))
        return total + final_weight * sum(v.sum() for v in hs), (ys, hs)

    return mx.value_and_grad(loss, argnums=tuple(range(n_in + len(names))))


def output_weights(rec, sizes, start, stop, seed):
    spec = rec.spec
    mx.random.seed(seed + 29)
    out = []
    for t in spec.outputs.values():
        shape = tuple(a if isinstance(a, int) else sizes[a] for a in t.axes)
        full = mx.random.normal(shape)  # small sizes only (the check)
        axis = t.axes.index(spec.time)
        out.append(full[(slice(None),) * axis + (slice(start, stop),)])
    return out


def rel(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm((a - b).reshape(-1)) / mx.maximum(mx.linalg.norm(b.reshape(-1)),
                                                               1e-30)).item()


def check(rec, sizes, L, world, rank, group, args):
    spec = rec.spec
    lengths = chunk_lengths(L, world, args.chunks_check)
    piece = math.gcd(*lengths)
    start = sum(lengths[:rank])
    stop = start + lengths[rank]
    n_in = len(spec.inputs)
    full_sizes = dict(sizes, **{spec.time: L})
    full = draw(rec, full_sizes, 0, L, piece, args.seed, args.decay_scale)
    init = initial_states(rec, full_sizes, args.seed)
    weights_full = output_weights(rec, full_sizes, 0, L, args.seed)
    # every rank's loss has the final-state term, so one process counts it once per rank
    (_, (ys, hs)), grads = make_loss(rec, n_in, weights_full, args.backend, None,
                                     final_weight=float(world), **options(args))(*full, *init)
    mine = draw(rec, full_sizes, start, stop, piece, args.seed, args.decay_scale)
    weights = output_weights(rec, full_sizes, start, stop, args.seed)
    (_, (ys_d, hs_d)), grads_d = make_loss(rec, n_in, weights, args.backend, group,
                                           **options(args))(*mine, *init)
    errors = {}
    for t, a, b in zip(spec.outputs.values(), ys_d, ys):
        axis = t.axes.index(spec.time)
        errors[f"output {t.name}"] = rel(a, b[(slice(None),) * axis + (slice(start, stop),)])
    for t, a, b in zip(spec.states.values(), hs_d, hs):
        errors[f"final {t.name}"] = rel(a, b)
    for i, t in enumerate([*spec.inputs.values(), *spec.states.values()]):
        a = grads_d[i]
        if t.kind == "input" and t.has_time:
            axis = t.axes.index(spec.time)
            b = grads[i][(slice(None),) * axis + (slice(start, stop),)]
            label = f"d {t.name} (chunk)"
        else:
            a = mx.distributed.all_sum(a, group=group) if group is not None else a
            b = grads[i]
            label = f"d {t.name} (summed)" if t.kind == "input" else f"d initial {t.name} (summed)"
        errors[label] = rel(a, b)
    return errors


def options(args) -> dict:
    return {"schedule": args.schedule, "seg": args.seg}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dist", default=None, help="mx.distributed backend (nccl, ring, ...); "
                    "none: one process without a group")
    ap.add_argument("--spec", default="gla")
    ap.add_argument("--backend", default="auto", help="the recurrence's backend")
    ap.add_argument("--schedule", default="auto", help="the recurrence's schedule")
    ap.add_argument("--seg", type=int, default=None, help="the recurrence's segment (chunk) "
                    "length; default: the schedule's choice")
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=16)
    ap.add_argument("--K", type=int, default=64)
    ap.add_argument("--V", type=int, default=64)
    ap.add_argument("--L", type=int, default=262144)
    ap.add_argument("--chunks", default="", help="chunk lengths, comma separated (default even)")
    ap.add_argument("--check-L", type=int, default=8192)
    ap.add_argument("--chunks-check", default="")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--decay-scale", type=float, default=1000.0,
                    help="gates g, a become 1 - (1 - g) / scale (see draw)")
    args = ap.parse_args()

    group = mx.distributed.init(backend=args.dist, strict=True) if args.dist else None
    world = group.size() if group is not None else 1
    rank = group.rank() if group is not None else 0
    rec = rg.load_spec(args.spec)
    spec = rec.spec
    sizes = {"B": args.B, "H": args.H, "K": args.K, "V": args.V}
    device = str(mx.default_device())
    say = print if rank == 0 else (lambda *a, **k: None)
    say(f"# {args.spec} B{args.B} H{args.H} K{args.K} V{args.V} L{args.L} on {world} "
        f"process(es), dist={args.dist}, backend={args.backend}, schedule={args.schedule}, "
        f"seg={args.seg or 'auto'}, device={device}")

    if args.check_L and group is not None:
        errors = check(rec, sizes, args.check_L, world, rank, group, args)
        worst = max(errors.values())
        for r in range(world):
            if r == rank:
                print(f"check L={args.check_L} rank {rank}: worst relative error {worst:.2e}; "
                      + ", ".join(f"{k} {v:.1e}" for k, v in errors.items()), flush=True)
            mx.eval(mx.distributed.all_sum(mx.array(0.0), group=group))  # print in rank order

    lengths = chunk_lengths(args.L, world, args.chunks)
    piece = math.gcd(*lengths)
    start = sum(lengths[:rank])
    stop = start + lengths[rank]
    full_sizes = dict(sizes, **{spec.time: args.L})
    inputs = draw(rec, full_sizes, start, stop, piece, args.seed, args.decay_scale)
    init = initial_states(rec, full_sizes, args.seed)
    mx.eval(inputs, init)
    weights = [None] * len(spec.outputs)
    step = make_loss(rec, len(spec.inputs), weights, args.backend, group, **options(args))

    def once():
        (value, _), grads = step(*inputs, *init)
        mx.eval(value, grads)

    once()  # warm-up: compiles kernels
    mx.synchronize()
    times = []
    for _ in range(args.reps):
        t0 = time.perf_counter()
        once()
        mx.synchronize()
        times.append(time.perf_counter() - t0)
    mx.reset_peak_memory()
    base = mx.get_active_memory()
    once()
    mx.synchronize()
    peak = mx.get_peak_memory()
    row = mx.array([statistics.median(times) * 1e3, peak / 2**20, (peak - base) / 2**20,
                    float(stop - start)])
    rows = (mx.distributed.all_gather(row[None], group=group) if group is not None
            else row[None]).tolist()
    say("| rank | chunk steps | fwd+bwd ms (median) | peak MiB | peak above inputs MiB |")
    say("|---:|---:|---:|---:|---:|")
    for r, (ms, mib, above, steps) in enumerate(rows):
        say(f"| {r} | {int(steps)} | {ms:.1f} | {mib:.1f} | {above:.1f} |")


if __name__ == "__main__":
    main()
