"""The ``mlx-recgen`` command line.

    mlx-recgen demo                                   # a small spec end to end, checked
    mlx-recgen list                                   # the bundled specs and their math
    mlx-recgen show SPEC_OR_FILE --kernel backward --backend metal
    mlx-recgen adjoint SPEC_OR_FILE                   # the derived backward statements
    mlx-recgen check SPEC_OR_FILE --backend metal-sim # forward + backward vs the reference

Errors are reported on one line on stderr, with exit status 1 (``--traceback`` shows the
Python traceback instead).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import mlx.core as mx

from .backends.kernels import CHUNKED_KERNELS, SCAN_KERNELS, SEQUENTIAL_KERNELS
from .backends.matrix_kernels import KERNELS as MATRIX_KERNELS
from .backends.matrix_kernels import spec_matrix_source
from .function import BACKENDS, default_backend, positive_int, require_backend
from .specs import list_specs, load_spec

TOLERANCE = 1e-4  # relative error allowed by `check` and `demo` (fp32 throughout)
MAX_MAGNITUDE = 1e4  # a check's reference values stay below this, or its inputs are redrawn

# Input distributions `check` tries in turn: values of both signs, scaled down until the
# reference stays finite and bounded; positive values for specs that take a log or a root of
# an input.
DISTRIBUTIONS = [("normal", 0.5), ("normal", 0.25), ("normal", 0.1), ("uniform", (0.2, 0.9)),
                 ("uniform", (0.05, 0.3))]


# ---------------------------------------------------------------------------------------------
# Backends
# ---------------------------------------------------------------------------------------------


def resolve_backend(requested: str | None, default: str = "auto") -> tuple:
    """``(backend, why it was chosen)`` for ``--backend requested`` (None when it is not given:
    the command's ``default``); raises if the backend is unknown or cannot run here (before
    anything is computed)."""
    given = requested is not None
    requested = requested if given else default
    if requested == "auto":
        backend = default_backend()
        if backend == "metal":
            return backend, "the best available: MLX has Metal on this machine"
        if backend == "cuda":
            return backend, "the best available: MLX has CUDA on this machine"
        if mx.is_available(mx.gpu):
            return backend, "the best available: MLX's default device is the CPU"
        return backend, "the best available: this MLX has neither Metal nor CUDA"
    if requested not in BACKENDS:
        raise ValueError(f"unknown backend {requested!r}; choose one of {', '.join(BACKENDS)}")
    require_backend(requested)
    return requested, ("requested with --backend" if given
                       else "the default; --backend chooses another")


# ---------------------------------------------------------------------------------------------
# Checking a spec against its reference
# ---------------------------------------------------------------------------------------------


def _sizes(rec, lanes=7, length=19, state=5, batch=2):
    s = rec.spec
    sizes = {b: batch for b in s.batch_axes}
    sizes.update({g: 1 for g in s.groups})  # one group serving every index of the axis
    sizes.update({s.time: length, s.lane: lanes})
    if s.state_axis:
        sizes[s.state_axis] = state
    return sizes


def _shape(t, sizes):
    return tuple(a if isinstance(a, int) else sizes[a] for a in t.axes)


def draw_case(rec, sizes, distribution, key):
    """Random inputs and initial states (in declaration order) of one distribution."""
    tensors = [*rec.spec.inputs.values(), *rec.spec.states.values()]
    keys = mx.random.split(key, len(tensors))
    kind, param = distribution
    out = []
    for t, k in zip(tensors, keys):
        if kind == "normal":
            out.append(param * mx.random.normal(_shape(t, sizes), key=k))
        else:
            out.append(mx.random.uniform(*param, _shape(t, sizes), key=k))
    n = len(rec.spec.inputs)
    return out[:n], out[n:]


def describe(distribution) -> str:
    kind, param = distribution
    if kind == "normal":
        return f"normal, standard deviation {param} (both signs)"
    return f"uniform in [{param[0]}, {param[1]}] (positive)"


def _rel(a, b):
    a, b = a.astype(mx.float32), b.astype(mx.float32)
    return (mx.linalg.norm((a - b).flatten()) / (mx.linalg.norm(b.flatten()) + 1e-30)).item()


def _finite_and_bounded(arrays) -> bool:
    return all(mx.all(mx.abs(x) <= MAX_MAGNITUDE).item() for x in arrays)


def check(rec, backend, seg=4, sizes=None, case=None, seed=0):
    """Run forward and backward on ``backend`` and on ``rec.reference`` (the traced spec evaluated
    on MLX arrays, independent of the renderers) and compare every output, every final state and
    the gradient of a random weighting of them with respect to every input and initial state.

    ``case`` is ``(inputs, initial states, description)``; by default random inputs are drawn
    from ``DISTRIBUTIONS`` in turn until the reference's values stay finite and bounded and its
    gradients finite (autodiff through ``where`` of an expression undefined on the branch not
    taken, e.g. ``sqrt`` of a negative input, gives NaN gradients). Returns
    ``(rows, description)`` with rows of ``(quantity, relative error)``."""
    spec = rec.spec
    sizes = sizes or _sizes(rec)
    n_in, states = len(spec.inputs), list(spec.states)

    def lists(outs, fins):
        """A recurrence's results as (outputs, final states), lists in declaration order."""
        outs = list(outs) if isinstance(outs, tuple) else [outs]
        return outs, [fins[k] for k in states] if isinstance(fins, dict) else [fins]

    def run(fn, args):
        return lists(*fn(*args[:n_in], initial_state=dict(zip(states, args[n_in:])),
                         return_state=True))

    def as_loss(fn, weights):
        def loss(*args):
            outs, fins = run(fn, args)
            return sum(mx.sum(x.astype(mx.float32) * w) for x, w in zip(outs + fins, weights))
        return loss

    argnums = tuple(range(n_in + len(states)))
    key, weight_key = mx.random.split(mx.random.key(seed))

    def reference(args, init):
        """The reference's outputs, final states, loss weights and gradients."""
        outs, fins = run(rec.reference, [*args, *init])
        keys = mx.random.split(weight_key, len(outs + fins))
        weights = [mx.random.normal(x.shape, key=k) for x, k in zip(outs + fins, keys)]
        grads = mx.grad(as_loss(rec.reference, weights), argnums=argnums)(*args, *init)
        return outs, fins, weights, list(grads)

    if case is None:
        for distribution in DISTRIBUTIONS:
            key, sub = mx.random.split(key)
            args, init = draw_case(rec, sizes, distribution, sub)
            ref_outs, ref_fins, weights, g_ref = reference(args, init)
            if _finite_and_bounded(ref_outs + ref_fins) and \
                    all(mx.all(mx.isfinite(g)).item() for g in g_ref):
                description = describe(distribution)
                break
        else:
            raise RuntimeError(f"{rec.name}: the reference or its gradients are not finite (or "
                               f"its values exceed {MAX_MAGNITUDE:g}) on any random inputs "
                               "tried: " + "; ".join(describe(d) for d in DISTRIBUTIONS))
    else:
        args, init, description = case
        ref_outs, ref_fins, weights, g_ref = reference(args, init)

    def ours(*a, **kw):
        return rec(*a, backend=backend, seg=seg, **kw)

    got_outs, got_fins = run(ours, [*args, *init])
    g_ours = mx.grad(as_loss(ours, weights), argnums=argnums)(*args, *init)

    rows = [(f"output {name}", _rel(a, b)) for name, a, b in zip(spec.outputs, got_outs, ref_outs)]
    rows += [(f"final state {name}", _rel(a, b)) for name, a, b in zip(states, got_fins, ref_fins)]
    labels = [f"grad {name}" for name in spec.inputs]
    labels += [f"grad {name} (initial state)" for name in states]
    rows += [(label, _rel(a, b)) for label, a, b in zip(labels, g_ours, g_ref)]
    return rows, description


