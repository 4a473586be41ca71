"""Whole mlx-lm models with and without ``mlx_recgen.integrations.mlx_lm.patch()``, in one process.

    python benchmarks/bench_models.py --size cpu --out results.md          # small, any machine
    python benchmarks/bench_models.py --size gpu --dtype bfloat16 --out results.md

Two models built from mlx-lm's own classes with random weights (nothing is downloaded):

* ``mamba2``: Mamba-2 with mamba2-370m's proportions (``--size gpu``: 24 layers, hidden 1024,
  32 heads of 64, state 128, one group; ``--size cpu``: 2 layers, hidden 256, 8 heads of 64,
  state 128);
* ``qwen3_next``: a Qwen3-Next-like model (``gpu``: 16 layers, hidden 1024, 16 value heads and
  8 key heads of 128, dense MLP, attention every fourth layer; ``cpu``: 2 layers, hidden 256,
  4 value and 2 key heads of 64).

For each model, unpatched and patched with each ``--schedules`` (mlx-lm's own code first):
a training step (forward + backward of the cross-entropy, ``nn.value_and_grad``; batch x
length ``--train``), prefill of ``--prefill`` tokens into a prompt cache, decoding per token
after it, and peak memory of the training step (``mx.get_peak_memory``). Times are medians of
``--reps`` after a warm-up; the patched model's training loss is checked against the
unpatched one. The decode time is the median of ``--decode`` tokens of one run per model and
patch, in turn: for decoding alone, ``bench_decode.py`` alternates the runs and splits a token
into building and evaluating its graph.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import platform
import statistics
import time

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten, tree_unflatten

CONFIGS = {
    ("mamba2", "gpu"): dict(
        num_heads=32, head_dim=64, hidden_size=1024, intermediate_size=2048, state_size=128,
        num_hidden_layers=24, n_groups=1),
    ("mamba2", "cpu"): dict(
        num_heads=8, head_dim=64, hidden_size=256, intermediate_size=512, state_size=128,
        num_hidden_layers=2, n_groups=1),
    ("qwen3_next", "gpu"): dict(
        hidden_size=1024, num_hidden_layers=16, intermediate_size=2816, num_attention_heads=8,
        num_key_value_heads=2, head_dim=128, linear_num_value_heads=16, linear_num_key_heads=8,
        linear_key_head_dim=128, linear_value_head_dim=128, full_attention_interval=4),
    ("qwen3_next", "cpu"): dict(
        hidden_size=256, num_hidden_layers=2, intermediate_size=512, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64, linear_num_value_heads=4, linear_num_key_heads=2,
        linear_key_head_dim=64, linear_value_head_dim=64, full_attention_interval=2),
}
COMMON = {
    "mamba2": dict(vocab_size=1024, layer_norm_epsilon=1e-5, conv_kernel=4, use_bias=False,
                   use_conv_bias=True, tie_word_embeddings=False,
                   time_step_limit=(0.001, 100.0), time_step_rank="auto"),
    "qwen3_next": dict(vocab_size=1024, linear_conv_kernel_dim=4, num_experts=0,
                       num_experts_per_tok=1, decoder_sparse_step=1,
                       shared_expert_intermediate_size=512, moe_intermediate_size=512,
                       rms_norm_eps=1e-6, rope_theta=10000.0, partial_rotary_factor=0.25,
                       max_position_embeddings=8192),
}


def build(name, size, dtype):
    module = importlib.import_module(f"mlx_lm.models.{name}")
    cfg = {"model_type": name, **COMMON[name], **CONFIGS[(name, size)]}
    if name == "qwen3_next":
        cfg["mlp_only_layers"] = list(range(cfg["num_hidden_layers"]))  # a dense MLP
    model = module.Model(module.ModelArgs.from_dict(cfg))
    flat = tree_flatten(model.parameters())
    keys = mx.random.split(mx.random.key(0), len(flat))
    model.update(tree_unflatten([(k, (0.02 * mx.random.normal(p.shape, key=key)).astype(dtype))
                                 for (k, p), key in zip(flat, keys)]))
    mx.eval(model.parameters())
    return model, cfg["vocab_size"]


def median_time(fn, reps):
    mx.eval(fn())
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        mx.eval(fn())
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def measure(model, vocab, args):
    from mlx_lm.models.cache import make_prompt_cache

    b, L = map(int, args.train.split("x"))
    tokens = mx.random.randint(0, vocab, (b, L + 1), key=mx.random.key(1))
    loss_and_grad = nn.value_and_grad(
        model, lambda m, x, y: nn.losses.cross_entropy(m(x), y).astype(mx.float32).mean())

    def step():
        return loss_and_grad(model, tokens[:, :-1], tokens[:, 1:])

    out = {"loss": step()[0].item()}
    out["train"] = median_time(step, args.reps)
    mx.reset_peak_memory()
    mx.eval(step())
    out["peak_gb"] = mx.get_peak_memory() / 1e9
    prompt = mx.random.randint(0, vocab, (1, args.prefill), key=mx.random.key(2))

    def prefill():
        cache = make_prompt_cache(model)
        return model(prompt, cache=cache), cache

    out["prefill"] = median_time(lambda: prefill()[0], max(1, args.reps // 2))
    logits, cache = prefill()
    mx.eval(logits)
    token = mx.argmax(logits[:, -1:], axis=-1)
    times = []
    for _ in range(args.decode):
        t0 = time.perf_counter()
        logits = model(token, cache=cache)
        token = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(token)
        times.append(time.perf_counter() - t0)
    out["decode"] = statistics.median(times[2:] or times)
    return out


def main():
    import mlx_lm

    from mlx_recgen.integrations.mlx_lm import patch

    p = argparse.ArgumentParser()
    p.add_argument("--size", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--models", default="mamba2,qwen3_next")
    p.add_argument("--schedules", default="auto,matrix")
    p.add_argument("--backend", default="auto")
    p.add_argument("--train", default=None, help="BxL of the training step")
    p.add_argument("--prefill", type=int, default=None)
    p.add_argument("--decode", type=int, default=20)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    args.train = args.train or ("4x1024" if args.size == "gpu" else "2x256")
    args.prefill = args.prefill or (2048 if args.size == "gpu" else 256)
    dtype = getattr(mx, args.dtype)
    lines = [f"# Whole models, patched and not ({args.size} sizes, {args.dtype})", "",
             f"{platform.machine()}, {mx.default_device()}; date {datetime.date.today()}; "
             f"mlx {mx.__version__}, mlx-lm {mlx_lm.__version__}; backend {args.backend}; "
             f"training step {args.train}, prefill {args.prefill} tokens, decode median of "
             f"{args.decode} tokens; medians of {args.reps}", "",
             "| model | run | train step | vs own | peak GB | prefill | decode / token | "
             "vs own | loss |", "|---|---|---|---|---|---|---|---|---|"]
    for name in args.models.split(","):
        model, vocab = build(name, args.size, dtype)
        base = measure(model, vocab, args)
        rows = [("mlx-lm's own", base)]
        for schedule in args.schedules.split(","):
            try:
                with patch(backend=args.backend, schedule=schedule):
                    rows.append((f"patched, {schedule}", measure(model, vocab, args)))
            except ValueError as exc:
                lines.append(f"| {name} | patched, {schedule} | not run: {exc} |||||||")
        for label, r in rows:
            lines.append(f"| {name} | {label} | {r['train'] * 1e3:.1f} ms | "
                         f"{r['train'] / base['train']:.2f} | {r['peak_gb']:.2f} | "
                         f"{r['prefill'] * 1e3:.1f} ms | {r['decode'] * 1e3:.2f} ms | "
                         f"{r['decode'] / base['decode']:.2f} | {r['loss']:.5f} |")
        print("\n".join(lines[-len(rows):]), flush=True)
        del model
        mx.clear_cache()
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)


if __name__ == "__main__":
    main()
