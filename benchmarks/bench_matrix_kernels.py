"""The matrix schedule's kernel variants on CUDA, in one process: the readouts as MLX's matmuls
around the weights kernel or in the outputs kernel (``matrix_kernels.OUTPUTS_BY_MATMULS``), the
chunks' backward in one kernel or as MLX's matmuls between kernels
(``matrix_kernels.GRADIENTS_BY_MATMULS``), the states through the chunks in one walk or in the
states and chain kernels (``matrix_kernels.WALKS``, ``WALK_GROUPS``), copies of four floats at a
time (``render.matrix.VECTOR_COPIES``), and the kernels' tiles within the 48 KB a CUDA kernel
may declare or within the dynamic shared memory (``Dialect.dynamic_shared_bytes``), beside
FLA's chunk kernel on the same inputs. Variants named more than once run in turn
(``--variants 3,1,3,1``): one process's first calls can run slower.

    python benchmarks/bench_matrix_kernels.py --cases 4,5 --out bench-matrix-kernels.json

``--cases`` indexes ``bench_peers.CASES``; times are ``bench_peers``'s (pipelined MLX calls,
medians of batches), ms, with the peak memory of forward+backward in GB and the relative error of
the output against the first variant. Each variant runs a fresh ``Recurrence`` with the kernels
rendered anew.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json

import mlx.core as mx
import numpy as np

import mlx_recgen as rg
from bench_peers import (CASES, PEERS, in_log_space, make_inputs, ours, peers_run, rel,
                         versions)
from mlx_recgen.backends import matrix_kernels as mk
from mlx_recgen.memo import LRU
from mlx_recgen.render import matrix as render_matrix
from mlx_recgen.render.matrix import WALK_KINDS
from mlx_recgen.render.dialects import DIALECTS

DYNAMIC = DIALECTS["cuda"].dynamic_shared_bytes
VARIANTS = {  # name: (readouts by matmuls, dynamic shared memory in bytes, backward by matmuls,
    #                the walk's least groups (``WALK_GROUPS``), None: no walk;
    #                the kernels copying four floats at a time, ``render.matrix.VECTOR_COPIES``)
    "matmuls, declared tiles": (True, 0, True, None, ()),
    "matmuls, dynamic tiles": (True, DYNAMIC, True, None, ()),
    "outputs kernel, declared tiles": (False, 0, True, None, ()),
    "outputs kernel, dynamic tiles": (False, DYNAMIC, True, None, ()),
    "outputs kernel, backward kernel": (False, DYNAMIC, False, None, ()),
    "backward kernel, walks where 128 groups": (False, DYNAMIC, False, 128, ()),
    "walks, their copies by fours": (False, DYNAMIC, False, 128, WALK_KINDS),
    "walks and outputs, copies by fours": (False, DYNAMIC, False, 128, (*WALK_KINDS, "outputs")),
    "walks, outputs and backward, copies by fours":
        (False, DYNAMIC, False, 128, (*WALK_KINDS, "outputs", "chunk_gradients")),
    "every kernel, copies by fours":
        (False, DYNAMIC, False, 128,
         (*WALK_KINDS, "outputs", "chunk_gradients", "states", "adjoint")),
}


def use(variant):
    """Run the CUDA matrix kernels as ``variant`` says, rendered anew."""
    by_matmuls, dynamic, backward_by_matmuls, walk_groups, by_fours = VARIANTS[variant]
    mk.OUTPUTS_BY_MATMULS["cuda"] = by_matmuls
    mk.GRADIENTS_BY_MATMULS["cuda"] = backward_by_matmuls
    mk.WALKS["cuda"] = walk_groups is not None
    mk.WALK_GROUPS = walk_groups or 1
    render_matrix.VECTOR_COPIES = frozenset(by_fours)
    kernels = mk.matrix_kernels("cuda")
    kernels.dialect = dataclasses.replace(DIALECTS["cuda"], dynamic_shared_bytes=dynamic)
    kernels._kernels, kernels._cores, kernels._shapes = LRU(32), LRU(32), LRU(64)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cases", default="4,5", help="indices into bench_peers.CASES")
    p.add_argument("--dtypes", default="float32,bfloat16")
    p.add_argument("--variants", default="3,4",
                   help="indices into VARIANTS, in the order run (repeats alternate them)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--peer", default="chunk_simple_gla", help="a peer of bench_peers.PEERS, or ''")
    p.add_argument("--gate", choices=("linear", "log"), default="linear",
                   help="GLA's gate as the bundled spec takes it, or in log space as FLA's "
                        "chunk_simple_gla takes it (our mlx_recgen.ops.gla_g)")
    p.add_argument("--compiled", action="store_true",
                   help="also our forward+backward under mx.compile (bench_peers.ours)")
    p.add_argument("--out", default="bench-matrix-kernels.json")
    args = p.parse_args()
    names = [list(VARIANTS)[int(i)] for i in args.variants.split(",")]
    result = dict(date=str(datetime.date.today()), versions=versions(), rows=[])
    rng = np.random.default_rng(0)
    for dtype in args.dtypes.split(","):
        for name, shape, _ in (CASES[int(i)] for i in args.cases.split(",")):
            xs = make_inputs(name, shape, rng)
            w = rng.standard_normal(tuple(shape[a] for a in ("B", "L", "H", "V")))
            w = w.astype(np.float32)
            mdt = {"float32": mx.float32, "bfloat16": mx.bfloat16}[dtype]
            row = dict(spec=name, shape=shape, dtype=dtype, runs=[])
            base = None
            for variant in names:
                use(variant)
                spec, ours_xs = in_log_space(name, rg.load_spec(name).spec, xs, args.gate)
                r = ours(rg.Recurrence(spec), ours_xs, w, mdt, "matrix", args.reps,
                         compiled=args.compiled)
                y = r.pop("y")
                base = y if base is None else base
                r["err"] = rel(y, base)
                row["runs"].append([variant, r])
                print(name, shape, dtype, variant, r, flush=True)
                mx.clear_cache()
            if args.peer and args.peer in PEERS.get(name, []):
                r = peers_run(args.peer, name, xs, w, dtype, args.reps)
                r["err"] = rel(r.pop("y"), base)
                row["runs"].append([args.peer, r])
                print(name, shape, dtype, args.peer, r, flush=True)
            result["rows"].append(row)
            with open(args.out, "w") as f:
                json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
