"""Train a small byte-level language model built from ``mlx_recgen.nn`` layers.

    python examples/train_tiny_lm.py --layer mamba2 --steps 300 --compare

The model: a byte embedding, ``--layers`` residual blocks of RMSNorm + recurrent mixer and
RMSNorm + GELU MLP, a final RMSNorm and the embedding as the output head (tied).

The text: the source of eight pure-Python modules of Python's standard library (``argparse``,
``dataclasses``, ``difflib``, ``enum``, ``functools``, ``inspect``, ``textwrap``, ``typing``),
read from the running interpreter's installation: about 620 KB on CPython 3.11, and present
wherever Python is. Nothing is downloaded. The tokens are its bytes (a vocabulary of 256); the
last 5% is held out for the evaluation loss.

Written to ``--out`` (``runs/tiny-lm`` under the current directory by default; ``runs/`` is
ignored by git in the repository): ``tiny-lm-<layer>-<device>.json`` (the run: device, mlx
version, date, arguments, tokens/s, final and held-out loss, the loss of every step, a sample)
and the loss curve, ``tiny-lm-<layer>-<device>.png`` (or ``.csv`` where matplotlib is not
installed).

``--compare`` also times the same model from the same initial weights on the same batches with
the recurrence run as the spec's plain per-step MLX loop (``backend="reference"``:
``Recurrence.reference``, differentiated by MLX autodiff), that is without mlx-recgen's
compiled recurrences; the two alternate step by step, so both see the same machine load.

Runs wherever MLX does: on the CPU (backend ``mlx``), on an NVIDIA GPU with MLX's CUDA build
(``cuda`` kernels), on Apple silicon (``metal``). Needs only mlx (matplotlib and tqdm are used
when installed).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten

import mlx_recgen
from mlx_recgen.nn import GLA, RGLRU, GatedDeltaNet, Mamba2

DEFAULT_OUT = "runs/tiny-lm"  # a run's own folder: never over results kept in the repository
CORPUS_MODULES = ("argparse", "dataclasses", "difflib", "enum", "functools", "inspect",
                  "textwrap", "typing")
LAYERS = ("mamba2", "gated_deltanet", "gla", "rglru")
HELD_OUT = 0.05


# ---------------------------------------------------------------------------------------------
# Data
# ---------------------------------------------------------------------------------------------


def load_corpus() -> np.ndarray:
    """The bytes of the corpus modules' source files, one after the other."""
    parts = []
    for name in CORPUS_MODULES:
        spec = importlib.util.find_spec(name)
        path = Path(spec.origin) if spec and spec.origin else None
        if path is None or path.suffix != ".py" or not path.is_file():
            raise FileNotFoundError(f"the source of the standard-library module {name!r} is not "
                                    f"installed (found {path}); this Python ships without its "
                                    ".py files")
        parts.append(path.read_bytes())
    return np.frombuffer(b"\n".join(parts), dtype=np.uint8)


def batches(data: np.ndarray, batch: int, seq: int, rng: np.random.Generator):
    """Endless ``(inputs, targets)`` of ``batch`` random windows of ``seq`` bytes."""
    if len(data) <= seq + 1:
        raise ValueError(f"--seq {seq} is longer than the text ({len(data)} bytes)")
    while True:
        starts = rng.integers(0, len(data) - seq - 1, size=batch)
        windows = np.stack([data[s:s + seq + 1] for s in starts]).astype(np.int32)
        yield mx.array(windows[:, :-1]), mx.array(windows[:, 1:])


# ---------------------------------------------------------------------------------------------
# Model
# ---------------------------------------------------------------------------------------------