def passed(rows) -> bool:
    return all(e < TOLERANCE for _, e in rows)  # also false for NaN


def print_rows(rows, indent="  "):
    width = max(len(name) for name, _ in rows)
    for name, err in rows:
        print(f"{indent}{name:<{width}}  {err:.2e}{'' if err < TOLERANCE else '  FAILED'}")


# ---------------------------------------------------------------------------------------------
# Commands
# ---------------------------------------------------------------------------------------------


DEMO_SPEC = '''
@rg.recurrence(lane="P", state={"h": "B P N"},
               inputs={"q": "B L N", "k": "B L N", "v": "B L P", "beta": "B L"},
               outputs={"y": "B L P"})
def delta_rule(h, q, k, v, beta, n):
    r = rg.Sum(k[n] * h[n], n)                 # read the state before writing it
    h[n] = h[n] + rg.sigmoid(beta) * (v - r) * k[n]
    return {"y": rg.Sum(q[n] * h[n], n)}
'''


def demo(backend=None, length=256):
    """Define the demo spec, print its derived backward step, check it on ``backend`` (the best
    available by default) against the reference, and time it; 0 when every check passes."""
    import mlx_recgen as rg

    backend, why = resolve_backend(backend)  # before printing anything
    scope = {"rg": rg}
    exec(DEMO_SPEC, scope)
    rec = scope["delta_rule"]
    print("A delta-rule recurrence, written as a spec:")
    print(DEMO_SPEC)
    print("Derived backward step:")
    print("  " + rec.adjoint_ir().replace("\n", "\n  "))
    B, L, P, N = 2, length, 32, 16
    sizes = {"B": B, "L": L, "P": P, "N": N}
    key = mx.random.key(0)
    kq, kk, kv, kb, kh = mx.random.split(key, 5)
    q, k = (x / mx.linalg.norm(x, axis=-1, keepdims=True)  # unit keys keep the rule stable
            for x in (mx.random.normal((B, L, N), key=kq), mx.random.normal((B, L, N), key=kk)))
    args = [q, k, mx.random.normal((B, L, P), key=kv), mx.random.normal((B, L), key=kb)]
    h0 = 0.5 * mx.random.normal((B, P, N), key=kh)
    rows, _ = check(rec, backend, seg=32, sizes=sizes, case=(args, [h0], "demo inputs"))

    print(f"\nBackend '{backend}' ({why}), on {mx.default_device()}.")
    print(f"Checked against rec.reference, the traced spec evaluated step by step on MLX arrays "
          f"and\ndifferentiated by MLX autodiff; B={B} L={L} P={P} N={N}, seg=32. Relative "
          f"errors (tolerance {TOLERANCE:.0e}),\ngradients of a random weighting of the output "
          "and the final state:")
    print_rows(rows)

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
    print(f"\nForward + backward time: {t_ours * 1e3:.1f} ms on '{backend}', {t_loop * 1e3:.1f} ms "
          f"for the per-step loop ({t_loop / t_ours:.2f}x).")
    worst = max(e for _, e in rows)
    if not passed(rows):
        print(f"FAILED: max relative error {worst:.2e} (tolerance {TOLERANCE:.0e})")
        return 1
    print(f"OK: max relative error {worst:.2e} (tolerance {TOLERANCE:.0e})")
    return 0


