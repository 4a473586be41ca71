"""Worst relative error of every zoo spec against its paper's loop (the references in
``tests/references.py``), per backend and schedule, on the zoo tests' inputs.

    python benchmarks/zoo_parity.py --backend cuda --out zoo-parity-cuda.md
"""

import argparse
import datetime
import os
import sys

import mlx.core as mx

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))


def main():
    import test_zoo

    p = argparse.ArgumentParser()
    p.add_argument("--backend", default="metal-sim")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    lines = [f"# Zoo parity: `{args.backend}` against the papers' loops", "",
             f"{datetime.date.today()}, mlx {mx.__version__}, device {mx.default_device()}; fp32; "
             "worst relative error over the output, the final states and every gradient "
             "(inputs and initial states); sizes of `tests/test_zoo.py`", "",
             "| spec | sequential | sequential, split 2 | chunked |", "|---|---|---|---|"]
    for name in test_zoo.ZOO:
        cells = []
        for schedule, call in (("sequential", {}), ("sequential", dict(split=2)), ("chunked", {})):
            if (schedule == "chunked" and name not in test_zoo.TIME_PARALLEL) or \
                    (call and name in ("mingru", "complex_lru")):
                cells.append("—")
                continue
            saved = test_zoo.K
            test_zoo.K = 4 if call else saved  # a state of 4 elements splits in 2
            try:
                errors = test_zoo.compare(name, args.backend, schedule, **call)
            finally:
                test_zoo.K = saved
            worst = max(errors, key=errors.get)
            cells.append(f"{errors[worst]:.1e} ({worst})")
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    text = "\n".join(lines) + "\n"
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
