"""Where a call's GPU time goes, kernel by kernel: one forward and one forward+backward of a
bundled spec (on the ``cuda`` backend unless ``--backend`` says otherwise), after warm-ups, with a marker kernel (an ``arcsinh`` of a
small array) launched before each phase, to run under Nsight Compute; then the same script
splits ncu's CSV at the markers and sums the kernels of each phase by name::

    ncu --clock-control none --metrics gpu__time_duration.sum --csv \\
        python benchmarks/profile_calls.py gla --shape B=8 L=4096 H=16 K=64 V=64 > calls.csv
    python benchmarks/profile_calls.py --split calls.csv

With ``--peer chunk_simple_gla`` (a peer of ``bench_peers.PEERS``) the same two phases are a
peer's, in PyTorch, on the same inputs, for a comparison kernel by kernel.

The inputs are ``bench_peers.py``'s (``make_inputs``); the forward+backward is the outputs and
the inputs' gradients for a random cotangent of the outputs, as there.
"""

from __future__ import annotations

import argparse
import collections
import csv


def run(args):
    import mlx.core as mx
    import numpy as np

    import mlx_recgen as rg
    from bench_peers import in_log_space, make_inputs

    dtype = getattr(mx, args.dtype)
    shape = {k: int(v) for k, v in (s.split("=") for s in args.shape)}
    inputs = make_inputs(args.spec, shape, np.random.default_rng(0))
    spec, inputs = in_log_space(args.spec, rg.load_spec(args.spec).spec, inputs, args.gate)
    rec = rg.Recurrence(spec)
    xs = [mx.array(x).astype(dtype) for x in inputs]

    def call(*a):
        return rec(*a, backend=args.backend, schedule=args.schedule)

    w = mx.random.normal(call(*xs).shape).astype(dtype)
    grad = lambda *a: mx.vjp(call, list(a), [w])  # w the outputs' cotangent, as the peer's
    marker = mx.ones((7,))

    def phase(f):
        mx.eval(mx.arcsinh(marker))
        mx.synchronize()
        mx.eval(f())
        mx.synchronize()

    for _ in range(args.warmups):
        mx.eval(grad(*xs), call(*xs))
    mx.synchronize()
    phase(lambda: call(*xs))
    phase(lambda: grad(*xs))
    mx.eval(mx.arcsinh(marker))


def run_peer(args):
    """The same two phases for a peer of ``bench_peers.PEERS`` (PyTorch) on the same inputs:
    its forward, then its forward+backward (``torch.autograd.grad`` of the outputs weighted by
    a random array), after warm-ups (a peer's autotuning among them), with ``torch.asinh``
    marking the phases."""
    import numpy as np
    import torch

    from bench_peers import make_inputs, peer_operands

    shape = {k: int(v) for k, v in (s.split("=") for s in args.shape)}
    inputs = make_inputs(args.spec, shape, np.random.default_rng(0))
    fn, operands = peer_operands(args.peer, args.spec, inputs, args.dtype)
    with torch.no_grad():
        w = torch.randn_like(fn(*operands))

    def forward():
        with torch.no_grad():
            return fn(*operands)

    def backward():
        return torch.autograd.grad(fn(*operands), operands, w)

    marker = torch.ones(7, device="cuda")

    def phase(f):
        torch.asinh(marker)
        torch.cuda.synchronize()
        f()
        torch.cuda.synchronize()

    for _ in range(args.warmups):
        forward(), backward()
    torch.cuda.synchronize()
    phase(forward)
    phase(backward)
    torch.asinh(marker)
    torch.cuda.synchronize()


def split(path, top):
    """Per phase: the count and total time of its kernels, then the kernels by name."""
    rows = csv.DictReader(line for line in open(path) if line.startswith('"'))
    phases, current = [], None
    for r in rows:
        name = r["Kernel Name"]
        if any(m in name.lower() for m in ("arcsinh", "asinh")):  # MLX's or PyTorch's marker
            current = collections.OrderedDict()
            phases.append(current)
            continue
        if current is None or r["Metric Name"] != "gpu__time_duration.sum":
            continue
        value = float(r["Metric Value"].replace(",", ""))
        us = value * {"ns": 1e-3, "nsecond": 1e-3, "us": 1.0, "usecond": 1.0, "ms": 1e3,
                      "msecond": 1e3}[r["Metric Unit"]]
        count, total = current.get(name[:90], (0, 0.0))
        current[name[:90]] = (count + 1, total + us)
    for label, kernels in zip(("forward", "forward+backward"), phases):
        total = sum(t for _, t in kernels.values())
        print(f"== {label}: {sum(c for c, _ in kernels.values())} kernels, {total:.0f} us")
        for name, (count, us) in sorted(kernels.items(), key=lambda kv: -kv[1][1])[:top]:
            print(f"{us:9.1f} us {count:3d}x  {name}")


def call_arguments(p, spec="gla", shape=("B=8", "L=4096", "H=16", "K=64", "V=64")):
    """The options that pick a call: the spec, its shape, schedule, backend and dtype."""
    p.add_argument("spec", nargs="?", default=spec)
    p.add_argument("--shape", nargs="+", default=list(shape))
    p.add_argument("--schedule", default="matrix")
    p.add_argument("--backend", default="cuda")
    p.add_argument("--dtype", default="float32")


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    call_arguments(p)
    p.add_argument("--warmups", type=int, default=2)
    p.add_argument("--gate", choices=("linear", "log"), default="linear",
                   help="GLA's gate as the bundled spec takes it, or in log space (ops.gla_g)")
    p.add_argument("--split", metavar="CSV", help="sum the kernels of ncu's CSV by phase")
    p.add_argument("--top", type=int, default=25, help="kernels listed per phase")
    p.add_argument("--peer", default=None,
                   help="profile a peer of bench_peers.PEERS instead (e.g. chunk_simple_gla)")
    args = p.parse_args()
    if args.split:
        split(args.split, args.top)
    elif args.peer:
        run_peer(args)
    else:
        run(args)


if __name__ == "__main__":
    main()