def one_line_math(doc: str) -> str:
    """A spec's math on one line: the first indented block of its docstring (the update and
    the outputs, one per line), its lines joined by ``;``."""
    block = []
    for line in doc.splitlines()[1:]:
        if line.startswith("    ") and line.strip():
            block.append(" ".join(line.split()))
        elif block:
            break
    return ";  ".join(block)


def _load(name):
    """``load_spec``, reporting a missing spec file as missing (a ':' in its directory's name is
    not ``path.py:name``) and an error raised while running a spec file, ``SystemExit``
    included, as such."""
    from .errors import SpecError

    file = name if name.endswith(".py") else name.rsplit(":", 1)[0] if ".py:" in name else None
    if file is not None and not Path(file).is_file() and not Path(name).is_file():
        raise FileNotFoundError(f"spec file not found: {file}")
    try:
        return load_spec(name)
    except (SpecError, FileNotFoundError):
        raise
    except (Exception, SystemExit) as exc:
        if file is None:
            raise
        # the file is user code: say which file and what it raised
        if isinstance(exc, SystemExit):
            raise RuntimeError(f"cannot load spec file '{name}': SystemExit: it exits at import "
                               f"(code {exc.code!r})") from exc
        raise RuntimeError(f"cannot load spec file '{name}': {type(exc).__name__}: {exc}") from exc