def make_mixer(layer: str, dims: int, backend: str) -> nn.Module:
    """The sequence mixer of one block, sized from the model width."""
    if layer == "mamba2":
        return Mamba2(dims, state_size=16, head_dim=32, expand=2, n_groups=2, backend=backend)
    if layer == "gated_deltanet":
        return GatedDeltaNet(dims, num_heads=4, num_key_heads=2, key_head_dim=dims // 4,
                             value_head_dim=dims // 2, backend=backend)
    if layer == "gla":
        return GLA(dims, num_heads=4, backend=backend)
    if layer == "rglru":
        return RGLRU(dims, num_heads=4, backend=backend)
    raise ValueError(f"unknown layer {layer!r}; choose from {LAYERS}")


class MLP(nn.Module):
    def __init__(self, dims: int, hidden: int):
        super().__init__()
        self.up, self.down = nn.Linear(dims, hidden), nn.Linear(hidden, dims)

    def __call__(self, x):
        return self.down(nn.gelu(self.up(x)))


class Block(nn.Module):
    def __init__(self, dims: int, mixer: nn.Module):
        super().__init__()
        self.mixer_norm, self.mixer = nn.RMSNorm(dims), mixer
        self.mlp_norm, self.mlp = nn.RMSNorm(dims), MLP(dims, 2 * dims)

    def __call__(self, x, cache=None):
        x = x + self.mixer(self.mixer_norm(x), cache=cache)
        return x + self.mlp(self.mlp_norm(x))


class TinyLM(nn.Module):
    def __init__(self, layer: str, dims: int, n_layers: int, backend: str = "auto"):
        super().__init__()
        self.embedding = nn.Embedding(256, dims)
        self.blocks = [Block(dims, make_mixer(layer, dims, backend)) for _ in range(n_layers)]
        self.norm = nn.RMSNorm(dims)

    def __call__(self, tokens, caches=None):
        h = self.embedding(tokens)
        for block, cache in zip(self.blocks, caches or [None] * len(self.blocks)):
            h = block(h, cache)
        return self.embedding.as_linear(self.norm(h))

    def make_cache(self) -> list:
        return [block.mixer.make_cache() for block in self.blocks]


def loss_fn(model, inputs, targets):
    return nn.losses.cross_entropy(model(inputs), targets, reduction="mean")


class Trainer:
    """One model, its optimiser and its training step."""

    def __init__(self, model: TinyLM, lr: float, steps: int):
        warmup = max(1, min(50, steps // 10))
        schedule = optim.join_schedules(
            [optim.linear_schedule(lr / warmup, lr, warmup),
             optim.cosine_decay(lr, max(1, steps - warmup), lr / 10)], [warmup])
        self.model, self.optimizer = model, optim.AdamW(schedule, weight_decay=0.0)
        self.loss_and_grad = nn.value_and_grad(model, loss_fn)

    def step(self, inputs, targets) -> float:
        loss, grads = self.loss_and_grad(self.model, inputs, targets)
        grads, _ = optim.clip_grad_norm(grads, 1.0)
        self.optimizer.update(self.model, grads)
        mx.eval(loss, self.model.parameters(), self.optimizer.state)
        return loss.item()


def evaluate(model: TinyLM, data: np.ndarray, batch: int, seq: int, n_batches: int) -> float:
    rng = np.random.default_rng(0)
    source = batches(data, batch, seq, rng)
    losses = [loss_fn(model, *next(source)).item() for _ in range(n_batches)]
    return float(np.mean(losses))


def generate(model: TinyLM, prompt: bytes, n: int, temperature: float = 0.8) -> tuple[bytes, float]:
    """``n`` bytes sampled after ``prompt``: the prompt prefilled through the caches in one
    call, then one byte per call. Returns the bytes and the decoding rate (bytes/s)."""
    caches = model.make_cache()
    logits = model(mx.array(list(prompt), dtype=mx.int32)[None], caches)[:, -1]
    key = mx.random.key(0)
    out = []
    start = time.perf_counter()
    for _ in range(n):
        key, sub = mx.random.split(key)
        token = mx.random.categorical(logits / temperature, key=sub)
        out.append(token.item())
        logits = model(token[:, None], caches)[:, -1]
    mx.eval(logits)
    return bytes(out), n / max(time.perf_counter() - start, 1e-9)


# ---------------------------------------------------------------------------------------------
# Progress, results
# ---------------------------------------------------------------------------------------------


class Progress:
    """A progress bar on stderr: tqdm when installed, else a line per update."""

    def __init__(self, total: int, label: str):
        self.total, self.label, self.done = total, label, 0
        try:
            from tqdm import tqdm
        except ImportError:
            self.bar = None
        else:
            self.bar = tqdm(total=total, desc=label, file=sys.stderr, dynamic_ncols=True)

    def update(self, done: int, **fields):
        """``done`` of ``total`` steps are done; ``fields`` are shown beside the bar."""
        text = " ".join(f"{k} {v}" for k, v in fields.items())
        if self.bar is not None:
            self.bar.update(done - self.done)
            self.bar.set_postfix_str(text)
        else:
            width = 30
            filled = width * done // self.total
            print(f"{self.label} [{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} "
                  f"{text}", file=sys.stderr, flush=True)
        self.done = done

    def log(self, line: str):
        if self.bar is not None:
            self.bar.write(line, file=sys.stderr)
        else:
            print(line, file=sys.stderr, flush=True)

    def close(self):
        if self.bar is not None:
            self.bar.close()


def save_curve(path: Path, losses: list, title: str) -> Path:
    """The loss curve as a PNG with matplotlib, else as a CSV; returns the file written."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        path = path.with_suffix(".csv")
        path.write_text("step,loss\n" + "".join(f"{i + 1},{v:.6f}\n" for i, v in
                                                enumerate(losses)))
        print(f"matplotlib is not installed: the loss curve is saved as {path}", file=sys.stderr)
        return path
    steps = np.arange(1, len(losses) + 1)
    window = max(1, len(losses) // 25)
    smooth = np.convolve(losses, np.ones(window) / window, mode="valid")
    fig, ax = plt.subplots(figsize=(6, 3.6), dpi=100)
    ax.plot(steps, losses, lw=0.6, alpha=0.45, label="step")
    ax.plot(steps[window - 1:], smooth, lw=1.6, label=f"mean of {window}")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats per byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = path.with_suffix(".png")
    fig.savefig(path)
    plt.close(fig)
    return path


def load_average():
    """The 1-minute load average where the platform has one: on a shared machine, others' work
    slows every rate measured here."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def machine() -> dict:
    device = mx.default_device()
    info = {"device": str(device), "device_type": "gpu" if device.type == mx.gpu else "cpu",
            "system": f"{platform.system()} {platform.machine()}", "cpu_count": os.cpu_count()}
    if hasattr(mx, "device_info"):
        try:
            info["device_info"] = {k: v for k, v in mx.device_info().items()
                                   if isinstance(v, (str, int, float))}
        except RuntimeError:
            pass
    return info


# ---------------------------------------------------------------------------------------------
# Runs
# ---------------------------------------------------------------------------------------------


def train(trainer: Trainer, source, steps: int, tokens_per_step: int, log_every: int,
          label: str):
    """Train for ``steps``; returns the loss of every step and the time of every step."""
    progress = Progress(steps, label)
    losses, times = [], []
    for step in range(1, steps + 1):
        inputs, targets = next(source)
        start = time.perf_counter()
        losses.append(trainer.step(inputs, targets))
        times.append(time.perf_counter() - start)
        if step % log_every == 0 or step == steps:
            recent = slice(max(0, step - log_every), step)
            rate = tokens_per_step * len(times[recent]) / sum(times[recent])
            progress.update(step, loss=f"{np.mean(losses[recent]):.3f}", tok_s=f"{rate:.0f}")
            progress.log(f"{label} step {step:5d}  loss {np.mean(losses[recent]):.4f}  "
                         f"{rate:8.0f} tokens/s")
    progress.close()
    return losses, times


def compare(args, initial, source, tokens_per_step: int) -> dict:
    """Steps of the model with the compiled recurrences and with the per-step loop,
    alternating, from the same initial weights on the same batches."""
    runs = {}
    for name, backend in (("recgen", args.backend), ("loop", "reference")):
        model = TinyLM(args.layer, args.dim, args.layers, backend=backend)
        model.update(initial)
        runs[name] = Trainer(model, args.lr, args.steps)
    times = {name: [] for name in runs}
    first = {}
    progress = Progress(args.compare_steps + 1, "compare")
    for step in range(args.compare_steps + 1):  # the first step of each warms up
        inputs, targets = next(source)
        for name, trainer in runs.items():
            start = time.perf_counter()
            loss = trainer.step(inputs, targets)
            times[name].append(time.perf_counter() - start)
            first.setdefault(name, loss)
        progress.update(step + 1)
    progress.close()
    rates = {name: tokens_per_step / statistics.median(t[1:] or t) for name, t in times.items()}
    return {"steps": args.compare_steps, "tokens_per_s": rates["recgen"],
            "tokens_per_s_loop": rates["loop"], "speedup": rates["recgen"] / rates["loop"],
            "first_loss": first["recgen"], "first_loss_loop": first["loop"]}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layer", choices=LAYERS, default="mamba2")
    p.add_argument("--backend", default="auto",
                   choices=("auto", "mlx", "metal", "metal-sim", "cuda", "reference"),
                   help="backend of the recurrences (auto: metal, cuda or mlx)")
    p.add_argument("--steps", type=int, default=300)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--dim", type=int, default=128)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=DEFAULT_OUT,
                   help=f"folder for the JSON and the loss curve (default: {DEFAULT_OUT}, under "
                        "the current directory)")
    p.add_argument("--compare", action="store_true",
                   help="also time the model with the per-step MLX loop as the recurrence")
    p.add_argument("--compare-steps", type=int, default=10,
                   help="timed steps of each model in --compare (after one warm-up step)")
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--eval-batches", type=int, default=8)
    p.add_argument("--sample", type=int, default=200, help="bytes to generate at the end")
    args = p.parse_args(argv)
    for name in ("steps", "batch", "seq", "dim", "layers", "compare_steps", "log_every"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    mx.random.seed(args.seed)
    data = load_corpus()
    load_at_start = load_average()
    split = int(len(data) * (1 - HELD_OUT))
    train_data, held_out = data[:split], data[split:]
    tokens_per_step = args.batch * args.seq
    backend = mlx_recgen.default_backend() if args.backend == "auto" else args.backend

    model = TinyLM(args.layer, args.dim, args.layers, backend=args.backend)
    initial = model.parameters()  # arrays are immutable: training replaces, never overwrites
    n_params = sum(p.size for _, p in tree_flatten(model.parameters()))
    print(f"{args.layer}: {args.layers} blocks of width {args.dim}, {n_params / 1e6:.2f}M "
          f"parameters, backend {backend}, {mx.default_device()}; text: {len(data) / 1e3:.0f} KB "
          f"of standard-library source ({len(train_data) / 1e3:.0f} KB to train on)",
          file=sys.stderr)

    source = batches(train_data, args.batch, args.seq, np.random.default_rng(args.seed))
    begin = time.perf_counter()
    losses, times = train(Trainer(model, args.lr, args.steps), source, args.steps,
                          tokens_per_step, args.log_every, args.layer)
    seconds = time.perf_counter() - begin
    steady = times[1:] or times  # the first step builds the recurrences' functions
    tokens_per_s = tokens_per_step * len(steady) / sum(steady)
    eval_loss = evaluate(model, held_out, args.batch, args.seq, args.eval_batches)
    final_loss = float(np.mean(losses[-min(len(losses), args.log_every):]))
    sample, decode_rate = generate(model, b"def ", args.sample) if args.sample else (b"", 0.0)

    result = {
        "layer": args.layer, "backend": backend, **machine(),
        "mlx_version": mx.__version__, "mlx_recgen_version": mlx_recgen.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "arguments": vars(args), "parameters": n_params,
        "corpus": {"standard_library_modules": list(CORPUS_MODULES), "bytes": int(len(data)),
                   "held_out_bytes": int(len(held_out))},
        "load_average": {"start": load_at_start, "end": load_average()},
        "steps": args.steps, "tokens_per_step": tokens_per_step, "train_seconds": seconds,
        "tokens_per_s": tokens_per_s, "final_loss": final_loss, "eval_loss": eval_loss,
        "decode_bytes_per_s": decode_rate,
        "sample": "def " + sample.decode("utf-8", errors="replace"),
        "losses": [round(v, 5) for v in losses],
    }
    print(f"trained {args.steps} steps in {seconds:.0f} s: {tokens_per_s:.0f} tokens/s, final "
          f"loss {final_loss:.3f}, held-out loss {eval_loss:.3f} nats/byte", file=sys.stderr)
    if args.compare:
        result["compare"] = compare(args, initial, source, tokens_per_step)
        c = result["compare"]
        print(f"with mlx-recgen ({backend}): {c['tokens_per_s']:.0f} tokens/s; per-step MLX "
              f"loop: {c['tokens_per_s_loop']:.0f} tokens/s ({c['speedup']:.2f}x); first "
              f"losses {c['first_loss']:.5f} and {c['first_loss_loop']:.5f}", file=sys.stderr)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"tiny-lm-{args.layer}-{result['device_type']}"
    title = (f"{args.layer}, {args.layers}x{args.dim}, batch {args.batch}x{args.seq} bytes, "
             f"{backend} on {result['device_type']}")
    result["curve"] = save_curve(stem, losses, title).name
    stem.with_suffix(".json").write_text(json.dumps(result, indent=1) + "\n")
    print(f"wrote {stem.with_suffix('.json')} and {result['curve']}", file=sys.stderr)
    if args.sample:
        print(result["sample"])
    return result


if __name__ == "__main__":
    main()
