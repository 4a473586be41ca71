"""The ``mlx-recgen`` command line.

    mlx-recgen demo                                   # a small spec end to end, checked
    mlx-recgen list                                   # the bundled specs
    mlx-recgen show SPEC_OR_FILE --kernel backward --backend metal
    mlx-recgen adjoint SPEC_OR_FILE                   # the derived backward statements
    mlx-recgen check SPEC_OR_FILE --backend metal-sim # forward + backward vs the reference
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx

from .function import default_backend
from .specs import list_specs, load_spec


def _random_inputs(rec, sizes, dtype=mx.float32):
    """Random inputs for a spec: values in a stable range for any recurrence (|decay| < 1)."""
    spec = rec.spec
    args = []
    for t in spec.inputs.values():
        shape = tuple(a if isinstance(a, int) else sizes[a] for a in t.axes)
        args.append(mx.random.uniform(0.2, 0.9, shape).astype(dtype))
    return args


def _sizes(rec, lanes=7, length=19, state=5, batch=2):
    s = rec.spec
    sizes = {b: batch for b in s.batch_axes}
    sizes.update({s.time: length, s.lane: lanes})
    if s.state_axis:
        sizes[s.state_axis] = state
    return sizes


def _rel(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm((a - b).flatten()) / (mx.linalg.norm(b.flatten()) + 1e-30)).item()


def check(rec, backend, seg=4, sizes=None, args=None):
    """Run forward and backward on ``backend`` and on the reference; return rows of
    (quantity, relative error)."""
    sizes = sizes or _sizes(rec)
    args = args if args is not None else _random_inputs(rec, sizes)
    n = len(args)
    outs = rec.reference(*args)
    outs = outs if isinstance(outs, tuple) else (outs,)
    weights = [mx.random.normal(o.shape) for o in outs]

    def loss(run):
        def f(*a):
            y = run(*a)
            y = y if isinstance(y, tuple) else (y,)
            return sum(mx.sum(o * w) for o, w in zip(y, weights))
        return f

    def ours(*a):
        return rec(*a, backend=backend, seg=seg)

    got = ours(*args)
    got = got if isinstance(got, tuple) else (got,)
    g_ours = mx.grad(loss(ours), argnums=tuple(range(n)))(*args)
    g_ref = mx.grad(loss(rec.reference), argnums=tuple(range(n)))(*args)
    rows = [(f"output {name}", _rel(a, b)) for name, a, b in zip(rec.spec.outputs, got, outs)]
    rows += [(f"grad {name}", _rel(a, b)) for name, a, b in zip(rec.spec.inputs, g_ours, g_ref)]
    return rows


DEMO_SPEC = '''
@rg.recurrence(lane="P", state={"h": "B P N"},
               inputs={"q": "B L N", "k": "B L N", "v": "B L P", "beta": "B L"},
               outputs={"y": "B L P"})
def delta_rule(h, q, k, v, beta, n):
    r = rg.Sum(k[n] * h[n], n)                 # read the state before writing it
    h[n] = h[n] + rg.sigmoid(beta) * (v - r) * k[n]
    return {"y": rg.Sum(q[n] * h[n], n)}
'''


def demo(backend=None):
    import mlx_recgen as rg

    scope = {"rg": rg}
    exec(DEMO_SPEC, scope)
    rec = scope["delta_rule"]
    backend = backend or default_backend()
    print("A delta-rule recurrence, written as a spec:")
    print(DEMO_SPEC)
    print("Derived backward step:")
    print("  " + rec.adjoint_ir().replace("\n", "\n  "))
    sizes = {"B": 2, "L": 256, "P": 32, "N": 16}
    q, k = (x / mx.linalg.norm(x, axis=-1, keepdims=True)  # unit keys keep the rule stable
            for x in (mx.random.normal((2, 256, 16)), mx.random.normal((2, 256, 16))))
    args = [q, k, mx.random.normal((2, 256, 32)), mx.random.normal((2, 256))]
    rows = check(rec, backend, seg=32, sizes=sizes, args=args)

    def timed(fn, reps=3):
        mx.eval(fn())
        t0 = time.perf_counter()
        for _ in range(reps):
            mx.eval(fn())
        return (time.perf_counter() - t0) / reps

    n = len(args)
    grad_ours = mx.grad(lambda *a: mx.sum(rec(*a, backend=backend)), argnums=tuple(range(n)))
    grad_loop = mx.grad(lambda *a: mx.sum(rec.reference(*a)), argnums=tuple(range(n)))
    t_ours = timed(lambda: grad_ours(*args))
    t_loop = timed(lambda: grad_loop(*args))
    print(f"\nforward + backward, B=2 L=256 P=32 N=16, on {mx.default_device()}:")
    print(f"  {'backend':<10} {'max rel error':>14} {'time (ms)':>10} {'vs per-step loop':>17}")
    print(f"  {backend:<10} {max(e for _, e in rows):>14.2e} {t_ours * 1e3:>10.1f} "
          f"{t_loop / t_ours:>16.2f}x")
    print(f"  {'loop':<10} {'(reference)':>14} {t_loop * 1e3:>10.1f} {1.0:>16.2f}x")
    worst = max(e for _, e in rows)
    if not all(e < 1e-4 for _, e in rows):  # also catches NaN
        print(f"FAILED: relative error {worst:.2e}")
        return 1
    print("OK")
    return 0


def main(argv=None):
    p = argparse.ArgumentParser(prog="mlx-recgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="define a spec, run it, check it against the reference")
    d.add_argument("--backend", default=None)
    sub.add_parser("list", help="list the bundled specs")
    s = sub.add_parser("show", help="print a generated kernel")
    s.add_argument("spec")
    s.add_argument("--kernel", choices=["forward", "backward"], default="forward")
    s.add_argument("--backend", choices=["metal", "cuda", "mlx"], default="metal")
    s.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    s.add_argument("--seg", type=int, default=32)
    a = sub.add_parser("adjoint", help="print the forward and derived backward step")
    a.add_argument("spec")
    c = sub.add_parser("check", help="run forward and backward on small random inputs and "
                                     "compare with the reference")
    c.add_argument("spec")
    c.add_argument("--backend", default="metal-sim")
    c.add_argument("--seg", type=int, default=4)
    args = p.parse_args(argv)

    if args.cmd == "demo":
        return demo(args.backend)
    if args.cmd == "list":
        for name in list_specs():
            doc = (load_spec(name).spec.doc or "").splitlines()
            print(f"{name:<8} {doc[0] if doc else ''}")
        return 0
    rec = load_spec(args.spec)
    if args.cmd == "show":
        print(rec.source(args.kernel, backend=args.backend, dtype=getattr(mx, args.dtype),
                         seg=args.seg))
        return 0
    if args.cmd == "adjoint":
        print("forward step:\n" + rec.forward_ir() + "\n\nbackward step:\n" + rec.adjoint_ir())
        return 0
    rows = check(rec, args.backend, seg=args.seg)
    worst = max(e for _, e in rows)
    for name, err in rows:
        print(f"{name:<24} {err:.2e}")
    ok = all(e < 1e-4 for _, e in rows)  # also catches NaN
    print(f"{rec.name} on {args.backend}: {'OK' if ok else 'FAILED'} (max relative error {worst:.2e})")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