def _parser():
    p = argparse.ArgumentParser(prog="mlx-recgen", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--traceback", action="store_true",
                   help="on an error, show the Python traceback instead of one line")
    sub = p.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="define a spec, run it, check it against the reference")
    d.add_argument("--backend", default=None, help=f"one of {', '.join(BACKENDS)} (default: "
                                                   "the best available)")
    sub.add_parser("list", help="list the bundled specs, each with its math and its title")
    s = sub.add_parser("show", help="print a generated kernel")
    s.add_argument("spec")
    s.add_argument("--kernel", default="forward",
                   choices=list(dict.fromkeys([*SEQUENTIAL_KERNELS, *CHUNKED_KERNELS,
                                               *SCAN_KERNELS, *MATRIX_KERNELS])),
                   help="forward/backward (the sequential and scan schedules), one of the "
                        f"chunked schedule's kernels ({', '.join(CHUNKED_KERNELS)}) or of the "
                        f"matrix schedule's ({', '.join(MATRIX_KERNELS)})")
    s.add_argument("--schedule", choices=["sequential", "chunked", "scan", "matrix"],
                   default=None, help="default: the schedule whose kernel --kernel names "
                                      "(sequential for forward/backward)")
    s.add_argument("--backend", choices=["metal", "metal-sim", "cuda", "mlx"], default="metal",
                   help="metal-sim prints the Metal text (the simulator runs it as it is)")
    s.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default="float32")
    s.add_argument("--seg", type=int, default=32)
    a = sub.add_parser("adjoint", help="print the forward and derived backward step")
    a.add_argument("spec")
    c = sub.add_parser("check", help="run forward and backward on small random inputs and "
                                     "compare with the reference")
    c.add_argument("spec")
    c.add_argument("--backend", default=None,
                   help=f"one of {', '.join(BACKENDS)} (default: metal-sim)")
    c.add_argument("--seg", type=int, default=4)
    return p


def _run(args):
    if args.cmd == "demo":
        return demo(args.backend)
    if args.cmd == "list":
        names = list_specs()
        width = max(len(n) for n in names)
        for name in names:
            doc = load_spec(name).spec.doc or ""
            print(f"{name:<{width}}  {one_line_math(doc)}")
            print(f"{'':<{width}}  {doc.splitlines()[0] if doc else ''}")
        return 0
    if args.cmd in ("show", "check"):
        positive_int(args.cmd, "--seg", args.seg)
    if args.cmd == "check":
        # before loading and compiling anything
        backend, why = resolve_backend(args.backend, default="metal-sim")
    rec = _load(args.spec)
    if args.cmd == "show":
        schedule = args.schedule or ("chunked" if args.kernel in CHUNKED_KERNELS else
                                     "matrix" if args.kernel in MATRIX_KERNELS else "sequential")
        if args.backend == "mlx" and schedule != "sequential":
            raise ValueError(f"the {schedule} schedule's kernels are rendered for metal or cuda")
        backend = "metal" if args.backend == "metal-sim" else args.backend
        if schedule == "matrix":
            if args.kernel not in MATRIX_KERNELS:
                raise ValueError(f"the matrix schedule's kernels are {MATRIX_KERNELS}, "
                                 f"got {args.kernel!r}")
            print(spec_matrix_source(rec, args.kernel, backend, seg=args.seg))
            return 0
        options = {} if args.backend == "mlx" else {"schedule": schedule}
        print(rec.source(args.kernel, backend=backend, dtype=getattr(mx, args.dtype),
                         seg=args.seg, **options))
        return 0
    if args.cmd == "adjoint":
        print("forward step:\n" + rec.forward_ir() + "\n\nbackward step:\n" + rec.adjoint_ir())
        return 0
    sizes = _sizes(rec)
    rows, inputs = check(rec, backend, seg=args.seg, sizes=sizes)
    print(f"{rec.name} on backend '{backend}' ({why}), seg={args.seg}, sizes "
          + " ".join(f"{a}={n}" for a, n in sizes.items()))
    print(f"inputs and initial states: {inputs}; relative error against the reference:")
    print_rows(rows)
    worst = max(e for _, e in rows)
    print(f"{rec.name} on {backend}: {'OK' if passed(rows) else 'FAILED'} (max relative error "
          f"{worst:.2e}, tolerance {TOLERANCE:.0e})")
    return 0 if passed(rows) else 1


def main(argv=None):
    args = _parser().parse_args(argv)
    try:
        return _run(args)
    except BrokenPipeError:  # the reader went away (`mlx-recgen show ... | head`): stop quietly
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    except Exception as exc:
        if args.traceback:
            raise
        message = str(exc).strip() or type(exc).__name__
        if not isinstance(exc, (ValueError, TypeError, RuntimeError, OSError)):
            message = f"{type(exc).__name__}: {message}"
        print(f"mlx-recgen: error: {message}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
