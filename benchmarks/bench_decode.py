"""Decoding a token with mlx-lm's models, patched and not: where the time goes.

    python benchmarks/bench_decode.py --size gpu --dtype bfloat16 --models qwen3_next,mamba2

* Models (``bench_models.build``, random weights): after a prefill of ``--prefill`` tokens,
  ``--tokens`` decode steps; per step the time to build the graph (``model(token, cache)`` and
  the argmax) and to evaluate it (``mx.eval``), the median of the steps after the fifth; the
  median over ``--runs`` runs of mlx-lm's own code and each patched backend, alternating.
* Generation (``--generate``): mlx-lm's own loop, ``mlx_lm.generate.generate_step``, which
  builds the next token's graph while the device evaluates this one (``mx.async_eval``): the
  time per token after the first (which carries the prefill), as a user of ``mlx_lm generate``
  sees it; the median over ``--runs`` alternating runs.
* Helpers (``--helpers``): 24 calls of a routed helper at one step, each feeding its own
  state, then one ``mx.eval`` (as a model's step does), in ms, mlx-lm's own and patched.

Measures both in one process; prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import mlx.core as mx

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from bench_models import build  # noqa: E402


def decode_split(model, vocab, prefill, tokens):
    """(build, eval) medians in ms of one decode step after a prefill."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    prompt = mx.random.randint(0, vocab, (1, prefill), key=mx.random.key(2))
    logits = model(prompt, cache=cache)
    mx.eval(logits)
    token = mx.argmax(logits[:, -1:], axis=-1)
    building, evaluating = [], []
    for _ in range(tokens):
        t0 = time.perf_counter()
        token = mx.argmax(model(token, cache=cache)[:, -1:], axis=-1)
        t1 = time.perf_counter()
        mx.eval(token)
        building.append(t1 - t0)
        evaluating.append(time.perf_counter() - t1)
    return (statistics.median(building[5:]) * 1e3, statistics.median(evaluating[5:]) * 1e3)


def generation_time(model, vocab, prefill, tokens):
    """ms per generated token of mlx-lm's ``generate_step`` after its first token (the prefill
    of ``prefill`` tokens), greedy."""
    from mlx_lm.generate import generate_step

    prompt = mx.random.randint(0, vocab, (prefill,), key=mx.random.key(2))
    stamps = [time.perf_counter() for _ in generate_step(prompt, model, max_tokens=tokens + 1)]
    return (stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3


def helper_cases(dtype):
    """(name, helper, arguments) of one decode step of each routed helper."""
    import mlx_lm.models.gated_delta as gated_delta
    import mlx_lm.models.ssm as ssm

    def r(*shape):
        return mx.random.normal(shape).astype(dtype)

    ssd = dict(hidden_states=r(1, 1, 32, 64), A_log=mx.random.normal((32,)), B=r(1, 1, 1, 128),
               C=r(1, 1, 1, 128), D=mx.random.normal((32,)), dt=r(1, 1, 32),
               dt_bias=mx.random.normal((32,)), state=r(1, 32, 64, 128))
    delta = dict(q=0.1 * r(1, 1, 8, 128), k=0.1 * r(1, 1, 8, 128), v=r(1, 1, 16, 128),
                 a=r(1, 1, 16), b=r(1, 1, 16), A_log=mx.random.normal((16,)),
                 dt_bias=mx.random.normal((16,)), state=mx.random.normal((1, 16, 128, 128)))
    return [("ssm_update (b1 H32 P64 N128)", lambda **a: ssm.ssm_update(**a), ssd),
            ("gated_delta_update (B1 Hk8 Hv16 K=V=128)",
             lambda **a: gated_delta.gated_delta_update(**a), delta)]


def helper_time(helper, args, layers=24, steps=30):
    states = [args["state"]] * layers

    def step():
        outs = []
        for i in range(layers):
            y, states[i] = helper(**{**args, "state": states[i]})
            outs.append(y)
        mx.eval(outs, states)

    for _ in range(10):
        step()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(steps):
            step()
        times.append((time.perf_counter() - t0) / steps * 1e3)
    return statistics.median(times)


def main():
    from mlx_recgen.integrations.mlx_lm import patch

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--size", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--models", default="qwen3_next,mamba2")
    p.add_argument("--backends", default="auto,mlx", help="the patch's backends")
    p.add_argument("--prefill", type=int, default=128)
    p.add_argument("--tokens", type=int, default=40)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--helpers", action="store_true", help="also time the routed helpers alone")
    p.add_argument("--generate", action="store_true",
                   help="also time mlx-lm's generation loop (generate_step), per token")
    args = p.parse_args()
    dtype = getattr(mx, args.dtype)
    backends = args.backends.split(",")
    print(f"{mx.default_device()}, {args.dtype}, prefill {args.prefill}, medians of "
          f"{args.runs} runs\n")
    print("| model | run | build | eval | total | vs own |\n|---|---|---|---|---|---|")
    for name in args.models.split(","):
        model, vocab = build(name, args.size, dtype)
        runs = {}
        for _ in range(args.runs):
            runs.setdefault("mlx-lm's own", []).append(
                decode_split(model, vocab, args.prefill, args.tokens))
            for backend in backends:
                with patch(backend=backend):
                    runs.setdefault(f"patch(backend={backend!r})", []).append(
                        decode_split(model, vocab, args.prefill, args.tokens))
        own = None
        for run, times in runs.items():
            b = statistics.median(t[0] for t in times)
            e = statistics.median(t[1] for t in times)
            own = own or b + e
            print(f"| {name} | {run} | {b:.2f} ms | {e:.2f} ms | {b + e:.2f} ms | "
                  f"{(b + e) / own:.2f} |")
    if args.generate:
        print(f"\n| model | generate_step, ms per token: mlx-lm's own | "
              + " | ".join(f"patch(backend={b!r})" for b in backends) + " | vs own |")
        print("|---|---|" + "---|" * len(backends) + "---|")
        for name in args.models.split(","):
            model, vocab = build(name, args.size, dtype)
            runs = {}
            for _ in range(args.runs + 1):  # the first round warms up
                runs.setdefault("own", []).append(
                    generation_time(model, vocab, args.prefill, args.tokens))
                for backend in backends:
                    with patch(backend=backend):
                        runs.setdefault(backend, []).append(
                            generation_time(model, vocab, args.prefill, args.tokens))
            times = [statistics.median(t[1:]) for t in runs.values()]
            print(f"| {name} | " + " | ".join(f"{t:.2f}" for t in times) + " | "
                  + " / ".join(f"{t / times[0]:.2f}" for t in times[1:]) + " |")
    if args.helpers:
        print("\n| helper, 24 one-step calls | mlx-lm's own | "
              + " | ".join(f"patch(backend={b!r})" for b in backends) + " |")
        print("|---|---|" + "---|" * len(backends))
        for name, helper, hargs in helper_cases(dtype):
            mx.eval(list(hargs.values()))
            times = [helper_time(helper, hargs)]
            for backend in backends:
                with patch(backend=backend):
                    times.append(helper_time(helper, hargs))
            print(f"| {name} | " + " | ".join(f"{t:.2f} ms" for t in times) + " |")


if __name__ == "__main__":
    main()
