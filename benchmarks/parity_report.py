"""Worst relative error per bundled spec, kernel backend vs the hand-written references.

    python benchmarks/parity_report.py --backend cuda --out benchmarks/results/parity-cuda.md

Runs the kernel-test shape cases (fp32 and bf16) and records, per spec, the worst relative error
over the forward output, the final state and every gradient.
"""

import argparse
import datetime
import os
import sys

import mlx.core as mx

TESTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests")


def main():
    sys.path.insert(0, TESTS)  # the shape cases and hand references live with the tests
    from conftest import rel_err
    from references import INPUTS, state_loss_weights, value_and_grads
    from test_kernels import CASES, REFERENCES, _run

    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="cuda")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    mx.random.seed(0)
    worst = {}
    for dtype in (mx.float32, mx.bfloat16):
        for spec, sizes, seg in CASES:
            inputs, h0 = INPUTS[spec](**sizes)
            inputs = [x.astype(dtype) for x in inputs]
            ref = REFERENCES[spec]
            y_ref, h_ref = ref(*inputs, h0)
            Wy, Wh = state_loss_weights(y_ref, h_ref)
            r = value_and_grads(lambda *a: ref(*a[:-1], a[-1]), inputs, h0, Wy, Wh)
            k = _run(spec, args.backend, inputs, h0, Wy, Wh, seg)
            errs = [rel_err(k[0], r[0]), rel_err(k[1], r[1])] + [rel_err(a, b) for a, b in zip(k[2], r[2])]
            key = (spec, str(dtype).split(".")[-1])
            worst[key] = max(worst.get(key, 0.0), max(errs))
    device = str(mx.default_device())
    lines = [f"# Parity of the {args.backend} kernels vs hand-written references",
             f"device: {device}; date: {datetime.date.today()}; mlx {mx.__version__}", "",
             "| spec | dtype | worst relative error (output, state, every gradient) |", "|---|---|---|"]
    lines += [f"| {s} | {d} | {e:.2e} |" for (s, d), e in sorted(worst.items())]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
