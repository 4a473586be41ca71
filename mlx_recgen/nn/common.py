"""Pieces the layers share: argument checks, the recurrence call, the short causal
convolution, gated RMS normalisation and the initialisers of the papers."""

from __future__ import annotations

import math

import mlx.core as mx
import mlx.nn as nn

from ..function import BACKENDS
from ..schedule import SCHEDULES
from .cache import RecurrentCache

#: ``backend=`` of the layers: the recurrence's backends, and ``"reference"`` for the spec's
#: plain per-step MLX loop (``Recurrence.reference``, differentiated by MLX autodiff).
LAYER_BACKENDS = (*BACKENDS, "reference")


def check_options(layer: str, backend: str, schedule: str):
    if backend not in LAYER_BACKENDS:
        raise ValueError(f"{layer}: backend must be one of {LAYER_BACKENDS}, got {backend!r}")
    if schedule not in SCHEDULES:
        raise ValueError(f"{layer}: schedule must be one of {SCHEDULES}, got {schedule!r}")


def check_call(layer: str, x, dims: int, cache) -> None:
    """``x`` must be a floating-point ``[B, L, dims]`` array with ``L >= 1``; ``cache`` ``None``
    or a ``RecurrentCache`` holding sequences of the same batch size."""
    if not isinstance(x, mx.array):
        raise TypeError(f"{layer}: x must be an mx.array, got {type(x).__name__}")
    if not mx.issubdtype(x.dtype, mx.floating):
        raise TypeError(f"{layer}: x has dtype {x.dtype}; expected a floating-point type")
    if x.ndim != 3 or x.shape[-1] != dims or x.shape[0] == 0 or x.shape[1] == 0:
        raise ValueError(f"{layer}: x has shape {tuple(x.shape)}; expected [batch, length, "
                         f"{dims}] with batch and length at least 1")
    if cache is None:
        return
    if not isinstance(cache, RecurrentCache):
        raise TypeError(f"{layer}: cache must be a RecurrentCache (from make_cache()), got "
                        f"{type(cache).__name__}")
    if cache.batch_size is not None and cache.batch_size != x.shape[0]:
        raise ValueError(f"{layer}: the cache holds {cache.batch_size} sequences but x has "
                         f"batch size {x.shape[0]}")


def scan(rec, inputs, cache, backend: str, schedule: str):
    """The recurrence ``rec`` on ``inputs``: from zeros without a cache, else from
    ``cache.state``, which then becomes the final state."""
    if backend == "reference":
        def call(*args, **options):
            return rec.reference(*args, **options)
    else:
        def call(*args, **options):
            return rec(*args, backend=backend, schedule=schedule, **options)
    if cache is None:
        return call(*inputs)
    y, cache.state = call(*inputs, initial_state=cache.state, return_state=True)
    return y


class ShortConv(nn.Module):
    """A causal depthwise convolution over time: ``y[t] = bias + sum_j weight[:, j] *
    x[t - kernel_size + 1 + j]``, with the inputs before the first one read from a window of
    the previous call's last ``kernel_size - 1`` inputs (zeros at the start of a sequence).

    ``weight`` is ``[channels, kernel_size]``; initialised as PyTorch's ``nn.Conv1d`` (and MLX's)
    with ``groups=channels``: uniform in ``±1/sqrt(kernel_size)``, the bias likewise.
    """

    def __init__(self, channels: int, kernel_size: int, bias: bool = True):
        super().__init__()
        if kernel_size < 1:
            raise ValueError(f"ShortConv: kernel_size must be at least 1, got {kernel_size}")
        self.kernel_size = kernel_size
        bound = 1 / math.sqrt(kernel_size)
        self.weight = mx.random.uniform(-bound, bound, (channels, kernel_size))
        if bias:
            self.bias = mx.random.uniform(-bound, bound, (channels,))

    def __call__(self, x, window=None):
        """``x`` ``[B, L, channels]`` -> ``(y, window)``: ``y`` like ``x``, and the last
        ``kernel_size - 1`` inputs (the window of the next call)."""
        B, L, C = x.shape
        K = self.kernel_size
        if window is None:
            window = mx.zeros((B, K - 1, C), dtype=x.dtype)
        elif window.shape != (B, K - 1, C):
            raise ValueError(f"ShortConv: the cached window has shape {tuple(window.shape)}; "
                             f"expected {(B, K - 1, C)}")
        padded = mx.concatenate([window.astype(x.dtype), x], axis=1)
        y = sum(padded[:, j:j + L] * self.weight[:, j] for j in range(K))
        if "bias" in self:
            y = y + self.bias
        return y, padded[:, L:]


class GatedRMSNorm(nn.Module):
    """RMS normalisation with a SiLU gate, over groups of ``group_size`` channels.

    ``norm_before_gate=False`` (Mamba-2): ``rms_norm(x * silu(z)) * weight``; ``True`` (Gated
    DeltaNet, GLA): ``rms_norm(x) * weight * silu(z)``, where ``rms_norm(u) = u /
    sqrt(mean(u^2) + eps)`` over each group. ``weight`` starts at ones.
    """

    def __init__(self, dims: int, eps: float = 1e-5, group_size: int | None = None,
                 norm_before_gate: bool = False):
        super().__init__()
        group_size = group_size or dims
        if dims % group_size:
            raise ValueError(f"GatedRMSNorm: group_size {group_size} does not divide dims {dims}")
        self.eps, self.group_size, self.norm_before_gate = eps, group_size, norm_before_gate
        self.weight = mx.ones((dims,))

    def __call__(self, x, z):
        shape = x.shape
        if not self.norm_before_gate:
            x = x * nn.silu(z)
        groups = x.reshape(*shape[:-1], shape[-1] // self.group_size, self.group_size)
        y = mx.fast.rms_norm(groups, None, self.eps).reshape(shape) * self.weight
        return y * nn.silu(z) if self.norm_before_gate else y


def inverse_softplus(y):
    """``x`` with ``softplus(x) == y`` (``y > 0``): ``y + log(-expm1(-y))``."""
    return y + mx.log(-mx.expm1(-y))


def dt_bias_init(n: int, dt_min: float, dt_max: float, dt_init_floor: float):
    """Mamba-2's ``dt_bias`` (Dao & Gu 2024, ``mamba_ssm``'s ``Mamba2``): ``dt`` log-uniform in
    ``[dt_min, dt_max]``, at least ``dt_init_floor``, mapped through the inverse softplus so that
    ``softplus(dt_bias) == dt``."""
    if not 0 < dt_min <= dt_max:
        raise ValueError(f"dt_min and dt_max must satisfy 0 < dt_min <= dt_max, got "
                         f"{dt_min}, {dt_max}")
    u = mx.random.uniform(shape=(n,))
    dt = mx.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min))
    return inverse_softplus(mx.maximum(dt, dt_init_floor))


def a_log_init(n: int, low: float, high: float):
    """``A_log = log(A)`` with ``A`` uniform in ``(low, high]`` (Mamba-2: ``(1, 16)``; Gated
    DeltaNet: ``(0, 16)``); the decay rate is ``-exp(A_log)``."""
    if not 0 <= low < high:
        raise ValueError(f"the range of A must satisfy 0 <= low < high, got ({low}, {high})")
    return mx.log(high - (high - low) * mx.random.uniform(shape=(n,)))


def l2_normalize(x, eps: float = 1e-6):
    """``x / sqrt(sum(x^2) + eps)`` over the last axis."""
    return x * mx.rsqrt(mx.sum(x * x, axis=-1, keepdims=True) + eps)
